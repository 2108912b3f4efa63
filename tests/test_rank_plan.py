"""Per-rank planning and the summary ``auto`` weighs, against the reference planners and cost model.

Every rank plans only its own messages (:mod:`spccl_train.collectives.rank_plan`) and ``auto``
weighs candidates from O(world) summaries (:mod:`spccl_train.collectives.summary`). The reference
planners (every rank's messages) and ``CostModel.predict`` (a plan's time) are the oracles.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spccl_train.collectives import ChunkLayout, CostModel, Thresholds, Topology
from spccl_train.collectives.exchange import Counts
from spccl_train.collectives.plan import (
    bound_reduced_counts,
    estimate_reduced_counts,
    plan_all_gather,
    plan_reduce_scatter,
)
from spccl_train.collectives.rank_plan import plan_all_gather_for, plan_reduce_scatter_for
from spccl_train.collectives.summary import CountSummary, predict
from spccl_train.formats import TILE, Format

COLLECTIVES = ["all_gather", "reduce_scatter", "all_reduce"]


def _digest(m) -> str:
    return hashlib.sha256(repr(tuple(m)).encode()).hexdigest()[:16]


@st.composite
def _calls(draw):
    world = draw(st.integers(1, 9))
    channels = draw(st.integers(1, 3))
    collective = draw(st.sampled_from(COLLECTIVES))
    per_rank = draw(st.sampled_from([1, 16, 33, 4096, 3 * TILE + 7]))
    if collective != "all_reduce":
        per_rank -= per_rank % 1  # any length: equal chunks of it
    layout = ChunkLayout.of(collective, world * per_rank, world, channels)
    rpn = draw(st.none() | st.integers(1, 4))
    sizes = [span.numel for chunk in layout.pieces for span in chunk]
    if collective == "all_gather":
        sizes = [[span.numel for span in layout.pieces[q]] + [0] * (len(sizes) - channels) for q in range(world)]
    else:
        sizes = [sizes] * world
    density = draw(st.floats(0, 1))
    table = [[draw(st.sampled_from([0, n, round(n * density)]) | st.integers(0, n)) for n in row] for row in sizes]
    fmt = draw(st.sampled_from([Format.PICI, Format.COO, Format.DENSE]))
    algorithm = draw(st.sampled_from(["ring", "direct"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return collective, layout, Topology(world, rpn), table, fmt, algorithm, dtype


def _plans(collective, layout, topology, table, fmt, algorithm, dtype):
    th = Thresholds().resolve(Format.PICI if fmt is Format.DENSE else fmt)
    p, ch = layout.world, layout.channels
    if collective == "all_gather":
        own = [row[:ch] for row in table]
        reference = plan_all_gather(
            own, layout, dtype, fmt=fmt, algorithm=algorithm, threshold=th.ag, topology=topology
        )
        mine = [
            plan_all_gather_for(r, own, layout, dtype, fmt=fmt, algorithm=algorithm, threshold=th.ag, topology=topology)
            for r in range(p)
        ]
        return reference, mine
    kw = dict(fmt=fmt, algorithm=algorithm, thresholds=th, topology=topology, collective=collective)
    reference = plan_reduce_scatter(table, layout, dtype, **kw)
    mine = [plan_reduce_scatter_for(r, np.array(table), layout, dtype, **kw) for r in range(p)]
    return reference, mine


@settings(deadline=None, max_examples=150)
@given(call=_calls())
def test_each_rank_plans_its_own_messages_as_the_reference_does(call):
    """Field for field (sparsity floats included), every message a rank plans is the reference's,
    and it plans every reference message it sends or receives, in the reference's order."""
    reference, mine = _plans(*call)
    for rank, plan in enumerate(mine):
        assert plan.rank == rank and len(plan.steps) == len(reference.steps)
        for want, got in zip(reference.steps, plan.steps):
            assert [m for m in want.messages if rank in (m.src, m.dst)] == list(got.messages)
            assert (want.route, want.slot_bytes, want.wave_bytes) == (got.route, got.slot_bytes, got.wave_bytes)
        assert plan.bytes_sent() == reference.bytes_sent(rank)
        assert plan.dense_bytes() == reference.dense_bytes(rank)


@settings(deadline=None, max_examples=150)
@given(call=_calls())
def test_ranks_agree_on_every_message_they_share(call):
    """Each message is in the plans of its sender and its receiver, planned apart, and hashes alike in both."""
    _, mine = _plans(*call)
    views: dict[tuple, dict[int, str]] = {}
    for rank, plan in enumerate(mine):
        for step in plan.steps:
            for m in step.messages:
                key = (step.phase, step.index, m.src, m.dst, m.chunk, m.piece)
                views.setdefault(key, {})[rank] = _digest(m)
    for (_, _, src, dst, _, _), seen in views.items():
        assert set(seen) == {src, dst} and len(set(seen.values())) == 1


def test_a_rank_plan_answers_for_its_rank_only():
    layout = ChunkLayout.equal(4 * TILE, 4)
    plan = plan_all_gather_for(
        1, [[10]] * 4, layout, torch.float32, fmt=Format.PICI, algorithm="direct", threshold=0.1, topology=Topology(4)
    )
    assert plan.bytes_sent() == plan.bytes_sent(1) > 0
    with pytest.raises(ValueError, match="rank 1's messages only, not rank 2's"):
        plan.bytes_sent(2)
    assert "(rank 1)" in plan.describe()


@settings(deadline=None, max_examples=100)
@given(call=_calls())
def test_summary_holds_the_tables_sums(call):
    collective, layout, topology, table, *_ = call
    s = CountSummary.of(collective, table, layout, topology)
    p, ch = layout.world, layout.channels
    if collective == "all_gather":
        assert s.bound.tolist() == [row[:ch] for row in table]
        return
    sent, received = np.zeros((2, p), np.int64), np.zeros((2, p), np.int64)
    for q in range(p):
        for c in range(p):
            if c != q:
                nnz = sum(table[q][c * ch : (c + 1) * ch])
                sent[int(topology.is_inter(q, c)), q] += nnz
                received[int(topology.is_inter(q, c)), c] += nnz
    assert s.sent.tolist() == sent.tolist() and s.received.tolist() == received.tolist()
    assert s.bound.tolist() == bound_reduced_counts(table, layout)
    if collective == "all_reduce":  # what the gather phase is sized from
        assert Counts.from_table(collective, table, layout, 0).reduced_bounds().tolist() == s.bound.tolist()
    assert s.estimate.tolist() == estimate_reduced_counts(table, layout)
    assert s.held.tolist() == [sum(row) for row in table]


def _uniform(layout: ChunkLayout, density: float) -> list[list[int]]:
    return [[round(density * span.numel) for chunk in layout.pieces for span in chunk]] * layout.world


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
@pytest.mark.parametrize("fmt", [Format.PICI, Format.COO, Format.DENSE])
@pytest.mark.parametrize("world, rpn, channels", [(2, None, 1), (4, 2, 2), (6, 3, 1), (8, 1, 3), (5, 2, 2)])
@pytest.mark.parametrize("density", [0.001, 0.03, 0.25])  # away from the thresholds (COO inter: 0.7)
@pytest.mark.parametrize("per_rank", [16 * TILE, 5 * TILE + 7])
def test_summary_predictions_equal_the_plans_on_equal_pieces(
    collective, algorithm, fmt, world, rpn, channels, density, per_rank
):
    """Where every rank holds each piece equally densely, the mean field is exact: the summary's
    time equals the reference plan's (up to each direct message's 16-byte alignment). Where the
    pieces differ in size (a chunk not a multiple of ``channels`` tiles) it is within 10% above it."""
    layout = ChunkLayout.of(collective, world * per_rank, world, channels)
    table = _uniform(layout, density)
    topology = Topology(world, rpn)
    th = Thresholds().resolve(Format.PICI if fmt is Format.DENSE else fmt)
    for model in (CostModel.default("cpu"), CostModel.default("cuda")):
        summary = CountSummary.of(collective, table, layout, topology)
        if collective == "all_gather":
            own = [row[:channels] for row in table]
            plans = {
                "": plan_all_gather(
                    own, layout, torch.float32, fmt=fmt, algorithm=algorithm, threshold=th.ag, topology=topology
                )
            }
        else:
            kw = dict(fmt=fmt, algorithm=algorithm, thresholds=th, topology=topology, collective=collective)
            rs = plan_reduce_scatter(table, layout, torch.float32, **kw)
            plans = {"": rs}
            if collective == "all_reduce":
                plans = {}
                for mode, reduced in (
                    ("bound", bound_reduced_counts(table, layout)),
                    ("measured", estimate_reduced_counts(table, layout)),
                ):
                    ahead = plan_all_gather(
                        reduced,
                        layout,
                        torch.float32,
                        fmt=fmt,
                        algorithm=algorithm,
                        threshold=th.ag,
                        topology=topology,
                        measured=False,
                    )
                    plans[mode] = rs.then(ahead)
        for mode, plan in plans.items():
            want = model.predict(plan, 1 + (mode == "measured"))
            got = predict(model, summary, torch.float32, algorithm, fmt, th, 1, mode)
            if per_rank % (channels * TILE) == 0:  # equal pieces
                assert got.seconds == pytest.approx(want, rel=1e-3), (mode, model.exchange_s)
            else:  # the ring priced at its largest piece, each direct message at its rank's mean size
                assert want * (1 - 1e-3) <= got.seconds <= want * 1.1, (mode, got.seconds, want)
            assert got.sparse == any(m.sparse for m in plan.messages())


@settings(deadline=None, max_examples=60)
@given(
    collective=st.sampled_from(COLLECTIVES),
    algorithm=st.sampled_from(["ring", "direct"]),
    world=st.integers(2, 8),
    rpn=st.none() | st.integers(1, 4),
    density=st.sampled_from([0.001, 0.01, 0.05, 0.25]),
    seed=st.integers(0, 2**31),
)
def test_summary_predictions_track_the_plans_on_iid_counts(collective, algorithm, world, rpn, density, seed):
    """Binomial counts (i.i.d. supports), densities away from the thresholds: within 15% of the
    reference (the summary prices the densest chunk of a ring, and each rank's mean message)."""
    layout = ChunkLayout.of(collective, world * 32 * TILE, world, 2)
    rng = np.random.default_rng(seed)
    sizes = [span.numel for chunk in layout.pieces for span in chunk]
    table = [[int(rng.binomial(n, density)) for n in sizes] for _ in range(world)]
    topology = Topology(world, rpn)
    th = Thresholds().resolve(Format.PICI)
    model = CostModel.default("cuda")
    summary = CountSummary.of(collective, table, layout, topology)
    if collective == "all_gather":
        plan = plan_all_gather(
            [row[:2] for row in table],
            layout,
            torch.float32,
            fmt=Format.PICI,
            algorithm=algorithm,
            threshold=th.ag,
            topology=topology,
        )
    else:
        kw = dict(fmt=Format.PICI, algorithm=algorithm, thresholds=th, topology=topology, collective=collective)
        plan = plan_reduce_scatter(table, layout, torch.float32, **kw)
        if collective == "all_reduce":
            ahead = plan_all_gather(
                bound_reduced_counts(table, layout),
                layout,
                torch.float32,
                fmt=Format.PICI,
                algorithm=algorithm,
                threshold=th.ag,
                topology=topology,
                measured=False,
            )
            plan = plan.then(ahead)
    want = model.predict(plan)
    got = predict(
        model, summary, torch.float32, algorithm, Format.PICI, th, 1, "bound" if collective == "all_reduce" else ""
    )
    assert math.isclose(got.seconds, want, rel_tol=0.15), (got.seconds, want)
