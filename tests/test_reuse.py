"""Plans reused across exchanged calls (``collectives/reuse.py``): bounds above the counts, kept by
the group while later counts fit them, and the calls that run on them stay exact and equal on
every rank."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch

import spccl_train
from spccl_train.collectives import ChunkLayout, CollectiveConfig, last_stats, reuse
from spccl_train.collectives.exchange import Counts

SEED = int(os.environ.get("SPCCL_TEST_SEED", random.SystemRandom().randrange(2**31)))


def test_bounds_hold_every_count_within_their_piece_and_fit_until_counts_leave_them():
    rng = np.random.default_rng(SEED)
    for _ in range(200):
        rows, cols = rng.integers(1, 6, size=2)
        limits = rng.integers(0, 1 << rng.integers(1, 22), size=(rows, cols))
        table = (limits * rng.random((rows, cols)) ** rng.integers(1, 8)).astype(np.int64)
        bounds = reuse.headroom(table, limits)
        assert (table <= bounds).all() and (bounds <= limits).all(), f"SPCCL_TEST_SEED={SEED}"
        c = table.astype(np.float64)
        assert (bounds <= table + np.ceil(c * reuse.HEADROOM + 4 * np.sqrt(c)) + 16).all(), f"SPCCL_TEST_SEED={SEED}"
        assert reuse.fits(table, bounds), f"SPCCL_TEST_SEED={SEED}"
        grown = table.copy()
        at = tuple(rng.integers(0, s) for s in table.shape)
        if bounds[at] < limits[at]:  # one count over its bound: no fit
            grown[at] = bounds[at] + 1
            assert not reuse.fits(grown, bounds), f"SPCCL_TEST_SEED={SEED}"
        loose = bounds.copy()  # one bound far above its count: no fit
        loose[at] = table[at] + math.ceil(table[at] * reuse.LOOSE + 8 * math.sqrt(table[at])) + 33
        assert not reuse.fits(table, loose), f"SPCCL_TEST_SEED={SEED}"


def test_a_store_keeps_the_last_entry_per_shape_and_starts_over_when_full():
    store = reuse.PlanStore()
    table = np.array([[100, 0], [5, 7]])
    bounds = reuse.headroom(table, np.full_like(table, 1000))
    entry = store.put("a", reuse.Reused(Counts("all_reduce", None, None, None, bounds), None))
    assert store.get("a", table) is entry and store.get("b", table) is None
    assert store.get("a", table * 3) is None  # grown past the bounds
    for k in range(reuse.MAX_SHAPES - 1):
        store.put(k, entry)
    assert store.get("a", table) is entry  # MAX_SHAPES shapes held
    store.put("one more", entry)
    assert store.get("a", table) is None and store.get("one more", table) is entry


def _fresh(n: int, density: float, layout: ChunkLayout, gen: torch.Generator) -> torch.Tensor:
    """Fresh positions and values, ``round(density * size)`` nonzeros in every piece of ``layout``:
    counts of independent nonzeros vary by about their square root, and pieces of a hundred
    nonzeros (these) then leave their bounds by chance in about 1% of seeds (:data:`reuse.LOOSE`),
    which is no property of the reuse to test."""
    x = torch.zeros(n)
    for piece in (p for chunk in layout.pieces for p in chunk):
        k = round(density * piece.numel)
        x[piece.start + torch.randperm(piece.numel, generator=gen)[:k]] = torch.randn(k, generator=gen)
    return x


def _job_reuse(rank, world, seed):
    """All-reduces of fresh data at one density reuse the first call's bounds; a denser call, then
    a much sparser one, plan anew. Each call is exact; the bounds are returned for the ranks to compare."""
    cfg = CollectiveConfig(format="pici", algorithm="direct")
    n = world * 3 * 4096 + 77
    layout = ChunkLayout.of("all_reduce", n, world, cfg.channels)
    out = []
    for call, density in enumerate([0.05, 0.05, 0.05, 0.2, 0.01, 0.01]):
        gen = torch.Generator().manual_seed(seed * 1000 + call)
        xs = [_fresh(n, density, layout, gen) for _ in range(world)]
        x = xs[rank].clone()
        spccl_train.all_reduce(x, config=cfg)
        ref = sum(xs[1:], xs[0].clone())  # (the sum's order differs: float32 rounding apart)
        zero = torch.stack(xs).eq(0).all(0)
        exact = torch.allclose(x, ref, rtol=1e-6, atol=1e-6) and bool(x[zero].eq(0).all())
        stats = last_stats()
        out.append((exact, stats.planned_from.tobytes()))
    return out


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    from _pool import pool_factory

    yield from pool_factory(tmp_path_factory, "reuse")


@pytest.mark.parametrize("world", [2, 3])
def test_repeated_calls_reuse_their_bounds_until_the_density_moves(pools, world):
    got = pools(world).run(_job_reuse, SEED % 10_000)
    assert all(g == got[0] for g in got), f"every rank plans alike (SPCCL_TEST_SEED={SEED})"
    exact = [e for e, _ in got[0]]
    assert all(exact), f"SPCCL_TEST_SEED={SEED}"
    bounds = [b for _, b in got[0]]
    assert bounds[0] == bounds[1] == bounds[2], f"fresh data, same density: reused (SPCCL_TEST_SEED={SEED})"
    assert bounds[3] != bounds[2], f"4x denser: planned anew (SPCCL_TEST_SEED={SEED})"
    assert bounds[4] != bounds[3] and bounds[4] == bounds[5], f"20x sparser: anew, then reused (SPCCL_TEST_SEED={SEED})"


def _job_two_groups(rank, world, seed):
    """Two groups of the same two ranks, their calls interleaved at different densities: each
    group reuses its own bounds (the store is the group's, not the process's)."""
    import torch.distributed as dist

    groups = (dist.new_group([0, 1]), dist.new_group([0, 1]))
    if rank > 1:
        return []
    cfg = CollectiveConfig(format="pici", algorithm="direct", cost_model="default")  # one model: alike calls
    n = 2 * 3 * 4096
    layout = ChunkLayout.of("all_reduce", n, 2, cfg.channels)
    out = []
    for call in range(6):
        density = 0.05 if call % 2 == 0 else 0.25
        gen = torch.Generator().manual_seed(seed * 1000 + call)
        xs = [_fresh(n, density, layout, gen) for _ in range(2)]
        x = xs[rank].clone()
        spccl_train.all_reduce(x, groups[call % 2], config=cfg)
        out.append(last_stats().planned_from.tobytes())
    return out


def test_each_group_keeps_its_own_bounds(pools):
    got = pools(3).run(_job_two_groups, SEED % 10_000)
    assert got[0] == got[1] and got[2] == [], f"SPCCL_TEST_SEED={SEED}"
    a, b = got[0][0::2], got[0][1::2]
    assert a[0] == a[1] == a[2] and b[0] == b[1] == b[2] and a[0] != b[0], f"SPCCL_TEST_SEED={SEED}"
