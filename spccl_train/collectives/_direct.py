"""The direct algorithm, run from a plan: each chunk travels once, at the sparsity it was measured at.

Reduce-scatter: every rank encodes each of its contributions to the other ranks' chunks and an
``all_to_all_single`` (split sizes from the plan) delivers them; each owner then sums the
``world`` contributions of its chunk. There is no fill-in in transit, and 16-bit data is summed
in an fp32 buffer and rounded once (with two ranks, one addition: in place, rounded once alike).

All-gather: every rank encodes its chunk once; an ``all_gather`` of payloads padded to the
largest (when the plan finds the padding cheap) or grouped point-to-point sends of the exact
payloads deliver it to every rank, which decodes each chunk in place.

Waves: with ``channels > 1`` each phase runs as one exchange per piece index (wave ``k`` moves
piece ``k`` of every chunk), posted as soon as its pieces are encoded. On a GPU the exchange of
wave ``k`` runs on NCCL's stream while wave ``k + 1`` encodes, and wave ``k`` is decoded while
wave ``k + 1`` is on the wire.

All-reduce runs both in place. When its gather phase is sized from bounds (no second count
exchange), both phases are planned up front and the gather of wave ``k`` is posted as soon as
wave ``k`` is summed (:func:`direct_all_reduce`); its transfer then runs beside the later waves'
accumulation (NCCL queues it behind the reduce-scatter's transfers). The gather phase writes
over chunks that still hold this rank's own contribution, which the reduce-scatter encoded.
Where both are Pici and the reduced piece is very sparse, the decode is a patch that writes only
the elements either payload marks (``decompress_into(prior=)``) instead of the whole piece.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..formats import Format
from ..transport import P2PTransport
from ._wire import StatusSink, carve, decode, encode
from .chunking import ChunkLayout
from .encoded import EncodedPieces
from .plan import WIRE_FORMATS, Messages, Route, Step

__all__ = ["direct_reduce_scatter", "direct_all_gather", "direct_all_reduce"]

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
    after_wave: Callable[[int], object] | None = None,
    encoded: EncodedPieces | None = None,
) -> dict[tuple[int, int], torch.Tensor]:
    """Sum chunk ``rank`` of every rank's ``x`` into ``out`` (``None``: into ``x``'s own chunk).

    ``x`` is read only when ``out`` is given; ``out`` may be ``x``'s own chunk (in place). Returns
    the Pici payloads this rank sent, by piece ``(start, numel)``: what those pieces of ``x`` hold.
    ``after_wave(k)`` is called as soon as piece ``k`` of the result is final.

    ``encoded``: this rank's input as payloads (``x``'s contents unread): a Pici message is its
    piece's payload, copied as it is; a piece sent in another format, and the own chunk, are
    decoded into ``x`` first. Then ``x``'s other pieces do not hold what was sent: nothing is returned.
    """
    rank, p, ch = transport.rank, transport.world, layout.channels
    dtype = x.dtype
    own = layout.chunks[rank]
    messages = step.messages
    in_splits, out_splits, send_waves, recv_waves = messages.derived(
        ("scatter", rank, ch, p), lambda: _scatter_waves(messages, rank, ch, p)
    )
    # 16-bit sums gather in float32 and round once per piece: p - 1 additions, one rounding. With
    # one contribution (two ranks) a 16-bit add is that already (the kernels and torch add in
    # float32 and round to nearest even), so the float32 copy of the chunk, in and out, buys nothing
    # (but for NaN payload bits, which the copy made canonical and now stay as they came).
    wide = dtype != torch.float32 and p > 2
    bufs = carve(x.device, [*map(sum, in_splits), *map(sum, out_splits), 4 * own.numel if wide else 0])
    sendbufs, recvbufs, wide_acc = bufs[:ch], bufs[ch : 2 * ch], bufs[-1]
    sent = {}
    works = []
    if encoded is not None:
        encoded.decode_into(x, [rank], sink=sink)
    for k in range(ch):
        offset = 0
        for start, numel, code, nbytes, dst, piece in send_waves[k]:
            slot = sendbufs[k][offset : offset + nbytes]
            fmt = WIRE_FORMATS[code]
            if encoded is None:
                encode(fmt, numel, nbytes, x, start, slot)
                if fmt is Format.PICI:
                    sent[(start, numel)] = slot
            elif fmt is Format.PICI:
                slot.copy_(encoded.payload(dst * ch + piece)[:nbytes])
            else:
                encoded.decode_piece_into(x, dst, piece, sink=sink)
                encode(fmt, numel, nbytes, x, start, slot)
            offset += nbytes
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
        for start, numel, code, nbytes in recv_waves[k]:
            slot = recvbufs[k][offset : offset + nbytes]
            decode(
                WIRE_FORMATS[code], numel, nbytes, slot, acc, start - own.start, accumulate=True, dtype=dtype, sink=sink
            )
            offset += nbytes
        if wide:  # piece k is summed: round it once
            piece = layout.pieces[rank][k]
            span = slice(piece.start - own.start, piece.stop - own.start)
            target[span].copy_(acc[span])
        if after_wave is not None:
            after_wave(k)
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

    ``own`` holds the piece that starts at element ``start`` of ``out`` at ``start - own_base`` (the all-gather input, or ``out`` itself).
    The own chunk of ``out`` is written only by ``copy_own``, which runs once the transfers are
    posted, so on a GPU the copy overlaps them. ``held``: as for :meth:`_Gather.finish`.
    """
    gather = _Gather(transport, step, layout, out, own, own_base, sink)
    for k in range(layout.channels):
        gather.post(k)
    if copy_own is not None:
        copy_own()
    gather.finish(held)


def direct_all_reduce(
    transport: P2PTransport,
    scatter: Step,
    gather: Step,
    layout: ChunkLayout,
    x: torch.Tensor,
    sink: StatusSink,
    encoded: EncodedPieces | None = None,
) -> None:
    """Sum ``x`` over the ranks in place: the direct reduce-scatter, then the direct all-gather.

    The gather of wave ``k`` is encoded and posted as soon as the reduce-scatter has summed wave
    ``k``, before the later waves are summed, so on a GPU its transfer runs beside their
    accumulation. Its decodes patch pieces that stay sparse (see :data:`PATCH_MAX_DENSITY`): the
    pieces of ``x`` still hold what this rank sent in the reduce-scatter (unless the input came
    ``encoded``: then every piece is overwritten).
    """
    phase = _Gather(transport, gather, layout, x, x, 0, sink)
    held = direct_reduce_scatter(transport, scatter, layout, x, None, sink, after_wave=phase.post, encoded=encoded)
    phase.finish(held)


class _Gather:
    """A direct all-gather step with its buffers carved: :meth:`post` each wave, then :meth:`finish`."""

    def __init__(
        self,
        transport: P2PTransport,
        step: Step,
        layout: ChunkLayout,
        out: torch.Tensor,
        own: torch.Tensor,
        own_base: int,
        sink: StatusSink,
    ) -> None:
        rank, p, ch = transport.rank, transport.world, layout.channels
        self._transport, self._out, self._own, self._own_base, self._sink = transport, out, own, own_base, sink
        messages = step.messages
        self._mine, self._theirs = messages.derived(
            ("gather", rank, ch, p), lambda: _gather_waves(messages, rank, ch, p)
        )
        self._padded = step.route is Route.ALL_GATHER
        size_of = step.wave_bytes
        self._recv_sizes = [[max(size_of[k]) if self._padded else size_of[k][q] for q in range(p)] for k in range(ch)]
        bufs = carve(out.device, [*(sizes[rank] for sizes in self._recv_sizes), *map(sum, self._recv_sizes)])
        self._sendbufs, self._recvbufs = bufs[:ch], bufs[ch:]
        self._works: list[list] = []

    def post(self, k: int) -> None:
        """Encode this rank's piece ``k`` and post wave ``k``'s exchange (waves in order 0, 1, ...)."""
        transport, rank, p = self._transport, self._transport.rank, self._transport.world
        sendbuf, recvbuf, sizes = self._sendbufs[k], self._recvbufs[k], self._recv_sizes[k]
        offset = 0
        for start, numel, code, nbytes in self._mine[k]:
            slot = sendbuf[offset : offset + nbytes]
            encode(WIRE_FORMATS[code], numel, nbytes, self._own, start - self._own_base, slot)
            offset += nbytes
        if self._padded:
            work = transport.all_gather(recvbuf, sendbuf)
            self._works.append([] if work is None else [work])
        else:
            at = _starts(sizes)
            sends = [(d, sendbuf) for d in range(p) if d != rank]
            recvs = [(q, recvbuf[at[q] : at[q] + sizes[q]]) for q in range(p) if q != rank]
            self._works.append(transport.send_recv(sends, recvs))

    def finish(self, held: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
        """Wait for each posted wave and decode it into the other chunks of ``out``.

        ``held``: Pici payloads of what pieces of ``out`` hold now (by ``(start, numel)``), which turn
        Pici decodes of those pieces into patches.
        """
        out = self._out
        patch_bound = PATCH_MAX_DENSITY * 4 / out.element_size()
        for k, waiting in enumerate(self._works):
            for w in waiting:
                w.wait()
            offsets = _starts(self._recv_sizes[k])
            for src, start, numel, code, nbytes, bound in self._theirs[k]:
                patch = held and bound <= patch_bound * numel
                decode(
                    WIRE_FORMATS[code],
                    numel,
                    nbytes,
                    self._recvbufs[k][offsets[src] : offsets[src] + nbytes],
                    out,
                    start,
                    accumulate=False,
                    dtype=out.dtype,
                    sink=self._sink,
                    prior=held.get((start, numel)) if patch else None,
                )
                offsets[src] += nbytes


def _scatter_waves(messages: Messages, rank: int, channels: int, world: int) -> tuple:
    """A direct reduce-scatter's ``(in_splits, out_splits, send_waves, recv_waves)`` for ``rank``:
    the bytes of each wave's all-to-all by peer, and the messages it sends (in destination order)
    and receives (in source order: its output's), by wave."""
    cols = messages.columns
    sends, receives = cols["src"] == rank, cols["dst"] == rank
    return (
        _splits(messages, sends, "dst", channels, world),
        _splits(messages, receives, "src", channels, world),
        _waves(messages, sends, channels, "start", "numel", "format", "nbytes", "dst", "piece"),
        _waves(messages, receives, channels, "start", "numel", "format", "nbytes"),
    )


def _gather_waves(messages: Messages, rank: int, channels: int, world: int) -> tuple:
    """A direct all-gather's ``(mine, theirs)`` for ``rank``, by wave: the payloads it encodes once
    for every receiver (planned on its messages to the right neighbour), and the messages it decodes."""
    cols = messages.columns
    to_right = (cols["src"] == rank) & (cols["dst"] == (rank + 1) % world)
    return (
        _waves(messages, to_right, channels, "start", "numel", "format", "nbytes"),
        _waves(messages, cols["dst"] == rank, channels, "src", "start", "numel", "format", "nbytes", "nnz_bound"),
    )


def _waves(messages: Messages, mask: np.ndarray, channels: int, *names: str) -> list[list[tuple]]:
    """The named fields of the messages where ``mask`` holds, split by piece index (wave), each
    wave in message order."""
    cols = messages.columns
    picked = np.flatnonzero(mask)
    piece = cols["piece"][picked]
    order = picked[np.argsort(piece, kind="stable")]
    rows = list(zip(*(cols[name][order].tolist() for name in names)))
    ends = np.cumsum(np.bincount(piece, minlength=channels)).tolist()
    return [rows[(ends[k - 1] if k else 0) : ends[k]] for k in range(channels)]


def _splits(messages: Messages, mask: np.ndarray, by: str, channels: int, world: int) -> list[list[int]]:
    """``splits[k][q]``: bytes of wave ``k``'s messages (where ``mask`` holds) whose field ``by`` is ``q``."""
    cols = messages.columns
    slot = cols["piece"][mask] * world + cols[by][mask]
    sums = np.bincount(slot, weights=cols["nbytes"][mask], minlength=channels * world)  # exact below 2**53
    return sums.astype(np.int64).reshape(channels, world).tolist()


def _starts(sizes: list[int]) -> list[int]:
    """Where each rank's region starts in a buffer packed in rank order."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts
