"""Helpers of the Triton launches: whether Triton imports here (it is optional: CPU-only installs
may lack it), and the small int64 tables the kernels read, made once per value and device."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["triton_importable", "device_table", "uses_triton"]

_TABLES_KEPT = 256
_tables: dict[tuple, torch.Tensor] = {}


@functools.cache
def triton_importable() -> bool:
    """True when ``import triton`` works (checked once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    from .versions import warn_once_if_unsupported

    warn_once_if_unsupported("triton")
    return True


def uses_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernels serve ``t``: on CUDA, or on CPU under the interpreter
    (``TRITON_INTERPRET=1``, as the tests run them)."""
    on_device = t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and triton_importable()


def device_table(values: tuple, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=int64)`` on ``device``, made once per ``(values, device)``.

    Launch arguments such as range starts and lengths repeat from call to call (the same
    buckets every step); copying them to the device each time would add a transfer per launch.
    """
    key = (values, device)
    table = _tables.get(key)
    if table is None:
        if len(_tables) >= _TABLES_KEPT:
            _tables.clear()  # a pure cache: forgetting costs one copy
        table = _tables[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return table
