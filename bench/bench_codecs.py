"""Codec throughput on one GPU: the Pici and COO kernels against a plain-torch COO baseline.

Times compress, decompress (overwrite) and decompress-accumulate of Pici and COO through the
public API (``compress_into`` / ``decompress_into`` with ``check=False``), and the torch
baseline (compress: ``idx = x.nonzero()``, ``x[idx]``; decompress: ``zero_`` + ``index_put_``;
accumulate: ``index_add_``), on i.i.d. random masks over ``randn`` values. Every timed case is
first checked once: decoding the compressed input gives it back bit for bit.

On the GPU machine (the default sweep: fp32 and bf16, 64 MiB / 256 MiB / 1 GiB of dense
input, sparsity 0 to 99.9 %; a few minutes on an H100, plus about a minute to compile the
kernels on first use)::

    python bench/bench_codecs.py --out-dir "$OUT"

Here, to check the script itself (CPU, 1 MiB, the reference codecs, host timer)::

    python bench/bench_codecs.py --smoke --out-dir /tmp/benchsmoke

Writes ``codecs_<device>_<date>.csv`` and a ``.png`` beside it (fraction of copy bandwidth
against sparsity, one line per op and implementation, a panel per dtype at the largest size)
into ``--out-dir``. ``sparsity`` is in percent; ``time_ms`` is the median of the reps, with the
fastest and slowest beside it (``time_min_ms``, ``time_max_ms``; the summary prints the worst
spread among the rows it judges). The commit is ``$SPCCL_GIT_COMMIT`` if set,
else ``git rev-parse --short HEAD``, else ``unknown``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

# NVLink multicast can take the lent machines' GPUs out of service (shared/design/GPU.md);
# this script uses no collectives, but keeps the rule for every script that may run there.
for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _value)

_REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))

import benchlib  # noqa: E402 (a sibling module: the script's folder is on sys.path)

from spccl_train import formats
from spccl_train._ext import KernelsUnavailableError, load_kernels
from spccl_train._provenance import git_commit

__all__ = ["main"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_OPS = ("compress", "decompress", "accumulate")
_IMPLS = ("pici", "coo", "torch")
# Fraction of copy that Pici should reach at the largest size (issue 19): compress and decompress
# at every sparsity from _TARGET_FROM, accumulate where it reads the destination whole (its
# fraction counts the destination read and written; sparser, it skips lines and reads above 1).
_TARGET_FRAC = {"compress": 0.85, "decompress": 0.85, "accumulate": 0.80}
_TARGET_FROM = 50.0
_TARGET_SPEEDUP = 5.0
_TARGET_SPEEDUP_AT = 99.0
_COPY_BYTES = 1 << 30
_SMOKE_COPY_BYTES = 16 << 20
# Enough GPU time (about 10 ms) ahead of the timed reps for the host to queue all of them,
# so kernel times exclude Python and launch overhead wherever the op needs no host sync.
_HOLD_CYCLES = 20_000_000
_BYTES_MOVED = (
    "bytes moved: compress = dense read + payload written; decompress = payload read + dense written; "
    "accumulate = payload read + dense read + dense written (a scatter that touches only the nonzeros of dst "
    "moves less, so its fraction can exceed 1); the torch rows count the COO payload "
    "(4-byte indices, as the spccl COO rows do) although torch keeps int64 indices, so they compare at "
    "equal work. GB/s = 1e9 bytes/s; frac_copy = GB/s over the device-to-device copy's GB/s (read + write)."
)


@dataclasses.dataclass(frozen=True, slots=True)
class _Settings:
    """What one run measures and how."""

    device: torch.device
    dtypes: list[str]
    sizes: list[int]
    sparsities: list[float]
    reps: int
    reps_1g: int
    warmup: int
    out_dir: pathlib.Path
    smoke: bool


@dataclasses.dataclass(slots=True)
class _Row:
    """One timed (case, op, implementation)."""

    dtype: str
    size_bytes: int
    sparsity: float
    op: str
    impl: str
    backend: str
    time_ms: float
    bytes_moved: int
    nnz: int
    payload_bytes: int
    reps: int
    input_sets: int
    verified: bool
    gbps: float = 0.0
    frac_copy: float = 0.0
    speedup_vs_torch: float | None = None
    time_min_ms: float = 0.0
    """The fastest rep (with :attr:`time_max_ms`, the slowest: their ratio shows a state of the
    device that moved some reps, as the frees before a case did: benchlib.free_cache)."""
    time_max_ms: float = 0.0


# ---------------------------------------------------------------------------------------
# Arguments


def _parse_list(text: str, parse: Callable[[str], object]) -> list:
    return [parse(item) for item in text.split(",") if item.strip()]


def _parse_dtype(text: str) -> str:
    name = text.strip().lower()
    if name not in _DTYPES:
        raise argparse.ArgumentTypeError(f"dtype {text!r} is not one of {', '.join(_DTYPES)}")
    return name


def _settings(argv: list[str] | None) -> _Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=lambda s: _parse_list(s, benchlib.parse_size),
        help="dense input sizes (default 64M,256M,1G; smoke 1M)",
    )
    parser.add_argument(
        "--sparsities",
        type=lambda s: _parse_list(s, benchlib.parse_sparsity),
        help="percent (default 0,50,90,95,99,99.9; smoke 50,99)",
    )
    parser.add_argument(
        "--dtypes",
        type=lambda s: _parse_list(s, _parse_dtype),
        default=["fp32", "bf16"],
        help="fp32,bf16,fp16 (default fp32,bf16)",
    )
    parser.add_argument("--reps", type=int, help="timed repetitions per op, median taken (default 25; smoke 5)")
    parser.add_argument("--reps-1g", type=int, help="timed repetitions for sizes of 1 GiB and more (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default 3)")
    parser.add_argument(
        "--out-dir", type=pathlib.Path, default=_REPO / "bench" / "results", help="where the CSV and PNG go"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="check the script on the CPU: 1 MiB, two sparsities, reference codecs"
    )
    args = parser.parse_args(argv)
    reps = args.reps or (5 if args.smoke else 25)
    reps_1g = args.reps_1g or (reps if args.smoke else 20)
    if not args.smoke and min(reps, reps_1g) < 20:
        parser.error("--reps and --reps-1g must be at least 20 for a GPU run (the median needs them)")
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        parser.error("no GPU visible: run on the GPU machine, or pass --smoke to check the script on the CPU")
    return _Settings(
        device=device,
        dtypes=args.dtypes,
        sizes=args.sizes or ([1 << 20] if args.smoke else [64 << 20, 256 << 20, 1 << 30]),
        sparsities=args.sparsities or ([50.0, 99.0] if args.smoke else [0.0, 50.0, 90.0, 95.0, 99.0, 99.9]),
        reps=reps,
        reps_1g=reps_1g,
        warmup=args.warmup,
        out_dir=args.out_dir,
        smoke=args.smoke,
    )


# ---------------------------------------------------------------------------------------
# Timing


class _Times(NamedTuple):
    """The reps' median, fastest and slowest, in ms."""

    median: float
    least: float
    most: float

    @classmethod
    def of(cls, times: list[float]) -> _Times:
        return cls(statistics.median(times), min(times), max(times))


def _time_ms(step: Callable[[int], object], device: torch.device, reps: int, warmup: int) -> _Times:
    """Times of ``step(i)`` over ``reps`` calls, after ``warmup`` untimed ones.

    On CUDA each call sits between two events; the GPU is held busy first so that the host
    can queue every call. On the CPU a host clock times each call.
    """
    for i in range(warmup):
        step(i)
    if device.type != "cuda":
        times = []
        for i in range(reps):
            start = time.perf_counter()
            step(i)
            times.append(1e3 * (time.perf_counter() - start))
        return _Times.of(times)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(_HOLD_CYCLES)
    for i in range(reps):
        starts[i].record()
        step(i)
        ends[i].record()
    torch.cuda.synchronize()
    return _Times.of([s.elapsed_time(e) for s, e in zip(starts, ends)])


def _copy_gbps(settings: _Settings) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    size = _SMOKE_COPY_BYTES if settings.smoke else _COPY_BYTES
    ms = _time_copy(size, settings)
    benchlib.free_cache(settings.device)
    return 2 * size / (ms * 1e6)


def _time_copy(size: int, settings: _Settings) -> float:
    src = torch.randn(size // 4, device=settings.device)
    dst = torch.empty_like(src)
    return _time_ms(lambda i: dst.copy_(src), settings.device, max(settings.reps, 20), settings.warmup).median


# ---------------------------------------------------------------------------------------
# One case: a dtype, a size and a sparsity


def _input_sets(dense_bytes: int, device: torch.device) -> int:
    """How many inputs to rotate among so that repeated calls do not run out of L2."""
    if device.type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return min(64, max(2, math.ceil(3 * l2 / dense_bytes)))


def _sparse_input(n: int, dtype: torch.dtype, sparsity: float, device: torch.device) -> torch.Tensor:
    x = torch.randn(n, device=device, dtype=dtype)
    drop = torch.rand(n, device=device) < sparsity / 100
    return x.masked_fill_(drop, 0)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with a NaN pattern, so that an element a decoder leaves unwritten shows."""
    return t.view(_BITS[t.dtype]).fill_(0x7FA5A5A5 if t.element_size() == 4 else 0x7FA5).view(t.dtype)


@dataclasses.dataclass(slots=True)
class _Case:
    """The inputs of one case: ``sets`` dense inputs and as many destinations."""

    dtype_name: str
    dtype: torch.dtype
    size_bytes: int
    sparsity: float
    n: int
    xs: list[torch.Tensor]
    dsts: list[torch.Tensor]
    reps: int

    def row(
        self, op: str, impl: str, backend: str, times: _Times, moved: int, nnz: int, payload: int, ok: bool
    ) -> _Row:
        return _Row(
            dtype=self.dtype_name,
            size_bytes=self.size_bytes,
            sparsity=self.sparsity,
            op=op,
            impl=impl,
            backend=backend,
            time_ms=times.median,
            time_min_ms=times.least,
            time_max_ms=times.most,
            bytes_moved=moved,
            nnz=nnz,
            payload_bytes=payload,
            reps=self.reps,
            input_sets=len(self.xs),
            verified=ok,
        )


def _verify(
    case: _Case, decode: Callable[[torch.Tensor], None], accumulate: Callable[[torch.Tensor], None]
) -> tuple[bool, bool]:
    """Decoding gives the input back bit for bit; accumulating it onto itself gives twice it (exact)."""
    x, dst = case.xs[0], case.dsts[0]
    try:
        decode(_poison(dst))
        decoded = _same_bits(dst, x)
        dst.copy_(x)
        accumulate(dst)
        accumulated = _same_bits(dst, x * 2)
    except formats.CorruptPayloadError as exc:
        print(f"verification failed: {exc}", flush=True)
        return False, False
    return decoded, accumulated


def _bench_spccl(case: _Case, fmt: str, settings: _Settings, backend: str) -> list[_Row]:
    """Pici or COO through compress_into / decompress_into, one capacity-sized buffer per input."""
    sets = len(case.xs)
    bufs = [
        torch.empty(formats.capacity_bytes(fmt, case.n, case.dtype), dtype=torch.uint8, device=settings.device)
        for _ in range(sets)
    ]
    nnzs = [formats.compress_into(fmt, x, buf, check=False) for x, buf in zip(case.xs, bufs)]
    counts = [int(k.item()) for k in nnzs]
    sizes = [formats.payload_bytes(fmt, case.n, k, case.dtype) for k in counts]
    payloads = [buf[:size] for buf, size in zip(bufs, sizes)]

    def decode(i: int, dst: torch.Tensor, *, accumulate: bool = False, check: bool = False):
        return formats.decompress_into(fmt, payloads[i], dst, nnz=nnzs[i], accumulate=accumulate, check=check)

    decoded, accumulated = _verify(
        case, lambda dst: decode(0, dst, check=True), lambda dst: decode(0, dst, accumulate=True, check=True)
    )
    time_compress = _time_ms(
        lambda i: formats.compress_into(fmt, case.xs[i % sets], bufs[i % sets], check=False),
        settings.device,
        case.reps,
        settings.warmup,
    )
    time_decompress = _time_ms(
        lambda i: decode(i % sets, case.dsts[i % sets]), settings.device, case.reps, settings.warmup
    )
    time_accumulate = _time_ms(
        lambda i: decode(i % sets, case.dsts[i % sets], accumulate=True), settings.device, case.reps, settings.warmup
    )
    nnz, payload = round(statistics.mean(counts)), round(statistics.mean(sizes))
    return [
        case.row("compress", fmt, backend, time_compress, case.size_bytes + payload, nnz, payload, decoded),
        case.row("decompress", fmt, backend, time_decompress, payload + case.size_bytes, nnz, payload, decoded),
        case.row("accumulate", fmt, backend, time_accumulate, payload + 2 * case.size_bytes, nnz, payload, accumulated),
    ]


def _torch_compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.nonzero(x).squeeze(1)
    return idx, x[idx]


def _torch_decompress(idx: torch.Tensor, values: torch.Tensor, dst: torch.Tensor) -> None:
    dst.zero_()
    dst.index_put_((idx,), values)


def _torch_accumulate(idx: torch.Tensor, values: torch.Tensor, dst: torch.Tensor) -> None:
    dst.index_add_(0, idx, values)


def _bench_torch(case: _Case, settings: _Settings) -> list[_Row]:
    """The plain-torch COO baseline: nonzero + gather, zero + index_put_, index_add_."""
    sets = len(case.xs)
    encoded = [_torch_compress(x) for x in case.xs]
    counts = [idx.numel() for idx, _ in encoded]
    decoded, accumulated = _verify(
        case,
        lambda dst: _torch_decompress(*encoded[0], dst),
        lambda dst: _torch_accumulate(*encoded[0], dst),
    )
    time_compress = _time_ms(lambda i: _torch_compress(case.xs[i % sets]), settings.device, case.reps, settings.warmup)
    time_decompress = _time_ms(
        lambda i: _torch_decompress(*encoded[i % sets], case.dsts[i % sets]),
        settings.device,
        case.reps,
        settings.warmup,
    )
    time_accumulate = _time_ms(
        lambda i: _torch_accumulate(*encoded[i % sets], case.dsts[i % sets]),
        settings.device,
        case.reps,
        settings.warmup,
    )
    nnz = round(statistics.mean(counts))
    payload = formats.coo_bytes(case.n, nnz, case.dtype)
    return [
        case.row("compress", "torch", "torch", time_compress, case.size_bytes + payload, nnz, payload, decoded),
        case.row("decompress", "torch", "torch", time_decompress, payload + case.size_bytes, nnz, payload, decoded),
        case.row(
            "accumulate", "torch", "torch", time_accumulate, payload + 2 * case.size_bytes, nnz, payload, accumulated
        ),
    ]


def _bench_case(dtype_name: str, size: int, sparsity: float, settings: _Settings, backend: str) -> list[_Row]:
    dtype = _DTYPES[dtype_name]
    n = size // torch.empty((), dtype=dtype).element_size()
    sets = _input_sets(size, settings.device)
    case = _Case(
        dtype_name=dtype_name,
        dtype=dtype,
        size_bytes=n * torch.empty((), dtype=dtype).element_size(),
        sparsity=sparsity,
        n=n,
        xs=[_sparse_input(n, dtype, sparsity, settings.device) for _ in range(sets)],
        dsts=[torch.empty(n, dtype=dtype, device=settings.device) for _ in range(sets)],
        reps=settings.reps_1g if size >= 1 << 30 else settings.reps,
    )
    rows = []
    for impl in ("pici", "coo"):
        rows += _bench_spccl(case, impl, settings, backend)
        benchlib.free_cache(settings.device)
    rows += _bench_torch(case, settings)
    del case
    benchlib.free_cache(settings.device)
    return rows


# ---------------------------------------------------------------------------------------
# Reporting


def _finish(rows: list[_Row], copy_gbps: float) -> None:
    """Fill in GB/s, fraction of copy bandwidth and the speedup over the torch baseline."""
    torch_ms = {(r.dtype, r.size_bytes, r.sparsity, r.op): r.time_ms for r in rows if r.impl == "torch"}
    for r in rows:
        r.gbps = r.bytes_moved / (r.time_ms * 1e6)
        r.frac_copy = r.gbps / copy_gbps
        base = torch_ms.get((r.dtype, r.size_bytes, r.sparsity, r.op))
        if r.impl != "torch" and base is not None:
            r.speedup_vs_torch = base / r.time_ms


_TABLE = "{:<5} {:>5} {:>6} {:<10} {:<6} {:>9} {:>8} {:>6} {:>8} {:>3}"


def _print_rows(rows: list[_Row]) -> None:
    for r in rows:
        speedup = f"{r.speedup_vs_torch:.2f}x" if r.speedup_vs_torch is not None else "-"
        print(
            _TABLE.format(
                r.dtype,
                benchlib.size_label(r.size_bytes),
                f"{r.sparsity:g}",
                r.op,
                r.impl,
                f"{r.time_ms:.3f}",
                f"{r.gbps:.0f}" if r.gbps >= 10 else f"{r.gbps:.2f}",
                f"{r.frac_copy:.2f}",
                speedup,
                "ok" if r.verified else "BAD",
            ),
            flush=True,
        )


def _write_csv(rows: list[_Row], path: pathlib.Path, meta: dict[str, str], copy_gbps: float) -> None:
    fields = [
        "date",
        "device",
        "torch",
        "commit",
        "dtype",
        "size_bytes",
        "sparsity",
        "op",
        "impl",
        "backend",
        "time_ms",
        "time_min_ms",
        "time_max_ms",
        "bytes_moved",
        "gbps",
        "frac_copy",
        "copy_gbps",
        "speedup_vs_torch",
        "nnz",
        "payload_bytes",
        "reps",
        "input_sets",
        "verified",
    ]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {
                    **meta,
                    "dtype": r.dtype,
                    "size_bytes": r.size_bytes,
                    "sparsity": r.sparsity,
                    "op": r.op,
                    "impl": r.impl,
                    "backend": r.backend,
                    "time_ms": f"{r.time_ms:.6f}",
                    "time_min_ms": f"{r.time_min_ms:.6f}",
                    "time_max_ms": f"{r.time_max_ms:.6f}",
                    "bytes_moved": r.bytes_moved,
                    "gbps": f"{r.gbps:.2f}",
                    "frac_copy": f"{r.frac_copy:.4f}",
                    "copy_gbps": f"{copy_gbps:.2f}",
                    "speedup_vs_torch": "" if r.speedup_vs_torch is None else f"{r.speedup_vs_torch:.3f}",
                    "nnz": r.nnz,
                    "payload_bytes": r.payload_bytes,
                    "reps": r.reps,
                    "input_sets": r.input_sets,
                    "verified": r.verified,
                }
            )


def _plot(rows: list[_Row], path: pathlib.Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is missing: no plot ({path.name})")
        return False
    largest = max(r.size_bytes for r in rows)
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    sparsities = sorted({r.sparsity for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False, sharey=True)
    colors = {"compress": "tab:blue", "decompress": "tab:orange", "accumulate": "tab:green"}
    styles = {"pici": "-", "coo": "--", "torch": ":"}
    for ax, dtype in zip(axes[0], dtypes):
        for op in _OPS:
            for impl in _IMPLS:
                points = {
                    r.sparsity: r.frac_copy
                    for r in rows
                    if (r.dtype, r.size_bytes, r.op, r.impl) == (dtype, largest, op, impl)
                }
                if points:
                    xs = [i for i, s in enumerate(sparsities) if s in points]
                    ax.plot(
                        xs,
                        [points[sparsities[i]] for i in xs],
                        styles[impl],
                        marker="o",
                        color=colors[op],
                        label=f"{impl} {op}",
                    )
        ax.axhline(_TARGET_FRAC["compress"], color="grey", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(sparsities)), [f"{s:g}" for s in sparsities])
        ax.set_xlabel("sparsity (%)")
        ax.set_title(f"{dtype}, {benchlib.size_label(largest)}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of device-to-device copy bandwidth (log)")
    axes[0][-1].legend(fontsize=7, ncol=3, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _summary(rows: list[_Row], settings: _Settings) -> None:
    """The closing table: Pici at the largest size, every dtype, against the targets, and the cases
    that miss them."""
    size = max(settings.sizes)
    pick = {(r.dtype, r.sparsity, r.op): r for r in rows if r.size_bytes == size and r.impl == "pici"}
    judged = [s for s in settings.sparsities if s >= _TARGET_FROM]
    print()
    print(
        f"summary: Pici, {benchlib.size_label(size)}: fraction of copy bandwidth (targets at {_TARGET_FROM:g}% "
        "sparsity and above: " + ", ".join(f"{op} >= {frac:.2f}" for op, frac in _TARGET_FRAC.items()) + "), "
        f"and compress speedup over torch nonzero COO (target >= {_TARGET_SPEEDUP:g}x at {_TARGET_SPEEDUP_AT:g}%)"
    )
    print(f"{'dtype':>5} {'sparsity':>8}  " + "  ".join(f"{op:>10} {'':4}" for op in _OPS) + f"  {'speedup':>8}")
    missed = []
    for dtype in settings.dtypes:
        for sparsity in settings.sparsities:
            cells = []
            for op in _OPS:
                frac = pick[(dtype, sparsity, op)].frac_copy
                verdict = ""
                if sparsity in judged:
                    verdict = "PASS" if frac >= _TARGET_FRAC[op] else "FAIL"
                    if verdict == "FAIL":
                        missed.append(f"{dtype} {sparsity:g}% {op} {frac:.2f}")
                cells.append(f"{frac:>10.2f} {verdict:4}")
            speedup = pick[(dtype, sparsity, "compress")].speedup_vs_torch or 0.0
            target = ("PASS" if speedup >= _TARGET_SPEEDUP else "FAIL") if sparsity == _TARGET_SPEEDUP_AT else ""
            print(f"{dtype:>5} {sparsity:>7g}%  " + "  ".join(cells) + f"  {speedup:>7.2f}x {target}")
    if not judged:
        print(f"(no case at {_TARGET_FROM:g}% sparsity or above: fractions not judged)")
    if _TARGET_SPEEDUP_AT not in settings.sparsities:
        print(f"(no {_TARGET_SPEEDUP_AT:g}% case in this run: speedup target not judged)")
    total = len(judged) * len(_OPS) * len(settings.dtypes)
    print(
        f"targets: {total - len(missed)} of {total} fractions met"
        + (f"; missed: {', '.join(missed)}" if missed else "")
    )
    spread = [r for r in pick.values() if r.sparsity in judged and r.time_min_ms > 0]
    if spread:
        worst = max(spread, key=lambda r: r.time_max_ms / r.time_min_ms)
        print(
            f"spread of those rows' reps (slowest / fastest): worst {worst.time_max_ms / worst.time_min_ms:.2f}x "
            f"({worst.dtype} {worst.sparsity:g}% {worst.op}: {worst.time_min_ms:.3f}-{worst.time_max_ms:.3f} ms)"
        )
    bad = [r for r in rows if not r.verified]
    print(
        f"verification: {len(rows) - len(bad)} of {len(rows)} timed rows decode bit for bit"
        + (
            "; FAILED: "
            + ", ".join(f"{r.dtype}/{benchlib.size_label(r.size_bytes)}/{r.sparsity:g}%/{r.impl} {r.op}" for r in bad)
            if bad
            else ""
        )
    )


def main(argv: list[str] | None = None) -> int:
    settings = _settings(argv)
    if settings.smoke:
        backend = "reference"
    else:
        try:
            load_kernels()
        except KernelsUnavailableError as exc:
            print(f"the spccl CUDA kernels are not available ({exc}); use --smoke for the reference codecs on the CPU")
            return 2
        backend = "kernels"
    now = datetime.datetime.now()
    device_name = benchlib.device_name(settings.device)
    meta = {
        "date": now.isoformat(timespec="seconds"),
        "device": device_name,
        "torch": torch.__version__,
        "commit": git_commit(),
    }
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    stem = settings.out_dir / f"codecs_{benchlib.slug(device_name)}_{now.date().isoformat()}"

    copy_gbps = _copy_gbps(settings)
    timer = "CUDA events" if settings.device.type == "cuda" else "time.perf_counter (smoke: CPU, reference codecs)"
    print(f"device: {device_name}   torch {meta['torch']}   commit {meta['commit']}   {meta['date']}")
    print(
        f"timing: {timer}; {settings.warmup} warm-up calls, median of {settings.reps} reps ({settings.reps_1g} at >= 1 GiB)"
    )
    print(f"copy bandwidth (dst.copy_(src), read + write): {copy_gbps:.0f} GB/s")
    print(_BYTES_MOVED)
    print(_TABLE.format("dtype", "size", "spars%", "op", "impl", "ms", "GB/s", "frac", "vs torch", "ok"))

    rows: list[_Row] = []
    for dtype_name in settings.dtypes:
        for size in settings.sizes:
            for sparsity in settings.sparsities:
                case_rows = _bench_case(dtype_name, size, sparsity, settings, backend)
                _finish(case_rows, copy_gbps)
                _print_rows(case_rows)
                rows += case_rows

    csv_path = stem.with_suffix(".csv")
    _write_csv(rows, csv_path, meta, copy_gbps)
    title = f"{device_name}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}; copy {copy_gbps:.0f} GB/s"
    png_path = stem.with_suffix(".png")
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if _plot(rows, png_path, title) else ""))
    _summary(rows, settings)
    return 0 if all(r.verified for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
