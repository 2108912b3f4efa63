// Host-side entry points of the spccl CUDA kernels. Plain C++ (no torch headers) so the .cu
// files compile fast and alone; ops.cpp checks arguments and calls these on torch's stream.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace spccl {

// Element types the formats carry. Compression and plain decompression only move bits, so
// they need the element size alone; accumulation also needs the arithmetic type.
enum class Elem : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Status bits a decoder reports (0 = the payload was valid). Kept in step with
// spccl_train/formats/reference.py::DecodeStatus.
constexpr int kBadIndex = 1;      // I[0] != 0 or I decreases
constexpr int kBadTileCount = 2;  // popcount of a tile's words != its index step
constexpr int kBadNnz = 4;        // nnz > n, or the values do not fit in the payload
constexpr int kPastEnd = 8;       // a nonzero marked at a position >= n
constexpr int kNotAscending = 16; // COO positions not strictly ascending

// Bytes of scratch the compressors need for `tiles` tiles (look-back state: per-tile status,
// per-group sums and prefixes, the tile counter; common.cuh LookBack).
int64_t compress_scratch_bytes(int64_t tiles);

// One range of a Pici compressor launch that encodes several: source elements [start, start + n)
// into the payload out[offset, offset + capacity).
struct PiciPiece {
  int64_t start, n, offset, capacity;
};

// A piece as the kernel reads it: the range, where its units start among all pieces' units (a
// unit is the tiles a compressor block takes per step), and where its look-back groups start.
struct PieceRow {
  PiciPiece piece;
  int64_t first_unit, first_group;
};

// The pieces of one launch: `count` rows, in device memory when count > 1 (`rows`), inline
// (`one`) when count == 1; `units` and `groups` in all. Rows are in order of first_unit.
struct Pieces {
  int64_t count;
  const PieceRow* rows;
  PieceRow one;
  int64_t units, groups;
};

// Fills rows[0, count) for `pieces` as a compressor of `elem_bytes` elements takes them (`prune`:
// the pruning compressor) and returns their totals (count and rows left for the caller to place).
Pieces plan_pici_pieces(const PiciPiece* pieces, int64_t count, int elem_bytes, bool prune, PieceRow* rows);

// Bytes of scratch a launch over `pieces` needs.
int64_t pieces_scratch_bytes(const Pieces& pieces);

// Pici-encode each of `pieces` of src (elem_bytes 4 or 2) into its payload in `out`, in one
// launch; writes piece i's nnz to nnz[i] (an empty piece's payload is I = [0] and its padding).
// `scratch` holds pieces_scratch_bytes(pieces) bytes; it is cleared here.
void pici_compress_pieces(const void* src, int elem_bytes, const Pieces& pieces, uint8_t* out, void* scratch,
                          int64_t* nnz, cudaStream_t stream);

// Prune each of `pieces` of grad (grad_type; the pieces' starts index grad and error alike) with
// leaky error feedback into error (error_type) and Pici-encode the pruned values into the piece's
// payload, in one launch that never writes grad: v = grad + error (fp32); kept where
// |v| >= *threshold (a device float): encoded as v rounded to grad_type; error = kept ? 0 : v *
// decay rounded to error_type. Adds the kept count to *kept and writes piece i's nnz to nnz[i].
// `scratch` as for pici_compress_pieces.
void pici_prune_compress_pieces(const void* grad, Elem grad_type, void* error, Elem error_type, const Pieces& pieces,
                                const float* threshold, float decay, unsigned int* kept, uint8_t* out,
                                void* scratch, int64_t* nnz, cudaStream_t stream);

// Pici-encode src[0, n) (elem_bytes 4 or 2) into out[0, capacity): pici_compress_pieces of one
// piece. Writes nnz to *nnz. `scratch` must hold compress_scratch_bytes(max(1, ceil(n / 4096)))
// bytes; it is cleared here.
void pici_compress(const void* src, int elem_bytes, int64_t n, uint8_t* out, int64_t capacity,
                   void* scratch, int64_t* nnz, cudaStream_t stream);

// Decode a Pici payload of n elements into dst[0, n): overwrite (value == dst type), or
// accumulate (dst is `value` or kF32). With `prior` (overwrite only: the bitvectors of a Pici
// payload of what dst[0, n) holds now), write only the elements either payload marks: the
// payload's values, and zeros where only the prior marks. ORs problems into *status.
void pici_decompress(const uint8_t* payload, int64_t capacity, int64_t n, Elem value,
                     void* dst, Elem dst_type, bool accumulate, const uint8_t* prior,
                     int32_t* status, cudaStream_t stream);

// COO-encode src[0, n) into out[0, capacity). `values_scratch` holds n elements and
// `scratch` compress_scratch_bytes(tiles) bytes.
void coo_compress(const void* src, int elem_bytes, int64_t n, uint8_t* out, int64_t capacity,
                  void* values_scratch, void* scratch, int64_t* nnz, cudaStream_t stream);

// Decode a COO payload with *nnz (device) nonzeros over n elements into dst[0, n). For
// overwrite the caller zeroes dst first.
void coo_decompress(const uint8_t* payload, int64_t capacity, const int64_t* nnz, int64_t n,
                    Elem value, void* dst, Elem dst_type, bool accumulate, int32_t* status,
                    cudaStream_t stream);

}  // namespace spccl
