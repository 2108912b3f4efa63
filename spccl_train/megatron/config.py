"""What a caller tunes on the Megatron-core integration: :class:`SpcclMegatronConfig`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..collectives import CollectiveConfig
from ..pruning import PruneConfig, check_capacity_factor

__all__ = ["SpcclMegatronConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class SpcclMegatronConfig:
    """How Megatron-core's data-parallel gradient reductions run through SpCCL. Equal on every rank.

    Example::

        >>> SpcclMegatronConfig(pruning={"density": 0.01}, collective={"format": "pici", "ranks_per_node": 8})
    """

    prune: bool = True
    """Prune each bucket with error feedback before reducing it. ``False``: an exact sparse
    reduction of whatever the gradients hold (the same sums as Megatron's own, up to the order
    of floating-point additions)."""
    pruning: PruneConfig = dataclasses.field(default_factory=PruneConfig)
    """Density kept, threshold sampling, error-feedback decay, error-buffer dtype and density
    warm-up. A mapping with :class:`~spccl_train.pruning.PruneConfig`'s field names is accepted
    too. The warm-up (``warmup_steps``) counts each bucket's reductions from its first sparse
    one, after ``dense_iterations``, so that it starts when pruning does."""
    collective: CollectiveConfig = dataclasses.field(default_factory=CollectiveConfig)
    """Format, algorithm, thresholds, topology (``ranks_per_node``) and channels of the sparse
    all-reduce / reduce-scatter. A mapping with :class:`~spccl_train.collectives.CollectiveConfig`'s
    field names is accepted too."""
    capacity_factor: float | None = None
    """``None``: every sparse reduction counts its bucket's nonzeros and exchanges the counts (a
    host synchronisation per bucket). A factor ``f >= 1``: after a bucket's first sparse
    reduction (planned with the exchange, which also checks that every rank's bucket agrees),
    each piece of the bucket (one per rank and channel) keeps at most ``ceil(f * density *
    piece size)`` nonzeros, the excess waiting undecayed in the error buffer, and the reduction
    is planned from those bounds with no host synchronisation (as ``SparseHookState``'s
    ``capacity_factor``; with ``collective.cuda_graphs`` it is replayed from a CUDA graph).
    Needs ``prune=True``."""
    prune_to_wire: bool = True
    """Prune an all-reduced bucket straight into the all-reduce's Pici payloads where it can send
    them as they are (as ``SparseHookState``'s ``prune_to_wire``); ``False`` saves the payloads'
    buffer (about the bucket's size) per bucket."""
    dense_iterations: int = 0
    """Reductions of each bucket done by Megatron's dense collective before SpCCL takes over.
    Megatron fixes its buckets when the model is wrapped, so none are needed for correctness;
    a few let pruned training start from exact gradients."""

    def __post_init__(self) -> None:
        if isinstance(self.pruning, Mapping):
            self.pruning = PruneConfig(**self.pruning)
        if isinstance(self.collective, Mapping):
            self.collective = CollectiveConfig(**self.collective)
        if not isinstance(self.prune, bool):
            raise TypeError(f"prune={self.prune!r} must be True or False (False reduces exactly, without pruning)")
        if not isinstance(self.pruning, PruneConfig):
            raise TypeError(f"pruning={self.pruning!r} must be a PruneConfig or a mapping of its fields")
        if not isinstance(self.collective, CollectiveConfig):
            raise TypeError(f"collective={self.collective!r} must be a CollectiveConfig or a mapping of its fields")
        self.capacity_factor = check_capacity_factor(self.capacity_factor, self.prune)
        n = self.dense_iterations
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"dense_iterations={n!r} must be an int >= 0 (0: SpCCL from the first reduction)")
