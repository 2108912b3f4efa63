"""Triton op: one fused pass of a BurstAdamW step over an fp32 parameter (:mod:`spccl_train.optim`)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["burst_adamw_step"]

BLOCK = 1024


@triton.jit
def _burst_adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    age_ptr,
    numel,
    log2_beta1,
    log2_beta2,
    decay_factor,
    step_size,
    inv_sqrt_bias2,
    eps,
    max_age,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    age = tl.minimum(tl.load(age_ptr + offsets, mask=mask, other=0).to(tl.int32) + 1, 255)
    arrived = g != 0.0
    a = tl.minimum(age, max_age).to(tl.float32)
    per_step = g / a
    # a steps of a constant per-step gradient in closed form; nothing moves where nothing arrived
    w1 = tl.where(arrived, 1.0 - tl.exp2(a * log2_beta1), 0.0)
    w2 = tl.where(arrived, 1.0 - tl.exp2(a * log2_beta2), 0.0)
    m = m + w1 * (per_step - m)
    v = v + w2 * (per_step * per_step - v)
    p = p * decay_factor
    update = a * m / (tl.sqrt(v) * inv_sqrt_bias2 + eps)
    p = tl.where(arrived, p - step_size * update, p)
    tl.store(p_ptr + offsets, p, mask=mask)
    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)
    tl.store(age_ptr + offsets, tl.where(arrived, 0, age).to(tl.uint8), mask=mask)


def _log2(beta: float) -> float:
    """log2(beta), with beta = 0 as the most negative float (exp2 of it times a >= 1 is 0)."""
    return math.log2(beta) if beta > 0.0 else -3.0e38


def burst_adamw_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    age: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    decay_factor: float,
    step_size: float,
    inv_sqrt_bias2: float,
    eps: float,
    max_age: int,
) -> None:
    """One step in place; every tensor contiguous, fp32 (``age``: uint8), of ``p``'s size."""
    numel = p.numel()
    if numel == 0:
        return
    _burst_adamw_kernel[(triton.cdiv(numel, BLOCK),)](
        p,
        grad,
        m,
        v,
        age,
        numel,
        _log2(beta1),
        _log2(beta2),
        decay_factor,
        step_size,
        inv_sqrt_bias2,
        eps,
        max_age,
        BLOCK=BLOCK,
    )
