"""Sparse collectives against dense torch.distributed, nccl-tests style: time, algbw / busbw, speedups.

Every point is one collective (all-reduce, all-gather, reduce-scatter) x method x dtype x input
pattern x size x sparsity, timed on every rank of a torchrun job. Methods:

- ``nccl``: the backend's dense collective (``torch.distributed``; NCCL on GPUs, gloo under
  ``--smoke``), the baseline, measured in the same run on the same inputs;
- ``naive_coo``: exact sparse collectives in plain torch, the baseline any design must beat
  (``shared/design/GPU.md``). All-reduce: ``nonzero`` -> int32 indices + values, all-gather of
  the counts (one host sync), all-gather of the indices and values padded to the largest count,
  ``zero_`` + one ``index_add_`` per rank. All-gather: the same on each rank's input, each block
  added at its rank's offset of the zeroed output. Reduce-scatter: ``nonzero`` of the input,
  split by destination chunk, ``all_to_all_single`` of the counts (one host sync), then of the
  indices and values, ``zero_`` + ``index_add_``;
- ``<format>/<algorithm>``: ``spccl_train`` with ``CollectiveConfig(format, algorithm)``:
  ``auto/auto`` (what a user gets), and ``pici``, ``coo``, ``auto`` each with ``ring`` and
  ``direct``; ``--channels`` and ``--thresholds-sweep`` repeat them per channel count and
  threshold scale. Methods that choose nothing (a format and the ring or direct algorithm given)
  run on a process group of their own, so that what their calls teach the measured model's corrections
  (``spccl_train/collectives/feedback.py``, per group) is not ``auto``'s to use: in training
  ``auto`` learns from its own calls alone.

Sizes are those of the full tensor, the nccl-tests convention: for all-reduce the tensor
(input = output); for all-gather the OUTPUT (each rank's input is size / world); for
reduce-scatter the INPUT (each rank's output is size / world). algbw = size / time;
busbw = algbw x 2(p-1)/p for all-reduce and algbw x (p-1)/p for all-gather and reduce-scatter
(GB/s = 1e9 bytes/s). ``sparsity`` is in percent.

Input patterns (values ``randn`` per rank; ``sparsity`` is each rank's fraction of zeros):
``iid`` every element nonzero with probability 1 - sparsity, a distinct seed per rank (the
paper's setting, pessimistic for fill-in); ``identical`` one support shared by all ranks
(no fill-in); ``disjoint`` supports that never overlap (worst fill-in: each rank keeps a
disjoint 1/world share of the positions when sparsity < 1 - 1/world, so its sparsity is then
1 - 1/world); ``clustered`` i.i.d. blocks of ``--block`` elements, all nonzero or all zero,
a distinct seed per rank. ``input_sparsity`` and ``output_sparsity`` record what was drawn and
what the dense result holds.

Timing: per point one verification call, ``--warmup`` untimed calls (``auto`` methods with
``--settle N``: up to N more, until two calls in a row run the same candidate, neither a trial of a
near-tied one, with the same predictions within 2% (the model did not move between them: a kind's
first observation reaches it two calls after it ran, so the first two equal choices at a new size
class can precede all its learning); the CSV's ``settle`` says how many). Once every method of
a case is ready, their ``--iters`` timed calls (``--iters-large`` at >= 256 MiB) go in turns, one
call of each method per turn, so that all methods are timed across the same windows (over sockets
one plan's time moves by 10-15% between windows a minute apart). Each timed call comes after an
untimed copy of the pristine input (an all-reduce works in place), a device sync and a barrier,
and is timed on the host up to a device sync (the calls synchronise the host once or twice
themselves, so host time is what a caller waits). Reported: the median over iterations of the
slowest rank's time. The counts shrink so that a point
takes about ``--point-budget-s`` when its first call is slow. ``predicted_ms`` is the cost model's
prediction for the plan that ran (for ``nccl``, the model's native-dense prediction from the
``auto/auto`` call); ``chosen`` is what the first call ran, and ``a>b`` when later calls of the
point ran ``b`` (``auto``'s measured model corrects itself from the calls it observes:
``spccl_train/collectives/feedback.py``; the run ends by printing what it learned, also in the
CSV's ``corrections``); ``bytes_ratio`` is bytes sent over a dense ring's, summed over ranks.
``--trace`` writes ``<stem>_trace.csv`` beside the table: every call of the ``auto`` methods in
order (verification, warm-up, settling, timed), with the candidate it ran, whether it was a trial,
rank 0's time and every candidate's corrected prediction, to see why ``auto`` chose what it did.
Memory per rank: the input, its working copy or the output, the reference and the tolerance (4
full-size buffers for a 1 GiB all-reduce), freed after each case.

Verification of every point, on its first and last call, against the dense collective of the
same inputs: all-gather bit for bit; all-reduce and reduce-scatter within 2 x world x unit
roundoff x (sum over ranks of |x|) elementwise (both sides are sums of ``world`` terms in
different orders), which also makes positions that are zero on every rank exactly zero; the
decoders' status clean on every call; all-gather and reduce-scatter inputs unchanged. Any
failure, or an exception on any rank, gives ``verified`` False (the point's ``error`` says why),
the run goes on, and it exits with status 1. Status 3: every point passed but
``--time-limit-s`` cut the run short. The default grid (486 points) is estimated at about 2
minutes on 4 H200s after start-up, plus a minute or two when the kernels compile on first use.

On the GPU machine (4 H200s; the default grid: fp32 i.i.d., 64 MiB / 256 MiB / 1 GiB,
sparsity 0-99.9 %, every method)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc-per-node=4 bench/bench_collectives.py --out-dir "$OUT"

Add ``--patterns all`` for the structured patterns, ``--channels 1,2,4`` and
``--thresholds-sweep`` for the sweeps, ``--cuda-graphs`` to time the spccl methods replayed from
CUDA graphs (``CollectiveConfig.cuda_graphs``: one count exchange per call, then a replay),
``--check-calls first`` to run them with ``CollectiveConfig.check_calls="first"`` (``auto`` holds
a shape whose last exchanged call went native, or that no sparse candidate could win, with no
exchange; the points of one size share a shape, so each case starts with the holds released,
``collectives.release_holds``, as where a job's sparsity changes: its first call sees its data,
where a hold left by the sparsity before would see it up to 16 calls later). Here, to check the
script (CPU, gloo, tiny sizes)::

    torchrun --standalone --nproc-per-node=2 bench/bench_collectives.py --smoke --out-dir /tmp/x

Writes ``collectives_<device>x<world>[_<N>nodes]_<date>.csv`` (``_2``, ``_3``, ... after it
when that file exists; ``_<N>nodes`` under ``--emulate-nodes N``) and speedup heatmaps like the paper's
(``..._<collective>_<pattern>_<dtype>.png``: rows sparsity, columns size, speedup over
``nccl``, a panel per method; with a sweep also ``..._sweep.png``: rows the channel count and
threshold scale, columns sparsity, at the largest size) into ``--out-dir``; only rank 0 writes
and prints, and ends with issue 3's acceptance points. The commit is
``$SPCCL_GIT_COMMIT`` if set, else ``git rev-parse --short HEAD``, else ``unknown``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import os
import pathlib
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

# NVLink multicast can take the lent machines' GPUs out of service (shared/design/GPU.md).
for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _value)

_REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))

import benchlib  # noqa: E402 (a sibling module: the script's folder is on sys.path)

import spccl_train
from spccl_train._ext import KernelsUnavailableError, load_kernels
from spccl_train._provenance import git_commit
from spccl_train.collectives import (
    DEFAULT_THRESHOLDS,
    CollectiveConfig,
    CollectiveStats,
    Thresholds,
    Topology,
    clearing_graphs,
    last_stats,
    learned_corrections,
    release_holds,
)
from spccl_train.collectives.links import measured_model
from spccl_train.emulation import emulate_nodes as emulate_nodes_env
from spccl_train.formats import Format
from spccl_train.transport import P2PTransport
from spccl_train.transport.dense import all_gather_flat, reduce_scatter_flat

__all__ = ["main"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
_PATTERNS = ("iid", "identical", "disjoint", "clustered")
_SPCCL_METHODS = ("auto/auto", "pici/ring", "pici/direct", "coo/ring", "coo/direct", "auto/ring", "auto/direct")
_METHODS = ("nccl", "naive_coo", *_SPCCL_METHODS)
_ON_REQUEST = ("pici/hierarchical", "coo/hierarchical", "auto/hierarchical")
"""Methods run only when named: the hierarchical collectives need nodes (``--ranks-per-node`` or
``--emulate-nodes`` with several ranks per node; with one level they are the flat call)."""
_DEFAULT_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5)
_LARGE = 256 << 20
_COMPARE_CHUNK = 1 << 26  # elements per slice when comparing, to bound the temporaries
# Acceptance targets of issue 3 on 4 H200s, fp32 i.i.d.: (collective, size, sparsity, speedup over nccl).
_TARGETS = (
    ("all_reduce", 1 << 30, 99.0, 4.0),
    ("all_reduce", 1 << 30, 95.0, 2.0),
    ("all_gather", 1 << 30, 99.0, 4.0),
    ("reduce_scatter", 1 << 30, 99.0, 3.0),
    ("all_reduce", 256 << 20, 99.0, 2.5),
)
_AUTO_FLOOR = 0.95
_AUTO_FLOOR_FROM = 64 << 20
# torch renamed these (the old names warn on newer versions); the GPU machine's torch may predate the new ones.


@dataclasses.dataclass(frozen=True, slots=True)
class _Settings:
    """What one run measures and how."""

    collectives: list[str]
    methods: list[str]
    sizes: list[int]
    sparsities: list[float]
    patterns: list[str]
    dtypes: list[str]
    channels: list[int]
    scales: list[float]
    warmup: int
    settle: int
    """``auto`` methods: more untimed calls, at most this many, until two calls in a row run the
    same candidate with the same predictions (the measured model settles on a choice, as a training
    run's repeated buckets let it)."""
    iters: int
    iters_large: int
    point_budget_s: float
    time_limit_s: float
    block: int
    seed: int
    ranks_per_node: int | None
    emulate_nodes: int
    """Emulated nodes on this host (``spccl_train.emulation``; 0: none)."""
    trace: bool
    """Keep every call of the ``auto`` methods (:data:`_TRACE_FIELDS`) for ``<stem>_trace.csv``."""
    out_dir: pathlib.Path
    plot: bool
    smoke: bool
    graphs: bool = False
    check_calls: str = "every"
    """``CollectiveConfig.check_calls`` of the spccl methods."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Method:
    """One way to run a collective: ``nccl``, ``naive_coo`` or a spccl config."""

    name: str
    fmt: str = ""
    algorithm: str = ""
    channels: int = 1
    scale: float = 1.0
    config: CollectiveConfig | None = None

    @property
    def label(self) -> str:
        """The method with its channel count and threshold scale where they are not the defaults."""
        extra = (f" ch{self.channels}" if self.channels != 1 else "") + (
            f" th{self.scale:g}" if self.scale != 1 else ""
        )
        return self.name + extra


@dataclasses.dataclass(slots=True)
class _Case:
    """The inputs of one (collective, dtype, pattern, size, sparsity) and the dense reference result."""

    collective: str
    dtype_name: str
    dtype: torch.dtype
    pattern: str
    sparsity: float
    size_bytes: int
    x0: torch.Tensor
    """This rank's pristine input (never handed to an in-place call)."""
    fingerprint: int
    """Sum of ``x0``'s bits, to check inputs that must stay unchanged."""
    ref: torch.Tensor
    """The dense collective's result on this rank."""
    tol: torch.Tensor | None
    """Elementwise float32 tolerance of sums (``None``: all-gather, exact)."""
    work: torch.Tensor | None = None
    """All-reduce: the in-place buffer, refilled from ``x0`` before every call."""
    out: torch.Tensor | None = None
    """All-gather / reduce-scatter: the output buffer."""
    input_sparsity: float = 0.0
    output_sparsity: float = 0.0

    def result(self) -> torch.Tensor:
        return self.work if self.collective == "all_reduce" else self.out


@dataclasses.dataclass(slots=True)
class _Row:
    """One measured point."""

    collective: str
    method: str
    fmt: str
    algorithm: str
    channels: int
    threshold_scale: float
    thresholds: str
    dtype: str
    pattern: str
    size_bytes: int
    sparsity: float
    input_sparsity: float
    output_sparsity: float
    time_ms: float = math.nan
    time_min_ms: float = math.nan
    time_max_ms: float = math.nan
    algbw: float = math.nan
    busbw: float = math.nan
    bytes_sent: int = 0
    dense_bytes: int = 0
    chosen: str = ""
    message_formats: str = ""
    predicted_ms: float | None = None
    native_predicted_ms: float | None = None
    """The cost model's prediction for the native dense call (from ``auto`` configs; not written)."""
    speedup_vs_nccl: float | None = None
    speedup_vs_naive: float | None = None
    auto_vs_best: float | None = None
    """``auto/auto`` rows: their time over the best fixed candidate's (``nccl`` or a pici / coo
    method with ring or direct) at the same point; 1.0 is as good as the best."""
    timed_chosen: str = ""
    """The candidates the timed calls ran (``"direct/pici"``; several, ``>``-separated, where they
    changed), without the verification, warm-up and settling calls that :attr:`chosen` includes."""
    fastest_vs_best: float | None = None
    """``auto/auto`` rows: their fastest timed call over the fastest of the best fixed candidate's
    (the candidate with the best median). Over sockets a call now and then stalls 15-30 ms longer
    than its like (every method alike); with few timed calls this tells such stalls from a cost
    every call of ``auto`` pays."""
    choice_vs_best: float | None = None
    """``auto/auto`` rows whose timed calls ran one fixed candidate: that candidate's own time
    (its fixed method's row) over the best fixed candidate's. Against :attr:`auto_vs_best` it tells
    a wrong choice from the right one that cost more as ``auto``'s call (its planning, its model's
    exchanges)."""
    choice: _Row | None = None
    """``auto/auto`` rows whose timed calls ran one fixed candidate: that candidate's row (not written)."""
    exchanges: str = ""
    """The spccl calls' planning exchanges, per timed call (``"1 1 2"``): an all-reduce whose gather
    phase was measured pays a second one, a call run native under ``check_calls="first"`` none."""
    gather_counts: str = ""
    """All-reduce: how the timed calls sized their gather phases (``"bound"``, ``"measured"``;
    several, separated by ``>``, where they changed)."""
    warmup: int = 0
    settle: int = 0
    """Untimed calls ``--settle`` gave ``auto`` before timing (0 for fixed methods)."""
    iters: int = 0
    peak_mem_gib: float = 0.0
    host_ms: float = math.nan
    """Median over the timed calls of the time from the call's start to its return (the slowest
    rank's of each call): what the host spent in it, its waits on the device included."""
    device_allocs: int = 0
    """Device memory the caching allocator took from the driver (``cudaMalloc``) over the timed
    calls (each with its input's reset and its gate), the most of any rank: each such allocation
    synchronises, so a nonzero count says the allocator, not the method, cost some of the time."""
    verified: bool = False
    error: str = ""

    @property
    def bytes_ratio(self) -> float | None:
        return self.bytes_sent / self.dense_bytes if self.dense_bytes else None


@dataclasses.dataclass(frozen=True, slots=True)
class _Env:
    """This process's place in the job."""

    rank: int
    world: int
    device: torch.device
    backend: str
    fixed_group: dist.ProcessGroup
    """The group of the methods that choose nothing (every rank; its own corrections)."""
    trace: list[dict[str, object]] | None = None
    """``--trace``: a record of every ``auto`` call so far (:func:`_timed_call`)."""


# ---------------------------------------------------------------------------------------
# Arguments


def _parse_scale(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"threshold scale {text!r} must be positive (1 keeps the defaults)")
    return value


def _choice(options: tuple[str, ...], what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        name = text.strip().lower()
        if name not in options:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not one of {', '.join(options)}")
        return name

    return parse


def _list_of(parse: Callable[[str], object], every: tuple[str, ...] = ()) -> Callable[[str], list]:
    def parse_list(text: str) -> list:
        if every and text.strip().lower() == "all":
            return list(every)
        items = [parse(item) for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one value")
        return list(dict.fromkeys(items))

    return parse_list


def _settings(argv: list[str] | None) -> _Settings:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--collectives",
        type=_list_of(_choice(_COLLECTIVES, "collective"), _COLLECTIVES),
        default=list(_COLLECTIVES),
        help="all_reduce,all_gather,reduce_scatter or all (default all)",
    )
    parser.add_argument(
        "--methods",
        type=_list_of(_choice((*_METHODS, *_ON_REQUEST), "method"), _METHODS),
        default=list(_METHODS),
        help=f"some of {','.join(_METHODS)}, or all (default all); also {','.join(_ON_REQUEST)} (on request)",
    )
    parser.add_argument(
        "--sizes",
        type=_list_of(benchlib.parse_size),
        help="full tensor sizes in bytes (default 64M,256M,1G; smoke 64K,256K)",
    )
    parser.add_argument(
        "--sparsities",
        type=_list_of(benchlib.parse_sparsity),
        help="percent (default 0,50,90,95,99,99.9; smoke 0,90,99.9)",
    )
    parser.add_argument(
        "--patterns",
        type=_list_of(_choice(_PATTERNS, "pattern"), _PATTERNS),
        help="iid,identical,disjoint,clustered or all (default iid; smoke all)",
    )
    parser.add_argument(
        "--dtype",
        type=_list_of(_choice(tuple(_DTYPES), "dtype")),
        default=["fp32"],
        help="fp32,bf16,fp16, one or several (default fp32)",
    )
    parser.add_argument(
        "--channels",
        type=_list_of(int),
        default=[1],
        help="pieces per chunk of the spccl calls, e.g. 1,2,4 (default 1)",
    )
    parser.add_argument(
        "--thresholds-sweep",
        type=_list_of(_parse_scale),
        nargs="?",
        const=list(_DEFAULT_SCALES),
        default=[1.0],
        metavar="SCALES",
        help="run the pici and coo methods with their default thresholds (intra, inter, ag) times each scale, capped "
        f"at 1 (default scale 1 only; the flag alone: {','.join(f'{s:g}' for s in _DEFAULT_SCALES)}); "
        "auto methods keep the defaults",
    )
    parser.add_argument("--warmup", type=int, help="untimed calls after the verification call (default 2; smoke 0)")
    parser.add_argument(
        "--settle",
        type=int,
        default=0,
        help="auto methods: up to this many more untimed calls, until two in a row run the same candidate, neither a trial "
        "(the calls auto spent are in the CSV's settle column and its choices in chosen; default 0)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="write every call of the auto methods (verification, warm-up, settling, timed) to <csv stem>_trace.csv: "
        "the candidate it ran, whether a trial, its prediction and time, and every candidate's corrected prediction",
    )
    parser.add_argument("--iters", type=int, help="timed calls below 256 MiB, median taken (default 10; smoke 2)")
    parser.add_argument("--iters-large", type=int, help="timed calls at >= 256 MiB (default 5)")
    parser.add_argument(
        "--point-budget-s",
        type=float,
        default=2.0,
        help="fewer warm-up and timed calls when the first call says a point would take longer (default 2 s)",
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=0.0,
        help="skip the remaining cases once the run has taken this long; 0: no limit (default)",
    )
    parser.add_argument(
        "--emulate-nodes",
        type=int,
        default=0,
        metavar="N",
        help="split this host's ranks into N emulated nodes joined by NCCL's socket transport "
        "(spccl_train.emulation; several ranks may share a GPU); ranks_per_node follows",
    )
    parser.add_argument("--block", type=int, default=4096, help="elements per block of the clustered pattern")
    parser.add_argument("--seed", type=int, default=1234, help="base seed of the inputs")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        help="CollectiveConfig.ranks_per_node (default $LOCAL_WORLD_SIZE, all ranks on one node without it)",
    )
    parser.add_argument(
        "--out-dir", type=pathlib.Path, default=_REPO / "bench" / "results", help="where the CSV and PNGs go"
    )
    parser.add_argument("--no-plot", action="store_true", help="write no heatmaps")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="run the spccl methods with CollectiveConfig(cuda_graphs=True): on GPUs a call replays a CUDA graph "
        "from its third run on (output names end in _graphs)",
    )
    parser.add_argument(
        "--check-calls",
        choices=("every", "first"),
        default="every",
        help="CollectiveConfig.check_calls of the spccl methods: 'first' lets auto run a shape whose last exchanged "
        "call went native with no count exchange for a while (output names end in _first; default every)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="check the script on the CPU (gloo): tiny sizes, few iterations"
    )
    args = parser.parse_args(argv)
    if args.emulate_nodes < 0:
        parser.error(f"--emulate-nodes {args.emulate_nodes} must be 0 (off) or a number of nodes")
    for name in ("warmup", "iters", "iters_large"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} {value} is too small")
    if any(not 1 <= c <= 64 for c in args.channels):
        parser.error(f"--channels {args.channels}: each must be from 1 to 64")
    if args.block < 1:
        parser.error("--block must be positive")
    smoke = args.smoke
    iters = args.iters or (2 if smoke else 10)
    rpn = args.ranks_per_node or (int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None)
    if args.emulate_nodes > 1 and "LOCAL_WORLD_SIZE" in os.environ:
        rpn = args.ranks_per_node or int(os.environ["LOCAL_WORLD_SIZE"]) // args.emulate_nodes
    return _Settings(
        collectives=args.collectives,
        methods=[m for m in (*_METHODS, *_ON_REQUEST) if m in args.methods],
        sizes=sorted(args.sizes or ([64 << 10, 256 << 10] if smoke else [64 << 20, 256 << 20, 1 << 30])),
        sparsities=args.sparsities or ([0.0, 90.0, 99.9] if smoke else [0.0, 50.0, 90.0, 95.0, 99.0, 99.9]),
        patterns=args.patterns or (list(_PATTERNS) if smoke else ["iid"]),
        dtypes=args.dtype,
        channels=args.channels,
        scales=args.thresholds_sweep,
        warmup=args.warmup if args.warmup is not None else (0 if smoke else 2),
        settle=args.settle,
        iters=iters,
        iters_large=args.iters_large or (iters if smoke else 5),
        point_budget_s=args.point_budget_s,
        time_limit_s=args.time_limit_s,
        block=args.block,
        seed=args.seed,
        ranks_per_node=rpn,
        out_dir=args.out_dir,
        plot=not args.no_plot,
        smoke=smoke,
        graphs=args.cuda_graphs,
        check_calls=args.check_calls,
        emulate_nodes=args.emulate_nodes,
        trace=args.trace,
    )


def _methods(settings: _Settings) -> list[_Method]:
    """The grid of methods: the baselines once, each spccl config per channel count and threshold scale."""
    out = []
    for name in settings.methods:
        if name in ("nccl", "naive_coo"):
            out.append(_Method(name))
            continue
        fmt, algorithm = name.split("/")
        for channels in settings.channels:
            for scale in [1.0] if fmt == "auto" else settings.scales:
                if scale == 1.0:
                    thresholds = Thresholds()
                else:
                    base = DEFAULT_THRESHOLDS[Format(fmt)]
                    thresholds = Thresholds(
                        intra=min(1.0, base.intra * scale),
                        inter=min(1.0, base.inter * scale),
                        ag=min(1.0, base.ag * scale),
                    )
                config = CollectiveConfig(
                    format=fmt,
                    algorithm=algorithm,
                    thresholds=thresholds,
                    ranks_per_node=settings.ranks_per_node,
                    channels=channels,
                    cuda_graphs=settings.graphs,
                    check_calls=settings.check_calls,
                )
                out.append(_Method(name, fmt, algorithm, channels, scale, config))
    return out


# ---------------------------------------------------------------------------------------
# The job


def _init(smoke: bool, emulate_nodes: int, trace: bool) -> _Env | None:
    """Join the torchrun job: NCCL with one GPU per rank (or several ranks per GPU when there are
    more local ranks than GPUs), or gloo on the CPU under ``--smoke``; on emulated nodes if asked.
    ``trace``: rank 0 keeps a record of every ``auto`` call (``--trace``)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    emulate_nodes_env(emulate_nodes)  # before the group exists: NCCL reads it when it connects
    if not smoke and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    return _Env(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        device=device,
        backend=dist.get_backend(),
        fixed_group=dist.new_group(list(range(dist.get_world_size()))),
        trace=[] if trace and dist.get_rank() == 0 else None,
    )


def _devices_used(env: _Env) -> int:
    """Distinct devices the ranks run on (ranks sharing a GPU share its compute and bandwidth)."""
    if env.device.type != "cuda":
        return 1
    uuid = str(torch.cuda.get_device_properties(env.device).uuid)
    names = [None] * env.world
    dist.all_gather_object(names, uuid)
    return len(set(names))


def _sync(env: _Env) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


class _PeerFailed(Exception):
    """Another rank failed the current point (``value``: what the failing rank passed its gate)."""

    def __init__(self, value: float = 0.0) -> None:
        super().__init__(value)
        self.value = value


def _gate(env: _Env, failed: bool = False, value: float = 0.0) -> float:
    """A barrier that also shares a failure flag and a value; returns the largest value over ranks.

    Every rank passes the same gates per point; a rank that fails calls one gate with ``failed``,
    which its peers meet at their next gate, where they raise :class:`_PeerFailed`, so that all
    ranks reach the point's closing reduction together instead of waiting in mismatched calls.
    """
    _sync(env)
    t = torch.tensor([1.0 if failed else 0.0, value], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    flag, top = t.tolist()  # waits for every rank: the barrier
    if flag and not failed:
        raise _PeerFailed(top)
    return top


def _reduce(env: _Env, values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=op)
    return t.tolist()


# ---------------------------------------------------------------------------------------
# Inputs and the dense reference


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def _draw(
    pattern: str, n: int, dtype: torch.dtype, sparsity: float, env: _Env, settings: _Settings, key
) -> torch.Tensor:
    """This rank's input: ``randn`` values on the support ``pattern`` gives (see the module docstring)."""
    dev = env.device
    own = torch.Generator(device=dev).manual_seed(_seed(settings.seed, key, "rank", env.rank))
    shared = torch.Generator(device=dev).manual_seed(_seed(settings.seed, key, "shared"))
    density = 1.0 - sparsity / 100
    x = torch.randn(n, generator=own, dtype=dtype, device=dev)
    if pattern == "iid":
        keep = torch.rand(n, generator=own, device=dev) < density
    elif pattern == "identical":
        keep = torch.rand(n, generator=shared, device=dev) < density
    elif pattern == "disjoint":
        u = torch.rand(n, generator=shared, device=dev)
        share = min(density, 1.0 / env.world)
        keep = (u >= env.rank * share) & (u < (env.rank + 1) * share)
        del u
    else:
        blocks = -(-n // settings.block)
        keep = (torch.rand(blocks, generator=own, device=dev) < density).repeat_interleave(settings.block)[:n]
    return x.masked_fill_(keep.logical_not_(), 0)


def _bits_sum(x: torch.Tensor) -> int:
    return int(x.view(_BITS[x.dtype]).sum(dtype=torch.int64))


def _make_case(
    collective: str, dtype_name: str, pattern: str, size: int, sparsity: float, env: _Env, settings: _Settings
) -> _Case:
    """Draw the inputs, run the dense collective once for the reference, and the abs-sum for the tolerance."""
    p = env.world
    dtype = _DTYPES[dtype_name]
    esize = torch.empty((), dtype=dtype).element_size()
    full = max(p, size // esize // p * p)
    n_in = full // p if collective == "all_gather" else full
    key = (collective, dtype_name, pattern, size, sparsity)
    x0 = _draw(pattern, n_in, dtype, sparsity, env, settings, key)
    tol = None
    if collective == "all_reduce":
        ref = x0.clone()
        dist.all_reduce(ref)
        tol = x0.abs().float()
        dist.all_reduce(tol)
    elif collective == "reduce_scatter":
        ref = torch.empty(full // p, dtype=dtype, device=env.device)
        reduce_scatter_flat(ref, x0)
        absolute = x0.abs().float()
        tol = torch.empty(full // p, dtype=torch.float32, device=env.device)
        reduce_scatter_flat(tol, absolute)
        del absolute
    else:
        ref = torch.empty(full, dtype=dtype, device=env.device)
        all_gather_flat(ref, x0)
    if tol is not None:
        # Two sums of `world` terms in different orders differ by at most 2 (world - 1) u sum|x|.
        tol.mul_(2 * p * _UNIT_ROUNDOFF[dtype])
    zeros_in, zeros_out = _reduce(env, [float((x0 == 0).sum()), float((ref == 0).sum())], dist.ReduceOp.SUM)
    case = _Case(
        collective=collective,
        dtype_name=dtype_name,
        dtype=dtype,
        pattern=pattern,
        sparsity=sparsity,
        size_bytes=full * esize,
        x0=x0,
        fingerprint=_bits_sum(x0),
        ref=ref,
        tol=tol,
        input_sparsity=100 * zeros_in / (p * n_in),
        output_sparsity=100 * zeros_out / (p * ref.numel()),
    )
    if collective == "all_reduce":
        case.work = torch.empty_like(x0)
    else:
        case.out = torch.empty_like(ref)
    return case


def _matches(case: _Case) -> bool:
    """The result equals the reference: bit for bit (all-gather) or within the per-element tolerance."""
    got, ref = case.result(), case.ref
    if case.tol is None:
        return torch.equal(got, ref)
    for start in range(0, got.numel(), _COMPARE_CHUNK):
        part = slice(start, start + _COMPARE_CHUNK)
        err = (got[part].float() - ref[part].float()).abs_()
        if not bool((err <= case.tol[part]).all()):
            return False
    return True


# ---------------------------------------------------------------------------------------
# The naive plain-torch COO collectives


def _coo(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.nonzero(x).view(-1).to(torch.int32)
    return idx, x.index_select(0, idx)


def _padded_gather(
    idx: torch.Tensor, vals: torch.Tensor, p: int
) -> tuple[list[int], int, torch.Tensor, torch.Tensor] | None:
    """All-gather the counts (one host sync), then indices and values padded to the largest count."""
    count = torch.tensor([idx.numel()], dtype=torch.int64, device=idx.device)
    counts_t = torch.empty(p, dtype=torch.int64, device=idx.device)
    all_gather_flat(counts_t, count)
    counts = counts_t.tolist()
    width = max(counts)
    if width == 0:
        return None
    pad_idx = torch.zeros(width, dtype=torch.int32, device=idx.device)
    pad_vals = torch.zeros(width, dtype=vals.dtype, device=vals.device)
    pad_idx[: idx.numel()] = idx
    pad_vals[: vals.numel()] = vals
    all_idx = torch.empty(p * width, dtype=torch.int32, device=idx.device)
    all_vals = torch.empty(p * width, dtype=vals.dtype, device=vals.device)
    all_gather_flat(all_idx, pad_idx)
    all_gather_flat(all_vals, pad_vals)
    return counts, width, all_idx, all_vals


def _naive_all_reduce(x: torch.Tensor, p: int) -> int:
    """Exact sparse all-reduce in plain torch, in place; returns the bytes this rank sent."""
    gathered = _padded_gather(*_coo(x), p)
    x.zero_()
    if gathered is None:
        return 8 * (p - 1)
    counts, width, all_idx, all_vals = gathered
    for q, c in enumerate(counts):
        x.index_add_(0, all_idx[q * width : q * width + c], all_vals[q * width : q * width + c])
    return (p - 1) * (8 + width * (4 + x.element_size()))


def _naive_all_gather(out: torch.Tensor, x: torch.Tensor, p: int) -> int:
    """Exact sparse all-gather in plain torch; returns the bytes this rank sent."""
    gathered = _padded_gather(*_coo(x), p)
    out.zero_()
    if gathered is None:
        return 8 * (p - 1)
    counts, width, all_idx, all_vals = gathered
    rows = out.view(p, -1)
    for q, c in enumerate(counts):
        rows[q].index_add_(0, all_idx[q * width : q * width + c], all_vals[q * width : q * width + c])
    return (p - 1) * (8 + width * (4 + x.element_size()))


def _naive_reduce_scatter(out: torch.Tensor, x: torch.Tensor, p: int, rank: int) -> int:
    """Exact sparse reduce-scatter in plain torch (COO per destination, all-to-all); returns bytes sent."""
    m = out.numel()
    idx = torch.nonzero(x).view(-1)
    bounds = torch.arange(p + 1, device=x.device, dtype=torch.int64) * m
    ends = torch.searchsorted(idx, bounds)
    send = ends[1:] - ends[:-1]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    vals = x.index_select(0, idx)
    local = torch.remainder(idx, m).to(torch.int32)
    del idx
    got_idx = torch.empty(sum(recv_counts), dtype=torch.int32, device=x.device)
    got_vals = torch.empty(sum(recv_counts), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(got_idx, local, recv_counts, send_counts)
    dist.all_to_all_single(got_vals, vals, recv_counts, send_counts)
    out.zero_()
    out.index_add_(0, got_idx, got_vals)
    others = sum(c for d, c in enumerate(send_counts) if d != rank)
    return 8 * (p - 1) + others * (4 + x.element_size())


# ---------------------------------------------------------------------------------------
# One point


def _dense_bytes(collective: str, case: _Case, p: int) -> int:
    """Bytes one rank sends in a dense ring (what nccl-tests' busbw counts)."""
    chunk = case.size_bytes // p
    return (p - 1) * chunk * (2 if collective == "all_reduce" else 1)


def _call(method: _Method, case: _Case, env: _Env) -> tuple[CollectiveStats | None, int]:
    """Run ``method`` once on the case's buffers; return the spccl stats (or None) and the naive bytes sent."""
    p = env.world
    coll = case.collective
    if method.name == "nccl":
        if coll == "all_reduce":
            dist.all_reduce(case.work)
        elif coll == "all_gather":
            all_gather_flat(case.out, case.x0)
        else:
            reduce_scatter_flat(case.out, case.x0)
        return None, 0
    if method.name == "naive_coo":
        if coll == "all_reduce":
            return None, _naive_all_reduce(case.work, p)
        if coll == "all_gather":
            return None, _naive_all_gather(case.out, case.x0, p)
        return None, _naive_reduce_scatter(case.out, case.x0, p, env.rank)
    fixed = method.fmt != "auto" and method.algorithm in ("ring", "direct")  # hierarchical: the default group's
    group = env.fixed_group if fixed else None
    if coll == "all_reduce":
        spccl_train.all_reduce(case.work, group=group, config=method.config)
    elif coll == "all_gather":
        spccl_train.all_gather_into_tensor(case.out, case.x0, group=group, config=method.config)
    else:
        spccl_train.reduce_scatter_tensor(case.out, case.x0, group=group, config=method.config)
    return last_stats(), 0


def _prepare(case: _Case, poison: bool) -> None:
    if case.work is not None:
        case.work.copy_(case.x0)
    elif poison:
        case.out.fill_(math.nan)


class _Timed(NamedTuple):
    seconds: float
    """From the call's start to the device's end of it."""
    stats: CollectiveStats | None
    sent: int
    host: float
    """From the call's start to its return."""


def _timed_call(method: _Method, case: _Case, env: _Env, phase: str, poison: bool = False) -> _Timed:
    """One call, timed from its start to the device's end of it; ``phase`` (``verify``, ``warmup``,
    ``settle`` or ``timed``) names it in the trace."""
    _prepare(case, poison)
    _gate(env)
    start = time.perf_counter()
    stats, sent = _call(method, case, env)
    returned = time.perf_counter()
    _sync(env)
    timed = _Timed(time.perf_counter() - start, stats, sent, returned - start)
    if env.trace is not None and stats is not None and "auto" in (method.fmt, method.algorithm):
        env.trace.append(_trace_record(method, case, phase, timed))
    return timed


_TRACE_FIELDS = (
    "collective", "dtype", "pattern", "size_bytes", "sparsity", "method", "channels", "phase", "ran", "trial",
    "predicted_ms", "time_ms", "host_ms", "exchanges", "candidates_ms",
)  # fmt: skip
"""The trace's columns: the point, the call's phase, the candidate it ran (``ran``; ``trial``: run
to try it), its corrected prediction and this rank's measured times, and every candidate's
corrected prediction, cheapest first."""


def _trace_record(method: _Method, case: _Case, phase: str, timed: _Timed) -> dict[str, object]:
    stats = timed.stats
    return {
        "collective": case.collective,
        "dtype": case.dtype_name,
        "pattern": case.pattern,
        "size_bytes": case.size_bytes,
        "sparsity": case.sparsity,
        "method": method.name,
        "channels": method.channels,
        "phase": phase,
        # as the candidates are named (a hierarchical call's format is its network step's)
        "ran": "hierarchical" if stats.algorithm == "hierarchical" else f"{stats.algorithm}/{stats.format.value}",
        "trial": stats.trial,
        "predicted_ms": f"{1e3 * stats.predicted_s:.4f}",
        "time_ms": f"{1e3 * timed.seconds:.4f}",
        "host_ms": f"{1e3 * timed.host:.4f}",
        "exchanges": stats.exchanges,
        "candidates_ms": " ".join(
            f"{name}:{1e3 * s:.4f}" for name, s in sorted(stats.candidates.items(), key=lambda kv: kv[1])
        ),
    }


def _device_allocs(env: _Env) -> int:
    """The caching allocator's ``cudaMalloc`` calls so far on this rank's device (0 on a CPU)."""
    if env.device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(env.device).get("num_device_alloc", 0))


def _same_weighing(before: dict[str, float], now: dict[str, float]) -> bool:
    """Whether two calls' predictions by candidate agree within 2% (equal on every rank)."""
    return before.keys() == now.keys() and all(abs(now[k] - v) <= 0.02 * v for k, v in before.items())


def _clean(stats: CollectiveStats | None) -> bool:
    return stats is None or stats.decode_status is None or int(stats.decode_status.max()) == 0


def _thresholds_text(method: _Method) -> str:
    if method.config is None:
        return ""
    th = method.config.thresholds
    if method.fmt == "auto" or (th.intra, th.inter, th.ag) == (None, None, None):
        return "default"
    return f"{th.intra:.3g}/{th.inter:.3g}/{th.ag:.3g}"


@dataclasses.dataclass(slots=True)
class _Point:
    """One method at one case, between its untimed calls and its timed ones."""

    method: _Method
    row: _Row
    """The point's row, filled as it goes (its ``warmup``, ``settle`` and ``iters`` here)."""
    ok: bool = True
    """This rank's verification so far (agreed over ranks when the point closes)."""
    error: str = ""
    """Why the point failed: the exception where it was raised, "failed on another rank" on the other
    ranks (a failure reaches every rank's next gate, so every rank fails the same points)."""
    sent: int = 0
    dense: int = 0
    peak: float = 0.0
    times: list[float] = dataclasses.field(default_factory=list)
    host_times: list[float] = dataclasses.field(default_factory=list)
    allocs: int = 0


def _new_row(method: _Method, case: _Case) -> _Row:
    return _Row(
        collective=case.collective,
        method=method.name,
        fmt=method.fmt,
        algorithm=method.algorithm,
        channels=method.channels,
        threshold_scale=method.scale,
        thresholds=_thresholds_text(method),
        dtype=case.dtype_name,
        pattern=case.pattern,
        size_bytes=case.size_bytes,
        sparsity=case.sparsity,
        input_sparsity=case.input_sparsity,
        output_sparsity=case.output_sparsity,
    )


def _failed(point: _Point, env: _Env, exc: Exception, value: float = 0.0) -> float:
    """Record a failure of this rank's call and meet the peers' next gate with ``value``, or a
    peer's failure; returns the failing rank's ``value`` (the largest, where several failed)."""
    if isinstance(exc, _PeerFailed):
        point.error = "failed on another rank"
        return exc.value
    point.error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
    print(
        f"rank {env.rank}: {point.row.collective} {point.method.label} failed: {point.error}",
        file=sys.stderr,
        flush=True,
    )
    return _gate(env, failed=True, value=value)


def _ready(method: _Method, case: _Case, env: _Env, settings: _Settings) -> _Point:
    """Verify one method on one case, warm it up (``auto``: let it settle) and size its timed calls."""
    point = _Point(method, _new_row(method, case))
    row = point.row
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    try:
        first, stats, naive_sent, _ = _timed_call(method, case, env, "verify", poison=True)
        point.ok = _matches(case) and _clean(stats)
        if stats is not None:
            point.sent, point.dense = stats.bytes_sent, stats.dense_bytes
            row.predicted_ms = 1e3 * stats.predicted_s
            row.chosen = f"{stats.algorithm}/{stats.format.value}"
            if stats.plan is not None:
                counts = stats.plan.format_counts()
                row.message_formats = " ".join(f"{f.value}:{counts[f]}" for f in sorted(counts, key=lambda f: f.value))
            native = stats.candidates.get("native/dense")
            if native is not None:
                row.native_predicted_ms = 1e3 * native
        else:
            point.dense = _dense_bytes(case.collective, case, env.world)
            point.sent = naive_sent if method.name == "naive_coo" else point.dense
            row.chosen = "native/dense" if method.name == "nccl" else "naive/coo"
        # Size the rest of the point by the first warm-up call where there is one: the first call of a
        # method may include one-time setup (NCCL creates its point-to-point communicators lazily).
        estimate = first
        if settings.warmup:
            estimate = _timed_call(method, case, env, "warmup").seconds
            row.warmup = 1
        estimate = _gate(env, value=estimate)
        want = settings.iters_large if case.size_bytes >= _LARGE else settings.iters
        left = int(settings.point_budget_s / max(estimate, 1e-9)) - 1 - row.warmup
        row.iters = max(1, min(want, left))
        more = max(0, min(settings.warmup - row.warmup, left - row.iters))
        for _ in range(more):
            _timed_call(method, case, env, "warmup")
        row.warmup += more
        if stats is not None and "auto" in (method.fmt, method.algorithm):
            # Every rank decides alike, so every rank leaves this loop at the same call.
            last, weighed = "", {}
            while row.settle < settings.settle:
                stats = _timed_call(method, case, env, "settle").stats
                row.settle += 1
                now = f"{stats.algorithm}/{stats.format.value}"
                if not row.chosen.endswith(now):
                    row.chosen = f"{row.chosen}>{now}"
                if stats.trial:  # auto tries a near-tied candidate: not yet settled
                    last = ""
                    continue
                if now == last and _same_weighing(weighed, stats.candidates):
                    break
                last, weighed = now, dict(stats.candidates)
        _gate(env)
    except Exception as exc:  # noqa: BLE001 (record the failure in the table and go on with the next point)
        _failed(point, env, exc)
    point.peak = torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else 0.0
    return point


def _note_timed(point: _Point, seconds: float, stats: CollectiveStats | None) -> None:
    row = point.row
    point.times.append(seconds)
    point.ok = point.ok and _clean(stats)
    if stats is not None:  # auto may change its mind as its model learns from observed calls
        now = f"{stats.algorithm}/{stats.format.value}"
        if not row.chosen.endswith(now):
            row.chosen = f"{row.chosen}>{now}"
        if not row.timed_chosen.endswith(now):
            row.timed_chosen = f"{row.timed_chosen}>{now}".lstrip(">")
        row.exchanges = f"{row.exchanges} {stats.exchanges}".strip()
        if stats.gather_counts and not row.gather_counts.endswith(stats.gather_counts):
            row.gather_counts = f"{row.gather_counts}>{stats.gather_counts}".lstrip(">")


def _time_in_turn(points: list[_Point], case: _Case, env: _Env) -> None:
    """The timed calls of every ready point, in turns: one call of each method per turn, so that
    every method is timed across the same windows of links whose speed drifts. Timed one method
    after another (8712ec0, 2 ranks as 2 nodes on one H100), the same plan ran 1.14-1.17x slower
    as ``auto``'s calls than as its fixed method's at three points of a sweep; in turns a second
    cause showed: a call over sockets now and then takes 15-30 ms longer than its like, whatever
    its method, and two such calls of three move a median (``fastest_vs_best``;
    bench/results/2026-11-26_seventeenth/). Each turn takes the methods in its own order (shuffled
    alike on every rank from the case), so that no method always follows the same one. In a
    fixed order on 2 H100s over NVLink (4039038, 1 GiB), ``auto``, always right after NCCL's
    dense call, ran its candidate 3-11% slower than the candidate's own row, where alternating
    the two without NCCL's call (``autoprof.py``) put them 1-2% apart. In shuffled turns the gap
    stayed (2-8%, caf0a76), so the order was not its cause (bench/results/2026-11-27_nineteenth/).

    A point is verified again after its last call. A failure stops the case's timed calls on every
    rank: the failing rank's gate carries the failing point's place, which the others' next gate
    raises with (a later call's, perhaps), so that every rank blames the same point; every point
    the failure left short fails with it.
    """
    live = [p for p in points if not p.error]  # the same on every rank
    current: _Point | None = None
    key = (case.collective, case.dtype_name, case.pattern, case.size_bytes, case.sparsity)
    try:
        for turn in range(max((p.row.iters for p in live), default=0)):
            order = list(live)
            random.Random(_seed(key, "turn", turn)).shuffle(order)
            for current in (p for p in order if turn < p.row.iters):
                if env.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(env.device)
                allocs = _device_allocs(env)
                timed = _timed_call(current.method, case, env, "timed")
                current.allocs += _device_allocs(env) - allocs
                current.host_times.append(timed.host)
                _note_timed(current, timed.seconds, timed.stats)
                if env.device.type == "cuda":
                    current.peak = max(current.peak, torch.cuda.max_memory_allocated(env.device) / 2**30)
                if turn == current.row.iters - 1:
                    current.ok = current.ok and _matches(case)
                    if case.collective != "all_reduce":
                        current.ok = current.ok and _bits_sum(case.x0) == case.fingerprint
        _gate(env)
    except Exception as exc:  # noqa: BLE001 (the case's rows say what failed)
        if current is None:  # no timed call was made: nothing of the case's to blame
            raise
        if isinstance(exc, _PeerFailed):
            place = exc.value
        else:
            place = _failed(current, env, exc, value=1 + next(i for i, p in enumerate(live) if p is current))
        blamed = live[int(place) - 1] if 1 <= place <= len(live) else current
        if not blamed.error:
            blamed.error = "failed on another rank"
        for p in live:
            if not p.error and len(p.times) < p.row.iters:
                p.error = f"not timed: {blamed.method.label} failed in the timed calls"


def _close(point: _Point, case: _Case, env: _Env, settings: _Settings) -> _Row:
    """Agree the point's numbers over ranks and fill its row (every rank, every point, in order)."""
    row = point.row
    # A fixed length on every rank, even one that failed part way.
    cap = max(settings.iters, settings.iters_large)
    padded = point.times[:cap] + [0.0] * (cap - len(point.times))
    host = point.host_times[:cap] + [0.0] * (cap - len(point.host_times))
    failed = 1.0 if point.error or not point.ok else 0.0
    agreed = _reduce(
        env, [*padded, float(len(point.times)), failed, point.peak, float(point.allocs), *host], dist.ReduceOp.MAX
    )
    totals = _reduce(env, [float(point.sent), float(point.dense)], dist.ReduceOp.SUM)
    per_iter = [1e3 * t for t in agreed[: int(agreed[cap])]]
    row.verified = agreed[cap + 1] == 0.0
    if per_iter and row.verified:
        row.time_ms = statistics.median(per_iter)
        row.time_min_ms, row.time_max_ms = min(per_iter), max(per_iter)
        row.host_ms = statistics.median(1e3 * t for t in agreed[cap + 4 : cap + 4 + len(per_iter)])
    row.peak_mem_gib = agreed[cap + 2]
    row.device_allocs = int(agreed[cap + 3])
    row.bytes_sent, row.dense_bytes = int(totals[0]), int(totals[1])
    if point.error:
        row.error = point.error
    seconds = row.time_ms / 1e3
    row.algbw = case.size_bytes / seconds / 1e9 if seconds > 0 else math.nan
    factor = 2 * (env.world - 1) / env.world if case.collective == "all_reduce" else (env.world - 1) / env.world
    row.busbw = row.algbw * factor
    return row


def _run_case(case: _Case, methods: list[_Method], env: _Env, settings: _Settings, on_row: Callable[[_Row], None]):
    """Every method of one case: each verified, warmed up and settled in turn, then all timed in turns."""
    if any(m.config is not None and m.config.holds_native() for m in methods):
        release_holds()  # a new sparsity of the shapes auto holds (every rank, between the same calls)
    points = [_ready(method, case, env, settings) for method in methods]
    _time_in_turn(points, case, env)
    rows = [_close(point, case, env, settings) for point in points]
    base: dict[str, _Row] = {}
    for row in rows:
        if "nccl" in base and base["nccl"].predicted_ms is None:
            base["nccl"].predicted_ms = row.native_predicted_ms
        if row.method in ("nccl", "naive_coo"):
            base[row.method] = row
    for row in rows:
        for name, attr in (("nccl", "speedup_vs_nccl"), ("naive_coo", "speedup_vs_naive")):
            if name in base and row.method != name and base[name].verified and row.verified:
                setattr(row, attr, base[name].time_ms / row.time_ms)
        on_row(row)
    return rows


# ---------------------------------------------------------------------------------------
# Reporting


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _gbps(value: float) -> str:
    return "nan" if math.isnan(value) else (f"{value:.0f}" if value >= 10 else f"{value:.2f}")


_TABLE = "{:<3} {:>6} {:>6} {:<9} {:<4} {:<16} {:>10} {:>7} {:>7} {:>7} {:<13} {:>8} {:>8} {:>9} {:>3}"
_HEADER = _TABLE.format(
    "op", "size", "spars%", "pattern", "type", "method", "time_ms", "algbw", "busbw", "bytes%", "chosen",
    "vs_nccl", "vs_naive", "pred_ms", "ok",
)  # fmt: skip


def _line(r: _Row) -> str:
    ratio = r.bytes_ratio
    return _TABLE.format(
        _SHORT[r.collective],
        benchlib.size_label(r.size_bytes),
        f"{r.sparsity:g}",
        r.pattern,
        r.dtype,
        _Method(r.method, channels=r.channels, scale=r.threshold_scale).label,
        f"{r.time_ms:.3f}",
        _gbps(r.algbw),
        _gbps(r.busbw),
        "-" if ratio is None else f"{100 * ratio:.1f}",
        r.chosen,
        _x(r.speedup_vs_nccl),
        _x(r.speedup_vs_naive),
        "-" if r.predicted_ms is None else f"{r.predicted_ms:.3f}",
        "ok" if r.verified else "BAD",
    )


_FIELDS = [
    "date", "device", "torch", "commit", "world_size", "ranks_per_node", "backend", "emulated_nodes", "devices_used",
    "check_calls", "measured", "corrections",
    "collective", "method", "format",
    "algorithm", "channels", "threshold_scale", "thresholds", "dtype", "pattern", "size_bytes", "sparsity",
    "input_sparsity", "output_sparsity", "time_ms", "time_min_ms", "time_max_ms", "algbw_GBps", "busbw_GBps",
    "bytes_sent", "dense_bytes", "bytes_ratio", "chosen", "message_formats", "speedup_vs_nccl", "speedup_vs_naive",
    "predicted_ms", "auto_vs_best", "fastest_vs_best", "timed_chosen", "choice_vs_best", "exchanges", "gather_counts", "warmup", "settle", "iters", "peak_mem_GiB",
    "host_ms", "device_allocs", "verified", "error",
]  # fmt: skip


def _write_csv(rows: list[_Row], path: pathlib.Path, meta: dict[str, object]) -> None:
    def opt(value: float | None, spec: int | str) -> str:
        """Empty for no value; ``spec``: decimal places, or a format spec (bandwidths keep 6
        significant digits, so a slow smoke-run case never reads as 0)."""
        if value is None or math.isnan(value):
            return ""
        return f"{value:.{spec}f}" if isinstance(spec, int) else f"{value:{spec}}"

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {
                    **meta,
                    "collective": r.collective,
                    "method": r.method,
                    "format": r.fmt,
                    "algorithm": r.algorithm,
                    "channels": r.channels,
                    "threshold_scale": r.threshold_scale,
                    "thresholds": r.thresholds,
                    "dtype": r.dtype,
                    "pattern": r.pattern,
                    "size_bytes": r.size_bytes,
                    "sparsity": r.sparsity,
                    "input_sparsity": f"{r.input_sparsity:.4f}",
                    "output_sparsity": f"{r.output_sparsity:.4f}",
                    "time_ms": opt(r.time_ms, 6),
                    "time_min_ms": opt(r.time_min_ms, 6),
                    "time_max_ms": opt(r.time_max_ms, 6),
                    "algbw_GBps": opt(r.algbw, ".6g"),
                    "busbw_GBps": opt(r.busbw, ".6g"),
                    "bytes_sent": r.bytes_sent,
                    "dense_bytes": r.dense_bytes,
                    "bytes_ratio": opt(r.bytes_ratio, 5),
                    "chosen": r.chosen,
                    "message_formats": r.message_formats,
                    "speedup_vs_nccl": opt(r.speedup_vs_nccl, 4),
                    "speedup_vs_naive": opt(r.speedup_vs_naive, 4),
                    "auto_vs_best": opt(r.auto_vs_best, 4),
                    "fastest_vs_best": opt(r.fastest_vs_best, 4),
                    "timed_chosen": r.timed_chosen,
                    "choice_vs_best": opt(r.choice_vs_best, 4),
                    "predicted_ms": opt(r.predicted_ms, 6),
                    "exchanges": r.exchanges,
                    "gather_counts": r.gather_counts,
                    "warmup": r.warmup,
                    "settle": r.settle,
                    "iters": r.iters,
                    "peak_mem_GiB": f"{r.peak_mem_gib:.3f}",
                    "host_ms": opt(r.host_ms, 6),
                    "device_allocs": r.device_allocs,
                    "verified": r.verified,
                    "error": r.error,
                }
            )


def _plot(rows: list[_Row], stem: pathlib.Path, title: str) -> list[pathlib.Path]:
    """Speedup heatmaps, one PNG per collective, pattern and dtype, a panel per method.

    ``<stem>_<collective>_<pattern>_<dtype>.png``: rows sparsity, columns size, at the first
    channel count and threshold scale 1 (the paper's figures). With a sweep also ``..._sweep.png``:
    rows the (channels, threshold scale) variants, columns sparsity, at the largest size.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: F401 (checks that pyplot loads before any work)
    except ImportError:
        print("matplotlib is missing: no heatmaps", flush=True)
        return []
    speedups = [r for r in rows if r.method != "nccl"]
    variants = list(dict.fromkeys((r.channels, r.threshold_scale) for r in speedups if r.method != "naive_coo"))
    base = min(variants, key=lambda v: (v[1] != 1.0, v)) if variants else (1, 1.0)
    written = []
    for coll, pattern, dtype in dict.fromkeys((r.collective, r.pattern, r.dtype) for r in speedups):
        picked = [r for r in speedups if (r.collective, r.pattern, r.dtype) == (coll, pattern, dtype)]
        name = f"{stem.name}_{coll}_{pattern}_{dtype}"
        panels: dict[str, dict[tuple, float | None]] = {}
        for r in picked:
            if r.method == "naive_coo" or (r.channels, r.threshold_scale) == base:
                panels.setdefault(r.method, {})[(r.sparsity, r.size_bytes)] = r.speedup_vs_nccl
        sparsities = sorted({r.sparsity for r in picked}, reverse=True)
        sizes = sorted({r.size_bytes for r in picked})
        variant = f", channels {base[0]}, threshold scale {base[1]:g}" if len(variants) > 1 else ""
        path = stem.parent / f"{name}.png"
        _heatmaps(
            path,
            panels,
            (sparsities, [f"{s:g}%" for s in sparsities], "sparsity"),
            (sizes, [benchlib.size_label(s) for s in sizes], "size"),
            f"{coll} speedup over nccl, {pattern}, {dtype}{variant}\n{title}",
        )
        written.append(path)
        if len(variants) > 1:
            largest = sizes[-1]
            panels = {}
            for r in picked:
                if r.method != "naive_coo" and r.size_bytes == largest:
                    panels.setdefault(r.method, {})[((r.channels, r.threshold_scale), r.sparsity)] = r.speedup_vs_nccl
            order = sorted(variants)
            path = stem.parent / f"{name}_sweep.png"
            _heatmaps(
                path,
                panels,
                (order, [f"ch{c} th{t:g}" for c, t in order], "channels, threshold scale"),
                (sparsities[::-1], [f"{s:g}%" for s in sparsities[::-1]], "sparsity"),
                f"{coll} speedup over nccl at {benchlib.size_label(largest)}, {pattern}, {dtype}\n{title}",
            )
            written.append(path)
    return written


def _heatmaps(
    path: pathlib.Path,
    panels: dict[str, dict[tuple, float | None]],
    rows: tuple[list, list[str], str],
    cols: tuple[list, list[str], str],
    title: str,
) -> None:
    """One heatmap per panel of speedups keyed ``(row key, column key)``, coloured on a log scale around 1x."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    row_keys, row_labels, row_name = rows
    col_keys, col_labels, col_name = cols
    width = min(4, len(panels))
    height = -(-len(panels) // width)
    panel_w, panel_h = max(2.4, 0.8 * len(col_keys) + 0.8), max(1.8, 0.4 * len(row_keys) + 0.8)
    fig, axes = plt.subplots(
        height,
        width,
        figsize=(panel_w * width + 1.5, panel_h * height + 1.0),
        squeeze=False,
        sharex=True,
        sharey=True,
        layout="constrained",
    )
    values = [v for cells in panels.values() for v in cells.values() if v]
    span = max([1.0] + [abs(math.log2(v)) for v in values])
    norm = TwoSlopeNorm(vmin=-span, vcenter=0.0, vmax=span)
    image = None
    for ax, (method, cells) in zip(axes.flat, panels.items()):
        grid = [[cells.get((rk, ck)) or math.nan for ck in col_keys] for rk in row_keys]
        image = ax.imshow([[math.log2(v) for v in line] for line in grid], cmap="RdYlGn", norm=norm, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                ax.text(j, i, "-" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(col_keys)), col_labels)
        ax.set_yticks(range(len(row_keys)), row_labels)
        ax.set_title(method, fontsize=9)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel(row_name)
    for ax in axes[-1, :]:
        ax.set_xlabel(col_name)
    if image is not None:
        bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
        step = 1 if span <= 4 else 2
        ticks = [t for t in range(-math.floor(span), math.floor(span) + 1) if t % step == 0]
        bar.set_ticks(ticks, labels=[f"{2**t}x" if t >= 0 else f"1/{2**-t}x" for t in ticks])
        bar.set_label("speedup over nccl (- : not verified or not run)")
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary(rows: list[_Row], world: int) -> None:
    """Issue 3's acceptance points (fp32 i.i.d.; meant for 4 H200s) and the verification count."""
    base = [r for r in rows if r.dtype == "fp32" and r.pattern == "iid" and r.channels == 1 and r.threshold_scale == 1]
    print(f"\nacceptance (fp32, iid, channels 1, default thresholds; targets are for 4 H200s, this run: {world} ranks)")
    for coll, size, sparsity, target in _TARGETS:
        at = [r for r in base if (r.collective, r.size_bytes, r.sparsity) == (coll, size, sparsity)]
        auto = next((r for r in at if r.method == "auto/auto"), None)
        spccl = [r for r in at if r.method not in ("nccl", "naive_coo") and r.speedup_vs_nccl]
        if not spccl:
            print(f"  {coll} {benchlib.size_label(size)} {sparsity:g}% >= {target:g}x: not in this run")
            continue
        best = max(spccl, key=lambda r: r.speedup_vs_nccl)
        value = auto.speedup_vs_nccl if auto and auto.speedup_vs_nccl else None
        verdict = "PASS" if value is not None and value >= target else "FAIL"
        print(
            f"  {coll} {benchlib.size_label(size)} {sparsity:g}% >= {target:g}x: auto/auto {_x(value)} {verdict}; "
            f"best {best.method} {_x(best.speedup_vs_nccl)}"
        )
    autos = [r for r in base if r.method == "auto/auto" and r.size_bytes >= _AUTO_FLOOR_FROM]
    if autos:
        low = [r for r in autos if not r.speedup_vs_nccl or r.speedup_vs_nccl < _AUTO_FLOOR]
        worst = min(autos, key=lambda r: r.speedup_vs_nccl or 0.0)
        print(
            f"  auto/auto >= {_AUTO_FLOOR}x nccl at every sparsity, sizes >= {benchlib.size_label(_AUTO_FLOOR_FROM)}: "
            f"{'PASS' if not low else 'FAIL'} (worst {_x(worst.speedup_vs_nccl)} at {worst.collective} "
            f"{benchlib.size_label(worst.size_bytes)} {worst.sparsity:g}%"
            + (f"; {len(low)} of {len(autos)} points below" if low else "")
            + ")"
        )
    bad = [r for r in rows if not r.verified]
    print(
        f"verification: {len(rows) - len(bad)} of {len(rows)} points match the dense result"
        + (
            "; FAILED: "
            + ", ".join(
                f"{_SHORT[r.collective]}/{benchlib.size_label(r.size_bytes)}/{r.sparsity:g}%/{r.pattern}/{r.dtype}/{r.method}"
                for r in bad
            )
            if bad
            else ""
        ),
        flush=True,
    )


_FIXED = ("nccl", "pici/ring", "pici/direct", "coo/ring", "coo/direct")
_AUTO_WITHIN = 1.10  # auto within 10% of the best fixed candidate (the links issue)


def _rate_auto(rows: list[_Row]) -> None:
    """Set ``auto_vs_best``, ``fastest_vs_best`` and ``choice_vs_best`` on the ``auto/auto`` rows
    from the fixed candidates of the same point."""

    def point(r: _Row) -> tuple:
        return (r.collective, r.dtype, r.pattern, r.size_bytes, r.sparsity, r.channels, r.threshold_scale)

    best: dict[tuple, _Row] = {}
    fixed: dict[tuple, _Row] = {}
    for r in rows:
        if r.method in _FIXED and r.verified and not math.isnan(r.time_ms):
            if point(r) not in best or r.time_ms < best[point(r)].time_ms:
                best[point(r)] = r
            fixed[point(r) + (r.method,)] = r
    for r in rows:
        if r.method == "auto/auto" and r.verified and point(r) in best:
            r.auto_vs_best = r.time_ms / best[point(r)].time_ms
            r.fastest_vs_best = r.time_min_ms / best[point(r)].time_min_ms
            algorithm, _, fmt = r.timed_chosen.partition("/")
            ran = "nccl" if algorithm == "native" else f"{fmt}/{algorithm}"
            if ">" not in r.timed_chosen and point(r) + (ran,) in fixed:
                r.choice = fixed[point(r) + (ran,)]
                r.choice_vs_best = r.choice.time_ms / best[point(r)].time_ms


def _auto_summary(rows: list[_Row]) -> None:
    """How far ``auto/auto`` was from the best fixed candidate, worst point first."""
    rated = sorted((r for r in rows if r.auto_vs_best is not None), key=lambda r: -r.auto_vs_best)
    if not rated:
        return
    worst = rated[0]
    over = [r for r in rated if r.auto_vs_best > _AUTO_WITHIN]
    print(
        f"auto/auto within {_AUTO_WITHIN - 1:.0%} of the best fixed candidate ({', '.join(_FIXED)}) at every point: "
        f"{'PASS' if not over else 'FAIL'} ({len(rated) - len(over)} of {len(rated)}; worst {worst.auto_vs_best:.2f}x at "
        f"{worst.collective} {benchlib.size_label(worst.size_bytes)} {worst.sparsity:g}%, chose {worst.chosen or '-'})"
    )
    slow = [r for r in rated if r.fastest_vs_best > _AUTO_WITHIN]
    print(
        f"  within {_AUTO_WITHIN - 1:.0%} on the fastest timed calls (auto's against the best candidate's): "
        f"{len(rated) - len(slow)} of {len(rated)}; worst {max(r.fastest_vs_best for r in rated):.2f}x"
    )
    if over:  # a wrong choice, or the right one at a cost of its own
        same = [r for r in over if r.choice_vs_best is not None and r.choice_vs_best <= _AUTO_WITHIN]
        print(
            f"  of the {len(over)} beyond: {len(same)} ran a candidate whose own fixed time was within "
            f"{_AUTO_WITHIN - 1:.0%} of the best ("
            + ", ".join(
                f"{benchlib.size_label(r.size_bytes)} {r.sparsity:g}% {r.dtype}: {r.timed_chosen} {r.choice_vs_best:.2f}x"
                for r in same
            )
            + ")"
        )
        for r in same:  # where the time went: the host's part of the call, the allocator
            print(
                f"    {benchlib.size_label(r.size_bytes)} {r.sparsity:g}% {r.dtype}: auto {r.time_ms:.3f} ms (host "
                f"{r.host_ms:.3f}, {r.device_allocs} device allocations), {r.choice.method} {r.choice.time_ms:.3f} ms "
                f"(host {r.choice.host_ms:.3f}, {r.choice.device_allocs})"
            )


# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    settings = _settings(argv)
    env = _init(settings.smoke, settings.emulate_nodes, settings.trace)
    if env is None:
        print(
            "run under torchrun, e.g. torchrun --standalone --nproc-per-node=4 bench/bench_collectives.py "
            "--out-dir DIR (add --smoke on a machine without GPUs)",
            file=sys.stderr,
        )
        return 2
    lead = env.rank == 0
    try:
        if env.device.type == "cuda":
            try:
                load_kernels()
            except KernelsUnavailableError as exc:
                if lead:
                    print(f"the spccl CUDA kernels are not available ({exc}); use --smoke on the CPU", flush=True)
                return 2
        elif not settings.smoke and lead:
            print("no GPU: running on the CPU with gloo and the reference codecs", flush=True)
        with clearing_graphs():  # a cached graph holding NCCL work would make destroy wait forever
            return _main(settings, env)
    finally:
        dist.destroy_process_group()


def _main(settings: _Settings, env: _Env) -> int:
    lead = env.rank == 0
    now = datetime.datetime.now()
    device_name = benchlib.device_name(env.device)
    meta = {
        "date": now.isoformat(timespec="seconds"),
        "device": device_name,
        "torch": torch.__version__,
        "commit": git_commit(),
        "world_size": env.world,
        "ranks_per_node": settings.ranks_per_node or env.world,
        "backend": env.backend,
        "emulated_nodes": settings.emulate_nodes,
        "devices_used": _devices_used(env),
        "check_calls": settings.check_calls,
    }
    name = f"collectives_{benchlib.slug(device_name)}x{env.world}"
    if settings.emulate_nodes > 1:
        name += f"_{settings.emulate_nodes}nodes"
    name += f"_{now.date().isoformat()}" + ("_graphs" if settings.graphs else "")
    name += "_first" if settings.check_calls == "first" else ""
    stem, taken = settings.out_dir / name, 1
    while stem.with_suffix(".csv").exists():  # never overwrite an earlier run's results
        taken += 1
        stem = settings.out_dir / f"{name}_{taken}"
    methods = _methods(settings)
    cases = [
        (dtype, pattern, coll, size, sparsity)
        for dtype in settings.dtypes
        for pattern in settings.patterns
        for coll in settings.collectives
        for size in settings.sizes
        for sparsity in settings.sparsities
    ]
    if lead:
        settings.out_dir.mkdir(parents=True, exist_ok=True)
        print(
            f"device: {env.world} ranks on {meta['devices_used']} x {device_name} ({env.backend}, ranks_per_node "
            f"{meta['ranks_per_node']}{', emulated nodes' if settings.emulate_nodes > 1 else ''})   "
            f"torch {meta['torch']}   commit {meta['commit']}   {meta['date']}"
        )
        print(
            f"{len(cases)} cases x {len(methods)} methods; per point: 1 verification call, {settings.warmup} warm-up, "
            f"median of {settings.iters} timed calls ({settings.iters_large} at >= {benchlib.size_label(_LARGE)}) of the "
            f"slowest rank, the methods in turns; barrier before each call; sizes: all-reduce tensor, all-gather output, "
            f"reduce-scatter input"
        )
        print(_HEADER, flush=True)

    if any(m.startswith("auto") for m in settings.methods):  # the model auto will use, measured now, shown
        measured = measured_model(P2PTransport(), Topology(env.world, settings.ranks_per_node), env.device)
        meta["measured"] = measured.describe()
        if lead:
            print(f"measured: {meta['measured']}", flush=True)

    def show(row: _Row) -> None:
        if lead:
            print(_line(row), flush=True)

    started = time.perf_counter()
    rows: list[_Row] = []
    skipped = 0
    for i, (dtype, pattern, coll, size, sparsity) in enumerate(cases):
        late = settings.time_limit_s > 0 and time.perf_counter() - started > settings.time_limit_s
        if _reduce(env, [1.0 if late else 0.0], dist.ReduceOp.MAX)[0]:
            skipped = len(cases) - i
            break
        case = _make_case(coll, dtype, pattern, size, sparsity, env, settings)
        rows += _run_case(case, methods, env, settings, show)
        del case
        benchlib.free_cache(env.device)
    elapsed = time.perf_counter() - started
    if "measured" in meta:  # what auto's model learned from the calls it observed (collectives/feedback.py)
        meta["corrections"] = learned_corrections().describe()
        if lead:
            print(f"corrections learned: {meta['corrections']}", flush=True)
    status = 1 if not all(r.verified for r in rows) else 3 if skipped else 0
    failure = None
    if lead:
        try:
            _report(rows, settings, env, meta, stem, elapsed, skipped, len(cases))
        except Exception as exc:  # noqa: BLE001 (raised below, once the other ranks are released)
            failure = exc
    _gate(env)  # torchrun stops every rank when one exits non-zero: wait until rank 0 has written the files
    if failure is not None:
        raise failure
    return status


def _report(
    rows: list[_Row],
    settings: _Settings,
    env: _Env,
    meta: dict[str, object],
    stem: pathlib.Path,
    elapsed: float,
    skipped: int,
    total: int,
) -> None:
    if skipped:
        print(f"time limit ({settings.time_limit_s:g} s) reached: {skipped} of {total} cases skipped", flush=True)
    csv_path = stem.with_suffix(".csv")
    _rate_auto(rows)
    if env.trace is not None:
        trace_path = stem.parent / f"{stem.name}_trace.csv"
        with trace_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=("date", "commit", "world_size", *_TRACE_FIELDS))
            writer.writeheader()
            writer.writerows(
                {"date": meta["date"], "commit": meta["commit"], "world_size": env.world, **r} for r in env.trace
            )
        print(f"wrote {trace_path} ({len(env.trace)} calls of auto, rank 0's times)")
    _write_csv(rows, csv_path, meta)  # after the trace: the newest CSV of a run is its table
    title = f"{env.world} ranks on {meta['devices_used']} x {meta['device']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}"
    pngs = _plot(rows, stem, title) if settings.plot and rows else []
    print(f"\n{len(rows)} points in {elapsed:.1f} s; wrote {csv_path}" + "".join(f"\n  {p}" for p in pngs))
    _summary(rows, env.world)
    _auto_summary(rows)


if __name__ == "__main__":
    sys.exit(main())
