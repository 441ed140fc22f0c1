// Prefill attention on FlashInfer's Hopper (sm90) kernels: FA3-style (TMA, wgmma, a producer
// warpgroup feeding two consumer warpgroups, persistent CTAs over a host-balanced work list).
// Built when CMake's TANDEM_FLASHINFER resolves ON (TANDEM_HAS_FLASHINFER); otherwise, or on
// another GPU, plan() returns false and paged_attention_launch runs our FA2 kernel.
//
// Use: once per forward, plan() from host copies of the batch's token_seq / positions (the
// same arrays PagedAttentionParams points to on the device); then every layer's
// paged_attention_launch with p.prefill_plan = &plan runs tokens [0, p.num_prefill_tokens)
// through FlashInfer and the decode tokens after them through our decode kernel. Two ways to
// read the paged HND KV (pool[page, k|v, head, slot, :]):
//   kPaged:    FlashInfer's paged kernel reads the pages in place (strides: head = page_size *
//              head_dim, token = head_dim, page = 2 * kv_heads * page_size * head_dim; the
//              block-table rows are its page lists), with cp.async gathers of 128-byte rows.
//   kGathered: each layer first copies the prefill sequences' keys and values (history + chunk)
//              into a contiguous [k|v, kv_head, key, head_dim] workspace, then FlashInfer's
//              ragged kernel loads 128 x 128 tiles with TMA. Costs one copy of the keys
//              (2 * kv_heads * head_dim * 2 bytes per key: ~2% of an 8k prefill).
// Supported: bf16, head_dim 128 (both paths) and 256 (Qwen3.5; kGathered only: FlashInfer's
// paged kernel at 256 is untuned and not built), any GQA group, any page size, sequences whose
// chunk queries sit at the end of their keys (positions kv_len - queries .. kv_len - 1).
// FP8 pools (PrefillPlanArgs::kv_fp8): kGathered, the gather dequantizing to bf16.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "backend/cuda/attention.h"

namespace tandem::cuda {

enum class PrefillKvPath : int32_t {
  kAuto = 0,      // kGathered when the gathered keys fit max_gather_keys, else kPaged
  kPaged = 1,     // see the header comment
  kGathered = 2,  // see the header comment
};

/// What plan() reads: host copies of the prefill part of a paged attention batch.
struct PrefillPlanArgs {
  int32_t const* token_seq = nullptr;  // [num_prefill_tokens] (host)
  int32_t const* positions = nullptr;  // [num_prefill_tokens] (host)
  int64_t num_prefill_tokens = 0;
  int64_t num_q_heads = 0, num_kv_heads = 0, head_dim = 0, page_size = 0, max_pages_per_seq = 0;
  /// The pool holds E4M3 codes (--kv-cache-dtype fp8): the gathered path whatever the path
  /// asked for, its gather dequantizing (code * k_scale | v_scale of the launch) into bf16;
  /// declined (false) above 4 x max_gather_keys keys (the workspace's bound).
  bool kv_fp8 = false;
};

class PrefillAttentionPlan {
 public:
  /// max_gather_keys: the most keys (summed over the prefill sequences) kAuto gathers; the
  /// workspace grows to what a plan needs.
  explicit PrefillAttentionPlan(PrefillKvPath path = PrefillKvPath::kAuto,
                                int64_t max_gather_keys = 65536);
  ~PrefillAttentionPlan();
  PrefillAttentionPlan(PrefillAttentionPlan const&) = delete;
  PrefillAttentionPlan& operator=(PrefillAttentionPlan const&) = delete;

  /// Whether the FlashInfer kernels were compiled in.
  static bool built();
  /// Whether the current device runs them (compute capability 9.0).
  static bool device_supported();

  /// Plans the prefill tokens (and copies the work lists to the device on `stream`). false
  /// (and nothing planned) when the batch or device is not supported; why() says why. Throws
  /// on inconsistent input (queries not at the end of their keys, a sequence split).
  bool plan(PrefillPlanArgs const& a, cudaStream_t stream);
  /// Forgets the plan: launches then use the FA2 kernel.
  void reset() { ready_ = false; }
  bool ready() const { return ready_; }
  PrefillKvPath path() const { return planned_path_; }  // kPaged or kGathered once ready
  std::string const& why() const { return why_; }

  /// Runs tokens [0, p.num_prefill_tokens) of p (called by paged_attention_launch; checks that
  /// p matches the plan).
  void run(PagedAttentionParams const& p, cudaStream_t stream) const;

 private:
  struct Impl;
  Impl* impl_;
  PrefillKvPath path_;
  PrefillKvPath planned_path_ = PrefillKvPath::kAuto;
  int64_t max_gather_keys_;
  bool ready_ = false;
  std::string why_;
};

}  // namespace tandem::cuda
