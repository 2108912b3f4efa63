// Pici compress / decompress / decompress-accumulate (layout: docs/FORMATS.md).
//
// Compression reads the input exactly once: each block stages a unit of 64x64 tiles in shared
// memory (one tile of 32-bit elements, two of 16-bit ones: tiles.cuh), builds each tile's 64
// column words, publishes the unit's count, compacts the unit's nonzeros into shared memory,
// learns its global offset by decoupled look-back, and writes the values out coalesced. The next
// unit's loads are issued before the current one is processed.
#include <type_traits>

#include "common.cuh"
#include "tiles.cuh"

namespace spccl {
namespace {

// Coalesced copy of `count` compacted values to A[base...]; nothing is written past capacity.
// Two values per store (a 4- or 8-byte word) from the first aligned one on: bf16 at 50% sparsity
// 0.73 -> 0.79 of copy on H100 (one store per value, each checked against the capacity, had
// been a sixth of the kernel's instructions).
template <typename T>
__device__ __forceinline__ void copy_out(const T* stage_s, uint32_t count, int64_t base, T* values,
                                         int64_t value_room) {
  using Word = typename std::conditional<sizeof(T) == 2, uint32_t, unsigned long long>::type;
  const int64_t room = value_room - base;
  const uint32_t limit = room <= 0 ? 0u : (room < int64_t(count) ? uint32_t(room) : count);
  T* to = values + base;
  const uint32_t head = (reinterpret_cast<uintptr_t>(to) % sizeof(Word)) ? 1u : 0u;
  if (limit <= head) {
    if (threadIdx.x == 0 && limit) to[0] = stage_s[0];
    return;
  }
  const uint32_t words = (limit - head) / 2;
  Word* out = reinterpret_cast<Word*>(to + head);
  for (uint32_t i = threadIdx.x; i < words; i += kThreads) {
    const Word lo = stage_s[head + 2 * i], hi = stage_s[head + 2 * i + 1];
    out[i] = lo | (hi << (8 * sizeof(T)));
  }
  if (threadIdx.x == 0 && head) to[0] = stage_s[0];
  if (threadIdx.x == kThreads - 1 && (limit - head) % 2) to[limit - 1] = stage_s[limit - 1];
}

// Tile::kUnit tiles taken as one work unit: one claim, one count, one look-back and one chain of
// barriers for all of them (a tile past the end loads zeros and is neither written nor indexed).
template <typename Tile>
struct Unit {
  static constexpr int kTiles = Tile::kUnit;
  Tile part[kTiles];

  __device__ __forceinline__ void load(const typename Tile::Source& s, int64_t unit) {
#pragma unroll
    for (int u = 0; u < kTiles; ++u) part[u].load(s, unit * kTiles + u);
  }
  __device__ __forceinline__ void prepare(const typename Tile::Source& s, int64_t unit) {
#pragma unroll
    for (int u = 0; u < kTiles; ++u) part[u].prepare(s, unit * kTiles + u);
  }
  __device__ __forceinline__ uint32_t count_nonzero() const {
    uint32_t count = 0;
#pragma unroll
    for (int u = 0; u < kTiles; ++u) count += part[u].count_nonzero();
    return count;
  }
  __device__ __forceinline__ void store_shared(typename Tile::Bits* tile_s) const {
#pragma unroll
    for (int u = 0; u < kTiles; ++u) part[u].store_shared(tile_s + u * kTile);
  }
};

template <typename Tile>
__global__ void __launch_bounds__(kThreads, Tile::kMinBlocks) pici_compress_kernel(
    const typename Tile::Source source, int64_t tiles, uint8_t* __restrict__ out, int64_t capacity,
    int64_t index_offset, int64_t values_offset, const LookBack lb, int64_t* __restrict__ nnz_out) {
  using T = typename Tile::Bits;
  constexpr int U = Tile::kUnit;
  __shared__ __align__(16) T tile_s[U * kTile];
  __shared__ __align__(16) T stage_s[U * kTile];
  __shared__ uint16_t part_s[U][4][kTileRows];
  __shared__ unsigned long long word_s[U][kTileRows];
  __shared__ uint32_t colpre_s[U][kTileRows];
  __shared__ uint32_t count_s[kThreads / 32];
  __shared__ uint32_t total_s[U], prefix_s, next_count_s, arrived_s;
  __shared__ int64_t claim_s[2];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t units = (tiles + U - 1) / U;
  unsigned long long* bits = reinterpret_cast<unsigned long long*>(out);
  uint32_t* index = reinterpret_cast<uint32_t*>(out + index_offset);
  T* values = reinterpret_cast<T*>(out + values_offset);
  const int64_t value_room = (capacity - values_offset) / int64_t(sizeof(T));

  // Each block holds two claims: the unit it processes and the next one, whose loads are in
  // flight meanwhile. A claimed unit's count is published before the block waits on anything.
  if (tid == 0) {
    claim_s[0] = atomicAdd(lb.counter, 1u);
    claim_s[1] = atomicAdd(lb.counter, 1u);
    next_count_s = 0;
    arrived_s = 0;
  }
  __syncthreads();
  int64_t unit = claim_s[0], next = claim_s[1];
  Unit<Tile> regs;
  if (unit < units) {
    regs.load(source, unit);
    regs.prepare(source, unit);
    publish_count(regs, unit, lb, count_s);
  }

  // Staged values of the previous unit wait in stage_s for their copy-out, done at the start
  // of the next iteration (alongside phase 1) to save a barrier.
  uint32_t pending = 0;
  int64_t pending_base = 0;
  while (unit < units) {
    regs.store_shared(tile_s);
    __syncthreads();
    if (next < units) regs.load(source, next);  // in flight while this unit is processed
    copy_out(stage_s, pending, pending_base, values, value_room);

    // Phase 1: thread (column c, quarter g) scans rows 16g..16g+15 of column c of each tile.
    {
      const int c = tid & 63, g = tid >> 6;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i)
          m |= uint32_t(is_nonzero(tile_s[u * kTile + (16 * g + i) * kTileRows + c])) << i;
        part_s[u][g][c] = uint16_t(m);
      }
    }
    __syncthreads();

    // Phase 2: warp 0 assembles each tile's column words (two adjacent columns per lane), writes
    // B, and prefix-sums the column counts with shuffles, each tile's after the unit's earlier ones.
    if (warp == 0) {
      const int c0 = 2 * lane, c1 = c0 + 1;
      uint32_t before = 0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        unsigned long long w0 = 0, w1 = 0;
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          w0 |= (unsigned long long)part_s[u][g][c0] << (16 * g);
          w1 |= (unsigned long long)part_s[u][g][c1] << (16 * g);
        }
        word_s[u][c0] = w0;
        word_s[u][c1] = w1;
        if (unit * U + u < tiles)
          reinterpret_cast<ulonglong2*>(bits + (unit * U + u) * kTileRows)[lane] = make_ulonglong2(w0, w1);
        const uint32_t n0 = __popcll(w0), n1 = __popcll(w1);
        const uint32_t inclusive = warp_inclusive_scan(n0 + n1, lane);
        colpre_s[u][c0] = before + inclusive - n0 - n1;
        colpre_s[u][c1] = before + inclusive - n1;
        if (lane == 31) total_s[u] = inclusive;
        before += __shfl_sync(kFullMask, inclusive, 31);
      }
    }
    __syncthreads();

    // Phases 3-4 overlap: warp 0 publishes the next unit's count and looks back for this
    // unit's offset while warps 1-7 compact; then warp 0 compacts its own share.
    if (warp == 0) {
      if (next < units) {
        regs.prepare(source, next);
        add_count_and_publish(regs, next, lb, &next_count_s, &arrived_s);
      }
      const uint32_t exclusive = unit == 0 ? 0u : look_back(lb, unit, lane);
      if (lane == 0) {
        claim_s[0] = atomicAdd(lb.counter, 1u);
        uint32_t inclusive = exclusive;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (unit * U + u < tiles) index[unit * U + u] = inclusive;
          inclusive += total_s[u];
        }
        publish_prefix(lb, unit, inclusive);
        prefix_s = exclusive;
        if (unit == units - 1) {
          index[tiles] = inclusive;
          // Zero the padding after I up to the 16-byte aligned values.
          for (int64_t i = 4 * (tiles + 1); i < values_offset - index_offset; i += 4) index[i / 4] = 0u;
          *nnz_out = inclusive;
        }
      }
    }
    // Phase 3: compact this thread's column segment of each tile into stage_s (unit-local
    // positions), walking its set bits with ffs.
    {
      const int c = tid & 63, g = tid >> 6;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const unsigned long long w = word_s[u][c];
        uint32_t m = uint32_t(w >> (16 * g)) & 0xffffu;
        uint32_t pos = colpre_s[u][c] + __popcll(w & ((1ull << (16 * g)) - 1ull));
        while (m) {
          const int r = __ffs(m) - 1;
          m &= m - 1;
          stage_s[pos++] = tile_s[u * kTile + (16 * g + r) * kTileRows + c];
        }
      }
    }
    if (warp != 0 && next < units) {
      regs.prepare(source, next);
      add_count_and_publish(regs, next, lb, &next_count_s, &arrived_s);
    }
    __syncthreads();

    const int64_t after = claim_s[0];
    pending = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) pending += total_s[u];
    pending_base = prefix_s;
    unit = next;
    next = after;
  }
  copy_out(stage_s, pending, pending_base, values, value_room);
}

// What a decoder does with the destination range.
enum Mode : int {
  kOverwrite = 0,   // write every element, zeros included
  kAccumulate = 1,  // add the marked elements
  kPatch = 2,       // the range holds the prior payload's data: write the marked elements and zero
                    // those only the prior marks
};

// The checks of one tile every decoder makes (warp-wide, lane l holding columns 2l, 2l+1): the
// words `w` (and a prior's `pw`) mark nothing at or past n, the index steps up by the tile's
// popcount, and stays within nnz. Returns the status bits (0: good); `inclusive` and `total`
// get the lane's inclusive column-pair prefix and the tile's count.
__device__ __forceinline__ int check_tile(ulonglong2 w, ulonglong2 pw, uint32_t lo, uint32_t hi, int64_t nnz,
                                          int64_t tile, int64_t n, int lane, uint32_t& inclusive, uint32_t& total) {
  const int c0 = 2 * lane, c1 = c0 + 1;
  const uint32_t n0 = __popcll(w.x), n1 = __popcll(w.y);
  inclusive = warp_inclusive_scan(n0 + n1, lane);
  total = __shfl_sync(kFullMask, inclusive, 31);
  const int64_t rest = n - tile * kTile;
  bool past_end = false;
  if (rest < kTile) {  // column c holds rows r with 64 r + c < rest
    const int64_t rows0 = rest > c0 ? (rest - c0 + 63) / 64 : 0;
    const int64_t rows1 = rest > c1 ? (rest - c1 + 63) / 64 : 0;
    past_end = (rows0 < 64 && ((w.x | pw.x) >> rows0)) || (rows1 < 64 && ((w.y | pw.y) >> rows1));
  }
  int bad = __any_sync(kFullMask, past_end) ? kPastEnd : 0;
  if (hi < lo || (tile == 0 && lo != 0)) bad |= kBadIndex;
  else if (hi - lo != total) bad |= kBadTileCount;
  if (hi > nnz) bad |= kBadNnz;
  return bad;
}

// Payloads of at most this many nonzeros per 100 elements accumulate with the warp-per-tile
// kernel, denser ones with the block-per-tile one. Both kernels are launched; each reads nnz and
// one returns at once. Measured on H200 (1 GiB fp32, fraction of copy; bench/results/NOTES.md),
// block only / warp only / this split: 0.79 / 0.38 / 0.78 at 50% sparsity, 0.83 / 0.61 / 0.63
// at 90%, 0.98 / 0.77 / 0.87 at 95%, 1.30 / 2.71 / 2.75 at 99%, 1.48 / 10.6 / 11.0 at 99.9%.
// The split at 90-95% should equal block only and does not; the cause is not found.
#ifndef SPCCL_SPARSE_PERCENT
#define SPCCL_SPARSE_PERCENT 2
#endif
constexpr int64_t kSparsePercent = SPCCL_SPARSE_PERCENT;

__device__ __forceinline__ bool sparse_payload(int64_t nnz, int64_t n) { return 100 * nnz <= kSparsePercent * n; }

// Overwrite decodes a tile of 16-bit elements with at most this many nonzeros by zeroing it with
// 16-byte stores and then storing the marked elements; denser tiles, and 32-bit ones that are not
// empty, gather every element (an empty tile of either size is only zeroed). Measured on H100 (1 GiB, fraction of copy, gather -> zero and store, bf16 / fp32):
// 99.9% 0.77 -> 0.87 / 0.88 -> 0.89, 99% 0.76 -> 0.83 / 0.86 -> 0.85, 97% 0.76 -> 0.81 / 0.85 ->
// 0.82, 95% 0.75 -> 0.64 / 0.85 -> 0.81, 80% 0.74 -> 0.35 / 0.86 -> 0.47: in the bit walk each
// marked element's load and store wait in turn, and 32-bit tiles gain little from wider zeros.
#ifndef SPCCL_SCATTER_MAX_16
#define SPCCL_SCATTER_MAX_16 128
#endif
template <typename D>
constexpr uint32_t kScatterMax = sizeof(D) == 2 ? SPCCL_SCATTER_MAX_16 : 0u;

// Copies values[lo, lo + total) into stage_s, from `first` = lo rounded down to 16 bytes (16-byte
// loads for the whole vectors when `vectors` is set; element by element else and for the tail);
// returns lo - first, where values[lo] landed. Reads nothing at or past lo + total. Measured on
// H100 (1 GiB, accumulation, fraction of copy, element by element -> vectors): bf16 at 50 / 75 /
// 90% 0.71 / 0.72 / 0.75 -> 0.77 / 0.75 / 0.76, fp32 at 50% 0.89 -> 0.91. Staging the dense tiles
// of 16-bit overwrite this way too (one block fewer per SM) gained 5 points at 50% and lost 3-14
// at 75-95% (bench/results/2026-11-26_pairs/README.md).
template <typename V>
__device__ __forceinline__ uint32_t stage_run(V* stage_s, const V* __restrict__ values, uint32_t lo, uint32_t total,
                                              bool vectors) {
  constexpr uint32_t kVec = 16 / sizeof(V);
  const uint32_t first = vectors ? lo & ~(kVec - 1) : lo, end = lo + total;
  const uint32_t whole = vectors && end > first ? (end - first) / kVec : 0;  // whole vectors from first
  const uint4* src = reinterpret_cast<const uint4*>(values + first);
  uint4* dst = reinterpret_cast<uint4*>(stage_s);
  for (uint32_t i = threadIdx.x; i < whole; i += kThreads) dst[i] = __ldg(src + i);
  for (uint32_t i = first + whole * kVec + threadIdx.x; i < end; i += kThreads) stage_s[i - first] = values[i];
  return lo - first;
}

// Decompression, one block per tile. Every warp reads the tile's 64 words and index step (L1
// broadcasts; the next tile's are prefetched into registers), and each warp writes 8 rows: lane l
// owns columns 2l and 2l+1, holds their words and offsets in registers, and stores each row as one
// coalesced pair per lane, gathering values at colprefix + popcount(word below the row).
// Accumulation (of dense payloads; sparse ones go to pici_sparse_decode_kernel) reads the marked
// elements of dst, stages the tile's run of A in shared memory (gathers there cost a few bank
// conflicts where L1 replays per line; measured +10-15 points), and then adds and writes the
// marked elements only. Every read is issued before the staging: a read, add and write of one
// element after another waited out a memory round trip each (H100, 90% sparsity: 0.33 of copy
// for bf16, 0.74 for fp32);
// overwrite gathers straight from A through L1, which measured faster than staging's two
// barriers, and writes every element.
template <typename V, typename D, bool kAccumulate>
__global__ void __launch_bounds__(kThreads, kAccumulate ? 4 : 6) pici_decompress_kernel(
    const uint8_t* __restrict__ payload, int64_t capacity, int64_t n, int64_t tiles,
    int64_t index_offset, int64_t values_offset, D* __restrict__ dst, bool aligned,
    int32_t* __restrict__ status) {
  constexpr int kRows = kTileRows / (kThreads / 32);  // rows per warp
  union Pair {
    D e[2];
    typename std::conditional<sizeof(D) == 4, uint2, uint32_t>::type vec;
  };
  __shared__ __align__(16) V stage_s[kAccumulate ? kTile + 16 / sizeof(V) : 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned long long* bits = reinterpret_cast<const unsigned long long*>(payload);
  const uint32_t* index = reinterpret_cast<const uint32_t*>(payload + index_offset);
  const V* values = reinterpret_cast<const V*>(payload + values_offset);
  const bool values_aligned = reinterpret_cast<uintptr_t>(values) % 16 == 0;
  const int64_t nnz = index[tiles];
  const int64_t value_room = (capacity - values_offset) / int64_t(sizeof(V));
  if (nnz > n || nnz > value_room) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(status, kBadNnz);
    return;
  }
  if (kAccumulate && sparse_payload(nnz, n)) return;  // the warp-per-tile kernel decodes it
  const int c0 = 2 * lane, c1 = c0 + 1;
  // The next tile's words and index step are loaded while this tile's rows are written.
  ulonglong2 w_next = make_ulonglong2(0ull, 0ull);
  uint32_t lo_next = 0, hi_next = 0;
  if (blockIdx.x < tiles) {
    w_next = reinterpret_cast<const ulonglong2*>(bits + int64_t(blockIdx.x) * kTileRows)[lane];
    lo_next = index[blockIdx.x];
    hi_next = index[blockIdx.x + 1];
  }
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const ulonglong2 w = w_next;
    const uint32_t lo = lo_next, hi = hi_next;
    if (tile + gridDim.x < tiles) {
      w_next = reinterpret_cast<const ulonglong2*>(bits + (tile + gridDim.x) * kTileRows)[lane];
      lo_next = index[tile + gridDim.x];
      hi_next = index[tile + gridDim.x + 1];
    }
    uint32_t inclusive, total;
    const int bad = check_tile(w, make_ulonglong2(0ull, 0ull), lo, hi, nnz, tile, n, lane, inclusive, total);
    if (bad) {  // block-uniform: every warp computed the same `bad`
      if (warp == 0 && lane == 0) atomicOr(status, bad);
      continue;
    }
    const uint32_t n0 = __popcll(w.x);
    const int64_t base = tile * kTile;
    D* out = dst + base + c0;
    Pair row[kRows];
    const V* col0;
    if constexpr (kAccumulate) {
      // Read every marked element of the warp's rows before anything waits on one, so that the
      // reads are in flight together and with the staging. Marked bits lie below n (checked above).
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = warp * kRows + i;
        if ((w.x >> r) & 1ull) row[i].e[0] = out[r * kTileRows];
        if ((w.y >> r) & 1ull) row[i].e[1] = out[r * kTileRows + 1];
      }
      __syncthreads();  // the previous tile's gathers are done with stage_s
      const uint32_t shift = stage_run(stage_s, values, lo, total, values_aligned);
      __syncthreads();
      col0 = stage_s + shift + (inclusive - n0 - __popcll(w.y));
    } else {
      col0 = values + lo + (inclusive - n0 - __popcll(w.y));
    }
    const V* col1 = col0 + n0;
    if constexpr (kAccumulate) {
      // Add to and write the marked elements only: unmarked ones keep their bits.
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = warp * kRows + i;
        const unsigned long long below = (1ull << r) - 1ull;
        if ((w.x >> r) & 1ull) out[r * kTileRows] = from_float<D>(to_float(row[i].e[0]) + to_float(col0[__popcll(w.x & below)]));
        if ((w.y >> r) & 1ull) out[r * kTileRows + 1] = from_float<D>(to_float(row[i].e[1]) + to_float(col1[__popcll(w.y & below)]));
      }
    } else if (total <= kScatterMax<D>) {
      // A sparse tile (or an empty one): zero the warp's rows with 16-byte stores, then store its
      // marked elements, each lane walking the set bits of its two columns' words.
      const unsigned long long above = (1ull << (warp * kRows)) - 1ull;
      const V* at0 = col0 + __popcll(w.x & above);
      const V* at1 = col1 + __popcll(w.y & above);
      D* rows = dst + base + warp * kRows * kTileRows;
      if (aligned && n - base >= kTile) {
        constexpr int kVectors = kRows * kTileRows * int(sizeof(D)) / 16;
#pragma unroll
        for (int v = lane; v < kVectors; v += 32) reinterpret_cast<uint4*>(rows)[v] = make_uint4(0u, 0u, 0u, 0u);
      } else {
        for (int i = lane; i < kRows * kTileRows; i += 32)
          if (base + warp * kRows * kTileRows + i < n) rows[i] = D(0);
      }
      __syncwarp();  // the zeros land before the lanes' marked elements
      uint32_t k = 0;
      for (uint32_t m = uint32_t(w.x >> (warp * kRows)) & 0xffu; m; m &= m - 1)
        out[(warp * kRows + __ffs(m) - 1) * kTileRows] = at0[k++];
      k = 0;
      for (uint32_t m = uint32_t(w.y >> (warp * kRows)) & 0xffu; m; m &= m - 1)
        out[(warp * kRows + __ffs(m) - 1) * kTileRows + 1] = at1[k++];
    } else {
      // A dense tile: each column's values from the warp's first row on, one more per marked row
      // (a running offset: +5-8 points for 16-bit elements over a popcount per row, but -10 to
      // -20 points in accumulation, which keeps the popcount); a coalesced pair per row and lane.
      const unsigned long long above = (1ull << (warp * kRows)) - 1ull;
      const V* at0 = col0 + __popcll(w.x & above);
      const V* at1 = col1 + __popcll(w.y & above);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = warp * kRows + i;
        const bool m0 = (w.x >> r) & 1ull, m1 = (w.y >> r) & 1ull;
        row[i].e[0] = m0 ? *at0 : D(0);
        row[i].e[1] = m1 ? *at1 : D(0);
        at0 += m0;
        at1 += m1;
      }
      const bool full = aligned && n - base >= kTile;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = warp * kRows + i;
        if (full) {
          *reinterpret_cast<decltype(row[i].vec)*>(out + r * kTileRows) = row[i].vec;
        } else {
          if (base + r * kTileRows + c0 < n) out[r * kTileRows] = row[i].e[0];
          if (base + r * kTileRows + c1 < n) out[r * kTileRows + 1] = row[i].e[1];
        }
      }
    }
  }
}

// One marked element of a sparse decode: add the value (accumulate) or store it (patch).
template <int kMode, typename V, typename D>
__device__ __forceinline__ void put(D* at, V value) {
  if constexpr (kMode == kAccumulate) *at = from_float<D>(to_float(*at) + to_float(value));
  else *at = value;
}

// Decodes that touch only marked elements (patch, and accumulation of sparse payloads): one warp
// per tile, so that eight tiles per block are in flight at once. At high sparsity these decodes
// are bound by latency per tile, not by bandwidth (the block-per-tile form took ~6 ns per tile,
// 0.33 ms per GiB, at any sparsity), and warps that wait on one tile's loads leave the SM to the
// others; dense payloads are faster block per tile (kSparsePercent). Lane l owns
// columns 2l and 2l+1. A tile with few nonzeros has each lane walk the set bits of its words
// (ffs); a fuller one goes row by row, each lane handling its two columns' marked elements,
// so that a warp's accesses to a row stay coalesced. Patch also zeros the elements only the
// prior's words `pw` mark. Marked elements lie below n (check_tile).
constexpr uint32_t kWalkMax = 128;  // tile counts up to this take the bit walk

template <typename V, typename D, int kMode>
__global__ void __launch_bounds__(kThreads, 8) pici_sparse_decode_kernel(
    const uint8_t* __restrict__ payload, int64_t capacity, int64_t n, int64_t tiles,
    int64_t index_offset, int64_t values_offset, D* __restrict__ dst,
    const uint8_t* __restrict__ prior, int32_t* __restrict__ status) {
  const int lane = threadIdx.x & 31;
  const unsigned long long* bits = reinterpret_cast<const unsigned long long*>(payload);
  const unsigned long long* prior_bits = reinterpret_cast<const unsigned long long*>(prior);
  const uint32_t* index = reinterpret_cast<const uint32_t*>(payload + index_offset);
  const V* values = reinterpret_cast<const V*>(payload + values_offset);
  const int64_t nnz = index[tiles];
  const int64_t value_room = (capacity - values_offset) / int64_t(sizeof(V));
  const int64_t first = int64_t(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (nnz > n || nnz > value_room) {
    if (first == 0 && lane == 0) atomicOr(status, kBadNnz);
    return;
  }
  if (kMode == kAccumulate && !sparse_payload(nnz, n)) return;  // the block-per-tile kernel decodes it
  const int64_t stride = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t tile = first; tile < tiles; tile += stride) {
    const ulonglong2 w = reinterpret_cast<const ulonglong2*>(bits + tile * kTileRows)[lane];
    ulonglong2 pw = make_ulonglong2(0ull, 0ull);
    if constexpr (kMode == kPatch) pw = reinterpret_cast<const ulonglong2*>(prior_bits + tile * kTileRows)[lane];
    uint32_t inclusive, total;
    const int bad = check_tile(w, pw, index[tile], index[tile + 1], nnz, tile, n, lane, inclusive, total);
    if (bad) {  // warp-uniform
      if (lane == 0) atomicOr(status, bad);
      continue;
    }
    const uint32_t n0 = __popcll(w.x);
    const V* col0 = values + index[tile] + (inclusive - n0 - __popcll(w.y));
    const V* col1 = col0 + n0;
    D* out = dst + tile * kTile + 2 * lane;
    if constexpr (kMode == kPatch) {  // zeros first: no element is both zeroed and written
      for (unsigned long long m = pw.x & ~w.x; m; m &= m - 1) out[(__ffsll(m) - 1) * kTileRows] = D(0);
      for (unsigned long long m = pw.y & ~w.y; m; m &= m - 1) out[(__ffsll(m) - 1) * kTileRows + 1] = D(0);
    }
    if (total <= kWalkMax) {
      uint32_t k = 0;
      for (unsigned long long m = w.x; m; m &= m - 1) put<kMode>(out + (__ffsll(m) - 1) * kTileRows, col0[k++]);
      k = 0;
      for (unsigned long long m = w.y; m; m &= m - 1) put<kMode>(out + (__ffsll(m) - 1) * kTileRows + 1, col1[k++]);
    } else {
#pragma unroll 8
      for (int r = 0; r < kTileRows; ++r) {
        const unsigned long long below = (1ull << r) - 1ull;
        if ((w.x >> r) & 1ull) put<kMode>(out + r * kTileRows, col0[__popcll(w.x & below)]);
        if ((w.y >> r) & 1ull) put<kMode>(out + r * kTileRows + 1, col1[__popcll(w.y & below)]);
      }
    }
  }
}

struct PiciOffsets {
  int64_t tiles, index_offset, values_offset;
  explicit PiciOffsets(int64_t n)
      : tiles((n + kTile - 1) / kTile),
        index_offset(512 * tiles),
        values_offset(512 * tiles + align16(4 * (tiles + 1))) {}
};

template <typename Tile>
void launch_compress(const typename Tile::Source& source, int64_t n, uint8_t* out, int64_t capacity, void* scratch,
                     int64_t* nnz, cudaStream_t stream) {
  const PiciOffsets off(n);
  const int64_t units = (off.tiles + Tile::kUnit - 1) / Tile::kUnit;  // the look-back's steps
  check_cuda(cudaMemsetAsync(scratch, 0, compress_scratch_bytes(units), stream), "cudaMemsetAsync");
  auto kernel = pici_compress_kernel<Tile>;
  const int blocks = resident_blocks(kernel, units);
  kernel<<<blocks, kThreads, 0, stream>>>(source, off.tiles, out, capacity, off.index_offset, off.values_offset,
                                          look_back_state(scratch, units), nnz);
  check_launch("pici_compress_kernel");
}

template <typename T>
void launch_plain_compress(const T* src, int64_t n, uint8_t* out, int64_t capacity, void* scratch, int64_t* nnz,
                           cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0;
  launch_compress<PlainTile<T>>({src, n, aligned}, n, out, capacity, scratch, nnz, stream);
}

template <typename G, typename E>
void launch_prune_compress(const void* grad, void* error, int64_t n, const float* threshold, float decay,
                           unsigned int* kept, uint8_t* out, int64_t capacity, void* scratch, int64_t* nnz,
                           cudaStream_t stream) {
  using Tile = PruneTile<G, E>;
  const bool aligned = reinterpret_cast<uintptr_t>(grad) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(error) % (Tile::kErrorBytes < 16 ? Tile::kErrorBytes : 16) == 0;
  const typename Tile::Source source{static_cast<const typename Tile::Bits*>(grad),
                                     static_cast<typename Tile::EBits*>(error), n, aligned, threshold, decay, kept};
  launch_compress<Tile>(source, n, out, capacity, scratch, nnz, stream);
}

template <typename G>
void launch_prune_compress(const void* grad, void* error, Elem error_type, int64_t n, const float* threshold,
                           float decay, unsigned int* kept, uint8_t* out, int64_t capacity, void* scratch,
                           int64_t* nnz, cudaStream_t stream) {
  if (error_type == Elem::kF32) {
    launch_prune_compress<G, float>(grad, error, n, threshold, decay, kept, out, capacity, scratch, nnz, stream);
  } else if (error_type == Elem::kBF16) {
    launch_prune_compress<G, __nv_bfloat16>(grad, error, n, threshold, decay, kept, out, capacity, scratch, nnz,
                                            stream);
  } else {
    launch_prune_compress<G, __half>(grad, error, n, threshold, decay, kept, out, capacity, scratch, nnz, stream);
  }
}

template <typename V, typename D, bool kAccumulate>
void launch_decompress(const uint8_t* payload, int64_t capacity, int64_t n, void* dst, int32_t* status,
                       cudaStream_t stream) {
  const PiciOffsets off(n);
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  auto kernel = pici_decompress_kernel<V, D, kAccumulate>;
  kernel<<<resident_blocks(kernel, off.tiles), kThreads, 0, stream>>>(
      payload, capacity, n, off.tiles, off.index_offset, off.values_offset, static_cast<D*>(dst), aligned, status);
  check_launch("pici_decompress_kernel");
}

// Patch, or accumulate: then both kernels go, and the one the payload's density does not suit
// returns after reading nnz (kSparsePercent).
template <typename V, typename D, int kMode>
void launch_sparse_decode(const uint8_t* payload, int64_t capacity, int64_t n, void* dst, const uint8_t* prior,
                          int32_t* status, cudaStream_t stream) {
  const PiciOffsets off(n);
  auto kernel = pici_sparse_decode_kernel<V, D, kMode>;
  const int64_t blocks = (off.tiles + kThreads / 32 - 1) / (kThreads / 32);  // a warp per tile at most
  kernel<<<resident_blocks(kernel, blocks), kThreads, 0, stream>>>(
      payload, capacity, n, off.tiles, off.index_offset, off.values_offset, static_cast<D*>(dst), prior, status);
  check_launch("pici_sparse_decode_kernel");
  if constexpr (kMode == kAccumulate) launch_decompress<V, D, true>(payload, capacity, n, dst, status, stream);
}

}  // namespace

int64_t compress_scratch_bytes(int64_t tiles) { return 8 * (tiles + 2 * look_back_groups(tiles)) + 8; }

void pici_compress(const void* src, int elem_bytes, int64_t n, uint8_t* out, int64_t capacity,
                   void* scratch, int64_t* nnz, cudaStream_t stream) {
  const PiciOffsets off(n);
  if (n == 0) {
    // No tiles: the payload is I = [0] and its padding.
    check_cuda(cudaMemsetAsync(out, 0, off.values_offset, stream), "cudaMemsetAsync");
    check_cuda(cudaMemsetAsync(nnz, 0, sizeof(int64_t), stream), "cudaMemsetAsync");
    return;
  }
  if (elem_bytes == 4) {
    launch_plain_compress(static_cast<const uint32_t*>(src), n, out, capacity, scratch, nnz, stream);
  } else {
    launch_plain_compress(static_cast<const uint16_t*>(src), n, out, capacity, scratch, nnz, stream);
  }
}

void pici_prune_compress(const void* grad, Elem grad_type, void* error, Elem error_type, int64_t n,
                         const float* threshold, float decay, unsigned int* kept, uint8_t* out, int64_t capacity,
                         void* scratch, int64_t* nnz, cudaStream_t stream) {
  if (n == 0) {
    check_cuda(cudaMemsetAsync(out, 0, PiciOffsets(n).values_offset, stream), "cudaMemsetAsync");
    check_cuda(cudaMemsetAsync(nnz, 0, sizeof(int64_t), stream), "cudaMemsetAsync");
    return;
  }
  if (grad_type == Elem::kF32) {
    launch_prune_compress<float>(grad, error, error_type, n, threshold, decay, kept, out, capacity, scratch, nnz,
                                 stream);
  } else if (grad_type == Elem::kBF16) {
    launch_prune_compress<__nv_bfloat16>(grad, error, error_type, n, threshold, decay, kept, out, capacity, scratch,
                                         nnz, stream);
  } else {
    launch_prune_compress<__half>(grad, error, error_type, n, threshold, decay, kept, out, capacity, scratch, nnz,
                                  stream);
  }
}

void pici_decompress(const uint8_t* payload, int64_t capacity, int64_t n, Elem value, void* dst,
                     Elem dst_type, bool accumulate, const uint8_t* prior, int32_t* status,
                     cudaStream_t stream) {
  if (n == 0) return;
  if (!accumulate) {
    // Overwrite and patch copy bits: the element size is all that matters.
    if (value == Elem::kF32) {
      if (prior) launch_sparse_decode<uint32_t, uint32_t, kPatch>(payload, capacity, n, dst, prior, status, stream);
      else launch_decompress<uint32_t, uint32_t, false>(payload, capacity, n, dst, status, stream);
    } else {
      if (prior) launch_sparse_decode<uint16_t, uint16_t, kPatch>(payload, capacity, n, dst, prior, status, stream);
      else launch_decompress<uint16_t, uint16_t, false>(payload, capacity, n, dst, status, stream);
    }
  } else if (dst_type == Elem::kF32) {
    if (value == Elem::kF32) {
      launch_sparse_decode<float, float, kAccumulate>(payload, capacity, n, dst, nullptr, status, stream);
    } else if (value == Elem::kBF16) {
      launch_sparse_decode<__nv_bfloat16, float, kAccumulate>(payload, capacity, n, dst, nullptr, status, stream);
    } else {
      launch_sparse_decode<__half, float, kAccumulate>(payload, capacity, n, dst, nullptr, status, stream);
    }
  } else if (dst_type == Elem::kBF16) {
    launch_sparse_decode<__nv_bfloat16, __nv_bfloat16, kAccumulate>(payload, capacity, n, dst, nullptr, status, stream);
  } else {
    launch_sparse_decode<__half, __half, kAccumulate>(payload, capacity, n, dst, nullptr, status, stream);
  }
}

}  // namespace spccl
