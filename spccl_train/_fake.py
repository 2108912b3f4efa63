"""Fake (meta) implementations of the ``spccl::*`` operators, for tracing and ``opcheck``.

Imported by :func:`spccl_train._ext.load_kernels` once the operators are registered.
"""

from __future__ import annotations

import torch

__all__: list[str] = []


def _nnz_like(src: torch.Tensor) -> torch.Tensor:
    return src.new_empty((1,), dtype=torch.int64)


def _status_like(payload: torch.Tensor) -> torch.Tensor:
    return payload.new_empty((1,), dtype=torch.int32)


@torch.library.register_fake("spccl::pici_compress")
def _pici_compress(src, offset, n, out):
    return _nnz_like(src)


@torch.library.register_fake("spccl::pici_compress_pieces")
def _pici_compress_pieces(src, starts, numels, out, offsets, nnz):
    return None


@torch.library.register_fake("spccl::pici_prune_compress_pieces")
def _pici_prune_compress_pieces(grad, error, starts, numels, threshold, decay, kept, out, offsets, nnz):
    return None


@torch.library.register_fake("spccl::coo_compress")
def _coo_compress(src, offset, n, out):
    return _nnz_like(src)


@torch.library.register_fake("spccl::pici_decompress")
def _pici_decompress(payload, n, dst, offset):
    return _status_like(payload)


@torch.library.register_fake("spccl::pici_decompress_patch")
def _pici_decompress_patch(payload, n, prior, dst, offset):
    return _status_like(payload)


@torch.library.register_fake("spccl::pici_decompress_accumulate")
def _pici_decompress_accumulate(payload, n, dtype, dst, offset):
    return _status_like(payload)


@torch.library.register_fake("spccl::coo_decompress")
def _coo_decompress(payload, nnz, n, dst, offset):
    return _status_like(payload)


@torch.library.register_fake("spccl::coo_decompress_accumulate")
def _coo_decompress_accumulate(payload, nnz, n, dtype, dst, offset):
    return _status_like(payload)
