"""Compress and decompress ranges of tensors: argument checks, then CUDA kernels or the reference.

The range / into-buffer forms (:func:`compress_into`, :func:`decompress_into`) are what the
collectives use: they never allocate the payload and, with ``check=False``, never synchronise
with the device. The simple forms (:func:`pici_encode`, :func:`pici_decode`, :func:`coo_encode`,
:func:`coo_decode`) are for users: a tensor in, exactly the bytes of ``FORMATS.md`` out.
"""

from __future__ import annotations

import enum

import torch

from .._ext import kernels_available
from . import reference
from .layout import Format, capacity_bytes, check_dtype, check_length, coo_nnz_from_bytes, payload_bytes, pici_layout
from .reference import CorruptPayloadError, PayloadTooSmallError

__all__ = [
    "DecodeStatus",
    "CorruptPayloadError",
    "PayloadTooSmallError",
    "compress_into",
    "decompress_into",
    "raise_for_status",
    "uses_kernels",
    "pici_encode",
    "pici_decode",
    "coo_encode",
    "coo_decode",
]


class DecodeStatus(enum.IntFlag):
    """Bits of the status a decoder reports (``csrc/spccl.h`` uses the same values)."""

    OK = 0
    BAD_INDEX = 1
    """Pici: the index array does not start at 0 or decreases."""
    BAD_TILE_COUNT = 2
    """Pici: a tile's bitvector popcount disagrees with its index step."""
    BAD_NNZ = 4
    """nnz exceeds n or what the payload can hold."""
    PAST_END = 8
    """Nonzeros are marked at positions >= n."""
    NOT_ASCENDING = 16
    """COO: positions are not strictly ascending."""


_STATUS_TEXT = {
    DecodeStatus.BAD_INDEX: "the index array does not start at 0 or decreases",
    DecodeStatus.BAD_TILE_COUNT: "a tile's bitvector popcount disagrees with its index step",
    DecodeStatus.BAD_NNZ: "nnz exceeds n or what the payload can hold",
    DecodeStatus.PAST_END: "nonzeros are marked past the end of the range",
    DecodeStatus.NOT_ASCENDING: "COO positions are not strictly ascending",
}


def uses_kernels(t: torch.Tensor) -> bool:
    """True when operations on ``t`` run the CUDA kernels rather than the reference."""
    return t.is_cuda and kernels_available()


def raise_for_status(status: torch.Tensor | int, fmt: Format | str) -> None:
    """Raise :class:`CorruptPayloadError` for a nonzero kernel status (synchronises)."""
    code = int(status.item()) if isinstance(status, torch.Tensor) else int(status)
    if code:
        reasons = "; ".join(text for bit, text in _STATUS_TEXT.items() if code & bit)
        raise CorruptPayloadError(f"corrupt {Format(fmt).value} payload: {reasons} (status {code})")


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
        payload: the uint8 payload on ``dst``'s device.
        dst: contiguous destination, viewed flat.
        offset, n: the destination range (``n`` defaults to the rest of ``dst``).
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
        check: raise :class:`CorruptPayloadError` on a corrupt payload. On CUDA this reads the
            kernel's status (a synchronisation); with ``check=False`` the status tensor is
            returned instead, for the caller to check later (:func:`raise_for_status`). A
            corrupt payload never makes the kernels read or write out of bounds; the reference
            raises at once even with ``check=False``.

    Returns:
        ``None`` when checked; otherwise a one-element int32 :class:`DecodeStatus` tensor on
        ``dst``'s device (0 = good).
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
    if not uses_kernels(dst):
        if prior is not None:
            reference.pici_decompress_patch(payload, prior, n, dst, offset)
        elif fmt is Format.PICI:
            reference.pici_decompress(payload, n, dst, offset, accumulate=accumulate, dtype=dtype)
        else:
            reference.coo_decompress(payload, int(nnz), n, dst, offset, accumulate=accumulate, dtype=dtype)
        return None if check else torch.zeros(1, dtype=torch.int32, device=dst.device)
    if payload.data_ptr() % 16:
        # The kernels read 8- and 16-byte words. Collectives keep payloads aligned; this copy
        # serves users decoding a payload sliced out of a larger buffer.
        payload = payload.clone()
    if fmt is Format.PICI:
        if payload.numel() < pici_layout(n).metadata_bytes:
            raise CorruptPayloadError(
                f"Pici payload of {payload.numel()} bytes is shorter than its metadata "
                f"({pici_layout(n).metadata_bytes} bytes for n={n})"
            )
        if accumulate:
            status = torch.ops.spccl.pici_decompress_accumulate(payload, n, dtype, dst, offset)
        elif prior is not None:
            if prior.data_ptr() % 16:
                prior = prior.clone()
            status = torch.ops.spccl.pici_decompress_patch(payload, n, prior, dst, offset)
        else:
            status = torch.ops.spccl.pici_decompress(payload, n, dst, offset)
    else:
        if not isinstance(nnz, torch.Tensor):
            nnz = torch.full((1,), int(nnz), dtype=torch.int64, device=dst.device)
        if accumulate:
            status = torch.ops.spccl.coo_decompress_accumulate(payload, nnz, n, dtype, dst, offset)
        else:
            status = torch.ops.spccl.coo_decompress(payload, nnz, n, dst, offset)
    if check:
        raise_for_status(status, fmt)
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
    """Decode a Pici payload of ``n`` elements of ``dtype`` into a new 1-D tensor on its device."""
    check_length(n)
    dst = torch.empty(n, dtype=dtype, device=payload.device)
    decompress_into(Format.PICI, payload, dst)
    return dst


def coo_decode(payload: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode a COO payload (exactly as :func:`coo_encode` returned it) into a new 1-D tensor."""
    payload = _byte_buffer("payload", payload)
    check_length(n)
    nnz = coo_nnz_from_bytes(payload.numel(), dtype)
    dst = torch.empty(n, dtype=dtype, device=payload.device)
    decompress_into(Format.COO, payload, dst, nnz=nnz)
    return dst
