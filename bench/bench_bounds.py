"""Collectives planned from counts, from bounds, and from bounds replayed as a CUDA graph, against NCCL.

Run on the GPU machine::

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=4 bench/bench_bounds.py [--sizes 1G 256M 64M] \
        [--collectives all_reduce all_gather reduce_scatter] [--sparsity 99 95 ...] [--channels 1] \
        [--methods auto pici/direct ...] [--paths exchange bounds bounds+graph] [--iterations 50]

fp32, i.i.d. sparsity (99% unless --sparsity says otherwise; a distinct seed per rank); the bounds
are 1.2x each piece's expected share of nonzeros. A size is the whole tensor, as in
``bench_collectives.py``: the all-reduce tensor, the all-gather output, the reduce-scatter input.
One input buffer, as a DDP bucket is: every timed iteration refills it from the source tensor (a
device copy) and runs the collective, and the time of the refill loop alone is subtracted, so a
CUDA graph (which replays on fixed addresses) and the eager calls are timed alike. Each variant is
verified against NCCL's result after its warm-up and again after the timed loop. ``host ms`` is
the host time to issue one call (no synchronisation in between; the calls with an exchange
synchronise by design, so theirs is their whole time).

Prints a table (the slowest rank's mean per call, the ratio to eager NCCL of the same run),
writes a PNG of speedup heatmaps beside the CSV (``--plot CSV`` redraws one without running), and
writes ``bench/results/collectives_bounds_<device>x<world>_<date>[tags].csv`` with date, device,
world size and commit.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import itertools
import pathlib
import time

import torch
import torch.distributed as dist
from benchlib import device_name, parse_size, size_label, slug

import spccl_train
from spccl_train._provenance import git_commit
from spccl_train.collectives import CollectiveConfig, clear_graphs, last_stats
from spccl_train.collectives.chunking import ChunkLayout
from spccl_train.transport.dense import all_gather_flat, reduce_scatter_flat

SLACK = 1.2
PATHS = ("exchange", "bounds", "bounds+graph")
NATIVE = {
    "all_reduce": lambda out, inp: dist.all_reduce(out),
    "all_gather": lambda out, inp: all_gather_flat(out, inp),
    "reduce_scatter": lambda out, inp: reduce_scatter_flat(out, inp),
}
SPCCL = {
    "all_reduce": lambda out, inp, **kw: spccl_train.all_reduce(out, **kw),
    "all_gather": lambda out, inp, **kw: spccl_train.all_gather_into_tensor(out, inp, **kw),
    "reduce_scatter": lambda out, inp, **kw: spccl_train.reduce_scatter_tensor(out, inp, **kw),
}
METHODS = {
    "auto": {"format": "auto", "algorithm": "auto"},
    "pici/direct": {"format": "pici", "algorithm": "direct"},
    "coo/direct": {"format": "coo", "algorithm": "direct"},
}


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _loop_ms(fn, device: torch.device, iterations: int) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    torch.cuda.synchronize()
    return _max_over_ranks((time.perf_counter() - t0) / iterations * 1e3, device)


def _host_ms(fn, device: torch.device, iterations: int = 10) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    ms = (time.perf_counter() - t0) / iterations * 1e3
    torch.cuda.synchronize()
    return _max_over_ranks(ms, device)


def _case(args: argparse.Namespace, collective: str, sparsity: float, nbytes: int, dev: torch.device) -> list[tuple]:
    """Time NCCL and every SpCCL variant on one collective, sparsity and size; one row per variant."""
    r, p = dist.get_rank(), dist.get_world_size()
    rows = []
    density = 1.0 - sparsity / 100.0
    numel = nbytes // 4
    n_in = numel // p if collective == "all_gather" else numel
    g = torch.Generator(device=dev).manual_seed(r + 1)
    src = torch.randn(n_in, device=dev, generator=g)
    src[torch.rand(n_in, device=dev, generator=g) >= density] = 0
    buf = src.clone()
    out = (
        buf
        if collective == "all_reduce"
        else torch.empty(numel // p if collective == "reduce_scatter" else numel, device=dev)
    )
    layout = ChunkLayout.of(collective, numel, p, args.channels)
    bounds = [[min(pc.numel, int(pc.numel * density * SLACK)) for chunk in layout.pieces for pc in chunk]] * p
    ref = src.clone() if collective == "all_reduce" else torch.empty_like(out)
    NATIVE[collective](ref, src)

    def refill() -> None:
        buf.copy_(src)

    def check(name: str, when: str) -> None:
        if not torch.allclose(out, ref, rtol=1e-5, atol=1e-5):
            raise AssertionError(f"{collective} {name}: result differs from NCCL's {when}")

    refill_ms = _loop_ms(refill, dev, args.iterations)
    variants = [("nccl", lambda: NATIVE[collective](out, buf), False)]
    graph = torch.cuda.CUDAGraph()
    variants.append(("nccl+graph", graph.replay, False))
    spccl = SPCCL[collective]
    for name in args.methods:
        cfg = CollectiveConfig(**METHODS[name], channels=args.channels)
        graphed = dataclasses.replace(cfg, cuda_graphs=True)
        paths = {
            "exchange": (lambda cfg=cfg: spccl(out, buf, config=cfg), False),
            "bounds": (lambda cfg=cfg: spccl(out, buf, config=cfg, bounds=bounds), True),
            "bounds+graph": (lambda c=graphed: spccl(out, buf, config=c, bounds=bounds), True),
        }
        variants += [(f"{name}+{path}", *paths[path]) for path in args.paths]
    for name, call, host in variants:
        if name == "nccl+graph":
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                NATIVE[collective](out, buf)
        for _ in range(2):  # warm-up; a graphed call is captured on its second run
            refill()
            call()
        refill()
        call()
        torch.cuda.synchronize()
        check(name, "after the warm-up")
        stats = last_stats() if name.startswith(tuple(METHODS)) else None
        ms = _loop_ms(lambda: (refill(), call()), dev, args.iterations) - refill_ms
        check(name, "after the timed loop")
        host_ms = _host_ms(call, dev) if host else float("nan")
        plan = f"{stats.algorithm}/{stats.format.value}" if stats is not None else "native"
        rows.append((collective, sparsity, nbytes, name, plan, ms, host_ms))
    clear_graphs()  # a graph holding NCCL work makes destroy_process_group wait forever
    return rows


def plot(csv_path: pathlib.Path) -> pathlib.Path | None:
    """Speedup heatmaps of a CSV this script wrote: a panel per collective and SpCCL variant,
    sizes by sparsity, each cell the ratio to eager NCCL (green above 1). Returns the PNG's path
    (``None`` without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no heatmap", flush=True)
        return None
    with csv_path.open() as f:
        rows = [row for row in csv.DictReader(f) if not row["variant"].startswith("nccl")]
    panels = sorted({(row["collective"], row["variant"]) for row in rows})
    sizes = sorted({int(row["bytes"]) for row in rows})
    sparsities = sorted({float(row["sparsity"]) for row in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1, 0.5 * len(sizes) + 2), squeeze=False)
    for ax, (collective, variant) in zip(axes[0], panels):
        grid = [[float("nan")] * len(sparsities) for _ in sizes]
        for row in rows:
            if (row["collective"], row["variant"]) == (collective, variant):
                grid[sizes.index(int(row["bytes"]))][sparsities.index(float(row["sparsity"]))] = float(
                    row["speedup_vs_nccl"]
                )
        ax.imshow(grid, cmap="RdYlGn", norm=matplotlib.colors.LogNorm(0.25, 4.0), aspect="auto")
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(sparsities)), [f"{sp:g}" for sp in sparsities])
        ax.set_yticks(range(len(sizes)), [size_label(n) for n in sizes])
        ax.set_xlabel("sparsity %")
        ax.set_title(f"{collective}\n{variant}", fontsize=9)
    first = rows[0] if rows else {"device": "?", "world": "?", "channels": "?", "commit": "?"}
    fig.suptitle(
        f"speedup over NCCL, {first['device']} x{first['world']}, channels {first['channels']}, {first['commit']}"
    )
    fig.tight_layout()
    png = csv_path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", type=pathlib.Path, help="only draw the heatmaps of a CSV this script wrote")
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[1 << 30, 1 << 28, 1 << 26])
    parser.add_argument(
        "--sparsity", nargs="+", type=float, default=[99.0], help="percents of zeros in each rank's input"
    )
    parser.add_argument("--collectives", nargs="+", choices=list(NATIVE), default=["all_reduce"])
    parser.add_argument(
        "--paths", nargs="+", choices=PATHS, default=list(PATHS), help="how SpCCL calls plan: counts, bounds, graphed"
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=50,
        help="timed calls per variant; the first call's host latency is spread over them",
    )
    parser.add_argument("--channels", type=int, default=1, help="pieces per chunk (CollectiveConfig.channels)")
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="SpCCL configs to run"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.plot is not None:
        print(f"wrote {plot(args.plot)}")
        return
    for sp in args.sparsity:
        if not 0.0 <= sp < 100.0:
            parser.error(f"--sparsity {sp}: must lie in [0, 100)")
    dist.init_process_group("nccl")
    r, p = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(r)
    dev = torch.device("cuda", r)
    rows = []
    for collective, sparsity, nbytes in itertools.product(args.collectives, args.sparsity, args.sizes):
        rows += _case(args, collective, sparsity, nbytes, dev)
    if r == 0:
        now = datetime.datetime.now()
        device = device_name(dev)
        base = {(c, sp, nbytes): ms for c, sp, nbytes, name, _, ms, _ in rows if name == "nccl"}
        print(
            f"{'collective':>14} {'sparsity':>8} {'size':>6}  {'variant':24s} {'plan':12s} {'ms':>8} {'x NCCL':>7} {'host ms':>8}"
        )
        for c, sp, nbytes, name, plan, ms, host_ms in rows:
            speedup = base[c, sp, nbytes] / ms
            print(
                f"{c:>14} {sp:8g} {size_label(nbytes):>6}  {name:24s} {plan:12s} {ms:8.3f} {speedup:7.2f} {host_ms:8.3f}"
            )
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "".join(
            [
                "" if args.collectives == ["all_reduce"] else "_" + "_".join(args.collectives),
                "" if args.sparsity == [99.0] else "_sp" + "_".join(f"{sp:g}" for sp in args.sparsity),
                "" if args.channels == 1 else f"_ch{args.channels}",
            ]
        )
        path = args.out / f"collectives_bounds_{slug(device)}x{p}_{now:%Y-%m-%d}{tag}.csv"
        header = [
            "date",
            "device",
            "world",
            "commit",
            "torch",
            "collective",
            "bytes",
            "sparsity",
            "channels",
            "iterations",
        ]
        header += ["variant", "plan", "ms", "speedup_vs_nccl", "host_ms"]
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            for c, sp, nbytes, name, plan, ms, host_ms in rows:
                writer.writerow(
                    [now.isoformat(timespec="seconds"), device, p, git_commit(), torch.__version__, c, nbytes, sp]
                    + [
                        args.channels,
                        args.iterations,
                        name,
                        plan,
                        f"{ms:.4f}",
                        f"{base[c, sp, nbytes] / ms:.3f}",
                        f"{host_ms:.4f}",
                    ]
                )
        print(f"wrote {path} and {plot(path)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
