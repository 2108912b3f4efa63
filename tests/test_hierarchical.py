"""The hierarchical collectives on gloo with simulated nodes: 4 x 2, 3 x 4 and 2 x 8 ranks (and the
flat ring and direct algorithms on the same nodes, every collective and format).

Each all-reduce case checks, against the float64 sum of every rank's input: the result within
the rounding of ``world`` additions, positions zero on every rank exactly zero, and the result
bit-identical on every rank (up to the sign of zero). Odd lengths (not a multiple of the ranks
per node, so the slices are padded), every format, float32 and bfloat16, sparsity 0.5 / 0.99 /
1.0, random and disjoint supports. The all-gather is exact and the reduce-scatter within the same
rounding, inputs unchanged. Also: it sends fewer bytes across nodes than the flat direct
algorithm where fill-in saturates, ``auto`` weighs it by the network and runs what it chose, and bad calls raise
the same error on every rank. Inputs are fresh every run (the seed of
``tests/test_collectives.py``, printed on failure, replays them).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
from _pool import pool_factory
from test_collectives import DTYPES, INT_OF, SEED, _check_sum, _digest, _inputs, _lengths, _run_one, _seed

import spccl_train
from spccl_train.collectives import CollectiveConfig, CostModel, Topology, choose, hierarchical, last_stats
from spccl_train.collectives.choice import clear_decisions
from spccl_train.collectives.chunking import ChunkLayout
from spccl_train.collectives.cost import CodecCost, LinkCost


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    yield from pool_factory(tmp_path_factory, f"SPCCL_TEST_SEED={SEED}")


def _job_hierarchical(rank, world, seed, rpn, cases):
    digests = []
    for fmt, dtype_name, sparsity, support, n in cases:
        what = f"hierarchical {world // rpn}x{rpn} {fmt} {dtype_name} sparsity={sparsity} {support} n={n}"
        xs = _inputs(
            _seed(seed, fmt, dtype_name, sparsity, support, n), world, n, DTYPES[dtype_name], sparsity, support
        )
        out = xs[rank].clone()
        cfg = CollectiveConfig(format=fmt, algorithm="hierarchical", ranks_per_node=rpn)
        work = spccl_train.all_reduce(out, config=cfg, async_op=True)
        work.wait()
        _check_sum(out, xs, what)
        stats = work.stats
        assert stats is last_stats() and stats.algorithm == "hierarchical", what
        # the flat exchange, then one per step (one more where a step measures its gather phase)
        assert stats.exchanges >= 4 and stats.dense_bytes > 0, (what, stats.exchanges)
        assert stats.decode_status is None or int(stats.decode_status.max()) == 0, what
        digests.append(_digest(out))
        # the same inputs, gathered and scattered
        mine = xs[rank].clone()
        gathered = torch.empty(world * n, dtype=mine.dtype)
        spccl_train.all_gather_into_tensor(gathered, mine, config=cfg)
        assert torch.equal(gathered, xs.reshape(-1)), f"{what}: all-gather is not exact"
        assert last_stats().algorithm == "hierarchical", what
        chunk = n - n % world
        shard = torch.empty(chunk // world, dtype=mine.dtype)
        spccl_train.reduce_scatter_tensor(shard, mine[:chunk], config=cfg)
        assert torch.equal(mine.view(INT_OF[mine.dtype]), xs[rank].view(INT_OF[mine.dtype])), f"{what}: input modified"
        _check_sum(shard, xs[:, :chunk].reshape(world, world, -1)[:, rank], f"{what} reduce-scatter")
        assert last_stats().algorithm == "hierarchical", what
    return digests


CASES = [
    ("pici", "fp32", 0.99, "random", 8 * 4096 + 777),
    ("coo", "bf16", 0.99, "disjoint", 8 * 1001 + 3),
    ("auto", "fp32", 0.5, "random", 8 * 513 + 5),
    ("dense", "bf16", 0.5, "disjoint", 8 * 77 + 1),
    ("auto", "fp32", 1.0, "random", 8 * 97 + 7),
]


@pytest.mark.parametrize("world, rpn", [(8, 2), (12, 4), (16, 8)])
def test_hierarchical_all_reduce_is_exact_and_identical_on_every_rank(pools, world, rpn):
    got = pools(world).run(_job_hierarchical, _seed("hierarchical", world), rpn, CASES)
    assert all(g == got[0] for g in got), "ranks hold different bits"


def _job_bytes(rank, world, seed, rpn):
    """Where fill-in saturates (each rank 20% dense, 8 ranks as 2 nodes of 4): what crosses the
    network. Flat direct: each rank's messages to the ranks of the other node, about
    ``(p - L) / (p - 1)`` of what it sends (i.i.d. data, equal chunks). Hierarchical: its step
    across nodes, the node sums of one slice in four."""
    n = world * 4096
    xs = _inputs(_seed(seed, "bytes"), world, n, torch.float32, 0.8, "random")
    sent = {}
    for algorithm in ("direct", "hierarchical"):
        out = xs[rank].clone()
        spccl_train.all_reduce(out, config=CollectiveConfig(format="pici", algorithm=algorithm, ranks_per_node=rpn))
        _check_sum(out, xs, algorithm)
        stats = last_stats()
        if algorithm == "direct":
            sent[algorithm] = stats.bytes_sent * (world - rpn) / (world - 1)
        else:
            assert len(stats.steps) == 3 and stats.bytes_sent == sum(s.bytes_sent for s in stats.steps)
            sent[algorithm] = stats.steps[1].bytes_sent
    return sent


def test_hierarchical_sends_fewer_bytes_across_nodes_where_fill_in_saturates(pools):
    got = pools(8).run(_job_bytes, _seed("hierarchical bytes"), 4)
    across = {a: sum(g[a] for g in got) for a in ("direct", "hierarchical")}
    # the node sums of a quarter of the tensor, dense by then (59% of positions nonzero): about 0.4 of
    # what flat direct sends across, which sends each rank's sparse data to every rank of the other node
    assert across["hierarchical"] < 0.5 * across["direct"], across


def _job_bad(rank, world, case):
    x = torch.ones(world * 8)
    try:
        if case == "size":  # one rank's tensor is longer: the flat exchange catches it on every rank
            spccl_train.all_reduce(
                torch.ones(world * 8 + (rank == 1)), config=CollectiveConfig(algorithm="hierarchical", ranks_per_node=2)
            )
        elif case == "subgroup":  # every rank, but not the default group: no subgroups can be made of it
            group = dist.new_group(list(range(world)))
            spccl_train.all_reduce(x, group=group, config=CollectiveConfig(algorithm="hierarchical", ranks_per_node=2))
        elif case == "environment":  # the launch tells ranks different node sizes
            os.environ["SPCCL_RANKS_PER_NODE"] = "2" if rank < 2 else "1"
            try:
                spccl_train.all_reduce(x, config=CollectiveConfig(algorithm="hierarchical"))
            finally:
                del os.environ["SPCCL_RANKS_PER_NODE"]
        elif case == "bounds":
            spccl_train.all_reduce(x, config=CollectiveConfig(algorithm="hierarchical"), bounds=[[8] * world] * world)
        else:
            spccl_train.all_reduce(x, config=CollectiveConfig(algorithm="hierarchical", ranks_per_node=3))
    except ValueError as exc:
        message = str(exc)
    else:
        message = ""
    # the group stays usable
    y = torch.full((5,), float(rank))
    spccl_train.all_reduce(y, config=CollectiveConfig(algorithm="hierarchical", ranks_per_node=2))
    assert torch.equal(y, torch.full((5,), float(sum(range(world)))))
    return message


@pytest.mark.parametrize(
    "case, message",
    [
        ("size", "numel"),
        ("subgroup", "runs on the default group only"),
        ("environment", "config"),
        ("bounds", "bounds= is not supported with algorithm='hierarchical'"),
        ("uneven", "4 ranks are not a multiple of ranks_per_node=3"),
    ],
)
def test_bad_hierarchical_calls_raise_alike_on_every_rank(pools, case, message):
    got = pools(4).run(_job_bad, case)
    assert all(g == got[0] for g in got) and message in got[0], got


# ----------------------------------------------------------------------------- auto weighs it


def _model(inter_bandwidth: float) -> CostModel:
    """Fast links and codecs inside a node; the network at ``inter_bandwidth`` bytes per second."""
    rates = CodecCost(compress=1e11, decompress=1e11, accumulate=1e11, call_s=1e-6)
    return CostModel(
        intra=LinkCost(latency_s=5e-6, bandwidth=2e11),
        inter=LinkCost(latency_s=2e-5, bandwidth=inter_bandwidth),
        pici=rates,
        coo=rates,
        reduce=1e11,
        copy=2e11,
        count=2e11,
        exchange_s=5e-5,
    )


def _weigh(world, rpn, density, inter_bandwidth, numel=1 << 24):
    layout = ChunkLayout.of("all_reduce", numel, world)
    table = [[round(density * p.numel) for chunk in layout.pieces for p in chunk] for _ in range(world)]
    topology, model = Topology(world, rpn), _model(inter_bandwidth)
    return choose("all_reduce", CollectiveConfig(), table, layout, torch.float32, topology, model, default_group=True)


def test_auto_weighs_the_hierarchical_all_reduce_by_the_network():
    # 4 nodes of 8 at 5% density each: the flat algorithms send the filled-in sums over the network
    slow_best, slow = _weigh(32, 8, 0.05, inter_bandwidth=2e9)
    fast_best, fast = _weigh(32, 8, 0.05, inter_bandwidth=2e11)
    assert slow_best.algorithm == "hierarchical", slow
    # it sends about 1/8 of the flat algorithms' bytes across the network
    assert slow["hierarchical"] < 0.5 * min(slow[n] for n in ("ring/pici", "direct/pici", "ring/coo", "direct/coo"))
    # on a network as fast as the node's links its steps go native, and then it is not weighed
    assert fast_best.algorithm != "hierarchical" and "hierarchical" not in fast, fast
    # one node, or one rank per node: not weighed
    assert "hierarchical" not in _weigh(8, None, 0.05, 2e9)[1] and "hierarchical" not in _weigh(8, 1, 0.05, 2e9)[1]
    # a call on a subgroup: its subgroups cannot be made, so it is not weighed
    layout = ChunkLayout.of("all_reduce", 1 << 24, 32)
    table = [[round(0.05 * p.numel) for chunk in layout.pieces for p in chunk] for _ in range(32)]
    _, weighed = choose("all_reduce", CollectiveConfig(), table, layout, torch.float32, Topology(32, 8), _model(2e9))
    assert "hierarchical" not in weighed


def test_the_hierarchical_steps_are_looked_up_in_curves_made_once():
    """A step is weighed at every density of the decision grid once (per step shape, config and
    model); another sparsity profile looks its steps up in the same curves, and a curve made again
    is the same (the memo is pure)."""
    clear_decisions(curves=True)
    first = _weigh(32, 8, 0.05, inter_bandwidth=2e9)[1]["hierarchical"]
    made = {key: tuple(dict(c) for c in curves) for key, curves in hierarchical._curves.items()}
    [curves] = made.values()
    assert len(curves) == 3, "one curve per step: the reduce-scatter and the all-gather inside a node, across once"
    other = _weigh(32, 8, 0.0123, inter_bandwidth=2e9)[1]["hierarchical"]
    assert hierarchical._curves.keys() == made.keys() and other != first
    clear_decisions()  # the decisions only
    assert hierarchical._curves.keys() == made.keys()
    clear_decisions(curves=True)
    assert not hierarchical._curves
    assert _weigh(32, 8, 0.05, inter_bandwidth=2e9)[1]["hierarchical"] == first
    assert {key: tuple(dict(c) for c in curves) for key, curves in hierarchical._curves.items()} == made


def _job_auto_hierarchical(rank, world, seed, rpn):
    n = world * 4096 + 333
    xs = _inputs(_seed(seed, "auto"), world, n, torch.float32, 0.95, "random")
    out = xs[rank].clone()
    spccl_train.all_reduce(out, config=CollectiveConfig(ranks_per_node=rpn, cost_model=_model(1e7)))
    _check_sum(out, xs, "auto over a slow network")
    stats = last_stats()
    return stats.algorithm, stats.exchanges, _digest(out)


def test_auto_runs_the_hierarchical_all_reduce_it_chose(pools):
    got = pools(8).run(_job_auto_hierarchical, _seed("auto hierarchical"), 2)
    assert all(g == got[0] for g in got), got
    algorithm, exchanges, _ = got[0]
    # the flat exchange, then one per step (the step across nodes may measure its gather phase: one more)
    assert algorithm == "hierarchical" and exchanges in (4, 5), got[0]


# ----------------------------------------------------------------------------- flat algorithms on the same nodes


def _job_flat_on_nodes(rank, world, seed, rpn):
    """Every collective, flat algorithm and format on simulated nodes (the plan rules re-derived from
    the data by tests/test_collectives.py's checks); all-reduce digests for the cross-rank check."""
    digests = []
    for i, (collective, algorithm, fmt) in enumerate(
        itertools.product(
            ("all_reduce", "reduce_scatter", "all_gather"), ("ring", "direct"), ("pici", "coo", "dense", "auto")
        )
    ):
        sparsity, support = ((0.99, "random"), (0.5, "disjoint"))[i % 2]
        dtype = ("fp32", "bf16")[i // 2 % 2]
        (n, channels) = _lengths(collective, world)[i % 2]
        what = f"{world // rpn}x{rpn} {collective} {algorithm} {fmt} {dtype} {sparsity} {support} n={n}"
        xs = _inputs(_seed(seed, i), world, n, DTYPES[dtype], sparsity, support)
        cfg = CollectiveConfig(format=fmt, algorithm=algorithm, ranks_per_node=rpn, channels=channels)
        digest = _run_one(rank, world, collective, xs, cfg, what)
        if collective == "all_reduce":
            digests.append(digest)
    return digests


@pytest.mark.parametrize("world, rpn", [(8, 2), (12, 4), (16, 8)])
def test_flat_algorithms_on_simulated_nodes(pools, world, rpn):
    got = pools(world).run(_job_flat_on_nodes, _seed("flat on nodes", world), rpn)
    assert all(g == got[0] for g in got), "all-reduce results differ between ranks"


# ----------------------------------------------------------------------------- nodes of a subgroup


@pytest.mark.parametrize(
    "members, launch, expected",
    [
        (range(16), 8, 8),  # the world in order
        (range(16), 16, None),  # one node
        (range(12), 8, 8),  # a short last node
        ([0, 4, 8, 12], 8, 2),  # data parallel beside tensor parallel 4
        ([2, 3, 0, 1], 2, 2),  # nodes in another order
        ([0, 2, 1, 3], 2, 1),  # a node's members apart: every hop taken as across nodes
        ([3, 4, 5, 6, 7], 4, 1),  # a short first block
        ([0, 1, 2, 4], 4, 3),  # a short last node
        ([0, 1, 4, 5, 6, 8], 4, 1),  # uneven blocks (2, then 3)
        ([0, 8], 8, 1),  # one rank per node
    ],
)
def test_a_groups_nodes_come_from_its_members_global_ranks(members, launch, expected):
    from spccl_train.collectives.context import group_ranks_per_node

    assert group_ranks_per_node(list(members), launch) == expected
