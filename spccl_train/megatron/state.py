"""Per-bucket error buffers, the reduction of one Megatron bucket through SpCCL, and statistics."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..collectives import CollectiveWork
from ..pruning import Pruner
from ..reducer import BucketReducer, BucketState, ReductionSummary
from ..sparse_config import SparseConfig
from ..transport.dense import reduce_scatter_flat

__all__ = ["BucketState", "SpcclMegatronState"]


class SpcclMegatronState:
    """Configuration, per-bucket state and statistics of the Megatron integration.

    :func:`spccl_train.megatron.enable` makes one and returns it; every patched bucket group
    reduces through the active state.

    Args:
        config: the :class:`~spccl_train.sparse_config.SparseConfig` (default: prune to 1%, ``auto``
            format and algorithm; ``dense_iterations`` ``None`` is 0 here).
    """

    __slots__ = ("_buckets", "_next_index", "config", "dense_iterations", "reducer")

    def __init__(self, config: SparseConfig | None = None) -> None:
        config = SparseConfig.of(config)
        self.config = config
        self.dense_iterations = config.dense_iterations_or(0)
        self.reducer = BucketReducer(config, "megatron")
        self._buckets: weakref.WeakKeyDictionary[object, BucketState] = weakref.WeakKeyDictionary()
        self._next_index = 0
        self.reset_stats()

    @property
    def pruner(self) -> Pruner:
        """The pruner (its config: ``config.pruning``)."""
        return self.reducer.pruner

    def reset_stats(self) -> None:
        """Zero the statistics (not the error buffers)."""
        self.reducer.reset_stats()

    def summary(self) -> ReductionSummary:
        """Totals so far (Megatron's dense warm-up reductions counted too). Reads device timers and
        counters: call it off the hot path."""
        return self.reducer.summary()

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
        dense = state.reductions < self.dense_iterations
        state.reductions += 1
        if dense:
            self.reducer.count_dense()
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
            schedule_step=step - self.dense_iterations,  # the warm-up counts from the first sparse one
            shard=shard,
        )
