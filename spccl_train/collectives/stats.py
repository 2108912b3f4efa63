"""What a collective call reports: :class:`CollectiveStats`, and the handle of an asynchronous
call, :class:`CollectiveWork`."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .._timing import Span
from ..formats import Format
from ._wire import StatusSink
from .plan import Plan

__all__ = ["CollectiveStats", "CollectiveWork", "candidate_name"]


def candidate_name(algorithm: str, fmt: Format) -> str:
    """A candidate's name as ``auto`` weighs and reports it: ``"ring/pici"``, ``"native/dense"``;
    ``"hierarchical"`` alone (its steps choose their formats)."""
    return algorithm if algorithm == "hierarchical" else f"{algorithm}/{fmt.value}"


@dataclasses.dataclass(slots=True)
class CollectiveStats:
    """What one call did: the plan it ran, what the cost model predicted, and what it sent."""

    collective: str
    """``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``."""
    algorithm: str
    """``"ring"``, ``"direct"``, ``"native"`` (the dense torch.distributed call), ``"hierarchical"``
    (three flat calls on node subgroups, summed here: ``plan`` is ``None``) or ``"local"`` (world size 1)."""
    format: Format
    """The format the plan allowed (``DENSE`` for native and dense plans)."""
    plan: Plan | None
    """The plan that ran (``None`` for native and local calls)."""
    predicted_s: float
    """The cost model's prediction for the chosen candidate, exchanges included (made for the
    call's sparsity profile as :func:`~.choice.decide` rounds it); for the native call of a
    config that holds native calls (:meth:`~.config.CollectiveConfig.holds_native`), NCCL's call
    alone, as the shape's held calls take it."""
    candidates: dict[str, float]
    """Every candidate the cost model weighed (``"ring/pici"``, ``"native/dense"``, ...) and its prediction."""
    exchanges: int
    """Planning exchanges (host synchronisations) the call made."""
    gather_counts: str
    """All-reduce: how its gather phase was sized, ``"bound"`` (from the first exchange) or
    ``"measured"`` (a second exchange); ``""`` for other collectives and native calls."""
    bytes_sent: int
    """Bytes this rank put on the wire."""
    dense_bytes: int
    """Bytes this rank would have sent with a dense ring."""
    graph: str
    """``CollectiveConfig.cuda_graphs``: ``"captured"`` (this call was captured, then replayed),
    ``"replayed"`` (it replayed an earlier capture), or ``""`` (it ran eagerly)."""
    _statuses: torch.Tensor | None
    _timer: Span
    steps: tuple[CollectiveStats, ...] = ()
    """A hierarchical call's steps, in order (the all-reduce: inside the node, across nodes, inside
    the node); empty for flat calls. The step across nodes says what crossed the network."""
    exchange: str = ""
    """How the call's counts were exchanged: ``"table"`` or ``"scalable"`` (:func:`.exchange.protocol`);
    ``""`` when nothing was (a call with bounds, a local call)."""
    exchange_bytes: int = 0
    """Bytes this rank received in the call's count exchanges (a hierarchical call: its steps' too)."""
    trial: bool = False
    """``auto`` ran this candidate to try it at this density, in place of its choice, with which it
    is near-tied (:data:`~.choice.TRIAL_MARGIN`)."""
    planned_from: np.ndarray | None = None
    """The count table the plan was sized from, when not the call's exact counts: the caller's
    bounds, or the exchanged counts with headroom, reused while later counts fit them
    (:mod:`.reuse`). Row ``q``: rank ``q``'s ``world * channels`` piece bounds. ``None``: the plan
    is from exact counts, or there is none (native)."""

    @property
    def candidate(self) -> str:
        """The candidate that ran, named as ``auto`` weighs it: ``"direct/coo"``, ``"native/dense"``, ``"hierarchical"``."""
        return candidate_name(self.algorithm, self.format)

    @property
    def decode_status(self) -> torch.Tensor | None:
        """OR of every decoder status on this rank, a one-element int32 tensor on the device (0: all
        payloads were intact); ``None`` for local calls. Folded when read, off the hot path."""
        return None if self._statuses is None else StatusSink.fold(self._statuses)

    @property
    def decode_failed(self) -> torch.Tensor | None:
        """Whether any decoder of this rank reported a bad payload: a 0-dim bool tensor on the
        device, made without a synchronisation (two small kernels); ``None`` for local calls."""
        return None if self._statuses is None else (self._statuses != 0).any()

    @property
    def elapsed_s(self) -> float:
        """Measured seconds from the call to the end of its work (on CUDA this waits for the work)."""
        return self._timer.seconds()


class CollectiveWork:
    """The handle an ``async_op=True`` call returns, like ``torch.distributed.Work``.

    On CPU the work is complete when the call returns. On CUDA every kernel and transfer is
    enqueued when the call returns (after the planning synchronisation): :meth:`wait` makes the
    current stream wait for them without blocking the host, and the future follows torch's
    CUDA-aware future semantics.
    """

    __slots__ = ("_tensors", "_stats", "_event", "_future")

    def __init__(self, tensors: list[torch.Tensor], stats: CollectiveStats, event: torch.cuda.Event | None) -> None:
        self._tensors = tensors
        self._stats = stats
        self._event = event
        devices = [t.device for t in tensors if t.device.type == "cuda"]
        self._future: torch.futures.Future = torch.futures.Future(devices=devices or None)
        self._future.set_result(tensors)

    def wait(self, timeout: float | None = None) -> bool:
        """Order the current stream after the collective (on CPU it is done already); return True."""
        if self._event is not None:
            torch.cuda.current_stream(self._tensors[0].device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        """True once the device finished the work."""
        return True if self._event is None else self._event.query()

    def get_future(self) -> torch.futures.Future:
        """A future whose value is ``[output tensor]``, complete when the collective is."""
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The output tensor, in a list (as ``torch.distributed.Work.result``)."""
        return self._tensors

    @property
    def stats(self) -> CollectiveStats:
        """What the call did (plan, prediction, bytes)."""
        return self._stats


def dense_ring_bytes(collective: str, numel: int, world: int, element_size: int) -> int:
    """Bytes one rank sends in a dense ring of ``numel`` elements (the chunked tensor): ``world - 1``
    chunks per phase, two phases for an all-reduce; the baseline of ``CollectiveStats.dense_bytes``."""
    return (world - 1) * (numel // world) * element_size * (2 if collective == "all_reduce" else 1)


def add_statuses(stats: CollectiveStats, sink: StatusSink) -> None:
    """Add the decoder statuses of ``sink`` to a call's stats."""
    extra = sink.collect()
    stats._statuses = extra if stats._statuses is None else torch.cat([extra, stats._statuses])
