"""Megatron-core GPT pretraining: the ``spccl-train`` experiments on Megatron-core's model, DDP and optimizer.

::

    python -m spccl_train.megatron.pretrain --config gpt2_xl_dense [--use-spccl] [--distributed-optimizer] [key=value ...]
    torchrun --nproc-per-node=4 -m spccl_train.megatron.pretrain --config gpt2_xl_spccl --use-spccl

It reads the same YAML configs (:mod:`spccl_train.train.config`) and data
(:func:`~spccl_train.train.data.prepare_tokens`, the same batches per step and rank) as the DDP
trainer, uses its learning-rate schedule, and writes the same run folder (``config.yaml``,
``iterations.csv``, ``summary.json`` with ``"engine": "megatron"``, ``report.png``), so
``spccl-train report`` compares Megatron runs with each other and with DDP runs.

Per rank: a process group (NCCL on GPUs, gloo on CPU), Megatron's parallel state with tensor and
pipeline parallel size 1, megatron-core's ``GPTModel`` with the local (no Transformer Engine)
layer spec, wrapped in Megatron's ``DistributedDataParallel`` (fp32 gradient buffers,
``overlap_grad_reduce``, buckets of ``train.bucket_cap_mb``, optionally the distributed
optimizer) and driven by ``get_megatron_optimizer`` (Adam with Megatron's weight-decay groups:
none on biases and norms). With ``spccl.enabled`` (``--use-spccl``) every bucket's gradient
reduction goes through :func:`spccl_train.megatron.enable` (pruning with error feedback, sparse
all-reduce or reduce-scatter).

Model mapping from ``model.*``: ``gpt2``: learned absolute positions (``max_position``),
LayerNorm, tanh-GELU MLP of ``intermediate`` (0: 4 x ``hidden``), biases, tied input/output
embeddings; ``starcoder2``: the same with rotary embeddings (``rope_theta``) and
``n_kv_head`` key/value groups. Attention is Megatron's local ``DotProductAttention`` (no fused
kernels: megatron-core alone ships none). Precision: on CUDA, ``train.precision`` bf16 (``auto``:
when supported) means bf16 parameters and activations (Megatron's ``Float16Module``) with fp32
main parameters and fp32 gradient reduction; the DDP trainer instead autocasts fp32 weights.

What is measured per iteration (rank 0, device synchronised at both ends): the wall time of
forward, backward, gradient reduction and optimizer step; the loss averaged over ranks; the
gradient-reduction time and bytes. With SpCCL these come from
:meth:`~spccl_train.megatron.SpcclMegatronState.summary` (pruning time, issue-to-completion time
of each sparse reduction, density, bytes sent against a dense ring). Dense runs time Megatron's
own bucket reductions the same way: each bucket group's ``start_grad_sync`` starts a timer and the
completion of its collective stops it (CUDA events ordered after the NCCL work; on gloo, when the
work finishes); bytes are those of a dense ring. Reductions overlap the backward pass, so their
time is reported beside the iteration time, not inside it. The dense warm-up reductions of a
SpCCL run (``spccl.dense_iterations``) are not timed (reported as 0; they fall in the summary's
warm-up iterations). Parameter all-gathers of the distributed optimizer happen in the optimizer
step and are dense in both modes: they count in the iteration time only.

CPU (gloo) runs are a functional path for tests and laptops: Megatron asks for
``torch.cuda.current_device()`` / ``current_stream()`` when it allocates buffers and reduces, and
its optimizer makes tensors with ``device='cuda'`` (grad-norm and loss-scale buffers), so on CPU
the device queries answer the CPU for the duration of the run, dropout uses the CPU generator
(Megatron's RNG tracker does not fork), and the optimizer is a stand-in: ``torch.optim.AdamW``
with Megatron's parameter groups, learning rate and weight decay, and global-norm clipping, over
the reduced ``main_grad`` buffers (step for step equal to Megatron's fp32 optimizer, which
tests/test_megatron_pretrain.py checks by letting Megatron's optimizer make its CUDA buffers on
the CPU). The distributed optimizer needs CUDA.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import sys
import time
import warnings

import torch
import torch.distributed as dist

from .._timing import Span
from ..collectives import clearing_graphs
from ..train.config import ExperimentConfig, from_dict, to_dict
from ..train.data import prepare_tokens
from ..train.trainer import (
    RunLog,
    _device,
    _lr_at,
    _sync,
    announce_links,
    apply_emulation,
    choices_text,
    finish_run,
    local_rendezvous,
    make_optimizer,
    one_rank_environment,
    sparse_config,
)

__all__ = ["launch", "main", "run_worker"]

_INSTALL = "pip install 'megatron-core>=0.16,<0.20'"


# ----------------------------------------------------------------------------- launching


def launch(cfg: ExperimentConfig, config_name: str, *, distributed_optimizer: bool = False) -> pathlib.Path | None:
    """Run the experiment on Megatron-core: in this process under torchrun, else spawn ``dist.nproc_per_node`` ranks.

    Args:
        cfg: the experiment (``spccl.enabled`` picks SpCCL or Megatron's dense reduction).
        config_name: names the run folder and the summary's ``config_name``.
        distributed_optimizer: Megatron's distributed optimizer (gradients reduce-scattered, each
            rank updates its shard, parameters all-gathered); needs CUDA.

    Returns:
        The run folder on the process that holds rank 0; ``None`` on other ranks.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_worker(cfg, config_name, distributed_optimizer=distributed_optimizer)
    nproc = cfg.dist.nproc_per_node
    with local_rendezvous(nproc) as env:
        if nproc == 1:
            with one_rank_environment(env):
                return run_worker(cfg, config_name, distributed_optimizer=distributed_optimizer)
        import torch.multiprocessing as mp

        result = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(
            _spawned,
            args=(env, nproc, to_dict(cfg), config_name, distributed_optimizer, result),
            nprocs=nproc,
            start_method="spawn",
        )
        run_dir = result.get()
    return pathlib.Path(run_dir) if run_dir else None


def _spawned(local_rank: int, env: dict, nproc: int, cfg_data: dict, config_name: str, distopt: bool, result) -> None:
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nproc))
    run_dir = run_worker(from_dict(cfg_data), config_name, distributed_optimizer=distopt)
    if local_rank == 0:
        result.put(str(run_dir) if run_dir else "")


def run_worker(cfg: ExperimentConfig, config_name: str, *, distributed_optimizer: bool = False) -> pathlib.Path | None:
    """Train on this rank; returns the run folder on rank 0.

    Uses the default process group if one is initialised (it is left as found), else makes one
    from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and
    destroys it at the end. Megatron's parallel state is set up (tensor and pipeline parallel
    size 1) unless already initialised, and torn down if this call set it up.
    """
    if cfg.optim.name != "adamw":
        raise ValueError(
            f"optim.name={cfg.optim.name!r} applies to the DDP engine only (the Megatron engine steps with "
            "Megatron's Adam): use optim.name=adamw, or --engine ddp"
        )
    if cfg.spccl.enabled and cfg.spccl.overlap != "off":
        warnings.warn(
            f"spccl.overlap={cfg.spccl.overlap!r} applies to the DDP engine only; the Megatron engine overlaps "
            "its reductions with the backward pass through Megatron's overlap_grad_reduce",
            stacklevel=2,
        )
    owns_group = not dist.is_initialized()
    cfg = apply_emulation(cfg)
    if owns_group:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = _device(cfg, local_rank)
    if distributed_optimizer and device.type != "cuda":
        raise ValueError(
            "the distributed optimizer needs CUDA (Megatron's optimizer makes CUDA tensors): "
            "run on GPUs, or leave out --distributed-optimizer on CPU"
        )
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu" and owns_group:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if owns_group:
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
    try:
        with _megatron_device(device), clearing_graphs():  # graphs hold NCCL work of the group
            return _train(cfg, config_name, rank, world, local_world, device, distributed_optimizer)
    finally:
        if owns_group:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- Megatron on this device


class _NoStream:
    """A CUDA stream stand-in for CPU runs: every CPU operation has finished when it returns."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def _megatron_device(device: torch.device):
    """On CPU, point Megatron's ``torch.cuda`` device and stream queries at the CPU while the run lasts.

    Megatron allocates DDP buffers on ``torch.cuda.current_device()`` and (0.19) waits on
    ``torch.cuda.current_stream()`` in every reduction. On CUDA nothing changes.
    """
    if device.type == "cuda":
        yield
        return
    stream = _NoStream()
    replaced = {
        "current_device": lambda: torch.device("cpu"),
        "current_stream": lambda device=None: stream,
        "default_stream": lambda device=None: stream,
    }
    saved = {name: getattr(torch.cuda, name) for name in replaced}
    for name, fn in replaced.items():
        setattr(torch.cuda, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def _import_megatron():
    """megatron.core, imported quietly (its TE / Apex fallback notices are recorded in the summary instead)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*(Transformer Engine and Apex are not installed|absl.logging).*"
            )
            import megatron.core as megatron_core
            import megatron.core.optimizer  # noqa: F401
            from megatron.core.distributed import param_and_grad_buffer  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the Megatron engine needs megatron-core: {_INSTALL}") from exc
    from . import check_version

    check_version(getattr(megatron_core, "__version__", "unknown"))
    return megatron_core


# ----------------------------------------------------------------------------- model and optimizer


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's ``gelu_new``, StarCoder2's ``gelu_pytorch_tanh``)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def _precision(cfg: ExperimentConfig, device: torch.device) -> str:
    if device.type != "cuda":
        return "fp32"
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return precision


def _transformer_config(cfg: ExperimentConfig, device: torch.device, bf16: bool):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    m = cfg.model
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=m.n_layer,
        hidden_size=m.hidden,
        num_attention_heads=m.n_head,
        num_query_groups=(m.n_kv_head or None) if m.arch == "starcoder2" else None,
        ffn_hidden_size=m.intermediate or 4 * m.hidden,
        hidden_dropout=m.dropout,
        attention_dropout=m.dropout,
        layernorm_epsilon=1e-5,
        normalization="LayerNorm",
        activation_func=_gelu_tanh,
        gated_linear_unit=False,
        add_bias_linear=True,
        init_method_std=0.02,
        attention_backend=AttnBackend.local,
        # megatron-core alone ships no fused kernels (they come with Transformer Engine / Apex).
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        persist_layer_norm=False,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=device.type != "cuda",
        perform_initialization=True,
    )


def _gpt_model(cfg: ExperimentConfig, config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    m = cfg.model
    rope = m.arch == "starcoder2"
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope" if rope else "learned_absolute",
        rotary_base=m.rope_theta if rope else 10000,
    )


class _LocalAdam:
    """The CPU stand-in for Megatron's optimizer (whose buffers are made with ``device='cuda'``).

    ``torch.optim.AdamW`` over Megatron's parameter groups (weight decay off for biases and
    1-D parameters: ``wd_mult`` 0), stepping on the reduced ``main_grad`` buffers after clipping
    their global norm. Same interface as the subset of ``MegatronOptimizer`` the loop uses.
    """

    def __init__(self, module: torch.nn.Module, o) -> None:
        decay, no_decay = [], []
        for name, param in module.named_parameters():
            if param.requires_grad:
                (no_decay if param.ndim == 1 or name.endswith(".bias") else decay).append(param)
        self.params = decay + no_decay
        self.clip = o.grad_clip
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        self.optimizer = make_optimizer([g for g in groups if g["params"]], o)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self):
        for param in self.params:
            grad = param.main_grad
            param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)
        norm = None
        if self.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        return True, norm, None


def _optimizer(cfg: ExperimentConfig, model, device: torch.device, bf16: bool, distopt: bool):
    """Megatron's optimizer on CUDA (``get_megatron_optimizer``); the :class:`_LocalAdam` stand-in on CPU."""
    o = cfg.optim
    if device.type != "cuda":
        return _LocalAdam(model, o), "torch AdamW stand-in (CPU)"
    from megatron.core import optimizer as megatron_optimizer

    config = megatron_optimizer.OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=o.grad_clip,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=distopt,
    )
    optimizer = megatron_optimizer.get_megatron_optimizer(config, [model])
    fused = not getattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    kind = "distributed" if distopt else ("mixed-precision" if bf16 else "fp32")
    return optimizer, f"Megatron {kind} Adam ({'fused' if fused else 'torch AdamW: no TE / Apex'})"


def _set_schedule(optimizer, cfg: ExperimentConfig, lr: float) -> None:
    """What Megatron's ``OptimizerParamScheduler.step`` sets, with the DDP trainer's learning rate."""
    for group in optimizer.param_groups:
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
        group["weight_decay"] = cfg.optim.weight_decay * group.get("wd_mult", 1.0)


# ----------------------------------------------------------------------------- reduction statistics


class _DenseReductions:
    """Megatron's own bucket-group reductions, timed from issue to completion like SpCCL's.

    Each bucket group's ``start_grad_sync`` and ``finish_grad_sync`` are wrapped on the instance
    (the class, and with it any SpCCL patch, stays as it is): a :class:`~spccl_train._timing.Span`
    starts when the group issues its collective and stops when the collective completes, in a
    callback of the work's future (CUDA: on a stream ordered after the NCCL work), else when
    ``finish_grad_sync`` has waited for it. Bytes are those of a dense ring over the group.
    """

    def __init__(self, model, device: torch.device) -> None:
        self.device = device
        self.reset_stats()
        groups = [*model.bucket_groups, *getattr(model, "expert_parallel_bucket_groups", [])]
        for group in groups:
            group.start_grad_sync = self._timed_start(group, group.start_grad_sync)
            group.finish_grad_sync = self._timed_finish(group.finish_grad_sync)

    def reset_stats(self) -> None:
        self.spans: list[Span] = []
        self.pending: list[Span] = []
        self.elements = 0
        self.dense_bytes = 0

    def _timed_start(self, group, start):
        distopt = group.ddp_config.use_distributed_optimizer
        reducing = group.intra_distributed_optimizer_instance_group if distopt else group.data_parallel_group
        world = dist.get_world_size(reducing)
        factor = 1 if distopt else 2  # a dense ring: reduce-scatter, or reduce-scatter + all-gather

        def start_grad_sync(*args, **kwargs):
            if getattr(group, "is_first_batch", False) and group.grad_reduce_handle is not None:
                return start(*args, **kwargs)  # Megatron's no-op: this group's reduction is out already
            span = Span(self.device)
            result = start(*args, **kwargs)
            self.spans.append(span)
            for bucket in group.buckets:
                numel = bucket.grad_data.numel()
                self.elements += numel
                self.dense_bytes += factor * (world - 1) * (numel // world) * bucket.grad_data.element_size()
            handle = getattr(group, "grad_reduce_handle", None)
            if handle is None:  # synchronous: the reduction finished (or the stream waits for it) already
                span.stop()
                return result
            works = getattr(handle, "works", None) or [handle]
            try:
                works[-1].get_future().then(lambda _: span.stop())
            except (AttributeError, RuntimeError):
                self.pending.append(span)
            return result

        return start_grad_sync

    def _timed_finish(self, finish):
        def finish_grad_sync(*args, **kwargs):
            result = finish(*args, **kwargs)
            while self.pending:
                self.pending.pop().stop()
            return result

        return finish_grad_sync

    def seconds(self) -> float:
        # On gloo a future's callback can trail Megatron's wait by a moment.
        deadline = time.monotonic() + 10
        while any(span._end is None for span in self.spans) and time.monotonic() < deadline:
            time.sleep(0.001)
        return sum(span.seconds() for span in self.spans if span._end is not None)


# ----------------------------------------------------------------------------- the loop


def _train(cfg, config_name, rank, world, local_world, device, distopt) -> pathlib.Path | None:
    megatron_core = _import_megatron()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from . import disable, enable

    t = cfg.train
    data = prepare_tokens(cfg.data, rank=int(os.environ.get("LOCAL_RANK", rank)), barrier=dist.barrier)
    if data.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {data.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}: raise the latter"
        )
    owns_parallel_state = not parallel_state.model_parallel_is_initialized()
    if owns_parallel_state:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    state = None
    try:
        torch.manual_seed(t.seed)
        if device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(t.seed, force_reset_rng=True)
        else:  # no CUDA generator to fork: dropout draws from the CPU generator
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        if cfg.spccl.enabled:  # before the model is wrapped
            state = enable(sparse_config(cfg, local_world))
            state.reset_stats()
        precision = _precision(cfg, device)
        bf16 = precision == "bf16"
        with warnings.catch_warnings():  # notices about defaults and missing Apex that ask nothing of us
            warnings.filterwarnings("ignore", message=".*(full scope is deprecated|Apex is not installed).*")
            config = _transformer_config(cfg, device, bf16)
            module = _gpt_model(cfg, config)
        n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if device.type == "cuda":
            module.cuda(device)
        if bf16:
            module = Float16Module(config, module)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            use_distributed_optimizer=distopt,
            bucket_size=max(1, t.bucket_cap_mb * 2**20 // 4),
            average_in_collective=False,
        )
        model = DistributedDataParallel(config, ddp_config, module)
        dense = None if state is not None else _DenseReductions(model, device)
        optimizer, optimizer_name = _optimizer(cfg, model, device, bf16, distopt)
        links = announce_links(cfg, rank, world, local_world, device)
        return _loop(
            cfg,
            config_name,
            rank,
            world,
            device,
            data,
            model,
            optimizer,
            state,
            dense,
            info={
                "engine": "megatron",
                "megatron_core": megatron_core.__version__,
                "distributed_optimizer": distopt,
                "optimizer": optimizer_name,
                "precision": precision,
                "parameters": n_params,
                "buckets": sum(len(g.buckets) for g in model.bucket_groups),
                "links": links,
            },
        )
    finally:
        if state is not None:
            disable()
        if owns_parallel_state:
            parallel_state.destroy_model_parallel()


def _loop(cfg, config_name, rank, world, device, data, model, optimizer, state, dense, info) -> pathlib.Path | None:
    t, seq = cfg.train, cfg.data.seq_len
    log = RunLog(cfg, config_name, rank, world, device, engine="megatron")

    # Megatron's attention mask: True where a query must not see a key.
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    positions = torch.arange(seq, device=device)[None].expand(t.micro_batch_size, seq)
    for step in range(t.iterations):
        lr = _lr_at(cfg, step)
        _set_schedule(optimizer, cfg, lr)
        batch = data.batch(step, rank, world, t.micro_batch_size, t.seed).to(device, non_blocking=True)
        _sync(device)
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        per_token = model(input_ids=batch[:, :-1], position_ids=positions, attention_mask=causal, labels=batch[:, 1:])
        loss = per_token.float().mean()
        loss.backward()
        model.finish_grad_sync()
        _, grad_norm, _ = optimizer.step()  # Megatron's (update made, norm before clipping, zeros)
        _sync(device)
        elapsed = time.perf_counter() - start

        if state is not None:
            s = state.summary()
            state.reset_stats()
            reduce_s, prune_s, sent, dense_bytes = s.reduce_seconds, s.prune_seconds, s.bytes_sent, s.dense_bytes
            density = s.density if s.elements else 1.0
            deferred, exchanges, choices = s.deferred, s.exchanges, choices_text(s.choices)
            log.calls(step, s.calls)
        else:
            reduce_s, prune_s, density = dense.seconds(), 0.0, 1.0
            deferred = exchanges = 0
            choices = ""
            sent = dense_bytes = dense.dense_bytes
            dense.reset_stats()
        log.record(
            step,
            elapsed,
            loss,
            lr,
            allreduce_s=reduce_s,
            prune_s=prune_s,
            density=density,
            bytes_sent=sent,
            dense_bytes=dense_bytes,
            deferred=deferred,
            exchanges=exchanges,
            choices=choices,
            # Megatron's chained optimizer reports a norm without clipping too: NaN there, as the DDP loop writes
            grad_norm=math.nan if grad_norm is None or cfg.optim.grad_clip <= 0 else float(grad_norm),
        )
    log.close()
    if rank != 0:
        return None

    return finish_run(
        cfg, config_name, log.run_dir, log.records, world, device, data, info, "run (megatron)", log.devices
    )


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m spccl_train.megatron.pretrain ...``: ``spccl-train --engine megatron ...`` (same flags)."""
    from ..cli import main as cli_main

    return cli_main(["--engine", "megatron", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    # Through the package module, so that spawned ranks unpickle spccl_train.megatron.pretrain's functions.
    from spccl_train.megatron.pretrain import main as _main

    sys.exit(_main())
