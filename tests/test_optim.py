"""BurstAdamW against torch's AdamW and against AdamW run step by step on the waiting gradients."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spccl_train.optim import BurstAdamW
from spccl_train.train.config import ConfigError, ExperimentConfig
from spccl_train.train.trainer import make_optimizer


def _pair(shape, **kwargs):
    p = torch.randn(shape, dtype=torch.float64)
    q = p.clone()
    p.requires_grad_(True)
    q.requires_grad_(True)
    return p, q, BurstAdamW([p], **kwargs), torch.optim.AdamW([q], **kwargs)


@settings(deadline=None, max_examples=20)
@given(
    st.integers(1, 300),
    st.floats(0.0, 0.2),
    st.sampled_from([(0.9, 0.95), (0.9, 0.999), (0.0, 0.99)]),
    st.integers(1, 6),
)
def test_equals_adamw_when_every_gradient_arrives(n, weight_decay, betas, steps):
    kwargs = {"lr": 1e-2, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay}
    p, q, burst, adamw = _pair((n,), **kwargs)
    for _ in range(steps):
        g = torch.randn(n, dtype=torch.float64)
        g[g == 0] = 1.0  # every coordinate arrives
        p.grad, q.grad = g.clone(), g.clone()
        burst.step()
        adamw.step()
    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert not burst.state[p]["age"].any()


def test_moments_after_a_burst_equal_adamw_on_the_steps_it_held():
    """A coordinate that waits a steps of a constant gradient g and then arrives as a * g ends with
    exactly the moments AdamW has after those a steps, and the others keep theirs."""
    a, g = 7, 0.3
    p, q, burst, adamw = _pair((2,), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    warm = torch.tensor([0.5, -0.2], dtype=torch.float64)
    p.grad, q.grad = warm.clone(), warm.clone()
    burst.step()
    adamw.step()
    for i in range(a):
        p.grad = torch.tensor([a * g if i == a - 1 else 0.0, 0.0], dtype=torch.float64)
        burst.step()
        q.grad = torch.tensor([g, 0.0], dtype=torch.float64)
        adamw.step()
    sb, sa = burst.state[p], adamw.state[q]
    assert math.isclose(sb["exp_avg"][0], sa["exp_avg"][0], rel_tol=1e-12)
    assert math.isclose(sb["exp_avg_sq"][0], sa["exp_avg_sq"][0], rel_tol=1e-12)
    assert sb["age"].tolist() == [0, a]
    # The coordinate that received nothing kept its moments and its value (no weight decay).
    assert sb["exp_avg"][1] == pytest.approx(0.1 * -0.2, rel=1e-12)
    assert sb["exp_avg_sq"][1] == pytest.approx(0.05 * 0.04, rel=1e-12)


def test_a_burst_moves_as_far_as_the_steps_it_held_in_steady_state():
    """With moments settled on a constant gradient, AdamW moves lr per step; the burst a * lr."""
    a, g, lr = 20, 0.3, 1e-3
    p, q, burst, adamw = _pair((1,), lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    for _ in range(400):  # settle both on g (bias corrections reach 1)
        p.grad, q.grad = torch.full((1,), g, dtype=torch.float64), torch.full((1,), g, dtype=torch.float64)
        burst.step()
        adamw.step()
    start_p, start_q = p.detach().clone(), q.detach().clone()
    for i in range(a):
        p.grad = torch.full((1,), a * g if i == a - 1 else 0.0, dtype=torch.float64)
        burst.step()
        q.grad = torch.full((1,), g, dtype=torch.float64)
        adamw.step()
    moved_burst, moved_adamw = float(start_p - p.detach()), float(start_q - q.detach())
    assert moved_adamw == pytest.approx(a * lr, rel=1e-6)
    assert moved_burst == pytest.approx(moved_adamw, rel=1e-6)
    # AdamW fed the same burst as one step's gradient moves it about one step, not a.
    r = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    plain = torch.optim.AdamW([r], lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    for _ in range(400):
        r.grad = torch.full((1,), g, dtype=torch.float64)
        plain.step()
    start_r = r.detach().clone()
    for i in range(a):
        r.grad = torch.full((1,), a * g if i == a - 1 else 0.0, dtype=torch.float64)
        plain.step()
    assert float(start_r - r.detach()) < 0.5 * moved_burst


def test_weight_decay_applies_to_coordinates_that_wait():
    p = torch.ones(3, dtype=torch.float64, requires_grad=True)
    opt = BurstAdamW([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(3, dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.95, dtype=torch.float64))
    assert opt.state[p]["age"].tolist() == [1, 1, 1]


def test_age_saturates_and_max_age_caps_the_burst():
    p = torch.zeros(1, requires_grad=True)
    opt = BurstAdamW([p], lr=1.0, betas=(0.0, 0.0), eps=1e-30, weight_decay=0.0, max_age=4)
    for _ in range(300):
        p.grad = torch.zeros(1)
        opt.step()
    assert opt.state[p]["age"].item() == 255
    p.grad = torch.ones(1)
    opt.step()
    # beta 0: m = g / a, v = (g / a)^2, so the step is a * sign = max_age.
    assert p.item() == pytest.approx(-4.0)


def test_max_burst_moves_a_long_burst_over_the_next_steps():
    """Settled on a constant gradient, a burst of 20 steps with max_burst 8 moves 8, 8 and 4 steps'
    worth on the arrival and the two steps after it, then nothing: as far as the burst moved at once."""
    a, g, lr = 20, 0.3, 1e-3
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-12, "weight_decay": 0.0}
    p, q = (
        torch.zeros(1, dtype=torch.float64, requires_grad=True),
        torch.zeros(1, dtype=torch.float64, requires_grad=True),
    )
    paced, at_once = BurstAdamW([p], max_burst=8, **kwargs), BurstAdamW([q], **kwargs)
    for _ in range(400):  # settle both on g (bias corrections reach 1)
        for t, opt in ((p, paced), (q, at_once)):
            t.grad = torch.full((1,), g, dtype=torch.float64)
            opt.step()
    assert not paced.state[p]["owed"].any()
    start = float(p.detach())
    moved = []
    for i in range(a + 4):
        grad = torch.full((1,), a * g if i == a - 1 else 0.0, dtype=torch.float64)
        p.grad, q.grad = grad.clone(), grad.clone()
        paced.step()
        at_once.step()
        moved.append(start - float(p.detach()))
        start = float(p.detach())
    assert moved[: a - 1] == [0.0] * (a - 1)
    assert moved[a - 1 :] == pytest.approx([8 * lr, 8 * lr, 4 * lr, 0.0, 0.0], rel=1e-6, abs=1e-15)
    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert paced.state[p]["owed"].item() == 0 and paced.state[p]["age"].item() == 4


def test_max_burst_leaves_shorter_bursts_as_they_were():
    """Bursts no longer than max_burst move at once: the same parameters, bit for bit."""
    torch.manual_seed(0)
    p = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    q = p.detach().clone().requires_grad_(True)
    paced, at_once = BurstAdamW([p], lr=1e-2, max_age=5, max_burst=5), BurstAdamW([q], lr=1e-2, max_age=5)
    for _ in range(12):
        g = torch.randn(1000, dtype=torch.float64) * (torch.rand(1000) < 0.3)
        p.grad, q.grad = g.clone(), g.clone()
        paced.step()
        at_once.step()
    assert torch.equal(p, q) and not paced.state[p]["owed"].any()


def test_state_round_trips_with_its_counters_and_an_older_checkpoint_takes_the_defaults():
    """load_state_dict casts state to the parameter's dtype: the counters come back as uint8 and
    the steps after a reload equal the steps without one; a checkpoint saved before max_burst
    existed takes the optimizer's own."""
    torch.manual_seed(1)
    p = torch.randn(500, requires_grad=True)
    opt = BurstAdamW([p], lr=1e-2, max_burst=2)
    grads = [torch.randn(500) * (torch.rand(500) < 0.2) for _ in range(10)]
    for g in grads[:5]:
        p.grad = g.clone()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    q = p.detach().clone().requires_grad_(True)
    again = BurstAdamW([q], lr=1e-2, max_burst=2)
    again.load_state_dict(saved)
    for g in grads[5:]:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        again.step()
    assert torch.equal(p, q)
    assert again.state[q]["age"].dtype == again.state[q]["owed"].dtype == torch.uint8
    del saved["param_groups"][0]["max_burst"]
    older = BurstAdamW([q], lr=1e-2, max_burst=4)
    older.load_state_dict(saved)
    q.grad = grads[0].clone()
    older.step()
    assert older.param_groups[0]["max_burst"] == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr=-1.0"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": 0.0}, "eps=0.0"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
        ({"max_age": 0}, "max_age=0"),
        ({"max_age": 256}, "max_age=256"),
        ({"max_burst": 0}, "max_burst=0"),
        ({"max_burst": 300}, "max_burst=300"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BurstAdamW([torch.zeros(1, requires_grad=True)], **kwargs)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_experiment_config_picks_the_optimizer():
    params = [torch.zeros(2, device=DEVICE, requires_grad=True)]  # the optimizer picks fused by the params' device
    cfg = ExperimentConfig()
    adamw = make_optimizer(iter(params), cfg.optim)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["params"] == params
    # fused on GPUs (the fastest dense baseline), foreach on CPU; groups keep their own keys
    impl = "fused" if DEVICE == "cuda" else "foreach"
    assert adamw.defaults[impl] is True
    groups = make_optimizer([{"params": iter([torch.zeros(1, device=DEVICE)]), "weight_decay": 0.0}], cfg.optim)
    assert groups.defaults[impl] is True and groups.param_groups[0]["weight_decay"] == 0.0
    cfg.optim.name, cfg.optim.max_age = "burst_adamw", 10
    opt = make_optimizer(params, cfg.optim)
    assert isinstance(opt, BurstAdamW) and opt.param_groups[0]["max_age"] == 10
    cfg.optim.max_age, cfg.optim.max_burst = 0, 16
    assert make_optimizer(params, cfg.optim).param_groups[0]["max_burst"] == 16
    cfg.optim.name = "adamw"
    with pytest.raises(ConfigError, match="optim.max_burst=16 applies to optim.name=burst_adamw"):
        cfg.validate()
    cfg.optim.max_age, cfg.optim.max_burst = 10, 0
    with pytest.raises(ConfigError, match="optim.max_age=10 applies to optim.name=burst_adamw"):
        cfg.validate()


@settings(deadline=None, max_examples=10)
@given(
    st.integers(1, 5000),
    st.floats(0.0, 0.9),
    st.sampled_from([None, 3]),
    st.sampled_from([None, 2]),
    st.sampled_from([0.0, 0.9]),
)
def test_fused_step_matches_the_torch_ops(n, drop, max_age, max_burst, beta1):
    """The Triton pass (CUDA, or the interpreter on CPU) against the torch ops, fp32, random arrivals."""
    params = [torch.randn(n, device=DEVICE, requires_grad=True) for _ in range(2)]
    kwargs = {"lr": 1e-2, "betas": (beta1, 0.95), "weight_decay": 0.1, "max_age": max_age, "max_burst": max_burst}
    fused, plain = BurstAdamW([params[0]], **kwargs), BurstAdamW([params[1]], **kwargs)
    with torch.no_grad():
        params[1].copy_(params[0])
    for _ in range(6):
        g = torch.randn(n, device=DEVICE) * (torch.rand(n, device=DEVICE) >= drop)
        params[0].grad, params[1].grad = g.clone(), g.clone()
        fused.step()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("spccl_train.optim._fused", lambda *tensors: False)
            plain.step()
    torch.testing.assert_close(params[0], params[1], rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq", "age", "owed")[: 3 if max_burst is None else 4]:
        # lerp's two formulas (torch switches at weight 0.5) round differently in fp32
        torch.testing.assert_close(fused.state[params[0]][key], plain.state[params[1]][key], rtol=1e-4, atol=1e-6)
    from spccl_train.optim import _fused

    assert _fused(params[0], params[0].grad, *[fused.state[params[0]][k] for k in ("exp_avg", "exp_avg_sq", "age")])
