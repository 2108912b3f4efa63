"""Host time of a sparse all-reduce's stages (rank 0; medians over calls). torchrun 2 ranks.
Env: ST_BYTES, ST_METHOD (pici/direct), ST_CALLS (60), ST_DTYPE."""
import os, statistics, time, functools, collections
import torch, torch.distributed as dist
import spccl_train
if os.environ.get("ST_DBG"): exec(open("/tmp/dbg.py").read())
from spccl_train.collectives import CollectiveConfig, api, executors, _direct, choice, exchange, chunking, plan as planmod, rank_plan, summary as summod, stats as statsmod

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
if cuda: torch.cuda.set_device(device)
dtype = torch.bfloat16 if os.environ.get("ST_DTYPE") == "bf16" else torch.float32
n = int(os.environ.get("ST_BYTES", 1 << 18)) // (2 if dtype == torch.bfloat16 else 4)
g = torch.Generator(device=device).manual_seed(rank + 1)
base = (torch.randn(n, device=device, generator=g) * (torch.rand(n, device=device, generator=g) < 0.01)).to(dtype)
x = base.clone()
m = os.environ.get("ST_METHOD", "pici/direct")
fmt, alg = m.split("/")
cfg = CollectiveConfig(check_calls=alg) if fmt == "auto" else CollectiveConfig(format=fmt, algorithm=alg)
durs = collections.defaultdict(list)
cur = {}
def wrap(owner, name, label=None):
    inner = getattr(owner, name, None)
    if inner is None:
        return
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"
    @functools.wraps(inner)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            cur[label] = cur.get(label, 0) + time.perf_counter() - t
    setattr(owner, name, w)
wrap(api, "_request", "request"); wrap(api, "_exchange", "exchange (count+gather+sync)")
wrap(exchange, "exchange_counts", "  exchange_counts"); wrap(api, "count_nonzero_pieces", "  count")
wrap(api, "_decide_and_plan", "decide_and_plan"); wrap(api, "decide", "  decide"); wrap(api, "_reused", "reused"); wrap(api, "_pick_and_plan", "pick_and_plan"); wrap(api, "priced", "  priced"); wrap(api, "plan_candidate", "  plan_candidate")
wrap(api, "gather_plan", "  gather_plan"); wrap(exchange.Counts, "summary", "summary")
wrap(api, "model_of", "model_of"); wrap(api, "corrections_of", "corrections_of")
wrap(api, "execute", "execute"); wrap(executors, "direct_all_reduce", "  direct_all_reduce")
wrap(_direct._Gather, "__init__", "    Gather.init"); wrap(_direct._Gather, "post", "    post"); wrap(_direct._Gather, "finish", "    finish")
wrap(_direct, "_waves", "    _waves"); wrap(_direct, "_splits", "    _splits"); wrap(_direct, "carve", "    carve")
wrap(_direct, "encode", "    encode"); wrap(_direct, "decode", "    decode")
wrap(api, "CollectiveStats", "stats"); wrap(api.held, "goes_native_unexchanged", "goes_native_unexchanged"); wrap(api, "_graphable", "graphable"); wrap(api.held, "lookup", "held.lookup"); wrap(api, "take_encoded", "take_encoded"); wrap(exchange, "check_table", "  check_table"); wrap(api.Counts, "from_table", "  from_table")
wrap(api, "_run", "_run"); wrap(api, "_call", "_call")
flag = torch.zeros(1, device=device)
def sync():
    if cuda: torch.cuda.synchronize()
for i in range(int(os.environ.get("ST_CALLS", 60)) + 5):
    x.copy_(base); sync(); dist.all_reduce(flag); flag.item()
    cur.clear()
    t = time.perf_counter()
    spccl_train.all_reduce(x, config=cfg)
    cur["total (host, to return)"] = time.perf_counter() - t
    sync()
    cur["total (to sync)"] = time.perf_counter() - t
    if i >= 5:
        for k, v in cur.items(): durs[k].append(v * 1e6)
if rank == 0:
    print(f"{m} {n} elements {dtype}, last choice {api.last_stats().algorithm}/{api.last_stats().format.value}")
    for k, v in durs.items():
        print(f"{k:34s} median {statistics.median(v):8.1f} us   min {min(v):8.1f}")
dist.destroy_process_group()
