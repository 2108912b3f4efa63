"""Host cost of planning a sparse collective as the rank count grows, and what the cost model predicts there.

No process group is needed: every rank runs the same pure functions on the same count table, so
one process times what each rank does. A synthetic table stands in for the exchanged counts:
per piece, its element count times the density, with 1% noise per rank (i.i.d. data).

Part 1, host time per rank per call, for an all-reduce of ``--size`` fp32 at ``--sparsity``
with ``--ranks-per-node``, per world size and channel count:

- ``decide_new_ms``: a sparsity profile seen for the first time (the memo cleared): round the
  table, weigh every candidate (plans of all of them), pick;
- ``decide_memo_ms``: the same profile again (round the table, look the decision up);
- ``plan_ms``: plan the chosen candidate from the exact counts;
- ``exchange_bytes``: what the count exchange gathers onto each rank, ``world`` rows of
  ``len(HEADER_FIELDS) + world * channels`` int64.

A point whose first timing is predicted (from the square of the rank count, as the planner
scales) to take longer than ``--max-point-s`` is skipped and says so.

Part 2, the model's predictions for that all-reduce with 8 GPUs per node (``CostModel.default``
for CUDA, its network replaced by ``--networks`` GB/s per GPU): dense (NCCL's ring), the best
flat sparse candidate (ring or direct, Pici or COO) and the hierarchical all-reduce (reduce inside
each node, across nodes, gather; weighed where one of its steps would send sparsely), each with
its ratio to dense. Predictions, not
measurements: the table tells a user whether SpCCL can help on their cluster, as far as the
model knows it (``bench/results/2026-11-25_h100/README.md`` says how far that is on emulated nodes).

::

    python bench/bench_planning.py                                # both parts, defaults below
    python bench/bench_planning.py --worlds 8,64 --channels 1 --max-point-s 5    # quick
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import pathlib
import platform
import random
import sys
import time

import benchlib
import torch

from spccl_train._provenance import git_commit
from spccl_train.collectives import CollectiveConfig, CostModel, LinkCost, Topology
from spccl_train.collectives.choice import clear_decisions, decide, plan_candidate
from spccl_train.collectives.chunking import ChunkLayout
from spccl_train.collectives.exchange import HEADER_FIELDS

_REPO = pathlib.Path(__file__).resolve().parent.parent


def _table(layout: ChunkLayout, density: float, seed: int) -> list[list[int]]:
    """Each rank's nonzero count of every piece: ``numel * density`` with 1% noise."""
    rng = random.Random(seed)
    sizes = [piece.numel for chunk in layout.pieces for piece in chunk]
    return [
        [min(n, max(0, round(n * density * (1 + 0.01 * rng.uniform(-1, 1))))) for n in sizes]
        for _ in range(layout.world)
    ]


def _time(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _model(network_gbps: float | None) -> CostModel:
    model = CostModel.default("cuda")
    if network_gbps is None:
        return model
    return dataclasses.replace(model, inter=LinkCost(latency_s=model.inter.latency_s, bandwidth=network_gbps * 1e9))


def planning_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    numel = args.size // 4
    config = CollectiveConfig()
    model = _model(None)
    per_p2: dict[int, float] = {}  # channels -> seconds / p^2 of the last timed world, for the skip estimate
    for channels in args.channels:
        for world in args.worlds:
            layout = ChunkLayout.of("all_reduce", numel, world, channels)
            topology = Topology(world, args.ranks_per_node if args.ranks_per_node < world else None)
            row = {
                "world": world,
                "channels": channels,
                "ranks_per_node": args.ranks_per_node,
                "size_bytes": args.size,
                "sparsity": args.sparsity,
                "exchange_bytes": world * (len(HEADER_FIELDS) + world * channels) * 8,
            }
            estimate = per_p2.get(channels, 0.0) * world * world
            if estimate > args.max_point_s:
                row["note"] = f"skipped: about {estimate:.0f} s per weighing (O(p^2)), over --max-point-s"
                rows.append(row)
                print(_line(row), flush=True)
                continue
            table = _table(layout, 1 - args.sparsity / 100, seed=world * 10 + channels)
            key = f"bench|{world}|{channels}"

            def weigh():
                clear_decisions()
                return decide("all_reduce", config, key, table, layout, torch.float32, topology, model)

            start = time.perf_counter()
            choice, weighed = weigh()
            first = time.perf_counter() - start
            per_p2[channels] = first / (world * world)
            repeats = max(1, min(args.repeats, int(args.max_point_s / max(first, 1e-9))))
            row["decide_new_ms"] = 1e3 * min(first, _time(weigh, repeats - 1) if repeats > 1 else first)
            row["decide_memo_ms"] = 1e3 * _time(
                lambda: decide("all_reduce", config, key, table, layout, torch.float32, topology, model), repeats
            )
            row["plan_ms"] = 1e3 * _time(
                lambda: plan_candidate(choice, "all_reduce", config, table, layout, torch.float32, topology), repeats
            )
            row["chosen"] = f"{choice.algorithm}/{choice.format.value}"
            row["candidates"] = len(weighed)
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    def ms(key: str) -> str:
        return f"{row[key]:10.3f}" if key in row else f"{'-':>10s}"

    return (
        f"{row['world']:6d} {row['channels']:3d} {ms('decide_new_ms')} {ms('decide_memo_ms')} {ms('plan_ms')} "
        f"{row['exchange_bytes'] / 1024:12.1f} {row.get('chosen', ''):12s} {row.get('note', '')}"
    )


def model_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    numel = args.size // 4
    config = CollectiveConfig()
    per_p2 = 0.0  # seconds / p^2 of the last weighing, for the skip estimate
    for network in args.networks:
        model = _model(network)
        for world in args.gpus:
            layout = ChunkLayout.of("all_reduce", numel, world, 1)
            topology = Topology(world, 8 if world > 8 else None)
            row = {"gpus": world, "ranks_per_node": 8, "network_GBps": network, "size_bytes": args.size}
            row["sparsity"] = args.sparsity
            dense = model.predict_native("all_reduce", numel, torch.float32, topology, 0)
            row["dense_ms"] = 1e3 * dense
            estimate = per_p2 * world * world
            if estimate > args.max_point_s:
                row["note"] = f"not weighed: the flat planner would take about {estimate:.0f} s (O(p^2))"
                rows.append(row)
                print(_model_line(row), flush=True)
                continue
            table = _table(layout, 1 - args.sparsity / 100, seed=world)
            clear_decisions()
            start = time.perf_counter()
            _, weighed = decide(
                "all_reduce", config, "model", table, layout, torch.float32, topology, model, default_group=True
            )
            per_p2 = max(per_p2, (time.perf_counter() - start) / (world * world))
            sparse = {name: t for name, t in weighed.items() if name not in ("native/dense", "hierarchical")}
            best = min(sparse, key=sparse.get)
            row["sparse_ms"] = 1e3 * sparse[best]
            row["sparse_best"] = best
            row["speedup"] = dense / sparse[best]
            if "hierarchical" in weighed:  # weighed where one of its steps would send sparsely
                row["hierarchical_ms"] = 1e3 * weighed["hierarchical"]
                row["hierarchical_speedup"] = dense / weighed["hierarchical"]
            rows.append(row)
            print(_model_line(row), flush=True)
    return rows


def _model_line(row: dict) -> str:
    sparse = f"{row['sparse_ms']:10.2f} {row['sparse_best']:12s} {row['speedup']:7.2f}x" if "sparse_ms" in row else ""
    if "hierarchical_ms" in row:
        sparse += f" {row['hierarchical_ms']:10.2f} {row['hierarchical_speedup']:7.2f}x"
    return f"{row['gpus']:6d} {row['network_GBps']:8.0f} {row['dense_ms']:10.2f} {sparse} {row.get('note', '')}"


def _write(path: pathlib.Path, rows: list[dict], meta: dict) -> None:
    fields = list(meta) + list(dict.fromkeys(k for r in rows for k in r))  # keys in first-seen order
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({**meta, **{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()}})


def _plot(path: pathlib.Path, rows: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for channels in sorted({r["channels"] for r in rows}):
        timed = [r for r in rows if r["channels"] == channels and "decide_new_ms" in r]
        for key, style in (("decide_new_ms", "-o"), ("decide_memo_ms", "--s"), ("plan_ms", ":^")):
            ax.plot([r["world"] for r in timed], [r[key] for r in timed], style, label=f"{key[:-3]}, {channels} ch")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("host ms per rank per call")
    ax.set_title(
        f"planning a {benchlib.size_label(meta['size_bytes'])} all-reduce, commit {meta['commit']}", fontsize=9
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=benchlib.parse_size, default=1 << 30, help="all-reduce bytes, fp32 (default 1G)")
    p.add_argument("--sparsity", type=benchlib.parse_sparsity, default=99.0, help="percent (default 99)")
    p.add_argument("--worlds", type=_ints, default=[8, 64, 256, 1024], help="part 1 rank counts")
    p.add_argument("--channels", type=_ints, default=[1, 2], help="part 1 channel counts")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="timings per figure (the fastest is kept)")
    p.add_argument("--max-point-s", type=float, default=60.0, help="skip a point predicted to take longer")
    p.add_argument("--gpus", type=_ints, default=[16, 64, 256, 1024], help="part 2 GPU counts (8 per node)")
    p.add_argument("--networks", type=_floats, default=[25, 50, 100], help="part 2 network GB/s per GPU")
    p.add_argument("--out-dir", type=pathlib.Path, default=_REPO / "bench" / "results")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "date": now.isoformat(timespec="seconds"),
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "commit": git_commit(),
        "command": " ".join(["python", "bench/bench_planning.py", *(argv if argv is not None else sys.argv[1:])]),
        "size_bytes": args.size,
    }
    print(
        f"host planning per rank: all-reduce {benchlib.size_label(args.size)} fp32, {args.sparsity:g}% sparse, "
        f"{args.ranks_per_node} ranks per node; commit {meta['commit']}, {meta['date']}"
    )
    print(f"{'ranks':>6s} {'ch':>3s} {'new ms':>10s} {'memo ms':>10s} {'plan ms':>10s} {'exch KiB':>12s} chosen")
    plan = planning_rows(args)
    print(
        f"\nmodel: all-reduce {benchlib.size_label(args.size)} fp32 at {args.sparsity:g}%, 8 GPUs per node "
        "(CostModel.default for CUDA, network replaced); predictions, not measurements"
    )
    print(
        f"{'gpus':>6s} {'net GB/s':>8s} {'dense ms':>10s} {'flat ms':>10s} {'best flat':12s} {'ratio':>8s} "
        f"{'hier. ms':>10s} {'ratio':>8s}"
    )
    model = model_rows(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"planning_cpu_{now.date().isoformat()}"
    _write(stem.with_suffix(".csv"), plan, meta)
    _write(stem.with_name(stem.name + "_model.csv"), model, meta)
    if not args.no_plot and any("decide_new_ms" in r for r in plan):
        _plot(stem.with_suffix(".png"), plan, meta)
    print(f"\nwrote {stem}.csv, {stem.name}_model.csv" + ("" if args.no_plot else f", {stem.name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
