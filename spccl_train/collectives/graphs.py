"""Replaying collectives planned from bounds as CUDA graphs (``CollectiveConfig.cuda_graphs``).

A call with ``bounds`` makes no host synchronisation, so everything it does (codec kernels,
NCCL transfers, status stacking) is fixed by its arguments: its tensors, the bounds, the group,
the config and the stream. On CUDA that is all a graph needs. The first call of a key runs
eagerly (it checks the arguments, warms NCCL's peer connections and the kernels); the second is
captured into a :class:`torch.cuda.CUDAGraph` and replayed; later ones replay it. A replay costs
about 0.1 ms of host time against about 1.3 ms of Python for the eager call (4x H200,
``bench/results/NOTES.md``).

**Every rank decides alike.** NCCL treats capturing as a collective property: every rank must
capture the same operation together and replay the graph of that joint capture. So the key that
decides between eager, capture and replay holds only what is equal on every rank: the
collective, the group, sizes, dtype, config, bounds, and the caller's ``graph_tag``; decisions
agree as long as every rank makes its graphed calls in one order (one thread per group does).
Calls on different tensors with otherwise equal keys (two buckets of one size) must pass
different tags; the DDP hook and the Megatron integration tag each bucket. A tag keeps one
graph: capturing a new key under it (other sizes or bounds) drops the previous one. What is local to a rank (the tensors'
addresses, the stream) is recorded at capture, and a later call of the key must match it: one
that does not raises on its rank (the other ranks, replaying, would wait for it, as they wait
for a rank that breaks its bounds). Likewise a capture that fails raises: falling back to eager
on one rank would leave the others in a captured collective.

What a replay reads and writes are the addresses of the captured call: the caller's tensors
(whatever they hold at replay time) and the graph's scratch, in the graph's private memory pool
for as long as the graph is cached. The decoder status words are copied out after each replay.
Replayed NCCL kernels are not watched by torch's NCCL watchdog, so a replay that never completes
(a rank that stopped calling) is not timed out. Call :func:`clear_graphs` on every rank before
``torch.distributed.destroy_process_group`` (both trainers do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from .._timing import Span

__all__ = [
    "BOUND_HEADROOM",
    "MAX_GRAPHS",
    "bounds_from_counts",
    "cached_graphs",
    "clear_graphs",
    "clearing_graphs",
    "graph_key",
    "run_graphed",
]

_log = logging.getLogger(__name__)

MAX_GRAPHS = 1024
"""Graphs kept at once (each holds its scratch memory). Past this, new keys run eagerly until
:func:`clear_graphs` (on every rank alike: the count is the same everywhere)."""
_MAX_SEEN = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class _Local:
    """What a capture fixed on this rank; a replay must be called with the same."""

    inp: int
    out: int
    out_dtype: torch.dtype
    device: int
    stream: int
    extra: int = 0
    """The address of one more buffer the call reads (an all-reduce's encoded input), or 0."""


@dataclasses.dataclass(slots=True)
class _Entry:
    graph: torch.cuda.CUDAGraph
    local: _Local
    stats: Any
    """The captured call's stats; replays copy it with their own timer and statuses."""
    statuses: torch.Tensor
    """The stacked decoder statuses the graph writes (overwritten by every replay)."""


_lock = threading.Lock()
_graphs: dict[tuple, _Entry] = {}
_named: dict[tuple, tuple] = {}  # (collective, group, tag) -> the key of its cached graph
_seen: set[tuple] = set()
_bounds: dict[tuple, list[list[int]]] = {}  # bounds derived for graphed calls made without bounds=
_threads = threading.local()  # each thread captures on a side stream of its own


def graph_key(
    collective: str,
    group_key: Hashable,
    inp: torch.Tensor,
    out: torch.Tensor,
    fingerprint: str,
    bounds: Sequence[Sequence[int]],
    tag: Hashable,
) -> tuple:
    """The rank-uniform key of a call planned from ``bounds`` (no address, no stream).

    Its first three parts name the tagged call (:func:`run_graphed` keeps one graph per name);
    a table whose rows are one object (``[row] * world``, as the hooks pass) is read once.
    """
    rows = list(bounds)
    if rows and all(row is rows[0] for row in rows):
        table: tuple = ("rows", len(rows), tuple(int(b) for b in rows[0]))
    else:
        table = tuple(tuple(int(b) for b in row) for row in rows)
    return (collective, group_key, tag, inp.numel(), out.numel(), inp.dtype, fingerprint, table)


BOUND_HEADROOM = 1.0625
"""``cuda_graphs`` calls without ``bounds``: each piece's bound is its exchanged count ``c`` times
this, plus ``4 sqrt(c) + 16`` (four standard deviations of a count of independent nonzeros), so
that the next calls' counts, which vary, still fit and replay the graph."""


def bounds_from_counts(name: tuple, table: list[list[int]], limits: list[list[int]]) -> list[list[int]]:
    """Bounds for a graphed call without ``bounds=``, from its exchanged count ``table`` (a row per
    rank, a column per piece): the bounds last derived under ``name`` while every count fits and
    none is loose (over twice its count plus 64), else new ones above the counts
    (:data:`BOUND_HEADROOM`), each at most its piece's size (``limits``: per row, the sizes of the
    pieces it may hold; the rest bound 0). Kept under ``name`` until :func:`clear_graphs`, so that
    the next calls reuse them, and their graph. Every rank exchanged the same table and passes the
    same rank-uniform ``name``, so all derive the same bounds."""
    with _lock:
        last = _bounds.get(name)
    if last is not None and all(c <= b <= 2 * c + 64 for row, bound in zip(table, last) for c, b in zip(row, bound)):
        return last
    bounds = [
        [min(n, math.ceil(c * BOUND_HEADROOM + 4 * math.sqrt(c)) + 16) for c, n in zip(row, lim)]
        + [0] * (len(row) - len(lim))
        for row, lim in zip(table, limits)
    ]
    with _lock:
        if len(_bounds) >= _MAX_SEEN:
            _bounds.clear()
        _bounds[name] = bounds
    return bounds


def _local(inp: torch.Tensor, out: torch.Tensor, extra: torch.Tensor | None) -> _Local:
    return _Local(
        inp=inp.data_ptr(),
        out=out.data_ptr(),
        out_dtype=out.dtype,
        device=inp.device.index,
        stream=torch.cuda.current_stream(inp.device).cuda_stream,
        extra=0 if extra is None else extra.data_ptr(),
    )


def run_graphed(
    key: tuple,
    inp: torch.Tensor,
    out: torch.Tensor,
    run: Callable[[], tuple[Any, torch.cuda.Event | None]],
    extra: torch.Tensor | None = None,
) -> tuple:
    """``run()``'s ``(stats, event)``, eagerly, captured or replayed as the key's history says.

    ``stats`` must be a :class:`~.stats.CollectiveStats` (fields ``graph``, ``_statuses``, ``_timer``);
    ``run`` checks the arguments (an eager call raises on bad ones before anything is recorded).
    ``extra``: one more tensor the call reads, whose address a replay must match too.
    """
    if torch.cuda.is_current_stream_capturing():
        return run()  # the caller's own capture records the eager call
    with _lock:
        entry = _graphs.get(key)
        if entry is not None:
            local = _local(inp, out, extra)
            if local != entry.local:
                raise ValueError(
                    f"cuda_graphs: this {key[0]} was captured with other tensors or on another stream "
                    f"(captured {entry.local}, now {local}); a replayed call must pass the same tensors on the "
                    "same stream: give calls on different tensors different graph_tag values, or call "
                    "spccl_train.collectives.clear_graphs() on every rank"
                )
            return _replay(entry, inp.device)
        if len(_graphs) >= MAX_GRAPHS:
            return run()
        if key not in _seen:
            result = run()  # first sighting: eager (checks arguments, connects NCCL peers, warms kernels)
            if len(_seen) >= _MAX_SEEN:
                _seen.clear()
            _seen.add(key)
            return result
        return _capture(key, inp, out, run, extra)


def _replay(entry: _Entry, device: torch.device) -> tuple:
    timer = Span(device)
    entry.graph.replay()
    statuses = entry.statuses.clone()  # the next replay overwrites the graph's own
    event = timer.stop()
    return dataclasses.replace(entry.stats, _statuses=statuses, _timer=timer), event


def _capture(
    key: tuple,
    inp: torch.Tensor,
    out: torch.Tensor,
    run: Callable[[], tuple[Any, torch.cuda.Event | None]],
    extra: torch.Tensor | None,
) -> tuple:
    device = inp.device
    local = _local(inp, out, extra)
    current = torch.cuda.current_stream(device)
    streams = getattr(_threads, "streams", None)
    if streams is None:
        streams = _threads.streams = {}
    side = streams.get(device.index)
    if side is None:
        side = streams[device.index] = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)  # once per key: nothing of earlier calls is in flight during the capture
    old = _named.pop(key[:3], None)
    if old is not None:  # the tag's previous graph (other sizes or bounds) is done with: drop it, alike on every rank
        del _graphs[old]
    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                stats, _ = run()
            finally:
                graph.capture_end()
    except Exception as exc:
        try:
            graph.pool()  # the capture ended: the graph owns its pool and frees it with itself
        except RuntimeError:
            _release_pool(device, pool)
        raise RuntimeError(
            f"cuda_graphs: could not capture this {key[0]} in a CUDA graph ({type(exc).__name__}: {exc}); "
            "the other ranks may be waiting in theirs. Run without CollectiveConfig(cuda_graphs=True) "
            "(trainer key spccl.collective.cuda_graphs=false)"
        ) from exc
    current.wait_stream(side)
    _named[key[:3]] = key
    entry = _graphs[key] = _Entry(
        graph=graph, local=local, stats=dataclasses.replace(stats, graph="replayed"), statuses=stats._statuses
    )
    stats, event = _replay(entry, device)
    return dataclasses.replace(stats, graph="captured"), event


def _release_pool(device: torch.device, pool: tuple) -> None:
    """Take the allocator out of a capture that ``capture_end`` did not finish, and free its pool."""
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        release = getattr(torch._C, name, None)
        if release is None:
            continue
        try:
            release(device.index, pool)
        except RuntimeError:  # capture_end got that far already
            pass


def cached_graphs() -> int:
    """Graphs held now (each keeps its scratch memory)."""
    return len(_graphs)


def clear_graphs(synchronize: bool = True) -> None:
    """Drop every cached graph and what the cache remembers; call it on every rank alike.

    With ``synchronize`` (the default) it first waits for the device, so no dropped graph's
    memory goes back to the allocator while the graph runs; pass ``False`` on an error path,
    where a stuck collective would make the wait endless (then it also gives up, leaving the
    cache as it is, if another thread holds the cache for more than 5 seconds).
    """
    if not _lock.acquire(timeout=-1 if synchronize else 5.0):
        return
    try:
        if synchronize and _graphs and torch.cuda.is_available():
            torch.cuda.synchronize()
        _graphs.clear()
        _named.clear()
        _seen.clear()
        _bounds.clear()
    finally:
        _lock.release()


@contextlib.contextmanager
def clearing_graphs() -> Iterator[None]:
    """Run a block, then :func:`clear_graphs`: waiting for the device after a clean exit, not
    after an exception (a stuck collective would make the wait endless). Wrap the work that
    must end before ``destroy_process_group``."""
    finished = False
    try:
        yield
        finished = True
    finally:
        clear_graphs(synchronize=finished)
