#include "backend/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace tandem::cpu {

namespace {

ThreadPool& pool() { return ThreadPool::global(); }

using v8f = float __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Four rows of a against one row of b: out4[i] = dot(a_i, b).
__attribute__((target_clones("arch=x86-64-v3", "default"))) void dot4(
    const float* a0, const float* a1, const float* a2, const float* a3, const float* b, int64_t k,
    float* out4) {
  v8f c0 = {}, c1 = {}, c2 = {}, c3 = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    v8f vb = load8(b + i);
    c0 += load8(a0 + i) * vb;
    c1 += load8(a1 + i) * vb;
    c2 += load8(a2 + i) * vb;
    c3 += load8(a3 + i) * vb;
  }
  float s0 = hsum(c0), s1 = hsum(c1), s2 = hsum(c2), s3 = hsum(c3);
  for (; i < k; ++i) {
    s0 += a0[i] * b[i];
    s1 += a1[i] * b[i];
    s2 += a2[i] * b[i];
    s3 += a3[i] * b[i];
  }
  out4[0] = s0;
  out4[1] = s1;
  out4[2] = s2;
  out4[3] = s3;
}

// One row against one row, with exactly dot4's per-row arithmetic, so that a row's result
// does not depend on how many rows are batched with it (batch invariance).
__attribute__((target_clones("arch=x86-64-v3", "default"))) float dot1(const float* a,
                                                                       const float* b, int64_t k) {
  v8f c0 = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) c0 += load8(a + i) * load8(b + i);
  float s = hsum(c0);
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

void gemm(const GemmParams& p) {
  if (p.m == 0 || p.n == 0) return;
  // Parallel over output columns (rows of b): each b row is read once per 4 rows of a.
  int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(p.k, 1));
  pool().parallel_for(p.n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < p.m; m += 4) {
      int64_t rows = std::min<int64_t>(4, p.m - m);
      const float* a[4];
      for (int64_t r = 0; r < 4; ++r) a[r] = p.a + (m + std::min(r, rows - 1)) * p.k;
      for (int64_t n = n0; n < n1; ++n) {
        const float* b = p.b + n * p.k;
        float r4[4];
        if (rows == 1) {
          r4[0] = dot1(a[0], b, p.k);
        } else {
          dot4(a[0], a[1], a[2], a[3], b, p.k, r4);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* o = p.out + (m + r) * p.n + n;
          *o = p.accumulate ? *o + r4[r] : r4[r];
        }
      }
    }
  });
}

void embedding(const EmbeddingParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    int32_t id = p.ids[t];
    TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < p.vocab, "token id ", id,
                      " out of range [0, ", p.vocab, ")");
    std::memcpy(p.out + t * p.hidden, p.table + id * p.hidden, sizeof(float) * p.hidden);
  }
}

namespace {
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t dim, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = w[i] * (x[i] * inv);
}
}  // namespace

void rms_norm(const RmsNormParams& p) {
  pool().parallel_for(p.rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rms_norm_row(p.x + r * p.dim, p.weight, p.out + r * p.dim, p.dim, p.eps);
    }
  });
}

void add_rms_norm(const AddRmsNormParams& p) {
  pool().parallel_for(p.rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* res = p.residual + r * p.dim;
      const float* x = p.x + r * p.dim;
      for (int64_t i = 0; i < p.dim; ++i) res[i] += x[i];
      rms_norm_row(res, p.weight, p.out + r * p.dim, p.dim, p.eps);
    }
  });
}

void qk_norm_rope(const QkNormRopeParams& p) {
  const int64_t half = p.head_dim / 2;
  // inv_freq in fp32 as transformers computes it: 1 / theta^(2i/d).
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    float expo = static_cast<float>(2 * i) / static_cast<float>(p.head_dim);
    inv_freq[static_cast<size_t>(i)] =
        1.0f / static_cast<float>(std::pow(static_cast<float>(p.rope_theta), expo));
  }
  pool().parallel_for(p.num_tokens, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
    for (int64_t t = t0; t < t1; ++t) {
      float pos = static_cast<float>(p.positions[t]);
      for (int64_t i = 0; i < half; ++i) {
        float f = pos * inv_freq[static_cast<size_t>(i)];
        cs[static_cast<size_t>(i)] = static_cast<float>(std::cos(static_cast<double>(f)));
        sn[static_cast<size_t>(i)] = static_cast<float>(std::sin(static_cast<double>(f)));
      }
      auto apply = [&](float* h, const float* w) {
        if (w) rms_norm_row(h, w, h, p.head_dim, p.eps);
        for (int64_t i = 0; i < half; ++i) {
          float x1 = h[i], x2 = h[i + half];
          float c = cs[static_cast<size_t>(i)], s = sn[static_cast<size_t>(i)];
          h[i] = x1 * c - x2 * s;
          h[i + half] = x2 * c + x1 * s;
        }
      };
      for (int64_t h = 0; h < p.num_q_heads; ++h) {
        apply(p.q + (t * p.num_q_heads + h) * p.head_dim, p.q_weight);
      }
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        apply(p.k + (t * p.num_kv_heads + h) * p.head_dim, p.k_weight);
      }
    }
  });
}

void kv_write(const KvWriteParams& p) {
  const int64_t page_stride = 2 * p.num_kv_heads * p.page_size * p.head_dim;
  const int64_t kv_stride = p.num_kv_heads * p.page_size * p.head_dim;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    int64_t page = p.slot_index[t] / p.page_size;
    int64_t slot = p.slot_index[t] % p.page_size;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      float* dk = p.pool + page * page_stride + (h * p.page_size + slot) * p.head_dim;
      std::memcpy(dk, p.k + (t * p.num_kv_heads + h) * p.head_dim, sizeof(float) * p.head_dim);
      std::memcpy(dk + kv_stride, p.v + (t * p.num_kv_heads + h) * p.head_dim,
                  sizeof(float) * p.head_dim);
    }
  }
}

void paged_attention(const PagedAttentionParams& p) {
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t page_stride = 2 * p.num_kv_heads * p.page_size * p.head_dim;
  const int64_t kv_stride = p.num_kv_heads * p.page_size * p.head_dim;
  // One work item per (token, q head).
  pool().parallel_for(p.num_tokens * p.num_q_heads, 2, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    for (int64_t w = w0; w < w1; ++w) {
      int64_t t = w / p.num_q_heads, h = w % p.num_q_heads, kvh = h / group;
      const float* q = p.q + (t * p.num_q_heads + h) * p.head_dim;
      const int32_t* table = p.block_table + p.token_seq[t] * p.max_pages_per_seq;
      int64_t len = p.positions[t] + 1;
      scores.resize(static_cast<size_t>(len));
      float mx = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const float* k = p.pool + table[j / p.page_size] * page_stride +
                         (kvh * p.page_size + j % p.page_size) * p.head_dim;
        float s = dot1(q, k, p.head_dim) * p.scale;
        scores[static_cast<size_t>(j)] = s;
        mx = std::max(mx, s);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < len; ++j) {
        float e = std::exp(scores[static_cast<size_t>(j)] - mx);
        scores[static_cast<size_t>(j)] = e;
        sum += e;
      }
      float* o = p.out + (t * p.num_q_heads + h) * p.head_dim;
      std::fill(o, o + p.head_dim, 0.f);
      float inv = 1.0f / sum;
      for (int64_t j = 0; j < len; ++j) {
        const float* v = p.pool + table[j / p.page_size] * page_stride + kv_stride +
                         (kvh * p.page_size + j % p.page_size) * p.head_dim;
        float pj = scores[static_cast<size_t>(j)] * inv;
        for (int64_t d = 0; d < p.head_dim; ++d) o[d] += pj * v[d];
      }
    }
  });
}

void topk_softmax(const TopkSoftmaxParams& p) {
  std::vector<float> prob(static_cast<size_t>(p.num_experts));
  std::vector<int32_t> idx(static_cast<size_t>(p.num_experts));
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float* l = p.logits + t * p.num_experts;
    float mx = *std::max_element(l, l + p.num_experts);
    float sum = 0.f;
    for (int64_t e = 0; e < p.num_experts; ++e) {
      prob[static_cast<size_t>(e)] = std::exp(l[e] - mx);
      sum += prob[static_cast<size_t>(e)];
    }
    for (auto& v : prob) v /= sum;
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + p.top_k, idx.end(), [&](int32_t a, int32_t b) {
      float pa = prob[static_cast<size_t>(a)], pb = prob[static_cast<size_t>(b)];
      return pa > pb || (pa == pb && a < b);
    });
    float ksum = 0.f;
    for (int64_t j = 0; j < p.top_k; ++j)
      ksum += prob[static_cast<size_t>(idx[static_cast<size_t>(j)])];
    for (int64_t j = 0; j < p.top_k; ++j) {
      int32_t e = idx[static_cast<size_t>(j)];
      p.topk_ids[t * p.top_k + j] = e;
      float w = prob[static_cast<size_t>(e)];
      p.topk_weights[t * p.top_k + j] = p.renormalize ? w / ksum : w;
    }
  }
}

void silu_mul(const SiluMulParams& p) {
  pool().parallel_for(p.rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = p.gate_up + r * 2 * p.inter;
      const float* u = g + p.inter;
      float* o = p.out + r * p.inter;
      for (int64_t i = 0; i < p.inter; ++i) o[i] = silu(g[i]) * u[i];
    }
  });
}

void moe(const MoeParams& p) {
  std::fill(p.out, p.out + p.num_tokens * p.hidden, 0.f);
  // Dispatch: group (token, weight) pairs by local expert, in token order.
  std::vector<std::vector<std::pair<int64_t, float>>> routed(
      static_cast<size_t>(p.num_local_experts));
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t j = 0; j < p.top_k; ++j) {
      int64_t e = p.topk_ids[t * p.top_k + j] - p.expert_begin;
      if (e < 0 || e >= p.num_local_experts) continue;
      routed[static_cast<size_t>(e)].push_back({t, p.topk_weights[t * p.top_k + j]});
    }
  }
  std::vector<float> xs, gu, act, y;
  for (int64_t e = 0; e < p.num_local_experts; ++e) {
    const auto& rt = routed[static_cast<size_t>(e)];
    const int64_t n = static_cast<int64_t>(rt.size());
    if (n == 0) continue;
    xs.resize(static_cast<size_t>(n * p.hidden));
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(xs.data() + i * p.hidden, p.x + rt[static_cast<size_t>(i)].first * p.hidden,
                  sizeof(float) * p.hidden);
    }
    gu.resize(static_cast<size_t>(n * 2 * p.inter));
    act.resize(static_cast<size_t>(n * p.inter));
    y.resize(static_cast<size_t>(n * p.hidden));
    gemm({xs.data(), p.w_gate_up[e], gu.data(), n, 2 * p.inter, p.hidden});
    silu_mul({gu.data(), act.data(), n, p.inter});
    gemm({act.data(), p.w_down[e], y.data(), n, p.hidden, p.inter});
    // Combine: weighted accumulation in token order.
    for (int64_t i = 0; i < n; ++i) {
      auto [t, w] = rt[static_cast<size_t>(i)];
      float* o = p.out + t * p.hidden;
      const float* yi = y.data() + i * p.hidden;
      for (int64_t d = 0; d < p.hidden; ++d) o[d] += w * yi[d];
    }
  }
}

}  // namespace tandem::cpu
