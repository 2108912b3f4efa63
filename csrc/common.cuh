// Device helpers shared by the Pici and COO kernels.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "spccl.h"

namespace spccl {

constexpr int kTileRows = 64;
constexpr int kTile = kTileRows * kTileRows;  // elements per tile
constexpr int kThreads = 256;                 // threads per block, one tile at a time
constexpr unsigned kFullMask = 0xffffffffu;

// Tuning knobs, measured on H200 (bench/results/NOTES.md): predecessors each look-back lane
// examines per round, and the Pici compressor's minimum resident blocks per SM for 32-bit
// elements (caps its registers: 5 measured 3-5 points above 6, 4 and the uncapped 44 registers;
// 16-bit elements and the pruning compressor have their own, in tiles.cuh).
#ifndef SPCCL_LOOKBACK_PER_LANE
#define SPCCL_LOOKBACK_PER_LANE 1
#endif
#ifndef SPCCL_COMPRESS_MIN_BLOCKS
#define SPCCL_COMPRESS_MIN_BLOCKS 5
#endif

// Look-back status word of a tile: flag in bits 32-33, count or prefix in bits 0-31.
constexpr unsigned long long kFlagAggregate = 1ull << 32;  // this tile's own count is known
constexpr unsigned long long kFlagPrefix = 2ull << 32;     // inclusive prefix is known

inline void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("spccl: launching ") + what + " failed: " +
                             cudaGetErrorString(err));
  }
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("spccl: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

inline int64_t align16(int64_t bytes) { return (bytes + 15) & ~int64_t(15); }

// Persistent grid size: as many blocks of `kernel` as fit on the device at once.
template <typename Kernel>
int resident_blocks(Kernel kernel, int64_t work_items) {
  int device = 0, sms = 0, per_sm = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  int64_t blocks = int64_t(sms) * (per_sm > 0 ? per_sm : 1);
  return int(blocks < work_items ? blocks : (work_items > 0 ? work_items : 1));
}

// Raw bits of an element: float32 as uint32_t, bf16/fp16 as uint16_t.
template <int kBytes> struct BitsOf;
template <> struct BitsOf<4> { using type = uint32_t; };
template <> struct BitsOf<2> { using type = uint16_t; };

// An element is zero iff it compares equal to 0: all bits but the sign are clear.
__device__ __forceinline__ bool is_nonzero(uint32_t b) { return (b << 1) != 0u; }
__device__ __forceinline__ bool is_nonzero(uint16_t b) { return (b & 0x7fffu) != 0u; }

// Accumulation types: fp32 adds in fp32; bf16/fp16 are widened, added in fp32, rounded once.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename D> __device__ __forceinline__ D from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Inclusive sum over the warp.
__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    uint32_t up = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  return v;
}

__device__ __forceinline__ unsigned long long load_volatile(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}

__device__ __forceinline__ void store_volatile(unsigned long long* p, unsigned long long v) {
  *reinterpret_cast<volatile unsigned long long*>(p) = v;
}

// Decoupled look-back (Merrill & Garland): called by one whole warp for `tile` > 0. Each lane
// examines SPCCL_LOOKBACK_PER_LANE predecessors per round, waiting for each to publish, and the
// warp sums aggregates until it meets an inclusive prefix. Returns the exclusive prefix.
// Measured on H200 (1 GiB fp32): 1 per lane is best; 4, 8, 16 per lane cost 5, 20, 45 points of
// bandwidth, since every extra status load lands on the few hot L2 lines being published.
// Progress is guaranteed because tiles are claimed in order from an atomic counter by
// resident blocks, and a block publishes a claimed tile's count before it waits on anything.
__device__ __forceinline__ uint32_t look_back(unsigned long long* status, int64_t tile, int lane) {
  constexpr int kPerLane = SPCCL_LOOKBACK_PER_LANE;
  uint32_t exclusive = 0;
  int64_t window = tile - 1;  // nearest predecessor not yet examined
  while (true) {
    unsigned long long s[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t pred = window - kPerLane * lane - j;
      s[j] = pred >= 0 ? load_volatile(status + pred) : kFlagPrefix;  // before tile 0: prefix 0
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      while ((s[j] >> 32) == 0) s[j] = load_volatile(status + window - kPerLane * lane - j);
    }
    int first = kPerLane;  // nearest of this lane's predecessors that carries a prefix
#pragma unroll
    for (int j = kPerLane - 1; j >= 0; --j)
      if (s[j] & kFlagPrefix) first = j;
    uint32_t lane_sum = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (j <= first) lane_sum += uint32_t(s[j]);
    const unsigned prefix_lanes = __ballot_sync(kFullMask, first < kPerLane);
    if (prefix_lanes) {
      const int first_lane = __ffs(prefix_lanes) - 1;
      return exclusive + warp_sum(lane <= first_lane ? lane_sum : 0u);
    }
    exclusive += warp_sum(lane_sum);
    window -= 32 * kPerLane;
  }
}

// A tile's elements held in registers as 16-byte vectors: vector j = k * kThreads + tid
// covers elements [j * kVec, (j + 1) * kVec) of the tile, so each k is one coalesced load.
template <typename T>
struct TileRegisters {
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr int kPerThread = kTile / kVec / kThreads;
  uint4 v[kPerThread];

  // Full, 16-byte aligned tiles take vector loads that bypass L1 (read once); the last
  // partial tile and unaligned ranges read element by element, zero past n.
  __device__ __forceinline__ void load(const T* __restrict__ src, int64_t n, int64_t tile, bool aligned) {
    const int64_t base = tile * kTile;
    if (aligned && base + kTile <= n) {
      const uint4* p = reinterpret_cast<const uint4*>(src + base);
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) v[k] = __ldcs(p + k * kThreads + threadIdx.x);
    } else {
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        union {
          uint4 vec;
          T elems[kVec];
        } tmp;
        const int64_t first = base + int64_t(k * kThreads + threadIdx.x) * kVec;
#pragma unroll
        for (int e = 0; e < kVec; ++e) tmp.elems[e] = first + e < n ? src[first + e] : T(0);
        v[k] = tmp.vec;
      }
    }
  }

  // Nonzeros among this thread's elements (waits for the loads to land).
  __device__ __forceinline__ uint32_t count_nonzero() const {
    uint32_t count = 0;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k)
#pragma unroll
      for (int e = 0; e < kVec; ++e) count += is_nonzero(element(k, e));
    return count;
  }

  __device__ __forceinline__ T element(int k, int e) const {
    return reinterpret_cast<const T*>(&v[k])[e];
  }

  __device__ __forceinline__ void store_shared(T* tile_s) const {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) reinterpret_cast<uint4*>(tile_s)[k * kThreads + threadIdx.x] = v[k];
  }
};

// Publish the nonzero count of a claimed tile held in registers, so that successors' look-backs
// never wait for this block to reach the tile. Whole block; `warp_counts` has kThreads/32 slots.
// Tile 0 publishes its count as its inclusive prefix.
template <typename Regs>
__device__ __forceinline__ void publish_count(const Regs& regs, int64_t tile,
                                              unsigned long long* status, uint32_t* warp_counts) {
  const uint32_t count = warp_sum(regs.count_nonzero());
  if ((threadIdx.x & 31) == 0) warp_counts[threadIdx.x >> 5] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += warp_counts[w];
    store_volatile(status + tile, (tile == 0 ? kFlagPrefix : kFlagAggregate) | total);
  }
}

// Barrier-free variant for a block busy with other work: each warp adds its count of the
// claimed tile to `*sum`; the last of the block's warps to arrive publishes the total and
// resets both counters for the next tile. Called once per warp, by whole warps.
template <typename Regs>
__device__ __forceinline__ void add_count_and_publish(const Regs& regs, int64_t tile,
                                                      unsigned long long* status, uint32_t* sum,
                                                      uint32_t* arrived) {
  const uint32_t count = warp_sum(regs.count_nonzero());
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(sum, count);
    __threadfence_block();
    if (atomicAdd(arrived, 1u) == kThreads / 32 - 1) {
      const uint32_t total = atomicAdd(sum, 0u);
      store_volatile(status + tile, kFlagAggregate | total);
      *sum = 0u;
      *arrived = 0u;
    }
  }
}

}  // namespace spccl
