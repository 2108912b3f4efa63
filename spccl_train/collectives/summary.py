"""What ``auto`` weighs: a few numbers per rank summarising the count table, and the model's time from them.

Weighing a candidate from its plan walks every message of every rank: O(world^2 x channels)
Python work per candidate, 190 ms at 64 ranks and about 50 s at 1024 (``bench/bench_planning.py``,
2026-11-25). :class:`CountSummary` keeps what the cost model needs, O(world x channels)
integers, equal on every rank:

- ``sent[h, q]`` / ``received[h, q]``: the nonzeros rank ``q`` sends to the other ranks' chunks
  (receives from the other ranks for its own chunk), over hops of kind ``h`` (0: inside its node,
  1: across nodes): a direct reduce-scatter's traffic per rank;
- ``ring[k]``: the most nonzeros the other ranks hold of piece ``k`` of one chunk (the densest
  chunk's), over ``world - 1`` the mean contribution of a ring step: the ring's fill-in;
- ``bound[c, k]``: most nonzeros piece ``k`` of chunk ``c`` can hold after the sum,
  ``min(n, sum over ranks)`` (an all-gather: rank ``c``'s own count);
- ``estimate[c, k]``: what it is expected to hold, ``n (1 - prod_q (1 - d_q))`` (independent
  supports), capped by the bound;
- ``held[q]``: rank ``q``'s nonzeros (the hierarchical all-reduce's prediction).

From these, :func:`predict` times a candidate step by step as :class:`~.cost.CostModel` times a
plan (``CostModel.predict``, which stays the reference), with O(world x channels) array work:

- a **direct all-gather** step (an all-gather; an all-reduce's gather phase) exactly: every
  payload is known from ``bound`` / ``estimate``;
- a **direct reduce-scatter** step per rank from its ``sent`` and ``received`` of each hop kind,
  as if its messages of that kind were equally dense (mean field: exact for equal pieces of
  i.i.d. data, within the 16-byte alignment of each message);
- a **ring** step from the densest chunk: the payload of step ``s`` of a reduce-scatter holds
  ``s + 1`` mean contributions (capped by ``n``; sparsity extrapolated as
  ``sigma^(s+1)``), sent over the slowest hop kind the ring uses; an all-gather's payloads are the
  largest of ``bound``. An upper bound of the reference's slowest rank.

How the summary is made, and what it costs: :meth:`CountSummary.of` reduces the exchanged table
(O(world^2 x channels) integer sums, numpy: 0.05 ms at 64 ranks, a few ms at 1024), then every
candidate is weighed from the summary alone. Integer sums are exact, so every rank holds the
same summary; the float steps are elementwise or ordered the same on every rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..formats import COO_HEADER_BYTES, Format, align16
from ..formats.layout import element_size, pici_metadata_bytes_of
from .chunking import ChunkLayout, piece_arrays
from .cost import CostModel
from .plan import PADDED_GATHER_SLACK, sparsities
from .state import Memo
from .topology import Topology

__all__ = [
    "DENSITY_STEPS_PER_OCTAVE",
    "CountSummary",
    "Prediction",
    "count_levels",
    "density_octave",
    "predict",
    "predict_variants",
    "round_count",
    "table_octave",
]

_INTRA, _INTER = 0, 1


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Geometry:
    """What the layout and topology fix: piece sizes, and elements and messages per rank and hop kind."""

    n: np.ndarray
    """``n[c, k]``: elements of piece ``k`` of chunk ``c``."""
    elems: np.ndarray
    """``elems[d, h, q]``: elements rank ``q`` sends (``d = 0``) to, or receives (``d = 1``) from,
    the other ranks over hop kind ``h``: a direct reduce-scatter's both directions in one array."""
    msgs: np.ndarray
    """The same in messages (nonempty pieces)."""
    meta: np.ndarray
    """The same in Pici metadata bytes (a message's fixed cost)."""
    kinds: tuple[int, ...]
    """Hop kinds a ring step uses (0: inside a node, 1: across nodes)."""
    ring_pairs: tuple[tuple[int, int], ...]
    """The (sending hop, receiving hop) kinds the ranks of a ring have: rank ``q`` sends to
    ``q + 1`` and receives from ``q - 1``."""
    peers: np.ndarray
    """``peers[h, q]``: other ranks of hop kind ``h`` from rank ``q``."""
    waves: int
    """Piece indices a chunk has: a direct step's exchanges."""


@functools.lru_cache(maxsize=64)
def _geometry(layout: ChunkLayout, topology: Topology) -> _Geometry:
    p = layout.world
    n = piece_arrays(layout)[0]
    meta = np.where(n > 0, pici_metadata_bytes_of(n), 0).sum(1)  # per chunk, all its pieces
    # every rank holds all of every chunk: its elements, messages and metadata per hop kind, both directions
    elems, msgs, meta = (
        np.stack(_by_kind(np.broadcast_to(per_chunk, (p, p)), topology))
        for per_chunk in (n.sum(1), (n > 0).sum(1), meta)
    )
    rpn = topology.ranks_per_node
    local = p if rpn is None else min(rpn, p)
    kinds = tuple(h for h, used in ((_INTRA, local > 1), (_INTER, topology.nodes > 1)) if used)
    hop = [int(topology.is_inter(q, (q + 1) % p)) for q in range(p)]
    ring_pairs = tuple(sorted({(hop[q], hop[q - 1]) for q in range(p)}))
    same = np.array([min(local, p - (q // local) * local) - 1 for q in range(p)], dtype=np.int64)
    peers = np.stack([same, p - 1 - same])
    waves = int((n > 0).sum(1).max()) if layout.channels > 1 else 1
    return _Geometry(n, elems, msgs, meta, kinds, ring_pairs, peers, waves)


def _by_kind(per_pair: np.ndarray, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """``per_pair[..., q, c]`` (what rank ``q`` holds of chunk ``c``) summed per hop kind, own chunk
    left out: ``(sent[..., h, q], received[..., h, c])``."""
    p = per_pair.shape[-1]
    own = np.diagonal(per_pair, axis1=-2, axis2=-1)
    out_total, in_total = per_pair.sum(-1) - own, per_pair.sum(-2) - own
    rpn = topology.ranks_per_node
    if rpn is None or rpn >= p:
        out_same, in_same = out_total, in_total
    else:
        starts, ranks = np.arange(0, p, rpn), np.arange(p)
        node = ranks // rpn
        out_same = np.add.reduceat(per_pair, starts, axis=-1)[..., ranks, node] - own
        in_same = np.add.reduceat(per_pair, starts, axis=-2)[..., node, ranks] - own
    return np.stack([out_same, out_total - out_same], axis=-2), np.stack([in_same, in_total - in_same], axis=-2)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CountSummary:
    """The count table of one call reduced to what ``auto`` weighs (see the module docstring)."""

    collective: str
    layout: ChunkLayout
    topology: Topology
    sent: np.ndarray
    """``sent[h, q]``: nonzeros rank ``q`` holds of other ranks' chunks, reached over hop kind ``h``."""
    received: np.ndarray
    """``received[h, c]``: nonzeros the other ranks hold of chunk ``c``, arriving over hop kind ``h``."""
    ring: np.ndarray
    """``ring[k]``: the most nonzeros the other ranks hold of piece ``k`` of one chunk."""
    bound: np.ndarray
    """``bound[c, k]``: most nonzeros of piece ``k`` of chunk ``c`` after the sum (an all-gather: its count)."""
    estimate: np.ndarray
    """``estimate[c, k]``: expected nonzeros after the sum (independent supports); an all-gather: ``bound``."""
    held: np.ndarray
    """``held[q]``: rank ``q``'s nonzeros (an all-gather: of its input)."""

    @property
    def density(self) -> np.ndarray:
        """``density[q]``: rank ``q``'s nonzeros over the elements it holds."""
        return self.held / max(1, _held_elements(self.collective, self.layout))

    @property
    def octave(self) -> int:
        """The ranks' mean density to the nearest octave, ``round(log2(density))``: 0 dense, -7
        at 99% sparsity, -10 at 99.9% (an empty call counts as one nonzero). Where ``auto``'s
        trials are counted (:meth:`.feedback.Corrections.tried`)."""
        return density_octave(self.collective, int(self.held.sum()), self.layout)

    @classmethod
    def of(
        cls, collective: str, table: object, layout: ChunkLayout, topology: Topology, batch: bool = False
    ) -> CountSummary:
        """Summarise an exchanged (or bounds) table: ``table[q]`` is rank ``q``'s ``world * channels``
        piece counts (an all-gather reads each row's first ``channels``). ``batch``: ``table`` has
        leading axes (``[..., world, row]``, an int64 array), a table per index: each array of the
        summary then has the same leading axes, and :func:`predict_variants` weighs them at once."""
        p, ch = layout.world, layout.channels
        counts = np.asarray(table, dtype=np.int64)
        lead = counts.shape[:-2] if batch else ()
        counts = counts.reshape(lead + (p, -1))
        n = _geometry(layout, topology).n
        if collective == "all_gather":
            own = counts[..., :ch]
            zero = np.zeros(lead + (2, p), dtype=np.int64)
            return cls(
                collective, layout, topology, zero, zero, np.zeros(lead + (ch,), np.int64), own, own, own.sum(-1)
            )
        cube = counts[..., : p * ch].reshape(lead + (p, p, ch))
        sent, received = _by_kind(cube.sum(-1), topology)
        column = cube.sum(-3)  # [..., c, k]: every rank's nonzeros of the piece
        ranks = np.arange(p)
        ring = (column - cube[..., ranks, ranks, :]).max(-2)
        bound = np.minimum(n, column)
        # [..., q, c, k] -> [..., c, k], a product in rank order
        expected = np.rint(n * (1.0 - np.prod(sparsities(n, cube), axis=-3))).astype(np.int64)
        estimate = np.minimum(bound, expected)
        held = counts[..., : p * ch].sum(-1)
        return cls(collective, layout, topology, sent, received, ring, bound, estimate, held)

    def rounded(self, steps: int) -> CountSummary:
        """Every count rounded to ``1 / steps`` of an octave of density (empty and full kept exact):
        summaries that round alike are weighed alike (:func:`~.choice.decide` memoises on this)."""
        rounding = _rounding(self.collective, self.layout, self.topology, steps)
        if self.collective == "all_gather":
            bound = rounding.apply(self.bound.ravel()).reshape(self.bound.shape)
            return dataclasses.replace(self, bound=bound, estimate=bound)
        parts = (self.sent, self.received, self.ring, self.bound, self.estimate, self.held)
        flat = rounding.apply(np.concatenate([np.ravel(v) for v in parts]))
        out, at = [], 0
        for v in parts:
            out.append(flat[at : at + v.size].reshape(v.shape))
            at += v.size
        return CountSummary(self.collective, self.layout, self.topology, *out)

    def key(self) -> bytes:
        """The summary's bytes (a memo key, with the call's other inputs)."""
        parts = (self.sent, self.received, self.ring, self.bound, self.estimate, self.held)
        return b"|".join(np.ascontiguousarray(a).tobytes() for a in parts)


def density_octave(collective: str, held: int, layout: ChunkLayout) -> int:
    """:attr:`CountSummary.octave` of a call whose ranks hold ``held`` nonzeros in all."""
    return round(math.log2(max(1, held) / max(1, layout.world * _held_elements(collective, layout))))


def table_octave(collective: str, table: np.ndarray, layout: ChunkLayout) -> int:
    """:attr:`CountSummary.octave` of a count table (as :meth:`CountSummary.of` reads it), without
    the summary."""
    p, ch = layout.world, layout.channels
    held = table[:, :ch] if collective == "all_gather" else table[:, : p * ch]
    return density_octave(collective, int(held.sum()), layout)


def _held_elements(collective: str, layout: ChunkLayout) -> int:
    """Elements one rank holds: its input (an all-gather: one chunk; else the whole tensor)."""
    return layout.numel // layout.world if collective == "all_gather" else layout.numel


@functools.lru_cache(maxsize=64)
def _rounding(collective: str, layout: ChunkLayout, topology: Topology, steps: int) -> _Rounding:
    """The rounding of a summary's counts, concatenated in :meth:`CountSummary.rounded`'s order:
    each against the size it is a part of (an all-gather: its ``bound`` only)."""
    geo = _geometry(layout, topology)
    if collective == "all_gather":
        return _Rounding.of(geo.n.ravel(), steps)
    p = layout.world
    sizes = (
        geo.elems[0],
        geo.elems[1],
        max(1, p - 1) * geo.n.max(0),
        geo.n,
        geo.n,
        np.full(p, _held_elements(collective, layout)),
    )
    return _Rounding.of(np.concatenate([np.ravel(n) for n in sizes]), steps)


class _Rounding:
    """:func:`_round` against fixed sizes, with what depends on the sizes alone made once: each
    size's boundaries rounded down to integers (``b >= x`` exactly when ``floor(b) >= x``), packed
    with the size's index into one sorted int64 array, so a call is one ``searchsorted``."""

    __slots__ = ("sizes", "which", "keys", "levels", "tables", "lists", "shifted", "first", "last")

    @classmethod
    def of(cls, sizes: np.ndarray, steps: int) -> _Rounding:
        self = cls()
        self.sizes = np.asarray(sizes, dtype=np.int64)
        distinct, which = np.unique(self.sizes, return_inverse=True)
        self.which = which.reshape(-1)
        self.tables = [_levels(max(2, size), steps) for size in distinct.tolist()]
        self.lists = (
            self.sizes.tolist(),
            self.which.tolist(),
            [_level_lists(size, steps) for size in distinct.tolist()],
        )
        # Per size n, boundaries with 0 and n - 1 added and levels with n and 0 around them, so a
        # count of 0 or n looks itself up: a count's level is levels[len(floors) - #(floors < count)].
        ends = [
            (np.concatenate([[0], f, [n - 1]]), np.concatenate([[n], lv, [0]]))
            if n > 1
            else (np.zeros(n, np.int64), np.array([n, 0][: n + 1], np.int64))
            for n, (f, lv) in zip(distinct.tolist(), self.tables)
        ]
        shift = int(distinct[-1]).bit_length() + 1
        counts = np.array([len(f) for f, _ in ends])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        level_starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]]).astype(np.int64)
        self.levels = np.concatenate([lv for _, lv in ends])
        packable = shift + len(distinct).bit_length() <= 62
        self.keys = np.concatenate([(i << shift) + f for i, (f, _) in enumerate(ends)]) if packable else None
        # per count: its key's offset, where its size's boundaries start, and its size's first level
        self.shifted = self.which << shift
        self.first = starts[self.which]
        self.last = level_starts[self.which] + counts[self.which]
        return self

    def apply(self, values: np.ndarray) -> np.ndarray:
        """``values`` (int64, one per size, at least 0) rounded."""
        values = np.asarray(values, dtype=np.int64)
        if values.size <= _SMALL:  # a few counts (small groups): numpy's per-call overhead dominates
            sizes, which, tables = self.lists
            return np.array([_look_up(x, n, *tables[w]) for x, n, w in zip(values.tolist(), sizes, which)], np.int64)
        values = np.minimum(values, self.sizes)
        if self.keys is None:  # sizes too large to pack: one size at a time
            inner = (values > 0) & (values < self.sizes)
            out = values.copy()
            x, which = values[inner], self.which[inner]
            for i, (floors, levels) in enumerate(self.tables):
                mine = which == i
                x[mine] = levels[len(floors) - np.searchsorted(floors, x[mine], side="left")]
            out[inner] = x
            return out
        # every count looked up at once
        return self.levels[self.last - (np.searchsorted(self.keys, self.shifted + values) - self.first)]


def _round(values: np.ndarray, sizes: np.ndarray, steps: int) -> np.ndarray:
    """Each count ``0 < x < n`` (``n`` its size, an equally shaped array) to ``round(n 2**(-j/steps))``
    for the nearest ``j`` (``j = round(-steps log2(x / n))``), clamped to ``[1, n - 1]``; empty
    and full stay exact, and a count above its size is the size (the scalable exchange's maxima
    may exceed a shorter chunk's rank's elements: a rank sends no more than it holds).
    Integer-exact (:class:`_Rounding`), so every rank rounds alike whatever its CPU's vector math."""
    values = np.asarray(values, dtype=np.int64)
    return _Rounding.of(np.ravel(sizes), steps).apply(values.ravel()).reshape(values.shape)


_SMALL = 64


DENSITY_STEPS_PER_OCTAVE = 16
"""The grid ``auto`` decides on: densities within 2**(1/16) (4.4%) share a decision
(:func:`~.choice.decide` rounds the summary to it; the hierarchical steps are weighed on it)."""


def round_count(x: int, n: int, steps: int = DENSITY_STEPS_PER_OCTAVE) -> int:
    """One count ``x`` of ``n`` rounded as :func:`_round` rounds it."""
    return _look_up(x, n, *_level_lists(n, steps))


def count_levels(n: int, steps: int = DENSITY_STEPS_PER_OCTAVE) -> list[int]:
    """The values :func:`round_count` can return for size ``n``, ascending (0 and ``n`` included;
    a level that no count rounds to may be among them)."""
    return sorted({0, n, *_level_lists(n, steps)[1]}) if n > 1 else list(range(n + 1))


def _look_up(x: int, n: int, floors: list[int], levels: list[int]) -> int:
    if x <= 0 or x >= n:
        return min(x, n)
    return levels[len(floors) - bisect.bisect_left(floors, x)]


@functools.lru_cache(maxsize=256)
def _level_lists(n: int, steps: int) -> tuple[list[int], list[int]]:
    floors, levels = _levels(max(n, 2), steps)
    return floors.tolist(), levels.tolist()


@functools.lru_cache(maxsize=256)
def _levels(n: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """For size ``n``: the boundaries ``n 2**(-(k + 1/2)/steps)`` between levels ``k`` and ``k + 1``,
    ascending and rounded down to integers, and each level's count ``round(n 2**(-j/steps))``
    clamped to [1, n - 1]. The same integers on every machine: a float lands on the wrong side of
    an integer (or a half) only within an ulp of it, and those few are settled in integers
    (:func:`_floor_power`, :func:`_round_power`), not by the C library's ``pow``."""
    top = steps * n.bit_length() + 2  # levels 0..top cover counts down to 1 (bit_length >= log2 n)
    floors = np.array([_floor_power(n, 2 * k + 1, 2 * steps) for k in range(top)], dtype=np.int64)
    levels = np.array([min(n - 1, max(1, _round_power(n, j, steps))) for j in range(top + 1)], dtype=np.int64)
    return floors[::-1].copy(), levels


_NEAR = 1e-9
"""How close (relative) a float ``n 2**(-a/b)`` may come to where its floor or rounding changes
before :func:`_floor_power` and :func:`_round_power` settle it in integers (a library ``pow`` is
off by an ulp at most, ~1e-16)."""


def _floor_power(n: int, a: int, b: int) -> int:
    """``floor(n 2**(-a/b))``, exact: ``f <= n 2**(-a/b)`` exactly when ``f**b 2**a <= n**b``."""
    x = n * 2.0 ** (-a / b)
    f = math.floor(x)
    if x - f > _NEAR * x and f + 1 - x > _NEAR * x:
        return f
    power = n**b
    while f > 0 and (f**b) << a > power:
        f -= 1
    while ((f + 1) ** b) << a <= power:
        f += 1
    return f


def _round_power(n: int, j: int, s: int) -> int:
    """``round(n 2**(-j/s))``, halves to even as Python's ``round``, exact: ``x >= f + 1/2`` exactly
    when ``(2n)**s >= (2f + 1)**s 2**j``."""
    x = n * 2.0 ** (-j / s)
    f = math.floor(x)
    if abs(x - f - 0.5) > _NEAR * max(x, 1.0):
        return f + (x - f > 0.5)
    f = _floor_power(n, j, s)
    twice, half = (2 * n) ** s, ((2 * f + 1) ** s) << j
    return f + 1 if twice > half else f if twice < half else f + f % 2


class Prediction(NamedTuple):
    """A candidate's predicted seconds, and whether any of its messages would travel sparse."""

    seconds: float
    """(An array over a batch of summaries: :meth:`CountSummary.of`.)"""
    sparse: bool


def predict(
    model: CostModel,
    summary: CountSummary,
    dtype: torch.dtype,
    algorithm: str,
    fmt: Format,
    thresholds,
    exchanges: int,
    gather: str = "",
) -> Prediction:
    """The model's time of a ring or direct candidate of ``summary``'s call.

    ``thresholds``: the format's resolved thresholds. ``gather`` (all-reduce): size the gather
    phase from ``"bound"`` or the ``"measured"`` estimate (which pays a second exchange).
    """
    return predict_variants(model, summary, dtype, algorithm, [(fmt, thresholds, gather)], exchanges)[0]


def predict_variants(
    model: CostModel,
    summary: CountSummary,
    dtype: torch.dtype,
    algorithm: str,
    variants: Sequence[tuple[Format, object, str]],
    exchanges: int,
) -> list[Prediction]:
    """:func:`predict` of each ``(format, thresholds, gather)`` variant of one algorithm.

    A direct algorithm weighs every variant in one pass of array operations (a leading axis of
    variants), each distinct format's reduce-scatter phase once: the cost of a weighing is the
    numpy calls' overhead, not the O(world x channels) arithmetic. A ring weighs them one by one.
    """
    collective, layout = summary.collective, summary.layout
    size = element_size(dtype)
    if layout.world == 1:  # no steps: the planning alone (over a batch, the same for each summary)
        lead = summary.held.shape[:-1]
        return [
            Prediction(np.full(lead, seconds) if lead else seconds, np.zeros(lead, dtype=bool) if lead else False)
            for seconds in (
                model.planning(collective, layout.numel, dtype, 1, exchanges + (g == "measured"))
                for _, _, g in variants
            )
        ]
    planning = {
        mode: model.planning(collective, layout.numel, dtype, layout.world, exchanges + (mode == "measured"))
        for mode in {mode for _, _, mode in variants}
    }
    if algorithm != "ring":
        return _direct_variants(model, summary, size, variants, planning)
    if summary.held.ndim > 1:
        raise ValueError("a ring is weighed one summary at a time, not a batch")
    steps: list[list[tuple]] = [[] for _ in variants]  # per variant: (seconds, sends sparse) per step
    if collective != "all_gather":
        distinct = {fmt: th for fmt, th, _ in variants}
        reduce = dict(zip(distinct, _ring_reduce(model, summary, size, list(distinct), list(distinct.values()))))
        for taken, (fmt, _, _) in zip(steps, variants):
            taken += reduce[fmt]
    if collective != "reduce_scatter":
        sized = [summary.estimate if g == "measured" else summary.bound for _, _, g in variants]
        fmts, taus = [f for f, _, _ in variants], [th.ag for _, th, _ in variants]
        for taken, more in zip(steps, _ring_gather(model, summary, np.stack(sized, axis=-3), size, fmts, taus)):
            taken += more
    out = []
    for (_, _, mode), taken in zip(variants, steps):
        seconds = planning[mode]
        sparse = False
        for step_s, sends in taken:  # in step order
            seconds = seconds + (model.step_s + step_s)
            sparse = sparse | sends
        out.append(Prediction(seconds, sparse))
    return out


def _direct_variants(
    model: CostModel, summary: CountSummary, size: int, variants: Sequence[tuple], planning: dict[str, float]
) -> list[Prediction]:
    """:func:`predict_variants` of the direct algorithm: its reduce-scatter phase (one all-to-all;
    per distinct format) then its gather phase (one all-gather; per variant), each weighed for
    every variant at once; a variant's time adds its planning and then each phase with its step
    cost, in that order (the same floats for a batch, elementwise, as for one summary)."""
    collective = summary.collective
    phases = []  # per phase: ([..., v] seconds, [..., v] sends sparse)
    if collective != "all_gather":
        distinct = {fmt: th for fmt, th, _ in variants}
        seconds, sparse = _direct_reduce(model, summary, size, list(distinct), list(distinct.values()))
        which = [list(distinct).index(fmt) for fmt, _, _ in variants]
        phases.append((seconds[..., which], sparse[..., which]))
    if collective != "reduce_scatter":
        # [..., v, k, c]: a chunk's pieces summed along an outer axis, the cheap way
        both = np.stack((summary.bound, summary.estimate), axis=-3).swapaxes(-1, -2)
        payloads = both[..., [int(mode == "measured") for _, _, mode in variants], :, :]
        fmts, taus = [fmt for fmt, _, _ in variants], [th.ag for _, th, _ in variants]
        phases.append(_direct_gather(model, summary, payloads, size, fmts, taus))
    if phases[0][0].ndim == 1:  # one summary: Python numbers
        phases = [(seconds.tolist(), sparse.tolist()) for seconds, sparse in phases]
    else:  # a batch: a leading axis per variant
        phases = [(np.moveaxis(seconds, -1, 0), np.moveaxis(sparse, -1, 0)) for seconds, sparse in phases]
    out = []
    for v, (_, _, mode) in enumerate(variants):
        seconds, sends = planning[mode], False
        for phase_s, phase_sparse in phases:
            seconds = seconds + (model.step_s + phase_s[v])
            sends = sends | phase_sparse[v]
        out.append(Prediction(seconds, sends))
    return out


_TERMS = Memo("weighing terms", 256)


def _terms(make, geo: _Geometry, model: CostModel, *key):
    """``make(geo, model, *key)``, the arrays a weighing needs that depend on the layout, topology,
    model and ``key`` alone, made once: a weighing's per-call work is then the data-dependent part."""
    full = (make, id(geo), id(model), *key)
    hit = _TERMS.get(full)
    if hit is None or hit[0] is not geo or hit[1] is not model:  # ids of live objects only
        hit = _TERMS.put(full, (geo, model, make(geo, model, *key)))
    return hit[2]


def _codec_rates(model: CostModel, fmts: Sequence[Format], rate: str, axes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per format, its codec's call cost and ``rate``, shaped ``[F, 1, ...]`` with ``axes`` trailing
    axes (a dense format's are unread: it never encodes)."""
    codecs = [model.codec(Format.PICI if f is Format.DENSE else f) for f in fmts]
    shape = (len(fmts),) + (1,) * axes
    calls = np.array([c.call_s for c in codecs]).reshape(shape)
    rates = np.array([getattr(c, rate) for c in codecs]).reshape(shape)
    return calls, rates


def _sparse_cap(sparse: Callable[[np.ndarray], np.ndarray], most: np.ndarray) -> np.ndarray:
    """Per element, the largest count ``0 <= x <= most`` with ``sparse(x)``, or -1 if there is
    none: ``sparse`` must be true up to some count and false above it (a sparsity falls and a
    payload grows with the count), so a weighing tests ``count <= cap`` in one comparison, with
    the bits of the tests it replaces. A bisection over whole arrays: O(log most) calls."""
    low = np.full(np.shape(most), -1, dtype=np.int64)  # sparse at low (or low = -1)
    high = np.asarray(most, dtype=np.int64) + 1  # not sparse at high (or high = most + 1)
    while True:
        open_ = high - low > 1
        if not open_.any():
            return low
        mid = np.where(open_, (low + high) // 2, low.clip(0))
        ok = sparse(mid)
        low = np.where(open_ & ok, mid, low)
        high = np.where(open_ & ~ok, mid, high)


class _ReduceTerms(NamedTuple):
    base: np.ndarray
    """``[f, d, h, q]``: the payloads' bytes besides their values and COO indices: Pici metadata, or COO headers."""
    coo_msgs: np.ndarray | None
    """``[f, d, h, q]``: a COO format's messages (0 for Pici), each with its indices padded to 16
    bytes (``None``: no COO format)."""
    per: np.ndarray
    """Messages, at least 1 (a divisor)."""
    per_less_1: np.ndarray
    """``per - 1``: what a division rounding up adds."""
    dense_bytes: np.ndarray
    cap: np.ndarray
    """``[f, d, h, q]``: the most nonzeros that still go sparse (-1: none do): :func:`_sparse_cap`
    of the sparsity and payload tests."""
    msgs_per_bandwidth: np.ndarray
    """``[d, h, q]``: messages over the hop kind's bandwidth (seconds per byte of each message)."""
    codec: tuple[np.ndarray, np.ndarray]
    """``[f, d, h, q]`` and ``[d, h, q]``: seconds of encoding what a rank sends (``d = 0``) and
    accumulating what it receives (``d = 1``) per hop kind: sparse (per format), dense."""
    latency: np.ndarray


def _reduce_terms(geo: _Geometry, model: CostModel, size: int, fmts: tuple, taus: tuple) -> _ReduceTerms:
    f = len(fmts)
    msgs = geo.msgs
    dense_bytes = geo.elems * size
    links = (model.intra, model.inter)
    calls, compress = _codec_rates(model, fmts, "compress", 2)
    _, accumulate = _codec_rates(model, fmts, "accumulate", 2)
    latency = np.array([geo.waves * link.latency_s for link in links])[:, None]
    coo = np.array([fmt is Format.COO for fmt in fmts]).reshape(f, 1, 1, 1)
    sends = (msgs > 0) & np.array([fmt is not Format.DENSE for fmt in fmts]).reshape(f, 1, 1, 1)
    base = np.where(coo, msgs * COO_HEADER_BYTES, geo.meta)
    coo_msgs = coo * msgs
    per = np.maximum(msgs, 1)
    elems = np.maximum(geo.elems, 1)
    limit = np.where(sends, dense_bytes, -1)
    tau = np.array(taus).reshape(f, 1, 2, 1)

    def sparse(nnz: np.ndarray) -> np.ndarray:  # sparsities() over the threshold, payload under the dense bytes
        payload = nnz * size + base + coo_msgs * align16((4 * nnz + per - 1) // per)
        return (1.0 - nnz / elems > tau) & (payload < limit)

    return _ReduceTerms(
        base=base,
        coo_msgs=coo_msgs if coo.any() else None,
        per=per,
        per_less_1=per - 1,
        dense_bytes=dense_bytes,
        cap=_sparse_cap(sparse, np.broadcast_to(geo.elems, limit.shape)),
        msgs_per_bandwidth=msgs / np.array([link.grouped_bandwidth for link in links])[:, None],
        codec=(
            np.stack([msgs[0] * calls + dense_bytes[0] / compress, msgs[1] * calls + dense_bytes[1] / accumulate], 1),
            np.stack([dense_bytes[0] / model.copy, dense_bytes[1] / model.reduce]),
        ),
        latency=np.where(msgs[0] > 0, latency, 0.0).max(0),
    )


def _direct_reduce(
    model: CostModel, s: CountSummary, size: int, fmts: Sequence[Format], ths: Sequence
) -> tuple[np.ndarray, np.ndarray]:
    """One all-to-all: each rank encodes what it sends, puts the larger of its outgoing and incoming
    bytes on the wire, one latency per wave, and accumulates what it receives; the slowest rank sets it.
    Returns each format's seconds and whether it sends anything sparse, ``[..., f]``.

    Arrays ``[..., f, d, h, q]``: the summary's leading axes (a batch), format, direction (0: what
    rank ``q`` sends, 1: what it receives), hop kind, rank."""
    geo = _geometry(s.layout, s.topology)
    t = _terms(_reduce_terms, geo, model, size, tuple(fmts), tuple((th.intra, th.inter) for th in ths))
    nnz = np.stack([s.sent, s.received], axis=-3)[..., None, :, :, :]  # [..., 1, d, h, q]
    # the messages' payloads summed (affine in nnz: exact for Pici), as if equally dense
    payload = nnz * size + t.base
    if t.coo_msgs is not None:  # a message's 4-byte indices, padded to 16 bytes
        payload = payload + t.coo_msgs * align16((4 * nnz + t.per_less_1) // t.per)
    sparse = nnz <= t.cap  # [..., f, d, h, q]
    per_message = (np.where(sparse, payload, t.dense_bytes) + t.per_less_1) // t.per  # bytes, rounded up
    wire = (align16(per_message) * t.msgs_per_bandwidth).sum(-2)  # [..., f, d, q]
    codec = np.where(sparse, *t.codec).sum(-2)  # [..., f, d, q]: encoding, accumulating
    busy = codec[..., 0, :] + np.maximum(wire[..., 0, :], wire[..., 1, :]) + t.latency + codec[..., 1, :]
    return busy.max(-1), sparse.any((-3, -2, -1))


class _GatherTerms(NamedTuple):
    cap: np.ndarray
    """``[v, k, c]``: the most nonzeros of the piece that still go sparse in the variant (-1: none
    do; a dense format or an empty piece): :func:`_sparse_cap` of the sparsity and payload tests."""
    dense_bytes: np.ndarray
    base: np.ndarray
    """``[v, k, c]``: a payload's bytes besides its values and (COO) indices: Pici metadata or the COO header."""
    coo: np.ndarray | None
    """``[v, 1, 1]``: 4 (bytes per index) for a COO variant, else 0 (``None``: there is none)."""
    codec: tuple[np.ndarray, np.ndarray]
    """``[v, 2, k, c]`` and ``[2, k, c]``: seconds of encoding (0) and decoding (1) each piece (0
    for empty ones), sent sparse (per variant) or dense."""
    reach: np.ndarray
    per_byte: tuple[float, float]
    """Seconds per byte inside a node, and across nodes."""
    latency: float
    nodes: tuple[np.ndarray, np.ndarray] | None
    """:func:`_from_others`'s node starts and each rank's node (``None``: one node)."""


def _gather_terms(
    geo: _Geometry, model: CostModel, size: int, fmts: tuple, taus: tuple, rpn: int | None
) -> _GatherTerms:
    v = len(fmts)
    n = np.ascontiguousarray(geo.n.T)  # [k, c]: sums over a chunk's pieces run along the outer axis
    has = n > 0
    dense_bytes = n * size
    sends, coo, base = _format_terms(fmts, n)
    calls, compress = _codec_rates(model, fmts, "compress", 2)
    _, decompress = _codec_rates(model, fmts, "decompress", 2)
    copy = np.where(has, dense_bytes / model.copy, 0.0)
    bw = tuple(model.link(h == _INTER).grouped_bandwidth for h in (_INTRA, _INTER))
    waves = int((geo.n.max(0) > 0).sum())  # piece indices that carry messages: one exchange each
    kinds = [h for h in (_INTRA, _INTER) if geo.peers[h].max() > 0]
    slowest = max((model.link(h == _INTER).latency_s for h in kinds), default=0.0)
    p = geo.n.shape[0]
    limit = np.where(has & sends, dense_bytes, -1)
    n_safe = np.maximum(n, 1)
    tau = np.array(taus).reshape(v, 1, 1)

    def sparse(nnz: np.ndarray) -> np.ndarray:  # sparsities() over the threshold, payload under the dense bytes
        return (1.0 - nnz / n_safe > tau) & (base + nnz * size + 4 * coo * ((nnz + 3) & ~3) < limit)

    return _GatherTerms(
        cap=_sparse_cap(sparse, np.broadcast_to(n, limit.shape)),
        dense_bytes=dense_bytes,
        base=base,
        coo=4 * coo if coo.any() else None,
        codec=(
            np.stack([np.where(has, calls + dense_bytes / rate, 0.0) for rate in (compress, decompress)], axis=1),
            np.stack([copy, copy]),
        ),
        reach=geo.peers[_INTRA] / bw[_INTRA] + geo.peers[_INTER] / bw[_INTER],
        per_byte=(1 / bw[_INTRA], 1 / bw[_INTER]),
        latency=waves * slowest,
        nodes=None if rpn is None or rpn >= p else (np.arange(0, p, rpn), np.arange(p) // rpn),
    )


def _direct_gather(
    model: CostModel, s: CountSummary, payloads: np.ndarray, size: int, fmts: Sequence[Format], taus: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """One all-gather of every owner's payload (padded to the largest of each wave when that costs
    at most ``PADDED_GATHER_SLACK`` more, as the planner does); exact. ``payloads[..., v, k, c]``:
    the nonzeros piece ``k`` of chunk ``c`` is sized for in variant ``v``, sent in format
    ``fmts[v]`` with all-gather threshold ``taus[v]``: every variant (and summary of a batch)
    weighed at once. Returns each variant's seconds and whether it sends anything sparse, ``[..., v]``."""
    geo = _geometry(s.layout, s.topology)
    t = _terms(_gather_terms, geo, model, size, tuple(fmts), tuple(taus), s.topology.ranks_per_node)
    p = s.layout.world
    sparse = payloads <= t.cap  # empty pieces are never sent
    payload = t.base + payloads * size  # wire_format's, per format
    if t.coo is not None:  # 4-byte indices padded to 16 bytes: 4 * (nnz rounded up to 4)
        payload += t.coo * ((payloads + 3) & ~3)
    nbytes = align16(np.where(sparse, payload, t.dense_bytes))  # [..., v, k, c]: packed (empty pieces: 0)
    codec = np.where(sparse[..., None, :, :], *t.codec).sum(-2)  # [..., v, 2, c]
    enc, dec = codec[..., 0, :], codec[..., 1, :]
    decode = dec.sum(-1, keepdims=True) - dec  # every other owner's payload
    # padded_slot of each variant: its waves padded to their largest payload, if cheap enough
    mine = nbytes.sum(-2)  # [..., v, c]
    padded = nbytes.max(-1).sum(-1, keepdims=True)  # [..., v, 1]
    use = (padded > 0) & (p * padded <= PADDED_GATHER_SLACK * mine.sum(-1, keepdims=True))
    out_wire = np.where(use, padded, mine) * t.reach
    in_wire = out_wire if use.all() else np.where(use, out_wire, _from_others(mine, *t.per_byte, t.nodes))
    busy = (enc + np.maximum(out_wire, in_wire) + t.latency + decode).max(-1)
    return busy, sparse.any((-2, -1))


def _from_others(
    nbytes: np.ndarray, intra: float, inter: float, nodes: tuple[np.ndarray, np.ndarray] | None
) -> np.ndarray:
    """Per rank ``d`` (the last axis): the seconds of receiving every other rank's ``nbytes``, at
    ``intra`` seconds per byte from its own node and ``inter`` from the others. ``nodes``: where
    each node's ranks start, and each rank's node (``None``: one node)."""
    others = nbytes.sum(-1, keepdims=True) - nbytes
    if nodes is None:
        return others * intra
    starts, node = nodes
    in_node = np.add.reduceat(nbytes, starts, axis=-1)[..., node] - nbytes
    return others * inter + in_node * (intra - inter)


def _format_terms(fmts: Sequence[Format], n: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per format (a leading axis): whether it sends sparse, whether it is COO, and a payload's bytes
    besides its values and COO indices (Pici metadata, or the COO header), for pieces of ``n``."""
    f = len(fmts)
    shape = (f,) + (1,) * n.ndim
    coo = np.array([fmt is Format.COO for fmt in fmts]).reshape(shape)
    sends = np.array([fmt is not Format.DENSE for fmt in fmts]).reshape(shape)
    base = np.where(coo, COO_HEADER_BYTES, pici_metadata_bytes_of(n))
    return sends, coo.astype(np.int64), base


def _ring_reduce(
    model: CostModel, s: CountSummary, size: int, fmts: Sequence[Format], ths: Sequence
) -> list[list[tuple[float, bool]]]:
    """``world - 1`` steps per format; step ``t`` sends the densest chunk's running sum of ``t + 1``
    contributions. Arrays ``[f, t, k]``: format, step, piece index."""
    geo = _geometry(s.layout, s.topology)
    p = s.layout.world
    n = geo.n.max(0)  # [k]: the largest piece of each index
    has = n > 0
    mean = s.ring / (p - 1)  # [k]: the densest chunk's mean contribution
    t = np.arange(1, p)[:, None]  # contributions summed at each step
    bound = np.minimum(n, t * mean)  # [t, k]
    # the extrapolated sparsity, a running product as the planner takes it (not numpy's power,
    # whose last bit depends on the CPU's vector extensions)
    sigma = np.cumprod(np.broadcast_to(sparsities(n, mean), (p - 1, len(n))), axis=0)
    dense_bytes = n * size
    sends, coo, base = _format_terms(fmts, n[None, :])
    payload = base + coo * align16(4 * np.ceil(bound).astype(np.int64)) + bound * size  # wire_format's
    calls, compress = _codec_rates(model, fmts, "compress", 2)
    _, accumulate = _codec_rates(model, fmts, "accumulate", 2)
    send, recv, any_sparse = {}, {}, np.zeros(len(fmts), dtype=bool)
    for h in geo.kinds:
        link = model.link(h == _INTER)
        tau = np.array([th.inter if h else th.intra for th in ths]).reshape(-1, 1, 1)
        sparse = has & sends & (sigma > tau) & (payload < dense_bytes)
        any_sparse |= sparse.any((1, 2))
        nbytes = np.where(sparse, payload, dense_bytes)
        wire = np.where(has, link.latency_s + np.ceil(nbytes) / link.bandwidth, 0.0)
        enc = np.where(sparse, calls + dense_bytes / compress, 0.0)  # dense: sent as it is
        dec = np.where(sparse, calls + dense_bytes / accumulate, dense_bytes / model.reduce)
        send[h], recv[h] = (wire + enc).sum(-1), np.where(has, dec, 0.0).sum(-1)
    busy = np.max([send[out] + recv[into] for out, into in geo.ring_pairs], axis=0)  # [f, t]
    return [[(x, sp) for x in row] for row, sp in zip(busy.tolist(), any_sparse.tolist())]


def _ring_gather(
    model: CostModel, s: CountSummary, payloads: np.ndarray, size: int, fmts: Sequence[Format], taus: Sequence[float]
) -> list[list[tuple[float, bool]]]:
    """``world - 1`` steps forwarding every payload unchanged (encoded at the first, decoded on
    arrival), per variant: ``payloads[v, c, k]`` sent in ``fmts[v]`` at threshold ``taus[v]``."""
    geo = _geometry(s.layout, s.topology)
    p = s.layout.world
    n = geo.n
    has = n > 0
    sigma = sparsities(n, payloads)
    dense_bytes = n * size
    sends, coo, base = _format_terms(fmts, n)
    payload = base + coo * align16(4 * payloads) + payloads * size  # wire_format's
    sparse = has & sends & (sigma > np.reshape(taus, (-1, 1, 1))) & (payload < dense_bytes)
    nbytes = np.where(sparse, payload, dense_bytes)
    calls, compress = _codec_rates(model, fmts, "compress", 2)
    _, decompress = _codec_rates(model, fmts, "decompress", 2)
    enc = np.where(sparse, calls + dense_bytes / compress, 0.0)  # dense: forwarded as it is
    dec = np.where(sparse, calls + dense_bytes / decompress, 0.0).sum(-1).max(-1)
    link = model.link(_INTER in geo.kinds)
    wire = np.where(has, link.latency_s + nbytes / link.bandwidth, 0.0)
    first = (wire + enc).sum(-1).max(-1) + dec
    later = wire.sum(-1).max(-1) + dec
    return [
        [(a, sp)] + [(b, sp)] * (p - 2)
        for a, b, sp in zip(first.tolist(), later.tolist(), sparse.any((-2, -1)).tolist())
    ]
