"""A held native call launched asynchronously on the group's stream, its timer started after the
launch (as the library does at 0de5ac0), against one launched synchronously with its timer
started before, and against NCCL's own call (2 GPUs, NVLink).

torchrun --standalone --nproc-per-node=2 heldab.py. Each call timed as bench_collectives times it
(copy of the input, device sync and gate, host clock, call, device sync), the three methods in a
shuffled order each round (the same on every rank). Env: HA_BYTES (default 256 MiB; CPU 256 KiB),
HA_DTYPE fp32|bf16 (fp32), HA_CALLS (default 60). Runs on a CPU too (gloo), as a check."""
import os, random, statistics, time
import torch, torch.distributed as dist
import spccl_train
from spccl_train._timing import Span
from spccl_train.collectives import CollectiveConfig, held, last_stats

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
sync = torch.cuda.synchronize if cuda else (lambda: None)
dtype = torch.bfloat16 if os.environ.get("HA_DTYPE") == "bf16" else torch.float32
n = int(os.environ.get("HA_BYTES", 256 << 20 if cuda else 1 << 18)) // (2 if dtype == torch.bfloat16 else 4)
x0 = (torch.randn(n, device=device) * (torch.rand(n, device=device) < 0.01)).to(dtype)
work = x0.clone()
flag = torch.zeros(1, device=device)
cfg = CollectiveConfig(check_calls="first")
launched_after = held.native_call


def launched_before(collective, transport, route, x, y, corrections, timer):
    return launched_after(collective, transport, route, x, y, corrections, timer or Span(x.device))


variants = {"async, timer after": launched_after, "sync, timer before": launched_before}


def one(method):
    work.copy_(x0)
    sync(); dist.all_reduce(flag); flag.item()
    start = time.perf_counter()
    if method == "nccl":
        dist.all_reduce(work)
    else:
        held.native_call = variants[method]
        spccl_train.all_reduce(work, config=cfg)
    sync()
    return time.perf_counter() - start


methods = ["nccl", *variants]
for _ in range(10):
    for m in methods:
        one(m)
times = {m: [] for m in methods}
held_calls = {m: 0 for m in variants}
for i in range(int(os.environ.get("HA_CALLS", 60))):
    order = list(methods)
    random.Random(i).shuffle(order)
    for m in order:
        times[m].append(one(m))
        if m in variants:
            held_calls[m] += last_stats().exchanges == 0
held.native_call = launched_after
t = torch.tensor([times[m] for m in methods], dtype=torch.float64, device=device)
dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each call's slowest rank
if rank == 0:
    base = statistics.median(t[0].tolist())
    print(f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}, {dtype}, {n} elements, {t.shape[1]} calls each")
    for m, row in zip(methods, t.tolist()):
        med = statistics.median(row)
        extra = f"; {held_calls[m]} held" if m in held_calls else ""
        print(f"{m:>20}: median {med * 1e3:.3f} ms ({(med - base) * 1e6:+.0f} us), min {min(row) * 1e3:.3f}{extra}")
dist.destroy_process_group()
