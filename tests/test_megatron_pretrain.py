"""The Megatron-core GPT entry point on CPU: 2 gloo ranks, dense vs SpCCL, the run folder it writes.

Most runs go through :func:`spccl_train.megatron.pretrain.launch`, which spawns the ranks (the
same path as ``python -m spccl_train.megatron.pretrain``); on CPU it points Megatron's CUDA device
and stream queries at the CPU itself and uses its CPU optimizer stand-in. The GPU path's optimizer
(``get_megatron_optimizer``: fp32, bf16 mixed precision, distributed) runs in a gloo pool under
``tests/_megatron_shims.py``, which lets it make its ``device='cuda'`` buffers on the CPU.
"""

import contextlib
import csv
import json
import math
import os
import pathlib

import pytest
import torch
import yaml
from _megatron_shims import megatron_on_cpu, megatron_optimizer_on_cpu
from _pool import pool_factory

from spccl_train.train import config as C

pytest.importorskip("megatron.core.distributed", reason="megatron-core is not installed")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

from spccl_train.megatron import pretrain

ITERATIONS = 4


def _overrides(tmp_path: pathlib.Path, name: str) -> list[str]:
    return [
        "model.n_layer=1",
        "model.hidden=32",
        "model.n_head=2",
        "model.vocab_size=512",
        "model.max_position=32",
        "data.seq_len=32",
        "data.tokenizer_vocab_size=512",
        "data.embedded_bytes=60000",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"train.iterations={ITERATIONS}",
        "train.warmup_iterations=1",
        "train.micro_batch_size=2",
        "optim.lr_warmup_iterations=1",
        # The Megatron engine steps with Megatron's Adam (the default's BurstAdamW is the DDP
        # engine's), and these few iterations leave no room for the default's density warm-up.
        "optim.name=adamw",
        "spccl.pruning.warmup_steps=0",
        "dist.nproc_per_node=2",
        f"output.dir={tmp_path / 'runs'}",
        f"output.name={name}",
        "output.progress=false",
        "output.plot=false",
    ]


def _tiny(tmp_path: pathlib.Path, name: str, *extra: str) -> C.ExperimentConfig:
    return C.load_config("tiny_cpu", [*_overrides(tmp_path, name), *extra])


def _rows(run_dir: pathlib.Path) -> list[dict]:
    lines = (run_dir / "iterations.csv").read_text().splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","), strict=True)) for line in lines[1:]]
    return [{k: v if k == "choices" else float(v) for k, v in row.items()} for row in rows]


def _summary(run_dir: pathlib.Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    yield from pool_factory(tmp_path_factory, "test_megatron_pretrain")


# (use Megatron's optimizer, bf16, distributed optimizer, config overrides) by run name
RUNS = {
    "dense": (False, False, False, ["spccl.enabled=false"]),
    # Pruning off: SpCCL sums exactly what Megatron's all-reduce sums, and with 2 ranks a + b
    # rounds the same in any order.
    "exact": (False, False, False, ["spccl.prune=false", "spccl.collective.format=pici"]),
    "megatron-adam": (True, False, False, ["spccl.enabled=false"]),
    "distopt": (True, False, True, ["spccl.enabled=false"]),
    "bf16-distopt-spccl": (
        True,
        True,
        True,
        ["spccl.collective.format=coo", "spccl.pruning.sample_fraction=0.05", "output.calls=true"],
    ),
}


def _job_train(rank, world, tmp, names):
    """Train the named runs on this pool rank: the loop of run_worker, under the test shims.

    Runs with Megatron's optimizer take the CUDA branch of ``pretrain._optimizer``
    (``get_megatron_optimizer``) inside :func:`megatron_optimizer_on_cpu`.
    """
    out = {}
    device = torch.device("cpu")
    real_optimizer, real_precision = pretrain._optimizer, pretrain._precision
    try:
        for name in names:
            megatron_optimizer, bf16, distopt, extra = RUNS[name]
            pretrain._precision = lambda c, d, bf16=bf16: "bf16" if bf16 else "fp32"
            shim = megatron_optimizer_on_cpu() if megatron_optimizer else contextlib.nullcontext()
            if megatron_optimizer:
                pretrain._optimizer = lambda c, m, d, b, o: real_optimizer(c, m, torch.device("cuda"), b, o)
            with megatron_on_cpu(), shim:
                run_dir = pretrain._train(_tiny(tmp, name, *extra), "tiny_cpu", rank, world, world, device, distopt)
            pretrain._optimizer = real_optimizer
            out[name] = run_dir and (_rows(run_dir), _summary(run_dir))
            if run_dir and (run_dir / "calls.csv").exists():
                with open(run_dir / "calls.csv", newline="") as f:
                    out[f"{name} calls"] = list(csv.DictReader(f))
    finally:
        pretrain._optimizer, pretrain._precision = real_optimizer, real_precision
    return out


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory):
    return pools(2).run(_job_train, tmp_path_factory.mktemp("pool_runs"), list(RUNS))[0]


def _losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def test_spccl_without_pruning_gives_megatrons_dense_losses(runs):
    dense, (exact, summary) = runs["dense"][0], runs["exact"]
    assert len(dense) == len(exact) == ITERATIONS
    assert _losses(exact) == pytest.approx(_losses(dense), abs=1e-6, rel=1e-6)
    assert dense[-1]["loss"] < dense[0]["loss"] - 0.05, "the optimizer should step on Megatron's main_grad"
    assert (summary["mode"], summary["density"], summary["prune_ms"]) == ("spccl", 1.0, 0.0)
    assert summary["allreduce_ms"] > 0 and summary["bytes_ratio"] > 0


def test_dense_run_times_megatrons_own_reduction(runs):
    rows, summary = runs["dense"]
    assert (summary["engine"], summary["mode"], summary["world_size"]) == ("megatron", "dense", 2)
    assert (summary["backend"], summary["precision"], summary["distributed_optimizer"]) == ("gloo", "fp32", False)
    assert summary["summarised_iterations"] == ITERATIONS - 1 and summary["parameters"] > 0
    assert summary["bytes_ratio"] == 1.0 and summary["prune_ms"] == 0.0 and summary["allreduce_ms"] > 0
    assert all(r["dense_bytes"] == rows[0]["dense_bytes"] > 0 and r["density"] == 1.0 for r in rows)
    distopt = runs["distopt"][1]
    assert distopt["bytes_ratio"] == 1.0 and distopt["allreduce_ms"] > 0
    # A reduce-scatter sends half an all-reduce's bytes (of a bucket Megatron pads for sharding).
    assert runs["distopt"][0][0]["dense_bytes"] / rows[0]["dense_bytes"] == pytest.approx(0.5, abs=0.02)


def test_megatron_optimizer_equals_the_cpu_stand_in_and_runs_bf16_distributed(runs):
    assert _losses(runs["megatron-adam"][0]) == pytest.approx(_losses(runs["dense"][0]), abs=1e-6)
    assert _losses(runs["distopt"][0]) == pytest.approx(_losses(runs["dense"][0]), abs=1e-6)
    # The gradient norm each optimizer reports (before clipping) is the same norm.
    norms = [r["grad_norm"] for r in runs["dense"][0]]
    assert all(0 < norm < math.inf for norm in norms)
    for name in ("megatron-adam", "distopt"):
        assert [r["grad_norm"] for r in runs[name][0]] == pytest.approx(norms, rel=1e-5), name
    assert runs["dense"][1]["optimizer"].startswith("torch AdamW stand-in")
    assert runs["megatron-adam"][1]["optimizer"].startswith("Megatron fp32 Adam")
    rows, summary = runs["bf16-distopt-spccl"]
    assert (summary["precision"], summary["distributed_optimizer"], summary["mode"]) == ("bf16", True, "spccl")
    assert summary["optimizer"].startswith("Megatron distributed Adam")
    assert all(math.isfinite(loss) for loss in _losses(rows)) and rows[-1]["loss"] < rows[0]["loss"]
    assert 0.005 < summary["density"] < 0.02 and summary["bytes_ratio"] < 0.5 and summary["prune_ms"] > 0
    assert summary["choices"] and all(name.endswith("/coo") for name in summary["choices"])  # the pinned format
    assert runs["dense"][1]["choices"] == {} and {r["choices"] for r in runs["dense"][0]} == {""}
    # output.calls: every reduction of every iteration, as the totals count them
    calls = runs["bf16-distopt-spccl calls"]
    assert calls and {c["collective"] for c in calls} == {"reduce_scatter"}
    assert all(c["candidate"].endswith("/coo") and c["encoded"] == "0" and float(c["time_ms"]) > 0 for c in calls)
    for r in rows:
        mine = [c for c in calls if int(c["iteration"]) == int(r["iteration"])]
        assert sum(int(c["bytes_sent"]) for c in mine) == r["bytes_sent"]
        assert len(mine) == sum(int(t.rsplit(":", 1)[1]) for t in r["choices"].split())
    assert "dense calls" not in runs and "exact calls" not in runs  # only where asked


def test_command_line_spawns_ranks_and_writes_the_run(tmp_path):
    """``python -m spccl_train.megatron.pretrain`` end to end: spawned gloo ranks, SpCCL with pruning."""
    argv = ["--config", "tiny_cpu", "--use-spccl", *_overrides(tmp_path, "pruned"), "output.plot=true"]
    assert (
        pretrain.main(
            [*argv, "spccl.collective.format=coo", "spccl.pruning.density=0.05", "spccl.pruning.sample_fraction=0.05"]
        )
        == 0
    )
    run_dir = tmp_path / "runs" / "pruned"
    rows, summary = _rows(run_dir), _summary(run_dir)
    assert (summary["engine"], summary["mode"], summary["world_size"]) == ("megatron", "spccl", 2)
    assert 0.035 < summary["density"] < 0.07, summary["density"]
    assert summary["bytes_ratio"] < 0.5 and summary["prune_ms"] > 0 and summary["allreduce_ms"] > 0
    assert rows[0]["density"] == 1.0, "spccl.dense_iterations=1: the first reduction is Megatron's"
    cfg = C.from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert cfg.spccl.enabled and cfg.model.hidden == 32
    assert [r["lr"] for r in rows] == [pytest.approx(pretrain._lr_at(cfg, i)) for i in range(ITERATIONS)]
    assert (run_dir / "report.png").stat().st_size > 10_000


def test_world_size_one_runs_in_process_and_restores_the_environment(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    queries = torch.cuda.current_device, torch.cuda.current_stream
    cfg = _tiny(tmp_path, "single", "dist.nproc_per_node=1", "train.iterations=2")
    run = pretrain.launch(cfg, "tiny_cpu")
    assert _summary(run)["world_size"] == 1 and len(_rows(run)) == 2
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    assert (torch.cuda.current_device, torch.cuda.current_stream) == queries, "CPU redirection undone"


def test_command_line_and_errors(tmp_path, capsys):
    assert pretrain.main(["--config", "tiny_cpu", "train.bogus=1"]) == 2
    assert "unknown key 'train.bogus'" in capsys.readouterr().err
    assert pretrain.main(["--use-spccl", "--no-spccl"]) == 2
    with pytest.raises(ValueError, match="distributed optimizer needs CUDA"):
        pretrain.launch(_tiny(tmp_path, "distopt", "dist.nproc_per_node=1"), "tiny_cpu", distributed_optimizer=True)
