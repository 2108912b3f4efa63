"""Why ``auto`` running direct/Pici takes longer than the fixed pici/direct call (2 GPUs, NVLink).

torchrun --standalone --nproc-per-node=2 autoprof.py. Methods timed in turns as bench_collectives
times them (device sync, gate, host clock, call, device sync), check_calls "first"; per method the
whole call and its host time (entry to return), what it ran, and with AP_PROF=1 a torch.profiler
table of 5 calls of each. Env: AP_BYTES (default 1 GiB; CPU 256 KiB), AP_DTYPE fp32|bf16 (bf16),
AP_SPARSITY (99.9), AP_CALLS (20), AP_METHODS (auto/auto,pici/direct,pici/ring)."""
import os, statistics, time
import torch, torch.distributed as dist
import spccl_train
from spccl_train.collectives import CollectiveConfig, last_stats

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
sync = torch.cuda.synchronize if cuda else (lambda: None)
dtype = torch.bfloat16 if os.environ.get("AP_DTYPE", "bf16") == "bf16" else torch.float32
n = int(os.environ.get("AP_BYTES", 1 << 30 if cuda else 1 << 18)) // (2 if dtype == torch.bfloat16 else 4)
keep = 1 - float(os.environ.get("AP_SPARSITY", "99.9")) / 100
g = torch.Generator(device=device).manual_seed(1234 + rank)
x0 = (torch.randn(n, device=device, generator=g) * (torch.rand(n, device=device, generator=g) < keep)).to(dtype)
work = x0.clone()
flag = torch.zeros(1, device=device)
methods = os.environ.get("AP_METHODS", "auto/auto,pici/direct,pici/ring").split(",")
configs = {m: CollectiveConfig(check_calls="first", format=m.split("/")[0], algorithm=m.split("/")[1]) for m in methods}


def gate():
    sync(); dist.all_reduce(flag); flag.item()


def one(m):
    work.copy_(x0)
    gate()
    start = time.perf_counter()
    spccl_train.all_reduce(work, config=configs[m])
    returned = time.perf_counter()
    sync()
    s = last_stats()
    ran = f"{s.algorithm}/{s.format.value} gc={s.gather_counts} ex={s.exchanges} how={s.exchange} trial={s.trial} sent={s.bytes_sent}"
    if s.plan is not None:
        ran += " msgs=" + " ".join(f"{f.value}:{c}" for f, c in sorted(s.plan.format_counts().items(), key=lambda t: t[0].value))
    return time.perf_counter() - start, returned - start, ran


for _ in range(12):  # warm up, let auto settle
    for m in methods:
        one(m)
rows = {m: [] for m in methods}
for i in range(int(os.environ.get("AP_CALLS", 20))):
    for m in methods if i % 2 else methods[::-1]:
        rows[m].append(one(m))
if rank == 0:
    print(f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}, {dtype}, {n} elements, keep {keep:g}")
    for m, r in rows.items():
        whole = [v[0] * 1e3 for v in r]
        host = [v[1] * 1e3 for v in r]
        print(f"{m:>12}: call median {statistics.median(whole):.3f} ms min {min(whole):.3f}; host median {statistics.median(host):.3f} ms")
        for ran in sorted(set(v[2] for v in r)):
            print(f"{'':>14}{sum(v[2] == ran for v in r)} x {ran}")
for m in methods:  # every rank calls; rank 0 prints
    one(m)
    s = last_stats()
    if rank == 0:
        print(f"--- {m}: predicted {s.predicted_s * 1e3:.3f} ms; candidates " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(s.candidates.items(), key=lambda t: t[1])))
    if rank == 0 and s.plan is not None:
        print(s.plan.describe()[:1500])
if os.environ.get("AP_PROF") == "1":
    from torch.profiler import ProfilerActivity, profile
    for m in methods:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(5):
                one(m)
        if rank == 0:
            print(f"=== profile {m}")
            print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "self_cpu_time_total", row_limit=18))
dist.destroy_process_group()
