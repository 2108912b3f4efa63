"""The ring algorithm of the SpCCL paper, run from a plan: reduce-scatter and all-gather phases.

Ranks pass chunks to their right neighbour ``rank + 1`` in ``world - 1`` steps per phase; at
each step every rank sends one chunk and receives one (:func:`ring_chunk`, which the planner
(:mod:`.rank_plan`) sizes the messages by). For rank ``q`` of ``p``:

- **reduce-scatter**, step ``s`` (``0 .. p - 2``): send chunk ``(q - s - 1) % p`` (step 0: this
  rank's own contribution; later: the running sum received at step ``s - 1``, to which this rank
  added its own); receive chunk ``(q - s - 2) % p`` from ``q - 1`` and add this rank's
  contribution to it. The chunk received at the last step is chunk ``q``, now summed over all
  ``p`` ranks: this rank's result. A piece sent at step ``s`` carries ``s + 1`` contributions,
  which is how its nonzero bound and its sparsity are extrapolated (fill-in).
- **all-gather**, step ``s``: send chunk ``(q - s) % p`` (step 0: this rank's own, encoded once;
  later: the payload received at step ``s - 1``, forwarded unchanged); receive chunk
  ``(q - s - 1) % p`` from ``q - 1`` and decode it into place. After ``p - 1`` steps every rank
  holds every chunk.

Each chunk is cut into pieces (channels) and the loop is software-pipelined by piece: piece ``k`` of
step ``s`` is finished (received, reduced or decoded) and then piece ``k`` of step ``s + 1`` is
encoded and posted, so while piece ``k`` is on the wire the next pieces are being encoded. On
CUDA, ``Work.wait()`` orders the current stream after NCCL's and never blocks the host.

Buffers (one allocation per call, reused by every step): per piece, one send slot for encoded
payloads and two receive slots (alternating by step parity, so a slot being forwarded or
reduced is never the one being received into). A piece's slots are reused only after its
previous step's works completed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ..formats import Format
from ..transport import P2PTransport
from ._wire import StatusSink, as_bytes, carve, decode, encode
from .chunking import ChunkLayout
from .plan import WIRE_FORMATS, Messages, Step

__all__ = ["ring_all_gather", "ring_chunk", "ring_reduce_scatter"]

_SHIFT = {"reduce_scatter": 1, "all_gather": 0}


def ring_chunk(rank, step, world: int, phase: str):
    """The chunk ``rank`` sends to ``rank + 1`` at ``step`` of a ring ``phase`` (``"reduce_scatter"``
    or ``"all_gather"``); it receives ``ring_chunk(rank - 1, step, ...)``. Elementwise over arrays."""
    return (rank - step - _SHIFT[phase]) % world


_Pending = tuple[list, Callable[[], None] | None]


def _finish(pending: _Pending | None) -> None:
    if pending is None:
        return
    works, then = pending
    for w in works:
        w.wait()
    if then is not None:
        then()


class _Hop(NamedTuple):
    """What a ring executor reads of one message: the peer (receiver of a send, sender of a receive)."""

    peer: int
    start: int
    numel: int
    format: Format
    nbytes: int

    @property
    def sparse(self) -> bool:
        return self.format is not Format.DENSE


def _by_piece(messages: Messages, rank: int, peer: str) -> dict[int, _Hop]:
    """A step's messages that ``rank`` sends (``peer="dst"``) or receives (``peer="src"``), by piece
    index (a ring step moves one message per piece each way)."""
    cols = messages.columns
    mine = np.flatnonzero(cols["src" if peer == "dst" else "dst"] == rank)
    piece, peers, start, numel, code, nbytes = (
        cols[name][mine].tolist() for name in ("piece", peer, "start", "numel", "format", "nbytes")
    )
    return {k: _Hop(q, s, n, WIRE_FORMATS[c], b) for k, q, s, n, c, b in zip(piece, peers, start, numel, code, nbytes)}


def ring_reduce_scatter(
    transport: P2PTransport,
    steps: tuple[Step, ...],
    layout: ChunkLayout,
    x: torch.Tensor,
    out: torch.Tensor | None,
    sink: StatusSink,
    *,
    out_aliases_x: bool = False,
) -> None:
    """Sum chunk ``rank`` of every rank's ``x`` into ``out`` (or, with ``out=None``, into ``x`` in place).

    Args:
        x: flat contributions (the whole chunked tensor). Read only unless ``out`` is ``None``.
        out: flat result of this rank's chunk (``layout.chunks[rank].numel`` elements), or ``None``
            for an all-reduce, which accumulates every chunk it handles in ``x`` itself.
        out_aliases_x: ``out`` is ``x``'s own chunk (in-place reduce-scatter).

    With 16-bit data each hop adds in fp32 and rounds once (partial sums travel in the data type,
    as in NCCL's ring).
    """
    rank, ch = transport.rank, layout.channels
    if not steps:
        return
    in_place = out is None
    dtype, size = x.dtype, x.element_size()
    own = layout.chunks[rank]
    sent = [_by_piece(step.messages, rank, "dst") for step in steps]
    received = [_by_piece(step.messages, rank, "src") for step in steps]
    last = len(steps) - 1

    def lands_in_target(s: int, m: _Hop) -> bool:
        # Dense data is received straight into the running sum, then the own contribution added.
        return not m.sparse and not in_place and not (s == last and out_aliases_x)

    send_slot, recv_slot, acc_slot = [0] * ch, [0] * ch, [0] * ch
    for s in range(len(steps)):
        for k, m in sent[s].items():
            if m.sparse:
                send_slot[k] = max(send_slot[k], m.nbytes)
        for k, m in received[s].items():
            if not lands_in_target(s, m):
                recv_slot[k] = max(recv_slot[k], m.nbytes)
            if not in_place and s < last:
                acc_slot[k] = max(acc_slot[k], m.numel * size)
    regions = carve(x.device, send_slot + recv_slot + recv_slot + acc_slot + acc_slot)
    sbuf = regions[:ch]
    rbuf = (regions[ch : 2 * ch], regions[2 * ch : 3 * ch])
    acc = (
        [r.view(dtype) for r in regions[3 * ch : 4 * ch]],
        [r.view(dtype) for r in regions[4 * ch : 5 * ch]],
    )

    def target(s: int, k: int, m: _Hop) -> tuple[torch.Tensor, int]:
        """Where the sum of piece ``k`` (message ``m``) received at step ``s`` lives: (tensor, element offset)."""
        if in_place:
            return x, m.start
        if s == last:
            return out, m.start - own.start
        return acc[s % 2][k], 0

    def source(s: int, k: int, m: _Hop) -> tuple[torch.Tensor, int]:
        """What piece ``k`` (message ``m``) sent at step ``s`` is read from: the input, or last step's sum."""
        if s == 0 or in_place:
            return x, m.start
        return acc[(s - 1) % 2][k], 0

    def reducer(s: int, k: int, m: _Hop, buf: torch.Tensor) -> Callable[[], None]:
        dst, off = target(s, k, m)
        n = m.numel

        def reduce() -> None:
            if lands_in_target(s, m):
                dst[off : off + n].add_(x[m.start : m.start + n])
                return
            if not in_place:
                dst[off : off + n].copy_(x[m.start : m.start + n])
            decode(m.format, n, m.nbytes, buf, dst, off, accumulate=True, dtype=dtype, sink=sink)

        return reduce

    pending: list[_Pending | None] = [None] * ch
    for s in range(len(steps)):
        for k in range(ch):
            # finish piece k of the previous step: its sum is what this step sends
            _finish(pending[k])
            pending[k] = None
            sends, recvs, then = [], [], None
            m = sent[s].get(k)
            if m is not None:
                src, off = source(s, k, m)
                if m.sparse:
                    encode(m.format, m.numel, m.nbytes, src, off, sbuf[k])
                    sends.append((m.peer, sbuf[k][: m.nbytes]))
                else:
                    sends.append((m.peer, as_bytes(src[off : off + m.numel])))
            m = received[s].get(k)
            if m is not None:
                if lands_in_target(s, m):
                    dst, off = target(s, k, m)
                    buf = as_bytes(dst[off : off + m.numel])
                else:
                    buf = rbuf[s % 2][k][: m.nbytes]
                recvs.append((m.peer, buf))
                then = reducer(s, k, m, buf)
            if sends or recvs:
                pending[k] = (transport.send_recv(sends, recvs), then)
    for k in range(ch):
        _finish(pending[k])


def ring_all_gather(
    transport: P2PTransport,
    steps: tuple[Step, ...],
    layout: ChunkLayout,
    out: torch.Tensor,
    own: torch.Tensor,
    own_base: int,
    sink: StatusSink,
) -> None:
    """Fill every chunk of ``out`` from its owner; this rank's chunk comes from ``own``.

    Args:
        out: the flat chunked tensor. Its own chunk is not written here.
        own: holds this rank's chunk; the piece at element ``start`` of ``out`` is at ``own[start - own_base:]`` (the
            all-gather input with ``own_base = chunk start``, or ``out`` itself with 0).

    A payload is encoded once, by its owner, and forwarded unchanged; dense pieces are received
    straight into ``out`` and forwarded from there.
    """
    rank, ch = transport.rank, layout.channels
    if not steps:
        return
    dtype = out.dtype
    sent = [_by_piece(step.messages, rank, "dst") for step in steps]
    received = [_by_piece(step.messages, rank, "src") for step in steps]
    send_slot, recv_slot = [0] * ch, [0] * ch
    for k, m in sent[0].items():
        if m.sparse:
            send_slot[k] = m.nbytes
    for step_received in received:
        for k, m in step_received.items():
            if m.sparse:
                recv_slot[k] = max(recv_slot[k], m.nbytes)
    regions = carve(out.device, send_slot + recv_slot + recv_slot)
    sbuf = regions[:ch]
    rbuf = (regions[ch : 2 * ch], regions[2 * ch :])
    forward: list[torch.Tensor | None] = [None] * ch

    def decoder(m: _Hop, buf: torch.Tensor) -> Callable[[], None]:
        return lambda: decode(m.format, m.numel, m.nbytes, buf, out, m.start, accumulate=False, dtype=dtype, sink=sink)

    pending: list[_Pending | None] = [None] * ch
    for s in range(len(steps)):
        for k in range(ch):
            _finish(pending[k])
            pending[k] = None
            sends, recvs, then = [], [], None
            m = sent[s].get(k)
            if m is not None:
                if s == 0:
                    # step 0: this rank's own chunk, encoded once
                    if m.sparse:
                        encode(m.format, m.numel, m.nbytes, own, m.start - own_base, sbuf[k])
                        payload = sbuf[k][: m.nbytes]
                    else:
                        payload = as_bytes(own[m.start - own_base : m.start - own_base + m.numel])
                elif m.sparse:
                    # later steps: forward what the left neighbour sent, as it came
                    payload = forward[k]
                else:
                    payload = as_bytes(out[m.start : m.start + m.numel])
                sends.append((m.peer, payload))
            m = received[s].get(k)
            forward[k] = None
            if m is not None:
                if m.sparse:
                    buf = rbuf[s % 2][k][: m.nbytes]
                    then = decoder(m, buf)
                    forward[k] = buf
                else:
                    buf = as_bytes(out[m.start : m.start + m.numel])
                recvs.append((m.peer, buf))
            if sends or recvs:
                pending[k] = (transport.send_recv(sends, recvs), then)
    for k in range(ch):
        _finish(pending[k])
