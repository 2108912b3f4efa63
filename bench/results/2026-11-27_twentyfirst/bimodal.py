"""Why bf16 Pici compress at 50% reads 0.89 or 0.82 of copy with one kernel (1 GiB, one GPU).

Times single compress calls (CUDA events, the GPU held busy first) of 1 GiB inputs into output
buffers, in four settings:
  pairs   K inputs x K outputs, each pair timed alone: does the time follow a buffer?
  offset  one input into one output at byte offsets 0, 4 KiB, 64 KiB, 2 MiB: does it follow the
          payload's placement?
  after0  the pair timed after 20 calls at 0% sparsity (the default sweep's order)
  clocks  nvidia-smi's SM / memory clocks and power before and after
Prints a table per setting and writes bimodal.csv under the output folder (argv[1]).
Run: python3 bimodal.py OUT [K]
"""

import csv
import statistics
import subprocess
import sys

import torch

from spccl_train import formats
from spccl_train._ext import load_kernels

GIB = 1 << 30


def clocks(tag):
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    print(f"clocks {tag}: {out}", flush=True)


def sparse(n, dtype, sparsity):
    x = torch.randn(n, device="cuda", dtype=dtype)
    return x.masked_fill_(torch.rand(n, device="cuda") < sparsity, 0)


def times(calls):
    """Per-call ms of the callables in order, each between two events."""
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in calls]
    torch.cuda._sleep(10_000_000)
    for (s, e), c in zip(ev, calls):
        s.record()
        c()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def main():
    out_dir = sys.argv[1]
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    load_kernels()
    rows = []
    clocks("start")
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        probe(dtype, name, k, rows)
        clocks(f"after {name}")
        torch.cuda.empty_cache()
    with open(f"{out_dir}/bimodal.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def probe(dtype, name, k, rows):
    n = GIB // torch.empty((), dtype=dtype).element_size()
    cap = formats.capacity_bytes("pici", n, dtype)
    xs = [sparse(n, dtype, 0.5) for _ in range(k)]
    bufs = [torch.empty(cap + (2 << 20), dtype=torch.uint8, device="cuda") for _ in range(k)]
    copy_src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy = statistics.median(times([lambda: copy_dst.copy_(copy_src)] * 20))
    print(
        f"{name}: copy 1 GiB {copy:.3f} ms; input/output addresses "
        f"{[hex(x.data_ptr()) for x in xs]} / {[hex(b.data_ptr()) for b in bufs]}",
        flush=True,
    )

    def call(i, j, off=0):
        return lambda: formats.compress_into("pici", xs[i], bufs[j][off : off + cap], check=False)

    for rnd in range(2):
        print(f"{name} pairs, round {rnd}: median ms (min-max) of 6 calls, row input, column output")
        for i in range(k):
            cells = []
            for j in range(k):
                t = times([call(i, j)] * 7)[1:]
                cells.append(f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})")
                rows.append(
                    dict(
                        dtype=name,
                        setting=f"pairs{rnd}",
                        i=i,
                        j=j,
                        off=0,
                        median=statistics.median(t),
                        lo=min(t),
                        hi=max(t),
                    )
                )
            print(f"  in{i}: " + "  ".join(cells), flush=True)
    print(f"{name} alternating two pairs (bench_codecs' rotation), 20 calls:")
    t = times([call(c % 2, c % 2) for c in range(22)])[2:]
    print("  " + " ".join(f"{v:.3f}" for v in t), flush=True)
    rows.append(dict(dtype=name, setting="rotate", i=0, j=0, off=0, median=statistics.median(t), lo=min(t), hi=max(t)))
    for off in (0, 256, 4096, 65536, 2 << 20):
        t = times([call(0, 0, off)] * 7)[1:]
        print(f"{name} offset {off}: {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})", flush=True)
        rows.append(
            dict(dtype=name, setting="offset", i=0, j=0, off=off, median=statistics.median(t), lo=min(t), hi=max(t))
        )
    dense = torch.randn(n, device="cuda", dtype=dtype)
    dcap = formats.capacity_bytes("pici", n, dtype)
    dbuf = torch.empty(dcap, dtype=torch.uint8, device="cuda")
    t0 = times([lambda: formats.compress_into("pici", dense, dbuf, check=False)] * 20)
    t = times([call(0, 0)] * 7)[1:]
    print(
        f"{name} after 20 calls at 0% ({statistics.median(t0):.3f} ms each): "
        f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})",
        flush=True,
    )
    rows.append(dict(dtype=name, setting="after0", i=0, j=0, off=0, median=statistics.median(t), lo=min(t), hi=max(t)))


if __name__ == "__main__":
    main()
