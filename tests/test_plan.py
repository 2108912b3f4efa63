"""The planner without processes: chunk layouts, per-piece counts, and every message of a plan.

Counts are made by hand (worked examples whose formats are written out) or drawn by hypothesis
(invariants every plan must keep). Multi-process runs check the same rules against real data in
``test_collectives.py``.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spccl_train.collectives import ChunkLayout, Phase, Route, Span, Thresholds, Topology
from spccl_train.collectives.chunking import SMALL_UNIT, count_nonzero_pieces, split_span, unit_for
from spccl_train.collectives.plan import (
    PADDED_GATHER_SLACK,
    choose_format,
    estimate_reduced_counts,
    plan_all_gather,
    plan_reduce_scatter,
    sparsity,
)
from spccl_train.formats import COO_HEADER_BYTES, TILE, Format, align16, coo_bytes, message_bytes, pici_bytes

PICI = Thresholds().resolve("pici")
COO = Thresholds().resolve("coo")
F32 = torch.float32


def _counts_for(layout: ChunkLayout, density: list[float]) -> list[list[int]]:
    """Rank q holds round(density[q] * n) nonzeros in every piece."""
    return [
        [round(density[q] * piece.numel) for chunk in layout.pieces for piece in chunk] for q in range(layout.world)
    ]


def _rs(counts, layout, fmt="pici", algorithm="ring", th=PICI, rpn=None, dtype=F32):
    return plan_reduce_scatter(
        counts, layout, dtype, fmt=fmt, algorithm=algorithm, thresholds=th, topology=Topology(layout.world, rpn)
    )


def _ag(counts, layout, fmt="pici", algorithm="ring", threshold=PICI.ag, rpn=None, dtype=F32):
    return plan_all_gather(
        counts, layout, dtype, fmt=fmt, algorithm=algorithm, threshold=threshold, topology=Topology(layout.world, rpn)
    )


# ----------------------------------------------------------------------------- chunking


def test_equal_layout_is_torchs_cut():
    layout = ChunkLayout.equal(3 * 5000, 3, channels=2)
    assert layout.chunks == (Span(0, 5000), Span(5000, 5000), Span(10000, 5000))
    # 5000 < 2 tiles: pieces are cut in 16-element units from the chunk start
    assert layout.pieces[1] == (Span(5000, 2512), Span(7512, 2488))
    with pytest.raises(ValueError, match="not a multiple"):
        ChunkLayout.equal(10, 3)


def test_aligned_layout_worked_example():
    # 5 tiles + 100 elements = 6 units over 4 ranks: 2, 2, 1, 1 units; the partial tile ends chunk 3
    n = 5 * TILE + 100
    layout = ChunkLayout.aligned(n, 4)
    assert layout.chunks == (Span(0, 2 * TILE), Span(2 * TILE, 2 * TILE), Span(4 * TILE, TILE), Span(5 * TILE, 100))
    # fewer than world tiles: 16-element units, trailing chunks empty
    assert ChunkLayout.aligned(40, 4).chunks == (Span(0, 16), Span(16, 16), Span(32, 8), Span(40, 0))
    assert ChunkLayout.aligned(0, 3).chunks == (Span(0, 0),) * 3


def test_each_collective_cuts_its_own_way():
    n = 4 * (3 * TILE + 77)
    assert ChunkLayout.of("all_reduce", n, 4, 2) == ChunkLayout.aligned(n, 4, 2)
    assert ChunkLayout.of("reduce_scatter", n, 4, 2) == ChunkLayout.equal(n, 4, 2)
    assert ChunkLayout.of("all_gather", n, 4) == ChunkLayout.equal(n, 4)
    with pytest.raises(ValueError, match="collective='broadcast'"):
        ChunkLayout.of("broadcast", n, 4)


@settings(deadline=None, max_examples=200)
@given(n=st.integers(0, 40 * TILE), world=st.integers(1, 9), channels=st.integers(1, 5))
def test_aligned_layout_invariants(n, world, channels):
    layout = ChunkLayout.aligned(n, world, channels)
    unit = unit_for(n, world)
    position = 0
    for c, chunk in enumerate(layout.chunks):
        assert chunk.start == position
        assert chunk.start % unit == 0 or chunk.numel == 0
        position = chunk.stop
        piece_unit = unit_for(chunk.numel, channels)
        inner = chunk.start
        for piece in layout.pieces[c]:
            assert piece.start == inner
            assert (piece.start - chunk.start) % piece_unit == 0 or piece.numel == 0
            inner = piece.stop
        assert inner == chunk.stop
        assert len(layout.pieces[c]) == channels
    assert position == n
    full = [c.numel for c in layout.chunks if c.stop < n]
    if full:  # chunks before the one holding the end differ by at most one unit
        assert max(full) - min(full) <= unit
    # every Pici tile of a tile-aligned layout lies in one chunk
    if unit == TILE:
        assert all(c.start % TILE == 0 for c in layout.chunks)


@settings(deadline=None, max_examples=100)
@given(numel=st.integers(0, 10 * TILE), parts=st.integers(1, 7), start=st.integers(0, 100))
def test_split_span_deals_units_evenly(numel, parts, start):
    pieces = split_span(Span(start, numel), parts)
    unit = unit_for(numel, parts)
    assert unit in (TILE, SMALL_UNIT)
    assert sum(p.numel for p in pieces) == numel
    assert all(p.start == q.stop for q, p in itertools.pairwise(pieces))
    # units are dealt first-come: counts never grow along the parts and differ by at most one
    units = [math.ceil(p.numel / unit) for p in pieces]
    assert units == sorted(units, reverse=True) and max(units) - min(units) <= 1
    assert all(p.numel % unit == 0 for p in pieces if p.stop < start + numel)


@settings(deadline=None, max_examples=60)
@given(
    world=st.integers(1, 5),
    channels=st.integers(1, 4),
    m=st.integers(0, 3 * TILE),
    aligned=st.booleans(),
    seed=st.integers(0, 2**31),
    density=st.floats(0, 1),
)
def test_count_nonzero_pieces_matches_slices(world, channels, m, aligned, seed, density):
    n = world * m
    layout = ChunkLayout.aligned(n, world, channels) if aligned else ChunkLayout.equal(n, world, channels)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) >= density] = 0
    x[torch.rand(n, generator=g) < 0.01] = -0.0
    x[torch.rand(n, generator=g) < 0.001] = float("nan")
    expected = [int((x[p.start : p.stop] != 0).sum()) for chunk in layout.pieces for p in chunk]
    assert count_nonzero_pieces(x, layout).tolist() == expected
    # one chunk on its own (the all-gather input), and a view that starts inside its storage
    for r in range(world):
        own = layout.chunks[r]
        alone = x[own.start : own.stop].clone()
        mine = expected[r * channels :][:channels]
        assert count_nonzero_pieces(alone, layout, [r], base=own.start).tolist() == mine
        padded = torch.cat([torch.ones(7), alone])[7:]
        assert count_nonzero_pieces(padded, layout, [r], base=own.start).tolist() == mine
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():  # the CUDA path's kernel
        from spccl_train.collectives._count import count_ranges

        device = "cuda" if torch.cuda.is_available() else "cpu"
        ranges = tuple((p.start, p.numel) for chunk in layout.pieces for p in chunk)
        for dtype in (torch.float32, torch.bfloat16):
            y = x.to(device=device, dtype=dtype)
            want = [int((y[p.start : p.stop] != 0).sum()) for chunk in layout.pieces for p in chunk]
            assert count_ranges(y, ranges).tolist() == want, dtype


# ----------------------------------------------------------------------------- formats and sizes


def test_message_bytes_and_framing():
    assert message_bytes("dense", 1000, 0, F32) == 4000
    assert message_bytes("pici", 1000, 37, F32) == pici_bytes(1000, 37, F32)
    assert message_bytes("coo", 1000, 37, torch.bfloat16) == COO_HEADER_BYTES + coo_bytes(1000, 37, torch.bfloat16)
    assert COO_HEADER_BYTES == 16


@pytest.mark.parametrize(
    "fmt, n, sigma, bound, threshold, expected",
    [
        ("pici", 1000, 0.61, 390, 0.6, "pici"),
        ("pici", 1000, 0.60, 400, 0.6, "dense"),  # at the threshold: dense
        ("pici", 1000, 0.99, 10, 1.0, "dense"),
        ("pici", 0, 1.0, 0, 0.0, "dense"),  # empty pieces send nothing sparse
        ("coo", 1000, 0.45, 550, 0.0, "dense"),  # below the threshold yet bigger than dense
        ("coo", 1000, 0.95, 50, 0.8, "coo"),
        ("dense", 1000, 1.0, 0, 0.0, "dense"),
        ("pici", 10, 0.99, 0, 0.5, "dense"),  # a 10-element Pici payload (528 B) outweighs 40 B dense
    ],
)
def test_choose_format(fmt, n, sigma, bound, threshold, expected):
    assert choose_format(fmt, n, sigma, bound, threshold, F32).value == expected


def test_paper_default_thresholds():
    assert (PICI.intra, PICI.inter, PICI.ag) == (0.6, 0.5, 0.1)
    assert (COO.intra, COO.inter, COO.ag) == (0.8, 0.7, 0.5)


# ----------------------------------------------------------------------------- ring reduce-scatter


def test_ring_reduce_scatter_extrapolates_fill_in():
    # 4 ranks at 80% sparsity: steps carry 1, 2, 3 contributions, sigma 0.8, 0.64, 0.512
    layout = ChunkLayout.equal(4 * TILE, 4)
    counts = _counts_for(layout, [0.2] * 4)
    plan = _rs(counts, layout)
    assert [s.index for s in plan.steps] == [0, 1, 2]
    sigmas = [{round(m.sparsity, 3) for m in step.messages} for step in plan.steps]
    assert sigmas == [{0.8}, {0.64}, {0.512}]
    formats = [{m.format for m in step.messages} for step in plan.steps]
    assert formats == [{Format.PICI}, {Format.PICI}, {Format.DENSE}]  # intra 0.6
    bounds = [{m.nnz_bound for m in step.messages} for step in plan.steps]
    assert bounds == [{819}, {1638}, {2457}]
    assert [all(m.nnz_exact for m in s.messages) for s in plan.steps] == [True, False, False]
    # the sizes are the bound's
    step1 = plan.steps[1].messages[0]
    assert step1.nbytes == pici_bytes(TILE, 1638, F32)


def test_ring_reduce_scatter_is_link_aware():
    # same data on 2 nodes of 2: hops 1->2 and 3->0 are inter-node (threshold 0.5), so at step 2
    # (sigma 0.512) those stay Pici while the intra-node hops (0.6) go dense
    layout = ChunkLayout.equal(4 * TILE, 4)
    plan = _rs(_counts_for(layout, [0.2] * 4), layout, rpn=2)
    last = plan.steps[2].messages
    assert {(m.src, m.dst): m.format for m in last} == {
        (0, 1): Format.DENSE,
        (1, 2): Format.PICI,
        (2, 3): Format.DENSE,
        (3, 0): Format.PICI,
    }
    assert {(m.src, m.dst): m.threshold for m in last} == {(0, 1): 0.6, (1, 2): 0.5, (2, 3): 0.6, (3, 0): 0.5}
    assert [m.inter_node for m in last] == [False, True, False, True]


def test_ring_reduce_scatter_chunk_routes():
    layout = ChunkLayout.equal(5 * 100, 5)
    plan = _rs(_counts_for(layout, [0.01] * 5), layout, fmt="coo", th=COO)
    for s, step in enumerate(plan.steps):
        for m in step.messages:
            assert m.dst == (m.src + 1) % 5
            assert m.chunk == (m.src - s - 1) % 5
    # after the last step rank c has received chunk c
    assert {m.dst: m.chunk for m in plan.steps[-1].messages} == {c: c for c in range(5)}


def test_ring_reduce_scatter_sparse_contributor_keeps_count_exact():
    # only rank 2 holds nonzeros: every partial sum has exactly its count
    layout = ChunkLayout.equal(3 * 1000, 3)
    counts = [[0, 0, 0], [0, 0, 0], [10, 10, 10]]
    plan = _rs(counts, layout, fmt="coo", th=COO)
    for step in plan.steps:
        for m in step.messages:
            contributors = {(m.chunk + 1 + i) % 3 for i in range(step.index + 1)}
            assert m.nnz_exact
            assert m.nnz_bound == (10 if 2 in contributors else 0)
            assert m.sparsity == (0.99 if 2 in contributors else 1.0)


def test_bound_never_exceeds_numel():
    layout = ChunkLayout.equal(4 * 100, 4)
    plan = _rs(_counts_for(layout, [0.9] * 4), layout, th=Thresholds(intra=0.0, inter=0.0).resolve("pici"))
    assert max(m.nnz_bound for m in plan.messages()) == 100
    assert all(m.format is Format.DENSE for m in plan.steps[-1].messages)  # a full bound is never smaller sparse


# ----------------------------------------------------------------------------- all-gather


def test_ring_all_gather_one_format_per_piece():
    layout = ChunkLayout.equal(4 * 2 * TILE, 4, channels=2)
    counts = [[20, 20], [4000, 20], [0, 4096], [3700, 3700]]  # per (chunk, piece); pieces hold 4096
    plan = _ag(counts, layout)
    seen = {}
    for s, step in enumerate(plan.steps):
        for m in step.messages:
            assert m.chunk == (m.src - s) % 4 and m.dst == (m.src + 1) % 4
            assert m.threshold == PICI.ag and m.nnz_exact and m.nnz_bound == counts[m.chunk][m.piece]
            assert seen.setdefault((m.chunk, m.piece), m.format) is m.format
            assert m.nbytes == message_bytes(m.format, TILE, m.nnz_bound, F32)
    assert seen == {
        (0, 0): Format.PICI, (0, 1): Format.PICI,
        (1, 0): Format.DENSE, (1, 1): Format.PICI,  # sparsity 0.023 <= ag 0.1
        (2, 0): Format.PICI, (2, 1): Format.DENSE,
        (3, 0): Format.DENSE, (3, 1): Format.DENSE,  # 0.097 <= 0.1
    }  # fmt: skip
    assert len(plan.steps) == 3


def test_all_gather_threshold_is_phase_aware():
    # 50% sparse chunks: reduce-scatter thresholds (intra 0.6) would send them dense; the gather
    # threshold (0.1) sends them as Pici
    layout = ChunkLayout.equal(3 * TILE, 3)
    counts = [[TILE // 2]] * 3
    assert {m.format for m in _ag(counts, layout).messages()} == {Format.PICI}
    assert {m.format for m in _rs(_counts_for(layout, [0.5] * 3), layout).steps[0].messages} == {Format.DENSE}


def test_direct_all_gather_routes():
    layout = ChunkLayout.equal(4 * TILE, 4)
    balanced = _ag([[100], [110], [90], [105]], layout, algorithm="direct")
    (step,) = balanced.steps
    assert step.route is Route.ALL_GATHER
    sizes = [align16(pici_bytes(TILE, c, F32)) for c in (100, 110, 90, 105)]
    assert step.slot_bytes == max(sizes)
    assert all(m.nbytes % 16 == 0 for m in step.messages)
    assert balanced.bytes_sent(0) == 3 * max(sizes) and balanced.bytes_sent() == 12 * max(sizes)
    skewed = _ag([[TILE], [0], [0], [5]], layout, algorithm="direct")
    assert skewed.steps[0].route is Route.P2P and skewed.steps[0].slot_bytes == 0
    assert skewed.bytes_sent(0) == 3 * TILE * 4 and skewed.bytes_sent(1) == 3 * align16(pici_bytes(TILE, 0, F32))
    # each chunk goes to every other rank, once
    pairs = sorted((m.src, m.dst) for m in skewed.messages())
    assert pairs == sorted((c, d) for c in range(4) for d in range(4) if c != d)
    assert 4 * max(sizes) <= PADDED_GATHER_SLACK * sum(sizes)


def test_direct_all_gather_pads_each_wave():
    # two pieces per chunk move as two waves; the padded route pads each wave to its largest payload
    layout = ChunkLayout.equal(4 * 2 * TILE, 4, channels=2)
    counts = [[100, 60], [60, 100], [80, 80], [70, 70]]
    (step,) = _ag(counts, layout, algorithm="direct").steps
    waves = [list(w) for w in step.wave_bytes]
    assert waves == [[align16(pici_bytes(TILE, row[k], F32)) for row in counts] for k in range(2)]
    assert step.route is Route.ALL_GATHER
    assert step.slot_bytes == max(waves[0]) + max(waves[1]) > max(map(sum, zip(*waves)))
    assert 4 * step.slot_bytes <= PADDED_GATHER_SLACK * sum(map(sum, waves))


def test_direct_reduce_scatter_messages():
    layout = ChunkLayout.equal(4 * 1000, 4, channels=2)
    counts = [[q * 10 + c for c in range(4) for _ in range(2)] for q in range(4)]
    plan = _rs(counts, layout, fmt="coo", algorithm="direct", th=COO, rpn=2)
    (step,) = plan.steps
    assert step.route is Route.ALL_TO_ALL and step.phase is Phase.REDUCE_SCATTER
    assert len(step.messages) == 4 * 3 * 2
    for m in step.messages:
        assert m.dst == m.chunk != m.src
        assert m.nnz_exact and m.nnz_bound == m.src * 10 + m.chunk
        assert m.inter_node == (m.src // 2 != m.dst // 2)
        assert m.threshold == (COO.inter if m.inter_node else COO.intra)
        assert m.format is Format.COO
        assert m.nbytes == align16(COO_HEADER_BYTES + coo_bytes(500, m.nnz_bound, F32))
    assert plan.dense_bytes(0) == 3 * 1000 * 4


def test_estimate_reduced_counts():
    layout = ChunkLayout.equal(2 * 1000, 2)
    # sigma 0.9 and 0.8: 1 - 0.72 = 0.28 -> 280, under the cap 100 + 200
    assert estimate_reduced_counts([[100, 100], [200, 200]], layout) == [[280], [280]]
    # disjoint-looking counts are capped by the sum; full ones by n
    assert estimate_reduced_counts([[0, 1000], [3, 1000]], layout) == [[3], [1000]]


def test_plan_helpers():
    layout = ChunkLayout.aligned(3 * TILE + 5, 3)
    counts = _counts_for(layout, [0.01, 0.02, 0.03])
    rs = _rs(counts, layout)
    ag = _ag(estimate_reduced_counts(counts, layout), layout)
    both = rs.then(ag)
    assert both.phase_steps(Phase.REDUCE_SCATTER) == rs.steps and both.phase_steps(Phase.ALL_GATHER) == ag.steps
    assert both.bytes_sent() == rs.bytes_sent() + ag.bytes_sent()
    assert both.dense_bytes(1) == sum(m.dense_nbytes for m in both.messages() if m.src == 1)
    assert sum(both.format_counts().values()) == len(list(both.messages()))
    text = both.describe()
    assert "reduce_scatter[0]" in text and "all_gather[1]" in text
    assert all(step.sent_by(0) == [m for m in step.messages if m.src == 0] for step in both.steps)


def test_world_of_one_plans_nothing():
    layout = ChunkLayout.aligned(1000, 1)
    for algorithm in ("ring", "direct"):
        assert _rs([[10]], layout, algorithm=algorithm).steps == ()
        assert _ag([[10]], layout, algorithm=algorithm).steps == ()


def test_bad_counts_shape():
    layout = ChunkLayout.equal(2 * 10, 2)
    with pytest.raises(ValueError, match="2 rows of 2"):
        _rs([[1, 2, 3]], layout)
    with pytest.raises(ValueError, match="'ring' or 'direct'"):
        _rs([[1, 1], [1, 1]], layout, algorithm="tree")


# ----------------------------------------------------------------------------- invariants


@st.composite
def _cases(draw):
    world = draw(st.integers(1, 6), label="world")
    channels = draw(st.integers(1, 3), label="channels")
    aligned = draw(st.booleans(), label="aligned")
    m = draw(st.integers(0, 3 * TILE), label="m")
    layout = (
        ChunkLayout.aligned(world * m, world, channels) if aligned else ChunkLayout.equal(world * m, world, channels)
    )
    counts = [[draw(st.integers(0, piece.numel)) for chunk in layout.pieces for piece in chunk] for _ in range(world)]
    fmt = draw(st.sampled_from(["pici", "coo", "dense"]), label="fmt")
    rpn = draw(st.none() | st.integers(1, world), label="ranks_per_node")
    th = Thresholds(intra=draw(st.floats(0, 1)), inter=draw(st.floats(0, 1)), ag=draw(st.floats(0, 1))).resolve(fmt)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), label="dtype")
    return layout, counts, fmt, rpn, th, dtype


def _expected_format(fmt, m, th_value, dtype):
    if fmt == "dense" or m.sparsity <= th_value:
        return Format.DENSE
    if message_bytes(fmt, m.numel, m.nnz_bound, dtype) >= m.numel * torch.empty((), dtype=dtype).element_size():
        return Format.DENSE
    return Format(fmt)


@settings(deadline=None, max_examples=150)
@given(case=_cases())
def test_ring_reduce_scatter_invariants(case):
    layout, counts, fmt, rpn, th, dtype = case
    p, ch = layout.world, layout.channels
    topo = Topology(p, rpn)
    plan = _rs(counts, layout, fmt=fmt, th=th, rpn=rpn, dtype=dtype)
    assert len(plan.steps) == max(p - 1, 0)
    for s, step in enumerate(plan.steps):
        for m in step.messages:
            piece = layout.pieces[m.chunk][m.piece]
            assert (m.start, m.numel) == piece and piece.numel > 0
            contributors = [(m.chunk + 1 + i) % p for i in range(s + 1)]
            assert contributors[-1] == m.src
            mine = [counts[q][m.chunk * ch + m.piece] for q in contributors]
            assert m.nnz_bound == min(m.numel, sum(mine))
            assert math.isclose(m.sparsity, math.prod(sparsity(m.numel, c) for c in mine), rel_tol=1e-12)
            assert m.nnz_exact == (sum(c > 0 for c in mine) <= 1)
            inter = topo.node_of(m.src) != topo.node_of(m.dst)
            assert m.inter_node == inter and m.threshold == (th.inter if inter else th.intra)
            assert m.format is _expected_format(fmt, m, m.threshold, dtype)
            assert m.nbytes == message_bytes(m.format, m.numel, m.nnz_bound, dtype)
            if m.sparse:
                assert m.nbytes < m.dense_nbytes
        # every rank sends one chunk, and the chunk it sends next is the one it just received
        if s + 1 < len(plan.steps):
            for m in step.messages:
                nxt = [n for n in plan.steps[s + 1].messages if n.src == m.dst and n.piece == m.piece]
                assert [n.chunk for n in nxt] == [m.chunk]
    assert plan.bytes_sent() <= plan.dense_bytes()


@settings(deadline=None, max_examples=150)
@given(case=_cases(), algorithm=st.sampled_from(["ring", "direct"]))
def test_all_gather_invariants(case, algorithm):
    layout, counts, fmt, rpn, th, dtype = case
    p, ch = layout.world, layout.channels
    ag_counts = [row[c * ch : (c + 1) * ch] for c, row in enumerate(counts)]
    plan = _ag(ag_counts, layout, fmt=fmt, algorithm=algorithm, threshold=th.ag, rpn=rpn, dtype=dtype)
    delivered = {}
    for m in plan.messages():
        assert m.nnz_bound == ag_counts[m.chunk][m.piece] and m.nnz_exact
        assert m.format is _expected_format(fmt, m, th.ag, dtype)
        size = message_bytes(m.format, m.numel, m.nnz_bound, dtype)
        assert m.nbytes == (align16(size) if algorithm == "direct" else size)
        delivered.setdefault((m.chunk, m.piece), set()).add(m.dst)
    for c in range(p):
        for k, piece in enumerate(layout.pieces[c]):
            if piece.numel:
                assert delivered.get((c, k), set()) == set(range(p)) - {c}


@settings(deadline=None, max_examples=100)
@given(case=_cases())
def test_direct_reduce_scatter_invariants(case):
    layout, counts, fmt, rpn, th, dtype = case
    p, ch = layout.world, layout.channels
    plan = _rs(counts, layout, fmt=fmt, algorithm="direct", th=th, rpn=rpn, dtype=dtype)
    seen = set()
    for m in plan.messages():
        assert m.dst == m.chunk != m.src and m.nnz_exact
        assert m.nnz_bound == counts[m.src][m.chunk * ch + m.piece]
        assert m.format is _expected_format(fmt, m, m.threshold, dtype)
        seen.add((m.src, m.chunk, m.piece))
    expected = {(q, c, k) for q in range(p) for c in range(p) if q != c for k in range(ch) if layout.pieces[c][k].numel}
    assert seen == expected
