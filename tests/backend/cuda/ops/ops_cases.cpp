// The cases of the simple CUDA ops (once tests/backend/cuda/test_ops_cuda.cpp): Embedding,
// RmsNorm, AddRmsNorm, QkNormRope, QkvPrep, KvWrite, PagedAttention, TopkSoftmax, SiluMul,
// MoePermute (+ unpermute), Gemm (GemmLt) and the MoeLayer composition, each against the CPU
// reference with bf16 inputs converted to fp32. Tolerances: bf16 outputs 1e-2, fp32 outputs
// 1e-5 where the op computes in fp32, copies and integer outputs exact. The edge cases are in
// the shape tables: one row / token, sizes that are not a multiple of a tile or a vector width,
// the largest supported (512 experts, top-16, head_dim 128 with 64 q heads).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/norm.h"
#include "backend_ops.h"
#include "core/dtype.h"

namespace tandem::cuda::backend_ops {
namespace {

using std::to_string;
using bfp = __nv_bfloat16*;

// ------------------------------------------------------------------------------ embedding

class EmbeddingCase : public OpCase {
 public:
  EmbeddingCase(int64_t hidden, int64_t tokens) : hidden_(hidden), tokens_(tokens) {}
  void setup(Rng& rng) override {
    table_ = rng.randn_bf16(kVocab * hidden_);
    ids_.resize(tokens_);
    for (auto& id : ids_) id = static_cast<int32_t>(rng.uniform(0, kVocab - 1));
    d_table_ = upload_bf16(table_);
    d_ids_ = upload(ids_);
    d_out_ = alloc<__nv_bfloat16>(tokens_ * hidden_);
    output("out", DType::kBF16, d_out_, tokens_ * hidden_).exact();  // a copy: exact
  }
  void reference() override {
    std::vector<float> ref(tokens_ * hidden_), tf = to_f32(table_);
    cpu::embedding({ids_.data(), tf.data(), ref.data(), tokens_, hidden_, kVocab});
    outputs()[0].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override {
    embedding_launch({d_ids_, d_table_, d_out_, tokens_, hidden_, kVocab}, s);
  }
  double bytes() const override { return double(tokens_) * (hidden_ * 4 + 4); }

 private:
  static constexpr int64_t kVocab = 1000;
  int64_t hidden_, tokens_;
  Bits table_;
  std::vector<int32_t> ids_;
  bfp d_table_ = nullptr, d_out_ = nullptr;
  int32_t* d_ids_ = nullptr;
};

// ------------------------------------------------------------------------------ rms norm

// out = rms_norm(x) * w; in place: x and out alias (x is the output, initially x).
class RmsNormCase : public OpCase {
 public:
  RmsNormCase(int64_t dim, int64_t rows, bool in_place)
      : dim_(dim), rows_(rows), in_place_(in_place) {}
  void setup(Rng& rng) override {
    x_ = rng.randn_bf16(rows_ * dim_, 2.0f);
    w_ = rng.randn_bf16(dim_, 0.1f, 1.0f);
    d_w_ = upload_bf16(w_);
    d_out_ = alloc<__nv_bfloat16>(rows_ * dim_);
    Output& o = output(in_place_ ? "x (in place)" : "out", DType::kBF16, d_out_, rows_ * dim_);
    if (in_place_) {
      o.initially(x_);
      d_x_ = d_out_;
    } else {
      d_x_ = upload_bf16(x_);
    }
  }
  void reference() override {
    std::vector<float> xf = to_f32(x_), wf = to_f32(w_), ref(rows_ * dim_);
    cpu::rms_norm({xf.data(), wf.data(), ref.data(), rows_, dim_, 1e-6f});
    outputs()[0].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override {
    rms_norm_launch({d_x_, d_w_, d_out_, rows_, dim_, 1e-6f}, s);
  }
  double bytes() const override { return double(rows_) * dim_ * 4 + dim_ * 2; }

 private:
  int64_t dim_, rows_;
  bool in_place_;
  Bits x_, w_;
  bfp d_x_ = nullptr, d_w_ = nullptr, d_out_ = nullptr;
};

// residual += x (in place), out = rms_norm(residual) * w.
class AddRmsNormCase : public OpCase {
 public:
  AddRmsNormCase(int64_t dim, int64_t rows) : dim_(dim), rows_(rows) {}
  void setup(Rng& rng) override {
    res_ = rng.randn_bf16(rows_ * dim_, 3.0f);
    x_ = rng.randn_bf16(rows_ * dim_);
    w_ = rng.randn_bf16(dim_, 0.1f, 1.0f);
    d_x_ = upload_bf16(x_);
    d_w_ = upload_bf16(w_);
    d_res_ = alloc<__nv_bfloat16>(rows_ * dim_);
    d_out_ = alloc<__nv_bfloat16>(rows_ * dim_);
    output("residual", DType::kBF16, d_res_, rows_ * dim_).initially(res_);
    output("out", DType::kBF16, d_out_, rows_ * dim_);
  }
  void reference() override {
    std::vector<float> rf = to_f32(res_), xf = to_f32(x_), wf = to_f32(w_), ref(rows_ * dim_);
    cpu::add_rms_norm({rf.data(), xf.data(), wf.data(), ref.data(), rows_, dim_, 1e-6f});
    outputs()[0].ref = std::move(rf);
    outputs()[1].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override {
    add_rms_norm_launch({d_res_, d_x_, d_w_, d_out_, rows_, dim_, 1e-6f}, s);
  }
  double bytes() const override { return double(rows_) * dim_ * 2 * 4 + dim_ * 2; }

 private:
  int64_t dim_, rows_;
  Bits res_, x_, w_;
  bfp d_res_ = nullptr, d_x_ = nullptr, d_w_ = nullptr, d_out_ = nullptr;
};

// ------------------------------------------------------------------------------ q/k norm + rope

struct Heads {
  int64_t q_heads, kv_heads, head_dim;
};

std::string heads_str(Heads h) {
  return "qh" + to_string(h.q_heads) + "_kvh" + to_string(h.kv_heads) + "_d" +
         to_string(h.head_dim);
}

// q and k normed (or not: no weights) and rotated in place.
class QkNormRopeCase : public OpCase {
 public:
  QkNormRopeCase(Heads h, int64_t tokens, bool norm) : h_(h), tokens_(tokens), norm_(norm) {}
  void setup(Rng& rng) override {
    const int64_t d = h_.head_dim;
    q_ = rng.randn_bf16(tokens_ * h_.q_heads * d, 2.0f);
    k_ = rng.randn_bf16(tokens_ * h_.kv_heads * d);
    qw_ = rng.randn_bf16(d, 0.1f, 1.0f);
    kw_ = rng.randn_bf16(d, 0.1f, 1.0f);
    pos_.resize(tokens_);
    for (auto& p : pos_) p = static_cast<int32_t>(rng.uniform(0, 40000));
    pos_[0] = 0;
    d_qw_ = upload_bf16(qw_);
    d_kw_ = upload_bf16(kw_);
    d_pos_ = upload(pos_);
    d_q_ = alloc<__nv_bfloat16>(q_.size());
    d_k_ = alloc<__nv_bfloat16>(k_.size());
    output("q", DType::kBF16, d_q_, q_.size()).initially(q_);
    output("k", DType::kBF16, d_k_, k_.size()).initially(k_);
  }
  void reference() override {
    std::vector<float> qf = to_f32(q_), kf = to_f32(k_), qwf = to_f32(qw_), kwf = to_f32(kw_);
    cpu::qk_norm_rope({qf.data(), kf.data(), norm_ ? qwf.data() : nullptr,
                       norm_ ? kwf.data() : nullptr, pos_.data(), tokens_, h_.q_heads, h_.kv_heads,
                       h_.head_dim, 1e-6f, 1e6});
    outputs()[0].ref = std::move(qf);
    outputs()[1].ref = std::move(kf);
  }
  void launch(cudaStream_t s) override {
    QkNormRopeParams p{d_q_,
                       d_k_,
                       norm_ ? d_qw_ : nullptr,
                       norm_ ? d_kw_ : nullptr,
                       d_pos_,
                       tokens_,
                       h_.q_heads,
                       h_.kv_heads,
                       h_.head_dim,
                       1e-6f,
                       1e6};
    qk_norm_rope_launch(p, s);
  }
  double bytes() const override { return double(q_.size() + k_.size()) * 4 + tokens_ * 4; }

 private:
  Heads h_;
  int64_t tokens_;
  bool norm_;
  Bits q_, k_, qw_, kw_;
  std::vector<int32_t> pos_;
  bfp d_q_ = nullptr, d_k_ = nullptr, d_qw_ = nullptr, d_kw_ = nullptr;
  int32_t* d_pos_ = nullptr;
};

// The fused attention prologue vs its CPU composition: split the fused qkv rows, q/k norm +
// RoPE (cpu::qk_norm_rope), k and v into the pages (cpu::kv_write); q_out and the pool are
// poisoned first; tokens with slot -1 must leave the pool untouched (still poison).
class QkvPrepCase : public OpCase {
 public:
  QkvPrepCase(Heads h, int64_t tokens) : h_(h), tokens_(tokens) {}
  void setup(Rng& rng) override {
    const int64_t d = h_.head_dim, w = (h_.q_heads + 2 * h_.kv_heads) * d;
    pages_ = tokens_ / kPage + 3;
    qkv_ = rng.randn_bf16(tokens_ * w, 2.0f);
    qw_ = rng.randn_bf16(d, 0.1f, 1.0f);
    kw_ = rng.randn_bf16(d, 0.1f, 1.0f);
    pos_.resize(tokens_);
    slots_.resize(tokens_);
    std::vector<int64_t> perm(pages_ * kPage);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.gen());
    for (int64_t t = 0; t < tokens_; ++t) {
      pos_[t] = static_cast<int32_t>(rng.uniform(0, 40000));
      slots_[t] = t % 7 == 3 ? -1 : perm[t];  // some tokens are padding
    }
    d_qkv_ = upload_bf16(qkv_);
    d_qw_ = upload_bf16(qw_);
    d_kw_ = upload_bf16(kw_);
    d_pos_ = upload(pos_);
    d_slots_ = upload(slots_);
    const size_t q_n = tokens_ * h_.q_heads * d, pool_n = pages_ * 2 * h_.kv_heads * kPage * d;
    d_q_ = alloc<__nv_bfloat16>(q_n);
    d_pool_ = alloc<__nv_bfloat16>(pool_n);
    output("q", DType::kBF16, d_q_, q_n);
    output("k / v in the pool", DType::kBF16, d_pool_, pool_n);
  }
  void reference() override {
    const int64_t d = h_.head_dim, qh = h_.q_heads, kvh = h_.kv_heads, w = (qh + 2 * kvh) * d;
    // CPU: split, norm + rope, write into an fp32 pool of NaN.
    std::vector<float> f = to_f32(qkv_), qf(tokens_ * qh * d), kf(tokens_ * kvh * d),
                       vf(tokens_ * kvh * d);
    for (int64_t t = 0; t < tokens_; ++t) {
      std::copy_n(f.begin() + t * w, qh * d, qf.begin() + t * qh * d);
      std::copy_n(f.begin() + t * w + qh * d, kvh * d, kf.begin() + t * kvh * d);
      std::copy_n(f.begin() + t * w + (qh + kvh) * d, kvh * d, vf.begin() + t * kvh * d);
    }
    std::vector<float> qwf = to_f32(qw_), kwf = to_f32(kw_);
    cpu::qk_norm_rope({qf.data(), kf.data(), qwf.data(), kwf.data(), pos_.data(), tokens_, qh, kvh,
                       d, 1e-6f, 1e6});
    std::vector<float> pool(pages_ * 2 * kvh * kPage * d, NAN);
    std::vector<int64_t> written;  // cpu::kv_write takes every token: pass the real ones only
    std::vector<float> kw_rows, vw_rows;
    for (int64_t t = 0; t < tokens_; ++t) {
      if (slots_[t] < 0) continue;
      written.push_back(slots_[t]);
      kw_rows.insert(kw_rows.end(), kf.begin() + t * kvh * d, kf.begin() + (t + 1) * kvh * d);
      vw_rows.insert(vw_rows.end(), vf.begin() + t * kvh * d, vf.begin() + (t + 1) * kvh * d);
    }
    cpu::kv_write({kw_rows.data(), vw_rows.data(), pool.data(), written.data(),
                   static_cast<int64_t>(written.size()), kvh, d, kPage});
    outputs()[0].ref = std::move(qf);
    // The pool: written slots within bf16 tolerance, every other element still poison.
    Output& o = outputs()[1];
    o.mask.resize(pool.size());
    for (size_t i = 0; i < pool.size(); ++i) {
      o.mask[i] = std::isnan(pool[i]) ? Elem::kUntouched : Elem::kCompare;
    }
    o.ref = std::move(pool);
  }
  void launch(cudaStream_t s) override {
    qkv_prep_launch({d_qkv_, d_q_, d_pool_, d_slots_, d_qw_, d_kw_, d_pos_, tokens_, h_.q_heads,
                     h_.kv_heads, h_.head_dim, kPage, 1e-6f, 1e6},
                    s);
  }
  double bytes() const override { return double(qkv_.size()) * 4 + tokens_ * 12; }

 private:
  static constexpr int64_t kPage = 16;
  Heads h_;
  int64_t tokens_, pages_ = 0;
  Bits qkv_, qw_, kw_;
  std::vector<int32_t> pos_;
  std::vector<int64_t> slots_;
  bfp d_qkv_ = nullptr, d_qw_ = nullptr, d_kw_ = nullptr, d_q_ = nullptr, d_pool_ = nullptr;
  int32_t* d_pos_ = nullptr;
  int64_t* d_slots_ = nullptr;
};

// ------------------------------------------------------------------------------ kv write

// k, v rows into a random pool (in place); slot -1 (token 1 when there are several) skipped;
// every other element of the pool unchanged (exact: copies).
class KvWriteCase : public OpCase {
 public:
  KvWriteCase(int64_t heads, int64_t head_dim, int64_t tokens)
      : heads_(heads), d_(head_dim), tokens_(tokens) {}
  void setup(Rng& rng) override {
    const int64_t pool_n = kPages * 2 * heads_ * kPage * d_;
    pool_ = rng.randn_bf16(pool_n);
    k_ = rng.randn_bf16(tokens_ * heads_ * d_);
    v_ = rng.randn_bf16(tokens_ * heads_ * d_);
    std::vector<int64_t> all(kPages * kPage);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng.gen());
    slots_.assign(all.begin(), all.begin() + tokens_);
    if (tokens_ > 1) slots_[1] = -1;  // padding: skipped
    d_k_ = upload_bf16(k_);
    d_v_ = upload_bf16(v_);
    d_slots_ = upload(slots_);
    d_pool_ = alloc<__nv_bfloat16>(pool_n);
    output("pool", DType::kBF16, d_pool_, pool_n).exact().initially(pool_);
  }
  void reference() override {
    // Reference over the non-padding tokens.
    std::vector<float> pf = to_f32(pool_), kf = to_f32(k_), vf = to_f32(v_), kc, vc;
    std::vector<int64_t> sc;
    const int64_t row = heads_ * d_;
    for (int64_t t = 0; t < tokens_; ++t) {
      if (slots_[t] < 0) continue;
      sc.push_back(slots_[t]);
      kc.insert(kc.end(), kf.begin() + t * row, kf.begin() + (t + 1) * row);
      vc.insert(vc.end(), vf.begin() + t * row, vf.begin() + (t + 1) * row);
    }
    cpu::kv_write({kc.data(), vc.data(), pf.data(), sc.data(), static_cast<int64_t>(sc.size()),
                   heads_, d_, kPage});
    outputs()[0].ref = std::move(pf);
  }
  void launch(cudaStream_t s) override {
    kv_write_launch({d_k_, d_v_, d_pool_, d_slots_, tokens_, heads_, d_, kPage}, s);
  }
  double bytes() const override { return double(tokens_) * (heads_ * d_ * 2 * 2 * 2 + 8); }

 private:
  static constexpr int64_t kPages = 13, kPage = 16;
  int64_t heads_, d_, tokens_;
  Bits pool_, k_, v_;
  std::vector<int64_t> slots_;
  bfp d_k_ = nullptr, d_v_ = nullptr, d_pool_ = nullptr;
  int64_t* d_slots_ = nullptr;
};

// ------------------------------------------------------------------------------ attention

// Four sequences of 1, 17, 300 and 64 tokens in shuffled pages (3 unused); queries: a decode
// token per sequence plus prefill-like tokens of sequence 2 at positions 0, 5, 31, 32, 150,
// 299. kv_split 0 (none), 128 (3 splits for the longest sequence, empty ones for the short),
// 256; the workspace poisoned too.
class PagedAttentionCase : public OpCase {
 public:
  PagedAttentionCase(Heads h, int64_t kv_split) : h_(h), kv_split_(kv_split) {}
  void setup(Rng& rng) override {
    const int64_t d = h_.head_dim, num_seqs = static_cast<int64_t>(kSeqLens.size());
    int64_t num_pages = 0;
    for (int64_t l : kSeqLens) {
      max_pages_ = std::max(max_pages_, (l + kPage - 1) / kPage);
      num_pages += (l + kPage - 1) / kPage;
    }
    num_pages += 3;  // unused pages
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.gen());
    table_.assign(num_seqs * max_pages_, 0);
    size_t next = 0;
    for (int64_t sq = 0; sq < num_seqs; ++sq) {
      for (int64_t pg = 0; pg < (kSeqLens[sq] + kPage - 1) / kPage; ++pg) {
        table_[sq * max_pages_ + pg] = perm[next++];
      }
    }
    for (int64_t sq = 0; sq < num_seqs; ++sq) {
      token_seq_.push_back(static_cast<int32_t>(sq));
      positions_.push_back(static_cast<int32_t>(kSeqLens[sq] - 1));
    }
    for (int32_t p : {0, 5, 31, 32, 150, 299}) {
      token_seq_.push_back(2);
      positions_.push_back(p);
    }
    tokens_ = static_cast<int64_t>(token_seq_.size());
    pool_ = rng.randn_bf16(num_pages * 2 * h_.kv_heads * kPage * d);
    q_ = rng.randn_bf16(tokens_ * h_.q_heads * d);
    d_pool_ = upload_bf16(pool_);
    d_q_ = upload_bf16(q_);
    d_table_ = upload(table_);
    d_seq_ = upload(token_seq_);
    d_pos_ = upload(positions_);
    d_out_ = alloc<__nv_bfloat16>(tokens_ * h_.q_heads * d);
    const size_t ws =
        paged_attention_workspace_floats(tokens_, h_.q_heads, d, max_pages_, kPage, kv_split_);
    d_ws_ = alloc<float>(ws);
    output("out", DType::kBF16, d_out_, tokens_ * h_.q_heads * d);
    output("workspace", DType::kF32, d_ws_, ws).compare = Compare::kScratch;
  }
  void reference() override {
    std::vector<float> qf = to_f32(q_), pf = to_f32(pool_), ref(tokens_ * h_.q_heads * h_.head_dim);
    cpu::paged_attention({qf.data(), pf.data(), table_.data(), token_seq_.data(), positions_.data(),
                          ref.data(), tokens_, h_.q_heads, h_.kv_heads, h_.head_dim, kPage,
                          max_pages_, scale()});
    outputs()[0].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override {
    PagedAttentionParams p{d_q_,   d_pool_,    d_table_,   d_seq_,      d_pos_,
                           d_out_, tokens_,    h_.q_heads, h_.kv_heads, h_.head_dim,
                           kPage,  max_pages_, scale(),    kv_split_,   d_ws_};
    paged_attention_launch(p, s);
  }

 private:
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(h_.head_dim)); }
  static constexpr int64_t kPage = 16;
  static inline const std::vector<int64_t> kSeqLens = {1, 17, 300, 64};
  Heads h_;
  int64_t kv_split_, max_pages_ = 0, tokens_ = 0;
  std::vector<int32_t> table_, token_seq_, positions_;
  Bits pool_, q_;
  bfp d_pool_ = nullptr, d_q_ = nullptr, d_out_ = nullptr;
  int32_t *d_table_ = nullptr, *d_seq_ = nullptr, *d_pos_ = nullptr;
  float* d_ws_ = nullptr;
};

// ------------------------------------------------------------------------------ router

// Softmax over the experts, top-k ids (exact, ties to the lower id) and weights (fp32 1e-5),
// from bf16 or fp32 logits; `ties`: a few distinct values, so many exact ties.
class TopkSoftmaxCase : public OpCase {
 public:
  TopkSoftmaxCase(int64_t experts, int64_t top_k, int64_t tokens, bool renorm, DType dt, bool ties)
      : experts_(experts), top_k_(top_k), tokens_(tokens), renorm_(renorm), dt_(dt), ties_(ties) {}
  void setup(Rng& rng) override {
    const int64_t n = tokens_ * experts_;
    logits_ = rng.randn(n, 2.0f);
    if (ties_) {
      for (auto& l : logits_) l = static_cast<float>(rng.uniform(-2, 2)) * 0.5f;
    }
    if (dt_ == DType::kBF16) {
      logits_ = to_f32(to_bf16(logits_));
      d_logits_ = upload(to_bf16(logits_));
    } else {
      d_logits_ = upload(logits_);
    }
    d_ids_ = alloc<int32_t>(tokens_ * top_k_);
    d_w_ = alloc<float>(tokens_ * top_k_);
    output("topk_ids", DType::kI32, d_ids_, tokens_ * top_k_);
    output("topk_weights", DType::kF32, d_w_, tokens_ * top_k_);
  }
  void reference() override {
    std::vector<int32_t> ref_ids(tokens_ * top_k_);
    std::vector<float> ref_w(tokens_ * top_k_);
    cpu::topk_softmax(
        {logits_.data(), ref_ids.data(), ref_w.data(), tokens_, experts_, top_k_, renorm_});
    outputs()[0].ref_i32 = std::move(ref_ids);
    outputs()[1].ref = std::move(ref_w);
  }
  void launch(cudaStream_t s) override {
    topk_softmax_launch({d_logits_, d_ids_, d_w_, tokens_, experts_, top_k_, renorm_, dt_}, s);
  }

 private:
  int64_t experts_, top_k_, tokens_;
  bool renorm_;
  DType dt_;
  bool ties_;
  std::vector<float> logits_;
  void const* d_logits_ = nullptr;
  int32_t* d_ids_ = nullptr;
  float* d_w_ = nullptr;
};

// ------------------------------------------------------------------------------ silu * mul

class SiluMulCase : public OpCase {
 public:
  SiluMulCase(int64_t inter, int64_t rows) : inter_(inter), rows_(rows) {}
  void setup(Rng& rng) override {
    gu_ = rng.randn_bf16(rows_ * 2 * inter_, 2.0f);
    d_gu_ = upload_bf16(gu_);
    d_out_ = alloc<__nv_bfloat16>(rows_ * inter_);
    output("out", DType::kBF16, d_out_, rows_ * inter_);
  }
  void reference() override {
    std::vector<float> gf = to_f32(gu_), ref(rows_ * inter_);
    cpu::silu_mul({gf.data(), ref.data(), rows_, inter_});
    outputs()[0].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override { silu_mul_launch({d_gu_, d_out_, rows_, inter_}, s); }

 private:
  int64_t inter_, rows_;
  Bits gu_;
  bfp d_gu_ = nullptr, d_out_ = nullptr;
};

// ------------------------------------------------------------------------------ moe permute

enum class Routing { kRandom, kSkewed, kAllToOne };

struct PermuteShape {
  int64_t tokens, experts, top_k, expert_begin, local_experts, hidden;
  Routing routing;
};

std::string permute_str(PermuteShape const& c) {
  static char const* const kRouting[] = {"random", "skewed", "alltoone"};
  return "t" + to_string(c.tokens) + "_E" + to_string(c.experts) + "_k" + to_string(c.top_k) +
         "_local" + to_string(c.expert_begin) + "p" + to_string(c.local_experts) + "_h" +
         to_string(c.hidden) + "_" + kRouting[static_cast<int>(c.routing)];
}

// Permute (counts, offsets, slot_row, permuted_src and rows exact against a stable counting
// sort of the local token-slots by expert) then unpermute to fp32 (1e-5) and bf16 (1e-2) from
// a y whose rows past the routed ones hold NaN (a read of one shows); with no local slot the
// fp32 output must be exactly zero.
class MoePermuteCase : public OpCase {
 public:
  explicit MoePermuteCase(PermuteShape c) : c_(c) {}
  void setup(Rng& rng) override {
    const int64_t slots = c_.tokens * c_.top_k, E = c_.local_experts;
    ids_ = route(rng);
    x_ = rng.randn_bf16(c_.tokens * c_.hidden);
    // Host reference: stable counting sort of the local token-slots by expert.
    std::vector<std::vector<int32_t>> by_expert(E);
    ref_slot_row_.assign(slots, -1);
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t e = ids_[s] - c_.expert_begin;
      if (e >= 0 && e < E) by_expert[e].push_back(static_cast<int32_t>(s));
    }
    ref_counts_.assign(E, 0);
    ref_offsets_.assign(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) {
      ref_counts_[e] = static_cast<int32_t>(by_expert[e].size());
      ref_offsets_[e + 1] = ref_offsets_[e] + ref_counts_[e];
      for (int32_t s : by_expert[e]) {
        ref_slot_row_[s] = static_cast<int32_t>(ref_src_.size());
        ref_src_.push_back(s);
      }
    }
    total_ = ref_offsets_[E];
    weights_.resize(slots);
    for (auto& w : weights_) w = rng.uniform_real(0.05f, 1.0f);
    y_ = rng.randn_bf16(slots * c_.hidden);
    for (int64_t i = total_ * c_.hidden; i < slots * c_.hidden; ++i) y_[i] = 0xffff;

    d_x_ = upload_bf16(x_);
    d_ids_ = upload(ids_);
    d_y_ = upload_bf16(y_);
    d_w_ = upload(weights_);
    d_ws_ = alloc<int32_t>(moe_permute_workspace_elems(c_.tokens, c_.top_k, E));
    d_px_ = alloc<__nv_bfloat16>(slots * c_.hidden);
    d_counts_ = alloc<int32_t>(E);
    d_offsets_ = alloc<int32_t>(E + 1);
    d_src_ = alloc<int32_t>(slots);
    d_slot_row_ = alloc<int32_t>(slots);
    d_out_f_ = alloc<float>(c_.tokens * c_.hidden);
    d_out_bf_ = alloc<__nv_bfloat16>(c_.tokens * c_.hidden);
    output("permuted rows", DType::kBF16, d_px_, slots * c_.hidden).exact();
    output("counts", DType::kI32, d_counts_, E);
    output("offsets", DType::kI32, d_offsets_, E + 1);
    output("permuted_src", DType::kI32, d_src_, slots);
    output("slot_row", DType::kI32, d_slot_row_, slots);
    output("unpermute fp32", DType::kF32, d_out_f_, c_.tokens * c_.hidden);
    output("unpermute bf16", DType::kBF16, d_out_bf_, c_.tokens * c_.hidden);
  }
  void reference() override {
    const int64_t slots = c_.tokens * c_.top_k, H = c_.hidden;
    std::vector<Output>& o = outputs();
    // Rows past `total` of px and permuted_src are not checked.
    std::vector<float> ref_px(slots * H, 0.f);
    for (size_t r = 0; r < ref_src_.size(); ++r) {
      const int64_t t = ref_src_[r] / c_.top_k;
      for (int64_t h = 0; h < H; ++h) ref_px[r * H + h] = bf16_to_f32(x_[t * H + h]);
    }
    o[0].ref = std::move(ref_px);
    o[0].mask.assign(slots * H, Elem::kIgnore);
    std::fill(o[0].mask.begin(), o[0].mask.begin() + total_ * H, Elem::kCompare);
    o[1].ref_i32 = ref_counts_;
    o[2].ref_i32 = ref_offsets_;
    std::vector<int32_t> src(slots, 0);
    std::copy(ref_src_.begin(), ref_src_.end(), src.begin());
    o[3].ref_i32 = std::move(src);
    o[3].mask.assign(slots, Elem::kIgnore);
    std::fill(o[3].mask.begin(), o[3].mask.begin() + total_, Elem::kCompare);
    o[4].ref_i32 = ref_slot_row_;
    // Unpermute.
    std::vector<float> yf = to_f32(y_), ref_out(c_.tokens * H, 0.f);
    for (int64_t t = 0; t < c_.tokens; ++t) {
      std::vector<std::pair<int32_t, int64_t>> order;  // (expert, j), ascending expert
      for (int64_t j = 0; j < c_.top_k; ++j) {
        if (ref_slot_row_[t * c_.top_k + j] >= 0) order.push_back({ids_[t * c_.top_k + j], j});
      }
      std::sort(order.begin(), order.end());
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.f;
        for (auto [e, j] : order) {
          acc += weights_[t * c_.top_k + j] * yf[ref_slot_row_[t * c_.top_k + j] * H + h];
        }
        ref_out[t * H + h] = acc;
      }
    }
    if (total_ == 0) {
      o[5].exact();  // all zeros
      o[6].compare = Compare::kScratch;
    }
    o[5].ref = ref_out;
    o[6].ref = std::move(ref_out);
  }
  void launch(cudaStream_t s) override {
    MoePermuteParams p{d_x_,     d_ids_,          d_px_,           d_counts_, d_offsets_,
                       d_src_,   d_slot_row_,     d_ws_,           c_.tokens, c_.hidden,
                       c_.top_k, c_.expert_begin, c_.local_experts};
    moe_permute_launch(p, s);
    MoeUnpermuteParams u{d_y_,      d_ids_,    d_w_,     d_slot_row_, d_out_f_,
                         c_.tokens, c_.hidden, c_.top_k, DType::kF32};
    moe_unpermute_launch(u, s);
    u.out = d_out_bf_;
    u.out_dtype = DType::kBF16;
    moe_unpermute_launch(u, s);
  }

 private:
  // top_k distinct experts per token out of `experts`.
  std::vector<int32_t> route(Rng& rng) const {
    std::vector<int32_t> ids(c_.tokens * c_.top_k);
    std::vector<int32_t> all(c_.experts);
    std::iota(all.begin(), all.end(), 0);
    for (int64_t t = 0; t < c_.tokens; ++t) {
      switch (c_.routing) {
        case Routing::kRandom:
          std::shuffle(all.begin(), all.end(), rng.gen());
          std::copy(all.begin(), all.begin() + c_.top_k, ids.begin() + t * c_.top_k);
          break;
        case Routing::kSkewed: {  // every token to expert 5, the rest among experts 0..8
          std::vector<int32_t> few = {0, 1, 2, 3, 4, 6, 7, 8};
          std::shuffle(few.begin(), few.end(), rng.gen());
          ids[t * c_.top_k] = 5;
          for (int64_t j = 1; j < c_.top_k; ++j) ids[t * c_.top_k + j] = few[j - 1];
          break;
        }
        case Routing::kAllToOne:
          for (int64_t j = 0; j < c_.top_k; ++j) {
            ids[t * c_.top_k + j] = static_cast<int32_t>(3 + j);
          }
          break;
      }
    }
    return ids;
  }

  PermuteShape c_;
  std::vector<int32_t> ids_, ref_counts_, ref_offsets_, ref_src_, ref_slot_row_;
  std::vector<float> weights_;
  Bits x_, y_;
  int64_t total_ = 0;
  bfp d_x_ = nullptr, d_y_ = nullptr, d_px_ = nullptr, d_out_bf_ = nullptr;
  int32_t *d_ids_ = nullptr, *d_ws_ = nullptr, *d_counts_ = nullptr, *d_offsets_ = nullptr,
          *d_src_ = nullptr, *d_slot_row_ = nullptr;
  float *d_w_ = nullptr, *d_out_f_ = nullptr;
};

// ------------------------------------------------------------------------------ gemm

struct Mnk {
  int64_t m, n, k;
};

// GemmLt (cuBLASLt) bf16: y = x W^T; beta 1 accumulates onto a random y (in place).
class GemmCase : public OpCase {
 public:
  GemmCase(Mnk s, bool beta1) : s_(s), beta1_(beta1) {}
  void setup(Rng& rng) override {
    x_ = rng.randn_bf16(s_.m * s_.k);
    w_ = rng.randn_bf16(s_.n * s_.k);
    y0_ = rng.randn_bf16(s_.m * s_.n, 4.0f);
    d_x_ = upload_bf16(x_);
    d_w_ = upload_bf16(w_);
    d_y_ = alloc<__nv_bfloat16>(s_.m * s_.n);
    Output& o = output(beta1_ ? "y (beta 1)" : "y", DType::kBF16, d_y_, s_.m * s_.n);
    if (beta1_) o.initially(y0_);
  }
  void reference() override {
    std::vector<float> xf = to_f32(x_), wf = to_f32(w_), ref(s_.m * s_.n);
    cpu::gemm({xf.data(), wf.data(), ref.data(), s_.m, s_.n, s_.k});
    if (beta1_) {
      std::vector<float> y0f = to_f32(y0_);
      for (size_t i = 0; i < ref.size(); ++i) ref[i] += y0f[i];
    }
    outputs()[0].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override {
    GemmParams p{d_x_, d_w_, d_y_, s_.m, s_.n, s_.k};
    if (beta1_) p.beta = 1.0f;
    gemm_.run(p, s);
  }
  double bytes() const override {
    return double(s_.m * s_.k + s_.n * s_.k + s_.m * s_.n * (beta1_ ? 2 : 1)) * 2;
  }
  double flops() const override { return 2.0 * s_.m * s_.n * s_.k; }

 private:
  Mnk s_;
  bool beta1_;
  GemmLt gemm_;
  Bits x_, w_, y0_;
  bfp d_x_ = nullptr, d_w_ = nullptr, d_y_ = nullptr;
};

// ------------------------------------------------------------------------------ composition

// Router -> permute -> per-expert GEMMs -> SiLU-mul -> GEMMs -> unpermute, against cpu::moe
// with the CPU router (ids exact, out 2e-2: bf16 intermediates gate_up, act, y). The launch
// reads the expert offsets back to the host (one sync).
class MoeLayerCase : public OpCase {
 public:
  explicit MoeLayerCase(int64_t begin) : begin_(begin), local_(begin == 0 ? kExperts : 4) {}
  void setup(Rng& rng) override {
    x_ = rng.randn_bf16(kTokens * kHidden);
    logits_ = rng.randn_bf16(kTokens * kExperts, 2.0f);
    wgu_.resize(local_);
    wd_.resize(local_);
    for (int64_t e = 0; e < local_; ++e) {
      wgu_[e] = rng.randn_bf16(2 * kInter * kHidden, 0.125f);
      wd_[e] = rng.randn_bf16(kHidden * kInter, 0.18f);
      d_wgu_.push_back(upload_bf16(wgu_[e]));
      d_wd_.push_back(upload_bf16(wd_[e]));
    }
    const int64_t slots = kTokens * kTopK;
    d_x_ = upload_bf16(x_);
    d_logits_ = upload(logits_);
    d_tw_ = alloc<float>(slots);
    d_px_ = alloc<__nv_bfloat16>(slots * kHidden);
    d_gu_ = alloc<__nv_bfloat16>(slots * 2 * kInter);
    d_act_ = alloc<__nv_bfloat16>(slots * kInter);
    d_y_ = alloc<__nv_bfloat16>(slots * kHidden);
    d_counts_ = alloc<int32_t>(local_);
    d_offsets_ = alloc<int32_t>(local_ + 1);
    d_src_ = alloc<int32_t>(slots);
    d_slot_row_ = alloc<int32_t>(slots);
    d_ws_ = alloc<int32_t>(moe_permute_workspace_elems(kTokens, kTopK, local_));
    d_ids_ = alloc<int32_t>(slots);
    d_out_ = alloc<float>(kTokens * kHidden);
    output("topk_ids", DType::kI32, d_ids_, slots);
    output("out", DType::kF32, d_out_, kTokens * kHidden).tolerance(2e-2);
  }
  void reference() override {
    const int64_t slots = kTokens * kTopK;
    std::vector<float> xf = to_f32(x_), lf = to_f32(logits_), tw(slots), ref(kTokens * kHidden);
    std::vector<int32_t> ids(slots);
    cpu::topk_softmax({lf.data(), ids.data(), tw.data(), kTokens, kExperts, kTopK, true});
    std::vector<std::vector<float>> wguf(local_), wdf(local_);
    std::vector<float const*> pgu(local_), pd(local_);
    for (int64_t e = 0; e < local_; ++e) {
      wguf[e] = to_f32(wgu_[e]);
      wdf[e] = to_f32(wd_[e]);
      pgu[e] = wguf[e].data();
      pd[e] = wdf[e].data();
    }
    cpu::moe({xf.data(), ids.data(), tw.data(), pgu.data(), pd.data(), ref.data(), kTokens, kHidden,
              kInter, kTopK, begin_, local_});
    outputs()[0].ref_i32 = std::move(ids);
    outputs()[1].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override {
    topk_softmax_launch({d_logits_, d_ids_, d_tw_, kTokens, kExperts, kTopK, true, DType::kBF16},
                        s);
    moe_permute_launch({d_x_, d_ids_, d_px_, d_counts_, d_offsets_, d_src_, d_slot_row_, d_ws_,
                        kTokens, kHidden, kTopK, begin_, local_},
                       s);
    std::vector<int32_t> offsets(local_ + 1);
    TANDEM_CUDA_CHECK(
        cudaMemcpyAsync(offsets.data(), d_offsets_, offsets.size() * 4, cudaMemcpyDeviceToHost, s));
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    // Expert MLPs, one GEMM pair per expert.
    for (int64_t e = 0; e < local_; ++e) {
      const int64_t r0 = offsets[e], n = offsets[e + 1] - offsets[e];
      gemm_.run({d_px_ + r0 * kHidden, d_wgu_[e], d_gu_ + r0 * 2 * kInter, n, 2 * kInter, kHidden},
                s);
    }
    const int64_t total = offsets[local_];
    silu_mul_launch({d_gu_, d_act_, total, kInter}, s);
    for (int64_t e = 0; e < local_; ++e) {
      const int64_t r0 = offsets[e], n = offsets[e + 1] - offsets[e];
      gemm_.run({d_act_ + r0 * kInter, d_wd_[e], d_y_ + r0 * kHidden, n, kHidden, kInter}, s);
    }
    moe_unpermute_launch(
        {d_y_, d_ids_, d_tw_, d_slot_row_, d_out_, kTokens, kHidden, kTopK, DType::kF32}, s);
  }
  double flops() const override { return 2.0 * kTokens * kTopK * 3 * kInter * kHidden; }

 private:
  static constexpr int64_t kTokens = 37, kHidden = 64, kInter = 32, kExperts = 8, kTopK = 2;
  int64_t begin_, local_;
  GemmLt gemm_;
  Bits x_, logits_;
  std::vector<Bits> wgu_, wd_;
  std::vector<bfp> d_wgu_, d_wd_;
  bfp d_x_ = nullptr, d_px_ = nullptr, d_gu_ = nullptr, d_act_ = nullptr, d_y_ = nullptr;
  uint16_t* d_logits_ = nullptr;
  float *d_tw_ = nullptr, *d_out_ = nullptr;
  int32_t *d_counts_ = nullptr, *d_offsets_ = nullptr, *d_src_ = nullptr, *d_slot_row_ = nullptr,
          *d_ws_ = nullptr, *d_ids_ = nullptr;
};

template <typename C, typename... A>
auto make(A... a) {
  return [=] { return std::unique_ptr<OpCase>(new C(a...)); };
}

}  // namespace

void register_op_cases(std::vector<CaseInfo>& r) {
  for (int64_t hidden : {2048, 72, 37}) {
    for (int64_t tokens : {1, 7, 130}) {
      add_case(r, "Embedding", "hidden" + to_string(hidden) + "_tokens" + to_string(tokens),
               make<EmbeddingCase>(hidden, tokens));
    }
  }
  for (bool in_place : {false, true}) {
    for (int64_t dim : {2048, 4096, 40, 33}) {
      for (int64_t rows : {1, 3, 257}) {
        add_case(r, "RmsNorm",
                 "dim" + to_string(dim) + "_rows" + to_string(rows) + (in_place ? "_inplace" : ""),
                 make<RmsNormCase>(dim, rows, in_place));
      }
    }
  }
  for (int64_t dim : {2048, 4096, 40, 33}) {
    for (int64_t rows : {1, 3, 257}) {
      add_case(r, "AddRmsNorm", "dim" + to_string(dim) + "_rows" + to_string(rows),
               make<AddRmsNormCase>(dim, rows));
    }
  }
  for (Heads h : {Heads{32, 4, 128}, Heads{16, 2, 64}, Heads{4, 4, 128}, Heads{3, 1, 64}}) {
    for (int64_t tokens : {1, 5, 67}) {
      for (bool norm : {true, false}) {
        add_case(r, "QkNormRope",
                 heads_str(h) + "_tokens" + to_string(tokens) + (norm ? "_norm" : "_nonorm"),
                 make<QkNormRopeCase>(h, tokens, norm));
      }
    }
  }
  for (Heads h : {Heads{32, 4, 128}, Heads{64, 4, 128}, Heads{16, 2, 64}, Heads{2, 1, 128}}) {
    for (int64_t tokens : {1, 5, 300}) {
      add_case(r, "QkvPrep", heads_str(h) + "_tokens" + to_string(tokens),
               make<QkvPrepCase>(h, tokens));
    }
  }
  for (int64_t heads : {4, 1}) {
    for (int64_t d : {128, 64}) {
      for (int64_t tokens : {1, 37}) {
        add_case(r, "KvWrite",
                 "kvh" + to_string(heads) + "_d" + to_string(d) + "_tokens" + to_string(tokens),
                 make<KvWriteCase>(heads, d, tokens));
      }
    }
  }
  for (Heads h :
       {Heads{32, 4, 128}, Heads{8, 1, 64}, Heads{4, 4, 128}, Heads{16, 2, 128}, Heads{4, 2, 64}}) {
    for (int64_t kv_split : {0, 128, 256}) {
      add_case(r, "PagedAttention", heads_str(h) + "_split" + to_string(kv_split),
               make<PagedAttentionCase>(h, kv_split));
    }
  }
  // Narrow variant (<= 256 experts, top-8) and the wide one (Qwen3.5-397B's 512 / top-10, an odd
  // k, top-16, more than 256 experts at top-8, a top-k past 8 of few experts).
  struct Ek {
    int64_t experts, top_k;
  };
  for (Ek c : {Ek{128, 8}, Ek{256, 8}, Ek{60, 4}, Ek{8, 1}, Ek{33, 8}, Ek{8, 8}, Ek{512, 10},
               Ek{512, 16}, Ek{300, 7}, Ek{257, 8}, Ek{64, 11}, Ek{16, 16}}) {
    for (int64_t tokens : {1, 33, 300}) {
      for (bool renorm : {true, false}) {
        for (DType dt : {DType::kBF16, DType::kF32}) {
          for (bool ties : {false, true}) {
            add_case(r, "TopkSoftmax",
                     "E" + to_string(c.experts) + "_k" + to_string(c.top_k) + "_tokens" +
                         to_string(tokens) + (renorm ? "_renorm" : "") +
                         (dt == DType::kBF16 ? "_bf16" : "_f32") + (ties ? "_ties" : ""),
                     make<TopkSoftmaxCase>(c.experts, c.top_k, tokens, renorm, dt, ties));
          }
        }
      }
    }
  }
  for (int64_t inter : {768, 100, 33}) {
    for (int64_t rows : {1, 9, 300}) {
      add_case(r, "SiluMul", "inter" + to_string(inter) + "_rows" + to_string(rows),
               make<SiluMulCase>(inter, rows));
    }
  }
  const PermuteShape permute[] = {
      {1, 128, 8, 0, 128, 2048, Routing::kRandom},
      {13, 8, 2, 0, 8, 72, Routing::kRandom},
      {1000, 128, 8, 0, 128, 2048, Routing::kRandom},
      {3000, 256, 8, 0, 256, 64, Routing::kRandom},  // 24 blocks of token-slots
      {700, 128, 8, 32, 64, 37, Routing::kRandom},   // EP: a slice of experts, odd hidden
      {2000, 128, 8, 0, 128, 64, Routing::kSkewed},  // every token to expert 5; most empty
      {1500, 16, 1, 0, 16, 40, Routing::kAllToOne},  // all slots to one expert
      {37, 256, 8, 0, 256, 128, Routing::kRandom},   // many empty experts
      {5, 128, 8, 120, 8, 64, Routing::kAllToOne},   // no local slot at all
      // Past 256 local experts (the 512-wide kernels) and top-k past 8: Qwen3.5-397B's 512 /
      // top-10, odd k, top-16.
      {1, 512, 10, 0, 512, 4096, Routing::kRandom},
      {1000, 512, 10, 0, 512, 64, Routing::kRandom},  // 10 blocks of token-slots
      {3000, 512, 11, 0, 512, 40, Routing::kRandom},  // 33 blocks, odd hidden rows of 40
      {700, 512, 9, 100, 300, 37, Routing::kRandom},  // EP: 300 of 512 local, odd hidden
      {2000, 512, 9, 0, 512, 64, Routing::kSkewed},   // every token to expert 5; most empty
      {1500, 512, 13, 0, 512, 40, Routing::kAllToOne},
      {64, 512, 16, 0, 512, 128, Routing::kRandom},
      {5, 512, 16, 500, 12, 64, Routing::kAllToOne},  // no local slot at all
      {40, 128, 10, 0, 128, 64, Routing::kRandom},    // top-10 of 128: narrow permute
  };
  for (PermuteShape const& c : permute) {
    add_case(r, "MoePermute", permute_str(c), make<MoePermuteCase>(c));
  }
  for (Mnk s : {Mnk{1, 5120, 2048}, Mnk{37, 200, 72}, Mnk{300, 128, 2048}, Mnk{8, 96, 40},
                Mnk{257, 512, 1024}}) {
    for (bool beta1 : {false, true}) {
      add_case(r, "Gemm",
               "m" + to_string(s.m) + "_n" + to_string(s.n) + "_k" + to_string(s.k) +
                   (beta1 ? "_beta1" : ""),
               make<GemmCase>(s, beta1));
    }
  }
  for (int64_t begin : {0, 4}) {
    add_case(r, "MoeLayer", begin == 0 ? "experts0p8" : "experts4p4", make<MoeLayerCase>(begin));
  }
}

}  // namespace tandem::cuda::backend_ops
