"""Round two of bimodal.py: bf16 Pici compress at 50% (1 GiB) read 0.630 ms in every setting of a
fresh process, but 0.648 or 0.684 ms in bench_codecs' default sweep. This times the same call
(fresh inputs and outputs each time, 2 x 2 pairs, 6 calls each) in one process:
  fresh     first thing in the process
  scratch   with small tensors held before the call, so that the compressor's per-call scratch
            (its look-back state, 0.5 MiB, from the caching allocator's small pool) lands elsewhere
  churn     after bench_codecs' 64 MiB and 256 MiB bf16 cases (its default sweep's start)
  bench     after bench_codecs' own 1 GiB 0% and 50% case, which prints what it measured
Run: python3 churn.py OUT   (from the repository root; imports bench/bench_codecs.py)
"""

import statistics
import sys

import torch

sys.path.insert(0, "bench")
import bench_codecs  # noqa: E402

from spccl_train import formats  # noqa: E402
from spccl_train._ext import load_kernels  # noqa: E402

N = (1 << 30) // 2
CAP = formats.capacity_bytes("pici", N, torch.bfloat16)


def times(calls):
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in calls]
    torch.cuda._sleep(20_000_000)
    for (s, e), c in zip(ev, calls):
        s.record()
        c()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def scratch_at():
    """Where a tensor of the compressor's scratch size lands now (the caching allocator reuses it)."""
    t = torch.empty(8 * (N // 4096 // 2) + 4096, dtype=torch.uint8, device="cuda")
    p = t.data_ptr()
    del t
    return hex(p)


def pairs(tag, pads=()):
    xs = [bench_codecs._sparse_input(N, torch.bfloat16, 50.0, torch.device("cuda")) for _ in range(2)]
    bufs = [torch.empty(CAP, dtype=torch.uint8, device="cuda") for _ in range(2)]
    cells = []
    for i in range(2):
        for j in range(2):
            t = times([lambda i=i, j=j: formats.compress_into("pici", xs[i], bufs[j], check=False)] * 7)[1:]
            cells.append(f"{statistics.median(t):.3f}")
    print(
        f"{tag:>28}: {' '.join(cells)} ms  scratch near {scratch_at()}  "
        f"in {hex(xs[0].data_ptr())} out {hex(bufs[0].data_ptr())}",
        flush=True,
    )


def main():
    out = sys.argv[1]
    load_kernels()
    pairs("fresh")
    for kib in (64, 256, 512, 768, 1024, 1536, 1984):
        pad = torch.empty(kib << 10, dtype=torch.uint8, device="cuda")
        pairs(f"pad {kib} KiB", pad)
        del pad
    torch.cuda.empty_cache()
    pairs("after empty_cache")
    bench_codecs.main(["--dtypes", "bf16", "--sizes", "64M,256M", "--out-dir", f"{out}/churn"])
    pairs("after 64M/256M sweep")
    for kib in (64, 512, 1024):
        pad = torch.empty(kib << 10, dtype=torch.uint8, device="cuda")
        pairs(f"after sweep, pad {kib} KiB", pad)
        del pad
    bench_codecs.main(["--dtypes", "bf16", "--sizes", "1G", "--sparsities", "0,50", "--out-dir", f"{out}/bench"])
    pairs("after 1G bench")
    torch.cuda.empty_cache()
    pairs("after 1G bench, empty_cache")


if __name__ == "__main__":
    main()
