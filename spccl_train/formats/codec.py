"""Compress and decompress ranges of tensors: argument checks, then CUDA kernels or the reference.

The range / into-buffer forms (:func:`compress_into`, :func:`decompress_into`) are what the
collectives use: they never allocate the payload and, with ``check=False``, never synchronise
with the device. The simple forms (:func:`pici_encode`, :func:`pici_decode`, :func:`coo_encode`,
:func:`coo_decode`) are for users: a tensor in, exactly the bytes of ``FORMATS.md`` out.
"""

from __future__ import annotations

import torch

from .._ext import kernels_available
from . import reference
from .layout import TILE, Format, capacity_bytes, check_dtype, check_length, coo_nnz_from_bytes, payload_bytes
from .reference import STATUS_TEXT, CorruptPayloadError, DecodeStatus, PayloadTooSmallError, check_pici_size

__all__ = [
    "DecodeStatus",
    "CorruptPayloadError",
    "PayloadTooSmallError",
    "compress_into",
    "compress_pieces_into",
    "decompress_into",
    "raise_for_status",
    "uses_kernels",
    "pici_encode",
    "pici_decode",
    "coo_encode",
    "coo_decode",
]


def uses_kernels(t: torch.Tensor) -> bool:
    """True when operations on ``t`` run the CUDA kernels rather than the reference."""
    return t.is_cuda and kernels_available()


def raise_for_status(status: torch.Tensor | int, fmt: Format | str, *, n: int | None = None) -> None:
    """Raise :class:`CorruptPayloadError` for a nonzero decoder status (synchronises).

    The message lists every bit set. ``n``, the number of elements the payload was decoded as,
    goes into the message; a payload decoded with another ``n`` than it was encoded with gets
    these statuses too (``PAST_END`` when ``n`` was too small, garbage otherwise).
    """
    code = int(status.item()) if isinstance(status, torch.Tensor) else int(status)
    if code:
        reasons = "; ".join(text for bit, text in STATUS_TEXT.items() if code & bit)
        what = f"corrupt {Format(fmt).value} payload" + ("" if n is None else f" for n={n}")
        hint = "" if n is None else f"; if it was encoded with another n than {n}, decode with that n"
        raise CorruptPayloadError(f"{what}: {reasons} (status {code}){hint}")


def _flat(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}); pass {name}.contiguous()")
    return t.view(-1)


def _range(name: str, t: torch.Tensor, offset: int, n: int | None) -> int:
    if n is None:
        n = t.numel() - offset
    if offset < 0 or n < 0 or offset + n > t.numel():
        raise ValueError(
            f"range [{offset}, {offset + n}) of {name} is outside its {t.numel()} elements; check offset and n"
        )
    check_length(n)
    return n


def _byte_buffer(name: str, t: torch.Tensor) -> torch.Tensor:
    t = _flat(name, t)
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} must be a torch.uint8 byte buffer, got {t.dtype}")
    return t


def compress_into(
    fmt: Format | str,
    src: torch.Tensor,
    out: torch.Tensor,
    *,
    offset: int = 0,
    n: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Encode ``src.view(-1)[offset:offset+n]`` into the byte buffer ``out``; return nnz.

    Args:
        fmt: ``"pici"`` or ``"coo"``.
        src: a contiguous float32 / bfloat16 / float16 tensor, viewed flat.
        out: a contiguous uint8 tensor on ``src``'s device (16-byte aligned for the CUDA
            kernels). Sized ``capacity_bytes(fmt, n, dtype)`` it can never overflow.
        offset: first element of the range.
        n: elements in the range (default: to the end of ``src``).
        check: with a buffer smaller than the worst case, verify that the payload fit and
            raise :class:`PayloadTooSmallError` if not (on CUDA this synchronises). With
            ``check=False`` the kernels still write no byte past ``out``; compare
            ``payload_bytes(fmt, n, nnz, dtype)`` with ``out.numel()`` yourself.

    Returns:
        A one-element int64 tensor on ``src``'s device holding nnz (no host synchronisation
        on the CUDA path).
    """
    fmt = Format(fmt)
    if fmt is Format.DENSE:
        raise ValueError("compress_into encodes 'pici' or 'coo'; dense data needs no encoding")
    src = _flat("src", src)
    check_dtype(src.dtype)
    n = _range("src", src, offset, n)
    out = _byte_buffer("out", out)
    if out.device != src.device:
        raise ValueError(f"out is on {out.device} but src is on {src.device}; put both on one device")
    minimum = payload_bytes(fmt, n, 0, src.dtype)
    if out.numel() < minimum:
        raise PayloadTooSmallError(
            f"output buffer of {out.numel()} bytes cannot hold even the {minimum}-byte metadata of a "
            f"{fmt.value} payload of n={n}; allocate capacity_bytes('{fmt.value}', n, dtype) bytes"
        )
    if not uses_kernels(src):
        encode = reference.pici_compress if fmt is Format.PICI else reference.coo_compress
        return encode(src, offset, n, out)
    if out.data_ptr() % 16:
        raise ValueError("the CUDA kernels need out to start at a 16-byte aligned address; slice at multiples of 16")
    op = torch.ops.spccl.pici_compress if fmt is Format.PICI else torch.ops.spccl.coo_compress
    nnz = op(src, offset, n, out)
    if check and out.numel() < capacity_bytes(fmt, n, src.dtype):
        need = payload_bytes(fmt, n, int(nnz.item()), src.dtype)
        if need > out.numel():
            raise PayloadTooSmallError(
                f"output buffer of {out.numel()} bytes is too small for the {fmt.value} payload of "
                f"{need} bytes (n={n}); allocate capacity_bytes('{fmt.value}', n, dtype) bytes"
            )
    return nnz


def compress_pieces_into(
    src: torch.Tensor,
    out: torch.Tensor,
    starts: tuple[int, ...],
    numels: tuple[int, ...],
    offsets: tuple[int, ...],
    nnz: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """Pici-encode pieces of ``src`` (flat), piece ``i`` being elements ``[starts[i], starts[i] +
    numels[i])``, into ``out[offsets[i] : offsets[i + 1]]``, and write its nonzero count to ``nnz[i]``.

    On CUDA one launch encodes every piece (a piece per launch underfills the GPU and costs a
    launch each: with many ranks, a bucket's pieces are many and small); elsewhere the reference
    encodes them one by one. ``offsets`` has one entry more than ``starts``; each payload starts at a
    16-byte aligned offset (``out`` itself 16-byte aligned for the kernels) and holds at least its
    piece's metadata (``payload_bytes("pici", n, 0, dtype)``). Sized ``capacity_bytes("pici", n,
    dtype)`` a payload can never overflow. One with less room than its piece needs: the kernels
    store the values that fit (no byte past its room) and the exact count; the reference raises
    :class:`PayloadTooSmallError`. ``nnz`` is a contiguous 1-D int64 tensor of one count per piece
    on ``src``'s device. No host synchronisation.

    ``validate=False`` skips the checks of each piece (host work in the number of pieces), for a
    layout that is valid by construction (:meth:`~spccl_train.collectives.EncodedPieces.encode`).
    """
    src = _flat("src", src)
    check_dtype(src.dtype)
    out = _byte_buffer("out", out)
    if not isinstance(nnz, torch.Tensor):
        raise TypeError(f"nnz must be a torch.Tensor, got {type(nnz).__name__}")
    if out.device != src.device or nnz.device != src.device:
        raise ValueError(f"out ({out.device}) and nnz ({nnz.device}) must be on src's device ({src.device})")
    if len(numels) != len(starts) or len(offsets) != len(starts) + 1:
        raise ValueError(
            f"{len(starts)} starts need as many numels (got {len(numels)}) and one offset more (got {len(offsets)})"
        )
    if nnz.dtype != torch.int64 or nnz.dim() != 1 or not nnz.is_contiguous() or nnz.numel() != len(starts):
        raise ValueError(
            f"nnz must be a contiguous 1-D int64 tensor with one count per piece ({len(starts)}), got "
            f"{nnz.dtype} of shape {tuple(nnz.shape)}"
        )
    if validate:
        _check_pieces(src, out, starts, numels, offsets)
    if uses_kernels(src):
        if out.data_ptr() % 16:
            raise ValueError(
                "the CUDA kernels need out to start at a 16-byte aligned address; slice at multiples of 16"
            )
        torch.ops.spccl.pici_compress_pieces(src, starts, numels, out, offsets, nnz)
        return
    for i, (start, numel) in enumerate(zip(starts, numels)):
        payload = out[offsets[i] : offsets[i + 1]]
        nnz[i : i + 1] = compress_into(Format.PICI, src, payload, offset=start, n=numel, check=False)


_MAX_UNITS = 2**31
"""Tiles one launch may encode in all: its blocks claim them from a 32-bit counter."""


def _check_pieces(
    src: torch.Tensor, out: torch.Tensor, starts: tuple[int, ...], numels: tuple[int, ...], offsets: tuple[int, ...]
) -> None:
    """Every piece inside ``src``, every payload 16-byte aligned, in order, with room for its metadata,
    inside ``out``, and not too many tiles in all (checked here, so that a bad layout is an error
    before any kernel runs)."""
    if offsets and offsets[-1] > out.numel():
        raise ValueError(f"the last payload ends at byte {offsets[-1]} but out holds {out.numel()}; allocate more")
    tiles = 0
    for i, (start, numel) in enumerate(zip(starts, numels)):
        _range(f"src (piece {i})", src, start, numel)
        room, metadata = offsets[i + 1] - offsets[i], payload_bytes(Format.PICI, numel, 0, src.dtype)
        if offsets[i] < 0 or offsets[i] % 16:
            raise ValueError(f"payload {i} starts at byte {offsets[i]}; payloads start at 16-byte aligned offsets")
        if room < metadata:
            raise PayloadTooSmallError(
                f"payload {i} has {room} bytes, less than the {metadata}-byte metadata of a pici payload of "
                f"n={numel}; give it capacity_bytes('pici', n, dtype) bytes"
            )
        tiles += max(1, -(-numel // TILE))
    if tiles >= _MAX_UNITS:
        raise ValueError(f"{len(starts)} pieces of {tiles} tiles in all are too many for one launch; encode fewer")


def decompress_into(
    fmt: Format | str,
    payload: torch.Tensor,
    dst: torch.Tensor,
    *,
    offset: int = 0,
    n: int | None = None,
    nnz: int | torch.Tensor | None = None,
    accumulate: bool = False,
    dtype: torch.dtype | None = None,
    prior: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor | None:
    """Decode ``payload`` into ``dst.view(-1)[offset:offset+n]``, overwriting or accumulating.

    Args:
        fmt: ``"pici"`` or ``"coo"``.
        payload: the uint8 payload on ``dst``'s device. Bytes after the payload (a
            ``capacity_bytes`` buffer it was compressed into) are ignored.
        dst: contiguous destination, viewed flat.
        offset, n: the destination range (``n`` defaults to the rest of ``dst``). ``n`` must
            be the number of elements the payload was encoded from.
        nnz: COO only: the number of nonzeros (an int, or a one-element int64 tensor on the
            device, e.g. the one :func:`compress_into` returned).
        accumulate: ``dst += decoded`` instead of overwriting (zeros included).
        dtype: the payload's element type; default ``dst.dtype``. A float32 ``dst`` may
            accumulate bfloat16 / float16 payloads (fp32 sums, no intermediate rounding).
        prior: Pici overwrite only: a Pici payload (uint8, on ``dst``'s device) of what the range
            holds now. Only the elements either payload marks are written (the payload's values, and
            zeros where only ``prior`` marks), which at high sparsity moves far fewer bytes than
            writing the whole range; the result is that of an overwrite. The in-place all-reduce
            uses it: the range still holds this rank's contribution, which it encoded earlier.
            Only its bitvectors are read (and checked for marks past ``n``).
        check: what a bad payload gets. ``True``: :class:`CorruptPayloadError` naming the problem
            (on CUDA reading the kernel's status is a synchronisation). ``False``: no exception
            for anything read from the payload (or a COO ``nnz`` that contradicts it); the
            returned status says what was wrong, for the caller to check later
            (:func:`raise_for_status`). The CPU path (the torch reference) and the CUDA kernels
            report the same :class:`DecodeStatus` bits.

    Returns:
        ``None`` when checked; otherwise a one-element int32 :class:`DecodeStatus` tensor on
        ``dst``'s device (0 = good), without a host synchronisation on CUDA.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, a payload or prior that is not uint8, or
            a type mix other than 16-bit values accumulated into float32.
        ValueError: ``fmt`` not ``"pici"`` / ``"coo"``, a non-contiguous tensor, a range outside
            ``dst``, ``n > MAX_ELEMENTS``, tensors on different devices, COO without ``nnz``,
            ``prior`` outside a Pici overwrite.
        CorruptPayloadError: whatever ``check`` says, a Pici payload shorter than the metadata of
            ``n`` elements (or a ``prior`` shorter than their bitvectors): it does not fit ``n``,
            and the message names ``n`` and the largest ``n`` its length can hold. A size error,
            checked on the host before anything is read or written. (COO has none: its ``nnz``
            may be on the device, so a payload too short for it is the status ``BAD_NNZ``.)
            With ``check=True`` also every status below.

    Statuses (``check=False``; with ``check=True`` the same problems raise
    :class:`CorruptPayloadError`, whose message names ``n`` and, where the payload is a good one
    for another ``n``, that ``n``): ``BAD_NNZ`` (nnz above ``n`` or more values than the
    payload holds, a negative COO ``nnz``), ``BAD_INDEX`` / ``BAD_TILE_COUNT`` (Pici index
    inconsistent with itself or the bitvectors), ``PAST_END`` (nonzeros at positions ``>= n``:
    the payload does not fit ``n``), ``NOT_ASCENDING`` (COO positions). Decoding with a wrong
    ``n`` gives these statuses too (``PAST_END`` when ``n`` is too small within the payload's
    tile count; garbage index statuses for another tile count); with the wrong ``n`` in the
    same tile count but larger, the decode succeeds with zeros past the true end.

    What ``dst`` holds after a nonzero status (with ``check=True``: when the error is raised),
    the same on both paths (the reference reproduces the kernels): nothing outside the range
    is ever written, and nothing at all after a size error. Pici: when ``I[NT]`` (nnz) exceeds
    ``n`` or the values present, nothing is written; otherwise each tile that passes its own
    checks is decoded (overwritten, zeros included; accumulated; or patched) and every other
    tile is left as it was. COO: an overwrite zeroes the whole range first, whatever the
    payload; then nothing more when ``nnz`` is bad, else every entry is decoded except those
    at positions ``>= n`` or not above the entry before (an element a bad payload names twice
    gets either value: the CUDA threads race). So treat the range as garbage after a failure.
    """
    fmt = Format(fmt)
    if fmt is Format.DENSE:
        raise ValueError("decompress_into decodes 'pici' or 'coo'; copy dense data directly")
    payload = _byte_buffer("payload", payload)
    dst = _flat("dst", dst)
    check_dtype(dst.dtype)
    dtype = dtype or dst.dtype
    check_dtype(dtype)
    if dtype != dst.dtype and not (accumulate and dst.dtype == torch.float32):
        raise TypeError(
            f"cannot decode {dtype} values into a {dst.dtype} tensor; only accumulation into float32 mixes types"
        )
    n = _range("dst", dst, offset, n)
    if payload.device != dst.device:
        raise ValueError(f"payload is on {payload.device} but dst is on {dst.device}; put both on one device")
    if prior is not None:
        if fmt is not Format.PICI or accumulate:
            raise ValueError("prior= serves overwriting Pici decodes only; drop it or use fmt='pici', accumulate=False")
        prior = _byte_buffer("prior", prior)
        if prior.device != dst.device:
            raise ValueError(f"prior is on {prior.device} but dst is on {dst.device}; put both on one device")
    if fmt is Format.COO and nnz is None:
        raise ValueError("COO payloads do not record nnz: pass nnz= (from compress_into or coo_nnz_from_bytes)")
    if fmt is Format.PICI:
        # Sizes first, on the host: a payload too short for n's metadata was made for a smaller n.
        check_pici_size(payload.numel(), n, dtype)
        if prior is not None:
            check_pici_size(prior.numel(), n, dtype, what="prior", bits_only=True)
    if not uses_kernels(dst):
        if prior is not None:
            status = reference.pici_decompress_patch(payload, prior, n, dst, offset, check=check)
        elif fmt is Format.PICI:
            status = reference.pici_decompress(payload, n, dst, offset, accumulate=accumulate, dtype=dtype, check=check)
        else:
            status = reference.coo_decompress(
                payload, int(nnz), n, dst, offset, accumulate=accumulate, dtype=dtype, check=check
            )
        return None if check else torch.tensor([int(status)], dtype=torch.int32, device=dst.device)
    if payload.data_ptr() % 16:
        # The kernels read 8- and 16-byte words. Collectives keep payloads aligned; this copy
        # serves users decoding a payload sliced out of a larger buffer.
        payload = payload.clone()
    if fmt is Format.PICI:
        if accumulate:
            status = torch.ops.spccl.pici_decompress_accumulate(payload, n, dtype, dst, offset)
        elif prior is not None:
            if prior.data_ptr() % 16:
                prior = prior.clone()
            status = torch.ops.spccl.pici_decompress_patch(payload, n, prior, dst, offset)
        else:
            status = torch.ops.spccl.pici_decompress(payload, n, dst, offset)
        if n == 0:
            # No tile, no kernel: the one field is I[0] = nnz, which must be 0 (as the reference checks).
            status = status | (payload[:4].view(torch.int32) != 0).to(torch.int32) * int(DecodeStatus.BAD_NNZ)
    else:
        if not isinstance(nnz, torch.Tensor):
            nnz = torch.full((1,), int(nnz), dtype=torch.int64, device=dst.device)
        if accumulate:
            status = torch.ops.spccl.coo_decompress_accumulate(payload, nnz, n, dtype, dst, offset)
        else:
            status = torch.ops.spccl.coo_decompress(payload, nnz, n, dst, offset)
        if n == 0:
            # No kernel runs for an empty range: nnz must be 0 (as the reference checks).
            status = status | (nnz.view(1) != 0).to(torch.int32) * int(DecodeStatus.BAD_NNZ)
    if check:
        code = int(status.item())
        if code:
            # The reference reads the payload on the device and explains the kernel's status.
            if fmt is Format.PICI:
                message = reference.pici_explain(payload, n, dtype, prior)
            else:
                message = reference.coo_explain(payload, int(nnz.item()), n, dtype)
            if message is None:
                raise_for_status(code, fmt, n=n)
            raise CorruptPayloadError(message)
        return None
    return status


def _encode(fmt: Format, x: torch.Tensor) -> torch.Tensor:
    x = _flat("x", x)
    check_dtype(x.dtype)
    n = x.numel()
    out = torch.empty(capacity_bytes(fmt, n, x.dtype), dtype=torch.uint8, device=x.device)
    nnz = int(compress_into(fmt, x, out).item())
    return out[: payload_bytes(fmt, n, nnz, x.dtype)].clone()


def pici_encode(x: torch.Tensor) -> torch.Tensor:
    """Encode a contiguous tensor (viewed flat) as a Pici payload: a uint8 tensor on its device.

    Example::

        >>> g = torch.zeros(10_000); g[::100] = 1.0
        >>> payload = pici_encode(g)
        >>> torch.equal(pici_decode(payload, g.numel(), g.dtype), g)
        True
    """
    return _encode(Format.PICI, x)


def coo_encode(x: torch.Tensor) -> torch.Tensor:
    """Encode a contiguous tensor (viewed flat) as a COO payload: a uint8 tensor on its device."""
    return _encode(Format.COO, x)


def pici_decode(payload: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode a Pici payload (exactly as :func:`pici_encode` returned it) into a new 1-D tensor on its device.

    ``n`` and ``dtype`` are those it was encoded with. Its length is checked against ``n``
    first: a length no payload of ``n`` elements has raises :class:`CorruptPayloadError` saying
    that it does not fit ``n`` and which ``n`` its length allows
    (:func:`~spccl_train.formats.pici_n_range`). A corrupt payload raises
    :class:`CorruptPayloadError` too, and so does one with bytes after its values; when the
    payload is a good one for another ``n``, the message says that it does not fit ``n`` and
    names the ``n`` it was made for. (:func:`decompress_into` accepts bytes after the payload.)
    """
    payload = _byte_buffer("payload", payload)
    check_length(n)
    check_dtype(dtype)
    check_pici_size(payload.numel(), n, dtype, exact=True)
    dst = torch.empty(n, dtype=dtype, device=payload.device)
    decompress_into(Format.PICI, payload, dst)
    reference.check_pici_exact(payload, n, dtype)
    return dst


def coo_decode(payload: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode a COO payload (exactly as :func:`coo_encode` returned it) into a new 1-D tensor.

    The payload's length gives its nnz (``ValueError`` when no nnz gives that length). More
    nonzeros than ``n``, or a position ``>= n``, means the payload does not fit ``n``:
    :class:`CorruptPayloadError` naming ``n`` and the ``n`` the payload needs. Decode with the
    ``n`` it was encoded with.
    """
    payload = _byte_buffer("payload", payload)
    check_length(n)
    nnz = coo_nnz_from_bytes(payload.numel(), dtype)
    if nnz > n:
        raise CorruptPayloadError(
            f"COO payload of {payload.numel()} bytes does not fit n={n}: its length means nnz={nnz} nonzeros "
            f"of {dtype}, more than n={n} elements, so it was made for n >= {nnz}; "
            "decode with the n it was encoded with"
        )
    dst = torch.empty(n, dtype=dtype, device=payload.device)
    decompress_into(Format.COO, payload, dst, nnz=nnz)
    return dst
