"""The DDP trainer behind ``spccl-train``: one process per rank, dense or SpCCL gradient reduction.

Per iteration it records wall time (the device synchronised at the end of each iteration) and
splits it into the parts of :data:`BREAKDOWN`, which add up to it: data, forward, backward
compute, the communication the step waited for, the pruning it waited for, the optimizer, and
the rest. It also records the DDP hook's own totals (all-reduce time from issue
to completion summed over buckets, pruning time), the loss averaged over ranks, achieved density
and bytes sent. Runs are written to ``<output.dir>/<name>/``: ``config.yaml``,
``iterations.csv``, ``summary.json`` and ``report.png``.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import socket
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import yaml

from .. import ddp as spccl_ddp
from .._provenance import git_commit
from ..collectives import CollectiveConfig, clearing_graphs, measure_links
from ..emulation import check_launch, emulate_nodes
from ..optim import BurstAdamW
from ..pruning import PruneConfig
from ..reducer import CallRecord
from ..sparse_config import SparseConfig
from .config import ExperimentConfig, from_dict, to_dict
from .data import prepare_tokens
from .model import build_model, count_parameters
from .report import BREAKDOWN, device_line

__all__ = [
    "BREAKDOWN",
    "CALL_COLUMNS",
    "CallsFile",
    "IterationRecord",
    "choices_text",
    "RunLog",
    "announce_links",
    "capacity_factor",
    "apply_emulation",
    "TimedHook",
    "Timeline",
    "describe_devices",
    "device_identity",
    "finish_run",
    "format_summary",
    "launch",
    "local_rendezvous",
    "make_optimizer",
    "one_rank_environment",
    "phase_breakdown",
    "run_worker",
    "summarize",
    "timed_hook",
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
    choices: str = ""
    """The iteration's SpCCL reductions by the candidate that ran, most first: ``"direct/coo:5 direct/pici:1"``."""
    grad_norm: float = math.nan
    """Global norm of the reduced gradient before clipping (NaN: ``optim.grad_clip=0``)."""
    data_s: float = math.nan
    """:data:`BREAKDOWN` ``data`` (NaN: the loop did not split its iterations, as the Megatron engine's)."""
    forward_s: float = math.nan
    """:data:`BREAKDOWN` ``forward``."""
    backward_s: float = math.nan
    """:data:`BREAKDOWN` ``backward``."""
    comm_wait_s: float = math.nan
    """:data:`BREAKDOWN` ``comm_wait``."""
    prune_inline_s: float = math.nan
    """:data:`BREAKDOWN` ``prune_inline``."""
    optimizer_s: float = math.nan
    """:data:`BREAKDOWN` ``optimizer``."""
    other_s: float = math.nan
    """:data:`BREAKDOWN` ``other``."""


class Timeline:
    """Marks on one timeline: the host clock on CPU, CUDA events on the current stream on GPUs.

    On a GPU the host runs ahead of the device, so host times would say when work was launched,
    not when it ran; an event recorded on the stream the step runs on says when the device got
    there. Recording costs no synchronisation; read :meth:`seconds` after the iteration's own
    end-of-iteration synchronisation.
    """

    __slots__ = ("_cuda",)

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        """A mark at this point of the (host or current-stream) timeline."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        """Seconds from mark ``start`` to mark ``end`` (both completed on CUDA)."""
        if self._cuda:
            return start.elapsed_time(end) / 1e3
        return end - start


class TimedHook:
    """A DDP comm hook and its state, wrapped to mark each bucket's call on a :class:`Timeline`.

    DDP calls a bucket's hook once the bucket's gradients are computed and waits, at the end of
    the backward pass, for the futures the hooks returned. The marks on either side of each call
    (``spans``: ``(called, returned)``) let :func:`phase_breakdown` tell compute from the time
    the backward pass spent blocked in a hook, and from its final wait for the reductions.
    Register it with :func:`timed_hook`: ``ddp_model.register_comm_hook(timed, timed_hook)``.
    """

    __slots__ = ("hook", "spans", "state", "timeline")

    def __init__(self, state: object, hook, timeline: Timeline) -> None:
        self.state = state
        self.hook = hook
        self.timeline = timeline
        self.spans: list[tuple] = []


def timed_hook(timed: TimedHook, bucket):
    """The comm hook of a :class:`TimedHook`: mark, run the wrapped hook, mark, hand on its future."""
    # No annotations: DDP compares them with dist.GradBucket and Future[Tensor] as objects, and
    # this module's (from __future__ import annotations) would be strings, which it rejects.
    called = timed.timeline.mark()
    future = timed.hook(timed.state, bucket)
    timed.spans.append((called, timed.timeline.mark()))
    return future


def phase_breakdown(
    data_end: float,
    forward_end: float,
    backward_end: float,
    step_end: float,
    wall: float,
    hook_spans: list[tuple[float, float]],
    prune_inline: float,
) -> dict[str, float]:
    """Split one iteration's ``wall`` seconds into the parts of :data:`BREAKDOWN`; they sum to ``wall``.

    Times are seconds from the iteration's start on one timeline: the ends of the data, forward,
    backward and optimizer phases, and each comm hook call's ``(called, returned)``, which lie
    in the backward pass. Time inside the hooks blocked the backward pass (on GPUs: the training
    stream); of it, ``prune_inline`` seconds (the hook's pruning, when it runs in line) are
    pruning and the rest communication. After the last hook returns, the backward pass only
    waits for the reductions still in flight (the gradients are all computed by then), so that
    tail is communication too. What is left of the backward pass is compute. ``other`` is the
    wall time outside the marked phases.
    """
    in_hooks = sum(returned - called for called, returned in hook_spans)
    tail = backward_end - max(returned for _, returned in hook_spans) if hook_spans else 0.0
    prune = min(prune_inline, in_hooks)
    return {
        "data": data_end,
        "forward": forward_end - data_end,
        "backward": backward_end - forward_end - in_hooks - tail,
        "comm_wait": in_hooks - prune + tail,
        "prune_inline": prune,
        "optimizer": step_end - backward_end,
        "other": wall - step_end,
    }


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
        return BurstAdamW(params, max_age=o.max_age or None, max_burst=o.max_burst or None, **kwargs)
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


def _ranks_per_node(cfg: ExperimentConfig, local_world: int) -> int | None:
    """Ranks per node of the group, ``None`` when every rank shares one node. Needs the process group."""
    ranks_per_node = cfg.dist.ranks_per_node or local_world
    return ranks_per_node if ranks_per_node < dist.get_world_size() else None


def capacity_factor(cfg: ExperimentConfig, local_world: int) -> float | None:
    """The capacity factor both engines reduce with: ``spccl.capacity_factor`` (``None`` for 0),
    except ``None`` where the group spans nodes and ``spccl.exact_across_nodes`` asks for exact
    sizes on the wire, and with ``spccl.collective.algorithm=hierarchical`` (whose steps plan from their own
    counts: it takes no bounds). Needs the process group."""
    s = cfg.spccl
    if not s.capacity_factor or s.collective.algorithm == "hierarchical":
        return None
    if s.exact_across_nodes and _ranks_per_node(cfg, local_world) is not None:
        return None
    return s.capacity_factor


def collective_config(cfg: ExperimentConfig, local_world: int) -> CollectiveConfig:
    """The sparse collectives' config of an experiment (both engines): format, algorithm, cost
    model, nodes (``dist.ranks_per_node``, else this node's ranks; ``None`` when every rank shares
    a node) and CUDA-graph replay (for reductions planned from bounds: see :func:`capacity_factor`).
    Needs the process group."""
    s = cfg.spccl
    return CollectiveConfig(
        format=s.collective.format,
        algorithm=s.collective.algorithm,
        ranks_per_node=_ranks_per_node(cfg, local_world),
        cuda_graphs=s.collective.cuda_graphs and capacity_factor(cfg, local_world) is not None,
        cost_model=s.collective.cost_model,
    )


def sparse_config(cfg: ExperimentConfig, local_world: int) -> SparseConfig:
    """The :class:`~spccl_train.sparse_config.SparseConfig` both engines reduce with, from the
    ``spccl`` section (its pruning keys, :func:`collective_config`, :func:`capacity_factor`; the
    sampling seed is ``train.seed``). Needs the process group."""
    s = cfg.spccl
    return SparseConfig(
        prune=s.prune,
        pruning=PruneConfig(**dataclasses.asdict(s.pruning), seed=cfg.train.seed),
        collective=collective_config(cfg, local_world),
        capacity_factor=capacity_factor(cfg, local_world),
        prune_to_wire=s.prune_to_wire,
        dense_iterations=s.dense_iterations,
        record_calls=cfg.output.calls,
    )


def _hook(
    cfg: ExperimentConfig, model: torch.nn.parallel.DistributedDataParallel, local_world: int, timeline: Timeline
) -> tuple[spccl_ddp.DenseHookState | spccl_ddp.SparseHookState, TimedHook, bool]:
    """Register the dense or sparse comm hook, wrapped in a :class:`TimedHook`.

    Returns the hook's state, the wrapper, and whether the backward pass waits for the hook's
    pruning (:meth:`~spccl_train.ddp.SparseHookState.waits_for_pruning`: in line, or on a side
    stream that the planning exchange waits for), so that its pruning time is time waited for.
    """
    s = cfg.spccl
    if not s.enabled:
        state = spccl_ddp.DenseHookState()
        timed = TimedHook(state, spccl_ddp.dense_allreduce_hook, timeline)
        model.register_comm_hook(timed, timed_hook)
        return state, timed, False
    state = spccl_ddp.SparseHookState(
        config=sparse_config(cfg, local_world),
        overlap={"auto": None, "on": True, "off": False, "stream": "stream"}[s.overlap],
    )
    timed = TimedHook(state, spccl_ddp.sparse_allreduce_hook, timeline)
    model.register_comm_hook(timed, timed_hook)
    return state, timed, s.prune and state.waits_for_pruning(next(model.parameters()).is_cuda)


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
    cfg = apply_emulation(cfg)
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


def apply_emulation(cfg: ExperimentConfig) -> ExperimentConfig:
    """Put this rank on its emulated node (``dist.emulate_nodes``) and set ``dist.ranks_per_node``
    to the emulated nodes' size. Call it before the process group is made (NCCL reads the host
    id when the group connects)."""
    if cfg.dist.emulate_nodes <= 1:
        return cfg
    if dist.is_initialized():
        raise ValueError(
            f"dist.emulate_nodes={cfg.dist.emulate_nodes}: the process group already exists, so its ranks cannot "
            "be moved onto emulated nodes; let the trainer make the group, or set dist.emulate_nodes=0"
        )
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", str(local_world)))
    problem = check_launch(cfg.dist.emulate_nodes, local_world, world, cfg.dist.ranks_per_node)
    if problem is not None:
        raise ValueError(problem)
    placed = emulate_nodes(cfg.dist.emulate_nodes)
    return dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, ranks_per_node=placed.ranks_per_node))


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
    timeline = Timeline(device)
    state, timed, waits_for_pruning = _hook(cfg, ddp_model, local_world, timeline)
    links = announce_links(cfg, rank, world, local_world, device)
    optimizer = make_optimizer(model.parameters(), cfg.optim)
    precision, autocast = _autocast(cfg, device)

    log = RunLog(cfg, config_name, rank, world, device)
    for step in range(t.iterations):
        lr = _lr_at(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        _sync(device)  # nothing of the last iteration (its loss all-reduce) runs into this one
        start = time.perf_counter()
        timed.spans.clear()
        t0 = timeline.mark()
        batch = data.batch(step, rank, world, t.micro_batch_size, t.seed).to(device, non_blocking=True)
        t_data = timeline.mark()
        with autocast():
            logits = ddp_model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        t_forward = timeline.mark()
        loss.backward()
        t_backward = timeline.mark()
        grad_norm = None
        if cfg.optim.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t_step = timeline.mark()
        _sync(device)
        elapsed = time.perf_counter() - start
        # Off the hot path from here: the device is idle, so reading the marks waits for nothing.
        hook = state.summary()
        state.reset_stats()
        since = functools.partial(timeline.seconds, t0)
        parts = phase_breakdown(
            since(t_data),
            since(t_forward),
            since(t_backward),
            since(t_step),
            elapsed,
            [(since(called), since(returned)) for called, returned in timed.spans],
            hook.prune_seconds if waits_for_pruning else 0.0,
        )
        log.calls(step, hook.calls)  # first: record raises on a non-finite loss
        log.record(
            step,
            elapsed,
            loss,
            lr,
            allreduce_s=hook.reduce_seconds,
            prune_s=hook.prune_seconds,
            density=hook.density if hook.elements else 1.0,
            bytes_sent=hook.bytes_sent,
            dense_bytes=hook.dense_bytes,
            deferred=hook.deferred,
            exchanges=hook.exchanges,
            choices=choices_text(hook.choices),
            grad_norm=math.nan if grad_norm is None else grad_norm.item(),
            **{f"{key}_s": value for key, value in parts.items()},
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
        {"precision": precision, "parameters": n_params, "links": links},
        identities=log.devices,
    )


def announce_links(cfg: ExperimentConfig, rank: int, world: int, local_world: int, device: torch.device) -> str | None:
    """Measure the links up front and say on rank 0 what was found, where it matters: on emulated
    nodes, and where SpCCL's ``auto`` chooses from the measured model (it would probe at its first
    call anyway; probing here keeps that out of the first timed iteration and shows the figures).
    Also says when ``spccl.exact_across_nodes`` sets the capacity factor aside. Collective: every
    rank calls it."""
    s = cfg.spccl
    if rank == 0 and s.enabled and s.capacity_factor and capacity_factor(cfg, local_world) is None:
        why = (
            "spccl.collective.algorithm=hierarchical takes no bounds"
            if s.collective.algorithm == "hierarchical"
            else "the group spans nodes (spccl.exact_across_nodes=false keeps it)"
        )
        print(
            f"spccl: spccl.capacity_factor={s.capacity_factor:g} is set aside: {why}; every all-reduce plans "
            "from exchanged counts and sends exact sizes",
            flush=True,
        )
    weighs = (
        s.enabled and s.collective.cost_model == "measured" and "auto" in (s.collective.format, s.collective.algorithm)
    )
    if world < 2 or not (cfg.dist.emulate_nodes > 1 or weighs):
        return None
    # Emulated nodes print what the network measured even where auto does not weigh with it.
    config = dataclasses.replace(collective_config(cfg, local_world), cost_model="measured")
    described = measure_links(config=config, device=device).describe()
    if rank == 0:
        print(f"links: {described}", flush=True)
    return described


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
        # Every rank's device, once, before the loop: the summary counts distinct devices, not
        # ranks (two ranks on one GPU are not two GPUs), and finish_run runs on rank 0 alone.
        self.devices: list = [None] * world
        dist.all_gather_object(self.devices, device_identity(device))
        self.records: list[IterationRecord] = []
        self._world = world
        self._loss_sum = torch.zeros((), device=device)
        self._progress = None
        self._calls = None
        if rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            if cfg.output.calls and cfg.spccl.enabled:
                self._calls = CallsFile(self.run_dir / "calls.csv")
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

    def calls(self, step: int, records: Sequence[CallRecord]) -> None:
        """Write the iteration's SpCCL reductions to ``calls.csv`` (``output.calls``; rank 0)."""
        if self._calls is not None:
            self._calls.write(step, records)

    def close(self) -> None:
        """Close the progress bar and ``calls.csv``."""
        if self._progress is not None:
            self._progress.close()
        if self._calls is not None:
            self._calls.close()


CALL_COLUMNS = (
    "iteration", "bucket", "collective", "elements", "candidate", "trial", "encoded", "predicted_ms", "time_ms",
    "bytes_sent", "dense_bytes", "exchanges", "candidates_ms",
)  # fmt: skip
"""``calls.csv``'s columns: :class:`~spccl_train.reducer.CallRecord`'s, times in milliseconds;
``candidates_ms``: every candidate weighed and its price, cheapest first (``direct/coo:21.300 ...``)."""


class CallsFile:
    """``calls.csv``, written an iteration at a time (a long run's records are not kept)."""

    def __init__(self, path: pathlib.Path) -> None:
        self._file = path.open("w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(CALL_COLUMNS)

    def write(self, step: int, records: Sequence[CallRecord]) -> None:
        """One row per record of iteration ``step``, flushed (a run cut short keeps its rows)."""
        for c in records:
            prices = " ".join(f"{name}:{1e3 * t:.3f}" for name, t in sorted(c.candidates.items(), key=lambda kv: kv[1]))
            self._writer.writerow(
                (
                    step, c.bucket, c.collective, c.elements, c.candidate, int(c.trial), int(c.encoded),
                    f"{1e3 * c.predicted_s:.3f}", f"{1e3 * c.seconds:.3f}", c.bytes_sent, c.dense_bytes, c.exchanges,
                    prices,
                )
            )  # fmt: skip
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def device_identity(device: torch.device) -> tuple[str, str, str]:
    """``(host, device id, device name)`` of a rank's device: ranks with equal host and id share it.

    GPUs are told apart by UUID, which names one GPU whatever index ``CUDA_VISIBLE_DEVICES``
    gives it in each process, else by index on the host; a host's CPU is one device.
    """
    host = socket.gethostname()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        return host, str(uuid) if uuid is not None else f"cuda:{device.index}", props.name
    return host, device.type, device.type


def describe_devices(identities: list[tuple[str, str, str]]) -> str:
    """What the ranks run on, counting distinct devices: ``4 x NVIDIA H200`` (one each) or
    ``2 ranks on 1 x NVIDIA H200`` (sharing); kinds of device joined by `` + ``."""
    kinds: dict[str, tuple[list[int], set[tuple[str, str]]]] = {}
    for host, ident, name in identities:
        ranks, devices = kinds.setdefault(name, ([0], set()))
        ranks[0] += 1
        devices.add((host, ident))
    return " + ".join(
        f"{ranks[0]} x {name}" if ranks[0] == len(devices) else f"{ranks[0]} ranks on {len(devices)} x {name}"
        for name, (ranks, devices) in kinds.items()
    )


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
    identities: list[tuple[str, str, str]] | None = None,
) -> pathlib.Path:
    """On rank 0 after the loop: summarise, write the run files, print the summary, plot.

    ``identities``: every rank's :func:`device_identity` (``RunLog.devices``); without them only
    this rank's device is known, and the device line says so rather than guess that each rank
    has its own.
    """
    info = {
        "config_name": config_name,
        "mode": "spccl" if cfg.spccl.enabled else "dense",
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "devices": len({(host, ident) for host, ident, _ in identities}) if identities else None,
        "device_line": describe_devices(identities)
        if identities
        else f"{world} ranks, rank 0 on {describe_devices([device_identity(device)])}",
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
    """Means over the iterations after ``warmup`` (the paper: the last 80 of 100).

    ``breakdown_ms`` holds the means of the :data:`BREAKDOWN` parts, which add up to
    ``iteration_ms`` (``None`` when the loop did not split its iterations). ``allreduce_ms`` and
    ``prune_ms`` are the comm hook's own totals: each bucket's all-reduce from issue to
    completion, summed over buckets, and all pruning. Spans of different buckets overlap one
    another and the backward pass, so ``allreduce_ms`` is not part of the iteration's sum and
    can exceed it; ``breakdown_ms["comm_wait"]`` is what the step waited for.
    """
    kept = records[warmup:]
    n = len(kept)

    def mean(key: str) -> float:
        return sum(getattr(r, key) for r in kept) / n

    sent, dense = sum(r.bytes_sent for r in kept), sum(r.dense_bytes for r in kept)
    tail = records[-min(10, len(records)) :]
    breakdown = {key: 1e3 * mean(f"{key}_s") for key, _, _ in BREAKDOWN}
    return {
        **info,
        "iterations": len(records),
        "warmup_iterations": warmup,
        "summarised_iterations": n,
        "iteration_ms": 1e3 * mean("time_s"),
        "iteration_ms_median": 1e3 * statistics.median(r.time_s for r in kept),
        "breakdown_ms": None if any(math.isnan(v) for v in breakdown.values()) else breakdown,
        "allreduce_ms": 1e3 * mean("allreduce_s"),
        "prune_ms": 1e3 * mean("prune_s"),
        "tokens_per_s": info["tokens_per_iteration"] / mean("time_s"),
        "density": mean("density"),
        "bytes_ratio": sent / dense if dense else 0.0,
        "deferred_per_iteration": mean("deferred"),
        "exchanges_per_iteration": mean("exchanges"),
        "choices": _choices_total(kept),
        "first_loss": records[0].loss,
        "final_loss": sum(r.loss for r in tail) / len(tail),
        "last_loss": records[-1].loss,
    }


def choices_text(choices: dict[str, int]) -> str:
    """``{"direct/pici": 1, "direct/coo": 5}`` as ``"direct/coo:5 direct/pici:1"`` (most first; "" for none)."""
    return " ".join(f"{name}:{n}" for name, n in sorted(choices.items(), key=lambda item: (-item[1], item[0])))


def _choices_total(records: list[IterationRecord]) -> dict[str, int]:
    """The records' :attr:`IterationRecord.choices` summed, most first."""
    total = collections.Counter()
    for r in records:
        for item in r.choices.split():
            name, n = item.rsplit(":", 1)
            total[name] += int(n)
    return dict(total.most_common())


def _write_run(run_dir: pathlib.Path, records: list[IterationRecord], summary: dict) -> None:
    with open(run_dir / "iterations.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in dataclasses.fields(IterationRecord)])
        writer.writeheader()
        for r in records:
            writer.writerow(dataclasses.asdict(r))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def format_summary(summary: dict, run_dir: pathlib.Path) -> str:
    """The readable end-of-run summary: the iteration's parts (they add up to it) and what each means."""
    s = summary
    lines = [
        f"run: {run_dir}",
        f"  {s['mode']} | {device_line(s)} ({s['backend']}, {s['precision']}) | "
        f"{s['parameters'] / 1e6:.1f}M parameters | commit {s['commit']}",
        f"  iterations {s['iterations']} (summary over the last {s['summarised_iterations']}, "
        f"{s['warmup_iterations']} warm-up left out)",
        f"  iteration {s['iteration_ms']:.1f} ms (mean; median {s['iteration_ms_median']:.1f}) | "
        f"{s['tokens_per_s']:.0f} tokens/s",
    ]
    breakdown = s.get("breakdown_ms")
    if breakdown:
        width = max(len(label) for _, label, _ in BREAKDOWN)
        lines += [
            f"    {label:{width}s} {breakdown[key]:8.1f} ms  {meaning}"
            for key, label, meaning in BREAKDOWN
            if key in breakdown
        ]
    kind = "sparse" if s["mode"] == "spccl" else "dense"
    lines += [
        f"  comm hook totals (not parts of the iteration): {kind} all-reduce {s['allreduce_ms']:.1f} ms, "
        "issue to completion summed over buckets (they overlap compute and each other) | "
        f"pruning {s['prune_ms']:.1f} ms",
        f"  loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} (mean of the last 10; {s['last_loss']:.3f} at "
        f"iteration {s['iterations']}) | density {s['density']:.4f} | bytes sent {100 * s['bytes_ratio']:.1f}% of dense",
    ]
    if s.get("choices"):
        ran = ", ".join(f"{name} {n}" for name, n in s["choices"].items())
        lines.append(f"  SpCCL reductions by the candidate that ran (summarised iterations): {ran}")
    if s.get("links"):
        lines.append(f"  links measured at start: {s['links']}")
    return "\n".join(lines)
