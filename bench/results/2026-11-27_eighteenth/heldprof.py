"""Where a held native call's time goes on the device, against NCCL's own call (2 GPUs).

torchrun --standalone --nproc-per-node=2 heldprof.py. Each call timed as bench_collectives times it
(device sync, gate, host clock, call, device sync); besides, the host's time from the call's entry
to NCCL's launch returning (the library's dist.all_reduce wrapped), and the whole call's host time.
Env: HP_BYTES (default 256 MiB), HP_DTYPE fp32|bf16, HP_CALLS (default 60), HP_PROF=1: a
torch.profiler table of 10 calls of each."""
import os, statistics, time
import torch, torch.distributed as dist
import spccl_train
from spccl_train.collectives import CollectiveConfig, executors, held, last_stats

cuda = torch.cuda.is_available()  # on a CPU (gloo) the script's logic runs, for a check
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
sync = torch.cuda.synchronize if cuda else (lambda: None)
dtype = torch.bfloat16 if os.environ.get("HP_DTYPE") == "bf16" else torch.float32
n = int(os.environ.get("HP_BYTES", 256 << 20 if cuda else 1 << 16)) // (2 if dtype == torch.bfloat16 else 4)
x0 = (torch.randn(n, device=device) * (torch.rand(n, device=device) < 0.01)).to(dtype)
work = x0.clone()
flag = torch.zeros(1, device=device)
cfg = CollectiveConfig(check_calls="first")
marks = {}
real = dist.all_reduce


def wrapped(*a, **k):  # the library's launch of NCCL's call, timed on the host
    marks["before"] = time.perf_counter()
    r = real(*a, **k)
    marks["after"] = time.perf_counter()
    return r


executors.dist.all_reduce = wrapped  # native_collective's dist


def gate():
    sync(); dist.all_reduce(flag); flag.item()


def one(method):
    work.copy_(x0)
    gate()
    start = time.perf_counter()
    if method == "nccl":
        marks["before"] = time.perf_counter()
        real(work)
        marks["after"] = time.perf_counter()
    else:
        spccl_train.all_reduce(work, config=cfg)
    returned = time.perf_counter()
    sync()
    end = time.perf_counter()
    return end - start, marks["before"] - start, marks["after"] - start, returned - start


for _ in range(30):  # settle auto into holding native
    one("auto")
st = last_stats()
rows = {"nccl": [], "auto": []}
for i in range(int(os.environ.get("HP_CALLS", 60))):
    for m in ("nccl", "auto") if i % 2 else ("auto", "nccl"):
        rows[m].append(one(m) + ((last_stats().exchanges, last_stats().algorithm) if m == "auto" else (0, "nccl")))
if rank == 0:
    print(f"spccl_train from {spccl_train.__file__}")
    print(f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}, {dtype}, {n} elements; auto's last settle call: {st.algorithm}, exchanges {st.exchanges}")
    for m, r in rows.items():
        held_rows = [v for v in r if v[4] == 0]
        print(f"{m}: {len(held_rows)} of {len(r)} calls unexchanged")
        for name, k in (("whole call", 0), ("entry to launch", 1), ("entry to launch returned", 2), ("entry to call returned", 3)):
            vals = [v[k] * 1e6 for v in held_rows]
            print(f"  {name:>26}: median {statistics.median(vals):8.1f} us  min {min(vals):8.1f}  p90 {sorted(vals)[int(0.9 * len(vals))]:8.1f}")
if os.environ.get("HP_PROF") == "1":
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            one("nccl"); one("auto")
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
dist.destroy_process_group()
