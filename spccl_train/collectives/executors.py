"""The last stage of a call: run the chosen candidate, through the executor registered for its
collective and algorithm.

A call's pipeline (:mod:`.api`) is request -> counts -> decision and plan -> **executor** -> stats.
The executor gets everything the earlier stages made in one :class:`Execution` and returns the plan
it ran (an all-reduce: both phases) and the extra count exchanges it made. One function per
(collective, algorithm), registered in :data:`EXECUTORS`:

===============  ====================================  ===================================
collective       ``direct``                            ``ring``
===============  ====================================  ===================================
all_gather       :func:`._direct.direct_all_gather`    :func:`._ring.ring_all_gather`
reduce_scatter   :func:`._direct.direct_reduce_scatter`  :func:`._ring.ring_reduce_scatter`
all_reduce       both, interleaved by wave             reduce-scatter, then all-gather
===============  ====================================  ===================================

and ``native`` (torch.distributed's dense collective) for all three. An all-reduce whose gather
phase was not sized up front (``gather_counts="measured"``) counts its reduced chunk and exchanges
again between the phases. Encoded input (:class:`.encoded.EncodedPieces`) goes to the direct
executors as it is; every other one gets it decoded into the input tensor first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..transport import P2PTransport
from ..transport.dense import all_gather_flat, reduce_scatter_flat
from ._direct import direct_all_gather, direct_all_reduce, direct_reduce_scatter
from ._ring import ring_all_gather, ring_reduce_scatter
from ._wire import StatusSink
from .choice import Candidate
from .chunking import ChunkLayout, count_nonzero_pieces
from .config import CollectiveConfig
from .encoded import EncodedPieces
from .exchange import exchange_reduced_counts
from .plan import Plan
from .rank_plan import plan_all_gather_for
from .topology import Topology

__all__ = ["EXECUTORS", "Execution", "execute", "gather_plan", "native_collective"]


class Execution(NamedTuple):
    """What the earlier stages of a call hand its executor."""

    collective: str
    choice: Candidate
    config: CollectiveConfig
    transport: P2PTransport
    plan: Plan | None
    """This rank's plan of the choice (``None`` for native)."""
    bound_gather: Plan | None
    """An all-reduce's gather phase sized from the first exchange or the bounds; ``None``: measure it."""
    layout: ChunkLayout
    topology: Topology
    x: torch.Tensor
    """The input, flat (an all-reduce's tensor, summed in place)."""
    y: torch.Tensor
    """The output, flat."""
    aliased: bool
    """The input is this rank's slice of the output (all-gather) or the output of it (reduce-scatter)."""
    sink: StatusSink
    xdev: torch.device | None
    """Where the exchange's counts live (a measured gather phase's second exchange)."""
    encoded: EncodedPieces | None
    """An all-reduce's input as payloads (direct only; decoded for the others)."""


Executor = Callable[[Execution], tuple[Plan | None, int]]
EXECUTORS: dict[tuple[str, str], Executor] = {}
"""``(collective, algorithm)`` -> the function that runs it."""


def _registered(collective: str, *algorithms: str) -> Callable[[Executor], Executor]:
    def register(fn: Executor) -> Executor:
        for algorithm in algorithms:
            EXECUTORS[(collective, algorithm)] = fn
        return fn

    return register


def execute(run: Execution) -> tuple[Plan | None, int]:
    """Run ``run.choice``: returns the plan run (native: ``None``) and the extra count exchanges made."""
    if run.encoded is not None and run.choice.algorithm != "direct":
        run.encoded.decode_into(run.x, sink=run.sink)
        run = run._replace(encoded=None)
    return EXECUTORS[(run.collective, run.choice.algorithm)](run)


def native_collective(
    collective: str, transport: P2PTransport, x: torch.Tensor, y: torch.Tensor, async_op: bool = False
) -> dist.Work | None:
    """torch.distributed's dense ``collective`` of ``x`` into ``y`` (an all-reduce: ``x`` in place);
    with ``async_op``, its work handle."""
    if collective == "all_gather":
        return all_gather_flat(y, x, group=transport.group, async_op=async_op)
    if collective == "reduce_scatter":
        return reduce_scatter_flat(y, x, group=transport.group, async_op=async_op)
    return dist.all_reduce(x, group=transport.group, async_op=async_op)


def gather_plan(
    choice: Candidate,
    config: CollectiveConfig,
    counts: object,
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    rank: int,
    measured: bool = False,
) -> Plan:
    """Rank ``rank``'s plan of an all-reduce's gather phase from the reduced pieces' counts
    (``measured``) or bounds."""
    return plan_all_gather_for(
        rank,
        counts,
        layout,
        dtype,
        fmt=choice.format,
        algorithm=choice.algorithm,
        threshold=config.thresholds.resolve(choice.format).ag,
        topology=topology,
        collective="all_reduce",
        measured=measured,
    )


@_registered("all_gather", "native")
@_registered("reduce_scatter", "native")
@_registered("all_reduce", "native")
def _native(run: Execution) -> tuple[Plan | None, int]:
    native_collective(run.collective, run.transport, run.x, run.y)
    return None, 0


@_registered("all_gather", "direct", "ring")
def _all_gather(run: Execution) -> tuple[Plan | None, int]:
    """Each chunk from its owner; the own chunk is the input, copied while the payloads travel."""
    own = run.layout.chunks[run.transport.rank]
    copy_own = None if run.aliased else functools.partial(run.y[own.start : own.stop].copy_, run.x)
    _gather(run, run.plan, run.y, run.x, own.start, copy_own=copy_own)
    return run.plan, 0


@_registered("reduce_scatter", "direct", "ring")
def _reduce_scatter(run: Execution) -> tuple[Plan | None, int]:
    _scatter(run, run.y)
    return run.plan, 0


@_registered("all_reduce", "direct", "ring")
def _all_reduce(run: Execution) -> tuple[Plan | None, int]:
    """Reduce-scatter, then all-gather, in place. Direct with the gather phase sized up front
    interleaves them by wave; otherwise the gather phase is sized from the bounds, or from a second
    exchange of the reduced chunk's counts (``gather_counts="measured"``)."""
    x, gather, extra = run.x, run.bound_gather, 0
    if run.choice.algorithm == "direct" and gather is not None:
        direct_all_reduce(run.transport, run.plan.steps[0], gather.steps[0], run.layout, x, run.sink, run.encoded)
        return run.plan.then(gather), 0
    held = _scatter(run, None)
    if gather is None:  # measured: count the reduced chunk and exchange again
        r = run.transport.rank
        reduced = exchange_reduced_counts(run.transport, count_nonzero_pieces(x, run.layout, [r], base=0), run.xdev)
        extra = 1
        gather = gather_plan(run.choice, run.config, reduced, run.layout, x.dtype, run.topology, r, measured=True)
    _gather(run, gather, x, x, 0, held=held)
    return run.plan.then(gather), extra


def _scatter(run: Execution, out: torch.Tensor | None) -> dict[tuple[int, int], torch.Tensor] | None:
    """The reduce-scatter phase into ``out`` (``None``: the input's own chunk); direct returns the
    Pici payloads it sent (see :func:`._direct.direct_reduce_scatter`)."""
    plan, x = run.plan, run.x
    if run.choice.algorithm == "ring":
        ring_reduce_scatter(run.transport, plan.steps, run.layout, x, out, run.sink, out_aliases_x=run.aliased)
    elif plan.steps:
        return direct_reduce_scatter(run.transport, plan.steps[0], run.layout, x, out, run.sink, encoded=run.encoded)
    elif run.encoded is not None:  # nothing to send: the input is this rank's own chunk
        run.encoded.decode_into(x, sink=run.sink)
    return None


def _gather(
    run: Execution,
    plan: Plan,
    out: torch.Tensor,
    own: torch.Tensor,
    own_base: int,
    held: dict[tuple[int, int], torch.Tensor] | None = None,
    copy_own: Callable[[], object] | None = None,
) -> None:
    """The gather phase; ``copy_own`` (an all-gather's copy of its input into its own chunk) runs
    before the ring, and while the direct algorithm's payloads are on the wire."""
    if run.choice.algorithm == "direct" and plan.steps:
        direct_all_gather(run.transport, plan.steps[0], run.layout, out, own, own_base, run.sink, held, copy_own)
        return
    if copy_own is not None:
        copy_own()
    ring_all_gather(run.transport, plan.steps, run.layout, out, own, own_base, run.sink)
