"""The Megatron-core integration on CPU with gloo: equal to Megatron's own reduction, error feedback.

Ranks run in spawned process pools (``tests/_pool.py``) with a ``file://`` rendezvous; Megatron's
CUDA device and stream queries are pointed at the CPU by ``tests/_megatron_shims.py``. Tests that
need megatron-core skip without it; the import and version checks run everywhere.
"""

import os
import random
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
from _megatron_shims import ensure_model_parallel, megatron_on_cpu
from _pool import pool_factory
from torch import nn

import spccl_train.megatron as spccl_megatron
from spccl_train.pruning import PruneConfig, Pruner, cap_ranges_reference, piece_caps, reference

SEED = int(os.environ.get("SPCCL_TEST_SEED", random.SystemRandom().randrange(2**31)))
os.environ["SPCCL_TEST_SEED"] = str(SEED)

# Embedding rows that no rank's batch touches get zero gradients, so that bucket is sparse
# without pruning and the exact comparisons run through the Pici codec, not only dense messages.
VOCAB, WIDTH, HIDDEN = 512, 16, 64
BUCKET_SIZE = 1000  # with overlap: one bucket for the MLP (1348 elements), one for the embedding (8192)


@pytest.fixture(scope="module")
def megatron():
    return pytest.importorskip("megatron.core.distributed", reason="megatron-core is not installed")


@pytest.fixture(scope="module")
def pools(megatron, tmp_path_factory):
    yield from pool_factory(tmp_path_factory, f"SPCCL_TEST_SEED={SEED}")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens).mean(1).to(self.mlp[0].weight.dtype))


def _wrapped(
    overlap: bool,
    distopt: bool,
    average_in_collective: bool = False,
    dtype: torch.dtype = torch.float32,
    embed_dtype: torch.dtype | None = None,
):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(SEED)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=distopt,
        average_in_collective=average_in_collective,
        bucket_size=BUCKET_SIZE,
    )
    config = TransformerConfig(num_layers=1, hidden_size=WIDTH, num_attention_heads=1)
    model = _Model().to(dtype)
    model.embed.to(embed_dtype or dtype)  # another dtype: Megatron gives it a buffer, so a bucket, of its own
    return DistributedDataParallel(config, ddp_config, model)


def _backward(model, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (8, 4), generator=g)
    target = torch.randn(8, 4, generator=g)
    model.zero_grad_buffer()
    nn.functional.mse_loss(model(tokens).float(), target).backward()


def _buckets(model) -> list:
    return [bucket for group in model.bucket_groups for bucket in group.buckets]


def _reduced_part(bucket, model, rank: int, world: int) -> torch.Tensor:
    """What the reduction defines: the whole bucket, or this rank's shard with the distributed optimizer."""
    if not model.ddp_config.use_distributed_optimizer:
        return bucket.grad_data
    return bucket.grad_data.view(world, -1)[rank]


def _before_reduction(model, state) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each bucket's gradient as it will be reduced (Megatron scales it by 1 / world in place
    first) and a copy of its error buffer (zeros before the first pruning: fp32, the default)."""
    before = []
    for bucket in _buckets(model):
        bucket_state = state.bucket_state(bucket)
        has_error = bucket_state is not None and bucket_state.error is not None
        error = bucket_state.error.clone() if has_error else torch.zeros(bucket.grad_data.shape)
        before.append((bucket.grad_data * bucket.gradient_scaling_factor, error))
    return before


def _assert_sum_of_sent(bucket, model, sent: torch.Tensor, rank: int, world: int) -> None:
    """The reduced bucket (or this rank's shard of it) is the sum of what every rank sent."""
    everyone = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(everyone, sent)
    expected = torch.stack(everyone).sum(0)
    if model.ddp_config.use_distributed_optimizer:
        expected = expected.view(world, -1)[rank]
    torch.testing.assert_close(_reduced_part(bucket, model, rank, world), expected)


# ----------------------------------------------------------------------------- jobs (run on every rank)


def _job_matches_megatron(
    rank, world, overlap, distopt, steps, average_in_collective=False, dense_iterations=0, dtype=None
):
    """Megatron's own reduction for some steps, then the same steps through SpCCL without pruning: equal."""
    with megatron_on_cpu():
        ensure_model_parallel()
        spccl_megatron.disable()
        dtype = dtype or torch.float32
        theirs = _wrapped(overlap, distopt, dtype=dtype)
        expected = []
        for step in range(steps):
            _backward(theirs, rank, step)
            theirs.finish_grad_sync()
            expected.append([_reduced_part(b, theirs, rank, world).clone() for b in _buckets(theirs)])
        model = _wrapped(overlap, distopt, average_in_collective, dtype)
        state = spccl_megatron.enable(prune=False, collective={"format": "pici"}, dense_iterations=dense_iterations)
        try:
            for step in range(steps):
                before = state.summary().sparse_reductions
                _backward(model, rank, step)
                if overlap and step > 0:  # after the first batch the hooks dispatch during backward
                    assert all(group.grad_reduce_handle is not None for group in model.bucket_groups)
                    assert state.summary().sparse_reductions > before or step < dense_iterations
                model.finish_grad_sync()
                assert all(group.grad_reduce_handle is None for group in model.bucket_groups)
                for bucket, reduced in zip(_buckets(model), expected[step], strict=True):
                    torch.testing.assert_close(_reduced_part(bucket, model, rank, world), reduced)
            if not distopt:
                for ours, their in zip(model.module.parameters(), theirs.module.parameters(), strict=True):
                    torch.testing.assert_close(ours.main_grad, their.main_grad)
        finally:
            spccl_megatron.disable()
    summary = state.summary()
    buckets = len(_buckets(model))
    assert summary.dense_reductions == dense_iterations * buckets
    assert summary.sparse_reductions == (steps - dense_iterations) * buckets
    assert summary.kept == summary.elements
    return buckets, summary.bytes_sent, summary.dense_bytes


def _job_error_feedback(rank, world, distopt, decay, steps, warmup_steps=0, dense_iterations=0):
    """Every bucket's error buffer holds exactly the decayed values pruning dropped, and the sum is theirs.

    With a density warm-up, each threshold is the one a pruner without warm-up finds at the
    density scheduled for the step, counted from the first sparse reduction.
    """
    with megatron_on_cpu():
        ensure_model_parallel()
        # Without overlap Megatron makes one bucket per buffer: the bf16 embedding gets its own.
        model = _wrapped(overlap=False, distopt=distopt, embed_dtype=torch.bfloat16)
        pruning = {"density": 0.05, "sample_fraction": 0.2, "decay": decay, "warmup_steps": warmup_steps}
        state = spccl_megatron.enable(pruning=pruning, dense_iterations=dense_iterations)
        checked = []
        try:
            for step in range(steps):
                _backward(model, rank, step)
                before = _before_reduction(model, state)
                model.finish_grad_sync()
                if step < dense_iterations:
                    assert all(state.bucket_state(bucket).last_prune is None for bucket in _buckets(model))
                    continue
                scheduled = state.pruner.config.density_at(step - dense_iterations)
                plain = Pruner(PruneConfig(density=scheduled, sample_fraction=0.2, decay=decay))
                for bucket, (grad, error) in zip(_buckets(model), before, strict=True):
                    bucket_state = state.bucket_state(bucket)
                    threshold = bucket_state.last_prune.threshold
                    again = plain.prune(grad.clone(), error.clone(), step=step, buffer=bucket_state.index)
                    assert torch.equal(threshold, again.threshold), f"step {step}: threshold of density {scheduled}"
                    kept = reference.prune_with_error_feedback(grad, error, threshold, decay)
                    assert torch.equal(bucket_state.error, error), f"step {step}: error buffer"
                    assert int(bucket_state.last_prune.kept) == int(kept)
                    _assert_sum_of_sent(bucket, model, grad, rank, world)
                    checked.append(str(grad.dtype))
        finally:
            spccl_megatron.disable()
    summary = state.summary()
    assert 0 < summary.kept < summary.elements
    return checked


def _job_capacity(rank, world, distopt, factor, steps):
    """``capacity_factor``: after each bucket's first sparse reduction no exchange is made, every
    piece keeps at most its cap, the excess waits undecayed in the error buffer, and the
    reduction sums exactly what the ranks sent."""
    decay, density = 0.7, 0.05
    with megatron_on_cpu():
        ensure_model_parallel()
        model = _wrapped(overlap=False, distopt=distopt, embed_dtype=torch.bfloat16)
        pruning = {"density": density, "sample_fraction": 0.2, "decay": decay}
        state = spccl_megatron.enable(pruning=pruning, capacity_factor=factor)
        exchanges = []
        try:
            for step in range(steps):
                _backward(model, rank, step)
                before = _before_reduction(model, state)
                made = state.summary().exchanges
                model.finish_grad_sync()
                exchanges.append(state.summary().exchanges - made)
                collective = "reduce_scatter" if distopt else "all_reduce"
                for bucket, (grad, error) in zip(_buckets(model), before, strict=True):
                    bucket_state = state.bucket_state(bucket)
                    reference.prune_with_error_feedback(grad, error, bucket_state.last_prune.threshold, decay)
                    ranges, caps = piece_caps(grad.numel(), world, 1, density, factor, collective)
                    cap_ranges_reference(grad, error, ranges, caps)  # grad: what was sent
                    for (start, numel), cap in zip(ranges, caps):
                        assert int((grad[start : start + numel] != 0).sum()) <= cap
                    assert torch.equal(bucket_state.error, error), f"step {step}: error buffer"
                    _assert_sum_of_sent(bucket, model, grad, rank, world)
        finally:
            spccl_megatron.disable()
    return exchanges, len(_buckets(model)), state.summary().deferred


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("distopt", [False, True], ids=["allreduce", "distopt"])
def test_capacity_factor_plans_from_bounds_after_the_first_reduction(pools, distopt):
    for exchanges, buckets, deferred in pools(2).run(_job_capacity, distopt, 1.0, 4):
        assert exchanges == [buckets, 0, 0, 0]
        assert deferred > 0, "with caps at the density itself some piece must defer"


@pytest.mark.parametrize(
    "world, overlap, distopt",
    [(2, False, False), (2, True, False), (2, False, True), (2, True, True), (4, True, True)],
    ids=["w2-allreduce", "w2-allreduce-overlap", "w2-distopt", "w2-distopt-overlap", "w4-distopt-overlap"],
)
def test_without_pruning_gradients_equal_megatrons_own(pools, world, overlap, distopt):
    results = pools(world).run(_job_matches_megatron, overlap, distopt, 3)
    assert results[0][0] == (2 if overlap else 1), "buckets"
    assert sum(r[1] for r in results) < sum(r[2] for r in results), "the sparse embedding bucket should save bytes"


def test_average_in_collective_and_dense_warm_up_equal_megatrons_own(pools):
    pools(2).run(_job_matches_megatron, True, True, 3, True, 1)


def test_bfloat16_gradients_equal_megatrons_own(pools):
    pools(2).run(_job_matches_megatron, True, False, 2, False, 0, torch.bfloat16)


@pytest.mark.parametrize("distopt", [False, True], ids=["allreduce", "distopt"])
def test_error_feedback_holds_exactly_what_was_dropped(pools, distopt):
    checked = pools(2).run(_job_error_feedback, distopt, 0.7, 3)[0]
    assert sorted(set(checked)) == ["torch.bfloat16", "torch.float32"] and len(checked) == 6


def test_density_warm_up_counts_from_the_first_sparse_reduction(pools):
    """One dense reduction, then a warm-up of 2: steps 1, 2 prune to 0.05 ** (1/3, 2/3), step 3 on to 0.05."""
    for checked in pools(2).run(_job_error_feedback, False, 0.7, 5, 2, 1):
        assert len(checked) == 8  # 2 buckets x 4 sparse steps


def test_enable_is_idempotent_and_disable_restores(megatron):
    group_class = megatron.param_and_grad_buffer._ParamAndGradBucketGroup
    original = group_class.start_grad_sync
    try:
        state = spccl_megatron.enable(prune=False)
        patched = group_class.start_grad_sync
        assert patched is not original and patched.__wrapped__ is original
        assert spccl_megatron.enable() is state and spccl_megatron.enable(prune=False) is state
        assert group_class.start_grad_sync is patched, "a second enable() must not wrap again"
        assert spccl_megatron.active_state() is state and spccl_megatron.is_enabled()
        replaced = spccl_megatron.enable(prune=True)
        assert replaced is not state and replaced.config.prune
        unsupported = types.SimpleNamespace(ddp_config=types.SimpleNamespace(num_distributed_optimizer_instances=2))
        with pytest.raises(ValueError, match="num_distributed_optimizer_instances"):
            group_class.start_grad_sync(unsupported)
    finally:
        assert spccl_megatron.disable() is not None
    assert group_class.start_grad_sync is original and not spccl_megatron.is_enabled()
    assert spccl_megatron.disable() is None


def test_config_validates_and_takes_mappings():
    config = spccl_megatron.SpcclMegatronConfig(pruning={"density": 0.02}, collective={"format": "coo"})
    assert config.pruning.density == 0.02 and config.collective.format == "coo"
    with pytest.raises(ValueError, match="dense_iterations"):
        spccl_megatron.SpcclMegatronConfig(dense_iterations=-1)
    with pytest.raises(ValueError, match="density"):
        spccl_megatron.SpcclMegatronConfig(pruning={"density": 2.0})
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        spccl_megatron.SpcclMegatronConfig(pruning={"warmup_steps": -1})
    assert spccl_megatron.SpcclMegatronConfig(pruning={"warmup_steps": 7}).pruning.warmup_steps == 7
    with pytest.raises(TypeError, match="not both"):
        spccl_megatron.enable(spccl_megatron.SpcclMegatronConfig(), prune=False)
    assert spccl_megatron.SpcclMegatronConfig(capacity_factor=3).capacity_factor == 3.0
    with pytest.raises(ValueError, match="capacity_factor=0.5 must be a number >= 1"):
        spccl_megatron.SpcclMegatronConfig(capacity_factor=0.5)
    with pytest.raises(ValueError, match="capacity_factor needs prune=True"):
        spccl_megatron.SpcclMegatronConfig(capacity_factor=2, prune=False)


def test_pretrain_passes_the_density_warm_up_and_the_bounds(monkeypatch):
    from spccl_train.megatron import pretrain
    from spccl_train.train.config import load_config

    monkeypatch.setattr(pretrain.dist, "get_world_size", lambda group=None: 2)
    overrides = [
        "spccl.pruning.warmup_steps=4",
        "spccl.dense_iterations=2",
        "spccl.capacity_factor=3",
        "spccl.collective.cuda_graphs=true",
    ]
    config = pretrain.sparse_config(load_config("tiny_cpu", overrides), local_world=2)
    assert config.pruning.warmup_steps == 4 and config.dense_iterations == 2
    assert config.capacity_factor == 3.0 and config.collective.cuda_graphs
    assert pretrain.sparse_config(load_config("tiny_cpu"), local_world=2).capacity_factor is None


@pytest.mark.parametrize("version", ["0.16.1", "0.17.0", "0.19.2", "0.19.0rc1"])
def test_supported_versions_pass(version):
    spccl_megatron.check_version(version)


@pytest.mark.parametrize("version", ["0.15.3", "0.20.0", "1.0.0", "unknown"])
def test_unsupported_versions_say_which_to_install(version):
    with pytest.raises(RuntimeError, match=r"supports megatron-core 0\.16 to 0\.19.*pip install"):
        spccl_megatron.check_version(version)


def test_imports_without_megatron_and_enable_says_how_to_install():
    # A fresh interpreter in which every megatron import fails, installed or not.
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "import spccl_train.megatron as m\n"
        "try:\n    m.enable()\nexcept ImportError as e:\n    print(e)\n"
        "assert m.disable() is None\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install" in out and "megatron-core" in out


def test_pretrain_says_that_the_hooks_overlap_modes_do_not_apply(monkeypatch):
    from spccl_train.megatron import pretrain
    from spccl_train.train.config import load_config

    monkeypatch.delenv("RANK", raising=False)
    cfg = load_config("tiny_cpu", ["optim.name=adamw", "spccl.enabled=true", "spccl.overlap=stream"])
    with pytest.warns(UserWarning, match="spccl.overlap='stream' applies to the DDP engine only"):
        with pytest.raises(KeyError, match="RANK"):  # stops where the process group would be made
            pretrain.run_worker(cfg, "tiny_cpu")
