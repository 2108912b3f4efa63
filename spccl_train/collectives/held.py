"""Calls that run the native collective without a count exchange (``check_calls="first"``).

After an exchange has checked a call shape on every rank, a call of that shape runs NCCL's own
collective with no exchange while the shape is held native (:class:`.state.NativeHolds`: its last
exchanged call chose native), or when no sparse candidate could win it whatever its data (unless
its last exchanged call chose a sparse one: then the exchange weighs it). The
first such call of a shape, on the full path (:func:`.api._run`), leaves a :class:`Route` in its
group's state; later calls take the short path from :func:`.api._call`: :func:`lookup`, the local
checks, :func:`run`. Both paths decide alike (:func:`held_now`, :meth:`Route.held_now`), from
inputs equal on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._timing import Span
from ..formats import Format
from ..formats.layout import element_size
from ..transport import P2PTransport
from .choice import NATIVE_MARGIN
from .chunking import ChunkLayout
from .config import CollectiveConfig
from .context import corrections_of, model_of
from .cost import CostModel
from .exchange import Request, exchange_rounds, protocol
from .executors import native_collective
from .feedback import NATIVE, Corrections, factor_of, kind_of
from .state import GroupState, group_state, state_of
from .stats import CollectiveStats, dense_ring_bytes
from .topology import Topology

__all__ = [
    "Route",
    "goes_native_unexchanged",
    "held_now",
    "lookup",
    "native_call",
    "no_sparse_wins",
    "remember_checked",
    "route_of",
    "run",
    "signature",
]


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
    """Whether this call runs the native collective without a count exchange: the config holds
    native calls (:meth:`.config.CollectiveConfig.holds_native`), an exchange already checked
    this call's shape on every rank of the group, and :func:`held_now`. Every input is equal on
    every rank (the shape, the config, the model, its corrections and the holds), so every rank
    decides alike, as long as their calls have the same shape."""
    if not config.holds_native() or layout is None or request.problems:
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
) -> bool:
    """For a call that may go native unexchanged (:func:`goes_native_unexchanged`): whether its
    shape was checked and it goes native now (:func:`_by_holds`, else :func:`no_sparse_wins`).
    The short path decides alike from its :class:`Route` (:meth:`Route.held_now`)."""
    held = _by_holds(state_of(transport), config.format == "dense", signature)
    if held is not None:
        return held
    rounds = exchange_rounds(protocol(transport.world), collective)
    model = model_of(config, transport, topology, device).model  # made by the checked call already
    return no_sparse_wins(collective, model, topology, layout.numel, dtype, corrections, rounds)


def _by_holds(state: GroupState, dense: bool, signature: tuple[int, ...]) -> bool | None:
    """Whether a call of ``signature`` goes native unexchanged as far as its group's state says:
    not unless an exchange checked its shape; yes for a dense config, or while the shape is held
    native (:class:`.state.NativeHolds`: its last exchanged call chose native; this spends one
    call of the hold); not if its last exchanged call chose a sparse candidate (the exchange
    weighs it again: weighing it here would delay every call of a shape that runs sparse);
    ``None``: the model decides (:func:`no_sparse_wins`)."""
    if signature not in state.checked:
        return False
    if dense or state.holds.take(signature):
        return True
    if state.holds.went_sparse(signature):
        return False
    return None


def no_sparse_wins(
    collective: str,
    model: CostModel,
    topology: Topology,
    numel: int,
    dtype: torch.dtype,
    corrections: Corrections | None,
    rounds: int,
) -> bool:
    """Whether no sparse candidate can win a call whatever its data: even the candidates' lower
    bound (:meth:`.cost.CostModel.least_sparse`, what any data would cost them at least, with
    the exchange's ``rounds`` of host synchronisations), corrected by what the group learned
    (``corrections``: :func:`.context.corrections_of`), misses the prediction of a native call
    with no exchange (as :func:`.choice.weigh` prices it where calls hold native) by
    :data:`NATIVE_MARGIN`."""
    nbytes = numel * element_size(dtype)
    factors = corrections.factors_for(collective, nbytes, dtype) if corrections is not None else None
    sparse_factor = min(
        factor_of(factors, name) for name in ("ring/pici", "ring/coo", "direct/pici", "direct/coo", "hierarchical")
    )
    local = corrections.least_local(collective, nbytes, dtype) if corrections is not None else None
    if local is not None:  # what a sparse candidate took at some density octave (no octave is weighed here)
        sparse_factor = min(sparse_factor, local)
    native = model.predict_native(collective, numel, dtype, topology, exchanges=0) * factor_of(factors, NATIVE)
    least = model.least_sparse(collective, numel, dtype, topology, rounds) * sparse_factor
    return least >= native * (1 - NATIVE_MARGIN)


class Route:
    """What the later calls of a shape that went native unexchanged need, made once by the first
    such call (:func:`route_of`) so that theirs is a short path: on NVLink the host's time up to
    NCCL's launch is most of what such a call adds to NCCL's own (56-64 us of 88-97 us over NCCL's
    256 MiB call on 2 H100s at 831a008, when the short path still read the launch's environment
    and looked up the group's state, corrections and model on every call:
    bench/results/2026-11-27_twentysecond/). The group's state, corrections, model and exchange
    rounds are those of the route's first call: every rank makes its route at the same call,
    from the same inputs, and a re-measured model forgets every route
    (:func:`.links.forget_measured`)."""

    __slots__ = (
        "collective", "signature", "numel", "dtype", "topology", "state", "dense_config", "corrections", "model",
        "rounds", "fingerprint", "predicted_s", "kind", "dense", "verdict",
    )  # fmt: skip

    def __init__(
        self,
        collective: str,
        signature: tuple[int, ...],
        layout: ChunkLayout,
        dtype: torch.dtype,
        topology: Topology,
        state: GroupState,
        config: CollectiveConfig,
        corrections: Corrections | None,
        model: CostModel,
        rounds: int,
        fingerprint: str,
    ) -> None:
        self.collective = collective
        self.signature = signature
        self.numel = layout.numel
        self.dtype = dtype
        self.topology = topology
        self.state = state
        self.dense_config = config.format == "dense"
        self.corrections = corrections
        self.model = model
        self.rounds = rounds
        self.fingerprint = fingerprint
        self.predicted_s = model.predict_native(collective, layout.numel, dtype, topology, exchanges=0)
        """The native call's prediction, without an exchange or corrections."""
        self.kind = kind_of(collective, NATIVE, layout.numel * element_size(dtype), dtype)
        """The native call's kind of correction (:func:`.feedback.kind_of`)."""
        self.dense = dense_ring_bytes(collective, layout.numel, topology.world, element_size(dtype))
        """The bytes a dense ring sends (the stats' ``bytes_sent`` and ``dense_bytes``)."""
        self.verdict: tuple[int, bool] | None = None
        """:func:`no_sparse_wins`' last verdict, with the corrections' revision it was made under."""

    def held_now(self) -> bool:
        """:func:`held_now` for a call of this route: the model's verdict is weighed again only
        when the group's corrections have changed since the last."""
        held = _by_holds(self.state, self.dense_config, self.signature)
        if held is not None:
            return held
        revision = -1 if self.corrections is None else self.corrections.revision
        if self.verdict is None or self.verdict[0] != revision:
            wins = no_sparse_wins(
                self.collective, self.model, self.topology, self.numel, self.dtype, self.corrections, self.rounds
            )
            self.verdict = (revision, wins)
        return self.verdict[1]


def route_key(collective: str, config: CollectiveConfig, inp, out) -> tuple:
    """What a call's signature depends on, read from its arguments without checking them (a key
    of its group's ``routes``; an all-reduce's ``out`` is its ``inp``). The nodes the launch's
    environment gives (:func:`.context.ranks_per_node`, two variables read) are not in it: a route
    keeps those of its first call, as the running job's launch does."""
    key = (collective, config.key(), inp.numel(), inp.dtype, inp.device)
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
    state = state_of(transport)
    key = route_key(collective, config, inp, out)
    route = state.routes.get(key)
    if route is None:
        if len(state.routes) >= 256:  # every rank forgets alike; a forgotten route is made again
            state.routes.clear()
        topology = Topology(transport.world, rpn)
        route = state.routes[key] = Route(
            collective,
            signature(request),
            layout,
            inp.dtype,
            topology,
            state,
            config,
            corrections_of(config, transport),
            model_of(config, transport, topology, inp.device).model,
            exchange_rounds(protocol(transport.world), collective),
            fingerprint,
        )
    return route


def lookup(
    collective: str, group: dist.ProcessGroup | None, config: CollectiveConfig, inp: torch.Tensor, out: torch.Tensor
) -> Route | None:
    """The route of this call's shape, if a call of it went native unexchanged on the full path
    (``None``: take the full path, which checks the group). The caller validates the config first
    and checks the tensors before :func:`run`."""
    # (a config with cuda_graphs takes the full path, graphable or not: a graphed call replays)
    if not config.holds_native() or config.cuda_graphs:
        return None
    if group is not None and not dist.is_initialized():  # a group kept past its destruction
        return None
    return group_state(group).routes.get(route_key(collective, config, inp, out))


def run(
    route: Route,
    inp: torch.Tensor,
    out: torch.Tensor,
    planning_stream: torch.cuda.Stream | None,
) -> tuple[CollectiveStats, torch.cuda.Event | None] | None:
    """The short path of a call of ``route``'s shape, its tensors checked: decided as
    :func:`goes_native_unexchanged` decides (:meth:`Route.held_now`), then :func:`native_call`
    (``None``: the call exchanges, on the full path). It skips the transport, the request, the
    layout, the model, corrections and topology look-ups, the native prediction and, while the
    group's corrections stand, the model's verdict."""
    if not route.held_now():
        return None
    if planning_stream is not None:  # the input is ready on the planning stream
        torch.cuda.current_stream(inp.device).wait_stream(planning_stream)
    x, y = (inp, inp) if out is inp else (inp.view(-1), out.view(-1))  # an all-reduce is taken as it is
    timer = None if x.is_cuda else Span(x.device)
    return native_call(route.collective, route.state.transport, route, x, y, route.corrections, timer)


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
