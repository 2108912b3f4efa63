"""The density warm-up of pruning (``PruneConfig.warmup_steps``, ``density_at``) on both pruning paths.

On CPU the Triton kernels run in Triton's interpreter (``tests/conftest.py``); ``use_interpreter``
False takes the torch reference instead.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from spccl_train.pruning import PruneConfig, Pruner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=[True, False], ids=["triton", "reference"])
def use_interpreter(request, monkeypatch):
    if request.param:
        pytest.importorskip("triton")
    else:
        monkeypatch.setattr("spccl_train.pruning.pruner.uses_triton", lambda t: False)
    return request.param


# ----------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("density", [0.001, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("warmup_steps", [1, 3, 20, 100])
def test_density_decays_exponentially_to_exactly_density(density, warmup_steps):
    cfg = PruneConfig(density=density, warmup_steps=warmup_steps)
    ramp = [cfg.density_at(step) for step in range(warmup_steps + 50)]
    assert all(0 < d <= 1 for d in ramp)
    assert all(a >= b for a, b in itertools.pairwise(ramp)), "non-increasing"
    assert ramp[0] == pytest.approx(density ** (1 / (warmup_steps + 1)))
    assert all(d == density for d in ramp[warmup_steps:]), "exactly density once the warm-up is over"
    assert all(d > density for d in ramp[:warmup_steps]) or density == 1.0
    # Exponential: the same ratio from one step to the next, over the whole ramp.
    ratios = [b / a for a, b in itertools.pairwise([1.0, *ramp[: warmup_steps + 1]])]
    assert ratios == pytest.approx([density ** (1 / (warmup_steps + 1))] * (warmup_steps + 1))


def test_density_at_examples():
    cfg = PruneConfig(density=0.01, warmup_steps=3)
    assert [cfg.density_at(s) for s in range(5)] == pytest.approx([10**-0.5, 0.1, 10**-1.5, 0.01, 0.01])
    assert PruneConfig(density=0.01, warmup_steps=100).density_at(0) > 0.95  # a long warm-up starts near dense
    assert PruneConfig(density=0.01, warmup_steps=19).density_at(19) == 0.01


def test_no_warmup_is_density_from_the_first_step():
    cfg = PruneConfig(density=0.02)
    assert cfg.warmup_steps == 0
    assert all(cfg.density_at(step) == 0.02 for step in range(100))


@pytest.mark.parametrize("bad", [-1, -20, 1.5, True, "3"])
def test_warmup_steps_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=f"warmup_steps={bad!r} must be an int >= 0"):
        PruneConfig(warmup_steps=bad)


def test_density_at_rejects_negative_steps():
    with pytest.raises(ValueError, match="step=-1 must be >= 0"):
        PruneConfig(warmup_steps=3).density_at(-1)


# ----------------------------------------------------------------------------- the pruner


def test_pruner_keeps_nearly_all_at_the_start_and_density_after(use_interpreter):
    density, warmup = 0.01, 100
    # 10% sampled (k = 200 at 1%): the achieved density stays within the bounds by > 4 sigma
    pruner = Pruner(PruneConfig(density=density, sample_fraction=0.1, warmup_steps=warmup))
    for step, low, high in [(0, 0.93, 0.98), (50, 0.08, 0.12), (warmup, 0.006, 0.015), (warmup + 7, 0.006, 0.015)]:
        grad = torch.randn(200_000, device=DEVICE)
        error = pruner.new_error_buffer(grad)
        result = pruner.prune(grad, error, step=step, buffer=1)
        achieved = int(result.kept) / grad.numel()
        assert low < achieved < high, f"step {step}: kept {achieved:.4f}, scheduled {pruner.config.density_at(step)}"
        assert int((grad != 0).sum()) == int(result.kept)


def test_warmup_only_changes_the_density(use_interpreter):
    """A warm-up step prunes bit for bit as a config without warm-up at that step's density would,
    with the sampling seed still following ``step`` (not ``schedule_step``)."""
    warm = Pruner(PruneConfig(density=0.01, sample_fraction=0.05, decay=0.7, warmup_steps=4))
    g0, e0 = torch.randn(50_000, device=DEVICE), torch.randn(50_000, device=DEVICE) * 0.1
    for step, schedule_step in [(0, None), (2, None), (7, 1), (9, 4)]:
        scheduled = warm.config.density_at(step if schedule_step is None else schedule_step)
        plain = Pruner(PruneConfig(density=scheduled, sample_fraction=0.05, decay=0.7))
        g1, e1, g2, e2 = g0.clone(), e0.clone(), g0.clone(), e0.clone()
        r1 = warm.prune(g1, e1, step=step, buffer=3, schedule_step=schedule_step)
        r2 = plain.prune(g2, e2, step=step, buffer=3)
        assert torch.equal(r1.threshold, r2.threshold) and int(r1.kept) == int(r2.kept)
        assert torch.equal(g1, g2) and torch.equal(e1, e2)


def test_schedule_step_defaults_to_step(use_interpreter):
    pruner = Pruner(PruneConfig(density=0.01, sample_fraction=0.05, warmup_steps=5))
    g0 = torch.randn(20_000, device=DEVICE)
    g1, g2 = g0.clone(), g0.clone()
    r1 = pruner.prune(g1, pruner.new_error_buffer(g1), step=2)
    r2 = pruner.prune(g2, pruner.new_error_buffer(g2), step=2, schedule_step=2)
    assert torch.equal(g1, g2) and torch.equal(r1.threshold, r2.threshold)
    g3 = g0.clone()
    r3 = pruner.prune(g3, pruner.new_error_buffer(g3), step=2, schedule_step=0)
    assert int(r3.kept) > int(r1.kept)


@pytest.mark.parametrize("error_dtype", ["float32", "bfloat16"])
def test_density_one_keeps_everything_and_empties_the_error_buffer(use_interpreter, error_dtype):
    """At density 1 the threshold is 0: elements below the smallest sample, and zeros, are kept too."""
    pruner = Pruner(PruneConfig(density=1.0, sample_fraction=0.001, decay=0.9, error_dtype=error_dtype))
    n = 30_000
    grad = torch.randn(n, device=DEVICE)
    error = (torch.randn(n, device=DEVICE) * 0.5).to(pruner.config.error_torch_dtype)
    # A few v = g + e exactly 0 or far below any of the 30 samples' magnitudes.
    grad[::997], error[::997] = 0.0, 0.0
    grad[1::1000], error[1::1000] = 1e-30, 0.0
    for step in range(3):
        v = grad + error.float()
        result = pruner.prune(grad, error, step=step)
        assert float(result.threshold) == 0.0
        assert int(result.kept) == n and result.numel == n
        assert torch.equal(grad, v), "every element kept, the error folded in"
        assert not error.any(), "nothing is left in the error buffer"


def test_density_reaches_one_only_at_density_one():
    for warmup in (0, 1, 1000):
        cfg = PruneConfig(density=0.5, warmup_steps=warmup)
        assert cfg.density_at(0) < 1.0
        assert math.isclose(PruneConfig(density=1.0, warmup_steps=warmup).density_at(0), 1.0)
