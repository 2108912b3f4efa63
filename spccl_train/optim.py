"""BurstAdamW: AdamW for gradients that error feedback delivers in bursts.

With 99% pruning and error feedback, a coordinate's gradient waits in the error buffer and
arrives, on average every hundred steps, as one burst holding the sum of the steps it waited.
AdamW takes that burst for one step's gradient: it inflates the second moment by the burst's
square, so the coordinate moves about as far as a few ordinary steps would, not as far as the
steps it waited. Training then falls behind dense (``bench/results/NOTES.md``: GPT-2 XL at 3.88
against 2.42 after 100 iterations).

BurstAdamW reads the all-reduced gradient as what arrived. A zero means nothing arrived this step.
A nonzero value after ``a`` steps (the steps since the coordinate last arrived, the ``age``) is
read as the sum of ``a`` per-step gradients ``g = grad / a``. It then applies ``a`` steps' worth
of AdamW at once:

    m <- beta1^a m + (1 - beta1^a) g          (a steps of a constant g, in closed form)
    v <- beta2^a v + (1 - beta2^a) g^2
    p <- p - lr a m_hat / (sqrt(v_hat) + eps)  (bias corrections of the global step)

Coordinates that received nothing keep ``m`` and ``v`` and move by weight decay only. Weight
decay is decoupled, as in AdamW, every step. With every coordinate arriving every step
(``a = 1``), this is AdamW (equal to rounding).

Error feedback with ``decay < 1`` leaks part of the waiting sum, so a burst then holds less than
``a`` steps. ``max_age`` caps ``a`` for that case; the age counter itself saturates at 255.

A coordinate whose gradient is exactly zero for reasons other than pruning, such as an unused
embedding row, also ages. Its first nonzero gradient then moves it as if that gradient had
waited. Bound that with ``max_age`` where it matters.

``max_burst`` paces the move: a coordinate moves at most ``max_burst`` steps' worth in one step,
and the rest of a longer burst on the next steps, with the moments of then (the steps still owed
are kept in ``owed``, uint8, saturating at 255). The moments take the whole burst at once, as
above. Why: at 99% density most bursts arrive after tens of steps, and applying each at once
moves the weights in lumps that dense AdamW never makes. On the tiny GPT-2 of ``tiny_cpu`` the
loss then spiked some tens of iterations after the density warm-up in 7 runs of 12 (seeds), and
ended up to 12% above dense. With ``max_burst=16`` none spiked, and 10 of 12 ended within 2% of
dense, against 8. Capping the age instead (``max_age=16``) also stops most spikes, but it loses
the rest of each burst, so the run falls behind dense late. On GPT-2 XL, whose dense runs spike
too, the 3 runs with ``max_burst=16`` ended 1.4-7.4% above the dense runs' mean (2 of them
spiked), and the 3 with ``max_age=16`` 1.0-2.7% (the shipped config's 12 runs: +0.5% on
average), so the shipped configs leave both off (``bench/results/2026-11-27_twentythird/``).
On the tiny model's default seed (1234), ``max_burst=16`` ended 3.4% above dense, against 0.9%.
"""

from __future__ import annotations

import math

import torch

from ._triton import uses_triton

__all__ = ["BurstAdamW"]

_AGE_LIMIT = 255  # ages are uint8


def _fused(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *counters: torch.Tensor) -> bool:
    """True when the step runs as one Triton pass: the Triton kernels serve ``p`` and the tensors
    are contiguous, fp32 (the counters, age and owed: uint8); otherwise the torch ops below serve."""
    return (
        uses_triton(p)
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (p, grad, m, v))
        and all(t.is_contiguous() for t in counters)
    )


def _after_load(optimizer: BurstAdamW) -> None:
    """After ``load_state_dict``: the counters back to uint8 (torch casts state to the parameter's
    dtype), and a checkpoint from before ``max_burst`` takes the optimizer's own."""
    for group in optimizer.param_groups:
        group.setdefault("max_burst", optimizer.defaults["max_burst"])
    for state in optimizer.state.values():
        for key in ("age", "owed"):
            if key in state and state[key].dtype != torch.uint8:
                state[key] = state[key].to(torch.uint8)


class BurstAdamW(torch.optim.Optimizer):
    """AdamW that applies a gradient arriving after ``a`` empty steps as ``a`` steps' worth (module docstring).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``.
        max_age: the most steps one arriving gradient is read as (1 to 255; ``None``: 255).
        max_burst: the most steps' worth a coordinate moves in one step; the rest of a longer
            burst moves on the next steps (1 to 255; ``None``: all at once).

    State per parameter: ``exp_avg``, ``exp_avg_sq`` (the parameter's dtype), ``age`` (uint8:
    steps since the coordinate last received a nonzero gradient), ``owed`` (uint8, with
    ``max_burst`` only: steps' worth still to move) and ``step``.

    Example::

        >>> opt = BurstAdamW(model.parameters(), lr=1.5e-4, betas=(0.9, 0.95), weight_decay=0.1)
        >>> # with spccl_train.ddp.sparse_allreduce_hook (decay=1.0) as the model's comm hook
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_age: int | None = None,
        max_burst: int | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr={lr}: the learning rate must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={betas}: each must lie in [0, 1)")
        if not eps > 0.0:
            raise ValueError(f"eps={eps}: must be > 0")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay={weight_decay}: must be >= 0")
        if max_age is not None and not 1 <= max_age <= _AGE_LIMIT:
            raise ValueError(f"max_age={max_age}: must be 1 to {_AGE_LIMIT} (or None for {_AGE_LIMIT})")
        if max_burst is not None and not 1 <= max_burst <= _AGE_LIMIT:
            raise ValueError(f"max_burst={max_burst}: must be 1 to {_AGE_LIMIT} (or None to move each burst at once)")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_age": max_age,
            "max_burst": max_burst,
        }
        super().__init__(params, defaults)
        self.register_load_state_dict_post_hook(_after_load)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step; ``closure`` as for other torch optimizers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            max_age = group["max_age"] or _AGE_LIMIT
            max_burst = group["max_burst"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("BurstAdamW takes dense gradients (zeros mark what did not arrive)")
                self._update(p, self._state(p, max_burst), beta1, beta2, lr, eps, wd, max_age, max_burst)
        return loss

    def _state(self, p: torch.Tensor, max_burst: int | None) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["age"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.preserve_format)
        if max_burst is not None and "owed" not in state:
            state["owed"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _update(p, state, beta1, beta2, lr, eps, wd, max_age, max_burst) -> None:
        grad, m, v, age = p.grad, state["exp_avg"], state["exp_avg_sq"], state["age"]
        owed = state.get("owed") if max_burst is not None else None
        state["step"] += 1
        step = state["step"]
        if _fused(p, grad, m, v, age, *([] if owed is None else [owed])):
            from ._optim_kernel import burst_adamw_step

            burst_adamw_step(
                p,
                grad,
                m,
                v,
                age,
                owed,
                beta1=beta1,
                beta2=beta2,
                decay_factor=1 - lr * wd,
                step_size=lr / (1 - beta1**step),
                inv_sqrt_bias2=1 / math.sqrt(1 - beta2**step),
                eps=eps,
                max_age=max_age,
                max_burst=max_burst or 0,
            )
            return
        age.add_(age < _AGE_LIMIT)  # saturating
        arrived = grad != 0
        a = age.clamp(max=max_age).to(m.dtype)
        g = grad.to(m.dtype) / a
        # m and v move only where something arrived: weight 1 - beta^a there, 0 elsewhere.
        m.lerp_(g, (1 - torch.pow(beta1, a)).mul_(arrived))
        v.lerp_(g.square_(), (1 - torch.pow(beta2, a)).mul_(arrived))
        if wd:
            p.mul_(1 - lr * wd)
        bias1 = 1 - beta1**step
        bias2 = 1 - beta2**step
        denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
        moves = a.mul_(arrived)  # steps' worth each coordinate moves now
        if owed is not None:
            due = moves.add_(owed).clamp_(max=_AGE_LIMIT)  # saturating
            moves = due.clamp(max=max_burst)
            owed.copy_(due.sub_(moves))
        p.addcdiv_(moves.mul_(m), denom, value=-lr / bias1)
        age.masked_fill_(arrived, 0)
