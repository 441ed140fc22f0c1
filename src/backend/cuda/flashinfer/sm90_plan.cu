// FlashInfer's sm90 prefill work plan behind flashinfer_sm90::plan (sm90.h). Host code; no
// CUTLASS, so this TU compiles in seconds.
#include <exception>
#include <flashinfer/attention/scheduler.cuh>

#include "backend/cuda/flashinfer/sm90.h"

namespace tandem::cuda::flashinfer_sm90 {

std::string plan(void* int_ws, void* pinned, size_t bytes, int32_t* qo_indptr, int32_t* kv_indptr,
                 int32_t* kv_len, int batch, int total_rows, int num_qo_heads, int num_kv_heads,
                 int head_dim, int page_size, Plan* out, cudaStream_t stream) {
  flashinfer::PrefillPlanSM90Info info;
  try {
    const cudaError_t st = flashinfer::PrefillSM90Plan<int32_t>(
        /*float_buffer=*/nullptr, 0, int_ws, pinned, bytes, info, qo_indptr, kv_indptr, kv_len,
        static_cast<uint32_t>(total_rows), static_cast<uint32_t>(batch),
        static_cast<uint32_t>(num_qo_heads), static_cast<uint32_t>(num_kv_heads),
        static_cast<uint32_t>(head_dim), static_cast<uint32_t>(head_dim),
        static_cast<uint32_t>(page_size), /*causal=*/true, /*enable_cuda_graph=*/false,
        /*sizeof_dtype_o=*/2, stream);
    if (st != cudaSuccess) return std::string("PrefillSM90Plan: ") + cudaGetErrorString(st);
  } catch (std::exception const& e) {
    return std::string("PrefillSM90Plan: ") + e.what();
  }
  out->qo_tile_indices = info.qo_tile_indices_offset;
  out->qo_indptr = info.qo_indptr_offset;
  out->kv_indptr = info.kv_indptr_offset;
  out->qo_len = info.qo_len_offset;
  out->kv_len = info.kv_len_offset;
  out->head_indices = info.head_indices_offset;
  out->work_indptr = info.work_indptr_offset;
  out->batch_indices = info.batch_indices_offset;
  out->same_schedule_for_all_heads = info.same_schedule_for_all_heads;
  return {};
}

size_t plan_bytes(int64_t works, int num_sms) {
  auto a16 = [](size_t b) { return (b + 15) / 16 * 16; };
  // Seven per-work int32 lists and work_indptr [num_sms + 1], each 16-byte aligned.
  return 7 * a16(static_cast<size_t>(works) * 4) + a16(static_cast<size_t>(num_sms + 1) * 4) + 256;
}

}  // namespace tandem::cuda::flashinfer_sm90
