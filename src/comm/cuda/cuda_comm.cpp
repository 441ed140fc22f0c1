#include "comm/cuda/cuda_comm.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "comm/cuda/check.h"
#include "comm/local_launcher.h"
#include "core/env.h"

namespace tandem::comm {

namespace {

constexpr size_t kMiB = size_t(1) << 20;
constexpr size_t kKiB = size_t(1) << 10;

bool aligned16(void const* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// What each rank publishes about its peer buffer.
struct PeerInfo {
  cudaIpcMemHandle_t handle;
  char bus_id[32];
  char host[64];
  uint64_t max_bytes;
  uint64_t one_shot_max_bytes;
  uint64_t two_shot_max_bytes;
  int32_t max_blocks;  // this rank's resident-capped limit; the group takes the minimum
  int32_t device;
  int64_t spin_timeout_ms;
};

std::atomic<int> g_instances{0};

}  // namespace

const char* all_reduce_algo_name(AllReduceAlgo algo) {
  switch (algo) {
    case AllReduceAlgo::kAuto: return "auto";
    case AllReduceAlgo::kOneShot: return "one_shot";
    case AllReduceAlgo::kTwoShot: return "two_shot";
    case AllReduceAlgo::kNccl: return "nccl";
  }
  return "?";
}

CudaAllReduceConfig CudaAllReduceConfig::defaults(int world_size) {
  CudaAllReduceConfig c;
  // Predictions before measurement (docs/perf-notes-comm.md); the benchmark prints measured ones.
  if (world_size <= 2) {
    c.one_shot_max_bytes = 16 * kMiB;  // two ranks: two-shot moves the same bytes, +1 barrier
    c.two_shot_max_bytes = 16 * kMiB;
  } else if (world_size <= 4) {
    c.one_shot_max_bytes = 512 * kKiB;
    c.two_shot_max_bytes = 8 * kMiB;
  } else if (world_size <= 8) {
    c.one_shot_max_bytes = 256 * kKiB;
    c.two_shot_max_bytes = 8 * kMiB;
  } else {
    c.one_shot_max_bytes = 128 * kKiB;
    c.two_shot_max_bytes = 4 * kMiB;
  }
  c.apply_env();
  return c;
}

void CudaAllReduceConfig::apply_env() {
  if (const auto v = env::bytes("TANDEM_AR_MAX_BYTES")) max_bytes = *v;
  if (const auto v = env::bytes("TANDEM_AR_ONE_SHOT_MAX_BYTES")) one_shot_max_bytes = *v;
  if (const auto v = env::bytes("TANDEM_AR_TWO_SHOT_MAX_BYTES")) two_shot_max_bytes = *v;
  if (const auto v = env::integer("TANDEM_AR_MAX_BLOCKS")) max_blocks = static_cast<int>(*v);
  if (const auto v = env::integer("TANDEM_AR_SPIN_TIMEOUT_MS")) {
    spin_timeout = std::chrono::milliseconds(*v);
  }
}

std::unique_ptr<CudaComm> CudaComm::from_env() {
  const RankEnv env = RankEnv::from_env();
  return from_env(CudaAllReduceConfig::defaults(env.world_size));
}

std::unique_ptr<CudaComm> CudaComm::from_env(const CudaAllReduceConfig& config) {
  const RankEnv env = RankEnv::from_env();
  int ndev = 0;
  TANDEM_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  TANDEM_CHECK_KIND(kInvalidArgument, ndev > 0, "no CUDA device visible");
  const int device = env.local_rank % ndev;
  auto store = std::make_shared<TcpStore>(TcpStoreOptions::of(env));
  return std::make_unique<CudaComm>(std::move(store), device, config);
}

CudaComm::CudaComm(std::shared_ptr<TcpStore> store, int device, CudaAllReduceConfig config)
    : store_(std::move(store)),
      rank_(store_->rank()),
      world_size_(store_->world_size()),
      device_(device),
      config_(config) {
  TANDEM_CHECK_KIND(kUnsupported, world_size_ <= cuda::kMaxRanks, "CudaComm: world size ",
                    world_size_, " > ", cuda::kMaxRanks);
  key_ = "cuda_comm/" + std::to_string(g_instances.fetch_add(1));
  config_.max_bytes = std::max<size_t>(4096, (config_.max_bytes + 4095) / 4096 * 4096);
  TANDEM_CUDA_CHECK(cudaSetDevice(device_));

  // Blocks per launch: every block of every kernel variant must be resident at once.
  int sms = 0;
  TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  int max_blocks = config_.max_blocks > 0 ? config_.max_blocks : 2 * sms;
  max_blocks = std::min(max_blocks, cuda::kMaxBlocks);
  if (world_size_ >= 2) {
    for (auto kind : {cuda::AllReduceKernel::kOneShot, cuda::AllReduceKernel::kTwoShot})
      for (auto dtype : {DType::kBF16, DType::kF32})
        for (bool reg : {false, true})
          max_blocks = std::min(max_blocks, cuda::all_reduce_max_resident_blocks(
                                                kind, dtype, world_size_, reg, cuda::kMaxThreads));
  }
  TANDEM_CHECK(max_blocks >= 1, "no all-reduce block fits on device ", device_);

  // Own peer-mapped allocation: [Signal | staging x2 | registered].
  const size_t total = cuda::kSignalBytes + 3 * config_.max_bytes;
  TANDEM_CUDA_CHECK(cudaMalloc(&base_, total));
  TANDEM_CUDA_CHECK(cudaMemset(base_, 0, cuda::kSignalBytes));
  TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
  registered_ = static_cast<char*>(base_) + cuda::kSignalBytes + 2 * config_.max_bytes;

  PeerInfo mine{};
  if (world_size_ >= 2) TANDEM_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, base_));
  TANDEM_CUDA_CHECK(cudaDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id), device_));
  ::gethostname(mine.host, sizeof(mine.host) - 1);
  mine.max_bytes = config_.max_bytes;
  mine.one_shot_max_bytes = config_.one_shot_max_bytes;
  mine.two_shot_max_bytes = config_.two_shot_max_bytes;
  mine.max_blocks = max_blocks;
  mine.device = device_;
  mine.spin_timeout_ms = config_.spin_timeout.count();
  auto infos = store_->all_gather(key_ + "/peer_info",
                                  std::span(reinterpret_cast<const uint8_t*>(&mine), sizeof(mine)));

  std::vector<PeerInfo> peers(world_size_);
  for (int q = 0; q < world_size_; ++q) {
    TANDEM_CHECK(infos[q].size() == sizeof(PeerInfo), "bad peer info from rank ", q);
    std::memcpy(&peers[q], infos[q].data(), sizeof(PeerInfo));
    const PeerInfo& p = peers[q];
    TANDEM_CHECK_KIND(kInvalidArgument,
                      p.max_bytes == mine.max_bytes &&
                          p.one_shot_max_bytes == mine.one_shot_max_bytes &&
                          p.two_shot_max_bytes == mine.two_shot_max_bytes &&
                          p.spin_timeout_ms == mine.spin_timeout_ms,
                      "CudaComm: rank ", q, " has another all-reduce config than rank ", rank_,
                      " (TANDEM_AR_* environment must be the same on every rank)");
    max_blocks = std::min<int>(max_blocks, p.max_blocks);
    if (q != rank_) {
      TANDEM_CHECK_KIND(kUnsupported, std::strncmp(p.host, mine.host, sizeof(p.host)) == 0,
                        "CudaComm: rank ", q, " runs on host '", p.host, "', rank ", rank_, " on '",
                        mine.host,
                        "': the custom all-reduce needs every rank on one host (NVLink)");
      if (std::strcmp(p.bus_id, mine.bus_id) == 0) {
        // Ranks sharing one GPU (tests): CUDA IPC works between processes on one device,
        // NCCL does not (one GPU per rank), so the custom kernels carry every size.
        TANDEM_CHECK_KIND(kInvalidArgument, allow_shared_device(), "CudaComm: ranks ", q, " and ",
                          rank_, " share GPU ", p.bus_id,
                          " (check LOCAL_RANK / CUDA_VISIBLE_DEVICES, or set "
                          "TANDEM_ALLOW_SHARED_GPU=1 for tests)");
        shared_device_ = true;
      }
    }
  }
  config_.max_blocks = max_blocks;

  // Check peer access where the peer's GPU is visible here, then map the peers' buffers; the
  // mapping enables access to them (lazily), without a context on the peer GPU.
  for (int q = 0; q < world_size_; ++q) {
    if (q == rank_) {
      peer_bases_[q] = base_;
      continue;
    }
    int peer_dev = -1;
    if (std::strcmp(peers[q].bus_id, mine.bus_id) == 0) {
      // the same GPU: no peer access to check
    } else if (cudaDeviceGetByPCIBusId(&peer_dev, peers[q].bus_id) == cudaSuccess) {
      int can = 0;
      TANDEM_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, peer_dev));
      TANDEM_CHECK_KIND(kUnsupported, can != 0, "CudaComm: GPU ", mine.bus_id,
                        " cannot access peer GPU ", peers[q].bus_id,
                        " (no NVLink/P2P): use NCCL instead of the custom all-reduce");
    } else {
      (void)cudaGetLastError();  // peer GPU not visible in this process (CUDA_VISIBLE_DEVICES)
    }
    TANDEM_CUDA_CHECK(
        cudaIpcOpenMemHandle(&peer_bases_[q], peers[q].handle, cudaIpcMemLazyEnablePeerAccess));
  }

  params_ = {};
  for (int q = 0; q < world_size_; ++q)
    params_.signals[q] = static_cast<cuda::Signal*>(peer_bases_[q]);
  params_.parity_stride = config_.max_bytes;
  params_.rank = rank_;
  params_.world_size = world_size_;
  params_.timeout_ns = static_cast<uint64_t>(config_.spin_timeout.count()) * 1000000ull;

  // Every rank agrees on whether any two ranks share a GPU (then there is no NCCL).
  uint8_t shared = shared_device_ ? 1 : 0;
  auto flags = store_->all_gather(key_ + "/shared", std::span(&shared, 1));
  for (const auto& f : flags) shared_device_ = shared_device_ || (!f.empty() && f[0] != 0);
  if (!shared_device_) {
    nccl_ = std::make_unique<NcclComm>(*store_, key_ + "/nccl");
  }
  store_->barrier();
}

CudaComm::~CudaComm() {
  // Nobody may unmap or free while a peer's kernel could still touch this rank's memory. While
  // an error unwinds this rank (its peers fail too: their next collective gives up after the
  // spin timeout), the barriers are skipped, so the error reaches the caller now instead of
  // after the store's timeout.
  const bool unwinding = std::uncaught_exceptions() > 0;
  if (unwinding) {
    std::fprintf(stderr, "CudaComm rank %d: closed while an error unwinds: no shutdown barrier\n",
                 rank_);
  }
  try {
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    if (!unwinding) store_->barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "CudaComm rank %d: shutdown barrier failed: %s\n", rank_, e.what());
  }
  nccl_.reset();
  for (int q = 0; q < world_size_; ++q) {
    if (q != rank_ && peer_bases_[q] != nullptr) cudaIpcCloseMemHandle(peer_bases_[q]);
  }
  try {
    if (!unwinding) store_->barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "CudaComm rank %d: shutdown barrier failed: %s\n", rank_, e.what());
  }
  if (base_ != nullptr) cudaFree(base_);
}

cuda::AllReduceParams CudaComm::registered_params() const {
  cuda::AllReduceParams p = params_;
  for (int q = 0; q < world_size_; ++q)
    p.data[q] = static_cast<char*>(peer_bases_[q]) + cuda::kSignalBytes + 2 * config_.max_bytes;
  return p;
}

bool CudaComm::allow_shared_device() { return env::flag("TANDEM_ALLOW_SHARED_GPU", false); }

NcclComm& CudaComm::nccl() {
  TANDEM_CHECK_KIND(kUnsupported, nccl_ != nullptr,
                    "CudaComm: no NCCL communicator (ranks share a GPU)");
  return *nccl_;
}

AllReduceAlgo CudaComm::choose(size_t bytes, bool aligned) const {
  if (nccl_ == nullptr) {  // ranks share a GPU: the custom kernels or nothing
    TANDEM_CHECK_KIND(kInvalidArgument, world_size_ < 2 || (aligned && bytes <= config_.max_bytes),
                      "all_reduce of ", bytes,
                      " bytes: ranks sharing a GPU need 16-byte aligned "
                      "messages of at most max_bytes (",
                      config_.max_bytes, ")");
    return bytes <= config_.one_shot_max_bytes ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot;
  }
  if (world_size_ < 2 || !aligned || bytes > config_.max_bytes) return AllReduceAlgo::kNccl;
  if (bytes <= config_.one_shot_max_bytes) return AllReduceAlgo::kOneShot;
  if (bytes <= config_.two_shot_max_bytes) return AllReduceAlgo::kTwoShot;
  return AllReduceAlgo::kNccl;
}

void CudaComm::set_thresholds(size_t one_shot_max_bytes, size_t two_shot_max_bytes) {
  uint64_t mine[2] = {one_shot_max_bytes, two_shot_max_bytes};
  auto all = store_->all_gather(key_ + "/thresholds/" + std::to_string(threshold_calls_++),
                                std::span(reinterpret_cast<const uint8_t*>(mine), sizeof(mine)));
  for (int q = 0; q < world_size_; ++q) {
    TANDEM_CHECK_KIND(
        kInvalidArgument,
        all[q].size() == sizeof(mine) && std::memcmp(all[q].data(), mine, sizeof(mine)) == 0,
        "set_thresholds: rank ", q, " passed other thresholds than rank ", rank_);
  }
  config_.one_shot_max_bytes = one_shot_max_bytes;
  config_.two_shot_max_bytes = two_shot_max_bytes;
}

void CudaComm::check_device() const {
  int cur = -1;
  TANDEM_CUDA_CHECK(cudaGetDevice(&cur));
  TANDEM_CHECK_KIND(kInvalidArgument, cur == device_, "CudaComm of rank ", rank_, " uses GPU ",
                    device_, " but the current device is ", cur);
}

void CudaComm::all_reduce(void const* input, void* output, size_t count, DType dtype,
                          cudaStream_t stream, AllReduceAlgo algo) {
  TANDEM_CHECK_KIND(kUnsupported, dtype == DType::kBF16 || dtype == DType::kF32,
                    "all_reduce: unsupported dtype: ", dtype_name(dtype), " (bf16, f32)");
  if (count == 0) return;
  check_device();
  const size_t bytes = count * dtype_size(dtype);
  auto const* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  TANDEM_CHECK_KIND(kInvalidArgument, in == out || in + bytes <= out || out + bytes <= in,
                    "all_reduce: input and output overlap without being equal");
  if (world_size_ == 1) {
    if (in != out)
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const bool aligned = aligned16(input) && aligned16(output);
  if (algo == AllReduceAlgo::kAuto) algo = choose(bytes, aligned);
  if (algo == AllReduceAlgo::kNccl) {
    nccl().all_reduce(input, output, count, dtype, stream);
    return;
  }
  TANDEM_CHECK_KIND(kInvalidArgument, aligned, "all_reduce (", all_reduce_algo_name(algo),
                    "): input and output must be 16-byte aligned");
  TANDEM_CHECK_KIND(kInvalidArgument, bytes <= config_.max_bytes, "all_reduce (",
                    all_reduce_algo_name(algo), "): ", bytes, " bytes exceed max_bytes ",
                    config_.max_bytes);
  launch_custom(input, output, count, dtype, stream, algo, /*registered=*/false);
}

void CudaComm::all_reduce_registered(void* output, size_t count, DType dtype, cudaStream_t stream,
                                     AllReduceAlgo algo) {
  TANDEM_CHECK_KIND(kUnsupported, dtype == DType::kBF16 || dtype == DType::kF32,
                    "all_reduce_registered: unsupported dtype: ", dtype_name(dtype));
  if (count == 0) return;
  check_device();
  const size_t bytes = count * dtype_size(dtype);
  TANDEM_CHECK_KIND(kInvalidArgument, bytes <= config_.max_bytes, "all_reduce_registered: ", bytes,
                    " bytes exceed the registered buffer (", config_.max_bytes, ")");
  auto* out = static_cast<char*>(output);
  auto* reg = static_cast<char*>(registered_);
  TANDEM_CHECK_KIND(kInvalidArgument, out + bytes <= reg || reg + config_.max_bytes <= out,
                    "all_reduce_registered: output must not lie in the registered buffer");
  if (world_size_ == 1) {
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(out, reg, bytes, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const bool aligned = aligned16(output);
  if (algo == AllReduceAlgo::kAuto) algo = choose(bytes, aligned);
  if (algo == AllReduceAlgo::kNccl) {
    nccl().all_reduce(registered_, output, count, dtype, stream);
    return;
  }
  TANDEM_CHECK_KIND(kInvalidArgument, aligned, "all_reduce_registered (",
                    all_reduce_algo_name(algo), "): output must be 16-byte aligned");
  launch_custom(nullptr, output, count, dtype, stream, algo, /*registered=*/true);
}

void CudaComm::launch_custom(void const* input, void* output, size_t count, DType dtype,
                             cudaStream_t stream, AllReduceAlgo algo, bool registered) {
  const auto kind = algo == AllReduceAlgo::kOneShot ? cuda::AllReduceKernel::kOneShot
                                                    : cuda::AllReduceKernel::kTwoShot;
  cuda::AllReduceParams p = params_;
  p.input = input;
  p.output = output;
  p.count = count;
  const size_t data_offset = cuda::kSignalBytes + (registered ? 2 * config_.max_bytes : 0);
  for (int q = 0; q < world_size_; ++q)
    p.data[q] = static_cast<char*>(peer_bases_[q]) + data_offset;
  const auto shape = cuda::all_reduce_shape(kind, count, dtype, world_size_, config_.max_blocks);
  cuda::all_reduce_launch(p, dtype, kind, registered, shape, stream);
}

}  // namespace tandem::comm
