"""Per-range caps on the nonzeros a pruned gradient sends, with the excess deferred to the error buffer.

A sparse all-reduce that knows an upper bound on every piece's nonzeros before the data exists
can size its messages from the bounds and skip the count exchange, the one host
synchronisation it otherwise needs (``spccl_train.all_reduce(..., bounds=...)``). Pruning
produces roughly ``density`` of each piece, but a piece can hold more (the threshold is global
and gradients are not uniform across a bucket). :func:`cap_ranges` makes the bound hold: in
every range holding more than ``cap`` nonzeros it keeps the first ``cap`` in position order and
moves the rest, undecayed, into the error buffer, so they are sent on a later step instead of
now. Nothing is lost: ``grad + error`` is unchanged element by element (up to the rounding of a
value moved into a narrower error dtype).

"Nonzero" is what the codecs mean by it: ``x != 0`` (``-0.0`` is zero, NaN is not).

CUDA tensors run two Triton launches (per-block counts, then the fix-up of the blocks that
cross their range's cap, which the others leave at once) plus a few small torch ops for the
per-range prefix sums: no host synchronisation. CPU tensors run the torch reference, or the
Triton kernels in Triton's interpreter when ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from .._triton import device_table
from ..collectives.chunking import ChunkLayout
from .pruner import PRUNE_BLOCK as BLOCK
from .pruner import uses_triton

__all__ = ["cap_ranges", "cap_ranges_reference", "piece_caps", "check_capacity_factor"]


def cap_ranges(
    grad: torch.Tensor,
    error: torch.Tensor,
    ranges: Sequence[tuple[int, int]],
    caps: Sequence[int],
    *,
    block_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Leave at most ``caps[i]`` nonzeros in ``grad[start : start + numel]`` for each ``ranges[i]``.

    Nonzeros beyond the cap (the last ones in position order) move from ``grad`` into ``error``
    (converted to its dtype; ``error`` is expected to hold zero there, as pruning leaves it at
    kept positions, and is overwritten). Ranges must not overlap.

    Args:
        grad: contiguous 1-D float32 / bfloat16 / float16 tensor, after pruning.
        error: its error buffer, same shape and device.
        ranges: ``(start, numel)`` of each range.
        caps: the most nonzeros each range may keep, ``>= 0``.
        block_counts: the nonzeros of every :data:`~.pruner.PRUNE_BLOCK`-element block of ``grad``,
            as the prune kernel leaves them (``prune_error_feedback(..., block_counts=)``), which
            saves the kernels a pass over ``grad``. Only for ranges that start on a block
            boundary and end on one or at the end of ``grad``; ignored by the torch reference.

    Returns:
        A one-element int64 tensor on the device: how many nonzeros were deferred.
    """
    if len(ranges) != len(caps):
        raise ValueError(f"got {len(ranges)} ranges but {len(caps)} caps; pass one cap per range")
    if any(cap < 0 for cap in caps):
        raise ValueError(f"caps must be >= 0, got {list(caps)}")
    if grad.shape != error.shape or grad.device != error.device or grad.dim() != 1:
        raise ValueError(
            f"grad {tuple(grad.shape)} on {grad.device} and error {tuple(error.shape)} on {error.device} must be "
            "1-D tensors of one shape on one device"
        )
    n = grad.numel()
    for start, numel in ranges:
        if start < 0 or numel < 0 or start + numel > n:
            raise ValueError(f"range (start={start}, numel={numel}) lies outside the {n} elements")
        if block_counts is not None and (start % BLOCK or ((start + numel) % BLOCK and start + numel != n)):
            raise ValueError(
                f"range (start={start}, numel={numel}) does not start and end on {BLOCK}-element block boundaries "
                "(or at the end of grad), so block_counts cannot count it; pass block_counts=None"
            )
    if block_counts is not None and block_counts.numel() != -(-n // BLOCK):
        raise ValueError(f"block_counts has {block_counts.numel()} entries; grad has {-(-n // BLOCK)} blocks")
    if not ranges or max(numel for _, numel in ranges) == 0:
        return torch.zeros(1, dtype=torch.int64, device=grad.device)
    if uses_triton(grad):
        return _cap_triton(grad, error, tuple(ranges), tuple(caps), block_counts)
    return cap_ranges_reference(grad, error, ranges, caps)


def cap_ranges_reference(
    grad: torch.Tensor, error: torch.Tensor, ranges: Sequence[tuple[int, int]], caps: Sequence[int]
) -> torch.Tensor:
    """Pure-torch :func:`cap_ranges` (the oracle of the Triton kernels)."""
    deferred = torch.zeros(1, dtype=torch.int64, device=grad.device)
    for (start, numel), cap in zip(ranges, caps):
        g, e = grad[start : start + numel], error[start : start + numel]
        nonzero = g != 0
        before = torch.cumsum(nonzero, 0) - nonzero.to(torch.int64)  # nonzeros before each position
        over = nonzero & (before >= cap)
        e.copy_(torch.where(over, g.to(e.dtype), e))
        g.masked_fill_(over, 0)
        deferred += over.sum()
    return deferred


def _cap_triton(
    grad: torch.Tensor, error: torch.Tensor, ranges: tuple, caps: tuple, block_counts: torch.Tensor | None
) -> torch.Tensor:
    import triton

    from ._cap_kernels import block_counts_kernel, cap_blocks_kernel

    device = grad.device
    bounds = device_table((tuple(s for s, _ in ranges), tuple(n for _, n in ranges)), device)
    cap = device_table(caps, device)
    blocks = triton.cdiv(max(numel for _, numel in ranges), BLOCK)
    grid = (blocks, len(ranges))
    if block_counts is None:
        counts = torch.zeros((len(ranges), blocks), dtype=torch.int32, device=device)
        block_counts_kernel[grid](grad, bounds[0], bounds[1], counts, blocks, BLOCK=BLOCK, num_warps=8)
    else:  # the prune kernel's per-block counts, laid out per range (blocks past a range's end count 0)
        padded = torch.cat([block_counts.view(-1), block_counts.new_zeros(1)])
        counts = padded[_block_index(ranges, blocks, block_counts.numel(), device)]
    before = torch.cumsum(counts, 1, dtype=torch.int64) - counts  # nonzeros of the range before each block
    allowed = (cap.view(-1, 1) - before).clamp_(min=0)
    cap_blocks_kernel[grid](grad, error, bounds[0], bounds[1], counts, allowed, blocks, BLOCK=BLOCK, num_warps=8)
    return (counts - allowed).clamp_(min=0).sum().view(1)


@functools.lru_cache(maxsize=256)
def _block_index(ranges: tuple, blocks: int, total: int, device: torch.device) -> torch.Tensor:
    """``[range, j]`` -> the global block holding block ``j`` of the range (``total``: past its end).

    Cached here on the small key: the table has a row of ``blocks`` entries per range.
    """
    rows = []
    for start, numel in ranges:
        own = -(-numel // BLOCK)
        rows.append([start // BLOCK + j if j < own else total for j in range(blocks)])
    return torch.tensor(rows, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=256)
def piece_caps(
    numel: int, world: int, channels: int, density: float, factor: float, collective: str = "all_reduce"
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """The pieces a collective cuts a bucket of ``numel`` elements into, and a cap for each.

    Returns ``(ranges, caps)``: ``ranges`` are ``(start, numel)`` in the order of the collective's
    count table (chunk by chunk, ``channels`` pieces each; an all-reduce's aligned chunks, a
    reduce-scatter's equal ones), ``caps[i] = min(n, ceil(factor * density * n))``. Pass them to
    :func:`cap_ranges` (or ``Pruner.prune(caps=...)``) and ``[list(caps)] * world`` as the
    collective's ``bounds``.
    """
    if collective not in ("all_reduce", "reduce_scatter"):
        raise ValueError(f"piece_caps is for 'all_reduce' or 'reduce_scatter' buckets, got {collective!r}")
    layout = ChunkLayout.of(collective, numel, world, channels)
    ranges = tuple((piece.start, piece.numel) for chunk in layout.pieces for piece in chunk)
    caps = tuple(min(n, math.ceil(factor * density * n)) for _, n in ranges)
    return ranges, caps


def check_capacity_factor(capacity_factor: object, prune: bool) -> float | None:
    """``capacity_factor`` as a float (``None`` stays ``None``), or ``ValueError`` naming the fix."""
    if capacity_factor is None:
        return None
    if (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or not (math.isfinite(capacity_factor) and capacity_factor >= 1)
    ):
        raise ValueError(
            f"capacity_factor={capacity_factor!r} must be a number >= 1 (each piece keeps at most that many "
            "times its share of the density) or None to plan every reduction from exchanged counts"
        )
    if not prune:
        raise ValueError(
            "capacity_factor needs prune=True: without pruning nothing bounds the nonzeros of a bucket; "
            "pass capacity_factor=None"
        )
    return float(capacity_factor)
