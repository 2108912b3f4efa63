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

// Tuning knob, measured on H200 (bench/results/NOTES.md): the Pici compressor's minimum resident
// blocks per SM for 32-bit elements (caps its registers: 5 measured 3-5 points above 6, 4 and the
// uncapped 44 registers; 16-bit elements and the pruning compressor have their own, in tiles.cuh).
#ifndef SPCCL_COMPRESS_MIN_BLOCKS
#define SPCCL_COMPRESS_MIN_BLOCKS 5
#endif

// Look-back status word of a tile or a group: flag in bits 32-33, count or prefix in bits 0-31.
constexpr unsigned long long kFlagAggregate = 1ull << 32;  // this tile's own count is known
constexpr unsigned long long kFlagPrefix = 2ull << 32;     // inclusive prefix is known

// Tiles per look-back group (see look_back): one per lane of the warp that looks back.
constexpr int kGroup = 32;

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

// A compressor's look-back state, carved from its scratch (compress_scratch_bytes or
// pieces_scratch_bytes, cleared before the launch): per tile a status word; per group of kGroup
// tiles the sum of the counts
// published so far with how many tiles it holds ((tiles << 32) | sum, built by atomic adds), and
// the inclusive prefix at the group's last tile once known; then the counter tiles are claimed from.
struct LookBack {
  unsigned long long* tile;
  unsigned long long* group_sum;
  unsigned long long* group_prefix;
  unsigned int* counter;
};

inline int64_t look_back_groups(int64_t tiles) { return (tiles + kGroup - 1) / kGroup; }

// The state of `tiles` tiles in `groups` groups (a launch's pieces: each piece's groups its own).
inline LookBack look_back_state(void* scratch, int64_t tiles, int64_t groups) {
  auto* words = static_cast<unsigned long long*>(scratch);
  return {words, words + tiles, words + tiles + groups, reinterpret_cast<unsigned int*>(words + tiles + 2 * groups)};
}

inline LookBack look_back_state(void* scratch, int64_t tiles) {
  return look_back_state(scratch, tiles, look_back_groups(tiles));
}

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

// A tile's count is known: publish it for the look-backs of its successors, in its own status
// word and in its group's sum. Tile 0's count is its inclusive prefix.
__device__ __forceinline__ void publish_tile_count(const LookBack& lb, int64_t tile, uint32_t count) {
  store_volatile(lb.tile + tile, (tile == 0 ? kFlagPrefix : kFlagAggregate) | count);
  atomicAdd(lb.group_sum + tile / kGroup, (1ull << 32) | count);
}

// A tile's inclusive prefix is known: publish it, and the group's if the tile ends one.
__device__ __forceinline__ void publish_prefix(const LookBack& lb, int64_t tile, uint32_t inclusive) {
  if (tile > 0) store_volatile(lb.tile + tile, kFlagPrefix | inclusive);
  if (tile % kGroup == kGroup - 1) store_volatile(lb.group_prefix + tile / kGroup, kFlagPrefix | inclusive);
}

// Decoupled look-back (Merrill & Garland) over two levels: called by one whole warp for
// `tile` > 0; returns the tile's exclusive prefix.
//   1. Each lane takes one predecessor within the tile's own group, waiting for it to publish;
//      the nearest that carries a prefix ends the walk, else the warp sums their counts.
//   2. Each lane takes one earlier group, 32 groups per round, nearest first, waiting until it
//      carries a prefix or a sum over all its kGroup tiles; the nearest prefix ends the walk.
// Why two levels: a persistent grid has every resident block's tile (and the claim behind it)
// in flight at once, about 1300 tiles on an H200, and none of them has a prefix until its own
// look-back ends. One level walks back 32 tiles per L2 round trip, so a tile far from the last
// known prefix spent some 20 round trips and ~600 status loads, all on the few hot L2 lines
// being published; counting by groups covers 1024 tiles per round.
// Progress is guaranteed because tiles are claimed in order from an atomic counter by running
// blocks, and no tile's count waits on the look-back of that tile or a later one (the Pici
// compressor's warps add their shares of the block's next claim's count without waiting for its
// warp 0, whose look-back is for an earlier tile; the COO one counts its next claim before it
// looks back): every tile below `tile` is claimed, so every group below its own fills up. Keep it so: a barrier between warp 0's look-back and the other warps'
// counting of the next claim would break it (and publishing that count later costs 40%:
// bench/results/2026-11-26_codecs/README.md, item 8).
__device__ __forceinline__ uint32_t look_back(const LookBack& lb, int64_t tile, int lane) {
  const int64_t group = tile / kGroup;
  const int64_t pred = tile - 1 - lane;
  const bool mine = pred >= group * kGroup;
  unsigned long long s = 0;
  if (mine) {
    do s = load_volatile(lb.tile + pred);
    while ((s >> 32) == 0);
  }
  const unsigned own_prefix = __ballot_sync(kFullMask, mine && (s & kFlagPrefix));
  if (own_prefix) {
    const int first_lane = __ffs(own_prefix) - 1;
    return warp_sum(lane <= first_lane ? uint32_t(s) : 0u);
  }
  uint32_t exclusive = warp_sum(mine ? uint32_t(s) : 0u);
  for (int64_t window = group - 1;; window -= 32) {
    const int64_t g = window - lane;
    bool prefix = g < 0;  // before group 0: prefix 0
    uint32_t value = 0;
    while (!prefix) {
      const unsigned long long p = load_volatile(lb.group_prefix + g);
      if (p & kFlagPrefix) {
        prefix = true;
        value = uint32_t(p);
        break;
      }
      const unsigned long long a = load_volatile(lb.group_sum + g);
      if ((a >> 32) == kGroup) {
        value = uint32_t(a);
        break;
      }
    }
    const unsigned prefix_lanes = __ballot_sync(kFullMask, prefix);
    if (prefix_lanes) {
      const int first_lane = __ffs(prefix_lanes) - 1;
      return exclusive + warp_sum(lane <= first_lane ? value : 0u);
    }
    exclusive += warp_sum(value);
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
template <typename Regs>
__device__ __forceinline__ void publish_count(const Regs& regs, int64_t tile, const LookBack& lb,
                                              uint32_t* warp_counts) {
  const uint32_t count = warp_sum(regs.count_nonzero());
  if ((threadIdx.x & 31) == 0) warp_counts[threadIdx.x >> 5] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += warp_counts[w];
    publish_tile_count(lb, tile, total);
  }
}

// Barrier-free variant for a block busy with other work: each warp adds its count of the
// claimed tile to `*sum`; the last of the block's warps to arrive publishes the total and
// resets both counters for the next tile. Called once per warp, by whole warps.
template <typename Regs>
__device__ __forceinline__ void add_count_and_publish(const Regs& regs, int64_t tile, const LookBack& lb,
                                                      uint32_t* sum, uint32_t* arrived) {
  const uint32_t count = warp_sum(regs.count_nonzero());
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(sum, count);
    __threadfence_block();
    if (atomicAdd(arrived, 1u) == kThreads / 32 - 1) {
      publish_tile_count(lb, tile, atomicAdd(sum, 0u));
      *sum = 0u;
      *arrived = 0u;
    }
  }
}

}  // namespace spccl
