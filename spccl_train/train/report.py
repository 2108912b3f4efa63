"""``spccl-train report RUN_DIR...``: compare runs (table, iteration-time breakdown, loss curves)."""

from __future__ import annotations

import csv
import json
import pathlib

__all__ = ["load_run", "plot_runs", "report_table"]


def load_run(run_dir: str | pathlib.Path) -> tuple[dict, list[dict]]:
    """A run's ``summary.json`` and ``iterations.csv`` rows."""
    run_dir = pathlib.Path(run_dir)
    summary_path, rows_path = run_dir / "summary.json", run_dir / "iterations.csv"
    if not summary_path.is_file() or not rows_path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a finished run folder: it needs summary.json and iterations.csv "
            "(written by spccl-train when a run ends)"
        )
    summary = json.loads(summary_path.read_text())
    with open(rows_path, newline="") as f:
        rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return summary, rows


def _label(summary: dict, run_dir: pathlib.Path) -> str:
    return f"{summary['mode']} ({run_dir.name})"


def report_table(run_dirs: list[pathlib.Path]) -> str:
    """One line per run; speed-up against the dense run of the same config listed last before it.

    List each dense run before the SpCCL runs it should be compared with (runs measured in one
    session, on one machine, compare fairly).
    """
    runs = [(pathlib.Path(d), load_run(d)[0]) for d in run_dirs]
    head = (
        f"{'run':44s} {'mode':6s} {'iter ms':>9s} {'allred ms':>9s} {'prune ms':>9s} "
        f"{'speedup':>8s} {'loss':>7s} {'density':>8s} {'bytes':>7s}"
    )
    lines = [head, "-" * len(head)]
    dense: dict[tuple[str, str], dict] = {}
    for d, s in runs:
        key = (s.get("engine", "ddp"), s["config_name"].replace("_spccl", "").replace("_dense", ""))
        if s["mode"] == "dense":
            dense[key] = s
        base = dense.get(key)
        speedup = f"{base['iteration_ms'] / s['iteration_ms']:.3f}x" if base else "-"
        lines.append(
            f"{d.name[:44]:44s} {s['mode']:6s} {s['iteration_ms']:9.1f} {s['allreduce_ms']:9.1f} {s['prune_ms']:9.2f} "
            f"{speedup:>8s} {s['final_loss']:7.3f} {s['density']:8.4f} {100 * s['bytes_ratio']:6.1f}%"
        )
    return "\n".join(lines)


def plot_runs(run_dirs: list[str | pathlib.Path], out: str | pathlib.Path) -> pathlib.Path:
    """Write a PNG: mean iteration time split into all-reduce, pruning and the rest, and loss curves.

    All-reduce time is measured from issue to completion and overlaps the backward pass, so the
    bar shows it beside (not inside) the iteration time, as the paper's DDP figures do.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(pathlib.Path(d), *load_run(d)) for d in run_dirs]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [_label(s, d) for d, s, _ in runs]
    x = range(len(runs))
    iteration = [s["iteration_ms"] for _, s, _ in runs]
    allreduce = [s["allreduce_ms"] for _, s, _ in runs]
    prune = [s["prune_ms"] for _, s, _ in runs]
    width = 0.38
    bars.bar([i - width / 2 for i in x], iteration, width, label="iteration", color="#4c72b0")
    bars.bar([i + width / 2 for i in x], allreduce, width, label="all-reduce", color="#dd8452")
    bars.bar([i + width / 2 for i in x], prune, width, bottom=allreduce, label="pruning", color="#55a868")
    for i, value in zip(x, iteration, strict=True):
        bars.annotate(f"{value:.0f}", (i - width / 2, value), ha="center", va="bottom", fontsize=8)
    bars.set_xticks(list(x), labels, rotation=15, ha="right", fontsize=8)
    bars.set_ylabel("ms per iteration (mean after warm-up)")
    bars.set_title("Iteration time breakdown")
    bars.legend(fontsize=8)
    for (_, _, rows), label in zip(runs, labels, strict=True):
        curves.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], label=label, linewidth=1)
    curves.set_xlabel("iteration")
    curves.set_ylabel("training loss")
    curves.set_title("Loss")
    curves.legend(fontsize=8)
    fig.suptitle(", ".join(sorted({f"{s['config_name']} on {s['world_size']} x {s['device']}" for _, s, _ in runs})))
    fig.tight_layout()
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
