"""Replaying collectives planned from bounds as CUDA graphs (``CollectiveConfig.cuda_graphs``).

A call with ``bounds`` makes no host synchronisation, so everything it does (codec kernels,
NCCL transfers, status stacking) is fixed by its arguments: the addresses and sizes of its
tensors, the bounds, the group, the plan-relevant config and the stream. On CUDA that is all a
graph needs. The first call of such a key runs eagerly (it checks the arguments, warms NCCL's
peer connections and the kernels); the second is captured into a :class:`torch.cuda.CUDAGraph`
and replayed; later ones replay it. A replay costs about 10 microseconds of host time against
about a millisecond of Python for the eager call (4x H200, ``bench/results/NOTES.md``).

What a replay reads and writes are the same addresses as the captured call: the caller's
tensors (whatever they hold at replay time) and the graph's own scratch, which lives in the
graph's private memory pool for as long as the graph is cached. Each stream gets its own graph,
so two replays never share scratch unless they are ordered on one stream.

Graphs hold NCCL work: call :func:`clear_graphs` before ``torch.distributed.destroy_process_group``
(the trainer does). A capture that fails (an operation CUDA cannot capture) is logged once and
that key runs eagerly from then on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from .._timing import Span

__all__ = ["graph_key", "run_graphed", "clear_graphs", "cached_graphs", "MAX_GRAPHS"]

_log = logging.getLogger(__name__)

MAX_GRAPHS = 1024
"""Graphs kept at once (each holds its scratch memory). Past this, new keys run eagerly until
:func:`clear_graphs`: evicting would need a device synchronisation, and keys that cycle (one per
DDP bucket) would pay it on every call."""
_MAX_SEEN = 4096


@dataclasses.dataclass(slots=True)
class _Entry:
    graph: torch.cuda.CUDAGraph
    stats: Any
    """The captured call's stats; replays copy it with their own timer and statuses."""
    statuses: torch.Tensor
    """The stacked decoder statuses the graph writes (overwritten by every replay)."""


_graphs: dict[tuple, _Entry] = {}
_seen: set[tuple] = set()
_eager_only: set[tuple] = set()
_capture_streams: dict[int, torch.cuda.Stream] = {}


def graph_key(
    collective: str,
    group_key: Hashable,
    inp: torch.Tensor,
    out: torch.Tensor,
    fingerprint: str,
    bounds: Sequence[Sequence[int]],
) -> tuple:
    """What fixes the work of a call planned from ``bounds`` (the current stream included)."""
    return (
        collective,
        group_key,
        inp.data_ptr(),
        out.data_ptr(),
        inp.numel(),
        out.numel(),
        inp.dtype,
        inp.device.index,
        torch.cuda.current_stream(inp.device).cuda_stream,
        fingerprint,
        tuple(tuple(int(b) for b in row) for row in bounds),
    )


def run_graphed(key: tuple, device: torch.device, run: Callable[[], tuple[Any, torch.cuda.Event | None]]) -> tuple:
    """``run()``'s ``(stats, event)``, eagerly, captured or replayed as the key's history says.

    ``stats`` must be a :class:`~.api.CollectiveStats` (fields ``graph``, ``_statuses``, ``_timer``).
    """
    entry = _graphs.get(key)
    if entry is not None:
        timer = Span(device)
        entry.graph.replay()
        statuses = entry.statuses.clone()  # the next replay overwrites the graph's own
        event = timer.stop()
        stats = dataclasses.replace(entry.stats, graph="replayed", _statuses=statuses, _timer=timer)
        return stats, event
    if key in _eager_only or len(_graphs) >= MAX_GRAPHS or torch.cuda.is_current_stream_capturing():
        return run()  # a caller's own capture records the eager call
    if key not in _seen:
        result = run()  # first sighting: eager (checks arguments, connects NCCL peers, warms kernels)
        if len(_seen) >= _MAX_SEEN:
            _seen.clear()
        _seen.add(key)
        return result
    return _capture(key, device, run)


def _capture(key: tuple, device: torch.device, run: Callable[[], tuple[Any, torch.cuda.Event | None]]) -> tuple:
    current = torch.cuda.current_stream(device)
    side = _capture_streams.get(device.index)
    if side is None:
        side = _capture_streams[device.index] = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)  # once per key: nothing of earlier calls is in flight during the capture
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                stats, _ = run()
            finally:
                graph.capture_end()
    except Exception as exc:  # noqa: BLE001  (any capture failure falls back to eager, once per key)
        _eager_only.add(key)
        _log.warning("spccl_train: could not capture %s in a CUDA graph, running it eagerly: %s", key[0], exc)
        torch.cuda.synchronize(device)
        return run()
    current.wait_stream(side)
    entry = _graphs[key] = _Entry(
        graph=graph, stats=dataclasses.replace(stats, graph="captured"), statuses=stats._statuses
    )
    timer = Span(device)
    graph.replay()
    statuses = entry.statuses.clone()
    event = timer.stop()
    return dataclasses.replace(entry.stats, _statuses=statuses, _timer=timer), event


def cached_graphs() -> int:
    """Graphs held now (each keeps its scratch memory)."""
    return len(_graphs)


def clear_graphs() -> None:
    """Drop every cached graph and what the cache remembers (call before destroying the process group).

    Waits for the device first, so no dropped graph is still running.
    """
    if _graphs and torch.cuda.is_available():
        torch.cuda.synchronize()
    _graphs.clear()
    _seen.clear()
    _eager_only.clear()
