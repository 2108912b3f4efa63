"""Sampled top-k gradient pruning with leaky error feedback: configuration and dispatch.

CUDA tensors run the Triton kernels (:mod:`.sample`, :mod:`.prune_ef`); CPU tensors run the
torch reference, or the Triton kernels in Triton's interpreter when ``TRITON_INTERPRET=1``
(that is how the kernels are tested without a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from . import reference

__all__ = ["PruneConfig", "PruneResult", "Pruner", "uses_triton"]

_ERROR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def uses_triton(t: torch.Tensor) -> bool:
    """True when pruning ``t`` runs the Triton kernels (CUDA, or the interpreter on CPU)."""
    on_device = t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and _triton_importable()


@dataclasses.dataclass(kw_only=True, slots=True)
class PruneConfig:
    """How gradients are pruned before a sparse all-reduce."""

    density: float = 0.01
    """Fraction of elements kept (0.01 = 99% sparsity), in (0, 1]."""
    sample_fraction: float = 0.001
    """Fraction of ``|g + e|`` sampled to pick the threshold, in (0, 1]; at least one element."""
    decay: float = 0.9
    """Leak of the error feedback: dropped values re-enter the next step times ``decay``, in [0, 1]."""
    error_dtype: str = "float32"
    """Element type of the error buffers: ``float32``, ``bfloat16`` or ``float16``."""
    seed: int = 0
    """Base seed of the sampling RNG; step ``s`` of buffer ``b`` draws with a seed derived from all three."""

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"density={self.density} must be in (0, 1]: the fraction of elements kept")
        if not 0 < self.sample_fraction <= 1:
            raise ValueError(f"sample_fraction={self.sample_fraction} must be in (0, 1], e.g. 0.001")
        if not 0 <= self.decay <= 1:
            raise ValueError(f"decay={self.decay} must be in [0, 1] (0 disables error feedback)")
        if self.error_dtype not in _ERROR_DTYPES:
            raise ValueError(f"error_dtype={self.error_dtype!r} must be one of {sorted(_ERROR_DTYPES)}")

    @property
    def error_torch_dtype(self) -> torch.dtype:
        """``error_dtype`` as a torch dtype."""
        return _ERROR_DTYPES[self.error_dtype]


@dataclasses.dataclass(frozen=True, slots=True)
class PruneResult:
    """What one pruning pass did; tensors stay on the device (read them when convenient)."""

    threshold: torch.Tensor
    """One-element fp32 tensor: the magnitude threshold used."""
    kept: torch.Tensor
    """One-element integer tensor: elements kept."""
    numel: int
    """Elements pruned."""


class Pruner:
    """Prunes gradient buffers in place with sampled top-k thresholds and leaky error feedback.

    Args:
        config: a :class:`PruneConfig` (defaults: keep 1%, sample 0.1%, decay 0.9, fp32 errors).

    Example::

        >>> pruner = Pruner(PruneConfig(density=0.01))
        >>> grad = torch.randn(1 << 16)
        >>> error = pruner.new_error_buffer(grad)
        >>> result = pruner.prune(grad, error, step=0)
        >>> int((grad != 0).sum()) == int(result.kept)
        True
    """

    __slots__ = ("config",)

    def __init__(self, config: PruneConfig | None = None) -> None:
        self.config = config or PruneConfig()

    def new_error_buffer(self, grad: torch.Tensor) -> torch.Tensor:
        """A zeroed error buffer for ``grad`` in the configured dtype."""
        return torch.zeros(grad.shape, dtype=self.config.error_torch_dtype, device=grad.device)

    def _seed(self, step: int, buffer: int) -> int:
        # Distinct, reproducible draws per (seed, step, buffer); kept within int32 for Triton.
        return (self.config.seed * 1_000_003 + step * 7_919 + buffer * 104_729) % (2**31 - 1)

    def prune(self, grad: torch.Tensor, error: torch.Tensor, *, step: int, buffer: int = 0) -> PruneResult:
        """Prune ``grad`` in place, folding in and refilling ``error``; no host synchronisation.

        Args:
            grad: contiguous float32 / bfloat16 / float16 gradient, any shape.
            error: its error buffer (same shape and device; dtype ``config.error_dtype``).
            step: training step, for the sampling seed.
            buffer: which buffer (e.g. a DDP bucket index), for the sampling seed.
        """
        self._check(grad, error)
        cfg = self.config
        g, e = grad.view(-1), error.view(-1)
        n = g.numel()
        if n == 0:
            zero = torch.zeros(1, dtype=torch.float32, device=g.device)
            return PruneResult(threshold=zero, kept=zero.to(torch.int64), numel=0)
        m = reference.sample_size(n, cfg.sample_fraction)
        seed = self._seed(step, buffer)
        if uses_triton(g):
            from .prune_ef import prune_error_feedback
            from .threshold import sampled_threshold

            threshold = sampled_threshold(g, e, m, reference.keep_count(m, cfg.density), seed)
            kept = prune_error_feedback(g, e, threshold, cfg.decay)
        else:
            generator = torch.Generator(device=g.device).manual_seed(seed)
            index = torch.randint(0, n, (m,), generator=generator, device=g.device)
            sample = (g[index].to(torch.float32) + e[index].to(torch.float32)).abs()
            threshold = reference.threshold_from_sample(sample, cfg.density)
            kept = reference.prune_with_error_feedback(g, e, threshold, cfg.decay)
        return PruneResult(threshold=threshold, kept=kept, numel=n)

    def _check(self, grad: torch.Tensor, error: torch.Tensor) -> None:
        if grad.dtype not in _GRAD_DTYPES:
            raise TypeError(f"cannot prune {grad.dtype} gradients: use float32, bfloat16 or float16")
        if error.dtype != self.config.error_torch_dtype:
            raise TypeError(
                f"error buffer is {error.dtype} but config.error_dtype is {self.config.error_dtype}; "
                "allocate it with Pruner.new_error_buffer"
            )
        if grad.shape != error.shape or grad.device != error.device:
            raise ValueError(
                f"error buffer {tuple(error.shape)} on {error.device} does not match gradient "
                f"{tuple(grad.shape)} on {grad.device}"
            )
        if not (grad.is_contiguous() and error.is_contiguous()):
            raise ValueError("gradient and error buffer must be contiguous; pass .contiguous() views")
        if grad.numel() >= 2**31:
            raise ValueError(
                f"cannot prune {grad.numel()} elements at once (the kernels count in int32); "
                "prune buffers of fewer than 2**31 elements, e.g. smaller DDP buckets"
            )
