"""Pure-torch reference codecs for Pici and COO: the oracle for every kernel and collective.

Vectorised torch code that runs on CPU and CUDA tensors alike and produces exactly the bytes of
``shared/design/FORMATS.md``. It synchronises with the device freely (it needs nnz on the host
to size its slices), so it is the ground truth and the CPU path, not the fast path.

Arguments are assumed to be checked by :mod:`spccl_train.formats.codec`; payload *contents*
are validated here, and a corrupt payload raises :class:`CorruptPayloadError` before any
element is read or written out of bounds.
"""

from __future__ import annotations

import torch

from .layout import TILE, TILE_ROWS, coo_layout, element_size, pici_layout

__all__ = [
    "CorruptPayloadError",
    "PayloadTooSmallError",
    "pici_compress",
    "pici_decompress",
    "pici_decompress_patch",
    "coo_compress",
    "coo_decompress",
]


class CorruptPayloadError(ValueError):
    """A payload's metadata contradicts itself or the range it claims to encode."""


class PayloadTooSmallError(ValueError):
    """An output buffer cannot hold the payload that compression produced."""


def _u32_bytes(values: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 bytes of non-negative int64 values below 2**32."""
    return values.to(torch.int64).contiguous().view(torch.uint8).view(-1, 8)[:, :4].reshape(-1)


def _read_u32(payload: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``count`` little-endian uint32 values at byte ``start``, as int64."""
    raw = payload[start : start + 4 * count].clone()
    return raw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _read_values(payload: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    return payload[start : start + count * element_size(dtype)].clone().view(dtype)


def _too_small(kind: str, have: int, need: int, n: int, nnz: int) -> PayloadTooSmallError:
    return PayloadTooSmallError(
        f"output buffer of {have} bytes is too small for the {kind} payload of {need} bytes "
        f"(n={n}, nnz={nnz}); allocate capacity_bytes('{kind.lower()}', n, dtype) bytes"
    )


def _result_nnz(nnz: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([nnz], dtype=torch.int64, device=device)


def _accumulate(dst: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """``dst[where] += values`` in fp32 for 16-bit types, rounding once, as the kernels do."""
    if dst.dtype == torch.float32:
        dst[where] = dst[where] + values.to(torch.float32)
    else:
        dst[where] = (dst[where].to(torch.float32) + values.to(torch.float32)).to(dst.dtype)


def pici_compress(src: torch.Tensor, offset: int, n: int, out: torch.Tensor) -> torch.Tensor:
    """Encode ``src[offset:offset+n]`` as Pici into the uint8 buffer ``out``; return nnz.

    Returns a one-element int64 tensor on ``src``'s device. Raises
    :class:`PayloadTooSmallError` (writing nothing) when ``out`` cannot hold the payload.
    """
    layout = pici_layout(n)
    tiles = layout.tiles
    x = src[offset : offset + n]
    padded = torch.zeros(tiles * TILE, dtype=src.dtype, device=src.device)
    padded[:n] = x
    # (tile, column, row): the order of the bitvector words and of the values.
    by_column = padded.view(tiles, TILE_ROWS, TILE_ROWS).transpose(1, 2)
    nonzero = by_column != 0
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64, device=src.device)
    # Byte k of column word c holds rows 8k..8k+7: the little-endian bytes of the uint64.
    bits = (nonzero.reshape(tiles, TILE_ROWS, 8, 8).to(torch.int64) * weights).sum(-1)
    tile_counts = nonzero.sum(dim=(1, 2))
    index = torch.zeros(tiles + 1, dtype=torch.int64, device=src.device)
    torch.cumsum(tile_counts, 0, out=index[1:])
    values = by_column[nonzero]
    nnz = int(index[-1])
    need = layout.nbytes(nnz, src.dtype)
    if out.numel() < need:
        raise _too_small("Pici", out.numel(), need, n, nnz)
    out[: layout.index_offset] = bits.reshape(-1).to(torch.uint8)
    out[layout.index_offset : layout.values_offset] = 0
    out[layout.index_offset : layout.index_offset + 4 * (tiles + 1)] = _u32_bytes(index)
    out[layout.values_offset : need] = values.contiguous().view(torch.uint8)
    return _result_nnz(nnz, src.device)


def _pici_parse(payload: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a Pici payload; return the (tile, row, column) nonzero mask and the values."""
    layout = pici_layout(n)
    tiles = layout.tiles
    if payload.numel() < layout.metadata_bytes:
        raise CorruptPayloadError(
            f"Pici payload of {payload.numel()} bytes is shorter than its metadata "
            f"({layout.metadata_bytes} bytes for n={n})"
        )
    index = _read_u32(payload, layout.index_offset, tiles + 1)
    nnz = int(index[-1])
    if int(index[0]) != 0:
        raise CorruptPayloadError(f"Pici index array starts at {int(index[0])}, not 0")
    steps = index[1:] - index[:-1]
    if bool((steps < 0).any()):
        tile = int(torch.nonzero(steps < 0)[0])
        raise CorruptPayloadError(f"Pici index array decreases at tile {tile}")
    capacity = (payload.numel() - layout.values_offset) // element_size(dtype)
    if nnz > n or nnz > capacity:
        raise CorruptPayloadError(
            f"Pici payload claims nnz={nnz}, but n={n} and the payload holds at most {capacity} values"
        )
    raw = payload[: layout.index_offset].view(tiles, TILE_ROWS, 8, 1)
    shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
    # (tile, column, row), row = 8 * byte + bit.
    by_column = ((raw >> shifts) & 1).bool().view(tiles, TILE_ROWS, TILE_ROWS)
    counts = by_column.sum(dim=(1, 2))
    if not torch.equal(counts, steps):
        tile = int(torch.nonzero(counts != steps)[0])
        raise CorruptPayloadError(
            f"Pici tile {tile} has {int(counts[tile])} bits set but its index step is {int(steps[tile])}"
        )
    mask = by_column.transpose(1, 2).reshape(-1)
    if bool(mask[n:].any()):
        raise CorruptPayloadError(f"Pici bitvector marks nonzeros past the end n={n}")
    values = _read_values(payload, layout.values_offset, nnz, dtype)
    return by_column, values


def pici_decompress(
    payload: torch.Tensor,
    n: int,
    dst: torch.Tensor,
    offset: int,
    *,
    accumulate: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    """Decode a Pici payload of ``n`` elements into ``dst[offset:offset+n]``.

    Overwrites the range (zeros included), or with ``accumulate`` adds the decoded nonzeros to
    it. ``dtype`` is the payload's element type (default ``dst.dtype``; a float32 ``dst`` may
    accumulate 16-bit values).
    """
    dtype = dtype or dst.dtype
    by_column, values = _pici_parse(payload, n, dtype)
    tiles = by_column.shape[0]
    dense = torch.zeros(tiles, TILE_ROWS, TILE_ROWS, dtype=dtype, device=payload.device)
    # masked_scatter_ copies bits; a boolean-index assignment of one value fills from a Python
    # float and would canonicalise a lone NaN.
    dense.masked_scatter_(by_column, values)
    dense = dense.transpose(1, 2).reshape(-1)[:n].to(dst.device)
    target = dst[offset : offset + n]
    if accumulate:
        where = by_column.transpose(1, 2).reshape(-1)[:n].to(dst.device)
        _accumulate(target, where, dense[where])
    else:
        target.copy_(dense)


def pici_decompress_patch(payload: torch.Tensor, prior: torch.Tensor, n: int, dst: torch.Tensor, offset: int) -> None:
    """Decode a Pici payload into ``dst[offset:offset+n]``, which holds what the Pici payload ``prior`` encodes.

    Writes only the elements either payload marks: the payload's values where it marks them, and
    zeros where only ``prior`` does. The range then equals an overwriting decode (a signed zero left
    unmarked by both keeps its sign). Both payloads are validated first.
    """
    by_column, values = _pici_parse(payload, n, dst.dtype)
    before, _ = _pici_parse(prior, n, dst.dtype)
    tiles = by_column.shape[0]
    dense = torch.zeros(tiles, TILE_ROWS, TILE_ROWS, dtype=dst.dtype, device=payload.device)
    dense.masked_scatter_(by_column, values)  # bits, as in pici_decompress
    where = by_column.transpose(1, 2).reshape(-1)[:n].to(dst.device)
    gone = before.transpose(1, 2).reshape(-1)[:n].to(dst.device) & ~where
    target = dst[offset : offset + n]
    target.masked_fill_(gone, 0)
    target.masked_scatter_(where, dense.transpose(1, 2).reshape(-1)[:n].to(dst.device)[where])


def coo_compress(src: torch.Tensor, offset: int, n: int, out: torch.Tensor) -> torch.Tensor:
    """Encode ``src[offset:offset+n]`` as COO into the uint8 buffer ``out``; return nnz."""
    x = src[offset : offset + n]
    positions = torch.nonzero(x != 0).view(-1)
    nnz = positions.numel()
    layout = coo_layout(nnz)
    need = layout.nbytes(src.dtype)
    if out.numel() < need:
        raise _too_small("COO", out.numel(), need, n, nnz)
    out[: layout.values_offset] = 0
    out[: 4 * nnz] = _u32_bytes(positions)
    out[layout.values_offset : need] = x[positions].contiguous().view(torch.uint8)
    return _result_nnz(nnz, src.device)


def coo_decompress(
    payload: torch.Tensor,
    nnz: int,
    n: int,
    dst: torch.Tensor,
    offset: int,
    *,
    accumulate: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    """Decode a COO payload of ``nnz`` nonzeros over ``n`` elements into ``dst[offset:offset+n]``."""
    dtype = dtype or dst.dtype
    if not 0 <= nnz <= n:
        raise CorruptPayloadError(f"COO payload claims nnz={nnz}, outside [0, n={n}]")
    layout = coo_layout(nnz)
    need = layout.nbytes(dtype)
    if payload.numel() < need:
        raise CorruptPayloadError(
            f"COO payload of {payload.numel()} bytes is shorter than the {need} bytes nnz={nnz} needs"
        )
    positions = _read_u32(payload, 0, nnz)
    if nnz and int(positions.max()) >= n:
        raise CorruptPayloadError(f"COO position {int(positions.max())} is past the end n={n}")
    if nnz > 1 and bool((positions[1:] <= positions[:-1]).any()):
        raise CorruptPayloadError("COO positions are not strictly ascending")
    values = _read_values(payload, layout.values_offset, nnz, dtype)
    target = dst[offset : offset + n]
    positions = positions.to(dst.device)
    values = values.to(dst.device)
    if accumulate:
        _accumulate(target, positions, values)
    else:
        target.zero_()
        target[positions] = values.to(dst.dtype)
