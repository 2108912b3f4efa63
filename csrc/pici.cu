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

// Tiles with at least this many nonzeros (of 4096) compact every row of a column segment at once,
// no load waiting on the bit walk; sparser ones walk the set bits. Measured on H100 (1 GiB,
// fraction of copy, two rounds; bench/results/2026-11-26_thirteenth/): bf16 compress at 50%
// 0.83 -> 0.86 and fp32 0.91 -> 0.92 with 1536 or 512; at 75% (about 1024 per tile) 0.84 with
// the walk, 0.83 with every row (512); 90-99% unchanged.
#ifndef SPCCL_DENSE_COMPACT
#define SPCCL_DENSE_COMPACT 1536
#endif
constexpr uint32_t kDenseCompact = SPCCL_DENSE_COMPACT;

// Coalesced copy of `count` compacted values to A[base...]; nothing is written past capacity.
// Two values per store (a 4- or 8-byte word) from the first aligned one on: bf16 at 50% sparsity
// 0.73 -> 0.79 of copy on H100 (one store per value, each checked against the capacity, had
// been a sixth of the kernel's instructions). The payload's values and words are stored evict
// first: on one H100 (1 GiB, two rounds against plain stores) bf16 compress 0.84 -> 0.85 of copy
// at 75% (0.559 -> 0.552 ms), 1-2% faster at 95-99.9% and fp32's at 95-99%; the fused prune +
// encode pass 1.149 -> 1.137 ms per GiB (fp32), bf16 / bf16 0.630 -> 0.616
// (bench/results/2026-11-27_nineteenth/ab_payload_stores/). Not measured: a small payload that
// the collective sends at once, which plain stores may leave in L2 for the send.
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
    __stcs(out + i, Word(lo | (hi << (8 * sizeof(T)))));
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

  // Whether a unit whose tiles held `nonzeros` calls for the unit after next (Tile::kPrefetchMin).
  __device__ __forceinline__ static bool prefetches_after(uint32_t nonzeros) {
    if constexpr (Tile::kPrefetchMin == 0) return true;
    else return nonzeros >= kTiles * Tile::kPrefetchMin;
  }
  __device__ __forceinline__ static void prefetch(const typename Tile::Source& s, int64_t unit) {
#pragma unroll
    for (int u = 0; u < kTiles; ++u) Tile::prefetch(s, unit * kTiles + u);
  }
  __device__ __forceinline__ void load(const typename Tile::Source& s, int64_t unit) {
#pragma unroll
    for (int u = 0; u < kTiles; ++u) part[u].load(s, unit * kTiles + u);
  }
  __device__ __forceinline__ void prepare(const typename Tile::Source& s, int64_t unit) {
#pragma unroll
    for (int u = 0; u < kTiles; ++u) part[u].prepare(s, unit * kTiles + u);
  }
  __device__ __forceinline__ void finish(const typename Tile::Source& s) const {
#pragma unroll
    for (int u = 0; u < kTiles; ++u) part[u].finish(s);
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

// Where a unit of a launch's pieces lies: its piece's row, which piece, and the unit's index
// within the piece.
struct Place {
  PieceRow row;
  int64_t piece, local;
};

// The place of `unit` (counted over all pieces' units), found by the whole warp and returned in
// every lane: a 32-way search of the rows' first units per step (one step for up to 32 pieces,
// two for 1024). Every piece has a unit (piece_units), so the rows' first units increase.
__device__ __forceinline__ Place place_of(const Pieces& ps, int64_t unit, int lane) {
  if (ps.count == 1) return {ps.one, 0, unit};
  int64_t lo = 0, span = ps.count;
  while (span > 1) {
    const int64_t step = (span + 31) / 32, at = lo + lane * step;
    const bool before = at < lo + span && ps.rows[at].first_unit <= unit;  // true in lane 0
    const int64_t found = lo + (__popc(__ballot_sync(kFullMask, before)) - 1) * step;
    span = min(step, lo + span - found);
    lo = found;
  }
  const PieceRow row = ps.rows[lo];
  return {row, lo, unit - row.first_unit};
}

// The look-back state of one piece: its own units' words and its own groups.
__device__ __forceinline__ LookBack look_back_of(const LookBack& all, const PieceRow& row) {
  return {all.tile + row.first_unit, all.group_sum + row.first_group, all.group_prefix + row.first_group, all.counter};
}

// A piece's payload: B at the start, then I, then the values (docs/FORMATS.md).
struct PayloadOffsets {
  int64_t tiles, index, values;
  __host__ __device__ explicit PayloadOffsets(int64_t n)
      : tiles((n + kTile - 1) / kTile), index(512 * tiles), values(512 * tiles + ((4 * (tiles + 1) + 15) & ~int64_t(15))) {}
};

// Units of a piece of n elements, `unit` tiles each: at least one, so that an empty piece's
// payload (I = [0] and its padding) and count are written like any other's.
__host__ __device__ __forceinline__ int64_t piece_units(int64_t n, int64_t unit) {
  const int64_t units = (PayloadOffsets(n).tiles + unit - 1) / unit;
  return units > 0 ? units : 1;
}

// What a block knows of a claimed unit held in slot `slot` of its places (`unit`: its index over
// all pieces). With one piece (kOne) everything comes from the launch's arguments, and the
// kernel is the single-range encoder it was before pieces: no shared loads on its look-back's path.
template <bool kOne>
__device__ __forceinline__ const PieceRow& row_in(const Pieces& ps, const Place* places, int slot) {
  if constexpr (kOne) return ps.one;
  else return places[slot].row;
}
template <bool kOne>
__device__ __forceinline__ int64_t local_in(const Place* places, int slot, int64_t unit) {
  if constexpr (kOne) return unit;
  else return places[slot].local;
}

// One launch encodes every piece of `pieces`: units (Tile::kUnit tiles) are claimed in order
// from one counter over all pieces' units, and each piece has its own look-back state, so a
// piece's offsets wait only on its own earlier units. Claims are in order, so a unit's
// predecessors in its piece are all claimed by running blocks (see look_back). `kOne`: the
// launch has one piece (pieces.count == 1), so claims need no place.
template <typename Tile, bool kOne>
__global__ void __launch_bounds__(kThreads, Tile::kMinBlocks) pici_compress_kernel(
    const typename Tile::Source source, const Pieces pieces, uint8_t* __restrict__ out, const LookBack lb,
    int64_t* __restrict__ nnz_out) {
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
  // The places of the unit in hand, of the next one, and of the one claimed meanwhile, in turn
  // (several pieces only).
  __shared__ Place place_s[kOne ? 1 : 3];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t units = pieces.units;

  // Each block holds two claims: the unit it processes and the next one, whose loads are in
  // flight meanwhile. A claimed unit's count is published before the block waits on anything.
  if (warp == 0) {
    int64_t first = 0, second = 0;
    if (lane == 0) {
      first = atomicAdd(lb.counter, 1u);
      second = atomicAdd(lb.counter, 1u);
      claim_s[0] = first;
      claim_s[1] = second;
      next_count_s = 0;
      arrived_s = 0;
    }
    if constexpr (!kOne) {
      first = __shfl_sync(kFullMask, first, 0);
      second = __shfl_sync(kFullMask, second, 0);
      const Place a = first < units ? place_of(pieces, first, lane) : Place{};
      const Place b = second < units ? place_of(pieces, second, lane) : Place{};
      if (lane == 0) {
        place_s[0] = a;
        place_s[1] = b;
      }
    }
  }
  __syncthreads();
  int64_t unit = claim_s[0], next = claim_s[1];
  int here = 0, ahead = 1;  // slots of place_s
  Unit<Tile> regs;
  if (unit < units) {
    const PieceRow& row = row_in<kOne>(pieces, place_s, here);
    const int64_t local = local_in<kOne>(place_s, here, unit);
    const auto src = source.at(row.piece.start, row.piece.n);
    regs.load(src, local);
    regs.prepare(src, local);
    publish_count(regs, local, look_back_of(lb, row), count_s);
  }

  // Staged values of the previous unit wait in stage_s for their copy-out, done at the start
  // of the next iteration (alongside phase 1) to save a barrier.
  uint32_t pending = 0;
  int64_t pending_base = 0, pending_room = 0;
  T* pending_values = nullptr;
  while (unit < units) {
    const int spare = 3 - here - ahead;
    regs.store_shared(tile_s);
    __syncthreads();
    if (next < units) {  // in flight while this unit is processed
      const PieceRow& row = row_in<kOne>(pieces, place_s, ahead);
      regs.load(source.at(row.piece.start, row.piece.n), local_in<kOne>(place_s, ahead, next));
    }
    copy_out(stage_s, pending, pending_base, pending_values, pending_room);

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
      const PieceRow& row = row_in<kOne>(pieces, place_s, here);
      const int64_t tiles = PayloadOffsets(row.piece.n).tiles, first = local_in<kOne>(place_s, here, unit) * U;
      unsigned long long* bits = reinterpret_cast<unsigned long long*>(out + row.piece.offset);
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
        if (first + u < tiles)
          __stcs(reinterpret_cast<ulonglong2*>(bits + (first + u) * kTileRows) + lane, make_ulonglong2(w0, w1));
        const uint32_t n0 = __popcll(w0), n1 = __popcll(w1);
        const uint32_t inclusive = warp_inclusive_scan(n0 + n1, lane);
        colpre_s[u][c0] = before + inclusive - n0 - n1;
        colpre_s[u][c1] = before + inclusive - n1;
        if (lane == 31) total_s[u] = inclusive;
        before += __shfl_sync(kFullMask, inclusive, 31);
      }
    }
    __syncthreads();

    // Phases 3-4 overlap: warp 0 publishes the next unit's count and looks back for this unit's
    // offset while warps 1-7 compact; then warp 0 compacts its own share. The unit after next is
    // claimed meanwhile: by warp 0 after its look-back (kOne), or by warp 1, which finds its
    // place after its compaction (the kernel for any number of pieces).
    uint32_t ticket = 0;
    if (warp == 0) {
      if (next < units) {
        const PieceRow& row = row_in<kOne>(pieces, place_s, ahead);
        const int64_t local = local_in<kOne>(place_s, ahead, next);
        regs.prepare(source.at(row.piece.start, row.piece.n), local);
        add_count_and_publish(regs, local, look_back_of(lb, row), &next_count_s, &arrived_s);
      }
      const PieceRow& row = row_in<kOne>(pieces, place_s, here);
      const int64_t local = local_in<kOne>(place_s, here, unit);
      const LookBack mine = look_back_of(lb, row);
      const uint32_t exclusive = local == 0 ? 0u : look_back(mine, local, lane);
      if (lane == 0) {
        if constexpr (kOne) claim_s[0] = atomicAdd(lb.counter, 1u);
        const PayloadOffsets off(row.piece.n);
        uint32_t* index = reinterpret_cast<uint32_t*>(out + row.piece.offset + off.index);
        uint32_t inclusive = exclusive;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (local * U + u < off.tiles) index[local * U + u] = inclusive;
          inclusive += total_s[u];
        }
        publish_prefix(mine, local, inclusive);  // first: later units' look-backs wait on it
        prefix_s = exclusive;
        if constexpr (kOne) {
          const int64_t after = claim_s[0];
          if (after < units && Unit<Tile>::prefetches_after(inclusive - exclusive))
            Unit<Tile>::prefetch(source.at(row.piece.start, row.piece.n), after);
        }
        if (local == piece_units(row.piece.n, U) - 1) {  // the piece's last unit
          index[off.tiles] = inclusive;
          // Zero the padding after I up to the 16-byte aligned values.
          for (int64_t i = 4 * (off.tiles + 1); i < off.values - off.index; i += 4) index[i / 4] = 0u;
          nnz_out[kOne ? 0 : place_s[here].piece] = inclusive;
        }
      }
    } else if (!kOne && warp == 1 && lane == 0) {
      ticket = atomicAdd(lb.counter, 1u);  // waited for only after this warp's compaction
    }
    // Phase 3: compact this thread's column segment of each tile into stage_s (unit-local
    // positions): in a dense tile all 16 rows, loaded at once and stored where marked; else
    // walking the set bits with ffs.
    {
      const int c = tid & 63, g = tid >> 6;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const unsigned long long w = word_s[u][c];
        uint32_t m = uint32_t(w >> (16 * g)) & 0xffffu;
        uint32_t pos = colpre_s[u][c] + __popcll(w & ((1ull << (16 * g)) - 1ull));
        const T* column = tile_s + u * kTile + 16 * g * kTileRows + c;
        if (total_s[u] >= kDenseCompact) {  // the same for the whole block
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            const T v = column[i * kTileRows];
            if (m & (1u << i)) stage_s[pos + __popc(m & ((1u << i) - 1u))] = v;
          }
        } else {
          while (m) {
            const int r = __ffs(m) - 1;
            m &= m - 1;
            stage_s[pos++] = column[r * kTileRows];
          }
        }
      }
    }
    if (warp != 0 && next < units) {
      const PieceRow& row = row_in<kOne>(pieces, place_s, ahead);
      const int64_t local = local_in<kOne>(place_s, ahead, next);
      regs.prepare(source.at(row.piece.start, row.piece.n), local);
      add_count_and_publish(regs, local, look_back_of(lb, row), &next_count_s, &arrived_s);
    }
    if constexpr (!kOne) {
      if (warp == 1) {
        const int64_t after = __shfl_sync(kFullMask, ticket, 0);
        if (lane == 0) claim_s[0] = after;
        if (after < units) {
          const Place p = place_of(pieces, after, lane);
          if (lane == 0) place_s[spare] = p;
        }
        uint32_t nonzeros = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) nonzeros += total_s[u];
        if (lane == 0 && after < units && Unit<Tile>::prefetches_after(nonzeros)) {
          const Place& p = place_s[spare];
          Unit<Tile>::prefetch(source.at(p.row.piece.start, p.row.piece.n), p.local);
        }
      }
    }
    __syncthreads();

    const int64_t after = claim_s[0];
    pending = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) pending += total_s[u];
    pending_base = prefix_s;
    {  // where they go: the piece's values, and their room (recomputed: fewer registers held)
      const PiciPiece& piece = row_in<kOne>(pieces, place_s, here).piece;
      const int64_t values_at = PayloadOffsets(piece.n).values;
      pending_values = reinterpret_cast<T*>(out + piece.offset + values_at);
      pending_room = (piece.capacity - values_at) / int64_t(sizeof(T));
    }
    unit = next;
    next = after;
    if constexpr (!kOne) {
      here = ahead;
      ahead = spare;
    }
  }
  copy_out(stage_s, pending, pending_base, pending_values, pending_room);
  regs.finish(source);
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
// popcount `total`, and stays within nnz. Returns the status bits (0: good).
__device__ __forceinline__ int tile_status(ulonglong2 w, ulonglong2 pw, uint32_t lo, uint32_t hi, uint32_t total,
                                           int64_t nnz, int64_t tile, int64_t n, int lane) {
  const int c0 = 2 * lane, c1 = c0 + 1;
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

// tile_status, with the lane's inclusive column-pair prefix and the tile's count.
__device__ __forceinline__ int check_tile(ulonglong2 w, ulonglong2 pw, uint32_t lo, uint32_t hi, int64_t nnz,
                                          int64_t tile, int64_t n, int lane, uint32_t& inclusive, uint32_t& total) {
  inclusive = warp_inclusive_scan(__popcll(w.x) + __popcll(w.y), lane);
  total = __shfl_sync(kFullMask, inclusive, 31);
  return tile_status(w, pw, lo, hi, total, nnz, tile, n, lane);
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

// Sum over the warp, the same in every lane: one instruction from sm_80 on.
__device__ __forceinline__ uint32_t warp_total(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_add_sync(kFullMask, v);
#else
  return warp_sum(v);
#endif
}

// Overwrite decodes a tile of 16-bit elements with at most this many nonzeros (of 4096) by zeroing
// it and then storing the marked elements; denser tiles, and 32-bit ones that are not empty, gather
// every element (an empty tile of either size is only zeroed). First measured on H100 (1 GiB,
// fraction of copy, gather -> zero and store, bf16 / fp32, each marked element loaded and stored
// in turn, straight to the tile): 99.9% 0.77 -> 0.87 / 0.88 -> 0.89, 99% 0.76 -> 0.83 / 0.86 ->
// 0.85, 95% 0.75 -> 0.64 / 0.85 -> 0.81, 80% 0.74 -> 0.35 / 0.86 -> 0.47. Since a whole tile is
// zeroed and scattered in shared memory, its stores whole, and the next tile's values prefetched,
// the bit walk is no longer what waits: bf16 at 95% (tiles of about 205) went 0.477 -> 0.457 ms
// (0.83 -> 0.87) with 256 here instead of 128. With two marked elements of each column loaded
// together per pass of the walk, 512 (tiles of about 410 at 90%) took 90% 0.497 -> 0.481 ms
// (0.84 -> 0.86) and 95% 0.459, and cost 0.7% at 99% (0.439 -> 0.442 against the old walk at 256);
// 1024 lost at 75% (0.553 -> 0.570 ms), so 512 (bench/results/2026-11-27_twentieth/).
#ifndef SPCCL_SCATTER_MAX_16
#define SPCCL_SCATTER_MAX_16 512
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

// Accumulation of dense payloads of 32-bit values, and of 16-bit ones into fp32 (sparse payloads
// go to pici_sparse_decode_kernel, 16-bit ones into their own type to pici_column_decode_kernel),
// one block per tile. Every warp reads the tile's 64 words and index step (L1 broadcasts; the next tile's are
// prefetched into registers), and each warp takes 8 rows: lane l owns columns 2l and 2l+1 and
// holds their words and offsets in registers. It reads the marked elements of dst, stages the
// tile's run of A in shared memory (gathers there cost a few bank conflicts where L1 replays per
// line; measured +10-15 points), and then adds and writes the marked elements only, gathering
// values at colprefix + popcount(word below the row) (a running offset instead measured 10-20
// points slower here: the kernel is at its 64-register cap). Every read is issued before the
// staging: a read, add and write of one element after another waited out a memory round trip
// each (H100, 90% sparsity: 0.33 of copy for bf16, 0.74 for fp32).
template <typename V, typename D>
__global__ void __launch_bounds__(kThreads, 4) pici_accumulate_kernel(
    const uint8_t* __restrict__ payload, int64_t capacity, int64_t n, int64_t tiles,
    int64_t index_offset, int64_t values_offset, D* __restrict__ dst, int32_t* __restrict__ status) {
  constexpr int kRows = kTileRows / (kThreads / 32);  // rows per warp
  struct Pair {  // a row's two elements, in one register for 16-bit types
    D e[2];
  };
  __shared__ __align__(16) V stage_s[kTile + 16 / sizeof(V)];
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
  if (sparse_payload(nnz, n)) return;  // the warp-per-tile kernel decodes it
  const int c0 = 2 * lane;
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
    D* out = dst + tile * kTile + c0;
    // Read every marked element of the warp's rows before anything waits on one, so that the
    // reads are in flight together and with the staging. Marked bits lie below n (checked above).
    Pair row[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = warp * kRows + i;
      if ((w.x >> r) & 1ull) row[i].e[0] = out[r * kTileRows];
      if ((w.y >> r) & 1ull) row[i].e[1] = out[r * kTileRows + 1];
    }
    __syncthreads();  // the previous tile's gathers are done with stage_s
    const uint32_t shift = stage_run(stage_s, values, lo, total, values_aligned);
    __syncthreads();
    const V* col0 = stage_s + shift + (inclusive - n0 - __popcll(w.y));
    const V* col1 = col0 + n0;
    // Add to and write the marked elements only: unmarked ones keep their bits.
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = warp * kRows + i;
      const unsigned long long below = (1ull << r) - 1ull;
      if ((w.x >> r) & 1ull) out[r * kTileRows] = from_float<D>(to_float(row[i].e[0]) + to_float(col0[__popcll(w.x & below)]));
      if ((w.y >> r) & 1ull) out[r * kTileRows + 1] = from_float<D>(to_float(row[i].e[1]) + to_float(col1[__popcll(w.y & below)]));
    }
  }
}

// Overwrite decode by columns, one block per tile (32-bit and 16-bit elements), and accumulation
// of 16-bit payloads into their own type the same way (`kMode`, below). The values of a
// column lie together in A, so lanes that take one column's rows read neighbouring values, and
// write them into the tile in shared memory; after one barrier each thread stores whole 16-byte
// pieces of rows. A row-wise gather (lane l owning columns 2l and 2l + 1, as pici_accumulate_kernel
// does from shared memory) sends each lane to its own column, 32 places of A per load; here a load
// touches one or two lines per column it reads. Warp w takes
// column pairs 4w to 4w + 3:
// - 32-bit elements: lane r takes rows r and r + 32 of each pair (a row's rank in its column is a
//   popcount of the column word below it); the pair's words come by broadcast loads, the starts
//   from one warp-wide sum;
// - 16-bit elements: eight lanes take a pair, eight rows each (offsets from popcounts of the
//   lane's eight bits) and one 32-bit word (the pair) per row: fewer instructions per value,
//   which bound bf16 (fp32 is bound by memory).
// In shared memory word k of row r (an element, or a column pair of 16-bit ones) sits at
// k ^ swizzle(r), with swizzle(r) = r % 32 (32-bit) or 4 (r / 8) (16-bit): each store of the
// columns falls in 32 banks, and a row's aligned 16-byte pieces stay whole (their words permuted
// by swizzle % 4). Two buffers take turns, so one barrier per tile keeps a tile's writes off the
// one its row stores still read. Empty tiles are zeroed without shared memory, and 16-bit tiles
// with at most kScatterMax nonzeros are zeroed, then scattered.
// `kBlocks`: resident blocks per SM (a register cap): kColumnBlocks for 32-bit elements,
// kWideColumnBlocks for 16-bit ones. Measured on H100 (1 GiB bf16, fraction of copy, 6 -> 8
// blocks): 0.82 -> 0.86 at 50% sparsity, 0.79-0.81 -> 0.83 at 75-95%. Sparse payloads, whose
// tiles are zeroed and scattered, once lost at 8 (0.84 -> 0.80 at 99%) and took a second
// kernel on 6, chosen on the device by density; since those tiles prefetch the next tile's
// values they run as fast on 8 (0.83-0.84 at 99%, 0.86 at 99.9%; 0.87-0.88 since they go through
// scatter_s), and one launch saves the other's 4 us (0.83 -> 0.84 at 90%;
// bench/results/2026-11-27_eighteenth/).
// `kMode` kAccumulate (16-bit payloads into their own type, the payload denser than
// kSparsePercent): the tile is staged as for overwrite, and each 16-byte piece of a row that holds
// a marked element is read, added to (add_marked) and written; pieces with none, and empty tiles,
// are neither read nor written. On 8 blocks per SM, measured on H100 (1 GiB bf16, fraction of copy
// counting the destination read and written whole, against pici_accumulate_kernel): 0.78 -> 0.96
// at 50% sparsity, 0.75 -> 0.95 at 75%, 0.76 -> 1.00 at 90%, 0.83 -> 1.11 at 95%, 0.91 -> 1.20 at
// 97%; on 6 blocks 2-5 points less. fp32 gained at 50% (0.91 -> 0.95) and lost 3-4 points at 90-97%
// (1.14 -> 1.10), where pici_accumulate_kernel touches fewer lines: it keeps 32-bit elements
// (bench/results/2026-11-26_twelfth/).
//
// add_marked: the staged word `s`, a pair of 16-bit elements of type E, added to the
// destination's `d` where marked, as pici_accumulate_kernel adds: widened to fp32, added, rounded
// once. A marked value is never a zero (is_nonzero), so a staged zero half is an unmarked element,
// whose bits stay as they are.
template <typename E>
__device__ __forceinline__ uint32_t add_marked(uint32_t d, uint32_t s) {
  static_assert(sizeof(E) == 2, "accumulation by columns takes 16-bit elements");
  float lo, hi;
  uint32_t sum;
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    lo = __uint_as_float(d << 16) + __uint_as_float(s << 16);
    hi = __uint_as_float(d & 0xffff0000u) + __uint_as_float(s & 0xffff0000u);
    const __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);  // .x (the low half) from lo
    sum = *reinterpret_cast<const uint32_t*>(&r);
  } else {
    lo = __half2float(__ushort_as_half(uint16_t(d))) + __half2float(__ushort_as_half(uint16_t(s)));
    hi = __half2float(__ushort_as_half(uint16_t(d >> 16))) + __half2float(__ushort_as_half(uint16_t(s >> 16)));
    const __half2 r = __floats2half2_rn(lo, hi);
    sum = *reinterpret_cast<const uint32_t*>(&r);
  }
  // 0xffff in each half whose staged magnitude is not zero (no carry crosses the halves)
  const uint32_t mask = ((((s & 0x7fff7fffu) + 0x7fff7fffu) & 0x80008000u) >> 15) * 0xffffu;
  return (sum & mask) | (d & ~mask);
}

// Values [lo, hi) of a payload whose values hold `room` (hi clamped to it) into L2, in whole
// 16-byte pieces (prefetch_l2).
template <typename V>
__device__ __forceinline__ void prefetch_values(const V* values, uint32_t lo, uint32_t hi, int64_t room) {
  const int64_t end_value = hi < room ? hi : room;
  const uintptr_t first = reinterpret_cast<uintptr_t>(values + lo) & ~uintptr_t(15);
  const uintptr_t end = reinterpret_cast<uintptr_t>(values + end_value) & ~uintptr_t(15);
  if (end > first) prefetch_l2(reinterpret_cast<const void*>(first), uint32_t(end - first));
}

constexpr int kColumnBlocks = 6;
constexpr int kWideColumnBlocks = 8;

template <typename E, int kBlocks, int kMode>
__global__ void __launch_bounds__(kThreads, kBlocks) pici_column_decode_kernel(
    const uint8_t* __restrict__ payload, int64_t capacity, int64_t n, int64_t tiles, int64_t index_offset,
    int64_t values_offset, typename BitsOf<sizeof(E)>::type* __restrict__ dst, bool aligned,
    int32_t* __restrict__ status) {
  using V = typename BitsOf<sizeof(E)>::type;                // what is staged and stored: bits
  constexpr bool kWide = sizeof(V) == 2;                     // two columns per 32-bit word
  constexpr int kWords = kWide ? kTileRows / 2 : kTileRows;  // 32-bit words per row
  constexpr int kRows = kTileRows / (kThreads / 32);         // rows per warp (zero and scatter)
  constexpr int kPairs = kTileRows / 2 / (kThreads / 32);    // column pairs per warp
  __shared__ __align__(16) uint32_t tile_s[2][kTileRows * kWords];
  // Each warp's rows of a sparse 16-bit tile (16-bit overwrite only: 8 KB a block)
  constexpr int kScatterRoom = kWide && kMode == kOverwrite ? kRows * kTileRows : 8;
  __shared__ __align__(16) V scatter_s[kThreads / 32][kScatterRoom];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned long long* bits = reinterpret_cast<const unsigned long long*>(payload);
  const uint32_t* index = reinterpret_cast<const uint32_t*>(payload + index_offset);
  const V* values = reinterpret_cast<const V*>(payload + values_offset);
  const int64_t nnz = index[tiles];
  const int64_t value_room = (capacity - values_offset) / int64_t(sizeof(V));
  if (nnz > n || nnz > value_room) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(status, kBadNnz);
    return;
  }
  if (kMode == kAccumulate && sparse_payload(nnz, n)) return;  // the warp-per-tile kernel decodes it
  const int c0 = 2 * lane;
  // The next tile's words and index step, as in pici_accumulate_kernel. Kept inline: the two
  // kernels sharing a helper for it measured 1 point slower here at 8 blocks (bf16 at 50% and
  // 90%; bench/results/2026-11-26_eleventh/ab/ab_8_shared_prefetch_not_kept.log).
  ulonglong2 w_next = make_ulonglong2(0ull, 0ull);
  uint32_t lo_next = 0, hi_next = 0;
  if (blockIdx.x < tiles) {
    w_next = reinterpret_cast<const ulonglong2*>(bits + int64_t(blockIdx.x) * kTileRows)[lane];
    lo_next = index[blockIdx.x];
    hi_next = index[blockIdx.x + 1];
  }
  int turn = 0;  // the buffer of the next tile decoded through shared memory
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const ulonglong2 w = w_next;
    const uint32_t lo = lo_next, hi = hi_next;
    if (tile + gridDim.x < tiles) {
      w_next = reinterpret_cast<const ulonglong2*>(bits + (tile + gridDim.x) * kTileRows)[lane];
      lo_next = index[tile + gridDim.x];
      hi_next = index[tile + gridDim.x + 1];
    }
    const uint32_t count = __popcll(w.x) + __popcll(w.y);  // of this lane's column pair
    const uint32_t total = warp_total(count);
    const int bad = tile_status(w, make_ulonglong2(0ull, 0ull), lo, hi, total, nnz, tile, n, lane);
    if (bad) {  // block-uniform: every warp computed the same `bad`
      if (warp == 0 && lane == 0) atomicOr(status, bad);
      continue;
    }
    const int64_t base = tile * kTile;
    const bool full = aligned && n - base >= kTile;
    V* out = dst + base;
    if (kMode == kAccumulate && total == 0) continue;  // nothing to add
    if (kMode == kOverwrite && total <= kScatterMax<V>) {
      // Empty, or a sparse 16-bit tile: zero the warp's rows with 16-byte stores, then store the
      // marked elements, each lane walking the set bits of its two columns' words, two of each a
      // pass (their loads in flight together; one a pass: 90% 0.488 ms, two: 0.481). A whole sparse
      // 16-bit tile does both in the warp's rows of scatter_s and then stores whole 16-byte pieces
      // (evict first), so that no marked element is written on its own to L2. Measured on H100 (1
      // GiB bf16, two rounds against stores to the tile): 99% 0.459 -> 0.438 ms (0.84 -> 0.87-0.88
      // of copy), 99.9% 0.438 -> 0.434; tiles that never came here (then: over 128) lost 1% (50%
      // 0.618 -> 0.625, 90% 0.493 -> 0.497, 95% 0.472 -> 0.478), and as much with a quarter of
      // the room (2 rows a warp at a time: 99% 0.448), so not by the smaller L1 share. Stores to
      // the tile made evict first instead lost (0.83 -> 0.69 at 99%;
      // bench/results/2026-11-27_nineteenth/).
      V* rows = out + warp * kRows * kTileRows;
      constexpr int kVectors = kRows * kTileRows * int(sizeof(V)) / 16;
      const bool in_shared = kWide && full && total > 0;
      if (in_shared) {
#pragma unroll
        for (int v = lane; v < kVectors; v += 32)
          reinterpret_cast<uint4*>(scatter_s[warp])[v] = make_uint4(0u, 0u, 0u, 0u);
      } else if (full) {
#pragma unroll
        for (int v = lane; v < kVectors; v += 32) reinterpret_cast<uint4*>(rows)[v] = make_uint4(0u, 0u, 0u, 0u);
      } else {
        for (int i = lane; i < kRows * kTileRows; i += 32)
          if (base + warp * kRows * kTileRows + i < n) rows[i] = V(0);
      }
      if (total == 0) continue;
      const uint32_t inclusive = warp_inclusive_scan(count, lane);
      __syncwarp();  // the zeros land before the lanes' marked elements
      const unsigned long long above = (1ull << (warp * kRows)) - 1ull;
      const V* at0 = values + lo + (inclusive - count) + __popcll(w.x & above);
      const V* at1 = values + lo + (inclusive - __popcll(w.y)) + __popcll(w.y & above);
      V* to = in_shared ? scatter_s[warp] : rows;
      uint32_t ma = uint32_t(w.x >> (warp * kRows)) & 0xffu, mb = uint32_t(w.y >> (warp * kRows)) & 0xffu;
      for (uint32_t k = 0; ma | mb; k += 2) {
        const uint32_t na = ma & (ma - 1), nb = mb & (mb - 1);  // without the pass's first bits
        const V va0 = ma ? at0[k] : V(0), va1 = na ? at0[k + 1] : V(0);
        const V vb0 = mb ? at1[k] : V(0), vb1 = nb ? at1[k + 1] : V(0);
        if (ma) to[(__ffs(ma) - 1) * kTileRows + c0] = va0;
        if (na) to[(__ffs(na) - 1) * kTileRows + c0] = va1;
        if (mb) to[(__ffs(mb) - 1) * kTileRows + c0 + 1] = vb0;
        if (nb) to[(__ffs(nb) - 1) * kTileRows + c0 + 1] = vb1;
        ma = na & (na - 1);
        mb = nb & (nb - 1);
      }
      if (in_shared) {
        __syncwarp();  // the warp's rows are whole in scatter_s; a lane reads back the pieces it zeroed
#pragma unroll
        for (int v = lane; v < kVectors; v += 32)
          __stcs(reinterpret_cast<uint4*>(rows) + v, reinterpret_cast<const uint4*>(scatter_s[warp])[v]);
      }
      if (kWide && threadIdx.x == 0 && tile + gridDim.x < tiles)  // as below, once this tile's gathers are done
        prefetch_values(values, lo_next, hi_next, value_room);
      continue;
    }
    // Columns into buf: word w of row r at w ^ swizzle(r).
    uint32_t* buf = tile_s[turn];
    turn ^= 1;
    const ulonglong2* words = reinterpret_cast<const ulonglong2*>(bits + tile * kTileRows);  // a pair each
    if constexpr (kWide) {
      // Lanes 8j .. 8j + 7 take pair 4w + j, lane 8j + l its rows 8l .. 8l + 7 (running offsets
      // down both columns, a 32-bit word per row); its words sit at pair ^ 4l, 32 banks a store.
      const int j = lane >> 3, l = lane & 7, pair = kPairs * warp + j;
      const ulonglong2 ab = words[pair];
      const uint32_t inclusive = warp_inclusive_scan(count, lane);
      const uint32_t sa = lo + __shfl_sync(kFullMask, inclusive - count, pair), sb = sa + __popcll(ab.x);
      const unsigned long long above = (1ull << (8 * l)) - 1ull;
      const uint32_t at_a = sa + __popcll(ab.x & above), at_b = sb + __popcll(ab.y & above);
      const uint32_t ma = uint32_t(ab.x >> (8 * l)) & 0xffu, mb = uint32_t(ab.y >> (8 * l)) & 0xffu;
      uint32_t* row = buf + 8 * l * kWords + (pair ^ (4 * l));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t below = (1u << i) - 1u;  // this lane's rows above row 8l + i
        const uint32_t va = (ma >> i) & 1u ? uint32_t(values[at_a + __popc(ma & below)]) : 0u;
        const uint32_t vb = (mb >> i) & 1u ? uint32_t(values[at_b + __popc(mb & below)]) : 0u;
        row[i * kWords] = __byte_perm(va, vb, 0x5410);  // column 2 pair in the low half
      }
    } else {
      // Pair k of the warp's pairs 4w .. 4w + 3 (their words by broadcast loads): lane r takes rows
      // r and r + 32 of both columns; element c of row r sits at c ^ (r % 32), 32 banks a store.
      const uint32_t below = (1u << lane) - 1u;  // rows above this lane's row r in a column half
      uint32_t at = lo + warp_total(lane < kPairs * warp ? count : 0u);  // start of the warp's first column
#pragma unroll
      for (int k = 0; k < kPairs; ++k) {
        const int pair = kPairs * warp + k;
        const ulonglong2 ab = words[pair];  // the same for every lane: one broadcast load
        const uint32_t a_lo = uint32_t(ab.x), a_hi = uint32_t(ab.x >> 32);
        const uint32_t b_lo = uint32_t(ab.y), b_hi = uint32_t(ab.y >> 32);
        const uint32_t sa = at, sb = sa + __popc(a_lo) + __popc(a_hi);
        at = sb + __popc(b_lo) + __popc(b_hi);
        const uint32_t va0 = (a_lo >> lane) & 1u ? uint32_t(values[sa + __popc(a_lo & below)]) : 0u;
        const uint32_t vb0 = (b_lo >> lane) & 1u ? uint32_t(values[sb + __popc(b_lo & below)]) : 0u;
        const uint32_t va1 = (a_hi >> lane) & 1u ? uint32_t(values[sa + __popc(a_lo) + __popc(a_hi & below)]) : 0u;
        const uint32_t vb1 = (b_hi >> lane) & 1u ? uint32_t(values[sb + __popc(b_lo) + __popc(b_hi & below)]) : 0u;
        buf[lane * kWords + ((2 * pair) ^ lane)] = va0;
        buf[lane * kWords + ((2 * pair + 1) ^ lane)] = vb0;
        buf[(lane + 32) * kWords + ((2 * pair) ^ lane)] = va1;
        buf[(lane + 32) * kWords + ((2 * pair + 1) ^ lane)] = vb1;
      }
    }
    __syncthreads();  // the tile is whole in buf (and every thread is done with the other buffer)
    // 16-bit overwrite: the next tile's run of values into L2 (its index step landed by now), so
    // that its gathers find L2. Measured on H100 (1 GiB, fraction of copy, two rounds): bf16 0.86
    // -> 0.89 at 50% sparsity, 0.83 -> 0.85 at 75%, 0.82 -> 0.83 at 90%, 0.82-0.83 at 95-99%;
    // after zero-and-scatter tiles too: 0.83 -> 0.84 at 99%, 0.86 -> 0.87 at 99.9%. fp32
    // overwrite lost 1-2 points at 50% and 99-99.9%, 16-bit accumulation 1-3 at 50-75%, so they
    // do not (bench/results/2026-11-26_fourteenth/).
    if (kWide && kMode == kOverwrite && threadIdx.x == 0 && tile + gridDim.x < tiles)
      prefetch_values(values, lo_next, hi_next, value_room);
    // Rows: each thread stores 16-byte pieces of rows r0, r0 + kRowsPerPass, ...: the piece of
    // logical words 4q .. 4q + 3 is whole at q ^ (swizzle / 4), its words at k ^ (swizzle % 4).
    constexpr int kPieces = kWords / 4;               // 16-byte pieces per row
    constexpr int kRowsPerPass = kThreads / kPieces;  // a multiple of 8: r % 4 and r / 8 % 4 stay
    const int q = threadIdx.x % kPieces, r0 = threadIdx.x / kPieces;
    if (full) {
#pragma unroll
      for (int r = r0; r < kTileRows; r += kRowsPerPass) {
        const int swizzle = kWide ? 4 * (r >> 3) : (r & 31);
        const uint4 v = reinterpret_cast<const uint4*>(buf + r * kWords)[q ^ (swizzle >> 2)];
        const uint4 h = swizzle & 1 ? make_uint4(v.y, v.x, v.w, v.z) : v;
        const uint4 s = swizzle & 2 ? make_uint4(h.z, h.w, h.x, h.y) : h;
        uint4* at = reinterpret_cast<uint4*>(out + r * kTileRows) + q;
        if constexpr (kMode == kAccumulate) {
          if ((s.x | s.y | s.z | s.w) == 0u) continue;  // no marked element: not read, not written
          const uint4 d = *at;
          *at = make_uint4(add_marked<E>(d.x, s.x), add_marked<E>(d.y, s.y), add_marked<E>(d.z, s.z),
                           add_marked<E>(d.w, s.w));
        } else {
          // Evict first: the tile is written once and read by the caller later. Measured on H100
          // (1 GiB, fraction of copy, two rounds against plain stores): bf16 0.84 -> 0.85 at 90%,
          // 0.493 -> 0.490 ms; fp32 0.87-0.88 -> 0.89 at 95%, 0.4-1.6% faster at 75-99%; equal at
          // 50%. Zero-and-scatter tiles go through shared memory (above) for the same stores.
          __stcs(at, s);
        }
      }
    } else {
      for (int i = threadIdx.x; i < kTile; i += kThreads) {
        if (base + i >= n) break;
        const int r = i / kTileRows, c = i % kTileRows;
        V v;
        if constexpr (kWide) v = V(buf[r * kWords + ((c / 2) ^ (4 * (r >> 3)))] >> (16 * (c & 1)));
        else v = V(buf[r * kWords + (c ^ (r & 31))]);
        if constexpr (kMode == kAccumulate) {
          if (v) out[i] = V(add_marked<E>(out[i], v));  // the low half: this element
        } else {
          out[i] = v;
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


// `kOne` as the kernel's: one piece only (the single-range encoder), or any number.
template <typename Tile, bool kOne>
void launch_compress(const typename Tile::Source& source, const Pieces& pieces, uint8_t* out, void* scratch,
                     int64_t* nnz, cudaStream_t stream) {
  if (pieces.count == 0) return;
  check_cuda(cudaMemsetAsync(scratch, 0, pieces_scratch_bytes(pieces), stream), "cudaMemsetAsync");
  auto kernel = pici_compress_kernel<Tile, kOne>;
  kernel<<<resident_blocks(kernel, pieces.units), kThreads, 0, stream>>>(
      source, pieces, out, look_back_state(scratch, pieces.units, pieces.groups), nnz);
  check_launch("pici_compress_kernel");
}

template <typename T>
void launch_plain_compress(const T* src, const Pieces& pieces, uint8_t* out, void* scratch, int64_t* nnz,
                           cudaStream_t stream) {
  if (pieces.count == 1) launch_compress<PlainTile<T>, true>({src, 0, false}, pieces, out, scratch, nnz, stream);
  else launch_compress<PlainTile<T>, false>({src, 0, false}, pieces, out, scratch, nnz, stream);
}

template <typename G, typename E>
void launch_prune_compress(const void* grad, void* error, const Pieces& pieces, const float* threshold, float decay,
                           unsigned int* kept, uint8_t* out, void* scratch, int64_t* nnz, cudaStream_t stream) {
  using Tile = PruneTile<G, E>;
  const typename Tile::Source source{static_cast<const typename Tile::Bits*>(grad),
                                     static_cast<typename Tile::EBits*>(error), 0, false, threshold, decay, kept};
  launch_compress<Tile, false>(source, pieces, out, scratch, nnz, stream);  // pruning goes by pieces
}

template <typename G>
void launch_prune_compress(const void* grad, void* error, Elem error_type, const Pieces& pieces,
                           const float* threshold, float decay, unsigned int* kept, uint8_t* out, void* scratch,
                           int64_t* nnz, cudaStream_t stream) {
  if (error_type == Elem::kF32) {
    launch_prune_compress<G, float>(grad, error, pieces, threshold, decay, kept, out, scratch, nnz, stream);
  } else if (error_type == Elem::kBF16) {
    launch_prune_compress<G, __nv_bfloat16>(grad, error, pieces, threshold, decay, kept, out, scratch, nnz, stream);
  } else {
    launch_prune_compress<G, __half>(grad, error, pieces, threshold, decay, kept, out, scratch, nnz, stream);
  }
}

template <typename E, int kBlocks, int kMode>
void launch_column_decode(const uint8_t* payload, int64_t capacity, int64_t n, void* dst, int32_t* status,
                          cudaStream_t stream) {
  const PayloadOffsets off(n);
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  auto kernel = pici_column_decode_kernel<E, kBlocks, kMode>;
  kernel<<<resident_blocks(kernel, off.tiles), kThreads, 0, stream>>>(
      payload, capacity, n, off.tiles, off.index, off.values,
      static_cast<typename BitsOf<sizeof(E)>::type*>(dst), aligned, status);
  check_launch("pici_column_decode_kernel");
}

template <typename V>
void launch_overwrite(const uint8_t* payload, int64_t capacity, int64_t n, void* dst, int32_t* status,
                      cudaStream_t stream) {
  launch_column_decode<V, sizeof(V) == 2 ? kWideColumnBlocks : kColumnBlocks, kOverwrite>(payload, capacity, n,
                                                                                       dst, status, stream);
}

template <typename V, typename D>
void launch_accumulate(const uint8_t* payload, int64_t capacity, int64_t n, void* dst, int32_t* status,
                       cudaStream_t stream) {
  const PayloadOffsets off(n);
  auto kernel = pici_accumulate_kernel<V, D>;
  kernel<<<resident_blocks(kernel, off.tiles), kThreads, 0, stream>>>(
      payload, capacity, n, off.tiles, off.index, off.values, static_cast<D*>(dst), status);
  check_launch("pici_accumulate_kernel");
}

// Patch, or accumulate: then both kernels go, and the one the payload's density does not suit
// returns after reading nnz (kSparsePercent).
template <typename V, typename D, int kMode>
void launch_sparse_decode(const uint8_t* payload, int64_t capacity, int64_t n, void* dst, const uint8_t* prior,
                          int32_t* status, cudaStream_t stream) {
  const PayloadOffsets off(n);
  auto kernel = pici_sparse_decode_kernel<V, D, kMode>;
  const int64_t blocks = (off.tiles + kThreads / 32 - 1) / (kThreads / 32);  // a warp per tile at most
  kernel<<<resident_blocks(kernel, blocks), kThreads, 0, stream>>>(
      payload, capacity, n, off.tiles, off.index, off.values, static_cast<D*>(dst), prior, status);
  check_launch("pici_sparse_decode_kernel");
  if constexpr (kMode == kAccumulate) {
    if constexpr (std::is_same_v<V, D> && sizeof(V) == 2)  // by columns (pici_column_decode_kernel)
      launch_column_decode<V, kWideColumnBlocks, kAccumulate>(payload, capacity, n, dst, status, stream);
    else
      launch_accumulate<V, D>(payload, capacity, n, dst, status, stream);
  }
}

}  // namespace

int64_t compress_scratch_bytes(int64_t tiles) { return 8 * (tiles + 2 * look_back_groups(tiles)) + 8; }

int64_t pieces_scratch_bytes(const Pieces& pieces) { return 8 * (pieces.units + 2 * pieces.groups) + 8; }

Pieces plan_pici_pieces(const PiciPiece* pieces, int64_t count, int elem_bytes, bool prune, PieceRow* rows) {
  const int64_t unit = prune ? 1 : (elem_bytes == 4 ? PlainTile<uint32_t>::kUnit : PlainTile<uint16_t>::kUnit);
  Pieces all{count, nullptr, {}, 0, 0};
  for (int64_t i = 0; i < count; ++i) {
    const int64_t units = piece_units(pieces[i].n, unit);
    rows[i] = {pieces[i], all.units, all.groups};
    all.units += units;
    all.groups += look_back_groups(units);
  }
  if (count == 1) all.one = rows[0];
  return all;
}

void pici_compress_pieces(const void* src, int elem_bytes, const Pieces& pieces, uint8_t* out, void* scratch,
                          int64_t* nnz, cudaStream_t stream) {
  if (elem_bytes == 4) {
    launch_plain_compress(static_cast<const uint32_t*>(src), pieces, out, scratch, nnz, stream);
  } else {
    launch_plain_compress(static_cast<const uint16_t*>(src), pieces, out, scratch, nnz, stream);
  }
}

void pici_compress(const void* src, int elem_bytes, int64_t n, uint8_t* out, int64_t capacity,
                   void* scratch, int64_t* nnz, cudaStream_t stream) {
  const PiciPiece piece{0, n, 0, capacity};
  PieceRow row;
  const Pieces pieces = plan_pici_pieces(&piece, 1, elem_bytes, false, &row);
  pici_compress_pieces(src, elem_bytes, pieces, out, scratch, nnz, stream);
}

void pici_prune_compress_pieces(const void* grad, Elem grad_type, void* error, Elem error_type, const Pieces& pieces,
                                const float* threshold, float decay, unsigned int* kept, uint8_t* out,
                                void* scratch, int64_t* nnz, cudaStream_t stream) {
  if (grad_type == Elem::kF32) {
    launch_prune_compress<float>(grad, error, error_type, pieces, threshold, decay, kept, out, scratch, nnz, stream);
  } else if (grad_type == Elem::kBF16) {
    launch_prune_compress<__nv_bfloat16>(grad, error, error_type, pieces, threshold, decay, kept, out, scratch, nnz,
                                         stream);
  } else {
    launch_prune_compress<__half>(grad, error, error_type, pieces, threshold, decay, kept, out, scratch, nnz, stream);
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
      else launch_overwrite<uint32_t>(payload, capacity, n, dst, status, stream);
    } else {
      if (prior) launch_sparse_decode<uint16_t, uint16_t, kPatch>(payload, capacity, n, dst, prior, status, stream);
      else launch_overwrite<uint16_t>(payload, capacity, n, dst, status, stream);
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
