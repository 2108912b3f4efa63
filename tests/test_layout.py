"""Size and offset math of the wire formats, checked against FORMATS.md written out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spccl_train import formats as F
from spccl_train.formats.layout import pici_metadata_bytes_of

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
BAD_DTYPES = [torch.int32, torch.float64, torch.int64, torch.uint8, torch.float8_e4m3fn]


def _spec_align16(k: int) -> int:
    return 16 * math.ceil(k / 16)


def _spec_pici_bytes(n: int, nnz: int, size: int) -> int:
    nt = math.ceil(n / 4096)
    return 512 * nt + _spec_align16(4 * (nt + 1)) + nnz * size


def _spec_coo_bytes(nnz: int, size: int) -> int:
    return _spec_align16(4 * nnz) + nnz * size


def test_constants():
    assert F.TILE == 4096
    assert F.MAX_ELEMENTS == 2**32 - 1
    assert set(F.SUPPORTED_DTYPES) == set(DTYPES)


@pytest.mark.parametrize(
    "k, expected",
    [(0, 0), (1, 16), (4, 16), (15, 16), (16, 16), (17, 32), (31, 32), (32, 32), (33, 48), (2**32, 2**32)],
)
def test_align16_examples(k, expected):
    assert F.align16(k) == expected


@settings(deadline=None)
@given(st.integers(0, 2**40))
def test_align16_is_smallest_multiple_of_16(k):
    a = F.align16(k)
    assert a % 16 == 0 and k <= a < k + 16


@pytest.mark.parametrize(
    "n, tiles, index_offset, values_offset",
    [
        # NT = 0: no B, I = [nnz] alone, padded to 16 bytes.
        (0, 0, 0, 16),
        (1, 1, 512, 512 + 16),
        (4096, 1, 512, 512 + 16),
        (4097, 2, 1024, 1024 + 16),
        # NT = 3: I is 16 bytes exactly, no padding.
        (3 * 4096, 3, 1536, 1536 + 16),
        # NT = 4: I is 20 bytes, padded to 32.
        (3 * 4096 + 5, 4, 2048, 2048 + 32),
        (2**32 - 1, 2**20, 512 * 2**20, 512 * 2**20 + _spec_align16(4 * (2**20 + 1))),
    ],
)
def test_pici_layout_examples(n, tiles, index_offset, values_offset):
    layout = F.pici_layout(n)
    assert layout.n == n
    assert layout.tiles == tiles
    assert layout.bits_offset == 0
    assert layout.index_offset == index_offset
    assert layout.values_offset == values_offset
    assert layout.metadata_bytes == values_offset
    assert F.pici_metadata_bytes(n) == values_offset


@settings(deadline=None, max_examples=300)
@given(n=st.integers(0, 2**32 - 1), data=st.data(), dtype=st.sampled_from(DTYPES))
def test_pici_sizes_match_spec(n, data, dtype):
    nnz = data.draw(st.integers(0, n), label="nnz")
    size = SIZES[dtype]
    nt = math.ceil(n / 4096)
    layout = F.pici_layout(n)
    assert layout.tiles == nt
    assert layout.index_offset == 512 * nt
    assert layout.values_offset == 512 * nt + _spec_align16(4 * (nt + 1))
    assert layout.values_offset % 16 == 0
    assert F.pici_bytes(n, nnz, dtype) == _spec_pici_bytes(n, nnz, size)
    assert layout.nbytes(nnz, dtype) == _spec_pici_bytes(n, nnz, size)
    assert F.payload_bytes("pici", n, nnz, dtype) == _spec_pici_bytes(n, nnz, size)
    assert F.payload_bytes(F.Format.PICI, n, nnz, dtype) == _spec_pici_bytes(n, nnz, size)
    assert F.capacity_bytes("pici", n, dtype) == _spec_pici_bytes(n, n, size)
    assert F.pici_metadata_bytes(n) == F.pici_bytes(n, 0, dtype)


@given(lengths=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20))
def test_pici_metadata_elementwise_matches_each_length(lengths):
    """The planner's vectorised metadata size is :func:`pici_metadata_bytes` of each length."""
    got = pici_metadata_bytes_of(np.array(lengths, dtype=np.int64))
    assert got.tolist() == [F.pici_metadata_bytes(n) for n in lengths]
    assert pici_metadata_bytes_of(lengths[0]) == F.pici_metadata_bytes(lengths[0])


@settings(deadline=None, max_examples=300)
@given(n=st.integers(0, 2**32 - 1), data=st.data(), dtype=st.sampled_from(DTYPES))
def test_coo_sizes_match_spec(n, data, dtype):
    nnz = data.draw(st.integers(0, n), label="nnz")
    size = SIZES[dtype]
    assert F.coo_bytes(n, nnz, dtype) == _spec_coo_bytes(nnz, size)
    assert F.payload_bytes("coo", n, nnz, dtype) == _spec_coo_bytes(nnz, size)
    assert F.capacity_bytes("coo", n, dtype) == _spec_coo_bytes(n, size)
    layout = F.coo_layout(nnz)
    assert layout.nnz == nnz
    assert layout.index_offset == 0
    assert layout.values_offset == _spec_align16(4 * nnz)
    assert layout.nbytes(dtype) == _spec_coo_bytes(nnz, size)


@settings(deadline=None, max_examples=100)
@given(n=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES))
def test_dense_sizes(n, dtype):
    assert F.dense_bytes(n, dtype) == n * SIZES[dtype]
    assert F.payload_bytes("dense", n, 0, dtype) == n * SIZES[dtype]
    assert F.capacity_bytes("dense", n, dtype) == n * SIZES[dtype]


def test_small_sizes_by_hand():
    # n = 70 fp32 with 4 nonzeros: one tile (512 bytes of B), I = 8 bytes -> 16, A = 16 bytes.
    assert F.pici_bytes(70, 4, torch.float32) == 544
    assert F.coo_bytes(70, 4, torch.float32) == 32
    # n = 4099 bf16 with 4 nonzeros: two tiles (1024), I = 12 bytes -> 16, A = 8 bytes.
    assert F.pici_bytes(4099, 4, torch.bfloat16) == 1048
    assert F.coo_bytes(4099, 4, torch.bfloat16) == 24
    assert F.pici_bytes(0, 0, torch.float16) == 16
    assert F.coo_bytes(0, 0, torch.float16) == 0
    assert F.coo_bytes(10, 1, torch.float16) == 18
    assert F.coo_bytes(10, 5, torch.float32) == 32 + 20


@pytest.mark.parametrize("dtype, overhead", [(torch.float32, 3.15), (torch.bfloat16, 6.3), (torch.float16, 6.3)])
@pytest.mark.parametrize("n", [4096 * 1000, 4096 * 100_000 + 17, 2**32 - 1])
def test_worst_case_overhead_at_large_n(dtype, overhead, n):
    dense = F.dense_bytes(n, dtype)
    worst = F.capacity_bytes("pici", n, dtype)
    percent = 100 * (worst - dense) / dense
    assert percent == pytest.approx(overhead, abs=0.005)


@pytest.mark.parametrize("dtype", DTYPES)
def test_overhead_per_tile_is_bitvector_plus_prefix(dtype):
    # 512 bytes of bitvector + 4 bytes of index per 4096 elements: the limit of the overhead.
    n = 4096 * 4096
    assert F.capacity_bytes("pici", n, dtype) - F.dense_bytes(n, dtype) == 512 * 4096 + 4 * 4097 + 12


@settings(deadline=None, max_examples=300)
@given(nnz=st.integers(0, 10**9), dtype=st.sampled_from(DTYPES))
def test_coo_nnz_from_bytes_inverts_coo_bytes(nnz, dtype):
    assert F.coo_nnz_from_bytes(_spec_coo_bytes(nnz, SIZES[dtype]), dtype) == nnz


@pytest.mark.parametrize("dtype", DTYPES)
def test_coo_nnz_from_bytes_every_small_size(dtype):
    valid = {_spec_coo_bytes(k, SIZES[dtype]): k for k in range(400)}
    for nbytes in range(max(valid) + 1):
        if nbytes in valid:
            assert F.coo_nnz_from_bytes(nbytes, dtype) == valid[nbytes]
        else:
            with pytest.raises(ValueError, match=f"{nbytes} bytes is not the size of any COO payload"):
                F.coo_nnz_from_bytes(nbytes, dtype)


@settings(deadline=None, max_examples=200)
@given(
    nnz=st.integers(1, 10**9), delta=st.integers(1, 15), sign=st.sampled_from([-1, 1]), dtype=st.sampled_from(DTYPES)
)
def test_coo_nnz_from_bytes_rejects_off_by_a_few(nnz, delta, sign, dtype):
    nbytes = _spec_coo_bytes(nnz, SIZES[dtype]) + sign * delta
    # coo_bytes grows by at least 2 per nonzero, so within 15 bytes only nnz +- 8 can match exactly.
    nearby = {_spec_coo_bytes(k, SIZES[dtype]): k for k in range(max(0, nnz - 8), nnz + 9)}
    if nbytes in nearby:
        assert F.coo_nnz_from_bytes(nbytes, dtype) == nearby[nbytes]
        return
    with pytest.raises(ValueError, match="not the size of any COO payload"):
        F.coo_nnz_from_bytes(nbytes, dtype)


def test_coo_nnz_from_bytes_rejects_negative():
    with pytest.raises(ValueError):
        F.coo_nnz_from_bytes(-16, torch.float32)


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_bad_dtype_is_a_type_error_naming_it(dtype):
    calls = [
        lambda: F.pici_bytes(10, 1, dtype),
        lambda: F.coo_bytes(10, 1, dtype),
        lambda: F.dense_bytes(10, dtype),
        lambda: F.payload_bytes("pici", 10, 1, dtype),
        lambda: F.capacity_bytes("coo", 10, dtype),
        lambda: F.coo_nnz_from_bytes(32, dtype),
        lambda: F.pici_layout(10).nbytes(1, dtype),
        lambda: F.coo_layout(1).nbytes(dtype),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
            call()


@pytest.mark.parametrize("n", [2**32, 2**32 + 1, 2**40, -1])
def test_length_outside_uint32_is_a_value_error(n):
    calls = [
        lambda: F.pici_layout(n),
        lambda: F.pici_metadata_bytes(n),
        lambda: F.pici_bytes(n, 0, torch.float32),
        lambda: F.coo_bytes(n, 0, torch.float32),
        lambda: F.dense_bytes(n, torch.float32),
        lambda: F.capacity_bytes("pici", n, torch.bfloat16),
        lambda: F.capacity_bytes("coo", n, torch.float16),
        lambda: F.coo_layout(n),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=f"cannot encode {n} elements"):
            call()


def test_largest_length_is_accepted():
    n = 2**32 - 1
    assert F.pici_layout(n).tiles == 2**20
    assert F.coo_bytes(n, n, torch.float32) == _spec_coo_bytes(n, 4)


@pytest.mark.parametrize("nnz", [-1, 11])
def test_coo_bytes_rejects_nnz_outside_range(nnz):
    with pytest.raises(ValueError, match=f"nnz={nnz} is outside"):
        F.coo_bytes(10, nnz, torch.float32)


def test_unknown_format_is_a_value_error():
    with pytest.raises(ValueError):
        F.payload_bytes("csr", 10, 1, torch.float32)


# ----------------------------------------------------------------------------- what a Pici length implies


def _spec_n_for_length(nbytes: int, size: int) -> list[int]:
    """Every n with some nnz in [0, n] whose Pici payload is exactly ``nbytes`` long (by brute force)."""
    return [
        n
        for n in range(4096 * (nbytes // 512 + 2))
        if _spec_pici_bytes(n, 0, size) <= nbytes <= _spec_pici_bytes(n, n, size)
        and (nbytes - _spec_pici_bytes(n, 0, size)) % size == 0
    ]


@settings(deadline=None, max_examples=60)
@given(nbytes=st.integers(0, 4000) | st.integers(0, 60_000), dtype=st.sampled_from(DTYPES))
def test_pici_n_range_is_every_n_of_that_length(nbytes, dtype):
    every = _spec_n_for_length(nbytes, SIZES[dtype])
    span = F.pici_n_range(nbytes, dtype)
    if not every:
        assert span is None
    else:
        assert every == list(range(every[0], every[-1] + 1))  # contiguous
        assert span == (every[0], every[-1])


@settings(deadline=None, max_examples=300)
@given(n=st.integers(0, 2**32 - 1), data=st.data(), dtype=st.sampled_from(DTYPES))
def test_pici_n_range_holds_the_n_a_payload_was_made_for(n, data, dtype):
    nnz = data.draw(st.integers(0, n), label="nnz")
    lo, hi = F.pici_n_range(F.pici_bytes(n, nnz, dtype), dtype)
    assert lo <= n <= hi
    # The ends are attained: some nnz makes a payload of that length for each.
    nbytes = F.pici_bytes(n, nnz, dtype)
    for end in (lo, hi):
        rest = nbytes - F.pici_metadata_bytes(end)
        assert rest % SIZES[dtype] == 0 and 0 <= rest // SIZES[dtype] <= end


@pytest.mark.parametrize(
    "nbytes, dtype, expected",
    [
        (0, torch.float32, None),
        (15, torch.float32, None),
        (16, torch.float32, (0, 0)),  # the empty payload
        (17, torch.float16, None),  # odd: no 2-byte values fill it
        (528, torch.float32, (1, 4096)),  # one tile, nnz = 0
        (544, torch.float32, (4, 4096)),  # one tile, nnz = 4
        # The two-tile bfloat16 example of FORMATS.md (nnz = 4), or one tile with nnz = 260.
        (1048, torch.bfloat16, (260, 8192)),
        (5324, torch.float32, (1199, 40960)),  # 1 to 10 tiles
    ],
)
def test_pici_n_range_examples(nbytes, dtype, expected):
    assert F.pici_n_range(nbytes, dtype) == expected


@settings(deadline=None, max_examples=300)
@given(nbytes=st.integers(0, 2**40))
def test_pici_max_tiles_is_the_most_whose_metadata_fits(nbytes):
    tiles = F.layout.pici_max_tiles(nbytes)
    if nbytes < 16:
        assert tiles == -1
    else:
        assert _spec_pici_bytes(4096 * tiles, 0, 4) <= nbytes < _spec_pici_bytes(4096 * (tiles + 1), 0, 4)
