"""Scratch: the held native call against torch.distributed's own, timed as the benchmark times a
call (barrier, host clock, call, device sync), and the held call's host time up to NCCL's launch,
stage by stage. CPU (gloo) or GPU (NCCL)."""
import os, statistics, sys, time
import torch, torch.distributed as dist
import spccl_train
from spccl_train.collectives import CollectiveConfig, api, held
from spccl_train.collectives import config as config_mod
from spccl_train import _timing

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
if cuda: torch.cuda.set_device(dev)
nbytes = int(os.environ.get("HP_BYTES", 4096))
dtype = torch.bfloat16 if os.environ.get("HP_DTYPE") == "bf16" else torch.float32
x = torch.randn(nbytes // (2 if dtype == torch.bfloat16 else 4), device=dev).to(dtype)
cfg = CollectiveConfig(check_calls="first")
flag = torch.zeros(1, device=dev)
def sync():
    if cuda: torch.cuda.synchronize()
def gate():
    sync(); dist.all_reduce(flag); flag.item()
for _ in range(40): spccl_train.all_reduce(x, config=cfg)
tag = os.environ.get("HP_TAG", "")
def out(*a):
    if rank == 0: print(tag, *a, flush=True)
# 1. benchmark-like, interleaved
res = {"nccl": [], "held": []}
for i in range(int(os.environ.get("HP_ROUNDS", 60))):
    for name in ("nccl", "held"):
        gate(); t = time.perf_counter()
        if name == "nccl": dist.all_reduce(x)
        else: spccl_train.all_reduce(x, config=cfg)
        sync(); dt = time.perf_counter() - t
        if name == "held" and api.last_stats().exchanges: continue
        res[name].append(dt * 1e6)
t = torch.tensor([statistics.median(res["nccl"]), statistics.median(res["held"])], dtype=torch.float64, device=dev)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
out(f"bench-like median (slowest rank): nccl {t[0]:.1f} us, held {t[1]:.1f} us, excess {t[1]-t[0]:.1f} us (held n={len(res['held'])})")
# 1b. the same with the held call's timer on the host clock (what its CUDA events cost)
real_span = held.Span
held.Span = lambda device: real_span(torch.device("cpu"))
res = {"nccl": [], "held": []}
for i in range(int(os.environ.get("HP_ROUNDS", 60))):
    for name in ("nccl", "held"):
        gate(); t = time.perf_counter()
        if name == "nccl": dist.all_reduce(x)
        else: spccl_train.all_reduce(x, config=cfg)
        sync(); dt = time.perf_counter() - t
        if name == "held" and api.last_stats().exchanges: continue
        res[name].append(dt * 1e6)
held.Span = real_span
t = torch.tensor([statistics.median(res["nccl"]), statistics.median(res["held"])], dtype=torch.float64, device=dev)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
out(f"host-clock timer: nccl {t[0]:.1f} us, held {t[1]:.1f} us, excess {t[1]-t[0]:.1f} us (held n={len(res['held'])})")
# 2. stages up to the launch
stamps = []
def wrap(mod, name, label=None):
    orig = getattr(mod, name); label = label or name
    def w(*a, **k):
        stamps.append((label + ">", time.perf_counter_ns()))
        r = orig(*a, **k)
        stamps.append(("<" + label, time.perf_counter_ns()))
        return r
    setattr(mod, name, w)
wrap(config_mod.CollectiveConfig, "validate")
for n in ("transport_of", "_local_problems", "_graphable"):
    if hasattr(api, n): wrap(api, n)
wrap(held, "lookup"); wrap(held, "held_now"); wrap(held, "Span"); wrap(held, "corrections_of"); wrap(held, "native_collective")
wrap(held, "run")
acc = {}
for i in range(300):
    gate(); stamps.clear(); t0 = time.perf_counter_ns()
    spccl_train.all_reduce(x, config=cfg)
    sync()
    if api.last_stats().exchanges: continue
    for label, ts in stamps: acc.setdefault(label, []).append((ts - t0) / 1e3)
for label, v in acc.items():
    out(f"  {label:22s} {statistics.median(v):8.1f} us")
dist.destroy_process_group()
