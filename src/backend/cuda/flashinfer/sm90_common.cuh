// Shared by the FlashInfer sm90 kernel TUs of this folder: the params structs they fill.
#pragma once

#include <flashinfer/attention/hopper/default_params.cuh>
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>

#include "backend/cuda/flashinfer/sm90.h"

namespace tandem::cuda::flashinfer_sm90 {

using Bf16 = cutlass::bfloat16_t;
using PagedParams = flashinfer::BatchPrefillPagedParams<Bf16, Bf16, Bf16, int32_t>;
using RaggedParams = flashinfer::BatchPrefillRaggedParams<Bf16, Bf16, Bf16, int32_t>;

// The fields both params structs share: pointers, strides, heads, the plan's work lists.
template <class P>
void fill_common(P& p, Args const& a) {
  p = P{};
  p.q_ptr = static_cast<Bf16*>(const_cast<void*>(a.q));
  p.k_ptr = static_cast<Bf16*>(const_cast<void*>(a.k));
  p.v_ptr = static_cast<Bf16*>(const_cast<void*>(a.v));
  p.o_ptr = static_cast<Bf16*>(a.o);
  p.lse_ptr = nullptr;
  auto ws = [&](int64_t off) {
    return reinterpret_cast<int32_t*>(static_cast<char*>(a.int_ws) + off);
  };
  p.qo_tile_indices = ws(a.plan.qo_tile_indices);
  p.qo_indptr = ws(a.plan.qo_indptr);
  p.kv_indptr = ws(a.plan.kv_indptr);
  p.qo_lens = ws(a.plan.qo_len);
  p.kv_lens = ws(a.plan.kv_len);
  p.head_indices = ws(a.plan.head_indices);
  p.work_indptr = ws(a.plan.work_indptr);
  p.batch_indices = ws(a.plan.batch_indices);
  p.additional_params.logits_soft_cap = 0.f;
  p.additional_params.sm_scale = a.sm_scale;
  p.additional_params.maybe_prefix_len_ptr = nullptr;
  p.additional_params.maybe_token_pos_in_items_ptr = nullptr;
  p.additional_params.token_pos_in_items_len = 0;
  p.additional_params.maybe_max_item_len_ptr = nullptr;
  p.q_stride_n = a.q_stride_n;
  p.q_stride_h = a.q_stride_h;
  p.k_stride_n = a.k_stride_n;
  p.k_stride_h = a.k_stride_h;
  p.v_stride_n = a.v_stride_n;
  p.v_stride_h = a.v_stride_h;
  p.o_stride_n = a.o_stride_n;
  p.o_stride_h = a.o_stride_h;
  p.nnz_qo = a.nnz_qo;
  p.num_qo_heads = a.num_qo_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.group_size = a.num_qo_heads / a.num_kv_heads;
  p.window_left = -1;
  p.causal = true;
}

}  // namespace tandem::cuda::flashinfer_sm90
