"""Route Megatron-core's bucket-group gradient reductions through SpCCL.

Megatron-core's ``DistributedDataParallel`` reduces gradients per bucket group in
``_ParamAndGradBucketGroup.start_grad_sync``: scale each bucket, then, inside
``torch.distributed._coalescing_manager``, ``torch.distributed.all_reduce`` every bucket (or
``dist_reduce_scatter_func`` it into this rank's shard when the distributed optimizer is used),
and keep the coalesced handle in ``grad_reduce_handle`` when ``overlap_grad_reduce`` is on, for
``finish_grad_sync`` to ``wait()`` on. :func:`enable` replaces that method with one that runs
Megatron's own code (so its scaling, checks, first-batch and overlap bookkeeping, and what
later versions add around the collectives, all stay as they are) with exactly those three
names pointed at SpCCL: the copy of the method resolves them in a private copy of its module's
namespace (taken when :func:`enable` first runs), so ``torch.distributed`` itself is never modified. Each bucket is then pruned with
error feedback and reduced by :func:`spccl_train.all_reduce` or
:func:`spccl_train.reduce_scatter_tensor`; the bucket group's handle waits for all of them.

Buckets in a group are reduced one call after another (a sparse call plans each message from
exchanged counts, so calls cannot be deferred into one coalesced launch); a group holds one
bucket unless Megatron mixes FP8 and other parameters.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import re
import sys
import threading
import types
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..sparse_config import SparseConfig
from .state import SpcclMegatronState

__all__ = ["SUPPORTED_VERSIONS", "active_state", "check_version", "disable", "enable", "is_enabled"]

SUPPORTED_VERSIONS = ((0, 16), (0, 19))
"""Oldest and newest megatron-core ``(major, minor)`` release series the integration is tested with."""

_INSTALL = "pip install 'megatron-core>=0.16,<0.20'"
# Names start_grad_sync looks up at call time that the patch points at SpCCL.
_REDIRECTED = ("_coalescing_manager", "dist_reduce_scatter_func", "torch")

_log = logging.getLogger(__name__)
_local = threading.local()
_lock = threading.Lock()
_active: SpcclMegatronState | None = None


def enable(config: SparseConfig | None = None, **fields) -> SpcclMegatronState:
    """Send Megatron-core's data-parallel gradient reductions through SpCCL; return the state.

    Call it before building the model, on every rank, with an equal config. Idempotent: the
    patch is installed once (Megatron's method stays in ``__wrapped__``); calling again with no
    config, or an equal one, returns the active state, and a different config replaces it
    (fresh error buffers and statistics).

    Args:
        config: a :class:`~spccl_train.sparse_config.SparseConfig`; or leave it out and pass its
            fields as keywords.

    Returns:
        The active :class:`SpcclMegatronState` (error buffers, ``summary()``).

    Raises:
        ImportError: megatron-core is not installed.
        RuntimeError: the installed megatron-core is outside :data:`SUPPORTED_VERSIONS`.

    Example::

        >>> state = spccl_train.megatron.enable(pruning={"density": 0.01}, collective={"format": "pici"})
        >>> model = DistributedDataParallel(transformer_config, ddp_config, gpt_model)
        >>> ...train...
        >>> print(state.summary())
    """
    global _active
    if config is not None and fields:
        raise TypeError("pass either a SparseConfig or its fields as keywords, not both")
    if config is None and fields:
        config = SparseConfig(**fields)
    group_class = _bucket_group_class()
    with _lock:
        current = group_class.__dict__["start_grad_sync"]
        if not getattr(current, "_spccl_patch", False):
            _check_patchable(current)
            group_class.start_grad_sync = _patched(current)
        if _active is not None and (config is None or config == _active.config):
            return _active
        if _active is not None:
            _log.info("spccl_train.megatron: replacing the active config (error buffers restart from zero)")
        _active = SpcclMegatronState(config)
        return _active


def disable() -> SpcclMegatronState | None:
    """Restore Megatron's own gradient reduction; return the state that was active (or ``None``)."""
    global _active
    with _lock:
        state, _active = _active, None
        module = _loaded_buffer_module()
        if module is not None:
            group_class = module._ParamAndGradBucketGroup
            current = group_class.__dict__["start_grad_sync"]
            if getattr(current, "_spccl_patch", False):
                group_class.start_grad_sync = current.__wrapped__
        return state


def is_enabled() -> bool:
    """True while :func:`enable` is in force."""
    return _active is not None


def active_state() -> SpcclMegatronState | None:
    """The state reductions go through now (``None`` when disabled)."""
    return _active


# ----------------------------------------------------------------------------- Megatron, lazily


def _bucket_group_class() -> type:
    try:
        import megatron.core as megatron_core
    except ImportError as exc:
        raise ImportError(f"spccl_train.megatron needs megatron-core: {_INSTALL}") from exc
    check_version(getattr(megatron_core, "__version__", "unknown"))
    from megatron.core.distributed import param_and_grad_buffer

    return param_and_grad_buffer._ParamAndGradBucketGroup


def _loaded_buffer_module() -> types.ModuleType | None:
    # disable() must not import Megatron (slow, maybe absent) just to find nothing patched.
    if "megatron.core.distributed.param_and_grad_buffer" not in sys.modules:
        return None
    return importlib.import_module("megatron.core.distributed.param_and_grad_buffer")


def check_version(version: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` (megatron-core's) is in :data:`SUPPORTED_VERSIONS`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = SUPPORTED_VERSIONS
    if match is None or not low <= (int(match[1]), int(match[2])) <= high:
        raise RuntimeError(
            f"spccl_train.megatron supports megatron-core {low[0]}.{low[1]} to {high[0]}.{high[1]}, "
            f"found {version!r}: install a supported release ({_INSTALL})"
        )


def _check_patchable(method: Callable) -> None:
    code = getattr(method, "__code__", None)
    needed = {"_coalescing_manager", "dist_reduce_scatter_func", "torch", "distributed", "all_reduce"}
    missing = needed - set(code.co_names) if code is not None else needed
    missing |= {name for name in _REDIRECTED if name not in getattr(method, "__globals__", {})}
    if missing:
        raise RuntimeError(
            "spccl_train.megatron: this megatron-core's _ParamAndGradBucketGroup.start_grad_sync does not "
            f"reduce through {sorted(missing)} as 0.16-0.19 do; install a supported release ({_INSTALL})"
        )


# ----------------------------------------------------------------------------- the patch


def _patched(original: Callable) -> Callable:
    redirected = _with_names(
        original,
        {
            "_coalescing_manager": _coalescing_manager,
            "dist_reduce_scatter_func": _reduce_scatter,
            "torch": _ModuleView(
                original.__globals__["torch"],
                distributed=_ModuleView(original.__globals__["torch"].distributed, all_reduce=_all_reduce),
            ),
        },
    )

    @functools.wraps(original)
    def start_grad_sync(self, *args, **kwargs):
        state = _active
        if state is None:
            return original(self, *args, **kwargs)
        _check_ddp_config(self.ddp_config)
        outer = getattr(_local, "call", None)
        _local.call = _Call(state, self)
        try:
            return redirected(self, *args, **kwargs)
        finally:
            _local.call = outer

    start_grad_sync._spccl_patch = True
    return start_grad_sync


def _with_names(fn: types.FunctionType, replaced: dict[str, object]) -> types.FunctionType:
    """A copy of ``fn`` that looks its globals up in a copy of its namespace with ``replaced`` applied."""
    namespace = dict(fn.__globals__)
    namespace.update(replaced)
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


class _ModuleView:
    """``module`` with some attributes replaced; every other attribute is ``module``'s own."""

    def __init__(self, module: object, **replaced: object) -> None:
        self.__dict__.update(replaced)
        self._module = module

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)


def _check_ddp_config(ddp_config: object) -> None:
    if getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1:
        raise ValueError(
            f"num_distributed_optimizer_instances={ddp_config.num_distributed_optimizer_instances} is not supported "
            "by spccl_train.megatron; set it to 1 (one distributed-optimizer instance over the data-parallel group)"
        )
    if getattr(ddp_config, "reduce_scatter_with_fp32_accumulation", False):
        raise ValueError(
            "reduce_scatter_with_fp32_accumulation=True is not supported by spccl_train.megatron (SpCCL sums in the "
            "gradient dtype); set it to False, and grad_reduce_in_fp32=True for fp32 sums"
        )


class _GroupWork:
    """The handle of one bucket group's reductions: ``wait()`` waits for each bucket's."""

    __slots__ = ("works",)

    def __init__(self) -> None:
        self.works: list = []

    def wait(self, timeout: float | None = None) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class _Call:
    """One start_grad_sync call in progress on this thread: its state, bucket group, open coalescings."""

    __slots__ = ("coalescing", "group", "state")

    def __init__(self, state: SpcclMegatronState, group: object) -> None:
        self.state = state
        self.group = group
        self.coalescing: list[_GroupWork] = []

    def bucket_of(self, tensor: torch.Tensor) -> object:
        for bucket in self.group.buckets:
            if bucket.grad_data is tensor:
                return bucket
        for bucket in self.group.buckets:
            data = bucket.grad_data
            if data.data_ptr() == tensor.data_ptr() and data.numel() == tensor.numel() and data.dtype == tensor.dtype:
                return bucket
        raise RuntimeError(
            "spccl_train.megatron: Megatron reduced a tensor that is no bucket's grad_data; "
            f"this megatron-core is not supported ({_INSTALL})"
        )

    def issued(self, work, async_op: bool):
        """Hand ``work`` to the open coalescing (or wait for it if synchronous); return what torch would."""
        if self.coalescing:
            self.coalescing[-1].works.append(work)
        elif not async_op:
            work.wait()
        return work if async_op else None


def _current_call() -> _Call:
    call = getattr(_local, "call", None)
    if call is None:
        raise RuntimeError("spccl_train.megatron: a redirected collective ran outside start_grad_sync")
    return call


@contextlib.contextmanager
def _coalescing_manager(group=None, device=None, async_ops: bool = False):
    """Stands in for ``torch.distributed._coalescing_manager``: collects the buckets' works."""
    call = _current_call()
    handle = _GroupWork()
    call.coalescing.append(handle)
    try:
        yield handle
    finally:
        call.coalescing.pop()
    if not async_ops:
        handle.wait()


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """Stands in for ``torch.distributed.all_reduce`` of a bucket's ``grad_data``."""
    call = _current_call()
    with torch.no_grad():
        work = call.state.reduce(call.bucket_of(tensor), tensor, None, op, group)
    return call.issued(work, async_op)


def _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """Stands in for Megatron's ``dist_reduce_scatter_func`` of a bucket's ``grad_data`` into its shard."""
    call = _current_call()
    with torch.no_grad():
        work = call.state.reduce(call.bucket_of(input), input, output, op, group)
    return call.issued(work, async_op)
