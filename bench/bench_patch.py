"""Pici decode by patch (``decompress_into(prior=)``) against the overwriting decode, by density.

Run on the GPU machine::

    python bench/bench_patch.py [--size 256M] [--densities 0.01,0.1,0.3,1,2,3,4,6,10]

One piece of ``--size`` bytes of fp32 (an all-reduce chunk): the decoded payload has the given
density (percent of nonzeros, i.i.d.), and the range holds a quarter of those nonzeros beforehand
(a rank's own contribution, as in the in-place all-reduce's gather phase), encoded as the prior.
Both decodes are timed over 30 launches after 3 warm-up ones and their results compared with the
payload's data. The ratio ``patch / overwrite`` below 1 is where patching wins; the gather phase
patches only below ``spccl_train.collectives._direct.PATCH_MAX_DENSITY``.

Prints a table and writes ``bench/results/patch_<device>_<date>.csv`` with date, device, commit.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import pathlib

import torch
from benchlib import device_name, parse_size, size_label, slug

from spccl_train._ext import load_kernels
from spccl_train._provenance import git_commit
from spccl_train.formats import capacity_bytes, compress_into, decompress_into

REPS = 30


def _time_us(fn) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default=256 << 20, help="bytes of the fp32 piece (default 256M)")
    parser.add_argument(
        "--densities",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[0.01, 0.1, 0.3, 1.0, 2.0, 3.0, 4.0, 6.0, 10.0],
        help="percent of nonzeros in the decoded payload (default 0.01,0.1,0.3,1,2,3,4,6,10)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a GPU with the spccl CUDA kernels")
    load_kernels()
    dev = torch.device("cuda")
    n = args.size // 4
    rows = []
    print(f"{size_label(args.size)} fp32 piece on {device_name(dev)}")
    print(f"{'density %':>10} {'overwrite us':>13} {'patch us':>9} {'patch/overwrite':>16}")
    for density in args.densities:
        new = torch.randn(n, device=dev) * (torch.rand(n, device=dev) < density / 100)
        old = new * (torch.rand(n, device=dev) < 0.25)
        payload = torch.empty(capacity_bytes("pici", n, torch.float32), dtype=torch.uint8, device=dev)
        prior = torch.empty_like(payload)
        compress_into("pici", new, payload)
        compress_into("pici", old, prior)
        dst = old.clone()
        overwrite = _time_us(lambda: decompress_into("pici", payload, dst, check=False))
        ok = torch.equal(dst, new)
        dst.copy_(old)
        patch = _time_us(lambda: decompress_into("pici", payload, dst, prior=prior, check=False))
        ok = ok and torch.equal(dst, new)
        if not ok:
            raise AssertionError(f"density {density}%: a decode differs from the data")
        rows.append((density, overwrite, patch))
        print(f"{density:10.3g} {overwrite:13.1f} {patch:9.1f} {patch / overwrite:16.2f}")
    now = datetime.datetime.now()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"patch_{slug(device_name(dev))}_{now:%Y-%m-%d}.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["date", "device", "commit", "torch", "bytes", "density_pct", "overwrite_us", "patch_us", "ratio"]
        )
        for density, overwrite, patch in rows:
            writer.writerow(
                [
                    now.isoformat(timespec="seconds"),
                    device_name(dev),
                    git_commit(),
                    torch.__version__,
                    args.size,
                    density,
                    f"{overwrite:.2f}",
                    f"{patch:.2f}",
                    f"{patch / overwrite:.3f}",
                ]
            )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
