"""Pure-torch reference of sampled top-k pruning with leaky error feedback.

The oracle for the Triton kernels (same semantics, same rounding): ``v = g + e`` in fp32;
``keep = |v| >= thr``; ``g = keep ? v : 0``; ``e = keep ? 0 : decay * v``, each rounded once to
its tensor's dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = ["sample_size", "keep_count", "threshold_from_sample", "prune_with_error_feedback"]


def sample_size(numel: int, fraction: float) -> int:
    """Elements to sample from ``numel``: ``ceil(fraction * numel)``, at least 1, at most numel."""
    return min(numel, max(1, math.ceil(fraction * numel)))


def keep_count(m: int, density: float) -> int:
    """How many of ``m`` samples the threshold must keep: ``ceil(density * m)``, in [1, m]."""
    return min(m, max(1, math.ceil(density * m)))


def threshold_from_sample(sample: torch.Tensor, density: float) -> torch.Tensor:
    """The threshold that keeps ``density`` of ``sample`` (non-negative magnitudes).

    The k-th largest sample (k = :func:`keep_count`) rounded down to its upper 16 float bits,
    i.e. to within 2**-7 relative: the bin edge the Triton kernel finds by histogram. At least k
    samples reach it. Returns a one-element float32 tensor on the sample's device.
    """
    k = keep_count(sample.numel(), density)
    kth = torch.topk(sample.to(torch.float32).view(-1), k, sorted=False).values.min().view(1)
    return (kth.view(torch.int32) & ~0xFFFF).view(torch.float32)


def prune_with_error_feedback(
    grad: torch.Tensor, error: torch.Tensor, threshold: torch.Tensor, decay: float
) -> torch.Tensor:
    """Prune ``grad`` in place with leaky error feedback into ``error``; return the kept count.

    Returns a one-element int64 tensor: how many elements of ``grad`` were kept.
    """
    v = grad.to(torch.float32) + error.to(torch.float32)
    keep = v.abs() >= threshold.to(torch.float32)
    grad.copy_(torch.where(keep, v, torch.zeros_like(v)))
    error.copy_(torch.where(keep, torch.zeros_like(v), v * decay))
    return keep.sum().view(1)
