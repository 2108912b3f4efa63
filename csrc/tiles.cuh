// What the Pici compressor reads a tile from: a range as it is (PlainTile), or a gradient pruned
// on the fly with leaky error feedback (PruneTile). Both hold one thread's share of a tile in
// registers, in TileRegisters' layout, name how many tiles the compressor takes per step (kUnit),
// and offer it the same calls:
//   load(source, tile)     issue the tile's loads (they land while the block works on another);
//   prepare(source, tile)  turn what landed into the values to encode (before counting them);
//   count_nonzero()        this thread's nonzeros of the prepared tile;
//   store_shared(tile_s)   the prepared values into the block's shared tile;
//   prefetch(source, tile) (static, one thread) start bringing a later tile's bytes into L2,
//                          once the unit in hand held kPrefetchMin nonzeros per tile;
//   finish(source)         at the launch's end, once (whole warps): publish what the tiles tallied.
// A launch encodes one or more pieces of its source: Source::at(start, n) is the view of piece
// [start, start + n), whose tiles are numbered from 0.
#pragma once

#include "common.cuh"

// Minimum resident blocks per SM of the pruning compressor (caps its registers).
#ifndef SPCCL_PRUNE_MIN_BLOCKS
#define SPCCL_PRUNE_MIN_BLOCKS 4
#endif

namespace spccl {

// Start bringing `bytes` (a multiple of 16) from 16-byte aligned `p` into L2, from one thread: the
// bulk copy engine's prefetch on sm_90 and later, nothing before. The compressor asks for the unit
// after next, so that its loads, a step later, find L2 instead of memory.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Tiles of 16-bit elements a compressor block takes per step (one claim, one look-back, one chain
// of barriers): 2 give it a 32-bit tile's bytes per step. Measured on H100 (1 GiB bf16, fraction
// of copy at 50 / 90 / 95 / 99 / 99.9% sparsity): 1 tile, 8 blocks: 0.79 / 0.79 / 0.80 / 0.81 /
// 0.82; 2 tiles, 5 blocks: 0.83 / 0.85 / 0.86 / 0.88 / 0.90; 2 tiles, 6 blocks (40 registers,
// 32 bytes spilled): 0.77 / 0.78 / 0.79 / 0.81 / 0.82 (bench/results/2026-11-26_pairs/).
#ifndef SPCCL_COMPRESS_UNIT_16
#define SPCCL_COMPRESS_UNIT_16 2
#endif

// Minimum resident blocks per SM of the 16-bit compressor (caps its registers). One tile per
// step, measured on H200 (1 GiB bf16, fraction of copy at 50 / 90 / 99% sparsity): 5: 0.49 /
// 0.48 / 0.49; 6: the same; 8: 0.52 / 0.52 / 0.52; 10: 0.51 / 0.51 / 0.52
// (bench/results/2026-11-26_wire/README.md). Two tiles per step: 5 (48 registers, 35 KB of
// shared memory per block), as above.
#ifndef SPCCL_COMPRESS_MIN_BLOCKS_16
#define SPCCL_COMPRESS_MIN_BLOCKS_16 (SPCCL_COMPRESS_UNIT_16 == 1 ? 8 : 5)
#endif

// The plain compressor prefetches the unit after next into L2 when it claims it (prefetch_l2),
// if the unit in hand had at least this many nonzeros per tile (the next ones likely alike). A
// dense unit's compaction leaves the prefetch time to land; a sparse unit's step is short, and
// there it cost a point. Measured on H100 (1 GiB, fraction of copy, two rounds, prefetching every
// unit): fp32 0.92 -> 0.96 at 50% sparsity, 0.91 -> 0.93 at 75%, 0.91 at 90%, 0.92 -> 0.91 at
// 99%, 0.93 -> 0.92 at 99.9%; bf16 0.85 -> 0.88, 0.83 -> 0.84, 0.84 -> 0.85, 0.87, 0.88
// (bench/results/2026-11-26_fourteenth/).
#ifndef SPCCL_PREFETCH_MIN_NNZ
#define SPCCL_PREFETCH_MIN_NNZ 256
#endif

template <typename T>
struct PlainTile {
  using Bits = T;
  static constexpr int kUnit = sizeof(T) == 2 ? SPCCL_COMPRESS_UNIT_16 : 1;
  static constexpr int kMinBlocks = sizeof(T) == 2 ? SPCCL_COMPRESS_MIN_BLOCKS_16 : SPCCL_COMPRESS_MIN_BLOCKS;
  static constexpr uint32_t kPrefetchMin = SPCCL_PREFETCH_MIN_NNZ;  // nonzeros per tile in hand
  struct Source {
    const T* src;
    int64_t n;
    bool aligned;
    __device__ __forceinline__ Source at(int64_t start, int64_t count) const {
      return {src + start, count, reinterpret_cast<uintptr_t>(src + start) % 16 == 0};
    }
  };
  TileRegisters<T> regs;

  __device__ __forceinline__ static void prefetch(const Source& s, int64_t tile) {
    if (s.aligned && (tile + 1) * kTile <= s.n) prefetch_l2(s.src + tile * kTile, kTile * sizeof(T));
  }
  __device__ __forceinline__ void load(const Source& s, int64_t tile) { regs.load(s.src, s.n, tile, s.aligned); }
  __device__ __forceinline__ void prepare(const Source&, int64_t) {}
  __device__ __forceinline__ void finish(const Source&) const {}
  __device__ __forceinline__ uint32_t count_nonzero() const { return regs.count_nonzero(); }
  __device__ __forceinline__ void store_shared(T* tile_s) const { regs.store_shared(tile_s); }
};

// Bits <-> values of the three element types.
__device__ __forceinline__ float value_of(uint32_t b, float) { return __uint_as_float(b); }
__device__ __forceinline__ float value_of(uint16_t b, __nv_bfloat16) { return __bfloat162float(__ushort_as_bfloat16(b)); }
__device__ __forceinline__ float value_of(uint16_t b, __half) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ uint32_t bits_of(float v, float) { return __float_as_uint(v); }
__device__ __forceinline__ uint16_t bits_of(float v, __nv_bfloat16) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ uint16_t bits_of(float v, __half) { return __half_as_ushort(__float2half_rn(v)); }

// The gradient G and its error buffer E (float, __nv_bfloat16 or __half), pruned as
// spccl_train/pruning/reference.py does: v = g + e in fp32; keep = |v| >= threshold; the value
// encoded is keep ? v : 0 rounded to G; the error becomes keep ? 0 : v * decay rounded to E and
// is stored by prepare(); the gradient itself is never written. Positions >= n are not elements:
// never kept, never stored. The error is loaded and stored in the gradient's element layout
// (kVec elements of E per vector: 8, 16 or 32 bytes).
template <typename G, typename E>
struct PruneTile {
  using Bits = typename BitsOf<sizeof(G)>::type;
  using EBits = typename BitsOf<sizeof(E)>::type;
  using Regs = TileRegisters<Bits>;
  static constexpr int kVec = Regs::kVec;
  static constexpr int kPerThread = Regs::kPerThread;
  static constexpr int kErrorBytes = kVec * int(sizeof(E));  // one vector of error elements
  // Twice the registers of a plain tile in flight: fewer resident blocks than the plain compressor.
  static constexpr int kMinBlocks = SPCCL_PRUNE_MIN_BLOCKS;
  static constexpr int kUnit = 1;
  // Prefetches the unit after next whatever the density: its step is long at any (two streams
  // read, one written), and the plain compressor's gate (nonzeros of the unit in hand) is never
  // met at the 1% a bucket is pruned to. Measured at 1% density (1 GiB, two rounds), fp32 gradient
  // with fp32 errors, bf16 / fp32, bf16 / bf16: H200 0.863 -> 0.830, 0.728 -> 0.705, 0.545 ->
  // 0.537 ms; H100 1.137 -> 1.108, 0.955 -> 0.936, 0.617 -> 0.587 ms
  // (bench/results/2026-11-27_twentieth/). An earlier kernel had gained nothing from it on H100
  // (1.338 -> 1.348 ms, bench/results/2026-11-26_fourteenth/).
  static constexpr uint32_t kPrefetchMin = 0;
  struct Source {
    const Bits* grad;
    EBits* error;
    int64_t n;
    bool aligned;  // grad 16-byte and error kErrorBytes-byte aligned
    const float* threshold;
    float decay;
    unsigned int* kept;  // += elements kept
    __device__ __forceinline__ Source at(int64_t start, int64_t count) const {
      const bool ok = reinterpret_cast<uintptr_t>(grad + start) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(error + start) % (kErrorBytes < 16 ? kErrorBytes : 16) == 0;
      return {grad + start, error + start, count, ok, threshold, decay, kept};
    }
  };
  Regs regs;
  union ErrorVector {
    uint4 words[(kErrorBytes + 15) / 16];
    uint2 half_words[(kErrorBytes + 7) / 8];
    EBits elems[kVec];
  } err[kPerThread];
  uint32_t kept_ = 0;  // elements this thread kept so far, summed into *kept by finish()

  __device__ __forceinline__ static int64_t first(int64_t tile, int k) {
    return tile * kTile + int64_t(k * kThreads + threadIdx.x) * kVec;
  }

  __device__ __forceinline__ static void prefetch(const Source& s, int64_t tile) {
    if (!s.aligned || (tile + 1) * kTile > s.n) return;
    prefetch_l2(s.grad + tile * kTile, kTile * sizeof(G));
    if (reinterpret_cast<uintptr_t>(s.error + tile * kTile) % 16 == 0)
      prefetch_l2(s.error + tile * kTile, kTile * sizeof(E));
  }

  __device__ __forceinline__ void load(const Source& s, int64_t tile) {
    regs.load(s.grad, s.n, tile, s.aligned);
    const bool whole = s.aligned && (tile + 1) * kTile <= s.n;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t at = first(tile, k);
      if (whole) {
        if constexpr (kErrorBytes == 8) {
          err[k].half_words[0] = __ldcs(reinterpret_cast<const uint2*>(s.error + at));
        } else {
#pragma unroll
          for (int w = 0; w < kErrorBytes / 16; ++w)
            err[k].words[w] = __ldcs(reinterpret_cast<const uint4*>(s.error + at) + w);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) err[k].elems[e] = at + e < s.n ? s.error[at + e] : EBits(0);
      }
    }
  }

  __device__ __forceinline__ void prepare(const Source& s, int64_t tile) {
    const float threshold = __ldg(s.threshold);
    const bool whole = s.aligned && (tile + 1) * kTile <= s.n;
    uint32_t kept = 0;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t at = first(tile, k);
      Bits* grad = reinterpret_cast<Bits*>(&regs.v[k]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float v = value_of(grad[e], G()) + value_of(err[k].elems[e], E());
        const bool inside = whole || at + e < s.n;
        const bool keep = inside && fabsf(v) >= threshold;
        kept += keep;
        grad[e] = keep ? bits_of(v, G()) : Bits(0);
        err[k].elems[e] = keep ? EBits(0) : bits_of(v * s.decay, E());
      }
      if (whole) {
        if constexpr (kErrorBytes == 8) {
          __stcs(reinterpret_cast<uint2*>(s.error + at), err[k].half_words[0]);
        } else {
#pragma unroll
          for (int w = 0; w < kErrorBytes / 16; ++w)
            __stcs(reinterpret_cast<uint4*>(s.error + at) + w, err[k].words[w]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (at + e < s.n) s.error[at + e] = err[k].elems[e];
      }
    }
    kept_ += kept;
  }

  // The launch's end: this thread's kept elements of every tile it prepared go to *kept, one
  // atomic per warp. An atomic per tile and warp, all on one address (8 per 4096 elements), had
  // cost the fused pass 7-30%: 1 GiB on H100, fp32 gradient with fp32 errors 1.338 -> 1.249 ms,
  // bf16 with bf16 errors 0.966 -> 0.673 ms, both trees timed at the benchmark's density then,
  // 22% on average (bench/results/2026-11-26_seventeenth/).
  __device__ __forceinline__ void finish(const Source& s) const {
    const uint32_t kept = warp_sum(kept_);
    if ((threadIdx.x & 31) == 0 && kept) atomicAdd(s.kept, kept);
  }

  __device__ __forceinline__ uint32_t count_nonzero() const { return regs.count_nonzero(); }
  __device__ __forceinline__ void store_shared(Bits* tile_s) const { regs.store_shared(tile_s); }
};

}  // namespace spccl
