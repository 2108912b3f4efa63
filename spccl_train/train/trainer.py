"""The DDP trainer behind ``spccl-train``: one process per rank, dense or SpCCL gradient reduction.

Per iteration it records wall time (the device synchronised at the end of each iteration),
time in gradient all-reduce and in pruning (device timers of the DDP hook), the loss averaged
over ranks, achieved density and bytes sent. Runs are written to ``<output.dir>/<name>/``:
``config.yaml``, ``iterations.csv``, ``summary.json`` and ``report.png``.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import json
import math
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import yaml

from .. import ddp as spccl_ddp
from .._provenance import git_commit
from ..collectives import CollectiveConfig, clearing_graphs
from ..optim import BurstAdamW
from .config import ExperimentConfig, from_dict, to_dict
from .data import prepare_tokens
from .model import build_model, count_parameters

__all__ = [
    "IterationRecord",
    "finish_run",
    "launch",
    "local_rendezvous",
    "make_optimizer",
    "one_rank_environment",
    "run_worker",
    "summarize",
]


@dataclasses.dataclass
class IterationRecord:
    """One row of ``iterations.csv`` (rank 0's view; times in seconds)."""

    iteration: int
    time_s: float
    allreduce_s: float
    prune_s: float
    loss: float
    lr: float
    density: float
    bytes_sent: int
    dense_bytes: int
    deferred: int = 0
    """Elements pruning kept but the capacity bound deferred to a later iteration (``spccl.capacity_factor``)."""
    exchanges: int = 0
    """Planning exchanges (host synchronisations) of the iteration's sparse all-reduces."""


@contextlib.contextmanager
def local_rendezvous(nproc: int):
    """torchrun's rendezvous variables for ``nproc`` ranks launched from this process.

    This process hosts the TCP store on a port the system picks, for as long as the block runs,
    and every rank joins it as a client (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun). No
    port is picked, closed and handed on, so none can be taken by another process in between.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    try:
        yield {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(nproc),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    finally:
        del store


def launch(cfg: ExperimentConfig, config_name: str) -> pathlib.Path | None:
    """Run the experiment: in this process under torchrun, else spawn ``dist.nproc_per_node`` ranks.

    Returns the run folder (on the process that holds rank 0; ``None`` on other ranks).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_worker(cfg, config_name)
    nproc = cfg.dist.nproc_per_node
    with local_rendezvous(nproc) as env:
        if nproc == 1:
            with one_rank_environment(env):
                return run_worker(cfg, config_name)
        import torch.multiprocessing as mp

        result = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(
            _spawned, args=(env, nproc, to_dict(cfg), config_name, result), nprocs=nproc, start_method="spawn"
        )
        run_dir = result.get()
    return pathlib.Path(run_dir) if run_dir else None


@contextlib.contextmanager
def one_rank_environment(env: dict[str, str]):
    """torchrun's variables for a single rank run in this process (``env`` plus rank 0 of 1),
    restored on exit so a later launch in the same process does not take them for torchrun's."""
    saved = {key: os.environ.get(key) for key in (*env, "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(env, RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _spawned(local_rank: int, env: dict, nproc: int, cfg_data: dict, config_name: str, result) -> None:
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nproc))
    run_dir = run_worker(from_dict(cfg_data), config_name)
    if local_rank == 0:
        result.put(str(run_dir) if run_dir else "")


def _device(cfg: ExperimentConfig, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but torch sees no GPU: use train.device=cpu (or auto)")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_optimizer(params, o) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names, from the ``optim`` section of an experiment."""
    kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    if o.name == "burst_adamw":
        return BurstAdamW(params, max_age=o.max_age or None, **kwargs)
    # torch's fused AdamW (one kernel over all tensors) on GPUs: the fastest dense step torch has, so
    # speed ratios against dense runs compare with the best dense baseline; foreach elsewhere.
    params = [{**q, "params": list(q["params"])} if isinstance(q, dict) else q for q in params]
    tensors = [t for q in params for t in (q["params"] if isinstance(q, dict) else (q,))]
    on_gpu = bool(tensors) and all(t.is_cuda for t in tensors)
    return torch.optim.AdamW(params, **kwargs, **({"fused": True} if on_gpu else {"foreach": True}))


def _autocast(cfg: ExperimentConfig, device: torch.device):
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16":
        return precision, lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return precision, contextlib.nullcontext


def _lr_at(cfg: ExperimentConfig, step: int) -> float:
    o, total = cfg.optim, cfg.train.iterations
    if step < o.lr_warmup_iterations:
        return o.lr * (step + 1) / o.lr_warmup_iterations
    span = max(1, total - o.lr_warmup_iterations)
    progress = min(1.0, (step - o.lr_warmup_iterations) / span)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


def collective_config(cfg: ExperimentConfig, local_world: int) -> CollectiveConfig:
    """The sparse collectives' config of an experiment (both engines): format, algorithm, nodes
    (``dist.ranks_per_node``, else this node's ranks; ``None`` when every rank shares a node) and
    CUDA-graph replay. Needs the process group."""
    s = cfg.spccl
    ranks_per_node = cfg.dist.ranks_per_node or local_world
    return CollectiveConfig(
        format=s.format,
        algorithm=s.algorithm,
        ranks_per_node=ranks_per_node if ranks_per_node < dist.get_world_size() else None,
        cuda_graphs=s.cuda_graphs,
    )


def _hook(cfg: ExperimentConfig, model: torch.nn.parallel.DistributedDataParallel, local_world: int):
    s = cfg.spccl
    if not s.enabled:
        state = spccl_ddp.DenseHookState()
        model.register_comm_hook(state, spccl_ddp.dense_allreduce_hook)
        return state
    state = spccl_ddp.SparseHookState(
        density=s.density,
        sample_fraction=s.sample_fraction,
        decay=s.decay,
        error_dtype=s.error_dtype,
        prune=s.prune,
        collective_config=collective_config(cfg, local_world),
        dense_iterations=s.dense_iterations,
        warmup_steps=s.warmup_steps,
        seed=cfg.train.seed,
        overlap={"auto": None, "on": True, "off": False, "stream": "stream"}[s.overlap],
        capacity_factor=s.capacity_factor or None,
    )
    model.register_comm_hook(state, spccl_ddp.sparse_allreduce_hook)
    return state


def _run_name(cfg: ExperimentConfig, config_name: str, engine: str = "") -> str:
    if cfg.output.name:
        return cfg.output.name
    mode = "spccl" if cfg.spccl.enabled else "dense"
    parts = [config_name, engine, mode, datetime.datetime.now().strftime("%Y%m%d-%H%M%S")]
    return "-".join(part for part in parts if part)


def run_worker(cfg: ExperimentConfig, config_name: str) -> pathlib.Path | None:
    """Train on this rank (process group from the environment). Returns the run folder on rank 0."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = _device(cfg, local_rank)
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
    try:
        with clearing_graphs():  # graphs hold NCCL work of the group
            return _train(cfg, config_name, rank, world, local_rank, local_world, device)
    finally:
        dist.destroy_process_group()


def _train(cfg, config_name, rank, world, local_rank, local_world, device) -> pathlib.Path | None:
    t = cfg.train
    data = prepare_tokens(cfg.data, rank=local_rank, barrier=dist.barrier)
    if data.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {data.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}: raise the latter"
        )
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, device, eos_id=data.eos_id)
    n_params = count_parameters(model)
    ddp_model = torch.nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=t.bucket_cap_mb,
        gradient_as_bucket_view=True,
    )
    state = _hook(cfg, ddp_model, local_world)
    optimizer = make_optimizer(model.parameters(), cfg.optim)
    precision, autocast = _autocast(cfg, device)

    log = RunLog(cfg, config_name, rank, world, device)
    for step in range(t.iterations):
        lr = _lr_at(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = data.batch(step, rank, world, t.micro_batch_size, t.seed).to(device, non_blocking=True)
        _sync(device)
        start = time.perf_counter()
        with autocast():
            logits = ddp_model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        elapsed = time.perf_counter() - start
        hook = state.summary()
        state.reset_stats()
        log.record(
            step,
            elapsed,
            loss,
            lr,
            allreduce_s=hook.allreduce_seconds,
            prune_s=hook.prune_seconds,
            density=hook.density if hook.elements else 1.0,
            bytes_sent=hook.bytes_sent,
            dense_bytes=hook.dense_bytes,
            deferred=hook.deferred,
            exchanges=hook.exchanges,
        )
    log.close()
    if rank != 0:
        return None

    return finish_run(
        cfg,
        config_name,
        log.run_dir,
        log.records,
        world,
        device,
        data,
        {"precision": precision, "parameters": n_params},
    )


class RunLog:
    """One run's folder, progress bar and per-iteration records, on every rank (files on rank 0).

    Shared by the DDP loop here and the Megatron one (:mod:`spccl_train.megatron.pretrain`):
    it names the run (rank 0's name, broadcast; ``engine`` goes into generated names), writes ``config.yaml``, averages each
    iteration's loss over the ranks and stops on a non-finite one.
    """

    def __init__(
        self, cfg: ExperimentConfig, config_name: str, rank: int, world: int, device: torch.device, engine: str = ""
    ) -> None:
        names = [_run_name(cfg, config_name, engine)]
        dist.broadcast_object_list(names, src=0)
        self.run_dir = pathlib.Path(cfg.output.dir) / names[0]
        self.records: list[IterationRecord] = []
        self._world = world
        self._loss_sum = torch.zeros((), device=device)
        self._progress = None
        if rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            if cfg.output.progress:
                from tqdm.auto import tqdm

                self._progress = tqdm(
                    total=cfg.train.iterations,
                    desc=names[0],
                    unit="it",
                    file=sys.stderr,
                    dynamic_ncols=True,
                    mininterval=1.0,
                )

    def record(self, step: int, elapsed: float, loss: torch.Tensor, lr: float, **reduction: float | int) -> None:
        """Average ``loss`` over the ranks and keep the iteration; ``reduction``: the rest of :class:`IterationRecord`."""
        self._loss_sum.copy_(loss.detach())
        dist.all_reduce(self._loss_sum)
        loss_value = self._loss_sum.item() / self._world
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at iteration {step}: lower optim.lr or check the data")
        self.records.append(IterationRecord(iteration=step, time_s=elapsed, loss=loss_value, lr=lr, **reduction))
        if self._progress is not None:
            self._progress.set_postfix(loss=f"{loss_value:.3f}", ms=f"{elapsed * 1e3:.0f}", refresh=False)
            self._progress.update()

    def close(self) -> None:
        """Close the progress bar."""
        if self._progress is not None:
            self._progress.close()


def finish_run(
    cfg: ExperimentConfig,
    config_name: str,
    run_dir: pathlib.Path,
    records: list[IterationRecord],
    world: int,
    device: torch.device,
    data,
    extra: dict,
    label: str = "run",
) -> pathlib.Path:
    """On rank 0 after the loop: summarise, write the run files, print the summary, plot."""
    info = {
        "config_name": config_name,
        "mode": "spccl" if cfg.spccl.enabled else "dense",
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(),
        **extra,
        "tokens_per_iteration": world * cfg.train.micro_batch_size * cfg.data.seq_len,
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "data": {k: v for k, v in data.meta.items() if k != "files"},
    }
    summary = summarize(records, cfg.train.warmup_iterations, info)
    _write_run(run_dir, records, summary)
    print(format_summary(summary, run_dir).replace("run: ", f"{label}: ", 1), flush=True)
    if cfg.output.plot:
        from .report import plot_runs

        png = plot_runs([run_dir], run_dir / "report.png")
        print(f"plot: {png}", flush=True)
    return run_dir


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(records: list[IterationRecord], warmup: int, info: dict) -> dict:
    """Means over the iterations after ``warmup`` (the paper: the last 80 of 100)."""
    kept = records[warmup:]
    n = len(kept)

    def mean(key: str) -> float:
        return sum(getattr(r, key) for r in kept) / n

    sent, dense = sum(r.bytes_sent for r in kept), sum(r.dense_bytes for r in kept)
    tail = records[-min(10, len(records)) :]
    return {
        **info,
        "iterations": len(records),
        "warmup_iterations": warmup,
        "summarised_iterations": n,
        "iteration_ms": 1e3 * mean("time_s"),
        "iteration_ms_median": 1e3 * statistics.median(r.time_s for r in kept),
        "allreduce_ms": 1e3 * mean("allreduce_s"),
        "prune_ms": 1e3 * mean("prune_s"),
        "tokens_per_s": info["tokens_per_iteration"] / mean("time_s"),
        "density": mean("density"),
        "bytes_ratio": sent / dense if dense else 0.0,
        "deferred_per_iteration": mean("deferred"),
        "exchanges_per_iteration": mean("exchanges"),
        "first_loss": records[0].loss,
        "final_loss": sum(r.loss for r in tail) / len(tail),
    }


def _write_run(run_dir: pathlib.Path, records: list[IterationRecord], summary: dict) -> None:
    with open(run_dir / "iterations.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in dataclasses.fields(IterationRecord)])
        writer.writeheader()
        for r in records:
            writer.writerow(dataclasses.asdict(r))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def format_summary(summary: dict, run_dir: pathlib.Path) -> str:
    """The readable end-of-run summary."""
    s = summary
    lines = [
        f"run: {run_dir}",
        f"  {s['mode']} | {s['world_size']} x {s['device']} ({s['backend']}, {s['precision']}) | "
        f"{s['parameters'] / 1e6:.1f}M parameters | commit {s['commit']}",
        f"  iterations {s['iterations']} (summary over the last {s['summarised_iterations']}, "
        f"{s['warmup_iterations']} warm-up left out)",
        f"  iteration {s['iteration_ms']:.1f} ms | all-reduce {s['allreduce_ms']:.1f} ms | "
        f"pruning {s['prune_ms']:.1f} ms | {s['tokens_per_s']:.0f} tokens/s",
        f"  loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} (mean of the last 10) | density {s['density']:.4f} | "
        f"bytes sent {100 * s['bytes_ratio']:.1f}% of dense",
    ]
    return "\n".join(lines)
