"""The ``spccl-train`` command.

::

    spccl-train [--config NAME_OR_PATH] [--use-spccl] [--engine ddp|megatron] [dotted.key=value ...]
    spccl-train report RUN_DIR [RUN_DIR ...] [--out PNG]   (default: ./compare-<A>-vs-<B>.png)
    spccl-train configs

With no ``--config`` it runs ``tiny_cpu``: a tiny GPT-2 on CPU with 2 gloo ranks, SpCCL on with
the recommended recipe (BurstAdamW, leak-free error feedback, density warm-up).
Under ``torchrun`` each process is one rank; otherwise ``dist.nproc_per_node`` ranks are spawned.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from .emulation import check_launch

__all__ = ["main"]


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spccl-train",
        description="Train a GPT model with DDP, dense or with SpCCL sparse gradient all-reduce. "
        "Subcommands: 'spccl-train report RUN_DIR...' compares finished runs; "
        "'spccl-train configs' lists shipped configs.",
    )
    p.add_argument("--config", default=None, help="a YAML path or a shipped config name (default: tiny_cpu)")
    p.add_argument("--use-spccl", action="store_true", help="reduce gradients with SpCCL (sets spccl.enabled=true)")
    p.add_argument("--no-spccl", action="store_true", help="dense all-reduce (sets spccl.enabled=false)")
    p.add_argument(
        "--engine",
        choices=("ddp", "megatron"),
        default="ddp",
        help="ddp: torch DDP with transformers models; megatron: megatron-core GPTModel and its DDP/optimizer",
    )
    p.add_argument("--distributed-optimizer", action="store_true", help="megatron engine: the distributed optimizer")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.iterations=10")
    return p


def _report(argv: list[str]) -> int:
    from .train.report import default_report_path, plot_runs, report_table

    p = argparse.ArgumentParser(
        prog="spccl-train report",
        description="Compare finished runs: print a table and write a plot (iteration-time breakdown, loss curves).",
    )
    p.add_argument("runs", nargs="+", type=pathlib.Path, help="run folders (holding summary.json)")
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="PNG path (default: compare-<RUN>-vs-<RUN>.png in the current directory, named after the run "
        "folders; a run's own report.png is never overwritten unless named here)",
    )
    args = p.parse_args(argv)
    try:
        print(report_table(args.runs))
        png = plot_runs(args.runs, args.out or default_report_path(args.runs))
    except FileNotFoundError as exc:
        print(f"spccl-train report: {exc}", file=sys.stderr)
        return 2
    print(f"plot: {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if argv[:1] == ["report"]:
        return _report(argv[1:])
    from .train.config import ConfigError, apply_overrides, find_config, load_config, shipped_configs

    if argv[:1] == ["configs"]:
        for name, path in shipped_configs().items():
            print(f"{name:24s} {path}")
        return 0
    # Intermixed: flags may follow overrides (spccl-train output.dir=x --no-spccl output.name=y).
    args = _train_parser().parse_intermixed_args(argv)
    if args.use_spccl and args.no_spccl:
        print("spccl-train: --use-spccl and --no-spccl contradict each other", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        if args.use_spccl or args.no_spccl:
            cfg.spccl.enabled = bool(args.use_spccl)
            apply_overrides(cfg, [])
        name = find_config(args.config or "tiny_cpu").stem
    except ConfigError as exc:
        print(f"spccl-train: config error: {exc}", file=sys.stderr)
        return 2
    from .train.data import DataError

    if args.distributed_optimizer and args.engine != "megatron":
        print("spccl-train: --distributed-optimizer needs --engine megatron", file=sys.stderr)
        return 2
    if args.engine == "megatron" and cfg.optim.name != "adamw":
        # The default and the shipped SpCCL configs step with BurstAdamW, which the Megatron engine
        # cannot (it steps with Megatron's Adam): say so here rather than from inside a rank.
        print(
            f"spccl-train: config error: optim.name={cfg.optim.name!r} (config {name}) applies to --engine ddp only; "
            "the Megatron engine steps with Megatron's Adam: add optim.name=adamw",
            file=sys.stderr,
        )
        return 2
    emulation = check_launch(
        cfg.dist.emulate_nodes,
        int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.dist.nproc_per_node),
        int(os.environ.get("WORLD_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or cfg.dist.nproc_per_node),
        cfg.dist.ranks_per_node,
    )
    if emulation is not None:
        print(f"spccl-train: config error: {emulation}", file=sys.stderr)
        return 2
    try:
        if args.engine == "megatron":
            from .megatron.pretrain import launch as launch_megatron

            launch_megatron(cfg, name, distributed_optimizer=args.distributed_optimizer)
        else:
            from .train.trainer import launch

            launch(cfg, name)
    except DataError as exc:
        print(f"spccl-train: data error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
