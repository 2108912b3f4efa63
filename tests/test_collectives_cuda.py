"""The collectives over NCCL with the CUDA kernels, against a float64 dense reference.

Skipped without a GPU and the compiled kernels. On the GPU machine:
``NCCL_NVLS_ENABLE=0 python -m pytest tests/test_collectives_cuda.py -q``. The multi-rank tests
spawn one process per GPU (up to 4; two sharing the GPU as emulated nodes on a machine of one,
``tests/_gpu_ranks.py``) with a ``file://`` rendezvous under tmp_path; each rank runs every
collective x algorithm x format x dtype x sparsity x channel count and writes its failures to a
file the test reads.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist

import spccl_train
from spccl_train._ext import kernels_available
from spccl_train.collectives import ChunkLayout, CollectiveConfig, last_stats
from spccl_train.collectives.chunking import _count_with_encoder, count_nonzero_pieces

from _gpu_ranks import gpu_world, init_gpu_rank  # noqa: I001 (a sibling test module)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels_available()),
    reason="needs a GPU and the compiled spccl CUDA kernels (torch.ops.spccl)",
)

EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aligned, world, channels", [(True, 4, 3), (False, 3, 2), (True, 2, 1)])
def test_encoder_counts_match_torch(dtype, aligned, world, channels):
    # on CUDA the counts come from Triton's counter, or (without Triton) from one launch of the
    # Pici encoder writing metadata only: both are checked
    n = world * (3 * 4096 + 77)
    layout = ChunkLayout.aligned(n, world, channels) if aligned else ChunkLayout.equal(n, world, channels)
    x = torch.randn(n, device="cuda").to(dtype)
    x[torch.rand(n, device="cuda") < 0.9] = 0
    expected = [int((x[p.start : p.stop] != 0).sum()) for chunk in layout.pieces for p in chunk]
    assert count_nonzero_pieces(x, layout).tolist() == expected
    own = layout.chunks[1]
    alone = x[own.start : own.stop].clone()
    assert count_nonzero_pieces(alone, layout, [1], base=own.start).tolist() == expected[channels : 2 * channels]
    assert _count_with_encoder(x, layout, list(range(world)), 0).tolist() == expected
    assert _count_with_encoder(alone, layout, [1], own.start).tolist() == expected[channels : 2 * channels]


def _finish_rank(rank: int, out_dir: str, failures: list[str]) -> None:
    """Write this rank's failures (an empty file: none) where the test reads them; leave the group."""
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures))
    dist.destroy_process_group()


def _run_ranks(fn, tmp_path, monkeypatch) -> None:
    """Spawn ``fn(rank, world, init_file, out_dir)`` on up to 4 GPUs and fail with any rank's failures."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # NVLink multicast can take shared GPUs out of service
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    world = gpu_world()
    torch.multiprocessing.spawn(fn, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world)
    for rank in range(world):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "", (tmp_path / f"rank{rank}.txt").read_text()


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dev = init_gpu_rank(rank, world, init_file)
    failures = []
    cases = itertools.product(
        ["all_reduce", "reduce_scatter", "all_gather"],
        ["ring", "direct"],
        ["pici", "coo", "dense", "auto"],
        [torch.float32, torch.bfloat16, torch.float16],
        [0.0, 0.5, 0.99, 1.0],
        [1, 3],
    )
    for collective, algorithm, fmt, dtype, sparsity, channels in cases:
        n = world * (3 * 4096 + 77)
        g = torch.Generator(device=dev).manual_seed(int(sparsity * 100) + channels)
        xs = torch.randn(world, n, device=dev, generator=g)
        xs[torch.rand(world, n, device=dev, generator=g) < sparsity] = 0
        xs = xs.to(dtype)
        ref = xs.double().sum(0)
        tol = 2 * world * EPS[dtype] * xs.double().abs().sum(0)
        cfg = CollectiveConfig(format=fmt, algorithm=algorithm, channels=channels, ranks_per_node=2)
        mine = xs[rank].clone()
        if collective == "all_reduce":
            out = mine
            spccl_train.all_reduce(out, config=cfg)
            ok = bool(((out.double() - ref).abs() <= tol).all())
        elif collective == "reduce_scatter":
            out = torch.empty(n // world, device=dev, dtype=dtype)
            spccl_train.reduce_scatter_tensor(out, mine, config=cfg)
            part = slice(rank * (n // world), (rank + 1) * (n // world))
            ok = bool(((out.double() - ref[part]).abs() <= tol[part]).all()) and torch.equal(mine, xs[rank])
        else:
            out = torch.empty(world * n, device=dev, dtype=dtype)
            spccl_train.all_gather_into_tensor(out, mine, config=cfg)
            ok = torch.equal(out, xs.reshape(-1))
        stats = last_stats()
        if stats.decode_status is not None and int(stats.decode_status):
            ok = False
        if not ok:
            failures.append(f"{collective} {algorithm} {fmt} {dtype} sparsity={sparsity} channels={channels}")
    _finish_rank(rank, out_dir, failures)


def test_collectives_over_nccl(tmp_path, monkeypatch):
    _run_ranks(_rank, tmp_path, monkeypatch)


def _rank_scalable(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The scalable count exchange over NCCL (forced on this small group): all-reduce (max) of the
    headers, all-to-all of int64 counts, sums and maxima; then a native call without an exchange."""
    os.environ["SPCCL_SCALABLE_EXCHANGE_WORLD"] = "2"
    dev = init_gpu_rank(rank, world, init_file)
    failures = []
    cases = itertools.product(
        ["all_reduce", "reduce_scatter", "all_gather"], ["pici", "coo", "auto"], [torch.float32, torch.bfloat16],
        [0.5, 0.99], [1, 2],
    )  # fmt: skip
    for collective, fmt, dtype, sparsity, channels in cases:
        what = f"scalable {collective} {fmt} {dtype} sparsity={sparsity} channels={channels}"
        n = world * (3 * 4096 + 77)
        g = torch.Generator(device=dev).manual_seed(int(sparsity * 100) + channels)
        xs = torch.randn(world, n, device=dev, generator=g)
        xs[torch.rand(world, n, device=dev, generator=g) < sparsity] = 0
        xs = xs.to(dtype)
        cfg = CollectiveConfig(format=fmt, algorithm="auto" if fmt == "auto" else "direct", channels=channels)
        mine = xs[rank].clone()
        out_numel = {"all_reduce": n, "reduce_scatter": n // world, "all_gather": world * n}[collective]
        out = mine if collective == "all_reduce" else torch.empty(out_numel, device=dev, dtype=dtype)
        if collective == "all_reduce":
            spccl_train.all_reduce(out, config=cfg)
        elif collective == "reduce_scatter":
            spccl_train.reduce_scatter_tensor(out, mine, config=cfg)
        else:
            spccl_train.all_gather_into_tensor(out, mine, config=cfg)
        stats = last_stats()
        if stats.exchange != "scalable" or not _matches(collective, out, xs, rank) or int(stats.decode_status or 0):
            failures.append(f"{what}: {stats.exchange} {stats.algorithm}")
    first = CollectiveConfig(check_calls="first")
    seen = []
    for _ in range(3):
        x = torch.full((1000,), float(rank + 1), device=dev)
        spccl_train.all_reduce(x, config=first)
        seen.append(last_stats().exchanges)
        if not torch.equal(x, torch.full_like(x, world * (world + 1) / 2)):
            failures.append("native without an exchange: wrong result")
    if seen != [3, 0, 0]:  # the first: the scalable exchange's three synchronisations; then none
        failures.append(f"native without an exchange: exchanges {seen}")
    _finish_rank(rank, out_dir, failures)


def test_scalable_exchange_over_nccl(tmp_path, monkeypatch):
    _run_ranks(_rank_scalable, tmp_path, monkeypatch)


def _piece_bounds(mask: torch.Tensor, layout: ChunkLayout, collective: str) -> list[list[int]]:
    """Exact per-piece nonzero counts of every rank's support (row q: rank q), as ``bounds=`` takes them."""
    rows = []
    for q in range(mask.shape[0]):
        m = mask[q]
        if collective == "all_gather":
            own = layout.chunks[q].start
            row = [int(m[p.start - own : p.stop - own].sum()) for p in layout.pieces[q]]
            row += [0] * (layout.world - 1) * layout.channels
        else:
            row = [int(m[p.start : p.stop].sum()) for chunk in layout.pieces for p in chunk]
        rows.append(row)
    return rows


def _matches(collective: str, out: torch.Tensor, xs: torch.Tensor, rank: int) -> bool:
    """``out`` is this rank's result of ``collective`` over the rows of ``xs`` (one per rank): sums
    within the rounding of ``world`` additions, an all-gather exactly."""
    world, n = xs.shape
    if collective == "all_gather":
        return torch.equal(out, xs.reshape(-1))
    ref = xs.double().sum(0)
    tol = 2 * world * EPS[xs.dtype] * xs.double().abs().sum(0)
    if collective == "reduce_scatter":
        part = slice(rank * (n // world), (rank + 1) * (n // world))
        ref, tol = ref[part], tol[part]
    return bool(((out.double() - ref).abs() <= tol).all())


def _rank_graphs(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from spccl_train.collectives import cached_graphs, clear_graphs

    dev = init_gpu_rank(rank, world, init_file)
    failures = []
    cases = itertools.product(
        ["all_reduce", "reduce_scatter", "all_gather"],
        ["ring", "direct"],
        ["pici", "coo", "auto"],
        [torch.float32, torch.bfloat16],
    )
    for collective, algorithm, fmt, dtype in cases:
        what = f"{collective} {algorithm} {fmt} {dtype}"
        n, channels = world * (3 * 4096 + 77), 2
        layout = ChunkLayout.of(collective, world * n if collective == "all_gather" else n, world, channels)
        g = torch.Generator(device=dev).manual_seed(7)
        mask = torch.rand(world, n, device=dev, generator=g) < 0.02  # the same support every iteration
        bounds = _piece_bounds(mask.cpu(), layout, collective)
        cfg = CollectiveConfig(format=fmt, algorithm=algorithm, channels=channels, cuda_graphs=True)
        mine = torch.empty(n, device=dev, dtype=dtype)
        out_numel = {"all_reduce": n, "reduce_scatter": n // world, "all_gather": world * n}[collective]
        out = mine if collective == "all_reduce" else torch.empty(out_numel, device=dev, dtype=dtype)
        seen, clean = [], None

        def call(x, async_op):
            kwargs = {"config": cfg, "bounds": bounds, "graph_tag": what, "async_op": async_op}
            if collective == "all_reduce":
                return spccl_train.all_reduce(x, **kwargs)
            if collective == "reduce_scatter":
                return spccl_train.reduce_scatter_tensor(out, x, **kwargs)
            return spccl_train.all_gather_into_tensor(out, x, **kwargs)

        for it in range(5):
            xs = (torch.randn(world, n, device=dev, generator=g) * mask).to(dtype)
            if it == 4:  # one piece over its bound on every rank: truncated, and reported by this replay only
                xs[:, : 4096 * 2] = 1.0
            mine.copy_(xs[rank])
            work = call(mine, async_op=it % 2 == 1)
            if work is not None:  # async: the result is ordered after wait()
                work.wait()
            stats = work.stats if work is not None else last_stats()
            seen.append(stats.graph)
            if it == 4:  # the ranks that decode a truncated payload report it; the previous replay's copy stays clean
                anywhere = torch.tensor([int(stats.decode_status)], device=dev)
                dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
                if not int(anywhere) and stats.algorithm != "native":
                    failures.append(f"{what}: a broken bound was not reported ({stats.algorithm}/{stats.format})")
                if int(clean.decode_status):
                    failures.append(f"{what}: a later replay changed an earlier call's decode status")
                continue
            clean = stats
            status = int(stats.decode_status)
            ok = _matches(collective, out, xs, rank)
            if not ok or status:
                failures.append(f"{what} iteration {it}: wrong result or decode status {status} ({stats.graph!r})")
        try:  # every rank passes another tensor under the same tag: every rank raises, before any transfer
            call(mine.clone(), async_op=False)
            failures.append(f"{what}: a replay with another tensor did not raise")
        except ValueError as exc:
            if "captured with other tensors" not in str(exc):
                failures.append(f"{what}: {exc}")
        if seen != ["", "captured", "replayed", "replayed", "replayed"]:
            failures.append(f"{what}: graph modes {seen}")
    if cached_graphs() == 0:
        failures.append("no graph cached")
    clear_graphs()
    _finish_rank(rank, out_dir, failures)


def test_bounded_calls_replay_cuda_graphs(tmp_path, monkeypatch):
    """cuda_graphs: eager, then captured, then replayed, each result exact on fresh data in the same tensors."""
    _run_ranks(_rank_graphs, tmp_path, monkeypatch)


def _rank_graphs_exchanged(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from spccl_train.collectives import clear_graphs

    dev = init_gpu_rank(rank, world, init_file)
    failures = []
    cases = itertools.product(
        ["all_reduce", "reduce_scatter", "all_gather"], ["pici", "auto"], [torch.float32, torch.bfloat16]
    )
    for collective, fmt, dtype in cases:
        what = f"{collective} {fmt} {dtype}"
        n = world * (3 * 4096 + 77)
        cfg = CollectiveConfig(format=fmt, algorithm="direct", channels=2, cuda_graphs=True)
        mine = torch.empty(n, device=dev, dtype=dtype)
        out_numel = {"all_reduce": n, "reduce_scatter": n // world, "all_gather": world * n}[collective]
        out = mine if collective == "all_reduce" else torch.empty(out_numel, device=dev, dtype=dtype)
        g = torch.Generator(device=dev).manual_seed(11)
        modes = []
        for it, density in enumerate([0.02] * 5 + [0.2, 0.02]):  # a denser call outgrows the bounds
            xs = torch.randn(world, n, device=dev, generator=g)
            xs = (xs * (torch.rand(world, n, device=dev, generator=g) < density)).to(dtype)  # a new support each call
            mine.copy_(xs[rank])
            kwargs = {"config": cfg, "graph_tag": what}
            if collective == "all_reduce":
                spccl_train.all_reduce(mine, **kwargs)
            elif collective == "reduce_scatter":
                spccl_train.reduce_scatter_tensor(out, mine, **kwargs)
            else:
                spccl_train.all_gather_into_tensor(out, mine, **kwargs)
            stats = last_stats()
            modes.append(stats.graph)
            ok = _matches(collective, out, xs, rank)
            if not ok or int(stats.decode_status) or stats.exchanges != 1:
                failures.append(
                    f"{what} call {it}: ok={ok} status={int(stats.decode_status)} exchanges={stats.exchanges}"
                )
        if stats.algorithm != "native" and modes[:5] != ["", "captured", "replayed", "replayed", "replayed"]:
            failures.append(f"{what}: graph modes {modes}")
        if modes[5] != "" and stats.algorithm != "native":
            failures.append(f"{what}: the call that outgrew the bounds ran as {modes[5]!r}, not eagerly")
    clear_graphs()
    _finish_rank(rank, out_dir, failures)


def test_graphed_calls_without_bounds_plan_from_exchanged_counts(tmp_path, monkeypatch):
    """cuda_graphs without bounds: one count exchange per call, bounds derived from it and kept while
    the counts fit, so calls on fresh supports replay; a call that outgrows them runs eagerly."""
    _run_ranks(_rank_graphs_exchanged, tmp_path, monkeypatch)
