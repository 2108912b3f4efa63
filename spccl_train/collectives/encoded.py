"""A collective's input handed over already encoded, one Pici payload per piece.

A sparse all-reduce cuts its input into the pieces of its :class:`~.chunking.ChunkLayout` (chunk
``q`` for rank ``q``, ``channels`` pieces each) and, in the direct algorithm's first phase, encodes
each piece for the rank that owns it. A caller that produces the data can write those payloads
itself, in the pass that makes the data: :meth:`spccl_train.pruning.Pruner.prune_to_wire` prunes a
gradient straight into them, reading the gradient and its error buffer once and never writing a
pruned dense copy. ``spccl_train.all_reduce(tensor, encoded=...)`` then counts nothing (the
payloads carry their nonzero counts) and sends the payloads as they are.

Any caller can build one: allocate with :meth:`EncodedPieces.empty` and encode the data into it
with :meth:`EncodedPieces.encode` (one launch for every piece on CUDA), or write each
:meth:`EncodedPieces.payload` and its count in :attr:`EncodedPieces.nnz` itself::

    layout = ChunkLayout.of("all_reduce", x.numel(), world, channels)
    encoded = EncodedPieces.empty(layout, x.dtype, x.device)
    encoded.encode(x)
    spccl_train.all_reduce(out, encoded=encoded)  # out: any tensor of x's size; it receives the sum

Each payload has room for its piece at any density (:func:`~spccl_train.formats.capacity_bytes`):
together about 3% more bytes than the data, kept by whoever reuses them (a DDP bucket keeps one).
An asynchronous all-reduce reads the payloads on its stream after it returns: rewrite them only
once its work is done (``work.wait()``, or stream order behind it).

How a call takes them (:func:`take_encoded`): payloads that are not its input's raise on every
rank through the exchange; a call that cannot send Pici as it is (another algorithm or format, a
group of one) decodes them into the tensor up front; the native and hierarchical paths decode
them first (:func:`decoded_first`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch

from ..formats import Format, capacity_bytes, compress_pieces_into, decompress_into
from ..formats.layout import align16
from ..transport import P2PTransport
from ._wire import StatusSink
from .chunking import ChunkLayout, Span
from .config import CollectiveConfig
from .exchange import Problem
from .stats import CollectiveStats, add_statuses

__all__ = ["EncodedPieces", "decoded_first", "take_encoded"]

_log = logging.getLogger(__name__)


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

    @functools.cached_property
    def ranges(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(starts, numels)``: every piece's first element and length, in payload order."""
        pieces = self.pieces
        return tuple(p.start for p in pieces), tuple(p.numel for p in pieces)

    def encode(self, x: torch.Tensor) -> None:
        """Encode ``x`` (contiguous, the layout's elements, this dtype and device) into the payloads
        and their counts into :attr:`nnz`: on CUDA one launch for every piece. No host synchronisation."""
        reason = self.misfit(x)
        if reason is not None:
            raise ValueError(reason)
        starts, numels = self.ranges
        compress_pieces_into(x, self.buffer, starts, numels, self.offsets, self.nnz, validate=False)

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

    def misfit(self, x: torch.Tensor, name: str = "tensor") -> str | None:
        """What keeps ``x`` (called ``name``) from being the data these payloads encode (``None``: nothing)."""
        reason = self.mismatch(x, self.layout)
        if reason is None and x.numel() != self.layout.numel:
            reason = f"encoded payloads are of {self.layout.numel} elements but the {name} has {x.numel()}"
        return reason

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


def take_encoded(
    encoded: object,
    collective: str,
    tensor: torch.Tensor,
    config: CollectiveConfig,
    transport: P2PTransport,
    planning_stream: torch.cuda.Stream | None,
) -> tuple[EncodedPieces | None, Problem, StatusSink | None]:
    """What a call does with the ``encoded=`` it was given: ``(encoded to send, problem, statuses)``.

    - Not this call's input encoded: nothing to send, and :attr:`~.exchange.Problem.ENCODED`,
      which the exchange reports on every rank (this rank also logs what differs). A wrong type
      raises ``TypeError`` at once.
    - A call that cannot send Pici payloads as they are (:func:`_may_send`): decoded into
      ``tensor`` up front, its decoders' statuses returned, nothing to send.
    - Else: the payloads, to send.
    """
    if encoded is None:
        return None, Problem.NONE, None
    if not isinstance(encoded, EncodedPieces):
        raise TypeError(f"encoded must be an EncodedPieces or None, got {type(encoded).__name__}")
    reason = encoded.mismatch(tensor, ChunkLayout.of(collective, tensor.numel(), transport.world, config.channels))
    if reason is not None:
        _log.error("spccl_train.all_reduce on rank %d: %s", transport.rank, reason)
        return None, Problem.ENCODED, None
    if _may_send(config, transport):
        return encoded, Problem.NONE, None
    decoded = StatusSink(tensor.device)
    _decode_up_front(encoded, tensor, decoded, planning_stream)
    return None, Problem.NONE, decoded


def _may_send(config: CollectiveConfig, transport: P2PTransport) -> bool:
    """Whether a call of ``config`` may run the direct algorithm with Pici payloads."""
    return transport.world > 1 and config.algorithm in ("auto", "direct") and config.format in ("auto", "pici")


def _decode_up_front(
    encoded: EncodedPieces, x: torch.Tensor, sink: StatusSink, planning_stream: torch.cuda.Stream | None
) -> None:
    """Decode ``encoded`` into ``x`` for a call that reads its input as it is: on ``planning_stream``
    when given (where the payloads are ready and the counting reads ``x``), then the current stream
    waits for it (a call planned from bounds reads ``x`` there)."""
    if planning_stream is None:
        encoded.decode_into(x, sink=sink)
        return
    with torch.cuda.stream(planning_stream):
        encoded.decode_into(x, sink=sink)
    torch.cuda.current_stream(x.device).wait_stream(planning_stream)


def decoded_first(
    encoded: EncodedPieces | None, x: torch.Tensor, sink: StatusSink, call: Callable[..., tuple], *args
) -> tuple[CollectiveStats, torch.cuda.Event | None]:
    """``call(*args)`` (a path that reads the input as it is: native, hierarchical), ``encoded``
    decoded into ``x`` first and its decoders' statuses added to the call's stats."""
    if encoded is None:
        return call(*args)
    encoded.decode_into(x, sink=sink)
    stats, event = call(*args)
    add_statuses(stats, sink)
    return stats, event
