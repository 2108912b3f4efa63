"""Pieces every benchmark script shares: argument parsers, device names, file-name slugs, size labels.

The scripts import it as a sibling module (``python bench/<script>.py`` and ``torchrun`` put the
script's folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import re
import time

import torch

__all__ = ["UNITS", "device_name", "free_cache", "parse_size", "parse_sparsity", "size_label", "slug"]

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
"""Binary size suffixes."""


def parse_size(text: str) -> int:
    """``64M`` -> 67108864 (binary units; ``B``/``iB`` optional); an argparse type."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r} is not like 64M, 256M or 1G (binary units)")
    return int(match.group(1)) * UNITS.get(match.group(2).upper(), 1)


def parse_sparsity(text: str) -> float:
    """A sparsity in percent, 0 to 100; an argparse type."""
    value = float(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"sparsity {text!r} is a percentage: give a number in [0, 100]")
    return value


def size_label(nbytes: int) -> str:
    """``64M``, ``1G``; sizes that are not a whole number of units read as ``~1024K``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"~{nbytes / scale:.4g}{unit}"
    return str(nbytes)


def device_name(device: torch.device) -> str:
    """The GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def slug(text: str) -> str:
    """A file-name-safe form: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


FREE_SETTLE_S = 0.1
"""Seconds the device is left idle after a case's blocks go back to the driver."""


def free_cache(device: torch.device) -> None:
    """Return cached blocks to the driver between cases, so one case's buffers do not crowd the next.

    Then leave the device idle for ``FREE_SETTLE_S``: memory-bound kernels run slower for tens of
    milliseconds after gigabytes are freed. On one H100 (bench/results/2026-11-27_twentyfirst/),
    the first 6-18 of 20 timed bf16 Pici compress calls at 50% (1 GiB) after the 0% case's frees
    took 0.681-0.687 ms against 0.625-0.636 for the rest, with the SM clock unchanged (1971-1990
    MHz); with 100 ms of idle after each free every call took 0.626-0.635 ms. Without it the
    median read 0.648-0.684 ms (0.86-0.82 of copy) in 8 of 14 sweeps, 0.629-0.633 in the others.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        time.sleep(FREE_SETTLE_S)
