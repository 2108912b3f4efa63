"""Host time per message of the collectives' codec calls (_wire.encode / decode), one process."""
import statistics, time, torch
from spccl_train.collectives import _wire
from spccl_train.formats import Format, capacity_bytes
from spccl_train._ext import load_kernels
load_kernels()
dev = torch.device("cuda")
n = 4096 * 16
x = torch.randn(n, device=dev) * (torch.rand(n, device=dev) < 0.01)
y = torch.zeros(n, device=dev)
sink = _wire.StatusSink(dev)
out = {}
for fmt in (Format.PICI, Format.COO):
    cap = capacity_bytes(fmt, n, torch.float32) + 16
    cap += -cap % 16
    slot = _wire.carve(dev, [cap])[0]
    _wire.encode(fmt, n, cap, x, 0, slot)
    cases = {
        "encode": lambda: _wire.encode(fmt, n, cap, x, 0, slot),
        "decode": lambda: _wire.decode(fmt, n, cap, slot, y, 0, accumulate=False, dtype=torch.float32, sink=sink),
        "accumulate": lambda: _wire.decode(fmt, n, cap, slot, y, 0, accumulate=True, dtype=torch.float32, sink=sink),
    }
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            sink._parts.clear()
            t = time.perf_counter()
            for _ in range(500):
                fn()
            ts.append((time.perf_counter() - t) / 500 * 1e6)
            torch.cuda.synchronize()
        out[f"{fmt.value} {name}"] = statistics.median(ts)
for k, v in out.items():
    print(f"{k:18s} {v:7.1f} us host per call")
