"""The held native call (check_calls="first") against torch.distributed's own, timed as
bench_collectives.py times a call (barrier, host clock, call, device sync), and the held call's
host time up to NCCL's launch, stage by stage. CPU (gloo) or GPU (NCCL); run with torchrun:

    HP_BYTES=268435456 HP_DTYPE=fp32 torchrun --standalone --nproc-per-node=2 heldprof.py

Environment: HP_BYTES (tensor bytes, default 4096), HP_DTYPE (fp32 or bf16), HP_ROUNDS (calls of
each kind in part 1, default 60), HP_TAG (a prefix for the printed lines).
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

import spccl_train
from spccl_train.collectives import CollectiveConfig, api, held
from spccl_train.collectives import config as config_mod

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dtype = torch.bfloat16 if os.environ.get("HP_DTYPE") == "bf16" else torch.float32
x = torch.randn(int(os.environ.get("HP_BYTES", 4096)) // (2 if dtype == torch.bfloat16 else 4), device=device).to(dtype)
config = CollectiveConfig(check_calls="first")
flag = torch.zeros(1, device=device)
tag = os.environ.get("HP_TAG", "")


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()


def gate() -> None:
    """The benchmark's barrier: a device sync and a small all-reduce read on the host."""
    sync()
    dist.all_reduce(flag)
    flag.item()


def say(text: str) -> None:
    if rank == 0:
        print(tag, text, flush=True)


def interleaved(label: str) -> None:
    """NCCL's call and the held call alternated, each timed alone; medians of the slowest rank
    (held calls that exchanged, when a hold ran out, left out)."""
    times = {"nccl": [], "held": []}
    for _ in range(int(os.environ.get("HP_ROUNDS", 60))):
        for name in times:
            gate()
            start = time.perf_counter()
            if name == "nccl":
                dist.all_reduce(x)
            else:
                spccl_train.all_reduce(x, config=config)
            sync()
            took = time.perf_counter() - start
            if name == "nccl" or not api.last_stats().exchanges:
                times[name].append(took * 1e6)
    t = torch.tensor([statistics.median(times["nccl"]), statistics.median(times["held"])], dtype=torch.float64)
    t = t.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    nccl, held_us = t.tolist()
    say(f"{label}: nccl {nccl:.1f} us, held {held_us:.1f} us, excess {held_us - nccl:.1f} us (held n={len(times['held'])})")


stamps: list[tuple[str, int]] = []


def stamped(owner, name: str) -> None:
    """Wrap ``owner.name`` so that each call stamps the host clock on entry and on return."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        stamps.append((name + ">", time.perf_counter_ns()))
        result = inner(*args, **kwargs)
        stamps.append(("<" + name, time.perf_counter_ns()))
        return result

    setattr(owner, name, wrapper)


for _ in range(40):  # the shape checked, then held native
    spccl_train.all_reduce(x, config=config)

# 1. as the benchmark times calls; then with the held call's timer on the host clock (its CUDA
# events' cost)
interleaved("bench-like median (slowest rank)")
device_span = held.Span
held.Span = lambda _device: device_span(torch.device("cpu"))
interleaved("host-clock timer")
held.Span = device_span

# 2. the held call's stages, stamped after the benchmark's barrier (median over calls, rank 0)
stamped(config_mod.CollectiveConfig, "validate")
for name in ("transport_of", "_local_problems", "_graphable"):
    stamped(api, name)
for name in ("lookup", "held_now", "Span", "corrections_of", "native_collective", "run"):
    stamped(held, name)
offsets: dict[str, list[float]] = {}
for _ in range(300):
    gate()
    stamps.clear()
    start = time.perf_counter_ns()
    spccl_train.all_reduce(x, config=config)
    sync()
    if api.last_stats().exchanges:
        continue
    for label, at in stamps:
        offsets.setdefault(label, []).append((at - start) / 1e3)
for label, values in offsets.items():
    say(f"  {label:22s} {statistics.median(values):8.1f} us")
dist.destroy_process_group()
