// cuBLASLt GEMM with cached plans. See gemm.h.
#include "backend/cuda/gemm.h"

#include "backend/cuda/check.h"
#include "backend/cuda/decode_switches.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/moe_gemm.h"

namespace tandem::cuda {

GemmLt::GemmLt(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  TANDEM_CUBLAS_CHECK(cublasLtCreate(&handle_));
  if (workspace_bytes_ > 0) TANDEM_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

GemmLt::~GemmLt() {
  // NOTE: destructors do not throw; errors here are ignored.
  for (auto& [key, plan] : plans_) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.op);
  }
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

// Row-major y[m, n] = x[m, k] W[n, k]^T is column-major y^T[n, m] = W^T... i.e. with
// cuBLASLt's column-major view: A = W as [k, n] (ld k) transposed, B = x as [k, m] (ld k),
// C = D = y as [n, m] (ld n): the "TN" layout.
namespace {
// Largest power of two (<= 256) dividing every pointer: cuBLASLt's heuristic assumes 256-byte
// aligned buffers unless told otherwise, and an algorithm picked for them can fail on less.
uint32_t common_alignment(void const* a, void const* b, void const* c) {
  uintptr_t bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
                   reinterpret_cast<uintptr_t>(c) | uintptr_t{256};
  return static_cast<uint32_t>(bits & (~bits + 1));  // lowest set bit
}
}  // namespace

GemmLt::Plan& GemmLt::plan_for(int64_t m, int64_t n, int64_t k, bool beta, uint32_t align,
                               bool f32_out) {
  auto key = std::make_tuple(m, n, k, beta, align, f32_out);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan plan;
  TANDEM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  TANDEM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                                     sizeof(transa)));
  TANDEM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                                     sizeof(transb)));
  TANDEM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_16BF, static_cast<uint64_t>(k),
                                                 static_cast<uint64_t>(n), k));
  TANDEM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_16BF, static_cast<uint64_t>(k),
                                                 static_cast<uint64_t>(m), k));
  TANDEM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, f32_out ? CUDA_R_32F : CUDA_R_16BF,
                                                 static_cast<uint64_t>(n), static_cast<uint64_t>(m),
                                                 n));
  cublasLtMatmulPreference_t pref = nullptr;
  TANDEM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_));
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
    }
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle_, plan.op, plan.a, plan.b, plan.c, plan.c, pref,
                                        kCandidates, results, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.op);
    TANDEM_THROW(kUnsupported, "gemm: no cuBLASLt algorithm for m ", m, " n ", n, " k ", k,
                 " (status ", static_cast<int>(st), ")");
  }
  plan.algo = results[0].algo;
  // Small m (decode shapes, a fixed set): the heuristic's first pick is often not the fastest
  // there, so the first eager call times the candidates (run()).
  if (m <= kTuneMaxM && !beta) {
    plan.tune_pending = true;
    for (int i = 0; i < found; ++i) {
      if (results[i].state == CUBLAS_STATUS_SUCCESS) plan.candidates.push_back(results[i].algo);
    }
    // m <= 8 (decode): the gemv kernel (gemv.h) is one more candidate when it takes the operands
    // (align >= 16: x and w 16-byte aligned).
    plan.gemv_candidate = gemv_enabled_ && m <= kGemvMaxM && k % 8 == 0 && align >= 16;
  }
  return plans_.emplace(key, plan).first->second;
}

namespace {
GemvParams gemv_params(GemmParams const& p) {
  return {p.x, p.w, p.y, p.m, p.n, p.k, p.alpha, p.y_f32};
}
// The two timing events, destroyed on every exit of tune().
struct EventPair {
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  EventPair() {
    TANDEM_CUDA_CHECK(cudaEventCreate(&e0));
    try {
      TANDEM_CUDA_CHECK(cudaEventCreate(&e1));
    } catch (...) {
      (void)cudaEventDestroy(e0);
      throw;
    }
  }
  ~EventPair() {
    (void)cudaEventDestroy(e0);
    (void)cudaEventDestroy(e1);
  }
  EventPair(EventPair const&) = delete;
  EventPair& operator=(EventPair const&) = delete;
};
}  // namespace

size_t GemmLt::num_gemv_plans() const {
  size_t count = 0;
  for (auto const& [key, plan] : plans_) count += plan.use_gemv ? 1 : 0;
  return count;
}

void GemmLt::tune(Plan& plan, GemmParams const& p, void* y, cudaStream_t stream) {
  plan.tune_pending = false;
  std::vector<cublasLtMatmulAlgo_t> cands;
  cands.swap(plan.candidates);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  TANDEM_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
  const GemvParams gp = gemv_params(p);
  const bool gemv = plan.gemv_candidate && gemv_supported(gp);
  if ((cands.size() < 2 && !gemv) || cap != cudaStreamCaptureStatusNone) return;
  if (cands.empty()) cands.push_back(plan.algo);
  EventPair ev;
  cudaEvent_t e0 = ev.e0, e1 = ev.e1;
  float best = 0;
  for (const auto& algo : cands) {
    auto launch = [&] {
      return cublasLtMatmul(handle_, plan.op, &p.alpha, p.w, plan.a, p.x, plan.b, &p.beta, y,
                            plan.c, y, plan.c, &algo, workspace_, workspace_bytes_, stream);
    };
    if (launch() != CUBLAS_STATUS_SUCCESS) continue;  // an algorithm may refuse the operands
    TANDEM_CUDA_CHECK(cudaEventRecord(e0, stream));
    bool ok = true;
    for (int i = 0; i < 5 && ok; ++i) ok = launch() == CUBLAS_STATUS_SUCCESS;
    TANDEM_CUDA_CHECK(cudaEventRecord(e1, stream));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (ok && (best == 0 || ms < best)) {
      best = ms;
      plan.algo = algo;
    }
  }
  if (gemv) {  // timed the same way: one warm-up launch, then 5
    gemv_launch(gp, stream);
    TANDEM_CUDA_CHECK(cudaEventRecord(e0, stream));
    for (int i = 0; i < 5; ++i) gemv_launch(gp, stream);
    TANDEM_CUDA_CHECK(cudaEventRecord(e1, stream));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (best == 0 || ms < best) {
      best = ms;
      plan.use_gemv = true;
    }
  }
}

void GemmLt::run_invariant(GemmParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kUnsupported, p.beta == 0.0f && p.k % 8 == 0 && p.n % 8 == 0,
                    "gemm: the batch-invariant mode needs beta 0, k % 8 == 0 and n % 8 == 0 (beta ",
                    p.beta, ", n ", p.n, ", k ", p.k, ")");
  MoeGemmParams g{};
  g.x = p.x;
  g.w = p.w;
  g.y = p.y;
  g.y_f32 = p.y_f32;
  g.expert_offsets = nullptr;  // one dense expert of m rows
  g.max_rows = p.m;
  g.n = p.n;
  g.k = p.k;
  g.num_experts = 1;
  g.epilogue = MoeGemmEpilogue::kPlain;
  // Any tile gives the same bits (moe_gemm.h); the tile only sets the speed. Decode rows on
  // the small tile (16 x 32: many CTAs stream the weights; a second row tile rereads them from
  // L2) unless the matrix is larger than L2 (lm_head: one 64-row tile reads it once).
  const bool big = p.n * p.k * static_cast<int64_t>(sizeof(bf16)) > (int64_t{32} << 20);
  g.tile = p.m <= 16 || (p.m <= 64 && !big) ? MoeGemmTile::kSmall
           : p.m <= 128                     ? MoeGemmTile::kMedium
                                            : MoeGemmTile::kLarge;
  TANDEM_CHECK(p.alpha == 1.0f, "gemm: the batch-invariant mode needs alpha 1, not ", p.alpha);
  moe_gemm_launch(g, stream);
}

void GemmLt::run(GemmParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.m >= 0 && p.n > 0 && p.k > 0, "gemm: bad sizes m ", p.m, " n ", p.n, " k ", p.k);
  if (p.m == 0) return;
  const bool f32_out = p.y_f32 != nullptr;
  void* y = f32_out ? static_cast<void*>(p.y_f32) : static_cast<void*>(p.y);
  if (batch_invariant_) {
    run_invariant(p, stream);
    return;
  }
  Plan& plan = plan_for(p.m, p.n, p.k, p.beta != 0.0f, common_alignment(p.x, p.w, y), f32_out);
  if (plan.tune_pending) tune(plan, p, y, stream);
  if (plan.use_gemv) {
    GemvParams gp = gemv_params(p);
    gp.pdl = decode_switches().gemv_pdl;  // the decode step's linears: weights stream early
    gemv_launch(gp, stream);
    return;
  }
  TANDEM_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.op, &p.alpha, p.w, plan.a, p.x, plan.b, &p.beta,
                                     y, plan.c, y, plan.c, &plan.algo, workspace_, workspace_bytes_,
                                     stream));
}

}  // namespace tandem::cuda
