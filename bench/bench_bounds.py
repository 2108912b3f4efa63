"""All-reduce planned from counts, from bounds, and from bounds replayed as a CUDA graph, against NCCL.

Run on the GPU machine::

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=4 bench/bench_bounds.py [--sizes 1G 256M 64M] [--sparsity 99] [--channels 1]

fp32, i.i.d. sparsity (99% unless --sparsity says otherwise; a distinct seed per rank); the bounds are 1.2x each piece's expected
share of nonzeros. One buffer per variant, as a DDP bucket is: every timed iteration refills it
from the source tensor (a device copy) and reduces it, and the time of the refill loop alone is
subtracted, so a CUDA graph (which replays on fixed addresses) and the eager calls are timed
alike. Each variant is verified against NCCL's sum after its warm-up and again after the timed
loop. ``host ms`` is the host time to issue one call (no synchronisation in between; the calls
with an exchange synchronise by design, so theirs is their whole time).

Prints a table (the slowest rank's mean per call, the ratio to eager NCCL of the same run) and
writes ``bench/results/collectives_bounds_<device>x<world>_<date>.csv`` with date, device,
world size and commit.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import pathlib
import time

import torch
import torch.distributed as dist
from benchlib import device_name, parse_size, size_label, slug

import spccl_train
from spccl_train._provenance import git_commit
from spccl_train.collectives import CollectiveConfig, clear_graphs, last_stats
from spccl_train.collectives.chunking import ChunkLayout

ITERATIONS = 20
SLACK = 1.2
METHODS = {"auto": ("auto", "auto"), "pici/direct": ("pici", "direct"), "coo/direct": ("coo", "direct")}


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _loop_ms(fn, device: torch.device, iterations: int = ITERATIONS) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[1 << 30, 1 << 28, 1 << 26])
    parser.add_argument("--sparsity", type=float, default=99.0, help="percent of zeros in each rank's input")
    parser.add_argument("--channels", type=int, default=1, help="pieces per chunk (CollectiveConfig.channels)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    if not 0.0 < args.sparsity < 100.0:
        parser.error(f"--sparsity {args.sparsity}: must lie strictly between 0 and 100")
    density = 1.0 - args.sparsity / 100.0
    dist.init_process_group("nccl")
    r, p = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(r)
    dev = torch.device("cuda", r)
    rows = []
    for nbytes in args.sizes:
        numel = nbytes // 4
        g = torch.Generator(device=dev).manual_seed(r + 1)
        src = torch.randn(numel, device=dev, generator=g)
        src[torch.rand(numel, device=dev, generator=g) >= density] = 0
        buf = src.clone()
        layout = ChunkLayout.of("all_reduce", numel, p, args.channels)
        bounds = [[int(pc.numel * density * SLACK) for chunk in layout.pieces for pc in chunk]] * p
        ref = src.clone()
        dist.all_reduce(ref)

        def refill() -> None:
            buf.copy_(src)

        refill_ms = _loop_ms(refill, dev)
        variants = [("nccl", lambda: dist.all_reduce(buf), False)]
        graph = torch.cuda.CUDAGraph()
        variants.append(("nccl+graph", graph.replay, False))
        for name, (fmt, algorithm) in METHODS.items():
            cfg = CollectiveConfig(format=fmt, algorithm=algorithm, channels=args.channels)
            graphed = dataclasses.replace(cfg, cuda_graphs=True)
            variants += [
                (f"{name}+exchange", lambda cfg=cfg: spccl_train.all_reduce(buf, config=cfg), False),
                (f"{name}+bounds", lambda cfg=cfg: spccl_train.all_reduce(buf, config=cfg, bounds=bounds), True),
                (f"{name}+bounds+graph", lambda c=graphed: spccl_train.all_reduce(buf, config=c, bounds=bounds), True),
            ]
        for name, call, host in variants:
            if name == "nccl+graph":
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    dist.all_reduce(buf)
            for _ in range(2):  # warm-up; a graphed call is captured on its second run
                refill()
                call()
            refill()
            call()
            torch.cuda.synchronize()
            if not torch.allclose(buf, ref, rtol=1e-5, atol=1e-5):
                raise AssertionError(f"{name}: result differs from NCCL's after the warm-up")
            stats = last_stats() if name.startswith(tuple(METHODS)) else None
            ms = _loop_ms(lambda: (refill(), call()), dev) - refill_ms
            if not torch.allclose(buf, ref, rtol=1e-5, atol=1e-5):
                raise AssertionError(f"{name}: result differs from NCCL's after the timed loop")
            host_ms = _host_ms(call, dev) if host else float("nan")
            plan = f"{stats.algorithm}/{stats.format.value}" if stats is not None else "native"
            rows.append((nbytes, name, plan, ms, host_ms))
    clear_graphs()
    del graph, variants  # a graph holding NCCL work makes destroy_process_group wait forever
    if r == 0:
        now = datetime.datetime.now()
        device = device_name(dev)
        base = {nbytes: ms for nbytes, name, _, ms, _ in rows if name == "nccl"}
        print(f"{'size':>8}  {'variant':24s} {'plan':12s} {'ms':>8} {'x NCCL':>7} {'host ms':>8}")
        for nbytes, name, plan, ms, host_ms in rows:
            print(f"{size_label(nbytes):>8}  {name:24s} {plan:12s} {ms:8.3f} {base[nbytes] / ms:7.2f} {host_ms:8.3f}")
        args.out.mkdir(parents=True, exist_ok=True)
        tag = ("" if args.sparsity == 99.0 else f"_sp{args.sparsity:g}") + (
            "" if args.channels == 1 else f"_ch{args.channels}"
        )
        path = args.out / f"collectives_bounds_{slug(device)}x{p}_{now:%Y-%m-%d}{tag}.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(
                [
                    "date",
                    "device",
                    "world",
                    "commit",
                    "torch",
                    "bytes",
                    "sparsity",
                    "channels",
                    "variant",
                    "plan",
                    "ms",
                    "speedup_vs_nccl",
                    "host_ms",
                ]
            )
            for nbytes, name, plan, ms, host_ms in rows:
                writer.writerow(
                    [
                        now.isoformat(timespec="seconds"),
                        device,
                        p,
                        git_commit(),
                        torch.__version__,
                        nbytes,
                        args.sparsity,
                        args.channels,
                        name,
                        plan,
                        f"{ms:.4f}",
                        f"{base[nbytes] / ms:.3f}",
                        f"{host_ms:.4f}",
                    ]
                )
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
