// PrefillAttentionPlan: host planning, the K/V gather kernel, and the calls into FlashInfer's
// sm90 kernels (backend/cuda/flashinfer/, built with TANDEM_HAS_FLASHINFER). See
// attention_sm90.h.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cuda/attention_sm90.h"
#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/kv_fp8.cuh"
#ifndef TANDEM_HAS_FLASHINFER
#define TANDEM_HAS_FLASHINFER 0
#endif
#if TANDEM_HAS_FLASHINFER
#include "backend/cuda/flashinfer/sm90.h"
#endif

namespace tandem::cuda {

namespace {

#if TANDEM_HAS_FLASHINFER

// One page of one prefill sequence to gather: its block-table row and page index, where its
// keys go in the contiguous workspace, and how many of the page's slots are keys.
struct GatherEntry {
  int32_t row, page, dst, count;
};

// Block (entry, kv head, k|v): copies `count` rows of head_dim bf16 of one page's head slice
// (contiguous in the HND page) to rows [dst, dst + count) of that head's keys in
// ws[k|v, kv_head, key, :] (also contiguous).
template <int kHeadDim>
__global__ void gather_kv_kernel(bf16 const* __restrict__ pool, int32_t const* __restrict__ table,
                                 GatherEntry const* __restrict__ entries, bf16* __restrict__ ws,
                                 int64_t num_kv_heads, int64_t page_size, int64_t max_pages,
                                 int64_t nnz_kv) {
  const GatherEntry e = entries[blockIdx.x];
  const int64_t head = blockIdx.y, kv = blockIdx.z;
  const int64_t page = table[static_cast<int64_t>(e.row) * max_pages + e.page];
  uint4 const* src = reinterpret_cast<uint4 const*>(pool + ((page * 2 + kv) * num_kv_heads + head) *
                                                               page_size * kHeadDim);
  uint4* dst =
      reinterpret_cast<uint4*>(ws + ((kv * num_kv_heads + head) * nnz_kv + e.dst) * kHeadDim);
  const int64_t vecs = static_cast<int64_t>(e.count) * kHeadDim / 8;
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) dst[i] = src[i];
}

// The same from an FP8 pool (E4M3 codes): 8 codes a thread, times the k or v scale, to bf16.
template <int kHeadDim>
__global__ void gather_kv_fp8_kernel(uint8_t const* __restrict__ pool,
                                     int32_t const* __restrict__ table,
                                     GatherEntry const* __restrict__ entries, bf16* __restrict__ ws,
                                     int64_t num_kv_heads, int64_t page_size, int64_t max_pages,
                                     int64_t nnz_kv, float k_scale, float v_scale) {
  const GatherEntry e = entries[blockIdx.x];
  const int64_t head = blockIdx.y, kv = blockIdx.z;
  const float scale = kv == 0 ? k_scale : v_scale;
  const int64_t page = table[static_cast<int64_t>(e.row) * max_pages + e.page];
  uint8_t const* src = pool + ((page * 2 + kv) * num_kv_heads + head) * page_size * kHeadDim;
  bf16* dst = ws + ((kv * num_kv_heads + head) * nnz_kv + e.dst) * kHeadDim;
  const int64_t vecs = static_cast<int64_t>(e.count) * kHeadDim / 8;
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
    float v[8];
    detail::load_kv_fp8<8>(src + i * 8, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] *= scale;
    detail::store_bf16<8>(dst + i * 8, v);
  }
}
#endif

// Device memory that grows (never shrinks); growing waits for `stream` first, since work
// queued there may still read the old buffer.
struct Grow {
  void* ptr = nullptr;
  size_t bytes = 0;
  bool pinned = false;
  [[maybe_unused]] void reserve(size_t need, cudaStream_t stream) {
    if (need <= bytes) return;
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
    release();
    need = std::max(need, bytes * 3 / 2);
    if (pinned) {
      TANDEM_CUDA_CHECK(cudaMallocHost(&ptr, need));
    } else {
      TANDEM_CUDA_CHECK(cudaMalloc(&ptr, need));
    }
    bytes = need;
  }
  void release() {
    if (ptr != nullptr) (void)(pinned ? cudaFreeHost(ptr) : cudaFree(ptr));
    ptr = nullptr;
    bytes = 0;
  }
};

}  // namespace

struct PrefillAttentionPlan::Impl {
  Grow int_ws, int_pinned{nullptr, 0, true};       // FlashInfer's work lists
  Grow entries, entries_pinned{nullptr, 0, true};  // GatherEntry list
  Grow gather;                                     // [2, kv_heads, nnz_kv, head_dim] bf16
  cudaEvent_t copied = nullptr;                    // the last plan's host-to-device copies are done
  bool copy_pending = false;
#if TANDEM_HAS_FLASHINFER
  flashinfer_sm90::Plan fplan;
#endif
  int64_t num_prefill = 0, q_heads = 0, kv_heads = 0, head_dim = 0, page_size = 0, max_pages = 0;
  int64_t nnz_kv = 0, num_entries = 0;
  bool kv_fp8 = false;

  ~Impl() {
    if (copied != nullptr) {
      (void)cudaEventSynchronize(copied);
      (void)cudaEventDestroy(copied);
    }
    for (Grow* g : {&int_ws, &int_pinned, &entries, &entries_pinned, &gather}) g->release();
  }
};

PrefillAttentionPlan::PrefillAttentionPlan(PrefillKvPath path, int64_t max_gather_keys)
    : impl_(new Impl), path_(path), max_gather_keys_(max_gather_keys) {}

PrefillAttentionPlan::~PrefillAttentionPlan() { delete impl_; }

bool PrefillAttentionPlan::built() { return TANDEM_HAS_FLASHINFER != 0; }

bool PrefillAttentionPlan::device_supported() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}

bool PrefillAttentionPlan::plan(PrefillPlanArgs const& a, cudaStream_t stream) {
  ready_ = false;
  auto no = [&](std::string why) {
    why_ = std::move(why);
    return false;
  };
  if (!built()) return no("built without FlashInfer (TANDEM_FLASHINFER)");
  if (a.num_prefill_tokens <= 0) return no("no prefill tokens");
  if (a.head_dim != 128 && a.head_dim != 256) {
    return no("head_dim " + std::to_string(a.head_dim) + " (128 or 256 only)");
  }
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0) return no("heads");
  if (!device_supported()) return no("not a compute capability 9.0 device");
  TANDEM_CHECK(a.token_seq != nullptr && a.positions != nullptr && a.page_size > 0 &&
                   a.max_pages_per_seq > 0,
               "PrefillAttentionPlan: bad args");
#if TANDEM_HAS_FLASHINFER
  Impl& m = *impl_;
  // Runs of one sequence's tokens, each with consecutive positions ending at its last key.
  std::vector<int32_t> qo_indptr{0}, kv_indptr, kv_len, rows;
  int64_t works = 0, keys = 0;
  for (int64_t t = 0; t < a.num_prefill_tokens;) {
    int64_t e = t + 1;
    while (e < a.num_prefill_tokens && a.token_seq[e] == a.token_seq[t] &&
           a.positions[e] == a.positions[e - 1] + 1) {
      ++e;
    }
    if (e < a.num_prefill_tokens && a.token_seq[e] == a.token_seq[t]) {
      return no("positions of a sequence's chunk are not consecutive");
    }
    const int64_t len = static_cast<int64_t>(a.positions[e - 1]) + 1, row = a.token_seq[t];
    TANDEM_CHECK(a.positions[t] >= 0 && row >= 0 &&
                     (len + a.page_size - 1) / a.page_size <= a.max_pages_per_seq,
                 "PrefillAttentionPlan: token ", t, " (sequence ", row, ", position ",
                 a.positions[t], ") outside its block table of ", a.max_pages_per_seq, " pages");
    if (row * a.max_pages_per_seq > INT32_MAX || keys + len > INT32_MAX) return no("too large");
    qo_indptr.push_back(static_cast<int32_t>(e));
    kv_len.push_back(static_cast<int32_t>(len));
    rows.push_back(static_cast<int32_t>(row));
    works += (e - t + flashinfer_sm90::kCtaQ - 1) / flashinfer_sm90::kCtaQ;
    keys += len;
    t = e;
  }
  works *= a.num_q_heads;
  // FP8 pools: the gathered path only (its gather dequantizes); its bf16 workspace (2 * kv_heads
  // * head_dim * 2 bytes a key) is bounded at 4 x max_gather_keys, beyond which the simple
  // kernel takes the prefill tokens.
  if (a.kv_fp8 && keys > 4 * max_gather_keys_) {
    return no("fp8 KV: " + std::to_string(keys) + " keys to gather (at most " +
              std::to_string(4 * max_gather_keys_) + ")");
  }
  // head_dim 256: only the ragged kernel is built (gathered whatever the path).
  const bool gathered = a.head_dim == 256 || a.kv_fp8 || path_ == PrefillKvPath::kGathered ||
                        (path_ == PrefillKvPath::kAuto && keys <= max_gather_keys_);
  int64_t entries = 0;
  {
    int32_t at = 0;
    for (size_t i = 0; i < kv_len.size(); ++i) {
      kv_indptr.push_back(gathered ? at : static_cast<int32_t>(rows[i] * a.max_pages_per_seq));
      at += kv_len[i];
      entries += (kv_len[i] + a.page_size - 1) / a.page_size;
    }
  }

  int dev = 0, num_sms = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
  TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  // The previous plan's copies read the pinned buffers: wait before rewriting them.
  if (m.copied == nullptr) {
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&m.copied, cudaEventDisableTiming));
  } else if (m.copy_pending) {
    TANDEM_CUDA_CHECK(cudaEventSynchronize(m.copied));
  }
  m.copy_pending = false;
  const size_t ws_bytes = flashinfer_sm90::plan_bytes(works, num_sms);
  m.int_ws.reserve(ws_bytes, stream);
  m.int_pinned.reserve(ws_bytes, stream);
  if (gathered) {
    m.entries.reserve(static_cast<size_t>(entries) * sizeof(GatherEntry), stream);
    m.entries_pinned.reserve(static_cast<size_t>(entries) * sizeof(GatherEntry), stream);
    m.gather.reserve(static_cast<size_t>(2 * a.num_kv_heads * keys * a.head_dim) * sizeof(bf16),
                     stream);
    auto* h = static_cast<GatherEntry*>(m.entries_pinned.ptr);
    int64_t k = 0;
    for (size_t i = 0; i < kv_len.size(); ++i) {
      for (int32_t pg = 0; pg * a.page_size < kv_len[i]; ++pg) {
        const int32_t first = static_cast<int32_t>(pg * a.page_size);
        h[k++] = {rows[i], pg, kv_indptr[i] + first,
                  static_cast<int32_t>(std::min<int64_t>(a.page_size, kv_len[i] - first))};
      }
    }
    TANDEM_CUDA_CHECK(
        cudaMemcpyAsync(m.entries.ptr, h, k * sizeof(GatherEntry), cudaMemcpyHostToDevice, stream));
  }
  const std::string err = flashinfer_sm90::plan(
      m.int_ws.ptr, m.int_pinned.ptr, m.int_ws.bytes, qo_indptr.data(), kv_indptr.data(),
      kv_len.data(), static_cast<int>(kv_len.size()), static_cast<int>(a.num_prefill_tokens),
      static_cast<int>(a.num_q_heads), static_cast<int>(a.num_kv_heads),
      static_cast<int>(a.head_dim), static_cast<int>(a.page_size), &m.fplan, stream);
  TANDEM_CUDA_CHECK(cudaEventRecord(m.copied, stream));
  m.copy_pending = true;
  if (!err.empty()) return no(err);
  if (m.fplan.same_schedule_for_all_heads) return no("too many query tiles for one plan");
  m.num_prefill = a.num_prefill_tokens;
  m.q_heads = a.num_q_heads;
  m.kv_heads = a.num_kv_heads;
  m.head_dim = a.head_dim;
  m.page_size = a.page_size;
  m.max_pages = a.max_pages_per_seq;
  m.nnz_kv = keys;
  m.num_entries = entries;
  m.kv_fp8 = a.kv_fp8;
  planned_path_ = gathered ? PrefillKvPath::kGathered : PrefillKvPath::kPaged;
  why_.clear();
  ready_ = true;
  return true;
#else
  (void)stream;
  return no("built without FlashInfer");
#endif
}

void PrefillAttentionPlan::run(PagedAttentionParams const& p, cudaStream_t stream) const {
  TANDEM_CHECK(ready_, "PrefillAttentionPlan::run without a plan");
#if TANDEM_HAS_FLASHINFER
  Impl const& m = *impl_;
  TANDEM_CHECK(p.num_prefill_tokens == m.num_prefill && p.num_q_heads == m.q_heads &&
                   p.num_kv_heads == m.kv_heads && p.head_dim == m.head_dim &&
                   p.page_size == m.page_size && p.max_pages_per_seq == m.max_pages &&
                   p.kv_fp8 == m.kv_fp8,
               "PrefillAttentionPlan: launch (", p.num_prefill_tokens, " prefill tokens, ",
               p.num_q_heads, "/", p.num_kv_heads, " heads, head_dim ", p.head_dim, ", page ",
               p.page_size, ", ", p.max_pages_per_seq, " pages) differs from the plan (",
               m.num_prefill, ", ", m.q_heads, "/", m.kv_heads, ", ", m.head_dim, ", ", m.page_size,
               ", ", m.max_pages, ") or its KV dtype (fp8 ", m.kv_fp8, ")");
  TANDEM_CHECK(detail::aligned_to(16, p.q, p.out, p.pool),
               "PrefillAttentionPlan: unaligned tensors");
  const int64_t d = m.head_dim, P = m.page_size, H = m.kv_heads;
  flashinfer_sm90::Args a;
  a.q = p.q;
  a.o = p.out;
  a.q_stride_n = a.o_stride_n = m.q_heads * d;
  a.q_stride_h = a.o_stride_h = d;
  a.nnz_qo = m.num_prefill;
  a.num_qo_heads = static_cast<int>(m.q_heads);
  a.num_kv_heads = static_cast<int>(H);
  a.sm_scale = p.scale;
  a.int_ws = m.int_ws.ptr;
  a.plan = m.fplan;
  cudaError_t st = cudaSuccess;
  if (planned_path_ == PrefillKvPath::kGathered) {
    bf16* ws = static_cast<bf16*>(m.gather.ptr);
    const dim3 grid(static_cast<unsigned>(m.num_entries), static_cast<unsigned>(H), 2);
    auto const* entries = static_cast<GatherEntry const*>(m.entries.ptr);
    auto const* pool8 = reinterpret_cast<uint8_t const*>(p.pool);
    if (m.kv_fp8 && d == 128) {
      gather_kv_fp8_kernel<128><<<grid, 256, 0, stream>>>(
          pool8, p.block_table, entries, ws, H, P, m.max_pages, m.nnz_kv, p.k_scale, p.v_scale);
    } else if (m.kv_fp8) {
      gather_kv_fp8_kernel<256><<<grid, 256, 0, stream>>>(
          pool8, p.block_table, entries, ws, H, P, m.max_pages, m.nnz_kv, p.k_scale, p.v_scale);
    } else if (d == 128) {
      gather_kv_kernel<128><<<grid, 256, 0, stream>>>(p.pool, p.block_table, entries, ws, H, P,
                                                      m.max_pages, m.nnz_kv);
    } else {
      gather_kv_kernel<256><<<grid, 256, 0, stream>>>(p.pool, p.block_table, entries, ws, H, P,
                                                      m.max_pages, m.nnz_kv);
    }
    TANDEM_CUDA_CHECK_LAUNCH();
    a.k = ws;
    a.v = ws + H * m.nnz_kv * d;
    a.k_stride_n = a.v_stride_n = d;
    a.k_stride_h = a.v_stride_h = m.nnz_kv * d;
    a.nnz_kv = m.nnz_kv;
    st = d == 128 ? flashinfer_sm90::run_ragged_hd128(a, stream)
                  : flashinfer_sm90::run_ragged_hd256(a, stream);
  } else {
    a.k = p.pool;
    a.v = p.pool + H * P * d;
    a.k_stride_n = a.v_stride_n = d;
    a.k_stride_h = a.v_stride_h = P * d;
    a.page_stride = 2 * H * P * d;
    a.page_size = static_cast<int>(P);
    a.kv_indices = p.block_table;
    st = flashinfer_sm90::run_paged_hd128(a, stream);
  }
  if (st != cudaSuccess) {
    TANDEM_THROW(kCuda, "FlashInfer sm90 prefill: ", cudaGetErrorName(st), " (",
                 cudaGetErrorString(st), ")");
  }
#else
  (void)p;
  (void)stream;
#endif
}

}  // namespace tandem::cuda
