#include "comm/cuda/cuda_moe.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include "comm/cuda/check.h"
#include "core/dtype.h"

namespace tandem::comm {

namespace {

std::atomic<int> g_moe_instances{0};

struct MoePeerInfo {
  cudaIpcMemHandle_t handle;
  int32_t num_experts, hidden, top_k, max_tokens, payload, send_blocks;
  int64_t total_bytes;
  int64_t spin_timeout_ms;
};

}  // namespace

CudaMoe::CudaMoe(CudaComm& comm, CudaMoeConfig config)
    : comm_(comm),
      config_(config),
      rank_(comm.rank()),
      world_(comm.world_size()),
      device_(comm.device()) {
  using namespace cuda;
  const CudaMoeConfig& c = config_;
  TANDEM_CHECK_KIND(kInvalidArgument, c.num_experts >= world_ && c.num_experts % world_ == 0,
                    "CudaMoe: ", c.num_experts, " experts do not divide over ", world_, " ranks");
  TANDEM_CHECK_KIND(kInvalidArgument, c.num_experts <= kMoeMaxExperts, "CudaMoe: more than ",
                    kMoeMaxExperts, " experts");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    c.top_k >= 1 && c.top_k <= std::min(kMoeMaxTopK, c.num_experts),
                    "CudaMoe: top_k ", c.top_k, " out of range");
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      c.hidden > 0 && c.hidden % (c.payload == MoePayload::kFP8 ? kMoeFp8Group : 8) == 0,
      "CudaMoe: hidden ", c.hidden, " must be a multiple of ",
      c.payload == MoePayload::kFP8 ? kMoeFp8Group : 8);
  TANDEM_CHECK_KIND(kInvalidArgument, c.max_tokens >= 1, "CudaMoe: max_tokens must be >= 1");
  TANDEM_CHECK_KIND(kUnsupported, world_ <= kMaxRanks, "CudaMoe: world size ", world_, " > ",
                    kMaxRanks);
  TANDEM_CUDA_CHECK(cudaSetDevice(device_));
  int sms = 0;
  TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  if (config_.send_blocks <= 0) config_.send_blocks = std::min(sms, c.max_tokens + 1);
  config_.send_blocks = std::clamp(config_.send_blocks, 1, kMoeMaxBlocks);
  recv_blocks_ = c.recv_blocks > 0 ? c.recv_blocks : sms;
  key_ = "cuda_moe/" + std::to_string(g_moe_instances.fetch_add(1));

  const int L = c.num_experts / world_;
  const MoeLayout layout = moe_layout(world_, L, c.max_tokens, c.top_k, c.hidden, c.payload);
  TANDEM_CUDA_CHECK(cudaMalloc(&base_, layout.total));
  TANDEM_CUDA_CHECK(cudaMemset(base_, 0, layout.total));
  const int max_rows = world_ * c.max_tokens * std::min(c.top_k, L);
  const size_t rb = moe_row_bytes(c.payload, c.hidden);
  const size_t local_bytes = size_t(max_rows) * rb + size_t(L + 1) * 4 + size_t(max_rows) * 4 * 6 +
                             size_t(c.max_tokens) * c.top_k * 4 + 1024;
  TANDEM_CUDA_CHECK(cudaMalloc(&local_, local_bytes));
  TANDEM_CUDA_CHECK(cudaMemset(local_, 0, local_bytes));
  TANDEM_CUDA_CHECK(cudaDeviceSynchronize());

  MoePeerInfo mine{};
  if (world_ >= 2) TANDEM_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, base_));
  mine.num_experts = c.num_experts;
  mine.hidden = c.hidden;
  mine.top_k = c.top_k;
  mine.max_tokens = c.max_tokens;
  mine.payload = static_cast<int32_t>(c.payload);
  mine.send_blocks = config_.send_blocks;
  mine.total_bytes = static_cast<int64_t>(layout.total);
  mine.spin_timeout_ms = c.spin_timeout.count();
  auto infos = comm_.store().all_gather(
      key_ + "/peer_info", std::span(reinterpret_cast<const uint8_t*>(&mine), sizeof(mine)));
  std::vector<MoePeerInfo> peers(world_);
  int mismatch = -1;
  for (int q = 0; q < world_; ++q) {
    TANDEM_CHECK(infos[q].size() == sizeof(MoePeerInfo), "bad moe peer info from rank ", q);
    std::memcpy(&peers[q], infos[q].data(), sizeof(MoePeerInfo));
    const MoePeerInfo& p = peers[q];
    const bool same = p.num_experts == mine.num_experts && p.hidden == mine.hidden &&
                      p.top_k == mine.top_k && p.max_tokens == mine.max_tokens &&
                      p.payload == mine.payload && p.send_blocks == mine.send_blocks &&
                      p.total_bytes == mine.total_bytes &&
                      p.spin_timeout_ms == mine.spin_timeout_ms;
    if (!same && mismatch < 0) mismatch = q;
  }
  if (mismatch >= 0) {  // every rank sees it: all throw, nothing is mapped yet
    cudaFree(base_);
    cudaFree(local_);
    base_ = local_ = nullptr;
    TANDEM_THROW(kInvalidArgument, "CudaMoe: rank ", mismatch, " has another MoE config than rank ",
                 rank_, " (experts, hidden, top_k, max_tokens, payload, send_blocks, timeout)");
  }
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) {
      peer_bases_[q] = base_;
      continue;
    }
    TANDEM_CUDA_CHECK(
        cudaIpcOpenMemHandle(&peer_bases_[q], peers[q].handle, cudaIpcMemLazyEnablePeerAccess));
  }

  MoeDecodeParams& p = params_;
  p = {};
  for (int q = 0; q < world_; ++q) p.peer[q] = static_cast<char*>(peer_bases_[q]);
  char* l = static_cast<char*>(local_);
  auto take = [&](size_t bytes) {
    char* r = l;
    l += (bytes + 255) / 256 * 256;
    return r;
  };
  p.out_x = take(size_t(max_rows) * rb);
  p.expert_offsets = reinterpret_cast<int32_t*>(take(size_t(L + 1) * 4));
  p.row_src = reinterpret_cast<int32_t*>(take(size_t(max_rows) * 4));
  p.row_token = reinterpret_cast<int32_t*>(take(size_t(max_rows) * 4));
  p.row_slot = reinterpret_cast<int32_t*>(take(size_t(max_rows) * 4));
  p.row_expert = reinterpret_cast<int32_t*>(take(size_t(max_rows) * 4));
  p.row_weight = reinterpret_cast<float*>(take(size_t(max_rows) * 4));
  p.rank_scratch = reinterpret_cast<int32_t*>(take(size_t(c.max_tokens) * c.top_k * 4));
  TANDEM_CHECK(static_cast<size_t>(l - static_cast<char*>(local_)) <= local_bytes + 2048,
               "CudaMoe: local buffer carving overflow");
  p.layout = layout;
  p.rank = rank_;
  p.world_size = world_;
  p.num_experts = c.num_experts;
  p.local_experts = L;
  p.top_k = c.top_k;
  p.hidden = c.hidden;
  p.max_tokens = c.max_tokens;
  p.max_recv_rows = max_rows;
  p.payload = c.payload;
  p.send_blocks = config_.send_blocks;
  p.timeout_ns = static_cast<uint64_t>(c.spin_timeout.count()) * 1000000ull;
  comm_.store().barrier();
}

CudaMoe::~CudaMoe() {
  // As ~CudaComm: no shutdown barrier while an error unwinds this rank.
  const bool unwinding = std::uncaught_exceptions() > 0;
  try {
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    if (!unwinding) comm_.store().barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "CudaMoe rank %d: shutdown barrier failed: %s\n", rank_, e.what());
  }
  for (int q = 0; q < world_; ++q)
    if (q != rank_ && peer_bases_[q] != nullptr) cudaIpcCloseMemHandle(peer_bases_[q]);
  try {
    if (!unwinding) comm_.store().barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "CudaMoe rank %d: shutdown barrier failed: %s\n", rank_, e.what());
  }
  if (base_ != nullptr) cudaFree(base_);
  if (local_ != nullptr) cudaFree(local_);
}

void CudaMoe::dispatch_send(void const* x, int32_t const* topk_ids, float const* topk_weights,
                            int32_t const* num_tokens, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument, (reinterpret_cast<uintptr_t>(x) & 15u) == 0,
                    "CudaMoe::dispatch_send: x must be 16-byte aligned");
  params_.x = x;
  params_.topk_ids = topk_ids;
  params_.topk_weights = topk_weights;
  params_.num_tokens = num_tokens;
  cuda::moe_decode_launch(cuda::kMoeDispatchSend, params_, params_.send_blocks, stream);
}

void CudaMoe::dispatch_recv(cudaStream_t stream) {
  cuda::moe_decode_launch(cuda::kMoeDispatchRecv, params_, recv_blocks_, stream);
}

void CudaMoe::combine_send(void const* expert_out, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument, (reinterpret_cast<uintptr_t>(expert_out) & 15u) == 0,
                    "CudaMoe::combine_send: expert_out must be 16-byte aligned");
  params_.expert_out = expert_out;
  cuda::moe_decode_launch(cuda::kMoeCombineSend, params_, params_.send_blocks, stream);
}

void CudaMoe::combine_recv(void* out, cudaStream_t stream, bool out_f32) {
  TANDEM_CHECK_KIND(kInvalidArgument, params_.topk_ids != nullptr,
                    "CudaMoe::combine_recv before any dispatch_send");
  TANDEM_CHECK_KIND(kInvalidArgument, (reinterpret_cast<uintptr_t>(out) & 15u) == 0,
                    "CudaMoe::combine_recv: out must be 16-byte aligned");
  params_.out = out;
  params_.out_f32 = out_f32 ? 1 : 0;
  cuda::moe_decode_launch(cuda::kMoeCombineRecv, params_, recv_blocks_, stream);
}

void prefill_combine_all_reduce(CudaComm& comm, cuda::PrefillCombineParams p, void* out, int blocks,
                                cudaStream_t stream, AllReduceAlgo algo, bool fused) {
  const DType dt = p.out_f32 ? DType::kF32 : DType::kBF16;
  const size_t count = size_t(p.max_tokens) * p.hidden;
  TANDEM_CHECK_KIND(kInvalidArgument, count * dtype_size(dt) <= comm.registered_bytes(),
                    "prefill_combine_all_reduce: ", count * dtype_size(dt),
                    " bytes exceed the registered buffer (", comm.registered_bytes(), ")");
  TANDEM_CHECK_KIND(kInvalidArgument, (reinterpret_cast<uintptr_t>(out) & 15u) == 0,
                    "prefill_combine_all_reduce: out must be 16-byte aligned");
  if (fused && comm.world_size() >= 2 &&
      (algo == AllReduceAlgo::kAuto || algo == AllReduceAlgo::kOneShot)) {
    cuda::AllReduceParams ar = comm.registered_params();
    ar.input = nullptr;
    ar.output = out;
    ar.count = count;
    cuda::prefill_combine_all_reduce_launch(
        p, ar, std::max(1, std::min(blocks, comm.config().max_blocks)), stream);
    return;
  }
  p.out = comm.registered_input();
  cuda::prefill_combine_launch(p, blocks, stream);
  comm.all_reduce_registered(out, count, dt, stream, algo);
}

}  // namespace tandem::comm
