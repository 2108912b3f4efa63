"""The direct algorithm, run from a plan: each chunk travels once, at the sparsity it was measured at.

Reduce-scatter: every rank encodes each of its contributions to the other ranks' chunks into one
packed buffer and a single ``all_to_all_single`` (split sizes from the plan) delivers them; each
owner then sums the ``world`` contributions of its chunk. There is no fill-in in transit, and
16-bit data is summed in an fp32 buffer and rounded once.

All-gather: every rank encodes its chunk once; one ``all_gather`` of payloads padded to the
largest (when the plan finds the padding cheap) or grouped point-to-point sends of the exact
payloads deliver it to every rank, which decodes each chunk in place.

All-reduce runs both in place. Its gather phase writes over chunks that still hold this rank's
own contribution, which the reduce-scatter encoded. Where both are Pici and the reduced piece is
very sparse, the decode is a patch that writes only the elements either payload marks
(``decompress_into(prior=)``) instead of the whole piece.
"""

from __future__ import annotations

import torch

from ..formats import Format
from ..transport import P2PTransport
from ._wire import StatusSink, carve, decode, encode
from .chunking import ChunkLayout
from .plan import Route, Step

__all__ = ["direct_reduce_scatter", "direct_all_gather"]

PATCH_MAX_DENSITY = 0.02
"""Most nonzeros per 4 bytes of a piece (its bound) for which a gather decode patches. Scattered
writes cost HBM a read and a write per touched sector, so a patch beats writing the whole piece only
at low density: on H200, 256 MiB fp32, patch / overwrite time was 0.65 at 0.1% density, 0.82 at
1%, 0.90 at 2%, 0.99 at 3% and 1.10 at 4% (``bench/bench_patch.py``,
``bench/results/patch_nvidia-h200_2026-11-22.csv``)."""


def direct_reduce_scatter(
    transport: P2PTransport,
    step: Step,
    layout: ChunkLayout,
    x: torch.Tensor,
    out: torch.Tensor | None,
    sink: StatusSink,
) -> dict[tuple[int, int], torch.Tensor]:
    """Sum chunk ``rank`` of every rank's ``x`` into ``out`` (``None``: into ``x``'s own chunk).

    ``x`` is read only when ``out`` is given; ``out`` may be ``x``'s own chunk (in place). Returns
    the Pici payloads this rank sent, by piece ``(start, numel)``: what those pieces of ``x`` hold.
    """
    rank, p = transport.rank, transport.world
    dtype = x.dtype
    own = layout.chunks[rank]
    sends, recvs = step.sent_by(rank), step.received_by(rank)
    in_splits, out_splits = [0] * p, [0] * p
    for m in sends:
        in_splits[m.dst] += m.nbytes
    for m in recvs:
        out_splits[m.src] += m.nbytes
    wide = dtype != torch.float32
    sendbuf, recvbuf, wide_acc = carve(x.device, [sum(in_splits), sum(out_splits), 4 * own.numel if wide else 0])
    offset = 0
    sent = {}
    for m in sends:  # (dst, piece) order: the all-to-all's input order
        slot = sendbuf[offset : offset + m.nbytes]
        encode(m, x, m.start, slot)
        if m.format is Format.PICI:
            sent[(m.start, m.numel)] = slot
        offset += m.nbytes
    work = transport.all_to_all(recvbuf, sendbuf, out_splits, in_splits)
    target = x[own.start : own.stop] if out is None else out
    if wide:
        acc = wide_acc.view(torch.float32)
        acc.copy_(x[own.start : own.stop])
    else:
        acc = target
        if out is not None:
            acc.copy_(x[own.start : own.stop])
    if work is not None:
        work.wait()
    offset = 0
    for m in recvs:  # (src, piece) order: the all-to-all's output order
        decode(
            m, recvbuf[offset : offset + m.nbytes], acc, m.start - own.start, accumulate=True, dtype=dtype, sink=sink
        )
        offset += m.nbytes
    if wide:
        target.copy_(acc)
    return sent


def direct_all_gather(
    transport: P2PTransport,
    step: Step,
    layout: ChunkLayout,
    out: torch.Tensor,
    own: torch.Tensor,
    own_base: int,
    sink: StatusSink,
    held: dict[tuple[int, int], torch.Tensor] | None = None,
) -> None:
    """Fill every chunk of ``out`` from its owner; this rank's pieces are read from ``own``.

    ``own`` holds piece ``m`` at ``m.start - own_base`` (the all-gather input, or ``out`` itself).
    The own chunk of ``out`` is not written here. ``held``: Pici payloads of what pieces of ``out``
    hold now (by ``(start, numel)``), which turn Pici decodes of those pieces into patches.
    """
    rank, p = transport.rank, transport.world
    dtype = out.dtype
    right = (rank + 1) % p
    mine = [m for m in step.messages if m.src == rank and m.dst == right]  # one payload for every receiver
    theirs = step.received_by(rank)
    padded = step.route is Route.ALL_GATHER
    size_of = [0] * p
    for m in step.messages:
        if m.dst == (m.src + 1) % p:
            size_of[m.src] += m.nbytes
    slot = step.slot_bytes if padded else size_of[rank]
    recv_sizes = [step.slot_bytes if padded else size_of[q] for q in range(p)]
    recv_offsets = [sum(recv_sizes[:q]) for q in range(p)]
    sendbuf, recvbuf = carve(out.device, [slot, sum(recv_sizes)])
    offset = 0
    for m in mine:
        encode(m, own, m.start - own_base, sendbuf[offset : offset + m.nbytes])
        offset += m.nbytes
    if padded:
        work = transport.all_gather(recvbuf, sendbuf)
        works = [] if work is None else [work]
    else:
        sends = [(d, sendbuf) for d in range(p) if d != rank]
        recvs = [(q, recvbuf[recv_offsets[q] : recv_offsets[q] + recv_sizes[q]]) for q in range(p) if q != rank]
        works = transport.send_recv(sends, recvs)
    for w in works:
        w.wait()
    offsets = list(recv_offsets)
    patch_bound = PATCH_MAX_DENSITY * 4 / out.element_size()
    for m in theirs:  # (src, piece) order: each source's pieces are packed in piece order
        decode(
            m,
            recvbuf[offsets[m.src] : offsets[m.src] + m.nbytes],
            out,
            m.start,
            accumulate=False,
            dtype=dtype,
            sink=sink,
            prior=held.get((m.start, m.numel)) if held and m.nnz_bound <= patch_bound * m.numel else None,
        )
        offsets[m.src] += m.nbytes
