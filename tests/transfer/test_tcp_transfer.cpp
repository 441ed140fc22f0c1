// End-to-end KV transfers over loopback TCP: prefill ranks (senders) stream random KV into
// decode ranks' reserved pages (receivers); every destination float is compared bit for bit
// with the expected value, and every float outside the reserved rows must keep its poison.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "net/cluster_auth.h"
#include "transfer/kv_pack.h"
#include "transfer/tcp_transfer.h"
#include "transfer/wire.h"

namespace tandem::transfer {
namespace {

using namespace std::chrono_literals;
using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;
using ::testing::HasSubstr;

constexpr uint32_t kPoison = 0x7FBADBADu;  // a NaN no computation produces

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct ModelShape {
  int64_t heads = 4;
  int64_t layers = 3;
  int64_t head_dim = 8;
};

// One request's KV as prefill computed it: [layers, 2, heads, tokens, head_dim].
struct Reference {
  Reference(const ModelShape& m, int64_t tokens, uint32_t seed)
      : m(m),
        tokens(tokens),
        data(static_cast<size_t>(m.layers * 2 * m.heads * tokens * m.head_dim)) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (float& x : data) x = u(rng);
  }
  const float* row(int64_t l, int64_t kv, int64_t h, int64_t t) const {
    return data.data() + (((l * 2 + kv) * m.heads + h) * tokens + t) * m.head_dim;
  }
  ModelShape m;
  int64_t tokens;
  std::vector<float> data;
};

// Every callback, by key ("rx0/req" for receiver 0, "tx1/req" for sender rank 1).
class Events {
 public:
  struct Event {
    std::string kind;  // complete, error (receiver); sent, error (sender)
    int32_t token = 0;
    float logprob = 0.0f;
    std::string message;
  };

  ReceiverCallbacks receiver(const std::string& name) {
    return {[this, name](const std::string& r, int32_t tok, float lp) {
              add(name + "/" + r, {"complete", tok, lp, ""});
            },
            [this, name](const std::string& r, const std::string& m) {
              add(name + "/" + r, {"error", 0, 0.0f, m});
            }};
  }
  SenderCallbacks sender(const std::string& name) {
    return {[this, name](const std::string& r) {
              add(name + "/" + r, {"sent", 0, 0.0f, ""});
            },
            [this, name](const std::string& r, const std::string& m) {
              add(name + "/" + r, {"error", 0, 0.0f, m});
            }};
  }

  /// Waits for the first event of `key`; returns it (kind "none" after the timeout).
  Event wait(const std::string& key, std::chrono::milliseconds timeout = 5s) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return !events_[key].empty(); });
    return events_[key].empty() ? Event{"none"} : events_[key].front();
  }
  std::vector<Event> of(const std::string& key) {
    std::lock_guard lock(mu_);
    return events_[key];
  }

 private:
  void add(const std::string& key, Event e) {
    {
      std::lock_guard lock(mu_);
      events_[key].push_back(std::move(e));
    }
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<Event>> events_;
};

template <typename Pred>
bool poll_until(Pred pred, std::chrono::milliseconds timeout = 5s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

std::vector<int32_t> take_pages(PageAllocator& alloc, int64_t tokens, int64_t page_size,
                                std::mt19937& rng) {
  std::vector<int32_t> pages;
  EXPECT_TRUE(alloc.allocate((tokens + page_size - 1) / page_size, pages));
  std::shuffle(pages.begin(), pages.end(), rng);  // block tables are not contiguous
  return pages;
}

// A prefill instance: TP ranks, each with its cache and its sender.
struct Prefill {
  Prefill(const ModelShape& m, int tp, int64_t page_size, TransferBackend& backend, Events& ev,
          int64_t num_pages = 32)
      : sharding{m.heads, tp} {
    for (int r = 0; r < tp; ++r) {
      caches.push_back(std::make_unique<KvCache>(
          KvGeometry{m.layers, num_pages, sharding.held(r).size(), page_size, m.head_dim}));
      allocs.emplace_back(num_pages);
      senders.push_back(
          backend.make_sender(*caches.back(), sharding, r, ev.sender("tx" + std::to_string(r))));
    }
  }

  // Writes the request's KV into every rank's pages (as the forward would); non-sending
  // replicas get different values, so data from a wrong replica would show. Returns the
  // block table of each rank.
  std::vector<std::vector<int32_t>> store(const Reference& ref, std::mt19937& rng) {
    std::vector<std::vector<int32_t>> tables;
    for (int r = 0; r < sharding.tp; ++r) {
      KvCache& c = *caches[static_cast<size_t>(r)];
      const auto& g = c.geometry();
      auto pages = take_pages(allocs[static_cast<size_t>(r)], ref.tokens, g.page_size, rng);
      const HeadRange held = sharding.held(r);
      const float bias = sharding.sends(r) ? 0.0f : 100.0f;
      for (int64_t l = 0; l < g.num_layers; ++l) {
        for (int64_t kv = 0; kv < 2; ++kv) {
          for (int64_t h = 0; h < held.size(); ++h) {
            for (int64_t t = 0; t < ref.tokens; ++t) {
              float* dst = c.head_rows(l, pages[static_cast<size_t>(t / g.page_size)],
                                       static_cast<int>(kv), h) +
                           (t % g.page_size) * g.head_dim;
              const float* src = ref.row(l, kv, held.begin + h, t);
              for (int64_t j = 0; j < g.head_dim; ++j) dst[j] = src[j] + bias;
            }
          }
        }
      }
      tables.push_back(std::move(pages));
    }
    return tables;
  }

  void begin_all(const std::string& id, const std::vector<TransferDescriptor>& descs,
                 const std::vector<std::vector<int32_t>>& tables) {
    for (size_t r = 0; r < senders.size(); ++r) senders[r]->begin(id, descs, tables[r]);
  }
  void send_all(const std::string& id, int64_t layer) {
    for (auto& s : senders) s->send_layer(id, layer);
  }
  void finish_all(const std::string& id, int32_t token, float logprob) {
    for (auto& s : senders) s->finish(id, token, logprob);
  }

  KvSharding sharding;
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<PageAllocator> allocs;
  std::vector<std::unique_ptr<TransferSender>> senders;
};

// A decode instance: ranks each holding a head range, caches poisoned, one receiver each.
struct Decode {
  Decode(const ModelShape& m, std::vector<HeadRange> ranges, int64_t page_size,
         TransferBackend& backend, Events& ev, int64_t num_pages = 24)
      : ranges(std::move(ranges)) {
    for (size_t i = 0; i < this->ranges.size(); ++i) {
      caches.push_back(std::make_unique<KvCache>(
          KvGeometry{m.layers, num_pages, this->ranges[i].size(), page_size, m.head_dim}));
      KvCache& c = *caches.back();
      for (int64_t l = 0; l < m.layers; ++l) {
        float* p = c.layer(l);
        for (int64_t k = 0; k < num_pages * c.geometry().page_elems(); ++k) {
          std::memcpy(p + k, &kPoison, 4);
        }
      }
      allocs.emplace_back(num_pages);
      receivers.push_back(backend.make_receiver(c, ev.receiver("rx" + std::to_string(i))));
    }
  }

  // Reserves pages on every rank, registers the request, returns the descriptors.
  std::vector<TransferDescriptor> reserve(const std::string& id, int64_t tokens,
                                          const KvSharding& src, std::mt19937& rng,
                                          int64_t state_elems = 0, int64_t hidden_size = 0) {
    std::vector<TransferDescriptor> out;
    for (size_t i = 0; i < ranges.size(); ++i) {
      const auto& g = caches[i]->geometry();
      TransferDescriptor d;
      d.request_id = id;
      d.dst_address = receivers[i]->address();
      d.dst_pages = take_pages(allocs[i], tokens, g.page_size, rng);
      d.dst_heads = ranges[i];
      d.src = src;
      d.num_tokens = tokens;
      d.page_size = g.page_size;
      d.head_dim = g.head_dim;
      d.num_layers = g.num_layers;
      d.state_elems = state_elems;
      d.hidden_size = hidden_size;
      receivers[i]->expect(d);
      out.push_back(std::move(d));
    }
    return out;
  }

  // Rank i's cache holds exactly the completed requests' KV in their reserved rows and
  // poison everywhere else (pages in `ignore` are not checked).
  AssertionResult check(
      size_t i, const std::vector<std::pair<const Reference*, const TransferDescriptor*>>& done,
      const std::vector<int32_t>& ignore = {}) {
    KvCache& c = *caches[i];
    const auto& g = c.geometry();
    std::map<int32_t, std::pair<const Reference*, int64_t>> owner;  // page -> (ref, index)
    for (auto [ref, d] : done) {
      for (int64_t k = 0; k * g.page_size < d->num_tokens; ++k) {
        owner[d->dst_pages[static_cast<size_t>(k)]] = {ref, k};
      }
    }
    for (int64_t p = 0; p < g.num_pages; ++p) {
      if (std::find(ignore.begin(), ignore.end(), p) != ignore.end()) continue;
      auto it = owner.find(static_cast<int32_t>(p));
      for (int64_t l = 0; l < g.num_layers; ++l) {
        for (int64_t kv = 0; kv < 2; ++kv) {
          for (int64_t h = 0; h < g.num_kv_heads; ++h) {
            const float* rows = c.head_rows(l, p, static_cast<int>(kv), h);
            for (int64_t s = 0; s < g.page_size; ++s) {
              const Reference* ref = it == owner.end() ? nullptr : it->second.first;
              const int64_t t = it == owner.end() ? -1 : it->second.second * g.page_size + s;
              const bool data = ref != nullptr && t < ref->tokens;
              for (int64_t j = 0; j < g.head_dim; ++j) {
                const uint32_t got = bits(rows[s * g.head_dim + j]);
                const uint32_t want =
                    data ? bits(ref->row(l, kv, ranges[i].begin + h, t)[j]) : kPoison;
                if (got != want) {
                  return AssertionFailure()
                         << "rank " << i << " page " << p << " layer " << l << " kv " << kv
                         << " head " << h << " slot " << s << " dim " << j << ": got 0x" << std::hex
                         << got << ", want 0x" << want << (data ? " (data)" : " (poison)");
                }
              }
            }
          }
        }
      }
    }
    return AssertionSuccess();
  }

  std::vector<HeadRange> ranges;
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<PageAllocator> allocs;
  std::vector<std::unique_ptr<TransferReceiver>> receivers;
};

// A raw client speaking the wire format, to send what a dying sender would.
int connect_to(const std::string& address) {
  const auto colon = address.rfind(':');
  const int port = std::stoi(address.substr(colon + 1));
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

void send_bytes(int fd, const std::vector<uint8_t>& b, size_t n) {
  ASSERT_EQ(::send(fd, b.data(), n, MSG_NOSIGNAL), static_cast<ssize_t>(n));
}

std::unique_ptr<TransferBackend> backend(std::chrono::milliseconds timeout = 5s) {
  HostTcpOptions o;
  o.timeout = timeout;
  return make_host_tcp_backend(o);
}

// Runs one request through prefill -> decode, layers interleaved over the ranks, and checks
// every callback and every destination float.
void run_and_check(const ModelShape& m, int tp, int64_t src_page,
                   const std::vector<HeadRange>& dst_ranges, int64_t dst_page, int64_t tokens,
                   uint32_t seed) {
  SCOPED_TRACE("TP=" + std::to_string(tp) + " src page " + std::to_string(src_page) + " -> " +
               std::to_string(dst_ranges.size()) + " decode ranks, page " +
               std::to_string(dst_page) + ", " + std::to_string(tokens) + " tokens");
  auto b = backend();
  Events ev;
  std::mt19937 rng(seed);
  Prefill prefill(m, tp, src_page, *b, ev);
  Decode decode(m, dst_ranges, dst_page, *b, ev);
  const Reference ref(m, tokens, seed);
  const auto tables = prefill.store(ref, rng);
  const auto descs = decode.reserve("req", tokens, prefill.sharding, rng);
  prefill.begin_all("req", descs, tables);
  for (int64_t l = 0; l < m.layers; ++l) prefill.send_all("req", l);
  prefill.finish_all("req", 1234, -0.75f);
  for (size_t i = 0; i < dst_ranges.size(); ++i) {
    const auto e = ev.wait("rx" + std::to_string(i) + "/req");
    ASSERT_EQ(e.kind, "complete") << e.message;
    EXPECT_EQ(e.token, 1234);
    EXPECT_EQ(e.logprob, -0.75f);
    EXPECT_TRUE(decode.check(i, {{&ref, &descs[i]}}));
    EXPECT_FALSE(decode.receivers[i]->progress("req").has_value());
  }
  for (int r = 0; r < tp; ++r) {
    const auto e = ev.wait("tx" + std::to_string(r) + "/req");
    EXPECT_EQ(e.kind, "sent") << "rank " << r << ": " << e.message;
  }
  std::this_thread::sleep_for(5ms);  // no second callback trails the first
  for (size_t i = 0; i < dst_ranges.size(); ++i) {
    EXPECT_EQ(ev.of("rx" + std::to_string(i) + "/req").size(), 1u);
  }
}

TEST(TcpTransfer, MergeTp2IntoOneDecodeRankWithLargerPages) {
  run_and_check(ModelShape{4, 3, 8}, 2, 8, {{0, 4}}, 16, 37, 1);
}

TEST(TcpTransfer, ReplicatedHeadsTp4WithTwoKvHeadsSendEachHeadOnce) {
  const ModelShape m{2, 3, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(2);
  Prefill prefill(m, 4, 8, *b, ev);
  Decode decode(m, {{0, 2}}, 8, *b, ev);
  const Reference ref(m, 21, 2);
  const auto tables = prefill.store(ref, rng);  // ranks 1 and 3 hold biased copies
  const auto descs = decode.reserve("r", 21, prefill.sharding, rng);
  const auto p = decode.receivers[0]->progress("r");
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->senders_expected, 2);  // ranks 0 and 2
  EXPECT_EQ(p->pieces_expected, 2 * m.layers);
  prefill.begin_all("r", descs, tables);
  for (int64_t l = m.layers - 1; l >= 0; --l) prefill.send_all("r", l);  // any order
  prefill.finish_all("r", 7, -0.5f);
  const auto e = ev.wait("rx0/r");
  ASSERT_EQ(e.kind, "complete") << e.message;
  EXPECT_TRUE(decode.check(0, {{&ref, &descs[0]}}));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(ev.wait("tx" + std::to_string(r) + "/r").kind, "sent");
}

TEST(TcpTransfer, SplitTp1IntoDecodeRanksHoldingSubsets) {
  // One prefill rank (all 4 heads, page 16) -> two decode ranks holding [0, 1) and [1, 4)
  // (page 4): one source's heads spread over destinations.
  run_and_check(ModelShape{4, 2, 8}, 1, 16, {{0, 1}, {1, 4}}, 4, 30, 3);
}

TEST(TcpTransfer, EveryPrefillTpIntoEveryDecodeLayout) {
  const ModelShape m{4, 2, 4};
  const std::vector<std::vector<HeadRange>> layouts = {
      {{0, 4}},          // decode DP: all heads on the rank
      {{0, 2}, {2, 4}},  // decode TP=2
      {{0, 1}, {0, 1}, {1, 2}, {1, 2}, {2, 3}, {2, 3}, {3, 4}, {3, 4}},  // TP=8, replicated
  };
  uint32_t seed = 10;
  for (int tp : {1, 2, 4, 8}) {
    for (const auto& layout : layouts) run_and_check(m, tp, 4, layout, 8, 19, seed++);
  }
}

TEST(TcpTransfer, CompletesOnlyAfterTheLastPieceAndFinish) {
  const ModelShape m{4, 4, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(4);
  Prefill prefill(m, 2, 8, *b, ev);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const Reference ref(m, 40, 4);
  const auto tables = prefill.store(ref, rng);
  const auto descs = decode.reserve("r", 40, prefill.sharding, rng);
  prefill.begin_all("r", descs, tables);
  auto& rank0 = *prefill.senders[0];
  auto& rank1 = *prefill.senders[1];
  for (int64_t l = 0; l < m.layers; ++l) rank0.send_layer("r", l);
  rank0.finish("r", 5, -1.0f);
  ASSERT_EQ(ev.wait("tx0/r").kind, "sent");  // the receiver acknowledged rank 0's part
  for (int64_t l = m.layers - 1; l >= 1; --l) rank1.send_layer("r", l);
  auto& rx = *decode.receivers[0];
  ASSERT_TRUE(poll_until([&] { return rx.progress("r")->pieces_received == 2 * m.layers - 1; }));
  std::this_thread::sleep_for(30ms);
  EXPECT_TRUE(ev.of("rx0/r").empty()) << "completed with a piece missing";
  rank1.send_layer("r", 0);
  ASSERT_TRUE(poll_until([&] { return rx.progress("r")->pieces_received == 2 * m.layers; }));
  std::this_thread::sleep_for(30ms);
  EXPECT_TRUE(ev.of("rx0/r").empty()) << "completed before rank 1's finish";
  EXPECT_EQ(rx.progress("r")->senders_finished, 1);
  rank1.finish("r", 5, -1.0f);
  const auto e = ev.wait("rx0/r");
  ASSERT_EQ(e.kind, "complete") << e.message;
  EXPECT_EQ(e.token, 5);
  EXPECT_TRUE(decode.check(0, {{&ref, &descs[0]}}));
}

// Receiver callbacks over ev's that also record the order they ran in ("state r", "hidden r",
// "complete r") and keep the states and hidden states that arrived.
struct Recorded {
  std::mutex mu;
  std::vector<std::string> order;
  std::map<std::string, std::vector<float>> states;
  std::map<std::string, PromptHidden> hidden;
  ReceiverCallbacks callbacks(Events& ev, const std::string& name) {
    ReceiverCallbacks cbs = ev.receiver(name);
    auto complete = cbs.on_complete;
    cbs.on_complete = [this, complete](const std::string& r, int32_t t, float lp) {
      {
        std::lock_guard lock(mu);
        order.push_back("complete " + r);
      }
      complete(r, t, lp);
    };
    cbs.on_state = [this](const std::string& r, std::vector<float> s) {
      std::lock_guard lock(mu);
      order.push_back("state " + r);
      states[r] = std::move(s);
    };
    cbs.on_hidden = [this](const std::string& r, PromptHidden h) {
      std::lock_guard lock(mu);
      order.push_back("hidden " + r);
      hidden[r] = std::move(h);
    };
    return cbs;
  }
};

// A prefill instance of tp ranks (8-token pages) and one decode rank holding KV heads [0, 2)
// (16-token pages) whose receiver records what arrives (Recorded).
struct PrefillToOneDecode {
  Events ev;
  Prefill prefill;
  Decode decode;
  Recorded rec;
  PrefillToOneDecode(const ModelShape& m, int tp, TransferBackend& b)
      : prefill(m, tp, 8, b, ev), decode(m, {{0, 2}}, 16, b, ev) {
    decode.receivers[0] = b.make_receiver(*decode.caches[0], rec.callbacks(ev, "rx0"));
  }
};

// Hybrid models: the recurrent state travels with the FINISH of the rank that sends it and
// reaches on_state (before on_complete) bit for bit; a request whose senders all finish without
// it fails; a state of the wrong size is refused at the sender.
TEST(TcpTransfer, RecurrentStateTravelsWithTheFinish) {
  const ModelShape m{2, 3, 8};  // 2 KV heads, 3 layers
  auto b = backend();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> ud(-2.f, 2.f);
  std::vector<float> state(1000);  // the FINISH body: 8 + 4000 bytes
  for (float& v : state) v = ud(rng);
  for (int tp : {1, 2}) {
    SCOPED_TRACE("prefill tp " + std::to_string(tp));
    PrefillToOneDecode cluster(m, tp, *b);
    auto& [ev, prefill, decode, rec] = cluster;
    const Reference ref(m, 20, 3);
    // "s": rank 0 sends the state; "n": nobody does; "w": a state of another size.
    for (const std::string id : {"s", "n", "w"}) {
      const auto tables = prefill.store(ref, rng);
      const auto descs =
          decode.reserve(id, 20, prefill.sharding, rng, static_cast<int64_t>(state.size()));
      prefill.begin_all(id, descs, tables);
      for (int64_t l = 0; l < m.layers; ++l) prefill.send_all(id, l);
      if (id == "w") {
        EXPECT_THROW(prefill.senders[0]->finish_with_state(id, 7, -0.5f,
                                                           std::vector<float>(state.size() - 1)),
                     Error);
        for (auto& s : prefill.senders) s->abort(id);
        decode.receivers[0]->cancel(id);
        continue;
      }
      for (size_t r = 0; r < prefill.senders.size(); ++r) {
        if (id == "s" && r == 0) {
          prefill.senders[r]->finish_with_state(id, 7, -0.5f, state);
        } else {
          prefill.senders[r]->finish(id, 7, -0.5f);
        }
      }
      const auto e = ev.wait("rx0/" + id);
      if (id == "s") {
        ASSERT_EQ(e.kind, "complete") << e.message;
        EXPECT_EQ(e.token, 7);
        std::lock_guard lock(rec.mu);
        EXPECT_EQ(rec.states["s"], state);
        EXPECT_EQ(rec.order, (std::vector<std::string>{"state s", "complete s"}));
      } else {
        EXPECT_EQ(e.kind, "error");
        EXPECT_NE(e.message.find("recurrent state"), std::string::npos) << e.message;
        std::lock_guard lock(rec.mu);
        EXPECT_FALSE(rec.states.contains("n"));
      }
    }
    // A plain (attention-only) request on the same receiver still completes without one.
    const auto tables = prefill.store(ref, rng);
    const auto descs = decode.reserve("plain", 20, prefill.sharding, rng);
    prefill.begin_all("plain", descs, tables);
    for (int64_t l = 0; l < m.layers; ++l) prefill.send_all("plain", l);
    EXPECT_THROW(prefill.senders[0]->finish_with_state("plain", 3, 0.f, state), Error);
    prefill.finish_all("plain", 3, 0.f);
    EXPECT_EQ(ev.wait("rx0/plain").kind, "complete");
  }
}

// MTP on the decode side (descriptor hidden_size > 0): the prompt's final hidden states travel
// from one sending rank (HIDDEN, before its FINISH) and reach on_hidden (after on_state, before
// on_complete) bit for bit, from row 0 or from a later row (a prefix-cache hit at the prefill);
// a request whose senders all finish without them fails; rows that do not end at num_tokens,
// or hidden states to a destination that asked for none, are refused at the sender.
TEST(TcpTransfer, PromptHiddenStatesTravelBeforeTheFinish) {
  const ModelShape m{2, 3, 8};  // 2 KV heads, 3 layers
  auto b = backend();
  EXPECT_TRUE(b->carries_prompt_hidden());
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> ud(-2.f, 2.f);
  constexpr int64_t kTokens = 20, kHidden = 6;
  std::vector<float> rows(static_cast<size_t>(kTokens * kHidden));
  for (float& v : rows) v = ud(rng);
  const std::vector<float> state = {1.f, 2.f, 3.f};
  for (int tp : {1, 2}) {
    SCOPED_TRACE("prefill tp " + std::to_string(tp));
    PrefillToOneDecode cluster(m, tp, *b);
    auto& [ev, prefill, decode, rec] = cluster;
    auto& got = rec.hidden;
    const Reference ref(m, kTokens, 3);
    // "a": every row from rank 0 (with a recurrent state too); "p": rows 8.. from the last
    // rank; "n": nobody sends them; "w": rows that stop short of the prompt's end.
    for (const std::string id : {"a", "p", "n", "w"}) {
      const auto tables = prefill.store(ref, rng);
      const int64_t state_elems = id == "a" ? 3 : 0;
      const auto descs = decode.reserve(id, kTokens, prefill.sharding, rng, state_elems, kHidden);
      prefill.begin_all(id, descs, tables);
      for (int64_t l = 0; l < m.layers; ++l) prefill.send_all(id, l);
      const size_t sender = id == "p" ? prefill.senders.size() - 1 : 0;
      const int64_t begin = id == "p" ? 8 : 0;
      PromptHidden h{begin, std::vector<float>(rows.begin() + begin * kHidden, rows.end())};
      if (id == "w") {
        h.rows.resize(h.rows.size() - kHidden);
        EXPECT_THROW(prefill.senders[0]->finish_with(id, 7, -0.5f, {{}, h}), Error);
        for (auto& s : prefill.senders) s->abort(id);
        decode.receivers[0]->cancel(id);
        continue;
      }
      for (size_t r = 0; r < prefill.senders.size(); ++r) {
        if (id != "n" && r == sender) {
          prefill.senders[r]->finish_with(id, 7, -0.5f,
                                          {id == "a" ? state : std::vector<float>{}, h});
        } else {
          prefill.senders[r]->finish(id, 7, -0.5f);
        }
      }
      const auto e = ev.wait("rx0/" + id);
      std::lock_guard lock(rec.mu);
      if (id == "n") {
        EXPECT_EQ(e.kind, "error");
        EXPECT_NE(e.message.find("hidden states"), std::string::npos) << e.message;
        EXPECT_FALSE(got.contains("n"));
        continue;
      }
      ASSERT_EQ(e.kind, "complete") << e.message;
      EXPECT_EQ(got[id].begin, begin);
      EXPECT_EQ(got[id].rows, h.rows);  // bit for bit (f32 on the wire)
    }
    {
      std::lock_guard lock(rec.mu);
      EXPECT_EQ(rec.order, (std::vector<std::string>{"state a", "hidden a", "complete a",
                                                     "hidden p", "complete p"}));
    }
    // A request that asked for none: hidden states are refused; it completes without.
    const auto tables = prefill.store(ref, rng);
    const auto descs = decode.reserve("plain", kTokens, prefill.sharding, rng);
    prefill.begin_all("plain", descs, tables);
    for (int64_t l = 0; l < m.layers; ++l) prefill.send_all("plain", l);
    EXPECT_THROW(prefill.senders[0]->finish_with("plain", 3, 0.f, {{}, {0, rows}}), Error);
    prefill.finish_all("plain", 3, 0.f);
    EXPECT_EQ(ev.wait("rx0/plain").kind, "complete");
  }
}

TEST(TcpTransfer, ChunkedPrefillStreamsEachChunkOfEachLayer) {
  // Chunks of 10, 17 and 10 tokens (as a chunked-prefill scheduler runs them), each sent per
  // layer right after it; chunk edges cross both sides' pages (prefill 8, decode 16).
  const ModelShape m{4, 3, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(12);
  Prefill prefill(m, 2, 8, *b, ev);
  Decode decode(m, {{0, 4}}, 16, *b, ev);
  const Reference ref(m, 37, 12);
  const auto tables = prefill.store(ref, rng);
  const auto descs = decode.reserve("chunked", 37, prefill.sharding, rng);
  prefill.begin_all("chunked", descs, tables);
  auto& rx = *decode.receivers[0];
  const int64_t edges[] = {0, 10, 27, 37};
  for (int c = 0; c < 3; ++c) {
    for (int64_t l = 0; l < m.layers; ++l) {
      for (auto& s : prefill.senders) s->send_layer("chunked", l, {edges[c], edges[c + 1]});
    }
    if (c < 2) {
      // Pieces count once a layer is whole: none until the last chunk.
      std::this_thread::sleep_for(10ms);
      EXPECT_EQ(rx.progress("chunked")->pieces_received, 0);
    }
  }
  prefill.finish_all("chunked", 77, -3.0f);
  const auto e = ev.wait("rx0/chunked");
  ASSERT_EQ(e.kind, "complete") << e.message;
  EXPECT_TRUE(decode.check(0, {{&ref, &descs[0]}}));
}

TEST(TcpTransfer, ReceiverRefusesTokenRangesThatDoNotFollowOn) {
  const ModelShape m{4, 2, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(13);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const auto descs = decode.reserve("gap", 20, KvSharding{4, 1}, rng);
  const int fd = connect_to(descs[0].dst_address);
  wire::Hello h;
  h.request_id = "gap";
  h.src = KvSharding{4, 1};
  h.heads = {0, 4};
  h.num_layers = m.layers;
  h.num_tokens = 20;
  h.head_dim = m.head_dim;
  const auto hello = wire::encode_hello(h);
  send_bytes(fd, hello, hello.size());
  const auto piece = wire::encode_layer({1, 5, 10}, packed_layer_elems(4, 5, m.head_dim));
  send_bytes(fd, piece, piece.size());
  const auto e = ev.wait("rx0/gap");
  ::close(fd);
  ASSERT_EQ(e.kind, "error");
  EXPECT_THAT(e.message, HasSubstr("layer 1 tokens [5, 10) with 5 rows of data do not follow on "
                                   "from token 0 of 20"));
  EXPECT_TRUE(decode.check(0, {}));
}

TEST(TcpTransfer, KilledSenderFailsOnlyItsRequest) {
  const ModelShape m{4, 4, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(5);
  Prefill doomed(m, 1, 8, *b, ev), healthy(m, 1, 8, *b, ev);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const Reference ref_a(m, 33, 51), ref_b(m, 29, 52);
  const auto tables_a = doomed.store(ref_a, rng);
  const auto tables_b = healthy.store(ref_b, rng);
  const auto descs_a = decode.reserve("a", 33, doomed.sharding, rng);
  const auto descs_b = decode.reserve("b", 29, healthy.sharding, rng);
  doomed.begin_all("a", descs_a, tables_a);
  healthy.begin_all("b", descs_b, tables_b);
  for (int64_t l = 0; l < 2; ++l) {
    doomed.send_all("a", l);
    healthy.send_all("b", l);
  }
  auto& rx = *decode.receivers[0];
  ASSERT_TRUE(poll_until([&] { return rx.progress("a")->pieces_received == 2; }));
  doomed.senders.clear();  // the prefill process dies: its sockets close mid-transfer
  const auto e = ev.wait("rx0/a");
  ASSERT_EQ(e.kind, "error");
  EXPECT_THAT(e.message, HasSubstr("request 'a'"));
  EXPECT_THAT(e.message, HasSubstr("source rank 0 (127.0.0.1:"));
  EXPECT_THAT(e.message, HasSubstr("closed the connection after 2 of 4 layers"));
  EXPECT_FALSE(rx.progress("a").has_value());

  for (int64_t l = 2; l < m.layers; ++l) healthy.send_all("b", l);
  healthy.finish_all("b", 9, -0.125f);
  const auto done = ev.wait("rx0/b");
  ASSERT_EQ(done.kind, "complete") << done.message;
  EXPECT_EQ(ev.wait("tx0/b").kind, "sent");
  // b is exact; a's pages may hold partial data (the engine frees them), all else is poison.
  EXPECT_TRUE(decode.check(0, {{&ref_b, &descs_b[0]}}, descs_a[0].dst_pages));
  EXPECT_EQ(ev.of("rx0/a").size(), 1u);
}

TEST(TcpTransfer, AbortOnASharedSenderFailsOnlyThatRequest) {
  const ModelShape m{4, 3, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(6);
  Prefill prefill(m, 2, 8, *b, ev, 48);
  Decode decode(m, {{0, 4}}, 16, *b, ev);
  const Reference ref_a(m, 50, 61), ref_b(m, 45, 62);
  const auto tables_a = prefill.store(ref_a, rng);
  const auto tables_b = prefill.store(ref_b, rng);
  const auto descs_a = decode.reserve("a", 50, prefill.sharding, rng);
  const auto descs_b = decode.reserve("b", 45, prefill.sharding, rng);
  prefill.begin_all("a", descs_a, tables_a);
  prefill.begin_all("b", descs_b, tables_b);
  prefill.send_all("a", 0);
  prefill.send_all("b", 0);
  auto& rx = *decode.receivers[0];
  ASSERT_TRUE(poll_until([&] { return rx.progress("a")->pieces_received == 2; }));
  prefill.senders[1]->abort("a");  // e.g. the client went away during prefill
  for (int64_t l = 1; l < m.layers; ++l) prefill.send_all("b", l);
  prefill.finish_all("b", 11, -2.0f);
  ASSERT_EQ(ev.wait("rx0/b").kind, "complete");
  const auto e = ev.wait("rx0/a");
  ASSERT_EQ(e.kind, "error");
  EXPECT_THAT(e.message, HasSubstr("request 'a'"));
  EXPECT_THAT(e.message, HasSubstr("source rank 1"));
  // Rank 0 learns that its part of 'a' is void; the aborting rank gets no callback.
  prefill.senders[0]->send_layer("a", 1);  // a no-op once failed
  const auto e0 = ev.wait("tx0/a");
  EXPECT_EQ(e0.kind, "error");
  EXPECT_THAT(e0.message, HasSubstr("failed at the receiver"));
  EXPECT_TRUE(ev.of("tx1/a").empty());
  EXPECT_TRUE(decode.check(0, {{&ref_b, &descs_b[0]}}, descs_a[0].dst_pages));
}

TEST(TcpTransfer, TruncatedPieceNeverReachesThePages) {
  const ModelShape m{4, 3, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(7);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const auto descs = decode.reserve("t", 20, KvSharding{4, 1}, rng);
  const int fd = connect_to(descs[0].dst_address);
  wire::Hello h;
  h.request_id = "t";
  h.src = KvSharding{4, 1};
  h.heads = {0, 4};
  h.num_layers = m.layers;
  h.num_tokens = 20;
  h.head_dim = m.head_dim;
  const auto hello = wire::encode_hello(h);
  send_bytes(fd, hello, hello.size());
  auto layer = wire::encode_layer({0, 0, 20}, packed_layer_elems(4, 20, m.head_dim));
  std::fill(layer.begin() + wire::kHeaderBytes + wire::kLayerPrefixBytes, layer.end(), 0x11);
  send_bytes(fd, layer, layer.size() / 2);
  std::this_thread::sleep_for(20ms);  // the receiver is now inside the LAYER body
  ::close(fd);
  const auto e = ev.wait("rx0/t");
  ASSERT_EQ(e.kind, "error");
  EXPECT_THAT(e.message, HasSubstr("closed the connection after 0 of 3 layers"));
  EXPECT_TRUE(decode.check(0, {}));  // every float still poison
}

TEST(TcpTransfer, BadDescriptorsAreRefusedWithClearErrors) {
  const ModelShape m{4, 2, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(8);
  Decode decode(m, {{0, 4}}, 8, *b, ev, 6);
  auto& rx = *decode.receivers[0];
  TransferDescriptor d;
  d.request_id = "bad";
  d.dst_address = rx.address();
  d.dst_pages = {0, 99};
  d.dst_heads = {0, 4};
  d.src = KvSharding{4, 2};
  d.num_tokens = 12;
  d.page_size = 8;
  d.head_dim = m.head_dim;
  d.num_layers = m.layers;
  auto expect_error = [](auto&& fn, const std::string& text) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one containing: " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_THAT(e.message(), HasSubstr(text));
      EXPECT_THAT(e.message(), HasSubstr("request 'bad'"));
    }
  };
  expect_error([&] { rx.expect(d); }, "page id 99 out of range [0, 6)");
  d.dst_pages = {3, 3};
  expect_error([&] { rx.expect(d); }, "page id 3 appears twice");
  d.dst_pages = {2};
  expect_error([&] { rx.expect(d); }, "1 destination pages cannot hold 12 tokens");
  d.dst_pages = {2, 3};
  d.dst_heads = {0, 2};
  expect_error([&] { rx.expect(d); }, "head range mismatch");
  d.dst_heads = {2, 6};
  expect_error([&] { rx.expect(d); }, "head range mismatch");
  d.dst_heads = {0, 4};
  rx.expect(d);
  expect_error([&] { rx.expect(d); }, "already expected");
  auto d2 = d;
  d2.request_id = "bad2";
  try {
    rx.expect(d2);  // pages 2 and 3 are being written for 'bad'
    ADD_FAILURE() << "overlapping reservation accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(),
                HasSubstr("page 2 is already reserved for the transfer of request 'bad'"));
  }

  // Sender side: the descriptor must fit the rank.
  Prefill prefill(m, 2, 8, *b, ev);
  auto& tx = *prefill.senders[0];
  auto wrong = d;
  wrong.src = KvSharding{4, 4};
  expect_error([&] { tx.begin("bad", {wrong}, {0, 1}); }, "head range mismatch");
  expect_error([&] { tx.begin("bad", {d}, {0}); }, "1 source pages cannot hold 12 tokens");
  expect_error([&] { tx.begin("bad", {d}, {0, 77}); }, "source page id 77 out of range");
  expect_error([&] { tx.send_layer("bad", 0); }, "was not begun");
  tx.begin("bad", {d}, {0, 1});
  tx.send_layer("bad", 0);
  expect_error([&] { tx.send_layer("bad", 0); }, "layer 0 was already sent whole");
  tx.send_layer("bad", 1, {0, 5});
  expect_error(
      [&] {
        tx.send_layer("bad", 1, {6, 12});
      },
      "layer 1 tokens [6, 12) do not follow on from token 5 of 12");
  expect_error([&] { tx.finish("bad", 1, 0.0f); },
               "finish before layer 1 was whole (tokens [5, 12) not sent)");
  tx.abort("bad");
  rx.cancel("bad");  // the receiver may have reported the closed connection already
}

TEST(TcpTransfer, DisagreeingSidesUnknownRequestsAndRefusedConnectionsFail) {
  const ModelShape m{4, 2, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(9);
  Prefill prefill(m, 1, 8, *b, ev);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const Reference ref(m, 16, 9);
  const auto tables = prefill.store(ref, rng);
  auto& tx = *prefill.senders[0];

  // The receiver registered 16 tokens; the sender's descriptor says 15.
  auto descs = decode.reserve("m", 16, prefill.sharding, rng);
  descs[0].num_tokens = 15;
  tx.begin("m", descs, tables[0]);
  const auto rx_err = ev.wait("rx0/m");
  ASSERT_EQ(rx_err.kind, "error");
  EXPECT_THAT(rx_err.message, HasSubstr("request 'm'"));
  EXPECT_THAT(rx_err.message, HasSubstr("source rank 0 (127.0.0.1:"));
  EXPECT_THAT(rx_err.message, HasSubstr("15 tokens"));
  const auto tx_err = ev.wait("tx0/m");
  ASSERT_EQ(tx_err.kind, "error");
  EXPECT_THAT(tx_err.message, HasSubstr("request 'm' to " + descs[0].dst_address));
  EXPECT_THAT(tx_err.message, HasSubstr("receiver:"));
  tx.send_layer("m", 0);  // no-ops after the failure
  tx.send_layer("m", 1);
  tx.finish("m", 0, 0.0f);

  // A request the receiver never expected.
  auto unknown = descs;
  unknown[0].request_id = "u";
  unknown[0].num_tokens = 16;
  tx.begin("u", unknown, tables[0]);
  const auto u = ev.wait("tx0/u");
  ASSERT_EQ(u.kind, "error");
  EXPECT_THAT(u.message, HasSubstr("request 'u' is not expected by this receiver"));
  tx.abort("u");

  // Nobody listens at the destination.
  std::string dead;
  {
    KvCache c(KvGeometry{m.layers, 4, 4, 8, m.head_dim});
    dead = b->make_receiver(c, {})->address();
  }
  auto refused = unknown;
  refused[0].request_id = "x";
  refused[0].dst_address = dead;
  tx.begin("x", refused, tables[0]);
  const auto x = ev.wait("tx0/x");
  ASSERT_EQ(x.kind, "error");
  EXPECT_THAT(x.message, HasSubstr("request 'x' to " + dead + " failed: cannot connect"));
  tx.abort("x");
  EXPECT_TRUE(decode.check(0, {}, descs[0].dst_pages));
}

TEST(TcpTransfer, ReceiverTimesOutARequestThatStalls) {
  const ModelShape m{4, 2, 8};
  auto b = backend(150ms);
  Events ev;
  std::mt19937 rng(10);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  decode.reserve("slow", 10, KvSharding{4, 1}, rng);
  const auto e = ev.wait("rx0/slow", 3s);
  ASSERT_EQ(e.kind, "error");
  EXPECT_THAT(e.message, HasSubstr("request 'slow' failed: timed out: no data for 150 ms (0 of 2"));
}

TEST(TcpTransfer, CancelStopsWritesAndCallbacks) {
  const ModelShape m{4, 3, 8};
  auto b = backend();
  Events ev;
  std::mt19937 rng(11);
  Prefill prefill(m, 1, 8, *b, ev);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const Reference ref(m, 24, 11);
  const auto tables = prefill.store(ref, rng);
  const auto descs = decode.reserve("c", 24, prefill.sharding, rng);
  auto& rx = *decode.receivers[0];
  auto& tx = *prefill.senders[0];
  tx.begin("c", descs, tables[0]);
  tx.send_layer("c", 0);
  ASSERT_TRUE(poll_until([&] { return rx.progress("c")->pieces_received == 1; }));
  EXPECT_TRUE(rx.cancel("c"));
  EXPECT_FALSE(rx.cancel("c"));
  const KvCache& cache = *decode.caches[0];
  const std::vector<float> snapshot(cache.layer(1),
                                    cache.layer(1) + 24 * cache.geometry().page_elems());
  tx.send_layer("c", 1);
  tx.send_layer("c", 2);
  tx.finish("c", 3, 0.0f);
  const auto e = ev.wait("tx0/c");
  ASSERT_EQ(e.kind, "error");
  EXPECT_THAT(e.message, HasSubstr("cancelled by the receiver"));
  std::this_thread::sleep_for(20ms);
  EXPECT_TRUE(ev.of("rx0/c").empty());  // no callback after a successful cancel
  EXPECT_EQ(std::memcmp(snapshot.data(), cache.layer(1), snapshot.size() * 4), 0)
      << "pages written after cancel()";
}

// ---- The cluster key (net/cluster_auth.h) on the KV transfer. ----

net::KeyRef test_key(char c) { return net::ClusterKey::from_bytes(std::string(32, c)); }

std::unique_ptr<TransferBackend> keyed_backend(net::KeyRef key,
                                               std::chrono::milliseconds timeout = 5s) {
  HostTcpOptions o;
  o.timeout = timeout;
  o.key = std::move(key);
  return make_host_tcp_backend(o);
}

// Captures the refusal log lines while alive.
class AuthLog {
 public:
  AuthLog() {
    prev_ = net::set_log([this](const std::string& l) {
      std::lock_guard lock(mu_);
      lines_.push_back(l);
    });
  }
  ~AuthLog() { net::set_log(prev_); }
  std::vector<std::string> lines() {
    std::lock_guard lock(mu_);
    return lines_;
  }

 private:
  std::function<void(const std::string&)> prev_;
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// The whole HELLO + LAYER 0 stream a sender would write for request `id` (no handshake).
std::vector<uint8_t> forged_stream(const ModelShape& m, const std::string& id, int64_t tokens) {
  wire::Hello h;
  h.request_id = id;
  h.src = KvSharding{m.heads, 1};
  h.heads = {0, m.heads};
  h.num_layers = m.layers;
  h.num_tokens = tokens;
  h.head_dim = m.head_dim;
  auto bytes = wire::encode_hello(h);
  auto layer = wire::encode_layer({0, 0, tokens}, packed_layer_elems(m.heads, tokens, m.head_dim));
  std::fill(layer.begin() + wire::kHeaderBytes + wire::kLayerPrefixBytes, layer.end(), 0x11);
  bytes.insert(bytes.end(), layer.begin(), layer.end());
  return bytes;
}

// True once the peer closed fd (reads to EOF or error within the timeout).
bool closed_by_peer(int fd, std::chrono::milliseconds timeout = 5s) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

// Sends the request's whole KV from a keyed prefill into `decode` and checks it arrived.
void complete_keyed(const ModelShape& m, TransferBackend& b, Events& ev, Decode& decode,
                    const std::string& id, const std::vector<TransferDescriptor>& descs,
                    std::mt19937& rng, const Reference& ref) {
  Prefill prefill(m, 1, 8, b, ev);
  const auto tables = prefill.store(ref, rng);
  prefill.begin_all(id, descs, tables);
  for (int64_t l = 0; l < m.layers; ++l) prefill.send_all(id, l);
  prefill.finish_all(id, 77, -0.5f);
  const auto e = ev.wait("rx0/" + id);
  ASSERT_EQ(e.kind, "complete") << e.message;
  EXPECT_EQ(e.token, 77);
  EXPECT_TRUE(decode.check(0, {{&ref, &descs[0]}}));
}

TEST(TcpTransferAuth, KeyedSidesTransferAsBefore) {
  const ModelShape m{4, 3, 8};
  const uint64_t before = net::failures(net::Channel::kKvTransfer);
  auto b = keyed_backend(test_key('a'));
  Events ev;
  std::mt19937 rng(21);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const Reference ref(m, 20, 21);
  const auto descs = decode.reserve("k", 20, KvSharding{4, 1}, rng);
  complete_keyed(m, *b, ev, decode, "k", descs, rng, ref);
  EXPECT_EQ(net::failures(net::Channel::kKvTransfer), before);
}

// A forged KV write into reserved pages by a peer without the key (the wire format alone, as
// any pod could send it): refused before a byte of it is read as a message, logged with the
// peer's address and counted; the pages keep their poison, the request is not failed, and the
// real sender completes it afterwards.
TEST(TcpTransferAuth, ForgedWriteWithoutTheKeyIsRefused) {
  const ModelShape m{4, 3, 8};
  AuthLog log;
  const uint64_t before = net::failures(net::Channel::kKvTransfer);
  auto b = keyed_backend(test_key('a'));
  Events ev;
  std::mt19937 rng(22);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const auto descs = decode.reserve("victim", 20, KvSharding{4, 1}, rng);
  const int fd = connect_to(descs[0].dst_address);
  const auto forged = forged_stream(m, "victim", 20);
  ::send(fd, forged.data(), forged.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(closed_by_peer(fd));
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
  ::close(fd);
  ASSERT_TRUE(poll_until([&] { return net::failures(net::Channel::kKvTransfer) == before + 1; }));
  const auto lines = log.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("refused kv-transfer connection with 127.0.0.1:" +
                                  std::to_string(ntohs(local.sin_port))));
  EXPECT_THAT(lines[0], HasSubstr("no cluster-key handshake"));
  EXPECT_TRUE(decode.check(0, {}));          // every float still poison
  EXPECT_TRUE(ev.of("rx0/victim").empty());  // the request was not failed by the forger
  ASSERT_TRUE(decode.receivers[0]->progress("victim").has_value());
  const Reference ref(m, 20, 22);
  complete_keyed(m, *b, ev, decode, "victim", descs, rng, ref);  // the receiver serves on
}

// A sender with another key, and one with none: both refused at the receiver (counted there),
// the sender's request fails with a clear error, the receiver's request stays expected.
TEST(TcpTransferAuth, WrongKeyAndNoKeySendersAreRefused) {
  const ModelShape m{4, 2, 8};
  AuthLog log;
  auto rx_backend = keyed_backend(test_key('a'));
  Events ev;
  std::mt19937 rng(23);
  Decode decode(m, {{0, 4}}, 8, *rx_backend, ev);
  const Reference ref(m, 12, 23);
  const auto descs = decode.reserve("r", 12, KvSharding{4, 1}, rng);
  std::vector<std::unique_ptr<TransferBackend>> senders;
  senders.push_back(keyed_backend(test_key('b')));
  senders.push_back(backend());
  int n = 0;
  for (auto& tx_backend : senders) {
    SCOPED_TRACE(n == 0 ? "wrong key" : "no key");
    const uint64_t before = net::failures_total();
    Events tx_ev;
    Prefill prefill(m, 1, 8, *tx_backend, tx_ev);
    const auto tables = prefill.store(ref, rng);
    prefill.begin_all("r", descs, tables);
    for (int64_t l = 0; l < m.layers; ++l) prefill.send_all("r", l);
    prefill.finish_all("r", 1, 0.0f);
    const auto e = tx_ev.wait("tx0/r");
    ASSERT_EQ(e.kind, "error");
    if (n == 0) EXPECT_THAT(e.message, HasSubstr("cluster key: the server does not hold"));
    // Counted where it was refused (and, for the wrong key, by the sender too).
    ASSERT_TRUE(poll_until([&] { return net::failures_total() >= before + (n == 0 ? 2 : 1); }));
    EXPECT_TRUE(decode.check(0, {}));
    EXPECT_TRUE(ev.of("rx0/r").empty());
    ++n;
  }
  complete_keyed(m, *rx_backend, ev, decode, "r", descs, rng, ref);
}

// A recorded handshake replayed byte for byte: the receiver's nonce is fresh, so the recorded
// proof is wrong; refused, the request untouched.
TEST(TcpTransferAuth, ReplayedHandshakeIsRefused) {
  const ModelShape m{4, 2, 8};
  AuthLog log;
  const auto key = test_key('a');
  auto b = keyed_backend(key);
  Events ev;
  std::mt19937 rng(24);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const auto descs = decode.reserve("p", 12, KvSharding{4, 1}, rng);
  // Record a genuine client's HELLO and PROOF.
  net::ClientHandshake genuine(*key, net::Channel::kKvTransfer);
  std::array<uint8_t, net::kProofBytes> proof{};
  {
    const int fd = connect_to(descs[0].dst_address);
    ::send(fd, genuine.hello().data(), genuine.hello().size(), MSG_NOSIGNAL);
    std::array<uint8_t, net::kChallengeBytes> challenge{};
    ASSERT_EQ(::recv(fd, challenge.data(), challenge.size(), MSG_WAITALL),
              static_cast<ssize_t>(challenge.size()));
    proof = genuine.respond(challenge);
    ::close(fd);  // (gone before proving: counted as a failure too)
  }
  ASSERT_TRUE(poll_until([&] { return log.lines().size() == 1; }));
  const uint64_t before = net::failures(net::Channel::kKvTransfer);
  const int fd = connect_to(descs[0].dst_address);
  ::send(fd, genuine.hello().data(), genuine.hello().size(), MSG_NOSIGNAL);
  std::array<uint8_t, net::kChallengeBytes> challenge{};
  ASSERT_EQ(::recv(fd, challenge.data(), challenge.size(), MSG_WAITALL),
            static_cast<ssize_t>(challenge.size()));
  ::send(fd, proof.data(), proof.size(), MSG_NOSIGNAL);
  const auto forged = forged_stream(m, "p", 12);
  ::send(fd, forged.data(), forged.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(closed_by_peer(fd));
  ::close(fd);
  ASSERT_TRUE(poll_until([&] { return net::failures(net::Channel::kKvTransfer) == before + 1; }));
  EXPECT_THAT(log.lines().back(), HasSubstr("wrong cluster key"));
  EXPECT_TRUE(decode.check(0, {}));
  EXPECT_TRUE(ev.of("rx0/p").empty());
}

// The right key, then garbage: the handshake passes, the garbage is refused as a malformed
// stream (the connection closed), nothing written, the request still expected.
TEST(TcpTransferAuth, CorrectKeyThenGarbageIsRefused) {
  const ModelShape m{4, 2, 8};
  const auto key = test_key('a');
  auto b = keyed_backend(key);
  Events ev;
  std::mt19937 rng(25);
  Decode decode(m, {{0, 4}}, 8, *b, ev);
  const auto descs = decode.reserve("g", 12, KvSharding{4, 1}, rng);
  const uint64_t before = net::failures_total();
  const int fd = connect_to(descs[0].dst_address);
  net::authenticate_client(fd, *key, net::Channel::kKvTransfer, "receiver");
  std::vector<uint8_t> garbage(4096);
  std::mt19937 g(5);
  for (auto& x : garbage) x = static_cast<uint8_t>(g());
  ::send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL);
  ::shutdown(fd, SHUT_WR);
  // The receiver answers with an error reply, then closes.
  std::array<uint8_t, wire::kReplyHeaderBytes> head{};
  ASSERT_EQ(::recv(fd, head.data(), head.size(), MSG_WAITALL), static_cast<ssize_t>(head.size()));
  uint32_t msg_bytes = 0;
  EXPECT_FALSE(wire::decode_reply_header(head, msg_bytes));
  std::string message(msg_bytes, '\0');
  ::recv(fd, message.data(), message.size(), MSG_WAITALL);
  EXPECT_THAT(message, HasSubstr("not a KV transfer stream"));
  ::close(fd);
  EXPECT_EQ(net::failures_total(), before);  // it held the key: a protocol error, not auth
  EXPECT_TRUE(decode.check(0, {}));
  EXPECT_TRUE(ev.of("rx0/g").empty());
  const Reference ref(m, 12, 25);
  complete_keyed(m, *b, ev, decode, "g", descs, rng, ref);
}

// Without a key on either side: today's behaviour (no handshake).
TEST(TcpTransferAuth, KeylessModeStillWorks) {
  run_and_check(ModelShape{4, 2, 8}, 2, 8, {{0, 4}}, 4, 13, 26);
}

}  // namespace
}  // namespace tandem::transfer
