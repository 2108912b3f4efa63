"""Where a held native all-reduce's extra time goes (2 GPUs over NVLink; runs on a CPU with gloo).

torchrun --standalone --nproc-per-node=2 heldstage.py. Each call timed as bench_collectives times
it (copy of the input, device sync and a gate, host clock, call, device sync); the methods in a
shuffled order each round, the same on every rank:
  nccl        dist.all_reduce(work)
  nccl async  dist.all_reduce(work, async_op=True).wait()
  async, span after  as held.native_call launches and times a call: async, a Span made after the
              launch, wait, stop
  floor       the same after one dict lookup: what a held call would take with no other prelude
  held        spccl_train.all_reduce(work, config=check_calls "first"), a held native call;
              its host clock is also read at the entry and return of executors.native_collective.
Then the host cost of each step of the held path's prelude, in loops of HS_LOOPS calls.
Env: HS_BYTES (default 256 MiB; CPU 256 KiB), HS_DTYPE fp32|bf16, HS_CALLS (default 60)."""
import os, random, statistics, time
import torch, torch.distributed as dist
import spccl_train
from spccl_train._timing import Span
from spccl_train.collectives import CollectiveConfig, held, last_stats
from spccl_train.collectives import api, context

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
sync = torch.cuda.synchronize if cuda else (lambda: None)
dtype = torch.bfloat16 if os.environ.get("HS_DTYPE") == "bf16" else torch.float32
n = int(os.environ.get("HS_BYTES", 256 << 20 if cuda else 1 << 18)) // (2 if dtype == torch.bfloat16 else 4)
x0 = (torch.randn(n, device=device) * (torch.rand(n, device=device) < 0.01)).to(dtype)
work = x0.clone()
flag = torch.zeros(1, device=device)
cfg = CollectiveConfig(check_calls="first")
marks = []
plain = held.native_collective


def marked(*a, **k):
    marks.append(time.perf_counter())
    w = plain(*a, **k)
    marks.append(time.perf_counter())
    return w


held.native_collective = marked


def one(method):
    work.copy_(x0)
    sync(); dist.all_reduce(flag); flag.item()
    marks.clear()
    start = time.perf_counter()
    if method == "nccl":
        dist.all_reduce(work)
    elif method == "nccl async":
        dist.all_reduce(work, async_op=True).wait()
    elif method == "async, span after":
        w = dist.all_reduce(work, async_op=True)
        span = Span(device)
        w.wait()
        span.stop()
    elif method == "floor":  # a dict lookup, then what held.native_call does
        floor_routes.get((n, dtype))
        w = dist.all_reduce(work, async_op=True)
        span = Span(device)
        w.wait()
        span.stop()
    else:
        spccl_train.all_reduce(work, config=cfg)
    returned = time.perf_counter()
    sync()
    end = time.perf_counter()
    pre, launch = (marks[0] - start, marks[1] - marks[0]) if marks else (0.0, 0.0)
    return [end - start, returned - start, pre, launch]


floor_routes = {(n, dtype): True}
methods = ["nccl", "nccl async", "async, span after", "floor", "held"]
for _ in range(10):
    for m in methods:
        one(m)
rows = {m: [] for m in methods}
held_calls = 0
for i in range(int(os.environ.get("HS_CALLS", 60))):
    order = list(methods)
    random.Random(i).shuffle(order)
    for m in order:
        rows[m].append(one(m))
        held_calls += m == "held" and last_stats().exchanges == 0
t = torch.tensor([[r[0] for r in rows[m]] for m in methods], dtype=torch.float64, device=device)
dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each call's slowest rank


def loop(fn, k=int(os.environ.get("HS_LOOPS", 20000))):
    fn()
    s = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - s) / k * 1e6


transport = context.transport_of(None)
try:  # from f4c1b86 the short path looks its route up by group, before the config's validation
    route = held.lookup("all_reduce", None, cfg, work, work)
    lookup_args = (None,)
except AttributeError:  # before: by transport
    route = held.lookup("all_reduce", transport, cfg, work, work)
    lookup_args = (transport,)
corr = context.corrections_of(cfg, transport)
if hasattr(held.Route, "held_now"):  # from 2026-11-27, twenty-second sitting
    route_held_now = route.held_now
else:  # 831a008
    route_held_now = lambda: held.held_now(
        "all_reduce", cfg, route.signature, route.layout, dtype, device, transport, route.topology, corr, route
    )
steps = {
    "config.validate": cfg.validate,
    "transport_of": lambda: context.transport_of(None),
    "_graphable": lambda: api._graphable(cfg, work, work, transport),
    "held.lookup": lambda: held.lookup("all_reduce", *lookup_args, cfg, work, work),
    "  config.key": cfg.key,
    "  ranks_per_node": lambda: context.ranks_per_node(cfg, transport),
    "  state_of": lambda: held.state_of(transport),
    "_fits": lambda: api._fits("all_reduce", work, work, transport),
    "corrections_of": lambda: context.corrections_of(cfg, transport),
    "held_now (route)": route_held_now,
    "requires_grad x2": lambda: work.requires_grad or work.requires_grad,
    "current_stream": lambda: torch.cuda.current_stream(device) if cuda else None,
    "Span (event made, recorded)": lambda: Span(device),
    "Event() only": lambda: torch.cuda.Event(enable_timing=True) if cuda else None,
}
costs = {name: loop(fn) for name, fn in steps.items()}
if rank == 0:
    base = statistics.median(t[0].tolist())
    print(f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}, {dtype}, {n} elements, {t.shape[1]} calls each, "
          f"{held_calls} held")
    for m, row in zip(methods, t.tolist()):
        med = statistics.median(row)
        mine = rows[m]
        host = statistics.median(r[1] for r in mine) * 1e6
        pre = statistics.median(r[2] for r in mine) * 1e6
        launch = statistics.median(r[3] for r in mine) * 1e6
        print(f"{m:>18}: median {med * 1e3:.3f} ms ({(med - base) * 1e6:+.0f} us), min {min(row) * 1e3:.3f}; "
              f"rank 0 host to return {host:.0f} us, to native_collective {pre:.0f} us, in it {launch:.0f} us")
    print("host cost per call (us):")
    for name, us in costs.items():
        print(f"  {name:<28} {us:6.2f}")
dist.destroy_process_group()
