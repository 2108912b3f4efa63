"""Whether Triton can be imported here (it is optional: CPU-only installs may lack it)."""

from __future__ import annotations

import functools

__all__ = ["triton_importable"]


@functools.cache
def triton_importable() -> bool:
    """True when ``import triton`` works (checked once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
