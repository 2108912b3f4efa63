"""A start/stop time span on the device (CUDA events) or on the host clock, read later.

Recording costs no host synchronisation; :meth:`Span.seconds` waits for the end event, so
callers read spans off the hot path.
"""

from __future__ import annotations

import time

import torch

__all__ = ["Span"]


class Span:
    """Starts when made; :meth:`stop` marks the end; :meth:`seconds` reads the length."""

    __slots__ = ("_cuda", "_start", "_end")

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        self._end = None

    def stop(self) -> torch.cuda.Event | None:
        """Mark the end (on CUDA, record and return the end event; on CPU, return None)."""
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
            return self._end
        self._end = time.perf_counter()
        return None

    def done(self) -> bool:
        """Whether the span is stopped and (on CUDA) its end has been reached; never waits."""
        if self._end is None:
            return False
        return self._end.query() if self._cuda else True

    def seconds(self) -> float:
        """Length of the span in seconds (on CUDA this waits for the end event)."""
        if self._end is None:
            raise RuntimeError("the span has not been stopped")
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start
