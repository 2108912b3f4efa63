"""Picking the algorithm and format of one call: every candidate the config allows, planned and priced.

With ``format="auto"`` the candidates are Pici and COO under each allowed algorithm, plus the
native dense ``torch.distributed`` collective, which comes first and wins ties, so ``auto``
never picks what the cost model predicts slower than dense. A fixed sparse format weighs only
its algorithms; ``format="dense", algorithm="auto"`` is the native call. An all-reduce's gather
phase is looked ahead at with :func:`~.plan.estimate_reduced_counts`, since its real counts come
from a second exchange. All inputs are equal on every rank, so every rank picks alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..formats import Format
from .chunking import ChunkLayout
from .config import CollectiveConfig
from .cost import CostModel
from .plan import Plan, estimate_reduced_counts, plan_all_gather, plan_reduce_scatter
from .topology import Topology

__all__ = ["Candidate", "choose"]


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One way to run a call, with its predicted time."""

    algorithm: str
    """``"native"``, ``"ring"`` or ``"direct"``."""
    format: Format
    """The sparse format its plan may use (``DENSE`` for native)."""
    plan: Plan | None
    """Its plan (an all-reduce: the reduce-scatter phase only); ``None`` for native."""
    predicted_s: float
    """The cost model's prediction, planning exchanges included."""

    @property
    def name(self) -> str:
        """``"algorithm/format"``, e.g. ``"ring/pici"``."""
        return f"{self.algorithm}/{self.format.value}"


def choose(
    collective: str,
    config: CollectiveConfig,
    counts: Sequence[Sequence[int]],
    layout: ChunkLayout,
    dtype: torch.dtype,
    topology: Topology,
    model: CostModel,
) -> tuple[Candidate, dict[str, float]]:
    """Weigh the candidates ``config`` allows; return the cheapest and every prediction by name.

    Args:
        collective: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        config: the call's config (format, algorithm, thresholds).
        counts: the exchanged table: ``counts[q]`` is rank ``q``'s ``world * channels`` per-piece
            nonzero counts (for an all-gather only the first ``channels``, its input's, are used).
        layout, dtype, topology: the call's chunks, element type and nodes.
        model: the cost model.
    """
    ch = layout.channels
    native_only = config.format == "dense" and config.algorithm == "auto"
    candidates: list[Candidate] = []
    if config.format == "auto" or native_only:
        predicted = model.predict_native(collective, layout.numel, dtype, topology)
        candidates.append(Candidate("native", Format.DENSE, None, predicted))
    if not native_only:
        formats = [Format.PICI, Format.COO] if config.format == "auto" else [Format(config.format)]
        algorithms = ["ring", "direct"] if config.algorithm == "auto" else [config.algorithm]
        for fmt in formats:
            th = config.thresholds.resolve(fmt)
            for algorithm in algorithms:
                if collective == "all_gather":
                    plan = plan_all_gather(
                        [row[:ch] for row in counts],
                        layout,
                        dtype,
                        fmt=fmt,
                        algorithm=algorithm,
                        threshold=th.ag,
                        topology=topology,
                    )
                    predicted = model.predict(plan)
                else:
                    plan = plan_reduce_scatter(
                        counts,
                        layout,
                        dtype,
                        fmt=fmt,
                        algorithm=algorithm,
                        thresholds=th,
                        topology=topology,
                        collective=collective,
                    )
                    if collective == "all_reduce":
                        ahead = plan_all_gather(
                            estimate_reduced_counts(counts, layout),
                            layout,
                            dtype,
                            fmt=fmt,
                            algorithm=algorithm,
                            threshold=th.ag,
                            topology=topology,
                            collective=collective,
                            measured=False,
                        )
                        exchanges = 1 if fmt is Format.DENSE else 2
                        predicted = model.predict(plan.then(ahead), exchanges=exchanges)
                    else:
                        predicted = model.predict(plan)
                candidates.append(Candidate(algorithm, fmt, plan, predicted))
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate.predicted_s < best.predicted_s:
            best = candidate
    return best, {c.name: c.predicted_s for c in candidates}
