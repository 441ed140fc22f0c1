// Device memory helpers shared by the CUDA models (src/model/cuda): RAII device / pinned
// buffers, the chunked host -> device uploader of checkpoint weights, checkpoint tensors as
// host bf16, and the capture of a CUDA graph. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/check.h"
#include "core/dtype.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace tandem::cuda_model {

// Bytes from a CUDA allocator, freed on destruction; movable, not copyable.
template <bool kPinned>
class CudaMem {
 public:
  CudaMem() = default;
  explicit CudaMem(size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    if constexpr (kPinned) {
      TANDEM_CUDA_CHECK(cudaMallocHost(&ptr_, bytes));
    } else {
      TANDEM_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
    }
  }
  ~CudaMem() {
    if (ptr_ == nullptr) return;
    if constexpr (kPinned) {
      (void)cudaFreeHost(ptr_);
    } else {
      (void)cudaFree(ptr_);
    }
  }
  CudaMem(CudaMem&& o) noexcept : ptr_(o.ptr_), size_(o.size_) {
    o.ptr_ = nullptr;
    o.size_ = 0;
  }
  CudaMem& operator=(CudaMem&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
    return *this;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};
using DeviceMem = CudaMem<false>;  // cudaMalloc
using PinnedMem = CudaMem<true>;   // cudaMallocHost

// Host -> device copies through two pinned chunks: the read of chunk i + 1 from the mapped
// file (page cache or disk) overlaps the DMA of chunk i.
class Uploader {
 public:
  explicit Uploader(cudaStream_t stream, size_t chunk = size_t{64} << 20)
      : stream_(stream), chunk_(chunk) {
    for (int i = 0; i < 2; ++i) {
      buf_[i] = PinnedMem(chunk);
      TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    }
  }
  ~Uploader() {
    (void)cudaStreamSynchronize(stream_);
    for (auto& e : done_) (void)cudaEventDestroy(e);
  }
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;

  void put(void* dst, const void* src, size_t bytes) {
    for (size_t off = 0; off < bytes; off += chunk_) {
      const size_t n = std::min(chunk_, bytes - off);
      uint8_t* staging = next();
      std::memcpy(staging, static_cast<const uint8_t*>(src) + off, n);
      submit(static_cast<uint8_t*>(dst) + off, n);
    }
  }
  /// A staging chunk to fill by hand (at most chunk() bytes), then submit(dst, n).
  uint8_t* next() {
    cur_ ^= 1;
    TANDEM_CUDA_CHECK(cudaEventSynchronize(done_[cur_]));
    return buf_[cur_].as<uint8_t>();
  }
  void submit(void* dst, size_t n) {
    TANDEM_CUDA_CHECK(
        cudaMemcpyAsync(dst, buf_[cur_].as<uint8_t>(), n, cudaMemcpyHostToDevice, stream_));
    TANDEM_CUDA_CHECK(cudaEventRecord(done_[cur_], stream_));
  }
  size_t chunk() const { return chunk_; }

 private:
  cudaStream_t stream_;
  size_t chunk_;
  PinnedMem buf_[2];
  cudaEvent_t done_[2]{};
  int cur_ = 1;
};

// A checkpoint tensor as host bf16: the mapped bytes when stored as bf16, else converted
// into `tmp` (block-FP8 / MXFP8 linears dequantized by the WeightReader, as the CPU model
// loads them; the weights then take bf16's bytes on the device).
inline const uint16_t* host_bf16(const WeightReader& wr, const std::string& name,
                                 const Shape& shape, std::vector<uint16_t>& tmp) {
  TensorView v = wr.checkpoint().get(name, shape);
  if (v.dtype == DType::kBF16) return v.ptr<uint16_t>();
  std::vector<float> f(static_cast<size_t>(v.numel()));
  if (wr.is_quantized(name)) {
    TANDEM_CHECK(shape.ndim() == 2, name, ": a quantized tensor must be a matrix");
    wr.read(name, shape[0], shape[1], f.data());
  } else {
    Checkpoint::to_f32(v, f.data());
  }
  tmp.resize(f.size());
  for (size_t i = 0; i < f.size(); ++i) tmp[i] = f32_to_bf16(f[i]);
  return tmp.data();
}

/// Rows r of a host bf16 matrix src [rows, cols] (row-major) to dst [r.size(), cols].
inline void upload_rows(Uploader& up, void* dst, const uint16_t* src, int64_t cols, IndexRange r) {
  up.put(dst, src + r.begin * cols, static_cast<size_t>(r.size() * cols) * sizeof(uint16_t));
}

/// Columns r of a host bf16 matrix src [rows, cols] to dst [rows, r.size()] (a row-parallel
/// linear's slice).
inline void upload_cols(Uploader& up, void* dst, const uint16_t* src, int64_t rows, int64_t cols,
                        IndexRange r) {
  if (r.begin == 0 && r.end == cols) {
    up.put(dst, src, static_cast<size_t>(rows * cols) * sizeof(uint16_t));
    return;
  }
  std::vector<uint16_t> g(static_cast<size_t>(rows * r.size()));
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(g.data() + i * r.size(), src + i * cols + r.begin,
                static_cast<size_t>(r.size()) * sizeof(uint16_t));
  }
  up.put(dst, g.data(), g.size() * sizeof(uint16_t));
}

/// Captures what `record` enqueues on `stream` (thread-local capture mode) into an
/// instantiated graph; on a throw the capture is ended and discarded, and the error rethrown.
template <typename F>
cudaGraphExec_t capture_graph(cudaStream_t stream, F&& record) {
  cudaGraph_t graph = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    record();
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    throw;
  }
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  TANDEM_CUDA_CHECK(err);
  return exec;
}

}  // namespace tandem::cuda_model
