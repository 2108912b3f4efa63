"""Picking the algorithm and format of one call: every candidate the config allows, planned and priced.

With ``format="auto"`` the candidates are Pici and COO under each allowed algorithm, plus the
native dense ``torch.distributed`` collective, which comes first and keeps the call unless a
sparse candidate is predicted :data:`NATIVE_MARGIN` faster, so ``auto`` never picks what the cost
model predicts slower than dense. A fixed sparse format weighs only
its algorithms; ``format="dense", algorithm="auto"`` is the native call. An all-reduce's gather
phase is looked ahead at in both ways it can be sized (``CollectiveConfig.gather_counts``): from
the bound of the first exchange (:func:`~.plan.bound_reduced_counts`, one synchronisation) or
from a second exchange (:func:`~.plan.estimate_reduced_counts` predicts what it will count);
the cheaper wins. All inputs are equal on every rank, so every rank picks alike.

:func:`decide` is what a call uses: the same choice made from the count table rounded to 1/16
of an octave of density (:func:`quantize_counts`) and memoised, so calls with the same sparsity
profile (every training step, every benchmark repetition) skip the weighing. The decision is a
pure function of the rounded table, so ranks agree whatever their caches hold; the call then
plans the chosen candidate from its exact counts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..formats import Format
from . import hierarchical
from .chunking import ChunkLayout
from .config import CollectiveConfig
from .cost import CostModel
from .feedback import factor_of
from .plan import Plan, bound_reduced_counts, estimate_reduced_counts, plan_all_gather, plan_reduce_scatter
from .topology import Topology

__all__ = ["Candidate", "choose", "decide", "plan_candidate", "quantize_counts", "clear_decisions"]


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One way to run a call, with its predicted time."""

    algorithm: str
    """``"native"``, ``"ring"``, ``"direct"`` or ``"hierarchical"``."""
    format: Format
    """The sparse format its plan may use (``DENSE`` for native)."""
    plan: Plan | None
    """Its plan (an all-reduce: the reduce-scatter phase only); ``None`` for native and hierarchical
    (whose steps plan themselves)."""
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
    counts: Sequence[Sequence[int]],
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    model: CostModel,
    exchanges: int = 1,
    factors: Mapping[str, float] | None = None,
    default_group: bool = False,
) -> tuple[Candidate, dict[str, float]]:
    """Weigh the candidates ``config`` allows; return the cheapest and every prediction by name.

    Args:
        collective: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        config: the call's config (format, algorithm, thresholds, gather_counts).
        counts: the exchanged table: ``counts[q]`` is rank ``q``'s ``world * channels`` per-piece
            nonzero counts (for an all-gather only the first ``channels``, its input's, are used).
        layout, dtype, topology: the call's chunks, element type and nodes.
        model: the cost model.
        exchanges: planning exchanges (each with its count pass) every candidate pays: 1, or 0
            for a call planned from bounds; an all-reduce that measures its gather phase adds one.
        factors: corrections learned from observed calls (:meth:`.feedback.Corrections.factors_for`):
            each candidate's prediction is multiplied by :func:`.feedback.factor_of`.
        default_group: the call is on the default group, so an all-reduce across nodes may weigh
            the hierarchical one (:mod:`.hierarchical`; its subgroups are made from that group).
    """
    native_only = config.format == "dense" and config.algorithm == "auto"
    candidates: list[Candidate] = []
    native_weighed = config.format == "auto" or native_only
    if native_weighed:
        predicted = model.predict_native(collective, layout.numel, dtype, topology, exchanges)
        candidates.append(Candidate("native", Format.DENSE, None, predicted))
    if not native_only:
        formats = [Format.PICI, Format.COO] if config.format == "auto" else [Format(config.format)]
        algorithms = ["ring", "direct"] if config.algorithm == "auto" else [config.algorithm]
        for fmt in formats:
            th = config.thresholds.resolve(fmt)
            for algorithm in algorithms:
                plan = plan_candidate(
                    Candidate(algorithm, fmt, None, 0.0), collective, config, counts, layout, dtype, topology
                )
                if collective != "all_reduce":
                    candidates.append(Candidate(algorithm, fmt, plan, model.predict(plan, exchanges)))
                    continue
                best_gather: tuple[float, str] | None = None
                for mode in _gather_modes(config.gather_counts, fmt):
                    reduced = (
                        bound_reduced_counts(counts, layout)
                        if mode == "bound"
                        else estimate_reduced_counts(counts, layout)
                    )
                    ahead = plan_all_gather(
                        reduced,
                        layout,
                        dtype,
                        fmt=fmt,
                        algorithm=algorithm,
                        threshold=th.ag,
                        topology=topology,
                        collective=collective,
                        measured=False,
                    )
                    predicted = model.predict(plan.then(ahead), exchanges + (mode == "measured"))
                    if best_gather is None or predicted < best_gather[0]:
                        best_gather = (predicted, mode)
                candidates.append(Candidate(algorithm, fmt, plan, best_gather[0], best_gather[1]))
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
            predicted, sparse = hierarchical.predict(config, counts, layout, dtype, topology, model, choose)
            if sparse:
                extra = model.planning(collective, layout.numel, dtype, topology.world, 1)
                fmt = Format.PICI if config.format == "auto" else Format(config.format)
                candidates.append(Candidate("hierarchical", fmt, None, predicted + extra))
    if factors:
        candidates = [
            dataclasses.replace(c, predicted_s=c.predicted_s * factor_of(factors, c.name)) for c in candidates
        ]
    best = candidates[0]
    for candidate in candidates[1:]:
        # A plan that sends nothing sparse is a dense collective run by SpCCL's own steps, which
        # NCCL's native one does better: with the native candidate weighed, it never wins.
        dominated = (
            native_weighed and candidate.plan is not None and not any(m.sparse for m in candidate.plan.messages())
        )
        # Leaving native takes a clear predicted win; other ties, up to rounding in the sums, go
        # to the earlier candidate.
        bar = best.predicted_s * ((1 - NATIVE_MARGIN) if best.algorithm == "native" else (1 - 1e-9))
        if not dominated and candidate.predicted_s < bar:
            best = candidate
    return best, {c.name: c.predicted_s for c in candidates}


NATIVE_MARGIN = 0.1
"""A sparse candidate replaces the native collective only when predicted more than this fraction
faster. The model's codec speeds do not depend on sparsity and its fixed costs are fitted, so
near-ties are noise: on 4 H200s a 64 MiB all-gather at 50% sparsity predicted 1% faster than NCCL
measured 10% slower (``bench/bench_bounds.py``, 2026-11-22)."""


def _gather_modes(setting: str, fmt: Format) -> tuple[str, ...]:
    # "bound" first, so it wins ties (one synchronisation fewer); a dense gather needs no counts.
    if fmt is Format.DENSE or setting == "bound":
        return ("bound",)
    if setting == "measured":
        return ("measured",)
    return ("bound", "measured")


DENSITY_STEPS_PER_OCTAVE = 16
"""Resolution of :func:`quantize_counts`: densities within 2**(1/16) (4.4%) share a decision."""
_MAX_DECISIONS = 1024
_decisions: dict[tuple, tuple[Candidate, dict[str, float]]] = {}


def quantize_counts(counts: Sequence[Sequence[int]], layout: ChunkLayout, collective: str) -> list[list[int]]:
    """``counts`` with every density rounded to 1/16 of an octave (empty and full pieces kept exact).

    A count ``0 < x < n`` of a piece of ``n`` elements becomes ``round(n * 2**(-j/16))`` for the
    nearest ``j`` (``j = round(-16 log2(x / n))``), clamped to ``[1, n - 1]``. For an all-gather
    only each row's first ``channels`` counts (rank ``q``'s pieces of chunk ``q``) are kept.
    """
    return _quantized(counts, layout, collective).tolist()


def _quantized(counts: Sequence[Sequence[int]], layout: ChunkLayout, collective: str) -> np.ndarray:
    """:func:`quantize_counts` as an int64 array, vectorised: per distinct piece size, the level
    of each count is found by integer-exact comparisons with that size's precomputed boundaries,
    so the work is a few array passes over the table, not a Python call per count."""
    table = np.asarray(counts, dtype=np.int64)
    if collective == "all_gather":
        table = table[:, : layout.channels]
        sizes = np.array([[span.numel for span in layout.pieces[q]] for q in range(len(table))], dtype=np.int64)
    else:
        every = np.array([span.numel for chunk in layout.pieces for span in chunk], dtype=np.int64)
        sizes = np.broadcast_to(every, table.shape)
    out = table.copy()
    inner = (table > 0) & (table < sizes)
    for n in np.unique(sizes[inner]).tolist():
        where = inner & (sizes == n)
        ascending, levels = _levels(n)
        # j = how many boundaries b_k (decreasing in k) are >= x: the nearest level's index
        j = len(ascending) - np.searchsorted(ascending, table[where], side="left")
        out[where] = levels[j]
    return out


@functools.lru_cache(maxsize=64)
def _levels(n: int) -> tuple[np.ndarray, np.ndarray]:
    """For pieces of ``n`` elements: the boundaries ``n 2**(-(k + 1/2)/16)`` between levels ``k``
    and ``k + 1``, ascending, and each level's count ``round(n 2**(-j/16))`` clamped to [1, n - 1]."""
    steps = DENSITY_STEPS_PER_OCTAVE
    top = math.ceil(steps * math.log2(n)) + 2  # levels 0..top cover counts down to 1
    bounds = np.array([n * 2.0 ** (-(k + 0.5) / steps) for k in range(top)])
    levels = np.array([min(n - 1, max(1, round(n * 2.0 ** (-j / steps)))) for j in range(top + 1)], dtype=np.int64)
    return bounds[::-1].copy(), levels


def decide(
    collective: str,
    config: CollectiveConfig,
    fingerprint: str,
    counts: Sequence[Sequence[int]],
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    model: CostModel,
    exchanges: int = 1,
    factors: Mapping[str, float] | None = None,
    default_group: bool = False,
) -> tuple[Candidate, dict[str, float]]:
    """:func:`choose` on the :func:`quantize_counts` of ``counts``, memoised; the candidate comes without a plan.

    ``fingerprint`` is ``config.fingerprint()`` plus anything else the cost model depends on
    (the device type, for the default model, and ``default_group``). Equal on every rank for equal tables, whatever
    each rank's memo holds.
    """
    rounded = _quantized(counts, layout, collective)
    corrected = tuple(sorted(factors.items())) if factors else ()
    key = (
        collective,
        fingerprint,
        exchanges,
        dtype,
        layout.numel,
        layout.world,
        layout.channels,
        corrected,
        rounded.shape,
        rounded.tobytes(),
    )
    hit = _decisions.get(key)
    if hit is None:
        if len(_decisions) >= _MAX_DECISIONS:
            _decisions.clear()  # a pure memo: forgetting only costs a recomputation
        table = rounded.tolist()
        best, weighed = choose(
            collective, config, table, layout, dtype, topology, model, exchanges, factors, default_group
        )
        hit = _decisions[key] = (dataclasses.replace(best, plan=None), weighed)
    return hit


def clear_decisions() -> None:
    """Forget every memoised decision (for measurements of the weighing itself)."""
    _decisions.clear()


def plan_candidate(
    candidate: Candidate,
    collective: str,
    config: CollectiveConfig,
    counts: Sequence[Sequence[int]],
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
) -> Plan | None:
    """The plan of ``candidate`` from the exact ``counts`` (an all-reduce: its reduce-scatter phase)."""
    if candidate.algorithm == "native":
        return None
    th = config.thresholds.resolve(candidate.format)
    if collective == "all_gather":
        ch = layout.channels
        return plan_all_gather(
            [row[:ch] for row in counts],
            layout,
            dtype,
            fmt=candidate.format,
            algorithm=candidate.algorithm,
            threshold=th.ag,
            topology=topology,
        )
    return plan_reduce_scatter(
        counts,
        layout,
        dtype,
        fmt=candidate.format,
        algorithm=candidate.algorithm,
        thresholds=th,
        topology=topology,
        collective=collective,
    )
