"""The sparse collectives across processes on CPU (gloo), checked against a float64 dense reference.

What is checked, for all-gather, reduce-scatter and all-reduce, ring and direct, formats pici /
coo / dense / auto, float32 / bfloat16 / float16, sparsity 0 / 50 / 99 / 100 %, odd lengths,
identical / disjoint / random supports, world sizes 1, 2, 3, 4 (as two simulated nodes) and 8:

- results equal the float64 sum within the rounding of ``world`` additions in the data type;
  positions that are zero on every rank are exactly zero; all-gather is exact; every rank's
  all-reduce result is bit-identical (up to the sign of zero: sparse payloads decode -0.0 as +0.0); inputs of all-gather / reduce-scatter are unchanged;
- the plan follows the rules, re-derived from the data itself: every exact count is the true
  count of that piece, every bound covers the partial sum it sizes, every sparsity is the
  measured (or, in a ring reduction, the product-extrapolated) one, and every message is sparse
  exactly when its sparsity is above the threshold of its hop (intra / inter node) or phase
  (all-gather) and its payload is smaller than dense;
- bad calls (mismatched numel, dtype, config or collective; a non-contiguous tensor on one rank;
  wrong sizes; unsupported dtypes or ops) raise the same ValueError on every rank and leave the
  group usable.

Process pools (``tests/_pool.py``): one per world size, spawned once per module with a
``file://`` rendezvous under pytest's tmp_path; each rank runs jobs (a function of this module
and its arguments) sent by the tests. Inputs are drawn fresh every run from a seed (``SPCCL_TEST_SEED=<seed>`` replays a
failure; failures print it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import os
import random
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _pool import pool_factory

import spccl_train
from spccl_train.collectives import (
    CollectiveConfig,
    CostModel,
    EncodedPieces,
    Phase,
    Thresholds,
    api,
    held,
    last_stats,
    learned_corrections,
    measure_links,
    release_holds,
    reuse,
)
from spccl_train.collectives.choice import NATIVE_MARGIN
from spccl_train.collectives.chunking import ChunkLayout
from spccl_train.collectives.cost import CodecCost, LinkCost
from spccl_train.collectives.exchange import exchange_rounds
from spccl_train.collectives.feedback import kind_of
from spccl_train.collectives.topology import Topology
from spccl_train.formats import Format, compress_into, message_bytes

SEED = int(os.environ.get("SPCCL_TEST_SEED", random.SystemRandom().randrange(2**31)))
os.environ["SPCCL_TEST_SEED"] = str(SEED)  # the spawned ranks import this module and must draw alike
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
SPARSITIES = (0.0, 0.5, 0.99, 1.0)
SUPPORTS = ("random", "identical", "disjoint")
TILE = 4096


# ----------------------------------------------------------------------------- process pools


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    yield from pool_factory(tmp_path_factory, f"SPCCL_TEST_SEED={SEED}")


# ----------------------------------------------------------------------------- data and checks


def _seed(*parts) -> int:
    return zlib.crc32(repr((SEED, *parts)).encode())


def _inputs(seed: int, world: int, n: int, dtype: torch.dtype, sparsity: float, support: str) -> torch.Tensor:
    """Every rank's input (row q is rank q's), built alike on every rank from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(world, n, generator=g).to(dtype)
    values[values == 0] = 1
    density = 1.0 - sparsity
    if support == "random":
        keep = torch.rand(world, n, generator=g) < density
    elif support == "identical":
        keep = (torch.rand(n, generator=g) < density).expand(world, n)
    elif support == "disjoint":
        owner = torch.randint(world, (n,), generator=g)
        active = torch.rand(n, generator=g) < min(1.0, world * density)
        keep = active & (owner == torch.arange(world)[:, None])
    elif support == "skewed":  # rank 0 at the given density, the others a hundred times sparser
        scale = torch.tensor([1.0] + [0.01] * (world - 1))[:, None]
        keep = torch.rand(world, n, generator=g) < density * scale
    else:
        raise ValueError(support)
    x = torch.where(keep, values, torch.zeros((), dtype=dtype))
    x[~keep & (torch.rand(world, n, generator=g) < 0.3)] = -0.0  # negative zeros are zeros too
    return x.contiguous()


def _digest(t: torch.Tensor) -> str:
    """Hash of the bits, with -0.0 read as +0.0 (sparse formats decode every zero as +0.0)."""
    t = torch.where(t == 0, torch.zeros((), dtype=t.dtype), t)
    return hashlib.sha1(t.contiguous().view(INT_OF[t.dtype]).numpy().tobytes()).hexdigest()


def _check_sum(got: torch.Tensor, parts: torch.Tensor, what: str) -> None:
    """``got`` is the sum over dim 0 of ``parts`` up to ``world`` roundings; all-zero columns exact."""
    world = parts.shape[0]
    ref = parts.double().sum(0)
    tol = 2 * world * EPS[parts.dtype] * parts.double().abs().sum(0)
    err = (got.double() - ref).abs()
    bad = torch.nonzero(err > tol).view(-1)
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} elements off, first at {bad[:5].tolist()}: got {got[bad[:5]].tolist()}, "
        f"expected {ref[bad[:5]].tolist()} (tol {tol[bad[:5]].tolist()})"
    )
    zero = (parts == 0).all(0)
    assert bool((got[zero] == 0).all()), f"{what}: a position zero on every rank is nonzero"


def _nnz(t: torch.Tensor) -> int:
    return int((t != 0).sum())


def _check_plan(
    collective: str, cfg: CollectiveConfig, xs: torch.Tensor, result: torch.Tensor, what: str, rank: int
) -> None:
    """Re-derive every message's count, bound, sparsity, threshold and format from the data."""
    stats = last_stats()
    plan = stats.plan
    if plan is None:
        assert stats.algorithm == "native" and cfg.format in ("auto", "dense"), what
        return
    world = xs.shape[0]
    dtype = xs.dtype
    if cfg.format != "auto":
        assert plan.format.value == cfg.format and stats.algorithm == cfg.algorithm, what
    th = cfg.thresholds.resolve(plan.format)
    rpn = cfg.ranks_per_node or world
    flat = xs.view(world, -1)
    ch = cfg.channels
    layout = plan.layout
    # the table protocol plans from the counts with headroom (spccl_train.collectives.reuse), the
    # scalable one from the exact counts (a ring: the whole table it gathered)
    bounds = stats.planned_from
    assert (bounds is None) == (stats.exchange == "scalable"), what
    if collective == "all_gather":  # rank q's input is its chunk
        base = [layout.chunks[q].start for q in range(world)]
        actual = [
            [_nnz(flat[q, s.start - base[q] : s.stop - base[q]]) for s in layout.pieces[q]] + [0] * ((world - 1) * ch)
            for q in range(world)
        ]
    else:
        actual = [[_nnz(flat[q, s.start : s.stop]) for chunk in layout.pieces for s in chunk] for q in range(world)]
    if bounds is None:
        bounds = np.array(actual)
    else:
        assert reuse.fits(np.array(actual), bounds), f"{what}: bounds {bounds.tolist()} of counts {actual}"
    exact = stats.planned_from is None

    def held(q: int, c: int, k: int) -> int:  # what the plan counted for rank q's piece k of chunk c
        return int(bounds[q][k if collective == "all_gather" else c * ch + k])

    for step in plan.steps:
        for m in step.messages:
            piece = slice(m.start, m.start + m.numel)
            inter = m.src // rpn != m.dst // rpn
            assert m.inter_node == inter, what
            if step.phase is Phase.REDUCE_SCATTER:
                contributors = (
                    [m.src]
                    if plan.algorithm == "direct"
                    else [(m.chunk + 1 + i) % world for i in range(step.index + 1)]
                )
                counts = [held(q, m.chunk, m.piece) for q in contributors]
                assert m.nnz_exact == (exact and sum(c > 0 for c in counts) <= 1), what
                assert m.nnz_bound == min(m.numel, sum(counts)), f"{what}: bound of {m}"
                union = _nnz((flat[contributors, piece] != 0).any(0))
                assert union <= m.nnz_bound, what
                sigma = math.prod(1.0 - c / m.numel for c in counts)
                expected_threshold = th.inter if inter else th.intra
            elif collective == "all_gather":  # each payload from its owner's count or bound
                assert m.nnz_exact == exact and m.nnz_bound == held(m.chunk, m.chunk, m.piece), f"{what}: bound of {m}"
                assert _nnz(result.view(-1)[piece]) <= m.nnz_bound, what
                sigma = 1.0 - m.nnz_bound / m.numel
                expected_threshold = th.ag
            elif not m.nnz_exact:  # an all-reduce gather phase sized from the first exchange's bound
                assert stats.gather_counts == "bound", what
                counts = [held(q, m.chunk, m.piece) for q in range(world)]
                assert m.nnz_bound == min(m.numel, sum(counts)), f"{what}: gather bound of {m}"
                assert _nnz(result.view(-1)[piece]) <= m.nnz_bound, what
                sigma = 1.0 - m.nnz_bound / m.numel
                expected_threshold = th.ag
            else:  # an all-reduce gather phase sized from its measured counts
                assert stats.gather_counts == "measured", what
                count = _nnz(result.view(-1)[piece])
                assert m.nnz_exact and m.nnz_bound == count, f"{what}: count of {m}"
                sigma = 1.0 - count / m.numel
                expected_threshold = th.ag
            assert math.isclose(m.sparsity, sigma, rel_tol=1e-9, abs_tol=1e-12), f"{what}: sparsity of {m}"
            assert m.threshold == expected_threshold, f"{what}: threshold of {m}"
            sparse_pays = message_bytes(plan.format, m.numel, m.nnz_bound, dtype) < m.dense_nbytes
            expected = plan.format if (sigma > expected_threshold and sparse_pays) else Format.DENSE
            assert m.format is expected, f"{what}: format of {m}"
    assert stats.bytes_sent == plan.bytes_sent(rank), what
    rounds = exchange_rounds(stats.exchange, collective, cfg.algorithm == "ring")  # host synchronisations
    assert stats.exchanges == rounds + (stats.gather_counts == "measured"), what
    assert stats.gather_counts in (("bound", "measured") if collective == "all_reduce" else ("",)), what
    if cfg.gather_counts != "auto" and collective == "all_reduce" and plan.format is not Format.DENSE:
        assert stats.gather_counts == cfg.gather_counts, what
    assert int(stats.decode_status) == 0, what


def _run_one(rank, world, collective, xs, cfg, what, group=None):
    """Run one collective on this rank's row of ``xs``; check it; return the output's digest.

    ``rank`` and ``world`` are this process's rank in ``group`` and the group's size.
    """
    me = rank
    dtype = xs.dtype
    mine = xs[me].clone()
    if collective == "all_reduce":
        out = mine
        spccl_train.all_reduce(out, group=group, config=cfg)
        _check_sum(out, xs, what)
    elif collective == "reduce_scatter":
        out = torch.empty(xs.shape[1] // world, dtype=dtype)
        spccl_train.reduce_scatter_tensor(out, mine, group=group, config=cfg)
        assert torch.equal(mine.view(INT_OF[dtype]), xs[me].view(INT_OF[dtype])), f"{what}: input modified"
        _check_sum(out, xs.view(world, world, -1)[:, me], what)
    else:
        out = torch.empty(world * xs.shape[1], dtype=dtype)
        spccl_train.all_gather_into_tensor(out, mine, group=group, config=cfg)
        assert torch.equal(mine.view(INT_OF[dtype]), xs[me].view(INT_OF[dtype])), f"{what}: input modified"
        assert torch.equal(out, xs.reshape(-1)), f"{what}: all-gather is not exact"
    _check_plan(collective, cfg, xs, out, what, rank)
    return _digest(out)


def _lengths(collective: str, world: int) -> list[tuple[int, int]]:
    """(input numel, channels) per case: a tiny odd length and one spanning tiles unevenly."""
    if collective == "all_reduce":
        return [(13 * world + 5, 1), (world * TILE + 777, 3)]
    if collective == "reduce_scatter":
        return [(13 * world, 1), ((TILE + 77) * world, 3)]
    return [(13, 1), (TILE + 77, 3)]


def _job_matrix(rank, world, seed, collective, algorithm, fmt, dtype_name, sparsities, supports, lengths, rpn, cost):
    dtype = DTYPES[dtype_name]
    digests = []
    for sparsity in sparsities:
        for support in supports:
            for n, channels in lengths:
                # an all-reduce sizes its gather phase both ways, in turn
                gather = "auto" if fmt == "auto" else ("bound", "measured")[len(digests) % 2]
                what = (
                    f"{collective} {algorithm} {fmt} {dtype_name} sparsity={sparsity} {support} n={n} ch={channels} "
                    f"gather={gather}"
                )
                xs = _inputs(_seed(seed, sparsity, support, n), world, n, dtype, sparsity, support)
                cfg = CollectiveConfig(
                    format=fmt,
                    algorithm=algorithm,
                    channels=channels,
                    ranks_per_node=rpn,
                    cost_model=cost,
                    gather_counts=gather,
                )
                digests.append(_run_one(rank, world, collective, xs, cfg, what))
    return digests


def _matrix(
    pool,
    collective,
    algorithm,
    fmt,
    dtype_name,
    *,
    sparsities=SPARSITIES,
    supports=SUPPORTS,
    lengths=None,
    rpn=None,
    cost=None,
):
    world = pool.world
    lengths = lengths or _lengths(collective, world)
    seed = _seed(collective, algorithm, fmt, dtype_name, world)
    digests = pool.run(
        _job_matrix, seed, collective, algorithm, fmt, dtype_name, sparsities, supports, lengths, rpn, cost
    )
    if collective == "all_reduce":  # the owner of each chunk reduces it once: every rank holds the same bits
        assert all(d == digests[0] for d in digests)


# ----------------------------------------------------------------------------- the matrix


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
ALGORITHMS = ("ring", "direct")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", ["pici", "coo", "dense", "auto"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_world3_full_matrix(pools, collective, algorithm, fmt, dtype_name):
    _matrix(pools(3), collective, algorithm, fmt, dtype_name)


@pytest.mark.parametrize("fmt", ["pici", "coo"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_world2(pools, collective, algorithm, fmt):
    dtype_name = "fp32" if fmt == "pici" else "bf16"
    _matrix(pools(2), collective, algorithm, fmt, dtype_name, lengths=_lengths(collective, 2)[1:])


def _job_two_rank_16bit_sums(rank, world, seed):
    """Two ranks, 16-bit all-reduces of every format and both algorithms: each element is the two
    inputs added in float32 and rounded once, bit for bit up to the sign of zeros (the direct algorithm adds into the
    16-bit chunk itself there: one contribution needs no float32 copy)."""
    out = []
    for dtype_name in ("bf16", "fp16"):
        dtype = DTYPES[dtype_name]
        for fmt in ("pici", "coo", "dense"):
            for algorithm in ALGORITHMS:
                xs = _inputs(_seed(seed, dtype_name, fmt, algorithm), world, 2 * TILE + 333, dtype, 0.6, "random")
                x = xs[rank].clone()
                spccl_train.all_reduce(x, config=CollectiveConfig(format=fmt, algorithm=algorithm, channels=2))
                want = (xs[0].float() + xs[1].float()).to(dtype)
                out.append(torch.equal(x, want))  # bits, but for the sign of a zero (nothing is added there)
    return out


def test_two_ranks_add_16_bit_values_in_float32_and_round_once(pools):
    got = pools(2).run(_job_two_rank_16bit_sums, _seed("16-bit sums"))
    assert got[0] == got[1] == [True] * 12, got


@pytest.mark.parametrize("fmt", ["pici", "coo", "dense"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_world4_two_simulated_nodes(pools, collective, algorithm, fmt):
    """Ranks 0-1 and 2-3 form two nodes: hops 1->2 and 3->0 (ring) use the inter-node threshold."""
    dtype_name = {"pici": "fp32", "coo": "fp16", "dense": "bf16"}[fmt]
    _matrix(
        pools(4),
        collective,
        algorithm,
        fmt,
        dtype_name,
        sparsities=(0.5, 0.99, 1.0),
        rpn=2,
        lengths=_lengths(collective, 4)[1:],
    )


def _job_link_aware(rank, world, seed):
    # 83% sparse, random supports: after 2 ring steps sigma ~ 0.69 (> intra 0.6 and inter 0.5),
    # after 3 ~ 0.57, between the two: inter-node hops stay Pici, intra-node hops go dense. (As
    # planned from the counts' bounds, about 7% denser: 0.67 and 0.55.)
    n = world * 8 * TILE
    xs = _inputs(seed, world, n, torch.float32, 0.83, "random")
    cfg = CollectiveConfig(format="pici", algorithm="ring", ranks_per_node=2)
    _run_one(rank, world, "reduce_scatter", xs, cfg, "link-aware")
    last = last_stats().plan.steps[-1].messages
    return sorted({(m.src, m.dst, m.format.value) for m in last})


def test_world4_link_aware_formats(pools):
    got = pools(4).run(_job_link_aware, _seed("link"))  # each rank plans the messages it sends and receives
    assert got[0] == [(0, 1, "dense"), (3, 0, "pici")]
    assert sorted(set().union(*map(set, got))) == [(0, 1, "dense"), (1, 2, "pici"), (2, 3, "dense"), (3, 0, "pici")]


def _job_phase_aware(rank, world, seed):
    # 70% sparse inputs on 3 ranks: the reduced chunks are ~66% zeros; the reduce-scatter steps
    # (intra 0.6) fill in to dense, while the gather phase (ag 0.1), sized from measured counts,
    # stays Pici
    n = world * 4 * TILE
    xs = _inputs(seed, world, n, torch.float32, 0.7, "random")
    cfg = CollectiveConfig(format="pici", algorithm="ring", gather_counts="measured")
    _run_one(rank, world, "all_reduce", xs, cfg, "phase-aware")
    plan = last_stats().plan
    return [sorted({m.format.value for m in s.messages}) for s in plan.steps]


def test_world3_phase_aware_all_reduce(pools):
    got = pools(3).run(_job_phase_aware, _seed("phase"))
    assert got[0] == [["pici"], ["dense"], ["pici"], ["pici"]]


def _job_world8(rank, world, seed):
    out = []
    for collective, algorithm, fmt, dtype_name in [
        ("all_reduce", "ring", "pici", "fp32"),
        ("all_reduce", "direct", "coo", "bf16"),
        ("reduce_scatter", "ring", "coo", "fp16"),
        ("all_gather", "direct", "pici", "fp32"),
    ]:
        n = (world * TILE + 333) if collective == "all_reduce" else world * 1001
        for sparsity, support in [(0.99, "random"), (0.5, "disjoint")]:
            what = f"world8 {collective} {algorithm} {fmt} {sparsity} {support}"
            xs = _inputs(_seed(seed, collective, sparsity), world, n, DTYPES[dtype_name], sparsity, support)
            cfg = CollectiveConfig(format=fmt, algorithm=algorithm, ranks_per_node=4, channels=2)
            out.append(_run_one(rank, world, collective, xs, cfg, what))
    return out


def test_world8(pools):
    got = pools(8).run(_job_world8, _seed("world8"))
    assert len({tuple(d[:2]) for d in got}) == 1  # the two all-reduce digests agree on every rank


def _job_scalable(rank, world, seed, rpn):
    """The scalable count exchange (forced on this small group): every collective, format and
    channel count, exact, with each rank's plan re-derived from the data; rings keep the table.
    On a group of every rank other than the default one, where ``auto`` weighs the flat algorithms."""
    os.environ["SPCCL_SCALABLE_EXCHANGE_WORLD"] = "2"
    group = dist.new_group(list(range(world)))
    try:
        digests, protocols = [], []
        for collective, fmt, channels in itertools.product(COLLECTIVES, ("auto", "pici", "coo"), (1, 2)):
            n = (world * TILE + 333) if collective == "all_reduce" else world * 1001
            for sparsity, support in [(0.99, "random"), (0.7, "disjoint"), (0.0, "random")]:
                algorithm = "auto" if fmt == "auto" else "direct"
                cfg = CollectiveConfig(
                    format=fmt, algorithm=algorithm, ranks_per_node=rpn, channels=channels, cost_model=_slow_links()
                )
                what = f"scalable {collective} {fmt} ch={channels} rpn={rpn} {sparsity} {support}"
                xs = _inputs(
                    _seed(seed, collective, fmt, channels, sparsity), world, n, torch.float32, sparsity, support
                )
                digest = _run_one(rank, world, collective, xs, cfg, what, group)
                stats = last_stats()
                assert stats.exchange == "scalable" and stats.algorithm in ("direct", "native"), what
                if stats.gather_counts != "measured":  # O(world x channels): the budget
                    assert stats.exchange_bytes <= 16 * world * channels + 4096, (what, stats.exchange_bytes)
                if collective == "all_reduce":
                    digests.append(digest)
                protocols.append(stats.exchange_bytes)
        cfg = CollectiveConfig(format="pici", algorithm="ring", ranks_per_node=rpn)
        xs = _inputs(_seed(seed, "ring"), world, world * TILE, torch.float32, 0.9, "random")
        digests.append(_run_one(rank, world, "all_reduce", xs, cfg, "scalable: a ring gathers the table", group))
        assert (last_stats().exchange, last_stats().exchanges) == ("scalable", 2)  # the headers, then the table
        cfg = dataclasses.replace(cfg, channels=2)  # an all-gather's table is each rank's own counts
        xs = _inputs(_seed(seed, "ring", "ag"), world, 2 * TILE, torch.float32, 0.9, "random")
        for call in range(2):
            _run_one(rank, world, "all_gather", xs, cfg, f"scalable: a ring all-gather, call {call}", group)
            assert (last_stats().exchange, last_stats().algorithm) == ("scalable", "ring")
        return digests, protocols
    finally:
        os.environ.pop("SPCCL_SCALABLE_EXCHANGE_WORLD", None)


@pytest.mark.parametrize("world, rpn", [(4, 2), (3, None), (8, 4)])
def test_scalable_exchange(pools, world, rpn):
    got = pools(world).run(_job_scalable, _seed("scalable", world), rpn)
    assert all(digests == got[0][0] for digests, _ in got)  # every all-reduce bit-identical on every rank
    assert all(received == got[0][1] for _, received in got)


def _job_native_unexchanged(rank, world, seed):
    """``check_calls="first"`` and ``auto`` on a call too small for any sparse candidate to win:
    the first call of each shape exchanges (and checks the ranks' calls), the later ones go native
    with no exchange."""
    seen = []
    # codec calls of 10 ms: no sparse candidate can beat the native call on 1000 elements
    slow = CodecCost(compress=1e9, decompress=1e9, accumulate=1e9, call_s=1e-2)
    model = dataclasses.replace(CostModel.default("cpu"), pici=slow, coo=slow)
    first = CollectiveConfig(check_calls="first", cost_model=model)
    for n in (1000, 1000, 1000, 1001, 1001):
        x = torch.full((n,), float(rank + 1))
        spccl_train.all_reduce(x, config=first)
        assert torch.equal(x, torch.full((n,), float(world * (world + 1) // 2)))
        stats = last_stats()
        assert stats.algorithm == "native" and stats.plan is None
        seen.append((stats.exchanges, stats.exchange))
    # a fixed sparse format always exchanges, and so does every call by default (check_calls="every")
    for cfg in (dataclasses.replace(first, format="pici"), CollectiveConfig(cost_model=model), CollectiveConfig()):
        x = torch.ones(1000)
        spccl_train.all_reduce(x, config=cfg)
        seen.append((last_stats().exchanges, last_stats().exchange))
    return seen


def test_native_calls_skip_the_exchange_once_checked(pools):
    got = pools(3).run(_job_native_unexchanged, _seed("native"))
    assert got[0] == got[1] == got[2]
    assert got[0] == [(1, "table"), (0, ""), (0, ""), (1, "table"), (0, ""), (1, "table"), (1, "table"), (1, "table")]


def _job_short_path_on_tensors_that_require_grad(rank, world):
    """Tensors that require grad (a leaf, and a view of one) through every collective's short path:
    the calls write them as torch.distributed's own do, with autograd kept out of it."""
    slow = CodecCost(compress=1e9, decompress=1e9, accumulate=1e9, call_s=1e-2)
    first = CollectiveConfig(
        check_calls="first", cost_model=dataclasses.replace(CostModel.default("cpu"), pici=slow, coo=slow)
    )
    n, seen = 1000, []
    for call in range(4):  # exchanged, then the full path leaves its route, then the short path
        x = torch.full((world * n,), float(rank + 1), requires_grad=True)
        with torch.no_grad():
            y = x.clone()
        spccl_train.all_reduce(x, config=first)
        gathered = torch.zeros(world * n, requires_grad=True)
        spccl_train.all_gather_into_tensor(gathered, torch.full((n,), float(rank)), config=first)
        shard = torch.zeros(world * 2 * n, requires_grad=True)[:n]  # a view of a leaf
        spccl_train.reduce_scatter_tensor(shard, y, config=first)
        total = float(world * (world + 1) // 2)
        assert torch.equal(x.detach(), torch.full((world * n,), total)), call
        assert torch.equal(gathered.detach(), torch.arange(world).float().repeat_interleave(n)), call
        assert torch.equal(shard.detach(), torch.full((n,), total)), call
        seen.append(last_stats().exchanges)
    return seen


def test_the_short_path_takes_tensors_that_require_grad(pools):
    got = pools(2).run(_job_short_path_on_tensors_that_require_grad)
    assert got[0] == got[1] == [1, 0, 0, 0], got


def _job_native_held(rank, world, seed):
    """``check_calls="first"``: a shape whose exchanged call chose native (dense data: no
    candidate sends anything sparse) runs native unexchanged for 1, 2, 4, ... calls between
    exchanges; when the data turns sparse, the next exchange sees it and the hold ends."""
    # sparse wins on sparse data, not on dense data, where a held native call (priced with no
    # exchange) is cheaper than any sparse one with its exchange
    slow = LinkCost(latency_s=1e-5, bandwidth=2.5e7)
    model = dataclasses.replace(CostModel.default("cpu"), intra=slow, inter=slow)
    cfg = CollectiveConfig(check_calls="first", cost_model=model)
    n = 1 << 16
    gen = torch.Generator().manual_seed(seed)
    seen, requests, weighed = [], [], []
    full = api._request  # made by the full path only: a held call on the short path makes none
    made, bounds = [], []
    api._request = lambda *a, **k: made.append(1) or full(*a, **k)
    least = CostModel.least_sparse  # held_now's verdict from the model
    CostModel.least_sparse = lambda *a, **k: bounds.append(1) or least(*a, **k)
    try:
        for call in range(14):
            sparse = call >= 7
            xs = [torch.randint(1, 9, (n,), generator=gen).float() for _ in range(world)]
            if sparse:  # 99% sparse: one element in a hundred kept, at random places
                xs = [x * (torch.rand(n, generator=gen) < 0.01) for x in xs]
            x = xs[rank].clone()
            before, bounded = len(made), len(bounds)
            spccl_train.all_reduce(x, config=cfg)
            assert torch.equal(x, sum(xs)), f"call {call}"
            stats = last_stats()
            seen.append((stats.exchanges > 0, stats.algorithm))
            requests.append(len(made) > before)
            weighed.append(len(bounds) > bounded)
    finally:
        api._request = full
        CostModel.least_sparse = least
    return seen, requests, weighed, hashlib.sha256(x.numpy().tobytes()).hexdigest()


def test_a_native_shape_is_held_without_exchanges(pools):
    got = pools(3).run(_job_native_held, _seed("held"))
    assert all(g == got[0] for g in got), "every rank holds alike, and ends with the same bits"
    seen, requests, weighed, _ = got[0]
    exchanged = [e for e, _ in seen]
    # dense calls 0-6: exchanged, held 1; exchanged, held 2; exchanged, held 4 (calls 6-9, the
    # last three on sparse data); call 10 exchanges, sees the sparsity and goes sparse from then on
    assert exchanged == [True, False, True, False, False, True, False, False, False, False, True, True, True, True]
    # the first held call takes the full path and leaves its route; later ones take the short path
    assert requests == [True, True, True, False, False, True, False, False, False, False, True, True, True, True]
    assert all(a == "native" for _, a in seen[:10]) and all(a != "native" for _, a in seen[10:]), seen
    # the model's verdict (could any sparse candidate win?) is weighed when a hold runs out, not on
    # the calls of a shape whose last exchanged call went sparse: the exchange weighs those
    assert weighed == [False, False, True, False, False, True, False, False, False, False, True, False, False, False]


def _job_release_holds(rank, world):
    """``release_holds`` ends a hold: the shape's next call is exchanged again."""
    slow = LinkCost(latency_s=1e-5, bandwidth=2.5e7)  # links where sparse data would go sparse
    model = dataclasses.replace(CostModel.default("cpu"), intra=slow, inter=slow)
    cfg = CollectiveConfig(check_calls="first", cost_model=model)
    n, exchanged = 1 << 16, []
    for call in range(6):
        if call == 4:  # call 4 would be held (the hold of 2 that call 2 began)
            release_holds()
        x = torch.full((n,), float(rank + 1))  # dense: native is chosen, and held
        spccl_train.all_reduce(x, config=cfg)
        assert torch.equal(x, torch.full((n,), float(world * (world + 1) // 2)))
        exchanged.append(last_stats().exchanges)
    return exchanged


def test_release_holds(pools):
    got = pools(2).run(_job_release_holds)
    # exchanged, held 1; exchanged, held 2 (call 3, then released); exchanged, held 1 again
    assert got[0] == got[1] == [1, 0, 1, 0, 1, 0], got


def _job_short_path_config_errors(rank, world):
    """A config changed after its shape took the short path is validated as any other: a field
    that cannot be hashed, a bad value, and one equal to the route's but of the wrong type each
    raise the error naming the field."""
    cfg = CollectiveConfig(check_calls="first", cost_model=CostModel.default("cpu"))
    x = torch.ones(3000)
    ran = []
    run = held.run
    held.run = lambda *a, **k: ran.append(1) or run(*a, **k)
    try:
        for _ in range(3):  # exchanged, then native unexchanged (the full path leaves its route), then the short path
            spccl_train.all_reduce(x, config=cfg)
    finally:
        held.run = run
    short = ran == [1] and last_stats().exchanges == 0
    errors = []
    # values equal to the route's, of the wrong type, too: 1.0 == 1 and 0 == False hash alike
    bad_values = (("thresholds", {"intra": 0.5}), ("channels", 0), ("channels", 1.0), ("cuda_graphs", 0))
    for field, value in bad_values:
        bad = dataclasses.replace(cfg)
        setattr(bad, field, value)
        try:
            spccl_train.all_reduce(x, config=bad)
        except ValueError as exc:
            errors.append(str(exc).split(" ")[0])
    return short, errors


def test_the_short_path_takes_no_bad_config(pools):
    for short, errors in pools(2).run(_job_short_path_config_errors):
        assert short and errors == ["thresholds={'intra':", "channels=0", "channels=1.0", "cuda_graphs=0"], errors


def _job_native_priced_as_held(rank, world):
    """Where calls hold native, ``auto`` prices the native call with no exchange (what the held
    calls take) and observes an exchanged native choice from NCCL's call alone, as a held call is
    observed; checking every call, native is priced with its exchange, as it runs."""
    n = 4096
    given = CostModel.default("cpu")
    topology = Topology(world)
    got = {}
    for check in ("every", "first"):
        x = torch.full((n,), float(rank + 1))
        spccl_train.all_reduce(x, config=CollectiveConfig(check_calls=check, cost_model=given))
        got[check] = last_stats().candidates["native/dense"]
    want = {
        "every": given.predict_native("all_reduce", n, torch.float32, topology, exchanges=1),
        "first": given.predict_native("all_reduce", n, torch.float32, topology, exchanges=0),
    }
    measured = CollectiveConfig(check_calls="first")  # the measured model, with corrections
    x = torch.full((n + 1,), float(rank + 1))  # a shape of its own: its first call exchanges
    spccl_train.all_reduce(x, config=measured)
    stats, pending = last_stats(), learned_corrections()._pending
    model = measure_links(config=measured).model
    observed = (
        stats.algorithm,
        pending.predicted_s == model.predict_native("all_reduce", n + 1, torch.float32, topology, exchanges=0),
        pending.timer is not stats._timer,
    )
    return got, want, observed


def test_native_is_priced_and_observed_as_a_held_call(pools):
    for got, want, observed in pools(2).run(_job_native_priced_as_held):
        assert got == pytest.approx(want, rel=1e-12) and want["every"] > want["first"]
        assert observed == ("native", True, True)


def _job_held_verdict(rank, world, seed):
    """A short-path call keeps its route's verdict (no sparse candidate can win) until the group's
    corrections change (their ``revision``); then it weighs again and exchanges. Native's
    correction factor is set by hand, alike on every rank, to make each verdict certain; the
    group's corrections are put back afterwards for the pool's later tests."""
    cfg = CollectiveConfig(check_calls="first")  # the measured model, with corrections
    n = 256 + random.Random(seed).randrange(256)
    corrections = learned_corrections()
    kind = kind_of("all_reduce", "native/dense", 4 * n, torch.float32)
    kept = {name: dict(getattr(corrections, name)) for name in ("factors", "seen", "recent", "last")}

    def native_corrected(factor: float, revise: bool = True) -> None:
        corrections.factors[kind], corrections.seen[kind] = factor, 2
        corrections.revision += revise

    exchanged = []
    try:
        for call in range(5):
            if call < 2:  # native predicted fast (the first call's exchange may learn: set it again)
                native_corrected(1e-3)
            elif call == 3:  # native predicted slow, unrevised: the route keeps its verdict
                native_corrected(1e6, revise=False)
            elif call == 4:  # revised: weighed again, and no longer sure, the call exchanges
                native_corrected(1e6)
            x = torch.full((n,), float(rank + 1))
            spccl_train.all_reduce(x, config=cfg)
            assert torch.equal(x, torch.full((n,), float(world * (world + 1) // 2)))
            exchanged.append(last_stats().exchanges)
    finally:
        for name, was in kept.items():
            getattr(corrections, name).clear()
            getattr(corrections, name).update(was)
        corrections.revision += 1
    return exchanged


def test_a_held_route_weighs_again_when_corrections_change(pools):
    got = pools(2).run(_job_held_verdict, _seed("verdict"))
    # exchanged and held for one call (the full path, which leaves the route); the short path
    # with the verdict made, then kept; weighed again and exchanged
    assert got[0] == got[1] == [1, 0, 0, 0, 1]


def _job_world1(rank, world, seed):
    for collective in COLLECTIVES:
        for fmt in ("pici", "coo", "dense", "auto"):
            for algorithm in ALGORITHMS:
                xs = _inputs(_seed(seed, collective, fmt), 1, 1000, torch.bfloat16, 0.9, "random")
                cfg = CollectiveConfig(format=fmt, algorithm=algorithm)
                mine = xs[0].clone()
                out = mine if collective == "all_reduce" else torch.empty_like(mine)
                if collective == "all_reduce":
                    spccl_train.all_reduce(out, config=cfg)
                elif collective == "reduce_scatter":
                    spccl_train.reduce_scatter_tensor(out, mine, config=cfg)
                else:
                    spccl_train.all_gather_into_tensor(out, mine, config=cfg)
                assert torch.equal(out.view(torch.int16), xs[0].view(torch.int16))
                assert last_stats().algorithm == "local" and last_stats().exchanges == 0
    bad = torch.zeros(4, 4)[:, 0]
    try:
        spccl_train.all_reduce(bad)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_world1(pools):
    (message,) = pools(1).run(_job_world1, _seed("world1"))
    assert "rank 0: the input is not contiguous" in message


# ----------------------------------------------------------------------------- auto


def _slow_links() -> CostModel:
    """Links so slow that compression pays for anything sparse (but not for dense data)."""
    base = CostModel.default("cpu")
    slow = LinkCost(latency_s=1e-5, bandwidth=1e6)
    fast = CodecCost(compress=1e9, decompress=1e9, accumulate=1e9, call_s=1e-5)
    return CostModel(
        intra=slow,
        inter=slow,
        pici=fast,
        coo=fast,
        reduce=base.reduce,
        copy=base.copy,
        count=base.count,
        exchange_s=base.exchange_s,
    )


def _job_auto(rank, world, seed):
    picks = []
    for collective in COLLECTIVES:
        n = {"all_reduce": world * TILE + 1, "reduce_scatter": world * 3000, "all_gather": 3000}[collective]
        for sparsity in (0.0, 0.99):
            xs = _inputs(_seed(seed, collective, sparsity), world, n, torch.float32, sparsity, "random")
            cfg = CollectiveConfig(cost_model=_slow_links())
            _run_one(rank, world, collective, xs, cfg, f"auto {collective} {sparsity}")
            stats = last_stats()
            best, native = min(stats.candidates.values()), stats.candidates["native/dense"]
            # the cheapest candidate, or native when no sparse one wins by NATIVE_MARGIN
            assert stats.predicted_s == best or (stats.algorithm == "native" and best >= (1 - NATIVE_MARGIN) * native)
            assert stats.elapsed_s > 0
            picks.append((collective, sparsity, stats.algorithm, stats.format.value))
    return picks


def test_auto_picks_by_predicted_time(pools):
    picks = pools(3).run(_job_auto, _seed("auto"))
    assert picks[0] == picks[1] == picks[2]
    for collective, sparsity, algorithm, fmt in picks[0]:
        if sparsity == 0.0:
            assert algorithm == "native", (collective, algorithm)
        else:
            assert algorithm in ALGORITHMS and fmt in ("pici", "coo"), (collective, algorithm, fmt)


# ----------------------------------------------------------------------------- bad calls


def _attempt(call) -> str:
    try:
        call()
    except (ValueError, TypeError) as exc:  # the error is the result; anything else fails the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _job_bad_call(rank, world, case, scalable=False):
    """Make one bad call (bad on some ranks only, for most cases); then show the group still works.
    ``scalable``: under the scalable count exchange (a direct config, every group size)."""
    if scalable:
        os.environ["SPCCL_SCALABLE_EXCHANGE_WORLD"] = "2"
    try:
        return _bad_call(rank, world, case, "direct" if scalable else "ring")
    finally:
        os.environ.pop("SPCCL_SCALABLE_EXCHANGE_WORLD", None)


def _bad_call(rank, world, case, algorithm):
    n = 10 * world
    x = torch.ones(n)
    out = torch.empty(n)
    cfg = CollectiveConfig(format="pici", algorithm=algorithm)
    calls = {
        "numel": lambda: spccl_train.all_reduce(torch.ones(n + (rank == 1)), config=cfg),
        "dtype": lambda: spccl_train.all_reduce(x.to(torch.bfloat16) if rank == 2 else x, config=cfg),
        "config": lambda: spccl_train.all_reduce(x, config=CollectiveConfig(format="pici" if rank else "coo")),
        "algorithm": lambda: spccl_train.all_reduce(
            x, config=CollectiveConfig(format="pici", algorithm="direct" if rank else "ring")
        ),
        "thresholds": lambda: spccl_train.all_reduce(
            x, config=CollectiveConfig(format="pici", thresholds=Thresholds(intra=0.5 if rank == 1 else 0.6))
        ),
        "collective": lambda: (
            spccl_train.all_reduce(x, config=cfg)
            if rank == 0
            else spccl_train.all_gather_into_tensor(out, x[:10], config=cfg)
        ),
        "not_contiguous": lambda: spccl_train.all_reduce(torch.ones(world, 10).t() if rank == 1 else x, config=cfg),
        "output_size": lambda: spccl_train.all_gather_into_tensor(torch.empty(n + (rank == 2)), x[:10], config=cfg),
        "input_size": lambda: spccl_train.reduce_scatter_tensor(torch.empty(10), torch.ones(n + 1), config=cfg),
        "output_dtype": lambda: spccl_train.reduce_scatter_tensor(
            torch.empty(10, dtype=torch.float16 if rank == 0 else torch.float32), x, config=cfg
        ),
        "unsupported_dtype": lambda: spccl_train.all_reduce(torch.ones(n, dtype=torch.int32), config=cfg),
        "overlap": lambda: spccl_train.all_gather_into_tensor(out, out[1:11] if rank == 1 else x[:10], config=cfg),
        "op": lambda: spccl_train.all_reduce(x, config=cfg, op=dist.ReduceOp.MAX),
        "not_a_tensor": lambda: spccl_train.all_reduce([1.0, 2.0], config=cfg),
        "bad_config": lambda: spccl_train.all_reduce(x, config={"format": "pici"}),
    }
    message = _attempt(calls[case])
    check = torch.full((n,), float(rank + 1))
    spccl_train.all_reduce(check, config=cfg)
    assert torch.equal(check, torch.full((n,), float(world * (world + 1) // 2))), "the group is broken afterwards"
    assert last_stats().exchange == ("scalable" if algorithm == "direct" else "table")
    return message


BAD_CALLS = {
    "numel": "ValueError: spccl_train.all_reduce: ranks disagree on the input numel (rank 0: 30, rank 1: 31, rank 2: 30)",
    "dtype": "disagree on the dtype (rank 0: torch.float32, rank 1: torch.float32, rank 2: torch.bfloat16)",
    "config": "ranks passed different CollectiveConfigs (alike within: ranks [0]; ranks [1, 2])",
    "algorithm": "ranks passed different CollectiveConfigs (alike within: ranks [0]; ranks [1, 2])",
    "thresholds": "ranks passed different CollectiveConfigs (alike within: ranks [0, 2]; ranks [1])",
    "collective": "ranks called different collectives (rank 0: all_reduce, rank 1: all_gather_into_tensor",
    "not_contiguous": "invalid arguments on 1 of 3 ranks. rank 1: the input is not contiguous",
    "output_size": "rank 2: the output has 31 elements but needs world_size * input.numel() = 3 * 10 = 30",
    "input_size": "the input has 31 elements but needs world_size * output.numel() = 3 * 10 = 30",
    "output_dtype": "rank 0: the output dtype torch.float16 differs from the input dtype torch.float32",
    "unsupported_dtype": "dtype torch.int32 is not supported",
    "overlap": "rank 1: the output overlaps the input",
    "op": "ValueError: spccl_train.all_reduce supports op=ReduceOp.SUM only",
    "not_a_tensor": "TypeError: output must be a torch.Tensor, got list",
    "bad_config": "TypeError: config must be a CollectiveConfig or None, got dict",
}


@pytest.mark.parametrize("scalable", [False, True], ids=["table", "scalable"])
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_call_raises_alike_on_every_rank(pools, case, scalable):
    messages = pools(3).run(_job_bad_call, case, scalable)
    assert messages[0] == messages[1] == messages[2], messages
    assert BAD_CALLS[case] in messages[0], messages[0]
    if not messages[0].startswith("TypeError"):
        assert messages[0].startswith("ValueError: spccl_train"), messages[0]


# ----------------------------------------------------------------------------- handles, aliasing, edges


def _job_async(rank, world, seed):
    xs = _inputs(seed, world, world * 2000, torch.float32, 0.95, "random")
    cfg = CollectiveConfig(format="coo", algorithm="direct")
    t = xs[rank].clone()
    work = spccl_train.all_reduce(t, async_op=True, config=cfg)
    assert work.wait() is True and work.is_completed()
    value = work.get_future().wait()
    assert value[0] is t and work.result()[0] is t
    assert work.stats is last_stats() and work.stats.collective == "all_reduce"
    _check_sum(t, xs, "async all_reduce")
    shard = torch.empty(2000)
    work = spccl_train.reduce_scatter_tensor(shard, xs[rank].clone(), async_op=True, config=cfg)
    chained = work.get_future().then(lambda fut: fut.value()[0].sum())
    _check_sum(shard, xs.view(world, world, -1)[:, rank], "async reduce_scatter")
    assert torch.equal(chained.wait(), shard.sum())
    gathered = torch.empty(world * xs.shape[1])
    work = spccl_train.all_gather_into_tensor(gathered, xs[rank].clone(), async_op=True, config=cfg)
    work.wait()
    assert torch.equal(gathered, xs.reshape(-1))
    assert spccl_train.all_reduce(t, config=cfg) is None
    return True


def test_async_handles(pools):
    assert pools(3).run(_job_async, _seed("async")) == [True] * 3


def _job_new_names_without_warnings(rank, world, seed):
    # torch 2.13's names give the same results, and no call (dense, sparse, native) warns about
    # torch's deprecated names: the library calls whichever one-tensor collective this torch has.
    import warnings

    xs = _inputs(seed, world, world * 1000, torch.float32, 0.9, "random")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for fmt in ("pici", "dense", "auto"):
            cfg = CollectiveConfig(format=fmt)
            gathered = torch.empty(world * xs.shape[1])
            spccl_train.all_gather_single(gathered, xs[rank].clone(), config=cfg)
            assert torch.equal(gathered, xs.reshape(-1)), fmt
            shard = torch.empty(xs.shape[1] // world)
            spccl_train.reduce_scatter_single(shard, xs[rank].clone(), config=cfg)
            _check_sum(shard, xs.view(world, world, -1)[:, rank], f"reduce_scatter_single {fmt}")
    return spccl_train.all_gather_single is spccl_train.all_gather_into_tensor


def test_torch_213_names_match_and_nothing_warns(pools):
    assert pools(2).run(_job_new_names_without_warnings, _seed("new names")) == [True] * 2


def _job_planning_group(rank, world, seed):
    # the planning exchange on a second group of the same ranks; a group of other ranks is refused
    second = dist.new_group()
    xs = _inputs(seed, world, world * 3000 + 17, torch.float32, 0.99, "random")
    for fmt, algorithm in (("pici", "direct"), ("coo", "ring"), ("auto", "auto")):
        t = xs[rank].clone()
        cfg = CollectiveConfig(format=fmt, algorithm=algorithm)
        spccl_train.all_reduce(t, config=cfg, planning_group=second)
        _check_sum(t, xs, f"all_reduce planned on a second group {fmt}/{algorithm}")
        gathered = torch.empty(world * xs.shape[1])
        spccl_train.all_gather_into_tensor(gathered, xs[rank].clone(), config=cfg, planning_group=second)
        assert torch.equal(gathered, xs.reshape(-1))
    alone = dist.new_group([rank], use_local_synchronization=True)
    try:
        spccl_train.all_reduce(xs[rank].clone(), planning_group=alone)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_planning_group(pools):
    messages = pools(2).run(_job_planning_group, _seed("planning group"))
    assert all("planning_group has 1 ranks" in m for m in messages), messages


def _job_in_place(rank, world, seed):
    m = TILE + 5
    for algorithm in ALGORITHMS:
        for fmt, sparsity in (("pici", 0.9), ("dense", 0.0), ("coo", 0.999)):
            what = f"in place {algorithm} {fmt}"
            xs = _inputs(_seed(seed, algorithm, fmt), world, world * m, torch.bfloat16, sparsity, "random")
            cfg = CollectiveConfig(format=fmt, algorithm=algorithm, channels=2)
            # reduce-scatter: the output is this rank's slice of the input
            buf = xs[rank].clone()
            spccl_train.reduce_scatter_tensor(buf[rank * m : (rank + 1) * m], buf, config=cfg)
            _check_sum(buf[rank * m : (rank + 1) * m], xs.view(world, world, m)[:, rank], what)
            assert torch.equal(buf[: rank * m], xs[rank, : rank * m]), what
            # all-gather: the input is this rank's slice of the output
            out = torch.zeros(world * m, dtype=torch.bfloat16)
            out[rank * m : (rank + 1) * m] = xs[rank, :m]
            spccl_train.all_gather_into_tensor(out, out[rank * m : (rank + 1) * m], config=cfg)
            assert torch.equal(out, xs[:, :m].reshape(-1)), what
    return True


def test_in_place_forms(pools):
    pools(3).run(_job_in_place, _seed("in place"))


def _job_specials(rank, world):
    results = []
    for collective, algorithm in (("all_reduce", "ring"), ("all_reduce", "direct"), ("reduce_scatter", "ring")):
        x = torch.zeros(world * 100)
        special = {0: {5: math.nan, 9: math.inf, 50: 1e-45}, 1: {7: math.inf, 50: 1e-45}, 2: {7: -math.inf}}
        for position, value in special.get(rank, {}).items():
            x[position] = value
        for fmt in ("pici", "coo"):
            t = x.clone()
            cfg = CollectiveConfig(format=fmt, algorithm=algorithm)
            if collective == "all_reduce":
                spccl_train.all_reduce(t, config=cfg)
                got = t
            else:
                got = torch.empty(100)
                spccl_train.reduce_scatter_tensor(got, t, config=cfg)
            if rank == 0 or collective == "all_reduce":
                results.append(
                    (math.isnan(got[5]), math.isnan(got[7]), math.isinf(got[9]), float(got[50]), int((got != 0).sum()))
                )
    return results


def test_nan_inf_subnormal_travel(pools):
    results = pools(3).run(_job_specials)
    tiny = float(torch.tensor(1e-45))  # the smallest float32 subnormal
    expected = (True, True, True, 2 * tiny, 4)
    assert all(r == expected for r in results[0]), results[0]
    assert all(r == expected for r in results[1])  # all-reduce results on rank 1


def _job_cancellations(rank, world, seed):
    """Sums that cancel to exactly zero where this rank holds a nonzero: the in-place all-reduce's
    gather phase, which at this density writes only what changed (a Pici patch), must clear them."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        n = 3 * TILE + 77
        g = torch.Generator().manual_seed(_seed("cancel", seed, str(dtype)))
        v = torch.randn(n, generator=g).to(dtype)
        v[v == 0] = 1
        support = torch.rand(n, generator=g) < 0.008  # the gathered bound stays under PATCH_MAX_DENSITY
        cancel = support & (torch.rand(n, generator=g) < 0.5)
        xs = torch.zeros(world, n, dtype=dtype)
        xs[0] = torch.where(support, v, torch.zeros((), dtype=dtype))
        xs[1] = torch.where(cancel, -v, torch.zeros((), dtype=dtype))
        xs[2:] = torch.where(torch.rand(world - 2, n, generator=g) < 0.003, v, torch.zeros((), dtype=dtype))
        zero = cancel & (xs[2:] == 0).all(0)
        t = xs[rank].clone()
        spccl_train.all_reduce(t, config=CollectiveConfig(format="pici", algorithm="direct"))
        _check_sum(t, xs, f"cancellations, {dtype}")
        assert int(zero.sum()) > 0 and bool((t[zero] == 0).all()), f"{dtype}: a cancelled sum is nonzero"
        out.append(_digest(t))
    return out


def test_all_reduce_clears_sums_that_cancel(pools):
    results = pools(3).run(_job_cancellations, SEED)
    assert all(r == results[0] for r in results), results  # bit-identical on every rank


def _job_subgroups(rank, world, seed):
    members = [[0, 2], [1, 3]]
    groups = [dist.new_group(ranks) for ranks in members]  # every rank creates every group
    mine = 0 if rank in members[0] else 1
    group, size = groups[mine], 2
    me = members[mine].index(rank)
    digests = []
    for collective in COLLECTIVES:
        for algorithm in ALGORITHMS:
            n = {"all_reduce": 2 * TILE + 9, "reduce_scatter": 2 * 999, "all_gather": 999}[collective]
            xs = _inputs(_seed(seed, mine, collective), size, n, torch.float32, 0.9, "random")
            cfg = CollectiveConfig(format="pici", algorithm=algorithm, channels=2)
            what = f"subgroup {members[mine]} {collective} {algorithm}"
            digests.append(_run_one(me, size, collective, xs, cfg, what, group))
    return mine, digests


def test_subgroups_run_side_by_side(pools):
    results = pools(4).run(_job_subgroups, _seed("groups"))
    for a, b in ((0, 2), (1, 3)):
        assert results[a][0] == results[b][0]
        assert results[a][1][0] == results[b][1][0]  # ring all-reduce: same bits in both members


def _job_shapes_and_edges(rank, world, seed):
    cfg = CollectiveConfig(format="pici", algorithm="ring")
    xs = _inputs(seed, world, 7 * 13, torch.float32, 0.8, "random")
    t = xs[rank].clone().view(7, 13)
    spccl_train.all_reduce(t, config=cfg)
    _check_sum(t.view(-1), xs, "2-D all_reduce")
    out = torch.empty(world, 7, 13)
    spccl_train.all_gather_into_tensor(out, xs[rank].view(7, 13), config=cfg)
    assert torch.equal(out.view(world, -1), xs)
    rs_in = _inputs(seed + 1, world, world * 12, torch.float32, 0.8, "random")
    shard = torch.empty(4, 3)
    spccl_train.reduce_scatter_tensor(shard, rs_in[rank].view(world * 4, 3), config=cfg)
    _check_sum(shard.view(-1), rs_in.view(world, world, -1)[:, rank], "2-D reduce_scatter")
    # autograd: a leaf that requires grad is reduced in place and keeps requiring grad
    param = torch.ones(50, requires_grad=True)
    spccl_train.all_reduce(param, config=cfg)
    assert param.requires_grad and torch.equal(param.detach(), torch.full((50,), float(world)))
    # nothing to move
    empty = torch.empty(0)
    for algorithm in ALGORITHMS:
        cfg = CollectiveConfig(format="coo", algorithm=algorithm)
        spccl_train.all_reduce(empty, config=cfg)
        spccl_train.all_gather_into_tensor(torch.empty(0), empty, config=cfg)
        spccl_train.reduce_scatter_tensor(torch.empty(0), empty, config=cfg)
        assert last_stats().bytes_sent == 0 and last_stats().exchanges == 1
    # fewer elements than ranks: the later chunks are empty
    tiny = _inputs(seed + 2, world, 2, torch.float16, 0.0, "random")
    t = tiny[rank].clone()
    spccl_train.all_reduce(t, config=CollectiveConfig(format="pici", algorithm="direct"))
    _check_sum(t, tiny, "2-element all_reduce")
    return True


def test_shapes_autograd_and_empty_tensors(pools):
    pools(3).run(_job_shapes_and_edges, _seed("shapes"))


def _job_gather_routes(rank, world, seed):
    routes = []
    for support, channels in itertools.product(("random", "skewed"), (1, 2)):
        xs = _inputs(_seed(seed, support), world, 3 * TILE, torch.float32, 0.9, support)
        cfg = CollectiveConfig(format="pici", algorithm="direct", channels=channels)
        _run_one(rank, world, "all_gather", xs, cfg, f"direct all-gather {support} ch={channels}")
        stats = last_stats()
        routes.append(stats.plan.steps[0].route.value)
        step = stats.plan.steps[0]
        if step.route.value == "p2p":  # exact payloads: what this rank sends is what its messages hold
            assert stats.bytes_sent == sum(m.nbytes for m in step.sent_by(rank))
        else:  # one padded slot to every other rank
            assert stats.bytes_sent == (world - 1) * step.slot_bytes
    return routes


def test_direct_all_gather_pads_only_balanced_payloads(pools):
    routes = pools(3).run(_job_gather_routes, _seed("routes"))
    assert routes[0] == ["all_gather", "all_gather", "p2p", "p2p"]  # (random, skewed) x (1, 2 waves)


def _job_empty_waves(rank, world, seed):
    # more pieces than elements: some waves are empty on every rank, some on a few (uneven chunks)
    for collective, algorithm, fmt in itertools.product(COLLECTIVES, ("direct", "ring"), ("pici", "coo")):
        for n, channels in ((5, 5), (13, 4), (2 * world + 1, 3)):
            n = n * world if collective == "reduce_scatter" else n
            for sparsity in (0.0, 0.7, 1.0):
                xs = _inputs(_seed(seed, collective, n, sparsity), world, n, torch.float32, sparsity, "random")
                cfg = CollectiveConfig(format=fmt, algorithm=algorithm, channels=channels)
                what = f"{collective} {algorithm} {fmt} n={n} ch={channels} sparsity={sparsity}"
                _run_one(rank, world, collective, xs, cfg, what)


def test_waves_with_empty_pieces(pools):
    pools(3).run(_job_empty_waves, _seed("empty waves"))


def _job_bytes(rank, world, seed):
    xs = _inputs(seed, world, world * 8 * TILE, torch.float32, 0.99, "random")
    out = []
    for algorithm in ALGORITHMS:
        cfg = CollectiveConfig(format="pici", algorithm=algorithm)
        _run_one(rank, world, "all_reduce", xs, cfg, f"bytes {algorithm}")
        stats = last_stats()
        out.append(stats.bytes_sent / stats.dense_bytes)
    return out


def test_sparse_data_sends_a_fraction_of_dense(pools):
    for ratios in pools(3).run(_job_bytes, _seed("bytes")):
        assert all(r < 0.15 for r in ratios), ratios  # 99% sparse: ~3% payload + Pici's 3% metadata


# ----------------------------------------------------------------------------- bounds: no planning exchange


def _piece_counts(xs: torch.Tensor, layout: ChunkLayout, collective: str) -> list[list[int]]:
    """The count table the planning exchange would gather (row q: rank q's pieces)."""
    table = []
    for q in range(xs.shape[0]):
        if collective == "all_gather":
            own = layout.chunks[q].start
            row = [_nnz(xs[q][p.start - own : p.stop - own]) for p in layout.pieces[q]]
            row += [0] * (layout.world - 1) * layout.channels
        else:
            row = [_nnz(xs[q][p.start : p.stop]) for chunk in layout.pieces for p in chunk]
        table.append(row)
    return table


def _job_bounds(rank, world, seed):
    results = []
    for collective in COLLECTIVES:
        for algorithm in ALGORITHMS:
            for fmt in ("pici", "coo", "auto"):
                for slack in (0, 2, None):  # exact counts, twice the counts, every piece full
                    n, channels = (world * TILE + 777, 3) if collective == "all_reduce" else (TILE + 77, 2)
                    n = n * world if collective == "reduce_scatter" else n
                    xs = _inputs(
                        _seed(seed, collective, algorithm, fmt, slack), world, n, torch.float32, 0.98, "random"
                    )
                    chunked = world * n if collective == "all_gather" else n
                    layout = ChunkLayout.of(collective, chunked, world, channels)
                    counts = _piece_counts(xs, layout, collective)
                    sizes = [p.numel for chunk in layout.pieces for p in chunk]
                    if collective == "all_gather":
                        sizes = [
                            [p.numel for p in layout.pieces[q]] + [0] * (world - 1) * channels for q in range(world)
                        ]
                    else:
                        sizes = [sizes] * world
                    bounds = [
                        [size if slack is None else min(size, c * max(1, slack)) for c, size in zip(row, row_sizes)]
                        for row, row_sizes in zip(counts, sizes)
                    ]
                    # cuda_graphs changes nothing off CUDA: the call runs eagerly
                    cfg = CollectiveConfig(format=fmt, algorithm=algorithm, channels=channels, cuda_graphs=slack == 2)
                    what = f"{collective} {algorithm} {fmt} bounds slack={slack}"
                    mine = xs[rank].clone()
                    if collective == "all_reduce":
                        work = spccl_train.all_reduce(mine, config=cfg, bounds=bounds, async_op=True)
                        _check_sum(mine, xs, what)
                    elif collective == "reduce_scatter":
                        out = torch.empty(n // world)
                        work = spccl_train.reduce_scatter_tensor(out, mine, config=cfg, bounds=bounds, async_op=True)
                        _check_sum(out, xs.view(world, world, -1)[:, rank], what)
                    else:
                        out = torch.empty(world * n)
                        work = spccl_train.all_gather_into_tensor(out, mine, config=cfg, bounds=bounds, async_op=True)
                        assert torch.equal(out, xs.reshape(-1)), what
                    stats = work.stats
                    assert stats.exchanges == 0 and stats.graph == "", what
                    if stats.decode_status is not None:
                        assert int(stats.decode_status) == 0, what
                    results.append((what, stats.algorithm, stats.gather_counts, stats.bytes_sent))
    return results


def test_bounds_plan_without_an_exchange(pools):
    """A call with bounds sums exactly, makes no exchange, and an all-reduce sizes its gather phase by bound."""
    per_rank = pools(3).run(_job_bounds, _seed("bounds"))
    for other in per_rank[1:]:  # every rank planned alike
        assert [r[:3] for r in other] == [r[:3] for r in per_rank[0]]
    for what, algorithm, gather, _ in per_rank[0]:
        if what.startswith("all_reduce") and algorithm != "native":
            assert gather == "bound", what
    # with a fixed format, looser bounds never send fewer bytes than exact ones
    sent = {what: sent for what, _, _, sent in per_rank[0]}
    for what, exact in sent.items():
        if what.endswith("slack=0") and " auto " not in what:
            assert sent[what.replace("slack=0", "slack=2")] >= exact, what


def _job_bad_bounds(rank, world):
    x = torch.zeros(world * TILE)
    layout = ChunkLayout.aligned(x.numel(), world, 1)
    full = [[p.numel for chunk in layout.pieces for p in chunk]] * world
    messages = []
    for bounds in ([[1] * world] * (world - 1), [[TILE + 1] * world] * world, [[-1] * world] * world, "nope"):
        try:
            spccl_train.all_reduce(x.clone(), bounds=bounds)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    try:
        spccl_train.all_reduce(x.clone(), bounds=full, config=CollectiveConfig(gather_counts="measured"))
        messages.append("no error")
    except ValueError as exc:
        messages.append(str(exc))
    # a bound the data breaks (on every rank): the reference encoder refuses to truncate
    y = torch.zeros(world * TILE)
    y[::2] = 1.0
    try:
        spccl_train.all_reduce(
            y, bounds=[[10] * world] * world, config=CollectiveConfig(format="pici", algorithm="direct")
        )
        messages.append("no error")
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_bad_bounds_raise(pools):
    for messages in pools(2).run(_job_bad_bounds):
        assert "it needs 2 rows" in messages[0], messages[0]
        assert "bounds[0][0] = 4097" in messages[1], messages[1]
        assert "bounds[0][0] = -1" in messages[2], messages[2]
        assert "bounds must be a sequence" in messages[3], messages[3]
        assert "gather_counts='measured'" in messages[4], messages[4]
        assert "too small for the Pici payload" in messages[5], messages[5]


def _encode(x: torch.Tensor, layout: ChunkLayout) -> EncodedPieces:
    """``x`` as an all-reduce's encoded input, the way the docs show any caller making one."""
    encoded = EncodedPieces.empty(layout, x.dtype, x.device)
    for i, piece in enumerate(encoded.pieces):
        encoded.nnz[i : i + 1] = compress_into("pici", x, encoded.payload(i), offset=piece.start, n=piece.numel)
    return encoded


def _job_encoded_input(rank, world, seed):
    """An all-reduce of encoded input equals the all-reduce of the tensor it encodes, bit for bit, on
    every path (direct sends the payloads; the others decode them first), whatever the tensor held."""
    n = 3 * TILE + 11
    cases = [
        ("auto", "auto", "auto", 1, None),
        ("direct", "pici", "auto", 2, None),
        ("direct", "pici", "measured", 2, None),
        ("direct", "auto", "auto", 1, None),
        ("direct", "coo", "auto", 1, None),
        ("ring", "pici", "auto", 2, None),
        ("auto", "dense", "auto", 1, None),  # native
        ("direct", "pici", "bound", 1, "bounds"),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for sparsity in (0.99, 0.5):
            xs = _inputs(_seed(seed, str(dtype), sparsity), world, n, dtype, sparsity, "random")
            for algorithm, fmt, gather, channels, bounds in cases:
                what = f"encoded {algorithm}/{fmt}/{gather} ch{channels} {dtype} {sparsity}"
                cfg = CollectiveConfig(format=fmt, algorithm=algorithm, channels=channels, gather_counts=gather)
                layout = ChunkLayout.of("all_reduce", n, world, channels)
                table = [[piece.numel for chunk in layout.pieces for piece in chunk]] * world if bounds else None
                plain = xs[rank].clone()
                spccl_train.all_reduce(plain, config=cfg, bounds=table)
                expected = last_stats()
                got = torch.full((n,), float("nan"), dtype=dtype)  # never read
                spccl_train.all_reduce(got, config=cfg, bounds=table, encoded=_encode(xs[rank], layout))
                stats = last_stats()
                _check_sum(got, xs, what)
                assert int(stats.decode_status) == 0, what
                chose = (stats.algorithm, stats.format, stats.gather_counts)
                if chose == (expected.algorithm, expected.format, expected.gather_counts):  # auto learns between calls
                    # bit for bit, but for the sign of zero: a payload carries -0.0 as zero (FORMATS.md)
                    assert torch.equal((got + 0.0).view(INT_OF[dtype]), (plain + 0.0).view(INT_OF[dtype])), what
                    assert stats.bytes_sent == expected.bytes_sent, what
                else:
                    assert "auto" in (algorithm, fmt), what  # native was weighed too
    # payloads of another cut are refused on every rank, also when one rank alone has them (no hang)
    good = _encode(xs[rank], ChunkLayout.of("all_reduce", n, world, 1))
    other = _encode(xs[rank], ChunkLayout.of("all_reduce", n, world, 2))
    for enc in (other, other if rank == 0 else good):
        with pytest.raises(ValueError, match="encoded input does not fit the call"):
            spccl_train.all_reduce(torch.empty(n, dtype=xs.dtype), encoded=enc)
    assert other.mismatch(xs[rank], good.layout).startswith("encoded payloads are of")
    with pytest.raises(TypeError, match="encoded must be an EncodedPieces"):
        spccl_train.all_reduce(torch.empty(n, dtype=xs.dtype), encoded=xs[rank])
    return True


def test_encoded_input(pools):
    pools(3).run(_job_encoded_input, _seed("encoded input"))
