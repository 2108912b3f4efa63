"""The direct algorithm, run from a plan: each chunk travels once, at the sparsity it was measured at.

Reduce-scatter: every rank encodes each of its contributions to the other ranks' chunks and an
``all_to_all_single`` (split sizes from the plan) delivers them; each owner then sums the
``world`` contributions of its chunk. There is no fill-in in transit, and 16-bit data is summed
in an fp32 buffer and rounded once.

All-gather: every rank encodes its chunk once; an ``all_gather`` of payloads padded to the
largest (when the plan finds the padding cheap) or grouped point-to-point sends of the exact
payloads deliver it to every rank, which decodes each chunk in place.

Waves: with ``channels > 1`` each phase runs as one exchange per piece index (wave ``k`` moves
piece ``k`` of every chunk), posted as soon as its pieces are encoded. On a GPU the exchange of
wave ``k`` runs on NCCL's stream while wave ``k + 1`` encodes, and wave ``k`` is decoded while
wave ``k + 1`` is on the wire.

All-reduce runs both in place. Its gather phase writes over chunks that still hold this rank's
own contribution, which the reduce-scatter encoded. Where both are Pici and the reduced piece is
very sparse, the decode is a patch that writes only the elements either payload marks
(``decompress_into(prior=)``) instead of the whole piece.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..formats import Format
from ..transport import P2PTransport
from ._wire import StatusSink, carve, decode, encode
from .chunking import ChunkLayout
from .plan import Message, Route, Step, wave_sizes

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
    rank, p, ch = transport.rank, transport.world, layout.channels
    dtype = x.dtype
    own = layout.chunks[rank]
    send_waves, recv_waves = _by_wave(step.sent_by(rank), ch), _by_wave(step.received_by(rank), ch)
    in_splits, out_splits = [[0] * p for _ in range(ch)], [[0] * p for _ in range(ch)]
    for k in range(ch):
        for m in send_waves[k]:
            in_splits[k][m.dst] += m.nbytes
        for m in recv_waves[k]:
            out_splits[k][m.src] += m.nbytes
    wide = dtype != torch.float32
    bufs = carve(x.device, [*map(sum, in_splits), *map(sum, out_splits), 4 * own.numel if wide else 0])
    sendbufs, recvbufs, wide_acc = bufs[:ch], bufs[ch : 2 * ch], bufs[-1]
    sent = {}
    works = []
    for k in range(ch):
        offset = 0
        for m in send_waves[k]:  # dst order: the all-to-all's input order
            slot = sendbufs[k][offset : offset + m.nbytes]
            encode(m, x, m.start, slot)
            if m.format is Format.PICI:
                sent[(m.start, m.numel)] = slot
            offset += m.nbytes
        works.append(transport.all_to_all(recvbufs[k], sendbufs[k], out_splits[k], in_splits[k]))
    target = x[own.start : own.stop] if out is None else out
    if wide:
        acc = wide_acc.view(torch.float32)
        acc.copy_(x[own.start : own.stop])
    else:
        acc = target
        if out is not None:
            acc.copy_(x[own.start : own.stop])
    for k, work in enumerate(works):
        if work is not None:
            work.wait()
        offset = 0
        for m in recv_waves[k]:  # src order: the all-to-all's output order
            slot = recvbufs[k][offset : offset + m.nbytes]
            decode(m, slot, acc, m.start - own.start, accumulate=True, dtype=dtype, sink=sink)
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
    copy_own: Callable[[], object] | None = None,
) -> None:
    """Fill every chunk of ``out`` from its owner; this rank's pieces are read from ``own``.

    ``own`` holds piece ``m`` at ``m.start - own_base`` (the all-gather input, or ``out`` itself).
    The own chunk of ``out`` is written only by ``copy_own``, which runs once the transfers are
    posted, so on a GPU the copy overlaps them. ``held``: Pici payloads of what pieces of ``out``
    hold now (by ``(start, numel)``), which turn Pici decodes of those pieces into patches.
    """
    rank, p, ch = transport.rank, transport.world, layout.channels
    dtype = out.dtype
    right = (rank + 1) % p
    # one payload for every receiver; each source's pieces in piece order
    mine = _by_wave([m for m in step.messages if m.src == rank and m.dst == right], ch)
    theirs = _by_wave(step.received_by(rank), ch)
    padded = step.route is Route.ALL_GATHER
    size_of = wave_sizes(step, p, ch)
    recv_sizes = [[max(size_of[k]) if padded else size_of[k][q] for q in range(p)] for k in range(ch)]
    bufs = carve(out.device, [*(sizes[rank] for sizes in recv_sizes), *map(sum, recv_sizes)])
    sendbufs, recvbufs = bufs[:ch], bufs[ch:]
    works = []
    for k in range(ch):
        offset = 0
        for m in mine[k]:
            encode(m, own, m.start - own_base, sendbufs[k][offset : offset + m.nbytes])
            offset += m.nbytes
        if padded:
            work = transport.all_gather(recvbufs[k], sendbufs[k])
            works.append([] if work is None else [work])
        else:
            at = _starts(recv_sizes[k])
            sends = [(d, sendbufs[k]) for d in range(p) if d != rank]
            recvs = [(q, recvbufs[k][at[q] : at[q] + recv_sizes[k][q]]) for q in range(p) if q != rank]
            works.append(transport.send_recv(sends, recvs))
    if copy_own is not None:
        copy_own()
    patch_bound = PATCH_MAX_DENSITY * 4 / out.element_size()
    for k, waiting in enumerate(works):
        for w in waiting:
            w.wait()
        offsets = _starts(recv_sizes[k])
        for m in theirs[k]:
            decode(
                m,
                recvbufs[k][offsets[m.src] : offsets[m.src] + m.nbytes],
                out,
                m.start,
                accumulate=False,
                dtype=dtype,
                sink=sink,
                prior=held.get((m.start, m.numel)) if held and m.nnz_bound <= patch_bound * m.numel else None,
            )
            offsets[m.src] += m.nbytes


def _by_wave(messages: list[Message], channels: int) -> list[list[Message]]:
    """``messages`` split by piece index (wave), each wave in the order given."""
    waves = [[] for _ in range(channels)]
    for m in messages:
        waves[m.piece].append(m)
    return waves


def _starts(sizes: list[int]) -> list[int]:
    """Where each rank's region starts in a buffer packed in rank order."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts
