"""Triton device functions shared by the kernels: what counts as nonzero, and rounding to a dtype.

Both exist because the interpreter (CPU tests, ``TRITON_INTERPRET=1``) and the compiler must give
the same bits. Triton 3.9's interpreter keeps bfloat16 as raw uint16 and compares it by its bits
(``-0.0 != 0`` there), and every version's interpreter truncates fp32 -> bf16; compiled code
compares and rounds as IEEE floats. So comparisons go through fp32 (exact for every 16-bit float)
and bf16 is rounded by hand.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["nonzero", "round_to"]


@triton.jit
def nonzero(x):
    """``x != 0`` as the codecs mean it (``-0.0`` is zero, NaN is not), for any float dtype."""
    return x.to(tl.float32) != 0.0


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 -> ``dtype`` rounding to nearest even, as torch does (NaN: torch's canonical bf16 NaN)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
