"""Sparsity thresholds: at or below them a message travels dense (link-aware in reduction steps,
phase-aware in gather steps). A leaf module: the planners and the config both read it."""

from __future__ import annotations

import dataclasses
import functools

from ..formats import Format

__all__ = ["Thresholds", "ResolvedThresholds", "DEFAULT_THRESHOLDS"]


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedThresholds:
    """Thresholds with every value filled in for one format (what the planner uses)."""

    intra: float
    """Reduction steps over an intra-node hop travel dense when sparsity <= this."""
    inter: float
    """Reduction steps over an inter-node hop travel dense when sparsity <= this."""
    ag: float
    """All-gather messages (and the all-reduce gather phase) travel dense when sparsity <= this."""


DEFAULT_THRESHOLDS: dict[Format, ResolvedThresholds] = {
    Format.PICI: ResolvedThresholds(intra=0.6, inter=0.5, ag=0.1),
    Format.COO: ResolvedThresholds(intra=0.8, inter=0.7, ag=0.5),
}
"""The SpCCL paper's tuned thresholds (fp32, Perlmutter A100s): Pici 0.6 / 0.5 / 0.1, COO 0.8 / 0.7 / 0.5."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    """Sparsity thresholds at or below which a message travels dense; ``None`` = the format's default.

    A threshold is a sparsity (fraction of zeros, 0 to 1). The defaults are the paper's
    (:data:`DEFAULT_THRESHOLDS`): Pici ``intra=0.6, inter=0.5, ag=0.1``, COO ``0.8, 0.7, 0.5``.
    """

    intra: float | None = None
    """Link-aware threshold of reduction steps whose hop stays inside a node (NVLink)."""
    inter: float | None = None
    """Link-aware threshold of reduction steps whose hop crosses nodes (the network)."""
    ag: float | None = None
    """Phase-aware threshold of all-gather messages: all-gather, and all-reduce after its
    reduce-scatter phase, where data no longer fills in, so sparse pays off at lower sparsity."""

    def __post_init__(self) -> None:
        for name in ("intra", "inter", "ag"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"thresholds.{name}={value!r} is not a sparsity in [0, 1]; a message travels dense when its "
                    f"sparsity is at or below the threshold (None keeps the format's default)"
                )

    def resolve(self, fmt: Format | str) -> ResolvedThresholds:
        """Fill the unset thresholds with ``fmt``'s defaults (dense uses Pici's, which it ignores)."""
        return _resolve(self, Format(fmt))


@functools.lru_cache(maxsize=256)
def _resolve(thresholds: Thresholds, fmt: Format) -> ResolvedThresholds:
    base = DEFAULT_THRESHOLDS.get(fmt, DEFAULT_THRESHOLDS[Format.PICI])
    return ResolvedThresholds(
        intra=base.intra if thresholds.intra is None else float(thresholds.intra),
        inter=base.inter if thresholds.inter is None else float(thresholds.inter),
        ag=base.ag if thresholds.ag is None else float(thresholds.ag),
    )
