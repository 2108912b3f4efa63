"""Megatron-core integration: data-parallel gradient reduction through SpCCL, pruned per bucket.

:func:`enable` patches Megatron-core's bucket groups (``_ParamAndGradBucketGroup``) so that
each bucket's gradients are pruned with error feedback and summed by SpCCL: an all-reduce, or
a reduce-scatter into this rank's shard with the distributed optimizer. Megatron's gradient
scaling, ``overlap_grad_reduce`` (asynchronous handles that ``finish_grad_sync`` waits on) and
bucket bookkeeping run unchanged. Supports megatron-core 0.16 to 0.19; Megatron is imported
only when :func:`enable` runs, so this package imports without it.

Example::

    >>> import spccl_train.megatron
    >>> state = spccl_train.megatron.enable(pruning={"density": 0.01})   # before building the model
    >>> model = DistributedDataParallel(transformer_config, DistributedDataParallelConfig(
    ...     overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=64_000_000), gpt_model)
    >>> ...train as usual...
    >>> print(state.summary().density, state.summary().bytes_ratio)
    >>> spccl_train.megatron.disable()

Not covered: Megatron-FSDP (``use_megatron_fsdp``), ``num_distributed_optimizer_instances > 1``
and ``reduce_scatter_with_fp32_accumulation`` (the last two raise a ``ValueError`` that says
what to set). Parameter all-gathers of the distributed optimizer stay dense.
"""

from ..reducer import ReductionSummary
from ..sparse_config import SparseConfig
from .patch import SUPPORTED_VERSIONS, active_state, check_version, disable, enable, is_enabled
from .state import BucketState, SpcclMegatronState

SpcclMegatronConfig = SparseConfig
"""This integration's earlier name of :class:`~spccl_train.sparse_config.SparseConfig`, the one
config every engine takes (the same class; its ``dense_iterations`` ``None`` is 0 here)."""

__all__ = [
    "SparseConfig",
    "SUPPORTED_VERSIONS",
    "BucketState",
    "ReductionSummary",
    "SpcclMegatronConfig",
    "SpcclMegatronState",
    "active_state",
    "check_version",
    "disable",
    "enable",
    "is_enabled",
]
