"""Pruning to the wire: prune with leaky error feedback straight into an all-reduce's Pici payloads.

The unfused path reads the gradient and error buffer, writes both back (the pruned gradient, the
new error), then reads the pruned gradient again to encode it: three passes over the bucket before
a byte moves. Here one pass reads the gradient and error, writes the error and every piece's
payload, and never writes the pruned gradient (the CUDA kernel ``spccl::pici_prune_compress_pieces``).
Its oracle is :func:`prune_to_wire_reference`, which equals the unfused reference bit for bit
(``tests/test_pruning_wire.py``).

Cost: O(numel) bytes read twice (gradient, error) and written once (error) plus the payloads, in
one persistent launch for all ``world x channels`` pieces (each piece its own look-back), so the
grid fills the GPU however many ranks cut the bucket. A launch per piece idled at each piece's
start and end and cost a launch each (H100, 1 GiB of fp32 with fp32 errors: 1.31-1.35 ms in 8,
32 or 128 pieces, as in one; a launch per piece took 1.34-1.37 ms in 8, 1.44 in 32 and 2.4-2.8
in 128; ``bench/results/2026-11-26_fourteenth/``).
"""

from __future__ import annotations

import torch

from ..collectives.encoded import EncodedPieces
from ..formats import reference as codec_reference
from ..formats import uses_kernels
from . import reference

__all__ = ["prune_to_wire", "prune_to_wire_reference", "prune_then_encode"]


def prune_to_wire(
    g: torch.Tensor, e: torch.Tensor, threshold: torch.Tensor, decay: float, into: EncodedPieces
) -> torch.Tensor:
    """Prune flat ``g`` against ``threshold`` into ``into``'s payloads, updating ``e``; returns the
    kept count (a one-element integer tensor on the device). ``g`` is left as it was where the CUDA
    kernels run; elsewhere it may hold the pruned values (the CPU path leaves it too). ``e`` is
    ``g``'s error buffer (its shape and device, contiguous), ``threshold`` a one-element float32
    tensor on the device, ``into`` the payloads of ``g``'s layout and dtype (see
    :meth:`.Pruner.prune_to_wire`, which makes them)."""
    _check_wire(g, e, threshold, into)
    return prune_into(g, e, threshold, decay, into)


def prune_into(
    g: torch.Tensor, e: torch.Tensor, threshold: torch.Tensor, decay: float, into: EncodedPieces
) -> torch.Tensor:
    """:func:`prune_to_wire` without its checks, for a caller that checked ``g``, ``e`` and the
    threshold and made ``into`` for them (:meth:`.Pruner.prune_to_wire`): once per bucket and step."""
    if uses_kernels(g):
        kept = torch.zeros(1, dtype=torch.int32, device=g.device)
        starts, numels = into.ranges
        torch.ops.spccl.pici_prune_compress_pieces(
            g, e, starts, numels, threshold, decay, kept, into.buffer, into.offsets, into.nnz
        )
        return kept
    if g.is_cuda:  # no kernels: the unfused path (the reference codec on a GPU)
        return prune_then_encode(g, e, threshold, decay, into)
    return prune_to_wire_reference(g, e, threshold, decay, into)


def _check_wire(g: torch.Tensor, e: torch.Tensor, threshold: torch.Tensor, into: EncodedPieces) -> None:
    """What the kernel takes on trust, checked (a mistake is an error here, before it runs)."""
    reason = into.misfit(g, "gradient")
    if reason is None and (e.shape != g.shape or e.device != g.device or not (g.is_contiguous() and e.is_contiguous())):
        reason = (
            f"error buffer {tuple(e.shape)} on {e.device} does not match the gradient {tuple(g.shape)} on {g.device}"
        )
    if reason is None and (threshold.numel() != 1 or threshold.dtype != torch.float32 or threshold.device != g.device):
        reason = f"threshold must be one float32 on {g.device}, got {threshold.dtype} of {threshold.numel()} on {threshold.device}"
    if reason is not None:
        raise ValueError(f"prune_to_wire: {reason}")


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
    into.encode(g)
    return kept
