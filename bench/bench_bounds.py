"""All-reduce planned from counts vs from bounds: 1 GiB and 256 MiB fp32 at 99% sparsity (i.i.d.).

Run on the GPU machine: ``NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=4 bench/bench_bounds.py``.
Each variant runs 11 calls back to back (host time included, no synchronisation between them)
after one verified call; the bounds are 1.2x each piece's expected share (1%). Prints a table
(the slowest rank's mean per call and the ratio to NCCL in the same run).
"""

import time

import torch
import torch.distributed as dist

import spccl_train
from spccl_train.collectives import CollectiveConfig
from spccl_train.collectives.chunking import ChunkLayout


def main() -> None:
    dist.init_process_group("nccl")
    r, p = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(r)
    dev = torch.device("cuda", r)
    out = []
    for numel in (1 << 28, 1 << 26):
        g = torch.Generator(device=dev).manual_seed(r + 1)
        x = torch.randn(numel, device=dev, generator=g)
        x[torch.rand(numel, device=dev, generator=g) >= 0.01] = 0
        layout = ChunkLayout.aligned(numel, p, 1)
        ranges = [(pc.start, pc.numel) for ch in layout.pieces for pc in ch]
        caps = [int(n * 0.01 * 1.2) for _, n in ranges]
        bounds = [caps] * p
        ref = x.clone()
        dist.all_reduce(ref)
        for name, call in (
            ("nccl", lambda t: dist.all_reduce(t)),
            ("auto", lambda t: spccl_train.all_reduce(t)),
            (
                "pici/direct",
                lambda t: spccl_train.all_reduce(t, config=CollectiveConfig(format="pici", algorithm="direct")),
            ),
            ("auto+bounds", lambda t: spccl_train.all_reduce(t, bounds=bounds)),
            (
                "pici/direct+bounds",
                lambda t: spccl_train.all_reduce(
                    t, config=CollectiveConfig(format="pici", algorithm="direct"), bounds=bounds
                ),
            ),
        ):
            bufs = [x.clone() for _ in range(12)]
            call(bufs[0])
            torch.cuda.synchronize()
            dist.barrier()
            assert torch.allclose(bufs[0], ref, rtol=1e-5, atol=1e-5), name
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for b in bufs[1:]:
                call(b)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / 11 * 1e3
            t = torch.tensor([ms], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append((numel * 4 >> 20, name, t.item()))
    if r == 0:
        base = {}
        for mib, name, ms in out:
            if name == "nccl":
                base[mib] = ms
            print(f"{mib:5d} MiB  {name:20s} {ms:7.3f} ms  {base[mib] / ms:5.2f}x NCCL")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
