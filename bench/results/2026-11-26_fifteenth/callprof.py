"""Where a sparse all-reduce's time goes: each method timed as bench_collectives times a call
(gate, host clock, call, device sync), interleaved; then cProfile (rank 0) and torch.profiler of
one method. torchrun --standalone --nproc-per-node=2 callprof.py
Env: CP_BYTES (default 256 MiB on GPU, 1 MiB on CPU), CP_DTYPE fp32|bf16, CP_SPARSITY (99),
CP_ROUNDS (20), CP_METHODS (nccl,pici/direct,coo/direct,auto/every,auto/first), CP_PROF (pici/direct),
CP_OUT (where traces go)."""
import cProfile, io, os, pstats, statistics, time
import torch, torch.distributed as dist
import spccl_train
from spccl_train.collectives import CollectiveConfig, api

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dtype = torch.bfloat16 if os.environ.get("CP_DTYPE") == "bf16" else torch.float32
nbytes = int(os.environ.get("CP_BYTES", 256 << 20 if cuda else 1 << 20))
n = nbytes // (2 if dtype == torch.bfloat16 else 4)
keep = 1 - float(os.environ.get("CP_SPARSITY", 99)) / 100
g = torch.Generator(device=device).manual_seed(rank + 1)
base = (torch.randn(n, device=device, generator=g) * (torch.rand(n, device=device, generator=g) < keep)).to(dtype)
x = base.clone()
flag = torch.zeros(1, device=device)
rounds = int(os.environ.get("CP_ROUNDS", 20))
out = os.environ.get("CP_OUT", "/tmp")


def config_of(m):
    if m == "nccl":
        return None
    fmt, alg = m.split("/")
    if fmt == "auto":
        return CollectiveConfig(check_calls=alg)
    return CollectiveConfig(format=fmt, algorithm=alg)


def sync():
    if cuda:
        torch.cuda.synchronize()


def gate():
    sync(); dist.all_reduce(flag); flag.item()


def call(m, cfg):
    x.copy_(base)
    sync()
    if m == "nccl":
        dist.all_reduce(x)
    else:
        spccl_train.all_reduce(x, config=cfg)


def say(t):
    if rank == 0:
        print(t, flush=True)


methods = os.environ.get("CP_METHODS", "nccl,pici/direct,coo/direct,auto/every,auto/first").split(",")
cfgs = {m: config_of(m) for m in methods}
for m in methods:  # warm-up and settling
    for _ in range(6):
        call(m, cfgs[m]); sync()
times = {m: [] for m in methods}
for _ in range(rounds):
    for m in methods:
        x.copy_(base); gate()
        t0 = time.perf_counter()
        if m == "nccl":
            dist.all_reduce(x)
        else:
            spccl_train.all_reduce(x, config=cfgs[m])
        sync()
        times[m].append((time.perf_counter() - t0) * 1e3)
for m in methods:
    q = statistics.quantiles(times[m], n=10)
    t = torch.tensor([statistics.median(times[m]), min(times[m]), q[0], q[-1]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    say(f"{m:12s} median {t[0]:.3f} ms  min {t[1]:.3f} ms  p10 {t[2]:.3f}  p90 {t[3]:.3f}")
prof_m = os.environ.get("CP_PROF", "pici/direct")
if prof_m == "none":
    dist.destroy_process_group(); raise SystemExit
cfg = cfgs.get(prof_m) or config_of(prof_m)
for _ in range(3):
    call(prof_m, cfg); sync()
# host time: cProfile, rank 0 (both ranks profile so they run alike)
pr = cProfile.Profile()
for _ in range(rounds):
    x.copy_(base); gate()
    pr.enable()
    spccl_train.all_reduce(x, config=cfg)
    sync()
    pr.disable()
s = io.StringIO()
ps = pstats.Stats(pr, stream=s).sort_stats("tottime")
ps.print_stats(35)
s2 = io.StringIO()
pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(45)
say(f"--- cProfile {prof_m}, {rounds} calls, by tottime\n" + s.getvalue()[-9000:])
say("--- by cumulative\n" + s2.getvalue()[-9000:])
if cuda:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            x.copy_(base); gate()
            spccl_train.all_reduce(x, config=cfg)
            sync()
    say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    if rank == 0:
        prof.export_chrome_trace(f"{out}/trace_{prof_m.replace('/', '_')}_r0.json")
dist.destroy_process_group()
