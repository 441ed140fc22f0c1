// The router <-> instance control protocol under the cluster key (net/cluster_auth.h) and its
// limits: a router with the key is served; a peer with a wrong key, no key, a replayed
// handshake, or the key and then garbage is refused (closed, logged with its address, counted)
// and nothing is admitted, while the instance keeps serving; a frame claiming more than the
// limit closes its connection only; the key-less mode is unchanged.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "disagg/instance_api.h"
#include "disagg/protocol.h"
#include "net/cluster_auth.h"
#include "server/http/instance_metrics.h"

namespace tandem {
namespace {

using namespace std::chrono_literals;

// A decode instance that admits everything and remembers what it admitted.
class CountingDecode final : public DecodeClient {
 public:
  std::optional<transfer::TransferDescriptor> accept(const GenRequest& req,
                                                     const transfer::KvSharding&,
                                                     OutputCallback) override {
    std::lock_guard<std::mutex> lock(mu_);
    admitted_.push_back(req.id);
    return transfer::TransferDescriptor{};
  }
  void prefilled(const std::string&, const StepOutput&) override {}
  void fail(const std::string&, const std::string&) override {}
  void abort(const std::string& id) override {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_.push_back(id);
  }
  DecodeLoad load() const override {
    DecodeLoad l;
    l.batch_per_rank = {0};
    l.max_decode_batch = 8;
    return l;
  }
  int64_t max_model_len() const override { return 1000; }
  int64_t vocab_size() const override { return 100; }
  std::vector<std::string> admitted() const {
    std::lock_guard<std::mutex> lock(mu_);
    return admitted_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> admitted_, aborted_;
};

net::KeyRef key(char c) { return net::ClusterKey::from_bytes(std::string(40, c)); }

class AuthLog {
 public:
  AuthLog() {
    prev_ = net::set_log([this](const std::string& l) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.push_back(l);
    });
  }
  ~AuthLog() { net::set_log(prev_); }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }

 private:
  std::function<void(const std::string&)> prev_;
  std::mutex mu_;
  std::vector<std::string> lines_;
};

template <typename Pred>
bool wait_for(Pred p, std::chrono::milliseconds timeout = 5s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!p()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

int dial(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

int local_port(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return ntohs(a.sin_port);
}

// One control frame: u32 type, u32 bytes, payload.
std::vector<uint8_t> frame(uint32_t type, const std::vector<uint8_t>& payload,
                           uint32_t claimed = UINT32_MAX) {
  std::vector<uint8_t> out(8);
  const uint32_t n = claimed == UINT32_MAX ? static_cast<uint32_t>(payload.size()) : claimed;
  std::memcpy(out.data(), &type, 4);
  std::memcpy(out.data() + 4, &n, 4);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

// A well-formed kAccept call (what a router sends to admit request `id`).
std::vector<uint8_t> accept_call(const std::string& id) {
  GenRequest req;
  req.id = id;
  req.prompt_ids = {1, 2, 3};
  req.max_tokens = 4;
  ByteWriter w;
  w.put<uint64_t>(1);  // serial
  put_request(w, req);
  w.put<int64_t>(4);  // prefill sharding: heads, tp
  w.put<int32_t>(1);
  return frame(2 /* kAccept */, w.bytes());
}

bool closed_by_peer(int fd) {
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

TEST(InstanceAuth, RouterWithTheKeyIsServed) {
  CountingDecode decode;
  InstanceServer server(&decode, nullptr, "127.0.0.1", 0, key('a'));
  RemoteDecode remote("127.0.0.1:" + std::to_string(server.port()), key('a'));
  EXPECT_TRUE(remote.load().alive);
  EXPECT_EQ(remote.max_model_len(), 1000);
  GenRequest req;
  req.id = "ok";
  req.prompt_ids = {1, 2};
  req.max_tokens = 2;
  EXPECT_TRUE(remote.accept(req, {4, 1}, [](const StepOutput&) {}).has_value());
  EXPECT_EQ(decode.admitted(), std::vector<std::string>{"ok"});
}

TEST(InstanceAuth, WrongKeyOrNoKeyRouterIsRefused) {
  AuthLog log;
  CountingDecode decode;
  InstanceServer server(&decode, nullptr, "127.0.0.1", 0, key('a'));
  const std::string at = "127.0.0.1:" + std::to_string(server.port());
  const uint64_t before = net::failures(net::Channel::kControl);
  {
    RemoteDecode wrong(at, key('b'));
    EXPECT_FALSE(wrong.load().alive);
  }
  {
    RemoteDecode none(at);  // speaks frames at once: the server reads them as a bad HELLO
    EXPECT_FALSE(none.load().alive);
  }
  // Wrong key: refused on both sides (the router sees the instance's proof fail, the instance
  // the router hang up); no key: refused by the instance.
  ASSERT_TRUE(wait_for([&] { return net::failures(net::Channel::kControl) >= before + 3; }));
  bool addressed = false;
  for (const auto& l : log.lines()) addressed |= l.find("with 127.0.0.1:") != std::string::npos;
  EXPECT_TRUE(addressed);
  EXPECT_TRUE(decode.admitted().empty());
  RemoteDecode good(at, key('a'));  // the instance serves on
  EXPECT_TRUE(good.load().alive);
  EXPECT_NE(instances_metrics_text({}, {}).find("tandem_auth_failures_total{channel=\"control\"}"),
            std::string::npos);
}

TEST(InstanceAuth, ForgedCallWithoutHandshakeAdmitsNothing) {
  AuthLog log;
  CountingDecode decode;
  InstanceServer server(&decode, nullptr, "127.0.0.1", 0, key('a'));
  const uint64_t before = net::failures(net::Channel::kControl);
  const int fd = dial(server.port());
  const int port = local_port(fd);
  const auto call = accept_call("forged");
  ::send(fd, call.data(), call.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(closed_by_peer(fd));
  ::close(fd);
  ASSERT_TRUE(wait_for([&] { return net::failures(net::Channel::kControl) == before + 1; }));
  ASSERT_FALSE(log.lines().empty());
  EXPECT_NE(log.lines().back().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << log.lines().back();
  EXPECT_TRUE(decode.admitted().empty());
}

TEST(InstanceAuth, ReplayedHandshakeIsRefused) {
  AuthLog log;
  CountingDecode decode;
  const auto k = key('a');
  InstanceServer server(&decode, nullptr, "127.0.0.1", 0, k);
  net::ClientHandshake genuine(*k, net::Channel::kControl);
  std::array<uint8_t, net::kChallengeBytes> challenge{};
  int fd = dial(server.port());
  ::send(fd, genuine.hello().data(), genuine.hello().size(), MSG_NOSIGNAL);
  ASSERT_EQ(::recv(fd, challenge.data(), challenge.size(), MSG_WAITALL),
            static_cast<ssize_t>(challenge.size()));
  const auto proof = genuine.respond(challenge);
  ::send(fd, proof.data(), proof.size(), MSG_NOSIGNAL);
  ::close(fd);  // a genuine session, recorded
  const uint64_t before = net::failures(net::Channel::kControl);
  fd = dial(server.port());
  ::send(fd, genuine.hello().data(), genuine.hello().size(), MSG_NOSIGNAL);
  ASSERT_EQ(::recv(fd, challenge.data(), challenge.size(), MSG_WAITALL),
            static_cast<ssize_t>(challenge.size()));
  ::send(fd, proof.data(), proof.size(), MSG_NOSIGNAL);  // the recorded proof
  const auto call = accept_call("replayed");
  ::send(fd, call.data(), call.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(closed_by_peer(fd));
  ::close(fd);
  ASSERT_TRUE(wait_for([&] { return net::failures(net::Channel::kControl) == before + 1; }));
  EXPECT_NE(log.lines().back().find("wrong cluster key"), std::string::npos);
  EXPECT_TRUE(decode.admitted().empty());
}

// With the key, then garbage: a malformed call gets an error reply (nothing admitted); a frame
// claiming more than kMaxControlFrameBytes closes that connection before anything is
// allocated; the instance serves other connections throughout.
TEST(InstanceAuth, CorrectKeyThenGarbageOrAHugeFrame) {
  CountingDecode decode;
  const auto k = key('a');
  InstanceServer server(&decode, nullptr, "127.0.0.1", 0, k);
  const uint64_t before = net::failures_total();
  {
    const int fd = dial(server.port());
    net::authenticate_client(fd, *k, net::Channel::kControl, "instance");
    std::vector<uint8_t> junk(300);
    std::mt19937 g(3);
    for (auto& x : junk) x = static_cast<uint8_t>(g());
    junk[0] = junk[1] = junk[2] = junk[3] = junk[4] = junk[5] = junk[6] = junk[7] = 0;
    const auto f = frame(2 /* kAccept */, junk);
    ::send(fd, f.data(), f.size(), MSG_NOSIGNAL);
    uint32_t head[2] = {0, 0};
    ASSERT_EQ(::recv(fd, head, sizeof(head), MSG_WAITALL), 8);
    EXPECT_EQ(head[0], 100u);  // kReply (an error: the message does not parse)
    ::close(fd);
  }
  {
    const int fd = dial(server.port());
    net::authenticate_client(fd, *k, net::Channel::kControl, "instance");
    const auto huge = frame(2, {}, kMaxControlFrameBytes + 1);  // ~256 MiB claimed, none sent
    ::send(fd, huge.data(), huge.size(), MSG_NOSIGNAL);
    EXPECT_TRUE(closed_by_peer(fd));
    ::close(fd);
  }
  EXPECT_EQ(net::failures_total(), before);  // they held the key
  EXPECT_TRUE(decode.admitted().empty());
  RemoteDecode good("127.0.0.1:" + std::to_string(server.port()), k);
  EXPECT_TRUE(good.load().alive);
}

// The limits hold without a key too; and the key-less pair works as before.
TEST(InstanceAuth, KeylessModeAndItsLimits) {
  CountingDecode decode;
  InstanceServer server(&decode, nullptr, "127.0.0.1", 0);
  const int fd = dial(server.port());
  const auto huge = frame(2, {}, 0xFFFFFFF0u);  // a 4 GB frame
  ::send(fd, huge.data(), huge.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(closed_by_peer(fd));
  ::close(fd);
  RemoteDecode remote("127.0.0.1:" + std::to_string(server.port()));
  EXPECT_TRUE(remote.load().alive);
  GenRequest req;
  req.id = "plain";
  req.prompt_ids = {1};
  req.max_tokens = 1;
  EXPECT_TRUE(remote.accept(req, {4, 1}, [](const StepOutput&) {}).has_value());
  EXPECT_EQ(decode.admitted(), std::vector<std::string>{"plain"});
  RemoteDecode keyed("127.0.0.1:" + std::to_string(server.port()), key('a'));
  EXPECT_FALSE(keyed.load().alive);  // a keyed router does not trust a key-less instance
}

}  // namespace
}  // namespace tandem
