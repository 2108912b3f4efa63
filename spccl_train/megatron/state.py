"""Per-bucket error buffers, the reduction of one Megatron bucket through SpCCL, and statistics."""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist

from ..collectives import CollectiveWork
from ..ddp import SummaryRatios
from ..pruning import Pruner
from ..reducer import BucketReducer, BucketState
from ..transport.dense import reduce_scatter_flat
from .config import SpcclMegatronConfig

__all__ = ["BucketState", "MegatronSummary", "SpcclMegatronState"]


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

    __slots__ = ("_buckets", "_dense_reductions", "_next_index", "config", "reducer")

    def __init__(self, config: SpcclMegatronConfig | None = None) -> None:
        if config is None:
            config = SpcclMegatronConfig()
        elif not isinstance(config, SpcclMegatronConfig):
            raise TypeError(f"config must be a SpcclMegatronConfig or None, got {type(config).__name__}")
        self.config = config
        self.reducer = BucketReducer(
            Pruner(config.pruning),
            config.prune,
            config.collective,
            config.capacity_factor,
            "megatron",
            config.prune_to_wire,
        )
        self._buckets: weakref.WeakKeyDictionary[object, BucketState] = weakref.WeakKeyDictionary()
        self._next_index = 0
        self.reset_stats()

    @property
    def pruner(self) -> Pruner:
        """The pruner (its config: ``config.pruning``)."""
        return self.reducer.pruner

    def reset_stats(self) -> None:
        """Zero the statistics (not the error buffers)."""
        self._dense_reductions = 0
        self.reducer.reset_stats()

    def summary(self) -> MegatronSummary:
        """Totals so far. Reads device timers and counters: call it off the hot path."""
        t = self.reducer.totals()
        return MegatronSummary(
            dense_reductions=self._dense_reductions,
            sparse_reductions=t.reductions,
            elements=t.elements,
            kept=t.kept,
            bytes_sent=t.bytes_sent,
            dense_bytes=t.dense_bytes,
            prune_seconds=t.prune_seconds,
            reduce_seconds=t.reduce_seconds,
            deferred=t.deferred,
            exchanges=t.exchanges,
        )

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
        and summed by SpCCL (:meth:`spccl_train.reducer.BucketReducer.reduce`).
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
        step = state.reductions - 1
        return self.reducer.reduce(
            state,
            tensor,
            group=group,
            world=dist.get_world_size(group),
            step=step,  # the seed follows the reduction count
            schedule_step=step - self.config.dense_iterations,  # the warm-up counts from the first sparse one
            shard=shard,
        )
