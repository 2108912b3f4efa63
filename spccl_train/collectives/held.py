"""Calls that run the native collective without a count exchange (``check_calls="first"``).

After an exchange has checked a call shape on every rank, a call of that shape runs NCCL's own
collective with no exchange while the shape is held native (:class:`.state.NativeHolds`: its last
exchanged call chose native), or when no sparse candidate could win it whatever its data (unless
its last exchanged call chose a sparse one: then the exchange weighs it). The
first such call of a shape, on the full path (:func:`.api._run`), leaves a :class:`Route` in its
group's state; later calls take the short path from :func:`.api._call`: :func:`lookup`, the local
checks, :func:`run`. Both paths decide with :func:`held_now`, from inputs equal on every rank.
"""

from __future__ import annotations

import torch

from .._timing import Span
from ..formats import Format
from ..formats.layout import element_size
from ..transport import P2PTransport
from .choice import NATIVE_MARGIN
from .chunking import ChunkLayout
from .config import CollectiveConfig
from .context import corrections_of, model_of, ranks_per_node
from .exchange import Request, exchange_rounds, protocol
from .executors import native_collective
from .feedback import Corrections, factor_of, kind_of
from .state import state_of
from .stats import CollectiveStats, dense_ring_bytes
from .topology import Topology

__all__ = [
    "Route",
    "applies",
    "goes_native_unexchanged",
    "held_now",
    "lookup",
    "native_call",
    "remember_checked",
    "route_of",
    "run",
    "signature",
]


def applies(config: CollectiveConfig) -> bool:
    """Whether calls of ``config`` may run native without an exchange: ``check_calls="first"``, and
    ``auto`` may choose native (``format`` auto or dense, ``algorithm`` auto)."""
    return config.check_calls == "first" and config.algorithm == "auto" and config.format in ("auto", "dense")


def signature(request: Request) -> tuple[int, ...]:
    """A call's header without its ``observed`` time: what the count exchange compares across ranks."""
    return tuple(request.header()[:-1])


def remember_checked(transport: P2PTransport, request: Request) -> None:
    """Note that an exchange checked this call's signature on every rank (``check_calls="first"``)."""
    checked = state_of(transport).checked
    if len(checked) >= 1024:  # every rank adds and forgets alike; a forgotten shape is checked again
        checked.clear()
    checked.add(signature(request))


def goes_native_unexchanged(
    collective: str,
    config: CollectiveConfig,
    request: Request,
    layout: ChunkLayout | None,
    transport: P2PTransport,
    rpn: int | None,
) -> bool:
    """Whether this call runs the native collective without a count exchange: :func:`applies`, an
    exchange already checked this call's shape on every rank of the group, and :func:`held_now`.
    Every input is equal on every rank (the shape, the config, the model, its corrections and the
    holds), so every rank decides alike, as long as their calls have the same shape."""
    if not applies(config) or layout is None or request.problems:
        return False
    topology = Topology(transport.world, rpn)
    corrections = corrections_of(config, transport)
    return held_now(
        collective, config, signature(request), layout, request.dtype, request.device, transport, topology, corrections
    )


def held_now(
    collective: str,
    config: CollectiveConfig,
    signature: tuple[int, ...],
    layout: ChunkLayout,
    dtype: torch.dtype,
    device: torch.device,
    transport: P2PTransport,
    topology: Topology,
    corrections: Corrections | None,
    route: Route | None = None,
) -> bool:
    """For a call that may go native unexchanged (:func:`goes_native_unexchanged`): whether its
    shape was checked and it goes native now, because the shape is held native
    (:class:`.state.NativeHolds`: its last exchanged call chose native; this spends one
    call of the hold) or, unless its last exchanged call chose a sparse candidate (then it is
    weighed again by the exchange, which :func:`goes_native_unexchanged` would delay on every call
    of a shape that runs sparse), no sparse candidate can win: even its lower bound
    (:meth:`.cost.CostModel.least_sparse`, what any data would cost it at least), corrected by
    what the group learned (``corrections``: :func:`.context.corrections_of`), misses native's
    prediction by :data:`NATIVE_MARGIN`. A ``route`` keeps that last verdict while the group's
    corrections and the exchange protocol stay as they were."""
    state = state_of(transport)
    if signature not in state.checked:
        return False
    if config.format == "dense" or state.holds.take(signature):
        return True
    if state.holds.went_sparse(signature):
        return False
    rounds = exchange_rounds(protocol(transport.world), collective)
    made = (-1 if corrections is None else corrections.revision, rounds)
    if route is not None and route.verdict is not None and route.verdict[0] == made:
        return route.verdict[1]
    model = model_of(config, transport, topology, device).model  # made by the checked call already
    nbytes = layout.numel * element_size(dtype)
    factors = corrections.factors_for(collective, nbytes, dtype) if corrections is not None else None
    sparse_factor = min(
        factor_of(factors, name) for name in ("ring/pici", "ring/coo", "direct/pici", "direct/coo", "hierarchical")
    )
    local = corrections.least_local(collective, nbytes, dtype) if corrections is not None else None
    if local is not None:  # what a sparse candidate took at some density octave (no octave is weighed here)
        sparse_factor = min(sparse_factor, local)
    extra = (rounds - 1) * model.exchange_s  # what an exchange's further rounds would add to every candidate
    native = (model.predict_native(collective, layout.numel, dtype, topology) + extra) * factor_of(
        factors, "native/dense"
    )
    least = model.least_sparse(collective, layout.numel, dtype, topology, rounds) * sparse_factor
    verdict = least >= native * (1 - NATIVE_MARGIN)
    if route is not None:
        route.verdict = (made, verdict)
    return verdict


class Route:
    """What a call shape that went native without an exchange needs for its next such call, made
    once (:func:`route_of`)."""

    __slots__ = ("signature", "layout", "topology", "fingerprint", "predicted_s", "kind", "dense", "verdict")

    def __init__(
        self,
        signature: tuple[int, ...],
        layout: ChunkLayout,
        topology: Topology,
        fingerprint: str,
        predicted_s: float,
        kind: tuple[str, str, int, str],
        dense: int,
    ) -> None:
        self.signature = signature
        self.layout = layout
        self.topology = topology
        self.fingerprint = fingerprint
        self.predicted_s = predicted_s
        """The native call's prediction, without an exchange or corrections."""
        self.kind = kind
        """The native call's kind of correction (:func:`.feedback.kind_of`)."""
        self.dense = dense
        """The bytes a dense ring sends (the stats' ``bytes_sent`` and ``dense_bytes``)."""
        self.verdict: tuple[tuple[int, int], bool] | None = None
        """:func:`held_now`'s last verdict from the model: what it was made under (the
        corrections' revision, the exchange's rounds), and whether no sparse candidate could win."""


def route_key(collective: str, config: CollectiveConfig, rpn: int | None, inp, out) -> tuple:
    """What a call's signature depends on, read from its arguments without checking them (a key
    of its group's ``routes``; an all-reduce's ``out`` is its ``inp``)."""
    key = (collective, config.key(), rpn, inp.numel(), inp.dtype, inp.device)
    return key if out is inp else key + (out.numel(), out.dtype, out.device)


def route_of(
    collective: str,
    transport: P2PTransport,
    config: CollectiveConfig,
    rpn: int | None,
    fingerprint: str,
    request: Request,
    layout: ChunkLayout,
    inp: torch.Tensor,
    out: torch.Tensor,
) -> Route:
    """The route of a call that goes native unexchanged (made once per shape; remembered)."""
    routes = state_of(transport).routes
    key = route_key(collective, config, rpn, inp, out)
    route = routes.get(key)
    if route is None:
        if len(routes) >= 256:  # every rank forgets alike; a forgotten route is made again
            routes.clear()
        p = transport.world
        topology = Topology(p, rpn)
        model = model_of(config, transport, topology, inp.device).model
        route = routes[key] = Route(
            signature=signature(request),
            layout=layout,
            topology=topology,
            fingerprint=fingerprint,
            predicted_s=model.predict_native(collective, layout.numel, inp.dtype, topology, exchanges=0),
            kind=kind_of(collective, "native/dense", layout.numel * inp.element_size(), inp.dtype),
            dense=dense_ring_bytes(collective, layout.numel, p, inp.element_size()),
        )
    return route


def lookup(
    collective: str, transport: P2PTransport, config: CollectiveConfig, inp: torch.Tensor, out: torch.Tensor
) -> Route | None:
    """The route of this call's shape, if a call of it went native unexchanged on the full path
    (``None``: take the full path). The caller checks the tensors before :func:`run`."""
    if not applies(config):
        return None
    return state_of(transport).routes.get(route_key(collective, config, ranks_per_node(config, transport), inp, out))


def run(
    collective: str,
    transport: P2PTransport,
    config: CollectiveConfig,
    route: Route,
    inp: torch.Tensor,
    out: torch.Tensor,
    planning_stream: torch.cuda.Stream | None,
) -> tuple[CollectiveStats, torch.cuda.Event | None] | None:
    """The short path of a call of ``route``'s shape, its tensors checked: decided exactly as
    :func:`goes_native_unexchanged` decides, then :func:`native_call` (``None``: the call
    exchanges, on the full path). It skips the request, the layout, the model and topology
    look-ups, the native prediction and, while the group's corrections stand, the model's verdict."""
    corrections = corrections_of(config, transport)
    dtype, device = inp.dtype, inp.device
    if not held_now(
        collective, config, route.signature, route.layout, dtype, device, transport, route.topology, corrections, route
    ):
        return None
    if planning_stream is not None:  # the input is ready on the planning stream
        torch.cuda.current_stream(device).wait_stream(planning_stream)
    x, y = (inp, inp) if out is inp else (inp.view(-1), out.view(-1))  # an all-reduce is taken as it is
    return native_call(collective, transport, route, x, y, corrections, None if x.is_cuda else Span(device))


def native_call(
    collective: str,
    transport: P2PTransport,
    route: Route,
    x: torch.Tensor,
    y: torch.Tensor,
    corrections: Corrections | None,
    timer: Span | None,
) -> tuple[CollectiveStats, torch.cuda.Event | None]:
    """The native collective with no exchange (:func:`goes_native_unexchanged`), timed by ``timer``
    (started before the call), or, if ``None`` (CUDA), by a timer started once NCCL's call is
    launched, so that the host's time to record its start event is not spent before the launch
    (on NVLink that time adds to a call of about a millisecond). The call then runs on the
    group's own stream (``async_op``), after the work already on the current stream, and the
    start event, recorded on the current stream, fires when that work is done: where the current
    stream was busy the span is the one a start before the launch gives; where it was idle it
    leaves out the host's time from the launch to the record (tens of microseconds on an H100
    host, a few percent of a 256 MiB call over NVLink and inside the corrections' dead band,
    :data:`.feedback.FAR`)."""
    if timer is None:
        work = native_collective(collective, transport, x, y, async_op=True)
        timer = Span(x.device)
        work.wait()  # the current stream waits for the group's
    else:
        native_collective(collective, transport, x, y)
    event = timer.stop()
    predicted = route.predicted_s
    if corrections is not None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        corrections.ran(route.kind, predicted, timer, route.fingerprint)
        predicted *= corrections.own_factor(route.kind)
    stats = CollectiveStats(
        collective=collective,
        algorithm="native",
        format=Format.DENSE,
        plan=None,
        predicted_s=predicted,
        candidates={"native/dense": predicted},
        exchanges=0,
        gather_counts="",
        bytes_sent=route.dense,
        dense_bytes=route.dense,
        graph="",
        _statuses=None,
        _timer=timer,
    )
    return stats, event
