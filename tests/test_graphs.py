"""The CUDA-graph cache of ``CollectiveConfig.cuda_graphs`` on CPU, with torch.cuda's graph API faked.

What runs for real on the GPU machine is ``tests/test_collectives_cuda.py::test_bounded_calls_replay_cuda_graphs``;
here the decisions are checked: eager first, captured second, replayed after; keys without
addresses, so every rank decides alike; a replay with other tensors, and a failed capture, raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random

import pytest
import torch

from spccl_train.collectives import graphs


@dataclasses.dataclass
class _Stats:
    graph: str
    _statuses: torch.Tensor
    _timer: object


class _FakeGraph:
    fail_capture = False
    made: list[_FakeGraph] = []

    def __init__(self) -> None:
        self.replays = 0
        self.pool_id = None
        _FakeGraph.made.append(self)

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        assert capture_error_mode == "thread_local"  # the NCCL watchdog queries events meanwhile
        self.pool_id = pool

    def capture_end(self) -> None:
        if _FakeGraph.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.ended = True

    def pool(self):
        if not getattr(self, "ended", False):
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture")
        return self.pool_id

    def replay(self) -> None:
        self.replays += 1


class _Stream:
    def __init__(self, handle: int = 7) -> None:
        self.cuda_stream = handle

    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"capturing": False, "stream": _Stream(), "released": []}
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["stream"])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream(99))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", len(_FakeGraph.made)))
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(torch._C, name, lambda device, pool, name=name: state["released"].append(name))
    monkeypatch.setattr(graphs, "Span", lambda device: _Span())
    _FakeGraph.made, _FakeGraph.fail_capture = [], False
    graphs.clear_graphs()
    yield state
    graphs.clear_graphs()


class _Span:
    """A stand-in for ``_timing.Span`` (no CUDA events on CPU)."""

    def stop(self) -> None:
        return None


def _call(key, inp, out, runs: list, fail: bool = False):
    """run_graphed with a run() that records each eager or captured execution (and may raise)."""

    def run():
        runs.append(key)
        if fail:
            raise TypeError("not capturable")
        return _Stats(graph="", _statuses=torch.zeros(2, dtype=torch.int32), _timer=None), None

    return graphs.run_graphed(key, inp, out, run)[0]


def _key(x, tag=None, bounds=((3, 3), (3, 3))):
    return graphs.graph_key("all_reduce", "group", x, x, "cfg", bounds, tag)


def test_eager_then_captured_then_replayed(fake_cuda):
    x, runs = torch.zeros(8), []
    modes = [_call(_key(x), x, x, runs).graph for _ in range(4)]
    assert modes == ["", "captured", "replayed", "replayed"]
    assert len(runs) == 2, "run() executes for the eager call and inside the capture, never for replays"
    (graph,) = _FakeGraph.made
    assert graph.replays == 3  # the captured call replays at once, then two more
    assert graphs.cached_graphs() == 1


def test_each_replay_gets_its_own_status_copy(fake_cuda):
    x, runs = torch.zeros(8), []
    stats = [_call(_key(x), x, x, runs) for _ in range(4)]
    assert stats[2]._statuses is not stats[3]._statuses
    assert all(s._statuses.data_ptr() != stats[1]._statuses.data_ptr() for s in stats[2:])


def test_keys_hold_no_address_so_ranks_agree(fake_cuda):
    a, b = torch.zeros(8), torch.zeros(8)
    assert _key(a) == _key(b)  # rank-uniform: two ranks' tensors give one key
    assert _key(a, tag=1) != _key(a, tag=2) and _key(a) != _key(a, bounds=((3, 2), (3, 3)))


def test_a_replay_with_other_tensors_or_stream_raises(fake_cuda):
    x, y, runs = torch.zeros(8), torch.zeros(8), []
    for _ in range(2):
        _call(_key(x), x, x, runs)
    with pytest.raises(ValueError, match="captured with other tensors .* different graph_tag"):
        _call(_key(y), y, y, runs)
    fake_cuda["stream"] = _Stream(8)
    with pytest.raises(ValueError, match="on another stream"):
        _call(_key(x), x, x, runs)
    fake_cuda["stream"] = _Stream()
    assert [_call(_key(y, tag="b"), y, y, runs).graph for _ in range(2)] == ["", "captured"]


def test_a_failed_capture_raises_and_frees_its_pool(fake_cuda):
    x, runs = torch.zeros(8), []
    _call(_key(x), x, x, runs)
    _FakeGraph.fail_capture = True
    with pytest.raises(RuntimeError, match="could not capture this all_reduce .* spccl.collective.cuda_graphs=false"):
        _call(_key(x), x, x, runs)
    assert fake_cuda["released"] == ["_cuda_endAllocateToPool", "_cuda_releasePool"]
    assert graphs.cached_graphs() == 0


def test_an_error_inside_a_finished_capture_leaves_the_pool_to_its_graph(fake_cuda):
    # capture_end succeeded, so the graph frees its pool itself: releasing it here too would free it twice
    x, runs = torch.zeros(8), []
    _call(_key(x), x, x, runs)
    with pytest.raises(RuntimeError, match="could not capture .*TypeError: not capturable"):
        _call(_key(x), x, x, runs, fail=True)
    assert fake_cuda["released"] == []


def test_a_tag_keeps_one_graph(fake_cuda):
    x, runs = torch.zeros(8), []
    narrow = ((3, 3), (3, 3))
    wide = ((5, 5), (5, 5))
    assert [_call(_key(x, "b", narrow), x, x, runs).graph for _ in range(2)] == ["", "captured"]
    assert [_call(_key(x, "b", wide), x, x, runs).graph for _ in range(3)] == ["", "captured", "replayed"]
    assert graphs.cached_graphs() == 1  # the narrow graph went when the wide one was captured
    assert _call(_key(x, "b", narrow), x, x, runs).graph == "captured"  # seen before: captured again


def test_rows_shared_by_every_rank_are_read_once(fake_cuda):
    x = torch.zeros(8)
    row = [3, 4]
    shared = graphs.graph_key("all_reduce", "g", x, x, "cfg", [row] * 4, None)
    assert shared[-1] == ("rows", 4, (3, 4))
    assert graphs.graph_key("all_reduce", "g", x, x, "cfg", [row] * 4, None) == shared
    assert graphs.graph_key("all_reduce", "g", x, x, "cfg", [[3, 4], [3, 5]], None)[-1] == ((3, 4), (3, 5))


def test_inside_a_callers_capture_every_call_runs_as_is(fake_cuda):
    x, runs = torch.zeros(8), []
    fake_cuda["capturing"] = True
    assert [_call(_key(x), x, x, runs).graph for _ in range(3)] == ["", "", ""]
    assert len(runs) == 3 and not _FakeGraph.made


def test_full_cache_and_clearing(fake_cuda, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 1)
    x, y, runs = torch.zeros(8), torch.zeros(4), []
    assert [_call(_key(x), x, x, runs).graph for _ in range(3)] == ["", "captured", "replayed"]
    assert [_call(_key(y), y, y, runs).graph for _ in range(3)] == ["", "", ""]  # full: eager
    graphs.clear_graphs()
    assert [_call(_key(y), y, y, runs).graph for _ in range(2)] == ["", "captured"]


def test_clearing_graphs_waits_only_after_a_clean_exit(fake_cuda, monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    x, runs = torch.zeros(8), []
    for ok in (True, False):
        waits.clear()
        with contextlib.suppress(KeyError), graphs.clearing_graphs():
            for _ in range(2):
                _call(_key(x), x, x, runs)
            waits.clear()  # the capture's own wait
            if not ok:
                raise KeyError("a failed step")
        assert graphs.cached_graphs() == 0 and waits == ([None] if ok else [])


def test_bounds_from_counts_hold_while_the_counts_fit_and_stay_tight():
    graphs.clear_graphs()
    seed = int(os.environ.get("SPCCL_TEST_SEED", random.SystemRandom().randrange(2**31)))
    counts = torch.randint(0, 5000, (4, 6), generator=torch.Generator().manual_seed(seed)).tolist()
    limits = [[6000] * 6] * 4
    name = ("all_reduce", "group", None, 24_000, 24_000, torch.float32, "cfg")
    first = graphs.bounds_from_counts(name, counts, limits)
    for row, bound in zip(counts, first):
        for c, b in zip(row, bound):  # above the count by the headroom and four deviations
            assert b == math.ceil(c * graphs.BOUND_HEADROOM + 4 * math.sqrt(c)) + 16, f"SPCCL_TEST_SEED={seed}"
    # counts that still fit (none loose): the same bounds, so the same graph key
    assert graphs.bounds_from_counts(name, [[max(0, c - 1) for c in row] for row in counts], limits) is first
    # a count above its bound: new bounds
    grown = [row[:] for row in counts]
    grown[2][3] = first[2][3] + 1
    assert graphs.bounds_from_counts(name, grown, limits) != first, f"SPCCL_TEST_SEED={seed}"
    graphs.clear_graphs()
    assert graphs.bounds_from_counts(name, counts, limits) is not first  # forgotten with the graphs


def test_bounds_from_counts_are_loose_past_twice_the_count_plus_64():
    graphs.clear_graphs()
    name, limits = ("all_reduce",), [[10_000]]
    first = graphs.bounds_from_counts(name, [[1000]], limits)
    b = first[0][0]  # ceil(1000 * 1.0625 + 4 sqrt(1000)) + 16
    assert b == 1205
    tightest = math.ceil((b - 64) / 2)  # the lowest count the bound still serves: b <= 2c + 64
    assert graphs.bounds_from_counts(name, [[tightest]], limits) is first
    assert graphs.bounds_from_counts(name, [[b]], limits) is first  # a count equal to its bound fits
    assert graphs.bounds_from_counts(name, [[tightest - 1]], limits) != first  # loose: new, tighter ones
    assert graphs.bounds_from_counts(name, [[0]], limits) == [[16]]


def test_bounds_from_counts_cap_at_the_pieces_a_row_may_hold():
    graphs.clear_graphs()
    table = [[10_000, 3, 0], [7, 10_000, 0]]
    limits = [[100], [100, 5_000]]  # an all-gather: row q holds only its own pieces
    assert graphs.bounds_from_counts(("all_gather",), table, limits) == [[100, 0, 0], [35, 5_000, 0]]
