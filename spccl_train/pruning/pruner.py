"""Sampled top-k gradient pruning with leaky error feedback: configuration and dispatch.

CUDA tensors run the Triton kernels (:mod:`.threshold`, :mod:`.prune_ef`); CPU tensors run the
torch reference, or the Triton kernels in Triton's interpreter when ``TRITON_INTERPRET=1``
(that is how the kernels are tested without a GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .._triton import uses_triton
from ..collectives.chunking import ChunkLayout
from ..collectives.encoded import EncodedPieces
from . import reference

__all__ = ["PRUNE_BLOCK", "PruneConfig", "PruneResult", "Pruner", "uses_triton"]

PRUNE_BLOCK = 4096
"""Elements per program of the fused prune kernel, and per entry of the block counts it can
leave for :func:`~.cap.cap_ranges`."""
_ERROR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    warmup_steps: int = 0
    """Warm-up of the density (Deep Gradient Compression's "warm-up training"): over the first
    ``warmup_steps`` pruned steps the kept fraction decays exponentially from 1 to ``density``,
    so that training starts from nearly dense gradients. See :meth:`density_at`; 0: ``density``
    from the first step."""

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"density={self.density} must be in (0, 1]: the fraction of elements kept")
        if not 0 < self.sample_fraction <= 1:
            raise ValueError(f"sample_fraction={self.sample_fraction} must be in (0, 1], e.g. 0.001")
        if not 0 <= self.decay <= 1:
            raise ValueError(f"decay={self.decay} must be in [0, 1] (0 disables error feedback)")
        if self.error_dtype not in _ERROR_DTYPES:
            raise ValueError(f"error_dtype={self.error_dtype!r} must be one of {sorted(_ERROR_DTYPES)}")
        n = self.warmup_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"warmup_steps={n!r} must be an int >= 0 (0: prune to density from the first step)")

    def density_at(self, step: int) -> float:
        """Fraction kept at pruned step ``step`` (0: the first pruned step) under the warm-up.

        ``density ** ((step + 1) / (warmup_steps + 1))`` for ``step < warmup_steps``, else exactly
        ``density``: the log of the density falls linearly from 0 (density 1, one step before the
        first) to ``log(density)`` at step ``warmup_steps``, i.e. each step keeps the same
        fraction ``density ** (1 / (warmup_steps + 1))`` of the previous step's kept elements.
        Density 0.01 over 3 steps keeps 31.6%, 10%, 3.2%, then 1% from step 3 on.
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0: count pruned steps from 0 (dense steps do not count)")
        if step >= self.warmup_steps:
            return self.density
        return self.density ** ((step + 1) / (self.warmup_steps + 1))

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
    deferred: torch.Tensor | None = None
    """One-element int64 tensor: nonzeros the per-range caps moved back into the error buffer
    (``None`` when :meth:`Pruner.prune` got no caps)."""


def _nothing_pruned(device: torch.device) -> PruneResult:
    """The result of pruning an empty buffer."""
    zero = torch.zeros(1, dtype=torch.float32, device=device)
    return PruneResult(threshold=zero, kept=zero.to(torch.int64), numel=0)


def _block_aligned(ranges: Sequence[tuple[int, int]], n: int) -> bool:
    """Whether every range starts on a prune block and ends on one or at ``n``."""
    return all(
        start % PRUNE_BLOCK == 0 and ((start + numel) % PRUNE_BLOCK == 0 or start + numel == n)
        for start, numel in ranges
    )


class Pruner:
    """Prunes gradient buffers with sampled top-k thresholds and leaky error feedback: in place
    (:meth:`prune`), or into an all-reduce's Pici payloads (:meth:`prune_to_wire`).

    Args:
        config: a :class:`PruneConfig` (defaults: keep 1%, sample 0.1%, decay 0.9, fp32 errors,
            no density warm-up).

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

    def prune(
        self,
        grad: torch.Tensor,
        error: torch.Tensor,
        *,
        step: int,
        buffer: int = 0,
        schedule_step: int | None = None,
        caps: tuple[Sequence[tuple[int, int]], Sequence[int]] | None = None,
    ) -> PruneResult:
        """Prune ``grad`` in place, folding in and refilling ``error``; no host synchronisation.

        The fraction kept is ``config.density_at(schedule_step)`` (:meth:`PruneConfig.density_at`).
        At density 1 the threshold is 0 and no sample is drawn: every element, zeros included, is
        kept (the k-th largest of m samples with k = m would be the smallest sample, which other
        elements can fall below), and the error buffer is emptied into ``grad``.

        Args:
            grad: contiguous float32 / bfloat16 / float16 gradient, any shape.
            error: its error buffer (same shape and device; dtype ``config.error_dtype``).
            step: training step, for the sampling seed (and the density, unless ``schedule_step``).
            buffer: which buffer (e.g. a DDP bucket index), for the sampling seed.
            schedule_step: pruned steps before this one, for the density warm-up
                (:attr:`PruneConfig.warmup_steps`); ``None``: ``step``. Callers that reduce the
                first steps densely pass ``step`` minus those, so that the warm-up starts when
                pruning does.
            caps: ``(ranges, limits)``: then at most ``limits[i]`` nonzeros stay in range
                ``ranges[i] = (start, numel)`` of the flat gradient, the rest deferred to the error
                buffer (:func:`~.cap.cap_ranges`). Ranges that start on :data:`PRUNE_BLOCK`
                boundaries are counted by the prune kernel itself, saving a pass.
        """
        self._check(grad, error)
        g, e = grad.view(-1), error.view(-1)
        n = g.numel()
        if n == 0:
            return _nothing_pruned(g.device)
        threshold = self._threshold(g, e, step, buffer, schedule_step)
        on_triton = uses_triton(g)
        cfg = self.config
        block_counts = None
        if on_triton:
            from .prune_ef import prune_error_feedback

            if caps is not None and _block_aligned(caps[0], n):
                block_counts = torch.empty(-(-n // PRUNE_BLOCK), dtype=torch.int32, device=g.device)
            kept = prune_error_feedback(g, e, threshold, cfg.decay, block_counts)
        else:
            kept = reference.prune_with_error_feedback(g, e, threshold, cfg.decay)
        deferred = None
        if caps is not None:
            from .cap import cap_ranges

            deferred = cap_ranges(g, e, caps[0], caps[1], block_counts=block_counts)
        return PruneResult(threshold=threshold, kept=kept, numel=n, deferred=deferred)

    def prune_to_wire(
        self,
        grad: torch.Tensor,
        error: torch.Tensor,
        layout: ChunkLayout,
        *,
        step: int,
        buffer: int = 0,
        schedule_step: int | None = None,
        into: EncodedPieces | None = None,
    ) -> tuple[PruneResult, EncodedPieces]:
        """Prune ``grad`` as :meth:`prune` does, writing the result as the Pici payloads of
        ``layout``'s pieces (an all-reduce's input, :class:`~spccl_train.collectives.EncodedPieces`)
        instead of into ``grad``; no host synchronisation.

        With the CUDA kernels this is one pass over every piece (one launch) that reads ``grad`` and
        ``error`` once and writes ``error`` and the payloads: ``grad`` is left as it was. Elsewhere the torch reference
        computes the same bytes (:func:`.wire.prune_to_wire_reference`; on a GPU without the
        kernels, pruning in place then encoding). The payloads, nonzero counts and error buffer
        equal those of :meth:`prune` followed by encoding each piece, bit for bit. No caps: a
        capacity-bounded reduction prunes with :meth:`prune`.

        Args:
            grad, error, step, buffer, schedule_step: as for :meth:`prune`.
            layout: the pieces, ``ChunkLayout.of("all_reduce", grad.numel(), world, channels)``.
            into: payloads from an earlier call to reuse (their layout and dtype must match).
        """
        from . import wire

        self._check(grad, error)
        g, e = grad.view(-1), error.view(-1)
        if layout.numel != g.numel():
            raise ValueError(
                f"layout cuts {layout.numel} elements but grad has {g.numel()}; "
                "pass ChunkLayout.of('all_reduce', grad.numel(), world, channels)"
            )
        if into is None or not into.fits(layout, g.dtype) or into.device != g.device:
            into = EncodedPieces.empty(layout, g.dtype, g.device)
        n = g.numel()
        if n == 0:
            return _nothing_pruned(g.device), into
        threshold = self._threshold(g, e, step, buffer, schedule_step)
        kept = wire.prune_into(g, e, threshold, self.config.decay, into)  # g, e and into checked above
        return PruneResult(threshold=threshold, kept=kept, numel=n), into

    def _threshold(
        self, g: torch.Tensor, e: torch.Tensor, step: int, buffer: int, schedule_step: int | None
    ) -> torch.Tensor:
        """The magnitude threshold of this step's density: sampled top-k, or 0 at density 1."""
        cfg = self.config
        density = cfg.density_at(step if schedule_step is None else schedule_step)
        n = g.numel()
        if density >= 1.0:
            return torch.zeros(1, dtype=torch.float32, device=g.device)
        m = reference.sample_size(n, cfg.sample_fraction)
        if uses_triton(g):
            from .threshold import sampled_threshold

            return sampled_threshold(g, e, m, reference.keep_count(m, density), self._seed(step, buffer))
        generator = torch.Generator(device=g.device).manual_seed(self._seed(step, buffer))
        index = torch.randint(0, n, (m,), generator=generator, device=g.device)
        sample = (g[index].to(torch.float32) + e[index].to(torch.float32)).abs()
        return reference.threshold_from_sample(sample, density)

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
