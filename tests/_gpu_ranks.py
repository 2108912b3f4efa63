"""Ranks of the multi-process CUDA tests: one per GPU, or, on a machine of one GPU, two ranks that
share it as two emulated nodes (``spccl_train.emulation``: each its own ``NCCL_HOSTID``, so NCCL
connects them over its socket transport), so every NCCL path is tested on any GPU machine."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from spccl_train.emulation import node_env

__all__ = ["gpu_world", "init_gpu_rank"]


def gpu_world(most: int = 4) -> int:
    """Ranks to spawn: one per GPU up to ``most``, and at least two."""
    return max(2, min(most, torch.cuda.device_count()))


def init_gpu_rank(rank: int, world: int, init_file: str) -> torch.device:
    """Join the NCCL group through the ``file://`` rendezvous on this rank's GPU; return it."""
    gpus = torch.cuda.device_count()
    if world > gpus:  # ranks share GPUs: make each its own emulated node
        os.environ.update(node_env(rank, world, world, os.environ)[1])
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return device
