"""The DDP comm hook over NCCL with the CUDA and Triton kernels (skipped without a GPU).

On the GPU machine: ``NCCL_NVLS_ENABLE=0 python -m pytest tests/test_ddp_cuda.py -q``. Spawns one
process per GPU (up to 4; two sharing the GPU as emulated nodes on a machine of one,
``tests/_gpu_ranks.py``) with a ``file://`` rendezvous under tmp_path; each rank writes its
failures to a file the test reads.
"""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from spccl_train._ext import kernels_available
from spccl_train.collectives import CollectiveConfig, clear_graphs
from spccl_train.ddp import SparseHookState, sparse_allreduce_hook

from _gpu_ranks import gpu_world, init_gpu_rank  # noqa: I001 (a sibling test module)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels_available()),
    reason="needs a GPU and the compiled spccl CUDA kernels",
)


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).to(device)


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    device = init_gpu_rank(rank, world, init_file)
    failures = []
    try:
        g = torch.Generator(device=device).manual_seed(10 + rank)
        # Pruning off: the same gradients as default DDP, in line, on a side stream, on a thread.
        for overlap in (False, "stream", True):
            reference = DDP(_model(device), device_ids=[device.index], bucket_cap_mb=0.5)
            hooked = DDP(_model(device), device_ids=[device.index], bucket_cap_mb=0.5)
            hooked.register_comm_hook(
                SparseHookState(overlap=overlap, config={"prune": False, "collective": {"format": "pici"}}),
                sparse_allreduce_hook,
            )
            for _ in range(3):
                x = torch.randn(32, 64, device=device, generator=g)
                for model in (reference, hooked):
                    model.zero_grad()
                    model(x).square().mean().backward()
                for a, b in zip(reference.parameters(), hooked.parameters(), strict=True):
                    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=f"overlap={overlap}")
        # Pruned training, bf16 model too: runs, stays finite, keeps about 1%, sends less than dense
        # (Pici ring forced: with buckets this small, "auto" rightly picks dense).
        for dtype in (torch.float32, torch.bfloat16):
            model = DDP(_model(device).to(dtype), device_ids=[device.index], bucket_cap_mb=0.5)
            state = SparseHookState(
                config={
                    "pruning": {"density": 0.01, "sample_fraction": 0.05},
                    "collective": {"format": "pici", "algorithm": "ring"},
                }
            )
            model.register_comm_hook(state, sparse_allreduce_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(20):
                x = torch.randn(32, 64, device=device, generator=g).to(dtype)
                optimizer.zero_grad()
                loss = model(x).float().square().mean()
                loss.backward()
                optimizer.step()
            summary = state.summary()
            if not torch.isfinite(loss) or not 0.005 < summary.density < 0.02 or summary.bytes_ratio >= 1:
                failures.append(f"{dtype}: loss {loss.item()}, {summary}")
        # Pruning to the wire (direct Pici, the default): the same gradients, bit for bit, as pruning
        # in place and encoding, eager or replayed from CUDA graphs, in every overlap mode.
        for overlap, graphs in ((False, False), ("stream", False), (True, False), ("stream", True)):
            models, states = [], []
            for wire in (True, False):
                model = DDP(_model(device), device_ids=[device.index], bucket_cap_mb=0.5)
                cfg = CollectiveConfig(format="pici", algorithm="direct", cuda_graphs=graphs)
                state = SparseHookState(
                    overlap=overlap,
                    config={
                        "pruning": {"density": 0.01, "sample_fraction": 0.05},
                        "collective": cfg,
                        "prune_to_wire": wire,
                    },
                )
                model.register_comm_hook(state, sparse_allreduce_hook)
                models.append(model)
                states.append(state)
            for step in range(6):
                x = torch.randn(32, 64, device=device, generator=g)
                for model in models:
                    model.zero_grad()
                    model(x).square().mean().backward()
                for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
                    if not torch.equal(a.grad, b.grad):
                        failures.append(f"prune_to_wire, overlap={overlap}, graphs={graphs}, step {step}: grads differ")
                        break
            wired = [bucket.encoded is not None for bucket in states[0].buckets.values()]
            if not any(wired) or states[0].decode_failures():
                failures.append(f"prune_to_wire, overlap={overlap}, graphs={graphs}: {wired}, {states[0].summary()}")
            clear_graphs()  # before destroy_process_group, which a cached graph's NCCL work would hang
        # Bounded planning (capacity_factor): exchanges only in the first sparse iteration, in every
        # overlap mode; the decoders never see a broken bound.
        for overlap in (False, "stream", True):
            model = DDP(_model(device), device_ids=[device.index], bucket_cap_mb=0.5)
            state = SparseHookState(
                overlap=overlap,
                config={
                    "pruning": {"density": 0.01, "sample_fraction": 0.05},
                    "capacity_factor": 2.0,
                    "collective": {"format": "pici"},
                },
            )
            model.register_comm_hook(state, sparse_allreduce_hook)
            for _ in range(10):
                model.zero_grad()
                model(torch.randn(32, 64, device=device, generator=g)).square().mean().backward()
            torch.cuda.synchronize()
            summary = state.summary()
            buckets = summary.sparse_reductions // 9
            if summary.exchanges != buckets or state.decode_failures() or not 0.005 < summary.density < 0.02:
                failures.append(f"capacity_factor, overlap={overlap}: {summary}, {state.decode_failures()} failures")
    except Exception:  # noqa: BLE001 (report to the test)
        failures.append(traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures))
    dist.destroy_process_group()


def test_hook_over_nccl(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    world = gpu_world()
    torch.multiprocessing.spawn(_rank, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world)
    problems = [(tmp_path / f"rank{r}.txt").read_text() for r in range(world)]
    assert not any(problems), "\n".join(problems)
