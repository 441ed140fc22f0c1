// MoE block as one call. See moe_layer.h.
#include "backend/cuda/moe_layer.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_switches.h"
#include "backend/cuda/fp8_act_quant.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_decode.h"
#include "backend/cuda/moe_gemm_w8a8.h"
#include "core/dtype.h"
#include "core/env.h"

namespace tandem::cuda {

namespace {
template <typename T>
void alloc(T*& p, int64_t count) {
  TANDEM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p),
                               static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T)));
}
// cuBLAS prefill path from this many routed rows per local expert on average.
constexpr int64_t kCublasMinRowsPerExpert = 64;
// Padded path: every expert's rows padded to the largest count rounded up to kPadRowsMultiple;
// taken when num_local_experts * Mmax <= routed * kPadMaxNum / kPadMaxDen (2: the strided-
// batched GEMM runs ~2.3x the grouped one's rate on the H200, so it wins up to 2x padding).
constexpr int64_t kPadRowsMultiple = 64, kPadMaxNum = 2, kPadMaxDen = 1;

// Programmatic dependent launches: the down GEMM and the unpermute in the decode and mma paths,
// gate_up after the decode router.
constexpr bool kDownPdl = true;

bool aligned16(void const* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
}  // namespace

MoeLayer::MoeLayer(int64_t max_tokens, int64_t hidden, int64_t inter, int64_t num_experts,
                   int64_t top_k, int64_t expert_begin, int64_t num_local_experts, bool renormalize)
    : max_tokens_(max_tokens),
      hidden_(hidden),
      inter_(inter),
      num_experts_(num_experts),
      top_k_(top_k),
      expert_begin_(expert_begin),
      num_local_(num_local_experts),
      renormalize_(renormalize) {
  TANDEM_CHECK(max_tokens >= 0 && hidden > 0 && inter > 0, "MoeLayer: bad sizes");
  TANDEM_CHECK(num_experts >= 1 && top_k >= 1 && top_k <= num_experts, "MoeLayer: bad top_k ",
               top_k, " of ", num_experts);
  TANDEM_CHECK(expert_begin >= 0 && num_local_experts >= 1 &&
                   expert_begin + num_local_experts <= num_experts,
               "MoeLayer: bad local experts [", expert_begin, ", +", num_local_experts, ")");
  if (num_experts > kRouterMaxExperts || top_k > kRouterMaxTopK) {
    TANDEM_THROW(kUnsupported, "MoeLayer: ", num_experts, " experts, top_k ", top_k,
                 " (the CUDA MoE kernels take at most ", kRouterMaxExperts, " experts, top_k ",
                 kRouterMaxTopK, ")");
  }
  // Validate what the grouped GEMMs need once here, not per step.
  if (hidden % 8 != 0 || inter % kMoeGateUpInterleave != 0) {
    TANDEM_THROW(kUnsupported, "MoeLayer: hidden ", hidden, " must be a multiple of 8, inter ",
                 inter, " of ", kMoeGateUpInterleave);
  }
  const int64_t slots = max_tokens * top_k;
  try {
    alloc(logits_, max_tokens * num_experts);
    alloc(topk_ids_, slots);
    alloc(topk_w_, slots);
    alloc(counts_, num_local_experts);
    alloc(offsets_, num_local_experts + 1);
    alloc(src_, slots);
    alloc(slot_row_, slots);
    alloc(perm_ws_,
          static_cast<int64_t>(moe_permute_workspace_elems(max_tokens, top_k, num_local_experts)));
    cublas_ok_ = slots >= kCublasMinRowsPerExpert * num_local_experts && inter / 8 <= 1024;
    pad_rows_cap_ = cublas_ok_
                        ? std::max(slots, (slots * kPadMaxNum + kPadMaxDen - 1) / kPadMaxDen +
                                              kPadRowsMultiple * num_local_experts)
                        : 0;
    const int64_t buf_rows = cublas_ok_ ? pad_rows_cap_ : slots;
    alloc(rows_, buf_rows * hidden);
    alloc(act_, buf_rows * inter * (cublas_ok_ ? 2 : 1));
    alloc(decode_counter_, 1);
    TANDEM_CUDA_CHECK(cudaMemset(decode_counter_, 0, sizeof(uint32_t)));
    if (cublas_ok_) {
      TANDEM_CUBLAS_CHECK(cublasCreate(&cublas_));
      TANDEM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&h_offsets_),
                                       static_cast<size_t>(num_local_experts + 1) * 4));
      TANDEM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&h_ptrs_),
                                       static_cast<size_t>(6 * num_local_experts) * sizeof(void*)));
      alloc(d_ptrs_, 6 * num_local_experts);
    }
    // No first launch of a grouped GEMM tile inside a graph capture (smem attributes).
    moe_gemm_prepare();
  } catch (...) {
    release();
    throw;
  }
}

MoeLayer::~MoeLayer() { release(); }

void MoeLayer::release() noexcept {
  // NOTE: cudaFree errors are ignored (called from the destructor).
  for (void* p :
       {static_cast<void*>(logits_), static_cast<void*>(topk_ids_), static_cast<void*>(topk_w_),
        static_cast<void*>(counts_), static_cast<void*>(offsets_), static_cast<void*>(src_),
        static_cast<void*>(slot_row_), static_cast<void*>(perm_ws_), static_cast<void*>(rows_),
        static_cast<void*>(act_), static_cast<void*>(decode_counter_), static_cast<void*>(d_ptrs_),
        static_cast<void*>(dq_gate_up_), static_cast<void*>(dq_down_), static_cast<void*>(xq_),
        static_cast<void*>(xqs_), static_cast<void*>(actq_), static_cast<void*>(actqs_),
        static_cast<void*>(gu_)}) {
    if (p) (void)cudaFree(p);
  }
  if (h_offsets_) (void)cudaFreeHost(h_offsets_);
  if (h_ptrs_) (void)cudaFreeHost(h_ptrs_);
  if (cublas_) (void)cublasDestroy(cublas_);
  h_offsets_ = nullptr;
  h_ptrs_ = d_ptrs_ = nullptr;
  cublas_ = nullptr;
  decode_counter_ = nullptr;
  logits_ = nullptr;
  topk_ids_ = nullptr;
  topk_w_ = nullptr;
  counts_ = offsets_ = src_ = slot_row_ = perm_ws_ = nullptr;
  rows_ = act_ = nullptr;
  dq_gate_up_ = dq_down_ = nullptr;
  xq_ = actq_ = nullptr;
  xqs_ = actqs_ = nullptr;
  gu_ = nullptr;
  wgmma_.reset();
}

void MoeLayer::set_fp8_activations(bool on, bool prequant) {
  fp8_activations_ = on;
  fp8_prequant_ = prequant;
  const int64_t rows = max_tokens_ * top_k_;
  if (on && prequant && xq_ == nullptr) {
    // Token rows (mma path) or gathered rows (wgmma path): sized for the latter.
    alloc(xq_, rows * hidden_);
    alloc(xqs_, rows * fp8_row_scale_cols(hidden_));
    alloc(actq_, rows * inter_);
    alloc(actqs_, rows * fp8_row_scale_cols(inter_));
  }
  const bool wgmma_off = !env::flag("TANDEM_CUDA_FP8_WGMMA", true);
  if (on && prequant && !wgmma_ && !wgmma_off && hidden_ % 128 == 0 && inter_ % 128 == 0 &&
      MoeGemmW8A8::supported()) {
    if (!cublas_ok_ && gu_ == nullptr) alloc(gu_, rows * 2 * inter_);
    auto g = std::make_unique<MoeGemmW8A8>();
    g->prepare(num_local_);
    wgmma_ = std::move(g);
  }
}

void MoeLayer::reserve_fp8_prefill() {
  if (dq_gate_up_ != nullptr || !cublas_ok_) return;
  alloc(dq_gate_up_, num_local_ * 2 * inter_ * hidden_);
  alloc(dq_down_, num_local_ * hidden_ * inter_);
}

MoeLayerPath MoeLayer::pick_path(int64_t num_tokens) const {
  if (num_tokens <= moe_layer_detail::kDecodeMaxTokens &&
      num_tokens * top_k_ <= moe_layer_detail::kDecodeMaxSlots && top_k_ <= kRouterMaxTopK &&
      num_experts_ <= kRouterMaxExperts) {
    return MoeLayerPath::kDecode;
  }
  if (cublas_ok_ && num_tokens * top_k_ >= kCublasMinRowsPerExpert * num_local_) {
    return MoeLayerPath::kPadded;  // or kCublas, decided in run() from the expert counts
  }
  return MoeLayerPath::kMma;
}

void MoeLayer::run(MoeLayerWeights const& w, bf16 const* x, bf16* out, int64_t num_tokens,
                   GemmLt& gemm, cudaStream_t stream) {
  TANDEM_CHECK(num_tokens >= 0 && num_tokens <= max_tokens_, "MoeLayer: num_tokens ", num_tokens,
               " outside [0, ", max_tokens_, "]");
  if (num_tokens == 0) return;
  const int64_t T = num_tokens, H = hidden_, I = inter_, rows = T * top_k_;
  MoeLayerPath path = path_ == MoeLayerPath::kAuto ? pick_path(T) : path_;
  if (path == MoeLayerPath::kDecode &&
      (pick_path(T) != MoeLayerPath::kDecode || !aligned16(x) || !aligned16(w.router))) {
    path = MoeLayerPath::kMma;
  }
  if (path == MoeLayerPath::kCublas || path == MoeLayerPath::kPadded) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TANDEM_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (!cublas_ok_ || capture != cudaStreamCaptureStatusNone ||
        (w.gate_up_fp8 != nullptr && (!fp8_prefill_dequant_ || fp8_wgmma()))) {
      path = MoeLayerPath::kMma;
    }
  }
  // FP8 experts on the cuBLAS paths: this layer's experts dequantized to bf16 first.
  MoeLayerWeights wd = w;
  if ((path == MoeLayerPath::kCublas || path == MoeLayerPath::kPadded) &&
      w.gate_up_fp8 != nullptr) {
    reserve_fp8_prefill();
    if (w.gate_up_e8m0 != nullptr) {
      mxfp8_dequantize_launch(w.gate_up_fp8, w.gate_up_e8m0, num_local_ * 2 * I, H, dq_gate_up_,
                              stream);
      mxfp8_dequantize_launch(w.down_fp8, w.down_e8m0, num_local_ * H, I, dq_down_, stream);
    } else {
      fp8_dequantize_launch(w.gate_up_fp8, w.gate_up_scale, num_local_ * 2 * I, H, dq_gate_up_,
                            stream);
      fp8_dequantize_launch(w.down_fp8, w.down_scale, num_local_ * H, I, dq_down_, stream);
    }
    wd.gate_up = dq_gate_up_;
    wd.down = dq_down_;
    wd.gate_up_fp8 = wd.down_fp8 = nullptr;
  }
  last_path_ = path;
  if (path == MoeLayerPath::kDecode) {
    // One launch: router logits, top-k softmax, permute indices.
    moe_layer_detail::DecodeRouterParams rp{x,
                                            w.router,
                                            logits_,
                                            topk_ids_,
                                            topk_w_,
                                            counts_,
                                            offsets_,
                                            src_,
                                            slot_row_,
                                            decode_counter_,
                                            static_cast<int>(T),
                                            static_cast<int>(H),
                                            static_cast<int>(num_experts_),
                                            static_cast<int>(top_k_),
                                            static_cast<int>(expert_begin_),
                                            static_cast<int>(num_local_),
                                            renormalize_,
                                            decode_switches().router_pdl};
    moe_layer_detail::decode_router_launch(rp, stream);
    // bf16 experts: the expert GEMVs of moe_decode.h (weights streamed once, the unpermute
    // folded into the down kernel).
    MoeDecodeParams dp{x,
                       w.gate_up,
                       w.down,
                       topk_ids_,
                       topk_w_,
                       offsets_,
                       src_,
                       act_,
                       out,
                       static_cast<int>(T),
                       static_cast<int>(H),
                       static_cast<int>(I),
                       static_cast<int>(top_k_),
                       static_cast<int>(expert_begin_),
                       static_cast<int>(num_local_)};
    if (decode_switches().moe_gemv && T <= decode_switches().moe_gemv_max_tokens &&
        w.gate_up_fp8 == nullptr && moe_decode_supported(dp)) {
      moe_decode_launch(dp, stream);
      return;
    }
  } else {
    // fp32 router logits: bf16 (8-bit mantissa) would round away top-k margins below ~1e-2.
    GemmParams rp{};
    rp.x = x;
    rp.w = w.router;
    rp.m = T;
    rp.n = num_experts_;
    rp.k = H;
    rp.y_f32 = logits_;
    gemm.run(rp, stream);
    topk_softmax_launch(
        {logits_, topk_ids_, topk_w_, T, num_experts_, top_k_, renormalize_, DType::kF32}, stream);
    if (path == MoeLayerPath::kCublas) {
      run_cublas(wd, x, out, T, stream);
      return;
    }
    if (path == MoeLayerPath::kPadded) {
      run_padded(wd, x, out, T, stream);  // sets last_path_ (kPadded or kCublas)
      return;
    }
    // Indices only: the gate_up GEMM gathers its x rows itself (permuted_src / top_k).
    moe_permute_launch({x, topk_ids_, nullptr, counts_, offsets_, src_, slot_row_, perm_ws_, T, H,
                        top_k_, expert_begin_, num_local_},
                       stream);
  }
  if (fp8_wgmma() && w.gate_up_fp8 != nullptr && w.gate_up_e8m0 == nullptr) {
    // W8A8 on wgmma: the gather quantizes the grouped rows; gate_up writes bf16 gate/up (the
    // packed row order), the SiLU-mul quantizes the down GEMM's input; counts from the device.
    int32_t const* routed = offsets_ + num_local_;
    bf16* gu = cublas_ok_ ? act_ : gu_;
    fp8_gather_quantize_launch({x, src_, top_k_, routed, xq_, xqs_, rows, H}, stream);
    wgmma_->run(
        {xq_, xqs_, w.gate_up_fp8, w.gate_up_scale, gu, offsets_, rows, 2 * I, H, num_local_},
        stream);
    silu_mul_quantize_fp8_launch({gu, routed, actq_, actqs_, rows, I, kMoeGateUpInterleave},
                                 stream);
    wgmma_->run({actq_, actqs_, w.down_fp8, w.down_scale, rows_, offsets_, rows, H, I, num_local_},
                stream);
  } else {
    run_mma_gemms(w, x, T, rows, path, stream);
  }
  if (kDownPdl && aligned16(out)) {
    moe_layer_detail::unpermute_pdl_launch(
        {rows_, topk_ids_, topk_w_, slot_row_, out, T, H, top_k_}, stream);
  } else {
    moe_unpermute_launch({rows_, topk_ids_, topk_w_, slot_row_, out, T, H, top_k_, DType::kBF16},
                         stream);
  }
}

void MoeLayer::run_mma_gemms(MoeLayerWeights const& w, bf16 const* x, int64_t T, int64_t rows,
                             MoeLayerPath path, cudaStream_t stream) {
  const int64_t H = hidden_, I = inter_;
  MoeGemmParams gate_up{
      x, w.gate_up, act_, offsets_, rows, 2 * I, H, num_local_, MoeGemmEpilogue::kSiluMul};
  gate_up.gather_src = src_;
  gate_up.gather_div = top_k_;
  gate_up.w_fp8 = w.gate_up_fp8;
  gate_up.w_scale = w.gate_up_scale;
  gate_up.w_e8m0 = w.gate_up_e8m0;
  gate_up.fp8_activations = fp8_activations_;
  const bool prequant = fp8_activations_ && fp8_prequant_ && w.gate_up_fp8 != nullptr;
  if (prequant) {  // the tokens' x once (gate_up gathers its rows by src / top_k)
    fp8_quantize_rows_launch(x, xq_, xqs_, T, H, stream);
    gate_up.x_fp8 = xq_;
    gate_up.x_scale = xqs_;
  }
  // After the decode router (which lets it start early): hide the launch latency.
  if (path == MoeLayerPath::kDecode && kDownPdl) gate_up.pdl = MoeGemmPdl::kWaitFirst;
  moe_gemm_launch(gate_up, stream);
  // The down GEMM may start during gate_up: its offsets come from the kernels before gate_up,
  // so it streams its first weight tiles and waits for gate_up only before reading act.
  MoeGemmParams down{
      act_, w.down, rows_, offsets_, rows, H, I, num_local_, MoeGemmEpilogue::kPlain};
  down.pdl = kDownPdl ? MoeGemmPdl::kPrefetchWeights : MoeGemmPdl::kOff;
  down.w_fp8 = w.down_fp8;
  down.w_scale = w.down_scale;
  down.w_e8m0 = w.down_e8m0;
  down.fp8_activations = fp8_activations_;
  if (prequant) {  // the SiLU-mul output (rows past the routed ones: never read by down)
    fp8_quantize_rows_launch(act_, actq_, actqs_, rows, I, stream);
    down.x_fp8 = actq_;
    down.x_scale = actqs_;
  }
  moe_gemm_launch(down, stream);
}

// Eager prefill after the router and top-k: permute with the permuted copy of x (rows
// contiguous per expert), offsets to the host, expert GEMMs through cublasGemmGroupedBatchedEx
// with one group per non-empty expert (group_size 1). Row-major y[m_e, n] = x_e[m_e, k]
// W_e[n, k]^T is column-major y^T[n, m_e] = op_T(W_e as [k, n], ld k) * (x_e^T as [k, m_e],
// ld k), ldc n.
void MoeLayer::run_cublas(MoeLayerWeights const& w, bf16 const* x, bf16* out, int64_t num_tokens,
                          cudaStream_t stream) {
  const int64_t T = num_tokens, H = hidden_, L = num_local_;
  moe_permute_launch({x, topk_ids_, rows_, counts_, offsets_, src_, slot_row_, perm_ws_, T, H,
                      top_k_, expert_begin_, L},
                     stream);
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(h_offsets_, offsets_, static_cast<size_t>(L + 1) * 4,
                                    cudaMemcpyDeviceToHost, stream));
  // Also waits for the previous run's upload of h_ptrs_ before it is rewritten below.
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  grouped_gemms(w, stream);
  moe_unpermute_launch({rows_, topk_ids_, topk_w_, slot_row_, out, T, H, top_k_, DType::kBF16},
                       stream);
}

// cublasGemmGroupedBatchedEx for gate_up and down (one group per non-empty expert) + the
// SiLU-multiply between them, on the compact permuted rows_ (h_offsets_ valid, stream synced).
void MoeLayer::grouped_gemms(MoeLayerWeights const& w, cudaStream_t stream) {
  const int64_t H = hidden_, I = inter_, L = num_local_;
  std::vector<int> gm, gn, gk, glda, gldb, gldc, gsize;
  std::vector<float> alpha, beta;
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int64_t> experts;
  for (int64_t e = 0; e < L; ++e) {
    if (h_offsets_[e + 1] > h_offsets_[e]) experts.push_back(e);
  }
  const int G = static_cast<int>(experts.size());
  const int64_t routed = h_offsets_[L];
  if (G > 0) {
    void** hA1 = h_ptrs_;
    void** hB1 = h_ptrs_ + G;
    void** hC1 = h_ptrs_ + 2 * G;
    void** hA2 = h_ptrs_ + 3 * G;
    void** hB2 = h_ptrs_ + 4 * G;
    void** hC2 = h_ptrs_ + 5 * G;
    for (int g = 0; g < G; ++g) {
      const int64_t e = experts[g], r0 = h_offsets_[e];
      hA1[g] = const_cast<bf16*>(w.gate_up) + e * 2 * I * H;
      hB1[g] = rows_ + r0 * H;
      hC1[g] = act_ + r0 * 2 * I;
      hA2[g] = const_cast<bf16*>(w.down) + e * H * I;
      hB2[g] = act_ + r0 * 2 * I;
      hC2[g] = rows_ + r0 * H;
    }
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(d_ptrs_, h_ptrs_, static_cast<size_t>(6 * G) * sizeof(void*),
                                      cudaMemcpyHostToDevice, stream));
    TANDEM_CUBLAS_CHECK(cublasSetStream(cublas_, stream));
    ta.assign(G, CUBLAS_OP_T);
    tb.assign(G, CUBLAS_OP_N);
    alpha.assign(G, 1.0f);
    beta.assign(G, 0.0f);
    gsize.assign(G, 1);
    gn.resize(G);
    for (int g = 0; g < G; ++g) {
      const int64_t e = experts[g];
      gn[g] = h_offsets_[e + 1] - h_offsets_[e];
    }
    // gate_up: [rows_e, 2I] packed = x_e [rows_e, H] . W_gu_e [2I, H]^T
    gm.assign(G, static_cast<int>(2 * I));
    gk.assign(G, static_cast<int>(H));
    glda.assign(G, static_cast<int>(H));
    gldb.assign(G, static_cast<int>(H));
    gldc.assign(G, static_cast<int>(2 * I));
    TANDEM_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
        cublas_, ta.data(), tb.data(), gm.data(), gn.data(), gk.data(), alpha.data(),
        const_cast<void const* const*>(d_ptrs_), CUDA_R_16BF, glda.data(),
        const_cast<void const* const*>(d_ptrs_ + G), CUDA_R_16BF, gldb.data(), beta.data(),
        d_ptrs_ + 2 * G, CUDA_R_16BF, gldc.data(), G, gsize.data(), CUBLAS_COMPUTE_32F));
    moe_layer_detail::silu_mul_packed_launch(act_, routed, I, stream);
    // down: [rows_e, H] = act_e [rows_e, I] (row stride 2I) . W_down_e [H, I]^T
    gm.assign(G, static_cast<int>(H));
    gk.assign(G, static_cast<int>(I));
    glda.assign(G, static_cast<int>(I));
    gldb.assign(G, static_cast<int>(2 * I));
    gldc.assign(G, static_cast<int>(H));
    TANDEM_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
        cublas_, ta.data(), tb.data(), gm.data(), gn.data(), gk.data(), alpha.data(),
        const_cast<void const* const*>(d_ptrs_ + 3 * G), CUDA_R_16BF, glda.data(),
        const_cast<void const* const*>(d_ptrs_ + 4 * G), CUDA_R_16BF, gldb.data(), beta.data(),
        d_ptrs_ + 5 * G, CUDA_R_16BF, gldc.data(), G, gsize.data(), CUBLAS_COMPUTE_32F));
  }
}

// Eager prefill, padded: permute indices, offsets to the host; if the experts padded to Mmax
// rows fit (balanced routing), gather x into the padded rows (zeros past each count; slot_row
// rewritten to the padded rows), one cublasGemmStridedBatchedEx per GEMM over all local
// experts, unpermute. Else the cublas path's gather (compact rows) and grouped GEMMs.
// Row-major Y_e[Mmax, n] = X_e[Mmax, k] W_e[n, k]^T as in run_cublas, batch stride Mmax k
// (X), n k (W), Mmax n (Y).
void MoeLayer::run_padded(MoeLayerWeights const& w, bf16 const* x, bf16* out, int64_t num_tokens,
                          cudaStream_t stream) {
  const int64_t T = num_tokens, H = hidden_, I = inter_, L = num_local_;
  moe_permute_launch({x, topk_ids_, nullptr, counts_, offsets_, src_, slot_row_, perm_ws_, T, H,
                      top_k_, expert_begin_, L},
                     stream);
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(h_offsets_, offsets_, static_cast<size_t>(L + 1) * 4,
                                    cudaMemcpyDeviceToHost, stream));
  // Also waits for the previous run's upload of h_ptrs_ (cublas path) before it is rewritten.
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t max_count = 0;
  for (int64_t e = 0; e < L; ++e) {
    max_count = std::max<int64_t>(max_count, h_offsets_[e + 1] - h_offsets_[e]);
  }
  const int64_t routed = h_offsets_[L];
  const int64_t m_pad = (max_count + kPadRowsMultiple - 1) / kPadRowsMultiple * kPadRowsMultiple;
  const bool fits = L * m_pad <= pad_rows_cap_ && m_pad * std::max(2 * I, H) <= INT32_MAX;
  const bool balanced = L * m_pad * kPadMaxDen <= routed * kPadMaxNum;
  const bool padded = routed > 0 && fits && (path_ == MoeLayerPath::kPadded || balanced);
  last_path_ = padded ? MoeLayerPath::kPadded : MoeLayerPath::kCublas;
  if (!padded) {
    // Unbalanced routing: the grouped cuBLAS path, its rows gathered by moe_permute (a gather
    // grid of max_count x experts blocks would be mostly idle here).
    moe_permute_launch({x, topk_ids_, rows_, counts_, offsets_, src_, slot_row_, perm_ws_, T, H,
                        top_k_, expert_begin_, L},
                       stream);
    grouped_gemms(w, stream);
  } else {
    moe_layer_detail::prefill_gather_launch(
        {x, offsets_, src_, slot_row_, rows_, H, top_k_, m_pad, static_cast<int>(L), true}, stream);
    TANDEM_CUBLAS_CHECK(cublasSetStream(cublas_, stream));
    const float alpha = 1.0f, beta = 0.0f;
    const int m = static_cast<int>(m_pad), batch = static_cast<int>(L);
    // gate_up: [Mmax, 2I] packed per expert = X_e [Mmax, H] . W_gu_e [2I, H]^T
    TANDEM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(2 * I), m, static_cast<int>(H), &alpha,
        w.gate_up, CUDA_R_16BF, static_cast<int>(H), 2 * I * H, rows_, CUDA_R_16BF,
        static_cast<int>(H), m_pad * H, &beta, act_, CUDA_R_16BF, static_cast<int>(2 * I),
        m_pad * 2 * I, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    moe_layer_detail::silu_mul_packed_launch(act_, L * m_pad, I, stream);
    // down: [Mmax, H] = act_e [Mmax, I] (row stride 2I) . W_down_e [H, I]^T, into rows_
    TANDEM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(H), m, static_cast<int>(I), &alpha,
        w.down, CUDA_R_16BF, static_cast<int>(I), H * I, act_, CUDA_R_16BF, static_cast<int>(2 * I),
        m_pad * 2 * I, &beta, rows_, CUDA_R_16BF, static_cast<int>(H), m_pad * H, batch,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  moe_unpermute_launch({rows_, topk_ids_, topk_w_, slot_row_, out, T, H, top_k_, DType::kBF16},
                       stream);
}

}  // namespace tandem::cuda
