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

// The dot kernels come in an AVX2 + FMA clone and a baseline one, picked by an ifunc resolver
// when the binary is loaded. Under ThreadSanitizer GCC instruments that resolver too, and it
// then runs before TSan's runtime is up (test_engine crashed in the dynamic loader): a TSan build
// keeps the baseline kernels only. So does clang (the ASan + UBSan and fuzzing build): clang 14
// compiles the "arch=x86-64-v3" clone of these loops into wrong sums (CpuOps.Gemm's error 0.67,
// every model test off), with or without sanitizers; the server is built with g++.
#if defined(__SANITIZE_THREAD__) || defined(__clang__)
#define TANDEM_DOT_CLONES
#else
#define TANDEM_DOT_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif

inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Four rows of a against one row of b: out4[i] = dot(a_i, b).
TANDEM_DOT_CLONES void dot4(const float* a0, const float* a1, const float* a2, const float* a3,
                            const float* b, int64_t k, float* out4) {
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
TANDEM_DOT_CLONES float dot1(const float* a, const float* b, int64_t k) {
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
  const int64_t rot = p.rotary_dim > 0 ? p.rotary_dim : p.head_dim;
  TANDEM_CHECK(rot % 2 == 0 && rot <= p.head_dim, "rotary_dim ", rot,
               " must be even and <= ", p.head_dim);
  const int64_t half = rot / 2;
  // inv_freq in fp32 as transformers computes it: 1 / theta^(2i/rot).
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    float expo = static_cast<float>(2 * i) / static_cast<float>(rot);
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

uint8_t kv_fp8_quantize(float x, float scale) {
  return f32_to_f8e4m3(bf16_to_f32(f32_to_bf16(x)) / scale);
}

void kv_fp8_quantize(const float* x, uint8_t* codes, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) codes[i] = kv_fp8_quantize(x[i], scale);
}

void kv_fp8_dequantize(const uint8_t* codes, float* out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = kv_fp8_dequantize(codes[i], scale);
}

void kv_write(const KvWriteParams& p) {
  const int64_t page_stride = 2 * p.num_kv_heads * p.page_size * p.head_dim;
  const int64_t kv_stride = p.num_kv_heads * p.page_size * p.head_dim;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (p.slot_index[t] < 0) continue;
    int64_t page = p.slot_index[t] / p.page_size;
    int64_t slot = p.slot_index[t] % p.page_size;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      float* dk = p.pool + page * page_stride + (h * p.page_size + slot) * p.head_dim;
      const float* k = p.k + (t * p.num_kv_heads + h) * p.head_dim;
      const float* v = p.v + (t * p.num_kv_heads + h) * p.head_dim;
      if (p.kv_fp8) {
        for (int64_t i = 0; i < p.head_dim; ++i) {
          dk[i] = kv_fp8_dequantize(kv_fp8_quantize(k[i], p.k_scale), p.k_scale);
          dk[kv_stride + i] = kv_fp8_dequantize(kv_fp8_quantize(v[i], p.v_scale), p.v_scale);
        }
        continue;
      }
      std::memcpy(dk, k, sizeof(float) * p.head_dim);
      std::memcpy(dk + kv_stride, v, sizeof(float) * p.head_dim);
    }
  }
}

void kv_write_fp8(const KvWriteParams& p, uint8_t* pool) {
  const int64_t page_stride = 2 * p.num_kv_heads * p.page_size * p.head_dim;
  const int64_t kv_stride = p.num_kv_heads * p.page_size * p.head_dim;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (p.slot_index[t] < 0) continue;
    const int64_t page = p.slot_index[t] / p.page_size, slot = p.slot_index[t] % p.page_size;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      uint8_t* dk = pool + page * page_stride + (h * p.page_size + slot) * p.head_dim;
      kv_fp8_quantize(p.k + (t * p.num_kv_heads + h) * p.head_dim, dk, p.head_dim, p.k_scale);
      kv_fp8_quantize(p.v + (t * p.num_kv_heads + h) * p.head_dim, dk + kv_stride, p.head_dim,
                      p.v_scale);
    }
  }
}

void kv_pool_dequantize_fp8(const uint8_t* pool, float* out, int64_t num_pages,
                            int64_t num_kv_heads, int64_t page_size, int64_t head_dim,
                            float k_scale, float v_scale) {
  const int64_t half = num_kv_heads * page_size * head_dim;  // k (or v) rows of one page
  for (int64_t pg = 0; pg < num_pages; ++pg) {
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t off = (pg * 2 + kv) * half;
      kv_fp8_dequantize(pool + off, out + off, half, kv == 0 ? k_scale : v_scale);
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

void causal_conv1d(const CausalConv1dParams& p) {
  const int64_t n = p.num_tokens, kw = p.kernel, hist = kw - 1;
  TANDEM_CHECK(kw >= 1, "causal_conv1d: kernel must be >= 1");
  pool().parallel_for(p.channels, 64, [&](int64_t c0, int64_t c1) {
    std::vector<float> xin(static_cast<size_t>(hist + n));  // (state, x) of one channel
    for (int64_t c = c0; c < c1; ++c) {
      float* st = p.state + c * hist;
      const float* w = p.weight + c * kw;
      for (int64_t j = 0; j < hist; ++j) xin[static_cast<size_t>(j)] = st[j];
      for (int64_t t = 0; t < n; ++t) xin[static_cast<size_t>(hist + t)] = p.x[t * p.channels + c];
      for (int64_t t = 0; t < n; ++t) {
        float acc = 0.f;
        for (int64_t j = 0; j < kw; ++j) acc += w[j] * xin[static_cast<size_t>(t + j)];
        p.out[t * p.channels + c] = p.silu ? silu(acc) : acc;
      }
      for (int64_t j = 0; j < hist; ++j) st[j] = xin[static_cast<size_t>(n + j)];
    }
  });
}

void deltanet_gates(const DeltaNetGatesParams& p) {
  const int64_t stride = p.stride > 0 ? p.stride : p.heads;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const float b = p.b[r * stride + h];
      const float x = p.a[r * stride + h] + p.dt_bias[h];
      const float sp = x > 20.0f ? x : std::log1p(std::exp(x));
      p.beta[r * p.heads + h] = 1.0f / (1.0f + std::exp(-b));
      p.g[r * p.heads + h] = -std::exp(p.a_log[h]) * sp;
    }
  }
}

void gated_delta_rule(const GatedDeltaRuleParams& p) {
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dk = p.k_dim, dv = p.v_dim;
  TANDEM_CHECK(hk > 0 && hv % hk == 0, "gated_delta_rule: ", hv, " value heads over ", hk,
               " key heads");
  const int64_t group = hv / hk;
  const int64_t qk_stride = p.stride > 0 ? p.stride : hk * dk;
  const int64_t v_stride = p.stride > 0 ? p.stride : hv * dv;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  // One work item per value head: its state is private to it.
  pool().parallel_for(hv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> q(static_cast<size_t>(dk)), k(static_cast<size_t>(dk)),
        delta(static_cast<size_t>(dv));
    for (int64_t h = h0; h < h1; ++h) {
      float* S = p.state + h * dk * dv;  // [dk, dv]
      const int64_t kh = h / group;
      for (int64_t t = 0; t < p.num_tokens; ++t) {
        const float* qt = p.q + t * qk_stride + kh * dk;
        const float* kt = p.k + t * qk_stride + kh * dk;
        const float* vt = p.v + t * v_stride + h * dv;
        float qinv = 1.0f, kinv = 1.0f;
        if (p.l2norm_qk) {
          float qs = 0.f, ks = 0.f;
          for (int64_t i = 0; i < dk; ++i) {
            qs += qt[i] * qt[i];
            ks += kt[i] * kt[i];
          }
          qinv = 1.0f / std::sqrt(qs + 1e-6f);
          kinv = 1.0f / std::sqrt(ks + 1e-6f);
        }
        for (int64_t i = 0; i < dk; ++i) {
          q[static_cast<size_t>(i)] = qt[i] * qinv * q_scale;
          k[static_cast<size_t>(i)] = kt[i] * kinv;
        }
        const float decay = std::exp(p.g[t * hv + h]);
        const float beta = p.beta[t * hv + h];
        // S = decay * S, and kv_mem = S^T k in the same pass.
        std::fill(delta.begin(), delta.end(), 0.f);
        for (int64_t i = 0; i < dk; ++i) {
          float* row = S + i * dv;
          const float ki = k[static_cast<size_t>(i)];
          for (int64_t j = 0; j < dv; ++j) {
            row[j] *= decay;
            delta[static_cast<size_t>(j)] += row[j] * ki;
          }
        }
        for (int64_t j = 0; j < dv; ++j) {
          delta[static_cast<size_t>(j)] = (vt[j] - delta[static_cast<size_t>(j)]) * beta;
        }
        float* o = p.out + (t * hv + h) * dv;
        std::fill(o, o + dv, 0.f);
        for (int64_t i = 0; i < dk; ++i) {
          float* row = S + i * dv;
          const float ki = k[static_cast<size_t>(i)], qi = q[static_cast<size_t>(i)];
          for (int64_t j = 0; j < dv; ++j) {
            row[j] += ki * delta[static_cast<size_t>(j)];
            o[j] += row[j] * qi;
          }
        }
      }
    }
  });
}

void gated_delta_rule_chunked(const GatedDeltaRuleParams& p, int64_t chunk) {
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dk = p.k_dim, dv = p.v_dim;
  TANDEM_CHECK(hk > 0 && hv % hk == 0 && chunk > 0, "gated_delta_rule_chunked: ", hv,
               " value heads over ", hk, " key heads, chunk ", chunk);
  const int64_t group = hv / hk;
  const int64_t qk_stride = p.stride > 0 ? p.stride : hk * dk;
  const int64_t v_stride = p.stride > 0 ? p.stride : hv * dv;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  pool().parallel_for(hv, 1, [&](int64_t h0, int64_t h1) {
    const size_t C = static_cast<size_t>(chunk);
    std::vector<float> q(C * dk), k(C * dk), v(C * dv), beta(C), G(C), A(C * C);
    std::vector<float> U(C * dv), W(C * dk), vn(C * dv), row(static_cast<size_t>(dv));
    for (int64_t h = h0; h < h1; ++h) {
      float* S = p.state + h * dk * dv;  // [dk, dv]
      const int64_t kh = h / group;
      for (int64_t c0 = 0; c0 < p.num_tokens; c0 += chunk) {
        const int64_t L = std::min(chunk, p.num_tokens - c0);
        // Normalised q, k; beta; cumulative log decay G within the chunk.
        float acc = 0.f;
        for (int64_t i = 0; i < L; ++i) {
          const int64_t t = c0 + i;
          const float* qt = p.q + t * qk_stride + kh * dk;
          const float* kt = p.k + t * qk_stride + kh * dk;
          float qinv = 1.0f, kinv = 1.0f;
          if (p.l2norm_qk) {
            float qs = 0.f, ks = 0.f;
            for (int64_t d = 0; d < dk; ++d) {
              qs += qt[d] * qt[d];
              ks += kt[d] * kt[d];
            }
            qinv = 1.0f / std::sqrt(qs + 1e-6f);
            kinv = 1.0f / std::sqrt(ks + 1e-6f);
          }
          for (int64_t d = 0; d < dk; ++d) {
            q[i * dk + d] = qt[d] * qinv * q_scale;
            k[i * dk + d] = kt[d] * kinv;
          }
          std::copy_n(p.v + t * v_stride + h * dv, dv, v.data() + i * dv);
          beta[i] = p.beta[t * hv + h];
          acc += p.g[t * hv + h];
          G[i] = acc;
        }
        // A (strictly lower) and the forward substitution for U and W.
        for (int64_t i = 0; i < L; ++i) {
          for (int64_t j = 0; j < i; ++j) {
            A[i * C + j] =
                beta[i] * dot1(k.data() + i * dk, k.data() + j * dk, dk) * std::exp(G[i] - G[j]);
          }
          const float eg = std::exp(G[i]);
          for (int64_t d = 0; d < dv; ++d) U[i * dv + d] = beta[i] * v[i * dv + d];
          for (int64_t d = 0; d < dk; ++d) W[i * dk + d] = beta[i] * k[i * dk + d] * eg;
          for (int64_t j = 0; j < i; ++j) {
            const float a = A[i * C + j];
            for (int64_t d = 0; d < dv; ++d) U[i * dv + d] -= a * U[j * dv + d];
            for (int64_t d = 0; d < dk; ++d) W[i * dk + d] -= a * W[j * dk + d];
          }
        }
        // V' = U - W S; out = exp(G) q S + causal (q k^T decay) V'.
        for (int64_t i = 0; i < L; ++i) {
          for (int64_t d = 0; d < dv; ++d) vn[i * dv + d] = U[i * dv + d];
          for (int64_t e = 0; e < dk; ++e) {
            const float w = W[i * dk + e];
            const float* Se = S + e * dv;
            for (int64_t d = 0; d < dv; ++d) vn[i * dv + d] -= w * Se[d];
          }
        }
        for (int64_t i = 0; i < L; ++i) {
          float* o = p.out + ((c0 + i) * hv + h) * dv;
          std::fill(row.begin(), row.end(), 0.f);
          const float eg = std::exp(G[i]);
          for (int64_t e = 0; e < dk; ++e) {
            const float qe = q[i * dk + e] * eg;
            const float* Se = S + e * dv;
            for (int64_t d = 0; d < dv; ++d) row[static_cast<size_t>(d)] += qe * Se[d];
          }
          for (int64_t j = 0; j <= i; ++j) {
            const float a = dot1(q.data() + i * dk, k.data() + j * dk, dk) * std::exp(G[i] - G[j]);
            for (int64_t d = 0; d < dv; ++d) row[static_cast<size_t>(d)] += a * vn[j * dv + d];
          }
          std::copy(row.begin(), row.end(), o);
        }
        // S = exp(G_last) S + (k exp(G_last - G))^T V'.
        const float glast = G[L - 1], decay = std::exp(glast);
        for (int64_t e = 0; e < dk; ++e) {
          float* Se = S + e * dv;
          for (int64_t d = 0; d < dv; ++d) Se[d] *= decay;
          for (int64_t j = 0; j < L; ++j) {
            const float kj = k[j * dk + e] * std::exp(glast - G[j]);
            for (int64_t d = 0; d < dv; ++d) Se[d] += kj * vn[j * dv + d];
          }
        }
      }
    }
  });
}

void gated_rms_norm(const GatedRmsNormParams& p) {
  pool().parallel_for(p.rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* o = p.out + r * p.dim;
      const float* z = p.gate + r * p.dim;
      rms_norm_row(p.x + r * p.dim, p.weight, o, p.dim, p.eps);
      for (int64_t i = 0; i < p.dim; ++i) o[i] *= silu(z[i]);
    }
  });
}

void sigmoid_gate(const SigmoidGateParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x + r * p.dim;
    const float* g = p.gate + r * p.gate_stride;
    float* o = p.out + r * p.dim;
    for (int64_t i = 0; i < p.dim; ++i) {
      const float s = 1.0f / (1.0f + std::exp(-(p.per_row ? g[0] : g[i])));
      o[i] = p.accumulate ? o[i] + x[i] * s : x[i] * s;
    }
  }
}

}  // namespace tandem::cpu
