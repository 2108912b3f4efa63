import os, sys, torch
sys.path.insert(0, os.getcwd())
import spccl_train._ext as e
e.load_kernels()
from spccl_train.formats import capacity_bytes
N = (1 << 30) // 4
sp = float(os.environ.get("SP", "0.99"))
x = torch.randn(N, device="cuda"); x[torch.rand(N, device="cuda") < sp] = 0
out = torch.empty(capacity_bytes("pici", N, torch.float32), dtype=torch.uint8, device="cuda")
for _ in range(3):
    torch.ops.spccl.pici_compress(x, 0, N, out)
torch.cuda.synchronize()
