"""The cost model and the ``auto`` choice, without processes: hand-computed predictions and the
rule that ``auto`` never picks what it predicts slower than dense."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from _stopped import Stopped
from hypothesis import given, settings
from hypothesis import strategies as st

from spccl_train.collectives import ChunkLayout, CollectiveConfig, CostModel, Thresholds, Topology, choose, hierarchical
from spccl_train.collectives.choice import (
    NATIVE_MARGIN,
    TRIAL_MARGIN,
    clear_decisions,
    decide,
    plan_candidate,
    priced,
    weigh,
    weigh_batch,
)
from spccl_train.collectives.config import DEFAULT_THRESHOLDS
from spccl_train.collectives.cost import CodecCost, LinkCost
from spccl_train.collectives.exchange import Counts
from spccl_train.collectives.plan import (
    bound_reduced_counts,
    estimate_reduced_counts,
    plan_all_gather,
    plan_reduce_scatter,
)
from spccl_train.collectives.rank_plan import plan_all_gather_for
from spccl_train.collectives.summary import (
    CountSummary,
    _levels,
    _round,
    _sparse_cap,
    count_levels,
    predict,
    round_count,
)
from spccl_train.formats import TILE, Format, align16, pici_bytes

F32 = torch.float32


def _model(**over) -> CostModel:
    """Round figures that make hand computation easy."""
    fields = {
        "intra": LinkCost(latency_s=1e-5, bandwidth=1e9),
        "inter": LinkCost(latency_s=2e-5, bandwidth=1e8),
        "pici": CodecCost(compress=1e10, decompress=2e10, accumulate=1e10, call_s=1e-6),
        "coo": CodecCost(compress=5e9, decompress=1e10, accumulate=5e9, call_s=1e-6),
        "reduce": 1e10,
        "copy": 2e10,
        "count": 1e10,
        "exchange_s": 1e-4,
    }
    fields.update(over)
    return CostModel(**fields)


def _table(layout: ChunkLayout, density: float) -> list[list[int]]:
    return [[round(density * p.numel) for chunk in layout.pieces for p in chunk] for _ in range(layout.world)]


def test_link_cost_is_hockney():
    link = LinkCost(latency_s=2e-6, bandwidth=25e9)
    assert link.seconds(0) == 2e-6
    assert math.isclose(link.seconds(25_000_000), 2e-6 + 1e-3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LinkCost(latency_s=-1.0, bandwidth=1.0), "latency_s=-1.0"),
        (lambda: LinkCost(latency_s=0.0, bandwidth=0.0), "bandwidth=0.0"),
        (lambda: LinkCost(latency_s=0.0, bandwidth=float("nan")), "bandwidth=nan"),
        (lambda: CodecCost(compress=float("inf"), decompress=1, accumulate=1, call_s=0), "compress=inf"),
        (lambda: _model(reduce=True), "reduce=True"),
    ],
)
def test_bad_figures_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_native_predictions_by_hand():
    m = _model()
    topo = Topology(4)
    n = 4_000_000  # 16 MB fp32: 4 MB chunks
    hop = 1e-5 + 4e6 / 1e9
    # the exchange, and the count pass over what the rank holds (the all-gather input is a chunk)
    plan_ag, plan_all = 1e-4 + 4e6 / 1e10, 1e-4 + 16e6 / 1e10
    assert math.isclose(m.predict_native("all_gather", n, F32, topo), plan_ag + 3 * hop)
    assert math.isclose(m.predict_native("reduce_scatter", n, F32, topo), plan_all + 3 * (hop + 4e6 / 1e10))
    assert math.isclose(m.predict_native("all_reduce", n, F32, topo), plan_all + 3 * (hop + 4e6 / 1e10) + 3 * hop)
    # two nodes: the ring runs at the network's speed
    slow = 2e-5 + 4e6 / 1e8
    assert math.isclose(m.predict_native("all_gather", n, F32, Topology(4, 2)), plan_ag + 3 * slow)
    assert math.isclose(m.predict_native("all_reduce", n, F32, Topology(1)), plan_all)


def test_planning_terms():
    m = _model()
    assert m.planning("all_reduce", 4000, F32, 4, exchanges=0) == 0.0
    assert math.isclose(m.planning("all_reduce", 4000, F32, 4), 1e-4 + 16000 / 1e10)
    # an all-reduce's second exchange counts its reduced chunk
    assert math.isclose(m.planning("all_reduce", 4000, F32, 4, exchanges=2), 2e-4 + (16000 + 4000) / 1e10)
    assert math.isclose(m.planning("all_gather", 4000, torch.bfloat16, 4), 1e-4 + 2000 / 1e10)


def test_ring_all_gather_prediction_by_hand():
    # 2 ranks, one Pici piece each way: encode, wire, decode; nothing else
    m = _model()
    layout = ChunkLayout.equal(2 * TILE, 2)
    plan = plan_all_gather([[40], [40]], layout, F32, fmt="pici", algorithm="ring", threshold=0.1, topology=Topology(2))
    size = pici_bytes(TILE, 40, F32)
    dense = 4 * TILE
    expected = 1e-4 + dense / 1e10 + (1e-5 + size / 1e9) + (1e-6 + dense / 1e10) + (1e-6 + dense / 2e10)
    assert math.isclose(m.predict(plan), expected)


def test_ring_reduce_scatter_prediction_by_hand():
    # 3 ranks, dense: every step each rank sends one chunk and adds one
    m = _model()
    layout = ChunkLayout.equal(3 * 1000, 3)
    plan = plan_reduce_scatter(
        [[1000] * 3] * 3,
        layout,
        F32,
        fmt="pici",
        algorithm="ring",
        thresholds=Thresholds().resolve("pici"),
        topology=Topology(3),
    )
    assert plan.format_counts() == {Format.DENSE: 6}
    step = 1e-5 + 4000 / 1e9 + 4000 / 1e10
    assert math.isclose(m.predict(plan, exchanges=0), 2 * step)


def test_direct_prediction_by_hand():
    # direct all-gather of 2 ranks, padded route: encode once, one slot each way, decode
    m = _model()
    layout = ChunkLayout.equal(2 * TILE, 2)
    plan = plan_all_gather(
        [[40], [40]], layout, F32, fmt="pici", algorithm="direct", threshold=0.1, topology=Topology(2)
    )
    slot = align16(pici_bytes(TILE, 40, F32))
    assert plan.steps[0].slot_bytes == slot
    count = 4 * TILE / 1e10
    expected = 1e-4 + count + (1e-6 + 4 * TILE / 1e10) + slot / 1e9 + 1e-5 + (1e-6 + 4 * TILE / 2e10)
    assert math.isclose(m.predict(plan), expected)


def test_defaults_per_device():
    cpu, cuda = CostModel.default("cpu"), CostModel.default(torch.device("cuda"))
    assert cuda.intra.bandwidth > cpu.intra.bandwidth and cuda.pici.compress > cpu.pici.compress
    assert cpu.fingerprint() != cuda.fingerprint()
    assert CostModel.default("cpu").fingerprint() == cpu.fingerprint()


def _choose(collective, cfg, layout, table, model, rpn=None):
    return choose(collective, cfg, table, layout, F32, Topology(layout.world, rpn), model)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_auto_stays_dense_on_dense_data(collective):
    layout = (
        ChunkLayout.equal(4 * 64 * TILE, 4) if collective != "all_reduce" else ChunkLayout.aligned(4 * 64 * TILE, 4)
    )
    best, weighed = _choose(collective, CollectiveConfig(), layout, _table(layout, 1.0), _model())
    assert best.algorithm == "native"
    assert set(weighed) == {"native/dense", "ring/pici", "direct/pici", "ring/coo", "direct/coo"}
    assert weighed["native/dense"] == min(weighed.values())


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_auto_goes_sparse_on_sparse_data_over_slow_links(collective):
    layout = (
        ChunkLayout.equal(4 * 64 * TILE, 4) if collective != "all_reduce" else ChunkLayout.aligned(4 * 64 * TILE, 4)
    )
    best, weighed = _choose(collective, CollectiveConfig(), layout, _table(layout, 0.001), _model(), rpn=2)
    assert best.algorithm in ("ring", "direct") and best.format in (Format.PICI, Format.COO)
    assert best.predicted_s == min(weighed.values()) < weighed["native/dense"]
    counts = Counts.from_table(collective, _table(layout, 0.001), layout, 0)
    plan = plan_candidate(best, collective, CollectiveConfig(), counts, layout, F32, Topology(4, 2), 0)
    assert plan is not None and plan.bytes_sent() < plan.dense_bytes() / 10


def test_fast_codecs_needed_to_leave_dense():
    # the same sparse data, with codecs so slow that compression never pays
    layout = ChunkLayout.aligned(4 * 64 * TILE, 4)
    slow = CodecCost(compress=1e6, decompress=1e6, accumulate=1e6, call_s=1e-3)
    best, _ = _choose("all_reduce", CollectiveConfig(), layout, _table(layout, 0.001), _model(pici=slow, coo=slow))
    assert best.algorithm == "native"


def test_candidates_follow_the_config():
    layout = ChunkLayout.aligned(4 * TILE, 4)
    table = _table(layout, 0.01)
    model = _model()
    _, weighed = _choose("all_reduce", CollectiveConfig(format="pici"), layout, table, model)
    assert set(weighed) == {"ring/pici", "direct/pici"}  # a fixed format never falls back to native
    _, weighed = _choose("all_reduce", CollectiveConfig(format="coo", algorithm="ring"), layout, table, model)
    assert set(weighed) == {"ring/coo"}
    best, weighed = _choose("all_reduce", CollectiveConfig(format="dense"), layout, table, model)
    assert set(weighed) == {"native/dense"} and best.algorithm == "native"
    best, weighed = _choose("all_reduce", CollectiveConfig(format="dense", algorithm="direct"), layout, table, model)
    counts = Counts.from_table("all_reduce", table, layout, 1)
    plan = plan_candidate(best, "all_reduce", CollectiveConfig(format="dense"), counts, layout, F32, Topology(4), 1)
    assert set(weighed) == {"direct/dense"} and plan.format_counts() == {Format.DENSE: 6}  # 3 sent, 3 received
    _, weighed = _choose("all_gather", CollectiveConfig(algorithm="ring"), layout, table, model)
    assert set(weighed) == {"native/dense", "ring/pici", "ring/coo"}


def test_ties_go_to_dense():
    # nothing to send and no latency: every candidate costs its exchange alone
    instant = LinkCost(latency_s=0.0, bandwidth=1e9)
    model = _model(intra=instant, inter=instant)
    best, weighed = _choose("all_gather", CollectiveConfig(), ChunkLayout.equal(0, 2), [[0], [0]], model)
    assert best.algorithm == "native" and len(set(weighed.values())) == 1


def test_all_reduce_looks_ahead_at_its_gather_phase():
    layout = ChunkLayout.aligned(4 * 16 * TILE, 4)
    table = _table(layout, 0.01)
    model = _model()
    rs = plan_reduce_scatter(
        table, layout, F32, fmt="pici", algorithm="ring", thresholds=Thresholds().resolve("pici"), topology=Topology(4)
    )
    predicted = {}
    for mode, reduced, exchanges in (
        ("measured", estimate_reduced_counts(table, layout), 2),
        ("bound", bound_reduced_counts(table, layout), 1),
    ):
        ahead = plan_all_gather(
            reduced, layout, F32, fmt="pici", algorithm="ring", threshold=0.1, topology=Topology(4), measured=False
        )
        assert not any(m.nnz_exact for m in ahead.messages())
        predicted[mode] = model.predict(rs.then(ahead), exchanges=exchanges)
        cfg = CollectiveConfig(format="pici", algorithm="ring", gather_counts=mode)
        best, _ = _choose("all_reduce", cfg, layout, table, model)
        assert math.isclose(best.predicted_s, predicted[mode]) and best.gather_counts == mode
    best, _ = _choose("all_reduce", CollectiveConfig(format="pici", algorithm="ring"), layout, table, model)
    assert best.predicted_s == min(predicted.values())
    assert best.gather_counts == ("bound" if predicted["bound"] <= predicted["measured"] else "measured")


def test_bound_wins_when_exchanges_are_dear_and_measuring_when_padding_is():
    layout = ChunkLayout.aligned(4 * 64 * TILE, 4)
    # identical supports at 90%: the bound (4 x 10%) pads every gathered payload about 3x
    n = layout.numel // 4
    table = [[n // 10] * 4 for _ in range(4)]
    cfg = CollectiveConfig(format="pici", algorithm="direct")
    slow_link = LinkCost(latency_s=0.0, bandwidth=1e6)
    best, _ = _choose("all_reduce", cfg, layout, table, _model(intra=slow_link, exchange_s=0.0))
    assert best.gather_counts == "measured"
    best, _ = _choose("all_reduce", cfg, layout, table, _model(exchange_s=10.0))
    assert best.gather_counts == "bound"


def test_decide_rounds_the_summary_and_agrees_with_weigh_on_it():
    layout = ChunkLayout.aligned(4 * 16 * TILE, 4)
    table = _table(layout, 0.013)
    model = _model()
    cfg = CollectiveConfig()
    summary = CountSummary.of("all_reduce", table, layout, Topology(4))
    rounded = summary.rounded(16)
    for x, y in zip(rounded.bound.ravel().tolist(), summary.bound.ravel().tolist()):
        assert abs(math.log2(x / y)) <= 1 / 32 + 1e-9
    clear_decisions()
    first, weighed = decide(cfg, "k", summary, F32, model)
    best, expected = weigh(rounded, cfg, F32, model)
    assert (first, weighed) == (best, expected)
    nearby = [[x + 1 for x in row] for row in table]  # same rounded profile: the memo answers
    near = CountSummary.of("all_reduce", nearby, layout, Topology(4))
    assert priced(cfg, "k", near, F32, model) is priced(cfg, "k", summary, F32, model)
    assert decide(cfg, "k", near, F32, model) == (first, weighed)


def _round_one(x: int, n: int) -> int:
    """The rounding :meth:`CountSummary.rounded` documents, one count at a time."""
    if x <= 0 or x >= n:
        return min(x, n)
    j = round(-math.log2(x / n) * 16)
    return min(n - 1, max(1, round(n * 2.0 ** (-j / 16))))


@settings(deadline=None, max_examples=80)
@given(sizes=st.lists(st.integers(1, 3_000_000), min_size=1, max_size=150), data=st.data())
def test_rounding_rounds_each_count_as_documented(sizes, data):
    """The integer-exact rounding (in Python for a few counts, vectorised for more) equals the
    one-count formula (empty, full, tiny, near-full and arbitrary counts)."""
    counts = [data.draw(st.sampled_from([0, n, n + 1, min(n, 3), max(0, n - 2)]) | st.integers(0, n)) for n in sizes]
    got = _round(np.array(counts), np.array(sizes), 16).tolist()
    assert got == [_round_one(x, n) for x, n in zip(counts, sizes)]


def _levels_exactly(n: int, steps: int) -> tuple[list[int], list[int]]:
    """_levels in integers alone: the largest f with f**(2 steps) 2**(2k + 1) <= n**(2 steps), and
    the nearest integer to n 2**(-j/steps) (halves to even), by bisection."""

    def floor_root(a: int, b: int) -> int:  # the largest f with f**b 2**a <= n**b
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if (mid**b) << a <= n**b else (lo, mid - 1)
        return lo

    top = steps * n.bit_length() + 2
    floors = [floor_root(2 * k + 1, 2 * steps) for k in range(top)]
    levels = []
    for j in range(top + 1):
        f = floor_root(j, steps)
        twice, half = (2 * n) ** steps, ((2 * f + 1) ** steps) << j
        levels.append(min(n - 1, max(1, f + 1 if twice > half else f if twice < half else f + f % 2)))
    return floors[::-1], levels


@settings(deadline=None, max_examples=30)
@given(
    n=st.sampled_from([2, 3, 5, 6, 7, 12, 48, 96, 4096, 1 << 20]) | st.integers(2, 1 << 34),
    steps=st.sampled_from([1, 2, 16]),
)
def test_the_rounding_levels_are_exact_integers(n, steps):
    """The levels every rank rounds to come out of integer comparisons where a float could land
    either side (halves, exact powers of two), so no machine's pow can move them."""
    floors, levels = _levels(n, steps)
    assert (floors.tolist(), levels.tolist()) == _levels_exactly(n, steps)


@settings(deadline=None, max_examples=40)
@given(sizes=st.lists(st.integers(0, 1 << 30), min_size=1, max_size=20), data=st.data())
def test_one_count_rounds_as_the_arrays_and_onto_its_levels(sizes, data):
    """``round_count`` (the hierarchical steps' grid) rounds as :func:`_round`, and only to
    :func:`count_levels`, which hold every value it can return."""
    for n in sizes:
        x = data.draw(st.sampled_from([0, n, n + 7, min(n, 1), max(0, n - 1)]) | st.integers(0, n))
        assert round_count(x, n) == _round(np.array([x]), np.array([n]), 16)[0] == _round_one(x, n)
        levels = count_levels(n)
        assert round_count(x, n) in levels and levels == sorted(set(levels)) and levels[0] == 0 and levels[-1] == n
        if n <= 4096:  # whatever the count
            assert {round_count(y, n) for y in range(n + 1)} <= set(levels)


@settings(deadline=None, max_examples=40)
@given(
    collective=st.sampled_from(["all_gather", "reduce_scatter", "all_reduce"]),
    world=st.integers(2, 9),
    rpn=st.none() | st.integers(1, 4),
    channels=st.integers(1, 2),
    fmt=st.sampled_from(["auto", "pici", "coo", "dense"]),
    data=st.data(),
)
def test_a_batch_of_summaries_weighs_as_each_alone(collective, world, rpn, channels, fmt, data):
    """``weigh_batch`` (the hierarchical steps' curves) gives each table of a batch what ``weigh``
    gives it alone, bit for bit: the same candidate and every prediction (tables of any counts)."""
    n = data.draw(st.integers(0, 40 * TILE))
    n = n if collective == "all_reduce" else n - n % world  # an all-gather's or reduce-scatter's equal chunks
    layout = ChunkLayout.of(collective, n, world, channels)
    sizes = [p.numel for chunk in layout.pieces for p in chunk]
    batch = data.draw(st.integers(1, 5))
    tables = np.array(
        [[[data.draw(st.integers(0, size)) for size in sizes] for _ in range(world)] for _ in range(batch)],
        dtype=np.int64,
    )
    topology, model = Topology(world, rpn), CostModel.default("cuda")
    cfg = CollectiveConfig(
        format=fmt, algorithm="auto" if fmt != "dense" else data.draw(st.sampled_from(["auto", "direct"]))
    )
    rounds = data.draw(st.integers(1, 3))
    got = weigh_batch(
        CountSummary.of(collective, tables, layout, topology, batch=True), cfg, F32, model, rounds=rounds, rings=False
    )
    for table, each in zip(tables, got):
        alone = weigh(CountSummary.of(collective, table, layout, topology), cfg, F32, model, rounds=rounds, rings=False)
        assert each == alone


@given(
    most=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    size=st.sampled_from([2, 4]),
    coo=st.booleans(),
    data=st.data(),
)
def test_a_sparse_cap_is_the_tests_it_replaces(most, size, coo, data):
    """The weighings test ``count <= cap``; the cap holds the bits of the sparsity and payload
    tests it replaces (a float sparsity over a threshold, a payload under the dense bytes) at
    every count from 0 to the size: exhaustively, on random sizes, thresholds and headers."""
    n = np.array(most, dtype=np.int64)
    tau = np.array([data.draw(st.floats(0.0, 0.999)) for _ in most])
    base = np.array([data.draw(st.integers(0, 64)) for _ in most], dtype=np.int64)
    limit = np.where(np.array([data.draw(st.booleans()) for _ in most]), n * size, -1)

    def sparse(x):
        payload = base + x * size + (4 * ((x + 3) & ~3) if coo else 0)
        return (1.0 - x / np.maximum(n, 1) > tau) & (payload < limit)

    cap = _sparse_cap(sparse, n)
    for x in range(int(n.max()) + 2):
        counts = np.minimum(x, n)
        assert ((counts <= cap) == sparse(counts)).all()


def test_a_batch_of_one_rank_and_a_table_as_cubes():
    """A one-rank layout's batch is the planning alone for each table; a single table may come as
    a ``(world, world, channels)`` cube, as before batches (it is a batch only when asked)."""
    one = ChunkLayout.of("all_reduce", 2 * TILE, 1)
    got = weigh_batch(
        CountSummary.of("all_reduce", np.zeros((3, 1, 1)), one, Topology(1), batch=True),
        CollectiveConfig(),
        F32,
        _model(),
        rings=False,
    )
    alone = weigh(
        CountSummary.of("all_reduce", np.zeros((1, 1)), one, Topology(1)),
        CollectiveConfig(),
        F32,
        _model(),
        rings=False,
    )
    assert got == [alone] * 3
    layout = ChunkLayout.of("all_reduce", 8 * TILE, 4, 2)
    flat = _table(layout, 0.01)
    cube = np.array(flat).reshape(4, 4, 2)
    for collective in ("all_reduce", "all_gather"):
        assert weigh(
            CountSummary.of(collective, cube, layout, Topology(4)), CollectiveConfig(), F32, _model()
        ) == weigh(CountSummary.of(collective, flat, layout, Topology(4)), CollectiveConfig(), F32, _model())


def test_a_batch_refuses_rings():
    layout = ChunkLayout.of("all_reduce", 4 * TILE, 4)
    tables = np.zeros((2, 4, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="a ring is weighed one summary at a time"):
        weigh_batch(
            CountSummary.of("all_reduce", tables, layout, Topology(4), batch=True), CollectiveConfig(), F32, _model()
        )


@settings(deadline=None, max_examples=60)
@given(
    collective=st.sampled_from(["all_gather", "reduce_scatter", "all_reduce"]),
    world=st.integers(2, 6),
    density=st.floats(0, 1),
    bandwidth=st.floats(1e6, 1e12),
    codec=st.floats(1e6, 1e12),
    rpn=st.none() | st.integers(1, 3),
    tiles=st.integers(1, 8),
)
def test_auto_never_predicts_slower_than_dense(collective, world, density, bandwidth, codec, rpn, tiles):
    n = world * tiles * TILE
    layout = ChunkLayout.aligned(n, world) if collective == "all_reduce" else ChunkLayout.equal(n, world)
    rates = CodecCost(compress=codec, decompress=codec, accumulate=codec, call_s=1e-6)
    model = _model(intra=LinkCost(latency_s=1e-6, bandwidth=bandwidth), pici=rates, coo=rates)
    best, weighed = _choose(collective, CollectiveConfig(), layout, _table(layout, density), model, rpn)
    native = weighed["native/dense"]
    assert best.predicted_s <= native
    # the cheapest wins, unless only plans that send nothing sparse, or that save less than the
    # margin, undercut native (they never win)
    assert math.isclose(best.predicted_s, min(weighed.values()), rel_tol=1e-9) or best.algorithm == "native"
    if best.algorithm != "native":
        # (a hierarchical candidate is weighed only where one of its steps sends sparsely)
        if best.algorithm != "hierarchical":
            assert _sends_sparse(best, collective, _table(layout, density), layout, Topology(world, rpn))
        assert best.predicted_s < (1 - NATIVE_MARGIN) * native


def _sends_sparse(best, collective, table, layout, topology) -> bool:
    """Whether any rank's plan of ``best`` (an all-reduce: both phases) sends a sparse message."""
    th = CollectiveConfig().thresholds.resolve(best.format)
    for rank in range(layout.world):
        counts = Counts.from_table(collective, table, layout, rank)
        plan = plan_candidate(best, collective, CollectiveConfig(), counts, layout, F32, topology, rank)
        if collective == "all_reduce":
            reduced = (
                Counts.from_table(collective, table, layout, rank).reduced_bounds()
                if best.gather_counts == "bound"
                else estimate_reduced_counts(table, layout)
            )
            plan = plan.then(
                plan_all_gather_for(
                    rank,
                    reduced,
                    layout,
                    F32,
                    fmt=best.format,
                    algorithm=best.algorithm,
                    threshold=th.ag,
                    topology=topology,
                )
            )
        if any(m.sparse for m in plan.messages()):
            return True
    return False


def test_near_ties_stay_native():
    # the sparse plan's prediction rises past native's with the density: native keeps the call
    # until sparse is predicted NATIVE_MARGIN faster
    layout = ChunkLayout.equal(4 * 16 * TILE, 4)
    cfg = CollectiveConfig(algorithm="direct")
    ratios = []
    for density in [i / 100 for i in range(1, 101)]:
        best, weighed = _choose("all_gather", cfg, layout, _table(layout, density), _model())
        # candidates whose plan sends something sparse (the others never win): a gather message
        # is sparse when its sparsity is above the format's all-gather threshold
        sparse = [f"direct/{f.value}" for f, th in DEFAULT_THRESHOLDS.items() if 1 - density > th.ag]
        if not sparse:
            assert best.algorithm == "native"
            continue
        ratio = min(weighed[name] for name in sparse) / weighed["native/dense"]
        ratios.append(ratio)
        assert (best.algorithm == "native") == (ratio >= 1 - NATIVE_MARGIN), (density, ratio)
    assert min(ratios) < 1 - NATIVE_MARGIN and any(1 - NATIVE_MARGIN < r < 1 for r in ratios), ratios


def test_plans_that_send_nothing_sparse_never_beat_native():
    # dense data: the sparse candidates' plans are all dense; make their model cost lower anyway
    layout = ChunkLayout.equal(4 * 4 * TILE, 4)
    model = _model(exchange_s=0.0, step_s=0.0, inter=LinkCost(latency_s=1.0, bandwidth=1e6))
    best, weighed = _choose("all_gather", CollectiveConfig(), layout, _table(layout, 1.0), model, rpn=1)
    assert best.algorithm == "native"
    assert min(weighed.values()) <= weighed["native/dense"]


def test_replayed_calls_shed_host_costs_and_go_sparse_sooner():
    """A call replayed from a CUDA graph pays no host launch costs, so auto leaves dense at smaller sizes.

    64 MiB fp32 at 99% on the CUDA defaults: eager, the fixed costs (codec calls, plan steps)
    keep it native; replayed, direct Pici wins (measured on 4 H200s: 0.195 ms against NCCL's 0.324).
    """
    cuda = CostModel.default("cuda")
    fast = cuda.replayed()
    assert fast.pici.call_s == fast.coo.call_s == fast.step_s == 5e-6
    assert (fast.intra, fast.inter, fast.pici.compress) == (cuda.intra, cuda.inter, cuda.pici.compress)
    assert _model(step_s=1e-6).replayed().step_s == 1e-6  # never dearer than the eager figures
    layout = ChunkLayout.aligned(1 << 24, 4)
    table = _table(layout, 0.012)
    cfg = CollectiveConfig(gather_counts="bound")
    eager, _ = _choose("all_reduce", cfg, layout, table, cuda)
    replayed, weighed = choose("all_reduce", cfg, table, layout, F32, Topology(4), fast, exchanges=0)
    assert eager.algorithm == "native"
    assert replayed.name == "direct/pici" and replayed.predicted_s < weighed["native/dense"]


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_calls_planned_from_bounds_are_priced_without_planning(collective):
    layout = (
        ChunkLayout.aligned(4 * 64 * TILE, 4) if collective == "all_reduce" else ChunkLayout.equal(4 * 64 * TILE, 4)
    )
    table, model = _table(layout, 0.01), _model()
    cfg = CollectiveConfig(gather_counts="bound")
    _, planned = choose(collective, cfg, table, layout, F32, Topology(4), model)
    _, bounded = choose(collective, cfg, table, layout, F32, Topology(4), model, exchanges=0)
    saved = model.planning(collective, layout.numel, F32, 4)
    assert saved > 0 and planned.keys() == bounded.keys()
    for name in planned:
        assert bounded[name] == pytest.approx(planned[name] - saved), name
    clear_decisions()  # decide keeps the two apart
    summary = CountSummary.of(collective, table, layout, Topology(4))
    a = decide(cfg, "k", summary, F32, model, 1)[1]
    b = decide(cfg, "k", summary, F32, model, 0)[1]
    assert a.keys() == b.keys() and all(b[name] == pytest.approx(a[name] - saved) for name in a)


def test_direct_steps_pay_one_latency_per_wave_and_rings_one_per_step():
    """An exchange posts to every peer at once: 4 ranks on 4 nodes, one wave, pay one latency, not
    three; a ring all-gather pays one per step (p - 1)."""
    layout = ChunkLayout.equal(4 * 64 * TILE, 4)
    table = _table(layout, 0.01)
    slow, instant = LinkCost(latency_s=1.0, bandwidth=1e9), LinkCost(latency_s=0.0, bandwidth=1e9)
    cfg = CollectiveConfig(format="pici")
    _, late = _choose("all_gather", cfg, layout, table, _model(inter=slow), rpn=1)
    _, prompt = _choose("all_gather", cfg, layout, table, _model(inter=instant), rpn=1)
    assert math.isclose(late["direct/pici"] - prompt["direct/pici"], 1.0)
    assert math.isclose(late["ring/pici"] - prompt["ring/pici"], 3.0)


def test_collective_bandwidth_prices_direct_and_native_but_not_ring():
    layout = ChunkLayout.equal(4 * 64 * TILE, 4)
    table = _table(layout, 0.05)
    plain = LinkCost(latency_s=0.0, bandwidth=1e8)
    grouped = LinkCost(latency_s=0.0, bandwidth=1e8, collective_bandwidth=1e9)
    assert grouped.grouped_bandwidth == 1e9 and plain.grouped_bandwidth == 1e8
    cfg = CollectiveConfig(format="pici")
    _, base = _choose("all_gather", cfg, layout, table, _model(inter=plain), rpn=1)
    _, fast = _choose("all_gather", cfg, layout, table, _model(inter=grouped), rpn=1)
    assert fast["ring/pici"] == base["ring/pici"]
    assert fast["direct/pici"] < base["direct/pici"]
    native = [
        m.predict_native("all_gather", layout.numel, F32, Topology(4, 1))
        for m in (_model(inter=plain), _model(inter=grouped))
    ]
    assert native[1] < native[0]
    with pytest.raises(ValueError, match="collective_bandwidth=0"):
        LinkCost(latency_s=0.0, bandwidth=1.0, collective_bandwidth=0)


@settings(deadline=None, max_examples=80)
@given(
    collective=st.sampled_from(["all_gather", "reduce_scatter", "all_reduce"]),
    world=st.integers(2, 8),
    rpn=st.none() | st.integers(1, 4),
    density=st.floats(0, 1),
    tiles=st.integers(1, 8),
    device=st.sampled_from(["cpu", "cuda"]),
)
def test_least_sparse_is_below_every_sparse_prediction(collective, world, rpn, density, tiles, device):
    """The bound behind native calls without an exchange (``check_calls="first"``): no candidate
    that sends anything sparse (the others never win), flat or hierarchical, of any data is
    predicted below it."""
    n = world * tiles * TILE
    layout = ChunkLayout.aligned(n, world) if collective == "all_reduce" else ChunkLayout.equal(n, world)
    model = CostModel.default(device)
    topology = Topology(world, rpn)
    summary = CountSummary.of(collective, _table(layout, density), layout, topology)
    least = model.least_sparse(collective, n, F32, topology)
    assert least > model.planning(collective, n, F32, world)
    modes = ("bound", "measured") if collective == "all_reduce" else ("",)
    for fmt, algorithm, mode in itertools.product((Format.PICI, Format.COO), ("ring", "direct"), modes):
        got = predict(model, summary, F32, algorithm, fmt, Thresholds().resolve(fmt), 1, mode)
        assert not got.sparse or got.seconds >= least, (fmt, algorithm, mode, got, least)
    if collective == "all_reduce" and hierarchical.applies(topology):
        seconds, sparse = hierarchical.predict(CollectiveConfig(), summary, F32, model, weigh_batch)
        assert not sparse or seconds + model.planning(collective, n, F32, world) >= least


def test_a_near_tie_keeps_the_candidate_the_group_ran_last():
    """``prefer``: the group's last sparse candidate keeps winning within STICKY_MARGIN of the best,
    the native call included, and loses to one predicted clearly faster; native is never held on to."""
    from spccl_train.collectives.choice import STICKY_MARGIN

    layout = ChunkLayout.aligned(4 * 16 * TILE, 4)
    summary = CountSummary.of("all_reduce", _table(layout, 0.013), layout, Topology(4))
    cfg = CollectiveConfig(format="pici")
    best, weighed = weigh(summary, cfg, F32, _model())
    sparse = {name: t for name, t in weighed.items() if name not in ("native/dense", best.name)}
    assert best.algorithm != "native" and sparse, weighed
    other, t = min(sparse.items(), key=lambda kv: kv[1])
    ratio = best.predicted_s / t  # scales the other's prediction to the best's
    near = {other: ratio * (1 + 0.5 * STICKY_MARGIN)}  # just inside the margin: the last one stays
    far = {other: ratio * (1 + 2 * STICKY_MARGIN)}  # outside it: the best wins
    assert weigh(summary, cfg, F32, _model(), factors=near, prefer=other)[0].name == other
    assert weigh(summary, cfg, F32, _model(), factors=near)[0].name == best.name  # nothing preferred
    assert weigh(summary, cfg, F32, _model(), factors=far, prefer=other)[0].name == best.name
    assert weigh(summary, cfg, F32, _model(), prefer="native/dense")[0].name == best.name
    # the native call too replaces the last sparse candidate only when clearly faster
    auto = CollectiveConfig()
    best, weighed = weigh(summary, auto, F32, _model())
    assert best.algorithm != "native", weighed
    to_best = best.predicted_s / weighed["native/dense"]  # scales native's prediction to the best's
    near = {"native/dense": to_best * (1 - 0.5 * STICKY_MARGIN)}  # native a little faster
    far = {"native/dense": to_best * (1 - 2 * STICKY_MARGIN)}  # native clearly faster
    assert weigh(summary, auto, F32, _model(), factors=near)[0].algorithm == "native"  # nothing preferred
    assert weigh(summary, auto, F32, _model(), factors=near, prefer=best.name)[0].name == best.name
    assert weigh(summary, auto, F32, _model(), factors=far, prefer=best.name)[0].algorithm == "native"


def test_the_group_remembers_what_it_ran_by_collective_size_and_config():
    from spccl_train._timing import Span
    from spccl_train.collectives.feedback import Corrections

    c = Corrections()
    assert c.last_run("all_reduce", 1 << 30) is None
    c.called("all_reduce", "ring/pici", 1 << 30, 0.01, Span(torch.device("cpu")))
    assert c.last_run("all_reduce", 1 << 30) == "ring/pici"
    assert c.last_run("all_reduce", 1 << 26) is None and c.last_run("all_gather", 1 << 30) is None
    # per config: what a fixed config ran is not the preference of auto's calls (and the reverse)
    c.called("all_reduce", "direct/coo", 1 << 30, 0.01, Span(torch.device("cpu")), torch.float32, "coo direct")
    c.called("all_reduce", "direct/pici", 1 << 30, 0.01, Span(torch.device("cpu")), torch.float32, "auto auto")
    c.called("all_reduce", "direct/coo", 1 << 30, 0.01, Span(torch.device("cpu")), torch.float32, "coo direct")
    assert c.last_run("all_reduce", 1 << 30, torch.float32, "auto auto") == "direct/pici"
    assert c.last_run("all_reduce", 1 << 30, torch.float32, "coo direct") == "direct/coo"


def _standing_trials(standing_of) -> dict[int, int]:
    """Calls of one size class alternating between two densities whose winners differ, weighed as
    the collectives weigh them (preference, trials, the standing choice from ``standing_of(c,
    prefer, octave)``), each taking what it was priced: the far trials of the other density's
    winner, by octave."""
    from spccl_train.collectives import feedback

    layout = ChunkLayout.aligned(4 * 64 * TILE, 4)
    # fast COO: direct/Pici wins at 20% (COO 1.7x its price), direct/COO at 0.2% (Pici 2.3x)
    model = _model(coo=CodecCost(compress=1e11, decompress=1e11, accumulate=1e11, call_s=1e-6))
    cfg, nbytes = CollectiveConfig(), layout.numel * 4
    summaries = [CountSummary.of("all_reduce", _table(layout, d), layout, Topology(4)) for d in (0.2, 0.002)]
    winners = [weigh(s, cfg, F32, model)[0].name for s in summaries]
    assert winners == ["direct/pici", "direct/coo"], winners  # else nothing stands far behind
    c, far = feedback.Corrections(), {}
    for call in range(12 * feedback.REFRESH_CALLS):
        summary = summaries[call % 2]
        octave, prefer = summary.octave, c.last_run("all_reduce", nbytes, F32, "auto")
        tried = c.tried("all_reduce", nbytes, F32, octave)
        got, predictions = weigh(
            summary, cfg, F32, model, prefer=prefer, tried=tried, standing=standing_of(c, prefer, octave)
        )
        if got.trial and got.predicted_s > (1 + TRIAL_MARGIN) * min(predictions.values()):
            far[octave] = far.get(octave, 0) + 1
        c.called(
            "all_reduce", got.name, nbytes, got.predicted_s, Stopped(got.predicted_s), F32, "auto", octave, got.trial
        )
        c.learn([c.report()])
    return far


def test_the_standing_choice_is_tried_once_per_density_not_every_refresh():
    """The collectives' rule (``standing``: the preference where it never ran at the octave) tries
    the other density's winner there TRIAL_RUNS times (one more for its kind's warm-up) in all;
    trying it wherever it is not among the recently tried would bring the far trial back every
    REFRESH_CALLS calls."""
    from spccl_train.collectives.feedback import TRIAL_RUNS

    def collectives_rule(c, prefer, octave):
        return prefer if prefer not in c.ran_at("all_reduce", 4 * 4 * 64 * TILE, F32, octave) else None

    def refreshed(c, prefer, octave):
        return prefer if prefer not in c.tried("all_reduce", 4 * 4 * 64 * TILE, F32, octave) else None

    once = _standing_trials(collectives_rule)
    assert once and all(n <= TRIAL_RUNS + 1 for n in once.values()), once
    again = _standing_trials(refreshed)
    assert sum(again.values()) > sum(once.values()) + 2, (once, again)


def test_where_calls_hold_native_the_native_call_is_priced_without_an_exchange():
    """``check_calls="first"`` (auto holds native choices): native is priced with no exchange and
    none of the exchange's further rounds, every sparse candidate with both; checking every call,
    native pays them too."""
    layout = ChunkLayout.aligned(4 * 16 * TILE, 4)
    topology = Topology(4)
    summary = CountSummary.of("all_reduce", _table(layout, 0.01), layout, topology)
    model, rounds = _model(), 3
    _, every = weigh(summary, CollectiveConfig(), F32, model, rounds=rounds)
    _, first = weigh(summary, CollectiveConfig(check_calls="first"), F32, model, rounds=rounds)
    extra = (rounds - 1) * model.exchange_s
    assert every["native/dense"] == pytest.approx(
        model.predict_native("all_reduce", layout.numel, F32, topology) + extra
    )
    assert first["native/dense"] == pytest.approx(model.predict_native("all_reduce", layout.numel, F32, topology, 0))
    assert first["native/dense"] < every["native/dense"] - extra
    assert {n: t for n, t in first.items() if n != "native/dense"} == {
        n: t for n, t in every.items() if n != "native/dense"
    }


def test_a_near_tied_candidate_not_yet_tried_at_this_density_is_run_instead():
    """``tried``: a sparse candidate within TRIAL_MARGIN of the choice and not among the tried runs
    instead (a trial); tried, or beyond the margin, it does not; native is tried and left for a
    trial alike; the trial does not change the predictions reported."""
    import random

    from spccl_train.collectives.choice import NATIVE_MARGIN, TRIAL_MARGIN

    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    layout = ChunkLayout.aligned(4 * 16 * TILE, 4)
    summary = CountSummary.of("all_reduce", _table(layout, rng.uniform(0.005, 0.05)), layout, Topology(4))
    cfg = CollectiveConfig(format="pici")
    best, weighed = weigh(summary, cfg, F32, _model())
    assert best.algorithm != "native" and not best.trial, weighed
    others = {name: t for name, t in weighed.items() if name not in ("native/dense", best.name)}
    other, t = min(others.items(), key=lambda kv: kv[1])
    ratio = best.predicted_s / t  # scales the other's prediction to the best's
    inside = {other: ratio * (1 + rng.uniform(0.05, 0.95) * TRIAL_MARGIN)}
    outside = {other: ratio * (1 + rng.uniform(1.05, 3.0) * TRIAL_MARGIN)}
    got, predictions = weigh(summary, cfg, F32, _model(), factors=inside, tried=frozenset())
    assert got.name == other and got.trial, (seed, got, predictions)
    assert predictions == weigh(summary, cfg, F32, _model(), factors=inside)[1]
    assert got.predicted_s == pytest.approx(predictions[other])
    assert weigh(summary, cfg, F32, _model(), factors=inside)[0] == best  # no trials asked for
    assert weigh(summary, cfg, F32, _model(), factors=inside, tried=frozenset({other}))[0] == best
    assert weigh(summary, cfg, F32, _model(), factors=outside, tried=frozenset())[0] == best
    # the standing choice (the candidate the group ran last, never run at this density) is tried
    # however far it is priced, until it has been; as a preference alone it is not
    got = weigh(summary, cfg, F32, _model(), factors=outside, tried=frozenset(), prefer=other, standing=other)[0]
    assert got.name == other and got.trial, (seed, got)
    assert weigh(summary, cfg, F32, _model(), factors=outside, tried=frozenset(), prefer=other)[0] == best
    got = weigh(summary, cfg, F32, _model(), factors=outside, tried=frozenset({other}), prefer=other, standing=other)
    assert got[0] == best
    assert weigh(summary, cfg, F32, _model(), factors=outside, prefer=other, standing=other)[0] == best  # no trials
    # the best untried itself: the near one is still tried first (each of them gets its runs)
    assert weigh(summary, cfg, F32, _model(), factors=inside, tried=frozenset({best.name}))[0].name == other
    # native: tried, and left for a trial, as a sparse candidate is
    auto = CollectiveConfig()
    best, raw = weigh(summary, auto, F32, _model())
    assert best.algorithm != "native", raw
    sparse = sorted(n for n in raw if n != "native/dense")
    b, o = best.name, next(n for n in sparse if n != best.name)

    def shaped(native_over_best: float) -> dict[str, float]:  # best at P, o at 1.1 P, the rest far
        p = raw[b]
        factors = {n: 3 * p / raw[n] for n in sparse}
        factors |= {b: 1.0, o: 1.1 * p / raw[o], "native/dense": native_over_best * p / raw["native/dense"]}
        return factors

    native_best = shaped(1 - 0.5 * NATIVE_MARGIN)  # native a little faster than b: kept by its margin
    assert weigh(summary, auto, F32, _model(), factors=native_best)[0].algorithm == "native"
    got = weigh(summary, auto, F32, _model(), factors=native_best, tried=frozenset())[0]
    assert got.name == b and got.trial, (seed, got)  # b, within the margin of native, is tried
    got = weigh(summary, auto, F32, _model(), factors=native_best, tried=frozenset({b}))[0]
    assert got.name == o and got.trial, (seed, got)  # then o (1.1 P)
    got = weigh(summary, auto, F32, _model(), factors=native_best, tried=frozenset({b, o}))[0]
    assert got.algorithm == "native" and not got.trial, (seed, got)
    far = shaped(1 / (1 + 1.5 * TRIAL_MARGIN))  # native well ahead: nothing near to try
    got = weigh(summary, auto, F32, _model(), factors=far, tried=frozenset())[0]
    assert got.algorithm == "native" and not got.trial, (seed, got)
    got = weigh(summary, auto, F32, _model(), factors=far, tried=frozenset({b}), prefer=o, standing=o)[0]
    assert got.name == o and got.trial, (seed, got)  # a standing sparse choice far behind native: tried
    wide_native = shaped(1 + 1.5 * TRIAL_MARGIN)  # native far behind b: a standing native call is not tried
    native = "native/dense"
    got = weigh(summary, auto, F32, _model(), factors=wide_native, tried=frozenset({o}), standing=native)[0]
    assert got.name == b and not got.trial, (seed, got)
    narrow = shaped(1 / 0.85)  # b beats native (1.18 P) by 15%; o (1.1 P) and native are near b
    got = weigh(summary, auto, F32, _model(), factors=narrow, tried=frozenset())[0]
    assert got.name == o and got.trial, (seed, got)  # the nearer first
    got = weigh(summary, auto, F32, _model(), factors=narrow, tried=frozenset({o}))[0]
    assert got.algorithm == "native" and got.trial, (seed, got)
    got = weigh(summary, auto, F32, _model(), factors=narrow, tried=frozenset({o, "native/dense"}))[0]
    assert got.name == b and not got.trial, (seed, got)
    wide = shaped(1 + 1.5 * TRIAL_MARGIN)  # native well behind b, o tried already: nothing left to try
    got = weigh(summary, auto, F32, _model(), factors=wide, tried=frozenset({o}))[0]
    assert got.name == b and not got.trial, (seed, got)
    # decide memoises under the tried candidates too
    clear_decisions()
    half = {other: ratio * (1 + 0.5 * TRIAL_MARGIN)}
    assert decide(cfg, "k", summary, F32, _model(), 1, half, tried=frozenset())[0].trial
    assert not decide(cfg, "k", summary, F32, _model(), 1, half, tried=frozenset({other}))[0].trial
