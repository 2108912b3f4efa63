"""What a caller tunes on sparse gradient reduction, for every engine: :class:`SparseConfig`.

One shape, two nested sections: ``pruning`` (:class:`~spccl_train.pruning.PruneConfig`) and
``collective`` (:class:`~spccl_train.collectives.CollectiveConfig`), plus what belongs to the
bucket reducer (:mod:`spccl_train.reducer`). The DDP comm hook
(``spccl_train.ddp.SparseHookState(config=...)``), the Megatron-core integration
(``spccl_train.megatron.enable(config)``) and the trainer (its ``spccl`` section) all take it.

Example::

    >>> SparseConfig(pruning={"density": 0.01, "warmup_steps": 20}, collective={"format": "auto"}, capacity_factor=4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .collectives import CollectiveConfig
from .pruning import PruneConfig, check_capacity_factor

__all__ = ["SparseConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class SparseConfig:
    """How gradient buckets are pruned and reduced through SpCCL. Equal on every rank."""

    prune: bool = True
    """Prune each bucket with error feedback before reducing it. ``False``: an exact sparse
    reduction of whatever the gradients hold (the same sums as a dense reduction, up to the order
    of floating-point additions)."""
    pruning: PruneConfig = dataclasses.field(default_factory=PruneConfig)
    """Density kept, threshold sampling, error-feedback decay, error-buffer dtype, seed and density
    warm-up. A mapping of :class:`~spccl_train.pruning.PruneConfig`'s fields is accepted too. The
    warm-up (``warmup_steps``) counts each bucket's reductions from its first sparse one, after
    ``dense_iterations``, so that it starts when pruning does."""
    collective: CollectiveConfig = dataclasses.field(default_factory=CollectiveConfig)
    """Format, algorithm, thresholds, topology (``ranks_per_node``), channels and CUDA graphs of the
    sparse all-reduce / reduce-scatter. A mapping of
    :class:`~spccl_train.collectives.CollectiveConfig`'s fields is accepted too."""
    capacity_factor: float | None = None
    """``None``: every sparse reduction counts its bucket's nonzeros and exchanges the counts, a
    host synchronisation per bucket (in the DDP hook it stalls the host thread launching the
    backward pass until the bucket's pruning is done). A factor ``f >= 1``: after a bucket's first
    sparse reduction (planned with the exchange, which also checks that every rank's bucket
    agrees), each piece of the bucket (one per rank and channel) keeps at most ``ceil(f * density *
    piece size)`` nonzeros, the excess (the last ones in position order) waiting undecayed in the
    error buffer for a later step (:func:`spccl_train.pruning.cap_ranges`; counted in
    ``ReductionSummary.deferred``), and the reduction is planned from those bounds with **no host
    synchronisation** (with ``collective.cuda_graphs`` replayed from a CUDA graph). Messages are
    sized for the bounds (an all-reduce's gather phase for the sum of every rank's bound), so a
    larger ``f`` sends more padding: on slow links prefer ``None``. Needs ``prune=True``."""
    prune_to_wire: bool = True
    """Prune a bucket straight into the all-reduce's Pici payloads where the all-reduce will send
    them as they are (:mod:`spccl_train.reducer`): one pass over gradient and error buffer instead
    of pruning in place and encoding again. Each such bucket keeps its payloads' buffer, about the
    bucket's size; ``False`` saves that memory."""
    record_calls: bool = False
    """Keep a record of every sparse reduction (:class:`~spccl_train.reducer.CallRecord`: bucket,
    candidate run, trial, whether its input came as Pici payloads, predicted and measured time,
    bytes, every candidate's price) in the engine's ``summary().calls`` until its stats are reset:
    what ``auto`` did, bucket by bucket (the trainer's ``output.calls`` writes them to
    ``calls.csv``). Reset the stats every step (the trainer does), or the records pile up."""
    dense_iterations: int | None = None
    """Reductions of each bucket done densely before SpCCL takes over (a few let pruned training
    start from exact gradients). ``None``: the engine's least, 1 for DDP (it rebuilds its buckets
    after the first iteration, and error buffers are kept per bucket) and 0 for Megatron (its
    buckets are fixed when the model is wrapped)."""

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
        if not isinstance(self.prune_to_wire, bool):
            raise TypeError(f"prune_to_wire={self.prune_to_wire!r} must be True or False")
        if not isinstance(self.record_calls, bool):
            raise TypeError(f"record_calls={self.record_calls!r} must be True or False")
        self.capacity_factor = check_capacity_factor(self.capacity_factor, self.prune)
        n = self.dense_iterations
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(
                f"dense_iterations={n!r} must be None (the engine's least) or an int >= 0 (0: SpCCL from the first "
                "reduction)"
            )

    def dense_iterations_or(self, least: int) -> int:
        """``dense_iterations``, or ``least`` (the engine's) when it is ``None``."""
        return least if self.dense_iterations is None else self.dense_iterations

    @classmethod
    def of(cls, config: SparseConfig | Mapping | None) -> SparseConfig:
        """``config`` as a :class:`SparseConfig` (``None``: the defaults; a mapping: its fields)."""
        if config is None:
            return cls()
        if isinstance(config, Mapping):
            return cls(**config)
        if not isinstance(config, cls):
            raise TypeError(
                f"config must be a SparseConfig, a mapping of its fields or None, got {type(config).__name__}"
            )
        return config
