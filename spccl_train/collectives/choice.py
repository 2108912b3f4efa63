"""Picking the algorithm and format of one call: every candidate the config allows, priced.

With ``format="auto"`` the candidates are Pici and COO under each allowed algorithm, plus the
native dense ``torch.distributed`` collective, which comes first and keeps the call unless a
sparse candidate is predicted :data:`NATIVE_MARGIN` faster, so ``auto`` never picks what the cost
model predicts slower than dense. A fixed sparse format weighs only
its algorithms; ``format="dense", algorithm="auto"`` is the native call. An all-reduce's gather
phase is looked ahead at in both ways it can be sized (``CollectiveConfig.gather_counts``): from
the bound of the first exchange (one synchronisation) or from a second exchange (whose counts
the summary's estimate predicts); the cheaper wins.

Candidates are weighed from the count table's :class:`~.summary.CountSummary` (O(world x
channels) numbers), not from plans, and only the chosen one is planned, for this rank alone
(:func:`plan_candidate`). :func:`decide` is what a call uses: the choice made from the summary
rounded to 1/16 of an octave of density and memoised, so calls with the same sparsity profile
(every training step, every benchmark repetition) skip the weighing. All inputs are equal on
every rank and the decision is a pure function of them, so every rank picks alike.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

from ..formats import Format
from . import hierarchical
from .chunking import ChunkLayout
from .config import CollectiveConfig
from .cost import CostModel
from .exchange import Counts
from .feedback import factor_of
from .plan import Plan
from .rank_plan import plan_all_gather_for, plan_direct_reduce_scatter_for, plan_reduce_scatter_for
from .state import Memo, clear_memos
from .summary import CountSummary, predict_variants
from .topology import Topology

__all__ = ["Candidate", "choose", "weigh", "decide", "plan_candidate", "clear_decisions"]


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One way to run a call, with its predicted time."""

    algorithm: str
    """``"native"``, ``"ring"``, ``"direct"`` or ``"hierarchical"``."""
    format: Format
    """The sparse format its plan may use (``DENSE`` for native)."""
    predicted_s: float
    """The cost model's prediction, planning exchanges included."""
    gather_counts: str = ""
    """All-reduce only: ``"bound"`` (gather phase sized from the first exchange) or
    ``"measured"`` (a second exchange); ``""`` otherwise."""

    @property
    def name(self) -> str:
        """``"algorithm/format"``, e.g. ``"ring/pici"``; ``"hierarchical"`` (its steps choose their formats)."""
        return self.algorithm if self.algorithm == "hierarchical" else f"{self.algorithm}/{self.format.value}"


def choose(
    collective: str,
    config: CollectiveConfig,
    counts: object,
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    model: CostModel,
    exchanges: int = 1,
    factors: Mapping[str, float] | None = None,
    default_group: bool = False,
    rounds: int = 1,
    rings: bool = True,
) -> tuple[Candidate, dict[str, float]]:
    """Weigh the candidates ``config`` allows; return the cheapest and every prediction by name.

    Args:
        collective: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        config: the call's config (format, algorithm, thresholds, gather_counts).
        counts: the exchanged table: ``counts[q]`` is rank ``q``'s ``world * channels`` per-piece
            nonzero counts (for an all-gather only the first ``channels``, its input's, are used),
            as nested sequences or an int64 array.
        layout, dtype, topology: the call's chunks, element type and nodes.
        model: the cost model.
        exchanges: planning exchanges (each with its count pass) every candidate pays: 1, or 0
            for a call planned from bounds; an all-reduce that measures its gather phase adds one.
        factors: corrections learned from observed calls (:meth:`.feedback.Corrections.factors_for`):
            each candidate's prediction is multiplied by :func:`.feedback.factor_of`.
        default_group: the call is on the default group, so an all-reduce across nodes may weigh
            the hierarchical one (:mod:`.hierarchical`; its subgroups are made from that group).
        rounds: host synchronisations of the call's count exchange
            (:func:`.exchange.exchange_rounds`): each beyond the first costs every candidate one
            more exchange.
        rings: whether the exchange gave every rank's counts, which a ring needs (the scalable
            exchange does not, unless a ring was asked for): else rings are not weighed.

    The candidates are weighed from the table's :class:`~.summary.CountSummary`, not from plans:
    every candidate comes without one (:func:`plan_candidate` plans the chosen one).
    """
    summary = CountSummary.of(collective, counts, layout, topology)
    return weigh(summary, config, dtype, model, exchanges, factors, default_group, rounds, rings)


def weigh(
    summary: CountSummary,
    config: CollectiveConfig,
    dtype: torch.dtype,
    model: CostModel,
    exchanges: int = 1,
    factors: Mapping[str, float] | None = None,
    default_group: bool = False,
    rounds: int = 1,
    rings: bool = True,
    prefer: str | None = None,
) -> tuple[Candidate, dict[str, float]]:
    """:func:`choose` from a summary: O(world x channels) array work per candidate. ``prefer``:
    the name of the candidate the group ran last for such a call, which keeps winning unless
    another is predicted more than :data:`STICKY_MARGIN` faster."""
    collective, layout, topology = summary.collective, summary.layout, summary.topology
    native_only = config.format == "dense" and config.algorithm == "auto"
    candidates: list[tuple[Candidate, bool]] = []  # with: does it send anything sparse
    native_weighed = config.format == "auto" or native_only
    if native_weighed:
        predicted = model.predict_native(collective, layout.numel, dtype, topology, exchanges)
        candidates.append((Candidate("native", Format.DENSE, predicted), True))
    if not native_only:
        formats = [Format.PICI, Format.COO] if config.format == "auto" else [Format(config.format)]
        # Two ranks: the ring sends the direct algorithm's messages (one peer, one step per phase)
        # through a slower executor, so it is weighed only when asked for. Over 6 sweeps of 2 ranks
        # (emulated nodes on one H100 or H200, NVLink on 2 H100s; 64 MiB-1 GiB, 90-99.9%, Pici
        # and COO: 128 pairs) it took 1.07x the direct time (median), over 1.1x at 44 pairs and
        # under 1x at 17 (0.87x at best), while the model saw ties and auto took it at up to 1.26x
        # the direct call.
        flat = ["ring", "direct"] if rings and topology.world > 2 else ["direct"]
        flat = flat if config.algorithm == "auto" else [config.algorithm]
        weighed: dict[tuple[Format, str], tuple[Candidate, bool]] = {}
        variants = [
            (fmt, th, mode)
            for fmt, th in ((fmt, config.thresholds.resolve(fmt)) for fmt in formats)
            for mode in (_gather_modes(config.gather_counts, fmt) if collective == "all_reduce" else ("",))
        ]
        for algorithm in flat:  # every format and gather mode of an algorithm weighed at once
            for (fmt, _, mode), got in zip(
                variants, predict_variants(model, summary, dtype, algorithm, variants, exchanges)
            ):
                best = weighed.get((fmt, algorithm))
                if best is None or got.seconds < best[0].predicted_s:  # ties: the first mode ("bound")
                    weighed[fmt, algorithm] = (Candidate(algorithm, fmt, got.seconds, mode), got.sparse)
        candidates += [weighed[fmt, algorithm] for fmt in formats for algorithm in flat]
        if (
            collective == "all_reduce"
            and config.algorithm == "auto"
            and exchanges == 1
            and layout.numel > 0
            and hierarchical.applies(topology)
            and default_group
        ):
            # after the flat call's exchange, the steps' own (each in its prediction); weighed only
            # where a step sends sparsely (all native, it is NCCL's work done slower)
            predicted, sparse = hierarchical.predict(config, summary, dtype, model, choose)
            if sparse:
                extra = model.planning(collective, layout.numel, dtype, topology.world, 1)
                fmt = Format.PICI if config.format == "auto" else Format(config.format)
                candidates.append((Candidate("hierarchical", fmt, predicted + extra), True))
    extra = (rounds - 1) * model.exchange_s if rounds > 1 and exchanges else 0.0  # rounds beyond the one counted
    if extra or factors:
        candidates = [
            (
                Candidate(
                    c.algorithm,
                    c.format,
                    (c.predicted_s + extra) * (factor_of(factors, c.name) if factors else 1.0),
                    c.gather_counts,
                ),
                sparse,
            )
            for c, sparse in candidates
        ]
    best = candidates[0][0]
    for candidate, sparse in candidates[1:]:
        # A plan that sends nothing sparse is a dense collective run by SpCCL's own steps, which
        # NCCL's native one does better: with the native candidate weighed, it never wins.
        dominated = native_weighed and not sparse
        # Leaving native takes a clear predicted win; other ties, up to rounding in the sums, go
        # to the earlier candidate.
        bar = best.predicted_s * ((1 - NATIVE_MARGIN) if best.algorithm == "native" else (1 - 1e-9))
        if not dominated and candidate.predicted_s < bar:
            best = candidate
    if prefer is not None and prefer != best.name and best.algorithm != "native" and STICKY_MARGIN > 0:
        kept = next((c for c, sparse in candidates if c.name == prefer and sparse), None)
        if (
            kept is not None
            and kept.algorithm != "native"
            and kept.predicted_s * (1 - STICKY_MARGIN) <= best.predicted_s
        ):
            best = kept
    return best, {c.name: c.predicted_s for c, _ in candidates}


NATIVE_MARGIN = 0.1
"""A sparse candidate replaces the native collective only when predicted more than this fraction
faster. The model's codec speeds do not depend on sparsity and its fixed costs are fitted, so
near-ties are noise: on 4 H200s a 64 MiB all-gather at 50% sparsity predicted 1% faster than NCCL
measured 10% slower (``bench/bench_bounds.py``, 2026-11-22)."""


STICKY_MARGIN = float(os.environ.get("SPCCL_STICKY_MARGIN", "0.05"))
"""A sparse candidate replaces the sparse one the group ran last for such a call (same collective,
size class, element type and config) only when predicted more than this fraction faster
(``SPCCL_STICKY_MARGIN`` overrides; 0 turns it off). Near-ties flip with the noise of the counts from call to call, and a
switch costs the new plan's first run: 2 ranks as 2 emulated nodes, 256 MiB and 1 GiB at 90%,
``auto`` alternated between ring/Pici and direct/Pici every call and ran 1.16-1.17x the better of
the two. With 0.05, ``auto`` was within 10% of the best fixed candidate at 11 of 12 sweep points
against 10 of 12 without, 4 ranks on one machine, and at 12 of 12 with 2 ranks
(``bench/results/2026-11-26_wire/sticky``). The native call keeps its own :data:`NATIVE_MARGIN`
and is never held on to this way."""


def _gather_modes(setting: str, fmt: Format) -> tuple[str, ...]:
    # "bound" first, so it wins ties (one synchronisation fewer); a dense gather needs no counts.
    if fmt is Format.DENSE or setting == "bound":
        return ("bound",)
    if setting == "measured":
        return ("measured",)
    return ("bound", "measured")


DENSITY_STEPS_PER_OCTAVE = 16
"""Resolution of :func:`decide`: densities within 2**(1/16) (4.4%) share a decision."""
_MAX_DECISIONS = 1024
_decisions = Memo("decisions", _MAX_DECISIONS)


def decide(
    config: CollectiveConfig,
    fingerprint: str,
    summary: CountSummary,
    dtype: torch.dtype,
    model: CostModel,
    exchanges: int = 1,
    factors: Mapping[str, float] | None = None,
    default_group: bool = False,
    rounds: int = 1,
    rings: bool = True,
    prefer: str | None = None,
) -> tuple[Candidate, dict[str, float]]:
    """:func:`weigh` on the summary rounded to 1/16 of an octave of density
    (:meth:`~.summary.CountSummary.rounded`), memoised: calls with the same sparsity profile (every
    training step, every benchmark repetition) skip the weighing.

    ``fingerprint`` is ``config.fingerprint()`` plus anything else the cost model depends on
    (the device type, for the default model, ``default_group``, the exchange protocol). The
    decision is a pure function of the rounded summary, so ranks agree whatever each rank's memo holds.
    """
    rounded = summary.rounded(DENSITY_STEPS_PER_OCTAVE)
    layout = summary.layout
    corrected = tuple(sorted(factors.items())) if factors else ()
    key = (
        summary.collective,
        fingerprint,
        exchanges,
        dtype,
        layout.numel,
        layout.world,
        layout.channels,
        summary.topology,
        rounds,
        rings,
        corrected,
        prefer,
        rounded.key(),
    )
    hit = _decisions.get(key)
    if hit is None:
        hit = _decisions.put(
            key, weigh(rounded, config, dtype, model, exchanges, factors, default_group, rounds, rings, prefer)
        )
    return hit


def clear_decisions(steps: bool = True) -> None:
    """Forget every memoised decision, and (``steps``) the hierarchical steps' weighings (for
    measurements of the weighing itself)."""
    clear_memos("decisions", *(["hierarchical steps"] if steps else []))


def plan_candidate(
    candidate: Candidate,
    collective: str,
    config: CollectiveConfig,
    counts: Counts,
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    rank: int,
) -> Plan | None:
    """Rank ``rank``'s plan of ``candidate`` from the exact counts it was given (an all-reduce: its
    reduce-scatter phase): the messages it sends and receives (:mod:`.rank_plan`). A ring needs
    the whole table (the table protocol)."""
    if candidate.algorithm == "native":
        return None
    th = config.thresholds.resolve(candidate.format)
    fmt, algorithm = candidate.format, candidate.algorithm
    if collective == "all_gather":
        return plan_all_gather_for(
            rank, counts.gathered, layout, dtype, fmt=fmt, algorithm=algorithm, threshold=th.ag, topology=topology
        )
    if algorithm == "direct":
        return plan_direct_reduce_scatter_for(
            rank,
            counts.row,
            counts.column,
            layout,
            dtype,
            fmt=fmt,
            thresholds=th,
            topology=topology,
            collective=collective,
        )
    if counts.table is None:
        raise ValueError(
            f"a {algorithm} plan needs every rank's counts (the table protocol); this call exchanged summaries"
        )
    return plan_reduce_scatter_for(
        rank,
        counts.table,
        layout,
        dtype,
        fmt=fmt,
        algorithm=algorithm,
        thresholds=th,
        topology=topology,
        collective=collective,
    )
