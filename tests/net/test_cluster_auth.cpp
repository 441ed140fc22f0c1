// The cluster-key handshake (net/cluster_auth.h): as messages (right key, wrong key, reflected,
// replayed, another channel, garbage) and over sockets (the blocking drivers both ways, the
// counter and the log line with the peer's address).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "net/cluster_auth.h"

namespace tandem::net {
namespace {

KeyRef key_a() { return ClusterKey::from_bytes("correct horse battery staple 0001"); }
KeyRef key_b() { return ClusterKey::from_bytes("correct horse battery staple 0002"); }

// The kind and message of what fn throws ("" when nothing).
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

TEST(ClusterAuth, SameKeyBothSidesAgree) {
  const KeyRef k = key_a();
  ClientHandshake c(*k, Channel::kControl);
  ServerHandshake s(*k, Channel::kControl);
  const auto challenge = s.challenge(c.hello());
  const auto proof = c.respond(challenge);
  EXPECT_EQ(error_of([&] { s.verify(proof); }), "");
}

TEST(ClusterAuth, WrongKeyFailsOnBothSides) {
  const KeyRef a = key_a(), b = key_b();
  {  // The client holds another key: it refuses the server's proof (and sends none).
    ClientHandshake c(*b, Channel::kControl);
    ServerHandshake s(*a, Channel::kControl);
    const auto challenge = s.challenge(c.hello());
    EXPECT_NE(error_of([&] { c.respond(challenge); }).find("server does not hold"),
              std::string::npos);
  }
  {  // A client that answers anyway (it ignores the server's proof): the server refuses it.
    ClientHandshake good(*a, Channel::kControl);
    ServerHandshake s(*a, Channel::kControl);
    const auto challenge = s.challenge(good.hello());
    std::array<uint8_t, kProofBytes> wrong{};
    for (size_t i = 0; i < wrong.size(); ++i) wrong[i] = static_cast<uint8_t>(i * 7);
    EXPECT_NE(error_of([&] { s.verify(wrong); }).find("wrong cluster key"), std::string::npos);
    // A proof of the right key for other nonces (another session) fails too.
    ClientHandshake other(*a, Channel::kControl);
    ServerHandshake s2(*a, Channel::kControl);
    const auto other_proof = other.respond(s2.challenge(other.hello()));
    EXPECT_NE(error_of([&] { s.verify(other_proof); }), "");
  }
}

TEST(ClusterAuth, ReflectedServerProofIsNoClientProof) {
  // An attacker without the key opens a session with the server and sends back the server's
  // own MAC as its proof (the MACs are direction-bound, so it fails).
  const KeyRef k = key_a();
  ClientHandshake c(*k, Channel::kControl);
  ServerHandshake s(*k, Channel::kControl);
  const auto challenge = s.challenge(c.hello());
  const std::span<const uint8_t> server_mac(challenge.data() + kNonceBytes, kMacBytes);
  EXPECT_NE(error_of([&] { s.verify(server_mac); }).find("wrong cluster key"), std::string::npos);
  // Nor does the server accept a HELLO whose nonce is its own challenge nonce with that MAC.
  ServerHandshake s2(*k, Channel::kControl);
  std::array<uint8_t, kHelloBytes> hello = c.hello();
  std::copy(challenge.begin(), challenge.begin() + kNonceBytes, hello.begin() + 12);
  const auto c2 = s2.challenge(hello);
  EXPECT_NE(error_of([&] { s2.verify(std::span<const uint8_t>(c2.data() + kNonceBytes, 32)); }),
            "");
}

TEST(ClusterAuth, ReplayedHandshakeFails) {
  const KeyRef k = key_a();
  ClientHandshake c(*k, Channel::kKvTransfer);
  ServerHandshake s1(*k, Channel::kKvTransfer);
  const auto proof = c.respond(s1.challenge(c.hello()));
  s1.verify(proof);
  // The same HELLO and PROOF bytes replayed: the server's nonce is fresh, so the proof is stale.
  ServerHandshake s2(*k, Channel::kKvTransfer);
  s2.challenge(c.hello());
  EXPECT_NE(error_of([&] { s2.verify(proof); }).find("wrong cluster key"), std::string::npos);
}

TEST(ClusterAuth, OtherChannelVersionAndGarbageAreRefused) {
  const KeyRef k = key_a();
  ClientHandshake c(*k, Channel::kStore);
  ServerHandshake s(*k, Channel::kControl);
  EXPECT_NE(error_of([&] { s.challenge(c.hello()); }).find("store channel"), std::string::npos);
  auto hello = c.hello();
  hello[8] = 2;
  ServerHandshake s2(*k, Channel::kStore);
  EXPECT_NE(error_of([&] { s2.challenge(hello); }).find("version"), std::string::npos);
  std::vector<uint8_t> garbage(kHelloBytes, 0x41);
  EXPECT_NE(error_of([&] { s2.challenge(garbage); }).find("no cluster-key handshake"),
            std::string::npos);
  EXPECT_NE(error_of([&] { s2.challenge(std::vector<uint8_t>(3, 0)); }), "");
  EXPECT_NE(error_of([&] { s2.verify(std::vector<uint8_t>(kProofBytes, 0)); }), "");
  EXPECT_NE(error_of([&] { c.respond(std::vector<uint8_t>(5, 0)); }), "");
}

TEST(ClusterAuth, KeysAreCheckedAndReadFromFiles) {
  EXPECT_NE(error_of([] { ClusterKey::from_bytes("short\n"); }).find("needs 16"),
            std::string::npos);
  EXPECT_NE(error_of([] { ClusterKey::from_bytes(std::string(5000, 'k')); }), "");
  const auto dir =
      std::filesystem::temp_directory_path() / ("tandem_key_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  { std::ofstream(dir / "key") << "correct horse battery staple 0001\n"; }
  const KeyRef from_file = ClusterKey::from_file((dir / "key").string());
  // The trailing newline is not part of the key: a file key agrees with the bytes.
  const KeyRef bytes = key_a();
  ClientHandshake c(*from_file, Channel::kControl);
  ServerHandshake s(*bytes, Channel::kControl);
  EXPECT_EQ(error_of([&] { s.verify(c.respond(s.challenge(c.hello()))); }), "");
  EXPECT_NE(error_of([&] { ClusterKey::from_file((dir / "missing").string()); }).find("missing"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

// Captures record_failure's log lines while alive.
class LogCapture {
 public:
  LogCapture() {
    prev_ = set_log([this](const std::string& l) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.push_back(l);
    });
  }
  ~LogCapture() { set_log(prev_); }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }

 private:
  std::function<void(const std::string&)> prev_;
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// Runs the two blocking drivers on a socket pair; returns {client error, server error}.
std::pair<std::string, std::string> over_sockets(const KeyRef& client_key,
                                                 const KeyRef& server_key) {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  auto server = std::async(std::launch::async, [&] {
    const std::string e = error_of(
        [&] { authenticate_server(sv[1], *server_key, Channel::kControl, "test-client"); });
    if (!e.empty()) ::shutdown(sv[1], SHUT_RDWR);  // the caller closes a refused peer
    return e;
  });
  const std::string c =
      error_of([&] { authenticate_client(sv[0], *client_key, Channel::kControl, "test-server"); });
  if (!c.empty()) ::shutdown(sv[0], SHUT_RDWR);
  const std::string s = server.get();
  ::close(sv[0]);
  ::close(sv[1]);
  return {c, s};
}

TEST(ClusterAuth, BlockingDriversCountAndLogFailures) {
  LogCapture log;
  const uint64_t before = failures(Channel::kControl);
  auto [c_ok, s_ok] = over_sockets(key_a(), key_a());
  EXPECT_EQ(c_ok, "");
  EXPECT_EQ(s_ok, "");
  EXPECT_EQ(failures(Channel::kControl), before);
  auto [c_bad, s_bad] = over_sockets(key_b(), key_a());
  EXPECT_NE(c_bad.find("server does not hold"), std::string::npos) << c_bad;
  EXPECT_NE(s_bad, "");  // the client hung up instead of proving
  EXPECT_EQ(failures(Channel::kControl), before + 2);
  const auto lines = log.lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("test-"), std::string::npos) << lines[0];
  EXPECT_NE(metrics_text().find("tandem_auth_failures_total{channel=\"control\"} " +
                                std::to_string(before + 2)),
            std::string::npos)
      << metrics_text();
}

TEST(ClusterAuth, ServerGivesUpOnASilentPeer) {
  LogCapture log;
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] {
    authenticate_server(sv[1], *key_a(), Channel::kStore, "silent", std::chrono::milliseconds(50));
  });
  EXPECT_NE(e.find("timeout"), std::string::npos) << e;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST(ClusterAuth, WarnsOnlyForAnOpenNonLoopbackListener) {
  EXPECT_EQ(open_listener_warning(nullptr, "127.0.0.1", "x"), "");
  EXPECT_EQ(open_listener_warning(key_a(), "0.0.0.0", "x"), "");
  EXPECT_NE(open_listener_warning(nullptr, "0.0.0.0", "decode instance").find("WARNING"),
            std::string::npos);
  EXPECT_NE(open_listener_warning(nullptr, "10.1.2.3", "x"), "");
}

}  // namespace
}  // namespace tandem::net
