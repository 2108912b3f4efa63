"""``spccl-train report RUN_DIR...``: compare runs (table, iteration-time breakdown, loss curves)."""

from __future__ import annotations

import csv
import json
import pathlib

__all__ = [
    "BREAKDOWN",
    "BREAKDOWN_COLORS",
    "default_report_path",
    "device_line",
    "load_run",
    "plot_runs",
    "report_table",
]

BREAKDOWN: tuple[tuple[str, str, str], ...] = (
    ("data", "data", "batch sampled and copied to the device"),
    ("forward", "forward", "forward pass and loss"),
    ("backward", "backward", "backward compute: the backward pass less the waits below"),
    (
        "comm_wait",
        "communication",
        "gradient reduction the step waited for: in the comm hook, and at the end of backward",
    ),
    ("prune_inline", "pruning", "top-k pruning with error feedback that the backward pass waited for"),
    ("optimizer", "optimizer", "gradient clipping, optimizer step, zero_grad"),
    ("other", "other", "rest of the wall time: end-of-iteration synchronisation, timer reads"),
)
"""The parts an iteration's wall time is split into, in order: ``(key, label, meaning)``. Every
part but ``other`` is a span of one timeline (the host clock on CPU, CUDA events on the training
stream on GPUs); ``other`` is the host's wall time less those spans, so the parts add up to the
iteration; ``iterations.csv`` holds ``<key>_s`` per iteration and
``summary.json`` their means as ``breakdown_ms``."""

BREAKDOWN_COLORS = {
    "data": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#64b5cd",
    "comm_wait": "#dd8452",
    "prune_inline": "#55a868",
    "optimizer": "#8172b3",
    "other": "#cccccc",
}
"""Bar colour of each part of :data:`BREAKDOWN` in the plot."""


TEXT_COLUMNS = ("choices",)
"""Columns of ``iterations.csv`` that hold text, not numbers."""


def load_run(run_dir: str | pathlib.Path) -> tuple[dict, list[dict]]:
    """A run's ``summary.json`` and ``iterations.csv`` rows (numbers, but the text column ``choices``)."""
    run_dir = pathlib.Path(run_dir)
    summary_path, rows_path = run_dir / "summary.json", run_dir / "iterations.csv"
    if not summary_path.is_file() or not rows_path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a finished run folder: it needs summary.json and iterations.csv "
            "(written by spccl-train when a run ends)"
        )
    summary = json.loads(summary_path.read_text())
    with open(rows_path, newline="") as f:
        rows = [{k: v if k in TEXT_COLUMNS else float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return summary, rows


def default_report_path(run_dirs: list[str | pathlib.Path], where: str | pathlib.Path = ".") -> pathlib.Path:
    """``compare-<A>-vs-<B>[...].png`` in ``where`` (the current directory): a name of its own,
    so that a comparison never overwrites a run's own ``report.png``.

    Named after the run folders; folders of one name (from different parents) are told apart by
    their parent's name, and past three runs the rest are counted (``-and-2-more``).
    """
    dirs = [pathlib.Path(d).resolve() for d in run_dirs]
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):
        names = [f"{d.parent.name}_{d.name}" for d in dirs]
    shown = "-vs-".join(names[:3]) + (f"-and-{len(names) - 3}-more" if len(names) > 3 else "")
    return pathlib.Path(where) / f"compare-{shown}.png"


def _label(summary: dict, run_dir: pathlib.Path) -> str:
    return f"{summary['mode']} ({run_dir.name})"


def device_line(summary: dict) -> str:
    """What a run ran on (``2 ranks on 1 x NVIDIA H200``); runs written before the device line
    existed say ``world x device``."""
    return summary.get("device_line") or f"{summary['world_size']} x {summary['device']}"


def report_table(run_dirs: list[pathlib.Path]) -> str:
    """One line per run; speed-up against the dense run of the same config listed last before it.

    List each dense run before the SpCCL runs it should be compared with (runs measured in one
    session, on one machine, compare fairly). ``comm ms`` is the communication the step waited
    for (``breakdown_ms``), ``-`` for runs without a breakdown (the Megatron engine, older runs).
    ``loss``: the mean of the last 10 iterations; ``last loss``: the last iteration's, and
    ``vs dense`` its difference from that dense run's (``-`` for runs older than the field).
    """
    runs = [(pathlib.Path(d), load_run(d)[0]) for d in run_dirs]
    head = (
        f"{'run':44s} {'mode':6s} {'iter ms':>9s} {'comm ms':>9s} {'prune ms':>9s} "
        f"{'speedup':>8s} {'loss':>7s} {'last loss':>9s} {'vs dense':>8s} {'density':>8s} {'bytes':>7s}"
    )
    lines = [head, "-" * len(head)]
    dense: dict[tuple[str, str], dict] = {}
    for d, s in runs:
        key = (s.get("engine", "ddp"), s["config_name"].replace("_spccl", "").replace("_dense", ""))
        if s["mode"] == "dense":
            dense[key] = s
        base = dense.get(key)
        speedup = f"{base['iteration_ms'] / s['iteration_ms']:.3f}x" if base else "-"
        breakdown = s.get("breakdown_ms")
        comm = f"{breakdown['comm_wait']:9.1f}" if breakdown else f"{'-':>9s}"
        last = s.get("last_loss")
        versus = (
            f"{100 * (last / base['last_loss'] - 1):+7.1f}%"
            if last is not None and base and base.get("last_loss")
            else "-"
        )
        lines.append(
            f"{d.name[:44]:44s} {s['mode']:6s} {s['iteration_ms']:9.1f} {comm} {s['prune_ms']:9.2f} "
            f"{speedup:>8s} {s['final_loss']:7.3f} {f'{last:.3f}' if last is not None else '-':>9s} {versus:>8s} "
            f"{s['density']:8.4f} {100 * s['bytes_ratio']:6.1f}%"
        )
    return "\n".join(lines)


def plot_runs(run_dirs: list[str | pathlib.Path], out: str | pathlib.Path) -> pathlib.Path:
    """Write a PNG: each run's mean iteration time as a stack of its parts, and loss curves.

    The parts (``breakdown_ms``) add up to the iteration, communication counted as the time the
    step waited for it. A run without a breakdown (the Megatron engine, runs written before it
    existed) is one bar, "not broken down".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(pathlib.Path(d), *load_run(d)) for d in run_dirs]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [_label(s, d) for d, s, _ in runs]
    x = list(range(len(runs)))
    width = 0.5
    bottom = [0.0] * len(runs)
    for key, label, _ in BREAKDOWN:
        heights = [(s.get("breakdown_ms") or {}).get(key, 0.0) for _, s, _ in runs]
        if any(heights):
            bars.bar(x, heights, width, bottom=bottom, label=label, color=BREAKDOWN_COLORS.get(key))
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    rest = [s["iteration_ms"] if not s.get("breakdown_ms") else 0.0 for _, s, _ in runs]
    if any(rest):
        bars.bar(x, rest, width, bottom=bottom, label="not broken down", color="#e0e0e0", hatch="//")
    for i, (_, s, _) in zip(x, runs, strict=True):
        bars.annotate(f"{s['iteration_ms']:.0f}", (i, s["iteration_ms"]), ha="center", va="bottom", fontsize=8)
    bars.set_xticks(x, labels, rotation=15, ha="right", fontsize=8)
    bars.set_ylabel("ms per iteration (mean after warm-up)")
    bars.set_title("Iteration time: parts add up to it (communication: time waited)")
    bars.legend(fontsize=7, loc="lower right")
    for (_, _, rows), label in zip(runs, labels, strict=True):
        curves.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], label=label, linewidth=1)
    curves.set_xlabel("iteration")
    curves.set_ylabel("training loss")
    curves.set_title("Loss")
    curves.legend(fontsize=8)
    fig.suptitle(", ".join(sorted({f"{s['config_name']} on {device_line(s)}" for _, s, _ in runs})))
    fig.tight_layout()
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
