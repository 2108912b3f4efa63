"""Triton kernels of :func:`spccl_train.pruning.cap.cap_ranges`.

Program ``(j, i)`` handles elements ``[j * BLOCK, (j + 1) * BLOCK)`` of range ``i``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton_math import nonzero, round_to

__all__ = ["block_counts_kernel", "cap_blocks_kernel"]


@triton.jit
def block_counts_kernel(grad_ptr, starts_ptr, numels_ptr, counts_ptr, blocks, BLOCK: tl.constexpr):
    """``counts[i, j]``: nonzeros of block ``j`` of range ``i`` (left 0 past the range's end)."""
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    start = tl.load(starts_ptr + i)
    numel = tl.load(numels_ptr + i)
    first = j * BLOCK
    if first < numel:
        offsets = first + tl.arange(0, BLOCK)
        mask = offsets < numel
        g = tl.load(grad_ptr + start + offsets, mask=mask, other=0.0)
        tl.store(counts_ptr + i * blocks + j, tl.sum(nonzero(g).to(tl.int32), axis=0))


@triton.jit
def cap_blocks_kernel(
    grad_ptr, error_ptr, starts_ptr, numels_ptr, counts_ptr, allowed_ptr, blocks, BLOCK: tl.constexpr
):
    """Move the nonzeros of block ``j`` of range ``i`` after its first ``allowed[i, j]`` into the error buffer."""
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    count = tl.load(counts_ptr + i * blocks + j)
    allowed = tl.load(allowed_ptr + i * blocks + j)
    if count > allowed:
        start = tl.load(starts_ptr + i)
        numel = tl.load(numels_ptr + i)
        offsets = j * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        g = tl.load(grad_ptr + start + offsets, mask=mask, other=0.0)
        e = tl.load(error_ptr + start + offsets, mask=mask, other=0.0)
        present = (nonzero(g) & mask).to(tl.int32)
        before = tl.cumsum(present, axis=0) - present
        over = (present != 0) & (before >= allowed)
        tl.store(error_ptr + start + offsets, tl.where(over, round_to(g.to(tl.float32), e.dtype), e), mask=mask)
        tl.store(grad_ptr + start + offsets, tl.where(over, 0.0, g).to(g.dtype), mask=mask)
