"""Typed experiment configs for the ``spccl-train`` trainer, loaded from YAML.

Every field has a default, a type and a docstring; YAML files and ``dotted.key=value``
overrides set fields, and anything unknown or out of range is a :class:`ConfigError` that
names the key, the value and what is allowed. ``spccl-train --config X.yaml`` accepts a path,
or the bare name of a config the project ships (``tiny_cpu``, ``gpt2_xl_spccl``, ...).
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing

import yaml

__all__ = [
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "ExperimentConfig",
    "ModelConfig",
    "OptimConfig",
    "OutputConfig",
    "SpcclCollectiveConfig",
    "SpcclConfig",
    "SpcclPruningConfig",
    "TrainConfig",
    "apply_overrides",
    "find_config",
    "from_dict",
    "load_config",
    "shipped_configs",
    "to_dict",
]

DEFAULT_CONFIG = "tiny_cpu"
"""What plain ``spccl-train`` runs."""


class ConfigError(ValueError):
    """A config file or override names an unknown key or holds a bad value."""


def _choices(*allowed: str) -> dict:
    return {"choices": allowed}


def _at_least(low: float, *, strict: bool = False) -> dict:
    return {"min": low, "strict": strict}


@dataclasses.dataclass
class ModelConfig:
    """The model, built with ``transformers`` from these sizes (random init, nothing downloaded)."""

    arch: str = dataclasses.field(default="gpt2", metadata=_choices("gpt2", "starcoder2"))
    """``gpt2`` (GPT2LMHeadModel) or ``starcoder2`` (Starcoder2ForCausalLM)."""
    n_layer: int = dataclasses.field(default=2, metadata=_at_least(1))
    """Transformer layers (GPT-2 XL: 48; StarCoder2-3B reduced: 28)."""
    hidden: int = dataclasses.field(default=128, metadata=_at_least(1))
    """Hidden size (GPT-2 XL: 1600; StarCoder2-3B: 3072)."""
    n_head: int = dataclasses.field(default=4, metadata=_at_least(1))
    """Attention heads; must divide ``hidden``."""
    n_kv_head: int = dataclasses.field(default=0, metadata=_at_least(0))
    """Key/value heads for grouped-query attention (starcoder2; 0: as many as ``n_head``)."""
    intermediate: int = dataclasses.field(default=0, metadata=_at_least(0))
    """MLP width (0: 4 x ``hidden``)."""
    vocab_size: int = dataclasses.field(default=4096, metadata=_at_least(2))
    """Rows of the embedding; at least the tokenizer's vocabulary (GPT-2: 50257; StarCoder2: 49152)."""
    max_position: int = dataclasses.field(default=1024, metadata=_at_least(1))
    """Longest sequence the position embedding covers; at least ``data.seq_len``."""
    rope_theta: float = dataclasses.field(default=10000.0, metadata=_at_least(0.0, strict=True))
    """Rotary embedding base (starcoder2)."""
    dropout: float = dataclasses.field(default=0.0, metadata={"min": 0.0, "max": 1.0})
    """Dropout probability everywhere (0 keeps runs with and without SpCCL comparable)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more compute)."""


@dataclasses.dataclass
class DataConfig:
    """Training text, tokenizer and batching. Everything is read from local files."""

    source: str = dataclasses.field(default="embedded", metadata=_choices("embedded", "wikitext103", "files"))
    """``embedded``: a corpus the project generates (nothing to provide); ``wikitext103``: from
    ``paths`` or the local HF datasets cache; ``files``: the text files or folders in ``paths``."""
    paths: list[str] = dataclasses.field(default_factory=list)
    """Files or folders (``files``), or the WikiText-103 folder (``wikitext103``: holding
    ``wiki.train.raw`` / ``wiki.train.tokens`` or ``train-*.parquet``)."""
    seq_len: int = dataclasses.field(default=128, metadata=_at_least(2))
    """Tokens per sample (the paper: 512)."""
    tokenizer: str = "bpe"
    """``bpe``: train a byte-level BPE on the corpus and cache it; otherwise a local path to a
    ``tokenizer.json`` file or a folder with one (a saved Hugging Face tokenizer)."""
    tokenizer_vocab_size: int = dataclasses.field(default=4096, metadata=_at_least(260))
    """Vocabulary of the trained BPE (``tokenizer: bpe``)."""
    tokenizer_train_bytes: int = dataclasses.field(default=20_000_000, metadata=_at_least(1))
    """Bytes of corpus text the BPE is trained on (the first ones)."""
    max_tokens: int = dataclasses.field(default=0, metadata=_at_least(0))
    """Tokenize at most this many tokens (0: the whole corpus)."""
    embedded_bytes: int = dataclasses.field(default=2_000_000, metadata=_at_least(10_000))
    """Size of the generated corpus (``embedded``)."""
    cache_dir: str = ""
    """Where tokenizers and token files are cached ("": ``$SPCCL_DATA_DIR`` or ``~/.cache/spccl_train/data``)."""


@dataclasses.dataclass
class OptimConfig:
    """AdamW (or BurstAdamW) with linear warm-up and cosine decay."""

    name: str = dataclasses.field(default="adamw", metadata=_choices("adamw", "burst_adamw"))
    """``adamw``: ``torch.optim.AdamW`` (``fused=True`` on GPUs, ``foreach`` on CPU). ``burst_adamw``: :class:`spccl_train.optim.BurstAdamW`, which
    reads a gradient that error feedback held back for ``a`` steps as ``a`` steps' worth (pair it
    with ``spccl.pruning.decay=1.0``; DDP engine only)."""
    max_age: int = dataclasses.field(default=0, metadata={"min": 0, "max": 255})
    """``burst_adamw``: the most steps one arriving gradient is read as (0: no cap below 255)."""
    max_burst: int = dataclasses.field(default=0, metadata={"min": 0, "max": 255})
    """``burst_adamw``: the most steps' worth a coordinate moves in one step; the rest of a longer
    burst moves on the next steps (0: each burst at once)."""
    lr: float = dataclasses.field(default=1e-3, metadata=_at_least(0.0))
    """Peak learning rate."""
    min_lr: float = dataclasses.field(default=1e-4, metadata=_at_least(0.0))
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iterations: int = dataclasses.field(default=10, metadata=_at_least(0))
    """Iterations of linear learning-rate warm-up."""
    weight_decay: float = dataclasses.field(default=0.1, metadata=_at_least(0.0))
    """AdamW weight decay."""
    beta1: float = dataclasses.field(default=0.9, metadata={"min": 0.0, "max": 1.0})
    """AdamW beta1."""
    beta2: float = dataclasses.field(default=0.95, metadata={"min": 0.0, "max": 1.0})
    """AdamW beta2."""
    eps: float = dataclasses.field(default=1e-8, metadata=_at_least(0.0, strict=True))
    """AdamW epsilon."""
    grad_clip: float = dataclasses.field(default=1.0, metadata=_at_least(0.0))
    """Clip the global gradient norm to this (0: no clipping)."""


@dataclasses.dataclass
class TrainConfig:
    """The loop: iterations, batch, precision, DDP buckets."""

    iterations: int = dataclasses.field(default=100, metadata=_at_least(1))
    """Optimizer steps (the paper: 100)."""
    warmup_iterations: int = dataclasses.field(default=20, metadata=_at_least(0))
    """First iterations left out of the summaries (the paper: 20 of 100)."""
    micro_batch_size: int = dataclasses.field(default=2, metadata=_at_least(1))
    """Samples per rank per iteration (the paper: 2)."""
    seed: int = 1234
    """Seeds the weights, the data order and the pruning sampler: runs are reproducible."""
    precision: str = dataclasses.field(default="auto", metadata=_choices("auto", "bf16", "fp32"))
    """``auto``: bf16 autocast on GPUs that support it, fp32 elsewhere."""
    device: str = dataclasses.field(default="auto", metadata=_choices("auto", "cpu", "cuda"))
    """``auto``: one GPU per rank when CUDA is available, else CPU."""
    bucket_cap_mb: int = dataclasses.field(default=256, metadata=_at_least(1))
    """DDP gradient bucket size; large buckets suit sparse all-reduce (DDP's own default is 25)."""


@dataclasses.dataclass
class DistConfig:
    """Processes and backend."""

    backend: str = dataclasses.field(default="auto", metadata=_choices("auto", "gloo", "nccl"))
    """``auto``: NCCL on GPUs, gloo on CPU."""
    nproc_per_node: int = dataclasses.field(default=1, metadata=_at_least(1))
    """Ranks to start when ``spccl-train`` is run without torchrun (with torchrun, its own count wins)."""
    ranks_per_node: int = dataclasses.field(default=0, metadata=_at_least(0))
    """Ranks per node for SpCCL's link-aware thresholds (0: torchrun's ``LOCAL_WORLD_SIZE``)."""
    emulate_nodes: int = dataclasses.field(default=0, metadata=_at_least(0))
    """Split this host's ranks into this many emulated nodes joined by NCCL's socket transport
    (:mod:`spccl_train.emulation`; 0 or 1: off). Works with several ranks per GPU; sets
    ``ranks_per_node`` to match. At start rank 0 prints the inter-node bandwidth it measured."""


@dataclasses.dataclass
class SpcclPruningConfig:
    """Pruning with error feedback (``spccl_train.pruning.PruneConfig``'s fields; its ``seed`` is
    ``train.seed``)."""

    density: float = dataclasses.field(default=0.01, metadata={"min": 0.0, "max": 1.0, "strict": True})
    """Fraction of each bucket kept (0.01: 99% sparse)."""
    sample_fraction: float = dataclasses.field(default=0.001, metadata={"min": 0.0, "max": 1.0, "strict": True})
    """Fraction of each bucket sampled to find the pruning threshold."""
    decay: float = dataclasses.field(default=0.9, metadata={"min": 0.0, "max": 1.0})
    """Leak of the error feedback (0: forget what was pruned)."""
    error_dtype: str = dataclasses.field(default="float32", metadata=_choices("float32", "bfloat16", "float16"))
    """Dtype of the error-feedback buffers."""
    warmup_steps: int = dataclasses.field(default=0, metadata=_at_least(0))
    """Density warm-up (Deep Gradient Compression's): over this many sparse iterations, counted
    from the first one after ``spccl.dense_iterations``, the kept fraction decays exponentially
    from 1 to ``density`` (``density ** ((s + 1) / (warmup_steps + 1))`` at sparse iteration
    ``s``); ``density`` from iteration ``dense_iterations + warmup_steps`` on. 0: no warm-up."""


@dataclasses.dataclass
class SpcclCollectiveConfig:
    """The sparse all-reduce (``spccl_train.collectives.CollectiveConfig``'s fields; its nodes come
    from ``dist``)."""

    format: str = dataclasses.field(default="auto", metadata=_choices("auto", "pici", "coo", "dense"))
    """Wire format of the sparse all-reduce."""
    algorithm: str = dataclasses.field(default="auto", metadata=_choices("auto", "ring", "direct", "hierarchical"))
    """Algorithm of the sparse all-reduce (``hierarchical``: reduce inside each node, across nodes,
    gather inside each node; :mod:`spccl_train.collectives.hierarchical`)."""
    cost_model: str = dataclasses.field(default="measured", metadata=_choices("measured", "default"))
    """What ``auto`` weighs with: ``measured`` probes the links and codecs at the start and corrects
    itself from observed call times; ``default`` uses the fixed figures of ``CostModel.default``
    (no probe)."""
    cuda_graphs: bool = False
    """With ``spccl.capacity_factor``, on GPUs: replay each bucket's bounded reduction from a
    captured CUDA graph, so it costs ~0.1 ms of host time."""


@dataclasses.dataclass
class SpcclConfig:
    """Sparse gradient reduction (``--use-spccl`` sets ``enabled``): the fields of
    ``spccl_train.SparseConfig``, the one config both engines take, with its two sections
    ``pruning`` and ``collective``, and the trainer's own ``enabled``, ``exact_across_nodes`` and
    ``overlap``."""

    enabled: bool = False
    """Reduce gradients with SpCCL instead of the dense collective."""
    prune: bool = True
    """Sampled top-k pruning with error feedback; ``false`` reduces the full gradients exactly."""
    pruning: SpcclPruningConfig = dataclasses.field(default_factory=SpcclPruningConfig)
    """Density, threshold sampling, error feedback, density warm-up."""
    collective: SpcclCollectiveConfig = dataclasses.field(default_factory=SpcclCollectiveConfig)
    """Format, algorithm, cost model, CUDA graphs of the sparse all-reduce."""
    dense_iterations: int = dataclasses.field(default=1, metadata=_at_least(1))
    """First iterations reduced densely (DDP rebuilds its buckets after the first)."""
    capacity_factor: float = dataclasses.field(default=0.0, metadata=_at_least(0.0))
    """0: every sparse all-reduce plans from exchanged nonzero counts (a host synchronisation per
    bucket). ``f >= 1``: after a bucket's first sparse iteration, each piece of it keeps at most
    ``f`` times its share of ``pruning.density`` (the excess waits in the error buffer) and the
    all-reduce is planned from those bounds, with no host synchronisation (both engines; see
    ``spccl_train.SparseConfig``)."""
    exact_across_nodes: bool = True
    """With ``capacity_factor``: where the group spans nodes (``dist.ranks_per_node`` or emulated
    nodes), plan every all-reduce from exchanged counts instead, so that exactly the nonzeros go
    on the wire. Bounds save a host synchronisation per bucket (tens of microseconds on NVLink, a
    few milliseconds of socket latency) but pad each piece to ``capacity_factor`` times its share:
    9.1% of the dense bytes instead of about 3% for GPT-2 XL on 2 ranks, which on a network 10-50x
    slower than NVLink costs far more than the synchronisation. ``false``: bounds everywhere."""
    prune_to_wire: bool = True
    """Prune each bucket straight into the sparse all-reduce's Pici payloads where it sends them as
    they are (``spccl_train.SparseConfig.prune_to_wire``): one pass instead of two; costs a payload
    buffer about the size of each such bucket. ``false``: prune in place, then encode."""
    overlap: str = dataclasses.field(default="off", metadata=_choices("auto", "on", "off", "stream"))
    """Where buckets are pruned and reduced: ``off`` in line on the current stream, ``stream`` on a
    side CUDA stream from the hook's thread, ``on`` on a background thread and side stream
    (``auto``: ``on`` on GPUs). Off by default; the 4 H200 measurements of each are in
    examples/gpt2_xl."""


@dataclasses.dataclass
class OutputConfig:
    """Where runs are written."""

    dir: str = "runs"
    """Parent folder of run folders."""
    name: str = ""
    """Run folder name ("": ``<config>-<dense|spccl>-<time>``)."""
    plot: bool = True
    """Write ``report.png`` (loss and time breakdown) at the end."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    calls: bool = False
    """Write ``calls.csv``: every SpCCL reduction of the run as rank 0 saw it (iteration, bucket,
    the candidate ``auto`` ran, trial or not, whether its input came as Pici payloads, predicted and
    measured milliseconds, bytes, every candidate's price): what ``auto`` did, bucket by bucket."""


@dataclasses.dataclass
class ExperimentConfig:
    """One training run."""

    description: str = ""
    """What the run is for (free text)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model sizes."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Corpus, tokenizer, batching."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Loop."""
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)
    """Processes."""
    spccl: SpcclConfig = dataclasses.field(default_factory=SpcclConfig)
    """Sparse all-reduce."""
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    """Run folders."""

    def validate(self) -> None:
        """Cross-field checks (single fields are checked as they are set)."""
        m, d, t = self.model, self.data, self.train
        if m.hidden % m.n_head:
            raise ConfigError(f"model.hidden={m.hidden} is not a multiple of model.n_head={m.n_head}")
        if m.n_kv_head and m.n_head % m.n_kv_head:
            raise ConfigError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head}")
        if d.seq_len > m.max_position:
            raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_position={m.max_position}: raise the latter")
        if t.warmup_iterations >= t.iterations:
            raise ConfigError(
                f"train.warmup_iterations={t.warmup_iterations} leaves no iteration of train.iterations="
                f"{t.iterations} to summarise: make it smaller"
            )
        if d.source == "files" and not d.paths:
            raise ConfigError("data.source=files needs data.paths: the text files or folders to train on")
        if d.tokenizer == "bpe" and d.tokenizer_vocab_size > m.vocab_size:
            raise ConfigError(
                f"data.tokenizer_vocab_size={d.tokenizer_vocab_size} exceeds model.vocab_size={m.vocab_size}"
            )
        for key in ("max_age", "max_burst"):
            if getattr(self.optim, key) and self.optim.name != "burst_adamw":
                raise ConfigError(f"optim.{key}={getattr(self.optim, key)} applies to optim.name=burst_adamw only")
        s = self.spccl
        if 0 < s.capacity_factor < 1:
            raise ConfigError(
                f"spccl.capacity_factor={s.capacity_factor}: use 0 (plan from exchanged counts) or a factor >= 1"
            )
        if s.capacity_factor and not s.prune:
            raise ConfigError("spccl.capacity_factor needs spccl.prune=true: without pruning nothing bounds a bucket")
        if s.collective.cuda_graphs and not s.capacity_factor:
            raise ConfigError(
                "spccl.collective.cuda_graphs=true needs spccl.capacity_factor >= 1: only all-reduces planned from bounds "
                "are captured (the others synchronise with the host to plan)"
            )


def _check_value(where: str, field: dataclasses.Field, hint: object, value: object) -> object:
    """Coerce ``value`` to the field's type (ints widen to floats) or raise a ConfigError."""
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}={value!r}: expected a list of strings, e.g. {where}=[a.txt,b.txt]")
        return list(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected true or false")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: expected an integer")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r}: expected a number")
        value = float(value)
    elif hint is str:
        if isinstance(value, bool) and {"on", "off"} <= set(field.metadata.get("choices", ())):
            value = "on" if value else "off"  # YAML 1.1 reads on/off as booleans
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r}: expected a string")
    meta = field.metadata
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{where}={value!r}: expected one of {', '.join(meta['choices'])}")
    if "min" in meta:
        low, strict = meta["min"], meta.get("strict", False)
        if value < low or (strict and value == low):
            raise ConfigError(f"{where}={value!r}: must be {'>' if strict else '>='} {low}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{where}={value!r}: must be <= {meta['max']}")
    return value


def _set(cfg: ExperimentConfig, dotted: str, value: object) -> None:
    parts = dotted.split(".")
    target: object = cfg
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(target)}
        where = ".".join(parts[: depth + 1])
        if part not in fields:
            scope = ".".join(parts[:depth]) or "the config"
            raise ConfigError(f"unknown key {where!r} in {scope}: known keys are {', '.join(fields)}")
        hint = typing.get_type_hints(type(target))[part]
        if dataclasses.is_dataclass(hint):
            if depth == len(parts) - 1:
                if not isinstance(value, dict):
                    raise ConfigError(f"{where}: expected a mapping of its keys, got {value!r}")
                for key, sub in value.items():
                    _set(cfg, f"{where}.{key}", sub)
                return
            target = getattr(target, part)
            continue
        if depth != len(parts) - 1:
            raise ConfigError(f"{where} is a value, not a section: cannot set {dotted!r}")
        setattr(target, part, _check_value(where, fields[part], hint, value))


def shipped_configs() -> dict[str, pathlib.Path]:
    """The YAML configs the project ships, by name (repository ``configs/`` or the installed copy)."""
    here = pathlib.Path(__file__).resolve().parent
    for folder in (here.parent.parent / "configs", here.parent / "configs"):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return {p.stem: p for p in sorted(folder.glob("*.yaml"))}
    return {}


def find_config(name_or_path: str) -> pathlib.Path:
    """A config path: an existing file, else a shipped config by name or file name."""
    path = pathlib.Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_configs()
    key = path.name.removesuffix(".yaml").removesuffix(".yml")
    if key in shipped:
        return shipped[key]
    raise ConfigError(
        f"config {name_or_path!r} not found: give a YAML path or one of the shipped configs: "
        f"{', '.join(shipped) or '(none found)'}"
    )


def load_config(name_or_path: str | None = None, overrides: typing.Sequence[str] = ()) -> ExperimentConfig:
    """Read a YAML config (default: ``tiny_cpu``), apply ``dotted.key=value`` overrides, validate."""
    path = find_config(name_or_path or DEFAULT_CONFIG)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    cfg = ExperimentConfig()
    try:
        for key, value in data.items():
            _set(cfg, str(key), value)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        apply_overrides(cfg, overrides)
    except ConfigError as exc:
        where = f"{path} with overrides {' '.join(overrides)}" if overrides else str(path)
        raise ConfigError(f"{where}: {exc}") from None
    return cfg


def apply_overrides(cfg: ExperimentConfig, overrides: typing.Sequence[str]) -> ExperimentConfig:
    """Apply ``dotted.key=value`` strings (values parsed as YAML: ``3``, ``true``, ``[a,b]``); validate."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. train.iterations=10")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from exc
        _set(cfg, key.strip(), value)
    cfg.validate()
    return cfg


def to_dict(cfg: ExperimentConfig) -> dict:
    """The config as plain data (for run folders and reports)."""
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> ExperimentConfig:
    """Rebuild a config written by :func:`to_dict`."""
    cfg = ExperimentConfig()
    for key, value in data.items():
        _set(cfg, key, value)
    return cfg
