"""Pruning to the wire (``Pruner.prune_to_wire``): the fused pass equals pruning then encoding.

CPU (in CI): the fused torch reference against the unfused reference (prune in place, then the
reference Pici encoder per piece), bit for bit: payload bytes, nonzero counts, error buffer, kept
count; random buckets, dtypes, layouts and thresholds, fresh every run; :meth:`EncodedPieces.encode`
against the encoder piece by piece. CUDA (with the kernels): ``spccl::pici_prune_compress_pieces``
(one launch for every piece, up to over a thousand) against the same reference, and ``opcheck``.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from spccl_train.collectives import ChunkLayout, EncodedPieces
from spccl_train.formats import PayloadTooSmallError, compress_into, compress_pieces_into, payload_bytes
from spccl_train.pruning import PruneConfig, Pruner
from spccl_train.pruning.wire import prune_then_encode, prune_to_wire, prune_to_wire_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ERRORS = ["float32", "bfloat16", "float16"]


def _bucket(n: int, dtype: torch.dtype, error_dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=gen)
    grad[torch.rand(n, generator=gen) < 0.05] = 0.0  # zeros already present (e.g. embeddings)
    error = torch.randn(n, generator=gen) * 0.3
    return grad.to(dtype).to(device), error.to(error_dtype).to(device)


def _assert_same(a: EncodedPieces, b: EncodedPieces, what: str = "") -> None:
    assert torch.equal(a.nnz.cpu(), b.nnz.cpu()), what
    for i, (piece, nnz) in enumerate(zip(a.pieces, a.nnz.tolist())):
        size = payload_bytes("pici", piece.numel, nnz, a.dtype)
        assert torch.equal(a.payload(i)[:size].cpu(), b.payload(i)[:size].cpu()), f"payload {i} differs: {what}"


def _unfused(grad, error, threshold, decay, layout):
    into = EncodedPieces.empty(layout, grad.dtype, grad.device)
    kept = prune_then_encode(grad, error, threshold, decay, into)
    return into, kept


@pytest.mark.parametrize("trial", range(12))
def test_fused_reference_equals_unfused_bit_for_bit(trial: int) -> None:
    rng = random.Random()
    dtype, error_name = rng.choice(DTYPES), rng.choice(ERRORS)
    error_dtype = PruneConfig(error_dtype=error_name).error_torch_dtype
    n = rng.choice([1, 4095, 4096, 4097, rng.randrange(1, 40_000), rng.randrange(40_000, 200_000)])
    world, channels = rng.randrange(1, 9), rng.randrange(1, 4)
    layout = ChunkLayout.of("all_reduce", n, world, channels)
    threshold = torch.tensor([rng.choice([0.0, 0.5, 1.5, 2.6, 10.0])])
    decay = rng.choice([0.0, 0.9, 1.0])
    seed = rng.randrange(1 << 30)
    what = (
        f"{dtype}/{error_name} n={n} world={world} channels={channels} thr={float(threshold)} decay={decay} seed={seed}"
    )
    grad, error = _bucket(n, dtype, error_dtype, "cpu", seed)
    g0, e0 = grad.clone(), error.clone()
    fused = EncodedPieces.empty(layout, dtype, "cpu")
    kept = prune_to_wire_reference(grad, error, threshold, decay, fused)
    assert torch.equal(grad.view(torch.uint8), g0.view(torch.uint8)), f"the fused pass wrote the gradient: {what}"
    unfused, kept_unfused = _unfused(g0, e0, threshold, decay, layout)
    _assert_same(fused, unfused, what)
    assert torch.equal(error.view(torch.uint8), e0.view(torch.uint8)), what
    assert int(kept) == int(kept_unfused), what


def test_pruner_prune_to_wire_matches_prune_then_encode() -> None:
    """Same seed and step: the same sampled threshold, so the same bits as :meth:`Pruner.prune`."""
    pruner = Pruner(PruneConfig(density=0.02, warmup_steps=3))
    grad, error = _bucket(70_000, torch.float32, torch.float32, "cpu", random.randrange(1 << 30))
    layout = ChunkLayout.of("all_reduce", grad.numel(), 4, 2)
    g0, e0 = grad.clone(), error.clone()
    result, encoded = pruner.prune_to_wire(grad, error, layout, step=5, buffer=2, schedule_step=1)
    plain = pruner.prune(g0, e0, step=5, buffer=2, schedule_step=1)
    assert torch.equal(result.threshold, plain.threshold) and int(result.kept) == int(plain.kept)
    again = EncodedPieces.empty(layout, grad.dtype, "cpu")
    for i, piece in enumerate(again.pieces):  # encode the pruned gradient as the collective would
        again.nnz[i : i + 1] = compress_into("pici", g0, again.payload(i), offset=piece.start, n=piece.numel)
    _assert_same(encoded, again)
    assert torch.equal(error, e0)
    decoded = torch.full_like(g0, float("nan"))
    encoded.decode_into(decoded)
    assert torch.equal(decoded, g0)
    # reused payloads: the same buffer comes back
    _, reused = pruner.prune_to_wire(grad, error, layout, step=6, into=encoded)
    assert reused is encoded


@pytest.mark.parametrize("trial", range(4))
def test_encode_equals_the_encoder_piece_by_piece(trial: int) -> None:
    rng = random.Random()
    dtype = rng.choice(DTYPES)
    n = rng.choice([1, 4097, rng.randrange(1, 100_000)])
    layout = ChunkLayout.of("all_reduce", n, rng.randrange(1, 40), rng.randrange(1, 3))
    x, _ = _bucket(n, dtype, torch.float32, "cpu", rng.randrange(1 << 30))
    x[torch.rand(n) < rng.random()] = 0
    encoded = EncodedPieces.empty(layout, dtype, "cpu")
    encoded.encode(x)
    again = EncodedPieces.empty(layout, dtype, "cpu")
    for i, piece in enumerate(again.pieces):
        again.nnz[i : i + 1] = compress_into("pici", x, again.payload(i), offset=piece.start, n=piece.numel)
    _assert_same(encoded, again, f"{dtype} n={n} world={layout.world} channels={layout.channels}")


def test_encode_and_compress_pieces_reject_what_does_not_fit() -> None:
    layout = ChunkLayout.of("all_reduce", 100, 2, 1)
    encoded = EncodedPieces.empty(layout, torch.float32, "cpu")
    with pytest.raises(ValueError, match="payloads are of 100 elements but the tensor has 99"):
        encoded.encode(torch.ones(99))
    with pytest.raises(ValueError, match="carry torch.float32 on cpu but the tensor is torch.bfloat16"):
        encoded.encode(torch.ones(100, dtype=torch.bfloat16))
    starts, numels = encoded.ranges
    with pytest.raises(ValueError, match="2 starts need as many numels .got 2. and one offset more .got 2."):
        compress_pieces_into(torch.ones(100), encoded.buffer, starts, numels, encoded.offsets[:2], encoded.nnz)
    with pytest.raises(ValueError, match="nnz must be a contiguous 1-D int64 tensor with one count per piece"):
        compress_pieces_into(torch.ones(100), encoded.buffer, starts, numels, encoded.offsets, encoded.nnz[:1])
    x, out, nnz = torch.ones(100), encoded.buffer, encoded.nnz
    with pytest.raises(ValueError, match=r"range \[90, 110\) of src \(piece 1\) is outside its 100 elements"):
        compress_pieces_into(x, out, (0, 90), (50, 20), encoded.offsets, nnz)
    with pytest.raises(ValueError, match="payload 1 starts at byte 648; payloads start at 16-byte aligned offsets"):
        compress_pieces_into(x, out, starts, numels, (0, 648, 1456), nnz)
    with pytest.raises(PayloadTooSmallError, match="payload 0 has 16 bytes, less than the 528-byte metadata"):
        compress_pieces_into(x, out, starts, numels, (0, 16, 640), nnz)
    with pytest.raises(ValueError, match="the last payload ends at byte 99999 but out holds"):
        compress_pieces_into(x, out, starts, numels, (0, 640, 99999), nnz)


def test_prune_to_wire_checks_what_the_kernel_trusts() -> None:
    layout = ChunkLayout.of("all_reduce", 100, 2, 1)
    into = EncodedPieces.empty(layout, torch.float32, "cpu")
    g, e, thr = torch.randn(100), torch.zeros(100), torch.tensor([1.0])
    with pytest.raises(ValueError, match="carry torch.float32 on cpu but the tensor is torch.bfloat16"):
        prune_to_wire(g.bfloat16(), e, thr, 0.9, into)
    with pytest.raises(ValueError, match="payloads are of 100 elements but the gradient has 99"):
        prune_to_wire(g[:99], e[:99], thr, 0.9, into)
    with pytest.raises(ValueError, match=r"error buffer \(99,\) on cpu does not match the gradient \(100,\)"):
        prune_to_wire(g, e[:99], thr, 0.9, into)
    with pytest.raises(ValueError, match="threshold must be one float32"):
        prune_to_wire(g, e, thr.double(), 0.9, into)


def test_prune_to_wire_rejects_a_foreign_layout() -> None:
    pruner = Pruner()
    grad, error = torch.randn(100), torch.zeros(100)
    with pytest.raises(ValueError, match="layout cuts 99 elements but grad has 100"):
        pruner.prune_to_wire(grad, error, ChunkLayout.of("all_reduce", 99, 2, 1), step=0)


needs_kernels = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the spccl kernels")


def _kernels() -> None:
    from spccl_train._ext import kernels_available

    if not kernels_available():
        pytest.skip("the spccl CUDA kernels are not available")


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("error_name", ERRORS)
@pytest.mark.parametrize("n", [1, 4096, 70_001, 1 << 20])
def test_cuda_fused_kernel_matches_reference(dtype: torch.dtype, error_name: str, n: int) -> None:
    _kernels()
    rng = random.Random()
    error_dtype = PruneConfig(error_dtype=error_name).error_torch_dtype
    world = rng.choice([rng.randrange(1, 6), rng.randrange(6, 40), rng.randrange(500, 700)])
    layout = ChunkLayout.of("all_reduce", n, world, rng.randrange(1, 3))
    seed = rng.randrange(1 << 30)
    grad, error = _bucket(n, dtype, error_dtype, "cpu", seed)
    threshold = torch.tensor([rng.choice([0.0, 1.0, 2.5])])
    what = f"world={layout.world} channels={layout.channels} thr={float(threshold)} seed={seed}"
    expected = EncodedPieces.empty(layout, dtype, "cpu")
    e_ref = error.clone()
    kept_ref = prune_to_wire_reference(grad, e_ref, threshold, 0.9, expected)
    g, e = grad.cuda(), error.cuda()
    got = EncodedPieces.empty(layout, dtype, "cuda")
    kept = prune_to_wire(g, e, threshold.cuda(), 0.9, got)
    torch.cuda.synchronize()
    assert torch.equal(g.cpu().view(torch.uint8), grad.view(torch.uint8)), "the kernel wrote the gradient"
    _assert_same(got, expected, what)
    assert torch.equal(e.cpu().view(torch.uint8), e_ref.view(torch.uint8)), what
    assert int(kept) == int(kept_ref), what


@needs_kernels
def test_cuda_fused_kernel_unaligned_offset() -> None:
    """A piece starting at an odd element: the element-wise loads and stores."""
    _kernels()
    grad, error = _bucket(50_001, torch.float32, torch.bfloat16, "cpu", 7)
    threshold = torch.tensor([1.0])
    out = torch.empty(1 << 20, dtype=torch.uint8)
    e_ref = error.clone()
    v = grad[3:].float() + e_ref[3:].float()
    keep = v.abs() >= 1.0
    e_ref[3:] = torch.where(keep, torch.zeros_like(v), v * 0.5)
    from spccl_train.formats import reference

    nnz_ref = reference.pici_compress(torch.where(keep, v, torch.zeros_like(v)), 0, v.numel(), out)
    g, e, kept = grad.cuda(), error.cuda(), torch.zeros(1, dtype=torch.int32, device="cuda")
    got = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    nnz = torch.empty(1, dtype=torch.int64, device="cuda")
    op = torch.ops.spccl.pici_prune_compress_pieces
    op(g, e, [3], [49_998], threshold.cuda(), 0.5, kept, got, [0, got.numel()], nnz)
    size = payload_bytes("pici", 49_998, int(nnz_ref), torch.float32)
    assert int(nnz) == int(nnz_ref) and int(kept) == int(keep.sum())
    assert torch.equal(got.cpu()[:size], out[:size])
    assert torch.equal(e.cpu().view(torch.uint8), e_ref.view(torch.uint8))


@needs_kernels
def test_cuda_graph_replays_encode_and_prune_to_wire() -> None:
    """Both one-launch encoders captured in a CUDA graph: each replay encodes what the tensors hold
    then, as the eager calls do (the pieces' rows are copied to the device on every replay)."""
    _kernels()
    n = 300_001
    layout = ChunkLayout.of("all_reduce", n, 5, 2)
    x = torch.zeros(n, device="cuda")
    g, e = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    threshold = torch.tensor([1.0], device="cuda")
    encoded = EncodedPieces.empty(layout, torch.float32, "cuda")
    wired = EncodedPieces.empty(layout, torch.float32, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream
        encoded.encode(x)
        prune_to_wire(g, e, threshold, 0.9, wired)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        encoded.encode(x)
        prune_to_wire(g, e, threshold, 0.9, wired)
    for _ in range(2):
        grad, error = _bucket(n, torch.float32, torch.float32, "cpu", random.randrange(1 << 30))
        x.copy_(grad)
        g.copy_(grad)
        e.copy_(error)
        graph.replay()
        torch.cuda.synchronize()
        expected = EncodedPieces.empty(layout, torch.float32, "cpu")
        expected.encode(grad)
        _assert_same(encoded, expected, "encode replayed")
        e_ref = error.clone()
        expected_wire = EncodedPieces.empty(layout, torch.float32, "cpu")
        prune_to_wire_reference(grad, e_ref, threshold.cpu(), 0.9, expected_wire)
        _assert_same(wired, expected_wire, "prune_to_wire replayed")
        assert torch.equal(e.cpu(), e_ref)
    # the graph owns the host rows its replays copy: gone with it, and eager calls go on
    del graph
    gc.collect()
    torch.cuda.synchronize()
    x.copy_(torch.randn(n))
    encoded.encode(x)
    expected = EncodedPieces.empty(layout, torch.float32, "cpu")
    expected.encode(x.cpu())
    _assert_same(encoded, expected, "encode after the graph")


@needs_kernels
def test_opcheck_prune_compress_pieces() -> None:
    _kernels()
    g = torch.randn(20_000, device="cuda")
    e = torch.zeros(20_000, device="cuda")
    thr, kept = torch.tensor([1.0], device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(1 << 18, dtype=torch.uint8, device="cuda")
    nnz = torch.empty(2, dtype=torch.int64, device="cuda")
    args = (g, e, [5, 12_000], [7_000, 8_000], thr, 0.9, kept, out, [0, 1 << 17, 1 << 18], nnz)
    torch.library.opcheck(torch.ops.spccl.pici_prune_compress_pieces.default, args)
