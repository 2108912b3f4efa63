// COO compress / decompress / decompress-accumulate (layout: docs/FORMATS.md).
//
// Compression reads the input once with the same tile loop as Pici: per-tile counts, a
// decoupled look-back for the tile's offset, indices written in place. The values' offset,
// align16(4 * nnz), is known only once every tile is counted, so the values go to a scratch
// array first and a second kernel moves them (nnz elements: small where COO pays off).
#include "common.cuh"

namespace spccl {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) coo_compress_kernel(
    const T* __restrict__ src, int64_t n, int64_t tiles, bool aligned, uint8_t* __restrict__ out,
    int64_t capacity, T* __restrict__ values_scratch, const LookBack lb, int64_t* __restrict__ nnz_out) {
  using Regs = TileRegisters<T>;
  constexpr int kWarps = kThreads / 32;
  constexpr int kSlots = Regs::kPerThread * kWarps;  // (k, warp) pairs in ascending order
  static_assert(kSlots <= 32, "one warp scans the per-(k, warp) counts");
  __shared__ __align__(16) uint32_t idx_s[kTile];
  __shared__ __align__(16) T val_s[kTile];
  __shared__ uint32_t slot_s[kSlots];
  __shared__ uint32_t count_s[kWarps];
  __shared__ uint32_t total_s, prefix_s;
  __shared__ int64_t next_s;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint32_t* positions = reinterpret_cast<uint32_t*>(out);
  const int64_t position_room = capacity / 4;

  if (tid == 0) next_s = atomicAdd(lb.counter, 1u);
  __syncthreads();
  int64_t tile = next_s;
  Regs regs;
  if (tile < tiles) {
    regs.load(src, n, tile, aligned);
    publish_count(regs, tile, lb, count_s);
  }

  while (tile < tiles) {
    // Phase 1: count per 16-byte vector; warp-scan so each thread knows its offset within
    // the warp's share of vector k.
    uint32_t within[Regs::kPerThread];
#pragma unroll
    for (int k = 0; k < Regs::kPerThread; ++k) {
      uint32_t count = 0;
#pragma unroll
      for (int e = 0; e < Regs::kVec; ++e) count += is_nonzero(regs.element(k, e));
      const uint32_t inclusive = warp_inclusive_scan(count, lane);
      within[k] = inclusive - count;
      if (lane == 31) slot_s[k * kWarps + warp] = inclusive;
    }
    if (tid == 0) next_s = atomicAdd(lb.counter, 1u);
    __syncthreads();

    // Phase 2: warp 0 turns the (k, warp) counts into offsets.
    if (warp == 0) {
      const uint32_t count = lane < kSlots ? slot_s[lane] : 0u;
      const uint32_t inclusive = warp_inclusive_scan(count, lane);
      __syncwarp();
      if (lane < kSlots) slot_s[lane] = inclusive - count;
      if (lane == 31) total_s = inclusive;
    }
    __syncthreads();

    // Phase 3: compact positions and values into shared memory in ascending order, then
    // load the next tile (the registers are free now) and publish its count.
    const int64_t base = tile * kTile;
#pragma unroll
    for (int k = 0; k < Regs::kPerThread; ++k) {
      uint32_t pos = slot_s[k * kWarps + warp] + within[k];
      const uint32_t first = uint32_t((k * kThreads + tid) * Regs::kVec);
#pragma unroll
      for (int e = 0; e < Regs::kVec; ++e) {
        const T v = regs.element(k, e);
        if (is_nonzero(v)) {
          idx_s[pos] = uint32_t(base) + first + e;
          val_s[pos] = v;
          ++pos;
        }
      }
    }
    const int64_t next = next_s;
    if (next < tiles) {
      regs.load(src, n, next, aligned);
      publish_count(regs, next, lb, count_s);
    }

    // Phase 4: warp 0 learns the tile's global offset.
    if (warp == 0) {
      const uint32_t exclusive = tile == 0 ? 0u : look_back(lb, tile, lane);
      if (lane == 0) {
        const uint32_t inclusive = exclusive + total_s;
        publish_prefix(lb, tile, inclusive);
        prefix_s = exclusive;
        if (tile == tiles - 1) *nnz_out = inclusive;
      }
    }
    __syncthreads();

    // Phase 5: coalesced writes of the positions (in place) and values (to scratch).
    {
      const uint32_t total = total_s;
      const int64_t at = prefix_s;
      for (uint32_t i = tid; i < total; i += kThreads) {
        if (at + i < position_room) positions[at + i] = idx_s[i];
        values_scratch[at + i] = val_s[i];
      }
    }
    __syncthreads();
    tile = next;
  }
}

// Zero the padding after the positions and move the values behind it, never past capacity.
template <typename T>
__global__ void __launch_bounds__(kThreads) coo_place_values_kernel(
    uint8_t* __restrict__ out, int64_t capacity, const T* __restrict__ values_scratch,
    const int64_t* __restrict__ nnz_ptr) {
  const int64_t nnz = *nnz_ptr;
  const int64_t values_offset = (4 * nnz + 15) & ~int64_t(15);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (first < (values_offset - 4 * nnz) / 4 && 4 * (nnz + first + 1) <= capacity) {
    reinterpret_cast<uint32_t*>(out)[nnz + first] = 0u;
  }
  const int64_t bytes = nnz * int64_t(sizeof(T));
  const int64_t room = capacity - values_offset;
  uint8_t* dst = out + values_offset;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(values_scratch);
  for (int64_t i = first; 16 * (i + 1) <= bytes; i += stride) {
    if (16 * (i + 1) <= room) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  }
  for (int64_t b = (bytes & ~int64_t(15)) + first * int64_t(sizeof(T)); b < bytes; b += stride * int64_t(sizeof(T))) {
    if (b + int64_t(sizeof(T)) <= room) *reinterpret_cast<T*>(dst + b) = *reinterpret_cast<const T*>(src + b);
  }
}

template <typename V, typename D, bool kAccumulate>
__global__ void __launch_bounds__(kThreads) coo_decompress_kernel(
    const uint8_t* __restrict__ payload, int64_t capacity, const int64_t* __restrict__ nnz_ptr,
    int64_t n, D* __restrict__ dst, int32_t* __restrict__ status) {
  const int64_t nnz = *nnz_ptr;
  const int64_t values_offset = (4 * nnz + 15) & ~int64_t(15);
  if (nnz < 0 || nnz > n || values_offset + nnz * int64_t(sizeof(V)) > capacity) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(status, kBadNnz);
    return;
  }
  const uint32_t* positions = reinterpret_cast<const uint32_t*>(payload);
  const V* values = reinterpret_cast<const V*>(payload + values_offset);
  int bad = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < nnz; i += int64_t(gridDim.x) * kThreads) {
    const uint32_t p = positions[i];
    if (p >= n) {
      bad |= kPastEnd;
      continue;
    }
    if (i > 0 && positions[i - 1] >= p) {
      bad |= kNotAscending;
      continue;
    }
    if constexpr (kAccumulate) {
      dst[p] = from_float<D>(to_float(dst[p]) + to_float(values[i]));
    } else {
      dst[p] = values[i];
    }
  }
  if (bad) atomicOr(status, bad);
}

template <typename T>
void launch_compress(const T* src, int64_t n, uint8_t* out, int64_t capacity, void* values_scratch,
                     void* scratch, int64_t* nnz, cudaStream_t stream) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  check_cuda(cudaMemsetAsync(scratch, 0, compress_scratch_bytes(tiles), stream), "cudaMemsetAsync");
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0;
  auto kernel = coo_compress_kernel<T>;
  kernel<<<resident_blocks(kernel, tiles), kThreads, 0, stream>>>(
      src, n, tiles, aligned, out, capacity, static_cast<T*>(values_scratch), look_back_state(scratch, tiles), nnz);
  check_launch("coo_compress_kernel");
  auto place = coo_place_values_kernel<T>;
  place<<<resident_blocks(place, (n * int64_t(sizeof(T)) / 16 + kThreads - 1) / kThreads + 1), kThreads, 0,
          stream>>>(out, capacity, static_cast<const T*>(values_scratch), nnz);
  check_launch("coo_place_values_kernel");
}

template <typename V, typename D, bool kAccumulate>
void launch_decompress(const uint8_t* payload, int64_t capacity, const int64_t* nnz, int64_t n, void* dst,
                       int32_t* status, cudaStream_t stream) {
  auto kernel = coo_decompress_kernel<V, D, kAccumulate>;
  kernel<<<resident_blocks(kernel, (n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      payload, capacity, nnz, n, static_cast<D*>(dst), status);
  check_launch("coo_decompress_kernel");
}

}  // namespace

void coo_compress(const void* src, int elem_bytes, int64_t n, uint8_t* out, int64_t capacity,
                  void* values_scratch, void* scratch, int64_t* nnz, cudaStream_t stream) {
  if (n == 0) {
    check_cuda(cudaMemsetAsync(nnz, 0, sizeof(int64_t), stream), "cudaMemsetAsync");
    return;
  }
  if (elem_bytes == 4) {
    launch_compress(static_cast<const uint32_t*>(src), n, out, capacity, values_scratch, scratch, nnz, stream);
  } else {
    launch_compress(static_cast<const uint16_t*>(src), n, out, capacity, values_scratch, scratch, nnz, stream);
  }
}

void coo_decompress(const uint8_t* payload, int64_t capacity, const int64_t* nnz, int64_t n, Elem value,
                    void* dst, Elem dst_type, bool accumulate, int32_t* status, cudaStream_t stream) {
  if (n == 0) return;
  if (!accumulate) {
    if (value == Elem::kF32) {
      launch_decompress<uint32_t, uint32_t, false>(payload, capacity, nnz, n, dst, status, stream);
    } else {
      launch_decompress<uint16_t, uint16_t, false>(payload, capacity, nnz, n, dst, status, stream);
    }
  } else if (dst_type == Elem::kF32) {
    if (value == Elem::kF32) {
      launch_decompress<float, float, true>(payload, capacity, nnz, n, dst, status, stream);
    } else if (value == Elem::kBF16) {
      launch_decompress<__nv_bfloat16, float, true>(payload, capacity, nnz, n, dst, status, stream);
    } else {
      launch_decompress<__half, float, true>(payload, capacity, nnz, n, dst, status, stream);
    }
  } else if (dst_type == Elem::kBF16) {
    launch_decompress<__nv_bfloat16, __nv_bfloat16, true>(payload, capacity, nnz, n, dst, status, stream);
  } else {
    launch_decompress<__half, __half, true>(payload, capacity, nnz, n, dst, status, stream);
  }
}

}  // namespace spccl
