"""One rank's plan: the messages it sends and receives, computed with array operations.

The reference planners of :mod:`.plan` build every rank's messages, O(world^2 x channels) Python
objects per call. A call needs only its own: O(world x channels) messages, each equal, field for
field, to the reference's (the tests compare them on random tables), so the ranks agree on every
size without exchanging any. Sizes, formats and sparsities are computed with numpy over the
exchanged table in the planner's order of floating-point operations (a ring's sparsity is the
running product of its contributors' in ring order, as the reference multiplies it), and turned
into :class:`~.plan.Message` tuples once.

Cost per call (rank ``r``, world ``p``, channels ``ch``): a direct step, O(p x ch); a ring
reduce-scatter, O(p^2 x ch) array work (each step's bound sums the contributions of the ranks
before ``r`` in the ring, which is a band of the whole table) and O(p x ch) messages; a ring
all-gather O(p x ch).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..formats import COO_HEADER_BYTES, Format
from ..formats.layout import element_size, pici_metadata_bytes_of
from ._ring import ring_chunk
from .chunking import ChunkLayout, piece_arrays
from .plan import (
    FORMAT_CODE,
    Messages,
    Phase,
    Plan,
    Route,
    Step,
    padded_slot,
    sparsities,
    wire_format,
)
from .thresholds import ResolvedThresholds
from .topology import Topology

__all__ = ["plan_reduce_scatter_for", "plan_direct_reduce_scatter_for", "plan_all_gather_for"]


def _node(topology: Topology, ranks: np.ndarray) -> np.ndarray:
    rpn = topology.ranks_per_node
    return np.zeros_like(ranks) if rpn is None else ranks // rpn


def _messages(
    fmt: Format,
    dtype: torch.dtype,
    packed: bool,
    src: np.ndarray,
    dst: np.ndarray,
    chunk: np.ndarray,
    piece: np.ndarray,
    start: np.ndarray,
    n: np.ndarray,
    bound: np.ndarray,
    exact: np.ndarray,
    sigma: np.ndarray,
    tau: np.ndarray,
    inter: np.ndarray,
    sized: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> Messages:
    """Messages from equally long arrays of their fields, each format chosen by the planner's rule
    (:func:`~.plan.choose_format`): sparse when sparser than its threshold and smaller than dense.
    ``sized``: that rule's ``(sparse, nbytes, dense_nbytes)`` of every message, when known."""
    sparse, nbytes, dense = _sizes(fmt, dtype, packed, n, bound, sigma, tau) if sized is None else sized
    columns = dict(  # Message's fields, in its order; every one an array
        src=src,
        dst=dst,
        chunk=chunk,
        piece=piece,
        start=start,
        numel=n,
        format=np.where(sparse, FORMAT_CODE[fmt], 0),
        nbytes=nbytes,
        nnz_bound=bound,
        nnz_exact=exact,
        sparsity=sigma,
        threshold=tau,
        inter_node=inter,
        dense_nbytes=dense,
    )
    return Messages(columns)


def _sizes(fmt: Format, dtype: torch.dtype, packed: bool, n, bound, sigma, tau) -> tuple[np.ndarray, ...]:
    """``(sparse, nbytes, dense_nbytes)`` of pieces of ``n`` elements sized for ``bound`` nonzeros."""
    size = element_size(dtype)
    sparse, nbytes = wire_format(fmt, n, bound, sigma, tau, size)
    if packed:
        nbytes = (nbytes + 15) & ~15
    return sparse, nbytes, n * size


def _packed_sizes(
    fmt: Format, size: int, n: np.ndarray, meta: np.ndarray, count: np.ndarray, sigma: np.ndarray, tau
) -> tuple[np.ndarray, ...]:
    """:func:`_sizes` of packed messages, with their pieces' Pici metadata bytes ``meta`` known:
    the same integers in fewer array operations (an empty piece has 0 bytes dense, so it never
    travels sparse, whatever its ``sigma``)."""
    dense = n * size
    if fmt is Format.DENSE:
        return np.zeros(n.shape, dtype=bool), (dense + 15) & ~15, dense
    values = count * size
    payload = meta + values if fmt is Format.PICI else COO_HEADER_BYTES + ((4 * count + 15) & ~15) + values
    sparse = (sigma > tau) & (payload < dense)
    return sparse, (np.where(sparse, payload, dense) + 15) & ~15, dense


def plan_reduce_scatter_for(
    rank: int,
    table: object,
    layout: ChunkLayout,
    dtype: torch.dtype,
    *,
    fmt: Format,
    algorithm: str,
    thresholds: ResolvedThresholds,
    topology: Topology,
    collective: str = "reduce_scatter",
    exact: bool = True,
) -> Plan:
    """Rank ``rank``'s part of :func:`~.plan.plan_reduce_scatter`'s plan (every message it sends or
    receives, in the reference's order); ``table`` as there, nested sequences or an array.
    ``exact``: the table holds counts, not bounds (what messages report as ``nnz_exact``)."""
    p, ch = layout.world, layout.channels
    cube = np.asarray(table, dtype=np.int64).reshape(p, -1)[:, : p * ch].reshape(p, p, ch)
    if algorithm == "direct":
        return plan_direct_reduce_scatter_for(
            rank,
            cube[rank],
            cube[:, rank],
            layout,
            dtype,
            fmt=fmt,
            thresholds=thresholds,
            topology=topology,
            collective=collective,
            exact=exact,
        )
    if algorithm != "ring":
        raise ValueError(f"algorithm={algorithm!r} must be 'ring' or 'direct' to plan")
    n, start = piece_arrays(layout)
    steps = _ring_reduce_scatter(rank, cube, n, start, dtype, fmt, thresholds, topology, exact)
    return Plan(collective, algorithm, fmt, dtype, layout, topology, steps, rank)


def plan_direct_reduce_scatter_for(
    rank: int,
    row: np.ndarray,
    column: np.ndarray,
    layout: ChunkLayout,
    dtype: torch.dtype,
    *,
    fmt: Format,
    thresholds: ResolvedThresholds,
    topology: Topology,
    collective: str = "reduce_scatter",
    exact: bool = True,
) -> Plan:
    """Rank ``rank``'s direct reduce-scatter from what it holds and what it receives alone:
    ``row[c, k]``, its own count of piece ``k`` of chunk ``c``, and ``column[q, k]``, rank ``q``'s
    count of piece ``k`` of this rank's chunk (``exact``: counts; else bounds). O(world x channels)."""
    p = layout.world
    if p == 1:
        return Plan(collective, "direct", fmt, dtype, layout, topology, (), rank)
    geo = _direct_geometry(rank, layout, topology, gather=False)
    count = np.concatenate([np.ravel(row), np.ravel(column)])[geo.counted]
    tau = np.where(geo.inter, thresholds.inter, thresholds.intra)
    sigma = 1.0 - count / geo.n  # sparsities(): every piece here has elements
    exact = np.full(len(count), exact)
    sized = _packed_sizes(fmt, element_size(dtype), geo.n, geo.meta, count, sigma, tau)
    messages = _direct_messages(fmt, dtype, geo, count, exact, sigma, tau, sized)
    step = Step(Phase.REDUCE_SCATTER, 0, Route.ALL_TO_ALL, messages)
    return Plan(collective, "direct", fmt, dtype, layout, topology, (step,), rank)


def _direct_messages(fmt, dtype, geo: _Direct, count, exact, sigma, tau, sized) -> Messages:
    """A direct step's messages: its geometry's fields with these counts, estimates and sizes."""
    g = geo
    return _messages(
        fmt, dtype, True, g.src, g.dst, g.chunk, g.piece, g.start, g.n, count, exact, sigma, tau, g.inter, sized=sized
    )


class _Direct(NamedTuple):
    """What a layout and topology fix of one rank's direct step: its messages' fields other than
    counts, sizes and formats (read-only arrays, made once per rank, layout, topology and phase)."""

    src: np.ndarray
    dst: np.ndarray
    chunk: np.ndarray
    piece: np.ndarray
    start: np.ndarray
    n: np.ndarray
    inter: np.ndarray
    meta: np.ndarray
    """Each message's Pici metadata bytes (fixed by its piece's length)."""
    counted: np.ndarray
    """Where each message's count is: a reduce-scatter's in ``row.ravel()`` followed by
    ``column.ravel()``; an all-gather's in the ``[owner, piece]`` table, flattened."""


@functools.lru_cache(maxsize=64)
def _piece_terms(layout: ChunkLayout) -> tuple[np.ndarray, np.ndarray]:
    """Every piece's element count (at least 1: a sparsity's divisor) and Pici metadata bytes, ``[c, k]``."""
    n = piece_arrays(layout)[0]
    return np.maximum(n, 1), pici_metadata_bytes_of(n)


@functools.lru_cache(maxsize=64)
def _direct_geometry(rank: int, layout: ChunkLayout, topology: Topology, gather: bool) -> _Direct:
    """A direct step's messages of ``rank``, in the reference's (src, dst, piece) order: from lower
    ranks to this one, from this rank to every other, from higher ranks to this one. A
    reduce-scatter message carries the receiver's chunk, an all-gather message the sender's."""
    n_all, start_all = piece_arrays(layout)
    p, ch = n_all.shape
    ranks = np.arange(p)
    node = _node(topology, ranks)
    others = np.delete(ranks, rank)
    src = np.concatenate([np.repeat(ranks[:rank], ch), np.full((p - 1) * ch, rank), np.repeat(ranks[rank + 1 :], ch)])
    dst = np.concatenate([np.full(rank * ch, rank), np.repeat(others, ch), np.full((p - 1 - rank) * ch, rank)])
    piece = np.tile(np.arange(ch), 2 * (p - 1))
    chunk = src if gather else dst
    keep = n_all[chunk, piece] > 0
    src, dst, chunk, piece = src[keep], dst[keep], chunk[keep], piece[keep]
    if gather:
        counted = chunk * ch + piece
    else:
        counted = np.where(src == rank, chunk * ch + piece, p * ch + src * ch + piece)
    n, meta = n_all[chunk, piece], _piece_terms(layout)[1][chunk, piece]
    fields = _Direct(src, dst, chunk, piece, start_all[chunk, piece], n, node[src] != node[dst], meta, counted)
    for a in fields:
        a.flags.writeable = False
    return fields


def _ring_reduce_scatter(rank, cube, n, start, dtype, fmt, th, topo, exact=True) -> tuple[Step, ...]:
    # The schedule is _ring.ring_chunk's: the piece of chunk c sent at step s carries the
    # contributions of ranks c + 1, ..., q (s + 1 of them, in ring order).
    p, ch = n.shape
    if p == 1:
        return ()
    ranks = np.arange(p)
    node = _node(topo, ranks)
    offsets = np.arange(1, p)
    contributors = (ranks[:, None] + offsets[None, :]) % p  # [c, i]: the i-th contributor of chunk c
    held = cube[contributors, ranks[:, None], :]  # [c, i, k]
    nn = n[:, None, :]
    bound = np.minimum(nn, np.cumsum(held, axis=1))
    sigma = np.cumprod(sparsities(nn, held), axis=1)  # the reference's running product, in its order
    exact = (np.cumsum(held > 0, axis=1) <= 1) & exact
    return _ring_steps(
        Phase.REDUCE_SCATTER,
        rank,
        n,
        start,
        node,
        dtype,
        fmt,
        lambda c, s, k: (bound[c, s, k], exact[c, s, k], sigma[c, s, k]),
        lambda inter: np.where(inter, th.inter, th.intra),
    )


def _ring_steps(phase, rank, n, start, node, dtype, fmt, fields, threshold) -> tuple[Step, ...]:
    """This rank's ring steps, on :func:`~._ring.ring_chunk`'s schedule: this rank's messages are
    its own and its left neighbour's (what it receives), in rank order. ``fields(c, s, k)`` gives
    ``(bound, exact, sigma)`` of piece ``k`` of chunk ``c`` sent at step ``s`` (equally long index
    arrays); ``threshold(inter)`` each hop's threshold."""
    p, ch = n.shape
    if p == 1:
        return ()
    senders = np.array(sorted({rank, (rank - 1) % p}))
    chunks = ring_chunk(senders[None, :], np.arange(p - 1)[:, None], p, phase.value)  # [step, sender]
    s, j, k = np.nonzero(n[chunks] > 0)  # every message, in (step, sender, piece) order
    c, src = chunks[s, j], senders[j]
    dst = (src + 1) % p
    inter = node[src] != node[dst]
    bound, exact, sigma = fields(c, s, k)
    messages = _messages(
        fmt, dtype, False, src, dst, c, k, start[c, k], n[c, k], bound, exact, sigma, threshold(inter), inter
    )
    bounds = [0, *np.searchsorted(s, np.arange(1, p)).tolist()]  # where each step's messages end
    return tuple(
        Step(phase, step, Route.P2P, messages.where(slice(bounds[step], bounds[step + 1]))) for step in range(p - 1)
    )


def plan_all_gather_for(
    rank: int,
    counts: Sequence[Sequence[int]] | np.ndarray,
    layout: ChunkLayout,
    dtype: torch.dtype,
    *,
    fmt: Format,
    algorithm: str,
    threshold: float,
    topology: Topology,
    collective: str = "all_gather",
    measured: bool = True,
) -> Plan:
    """Rank ``rank``'s part of :func:`~.plan.plan_all_gather`'s plan; ``counts[c][k]`` as there.

    A direct step keeps every rank's payload size per wave (:attr:`~.plan.Step.wave_bytes`),
    which the receivers need, and pads as the reference does."""
    p, ch = layout.world, layout.channels
    payload = np.asarray(counts, dtype=np.int64).reshape(p, ch)
    n, start = piece_arrays(layout)
    if algorithm == "ring":  # each payload forwarded p - 1 times unchanged
        sigma_all = sparsities(n, payload)
        node = _node(topology, np.arange(p))
        steps = _ring_steps(
            Phase.ALL_GATHER,
            rank,
            n,
            start,
            node,
            dtype,
            fmt,
            lambda c, s, k: (payload[c, k], np.full(len(c), measured), sigma_all[c, k]),
            lambda inter: np.full(inter.shape, threshold),
        )
        return Plan(collective, algorithm, fmt, dtype, layout, topology, tuple(steps), rank)
    if algorithm != "direct":
        raise ValueError(f"algorithm={algorithm!r} must be 'ring' or 'direct' to plan")
    if p == 1:
        return Plan(collective, algorithm, fmt, dtype, layout, topology, (), rank)
    # every owner's payload per wave (what its receivers size their buffers by); a message carries its owner's
    n_safe, meta = _piece_terms(layout)
    sigma_all = 1.0 - payload / n_safe  # sparsities(): 1.0 for an empty piece, which never travels sparse
    sparse, sizes, dense = _packed_sizes(fmt, element_size(dtype), n, meta, payload, sigma_all, threshold)
    waves = tuple(map(tuple, np.where(n > 0, sizes, 0).T.tolist()))
    geo = _direct_geometry(rank, layout, topology, gather=True)
    at = geo.counted
    messages = _direct_messages(
        fmt,
        dtype,
        geo,
        payload.ravel()[at],
        np.full(len(at), measured),
        sigma_all.ravel()[at],
        np.full(len(at), threshold),
        (sparse.ravel()[at], sizes.ravel()[at], dense.ravel()[at]),
    )
    padded = padded_slot(waves, p)
    route = Route.ALL_GATHER if padded else Route.P2P
    step = Step(Phase.ALL_GATHER, 0, route, messages, slot_bytes=padded, wave_bytes=waves)
    return Plan(collective, algorithm, fmt, dtype, layout, topology, (step,), rank)
