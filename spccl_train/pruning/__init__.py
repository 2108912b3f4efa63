"""Gradient layer: sampled top-k pruning with leaky error feedback (Triton kernels + torch reference)."""

from .cap import cap_ranges, cap_ranges_reference, check_capacity_factor, piece_caps
from .pruner import PruneConfig, Pruner, PruneResult, uses_triton
from .reference import keep_count, prune_with_error_feedback, sample_size, threshold_from_sample

__all__ = [
    "PruneConfig",
    "cap_ranges",
    "cap_ranges_reference",
    "check_capacity_factor",
    "piece_caps",
    "PruneResult",
    "Pruner",
    "keep_count",
    "prune_with_error_feedback",
    "sample_size",
    "threshold_from_sample",
    "uses_triton",
]
