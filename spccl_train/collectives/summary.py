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
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..formats import COO_HEADER_BYTES, TILE, Format
from ..formats.layout import element_size
from .chunking import ChunkLayout, piece_arrays
from .cost import CostModel
from .plan import PADDED_GATHER_SLACK, sparsities
from .state import Memo
from .topology import Topology

__all__ = ["CountSummary", "Prediction", "predict", "predict_variants"]

_INTRA, _INTER = 0, 1


def _align16(x: np.ndarray) -> np.ndarray:
    return (x + 15) & ~15


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
    tiles = -(-n // TILE)
    meta = np.where(n > 0, 512 * tiles + _align16(4 * (tiles + 1)), 0).sum(1)  # per chunk, all its pieces
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
    """``per_pair[q, c]`` (what rank ``q`` holds of chunk ``c``) summed per hop kind, own chunk left
    out: ``(sent[h, q], received[h, c])``."""
    p = per_pair.shape[0]
    own = per_pair.diagonal()
    out_total, in_total = per_pair.sum(1) - own, per_pair.sum(0) - own
    rpn = topology.ranks_per_node
    if rpn is None or rpn >= p:
        out_same, in_same = out_total, in_total
    else:
        starts = np.arange(0, p, rpn)
        node = np.arange(p) // rpn
        out_same = np.add.reduceat(per_pair, starts, axis=1)[np.arange(p), node] - own
        in_same = np.add.reduceat(per_pair, starts, axis=0)[node, np.arange(p)] - own
    return np.stack([out_same, out_total - out_same]), np.stack([in_same, in_total - in_same])


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

    @classmethod
    def of(cls, collective: str, table: object, layout: ChunkLayout, topology: Topology) -> CountSummary:
        """Summarise an exchanged (or bounds) table: ``table[q]`` is rank ``q``'s ``world * channels``
        piece counts (an all-gather reads each row's first ``channels``)."""
        p, ch = layout.world, layout.channels
        counts = np.asarray(table, dtype=np.int64).reshape(p, -1)
        geo = _geometry(layout, topology)
        n = geo.n
        if collective == "all_gather":
            own = counts[:, :ch]
            zero = np.zeros((2, p), dtype=np.int64)
            return cls(collective, layout, topology, zero, zero, np.zeros(ch, np.int64), own, own, own.sum(1))
        cube = counts[:, : p * ch].reshape(p, p, ch)
        sent, received = _by_kind(cube.sum(2), topology)
        column = cube.sum(0)  # [c, k]: every rank's nonzeros of the piece
        others = column - cube[np.arange(p), np.arange(p)]
        ring = others.max(0)
        bound = np.minimum(n, column)
        expected = np.rint(n * (1.0 - np.prod(sparsities(n, cube), axis=0))).astype(np.int64)  # [q, c, k] -> [c, k]
        estimate = np.minimum(bound, expected)
        held = counts[:, : p * ch].sum(1)
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
        sent, received, ring, bound, estimate, held = out
        return dataclasses.replace(
            self, sent=sent, received=received, ring=ring, bound=bound, estimate=estimate, held=held
        )

    def key(self) -> bytes:
        """The summary's bytes (a memo key, with the call's other inputs)."""
        parts = (self.sent, self.received, self.ring, self.bound, self.estimate, self.held)
        return b"|".join(np.ascontiguousarray(a).tobytes() for a in parts)


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
        roundable = self.sizes > 1
        distinct, which = np.unique(np.where(roundable, self.sizes, 2), return_inverse=True)
        self.which = which.reshape(-1)
        self.tables = [_levels(size, steps) for size in distinct.tolist()]
        self.lists = (self.sizes.tolist(), self.which.tolist(), [(f.tolist(), lv.tolist()) for f, lv in self.tables])
        shift = int(distinct[-1]).bit_length() + 1
        counts = np.array([len(f) for f, _ in self.tables])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        level_starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]]).astype(np.int64)
        self.levels = np.concatenate([lv for _, lv in self.tables])
        packable = shift + len(distinct).bit_length() <= 62
        self.keys = np.concatenate([(i << shift) + f for i, (f, _) in enumerate(self.tables)]) if packable else None
        # per count: its key's offset, where its size's boundaries start, and its size's level 0
        self.shifted = self.which << shift
        self.first = starts[self.which]
        self.last = level_starts[self.which] + counts[self.which]
        return self

    def apply(self, values: np.ndarray) -> np.ndarray:
        """``values`` (int64, one per size) rounded."""
        values = np.asarray(values, dtype=np.int64)
        if values.size <= _SMALL:  # a few counts (small groups): numpy's per-call overhead dominates
            sizes, which, tables = self.lists
            out = []
            for x, n, w in zip(values.tolist(), sizes, which):
                if x <= 0 or x >= n:
                    out.append(x)
                else:
                    floors, levels = tables[w]
                    out.append(levels[len(floors) - bisect.bisect_left(floors, x)])
            return np.array(out, dtype=np.int64)
        inner = (values > 0) & (values < self.sizes)
        if self.keys is None:  # sizes too large to pack: one size at a time
            out = values.copy()
            x, which = values[inner], self.which[inner]
            for i, (floors, levels) in enumerate(self.tables):
                mine = which == i
                x[mine] = levels[len(floors) - np.searchsorted(floors, x[mine], side="left")]
            out[inner] = x
            return out
        # every count looked up at once (those outside (0, n) at a clipped value, then kept as they are)
        below = np.searchsorted(self.keys, self.shifted + np.clip(values, 0, self.sizes), side="left") - self.first
        return np.where(inner, self.levels[self.last - below], values)


def _round(values: np.ndarray, sizes: np.ndarray, steps: int) -> np.ndarray:
    """Each count ``0 < x < n`` (``n`` its size, an equally shaped array) to ``round(n 2**(-j/steps))``
    for the nearest ``j`` (``j = round(-steps log2(x / n))``), clamped to ``[1, n - 1]``; empty
    and full stay exact. Integer-exact (:class:`_Rounding`), so every rank rounds alike whatever
    its CPU's vector math."""
    values = np.asarray(values, dtype=np.int64)
    return _Rounding.of(np.ravel(sizes), steps).apply(values.ravel()).reshape(values.shape)


_SMALL = 64


@functools.lru_cache(maxsize=256)
def _levels(n: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """For size ``n``: the boundaries ``n 2**(-(k + 1/2)/steps)`` between levels ``k`` and ``k + 1``,
    ascending and rounded down to integers, and each level's count ``round(n 2**(-j/steps))``
    clamped to [1, n - 1]."""
    top = math.ceil(steps * math.log2(n)) + 2  # levels 0..top cover counts down to 1
    floors = np.array([math.floor(n * 2.0 ** (-(k + 0.5) / steps)) for k in range(top)], dtype=np.int64)
    levels = np.array([min(n - 1, max(1, round(n * 2.0 ** (-j / steps)))) for j in range(top + 1)], dtype=np.int64)
    return floors[::-1].copy(), levels


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    """A candidate's predicted seconds, and whether any of its messages would travel sparse."""

    seconds: float
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
    if layout.world == 1:
        return [
            Prediction(model.planning(collective, layout.numel, dtype, 1, exchanges + (g == "measured")), False)
            for _, _, g in variants
        ]
    reduce: dict[Format, list[tuple[float, bool]]] = {}
    gather: list[list[tuple[float, bool]]] = [[] for _ in variants]
    ring = algorithm == "ring"
    if collective != "all_gather":
        distinct = {fmt: th for fmt, th, _ in variants}
        if ring:
            steps = _ring_reduce(model, summary, size, list(distinct), list(distinct.values()))
        else:
            steps = [[step] for step in _direct_reduce(model, summary, size, list(distinct), list(distinct.values()))]
        reduce = dict(zip(distinct, steps))
    if collective != "reduce_scatter":
        payloads = np.stack([summary.estimate if g == "measured" else summary.bound for _, _, g in variants])
        fmts, taus = [f for f, _, _ in variants], [th.ag for _, th, _ in variants]
        if ring:
            gather = _ring_gather(model, summary, payloads, size, fmts, taus)
        else:
            gather = [[step] for step in _direct_gather(model, summary, payloads, size, fmts, taus)]
    out = []
    for (fmt, _, mode), gathered in zip(variants, gather):
        terms = [model.planning(collective, layout.numel, dtype, layout.world, exchanges + (mode == "measured"))]
        sparse = False
        for seconds, sends in reduce.get(fmt, []) + gathered:
            terms.append(model.step_s + seconds)
            sparse = sparse or sends
        out.append(Prediction(math.fsum(terms), sparse))
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


class _ReduceTerms(NamedTuple):
    sends: np.ndarray
    """``[f, d, h, q]``: the format is sparse and the rank has messages of that kind."""
    per: np.ndarray
    elems: np.ndarray
    """At least 1 (a sparsity's divisor)."""
    dense_bytes: np.ndarray
    tau: np.ndarray
    bandwidth: np.ndarray
    encode: tuple[np.ndarray, np.ndarray]
    """Seconds of encoding what a rank sends per hop kind: sparse (per format), dense."""
    decode: tuple[np.ndarray, np.ndarray]
    latency: np.ndarray
    coo: tuple[bool, ...]


def _reduce_terms(geo: _Geometry, model: CostModel, size: int, fmts: tuple, taus: tuple) -> _ReduceTerms:
    f = len(fmts)
    msgs = geo.msgs
    dense_bytes = geo.elems * size
    links = (model.intra, model.inter)
    calls, compress = _codec_rates(model, fmts, "compress", 2)
    _, accumulate = _codec_rates(model, fmts, "accumulate", 2)
    latency = np.array([geo.waves * link.latency_s for link in links])[:, None]
    return _ReduceTerms(
        sends=(msgs > 0) & np.array([fmt is not Format.DENSE for fmt in fmts]).reshape(f, 1, 1, 1),
        per=np.maximum(msgs, 1),
        elems=np.maximum(geo.elems, 1),
        dense_bytes=dense_bytes,
        tau=np.array(taus).reshape(f, 1, 2, 1),
        bandwidth=np.array([link.grouped_bandwidth for link in links])[:, None],
        encode=(msgs[0] * calls + dense_bytes[0] / compress, dense_bytes[0] / model.copy),
        decode=(msgs[1] * calls + dense_bytes[1] / accumulate, dense_bytes[1] / model.reduce),
        latency=np.where(msgs[0] > 0, latency, 0.0).max(0),
        coo=tuple(fmt is Format.COO for fmt in fmts),
    )


def _direct_reduce(
    model: CostModel, s: CountSummary, size: int, fmts: Sequence[Format], ths: Sequence
) -> list[tuple[float, bool]]:
    """One all-to-all: each rank encodes what it sends, puts the larger of its outgoing and incoming
    bytes on the wire, one latency per wave, and accumulates what it receives; the slowest rank sets it.

    Arrays ``[f, d, h, q]``: format, direction (0: what rank ``q`` sends, 1: what it receives),
    hop kind, rank."""
    geo = _geometry(s.layout, s.topology)
    t = _terms(_reduce_terms, geo, model, size, tuple(fmts), tuple((th.intra, th.inter) for th in ths))
    nnz = np.stack([s.sent, s.received])  # [d, h, q]
    # the messages' payloads summed (affine in nnz: exact for Pici), as if equally dense
    values = nnz * size
    pici = geo.meta + values
    if any(t.coo):
        chunked = _align16(np.ceil(4 * nnz / t.per).astype(np.int64))
        coo = geo.msgs * (COO_HEADER_BYTES + chunked) + values
        payload = np.stack([coo if is_coo else pici for is_coo in t.coo])
    else:
        payload = pici[None]
    sigma = 1.0 - nnz / t.elems  # sparsities(): 1.0 where a rank has nothing of that kind
    sparse = t.sends & (sigma > t.tau) & (payload < t.dense_bytes)  # [f, d, h, q]
    nbytes = np.where(sparse, payload, t.dense_bytes) / t.per
    wire = (geo.msgs * _align16(np.ceil(nbytes).astype(np.int64)) / t.bandwidth).sum(-2)  # [f, d, q]
    encode = np.where(sparse[:, 0], *t.encode).sum(-2)
    decode = np.where(sparse[:, 1], *t.decode).sum(-2)
    busy = encode + np.maximum(wire[:, 0], wire[:, 1]) + t.latency + decode
    return list(zip(busy.max(-1).tolist(), sparse.any((1, 2, 3)).tolist()))


class _GatherTerms(NamedTuple):
    sends: np.ndarray
    """``[v, c, k]``: the variant's format is sparse and the piece has elements."""
    n: np.ndarray
    """At least 1 (a sparsity's divisor)."""
    dense_bytes: np.ndarray
    tau: np.ndarray
    base: np.ndarray
    """``[v, c, k]``: a payload's bytes besides its values and (COO) indices: Pici metadata or the COO header."""
    coo: np.ndarray | None
    """``[v, 1, 1]``: 1 for a COO variant (``None``: there is none)."""
    encode: tuple[np.ndarray, np.ndarray]
    """Seconds of encoding each piece (0 for empty ones): sparse (per variant), dense."""
    decode: tuple[np.ndarray, np.ndarray]
    reach: np.ndarray
    bandwidth: tuple[float, float]
    latency: float
    nodes: tuple[np.ndarray, np.ndarray] | None
    """:func:`_from_others`'s node starts and each rank's node (``None``: one node)."""


def _gather_terms(
    geo: _Geometry, model: CostModel, size: int, fmts: tuple, taus: tuple, rpn: int | None
) -> _GatherTerms:
    v = len(fmts)
    n = geo.n
    has = n > 0
    dense_bytes = n * size
    sends, coo, base = _format_terms(fmts, n)
    calls, compress = _codec_rates(model, fmts, "compress", 2)
    _, decompress = _codec_rates(model, fmts, "decompress", 2)
    copy = np.where(has, dense_bytes / model.copy, 0.0)
    bw = tuple(model.link(h == _INTER).grouped_bandwidth for h in (_INTRA, _INTER))
    waves = int((n.max(0) > 0).sum())  # piece indices that carry messages: one exchange each
    kinds = [h for h in (_INTRA, _INTER) if geo.peers[h].max() > 0]
    slowest = max((model.link(h == _INTER).latency_s for h in kinds), default=0.0)
    p = geo.n.shape[0]
    return _GatherTerms(
        sends=has & sends,
        n=np.maximum(n, 1),
        dense_bytes=dense_bytes,
        tau=np.array(taus).reshape(v, 1, 1),
        base=base,
        coo=coo if coo.any() else None,
        encode=(np.where(has, calls + dense_bytes / compress, 0.0), copy),
        decode=(np.where(has, calls + dense_bytes / decompress, 0.0), copy),
        reach=geo.peers[_INTRA] / bw[_INTRA] + geo.peers[_INTER] / bw[_INTER],
        bandwidth=bw,
        latency=waves * slowest,
        nodes=None if rpn is None or rpn >= p else (np.arange(0, p, rpn), np.arange(p) // rpn),
    )


def _direct_gather(
    model: CostModel, s: CountSummary, payloads: np.ndarray, size: int, fmts: Sequence[Format], taus: Sequence[float]
) -> list[tuple[float, bool]]:
    """One all-gather of every owner's payload (padded to the largest of each wave when that costs
    at most ``PADDED_GATHER_SLACK`` more, as the planner does); exact. ``payloads[v, c, k]``: the
    nonzeros piece ``k`` of chunk ``c`` is sized for in variant ``v``, sent in format ``fmts[v]``
    with all-gather threshold ``taus[v]``: every variant weighed at once."""
    geo = _geometry(s.layout, s.topology)
    t = _terms(_gather_terms, geo, model, size, tuple(fmts), tuple(taus), s.topology.ranks_per_node)
    p = s.layout.world
    sigma = 1.0 - payloads / t.n  # sparsities(): empty pieces are never sent
    payload = t.base + payloads * size  # wire_format's, per format
    if t.coo is not None:
        payload += t.coo * _align16(4 * payloads)
    sparse = t.sends & (sigma > t.tau) & (payload < t.dense_bytes)
    nbytes = _align16(np.where(sparse, payload, t.dense_bytes))  # [v, c, k]: packed (empty pieces: 0)
    enc = np.where(sparse, *t.encode).sum(-1)  # [v, c]
    dec = np.where(sparse, *t.decode).sum(-1)
    decode = dec.sum(-1, keepdims=True) - dec  # every other owner's payload
    # padded_slot of each variant: its waves padded to their largest payload, if cheap enough
    mine = nbytes.sum(-1)  # [v, c]
    padded = nbytes.max(-2).sum(-1, keepdims=True)  # [v, 1]
    use = (padded > 0) & (p * padded <= PADDED_GATHER_SLACK * mine.sum(-1, keepdims=True))
    intra, inter = t.bandwidth
    out_wire = np.where(use, padded, mine) * t.reach
    in_wire = np.where(use, out_wire, _from_others(mine / intra, mine / inter, t.nodes))
    busy = (enc + np.maximum(out_wire, in_wire) + t.latency + decode).max(-1)
    return list(zip(busy.tolist(), sparse.any((-2, -1)).tolist()))


def _from_others(intra: np.ndarray, inter: np.ndarray, nodes: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """Per rank ``d`` (the last axis): the sum over the other ranks ``c`` of ``intra[c]`` (same node)
    or ``inter[c]``. ``nodes``: where each node's ranks start, and each rank's node (``None``: one node)."""
    if nodes is None:
        return intra.sum(-1, keepdims=True) - intra
    starts, node = nodes
    intra_node = np.add.reduceat(intra, starts, axis=-1)[..., node]
    inter_node = np.add.reduceat(inter, starts, axis=-1)[..., node]
    return (intra_node - intra) + (inter.sum(-1, keepdims=True) - inter_node)


def _format_terms(fmts: Sequence[Format], n: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per format (a leading axis): whether it sends sparse, whether it is COO, and a payload's bytes
    besides its values and COO indices (Pici metadata, or the COO header), for pieces of ``n``."""
    f = len(fmts)
    shape = (f,) + (1,) * n.ndim
    tiles = -(-n // TILE)
    coo = np.array([fmt is Format.COO for fmt in fmts]).reshape(shape)
    sends = np.array([fmt is not Format.DENSE for fmt in fmts]).reshape(shape)
    base = np.where(coo, COO_HEADER_BYTES, 512 * tiles + _align16(4 * (tiles + 1)))
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
    payload = base + coo * _align16(4 * np.ceil(bound).astype(np.int64)) + bound * size  # wire_format's
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
    payload = base + coo * _align16(4 * payloads) + payloads * size  # wire_format's
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
