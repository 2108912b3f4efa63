"""The DDP comm hook on CPU with gloo: exactness without pruning, error feedback, buckets, training.

Ranks run in spawned process pools (``tests/_pool.py``) with a ``file://`` rendezvous.
"""

import os
import pickle
import random
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _pool import pool_factory
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from spccl_train import reducer as reducer_module
from spccl_train.ddp import ReductionSummary, SparseHookState, sparse_allreduce_hook
from spccl_train.pruning import piece_caps

SEED = int(os.environ.get("SPCCL_TEST_SEED", random.SystemRandom().randrange(2**31)))
os.environ["SPCCL_TEST_SEED"] = str(SEED)


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    yield from pool_factory(tmp_path_factory, f"SPCCL_TEST_SEED={SEED}")


def _model(seed: int) -> nn.Module:
    # Parameters of 136, 2700, 21070 and 213 elements: with a 0.03 MB bucket cap DDP makes buckets
    # of 21283 and 2836 elements, uneven and one smaller than a Pici tile.
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 70), nn.ReLU(), nn.Linear(70, 3)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    return torch.randn(32, 16, generator=g), torch.randn(32, 3, generator=g)


# ----------------------------------------------------------------------------- jobs (run on every rank)


def _backward_steps(model: nn.Module, rank: int, steps: int) -> None:
    for step in range(steps):
        x, y = _batch(rank, step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()


def _assert_mean_of_contributions(reduced: torch.Tensor, contributed: torch.Tensor, world: int) -> None:
    """``reduced`` is the mean over the ranks of what each contributed."""
    everyone = [torch.empty_like(contributed) for _ in range(world)]
    dist.all_gather(everyone, contributed)
    torch.testing.assert_close(reduced, torch.stack(everyone).sum(0) / world, rtol=1e-5, atol=1e-7)


def _bucket_before_hook(state: SparseHookState, bucket: dist.GradBucket):
    """``(index, buffer, v, iteration, sparse)`` as the hook finds the bucket: ``v = g + e``."""
    index, buffer = bucket.index(), bucket.buffer()
    old = state.error_buffers.get(index)
    error = old.clone() if old is not None and old.shape == buffer.shape else torch.zeros_like(buffer)
    return index, buffer, buffer.clone() + error, state.iteration, state.iteration >= state.dense_iterations


def _job_matches_default_ddp(rank: int, world: int, steps: int, overlap: bool | str | None = None) -> int:
    reference = DDP(_model(SEED), bucket_cap_mb=0.03)
    hooked = DDP(_model(SEED), bucket_cap_mb=0.03)
    state = SparseHookState(overlap=overlap, config={"prune": False, "collective": {"format": "pici"}})
    hooked.register_comm_hook(state, sparse_allreduce_hook)
    for step in range(steps):
        x, y = _batch(rank, step)
        for model in (reference, hooked):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        for a, b in zip(reference.parameters(), hooked.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    summary = state.summary()
    assert summary.sparse_reductions > 0 and summary.kept == summary.elements
    return summary.sparse_reductions


def _job_error_feedback(
    rank: int, world: int, steps: int, decay: float, warmup_steps: int = 0, dense_iterations: int = 1
) -> tuple[list[int], dict[int, float]]:
    """Wraps the hook to check every bucket: the error buffer holds exactly what was dropped.

    Returns the sizes of the buckets checked and the density achieved in each sparse iteration.
    """
    model = DDP(_model(SEED), bucket_cap_mb=0.03)
    state = SparseHookState(
        config={
            "pruning": {"density": 0.05, "sample_fraction": 0.2, "decay": decay, "warmup_steps": warmup_steps},
            "dense_iterations": dense_iterations,
            "collective": {"format": "pici"},
        }
    )
    sizes: list[int] = []
    counts: dict[int, list[int]] = {}  # iteration -> [kept, elements]

    def checking_hook(state: SparseHookState, bucket: dist.GradBucket):
        index, buffer, v, iteration, sparse = _bucket_before_hook(state, bucket)
        future = sparse_allreduce_hook(state, bucket)
        if sparse:
            keep = v.abs() >= state.last_prune[index].threshold
            expected = torch.where(keep, torch.zeros_like(v), v * decay)
            assert torch.equal(state.error_buffers[index], expected), f"bucket {index}: error buffer"
            kept = int(state.last_prune[index].kept)
            assert kept == int(keep.sum())
            # What this rank contributed is exactly v where kept: gather everyone's and compare.
            contributed = torch.where(keep, v, torch.zeros_like(v))
            _assert_mean_of_contributions(future.wait(), contributed, world)
            sizes.append(buffer.numel())
            count = counts.setdefault(iteration, [0, 0])
            count[0] += kept
            count[1] += buffer.numel()
        return future

    model.register_comm_hook(state, checking_hook)
    _backward_steps(model, rank, steps)
    return sizes, {iteration: kept / elements for iteration, (kept, elements) in counts.items()}


def _job_train(rank: int, world: int, mode: str, steps: int) -> float:
    """Train a small MLP to imitate a fixed teacher; return the mean loss of the last 25 steps.

    Pruning takes the torch reference here (the Triton kernels, slow in the interpreter, are
    covered by tests/test_pruning.py and the error-feedback test above).
    """
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return _train(rank, mode, steps)
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def _train(rank: int, mode: str, steps: int) -> float:
    torch.manual_seed(1234)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1)))
    if mode != "dense":
        decay = 1.0 if mode == "error_feedback" else 0.0
        state = SparseHookState(
            config={
                "pruning": {"density": 0.01, "sample_fraction": 0.05, "decay": decay, "seed": rank},
                "collective": {"format": "pici"},
            }
        )
        model.register_comm_hook(state, sparse_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(77 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        with torch.no_grad():
            y = teacher(x)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return sum(losses[-25:]) / 25


def _job_capacity(rank: int, world: int, steps: int, factor: float, overlap: bool | str) -> dict:
    """The hook with ``capacity_factor``: after each bucket's first sparse iteration no exchange is
    made, every piece keeps at most its cap, and what the cap deferred waits, undecayed, in the
    error buffer; the all-reduce still sums exactly what the ranks contributed."""
    decay = 0.7
    model = DDP(_model(SEED), bucket_cap_mb=0.03)
    state = SparseHookState(
        overlap=overlap,
        config={
            "pruning": {"density": 0.05, "sample_fraction": 0.2, "decay": decay},
            "capacity_factor": factor,
            "collective": {"format": "auto"},
        },
    )
    exchanges: dict[int, int] = {}  # iteration -> planning exchanges made by its all-reduces

    def checking_hook(state: SparseHookState, bucket: dist.GradBucket):
        index, buffer, v, iteration, sparse = _bucket_before_hook(state, bucket)
        calls_before = state.summary().exchanges
        future = sparse_allreduce_hook(state, bucket)
        if not sparse:
            return future
        reduced = future.wait()  # overlap=True reduces on a background thread
        exchanges[iteration] = exchanges.get(iteration, 0) + state.summary().exchanges - calls_before
        passed = v.abs() >= state.last_prune[index].threshold
        ranges, caps = piece_caps(buffer.numel(), world, 1, 0.05, factor)
        sent = torch.zeros_like(v)
        for (start, numel), cap in zip(ranges, caps):
            piece = torch.where(passed[start : start + numel], v[start : start + numel], torch.zeros(()))
            nonzero = piece != 0
            first = (torch.cumsum(nonzero, 0) - nonzero.to(torch.int64)) < cap
            sent[start : start + numel] = torch.where(nonzero & first, piece, torch.zeros(()))
            assert int((sent[start : start + numel] != 0).sum()) <= cap
        deferred = passed & (sent == 0)
        expected_error = torch.where(passed, torch.where(deferred, v, torch.zeros(())), v * decay)
        assert torch.equal(state.error_buffers[index], expected_error), f"bucket {index}: error buffer"
        _assert_mean_of_contributions(reduced, sent, world)
        return future

    model.register_comm_hook(state, checking_hook)
    _backward_steps(model, rank, steps)
    summary = state.summary()
    return {"exchanges": exchanges, "deferred": summary.deferred, "failures": state.decode_failures()}


# ----------------------------------------------------------------------------- tests


def _job_sends_encoded(rank: int, world: int) -> dict[str, bool]:
    """Which configs prune a bucket whose last reduction ran direct Pici straight to Pici payloads."""
    from spccl_train.formats import Format

    out = {}
    for fmt in ("auto", "pici", "coo"):
        for nodes in ("one node", "across nodes", "one node of world ranks"):
            rpn = {"one node": None, "across nodes": 1, "one node of world ranks": world}[nodes]
            collective = {"format": fmt, "ranks_per_node": rpn}
            state = SparseHookState(config={"pruning": {"density": 0.01}, "collective": collective})
            bucket = state.bucket(0)
            bucket.last_choice = ("direct", Format.PICI)
            out[f"{fmt}, {nodes}"] = state.reducer.sends_encoded(bucket, None, world, False, True)
            bucket.last_choice = ("direct", Format.COO)
            out[f"{fmt}, {nodes}, after COO"] = state.reducer.sends_encoded(bucket, None, world, False, True)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_without_pruning_gradients_equal_default_ddp(pools, world):
    calls = pools(world).run(_job_matches_default_ddp, 4)
    assert min(calls) > 0


@pytest.mark.parametrize("overlap", [True, "stream"])
def test_background_reducer_gives_the_same_gradients(pools, overlap):
    """``overlap=True`` reduces buckets in order on a background thread; ``"stream"`` (a CUDA
    side stream) runs in line on CPU."""
    calls = pools(2).run(_job_matches_default_ddp, 4, overlap)
    assert min(calls) > 0


def test_overlap_must_be_a_known_mode():
    with pytest.raises(ValueError, match="overlap='side'"):
        SparseHookState(overlap="side")


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_holds_exactly_what_was_dropped(pools, world):
    sizes, _ = pools(world).run(_job_error_feedback, 4, 0.7)[0]
    assert len(set(sizes)) >= 2, f"expected buckets of uneven size, got {sorted(set(sizes))}"
    assert min(sizes) < 4096, "expected a bucket smaller than one Pici tile"


def test_density_warm_up_counts_from_the_first_sparse_iteration(pools):
    """With 2 dense iterations and a warm-up of 3, iterations 2..4 keep 0.05 ** (1/4, 2/4, 3/4)
    and iteration 5 on keeps 0.05; the error buffers hold exactly what was dropped throughout."""
    dense_iterations, warmup_steps, density = 2, 3, 0.05
    results = pools(2).run(_job_error_feedback, 7, 0.7, warmup_steps, dense_iterations)
    for _, achieved in results:
        assert sorted(achieved) == list(range(dense_iterations, 7))
        for iteration, got in achieved.items():
            scheduled = density ** min(1.0, (iteration - dense_iterations + 1) / (warmup_steps + 1))
            assert abs(got - scheduled) <= 0.2 * scheduled + 0.01, (
                f"iteration {iteration}: {got:.4f} vs {scheduled:.4f}"
            )
        ramp = [achieved[i] for i in sorted(achieved)]
        assert ramp[0] > 0.35 and ramp[0] > ramp[1] > ramp[2] > ramp[3], ramp


def test_pruned_training_tracks_dense_with_error_feedback(pools):
    """300 steps at 99% sparsity: error feedback ends within 10% of dense; without it, further."""
    pool = pools(2)
    dense = pool.run(_job_train, "dense", 300)[0]
    with_ef = pool.run(_job_train, "error_feedback", 300)[0]
    without_ef = pool.run(_job_train, "no_error_feedback", 300)[0]
    gap_ef = abs(with_ef - dense) / dense
    gap_plain = abs(without_ef - dense) / dense
    print(f"final losses: dense {dense:.4g}, error feedback {with_ef:.4g}, none {without_ef:.4g}")
    assert gap_ef <= 0.10, f"dense {dense:.4g}, with error feedback {with_ef:.4g} ({gap_ef:.1%} apart)"
    assert gap_plain > gap_ef, f"without error feedback {without_ef:.4g} should lag more than {with_ef:.4g}"


@pytest.mark.parametrize(("world", "factor", "overlap"), [(2, 1.0, False), (3, 2.0, True)])
def test_capacity_factor_reduces_without_exchanges(pools, world, factor, overlap):
    results = pools(world).run(_job_capacity, 5, factor, overlap)
    for result in results:
        iterations = sorted(result["exchanges"])
        assert iterations == [1, 2, 3, 4]
        # DDP rebuilds its buckets after iteration 0, so iteration 1 plans with exchanges, then none
        assert result["exchanges"][1] > 0, result
        assert all(result["exchanges"][i] == 0 for i in iterations[1:]), result
        assert result["failures"] == 0
    if factor == 1.0:  # pieces holding more than their share: the cap defers some
        assert sum(r["deferred"] for r in results) > 0


def test_auto_prunes_to_pici_payloads_only_within_one_node(pools):
    # across nodes auto prunes in place whatever the bucket last ran (a Pici payload tilts auto to
    # keep Pici where COO sends half the bytes); within one node it follows the last choice, and a
    # pinned pici always sends payloads
    everyone = pools(2).run(_job_sends_encoded)
    assert all(got == everyone[0] for got in everyone)  # a rank-uniform decision
    got = {key: value for key, value in everyone[0].items() if "world ranks" not in key}
    whole = {key.replace(" of world ranks", ""): value for key, value in everyone[0].items() if "world ranks" in key}
    assert whole == {key: value for key, value in got.items() if "one node" in key}  # ranks_per_node = world
    assert got == {
        "auto, one node": True,
        "auto, one node, after COO": False,
        "auto, across nodes": False,
        "auto, across nodes, after COO": False,
        "pici, one node": True,
        "pici, one node, after COO": True,
        "pici, across nodes": True,
        "pici, across nodes, after COO": True,
        "coo, one node": False,
        "coo, one node, after COO": False,
        "coo, across nodes": False,
        "coo, across nodes, after COO": False,
    }


def test_state_validates_and_pickles_without_its_group():
    with pytest.raises(ValueError, match="dense_iterations"):
        SparseHookState(config={"dense_iterations": 0})
    with pytest.raises(ValueError, match="density"):
        SparseHookState(config={"pruning": {"density": 2.0}})
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        SparseHookState(config={"pruning": {"warmup_steps": -1}})
    with pytest.raises(ValueError, match="capacity_factor=0.5"):
        SparseHookState(config={"capacity_factor": 0.5})
    with pytest.raises(ValueError, match="capacity_factor needs prune=True"):
        SparseHookState(config={"capacity_factor": 2.0, "prune": False})
    state = SparseHookState(process_group=object(), config={"pruning": {"density": 0.02, "warmup_steps": 5}})
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None and copy.pruner.config.density == 0.02
    assert copy.pruner.config.warmup_steps == 5
    assert isinstance(copy.summary(), ReductionSummary)
    assert copy.reducer.scope != state.reducer.scope  # a copy tags its CUDA graphs apart from the original's


_GROUP_FREED = """
import gc, sys, weakref
import torch, torch.distributed as dist
if sys.argv[1] == "hook-module-first":
    import spccl_train.ddp
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
import spccl_train.ddp
group = weakref.ref(dist.group.WORLD)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
state = spccl_train.ddp.SparseHookState(overlap=True, config={"pruning": {"density": 0.1}})  # the background reducer
model.register_comm_hook(state, spccl_train.ddp.sparse_allreduce_hook)
for _ in range(3):  # a dense first iteration, then sparse ones on the reducer thread
    model(torch.randn(2, 64)).sum().backward()
del model, state
dist.destroy_process_group()
gc.collect()
print("alive" if group() is not None else "freed")
"""


def test_destroy_frees_the_group_when_the_hook_module_came_first(tmp_path):
    """Nothing keeps the group alive past destroy_process_group, or gloo's threads run into
    interpreter shutdown, where a rank can abort.

    DDP imports torch.distributed.nn.functional, whose default arguments bind the default group
    if it exists by then: importing spccl_train.ddp first prevents that (the run that imports it
    after init shows the leak). The background reducer lets go of its last bucket's closure and
    stops with its hook state.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}

    def run(imports: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _GROUP_FREED, imports, str(tmp_path / imports)],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        # The other run may abort at shutdown (the hazard itself): only its verdict counts.
        assert done.returncode == 0 or imports == "hook-module-after-init", done.stderr
        return done.stdout.split()[-1] if done.stdout.split() else done.stderr

    if run("hook-module-after-init") == "freed":
        pytest.skip("this torch frees the group even when DDP binds it after init")
    assert run("hook-module-first") == "freed"


def test_the_backward_pass_waits_for_pruning_in_line_and_when_a_side_stream_plans_from_counts():
    def waits(overlap, capacity_factor, on_cuda):
        state = SparseHookState(
            overlap=overlap, config={"pruning": {"density": 0.01}, "capacity_factor": capacity_factor}
        )
        return state.waits_for_pruning(on_cuda)

    assert waits(False, None, True) and waits(False, 4.0, False)  # in line
    assert waits("stream", None, False)  # no side stream on CPU: in line
    assert waits("stream", None, True)  # the planning exchange waits on the host for the side stream's pruning
    assert not waits("stream", 4.0, True)  # from bounds: nothing waits for the side stream
    assert not waits(True, None, True) and not waits(None, None, True)  # a background thread waits instead


class _FinishedCall:
    """A finished call's stats as the reducer reads them: its time and its decoders' verdict."""

    def __init__(self, seconds: float, failed: bool | None) -> None:
        self.elapsed_s = seconds
        self.decode_failed = None if failed is None else torch.tensor(failed)


def test_reducer_folds_old_timers_into_its_totals_without_losing_any(monkeypatch):
    # past PENDING_TIMERS pending calls the older half is folded into the totals (in the hot path,
    # without a synchronisation); the totals read then must equal those of keeping everything
    monkeypatch.setattr(reducer_module, "PENDING_TIMERS", 4)
    state = SparseHookState(config={"pruning": {"density": 0.5}})
    red = state.reducer
    calls = [_FinishedCall(0.5 * (i + 1), failed) for i, failed in enumerate([False, True, None, True, False, False])]
    for call in calls:
        red._stats.append(call)
        if len(red._stats) > reducer_module.PENDING_TIMERS:
            red._fold(keep=reducer_module.PENDING_TIMERS // 2)
    assert len(red._stats) < len(calls)  # some were folded
    totals = red.summary()
    assert totals.reduce_seconds == pytest.approx(sum(c.elapsed_s for c in calls))
    assert totals.decode_failures == 2 == state.decode_failures()
    assert state.summary().reduce_seconds == pytest.approx(totals.reduce_seconds)
    state.reset_stats()
    assert state.reducer.summary().decode_failures == 0 and state.summary().reduce_seconds == 0.0


def test_one_config_serves_both_engines():
    """``SparseConfig``: nested sections from mappings, clear errors, the engines' dense warm-up."""
    import spccl_train
    import spccl_train.megatron as spccl_megatron

    config = spccl_train.SparseConfig(pruning={"density": 0.02}, collective={"format": "coo"}, capacity_factor=2)
    assert config.pruning.density == 0.02 and config.collective.format == "coo" and config.capacity_factor == 2.0
    assert spccl_megatron.SpcclMegatronConfig is spccl_train.SparseConfig
    assert SparseHookState(config=config).dense_iterations == 1  # None: DDP's least
    assert spccl_megatron.SpcclMegatronState(config).dense_iterations == 0  # None: Megatron's
    with pytest.raises(TypeError, match="prune_to_wire='yes' must be True or False"):
        spccl_train.SparseConfig(prune_to_wire="yes")
    with pytest.raises(TypeError, match="config must be a SparseConfig, a mapping of its fields or None"):
        SparseHookState(config=0.01)
    with pytest.raises(TypeError, match="unexpected keyword argument 'density'"):
        SparseHookState(density=0.01)  # the flat keywords are gone: config=SparseConfig(pruning={...})
