"""DDP communication hook: prune each gradient bucket with error feedback, all-reduce it sparsely.

Example::

    >>> model = DDP(model, bucket_cap_mb=spccl_train.ddp.RECOMMENDED_BUCKET_CAP_MB)
    >>> state = spccl_train.ddp.SparseHookState(config=SparseConfig(pruning={"density": 0.01}))
    >>> model.register_comm_hook(state, spccl_train.ddp.sparse_allreduce_hook)
    >>> ...train...
    >>> print(state.summary())

The module avoids ``from __future__ import annotations``: DDP checks the hook's annotations
at run time (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``) and rejects strings.

Bucket size: a sparse collective pays one planning exchange (a host synchronisation, tens of
microseconds) per call and gains from volume, so large buckets win. DDP's default of 25 MB
suits dense NCCL; with SpCCL use ``bucket_cap_mb=256`` (:data:`RECOMMENDED_BUCKET_CAP_MB`),
fewer if you need more overlap of communication with the backward pass.

Import this module before ``init_process_group``. DDP imports ``torch.distributed.nn.functional``
on first use, and that module binds the default group as a default argument. If it is first
imported after the group exists, ``destroy_process_group`` cannot free the group. Gloo's worker
threads then live into interpreter shutdown, where they can abort the process ("terminate called
without an active exception"). Importing this module imports that one first, so the binding
happens while there is no group.
"""

import queue
import threading
import weakref

import torch
import torch.distributed as dist
import torch.distributed.nn.functional

from ._timing import Span
from .collectives import CollectiveConfig
from .pruning import Pruner, PruneResult
from .reducer import BucketReducer, BucketState, ReductionSummary
from .sparse_config import SparseConfig

__all__ = [
    "RECOMMENDED_BUCKET_CAP_MB",
    "DenseHookState",
    "ReductionSummary",
    "SparseConfig",
    "SparseHookState",
    "dense_allreduce_hook",
    "sparse_allreduce_hook",
]

RECOMMENDED_BUCKET_CAP_MB = 256
"""DDP bucket size for sparse all-reduce: large messages amortise the per-call planning exchange."""


class SparseHookState:
    """State of :func:`sparse_allreduce_hook`: configuration, per-bucket error buffers, statistics.

    Args:
        process_group: the group to reduce over (``None``: the default group). Not pickled.
        config: the :class:`~spccl_train.sparse_config.SparseConfig` (or a mapping of its fields):
            ``pruning`` (density, sampling, error-feedback decay, error dtype, seed, density
            warm-up), ``collective`` (format, algorithm, thresholds, topology, channels, CUDA
            graphs), ``capacity_factor``, ``prune_to_wire`` and ``dense_iterations`` (``None``:
            1; DDP rebuilds its buckets after the first iteration, and error buffers are kept per
            bucket, so at least 1). Iteration ``i`` prunes to
            ``pruning.density_at(i - dense_iterations)``: the warm-up counts from the first sparse
            iteration. Default: prune to 1%, ``auto`` format and algorithm.
        overlap: where pruning and the sparse all-reduce run. ``False``: on the hook's thread
            and the current stream, in line with the backward pass. ``"stream"``: on the hook's
            thread, pruning, counting and the planning exchange on one side CUDA stream and the
            transfers and codecs on another, both waiting only for the bucket, so the
            collective's kernels run beside the rest of the backward pass instead of in line
            with it (the planning synchronisation still waits for the bucket's pruning). ``True``: on a background
            thread and side stream, so the synchronisation blocks neither the backward pass
            nor the host thread launching it. ``None``: ``True`` for CUDA buckets. On CPU every
            mode but ``True`` runs in line. Off by default; ``examples/gpt2_xl`` has the 4 H200
            measurements of each (the thread competes with the backward pass for the
            interpreter lock).
        planning_group: ``overlap="stream"`` only: a group of the same ranks as ``process_group``
            on which the planning exchanges run, so that planning a bucket does not wait for the
            previous bucket's transfers (NCCL runs one group's operations in order). ``None``:
            made over the world on first use when reducing over the world; with another
            ``process_group`` pass one (made on every rank of the world), else the exchanges
            share ``process_group``. Not pickled.
    """

    __slots__ = (
        "process_group",
        "reducer",  # prune, cap, bound, reduce, count: shared with the Megatron integration
        "dense_iterations",
        "overlap",
        "iteration",
        "buckets",  # bucket index -> BucketState (error buffer, last pruning, validation)
        "_reducer",
        "_streams",
        "planning_group",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        config: SparseConfig | None = None,
        *,
        overlap: bool | str | None = False,
        planning_group: dist.ProcessGroup | None = None,
    ) -> None:
        config = SparseConfig.of(config)
        dense_iterations = config.dense_iterations_or(1)
        if dense_iterations < 1:
            raise ValueError(
                f"dense_iterations={dense_iterations}: DDP rebuilds its buckets after the first iteration, "
                "so reduce at least 1 iteration densely"
            )
        self.process_group = process_group
        self.reducer = BucketReducer(config, "ddp")
        self.dense_iterations = dense_iterations
        if overlap not in (True, False, None, "stream"):
            raise ValueError(f"overlap={overlap!r} must be False, True, None (True on CUDA) or 'stream'")
        self.overlap = overlap
        self._reducer: _Reducer | None = None
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self.planning_group = planning_group
        self.iteration = 0
        self.buckets: dict[int, BucketState] = {}

    @property
    def config(self) -> SparseConfig:
        """The settings this state was made with."""
        return self.reducer.settings

    @property
    def pruner(self) -> Pruner:
        """The pruner (its config: density, warm-up, sampling, error feedback)."""
        return self.reducer.pruner

    @property
    def prune(self) -> bool:
        """Whether buckets are pruned before their sparse all-reduce."""
        return self.reducer.prune

    @property
    def collective_config(self) -> CollectiveConfig:
        """The sparse all-reduce's config."""
        return self.reducer.config

    @property
    def capacity_factor(self) -> float | None:
        """The per-piece cap factor (``None``: every all-reduce plans from exchanged counts)."""
        return self.reducer.capacity_factor

    @property
    def error_buffers(self) -> dict[int, torch.Tensor]:
        """Each bucket's error buffer, by bucket index."""
        return {i: b.error for i, b in self.buckets.items() if b.error is not None}

    @property
    def last_prune(self) -> dict[int, PruneResult]:
        """Each bucket's latest pruning pass (threshold, kept), by bucket index."""
        return {i: b.last_prune for i, b in self.buckets.items() if b.last_prune is not None}

    def bucket(self, index: int) -> BucketState:
        """Bucket ``index``'s state (made on first use)."""
        state = self.buckets.get(index)
        if state is None:
            state = self.buckets[index] = BucketState(index=index)
        return state

    def reset_stats(self) -> None:
        """Zero the statistics (not the error buffers)."""
        self.reducer.reset_stats()

    def summary(self) -> ReductionSummary:
        """Totals so far (the dense warm-up's reductions counted too). Reads device timers and
        counters: call it off the hot path."""
        return self.reducer.summary()

    def decode_failures(self) -> int:
        """Sparse all-reduces whose decoders reported a bad payload (reads device statuses: off the hot path).

        With ``capacity_factor`` the bounds hold by construction, so anything but 0 is a bug to report.
        """
        return self.reducer.summary().decode_failures

    def in_line(self, on_cuda: bool) -> bool:
        """Whether :func:`sparse_allreduce_hook` prunes and reduces a bucket on the calling
        thread and stream, so that the backward pass waits for it: ``overlap`` ``False``, or
        ``"stream"`` on CPU (no side stream there); not on a side stream or background thread."""
        overlap = self.overlap if self.overlap is not None else on_cuda
        return not overlap or (overlap == "stream" and not on_cuda)

    def waits_for_pruning(self, on_cuda: bool) -> bool:
        """Whether the hook's caller (the backward pass) waits for the pruning: in line
        (:meth:`in_line`), or ``"stream"`` on CUDA planning from exchanged counts (no
        ``capacity_factor``): the planning exchange waits on the host for the side stream's
        pruning and count before the hook returns."""
        if self.in_line(on_cuda):
            return True
        return on_cuda and self.overlap == "stream" and self.capacity_factor is None

    def bounded(self, index: int, numel: int) -> bool:
        """True when bucket ``index`` of ``numel`` elements is all-reduced from bounds (no host synchronisation)."""
        return self.reducer.bounded(self.bucket(index), numel)

    def _side_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """``(planning, data)`` streams of ``overlap="stream"``, made once."""
        if self._streams is None or self._streams[0].device != device:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams

    def _planning_group_for(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """The group planning exchanges run on: ``planning_group``, or one made once over the world."""
        if self.planning_group is None:
            if group is not dist.group.WORLD:
                return group  # a new group needs every rank of the world: the caller must pass one
            self.planning_group = dist.new_group()
        return self.planning_group

    def error_buffer(self, index: int, bucket_buffer: torch.Tensor) -> torch.Tensor:
        """The error buffer of bucket ``index`` (made, or remade if the bucket changed shape)."""
        return self.reducer.error_buffer(self.bucket(index), bucket_buffer)

    def __getstate__(self) -> dict:
        return {
            slot: getattr(self, slot)
            for slot in self.__slots__
            if slot not in ("process_group", "_reducer", "_streams", "planning_group")
        }

    def __setstate__(self, state: dict) -> None:
        self.process_group = None
        self._reducer = None
        self._streams = None
        self.planning_group = None
        for slot, value in state.items():
            setattr(self, slot, value)


class _Reducer:
    """One background thread (and, on CUDA, one side stream) that runs bucket reductions in order.

    Buckets are reduced in the order DDP hands them over, on every rank, so the collectives
    pair up across ranks. The thread owns the host synchronisations of the sparse collectives'
    planning; the backward pass goes on launching kernels meanwhile.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        # The thread holds the queue and stream, not this object: when the hook state drops its
        # reducer, the finaliser's None stops the thread, which lets go of the group and buffers.
        self.thread = threading.Thread(
            target=_reducer_loop, args=(self.jobs, self.device, self.stream), name="spccl-ddp-reducer", daemon=True
        )
        self.thread.start()
        weakref.finalize(self, self.jobs.put, None)

    def submit(self, job, ready: torch.cuda.Event | None) -> torch.futures.Future:
        future = torch.futures.Future(devices=[self.device] if self.stream is not None else None)
        self.jobs.put((job, ready, future))
        return future


def _reducer_loop(jobs: queue.SimpleQueue, device: torch.device, stream: torch.cuda.Stream | None) -> None:
    while (item := jobs.get()) is not None:
        job, ready, future = item
        item = None
        try:
            if stream is None:
                result = job()
                # Let go of the job before DDP can go on: its closure holds the group, which must be
                # free by the time the caller destroys it.
                job = None
                future.set_result(result)
            else:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    stream.wait_event(ready)  # the bucket's gradients are complete
                    result = job()
                    job = ready = None
                    future.set_result(result)  # records an event on the side stream for DDP to wait on
        except BaseException as exc:  # noqa: BLE001 - handed to DDP, which raises it on its thread
            job = ready = None
            future.set_exception(exc)
        # Keep nothing while waiting for the next job.
        result = future = None


def _reduce_sparse(
    state: SparseHookState,
    buffer: torch.Tensor,
    index: int,
    iteration: int,
    group: dist.ProcessGroup,
    world: int,
    planning_group: dist.ProcessGroup | None = None,
    planning_stream: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    work = state.reducer.reduce(
        state.bucket(index),
        buffer,
        group=group,
        world=world,
        step=iteration,
        schedule_step=iteration - state.dense_iterations,  # the warm-up counts from the first sparse iteration
        planning_group=planning_group,
        planning_stream=planning_stream,
    )
    work.wait()
    return buffer.div_(world)


def sparse_allreduce_hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Prune ``bucket`` with error feedback, sum it over the group with SpCCL, and average it.

    The first ``state.dense_iterations`` iterations use a dense ``torch.distributed.all_reduce``.

    Returns:
        A future holding the averaged bucket buffer, as DDP expects.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    iteration = state.iteration
    dense = iteration < state.dense_iterations
    if bucket.is_last():
        state.iteration += 1
    if dense:
        state.reducer.count_dense()
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        return future.then(lambda fut: fut.value()[0].div_(world))
    index = bucket.index()
    if state.overlap == "stream" and buffer.is_cuda:
        return _reduce_on_side_stream(state, buffer, index, iteration, group, world)
    if state.in_line(buffer.is_cuda):
        future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        future.set_result(_reduce_sparse(state, buffer, index, iteration, group, world))
        return future
    if state._reducer is None:
        state._reducer = _Reducer(buffer.device)
    ready = None
    if buffer.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return state._reducer.submit(lambda: _reduce_sparse(state, buffer, index, iteration, group, world), ready)


def _reduce_on_side_stream(
    state: SparseHookState, buffer: torch.Tensor, index: int, iteration: int, group: dist.ProcessGroup, world: int
) -> torch.futures.Future:
    """Prune, count and plan on one side stream, transfer and decode on another; DDP's wait orders the result.

    Both streams wait only for the bucket; the planning exchange runs on a second process group
    of the same ranks, so planning bucket ``k + 1`` (a host synchronisation) waits neither for
    the backward pass after it nor for bucket ``k``'s transfers. A bucket reduced from bounds
    (``capacity_factor``) has nothing to plan and runs wholly on the data stream.
    """
    planning, data = state._side_streams(buffer.device)
    ready = torch.cuda.Event()
    ready.record()  # the bucket's gradients are complete on the current stream
    planning.wait_event(ready)
    data.wait_event(ready)
    future = torch.futures.Future(devices=[buffer.device])
    with torch.cuda.stream(data):
        result = _reduce_sparse(
            state, buffer, index, iteration, group, world, state._planning_group_for(group), planning
        )
        future.set_result(result)  # records an event on the data stream for DDP to wait on
    return future


class DenseHookState:
    """State of :func:`dense_allreduce_hook`: DDP's own dense all-reduce, timed like the sparse hook.

    It is the baseline of a dense-vs-SpCCL comparison: the same statistics (:class:`ReductionSummary`,
    with ``bytes_sent`` those of a dense ring) from the same timers.
    """

    __slots__ = ("_calls", "_dense_bytes", "_elements", "_spans", "iteration", "process_group")

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.iteration = 0
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the statistics."""
        self._calls = 0
        self._elements = 0
        self._dense_bytes = 0
        self._spans: list[Span] = []

    def summary(self) -> ReductionSummary:
        """Totals so far. Reads device timers: call it off the hot path."""
        return ReductionSummary(
            dense_reductions=self._calls,
            sparse_reductions=0,
            elements=self._elements,
            kept=self._elements,
            bytes_sent=self._dense_bytes,
            dense_bytes=self._dense_bytes,
            prune_seconds=0.0,
            reduce_seconds=sum(span.seconds() for span in self._spans),
            deferred=0,
            exchanges=0,
        )

    def __getstate__(self) -> dict:
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state: dict) -> None:
        self.process_group = None
        for slot, value in state.items():
            setattr(self, slot, value)


def dense_allreduce_hook(state: DenseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (sum, then average), timed from issue to completion."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    if bucket.is_last():
        state.iteration += 1
    span = Span(buffer.device)
    state._spans.append(span)
    state._calls += 1
    state._elements += buffer.numel()
    state._dense_bytes += 2 * (world - 1) * -(-buffer.numel() // world) * buffer.element_size()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        span.stop()  # the callback's stream is ordered after the all-reduce
        return fut.value()[0].div_(world)

    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(finish)
