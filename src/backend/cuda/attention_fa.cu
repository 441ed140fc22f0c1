// Tensor-core paged attention (FlashAttention-2 style prefill, split-KV decode). See
// attention_fa.h. mma.sync m16n8k16 bf16 -> fp32, ldmatrix from XOR-swizzled shared tiles,
// K/V tiles gathered from HND pages by cp.async, double-buffered. The decode kernel also reads
// FP8 (E4M3) pages: half the bytes by cp.async, widened to fp16 tiles in shared memory (exact)
// and multiplied in fp16 (mma f16 -> fp32).
#include <climits>
#include <cmath>
#include <type_traits>

#include "backend/cuda/attention_fa.h"
#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/decode_switches.h"
#include "backend/cuda/kv_fp8.cuh"

namespace tandem::cuda::detail {

namespace {

constexpr int kTileKeys = 64;  // keys per shared K/V tile (prefill; decode at head_dim <= 128)

// ---------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ uint32_t smem_u32(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// NOTE: src_bytes 0 zero-fills the 16 bytes without reading src: keys past the end of a
// sequence become zeros, so masked probabilities (0) never meet a NaN from stale memory.
__device__ __forceinline__ void cp_async_16(uint32_t dst, void const* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b: a 16x16 row-major, b 16x8 (k x n) column-major, c 16x8 fp32.
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t const (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same with fp16 a and b (the FP8 decode kernel's tiles).
__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t const (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The lower column goes to the low half, as the mma fragments expect.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element type T (bf16 or fp16) of the tiles warp_attend multiplies.
template <class T>
__device__ __forceinline__ void mma_t(float (&c)[4], uint32_t const (&a)[4], uint32_t b0,
                                      uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    mma_f16(c, a, b0, b1);
  } else {
    mma_bf16(c, a, b0, b1);
  }
}
template <class T>
__device__ __forceinline__ uint32_t pack_t(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    return pack_f16(lo, hi);
  } else {
    return pack_bf16(lo, hi);
  }
}

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows, kD] bf16 tile. The XOR
// spreads the 8 rows one ldmatrix reads at the same logical chunk over 8 distinct bank groups.
template <int kD>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * kD + ((chunk ^ (row & 7)) << 3);
}

// ---------------------------------------------------------------- warp tile
// Online-softmax state of a warp's 16 query rows: this thread holds rows lane / 4 (h = 0) and
// lane / 4 + 8 (h = 1); o[n][2h + e] is dim 8n + 2 (lane % 4) + e. m is in raw score units;
// l is this thread's partial row sum (the 4 threads of a quad share m; sum l at the end).
template <int kD>
struct RowState {
  float o[kD / 8][4];
  float m[2], l[2];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
    }
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }
};

// Attends the warp's 16 rows (rows q_row0.. of sQ) to kKeys keys (rows key_row0.. of sK/sV,
// all [*, kD] swizzled tiles of T: bf16, or fp16 for FP8 pages). valid(h, key) says whether
// this thread's row h may see tile key `key` (relative to key_row0); it is only called when
// kMask.
template <int kD, int kKeys, bool kMask, class T, class Valid>
__device__ __forceinline__ void warp_attend(RowState<kD>& st, T const* sQ, int q_row0, T const* sK,
                                            T const* sV, int key_row0, float scale_log2,
                                            Valid const& valid) {
  static_assert(kKeys % 16 == 0 && kD % 16 == 0, "mma tiles");
  const int lane = threadIdx.x & 31;

  // S = Q K^T (16 x kKeys).
  float s[kKeys / 8][4];
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
  }
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t a[4];
    ldmatrix_x4(a, smem_u32(sQ + swz<kD>(q_row0 + (lane & 15), 2 * kk + (lane >> 4))));
#pragma unroll
    for (int nn = 0; nn < kKeys / 16; ++nn) {
      uint32_t b[4];
      const int key = key_row0 + nn * 16 + (lane & 7) + ((lane >> 4) << 3);
      ldmatrix_x4(b, smem_u32(sK + swz<kD>(key, 2 * kk + ((lane >> 3) & 1))));
      mma_t<T>(s[2 * nn], a, b[0], b[1]);
      mma_t<T>(s[2 * nn + 1], a, b[2], b[3]);
    }
  }

  if constexpr (kMask) {
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!valid(e >> 1, 8 * j + 2 * (lane & 3) + (e & 1))) s[j][e] = -INFINITY;
      }
    }
  }

  // Online softmax; a row that has seen no valid key keeps m = -inf and uses 0 as its base, so
  // its probabilities and correction are exp2(-inf) = 0, never NaN.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(st.m[h], mx);
    const float base = m_new == -INFINITY ? 0.f : m_new * scale_log2;
    const float corr = exp2f(st.m[h] * scale_log2 - base);
    st.m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        s[j][e] = exp2f(fmaf(s[j][e], scale_log2, -base));
        sum += s[j][e];
      }
    }
    st.l[h] = st.l[h] * corr + sum;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      st.o[n][2 * h] *= corr;
      st.o[n][2 * h + 1] *= corr;
    }
  }

  // O += P V: the S accumulators of key tiles 2kk, 2kk + 1 are the A fragment of k-step kk.
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    uint32_t a[4];
    a[0] = pack_t<T>(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack_t<T>(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack_t<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack_t<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    const int key = key_row0 + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
    for (int dn = 0; dn < kD / 16; ++dn) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, smem_u32(sV + swz<kD>(key, 2 * dn + (lane >> 4))));
      mma_t<T>(st.o[2 * dn], a, b[0], b[1]);
      mma_t<T>(st.o[2 * dn + 1], a, b[2], b[3]);
    }
  }
}

// Gathers keys [k0, k0 + kKeys) of one sequence and kv head into swizzled sK / sV; keys at
// or past kv_len are zero-filled (their block-table entries may be garbage).
template <int kD, int kThreads, int kKeys = kTileKeys>
__device__ __forceinline__ void load_kv_tile(bf16* sK, bf16* sV, PagedAttentionParams const& p,
                                             int32_t const* table, int64_t kvh, int64_t k0,
                                             int64_t kv_len, int page_shift) {
  constexpr int kChunks = kD / 8;
  constexpr int kTotal = kKeys * kChunks;
  static_assert(kTotal % kThreads == 0, "whole chunks per thread");
  // NOTE: 16 chunks a thread (the head_dim-256 decode block) unrolled 4 at a time: fully, their
  // addresses spill registers beside the 128 of the fp32 output.
  constexpr int kUnroll = kTotal / kThreads > 8 ? 4 : kTotal / kThreads;
  const int64_t page_mask = p.page_size - 1;
  const int64_t head_stride = p.page_size * kD;            // one (page, k|v, head)
  const int64_t kv_stride = p.num_kv_heads * head_stride;  // k -> v of a page
#pragma unroll kUnroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int key = idx / kChunks, c = idx % kChunks;
    const int64_t j = k0 + key;
    const bool valid = j < kv_len;
    bf16 const* gK = p.pool;
    if (valid) {
      const int64_t page = table[j >> page_shift];
      gK = p.pool + page * 2 * kv_stride + kvh * head_stride + (j & page_mask) * kD + c * 8;
    }
    cp_async_16(smem_u32(sK + swz<kD>(key, c)), gK, valid);
    cp_async_16(smem_u32(sV + swz<kD>(key, c)), valid ? gK + kv_stride : p.pool, valid);
  }
}

// The same over an FP8 pool, into plain (unswizzled) [kKeys, kD] byte tiles s8K / s8V:
// 16 codes per cp.async. Thread `threadIdx.x` copies chunks idx = i * kThreads + threadIdx.x
// (key idx / (kD / 16), codes 16 * (idx % (kD / 16)) ..), the chunks widen_kv_tile_fp8 reads
// back in the same thread, so that a thread's cp.async.wait_group is all the widening waits
// for. Consecutive threads take consecutive 16-byte chunks: coalesced gathers, and the
// shared-memory writes of 8 threads cover 128 contiguous bytes (no bank conflict).
template <int kD, int kThreads, int kKeys>
__device__ __forceinline__ void load_kv_tile_fp8(uint8_t* s8K, uint8_t* s8V,
                                                 PagedAttentionParams const& p,
                                                 int32_t const* table, int64_t kvh, int64_t k0,
                                                 int64_t kv_len, int page_shift) {
  constexpr int kChunks = kD / 16;
  constexpr int kTotal = kKeys * kChunks;
  static_assert(kTotal % kThreads == 0, "whole chunks per thread");
  constexpr int kUnroll = kTotal / kThreads > 4 ? 4 : kTotal / kThreads;  // as load_kv_tile
  uint8_t const* pool = reinterpret_cast<uint8_t const*>(p.pool);
  const int64_t page_mask = p.page_size - 1;
  const int64_t head_stride = p.page_size * kD;            // bytes of one (page, k|v, head)
  const int64_t kv_stride = p.num_kv_heads * head_stride;  // k -> v of a page
#pragma unroll kUnroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int key = idx / kChunks, c = idx % kChunks;
    const int64_t j = k0 + key;
    const bool valid = j < kv_len;
    uint8_t const* gK = pool;
    if (valid) {
      const int64_t page = table[j >> page_shift];
      gK = pool + page * 2 * kv_stride + kvh * head_stride + (j & page_mask) * kD + c * 16;
    }
    cp_async_16(smem_u32(s8K + key * kD + c * 16), gK, valid);
    cp_async_16(smem_u32(s8V + key * kD + c * 16), valid ? gK + kv_stride : pool, valid);
  }
}

// Widens this thread's chunks of s8K / s8V (load_kv_tile_fp8's, after its wait_group) into the
// swizzled fp16 tiles sK / sV: code c -> its exact value (kv_fp8_value's; zero-filled keys ->
// 0). Chunk c of a key row becomes the 8-element chunks 2c and 2c + 1; the thread stores first
// the one with index 2c + ((c >> 2) & 1), so that each of the two 16-byte stores of 8
// consecutive threads (one row, chunks c .. c + 7; at head_dim 64 two rows) lands on 8
// distinct bank groups after the swizzle.
template <int kD, int kThreads, int kKeys>
__device__ __forceinline__ void widen_kv_tile_fp8(__half* sK, __half* sV, uint8_t const* s8K,
                                                  uint8_t const* s8V) {
  constexpr int kChunks = kD / 16;
  constexpr int kTotal = kKeys * kChunks;
#pragma unroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int key = idx / kChunks, c = idx % kChunks;
    const int first = 2 * c + ((c >> 2) & 1);  // its partner is first ^ 1
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      uint8_t const* src = (kv == 0 ? s8K : s8V) + key * kD + c * 16;
      __half* dst = kv == 0 ? sK : sV;
      const uint4 raw = *reinterpret_cast<uint4 const*>(src);
      const uint2 h0 = kv_fp8x4_to_half(raw.x), h1 = kv_fp8x4_to_half(raw.y),
                  h2 = kv_fp8x4_to_half(raw.z), h3 = kv_fp8x4_to_half(raw.w);
      const uint4 lo = make_uint4(h0.x, h0.y, h1.x, h1.y);  // chunk 2c
      const uint4 hi = make_uint4(h2.x, h2.y, h3.x, h3.y);  // chunk 2c + 1
      const bool swap = (first & 1) != 0;
      *reinterpret_cast<uint4*>(dst + swz<kD>(key, first)) = swap ? hi : lo;
      *reinterpret_cast<uint4*>(dst + swz<kD>(key, first ^ 1)) = swap ? lo : hi;
    }
  }
}

// ---------------------------------------------------------------- prefill
// Default shape: 8 warps (128 rows), no register cap (about 180 registers at head_dim 128, so
// one block per multiprocessor). The bench also times (8 warps, 2 blocks/SM) and (4, 2).
constexpr int kPrefillWarps = 8, kPrefillMinBlocks = 1;

template <int kD, int kWarps = kPrefillWarps>
constexpr size_t prefill_smem_bytes() {
  return (static_cast<size_t>(kWarps) * 16 + 4 * kTileKeys) * kD * sizeof(bf16);
}

// Block: kWarps * 16 rows (token t0 + r / kGroup, q head kvh * kGroup + r % kGroup), warp w
// rows 16w..16w+15: kWarps * 16 / kGroup tokens per block (8 warps, group 16: 8 tokens, a
// warp per token).
// Tiles are taken last-first so that the longest causal rows start first.
template <int kD, int kGroup, int kWarps, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    prefill_kernel(PagedAttentionParams p, int64_t num_tokens, int page_shift) {
  constexpr int kPrefillRows = kWarps * 16;
  constexpr int kThreads = kWarps * 32, kTokens = kPrefillRows / kGroup;
  constexpr int kChunks = kD / 8;
  static_assert(kPrefillRows % kGroup == 0, "whole tokens per tile");
  extern __shared__ uint4 smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [kPrefillRows, kD]
  bf16* sK = sQ + kPrefillRows * kD;             // [2][kTileKeys, kD]
  bf16* sV = sK + 2 * kTileKeys * kD;            // [2][kTileKeys, kD]
  __shared__ int s_seq[kTokens], s_pos[kTokens];

  const int64_t tile = static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x;
  const int64_t kvh = blockIdx.y;
  const int64_t t0 = tile * kTokens;
  const int n_tok = static_cast<int>(min(static_cast<int64_t>(kTokens), num_tokens - t0));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  for (int i = threadIdx.x; i < kTokens; i += kThreads) {
    s_seq[i] = i < n_tok ? p.token_seq[t0 + i] : -1;
    s_pos[i] = i < n_tok ? p.positions[t0 + i] : -1;
  }
  // Q rows of the group's heads (contiguous per token); rows past the batch are zeros.
  for (int idx = threadIdx.x; idx < kPrefillRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks, tt = r / kGroup;
    const bool valid = tt < n_tok;
    bf16 const* gQ =
        valid ? p.q + ((t0 + tt) * p.num_q_heads + kvh * kGroup + r % kGroup) * kD + c * 8 : p.q;
    cp_async_16(smem_u32(sQ + swz<kD>(r, c)), gQ, valid);
  }
  cp_async_commit();
  __syncthreads();  // s_seq, s_pos

  const float scale_log2 = p.scale * 1.4426950408889634f;
  const int q_row0 = warp * 16;
  int row_tok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) row_tok[h] = (q_row0 + (lane >> 2) + 8 * h) / kGroup;

  RowState<kD> st;
  st.init();

  // NOTE: sequences are contiguous in the batch, so a tile is a few runs ("segments") of one
  // sequence each; every row sees keys only in its own segment's pass.
  int seg_begin = 0;
  while (seg_begin < n_tok) {
    const int seq = s_seq[seg_begin];
    int seg_end = seg_begin + 1;
    while (seg_end < n_tok && s_seq[seg_end] == seq) ++seg_end;
    int min_pos = INT_MAX, max_pos = -1;
    for (int i = seg_begin; i < seg_end; ++i) {
      min_pos = min(min_pos, s_pos[i]);
      max_pos = max(max_pos, s_pos[i]);
    }
    const bool whole = seg_begin == 0 && seg_end == kTokens;  // every row in this segment
    int row_pos[2];  // last key the row may see; -1 outside the segment
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_pos[h] = row_tok[h] >= seg_begin && row_tok[h] < seg_end ? s_pos[row_tok[h]] : -1;
    }
    const int64_t kv_len = static_cast<int64_t>(max_pos) + 1;
    const int n_tiles = static_cast<int>((kv_len + kTileKeys - 1) / kTileKeys);
    int32_t const* table = p.block_table + static_cast<int64_t>(seq) * p.max_pages_per_seq;

    load_kv_tile<kD, kThreads>(sK, sV, p, table, kvh, 0, kv_len, page_shift);
    cp_async_commit();
    for (int it = 0; it < n_tiles; ++it) {
      const int stage = it & 1;
      if (it + 1 < n_tiles) {
        load_kv_tile<kD, kThreads>(sK + (stage ^ 1) * kTileKeys * kD,
                                   sV + (stage ^ 1) * kTileKeys * kD, p, table, kvh,
                                   static_cast<int64_t>(it + 1) * kTileKeys, kv_len, page_shift);
      }
      cp_async_commit();  // possibly empty: keeps the group count uniform
      cp_async_wait<1>();
      __syncthreads();
      const int k0 = it * kTileKeys;
      bf16 const* cK = sK + stage * kTileKeys * kD;
      bf16 const* cV = sV + stage * kTileKeys * kD;
      if (whole && k0 + kTileKeys - 1 <= min_pos) {
        warp_attend<kD, kTileKeys, false>(st, sQ, q_row0, cK, cV, 0, scale_log2,
                                          [](int, int) { return true; });
      } else {
        warp_attend<kD, kTileKeys, true>(st, sQ, q_row0, cK, cV, 0, scale_log2,
                                         [&](int h, int key) { return k0 + key <= row_pos[h]; });
      }
      __syncthreads();  // the stage is overwritten by the next iteration's load
    }
    seg_begin = seg_end;
  }

  // Normalise and store this thread's two rows.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = st.l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = q_row0 + (lane >> 2) + 8 * h;
    const int tt = r / kGroup;
    if (tt >= n_tok) continue;
    const float inv = 1.f / l;
    bf16* gO =
        p.out + ((t0 + tt) * p.num_q_heads + kvh * kGroup + r % kGroup) * kD + 2 * (lane & 3);
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      *reinterpret_cast<__nv_bfloat162*>(gO + 8 * n) =
          __floats2bfloat162_rn(st.o[n][2 * h] * inv, st.o[n][2 * h + 1] * inv);
    }
  }
}

// ---------------------------------------------------------------- decode
constexpr int kDecodeKeysPerWarp = 16;  // one mma k-step of P V

// Warps of a decode block, each with its 16 keys of every tile: 4 (64-key tiles) at head_dim 64
// and 128, 2 (32-key tiles) at 256, so that three blocks fit a multiprocessor there too.
template <int kD>
__host__ __device__ constexpr int decode_warps() {
  return kD == 256 ? 2 : 4;
}

// Shared memory of a decode block (kKeys = 16 * decode_warps keys a tile). bf16 pages: Q (16
// rows) + 2 stages of K and V tiles. FP8 pages: Q (16 rows, fp16) + one stage of fp16 K and V
// tiles + 2 stages of the K and V codes: the same bytes, (16 + 4 * kKeys) * kD * 2: 34 KiB at
// head_dim 64, 68 KiB at 128, 72 KiB at 256; three blocks per H100 / H200 multiprocessor (228
// KiB, 1 KiB of it reserved per block) in each case, and above the 48 KiB default, set with
// cudaFuncAttributeMaxDynamicSharedMemorySize (227 KiB per block at most). At 256 the
// registers (255, the fp32 output alone takes 128) allow 4 blocks of 2 warps. The end-of-block
// merge reuses the space after Q.
template <int kD, bool kFp8 = false>
__host__ __device__ constexpr size_t decode_smem_bytes() {
  constexpr size_t kKeys = 16 * decode_warps<kD>();
  if constexpr (kFp8) {
    return (16 + 2 * kKeys) * kD * sizeof(__half) + 4 * kKeys * kD;
  } else {
    return (16 + 4 * kKeys) * kD * sizeof(bf16);
  }
}
static_assert(decode_smem_bytes<256, true>() == decode_smem_bytes<256>() &&
                  3 * (decode_smem_bytes<256>() + 1024) <= 228 * 1024 &&
                  3 * (decode_smem_bytes<128>() + 1024) <= 228 * 1024,
              "three decode blocks per multiprocessor");

// Block: (token t, kv head) x split. The 16 mma rows are the group's q heads (rows >= kGroup
// are zero queries, never stored; group 16 fills them all); warp w takes keys 16w..16w+15 of every
// 64-key tile (32 at head_dim 256: 2 warps) with its own softmax state, and the warps merge
// through shared memory at the end.
// kFp8: the pool holds E4M3 codes. Their tiles arrive by cp.async (half the bytes of bf16),
// each thread widens the chunks it copied into one stage of fp16 tiles (exact), and the mmas
// run in fp16: q enters as fp16(q * scale) (saturated to +-65504), k_scale scales the scores
// (the softmax's base-2 factor), v_scale the output (so the splits' partials are in output
// units, as the simple kernel's).
template <int kD, int kGroup, bool kFp8>
__global__ void __launch_bounds__(decode_warps<kD>() * 32)
    decode_kernel(PagedAttentionParams p, int64_t token_begin, int page_shift, bool trigger) {
  pdl_wait();  // launched with launch_pdl: the previous kernel's q / KV writes first
  if (trigger) pdl_trigger();
  constexpr int kWarps = decode_warps<kD>(), kKeys = kWarps * kDecodeKeysPerWarp;
  constexpr int kThreads = kWarps * 32, kChunks = kD / 8;
  static_assert(kGroup <= 16, "one mma row tile");
  using T = std::conditional_t<kFp8, __half, bf16>;  // the mma tiles' element type
  extern __shared__ uint4 smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);    // [16, kD]
  T* sK = sQ + 16 * kD;                      // [2][kKeys, kD] (fp8: [kKeys, kD])
  T* sV = sK + (kFp8 ? 1 : 2) * kKeys * kD;  // the same
  // fp8: the codes, [2][kKeys, kD] bytes each for K and V.
  uint8_t* s8K = reinterpret_cast<uint8_t*>(sV + kKeys * kD);
  uint8_t* s8V = s8K + 2 * kKeys * kD;

  const int64_t t = token_begin + blockIdx.x / p.num_kv_heads;
  const int64_t kvh = blockIdx.x % p.num_kv_heads;
  const int64_t split = blockIdx.y, num_splits = gridDim.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  const int64_t len = static_cast<int64_t>(p.positions[t]) + 1;
  const int64_t begin = p.kv_split > 0 ? split * p.kv_split : 0;
  const int64_t end = p.kv_split > 0 ? min(len, begin + p.kv_split) : len;
  const int64_t q_head0 = t * p.num_q_heads + kvh * kGroup;  // row of the group's first head

  if (begin >= end) {
    // Past this replay's length (CUDA graphs size the grid for the capacity): an empty
    // partial, which the merge skips.
    for (int i = threadIdx.x; i < kGroup * (kD + 2); i += kThreads) {
      const int g = i / (kD + 2), d = i % (kD + 2);
      p.workspace[((q_head0 + g) * num_splits + split) * (kD + 2) + d] = d == kD ? -INFINITY : 0.f;
    }
    return;
  }

  if constexpr (kFp8) {
    // fp16(q * scale), visible to the other warps after the first tile's __syncthreads.
    for (int idx = threadIdx.x; idx < 16 * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      float v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 0.f;
      if (r < kGroup) load_bf16<8>(p.q + (q_head0 + r) * kD + c * 8, v);
      auto sat = [](float x) { return isnan(x) ? x : fminf(fmaxf(x, -65504.f), 65504.f); };
      uint32_t h[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        h[e] = pack_f16(sat(v[2 * e] * p.scale), sat(v[2 * e + 1] * p.scale));
      }
      *reinterpret_cast<uint4*>(sQ + swz<kD>(r, c)) = make_uint4(h[0], h[1], h[2], h[3]);
    }
  } else {
    for (int idx = threadIdx.x; idx < 16 * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool valid = r < kGroup;
      cp_async_16(smem_u32(sQ + swz<kD>(r, c)), valid ? p.q + (q_head0 + r) * kD + c * 8 : p.q,
                  valid);
    }
    cp_async_commit();
  }

  int32_t const* table = p.block_table + static_cast<int64_t>(p.token_seq[t]) * p.max_pages_per_seq;
  // Raw scores (mma units) -> natural-log units: scale (bf16; fp8 q already carries it, the
  // codes need k_scale).
  const float score_scale = kFp8 ? p.k_scale : p.scale;
  const float scale_log2 = score_scale * 1.4426950408889634f;
  const int n_tiles = static_cast<int>((end - begin + kKeys - 1) / kKeys);
  RowState<kD> st;
  st.init();

  auto load_tile = [&](int stage, int64_t k0) {
    if constexpr (kFp8) {
      load_kv_tile_fp8<kD, kThreads, kKeys>(s8K + stage * kKeys * kD, s8V + stage * kKeys * kD, p,
                                            table, kvh, k0, end, page_shift);
    } else {
      load_kv_tile<kD, kThreads, kKeys>(sK + stage * kKeys * kD, sV + stage * kKeys * kD, p, table,
                                        kvh, k0, end, page_shift);
    }
  };
  load_tile(0, begin);
  cp_async_commit();
  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1;
    if (it + 1 < n_tiles) load_tile(stage ^ 1, begin + static_cast<int64_t>(it + 1) * kKeys);
    cp_async_commit();
    cp_async_wait<1>();
    if constexpr (kFp8) {
      // This thread's own chunks of the stage: complete after its wait_group. The fp16 tiles'
      // previous readers finished before the previous iteration's last __syncthreads.
      widen_kv_tile_fp8<kD, kThreads, kKeys>(sK, sV, s8K + stage * kKeys * kD,
                                             s8V + stage * kKeys * kD);
    }
    __syncthreads();
    const int64_t k0 = begin + static_cast<int64_t>(it) * kKeys + warp * kDecodeKeysPerWarp;
    T const* cK = kFp8 ? sK : sK + stage * kKeys * kD;
    T const* cV = kFp8 ? sV : sV + stage * kKeys * kD;
    if (k0 + kDecodeKeysPerWarp <= end) {
      warp_attend<kD, kDecodeKeysPerWarp, false>(st, sQ, 0, cK, cV, warp * kDecodeKeysPerWarp,
                                                 scale_log2, [](int, int) { return true; });
    } else {
      warp_attend<kD, kDecodeKeysPerWarp, true>(st, sQ, 0, cK, cV, warp * kDecodeKeysPerWarp,
                                                scale_log2,
                                                [&](int, int key) { return k0 + key < end; });
    }
    __syncthreads();
  }

  // Merge the warps: states to shared memory (over the K/V tiles, free after the last
  // __syncthreads above), then a thread per (head, dim).
  float* sO = reinterpret_cast<float*>(sK);  // [kWarps][kGroup][kD]
  float* sM = sO + kWarps * kGroup * kD;     // [kWarps][kGroup]
  float* sL = sM + kWarps * kGroup;          // [kWarps][kGroup]
  static_assert((kWarps * kGroup * (kD + 2)) * sizeof(float) <=
                    decode_smem_bytes<kD, kFp8>() - 16 * kD * sizeof(T),
                "merge fits in the K/V tiles");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = st.l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int g = (lane >> 2) + 8 * h;
    if (g >= kGroup) continue;
    if ((lane & 3) == 0) {
      sM[warp * kGroup + g] = st.m[h];
      sL[warp * kGroup + g] = l;
    }
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      float* row = sO + (warp * kGroup + g) * kD + 8 * n + 2 * (lane & 3);
      row[0] = st.o[n][2 * h];
      row[1] = st.o[n][2 * h + 1];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kGroup * kD; i += kThreads) {
    const int g = i / kD, d = i % kD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sM[w * kGroup + g]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = sM[w * kGroup + g];
      const float f = mw == -INFINITY ? 0.f : exp2f((mw - mx) * scale_log2);
      num += f * sO[(w * kGroup + g) * kD + d];
      den += f * sL[w * kGroup + g];
    }
    if constexpr (kFp8) num *= p.v_scale;
    if (p.kv_split > 0) {
      // Same partial layout as the simple kernel: acc, max (scaled scores), sum.
      float* gW = p.workspace + ((q_head0 + g) * num_splits + split) * (kD + 2);
      gW[d] = num;
      if (d == 0) {
        gW[kD] = mx * score_scale;
        gW[kD + 1] = den;
      }
    } else {
      p.out[(q_head0 + g) * kD + d] = __float2bfloat16_rn(num / den);
    }
  }
}

// One block of kD threads per (token, q head) of tokens [token_begin, num_tokens).
template <int kD>
__global__ void __launch_bounds__(kD)
    merge_kernel(PagedAttentionParams p, int64_t token_begin, int num_splits, bool trigger) {
  pdl_wait();
  if (trigger) pdl_trigger();  // the o_proj gemv may stream its weights meanwhile
  const int64_t tq = token_begin * p.num_q_heads + blockIdx.x;  // t * num_q_heads + h
  const int d = threadIdx.x;
  float const* gW = p.workspace + tq * num_splits * (kD + 2);
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, gW[s * (kD + 2) + kD]);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    float const* gS = gW + s * (kD + 2);
    const float ms = gS[kD];
    if (ms == -INFINITY) continue;  // empty split
    const float f = expf(ms - mx);
    num += f * gS[d];
    den += f * gS[kD + 1];
  }
  p.out[tq * kD + d] = __float2bfloat16_rn(num / den);
}

int log2_exact(int64_t v) {
  int s = 0;
  while ((int64_t{1} << s) < v) ++s;
  TANDEM_CHECK((int64_t{1} << s) == v, "paged_attention: page_size ", v, " is not a power of two");
  return s;
}

template <class Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  // NOTE: cudaFuncSetAttribute is not a stream operation, so it is legal during capture.
  TANDEM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes)));
}

template <int kD, int kGroup, int kWarps = kPrefillWarps, int kMinBlocks = kPrefillMinBlocks>
void prefill_typed(PagedAttentionParams const& p, int64_t num_tokens, int page_shift,
                   cudaStream_t stream) {
  constexpr int64_t kTokens = kWarps * 16 / kGroup;
  const int64_t tiles = (num_tokens + kTokens - 1) / kTokens;
  TANDEM_CHECK(tiles <= INT32_MAX && p.num_kv_heads <= 65535, "paged_attention: too large");
  constexpr size_t smem = prefill_smem_bytes<kD, kWarps>();
  auto kernel = prefill_kernel<kD, kGroup, kWarps, kMinBlocks>;
  set_smem(kernel, smem);
  kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.num_kv_heads)), kWarps * 32,
           smem, stream>>>(p, num_tokens, page_shift);
  TANDEM_CUDA_CHECK_LAUNCH();
}

template <int kD, int kGroup, bool kFp8>
void decode_typed(PagedAttentionParams const& p, int64_t token_begin, int num_splits,
                  int page_shift, cudaStream_t stream) {
  const int64_t blocks = (p.num_tokens - token_begin) * p.num_kv_heads;
  TANDEM_CHECK(blocks <= INT32_MAX && num_splits <= 65535, "paged_attention: too large");
  constexpr size_t smem = decode_smem_bytes<kD, kFp8>();
  auto kernel = decode_kernel<kD, kGroup, kFp8>;
  set_smem(kernel, smem);
  // Programmatic dependent launches: the small decode kernels' launch overlaps the previous
  // kernel's tail (both wait for it before reading).
  TANDEM_CUDA_CHECK(
      launch_pdl(kernel, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(num_splits)),
                 decode_warps<kD>() * 32, smem, stream, p, token_begin, page_shift,
                 decode_switches().pdl_trigger));
  if (p.kv_split > 0) {
    TANDEM_CUDA_CHECK(launch_pdl(
        merge_kernel<kD>, static_cast<unsigned>((p.num_tokens - token_begin) * p.num_q_heads), kD,
        0, stream, p, token_begin, num_splits, decode_switches().pdl_trigger));
  }
}

// Turns (head_dim, group) into template arguments.
template <template <int, int> class F, class... Args>
void dispatch(int64_t head_dim, int64_t group, Args&&... args) {
  auto by_group = [&]<int kD>() {
    switch (group) {
      case 1: F<kD, 1>::run(args...); break;
      case 2: F<kD, 2>::run(args...); break;
      case 4: F<kD, 4>::run(args...); break;
      case 8: F<kD, 8>::run(args...); break;
      case 16: F<kD, 16>::run(args...); break;
      default: TANDEM_THROW(kUnsupported, "paged_attention: unsupported GQA group size ", group);
    }
  };
  switch (head_dim) {
    case 64: by_group.template operator()<64>(); break;
    case 128: by_group.template operator()<128>(); break;
    default: TANDEM_THROW(kUnsupported, "paged_attention: unsupported head_dim ", head_dim);
  }
}

template <int kD, int kGroup>
struct PrefillRun {
  static void run(PagedAttentionParams const& p, int64_t num_tokens, int page_shift,
                  cudaStream_t stream) {
    prefill_typed<kD, kGroup>(p, num_tokens, page_shift, stream);
  }
};
// The decode kernel's variants: (head_dim 64, 128, 256) x (group 1, 2, 4, 8, 16) x (bf16,
// FP8 pages): 30 kernels (+ the split merge at each head_dim).
template <int kD, bool kFp8>
void decode_by_group(PagedAttentionParams const& p, int64_t token_begin, int num_splits,
                     int page_shift, cudaStream_t stream) {
  switch (p.num_q_heads / p.num_kv_heads) {
    case 1: decode_typed<kD, 1, kFp8>(p, token_begin, num_splits, page_shift, stream); break;
    case 2: decode_typed<kD, 2, kFp8>(p, token_begin, num_splits, page_shift, stream); break;
    case 4: decode_typed<kD, 4, kFp8>(p, token_begin, num_splits, page_shift, stream); break;
    case 8: decode_typed<kD, 8, kFp8>(p, token_begin, num_splits, page_shift, stream); break;
    case 16: decode_typed<kD, 16, kFp8>(p, token_begin, num_splits, page_shift, stream); break;
    default:
      TANDEM_THROW(kUnsupported, "paged_attention: unsupported GQA group size ",
                   p.num_q_heads / p.num_kv_heads);
  }
}
template <bool kFp8>
void decode_by_dim(PagedAttentionParams const& p, int64_t token_begin, int num_splits,
                   int page_shift, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: decode_by_group<64, kFp8>(p, token_begin, num_splits, page_shift, stream); break;
    case 128: decode_by_group<128, kFp8>(p, token_begin, num_splits, page_shift, stream); break;
    case 256: decode_by_group<256, kFp8>(p, token_begin, num_splits, page_shift, stream); break;
    default: TANDEM_THROW(kUnsupported, "paged_attention: unsupported head_dim ", p.head_dim);
  }
}

}  // namespace

void paged_attention_prefill(PagedAttentionParams const& p, int64_t num_tokens,
                             cudaStream_t stream) {
  if (num_tokens <= 0) return;
  TANDEM_CHECK(aligned_to(16, p.q, p.pool) && aligned_to(4, p.out),
               "paged_attention: q and pool must be 16-byte aligned, out 4-byte");
  const int page_shift = log2_exact(p.page_size);
  dispatch<PrefillRun>(p.head_dim, p.num_q_heads / p.num_kv_heads, p, num_tokens, page_shift,
                       stream);
}

void paged_attention_decode(PagedAttentionParams const& p, int64_t token_begin, int num_splits,
                            cudaStream_t stream) {
  if (token_begin >= p.num_tokens) return;
  TANDEM_CHECK(aligned_to(16, p.q, p.pool) && aligned_to(4, p.out),
               "paged_attention: q and pool must be 16-byte aligned, out 4-byte");
  const int page_shift = log2_exact(p.page_size);
  if (p.kv_fp8) {
    decode_by_dim<true>(p, token_begin, num_splits, page_shift, stream);
  } else {
    decode_by_dim<false>(p, token_begin, num_splits, page_shift, stream);
  }
}

void paged_attention_prefill_variant(PagedAttentionParams const& p, int variant,
                                     cudaStream_t stream) {
  TANDEM_CHECK(p.head_dim == 128 && p.num_q_heads == 8 * p.num_kv_heads,
               "paged_attention_prefill_variant: head_dim 128, group 8 only");
  TANDEM_CHECK(aligned_to(16, p.q, p.pool) && aligned_to(4, p.out),
               "paged_attention: q and pool must be 16-byte aligned, out 4-byte");
  if (p.num_tokens <= 0) return;
  const int page_shift = log2_exact(p.page_size);
  switch (variant) {
    case 0: prefill_typed<128, 8>(p, p.num_tokens, page_shift, stream); break;
    case 1: prefill_typed<128, 8, 8, 2>(p, p.num_tokens, page_shift, stream); break;
    case 2: prefill_typed<128, 8, 4, 2>(p, p.num_tokens, page_shift, stream); break;
    default: TANDEM_THROW(kUnsupported, "paged_attention_prefill_variant: unknown ", variant);
  }
}

size_t paged_attention_prefill_smem(int64_t head_dim) {
  return head_dim == 64 ? prefill_smem_bytes<64>() : prefill_smem_bytes<128>();
}
size_t paged_attention_decode_smem(int64_t head_dim, bool kv_fp8) {
  if (kv_fp8) {
    return head_dim == 64    ? decode_smem_bytes<64, true>()
           : head_dim == 128 ? decode_smem_bytes<128, true>()
                             : decode_smem_bytes<256, true>();
  }
  return head_dim == 64    ? decode_smem_bytes<64>()
         : head_dim == 128 ? decode_smem_bytes<128>()
                           : decode_smem_bytes<256>();
}

}  // namespace tandem::cuda::detail
