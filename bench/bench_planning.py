"""Host cost of planning a sparse collective as the rank count grows, and what the cost model predicts there.

No process group is needed: every rank runs the same pure functions on the same count table, so
one process times what each rank does. A synthetic table stands in for the exchanged counts:
per piece, its element count times the density, with 1% noise per rank (i.i.d. data).

Part 1, host time per rank per call, for an all-reduce of ``--size`` fp32 at ``--sparsity``
with ``--ranks-per-node``, per world size and channel count:

- ``summary_ms``: summarise what the exchange delivered
  (:class:`~spccl_train.collectives.summary.CountSummary`): under the table protocol integer sums
  over the ``world x world x channels`` table; under the scalable one O(world x channels);
- ``decide_new_ms``: a sparsity profile seen for the first time (the memo cleared): summarise,
  round the summary, weigh every candidate from it, pick;
- ``decide_memo_ms``: the same profile again (summarise, round, look the decision up);
- ``plan_ms``: rank 0's plan of the chosen candidate (if native, of direct Pici) from the exact
  counts: its own messages, both phases (the gather phase sized from the bounds), as columns;
- ``total_new_ms`` / ``total_memo_ms``: planning and choice per rank per call, ``decide + plan``;
- ``total_new_default_group_ms``: the same for a new profile on the default group of several
  nodes, where ``auto`` also weighs the hierarchical all-reduce (its three steps looked up in
  their curves: :func:`~spccl_train.collectives.hierarchical.predict`);
- ``curves_ms``: the first such call of a bucket shape, which makes the steps' curves (each step
  weighed at every density of the decision grid, once per step shape, config and model);
- ``reads_ms``: what rank 0's executors read of the plan before launching anything (split sizes,
  and each message's fields as lists): not planning, but per-call host work that grows with the
  ranks (the executors then launch a codec call per message);
- ``protocol``, ``exchange_bytes``: the count exchange of a group of that size
  (:func:`~spccl_train.collectives.exchange.protocol`) and what it delivers to each rank;
  ``table_bytes``: what the table protocol would (``world`` rows of ``11 + world * channels`` int64).

Under the scalable protocol a rank's host work is timed as it runs: its share of the third round
(``owner_terms``, in ``summary_ms``), the summary from the exchanged maxima and sums, the
decision and its plan; the collectives' results are made from the synthetic table, untimed.

A point whose first timing is predicted (from the square of the rank count, as the table
grows) to take longer than ``--max-point-s`` is skipped and says so.

Part 2, the model's predictions for that all-reduce with 8 GPUs per node (``CostModel.default``
for CUDA, its network replaced by ``--networks`` GB/s per GPU), each group exchanging counts by
its protocol (from 32 GPUs the scalable one: three rounds, rings not weighed): dense (NCCL's
ring), the best flat sparse candidate (ring or direct, Pici or COO) and the hierarchical all-reduce (reduce inside
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
import sys
import time

import benchlib
import numpy as np
import torch

from spccl_train._provenance import git_commit
from spccl_train.collectives import CollectiveConfig, CostModel, LinkCost, Topology, _direct, _ring, hierarchical
from spccl_train.collectives.choice import Candidate, clear_decisions, decide, plan_candidate
from spccl_train.collectives.chunking import ChunkLayout
from spccl_train.collectives.exchange import Counts, exchange_bytes, exchange_rounds, owner_terms, protocol
from spccl_train.collectives.rank_plan import plan_all_gather_for
from spccl_train.collectives.summary import CountSummary
from spccl_train.formats import Format

_REPO = pathlib.Path(__file__).resolve().parent.parent


def _table(layout: ChunkLayout, density: float, seed: int) -> np.ndarray:
    """Each rank's nonzero count of every piece, ``numel * density`` with 1% noise, as the exchange
    hands it over (an int64 array of ``world`` rows)."""
    rng = np.random.default_rng(seed)
    sizes = np.array([piece.numel for chunk in layout.pieces for piece in chunk], dtype=np.int64)
    noise = 1 + 0.01 * rng.uniform(-1, 1, size=(layout.world, len(sizes)))
    return np.clip(np.rint(sizes * density * noise), 0, sizes).astype(np.int64)


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


def _counts(table: np.ndarray, layout: ChunkLayout, topology: Topology, how: str, rank: int):
    """What rank ``rank`` holds after the count exchange of protocol ``how``, and the host work it
    does to get there (a function to time): the table protocol's rows, or the scalable protocol's
    row, column, gathered bounds and reduced sums and maxima (the collectives' results are made
    here from the whole table, untimed; each rank's own terms are timed)."""
    if how == "table":
        return lambda: Counts.from_table("all_reduce", table, layout, rank)
    p, ch = layout.world, layout.channels
    cube = table.reshape(p, p, ch)
    terms = [owner_terms(cube[q], cube[:, q], layout, topology, q) for q in range(p)]
    maxima = np.max([t[0] for t in terms], axis=0)
    bounds = np.stack([t[1] for t in terms])
    sums = np.sum([t[2] for t in terms], axis=0)

    def received() -> Counts:
        owner_terms(cube[rank], cube[:, rank], layout, topology, rank)  # this rank's share of round 3
        return Counts(
            "all_reduce",
            cube[rank],
            cube[:, rank],
            bounds,
            None,
            maxima[:2],
            maxima[2:],
            sums[:ch],
            int(sums[ch]),
        )

    return received


def _plan(candidate: Candidate, config: CollectiveConfig, counts: Counts, layout: ChunkLayout, topology: Topology):
    """Rank 0's plan of an all-reduce: its reduce-scatter phase, then its gather phase sized from the bounds."""
    scatter = plan_candidate(candidate, "all_reduce", config, counts, layout, torch.float32, topology, 0)
    th = config.thresholds.resolve(candidate.format)
    gather = plan_all_gather_for(
        0, counts.reduced_bounds(), layout, torch.float32, fmt=candidate.format, algorithm=candidate.algorithm,
        threshold=th.ag, topology=topology, collective="all_reduce", measured=False,
    )  # fmt: skip
    return scatter.then(gather)


def _reads(plan) -> None:
    """What rank 0's executors read of its plan before they launch anything: a direct plan's split
    sizes and per-wave fields, a ring's messages per step and piece (lists of the columns)."""
    p, ch = plan.world, plan.layout.channels
    if plan.algorithm == "direct":
        scatter, gather = plan.steps
        messages = scatter.messages
        sends, receives = messages.columns["src"] == 0, messages.columns["dst"] == 0
        _direct._splits(messages, sends, "dst", ch, p), _direct._splits(messages, receives, "src", ch, p)
        _direct._waves(messages, sends, ch, "start", "numel", "format", "nbytes")
        _direct._waves(messages, receives, ch, "start", "numel", "format", "nbytes")
        messages = gather.messages
        to_right = (messages.columns["src"] == 0) & (messages.columns["dst"] == 1 % p)
        _direct._waves(messages, to_right, ch, "start", "numel", "format", "nbytes")
        _direct._waves(
            messages, messages.columns["dst"] == 0, ch, "src", "start", "numel", "format", "nbytes", "nnz_bound"
        )
    else:
        for step in plan.steps:
            _ring._by_piece(step.messages, 0, "dst"), _ring._by_piece(step.messages, 0, "src")


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
            how = protocol(world)
            rounds, rings = exchange_rounds(how, "all_reduce"), how == "table"
            row = {
                "world": world,
                "channels": channels,
                "ranks_per_node": args.ranks_per_node,
                "size_bytes": args.size,
                "sparsity": args.sparsity,
                "protocol": how,
                "exchange_bytes": exchange_bytes(how, "all_reduce", world, channels),
                "table_bytes": exchange_bytes("table", "all_reduce", world, channels),
            }
            estimate = per_p2.get(channels, 0.0) * world * world
            if estimate > args.max_point_s:
                row["note"] = (
                    f"skipped: about {estimate:.0f} s to make the synthetic table (O(p^2)), over --max-point-s"
                )
                rows.append(row)
                print(_line(row), flush=True)
                continue
            start = time.perf_counter()
            table = _table(layout, 1 - args.sparsity / 100, seed=world * 10 + channels)
            receive = _counts(table, layout, topology, how, rank=0)
            per_p2[channels] = (time.perf_counter() - start) / (world * world)
            key = f"bench|{world}|{channels}|{how}"

            def summarise():
                return receive().summary(layout, topology)

            def choose_new():
                clear_decisions()
                return decide(config, key, summarise(), torch.float32, model, 1, None, False, rounds, rings)

            def choose_memo():
                return decide(config, key, summarise(), torch.float32, model, 1, None, False, rounds, rings)

            def choose_new_default_group():  # a call on the default group also weighs the hierarchical one
                clear_decisions()
                return decide(config, key, summarise(), torch.float32, model, 1, None, True, rounds, rings)

            def make_curves():  # the first call of this shape on the default group
                clear_decisions(curves=True)
                return decide(config, key, summarise(), torch.float32, model, 1, None, True, rounds, rings)

            choice, weighed = choose_new()
            counts = receive()
            repeats = args.repeats
            row["summary_ms"] = 1e3 * _time(summarise, repeats)
            row["decide_new_ms"] = 1e3 * _time(choose_new, repeats)
            row["decide_memo_ms"] = 1e3 * _time(choose_memo, repeats)
            sparse = next(c for c in (choice, Candidate("direct", Format.PICI, 0.0)) if c.algorithm != "native")
            row["plan_ms"] = 1e3 * _time(lambda: _plan(sparse, config, counts, layout, topology), repeats)
            planned = _plan(sparse, config, counts, layout, topology)
            row["reads_ms"] = 1e3 * _time(lambda: _reads(planned), repeats)
            row["total_new_ms"] = row["decide_new_ms"] + row["plan_ms"]
            row["total_memo_ms"] = row["decide_memo_ms"] + row["plan_ms"]
            if hierarchical.applies(topology):
                row["curves_ms"] = 1e3 * _time(make_curves, repeats)
                row["decide_new_default_group_ms"] = 1e3 * _time(choose_new_default_group, repeats)
                row["total_new_default_group_ms"] = row["decide_new_default_group_ms"] + row["plan_ms"]
            row["chosen"] = f"{choice.algorithm}/{choice.format.value}"
            row["planned"] = sparse.name
            row["candidates"] = len(weighed)
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    def ms(key: str) -> str:
        return f"{row[key]:10.3f}" if key in row else f"{'-':>10s}"

    return (
        f"{row['world']:6d} {row['channels']:3d} {ms('summary_ms')} {ms('decide_new_ms')} {ms('decide_memo_ms')} "
        f"{ms('plan_ms')} {ms('total_new_ms')} {ms('total_memo_ms')} {ms('total_new_default_group_ms')} "
        f"{ms('curves_ms')} {ms('reads_ms')} {row['protocol']:>8s} "
        f"{row['exchange_bytes'] / 1024:10.1f} {row['table_bytes'] / 1024:10.1f} {row.get('chosen', ''):12s} "
        f"{row.get('note', '')}"
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
                row["note"] = f"not weighed: about {estimate:.0f} s (from the O(p^2) table), over --max-point-s"
                rows.append(row)
                print(_model_line(row), flush=True)
                continue
            table = _table(layout, 1 - args.sparsity / 100, seed=world)
            clear_decisions()
            start = time.perf_counter()
            summary = CountSummary.of("all_reduce", table, layout, topology)
            how = protocol(world)  # the scalable exchange: three rounds, and no rings
            rounds, rings = exchange_rounds(how, "all_reduce"), how == "table"
            _, weighed = decide(config, f"model|{how}", summary, torch.float32, model, 1, None, True, rounds, rings)
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
        for key, style in (("total_new_ms", "-o"), ("total_memo_ms", "--s"), ("plan_ms", ":^")):
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
    print(
        f"{'ranks':>6s} {'ch':>3s} {'summary':>10s} {'new ms':>10s} {'memo ms':>10s} {'plan ms':>10s} "
        f"{'total new':>10s} {'total memo':>10s} {'new, hier.':>10s} {'curves ms':>10s} {'reads ms':>10s} "
        f"{'protocol':>8s} {'exch KiB':>10s} "
        f"{'table KiB':>10s} chosen"
    )
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
