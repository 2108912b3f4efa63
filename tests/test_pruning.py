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

from spccl_train.pruning import PruneConfig, Pruner, cap_ranges, cap_ranges_reference, reference, uses_triton

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
    # Uniform over positions: the sample's median is close to the population's (the inputs are
    # fresh each run; 0.25 is about 5 standard deviations of a 500-draw median here).
    assert abs(float(sample.median()) - float(population.median())) < 0.25


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
    # 40 of 4000 sampled values set the threshold: about 16% relative spread; fresh inputs each
    # run, so the bounds sit about 5 standard deviations out.
    assert 0.003 < achieved < 0.02
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


# ----------------------------------------------------------------------------- per-range caps


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    grad_dtype=st.sampled_from(DTYPES),
    error_dtype=st.sampled_from(DTYPES),
    density=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
)
def test_cap_kernels_match_reference(data, grad_dtype, error_dtype, density):
    """Fresh ranges, caps and values each run: the kernels equal the reference bit for bit, every
    range keeps at most its cap (its first nonzeros), and nothing is lost."""
    n = data.draw(st.integers(1, 3 * 4096 + 5), label="n")
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4), label="cuts"))
    edges = [0, *cuts, n]
    ranges = [(a, b - a) for a, b in zip(edges, edges[1:])]
    caps = [data.draw(st.integers(0, max(0, numel + 2)), label="cap") for _, numel in ranges]
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=g)
    grad[torch.rand(n, generator=g) >= density] = 0.0
    grad[torch.rand(n, generator=g) < 0.05] = -0.0  # a zero to the codecs: never counted
    grad[torch.rand(n, generator=g) < 0.01] = float("nan")  # nonzero to the codecs
    grad = grad.to(grad_dtype).to(DEVICE)
    error = torch.where(grad == 0, torch.randn(n, generator=g).to(DEVICE), torch.zeros((), device=DEVICE))
    error = error.to(error_dtype)
    grad_before, error_before = grad.clone(), error.clone()
    expected_grad, expected_error = grad.clone().cpu(), error.clone().cpu()
    expected_deferred = cap_ranges_reference(expected_grad, expected_error, ranges, caps)
    deferred = cap_ranges(grad, error, ranges, caps)
    _assert_same(grad.cpu(), expected_grad)
    _assert_same(error.cpu(), expected_error)
    assert int(deferred) == int(expected_deferred)
    after = grad.cpu()
    for (start, numel), cap in zip(ranges, caps):
        assert int((after[start : start + numel] != 0).sum()) <= cap
    # nothing lost: each moved value now sits in the error buffer, everything else is untouched
    original_grad = grad_before.cpu()
    moved = _bits(after) != _bits(original_grad)
    assert int(moved.sum()) == int(deferred)
    assert bool((after[moved] == 0).all())
    _assert_same(error.cpu()[moved], original_grad[moved].to(error_dtype))
    _assert_same(error.cpu()[~moved], error_before.cpu()[~moved])


def test_cap_defers_the_last_nonzeros_of_a_range():
    grad = torch.tensor([0.0, 1.0, 2.0, -0.0, 3.0, 4.0, 5.0, 6.0], device=DEVICE)
    error = torch.zeros(8, device=DEVICE)
    deferred = cap_ranges(grad, error, [(0, 4), (4, 4)], [1, 3])
    assert grad.tolist() == [0.0, 1.0, 0.0, 0.0, 3.0, 4.0, 5.0, 0.0]
    assert error.tolist() == [0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 6.0]
    assert int(deferred) == 2


def test_cap_argument_errors():
    grad, error = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="2 ranges but 1 caps"):
        cap_ranges(grad, error, [(0, 4), (4, 4)], [1])
    with pytest.raises(ValueError, match="caps must be >= 0"):
        cap_ranges(grad, error, [(0, 4)], [-1])
    with pytest.raises(ValueError, match="lies outside the 8 elements"):
        cap_ranges(grad, error, [(6, 4)], [1])
    with pytest.raises(ValueError, match="1-D tensors of one shape"):
        cap_ranges(grad, torch.zeros(9), [(0, 4)], [1])


@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_prune_kernel_counts_blocks_for_the_caps(grad_dtype):
    """The prune kernel's per-block counts give the caps the same result as counting afresh."""
    n = 5 * 4096 + 123
    g = torch.Generator().manual_seed(7)
    grad = torch.randn(n, generator=g).to(grad_dtype).to(DEVICE)
    error = torch.zeros(n, device=DEVICE)
    threshold = torch.tensor([0.5], device=DEVICE)
    ranges, caps = [(0, 2 * 4096), (2 * 4096, 3 * 4096 + 123)], [900, 1500]
    fused_grad, fused_error = grad.clone(), error.clone()
    counts = torch.empty(6, dtype=torch.int32, device=DEVICE)
    prune_error_feedback(fused_grad, fused_error, threshold, 0.9, counts)
    expected_counts = [int((fused_grad[i * 4096 : (i + 1) * 4096] != 0).sum()) for i in range(6)]
    assert counts.tolist() == expected_counts
    deferred = cap_ranges(fused_grad, fused_error, ranges, caps, block_counts=counts)
    ref_grad, ref_error = grad.clone().cpu(), error.clone().cpu()
    reference.prune_with_error_feedback(ref_grad, ref_error, threshold.cpu(), 0.9)
    ref_deferred = cap_ranges_reference(ref_grad, ref_error, ranges, caps)
    _assert_same(fused_grad.cpu(), ref_grad)
    _assert_same(fused_error.cpu(), ref_error)
    assert int(deferred) == int(ref_deferred) > 0
    with pytest.raises(ValueError, match="block boundaries"):
        cap_ranges(fused_grad, fused_error, [(100, 4096)], [1], block_counts=counts)


def test_pruner_caps_ranges():
    pruner = Pruner(PruneConfig(density=0.2, sample_fraction=0.5))
    grad = torch.randn(3 * 4096, device=DEVICE)
    error = pruner.new_error_buffer(grad)
    total = grad.clone()
    result = pruner.prune(grad, error, step=0, caps=([(0, 4096), (4096, 8192)], [10, 100000]))
    assert int((grad[:4096] != 0).sum()) == 10
    assert int(result.deferred) == int(result.kept) - int((grad != 0).sum())
    kept = grad != 0
    torch.testing.assert_close(grad[kept], total[kept])
