"""A collective's input handed over already encoded, one Pici payload per piece.

A sparse all-reduce cuts its input into the pieces of its :class:`~.chunking.ChunkLayout` (chunk
``q`` for rank ``q``, ``channels`` pieces each) and, in the direct algorithm's first phase, encodes
each piece for the rank that owns it. A caller that produces the data can write those payloads
itself, in the pass that makes the data: :meth:`spccl_train.pruning.Pruner.prune_to_wire` prunes a
gradient straight into them, reading the gradient and its error buffer once and never writing a
pruned dense copy. ``spccl_train.all_reduce(tensor, encoded=...)`` then counts nothing (the
payloads carry their nonzero counts) and sends the payloads as they are.

Any caller can build one: allocate with :meth:`EncodedPieces.empty`, encode each piece of the data
into :meth:`EncodedPieces.payload` with :func:`spccl_train.formats.compress_into` and store the
count it returns in :attr:`EncodedPieces.nnz`::

    layout = ChunkLayout.of("all_reduce", x.numel(), world, channels)
    encoded = EncodedPieces.empty(layout, x.dtype, x.device)
    for i, piece in enumerate(encoded.pieces):
        encoded.nnz[i : i + 1].copy_(compress_into("pici", x, encoded.payload(i), offset=piece.start, n=piece.numel))
    spccl_train.all_reduce(out, encoded=encoded)  # out: any tensor of x's size; it receives the sum

Each payload has room for its piece at any density (:func:`~spccl_train.formats.capacity_bytes`):
together about 3% more bytes than the data, kept by whoever reuses them (a DDP bucket keeps one).
An asynchronous all-reduce reads the payloads on its stream after it returns: rewrite them only
once its work is done (``work.wait()``, or stream order behind it).
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import Format, capacity_bytes, decompress_into
from ..formats.layout import align16
from ._wire import StatusSink
from .chunking import ChunkLayout, Span

__all__ = ["EncodedPieces"]


@dataclasses.dataclass(frozen=True, eq=False)
class EncodedPieces:
    """One Pici payload per piece of ``layout``, in piece order (chunk by chunk, ``channels`` each)."""

    layout: ChunkLayout
    """The pieces: those of the collective the payloads are for (``ChunkLayout.of("all_reduce", ...)``)."""
    dtype: torch.dtype
    """The element type the payloads carry."""
    buffer: torch.Tensor
    """uint8: every payload, each at a 16-byte aligned offset with room for its whole piece."""
    nnz: torch.Tensor
    """int64, one per piece, on the buffer's device: the nonzeros each payload holds."""
    offsets: tuple[int, ...]
    """Where each payload starts in ``buffer``, and (last) its end."""

    @classmethod
    def empty(cls, layout: ChunkLayout, dtype: torch.dtype, device: torch.device | str) -> EncodedPieces:
        """Room for every piece of ``layout`` at any density (nothing encoded yet: ``nnz`` zero)."""
        offsets = [0]
        for chunk in layout.pieces:
            for piece in chunk:
                offsets.append(offsets[-1] + align16(capacity_bytes(Format.PICI, piece.numel, dtype)))
        buffer = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
        nnz = torch.zeros(len(offsets) - 1, dtype=torch.int64, device=device)
        return cls(layout, dtype, buffer, nnz, tuple(offsets))

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def pieces(self) -> list[Span]:
        """Every piece, in payload order."""
        return [piece for chunk in self.layout.pieces for piece in chunk]

    def payload(self, index: int) -> torch.Tensor:
        """Payload ``index`` (piece ``k`` of chunk ``q`` is ``q * channels + k``), with its whole room."""
        return self.buffer[self.offsets[index] : self.offsets[index + 1]]

    def fits(self, layout: ChunkLayout, dtype: torch.dtype) -> bool:
        """Whether these payloads are of ``layout``'s pieces and ``dtype`` (reusable for them)."""
        return (self.layout is layout or self.layout == layout) and self.dtype == dtype

    def decode_into(
        self, out: torch.Tensor, chunks: range | list[int] | None = None, *, sink: StatusSink | None = None
    ) -> None:
        """Write the encoded data of ``chunks`` (default: all) into ``out`` (its elements, flat; every
        element of those chunks is written). No host synchronisation on CUDA; the decoders'
        statuses go to ``sink`` (without one, a bad payload raises, which synchronises)."""
        for q in range(self.layout.world) if chunks is None else chunks:
            for k in range(self.layout.channels):
                self.decode_piece_into(out, q, k, sink=sink)

    def decode_piece_into(self, out: torch.Tensor, chunk: int, piece: int, *, sink: StatusSink | None = None) -> None:
        """Write piece ``piece`` of chunk ``chunk`` into ``out`` (see :meth:`decode_into`)."""
        span = self.layout.pieces[chunk][piece]
        if span.numel:
            status = decompress_into(
                Format.PICI,
                self.payload(chunk * self.layout.channels + piece),
                out.view(-1),
                offset=span.start,
                n=span.numel,
                check=sink is None,
            )
            if sink is not None:
                sink.add(status)

    def mismatch(self, tensor: torch.Tensor, layout: ChunkLayout) -> str | None:
        """What keeps these payloads from being ``tensor``'s input to an all-reduce cut as
        ``layout`` (``None``: nothing)."""
        if tensor.dtype != self.dtype or tensor.device != self.device:
            return (
                f"encoded payloads carry {self.dtype} on {self.device} but the tensor is {tensor.dtype} on "
                f"{tensor.device}; encode the tensor's own dtype on its device"
            )
        if layout is not self.layout and layout != self.layout:
            mine = self.layout
            return (
                f"encoded payloads are of {mine.numel} elements for {mine.world} ranks and {mine.channels} channels, "
                f"but the call cuts {layout.numel} elements for {layout.world} ranks and {layout.channels} channels; "
                "encode with the call's ChunkLayout.of('all_reduce', numel, world, config.channels)"
            )
        return None
