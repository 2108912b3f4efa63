"""Triton op: one fused pass of pruning with leaky error feedback, in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["prune_error_feedback"]

_BLOCK = 4096


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 -> ``dtype`` rounding to nearest even, as torch does. bf16 is rounded by hand: the
    Triton interpreter (CPU tests) truncates fp32 -> bf16 whatever rounding is asked for."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN: torch's canonical bf16 NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _prune_error_feedback_kernel(grad_ptr, error_ptr, threshold_ptr, kept_ptr, numel, decay, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    threshold = tl.load(threshold_ptr)
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
    e = tl.load(error_ptr + offsets, mask=mask, other=0.0)
    v = g.to(tl.float32) + e.to(tl.float32)
    keep = (tl.abs(v) >= threshold) & mask
    tl.store(grad_ptr + offsets, _round_to(tl.where(keep, v, 0.0), g.dtype), mask=mask)
    tl.store(error_ptr + offsets, _round_to(tl.where(keep, 0.0, v * decay), e.dtype), mask=mask)
    tl.atomic_add(kept_ptr, tl.sum(keep.to(tl.int32), axis=0), sem="relaxed")


def prune_error_feedback(
    grad: torch.Tensor, error: torch.Tensor, threshold: torch.Tensor, decay: float
) -> torch.Tensor:
    """Prune ``grad`` in place against ``threshold`` (a one-element fp32 device tensor), moving
    what is dropped, times ``decay``, into ``error``; return the kept count (int32[1] on device).

    ``v = g + e`` in fp32; ``keep = |v| >= thr``; ``g = keep ? v : 0``; ``e = keep ? 0 : decay*v``.
    """
    kept = torch.zeros(1, dtype=torch.int32, device=grad.device)
    grid = (triton.cdiv(grad.numel(), _BLOCK),)
    _prune_error_feedback_kernel[grid](grad, error, threshold, kept, grad.numel(), decay, BLOCK=_BLOCK, num_warps=8)
    return kept
