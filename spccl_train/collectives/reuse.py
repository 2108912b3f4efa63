"""Plans reused across exchanged calls: a call whose counts fit the last plan runs it again.

An exchanged call (the table protocol: every rank holds every rank's counts) used to summarise,
weigh and plan from its exact counts every time: on a 2-H100 host 0.47 ms of Python and numpy per
256 MiB all-reduce, while the GPU waited (NCCL's whole call takes about 1 ms). Instead, each call
shape plans from *bounds*: its counts with headroom (:func:`headroom`), and keeps the bounds
with the priced candidates and the plans made from them (0.09 ms per call that reuses them). The next call whose counts
all fit under those bounds, and lie not far below them (:func:`fits`), runs the same decision and
plans; the executors' per-plan preparation is memoised on the plans' messages too. So a repeated
call (every training step, every benchmark repetition) costs the exchange and the launches.

What it costs: messages are sized for the bounds, not the counts. A sparse payload's values part
is at most ``HEADROOM`` (1/64) of its count larger, plus four standard deviations of an
independent count and 16 elements; a piece that is reused stays within ``LOOSE`` of its count
before it is planned again. The candidates are priced on the counts that made the bounds (a
piece of a few hundred nonzeros gets a fifth more room, which would tip near-ties), and reused
while later counts fit: within a few percent of those counts from a few thousand nonzeros per
piece up, where :func:`~.choice.priced` rounds to 1/16 of an octave anyway; a piece of a hundred
fits from about 60 to 160 (the square-root and constant terms), where its bytes barely weigh
against a call's fixed costs.

Every rank exchanged the same table and the store is its group's (:class:`.state.GroupState`),
changed only by that group's calls, which every rank makes in the same order: every rank reuses
and replans alike, and their plans stay equal. The store is not a memo (:func:`.state.clear_memos`
leaves it): forgetting it on one rank alone would part the ranks' plans. Only the table protocol
(under 32 ranks) reuses: the scalable one gives no rank the whole table.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from .chunking import ChunkLayout, piece_arrays

if TYPE_CHECKING:  # (the group state holds a store, and the choice module imports the state)
    from ..formats import Format
    from .choice import Weighing
    from .exchange import Counts

__all__ = ["HEADROOM", "LOOSE", "PlanStore", "Reused", "fits", "headroom", "limits_of"]

HEADROOM = 1 / 64
"""New bounds: each count ``c`` plus ``c * HEADROOM + 4 sqrt(c) + 16`` (at most its piece's size),
so that the next calls' counts, which vary (by about ``sqrt(c)`` for independent nonzeros), fit."""

LOOSE = 4 * HEADROOM
"""Reused bounds may exceed a count by up to ``c * LOOSE + 8 sqrt(c) + 32``: a call whose data
grew sparser by more replans, so that its messages are not sized for a density it has left."""

MAX_SHAPES = 256
"""Call shapes a group remembers; then it forgets them all (every rank alike: the same calls)."""


def limits_of(collective: str, layout: ChunkLayout) -> np.ndarray:
    """The size of every piece a count table entry counts, in the table's shape ``(world, world *
    channels)``; an all-gather's row ``q`` counts rank ``q``'s chunk in its first ``channels``
    entries, and the rest are 0."""
    p, ch = layout.world, layout.channels
    n = piece_arrays(layout)[0]
    if collective == "all_gather":
        out = np.zeros((p, p * ch), dtype=np.int64)
        out[:, :ch] = n
        return out
    return np.broadcast_to(n.reshape(1, p * ch), (p, p * ch))


def headroom(table: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Bounds above every count of ``table`` (see :data:`HEADROOM`), each at most its limit."""
    c = table.astype(np.float64)
    return np.minimum(limits, table + np.ceil(c * HEADROOM + 4 * np.sqrt(c)).astype(np.int64) + 16)


def fits(table: np.ndarray, bounds: np.ndarray) -> bool:
    """Whether ``bounds`` hold every count of ``table`` and none loosely (see :data:`LOOSE`)."""
    if not (table <= bounds).all():
        return False
    c = table.astype(np.float64)
    return bool((bounds <= table + np.ceil(c * LOOSE + 8 * np.sqrt(c)).astype(np.int64) + 32).all())


class Reused:
    """What one call shape last planned: the bounds as counts, the priced candidates, and the
    plans of each candidate run from them (by algorithm, format and gather mode)."""

    __slots__ = ("counts", "weighing", "plans")

    def __init__(self, counts: Counts, weighing: Weighing) -> None:
        self.counts = counts
        """:class:`~.exchange.Counts` of the bounds (their whole table), as this rank plans from them."""
        self.weighing = weighing
        self.plans: dict[tuple[str, Format, str], tuple] = {}

    @property
    def bounds(self) -> np.ndarray:
        """The bounds table, ``(world, world * channels)``."""
        return self.counts.table


class PlanStore:
    """A group's last bounds and plans, by call shape (see the module's text)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[Hashable, Reused] = {}

    def get(self, shape: Hashable, table: np.ndarray) -> Reused | None:
        """What ``shape`` last planned, if its bounds fit ``table`` (:func:`fits`); else ``None``."""
        entry = self._last.get(shape)
        return entry if entry is not None and fits(table, entry.bounds) else None

    def put(self, shape: Hashable, entry: Reused) -> Reused:
        """Remember ``entry`` for ``shape``; returns it."""
        if shape not in self._last and len(self._last) >= MAX_SHAPES:
            self._last.clear()
        self._last[shape] = entry
        return entry
