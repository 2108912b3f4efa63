"""Triton op: one fused pass of pruning with leaky error feedback, in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_math import nonzero, round_to
from .pruner import PRUNE_BLOCK as BLOCK

__all__ = ["prune_error_feedback"]


@triton.jit
def _prune_error_feedback_kernel(
    grad_ptr, error_ptr, threshold_ptr, kept_ptr, counts_ptr, numel, decay, BLOCK: tl.constexpr, COUNT: tl.constexpr
):
    block = tl.program_id(0)
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    threshold = tl.load(threshold_ptr)
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
    e = tl.load(error_ptr + offsets, mask=mask, other=0.0)
    v = g.to(tl.float32) + e.to(tl.float32)
    keep = (tl.abs(v) >= threshold) & mask
    pruned = round_to(tl.where(keep, v, 0.0), g.dtype)
    tl.store(grad_ptr + offsets, pruned, mask=mask)
    tl.store(error_ptr + offsets, round_to(tl.where(keep, 0.0, v * decay), e.dtype), mask=mask)
    tl.atomic_add(kept_ptr, tl.sum(keep.to(tl.int32), axis=0), sem="relaxed")
    if COUNT:  # nonzeros left in the block, for the per-range caps
        tl.store(counts_ptr + block, tl.sum((nonzero(pruned) & mask).to(tl.int32), axis=0))


def prune_error_feedback(
    grad: torch.Tensor,
    error: torch.Tensor,
    threshold: torch.Tensor,
    decay: float,
    block_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prune ``grad`` in place against ``threshold`` (a one-element fp32 device tensor), moving
    what is dropped, times ``decay``, into ``error``; return the kept count (int32[1] on device).

    ``v = g + e`` in fp32; ``keep = |v| >= thr``; ``g = keep ? v : 0``; ``e = keep ? 0 : decay*v``.
    ``block_counts``: an int32 tensor of ``ceil(numel / PRUNE_BLOCK)`` elements that receives the
    nonzeros left in each block of :data:`~.pruner.PRUNE_BLOCK` elements (for :func:`.cap.cap_ranges`).
    """
    kept = torch.zeros(1, dtype=torch.int32, device=grad.device)
    grid = (triton.cdiv(grad.numel(), BLOCK),)
    count = block_counts is not None
    _prune_error_feedback_kernel[grid](
        grad,
        error,
        threshold,
        kept,
        block_counts if count else kept,
        grad.numel(),
        decay,
        BLOCK=BLOCK,
        COUNT=count,
        num_warps=8,
    )
    return kept
