"""Per-bucket error buffers, the reduction of one Megatron bucket through SpCCL, and statistics."""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch
import torch.distributed as dist

from .._timing import Span
from ..collectives import CollectiveStats, CollectiveWork, all_reduce, reduce_scatter_tensor
from ..ddp import SummaryRatios
from ..pruning import Pruner, PruneResult, piece_caps
from ..transport.dense import reduce_scatter_flat
from .config import SpcclMegatronConfig

__all__ = ["BucketState", "MegatronSummary", "SpcclMegatronState"]

_graph_scopes = itertools.count()
"""Numbers the states, to tag their buckets' CUDA graphs apart."""

_PENDING_TIMERS = 1024
"""Timers kept unread; past this the older half is read (long finished, so reading waits for nothing)."""


@dataclasses.dataclass(slots=True)
class BucketState:
    """What the integration keeps for one Megatron bucket (``_ParamAndGradBucket``)."""

    index: int
    """Order in which the bucket was first reduced: equal on every rank, it seeds the sampling."""
    reductions: int = 0
    """Reductions so far, dense warm-up included."""
    error: torch.Tensor | None = None
    """Error-feedback buffer (the bucket's shape, ``pruning.error_dtype``); made at the first pruning."""
    last_prune: PruneResult | None = None
    """The latest pruning pass (threshold, kept count; tensors on the device)."""
    validated: tuple[int, str] | None = None
    """``capacity_factor``: ``(numel, collective)`` of the bucket's reduction once it was planned
    with the exchange (every rank's bucket agreed); later ones are planned from the caps."""


@dataclasses.dataclass(frozen=True, slots=True)
class MegatronSummary(SummaryRatios):
    """Totals since the state was made (or :meth:`SpcclMegatronState.reset_stats`)."""

    dense_reductions: int
    """Bucket reductions done by Megatron's dense collective (warm-up)."""
    sparse_reductions: int
    """Bucket reductions done by SpCCL (all-reduces and reduce-scatters)."""
    elements: int
    """Gradient elements that went through SpCCL."""
    kept: int
    """Elements kept by pruning (all elements when pruning is off)."""
    bytes_sent: int
    """Bytes this rank sent in SpCCL calls."""
    dense_bytes: int
    """Bytes a dense ring would have sent for the same calls."""
    prune_seconds: float
    """Time in pruning (device time on CUDA)."""
    reduce_seconds: float
    """Time from issuing each sparse reduction to its completion."""
    deferred: int = 0
    """Elements pruning kept that the capacity bound deferred to a later reduction (``capacity_factor``)."""
    exchanges: int = 0
    """Planning exchanges (host synchronisations) of the sparse reductions."""


class SpcclMegatronState:
    """Configuration, per-bucket state and statistics of the Megatron integration.

    :func:`spccl_train.megatron.enable` makes one and returns it; every patched bucket group
    reduces through the active state.

    Args:
        config: the :class:`SpcclMegatronConfig` (default: prune to 1%, ``auto`` format and algorithm).
    """

    __slots__ = (
        "_buckets",
        "_bytes_sent",
        "_dense_bytes",
        "_deferred",
        "_dense_reductions",
        "_exchanges",
        "_graph_scope",
        "_elements",
        "_kept",
        "_next_index",
        "_prune_seconds",
        "_prune_spans",
        "_reduce_seconds",
        "_reduce_stats",
        "_sparse_reductions",
        "config",
        "pruner",
    )

    def __init__(self, config: SpcclMegatronConfig | None = None) -> None:
        if config is None:
            config = SpcclMegatronConfig()
        elif not isinstance(config, SpcclMegatronConfig):
            raise TypeError(f"config must be a SpcclMegatronConfig or None, got {type(config).__name__}")
        self.config = config
        self.pruner = Pruner(config.pruning)
        self._buckets: weakref.WeakKeyDictionary[object, BucketState] = weakref.WeakKeyDictionary()
        self._next_index = 0
        self._graph_scope = next(_graph_scopes)  # equal on every rank that makes its states in one order
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the statistics (not the error buffers)."""
        self._dense_reductions = 0
        self._sparse_reductions = 0
        self._elements = 0
        self._kept: torch.Tensor | int = 0
        self._deferred: torch.Tensor | int = 0
        self._exchanges = 0
        self._bytes_sent = 0
        self._dense_bytes = 0
        self._prune_seconds = 0.0
        self._reduce_seconds = 0.0
        self._prune_spans: list[Span] = []
        self._reduce_stats: list[CollectiveStats] = []

    def summary(self) -> MegatronSummary:
        """Totals so far. Reads device timers and counters: call it off the hot path."""
        self._fold_timers(keep=0)
        return MegatronSummary(
            dense_reductions=self._dense_reductions,
            sparse_reductions=self._sparse_reductions,
            elements=self._elements,
            kept=int(self._kept),
            bytes_sent=self._bytes_sent,
            dense_bytes=self._dense_bytes,
            prune_seconds=self._prune_seconds,
            reduce_seconds=self._reduce_seconds,
            deferred=int(self._deferred),
            exchanges=self._exchanges,
        )

    def _fold_timers(self, keep: int) -> None:
        """Add all but the newest ``keep`` timers of each kind to the totals, and drop them."""
        old = max(len(self._prune_spans) - keep, 0)
        self._prune_seconds += sum(span.seconds() for span in self._prune_spans[:old])
        del self._prune_spans[:old]
        old = max(len(self._reduce_stats) - keep, 0)
        self._reduce_seconds += sum(stats.elapsed_s for stats in self._reduce_stats[:old])
        del self._reduce_stats[:old]

    def bucket_state(self, bucket: object) -> BucketState | None:
        """The state of a Megatron ``_ParamAndGradBucket`` (``None`` before its first reduction)."""
        return self._buckets.get(bucket)

    def reduce(
        self,
        bucket: object,
        tensor: torch.Tensor,
        shard: torch.Tensor | None,
        op: dist.ReduceOp.RedOpType,
        group: dist.ProcessGroup | None,
    ) -> CollectiveWork | dist.Work:
        """Reduce one bucket's gradients over ``group``; return the (always asynchronous) work.

        All-reduce ``tensor`` in place when ``shard`` is ``None``, else reduce-scatter it into
        ``shard`` (this rank's slice of it). Megatron has scaled ``tensor`` already; ``op`` is
        its ``SUM`` or ``AVG``. During the dense warm-up this is Megatron's own collective; after,
        ``tensor`` is averaged if ``op`` asks for it, pruned with error feedback (if enabled),
        and summed by SpCCL.
        """
        state = self._buckets.get(bucket)
        if state is None:
            state = self._buckets[bucket] = BucketState(index=self._next_index)
            self._next_index += 1
        dense = state.reductions < self.config.dense_iterations
        state.reductions += 1
        if dense:
            self._dense_reductions += 1
            if shard is None:
                return dist.all_reduce(tensor, op=op, group=group, async_op=True)
            return reduce_scatter_flat(shard, tensor, op=op, group=group, async_op=True)
        if op == dist.ReduceOp.AVG:
            tensor.div_(dist.get_world_size(group))
        elif op != dist.ReduceOp.SUM:
            raise ValueError(f"Megatron asked for a {op!r} gradient reduction; SpCCL reduces with SUM or AVG only")
        collective = "all_reduce" if shard is None else "reduce_scatter"
        world = dist.get_world_size(group)
        capped = None
        if self.config.prune:
            if state.error is None or state.error.shape != tensor.shape or state.error.device != tensor.device:
                state.error = self.pruner.new_error_buffer(tensor)
            span = Span(tensor.device)
            step = state.reductions - 1
            # The seed follows the reduction count; the density warm-up counts from the first sparse one.
            schedule_step = step - self.config.dense_iterations
            if self.config.capacity_factor is not None:
                density = self.pruner.config.density_at(schedule_step)
                channels = self.config.collective.channels
                capped = piece_caps(tensor.numel(), world, channels, density, self.config.capacity_factor, collective)
            result = self.pruner.prune(
                tensor, state.error, step=step, buffer=state.index, schedule_step=schedule_step, caps=capped
            )
            if result.deferred is not None:
                self._deferred = self._deferred + result.deferred
            span.stop()
            self._prune_spans.append(span)
            state.last_prune = result
            self._kept = self._kept + result.kept
        else:
            self._kept = self._kept + tensor.numel()
        bounded = capped is not None and state.validated == (tensor.numel(), collective)
        bounds = [list(capped[1])] * world if bounded else None
        cfg = self.config.collective
        tag = ("megatron", self._graph_scope, state.index)  # the bucket's CUDA graph (collective.cuda_graphs)
        if shard is None:
            work = all_reduce(tensor, group=group, async_op=True, config=cfg, bounds=bounds, graph_tag=tag)
        else:
            work = reduce_scatter_tensor(
                shard, tensor, group=group, async_op=True, config=cfg, bounds=bounds, graph_tag=tag
            )
        if capped is not None:
            state.validated = (tensor.numel(), collective)  # every rank's bucket agreed in the exchange
        stats = work.stats
        self._exchanges += stats.exchanges
        self._sparse_reductions += 1
        self._elements += tensor.numel()
        self._bytes_sent += stats.bytes_sent
        self._dense_bytes += stats.dense_bytes
        self._reduce_stats.append(stats)
        if len(self._reduce_stats) > _PENDING_TIMERS:
            self._fold_timers(keep=_PENDING_TIMERS // 2)
        return work
