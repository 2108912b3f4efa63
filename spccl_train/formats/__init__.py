"""Sparse wire formats: Pici (bitvector + per-tile prefix sums) and COO, with their codecs.

Byte layout: ``docs/FORMATS.md``. Sizes and offsets live in :mod:`.layout`, the
pure-torch oracle in :mod:`.reference`, and dispatch to the CUDA kernels in :mod:`.codec`.
"""

from .codec import (
    CorruptPayloadError,
    DecodeStatus,
    PayloadTooSmallError,
    compress_into,
    coo_decode,
    coo_encode,
    decompress_into,
    pici_decode,
    pici_encode,
    raise_for_status,
    uses_kernels,
)
from .layout import (
    COO_HEADER_BYTES,
    MAX_ELEMENTS,
    SUPPORTED_DTYPES,
    TILE,
    Format,
    align16,
    capacity_bytes,
    coo_bytes,
    coo_layout,
    coo_nnz_from_bytes,
    dense_bytes,
    message_bytes,
    payload_bytes,
    pici_bytes,
    pici_layout,
    pici_metadata_bytes,
    pici_n_range,
)

__all__ = [
    "COO_HEADER_BYTES",
    "CorruptPayloadError",
    "DecodeStatus",
    "PayloadTooSmallError",
    "Format",
    "MAX_ELEMENTS",
    "SUPPORTED_DTYPES",
    "TILE",
    "align16",
    "capacity_bytes",
    "compress_into",
    "coo_bytes",
    "coo_decode",
    "coo_encode",
    "coo_layout",
    "coo_nnz_from_bytes",
    "decompress_into",
    "dense_bytes",
    "message_bytes",
    "payload_bytes",
    "pici_bytes",
    "pici_decode",
    "pici_encode",
    "pici_layout",
    "pici_metadata_bytes",
    "pici_n_range",
    "raise_for_status",
    "uses_kernels",
]
