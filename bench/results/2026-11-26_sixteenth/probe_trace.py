"""The link probe's repeatability, and auto's calls at a new size class, call by call.

  torchrun --standalone --nproc-per-node=2 probe_trace.py   # every rank its own emulated node, GPU 0

Env: PT_PROBES (probes in a row, default 6), PT_POINTS ("1G:90,256M:90"), PT_CALLS (auto's calls
per point, 14), PT_FIXED (fixed candidates timed first, "pici/direct,coo/direct"), PT_TAG (a label).
Each probe starts afresh (forget_measured); the codec calibration comes from its disk cache after
the first. Each call is timed as bench_collectives times one: device sync and a small all-reduce
read on the host, host clock, call, device sync; the slowest rank's time."""
import os, time
from spccl_train.emulation import emulate_nodes

world = int(os.environ["WORLD_SIZE"])
emulate_nodes(world)
import torch, torch.distributed as dist  # noqa: E402
import spccl_train  # noqa: E402
from spccl_train.collectives import CollectiveConfig, last_stats, learned_corrections, measure_links  # noqa: E402
from spccl_train.collectives.links import forget_measured  # noqa: E402

dist.init_process_group("nccl")
rank = dist.get_rank()
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
tag = os.environ.get("PT_TAG", "")
flag = torch.zeros(1, device=device)


def say(t):
    if rank == 0:
        print(f"[{tag}] {t}", flush=True)


def slowest(t):
    v = torch.tensor([t], device=device, dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v.item()


for i in range(int(os.environ.get("PT_PROBES", 6))):
    forget_measured()
    start = time.perf_counter()
    m = measure_links()
    inter = m.links.inter
    say(f"probe {i}: {time.perf_counter() - start:.2f} s; inter p2p {inter.bandwidth / 1e9:.2f} GB/s, "
        f"all-to-all {(inter.collective_bandwidth or 0) / 1e9:.2f} GB/s, {inter.latency_s * 1e3:.2f} ms; "
        f"native {m.links.native.bandwidth / 1e9:.2f} GB/s {m.links.native.latency_s * 1e3:.2f} ms; "
        f"exchange {m.links.exchange_s * 1e3:.2f} ms")

sizes = {"64M": 64 << 20, "256M": 256 << 20, "1G": 1 << 30}
calls = int(os.environ.get("PT_CALLS", 14))
for point in [p for p in os.environ.get("PT_POINTS", "1G:90,256M:90").split(",") if p]:
    size, sparsity = point.split(":")
    n = sizes[size] // 4
    g = torch.Generator(device=device).manual_seed(rank + 1)
    base = torch.randn(n, device=device, generator=g) * (torch.rand(n, device=device, generator=g) >= float(sparsity) / 100)
    x = torch.empty_like(base)
    methods = [m for m in os.environ.get("PT_FIXED", "pici/direct,coo/direct").split(",") if m] + ["auto"]
    for method in methods:
        cfg = CollectiveConfig() if method == "auto" else CollectiveConfig(format=method.split("/")[0], algorithm=method.split("/")[1])
        times = []
        for c in range(calls if method == "auto" else 6):
            x.copy_(base)
            torch.cuda.synchronize()
            dist.all_reduce(flag)
            flag.item()
            start = time.perf_counter()
            spccl_train.all_reduce(x, config=cfg)
            torch.cuda.synchronize()
            stats = last_stats()
            t = slowest(time.perf_counter() - start) * 1e3
            times.append(t)
            if method == "auto":
                cands = " ".join(f"{k}={v * 1e3:.1f}" for k, v in sorted(stats.candidates.items(), key=lambda kv: kv[1]))
                say(f"{point} auto call {c}: {stats.algorithm}/{stats.format.value}{' TRIAL' if stats.trial else ''} "
                    f"{t:.1f} ms, predicted {stats.predicted_s * 1e3:.1f}; {cands}")
        say(f"{point} {method}: " + " ".join(f"{t:.1f}" for t in times))
    say("factors: " + learned_corrections().describe())
dist.destroy_process_group()
