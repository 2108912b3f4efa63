"""Gradient-layer throughput on one GPU: the fused prune + leaky error feedback pass and the
sampled threshold, against the device-to-device copy bandwidth measured in the same run.

    python bench/bench_pruning.py --out-dir "$OUT"          # GPU machine
    python bench/bench_pruning.py --smoke --out-dir /tmp/x   # CPU, tiny, to check the script

Bytes moved by the prune pass: gradient read + written and error buffer read + written
(16 bytes per element for fp32 gradients with fp32 errors). Sampling: the fused Triton sample +
histogram + bin selection (0.1% of the elements by default), as a share of the prune pass.
Writes ``pruning_<device>_<date>.csv`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pathlib
import subprocess
import sys
import time

import torch

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from spccl_train.pruning import PruneConfig, Pruner, reference  # noqa: E402
from spccl_train.pruning.prune_ef import prune_error_feedback  # noqa: E402
from spccl_train.pruning.threshold import sampled_threshold  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time_ms(fn, reps: int, cuda: bool) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _copy_gbps(n: int, device: str, reps: int, cuda: bool) -> float:
    """Device-to-device copy bandwidth of n fp32 elements, counting bytes read and written."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 2 * n * 4 / _time_ms(lambda: dst.copy_(src), reps, cuda) / 1e6


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SPCCL_GIT_COMMIT", "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=(1 << 30) // 4, help="gradient elements (default 1 GiB of fp32)")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU, 64Ki elements")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    n = 1 << 16 if args.smoke else args.numel
    name = torch.cuda.get_device_name() if cuda else "cpu"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")

    copy_gbps = _copy_gbps(n, device, args.reps, cuda)
    print(f"device: {name}   torch {torch.__version__}   commit {_commit()}   {stamp}")
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s; {n} elements per gradient\n")
    print(f"{'grad':>5} {'error':>5} {'prune ms':>9} {'GB/s':>7} {'/copy':>6} {'sample ms':>10} {'sample/prune':>13} {'density':>8}")
    rows = []
    for grad_name, error_name in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")):
        error_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[error_name]
        pruner = Pruner(PruneConfig(density=0.01, sample_fraction=0.001, decay=0.9, error_dtype=error_dtype))
        grad = torch.randn(n, device=device).to(_DTYPES[grad_name])
        error = (torch.randn(n, device=device) * 0.01).to(_DTYPES[error_name])
        threshold = torch.tensor([2.5758], device=device)  # keeps about 1% of a standard normal
        prune_ms = _time_ms(lambda: prune_error_feedback(grad, error, threshold, 0.9), args.reps, cuda)
        m = reference.sample_size(n, pruner.config.sample_fraction)
        k = reference.keep_count(m, pruner.config.density)
        sample_ms = _time_ms(lambda: sampled_threshold(grad, error, m, k, 1), args.reps, cuda)
        grad = torch.randn(n, device=device).to(_DTYPES[grad_name])
        error.zero_()
        kept = int(pruner.prune(grad, error, step=0).kept)
        moved = 2 * n * (grad.element_size() + error.element_size())
        gbps = moved / prune_ms / 1e6
        row = dict(
            date=stamp, device=name, torch=torch.__version__, commit=_commit(), numel=n, grad_dtype=grad_name,
            error_dtype=error_name, prune_ms=round(prune_ms, 4), bytes_moved=moved, gbps=round(gbps, 1),
            frac_copy=round(gbps / copy_gbps, 3), copy_gbps=round(copy_gbps, 1), sample_ms=round(sample_ms, 4),
            sample_over_prune=round(sample_ms / prune_ms, 4), achieved_density=round(kept / n, 5),
        )
        rows.append(row)
        print(
            f"{grad_name:>5} {error_name:>5} {prune_ms:>9.3f} {gbps:>7.0f} {gbps / copy_gbps:>6.2f} "
            f"{sample_ms:>10.3f} {sample_ms / prune_ms:>13.1%} {kept / n:>8.4f}"
        )
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")
    path = out / f"pruning_{slug}_{stamp[:10]}.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    first = rows[0]
    print(f"\nwrote {path}")
    print(
        f"targets (fp32, fp32 errors): prune pass >= 0.70 of copy: {first['frac_copy']:.2f} "
        f"{'PASS' if first['frac_copy'] >= 0.70 else 'FAIL'}; sampling < 5% of the pass: "
        f"{first['sample_over_prune']:.1%} {'PASS' if first['sample_over_prune'] < 0.05 else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
