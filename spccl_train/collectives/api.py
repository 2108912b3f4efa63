"""Exact sparse collectives with the signatures of ``torch.distributed``'s dense ones.

Each call: check the arguments locally; one planning exchange of every rank's call and per-piece
nonzero counts (the one host synchronisation; an all-reduce that measures its reduced chunks
adds a second before its gather phase, see ``CollectiveConfig.gather_counts``); pick the
algorithm and format (``auto``: the cost model, priced once per sparsity profile); plan from
the counts with headroom, reused by later calls whose counts fit (:mod:`.reuse`); run it. The
result equals the dense sum up to the order of floating-point additions, and positions that are
zero on every rank stay exactly zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from .._timing import Span
from ..formats import MAX_ELEMENTS, SUPPORTED_DTYPES, Format
from ..transport import P2PTransport
from . import held, hierarchical
from ._wire import StatusSink
from .choice import Candidate, decide, plan_candidate, priced
from .chunking import ChunkLayout, count_nonzero_pieces
from .config import CollectiveConfig
from .context import corrections_of, model_of, nodes_code, ranks_per_node, transport_of
from .cost import CostModel
from .encoded import EncodedPieces, decoded_first, take_encoded
from .exchange import (
    Counts,
    Problem,
    Request,
    check_bounds,
    check_local,
    check_table,
    config_code,
    exchange_bytes,
    exchange_counts,
    exchange_rounds,
    exchange_scalable,
    protocol,
)
from .executors import Execution, execute, gather_plan
from .feedback import Corrections, factor_of
from .graphs import bounds_from_counts, graph_key, run_graphed
from .hierarchical import check_hierarchy
from .plan import Plan
from .reuse import PlanStore, Reused, headroom, limits_of
from .state import Memo, state_of
from .stats import CollectiveStats, CollectiveWork, add_statuses, dense_ring_bytes
from .summary import CountSummary, table_octave
from .topology import Topology

__all__ = [
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "last_stats",
]

_log = logging.getLogger(__name__)
_local = threading.local()


def last_stats() -> CollectiveStats | None:
    """The :class:`CollectiveStats` of this thread's most recent call (``None`` before the first)."""
    return getattr(_local, "stats", None)


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    config: CollectiveConfig | None = None,
    *,
    planning_group: dist.ProcessGroup | None = None,
    planning_stream: torch.cuda.Stream | None = None,
    bounds: Sequence[Sequence[int]] | None = None,
    graph_tag: Hashable = None,
) -> CollectiveWork | None:
    """Gather every rank's ``input`` into ``output`` (rank ``q``'s at ``q * input.numel()``), sparsely.

    Args:
        output: contiguous, ``world_size * input.numel()`` elements of ``input``'s dtype, any shape
            (viewed flat). ``input`` may be this rank's slice of it (in place).
        input: contiguous float32 / bfloat16 / float16 tensor, any shape; never modified.
        group: the process group (default: the world).
        async_op: return a :class:`CollectiveWork` instead of ``None``.
        config: format, algorithm, thresholds, topology, channels; equal on every rank.
        planning_group: a group of the same ranks for the planning exchange (default: ``group``).
            NCCL runs one group's operations in order, so on ``group`` the exchange of this call
            waits for the transfers of the previous one; a second group lets it go ahead.
        planning_stream: CUDA only: the stream the count pass and planning exchange run on
            (default: the current stream). ``input`` must be ready on it; the transfers and
            codecs run on the current stream, after it. With ``planning_group`` this lets a
            caller plan call ``k + 1`` while call ``k``'s kernels are still queued.
        bounds: upper bounds on the nonzeros, in the layout of the count table the planning
            exchange would gather: ``bounds[q][c * channels + k]`` bounds piece ``k`` of chunk
            ``c`` as rank ``q`` holds it (an all-gather reads each row's first ``channels``:
            rank ``q``'s input). Given, the call skips counting and the planning exchange and
            plans from the bounds, with **no host synchronisation**; messages are sized for the
            bounds (an all-reduce sizes its gather phase from them too). The caller promises
            that every rank passes the same bounds and the same kind of call (nothing checks
            the ranks against each other; local argument errors still raise, on this rank),
            and that no piece holds more nonzeros than its bound. A piece that does is
            truncated by the CUDA encoders, its decoders report it in
            :attr:`CollectiveStats.decode_status`, and the result is wrong; the torch
            reference encoder (CPU) raises ``PayloadTooSmallError`` on that rank instead.
            :func:`spccl_train.pruning.cap_ranges` makes pruned gradients keep such bounds
            (the DDP hook's ``capacity_factor``).
        graph_tag: ``config.cuda_graphs`` only: names the call's CUDA graph, equal on every rank
            (any hashable). Calls with equal sizes, dtype, config and bounds share a graph unless
            their tags differ, so give calls on different tensors different tags (the DDP hook
            tags each bucket). A replayed call must pass the tensors it was captured with.

    Returns:
        A :class:`CollectiveWork` when ``async_op``, else ``None``.

    Example::

        >>> out = torch.empty(world * g.numel(), device=g.device)
        >>> spccl_train.all_gather_into_tensor(out, g, config=CollectiveConfig(format="pici"))
    """
    return _call(
        "all_gather", output, input, group, async_op, config, planning_group, planning_stream, bounds, graph_tag
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    config: CollectiveConfig | None = None,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    planning_group: dist.ProcessGroup | None = None,
    planning_stream: torch.cuda.Stream | None = None,
    bounds: Sequence[Sequence[int]] | None = None,
    graph_tag: Hashable = None,
) -> CollectiveWork | None:
    """Sum ``input`` over ranks and leave slice ``rank`` of the sum in ``output``, sparsely.

    Args:
        output: contiguous, ``input.numel() / world_size`` elements of ``input``'s dtype. It may be
            this rank's slice of ``input`` (in place).
        input: contiguous float32 / bfloat16 / float16 tensor; never modified (unless ``output``
            is its slice).
        group, async_op, config, planning_group, planning_stream, bounds, graph_tag: as for
            :func:`all_gather_into_tensor`.
        op: only ``ReduceOp.SUM``.

    Example::

        >>> shard = torch.empty(g.numel() // world, device=g.device)
        >>> spccl_train.reduce_scatter_tensor(shard, g)
    """
    _check_op(op, "reduce_scatter_tensor")
    return _call(
        "reduce_scatter", output, input, group, async_op, config, planning_group, planning_stream, bounds, graph_tag
    )


# torch 2.13's names for the two one-tensor collectives (torch.distributed.all_gather_single /
# reduce_scatter_single); the same functions, so code written for either torch reads the same here.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    config: CollectiveConfig | None = None,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    planning_group: dist.ProcessGroup | None = None,
    planning_stream: torch.cuda.Stream | None = None,
    bounds: Sequence[Sequence[int]] | None = None,
    graph_tag: Hashable = None,
    encoded: EncodedPieces | None = None,
) -> CollectiveWork | None:
    """Sum ``tensor`` over ranks, in place, sparsely.

    Args:
        tensor: contiguous float32 / bfloat16 / float16 tensor, any shape; holds the sum after.
        group, async_op, config, planning_group, planning_stream, bounds, graph_tag: as for
            :func:`all_gather_into_tensor`.
        op: only ``ReduceOp.SUM``.
        encoded: this rank's contribution already encoded, one Pici payload per piece of the
            call's layout (:class:`~.encoded.EncodedPieces`, e.g. from
            :meth:`spccl_train.pruning.Pruner.prune_to_wire`); then ``tensor``'s contents are not
            read, only overwritten with the sum. The direct algorithm counts nothing (the payloads
            carry their counts) and sends the payloads as they are (with ``bounds``, each message
            sized for its bound; under ``cuda_graphs`` a replay reads the payloads' buffer it was
            captured with); any other path (ring, native, hierarchical, a format without Pici)
            first decodes them into ``tensor``. The payloads must be ready on ``planning_stream``
            (or the current stream).

    Example::

        >>> spccl_train.all_reduce(grad, config=CollectiveConfig(format="pici", ranks_per_node=4))
    """
    _check_op(op, "all_reduce")
    return _call(
        "all_reduce",
        tensor,
        tensor,
        group,
        async_op,
        config,
        planning_group,
        planning_stream,
        bounds,
        graph_tag,
        encoded,
    )


_SUM = dist.ReduceOp.SUM


def _check_op(op: object, api: str) -> None:
    if op is not _SUM and op != _SUM:
        raise ValueError(
            f"spccl_train.{api} supports op=ReduceOp.SUM only, got {op!r}; use torch.distributed for others"
        )


def _call(
    collective: str,
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    async_op: bool,
    config: CollectiveConfig | None,
    planning_group: dist.ProcessGroup | None = None,
    planning_stream: torch.cuda.Stream | None = None,
    bounds: Sequence[Sequence[int]] | None = None,
    graph_tag: Hashable = None,
    encoded: EncodedPieces | None = None,
) -> CollectiveWork | None:
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if config is None:
        config = CollectiveConfig()
    elif not isinstance(config, CollectiveConfig):
        raise TypeError(f"config must be a CollectiveConfig or None, got {type(config).__name__}")
    config.validate()
    if planning_stream is not None and not isinstance(planning_stream, torch.cuda.Stream):
        raise TypeError(f"planning_stream must be a torch.cuda.Stream or None, got {type(planning_stream).__name__}")
    if planning_stream is not None and not input.is_cuda:
        planning_stream = None  # CPU work is ordered by the host
    # A call of a shape that went native unexchanged before: the short path, ahead of the rest (on
    # NVLink the host's time up to NCCL's launch is most of what it adds to NCCL's call).
    route = (
        held.lookup(collective, group, config, input, output)
        if bounds is None and encoded is None and planning_group is None
        else None
    )  # fmt: skip
    if route is not None and _fits(collective, input, output, route.state.transport):
        if input.requires_grad or output.requires_grad:  # it writes its output, as the full path does
            with torch.no_grad():
                ran = held.run(route, input, output, planning_stream)
        else:  # (entering no_grad costs a few microseconds, all of them before NCCL's launch)
            ran = held.run(route, input, output, planning_stream)
        if ran is not None:
            _local.stats = ran[0]
            return CollectiveWork([output], *ran) if async_op else None
    transport = transport_of(group)
    planner = transport if planning_group is None else transport_of(planning_group)
    if (planner.world, planner.rank) != (transport.world, transport.rank):
        raise ValueError(
            f"planning_group has {planner.world} ranks with this one as rank {planner.rank}, but group has "
            f"{transport.world} with it as rank {transport.rank}; pass a group of the same ranks in the same order"
        )
    if config.algorithm == "hierarchical":
        hierarchical.check_request(transport, config, bounds)
    graphed = _graphable(config, input, output, transport)
    with torch.no_grad():
        # ``misfit``: reported by the exchange, so that every rank raises; ``decoded``: the statuses
        # of decoding ``encoded`` into the input up front, for a call that will not send it
        encoded, misfit, decoded = take_encoded(encoded, collective, input, config, transport, planning_stream)
        exchanged = (
            graphed and bounds is None and not (collective == "all_reduce" and config.gather_counts == "measured")
        )
        fingerprint = config.fingerprint() + nodes_code(ranks_per_node(config, transport)) if graphed else ""
        if exchanged:  # plan from the exchanged counts, rounded up so that calls repeat and replay
            bounds = _measured_bounds(
                collective, transport, config, fingerprint, input, output, planner, planning_stream, graph_tag, encoded,
                misfit,
            )  # fmt: skip
        if graphed and bounds is not None:
            key = graph_key(collective, transport, input, output, fingerprint, bounds, graph_tag) + (encoded is None,)
            stats, event = run_graphed(
                key,
                input,
                output,
                lambda: _run(collective, transport, config, input, output, planner, None, bounds, encoded, misfit),
                None if encoded is None else encoded.buffer,
            )
            if exchanged:
                stats.exchanges = 1
        else:
            stats, event = _run(
                collective, transport, config, input, output, planner, planning_stream, bounds, encoded, misfit
            )
        if decoded is not None:
            add_statuses(stats, decoded)
    _local.stats = stats
    return CollectiveWork([output], stats, event) if async_op else None


def _step(
    collective: str, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, config: CollectiveConfig
) -> CollectiveStats:
    """One flat step of a hierarchical call (:func:`.hierarchical.run`), run synchronously: its stats."""
    _call(collective, output, input, group, False, config)
    return _local.stats


def _graphable(config: CollectiveConfig, inp: torch.Tensor, out: torch.Tensor, transport: P2PTransport) -> bool:
    """A call ``cuda_graphs`` applies to; others (and bad arguments, which the eager path reports) run eagerly."""
    return (
        config.cuda_graphs
        and config.algorithm != "hierarchical"
        and inp.is_cuda
        and out.device == inp.device
        and inp.is_contiguous()
        and out.is_contiguous()
        and transport.world > 1
        and inp.numel() > 0
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    return lo_a < lo_b + b.numel() * b.element_size() and lo_b < lo_a + a.numel() * a.element_size()


def _fits(collective: str, inp: torch.Tensor, out: torch.Tensor, transport: P2PTransport) -> bool:
    """Whether a call that found a route (:func:`.held.lookup`) has no local problem. The route's
    key holds its shapes, element types and device, checked when an earlier call of it made the
    route; an all-reduce (in place: ``out`` is ``inp``) can then differ only in its layout."""
    if collective == "all_reduce":
        return inp.is_contiguous()
    return not _local_problems(collective, inp, out, transport)[0]


def _local_problems(
    collective: str, inp: torch.Tensor, out: torch.Tensor, transport: P2PTransport
) -> tuple[Problem, bool]:
    """This rank's argument problems, and whether input and output alias in a supported in-place form."""
    p, r = transport.world, transport.rank
    problems = Problem.NONE
    if not inp.is_contiguous():
        problems |= Problem.INPUT_NOT_CONTIGUOUS
    if out is not inp and not out.is_contiguous():
        problems |= Problem.OUTPUT_NOT_CONTIGUOUS
    if inp.dtype not in SUPPORTED_DTYPES:
        problems |= Problem.UNSUPPORTED_DTYPE
    if out.dtype != inp.dtype:
        problems |= Problem.DTYPES_DIFFER
    if out.device != inp.device:
        problems |= Problem.DEVICES_DIFFER
    if not transport.supports(inp.device):
        problems |= Problem.DEVICE
    aliased = False
    wrong_size = (collective == "all_gather" and out.numel() != p * inp.numel()) or (
        collective == "reduce_scatter" and inp.numel() != p * out.numel()
    )
    if wrong_size:
        problems |= Problem.OUTPUT_SIZE
    elif collective != "all_reduce" and not problems and _overlap(inp, out):
        size = inp.element_size()
        if collective == "all_gather":
            aliased = inp.data_ptr() == out.data_ptr() + r * inp.numel() * size
        else:
            aliased = out.data_ptr() == inp.data_ptr() + r * out.numel() * size
        if not aliased:
            problems |= Problem.OVERLAP
    return problems, aliased


def _layout(collective: str, inp: torch.Tensor, out: torch.Tensor, p: int, channels: int) -> ChunkLayout:
    """The call's chunks (memoised by :meth:`ChunkLayout.of`: the same buckets every step)."""
    return ChunkLayout.of(collective, out.numel() if collective == "all_gather" else inp.numel(), p, channels)


def _run(
    collective: str,
    transport: P2PTransport,
    config: CollectiveConfig,
    inp: torch.Tensor,
    out: torch.Tensor,
    planner: P2PTransport,
    planning_stream: torch.cuda.Stream | None,
    bounds: Sequence[Sequence[int]] | None = None,
    encoded: EncodedPieces | None = None,
    misfit: Problem = Problem.NONE,
) -> tuple[CollectiveStats, torch.cuda.Event | None]:
    """One flat call, in stages: the request (checked locally), the counts (exchanged, or the
    caller's bounds), the decision and this rank's plan, the executors, the stats. ``encoded``
    (an all-reduce): the input as payloads, decoded where the plan needs it; ``misfit``: a problem
    found in them, which the request carries to every rank."""
    p, r = transport.world, transport.rank
    timer = Span(inp.device)
    rpn = ranks_per_node(config, transport)  # once: the exchange checks what the topology uses
    nodes = nodes_code(rpn)
    fingerprint = config.fingerprint() + nodes
    request, problems, aliased, layout = _request(collective, transport, config, fingerprint, inp, out, misfit)
    if p == 1:
        return _local_call(collective, request, aliased, inp, out, transport, timer)

    # 1. counts: every rank ends this stage holding the same counts (or summaries)
    x = inp.view(-1) if not problems else inp
    corrections = corrections_of(config, transport)
    sink = StatusSink(inp.device)
    if bounds is None and held.goes_native_unexchanged(collective, config, request, layout, transport, rpn):
        if planning_stream is not None:  # the input is ready on the planning stream
            torch.cuda.current_stream(inp.device).wait_stream(planning_stream)
        route = held.route_of(collective, transport, config, rpn, fingerprint, request, layout, inp, out)
        return decoded_first(
            encoded, x, sink, held.native_call, collective, transport, route, x, out.view(-1), corrections, timer
        )
    how, xdev = "", None  # the exchange protocol; none for a call with bounds
    if bounds is not None:  # planned from the caller's bounds: no count, no exchange, no synchronisation
        check_local(request, p, transport.backend)
        counts = Counts.from_table(collective, check_bounds(bounds, layout, collective), layout, r, exact=False)
        if config.gather_counts == "measured" and collective == "all_reduce":
            raise ValueError(
                "spccl_train.all_reduce: gather_counts='measured' needs a second count exchange, which a call with "
                "bounds does not make; use gather_counts='auto' or 'bound'"
            )
        if config.gather_counts == "auto":  # nothing to measure: the gather phase is sized from the bounds
            config, fingerprint = _bounded_config(config, fingerprint)
            fingerprint += nodes
    else:
        how = protocol(p)
        counts, xdev = _exchange(
            collective, request, layout, x, Topology(p, rpn), planner, planning_stream, corrections, how,
            whole_table=config.algorithm == "ring", encoded=encoded,
        )  # fmt: skip
        held.remember_checked(transport, request)
    topology = Topology(p, rpn)
    whole = how == "table" or (how == "scalable" and config.algorithm == "ring")  # every rank's counts
    rounds = exchange_rounds(how, collective, whole_table=how == "scalable" and whole) if how else 0
    received = exchange_bytes(how, collective, p, config.channels, how == "scalable" and whole) if how else 0

    # 2. the decision and this rank's plan (the same on every rank: functions of the counts and of
    # the group's state, which every rank changes alike)
    measured = model_of(config, transport, topology, inp.device)
    default_group = hierarchical.is_world(transport.group)
    model, key = measured.model, f"{fingerprint}|{measured.tag}|{'default group' if default_group else 'subgroup'}"
    if bounds is not None and _graphable(config, inp, out, transport):  # replayed: no host cost per launch
        model, key = model.replayed(), f"{key}|replayed"
    nbytes = layout.numel * inp.element_size()
    if config.algorithm == "hierarchical":  # asked for: run its steps, unless the group has one level
        check_hierarchy(p, topology.ranks_per_node)  # every rank agreed on the nodes in the exchange
        if hierarchical.applies(topology) and layout.numel > 0:
            # the flat exchange before the steps
            flat = model.planning(collective, layout.numel, inp.dtype, p) + (rounds - 1) * model.exchange_s
            return decoded_first(
                encoded, x, sink, hierarchical.run, _step, collective, transport, config, topology, inp, out, timer, flat,
                None, how, received,
            )  # fmt: skip
        config = dataclasses.replace(config, algorithm="auto")  # (the memo key keeps "hierarchical")
    # the density octave of exchanged counts, where the corrections keep what candidates took and
    # trials are counted (a call with bounds keeps one plan per bounds table: neither). A call that
    # exchanged the whole table plans from bounds above it, reused while its counts fit (:mod:`.reuse`)
    summary = counts.summary(layout, topology) if bounds is None and how != "table" else None
    octave = None
    if corrections is not None and bounds is None:
        octave = summary.octave if summary is not None else table_octave(collective, counts.table, layout)
    factors = corrections.factors_for(collective, nbytes, inp.dtype, octave) if corrections is not None else None

    def learn(timer: Span, choice: Candidate) -> None:  # the call's time, for the next exchange
        if corrections is not None and not (inp.is_cuda and torch.cuda.is_current_stream_capturing()):
            # (a call captured in a CUDA graph ran nothing: its timer's events belong to the graph)
            uncorrected = choice.predicted_s / factor_of(factors, choice.name)
            corrections.called(
                collective, choice.name, nbytes, uncorrected, timer, inp.dtype, fingerprint, octave, choice.trial
            )

    prefer, tried, standing = None, None, None
    if corrections is not None:
        prefer = corrections.last_run(collective, nbytes, inp.dtype, fingerprint)
        if octave is not None:
            tried = corrections.tried(collective, nbytes, inp.dtype, octave)
            if prefer is not None and prefer not in corrections.ran_at(collective, nbytes, inp.dtype, octave):
                standing = prefer  # tried here before it is left (:data:`~.choice.TRIAL_MARGIN`)
    entry = None
    if summary is not None:  # the scalable exchange: decided and planned from its counts every call
        choice, weighed, plan, bound_gather = _decide_and_plan(
            collective, config, key, counts, summary, layout, inp.dtype, topology, r, model, factors, default_group,
            rounds, prefer, tried, standing,
        )  # fmt: skip
    else:  # priced and planned once per bounds, picked every call
        store = state_of(transport).plans if bounds is None else None
        entry = _priced_plans(
            collective, config, key, counts, layout, inp.dtype, topology, r, model, default_group, store
        )
        choice, weighed, plan, bound_gather = _pick_and_plan(
            entry, int(bounds is None), collective, config, layout, inp.dtype, topology, r, model, factors, rounds,
            prefer, tried, standing,
        )  # fmt: skip
    if bounds is None and config.holds_native():  # (a dense config's calls go native before the holds matter)
        # a trial holds nothing: its runs come on the next exchanged calls, two per candidate
        state_of(transport).holds.decided(held.signature(request), choice.algorithm == "native" and not choice.trial)
    if choice.algorithm == "hierarchical":  # auto chose it: the steps exchange and plan on the node subgroups
        chosen = (choice.predicted_s, weighed)
        return decoded_first(
            encoded, x, sink, hierarchical.run, _step, collective, transport, config, topology, inp, out, timer, 0.0,
            chosen, how, received, functools.partial(learn, choice=choice),
        )  # fmt: skip

    # 3. the executors (a native choice that calls of the shape hold is priced, so observed, as
    # NCCL's call alone, timed from just before the executor issues it: what the held calls will
    # take, :func:`.choice._price`)
    alone = Span(inp.device) if choice.algorithm == "native" and bounds is None and config.holds_native() else None
    plan, extra = execute(
        Execution(
            collective, choice, config, transport, plan, bound_gather, layout, topology, x, out.view(-1), aliased,
            sink, xdev, encoded,
        )
    )  # fmt: skip
    sent, dense = (
        (plan.bytes_sent(r), plan.dense_bytes(r))
        if plan is not None
        else (dense_ring_bytes(collective, layout.numel, p, inp.element_size()),) * 2
    )
    event = timer.stop()
    if alone is not None:
        alone.stop()
    learn(timer if alone is None else alone, choice)

    # 4. the stats
    stats = CollectiveStats(
        collective=collective,
        algorithm=choice.algorithm,
        format=choice.format,
        plan=plan,
        predicted_s=choice.predicted_s,
        candidates=weighed,
        exchanges=rounds + extra,  # host synchronisations (none with bounds)
        gather_counts=choice.gather_counts,
        bytes_sent=sent,
        dense_bytes=dense,
        graph="",
        _statuses=sink.collect(),
        _timer=timer,
        exchange=how,
        exchange_bytes=received + extra * 8 * p * (1 + layout.channels),
        trial=choice.trial,
        planned_from=None if entry is None or plan is None else entry.bounds,
    )
    if r == 0 and _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "%s: chose %s/%s (predicted %.3g s; candidates %s)\n%s",
            collective,
            choice.algorithm,
            choice.format.value,
            choice.predicted_s,
            weighed,
            plan.describe() if plan else "native",
        )
    return stats, event


def _local_call(
    collective: str,
    request: Request,
    aliased: bool,
    inp: torch.Tensor,
    out: torch.Tensor,
    transport: P2PTransport,
    timer: Span,
) -> tuple[CollectiveStats, torch.cuda.Event | None]:
    """A group of one rank: checked as any call, then the input is the result."""
    check_table([request.header()], collective, 1, transport.backend)
    if collective != "all_reduce" and not aliased:
        out.view(-1).copy_(inp.view(-1))
    stats = CollectiveStats(
        collective=collective,
        algorithm="local",
        format=Format.DENSE,
        plan=None,
        predicted_s=0.0,
        candidates={},
        exchanges=0,
        gather_counts="",
        bytes_sent=0,
        dense_bytes=0,
        graph="",
        _statuses=None,
        _timer=timer,
    )
    return stats, timer.stop()


def _decide_and_plan(
    collective: str,
    config: CollectiveConfig,
    key: str,
    counts: Counts,
    summary: CountSummary,
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    rank: int,
    model: CostModel,
    factors: dict[str, float] | None,
    default_group: bool,
    rounds: int,
    prefer: str | None = None,
    tried: frozenset[str] | None = None,
    standing: str | None = None,
) -> tuple[Candidate, dict[str, float], Plan | None, Plan | None]:
    """``(choice, predictions, plan, gather plan)`` of a call that exchanged its counts by the
    scalable protocol: :func:`~.choice.decide` from the counts' ``summary`` (``prefer``: the
    candidate the group ran last for such a call, :data:`~.choice.STICKY_MARGIN`; ``tried``:
    :meth:`.feedback.Corrections.tried`, or ``None``; ``standing``: ``prefer`` where it never ran
    at this density, :data:`~.choice.TRIAL_MARGIN`), then :func:`_plan_choice` (a ring from the
    whole table it gathered)."""
    rings = counts.table is not None
    choice, weighed = decide(
        config, key, summary, dtype, model, 1, factors, default_group, max(rounds, 1), rings, prefer, tried, standing
    )
    return choice, weighed, *_plan_choice(choice, collective, config, counts, layout, dtype, topology, rank)


def _priced_plans(
    collective: str,
    config: CollectiveConfig,
    key: str,
    counts: Counts,
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    rank: int,
    model: CostModel,
    default_group: bool,
    store: PlanStore | None,
) -> Reused:
    """The priced candidates and plans a call picks and runs from (a :class:`~.reuse.Reused`).

    ``store`` ``None``: a call with the caller's bounds (the same every step: a DDP bucket), once
    per bounds table, a pure memo. Else a call that exchanged the whole count table: priced from
    its counts, planned from bounds above them, the last ones of its shape while the counts fit
    them (:mod:`.reuse`; ``store`` is its group's). The bounds are read-only: what every rank
    kept must stay equal (:attr:`.stats.CollectiveStats.planned_from` hands them out)."""
    if store is None:
        memo_key = (collective, key, dtype, layout, topology, rank, counts.table.tobytes())
        entry = _bounded_plans.get(memo_key)
        if entry is None:
            counts.table.flags.writeable = False
            weighing = priced(config, key, counts.summary(layout, topology), dtype, model, 0, default_group, True)
            entry = _bounded_plans.put(memo_key, Reused(counts, weighing))
        return entry
    shape = (collective, key, dtype, layout, topology)
    entry = store.get(shape, counts.table)
    if entry is None:
        weighing = priced(config, key, counts.summary(layout, topology), dtype, model, 1, default_group, True)
        table = headroom(counts.table, limits_of(collective, layout))
        table.flags.writeable = False
        entry = store.put(shape, Reused(Counts.from_table(collective, table, layout, rank, False), weighing))
    return entry


_bounded_plans = Memo("bounded plans", 64)
"""Calls with bounds: the :class:`~.reuse.Reused` of each call and bounds table."""


def _pick_and_plan(
    entry: Reused,
    exchanges: int,
    collective: str,
    config: CollectiveConfig,
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    rank: int,
    model: CostModel,
    factors: dict[str, float] | None,
    rounds: int,
    prefer: str | None,
    tried: frozenset[str] | None,
    standing: str | None = None,
) -> tuple[Candidate, dict[str, float], Plan | None, Plan | None]:
    """``(choice, predictions, plan, gather plan)`` from priced candidates: the pick (corrections,
    preference, trials) every call, each choice planned once from the entry's counts."""
    choice, weighed = entry.weighing.pick(model, exchanges, factors, max(rounds, 1), prefer, tried, standing)
    which = (choice.algorithm, choice.format, choice.gather_counts)
    plans = entry.plans.get(which)
    if plans is None:
        plans = entry.plans[which] = _plan_choice(
            choice, collective, config, entry.counts, layout, dtype, topology, rank
        )
    return choice, weighed, *plans


def _plan_choice(
    choice: Candidate,
    collective: str,
    config: CollectiveConfig,
    counts: Counts,
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    rank: int,
) -> tuple[Plan | None, Plan | None]:
    """This rank's plan of ``choice`` (``None`` for native or hierarchical) and, for an all-reduce
    whose gather phase is sized from the first exchange or the bounds, of its gather phase."""
    if choice.algorithm == "hierarchical":
        return None, None
    plan = plan_candidate(choice, collective, config, counts, layout, dtype, topology, rank)
    bound_gather = None
    if collective == "all_reduce" and plan is not None and choice.gather_counts != "measured":
        bound_gather = gather_plan(choice, config, counts.reduced_bounds(), layout, dtype, topology, rank)
    return plan, bound_gather


def _request(
    collective: str,
    transport: P2PTransport,
    config: CollectiveConfig,
    fingerprint: str,
    inp: torch.Tensor,
    out: torch.Tensor,
    misfit: Problem = Problem.NONE,
) -> tuple[Request, Problem, bool, ChunkLayout | None]:
    """This rank's call as the planning exchange describes it, its problems (``misfit``: found in
    its encoded input), whether it is an in-place form, and its chunk layout (``None`` when it has
    problems)."""
    problems, aliased = _local_problems(collective, inp, out, transport)
    problems |= misfit
    layout = None
    if not problems:
        layout = _layout(collective, inp, out, transport.world, config.channels)
        if max((piece.numel for chunk in layout.pieces for piece in chunk), default=0) > MAX_ELEMENTS:
            problems |= Problem.TOO_LARGE
    request = Request(
        collective=collective,
        numel=inp.numel(),
        out_numel=out.numel(),
        dtype=inp.dtype,
        out_dtype=out.dtype,
        device=inp.device,
        config=config_code(fingerprint),
        problems=problems,
        channels=config.channels,
    )
    return request, problems, aliased, layout


def _exchange(
    collective: str,
    request: Request,
    layout: ChunkLayout | None,
    x: torch.Tensor,
    topology: Topology,
    planner: P2PTransport,
    planning_stream: torch.cuda.Stream | None,
    corrections: Corrections | None,
    how: str = "table",
    whole_table: bool = False,
    encoded: EncodedPieces | None = None,
) -> tuple[Counts, torch.device]:
    """Count this rank's pieces (``encoded``: read their payloads' counts) and exchange the counts
    (the call's host synchronisations) by the ``how`` protocol (:func:`.exchange.protocol`), with
    the time of this rank's previous call on the group, which ``corrections`` learns from."""
    r = planner.rank
    counts = None
    with torch.cuda.stream(planning_stream) if planning_stream is not None else contextlib.nullcontext():
        if layout is not None and not request.problems:
            if collective == "all_gather":
                counts = count_nonzero_pieces(x, layout, [r], base=layout.chunks[r].start)
            elif encoded is not None:
                counts = encoded.nnz
            else:
                counts = count_nonzero_pieces(x, layout)
        observed = corrections.report() if corrections is not None else -1
        if how == "scalable":
            shared, xdev, times = exchange_scalable(planner, request, counts, layout, topology, observed, whole_table)
        else:
            width = topology.world * request.channels
            table, xdev, times = exchange_counts(planner, request, counts, width, observed)
            shared = None if layout is None else Counts.from_table(request.collective, table, layout, r)
    if corrections is not None:
        corrections.learn(times)
    if planning_stream is not None:  # what the planning stream waited for, the transfers wait for too
        torch.cuda.current_stream(x.device).wait_stream(planning_stream)
    return shared, xdev


def _measured_bounds(
    collective: str,
    transport: P2PTransport,
    config: CollectiveConfig,
    fingerprint: str,
    inp: torch.Tensor,
    out: torch.Tensor,
    planner: P2PTransport,
    planning_stream: torch.cuda.Stream | None,
    tag: Hashable,
    encoded: EncodedPieces | None = None,
    misfit: Problem = Problem.NONE,
) -> list[list[int]]:
    """Bounds for a graphed call from its exchanged counts (:func:`.graphs.bounds_from_counts`, under
    the name of this call: collective, group, tag, sizes, dtype and config). ``fingerprint``:
    ``config.fingerprint()`` and the nodes this rank resolved (:func:`.context.nodes_code`)."""
    request, problems, _, layout = _request(collective, transport, config, fingerprint, inp, out, misfit)
    x = inp.view(-1) if not problems else inp
    exchanged, _ = _exchange(
        collective,
        request,
        layout,
        x,
        Topology(transport.world, None),
        planner,
        planning_stream,
        corrections_of(config, transport),
        protocol(transport.world),
        whole_table=True,  # every rank derives every rank's bounds
        encoded=encoded,
    )
    table = exchanged.table.tolist()
    assert layout is not None  # the exchange raised on every rank otherwise
    sizes = [piece.numel for chunk in layout.pieces for piece in chunk]
    limits = [
        [piece.numel for piece in layout.pieces[q]] if collective == "all_gather" else sizes for q in range(len(table))
    ]
    name = (collective, transport, tag, inp.numel(), out.numel(), inp.dtype, fingerprint)
    return bounds_from_counts(name, table, limits)


_bounded_configs = Memo("bounded configs", 64)


def _bounded_config(config: CollectiveConfig, fingerprint: str) -> tuple[CollectiveConfig, str]:
    """``config`` with ``gather_counts="bound"`` and its fingerprint, made once per fingerprint
    (equal fingerprints plan alike; a call with bounds repeats every training step)."""
    hit = _bounded_configs.get(fingerprint)
    if hit is None:
        bounded = dataclasses.replace(config, gather_counts="bound")
        hit = _bounded_configs.put(fingerprint, (bounded, bounded.fingerprint()))
    return hit
