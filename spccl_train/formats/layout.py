"""Byte layout of the Pici, COO and dense wire formats: every size and offset, in one place.

The normative description is ``docs/FORMATS.md``; the reference codec, the CUDA
kernels (``csrc/``) and the collectives all take their numbers from here.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = [
    "TILE",
    "TILE_ROWS",
    "MAX_ELEMENTS",
    "SUPPORTED_DTYPES",
    "Format",
    "PiciLayout",
    "CooLayout",
    "align16",
    "element_size",
    "check_dtype",
    "check_length",
    "num_tiles",
    "pici_bytes",
    "pici_layout",
    "pici_metadata_bytes",
    "pici_max_tiles",
    "pici_n_range",
    "coo_bytes",
    "coo_layout",
    "dense_bytes",
    "payload_bytes",
    "capacity_bytes",
    "coo_nnz_from_bytes",
    "COO_HEADER_BYTES",
    "message_bytes",
]

TILE_ROWS = 64
"""A Pici virtual tile is ``TILE_ROWS x TILE_ROWS`` elements, row-major."""
TILE = TILE_ROWS * TILE_ROWS
"""Elements per Pici tile (4096): one 64-bit bitvector word per tile column."""
MAX_ELEMENTS = 2**32 - 1
"""Largest encodable range: indices and prefix sums are uint32 on the wire."""
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Format(str, enum.Enum):
    """A wire format a message can travel in."""

    DENSE = "dense"
    PICI = "pici"
    COO = "coo"


def align16(nbytes: int) -> int:
    """Round ``nbytes`` up to a multiple of 16."""
    return (nbytes + 15) & ~15


def check_dtype(dtype: torch.dtype) -> None:
    """Raise if ``dtype`` is not an element type the sparse formats carry."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"unsupported dtype {dtype}: the sparse formats carry {names}; cast first")


def check_length(n: int) -> None:
    """Raise if ``n`` is not an encodable number of elements."""
    if not 0 <= n <= MAX_ELEMENTS:
        raise ValueError(
            f"cannot encode {n} elements: a payload holds 0 to {MAX_ELEMENTS} (uint32 positions); "
            "split the tensor into smaller ranges"
        )


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of a supported dtype."""
    check_dtype(dtype)
    return dtype.itemsize


def num_tiles(n: int) -> int:
    """Number of 4096-element Pici tiles covering ``n`` elements."""
    return (n + TILE - 1) // TILE


@dataclasses.dataclass(frozen=True, slots=True)
class PiciLayout:
    """Offsets (bytes from the payload start) of the three parts of a Pici payload."""

    n: int
    """Elements encoded."""
    tiles: int
    """Number of 64x64 tiles, ``ceil(n / 4096)``."""
    bits_offset: int
    """Start of ``B``: ``64 * tiles`` uint64 column words."""
    index_offset: int
    """Start of ``I``: ``tiles + 1`` uint32 exclusive prefix sums (last one is nnz)."""
    values_offset: int
    """Start of ``A``: the nonzero values, by tile, then column, then row."""

    @property
    def metadata_bytes(self) -> int:
        """Bytes before the values: ``B`` plus the 16-byte aligned ``I``."""
        return self.values_offset

    def nbytes(self, nnz: int, dtype: torch.dtype) -> int:
        """Total payload size for ``nnz`` nonzeros of ``dtype``."""
        return self.values_offset + nnz * element_size(dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class CooLayout:
    """Offsets of the two parts of a COO payload (depends on nnz, not on n)."""

    nnz: int
    """Nonzeros encoded."""
    index_offset: int
    """Start of the ascending uint32 positions (always 0)."""
    values_offset: int
    """Start of the values: ``align16(4 * nnz)``."""

    def nbytes(self, dtype: torch.dtype) -> int:
        """Total payload size for values of ``dtype``."""
        return self.values_offset + self.nnz * element_size(dtype)


def pici_layout(n: int) -> PiciLayout:
    """Layout of a Pici payload encoding ``n`` elements."""
    check_length(n)
    tiles = num_tiles(n)
    index_offset = 8 * TILE_ROWS * tiles
    return PiciLayout(
        n=n,
        tiles=tiles,
        bits_offset=0,
        index_offset=index_offset,
        values_offset=index_offset + align16(4 * (tiles + 1)),
    )


def pici_metadata_bytes(n: int) -> int:
    """Bytes of ``B`` and ``I`` for ``n`` elements: the Pici size at nnz = 0."""
    return pici_layout(n).metadata_bytes


def _tiles_metadata_bytes(tiles: int) -> int:
    return 8 * TILE_ROWS * tiles + align16(4 * (tiles + 1))


def pici_metadata_bytes_of(n):
    """:func:`pici_metadata_bytes` of an int or elementwise of an integer array of lengths (the
    planner's and the cost model's vectorised sizing)."""
    return _tiles_metadata_bytes(-(-n // TILE))


def pici_max_tiles(nbytes: int) -> int:
    """The most tiles whose Pici metadata (``B`` and ``I``) fits in ``nbytes`` bytes.

    A buffer of ``nbytes`` bytes can hold a Pici payload of at most ``TILE * pici_max_tiles(nbytes)``
    elements. -1 when ``nbytes`` is less than the 16 bytes of even an empty (n = 0) payload.
    """
    if nbytes < _tiles_metadata_bytes(0):
        return -1
    # 516 t + 4 <= metadata(t) <= 516 t + 19, so this undershoots by at most a tile or two.
    tiles = max(0, (nbytes - 19) // (8 * TILE_ROWS + 4))
    while _tiles_metadata_bytes(tiles + 1) <= nbytes:
        tiles += 1
    return tiles


def pici_n_range(nbytes: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """The ``n`` a Pici payload of exactly ``nbytes`` bytes of ``dtype`` can encode: ``(lowest, highest)``.

    A payload's length fixes its tile count to a narrow range (the metadata must fit, and the
    values left over, ``nnz``, must not outnumber the elements), and so the ``n`` it was made
    for: every ``n`` from ``lowest`` to ``highest`` inclusive has some nnz whose
    ``pici_bytes(n, nnz, dtype)`` is ``nbytes``, and no other ``n`` has. ``None`` when no
    payload is that long (a truncated or padded buffer, or another dtype's payload).
    """
    size = element_size(dtype)
    most = min(pici_max_tiles(nbytes), num_tiles(MAX_ELEMENTS))
    if most < 0 or (nbytes - _tiles_metadata_bytes(0)) % size:
        return None  # the metadata is a multiple of 16 bytes, so the values take the rest
    # The fewest tiles whose elements can number the values left over: nbytes <= metadata(t) + TILE t size.
    tiles = max(0, (nbytes - 19) // (8 * TILE_ROWS + 4 + TILE * size))
    while nbytes > _tiles_metadata_bytes(tiles) + TILE * size * tiles:
        tiles += 1
    if tiles > most:
        return None
    nnz = (nbytes - _tiles_metadata_bytes(tiles)) // size
    # n needs `tiles` tiles and at least nnz elements; more tiles take any n they cover (their
    # smaller nnz is below TILE * (t - 1) + 1: the range is contiguous).
    lowest = max(nnz, TILE * (tiles - 1) + 1 if tiles else 0)
    highest = min(TILE * most, MAX_ELEMENTS)
    return (lowest, highest) if lowest <= highest else None


def _check_nnz(n: int, nnz: int) -> None:
    if not 0 <= nnz <= n:
        raise ValueError(f"nnz={nnz} is outside [0, n={n}]")


def pici_bytes(n: int, nnz: int, dtype: torch.dtype) -> int:
    """``512*NT + align16(4*(NT+1)) + nnz*sizeof(T)``: size of a Pici payload."""
    layout = pici_layout(n)
    _check_nnz(n, nnz)
    return layout.nbytes(nnz, dtype)


def coo_layout(nnz: int) -> CooLayout:
    """Layout of a COO payload holding ``nnz`` nonzeros."""
    check_length(nnz)
    return CooLayout(nnz=nnz, index_offset=0, values_offset=align16(4 * nnz))


def coo_bytes(n: int, nnz: int, dtype: torch.dtype) -> int:
    """``align16(4*nnz) + nnz*sizeof(T)``: size of a COO payload (``n`` only bounds nnz)."""
    check_length(n)
    _check_nnz(n, nnz)
    return coo_layout(nnz).nbytes(dtype)


def dense_bytes(n: int, dtype: torch.dtype) -> int:
    """``n * sizeof(T)``: the raw elements."""
    check_length(n)
    return n * element_size(dtype)


def payload_bytes(fmt: Format | str, n: int, nnz: int, dtype: torch.dtype) -> int:
    """Size of a payload of format ``fmt`` for ``n`` elements with ``nnz`` nonzeros."""
    fmt = Format(fmt)
    if fmt is Format.PICI:
        return pici_bytes(n, nnz, dtype)
    if fmt is Format.COO:
        return coo_bytes(n, nnz, dtype)
    return dense_bytes(n, dtype)


COO_HEADER_BYTES = 16
"""Bytes in front of every COO message of a collective: int64 nnz, int64 n (a COO payload does
not record its nnz; a Pici payload does, as its last index entry, so it travels bare)."""


def message_bytes(fmt: Format | str, numel: int, nnz: int, dtype: torch.dtype) -> int:
    """Unpadded size of a collective's message: dense elements, a bare Pici payload, or the COO
    header followed by a COO payload."""
    fmt = Format(fmt)
    if fmt is Format.COO:
        return COO_HEADER_BYTES + coo_bytes(numel, nnz, dtype)
    return payload_bytes(fmt, numel, nnz, dtype)


def capacity_bytes(fmt: Format | str, n: int, dtype: torch.dtype) -> int:
    """Worst-case payload size (every element nonzero): a buffer this large never overflows."""
    return payload_bytes(fmt, n, n, dtype)


def coo_nnz_from_bytes(nbytes: int, dtype: torch.dtype) -> int:
    """Invert ``coo_bytes``: the nnz of a COO payload of exactly ``nbytes`` bytes.

    Raises ``ValueError`` when no nnz gives that size (a truncated or padded payload).
    """
    size = element_size(dtype)
    # coo_bytes grows strictly with nnz and nnz*(4+size) <= nbytes < nnz*(4+size) + 16.
    nnz = max(0, (nbytes - 15) // (4 + size))
    while align16(4 * nnz) + nnz * size < nbytes:
        nnz += 1
    if align16(4 * nnz) + nnz * size != nbytes:
        raise ValueError(
            f"{nbytes} bytes is not the size of any COO payload of {dtype}: "
            "pass the payload exactly as coo_encode returned it"
        )
    return nnz
