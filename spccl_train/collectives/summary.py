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

import numpy as np
import torch

from ..formats import TILE, Format
from ..formats.layout import element_size
from .chunking import ChunkLayout, piece_arrays
from .cost import CostModel
from .plan import COO_HEADER_BYTES, padded_slot, sparsities, wire_format
from .topology import Topology

__all__ = ["CountSummary", "Prediction", "predict"]

_INTRA, _INTER = 0, 1


def _align16(x: np.ndarray) -> np.ndarray:
    return (x + 15) & ~15


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Geometry:
    """What the layout and topology fix: piece sizes, and elements and messages per rank and hop kind."""

    n: np.ndarray
    """``n[c, k]``: elements of piece ``k`` of chunk ``c``."""
    sent_elems: np.ndarray
    sent_msgs: np.ndarray
    recv_elems: np.ndarray
    recv_msgs: np.ndarray
    sent_meta: np.ndarray
    """Pici metadata bytes of the messages a rank sends, by hop kind (its fixed cost per piece)."""
    recv_meta: np.ndarray
    kinds: tuple[int, ...]
    """Hop kinds a ring step uses (0: inside a node, 1: across nodes)."""
    ring_pairs: tuple[tuple[int, int], ...]
    """The (sending hop, receiving hop) kinds the ranks of a ring have: rank ``q`` sends to
    ``q + 1`` and receives from ``q - 1``."""
    peers: np.ndarray
    """``peers[h, q]``: other ranks of hop kind ``h`` from rank ``q``."""


@functools.lru_cache(maxsize=64)
def _geometry(layout: ChunkLayout, topology: Topology) -> _Geometry:
    p = layout.world
    n = piece_arrays(layout)[0]
    elems = np.broadcast_to(n.sum(1), (p, p))
    msgs = np.broadcast_to((n > 0).sum(1), (p, p))
    sent_elems, recv_elems = _by_kind(elems, topology)
    sent_msgs, recv_msgs = _by_kind(msgs, topology)
    tiles = -(-n // TILE)
    meta = np.where(n > 0, 512 * tiles + _align16(4 * (tiles + 1)), 0).sum(1)  # per chunk, all its pieces
    sent_meta, recv_meta = _by_kind(np.broadcast_to(meta, (p, p)), topology)
    rpn = topology.ranks_per_node
    local = p if rpn is None else min(rpn, p)
    kinds = tuple(h for h, used in ((_INTRA, local > 1), (_INTER, topology.nodes > 1)) if used)
    hop = [int(topology.is_inter(q, (q + 1) % p)) for q in range(p)]
    ring_pairs = tuple(sorted({(hop[q], hop[q - 1]) for q in range(p)}))
    same = np.array([min(local, p - (q // local) * local) - 1 for q in range(p)], dtype=np.int64)
    peers = np.stack([same, p - 1 - same])
    return _Geometry(n, sent_elems, sent_msgs, recv_elems, recv_msgs, sent_meta, recv_meta, kinds, ring_pairs, peers)


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
        geo = _geometry(self.layout, self.topology)
        if self.collective == "all_gather":
            bound = _round(self.bound, geo.n, steps)
            return dataclasses.replace(self, bound=bound, estimate=bound)
        return dataclasses.replace(
            self,
            sent=_round(self.sent, geo.sent_elems, steps),
            received=_round(self.received, geo.recv_elems, steps),
            ring=_round(self.ring, max(1, self.layout.world - 1) * geo.n.max(0), steps),
            bound=_round(self.bound, geo.n, steps),
            estimate=_round(self.estimate, geo.n, steps),
            held=_round(self.held, _held_elements(self.collective, self.layout), steps),
        )

    def key(self) -> bytes:
        """The summary's bytes (a memo key, with the call's other inputs)."""
        parts = (self.sent, self.received, self.ring, self.bound, self.estimate, self.held)
        return b"|".join(np.ascontiguousarray(a).tobytes() for a in parts)


def _held_elements(collective: str, layout: ChunkLayout) -> int:
    """Elements one rank holds: its input (an all-gather: one chunk; else the whole tensor)."""
    return layout.numel // layout.world if collective == "all_gather" else layout.numel


def _round(values: np.ndarray, sizes: object, steps: int) -> np.ndarray:
    """Each count ``0 < x < n`` (``n`` its size) to ``round(n 2**(-j/steps))`` for the nearest ``j``
    (``j = round(-steps log2(x / n))``), clamped to ``[1, n - 1]``; empty and full stay exact.

    Integer-exact: per distinct size, each count's level is found by comparing it with that size's
    precomputed boundaries (Python floats), so every rank rounds alike whatever its CPU's vector math.
    """
    values = np.asarray(values, dtype=np.int64)
    if values.size <= _SMALL:  # a few counts (small groups): numpy's per-call overhead dominates
        flat = values.ravel().tolist()
        if np.ndim(sizes) == 0:
            every = [int(sizes)] * len(flat)
        elif np.shape(sizes) == values.shape:
            every = np.asarray(sizes).ravel().tolist()
        else:
            every = np.broadcast_to(sizes, values.shape).ravel().tolist()
        out = [x if x <= 0 or x >= n else _level(x, n, steps) for x, n in zip(flat, every)]
        return np.array(out, dtype=np.int64).reshape(values.shape)
    sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), values.shape)
    out = values.copy()
    inner = (values > 0) & (values < sizes)
    for n in np.unique(sizes[inner]).tolist():
        where = inner & (sizes == n)
        ascending, levels = _levels(n, steps)
        # j = how many boundaries b_k (decreasing in k) are >= x: the nearest level's index
        out[where] = levels[len(ascending) - np.searchsorted(ascending, values[where], side="left")]
    return out


_SMALL = 64


def _level(x: int, n: int, steps: int) -> int:
    """:func:`_round` of one count ``0 < x < n``, by the same boundaries."""
    ascending, levels = _level_lists(n, steps)
    return levels[len(ascending) - bisect.bisect_left(ascending, x)]


@functools.lru_cache(maxsize=256)
def _level_lists(n: int, steps: int) -> tuple[list[float], list[int]]:
    ascending, levels = _levels(n, steps)
    return ascending.tolist(), levels.tolist()


@functools.lru_cache(maxsize=256)
def _levels(n: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """For size ``n``: the boundaries ``n 2**(-(k + 1/2)/steps)`` between levels ``k`` and ``k + 1``,
    ascending, and each level's count ``round(n 2**(-j/steps))`` clamped to [1, n - 1]."""
    top = math.ceil(steps * math.log2(n)) + 2  # levels 0..top cover counts down to 1
    bounds = np.array([n * 2.0 ** (-(k + 0.5) / steps) for k in range(top)])
    levels = np.array([min(n - 1, max(1, round(n * 2.0 ** (-j / steps)))) for j in range(top + 1)], dtype=np.int64)
    return bounds[::-1].copy(), levels


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
    collective, layout = summary.collective, summary.layout
    size = element_size(dtype)
    total = model.planning(collective, layout.numel, dtype, layout.world, exchanges + (gather == "measured"))
    if layout.world == 1:
        return Prediction(total, False)
    steps: list[tuple[float, bool]] = []
    if collective != "all_gather":
        if algorithm == "ring":
            steps += _ring_reduce(model, summary, size, fmt, thresholds)
        else:
            steps.append(_direct_reduce(model, summary, size, fmt, thresholds))
    if collective != "reduce_scatter":
        payload = summary.estimate if gather == "measured" else summary.bound
        if algorithm == "ring":
            steps += _ring_gather(model, summary, payload, size, fmt, thresholds.ag)
        else:
            steps.append(_direct_gather(model, summary, payload, size, fmt, thresholds.ag))
    seconds = math.fsum([total, *(model.step_s + t for t, _ in steps)])
    return Prediction(seconds, any(sparse for _, sparse in steps))


def _codec_seconds(codec, sparse, calls, dense_bytes, rate: str, dense_rate: float):
    """Seconds of pieces' codec work: ``calls`` calls and ``dense_bytes`` at ``codec``'s ``rate``
    where ``sparse``, else ``dense_bytes`` at ``dense_rate`` (``math.inf``: free); no codec (a
    dense format): all at ``dense_rate``."""
    if codec is None:
        return dense_bytes / dense_rate
    return np.where(sparse, calls * codec.call_s + dense_bytes / getattr(codec, rate), dense_bytes / dense_rate)


def _direct_reduce(model: CostModel, s: CountSummary, size: int, fmt: Format, th) -> tuple[float, bool]:
    """One all-to-all: each rank encodes what it sends, puts the larger of its outgoing and incoming
    bytes on the wire, one latency per wave, and accumulates what it receives; the slowest rank sets it."""
    geo = _geometry(s.layout, s.topology)
    p = s.layout.world
    codec = model.codec(fmt) if fmt is not Format.DENSE else None
    encode = np.zeros(p)
    decode = np.zeros(p)
    out_wire = np.zeros(p)
    in_wire = np.zeros(p)
    latency = np.zeros(p)
    any_sparse = False
    for h in (_INTRA, _INTER):
        link = model.link(h == _INTER)
        tau = th.inter if h == _INTER else th.intra
        for nnz, elems, msgs, meta, outgoing in (
            (s.sent[h], geo.sent_elems[h], geo.sent_msgs[h], geo.sent_meta[h], True),
            (s.received[h], geo.recv_elems[h], geo.recv_msgs[h], geo.recv_meta[h], False),
        ):
            some = msgs > 0
            if not some.any():
                continue
            per = np.maximum(msgs, 1)
            dense_bytes = elems * size
            # the messages' payloads summed (affine in nnz: exact for Pici), as if equally dense
            if fmt is Format.PICI:
                payload = meta + nnz * size
            else:
                payload = msgs * (COO_HEADER_BYTES + _align16(np.ceil(4 * nnz / per).astype(np.int64))) + nnz * size
            sparse = some & (fmt is not Format.DENSE) & (sparsities(elems, nnz) > tau) & (payload < dense_bytes)
            any_sparse = any_sparse or bool(sparse.any())
            nbytes = np.where(sparse, payload, dense_bytes) / per
            wire = msgs * _align16(np.ceil(nbytes).astype(np.int64)) / link.grouped_bandwidth
            if outgoing:
                out_wire += wire
                encode += _codec_seconds(codec, sparse, msgs, dense_bytes, "compress", model.copy)
                waves = (geo.n > 0).sum(1).max() if s.layout.channels > 1 else 1
                latency = np.maximum(latency, np.where(some, waves * link.latency_s, 0.0))
            else:
                in_wire += wire
                decode += _codec_seconds(codec, sparse, msgs, dense_bytes, "accumulate", model.reduce)
    return float((encode + np.maximum(out_wire, in_wire) + latency + decode).max()), any_sparse


def _direct_gather(model: CostModel, s: CountSummary, payload: np.ndarray, size: int, fmt: Format, tau: float):
    """One all-gather of every owner's payload (padded to the largest of each wave when that costs
    at most ``PADDED_GATHER_SLACK`` more, as the planner does); exact."""
    geo = _geometry(s.layout, s.topology)
    p = s.layout.world
    n = geo.n
    sigma = sparsities(n, payload)
    sparse, nbytes = wire_format(fmt, n, payload, sigma, tau, size)
    nbytes = np.where(n > 0, _align16(nbytes), 0)  # [c, k]: packed
    dense_bytes = n * size
    codec = model.codec(fmt) if fmt is not Format.DENSE else None
    enc = _codec_seconds(codec, sparse, 1, dense_bytes, "compress", model.copy)
    dec = _codec_seconds(codec, sparse, 1, dense_bytes, "decompress", model.copy)
    enc, dec = np.where(n > 0, enc, 0.0).sum(1), np.where(n > 0, dec, 0.0).sum(1)
    decode = dec.sum() - dec  # every other owner's payload
    slot = padded_slot(nbytes.T.tolist(), p)
    bw = [model.link(h == _INTER).grouped_bandwidth for h in (_INTRA, _INTER)]
    if slot:
        per_peer = np.full(p, slot)
        out_wire = per_peer * (geo.peers[_INTRA] / bw[_INTRA] + geo.peers[_INTER] / bw[_INTER])
        in_wire = out_wire
    else:
        mine = nbytes.sum(1)
        out_wire = mine * (geo.peers[_INTRA] / bw[_INTRA] + geo.peers[_INTER] / bw[_INTER])
        in_wire = _from_others(mine / bw[_INTRA], mine / bw[_INTER], s.topology)
    waves = int((n.max(0) > 0).sum())  # piece indices that carry messages: one exchange each
    kinds = [h for h in (_INTRA, _INTER) if geo.peers[h].max() > 0]
    slowest = max((model.link(h == _INTER).latency_s for h in kinds), default=0.0)
    latency = waves * slowest
    return float((enc + np.maximum(out_wire, in_wire) + latency + decode).max()), bool(sparse.any())


def _from_others(intra: np.ndarray, inter: np.ndarray, topology: Topology) -> np.ndarray:
    """Per rank ``d``: the sum over the other ranks ``c`` of ``intra[c]`` (same node) or ``inter[c]``."""
    p = len(intra)
    rpn = topology.ranks_per_node
    if rpn is None or rpn >= p:
        return intra.sum() - intra
    node = np.arange(p) // rpn
    intra_node = np.add.reduceat(intra, np.arange(0, p, rpn))[node]
    inter_node = np.add.reduceat(inter, np.arange(0, p, rpn))[node]
    return (intra_node - intra) + (inter.sum() - inter_node)


def _ring_reduce(model: CostModel, s: CountSummary, size: int, fmt: Format, th) -> list[tuple[float, bool]]:
    """``world - 1`` steps; step ``t`` sends the densest chunk's running sum of ``t + 1`` contributions."""
    geo = _geometry(s.layout, s.topology)
    p = s.layout.world
    n = geo.n.max(0)  # [k]: the largest piece of each index
    mean = s.ring / (p - 1)  # [k]: the densest chunk's mean contribution
    t = np.arange(1, p)[:, None]  # contributions summed at each step
    bound = np.minimum(n, t * mean)  # [t, k]
    # the extrapolated sparsity, a running product as the planner takes it (not numpy's power,
    # whose last bit depends on the CPU's vector extensions)
    sigma = np.cumprod(np.broadcast_to(sparsities(n, mean), (p - 1, len(n))), axis=0)
    dense_bytes = n * size
    codec = model.codec(fmt) if fmt is not Format.DENSE else None
    send, recv = {}, {}
    any_sparse = False
    for h in geo.kinds:
        link = model.link(h == _INTER)
        sparse, nbytes = wire_format(
            fmt, np.broadcast_to(n, bound.shape), bound, sigma, th.inter if h else th.intra, size
        )
        sparse &= n > 0
        any_sparse = any_sparse or bool(sparse.any())
        wire = np.where(n > 0, link.latency_s + np.ceil(nbytes) / link.bandwidth, 0.0)
        enc = _codec_seconds(codec, sparse, 1, dense_bytes, "compress", math.inf)  # dense: sent as it is
        dec = np.broadcast_to(_codec_seconds(codec, sparse, 1, dense_bytes, "accumulate", model.reduce), bound.shape)
        send[h], recv[h] = (wire + enc).sum(1), np.where(n > 0, dec, 0.0).sum(1)
    busy = np.max([send[out] + recv[into] for out, into in geo.ring_pairs], axis=0)
    return [(float(x), any_sparse) for x in busy]


def _ring_gather(model: CostModel, s: CountSummary, payload: np.ndarray, size: int, fmt: Format, tau: float):
    """``world - 1`` steps forwarding every payload unchanged (encoded at the first, decoded on arrival)."""
    geo = _geometry(s.layout, s.topology)
    p = s.layout.world
    n = geo.n
    sigma = sparsities(n, payload)
    sparse, nbytes = wire_format(fmt, n, payload, sigma, tau, size)
    sparse &= n > 0
    dense_bytes = n * size
    codec = model.codec(fmt) if fmt is not Format.DENSE else None
    enc = _codec_seconds(codec, sparse, 1, dense_bytes, "compress", math.inf)  # dense: forwarded as it is
    dec = _codec_seconds(codec, sparse, 1, dense_bytes, "decompress", math.inf)
    link = model.link(_INTER in geo.kinds)
    wire = np.where(n > 0, link.latency_s + nbytes / link.bandwidth, 0.0)
    first = float((wire + enc).sum(1).max() + dec.sum(1).max())
    later = float(wire.sum(1).max() + dec.sum(1).max())
    any_sparse = bool(sparse.any())
    return [(first, any_sparse)] + [(later, any_sparse)] * (p - 2)
