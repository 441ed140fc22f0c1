// The whole Qwen3-MoE sparse block as one call. Three paths, picked on the host per call:
//  - mma (default): router GEMM (cuBLASLt, fp32 logits) -> top-k softmax -> permute indices
//    (group token-slots by local expert) -> grouped GEMM gate_up gathering its rows from x,
//    with fused SiLU-multiply -> grouped GEMM down -> weighted unpermute into out. Eight
//    launches, no host sync, no allocation: CUDA-graph capturable for a fixed num_tokens once
//    run() has been called eagerly for that num_tokens (cuBLASLt plan creation).
//  - decode (num_tokens <= 8, num_tokens * top_k <= 64): one kernel does router dot products
//  (fp32),
//    top-k softmax and the permute indices, then with bf16 experts the two expert GEMVs of
//    moe_decode.h (gate_up + SiLU, down + weighted unpermute: three launches; the grouped GEMMs
//    below when decode_switches().moe_gemv is off), with FP8 experts the same grouped GEMMs and
//    unpermute: four launches, capturable. In the decode and mma paths gate_up (decode only), down
//    and the unpermute are programmatic dependent launches (each may start before its predecessor
//    ends and waits for it with griddepcontrol.wait before reading its output).
//  - cublas (prefill: num_tokens * top_k >= 64 * num_local_experts, stream not capturing):
//    permute with the permuted copy of x, expert offsets to the host (one stream sync),
//    cublasGemmGroupedBatchedEx for gate_up (packed [rows, 2 inter] output), in-place
//    SiLU-multiply on the packed rows, cublasGemmGroupedBatchedEx for down, unpermute.
//  - padded (what kAuto picks at prefill sizes; eager only): permute indices, offsets to the
//    host (one sync); when every local expert's rows padded to Mmax (the largest count rounded
//    up to 64) fit, i.e. num_local_experts * Mmax <= 2 routed rows, expert e's rows go to
//    rows [e Mmax, e Mmax + count_e) of a padded buffer (token order kept, padding zeroed) and
//    both expert GEMMs are one cublasGemmStridedBatchedEx each over all local experts
//    (gate_up packed [Mmax, 2 inter] per expert, in-place SiLU-multiply, down), then the
//    unpermute reads the padded rows. Otherwise (skewed routing) it falls back to the cublas
//    path on the same indices; last_path() says which ran.
// CPU reference: cpu::topk_softmax + cpu::moe (see tests/backend/cuda/test_moe_gemm_cuda.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "backend/cuda/gemm.h"
#include "backend/cuda/moe_gemm.h"

struct cublasContext;

namespace tandem::cuda {

class MoeGemmW8A8;

struct MoeLayerWeights {
  bf16 const* router;   // [num_experts, hidden]
  bf16 const* gate_up;  // [num_local_experts, 2 * inter, hidden], packed by moe_pack_gate_up
  bf16 const* down;     // [num_local_experts, hidden, inter]
  // FP8 experts (fp8_linear.h; gate_up and down then unused): E4M3 codes in the layouts above
  // and their row scales ([num_local_experts, 2 * inter, ceil(hidden / 128)] packed as the
  // rows, [num_local_experts, hidden, ceil(inter / 128)]). The decode and mma paths take them;
  // a prefill batch that picks the cuBLAS paths dequantizes the layer's experts into a bf16
  // scratch (allocated on first use, num_local_experts * 3 * inter * hidden bf16) and runs them
  // on the bf16 weights (set_fp8_prefill_dequant(false): the mma path instead).
  uint8_t const* gate_up_fp8 = nullptr;
  float const* gate_up_scale = nullptr;
  uint8_t const* down_fp8 = nullptr;
  float const* down_scale = nullptr;
  // MXFP8 experts (native, fp8_linear.h): E8M0 codes [.., ceil(hidden / 32)] and [..,
  // ceil(inter / 32)] in the scales' places (those then unused). W8A16 only.
  uint8_t const* gate_up_e8m0 = nullptr;
  uint8_t const* down_e8m0 = nullptr;
};

/// Which implementation run() uses. kAuto picks (see above); a forced path is for tests and
/// benchmarks and still falls back to kMma where it cannot run (kDecode: num_tokens > 8 or
/// num_tokens * top_k > 64; kCublas: the stream is capturing or the layer was built without the
/// cuBLAS buffers, i.e. max_tokens * top_k < 64 * num_local_experts; kPadded: as kCublas, and
/// it falls back to kCublas when the padded rows exceed the padded buffers, whatever the
/// balance). pick_path says kPadded for prefill sizes: run() then takes kPadded or kCublas by
/// the routing balance.
enum class MoeLayerPath { kAuto, kMma, kDecode, kCublas, kPadded };

/// Owns the workspace of one MoE block sized for max_tokens at construction (about
/// max_tokens * (top_k * (hidden + inter) + num_experts) * 2 bytes plus index buffers, and
/// when the cuBLAS prefill paths are possible, rows sized for the padded path: max(max_tokens
/// top_k, 2 max_tokens top_k + 64 num_local_experts) rows of hidden + 2 inter instead of
/// max_tokens top_k rows of hidden + inter). Not thread safe; one per stream. Experts
/// [expert_begin, expert_begin + num_local_experts) live here (EP); tokens routed elsewhere
/// contribute zeros.
class MoeLayer {
 public:
  MoeLayer(int64_t max_tokens, int64_t hidden, int64_t inter, int64_t num_experts, int64_t top_k,
           int64_t expert_begin, int64_t num_local_experts, bool renormalize);
  ~MoeLayer();
  MoeLayer(MoeLayer const&) = delete;
  MoeLayer& operator=(MoeLayer const&) = delete;

  /// out[t] = sum over the token's top_k local experts e of w[t, e] * down_e(silu(gate_e x[t])
  /// * up_e x[t]). x [num_tokens, hidden], out [num_tokens, hidden] (overwritten), bf16.
  /// 0 <= num_tokens <= max_tokens; 0 launches nothing.
  void run(MoeLayerWeights const& w, bf16 const* x, bf16* out, int64_t num_tokens, GemmLt& gemm,
           cudaStream_t stream);

  // Intermediates of the last run (device), valid until the next run:
  float const* router_logits() const { return logits_; }      // [num_tokens, num_experts]
  int32_t const* topk_ids() const { return topk_ids_; }       // [num_tokens, top_k]: global ids
  float const* topk_weights() const { return topk_w_; }       // [num_tokens, top_k]
  int32_t const* expert_offsets() const { return offsets_; }  // [num_local_experts + 1]

  int64_t max_tokens() const { return max_tokens_; }

  /// FP8 experts at prefill sizes: dequantize to bf16 for the cuBLAS paths (default true) or run
  /// the FP8 grouped GEMM (mma path). With the wgmma W8A8 GEMMs (fp8_wgmma()) prefill always
  /// takes them.
  void set_fp8_prefill_dequant(bool on) { fp8_prefill_dequant_ = on; }
  /// FP8 experts on the decode and mma paths: W8A8 on the FP8 tensor cores, the activations
  /// quantized per token and 128-column group in the GEMMs (MoeGemmParams::fp8_activations),
  /// or (false, the default) W8A16 with the weights converted to bf16.
  /// prequant (default): the activations are quantized by one pass each before the GEMMs
  /// (the tokens' x, then the SiLU-mul output; fp8_quantize_rows_launch) and the GEMMs load
  /// E4M3 (MoeGemmParams::x_fp8); false: each GEMM CTA quantizes the bf16 rows it loads. The
  /// first call with on allocates the E4M3 copies (max_tokens * top_k * (hidden + inter) bytes
  /// and their scales).
  /// With prequant on an sm_90 build with CUTLASS (MoeGemmW8A8::supported()), hidden and inter
  /// multiples of 128 and FP8 (not native MXFP8) experts, the GEMMs are the wgmma grouped GEMMs
  /// of moe_gemm_w8a8.h: the permute's gather quantizes the rows (fp8_gather_quantize_launch),
  /// gate_up writes bf16 gate/up, silu_mul_quantize_fp8_launch makes the down GEMM's E4M3 input
  /// (TANDEM_CUDA_FP8_WGMMA=0: the mma.sync W8A8 kernels instead). That first call also sets up
  /// the wgmma kernels (outside any capture) and, without the cuBLAS buffers, a
  /// [max_tokens * top_k, 2 inter] bf16 scratch.
  void set_fp8_activations(bool on, bool prequant = true);
  /// Whether run() takes the wgmma W8A8 GEMMs (see set_fp8_activations).
  bool fp8_wgmma() const { return fp8_activations_ && fp8_prequant_ && wgmma_ != nullptr; }
  /// Allocates that scratch now (when the cuBLAS paths are possible for max_tokens), so that a
  /// later prefill does not allocate beside a full KV cache.
  void reserve_fp8_prefill();
  /// Forces a path (tests, benchmarks); kAuto by default.
  void set_path(MoeLayerPath path) { path_ = path; }
  /// The path the last run() took (kAuto before any run).
  MoeLayerPath last_path() const { return last_path_; }
  /// The path run() would pick for num_tokens on a non-capturing stream (kPadded: padded, or
  /// cublas when the routing of that run turns out skewed).
  MoeLayerPath pick_path(int64_t num_tokens) const;

 private:
  void release() noexcept;
  void run_cublas(MoeLayerWeights const& w, bf16 const* x, bf16* out, int64_t num_tokens,
                  cudaStream_t stream);
  // kPadded (or its fallback to kCublas): sets last_path_.
  void run_padded(MoeLayerWeights const& w, bf16 const* x, bf16* out, int64_t num_tokens,
                  cudaStream_t stream);
  // The two cublasGemmGroupedBatchedEx + SiLU of the cublas path on rows_ (compact, permuted),
  // h_offsets_ filled and the stream synchronised.
  void grouped_gemms(MoeLayerWeights const& w, cudaStream_t stream);
  // The mma.sync grouped GEMMs (bf16, W8A16, W8A8) of the decode and mma paths: rows_ = the
  // routed rows' down output.
  void run_mma_gemms(MoeLayerWeights const& w, bf16 const* x, int64_t T, int64_t rows,
                     MoeLayerPath path, cudaStream_t stream);

  int64_t max_tokens_, hidden_, inter_, num_experts_, top_k_, expert_begin_, num_local_;
  bool renormalize_;
  float* logits_ = nullptr;      // [max_tokens, num_experts], fp32
  int32_t* topk_ids_ = nullptr;  // [max_tokens, top_k]
  float* topk_w_ = nullptr;      // [max_tokens, top_k]
  int32_t* counts_ = nullptr;    // [num_local_experts]
  int32_t* offsets_ = nullptr;   // [num_local_experts + 1]
  int32_t* src_ = nullptr;       // [max_tokens * top_k]
  int32_t* slot_row_ = nullptr;  // [max_tokens * top_k]
  int32_t* perm_ws_ = nullptr;   // moe_permute workspace
  bf16* rows_ = nullptr;         // [max_tokens * top_k, hidden]: permuted x, then the down output
                                 // ([pad_rows_cap_, hidden] with the cuBLAS paths)
  bf16* act_ = nullptr;          // [max_tokens * top_k, inter] (with the cuBLAS paths
                                 // [pad_rows_cap_, 2 inter]: packed gate_up output,
                                 // SiLU-multiplied in place, row stride 2 inter)
  int64_t pad_rows_cap_ = 0;     // rows of rows_ / act_ the padded path may use
  uint32_t* decode_counter_ = nullptr;  // last-block counter of the fused decode kernel
  // cuBLAS prefill path (allocated only when it is possible for max_tokens):
  bool cublas_ok_ = false;
  cublasContext* cublas_ = nullptr;
  int32_t* h_offsets_ = nullptr;  // pinned [num_local_experts + 1]
  void** h_ptrs_ = nullptr;       // pinned [6 * num_local_experts]: A, B, C of gate_up, down
  void** d_ptrs_ = nullptr;       // device copy of h_ptrs_
  MoeLayerPath path_ = MoeLayerPath::kAuto, last_path_ = MoeLayerPath::kAuto;
  bool fp8_prefill_dequant_ = true;
  bool fp8_activations_ = false, fp8_prequant_ = true;
  uint8_t* xq_ = nullptr;       // [max_tokens, hidden] E4M3 (W8A8 prequant)
  float* xqs_ = nullptr;        // [max_tokens, ceil(hidden / 128)]
  uint8_t* actq_ = nullptr;     // [max_tokens * top_k, inter] E4M3
  float* actqs_ = nullptr;      // [max_tokens * top_k, ceil(inter / 128)]
  bf16* dq_gate_up_ = nullptr;  // FP8 experts dequantized for the cuBLAS paths (lazy)
  bf16* dq_down_ = nullptr;
  std::unique_ptr<MoeGemmW8A8> wgmma_;  // W8A8 wgmma GEMMs (set_fp8_activations)
  bf16* gu_ = nullptr;  // [max_tokens * top_k, 2 inter] gate_up output (wgmma, no cuBLAS bufs)
};

// Kernels of moe_layer_kernels.cu, used by MoeLayer only.
namespace moe_layer_detail {
constexpr int kDecodeMaxTokens = 8, kDecodeMaxSlots = 64;
struct DecodeRouterParams {
  bf16 const* x;       // [num_tokens, hidden], 16-byte aligned
  bf16 const* router;  // [num_experts, hidden]
  float* logits;       // [num_tokens, num_experts]
  int32_t* topk_ids;
  float* topk_weights;
  int32_t *expert_counts, *expert_offsets, *permuted_src, *slot_row;  // as moe_permute's
  uint32_t* counter;  // zero before the launch; zero again after it
  int num_tokens, hidden, num_experts, top_k, expert_begin, num_local_experts;
  bool renormalize;
  /// A programmatic dependent launch: the first router weight loads are issued before waiting
  /// for the previous kernel (which produces x).
  bool pdl = false;
};
/// Router logits + top-k softmax + permute indices; num_tokens <= 8, num_tokens * top_k <= 64,
/// num_experts <= kRouterMaxExperts, top_k <= kRouterMaxTopK (moe.h), hidden % 8 == 0.
void decode_router_launch(DecodeRouterParams const& p, cudaStream_t stream);
struct UnpermutePdlParams {
  bf16 const* permuted_y;  // written by the preceding kernel (the down GEMM)
  int32_t const* topk_ids;
  float const* topk_weights;
  int32_t const* slot_row;  // these three complete before the preceding kernel started
  bf16* out;
  int64_t num_tokens, hidden, top_k;
};
/// moe_unpermute_launch's bf16 result as a programmatic dependent launch (see the .cu).
/// hidden % 8 == 0, top_k <= kRouterMaxTopK, permuted_y and out 16-byte aligned.
void unpermute_pdl_launch(UnpermutePdlParams const& p, cudaStream_t stream);
/// gate_up [rows, 2 inter] packed (moe_pack_gate_up order) -> columns [0, inter) of each row =
/// silu(gate) * up, in place. inter % 8 == 0, inter <= 8192, 16-byte aligned.
void silu_mul_packed_launch(bf16* gate_up, int64_t rows, int64_t inter, cudaStream_t stream);
struct PrefillGatherParams {
  bf16 const* x;                // [num_tokens, hidden]
  int32_t const* offsets;       // [num_local_experts + 1] from moe_permute (compact rows)
  int32_t const* permuted_src;  // token-slot of each compact row
  int32_t* slot_row;            // padded: rewritten to the padded row of each local slot
  bf16* rows;                   // padded: [num_local_experts * rows_per_expert, hidden]
  int64_t hidden, top_k;
  int64_t rows_per_expert;  // padded: Mmax; compact: the largest count (grid only)
  int num_local_experts;
  bool padded;
};
/// Padded: row e * Mmax + i = x[token of compact row offsets[e] + i] for i < count_e, zeros for
/// count_e <= i < Mmax, and slot_row of that slot = e * Mmax + i. Compact: row offsets[e] + i =
/// that token's x (moe_permute's permuted_x), slot_row untouched. hidden % 8 == 0.
void prefill_gather_launch(PrefillGatherParams const& p, cudaStream_t stream);
}  // namespace moe_layer_detail

}  // namespace tandem::cuda
