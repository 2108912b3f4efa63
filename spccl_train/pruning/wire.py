"""Pruning to the wire: prune with leaky error feedback straight into an all-reduce's Pici payloads.

The unfused path reads the gradient and error buffer, writes both back (the pruned gradient, the
new error), then reads the pruned gradient again to encode it: three passes over the bucket before
a byte moves. Here one pass per piece reads the gradient and error, writes the error and the
payload, and never writes the pruned gradient (the CUDA kernel ``spccl::pici_prune_compress``).
Its oracle is :func:`prune_to_wire_reference`, which equals the unfused reference bit for bit
(``tests/test_pruning_wire.py``).

Cost: O(numel) bytes read twice (gradient, error) and written once (error) plus the payloads;
one launch per piece (``world x channels``), each a persistent grid over its tiles. A piece's grid
idles at its start (the first loads) and its end (the last tiles' look-backs, blocks without a
tile), so the pieces alternate between the caller's stream and a second one, and one piece's tail
overlaps the next one's start (H100, 1 GiB of fp32 in 8 pieces: 1.42 -> 1.37 ms). The second
stream comes from torch's pool, as the DDP hook's do: where it is a stream NCCL also drew, its
pieces wait for that stream's all-reduce (a cost, not an error).
"""

from __future__ import annotations

import torch

from ..collectives.encoded import EncodedPieces
from ..formats import Format, compress_into, uses_kernels
from ..formats import reference as codec_reference
from . import reference

__all__ = ["prune_to_wire", "prune_to_wire_reference", "prune_then_encode"]


def prune_to_wire(
    g: torch.Tensor, e: torch.Tensor, threshold: torch.Tensor, decay: float, into: EncodedPieces
) -> torch.Tensor:
    """Prune flat ``g`` against ``threshold`` into ``into``'s payloads, updating ``e``; returns the
    kept count (a one-element integer tensor on the device). ``g`` is left as it was where the CUDA
    kernels run; elsewhere it may hold the pruned values (the CPU path leaves it too)."""
    if uses_kernels(g):
        kept = torch.zeros(1, dtype=torch.int32, device=g.device)
        main = torch.cuda.current_stream(g.device)
        side = _side_stream(g.device, main)
        side.wait_stream(main)  # the gradient, error, threshold and kept are ready
        counts = []
        try:
            for i, piece in enumerate(into.pieces):
                stream = side if i % 2 else main
                with torch.cuda.stream(stream):
                    count = torch.ops.spccl.pici_prune_compress(
                        g, e, piece.start, piece.numel, threshold, decay, kept, into.payload(i)
                    )
                if stream is not main:
                    count.record_stream(main)  # made on the side stream, read on the caller's
                counts.append(count)
        finally:  # also when a piece raises: nothing main frees may still be in use on the side
            main.wait_stream(side)
        torch.cat(counts, out=into.nnz)
        return kept
    if g.is_cuda:  # no kernels: the unfused path (the reference codec on a GPU)
        return prune_then_encode(g, e, threshold, decay, into)
    return prune_to_wire_reference(g, e, threshold, decay, into)


_side_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, main: torch.cuda.Stream) -> torch.cuda.Stream:
    """A second stream for every other piece of :func:`prune_to_wire`, one per caller's stream
    (callers on other streams share no false dependency), made once. torch hands out streams from
    a pool, so it may be the caller's own: then the pieces run on it alone, in order."""
    key = (device, main.cuda_stream)
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream(device)
    return stream if stream.cuda_stream != main.cuda_stream else main


def prune_to_wire_reference(
    g: torch.Tensor, e: torch.Tensor, threshold: torch.Tensor, decay: float, into: EncodedPieces
) -> torch.Tensor:
    """The fused pass in torch, piece by piece: ``v = g + e`` in fp32, kept where ``|v| >= threshold``,
    the kept values rounded to ``g``'s dtype encoded, the others times ``decay`` into ``e``.
    ``g`` is not written. Returns the kept count (int64[1])."""
    thr = threshold.to(torch.float32)
    kept = torch.zeros(1, dtype=torch.int64, device=g.device)
    for i, piece in enumerate(into.pieces):
        span = slice(piece.start, piece.start + piece.numel)
        v = g[span].to(torch.float32) + e[span].to(torch.float32)
        keep = v.abs() >= thr
        values = torch.where(keep, v, torch.zeros_like(v)).to(g.dtype)
        e[span] = torch.where(keep, torch.zeros_like(v), v * decay)
        into.nnz[i : i + 1] = codec_reference.pici_compress(values, 0, piece.numel, into.payload(i))
        kept += keep.sum()
    return kept


def prune_then_encode(
    g: torch.Tensor, e: torch.Tensor, threshold: torch.Tensor, decay: float, into: EncodedPieces
) -> torch.Tensor:
    """The unfused path: prune ``g`` in place (:func:`.reference.prune_with_error_feedback`), then
    encode each piece of it. Returns the kept count."""
    kept = reference.prune_with_error_feedback(g, e, threshold, decay)
    for i, piece in enumerate(into.pieces):
        into.nnz[i : i + 1] = compress_into(Format.PICI, g, into.payload(i), offset=piece.start, n=piece.numel)
    return kept
