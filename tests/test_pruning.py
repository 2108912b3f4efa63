"""Sampled top-k pruning with leaky error feedback: Triton kernels against the torch reference.

On CPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1),
on small sizes; on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spccl_train.pruning import PruneConfig, Pruner, reference, uses_triton

pytest.importorskip("triton")
from spccl_train.pruning.prune_ef import prune_error_feedback  # noqa: E402
from spccl_train.pruning.threshold import sampled_threshold  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LENGTHS = [1, 63, 4095, 4096, 4097, 3 * 4096 + 5]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical, except that NaNs (whose payload arithmetic leaves unspecified) match by position."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(_bits(actual)[~nan], _bits(expected)[~nan])


def test_kernels_run_where_expected():
    assert uses_triton(torch.ones(1, device=DEVICE))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("error_dtype", DTYPES)
def test_prune_kernel_matches_reference(n, grad_dtype, error_dtype):
    g = torch.randn(n, device=DEVICE).to(grad_dtype)
    e = (torch.randn(n, device=DEVICE) * 0.5).to(error_dtype)
    if n > 8:
        g[1], g[2], e[3] = float("nan"), float("inf"), -float("inf")
    threshold = torch.rand(1, device=DEVICE) * 2
    decay = float(torch.rand(()))
    g_ref, e_ref = g.clone(), e.clone()
    kept = prune_error_feedback(g, e, threshold, decay)
    kept_ref = reference.prune_with_error_feedback(g_ref, e_ref, threshold, decay)
    _assert_same(g, g_ref)
    _assert_same(e, e_ref)
    assert int(kept) == int(kept_ref)


@pytest.mark.parametrize("threshold", [0.0, float("inf")])
def test_prune_extremes(threshold):
    g = torch.randn(5000, device=DEVICE)
    e = torch.randn(5000, device=DEVICE)
    v = g + e
    kept = prune_error_feedback(g, e, torch.tensor([threshold], device=DEVICE), 0.5)
    if threshold == 0.0:  # everything kept, nothing left behind
        assert torch.equal(g, v) and not e.any() and int(kept) == 5000
    else:  # everything dropped into the error buffer, decayed
        assert not g.any() and torch.equal(e, v * 0.5) and int(kept) == 0


@settings(deadline=None, max_examples=15)
@given(steps=st.integers(2, 5), decay=st.floats(0.0, 1.0), density=st.sampled_from([0.01, 0.1, 0.5]))
def test_error_feedback_holds_what_was_dropped(steps, decay, density):
    """Over several steps, the error buffer is exactly decay * (dropped part of g + e)."""
    pruner = Pruner(PruneConfig(density=density, sample_fraction=0.05, decay=decay))
    n = 3000
    error = pruner.new_error_buffer(torch.empty(n, device=DEVICE))
    for step in range(steps):
        grad = torch.randn(n, device=DEVICE)
        v = grad + error
        result = pruner.prune(grad, error, step=step)
        keep = v.abs() >= result.threshold
        assert torch.equal(grad, torch.where(keep, v, torch.zeros_like(v)))
        assert torch.equal(error, torch.where(keep, torch.zeros_like(v), v * decay))
        assert int(result.kept) == int(keep.sum())


@pytest.mark.parametrize("density", [1e-4, 0.01, 0.3, 1.0])
def test_sampled_threshold_matches_reference_on_its_sample(density):
    g = torch.randn(20000, device=DEVICE)
    e = torch.randn(20000, device=DEVICE)
    population = (g + e).abs()
    m = 500
    k = reference.keep_count(m, density)
    threshold, sample = sampled_threshold(g, e, m, k, seed=7, return_sample=True)
    assert sample.shape == (m,) and torch.isin(sample, population).all()
    assert torch.equal(threshold, reference.threshold_from_sample(sample, density))
    assert torch.equal(threshold, sampled_threshold(g, e, m, k, seed=7))
    _, other = sampled_threshold(g, e, m, k, seed=8, return_sample=True)
    assert not torch.equal(sample, other)
    # Uniform over positions: the sample's median is close to the population's.
    assert abs(float(sample.median()) - float(population.median())) < 0.15


def _assert_state_zeroed(device) -> None:
    """The kernel leaves its per-device histogram and "programs done" counter zeroed."""
    from spccl_train.pruning import threshold as threshold_module

    hist, done, _ = threshold_module._device_state(torch.device(device))
    assert not hist.any() and int(done) == 0


def test_sampled_threshold_resets_between_calls():
    """Back-to-back calls on different inputs, sizes and k: each equals the reference on its sample."""
    torch.manual_seed(0)
    previous = []
    for n, m, density in [(5000, 700, 0.01), (300, 300, 1.0), (20000, 1, 0.5), (4096, 1500, 0.3), (777, 64, 1e-4)]:
        g = torch.randn(n, device=DEVICE) * 3
        e = torch.randn(n, device=DEVICE)
        k = reference.keep_count(m, density)
        threshold, sample = sampled_threshold(g, e, m, k, seed=n + m, return_sample=True)
        assert torch.equal(threshold, reference.threshold_from_sample(sample, density))
        _assert_state_zeroed(DEVICE)
        again = sampled_threshold(g, e, m, k, seed=n + m)
        assert torch.equal(again, threshold)
        _assert_state_zeroed(DEVICE)
        previous.append((threshold, threshold.clone()))
    # Each call returns a fresh tensor, left alone by the calls after it.
    assert len({t.data_ptr() for t, _ in previous}) == len(previous)
    assert all(torch.equal(t, kept) for t, kept in previous)


@pytest.mark.parametrize("m", [1024, 1025, 4 * 1024 + 17])
@pytest.mark.parametrize("density", [1e-3, 0.05, 1.0])
def test_sampled_threshold_over_many_programs(m, density):
    """One program's draws (1024) and more, over magnitudes spread across many bins (and blocks of
    bins), with infinities: the last program done selects over every program's counts."""
    n = 6000
    g = torch.randn(n, device=DEVICE) * torch.exp2(torch.randint(-120, 120, (n,), device=DEVICE).float())
    e = torch.zeros(n, device=DEVICE)
    g[::500] = float("inf")
    k = reference.keep_count(m, density)
    threshold, sample = sampled_threshold(g, e, m, k, seed=m, return_sample=True)
    assert torch.equal(threshold, reference.threshold_from_sample(sample, density))
    assert int((sample >= threshold).sum()) >= k
    _assert_state_zeroed(DEVICE)


@settings(deadline=None, max_examples=40)
@given(m=st.integers(1, 2000), density=st.floats(1e-4, 1.0))
def test_threshold_keeps_the_target_share_of_the_sample(m, density):
    sample = torch.rand(m) * 10
    threshold = reference.threshold_from_sample(sample, density)
    k = min(m, max(1, math.ceil(density * m)))
    kth = torch.sort(sample, descending=True).values[k - 1]
    assert int((sample >= threshold).sum()) >= k
    assert threshold <= kth and float(kth - threshold) <= float(kth) * 2**-7


@pytest.mark.parametrize("use_interpreter", [True, False])
def test_pruner_reaches_the_target_density(use_interpreter, monkeypatch):
    if not use_interpreter:
        monkeypatch.setattr("spccl_train.pruning.pruner.uses_triton", lambda t: False)
    pruner = Pruner(PruneConfig(density=0.01, sample_fraction=0.02))
    grad = torch.randn(200_000, device=DEVICE)
    error = pruner.new_error_buffer(grad)
    result = pruner.prune(grad, error, step=3, buffer=1)
    achieved = int(result.kept) / grad.numel()
    assert 0.006 < achieved < 0.015
    assert int((grad != 0).sum()) == int(result.kept)


def test_pruner_empty_and_tiny_buffers():
    pruner = Pruner()
    for n in (0, 1, 5):
        grad = torch.randn(n, device=DEVICE)
        error = pruner.new_error_buffer(grad)
        result = pruner.prune(grad, error, step=0)
        assert result.numel == n and int(result.kept) <= n


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"sample_fraction": 0.0}, "sample_fraction"),
        ({"decay": -0.1}, "decay"),
        ({"error_dtype": "float64"}, "error_dtype"),
    ],
)
def test_config_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PruneConfig(**kwargs)


def test_pruner_argument_errors():
    pruner = Pruner()
    grad = torch.randn(10, device=DEVICE)
    with pytest.raises(TypeError, match="float64"):
        pruner.prune(grad.double(), pruner.new_error_buffer(grad), step=0)
    with pytest.raises(TypeError, match="error_dtype"):
        pruner.prune(grad, torch.zeros(10, dtype=torch.bfloat16, device=DEVICE), step=0)
    with pytest.raises(ValueError, match="does not match"):
        pruner.prune(grad, pruner.new_error_buffer(torch.randn(11, device=DEVICE)), step=0)
    with pytest.raises(ValueError, match="contiguous"):
        g2 = torch.randn(10, 2, device=DEVICE).t()
        pruner.prune(g2, pruner.new_error_buffer(g2.contiguous()), step=0)
