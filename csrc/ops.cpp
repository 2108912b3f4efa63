// torch.library registration of the spccl operators: schemas once (TORCH_LIBRARY), CUDA
// implementations (TORCH_LIBRARY_IMPL) that check arguments and launch on torch's current
// stream. Fake implementations live in spccl_train/_fake.py.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

#include "spccl.h"

namespace spccl {
namespace {

Elem elem_of(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return Elem::kF32;
    case at::kBFloat16: return Elem::kBF16;
    case at::kHalf: return Elem::kF16;
    default: TORCH_CHECK(false, "spccl: unsupported dtype ", t, "; the formats carry float32, bfloat16, float16");
  }
}

void check_range(const at::Tensor& t, const char* name, int64_t offset, int64_t n) {
  TORCH_CHECK(t.is_cuda(), "spccl: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "spccl: ", name, " must be a contiguous 1-D tensor, got shape ",
              t.sizes());
  TORCH_CHECK(offset >= 0 && n >= 0 && offset + n <= t.numel(), "spccl: range [", offset, ", ", offset + n,
              ") is outside ", name, " of ", t.numel(), " elements");
  TORCH_CHECK(n <= int64_t(0xffffffff), "spccl: n=", n, " exceeds the 2^32-1 elements a payload can encode");
}

void check_bytes(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::kByte, "spccl: ", name, " must be uint8, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "spccl: ", name, " must be a contiguous 1-D tensor");
  TORCH_CHECK(t.device() == like.device(), "spccl: ", name, " is on ", t.device(), " but the data is on ",
              like.device());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "spccl: ", name,
              " must start at a 16-byte aligned address");
}

int64_t tiles_of(int64_t n) { return (n + 4095) / 4096; }
int64_t pici_metadata(int64_t n) { return 512 * tiles_of(n) + ((4 * (tiles_of(n) + 1) + 15) & ~int64_t(15)); }

// Host rows that a captured graph copies to the device on every replay live as long as the graph:
// a CUDA user object owns them, and its destructor (which may not call CUDA, so may not free
// pinned memory) hands them to this list, emptied by the next call outside a capture.
std::mutex& released_lock() {
  static auto* lock = new std::mutex();  // never destroyed: a graph may outlive static destruction
  return *lock;
}
std::vector<at::Tensor*>& released_rows() {
  static auto* rows = new std::vector<at::Tensor*>();
  return *rows;
}

void release_rows(void* rows) {
  const std::lock_guard<std::mutex> guard(released_lock());
  released_rows().push_back(static_cast<at::Tensor*>(rows));
}

void free_released_rows() {
  std::vector<at::Tensor*> rows;
  {
    const std::lock_guard<std::mutex> guard(released_lock());
    rows.swap(released_rows());
  }
  for (at::Tensor* t : rows) delete t;
}

void keep_for_graph(const at::Tensor& rows_host, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  TORCH_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph) == cudaSuccess &&
                  status == cudaStreamCaptureStatusActive && graph != nullptr,
              "spccl: the stream's capture is not active (invalidated?); the pieces cannot be captured");
  auto* owned = new at::Tensor(rows_host);
  cudaUserObject_t object;
  if (cudaUserObjectCreate(&object, owned, release_rows, 1, cudaUserObjectNoDestructorSync) != cudaSuccess) {
    delete owned;
    TORCH_CHECK(false, "spccl: cudaUserObjectCreate failed");
  }
  TORCH_CHECK(cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove) == cudaSuccess,
              "spccl: cudaGraphRetainUserObject failed");
}

// The pieces of a compressor launch, checked against `src` (and `error`, if given) and `out`,
// with their rows in device memory when there are several (`rows_device` keeps them alive).
Pieces plan_pieces(const at::Tensor& src, const at::Tensor* error, at::IntArrayRef starts, at::IntArrayRef numels,
                   const at::Tensor& out, at::IntArrayRef offsets, const at::Tensor& nnz, at::Tensor& rows_device) {
  const int64_t count = int64_t(starts.size());
  TORCH_CHECK(numels.size() == starts.size() && offsets.size() == starts.size() + 1, "spccl: ", starts.size(),
              " starts need as many numels (got ", numels.size(), ") and one offset more (got ", offsets.size(), ")");
  TORCH_CHECK(nnz.device() == src.device() && nnz.scalar_type() == at::kLong && nnz.dim() == 1 &&
                  nnz.is_contiguous() && nnz.numel() == count,
              "spccl: nnz must be a contiguous int64 tensor of ", count, " elements on ", src.device(), ", got ",
              nnz.scalar_type(), " of ", nnz.numel(), " on ", nnz.device());
  TORCH_CHECK(offsets.back() <= out.numel(), "spccl: the last payload ends at byte ", offsets.back(), " of out, which holds ",
              out.numel());
  std::vector<PiciPiece> pieces(count);
  for (int64_t i = 0; i < count; ++i) {
    check_range(src, "src", starts[i], numels[i]);
    if (error) {
      check_range(*error, "error", starts[i], numels[i]);
      TORCH_CHECK(i == 0 || starts[i] >= starts[i - 1] + numels[i - 1], "spccl: piece ", i, " starts at ", starts[i],
                  ", inside piece ", i - 1, " [", starts[i - 1], ", ", starts[i - 1] + numels[i - 1],
                  "): pruned pieces must be disjoint and in order (each updates its error)");
    }
    const int64_t capacity = offsets[i + 1] - offsets[i];
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] % 16 == 0, "spccl: payload ", i, " starts at byte ", offsets[i],
                " of out; payloads start at 16-byte aligned offsets");
    TORCH_CHECK(capacity >= pici_metadata(numels[i]), "spccl: payload ", i, " holds ", capacity,
                " bytes, less than the ", pici_metadata(numels[i]), "-byte Pici metadata for n=", numels[i]);
    pieces[i] = {starts[i], numels[i], offsets[i], capacity};
  }
  const int64_t bytes = int64_t(sizeof(PieceRow)) * (count > 0 ? count : 1);
  auto rows_host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(count > 1));
  auto* rows = reinterpret_cast<PieceRow*>(rows_host.mutable_data_ptr<uint8_t>());
  Pieces planned = plan_pici_pieces(pieces.data(), count, int(src.element_size()), error != nullptr, rows);
  if (count > 1) {  // one piece travels in the launch's arguments
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    TORCH_CHECK(cudaStreamIsCapturing(stream, &capturing) == cudaSuccess, "spccl: cudaStreamIsCapturing failed");
    if (capturing == cudaStreamCaptureStatusNone) {
      free_released_rows();
      rows_device = rows_host.to(src.device(), /*non_blocking=*/true);  // torch keeps rows_host until copied
    } else {
      keep_for_graph(rows_host, stream);
      rows_device = at::empty({bytes}, src.options().dtype(at::kByte));
      TORCH_CHECK(cudaMemcpyAsync(rows_device.mutable_data_ptr(), rows_host.const_data_ptr(), bytes,
                                  cudaMemcpyHostToDevice, stream) == cudaSuccess,
                  "spccl: copying the pieces' rows failed");
    }
    planned.rows = reinterpret_cast<const PieceRow*>(rows_device.const_data_ptr<uint8_t>());
  }
  return planned;
}

at::Tensor pici_compress_cuda(const at::Tensor& src, int64_t offset, int64_t n, at::Tensor& out) {
  check_range(src, "src", offset, n);
  check_bytes(out, "out", src);
  elem_of(src.scalar_type());
  TORCH_CHECK(out.numel() >= pici_metadata(n), "spccl: out holds ", out.numel(), " bytes, less than the ",
              pici_metadata(n), "-byte Pici metadata for n=", n);
  const c10::cuda::CUDAGuard guard(src.device());
  auto nnz = at::empty({1}, src.options().dtype(at::kLong));
  auto scratch = at::empty({compress_scratch_bytes(tiles_of(n) > 0 ? tiles_of(n) : 1)}, src.options().dtype(at::kByte));
  pici_compress(static_cast<const uint8_t*>(src.const_data_ptr()) + offset * src.element_size(),
                int(src.element_size()), n, out.mutable_data_ptr<uint8_t>(), out.numel(), scratch.mutable_data_ptr(),
                nnz.mutable_data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
  return nnz;
}

void pici_compress_pieces_cuda(const at::Tensor& src, at::IntArrayRef starts, at::IntArrayRef numels, at::Tensor& out,
                               at::IntArrayRef offsets, at::Tensor& nnz) {
  TORCH_CHECK(src.is_cuda(), "spccl: src must be a CUDA tensor, got ", src.device());
  check_bytes(out, "out", src);
  elem_of(src.scalar_type());
  const c10::cuda::CUDAGuard guard(src.device());
  at::Tensor rows;
  const Pieces pieces = plan_pieces(src, nullptr, starts, numels, out, offsets, nnz, rows);
  auto scratch = at::empty({pieces_scratch_bytes(pieces)}, src.options().dtype(at::kByte));
  pici_compress_pieces(src.const_data_ptr(), int(src.element_size()), pieces, out.mutable_data_ptr<uint8_t>(),
                       scratch.mutable_data_ptr(), nnz.mutable_data_ptr<int64_t>(),
                       c10::cuda::getCurrentCUDAStream());
}

void pici_prune_compress_pieces_cuda(const at::Tensor& grad, at::Tensor& error, at::IntArrayRef starts,
                                     at::IntArrayRef numels, const at::Tensor& threshold, double decay,
                                     at::Tensor& kept, at::Tensor& out, at::IntArrayRef offsets, at::Tensor& nnz) {
  TORCH_CHECK(grad.is_cuda(), "spccl: grad must be a CUDA tensor, got ", grad.device());
  TORCH_CHECK(error.numel() == grad.numel() && error.device() == grad.device(), "spccl: error buffer of ",
              error.numel(), " elements on ", error.device(), " does not match grad of ", grad.numel(), " on ",
              grad.device());
  TORCH_CHECK(threshold.device() == grad.device() && threshold.scalar_type() == at::kFloat && threshold.numel() == 1,
              "spccl: threshold must be a one-element float32 tensor on ", grad.device());
  TORCH_CHECK(kept.device() == grad.device() && kept.scalar_type() == at::kInt && kept.numel() == 1,
              "spccl: kept must be a one-element int32 tensor on ", grad.device());
  check_bytes(out, "out", grad);
  const c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor rows;
  const Pieces pieces = plan_pieces(grad, &error, starts, numels, out, offsets, nnz, rows);
  auto scratch = at::empty({pieces_scratch_bytes(pieces)}, grad.options().dtype(at::kByte));
  pici_prune_compress_pieces(grad.const_data_ptr(), elem_of(grad.scalar_type()), error.mutable_data_ptr(),
                             elem_of(error.scalar_type()), pieces, threshold.const_data_ptr<float>(), float(decay),
                             reinterpret_cast<unsigned int*>(kept.mutable_data_ptr<int32_t>()),
                             out.mutable_data_ptr<uint8_t>(), scratch.mutable_data_ptr(),
                             nnz.mutable_data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
}

at::Tensor coo_compress_cuda(const at::Tensor& src, int64_t offset, int64_t n, at::Tensor& out) {
  check_range(src, "src", offset, n);
  check_bytes(out, "out", src);
  elem_of(src.scalar_type());
  const c10::cuda::CUDAGuard guard(src.device());
  auto nnz = at::empty({1}, src.options().dtype(at::kLong));
  auto values = at::empty({n}, src.options());
  auto scratch = at::empty({compress_scratch_bytes(tiles_of(n))}, src.options().dtype(at::kByte));
  coo_compress(static_cast<const uint8_t*>(src.const_data_ptr()) + offset * src.element_size(),
               int(src.element_size()), n, out.mutable_data_ptr<uint8_t>(), out.numel(), values.mutable_data_ptr(),
               scratch.mutable_data_ptr(), nnz.mutable_data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
  return nnz;
}

void check_decode(const at::Tensor& payload, int64_t n, c10::ScalarType value, const at::Tensor& dst,
                  int64_t offset, bool accumulate) {
  check_range(dst, "dst", offset, n);
  check_bytes(payload, "payload", dst);
  elem_of(value);
  elem_of(dst.scalar_type());
  TORCH_CHECK(value == dst.scalar_type() || (accumulate && dst.scalar_type() == at::kFloat),
              "spccl: cannot decode ", value, " values into a ", dst.scalar_type(),
              " tensor; only accumulation into float32 mixes types");
}

at::Tensor pici_decode_cuda(const at::Tensor& payload, int64_t n, c10::ScalarType value, at::Tensor& dst,
                            int64_t offset, bool accumulate, const at::Tensor* prior = nullptr) {
  check_decode(payload, n, value, dst, offset, accumulate);
  TORCH_CHECK(payload.numel() >= pici_metadata(n), "spccl: Pici payload of ", payload.numel(),
              " bytes is shorter than its ", pici_metadata(n), "-byte metadata for n=", n);
  if (prior) {
    check_bytes(*prior, "prior", dst);
    TORCH_CHECK(prior->numel() >= 512 * tiles_of(n), "spccl: prior Pici payload of ", prior->numel(),
                " bytes is shorter than its ", 512 * tiles_of(n), " bytes of bitvectors for n=", n);
  }
  const c10::cuda::CUDAGuard guard(dst.device());
  auto status = at::zeros({1}, dst.options().dtype(at::kInt));
  pici_decompress(payload.const_data_ptr<uint8_t>(), payload.numel(), n, elem_of(value),
                  static_cast<uint8_t*>(dst.mutable_data_ptr()) + offset * dst.element_size(),
                  elem_of(dst.scalar_type()), accumulate, prior ? prior->const_data_ptr<uint8_t>() : nullptr,
                  status.mutable_data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream());
  return status;
}

at::Tensor pici_decompress_cuda(const at::Tensor& payload, int64_t n, at::Tensor& dst, int64_t offset) {
  return pici_decode_cuda(payload, n, dst.scalar_type(), dst, offset, false);
}

at::Tensor pici_decompress_patch_cuda(const at::Tensor& payload, int64_t n, const at::Tensor& prior, at::Tensor& dst,
                                      int64_t offset) {
  return pici_decode_cuda(payload, n, dst.scalar_type(), dst, offset, false, &prior);
}

at::Tensor pici_decompress_accumulate_cuda(const at::Tensor& payload, int64_t n, c10::ScalarType dtype,
                                           at::Tensor& dst, int64_t offset) {
  return pici_decode_cuda(payload, n, dtype, dst, offset, true);
}

at::Tensor coo_decode_cuda(const at::Tensor& payload, const at::Tensor& nnz, int64_t n, c10::ScalarType value,
                           at::Tensor& dst, int64_t offset, bool accumulate) {
  check_decode(payload, n, value, dst, offset, accumulate);
  TORCH_CHECK(nnz.device() == dst.device() && nnz.scalar_type() == at::kLong && nnz.numel() == 1,
              "spccl: nnz must be a one-element int64 tensor on ", dst.device());
  const c10::cuda::CUDAGuard guard(dst.device());
  auto status = at::zeros({1}, dst.options().dtype(at::kInt));
  if (!accumulate) dst.narrow(0, offset, n).zero_();
  coo_decompress(payload.const_data_ptr<uint8_t>(), payload.numel(), nnz.const_data_ptr<int64_t>(), n,
                 elem_of(value), static_cast<uint8_t*>(dst.mutable_data_ptr()) + offset * dst.element_size(),
                 elem_of(dst.scalar_type()), accumulate, status.mutable_data_ptr<int32_t>(),
                 c10::cuda::getCurrentCUDAStream());
  return status;
}

at::Tensor coo_decompress_cuda(const at::Tensor& payload, const at::Tensor& nnz, int64_t n, at::Tensor& dst,
                               int64_t offset) {
  return coo_decode_cuda(payload, nnz, n, dst.scalar_type(), dst, offset, false);
}

at::Tensor coo_decompress_accumulate_cuda(const at::Tensor& payload, const at::Tensor& nnz, int64_t n,
                                          c10::ScalarType dtype, at::Tensor& dst, int64_t offset) {
  return coo_decode_cuda(payload, nnz, n, dtype, dst, offset, true);
}

}  // namespace

TORCH_LIBRARY(spccl, m) {
  m.def("pici_compress(Tensor src, int offset, int n, Tensor(a!) out) -> Tensor");
  m.def("pici_decompress(Tensor payload, int n, Tensor(a!) dst, int offset) -> Tensor");
  m.def("pici_decompress_patch(Tensor payload, int n, Tensor prior, Tensor(a!) dst, int offset) -> Tensor");
  m.def("pici_decompress_accumulate(Tensor payload, int n, ScalarType dtype, Tensor(a!) dst, int offset) -> Tensor");
  m.def("pici_compress_pieces(Tensor src, int[] starts, int[] numels, Tensor(a!) out, int[] offsets, Tensor(b!) nnz) -> ()");
  m.def(
      "pici_prune_compress_pieces(Tensor grad, Tensor(a!) error, int[] starts, int[] numels, Tensor threshold, "
      "float decay, Tensor(b!) kept, Tensor(c!) out, int[] offsets, Tensor(d!) nnz) -> ()");
  m.def("coo_compress(Tensor src, int offset, int n, Tensor(a!) out) -> Tensor");
  m.def("coo_decompress(Tensor payload, Tensor nnz, int n, Tensor(a!) dst, int offset) -> Tensor");
  m.def(
      "coo_decompress_accumulate(Tensor payload, Tensor nnz, int n, ScalarType dtype, Tensor(a!) dst, int offset) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(spccl, CUDA, m) {
  m.impl("pici_compress", &pici_compress_cuda);
  m.impl("pici_decompress", &pici_decompress_cuda);
  m.impl("pici_decompress_patch", &pici_decompress_patch_cuda);
  m.impl("pici_decompress_accumulate", &pici_decompress_accumulate_cuda);
  m.impl("pici_compress_pieces", &pici_compress_pieces_cuda);
  m.impl("pici_prune_compress_pieces", &pici_prune_compress_pieces_cuda);
  m.impl("coo_compress", &coo_compress_cuda);
  m.impl("coo_decompress", &coo_decompress_cuda);
  m.impl("coo_decompress_accumulate", &coo_decompress_accumulate_cuda);
}

}  // namespace spccl
