"""Turning a planned message into bytes and back, and the per-call scratch buffer.

A message's bytes are: the raw elements (dense), a bare Pici payload, or a 16-byte header
(int64 nnz, int64 n) followed by a COO payload. Encoders and decoders never synchronise with
the device: nnz goes from the encoder into the header on the device, and from the header to the
decoder as a device tensor.
"""

from __future__ import annotations

import torch

from ..formats import COO_HEADER_BYTES, Format, align16, compress_into, decompress_into

__all__ = ["carve", "encode", "decode", "as_bytes", "StatusSink"]


def carve(device: torch.device, sizes: list[int]) -> list[torch.Tensor]:
    """One allocation cut into 16-byte aligned uint8 regions of the given sizes."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += align16(size)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    return [buf[o : o + s] for o, s in zip(offsets, sizes)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    return t.view(-1).view(torch.uint8)


def encode(fmt: Format, numel: int, nbytes: int, src: torch.Tensor, offset: int, slot: torch.Tensor) -> None:
    """Write a message of ``fmt`` for ``src[offset : offset + numel]`` into ``slot`` (at least
    ``nbytes``, the message's planned size)."""
    if fmt is Format.DENSE:
        slot[: numel * src.element_size()].view(src.dtype).copy_(src[offset : offset + numel])
    elif fmt is Format.PICI:
        compress_into(Format.PICI, src, slot[:nbytes], offset=offset, n=numel, check=False)
    else:
        nnz = compress_into(Format.COO, src, slot[COO_HEADER_BYTES:nbytes], offset=offset, n=numel, check=False)
        header = slot[:COO_HEADER_BYTES].view(torch.int64)
        header[0:1].copy_(nnz)
        header[1:2].fill_(numel)


def decode(
    fmt: Format,
    numel: int,
    nbytes: int,
    slot: torch.Tensor,
    dst: torch.Tensor,
    offset: int,
    *,
    accumulate: bool,
    dtype: torch.dtype,
    sink: StatusSink,
    prior: torch.Tensor | None = None,
) -> None:
    """Decode a message of ``fmt`` (``numel`` elements, ``nbytes`` planned) from ``slot`` into
    ``dst[offset : offset + numel]``, overwriting or adding.

    ``dtype`` is the element type on the wire; a float32 ``dst`` may accumulate 16-bit messages.
    ``prior``: a Pici payload of what the range holds, used when the message is Pici and
    overwrites (a patch: only elements either payload marks are written).
    """
    if fmt is Format.DENSE:
        values = slot[: numel * dtype.itemsize].view(dtype)
        target = dst[offset : offset + numel]
        if accumulate:
            target.add_(values)
        else:
            target.copy_(values)
        return
    if fmt is Format.PICI:
        status = decompress_into(
            Format.PICI,
            slot[:nbytes],
            dst,
            offset=offset,
            n=numel,
            accumulate=accumulate,
            dtype=dtype,
            prior=prior,
            check=False,
        )
    else:
        nnz = slot[:8].view(torch.int64)
        status = decompress_into(
            Format.COO,
            slot[COO_HEADER_BYTES:nbytes],
            dst,
            offset=offset,
            n=numel,
            nnz=nnz,
            accumulate=accumulate,
            dtype=dtype,
            check=False,
        )
    sink.add(status)


class StatusSink:
    """Collects the decoders' status words on the device (0: every payload decoded cleanly).

    Each decoder returns its own status tensor; :meth:`collect` stacks them with one kernel at
    the end of the call (on the calling stream, after the call's work), and :meth:`fold` ORs the
    stack when someone reads it, so the hot path pays one launch per call, not one per decode.
    """

    __slots__ = ("_device", "_parts")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._parts: list[torch.Tensor] = []

    def add(self, status: torch.Tensor | None) -> None:
        """Keep one decoder status (``None`` when the decoder checked it already)."""
        if status is not None:
            self._parts.append(status)

    def collect(self) -> torch.Tensor:
        """Every status so far, stacked (an empty int32 tensor when there were none)."""
        if not self._parts:
            return torch.zeros(0, dtype=torch.int32, device=self._device)
        return torch.stack([part.view(-1)[:1] for part in self._parts]).view(-1)

    @staticmethod
    def fold(statuses: torch.Tensor) -> torch.Tensor:
        """OR of a :meth:`collect` result: a one-element int32 tensor."""
        out = torch.zeros(1, dtype=torch.int32, device=statuses.device)
        for status in statuses.to(torch.int32).unbind(0):
            out.bitwise_or_(status)
        return out
