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
    owed_ptr,
    numel,
    log2_beta1,
    log2_beta2,
    decay_factor,
    step_size,
    inv_sqrt_bias2,
    eps,
    max_age,
    max_burst,
    PACED: tl.constexpr,
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
    a_steps = tl.minimum(age, max_age)
    a = a_steps.to(tl.float32)
    per_step = g / a
    # a steps of a constant per-step gradient in closed form; the moments move only where something arrived
    w1 = tl.where(arrived, 1.0 - tl.exp2(a * log2_beta1), 0.0)
    w2 = tl.where(arrived, 1.0 - tl.exp2(a * log2_beta2), 0.0)
    m = m + w1 * (per_step - m)
    v = v + w2 * (per_step * per_step - v)
    p = p * decay_factor
    moves = tl.where(arrived, a_steps, 0)  # steps' worth each coordinate moves now
    if PACED:  # at most max_burst now, the rest owed to the next steps (saturating at 255)
        due = tl.minimum(moves + tl.load(owed_ptr + offsets, mask=mask, other=0).to(tl.int32), 255)
        moves = tl.minimum(due, max_burst)
        tl.store(owed_ptr + offsets, (due - moves).to(tl.uint8), mask=mask)
    update = moves.to(tl.float32) * m / (tl.sqrt(v) * inv_sqrt_bias2 + eps)
    p = tl.where(moves > 0, p - step_size * update, p)
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
    owed: torch.Tensor | None,
    *,
    beta1: float,
    beta2: float,
    decay_factor: float,
    step_size: float,
    inv_sqrt_bias2: float,
    eps: float,
    max_age: int,
    max_burst: int,
) -> None:
    """One step in place; every tensor contiguous, fp32 (``age``, ``owed``: uint8), of ``p``'s size.
    ``max_burst`` 0 (``owed`` None): each burst moves at once."""
    numel = p.numel()
    if numel == 0:
        return
    _burst_adamw_kernel[(triton.cdiv(numel, BLOCK),)](
        p,
        grad,
        m,
        v,
        age,
        age if owed is None else owed,  # not read unless paced
        numel,
        _log2(beta1),
        _log2(beta2),
        decay_factor,
        step_size,
        inv_sqrt_bias2,
        eps,
        max_age,
        max_burst,
        PACED=owed is not None,
        BLOCK=BLOCK,
    )
