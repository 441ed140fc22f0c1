// The thin layer over FlashInfer's Hopper (sm90) batch prefill kernels that
// PrefillAttentionPlan (backend/cuda/attention_sm90.h) calls. Only the .cu files of this folder
// include FlashInfer; they are compiled when CMake's TANDEM_FLASHINFER resolves ON (headers of
// the flashinfer-python wheel, fetched by scripts/fetch_flashinfer.sh), which also defines
// TANDEM_HAS_FLASHINFER=1 for the backend. Plain types only here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace tandem::cuda::flashinfer_sm90 {

/// Byte offsets into the device int workspace of the work lists a plan wrote (FlashInfer's
/// PrefillPlanSM90Info).
struct Plan {
  int64_t qo_tile_indices = 0, qo_indptr = 0, kv_indptr = 0, qo_len = 0, kv_len = 0,
          head_indices = 0, work_indptr = 0, batch_indices = 0;
  bool same_schedule_for_all_heads = false;
};

/// Splits the batch's (q tile, q head) works over the multiprocessors (longest first onto the
/// least loaded, FlashInfer's PrefillSM90Plan) and copies the lists from `pinned` (page-locked,
/// `bytes` long) to `int_ws` (device, `bytes` long) on `stream`. qo_indptr [batch + 1]: first
/// query row of each sequence; kv_indptr [batch]: where its keys start (paged: index into the
/// page list; ragged: first key row); kv_len [batch]: its keys (the last num_queries of them are
/// its queries' positions). Returns an empty string, or the error.
std::string plan(void* int_ws, void* pinned, size_t bytes, int32_t* qo_indptr, int32_t* kv_indptr,
                 int32_t* kv_len, int batch, int total_rows, int num_qo_heads, int num_kv_heads,
                 int head_dim, int page_size, Plan* out, cudaStream_t stream);

/// Int workspace bytes a plan needs for `works` (q tile, q head) pairs (upper bound).
size_t plan_bytes(int64_t works, int num_sms);
/// Query rows per CTA tile of the kernels (the work unit of the plan): 128 at head_dim 128, 256.
constexpr int kCtaQ = 128;

/// One launch: bf16 q / k / v / o with element strides; causal (queries at the end of their
/// sequence's keys); fp32 softmax.
struct Args {
  void const* q = nullptr;  // [nnz_qo, num_qo_heads, head_dim] with q_stride_n / q_stride_h
  void const* k = nullptr;  // paged: page base (+ head * k_stride_h + slot * k_stride_n)
  void const* v = nullptr;
  void* o = nullptr;
  int64_t q_stride_n = 0, q_stride_h = 0, k_stride_n = 0, k_stride_h = 0, v_stride_n = 0,
          v_stride_h = 0, o_stride_n = 0, o_stride_h = 0;
  int64_t page_stride = 0;              // paged: elements between pages (K and V the same)
  int32_t const* kv_indices = nullptr;  // paged: page ids, indexed from kv_indptr
  int page_size = 0;                    // paged
  int64_t nnz_qo = 0, nnz_kv = 0;       // nnz_kv: ragged
  int num_qo_heads = 0, num_kv_heads = 0;
  float sm_scale = 0.f;
  void* int_ws = nullptr;  // the plan's device workspace
  Plan plan;
};

/// Paged K/V (cp.async gather of each key row through the page list; any page size).
cudaError_t run_paged_hd128(Args const& a, cudaStream_t stream);
/// Contiguous ("ragged") K/V: TMA loads of 128 x 128 tiles.
cudaError_t run_ragged_hd128(Args const& a, cudaStream_t stream);
/// The same at head_dim 256 (Qwen3.5's gated attention): 128 x 64 tiles. (FlashInfer's paged
/// kernel at 256 uses untuned 32-key tiles: not built.)
cudaError_t run_ragged_hd256(Args const& a, cudaStream_t stream);

}  // namespace tandem::cuda::flashinfer_sm90
