"""How a flat tensor is cut into one chunk per rank, and each chunk into pieces (channels).

Two layouts, both documented here and nowhere else:

* **equal** (:meth:`ChunkLayout.equal`), for ``reduce_scatter_tensor`` and
  ``all_gather_into_tensor``: torch's semantics fix the cut. A tensor of ``world * m`` elements
  has chunk ``c = [c*m, (c+1)*m)``, the slice rank ``c`` owns (its output for reduce-scatter,
  its input for all-gather). ``m`` may be any length, so chunk starts need not be tile aligned.

* **aligned** (:meth:`ChunkLayout.aligned`), for ``all_reduce``, where the cut is ours: the
  tensor is split into ``units`` of ``TILE`` = 4096 elements (one Pici tile; the last unit may
  be partial) and chunk ``c`` takes ``units // world`` consecutive units, the first
  ``units % world`` chunks one more. So every chunk starts on a tile boundary and every Pici
  tile of the tensor lies whole in one chunk; chunk sizes differ by at most one tile, the chunk
  holding the tensor's end is shorter, and the chunks after it are empty. A tensor smaller than
  ``world`` tiles is cut in units of 16 elements instead (so every chunk is 16-element aligned:
  32-byte aligned for all supported dtypes) rather than leaving most ranks without data.

Pieces: each chunk is cut the same way into ``channels`` pieces (units of one tile when the
chunk holds at least ``channels`` tiles, else 16 elements), counted from the chunk's start. A
piece is the unit of every message and of every nonzero count.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
import torch

from .._triton import triton_importable
from ..formats import SUPPORTED_DTYPES, TILE, align16, compress_pieces_into, pici_metadata_bytes, uses_kernels

__all__ = ["Span", "ChunkLayout", "split_span", "unit_for", "SMALL_UNIT", "count_nonzero_pieces", "piece_arrays"]

SMALL_UNIT = 16
"""Cut granularity (elements) for ranges too small to give every part a whole tile."""


class Span(NamedTuple):
    """Elements ``[start, start + numel)`` of a flat tensor."""

    start: int
    numel: int

    @property
    def stop(self) -> int:
        """One past the last element."""
        return self.start + self.numel


def unit_for(numel: int, parts: int) -> int:
    """Cut granularity for ``numel`` elements in ``parts``: a tile if each part gets one, else 16."""
    return TILE if numel >= parts * TILE else SMALL_UNIT


def split_span(span: Span, parts: int, unit: int | None = None) -> tuple[Span, ...]:
    """Cut ``span`` into ``parts`` consecutive spans starting at multiples of ``unit`` from its start.

    Units are dealt out as evenly as possible, the first parts taking one extra; the part that
    reaches the end of ``span`` may be shorter, and parts after it are empty.
    """
    if parts < 1:
        raise ValueError(f"parts={parts} must be at least 1")
    unit = unit_for(span.numel, parts) if unit is None else unit
    units = -(-span.numel // unit)
    base, extra = divmod(units, parts)
    out = []
    first_unit = 0
    for i in range(parts):
        count = base + (1 if i < extra else 0)
        lo = min(span.numel, first_unit * unit)
        hi = min(span.numel, (first_unit + count) * unit)
        out.append(Span(span.start + lo, hi - lo))
        first_unit += count
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkLayout:
    """The cut of a flat tensor of ``numel`` elements into ``world`` chunks of ``channels`` pieces."""

    numel: int
    """Elements of the chunked tensor (reduce-scatter: its input; all-gather: its output)."""
    world: int
    """Number of chunks: one per rank, chunk ``c`` owned by rank ``c``."""
    channels: int
    """Pieces per chunk."""
    chunks: tuple[Span, ...]
    """Chunk ``c``'s elements."""
    pieces: tuple[tuple[Span, ...], ...]
    """``pieces[c][k]``: piece ``k`` of chunk ``c`` (absolute positions)."""

    @classmethod
    def equal(cls, numel: int, world: int, channels: int = 1) -> ChunkLayout:
        """torch's cut for reduce-scatter / all-gather: ``world`` chunks of ``numel / world``."""
        if world < 1 or numel % world:
            raise ValueError(f"numel={numel} is not a multiple of world={world}")
        m = numel // world
        return cls._build(numel, world, channels, tuple(Span(c * m, m) for c in range(world)))

    @classmethod
    def aligned(cls, numel: int, world: int, channels: int = 1) -> ChunkLayout:
        """The all-reduce cut: tile-aligned chunks (see the module docstring)."""
        return cls._build(numel, world, channels, split_span(Span(0, numel), world))

    @classmethod
    def of(cls, collective: str, numel: int, world: int, channels: int = 1) -> ChunkLayout:
        """The cut a collective makes: :meth:`aligned` for ``"all_reduce"``, :meth:`equal` for
        ``"reduce_scatter"`` and ``"all_gather"``. ``numel`` is the chunked tensor's size: the
        all-reduce tensor, the reduce-scatter input, the all-gather output. Made once per
        arguments (a layout is immutable), so a call's caches find it by identity."""
        return _layout_of(cls, collective, numel, world, channels)

    def __hash__(self) -> int:
        # the fields fix the rest: hashing every span (O(world x channels)) on each cache lookup
        # would cost more than the lookup saves at a thousand ranks
        return hash((self.numel, self.world, self.channels, self.chunks[0], self.chunks[-1]))

    @classmethod
    def _build(cls, numel: int, world: int, channels: int, chunks: tuple[Span, ...]) -> ChunkLayout:
        pieces = tuple(split_span(chunk, channels) for chunk in chunks)
        return cls(numel=numel, world=world, channels=channels, chunks=chunks, pieces=pieces)

    def piece_numel(self, chunk: int, piece: int) -> int:
        """Elements of piece ``piece`` of chunk ``chunk``."""
        return self.pieces[chunk][piece].numel


@functools.lru_cache(maxsize=256)
def _layout_of(cls: type[ChunkLayout], collective: str, numel: int, world: int, channels: int) -> ChunkLayout:
    if collective == "all_reduce":
        return cls.aligned(numel, world, channels)
    if collective in ("reduce_scatter", "all_gather"):
        return cls.equal(numel, world, channels)
    raise ValueError(f"collective={collective!r} is not 'all_reduce', 'reduce_scatter' or 'all_gather'")


@functools.lru_cache(maxsize=256)
def piece_arrays(layout: ChunkLayout) -> tuple[np.ndarray, np.ndarray]:
    """``(n[c, k], start[c, k])``: every piece's elements and first element, as int64 arrays
    (read-only; made once per layout)."""
    p, ch = layout.world, layout.channels
    n = np.array([[s.numel for s in chunk] for chunk in layout.pieces], dtype=np.int64).reshape(p, ch)
    start = np.array([[s.start for s in chunk] for chunk in layout.pieces], dtype=np.int64).reshape(p, ch)
    n.flags.writeable = start.flags.writeable = False
    return n, start


def count_nonzero_pieces(
    flat: torch.Tensor, layout: ChunkLayout, chunks: range | list[int] | None = None, base: int = 0
) -> torch.Tensor:
    """Nonzero count of every piece of ``chunks``: an int64 tensor of ``len(chunks) * channels``, on ``flat``'s device.

    ``flat`` holds the chunks' elements, chunk ``chunks[0]`` of the layout starting at element
    ``layout.chunks[chunks[0]].start - base`` of ``flat`` (``base`` lets the input of an
    all-gather, which is one chunk, be counted on its own). No host synchronisation.

    On CUDA with Triton, one streaming launch counts every piece (:mod:`._count`, near copy
    bandwidth). Else, with the CUDA kernels, one launch of the Pici encoder counts every piece,
    each into a payload with room for its metadata only: it reports nnz without storing values
    (the encoder never writes past a payload's room), at the encoder's speed (2.2 TB/s on an H200,
    against 0.65 TB/s for ``torch.count_nonzero``). Otherwise runs
    of equally long, equally spaced chunks are counted as one strided 2-D view per piece, so the
    number of kernels is about ``channels`` times the number of distinct chunk lengths.
    """
    chunks = list(range(layout.world)) if chunks is None else list(chunks)
    if flat.dtype in SUPPORTED_DTYPES and _counts_with_triton(flat):
        from ._count import count_ranges

        return count_ranges(flat, tuple((p.start - base, p.numel) for c in chunks for p in layout.pieces[c]))
    if uses_kernels(flat) and flat.dtype in SUPPORTED_DTYPES:
        return _count_with_encoder(flat, layout, chunks, base)
    ch = layout.channels
    out = torch.zeros(len(chunks) * ch, dtype=torch.int64, device=flat.device)
    i = 0
    while i < len(chunks):
        first = layout.chunks[chunks[i]]
        j = i + 1
        while (
            j < len(chunks)
            and chunks[j] == chunks[j - 1] + 1
            and layout.chunks[chunks[j]].numel == first.numel
            and layout.chunks[chunks[j]].start - layout.chunks[chunks[j - 1]].start == first.numel
        ):
            j += 1
        if first.numel:
            rows = j - i
            view = flat.as_strided((rows, first.numel), (first.numel, 1), flat.storage_offset() + first.start - base)
            for k, piece in enumerate(layout.pieces[chunks[i]]):
                if piece.numel:
                    lo = piece.start - first.start
                    # summing the bool mask as bytes into int32 skips the int64 copy count_nonzero makes
                    nonzero = (view[:, lo : lo + piece.numel] != 0).view(torch.uint8)
                    out[i * ch + k : j * ch : ch] = nonzero.sum(dim=1, dtype=torch.int32)
        i = j
    return out


def _counts_with_triton(flat: torch.Tensor) -> bool:
    """CUDA tensors with Triton installed (tests run :func:`._count.count_ranges` in Triton's interpreter)."""
    return flat.is_cuda and triton_importable()


def _count_with_encoder(flat: torch.Tensor, layout: ChunkLayout, chunks: list[int], base: int) -> torch.Tensor:
    """One launch of the Pici encoder over every piece, each into a payload with room for its
    metadata only (no value is stored; the count is exact)."""
    pieces = [piece for c in chunks for piece in layout.pieces[c]]
    offsets = [0]
    for p in pieces:
        offsets.append(offsets[-1] + align16(pici_metadata_bytes(p.numel)))
    scratch = torch.empty(offsets[-1], dtype=torch.uint8, device=flat.device)
    counts = torch.empty(len(pieces), dtype=torch.int64, device=flat.device)
    starts = tuple(p.start - base for p in pieces)
    compress_pieces_into(flat, scratch, starts, tuple(p.numel for p in pieces), tuple(offsets), counts)
    return counts
