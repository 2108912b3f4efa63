"""Test-only shims that let megatron-core's DistributedDataParallel run on CPU tensors over gloo.

Megatron allocates its parameter and gradient buffers on ``torch.cuda.current_device()`` and
(0.19) asks for ``torch.cuda.current_stream()`` in every gradient reduction, to wait on CUDA
graph events it only has on GPUs. Inside :func:`megatron_on_cpu` the current device is the CPU
and the streams are stand-ins whose waits do nothing, even where CUDA is available, so the
buffers are CPU tensors that gloo reduces. Never use this outside tests.
"""

from __future__ import annotations

import contextlib

import torch

from spccl_train.megatron.pretrain import _megatron_device

__all__ = ["ensure_model_parallel", "megatron_on_cpu", "megatron_optimizer_on_cpu"]


def megatron_on_cpu():
    """Point Megatron's CUDA device and stream queries at the CPU while the block runs."""
    return _megatron_device(torch.device("cpu"))


def ensure_model_parallel() -> None:
    """Initialise Megatron's parallel state once per process: tensor and pipeline parallel size 1."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, create_gloo_process_groups=False
        )


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


@contextlib.contextmanager
def megatron_optimizer_on_cpu():
    """Let Megatron's optimizer (``get_megatron_optimizer``) run on CPU tensors while the block runs.

    It makes its grad-norm, loss-scale and overflow buffers with ``device='cuda'`` and checks
    ``param.type()`` against ``torch.cuda.*Tensor`` names: inside this block those factories put
    ``device='cuda'`` tensors on the CPU, and ``Tensor.type()`` names CPU tensors as CUDA ones.
    Use it with :func:`megatron_on_cpu`, in processes of their own (it patches ``torch`` globally).
    """
    saved = {name: getattr(torch, name) for name in _FACTORIES}
    saved_type = torch.Tensor.type

    def on_cpu(factory):
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    def type_name(self, *args, **kwargs):
        if args or kwargs:
            return saved_type(self, *args, **kwargs)
        name = saved_type(self)
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    for name in _FACTORIES:
        setattr(torch, name, on_cpu(saved[name]))
    torch.Tensor.type = type_name
    try:
        yield
    finally:
        for name, factory in saved.items():
            setattr(torch, name, factory)
        torch.Tensor.type = saved_type
