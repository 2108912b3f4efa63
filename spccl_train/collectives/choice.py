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
(:func:`plan_candidate`). :func:`decide` is what a call uses: the candidates priced from the
summary rounded to 1/16 of an octave of density and memoised (:func:`priced`), so calls with the
same sparsity profile (every training step, every benchmark repetition) skip the weighing, then
picked (:meth:`Weighing.pick`: the corrections, the sticky preference, trials). All inputs are
equal on every rank and the decision is a pure function of them, so every rank picks alike.

A candidate (native or sparse) predicted within :data:`TRIAL_MARGIN` of the choice that has not
been run at the call's density octave, or the sparse one the group ran last where it never ran
there, is run instead, twice, so that the measured model observes it (a *trial*,
:mod:`.feedback`); the group's corrections say which were run, equally on every rank.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

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
from .stats import candidate_name
from .summary import DENSITY_STEPS_PER_OCTAVE, CountSummary, Prediction, predict_variants
from .topology import Topology

__all__ = [
    "Candidate",
    "choose",
    "weigh",
    "weigh_batch",
    "decide",
    "priced",
    "price",
    "Weighing",
    "plan_candidate",
    "clear_decisions",
]


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
    trial: bool = False
    """Run in place of the choice, near-tied with it and not yet tried at this density
    (:data:`TRIAL_MARGIN`)."""

    @property
    def name(self) -> str:
        """``"algorithm/format"``, e.g. ``"ring/pici"``; ``"hierarchical"`` (its steps choose their formats)."""
        return candidate_name(self.algorithm, self.format)


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
    tried: frozenset[str] | None = None,
    standing: str | None = None,
) -> tuple[Candidate, dict[str, float]]:
    """:func:`choose` from a summary: O(world x channels) array work per candidate. ``prefer``:
    the name of the candidate the group ran last for such a call, which keeps winning unless
    another is predicted more than :data:`STICKY_MARGIN` faster. ``tried``: the candidates run
    often enough at this density (:meth:`.feedback.Corrections.tried`); one predicted within
    :data:`TRIAL_MARGIN` of the choice and not among them is run instead (``None``: no trials).
    ``standing``: a sparse candidate to try so however far it is priced (``prefer`` where it never
    ran at this density, :data:`TRIAL_MARGIN`)."""
    return price(summary, config, dtype, model, exchanges, default_group, rings).pick(
        model, exchanges, factors, rounds, prefer, tried, standing
    )


_Weighed = tuple[str, str, Format, float, str, bool]
"""A weighed candidate: ``(name, algorithm, format, seconds, gather mode, sends anything sparse)``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Weighing:
    """A call's candidates priced from its summary, before what changes from call to call (the
    corrections, the sticky preference, trials): :meth:`pick` applies those."""

    candidates: tuple[_Weighed, ...]
    native_weighed: bool
    native_held: bool = False
    """Whether the native candidate, where weighed, is priced as a held call (no exchange: :func:`_price`)."""

    def pick(
        self,
        model: CostModel,
        exchanges: int = 1,
        factors: Mapping[str, float] | None = None,
        rounds: int = 1,
        prefer: str | None = None,
        tried: frozenset[str] | None = None,
        standing: str | None = None,
    ) -> tuple[Candidate, dict[str, float]]:
        """The choice and every prediction by name (see :func:`weigh`): O(candidates)."""
        return _pick(
            self.candidates, self.native_weighed, model, exchanges, factors, rounds, prefer, tried, self.native_held,
            standing=standing,
        )  # fmt: skip


def price(
    summary: CountSummary,
    config: CollectiveConfig,
    dtype: torch.dtype,
    model: CostModel,
    exchanges: int = 1,
    default_group: bool = False,
    rings: bool = True,
) -> Weighing:
    """Every candidate of :func:`weigh`, priced: the array work of a decision."""
    native, priced = _price(summary, config, dtype, model, exchanges, rings)
    candidates = _candidates(native, priced)
    if (
        summary.collective == "all_reduce"
        and config.algorithm == "auto"
        and config.format != "dense"
        and exchanges == 1
        and summary.layout.numel > 0
        and hierarchical.applies(summary.topology)
        and default_group
    ):
        # after the flat call's exchange, the steps' own (each in its prediction); weighed only
        # where a step sends sparsely (all native, it is NCCL's work done slower)
        predicted, sparse = hierarchical.predict(config, summary, dtype, model, weigh_batch)
        if sparse:
            layout = summary.layout
            extra = model.planning(summary.collective, layout.numel, dtype, summary.topology.world, 1)
            fmt = Format.PICI if config.format == "auto" else Format(config.format)
            candidates.append(("hierarchical", "hierarchical", fmt, predicted + extra, "", True))
    return Weighing(tuple(candidates), native is not None, config.holds_native())


def weigh_batch(
    summary: CountSummary,
    config: CollectiveConfig,
    dtype: torch.dtype,
    model: CostModel,
    exchanges: int = 1,
    rounds: int = 1,
    rings: bool = True,
) -> list[tuple[Candidate, dict[str, float]]]:
    """:func:`weigh` of each summary of a batch (:meth:`~.summary.CountSummary.of` with
    ``batch=True``, one leading axis), the array work done once for all: what :func:`.hierarchical.predict` weighs
    its steps with, at every density of the decision grid. Rings are weighed one summary at a time
    (``rings`` must be false, or the config's algorithm not ``"auto"``/``"ring"``); the hierarchical
    candidate is not weighed (its steps are flat calls)."""
    native, priced = _price(summary, config, dtype, model, exchanges, rings)
    batch = summary.held.shape[0]
    out = []
    held = config.holds_native()
    for i in range(batch):
        at = [(a, f, m, Prediction(float(p.seconds[i]), bool(p.sparse[i]))) for a, f, m, p in priced]
        out.append(_pick(_candidates(native, at), native is not None, model, exchanges, None, rounds, None, None, held))
    return out


def _price(
    summary: CountSummary, config: CollectiveConfig, dtype: torch.dtype, model: CostModel, exchanges: int, rings: bool
) -> tuple[float | None, list[tuple[str, Format, str, Prediction]]]:
    """The native call's prediction (``None``: not weighed), and every flat sparse variant's:
    ``(algorithm, format, gather mode, prediction)``, formats in the config's order.

    Where calls of the config hold native (:meth:`~.config.CollectiveConfig.holds_native`), the
    native call is priced with no exchange: a native choice is held, and the shape's next calls
    run NCCL's call alone (up to 16 of 17: :class:`~.state.NativeHolds`), while a sparse choice
    exchanges on every call. Priced with the exchange, as this call made it, a native call of
    1 GiB bf16 at 90% on 2 H100s over NVLink was predicted at 4.2-4.6 ms and took 4.5-4.8 after a
    1.4 ms count pass and exchange, and ``auto`` ran direct/Pici at 3.76 ms (1.13x) where NCCL's
    call alone took 3.34 (bench/results/2026-11-27_twentysecond/)."""
    collective, layout, topology = summary.collective, summary.layout, summary.topology
    native_only = config.format == "dense" and config.algorithm == "auto"
    native = None
    if config.format == "auto" or native_only:
        native = model.predict_native(
            collective, layout.numel, dtype, topology, 0 if config.holds_native() else exchanges
        )
    if native_only:
        return native, []
    formats = [Format.PICI, Format.COO] if config.format == "auto" else [Format(config.format)]
    # Two ranks: the ring sends the direct algorithm's messages (one peer, one step per phase)
    # through a slower executor, so it is weighed only when asked for. Over 6 sweeps of 2 ranks
    # (emulated nodes on one H100 or H200, NVLink on 2 H100s; 64 MiB-1 GiB, 90-99.9%, Pici
    # and COO: 128 pairs) it took 1.07x the direct time (median), over 1.1x at 44 pairs and
    # under 1x at 17 (0.87x at best), while the model saw ties and auto took it at up to 1.26x
    # the direct call.
    flat = ["ring", "direct"] if rings and topology.world > 2 else ["direct"]
    flat = flat if config.algorithm == "auto" else [config.algorithm]
    variants = [
        (fmt, th, mode)
        for fmt, th in ((fmt, config.thresholds.resolve(fmt)) for fmt in formats)
        for mode in (_gather_modes(config.gather_counts, fmt) if collective == "all_reduce" else ("",))
    ]
    priced = []
    for algorithm in flat:  # every format and gather mode of an algorithm weighed at once
        got = predict_variants(model, summary, dtype, algorithm, variants, exchanges)
        priced += [(algorithm, fmt, mode, prediction) for (fmt, _, mode), prediction in zip(variants, got)]
    return native, priced


def _candidates(native: float | None, priced: list[tuple[str, Format, str, Prediction]]) -> list[_Weighed]:
    """The native candidate first, then per format and algorithm its cheaper gather mode (ties:
    the first, ``"bound"``)."""
    candidates: list[_Weighed] = [] if native is None else [("native/dense", "native", Format.DENSE, native, "", True)]
    weighed: dict[tuple[Format, str], _Weighed] = {}
    for algorithm, fmt, mode, got in priced:
        best = weighed.get((fmt, algorithm))
        if best is None or got.seconds < best[3]:
            weighed[fmt, algorithm] = (candidate_name(algorithm, fmt), algorithm, fmt, got.seconds, mode, got.sparse)
    formats = dict.fromkeys(fmt for _, fmt, _, _ in priced)
    algorithms = dict.fromkeys(algorithm for algorithm, _, _, _ in priced)
    return candidates + [weighed[fmt, algorithm] for fmt in formats for algorithm in algorithms]


def _pick(
    candidates: Sequence[_Weighed],
    native_weighed: bool,
    model: CostModel,
    exchanges: int,
    factors: Mapping[str, float] | None,
    rounds: int,
    prefer: str | None,
    tried: frozenset[str] | None,
    native_held: bool = False,
    *,
    standing: str | None = None,
) -> tuple[Candidate, dict[str, float]]:
    """The cheapest candidate after the extra exchange rounds (``native_held``: none for the native
    call) and the learned corrections, with the native margin, the sticky preference and trials;
    and every prediction by name."""
    extra = (rounds - 1) * model.exchange_s if rounds > 1 and exchanges else 0.0  # rounds beyond the one counted
    if extra or factors:
        native_extra = 0.0 if native_held else extra  # a held native call makes no exchange
        candidates = [
            (
                name,
                a,
                f,
                (seconds + (native_extra if a == "native" else extra)) * factor_of(factors, name),
                mode,
                sparse,
            )
            for name, a, f, seconds, mode, sparse in candidates
        ]
    best = candidates[0]
    for candidate in candidates[1:]:
        # A plan that sends nothing sparse is a dense collective run by SpCCL's own steps, which
        # NCCL's native one does better: with the native candidate weighed, it never wins.
        dominated = native_weighed and not candidate[5]
        # Leaving native takes a clear predicted win; other ties, up to rounding in the sums, go
        # to the earlier candidate.
        bar = best[3] * ((1 - NATIVE_MARGIN) if best[1] == "native" else (1 - 1e-9))
        if not dominated and candidate[3] < bar:
            best = candidate
    if prefer is not None and prefer != best[0] and STICKY_MARGIN > 0:
        kept = next((c for c in candidates if c[0] == prefer and c[5]), None)
        if kept is not None and kept[1] != "native" and kept[3] * (1 - STICKY_MARGIN) <= best[3]:
            best = kept
    trial = False
    if tried is not None and best[1] != "hierarchical":
        near = [
            c
            for c in candidates
            if c[1] != "hierarchical"
            and c[0] not in tried
            and c[0] != best[0]
            and (c[5] or not native_weighed)
            and (c[3] <= best[3] * (1 + TRIAL_MARGIN) or (c[0] == standing and c[1] != "native"))
        ]
        if near:
            best, trial = min(near, key=lambda c: c[3]), True
    _, algorithm, fmt, seconds, mode, _ = best
    return Candidate(algorithm, fmt, seconds, mode, trial), {c[0]: c[3] for c in candidates}


NATIVE_MARGIN = 0.05
"""A sparse candidate replaces the native collective only when predicted more than this fraction
faster. The model's codec speeds do not depend on sparsity and its fixed costs are fitted, so
near-ties are noise: on 4 H200s a 64 MiB all-gather at 50% sparsity predicted 1% faster than NCCL
measured 10% slower (``bench/bench_bounds.py``, 2026-11-22, before the corrections). It was 0.1
until the corrections priced each candidate from its own observed calls and the native call of a
config that holds native calls at what its held calls take: then a 10% margin kept native where a
sparse candidate ran 10% faster (1 GiB bf16 at 95% on 2 H100s over NVLink: native held at 3.39 ms,
direct/Pici 3.07, its figure 3.09 against native's 3.30; bench/results/2026-11-27_twentysecond/)."""


STICKY_MARGIN = float(os.environ.get("SPCCL_STICKY_MARGIN", "0.05"))
"""A sparse candidate replaces the sparse one the group ran last for such a call (same collective,
size class, element type and config) only when predicted more than this fraction faster
(``SPCCL_STICKY_MARGIN`` overrides; 0 turns it off). Near-ties flip with the noise of the counts from call to call, and a
switch costs the new plan's first run: 2 ranks as 2 emulated nodes, 256 MiB and 1 GiB at 90%,
``auto`` alternated between ring/Pici and direct/Pici every call and ran 1.16-1.17x the better of
the two. With 0.05, ``auto`` was within 10% of the best fixed candidate at 11 of 12 sweep points
against 10 of 12 without, 4 ranks on one machine, and at 12 of 12 with 2 ranks
(``bench/results/2026-11-26_wire/sticky``). The native call replaces it on the same terms: on 2
H100s over NVLink, a 1 GiB fp32 all-reduce at 95% sat where the model priced direct/Pici about 10%
below native, and ``auto`` went back and forth between the two (native then held, under
``check_calls="first"``): 2.95 ms median against direct/Pici's 2.66 ms alone
(``bench/results/2026-11-26_tenth/``). The native call itself is never held on to this way: a
sparse candidate replaces it when predicted :data:`NATIVE_MARGIN` faster."""


TRIAL_MARGIN = 0.25
"""A candidate predicted within this fraction above the choice, and not yet run
:data:`~.feedback.TRIAL_RUNS` times at the call's density octave, is run instead (a trial) until
it has been: the model's errors inside :data:`~.feedback.FAR` are never corrected, so near-ties can
be misordered, and a candidate never run is never observed. That holds for the native call too, on
either side of the tie:

- 4 ranks as 4 emulated nodes on one H100, 256 MiB at 99% (2026-11-26): direct/COO was priced 2%
  above direct/Pici and took 0.85x its time.
- 2 H100s over NVLink, 1 GiB bf16 at 99.9% (27d88b2, when native was neither tried nor left for a
  trial): direct/Pici was priced 0.98x the native call, native was held, and direct/Pici took
  0.81x its time.
- The same at 90% (9f449d7, native left for trials but never tried): native, never run at bf16 and
  1 GiB, was priced from the probe's smaller calls about 1.2x what it took; direct/Pici ran
  instead, 1.15x native's time.

The sparse candidate the group ran last (``prefer``, a standing choice from another density) is
tried at a density octave where it has never run :data:`~.feedback.TRIAL_RUNS` times, however far
it is priced (``standing``: :meth:`.feedback.Corrections.ran_at`, which, unlike ``tried``, forgets
no run, so the trial does not come back every :data:`~.feedback.REFRESH_CALLS` calls): a trial
there can make another candidate the choice on its observed figure while the standing one is
priced from figures of other densities, and then it would be left unseen. 2 H100s over NVLink,
1 GiB fp32 at 99.9% (5d3514a): direct/Pici, run at 99%, was priced 3.13 ms from what its kind
learned at 90-99%, direct/COO's trial measured 2.41 ms and became the choice (2.21 ms) past the
margin, and ``auto`` ran direct/COO at 1.11x direct/Pici's 2.05 ms. (At 92a1698 that point ran
direct/Pici from its first call, priced cheapest there; no measured call has fired this rule yet:
``bench/results/2026-11-27_twentyfourth/``.)

A trial costs at most :data:`~.feedback.TRIAL_RUNS` calls per candidate, density octave, size
class and element type (one more where it includes its kind's warm-up), each predicted at most
this fraction slower than the choice, or the standing choice. The hierarchical call is neither
tried nor left for a trial (its steps choose their own)."""


def _gather_modes(setting: str, fmt: Format) -> tuple[str, ...]:
    # "bound" first, so it wins ties (one synchronisation fewer); a dense gather needs no counts.
    if fmt is Format.DENSE or setting == "bound":
        return ("bound",)
    if setting == "measured":
        return ("measured",)
    return ("bound", "measured")


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
    tried: frozenset[str] | None = None,
    standing: str | None = None,
) -> tuple[Candidate, dict[str, float]]:
    """:func:`weigh` on the summary rounded to 1/16 of an octave of density
    (:meth:`~.summary.CountSummary.rounded`), its pricing memoised (:func:`priced`): calls with the
    same sparsity profile (every training step, every benchmark repetition) only pick."""
    weighing = priced(config, fingerprint, summary, dtype, model, exchanges, default_group, rings)
    return weighing.pick(model, exchanges, factors, rounds, prefer, tried, standing)


def priced(
    config: CollectiveConfig,
    fingerprint: str,
    summary: CountSummary,
    dtype: torch.dtype,
    model: CostModel,
    exchanges: int = 1,
    default_group: bool = False,
    rings: bool = True,
) -> Weighing:
    """:func:`price` on the summary rounded to 1/16 of an octave of density, memoised.

    ``fingerprint`` is ``config.fingerprint()`` plus anything else the cost model depends on
    (the device type, for the default model, ``default_group``, the exchange protocol). The
    pricing is a pure function of the rounded summary, so ranks agree whatever each rank's memo holds.
    """
    rounded = summary.rounded(DENSITY_STEPS_PER_OCTAVE)
    layout = summary.layout
    key = (
        summary.collective,
        fingerprint,
        exchanges,
        dtype,
        layout.numel,
        layout.world,
        layout.channels,
        summary.topology,
        rings,
        rounded.key(),
    )
    hit = _decisions.get(key)
    if hit is None:
        hit = _decisions.put(key, price(rounded, config, dtype, model, exchanges, default_group, rings))
    return hit


def clear_decisions(curves: bool = False) -> None:
    """Forget every memoised decision, and (``curves``) the hierarchical steps' weighings at every
    density (:func:`.hierarchical.predict`'s curves, which depend on no sparsity profile): for
    measurements of the weighing itself."""
    clear_memos("decisions", *(["hierarchical curves"] if curves else []))


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
    """Rank ``rank``'s plan of ``candidate`` from the counts (or bounds: ``counts.exact``) it was
    given (an all-reduce: its reduce-scatter phase): the messages it sends and receives
    (:mod:`.rank_plan`). A ring needs the whole table (the table protocol)."""
    if candidate.algorithm == "native":
        return None
    th = config.thresholds.resolve(candidate.format)
    fmt, algorithm = candidate.format, candidate.algorithm
    if collective == "all_gather":
        return plan_all_gather_for(
            rank, counts.gathered, layout, dtype, fmt=fmt, algorithm=algorithm, threshold=th.ag, topology=topology,
            measured=counts.exact,
        )  # fmt: skip
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
            exact=counts.exact,
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
        exact=counts.exact,
    )
