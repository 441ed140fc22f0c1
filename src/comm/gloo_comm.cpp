#include "comm/gloo_comm.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <cstring>
#include <exception>

#include "core/error.h"

namespace tandem::comm {

namespace {

// Slot prefix of our point-to-point messages; Gloo's collectives use prefixes 0x01..0x08.
constexpr uint8_t kP2pSlotPrefix = 0x54;
constexpr uint32_t kMaxTag = 1u << 24;

// gloo::rendezvous::Store on top of the project's TcpStore, keys under a prefix.
class TcpStoreAdapter final : public gloo::rendezvous::Store {
 public:
  TcpStoreAdapter(TcpStore& store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + key, std::span<const uint8_t>(
                                  reinterpret_cast<const uint8_t*>(data.data()), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    std::vector<uint8_t> v = store_.get(prefix_ + key, timeout_);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const auto& k : keys) store_.get(prefix_ + k, timeout);
  }

 private:
  TcpStore& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

// Gloo wants non-null buffers even for zero bytes.
uint8_t g_empty[8];
uint8_t* bytes_ptr(const void* p) {
  return p ? static_cast<uint8_t*>(const_cast<void*>(p)) : g_empty;
}

// Runs one Gloo call; its exceptions (timeouts, closed peers, enforce failures) become kIo.
template <typename F>
void guarded(const char* what, int rank, F&& f) {
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    TANDEM_THROW(kIo, "gloo ", what, " on rank ", rank, ": ", e.what());
  }
}

}  // namespace

struct GlooCommunicator::Impl {
  std::unique_ptr<TcpStore> owned_store;  // from_env() only; outlives the context
  GlooOptions options;
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::vector<uint8_t> scratch;  // all_reduce_sum's gathered chunks
};

GlooCommunicator::GlooCommunicator(TcpStore& store, GlooOptions options)
    : GlooCommunicator(store, std::move(options), nullptr) {}

GlooCommunicator::GlooCommunicator(TcpStore& store, GlooOptions options,
                                   std::unique_ptr<TcpStore> owned)
    : rank_(store.rank()), world_size_(store.world_size()), impl_(std::make_unique<Impl>()) {
  impl_->owned_store = std::move(owned);
  impl_->options = std::move(options);
  const GlooOptions& o = impl_->options;
  guarded("rendezvous", rank_, [&] {
    gloo::transport::tcp::attr attr;
    if (!o.iface.empty()) {
      attr.iface = o.iface;
    } else {
      attr.hostname = o.hostname;
    }
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank_, world_size_);
    context->setTimeout(o.timeout);
    TcpStoreAdapter adapter(store, o.store_prefix, o.timeout);
    context->connectFullMesh(adapter, device);
    impl_->context = std::move(context);
  });
}

std::unique_ptr<GlooCommunicator> GlooCommunicator::from_env(GlooOptions options) {
  const RankEnv env = RankEnv::from_env();
  TcpStoreOptions so = TcpStoreOptions::of(env);
  so.timeout = options.timeout;
  auto store = std::make_unique<TcpStore>(so);
  TcpStore* raw = store.get();
  return std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(*raw, std::move(options), std::move(store)));
}

GlooCommunicator::~GlooCommunicator() = default;

void GlooCommunicator::all_reduce_sum(void* data, int64_t count, DType dtype) {
  add_into(data, data, 0, dtype);  // rejects dtypes we cannot sum, on every rank alike
  TANDEM_CHECK(count >= 0, "all_reduce_sum: negative count ", count);
  const int n = world_size_;
  if (n == 1 || count == 0) return;
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  // Rank r owns chunk r: elements [count * r / n, count * (r + 1) / n).
  std::vector<int64_t> chunk(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) chunk[static_cast<size_t>(r)] = count * (r + 1) / n - count * r / n;
  const int64_t mine = chunk[static_cast<size_t>(rank_)];
  std::vector<int64_t> recv_counts(static_cast<size_t>(n), mine);
  auto& scratch = impl_->scratch;
  scratch.resize(static_cast<size_t>(n * mine * es));
  // Reduce-scatter: every rank's copy of my chunk, summed in rank order.
  all_to_all_v(data, chunk, scratch.data(), recv_counts, dtype);
  for (int r = 1; r < n; ++r) add_into(scratch.data(), scratch.data() + r * mine * es, mine, dtype);
  // All-gather the reduced chunks back into data.
  all_gather_v(scratch.data(), data, chunk, dtype);
}

void GlooCommunicator::all_gather(const void* in, void* out, int64_t count, DType dtype) {
  TANDEM_CHECK(count >= 0, "all_gather: negative count ", count);
  if (count == 0) return;
  const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
  if (world_size_ == 1) {
    std::memcpy(out, in, bytes);
    return;
  }
  guarded("all_gather", rank_, [&] {
    gloo::AllgatherOptions opts(impl_->context);
    opts.setInput(bytes_ptr(in), bytes);
    opts.setOutput(bytes_ptr(out), bytes * static_cast<size_t>(world_size_));
    gloo::allgather(opts);
  });
}

void GlooCommunicator::all_gather_v(const void* in, void* out, std::span<const int64_t> counts,
                                    DType dtype) {
  TANDEM_CHECK(static_cast<int>(counts.size()) == world_size_, "all_gather_v: ", counts.size(),
               " counts for ", world_size_, " ranks");
  const size_t es = dtype_size(dtype);
  std::vector<size_t> bytes(counts.size());
  size_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    TANDEM_CHECK(counts[r] >= 0, "all_gather_v: negative count for rank ", r);
    bytes[r] = static_cast<size_t>(counts[r]) * es;
    total += bytes[r];
  }
  if (total == 0) return;  // every rank sees the same counts
  if (world_size_ == 1) {
    std::memcpy(out, in, total);
    return;
  }
  guarded("all_gather_v", rank_, [&] {
    gloo::AllgathervOptions opts(impl_->context);
    opts.setInput(bytes_ptr(in), bytes[static_cast<size_t>(rank_)]);
    opts.setOutput(bytes_ptr(out), bytes);
    gloo::allgatherv(opts);
  });
}

void GlooCommunicator::all_to_all_v(const void* in, std::span<const int64_t> send_counts, void* out,
                                    std::span<const int64_t> recv_counts, DType dtype) {
  const int n = world_size_;
  TANDEM_CHECK(
      static_cast<int>(send_counts.size()) == n && static_cast<int>(recv_counts.size()) == n,
      "all_to_all_v: counts must have one entry per rank (", n, ")");
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  std::vector<int64_t> send_bytes(static_cast<size_t>(n)), recv_bytes(static_cast<size_t>(n));
  for (size_t r = 0; r < static_cast<size_t>(n); ++r) {
    TANDEM_CHECK(send_counts[r] >= 0 && recv_counts[r] >= 0,
                 "all_to_all_v: negative count for rank ", r);
    send_bytes[r] = send_counts[r] * es;
    recv_bytes[r] = recv_counts[r] * es;
  }
  if (n == 1) {
    TANDEM_CHECK(send_bytes[0] == recv_bytes[0], "all_to_all_v: send and recv counts differ");
    if (send_bytes[0] > 0) std::memcpy(out, in, static_cast<size_t>(send_bytes[0]));
    return;
  }
  guarded("all_to_all_v", rank_, [&] {
    gloo::AlltoallvOptions opts(impl_->context);
    opts.setInput(bytes_ptr(in), send_bytes);
    opts.setOutput(bytes_ptr(out), recv_bytes);
    gloo::alltoallv(opts);
  });
}

void GlooCommunicator::broadcast(void* data, int64_t count, DType dtype, int root) {
  TANDEM_CHECK(root >= 0 && root < world_size_, "broadcast: bad root ", root);
  TANDEM_CHECK(count >= 0, "broadcast: negative count ", count);
  if (count == 0 || world_size_ == 1) return;
  guarded("broadcast", rank_, [&] {
    gloo::BroadcastOptions opts(impl_->context);
    opts.setOutput(bytes_ptr(data), static_cast<size_t>(count) * dtype_size(dtype));
    opts.setRoot(root);
    gloo::broadcast(opts);
  });
}

void GlooCommunicator::barrier() {
  if (world_size_ == 1) return;
  guarded("barrier", rank_, [&] {
    gloo::BarrierOptions opts(impl_->context);
    gloo::barrier(opts);
  });
}

void GlooCommunicator::send(const void* data, int64_t bytes, int peer, uint32_t tag) {
  TANDEM_CHECK(peer >= 0 && peer < world_size_ && peer != rank_, "send: bad peer ", peer);
  TANDEM_CHECK(tag < kMaxTag, "send: tag ", tag, " out of range");
  if (bytes == 0) return;
  guarded("send", rank_, [&] {
    auto buf = impl_->context->createUnboundBuffer(bytes_ptr(data), static_cast<size_t>(bytes));
    buf->send(peer, gloo::Slot::build(kP2pSlotPrefix, tag));
    TANDEM_CHECK_KIND(kIo, buf->waitSend(impl_->options.timeout), "send to rank ", peer, " (tag ",
                      tag, ") aborted");
  });
}

void GlooCommunicator::recv(void* data, int64_t bytes, int peer, uint32_t tag) {
  TANDEM_CHECK(peer >= 0 && peer < world_size_ && peer != rank_, "recv: bad peer ", peer);
  TANDEM_CHECK(tag < kMaxTag, "recv: tag ", tag, " out of range");
  if (bytes == 0) return;
  guarded("recv", rank_, [&] {
    auto buf = impl_->context->createUnboundBuffer(bytes_ptr(data), static_cast<size_t>(bytes));
    buf->recv(peer, gloo::Slot::build(kP2pSlotPrefix, tag));
    TANDEM_CHECK_KIND(kIo, buf->waitRecv(impl_->options.timeout), "recv from rank ", peer, " (tag ",
                      tag, ") aborted");
  });
}

}  // namespace tandem::comm
