#include "net/cluster_auth.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "net/address.h"

namespace tandem::net {

namespace {

constexpr char kMagic[8] = {'T', 'N', 'D', 'M', 'A', 'U', 'T', 'H'};
constexpr uint8_t kVersion = 1;
constexpr char kLabel[] = "tandem-auth-v1";

std::array<uint8_t, kNonceBytes> fresh_nonce() {
  std::array<uint8_t, kNonceBytes> n{};
  TANDEM_CHECK_KIND(kInternal, RAND_bytes(n.data(), static_cast<int>(n.size())) == 1,
                    "cluster key: OpenSSL RAND_bytes failed");
  return n;
}

// HMAC(K, label | role | channel | nonce_c | nonce_s).
std::array<uint8_t, kMacBytes> handshake_mac(const ClusterKey& key, char role, Channel channel,
                                             std::span<const uint8_t> nonce_c,
                                             std::span<const uint8_t> nonce_s) {
  std::vector<uint8_t> msg(kLabel, kLabel + sizeof(kLabel) - 1);
  msg.push_back(static_cast<uint8_t>(role));
  msg.push_back(static_cast<uint8_t>(channel));
  msg.insert(msg.end(), nonce_c.begin(), nonce_c.end());
  msg.insert(msg.end(), nonce_s.begin(), nonce_s.end());
  return key.mac(msg);
}

bool same(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::atomic<uint64_t> g_failures[kNumChannels + 1];
std::mutex g_log_mu;
std::function<void(const std::string&)> g_log;

// Reads exactly n bytes before the deadline; "" on success, else why not.
std::string read_exact(int fd, uint8_t* p, size_t n, std::chrono::steady_clock::time_point until) {
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          until - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) return "no answer within the handshake timeout";
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return "no answer within the handshake timeout";
    if (r < 0) return std::string("poll: ") + std::strerror(errno);
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) return "the peer closed the connection during the handshake";
    if (k < 0) return std::string("recv: ") + std::strerror(errno);
    p += k;
    n -= static_cast<size_t>(k);
  }
  return {};
}

[[noreturn]] void fail(Channel channel, const std::string& peer, const std::string& why) {
  record_failure(channel, peer, why);
  TANDEM_THROW(kIo, "cluster key: ", channel_name(channel), " connection with ", peer,
               " refused: ", why);
}

}  // namespace

std::shared_ptr<const ClusterKey> ClusterKey::from_bytes(std::string bytes) {
  while (!bytes.empty() && (bytes.back() == '\n' || bytes.back() == '\r' || bytes.back() == ' ' ||
                            bytes.back() == '\t')) {
    bytes.pop_back();
  }
  TANDEM_CHECK_KIND(kInvalidArgument, bytes.size() >= kMinBytes && bytes.size() <= kMaxBytes,
                    "a cluster key of ", bytes.size(), " bytes: it needs ", kMinBytes, " to ",
                    kMaxBytes, " (e.g. `openssl rand -hex 32`)");
  return std::shared_ptr<const ClusterKey>(new ClusterKey(std::move(bytes)));
}

std::shared_ptr<const ClusterKey> ClusterKey::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK_KIND(kInvalidArgument, in.good(), "--cluster-key-file ", path, ": cannot read it (",
                    std::strerror(errno), ")");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    return from_bytes(std::move(bytes));
  } catch (const Error& e) {
    TANDEM_THROW(kInvalidArgument, "--cluster-key-file ", path, ": ", e.message());
  }
}

std::array<uint8_t, 32> ClusterKey::mac(std::span<const uint8_t> data) const {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  const uint8_t* r = HMAC(EVP_sha256(), bytes_.data(), static_cast<int>(bytes_.size()), data.data(),
                          data.size(), out.data(), &len);
  TANDEM_CHECK_KIND(kInternal, r != nullptr && len == out.size(), "cluster key: HMAC failed");
  return out;
}

const char* channel_name(Channel channel) {
  switch (channel) {
    case Channel::kControl: return "control";
    case Channel::kKvTransfer: return "kv-transfer";
    case Channel::kIpcControl: return "ipc-control";
    case Channel::kStore: return "store";
  }
  return "unknown";
}

ClientHandshake::ClientHandshake(const ClusterKey& key, Channel channel)
    : key_(key), channel_(channel), nonce_(fresh_nonce()) {
  std::memcpy(hello_.data(), kMagic, sizeof(kMagic));
  hello_[8] = kVersion;
  hello_[9] = static_cast<uint8_t>(channel);
  std::memcpy(hello_.data() + 12, nonce_.data(), kNonceBytes);
}

std::array<uint8_t, kProofBytes> ClientHandshake::respond(
    std::span<const uint8_t> challenge) const {
  TANDEM_CHECK_KIND(kIo, challenge.size() == kChallengeBytes, "a CHALLENGE of ", challenge.size(),
                    " bytes (", kChallengeBytes, " expected)");
  const auto nonce_s = challenge.first(kNonceBytes);
  const auto expect = handshake_mac(key_, 'S', channel_, nonce_, nonce_s);
  TANDEM_CHECK_KIND(kIo, same(expect, challenge.subspan(kNonceBytes)),
                    "the server does not hold this cluster key (its proof is wrong)");
  return handshake_mac(key_, 'C', channel_, nonce_, nonce_s);
}

ServerHandshake::ServerHandshake(const ClusterKey& key, Channel channel)
    : key_(key), channel_(channel) {}

std::array<uint8_t, kChallengeBytes> ServerHandshake::challenge(std::span<const uint8_t> hello) {
  TANDEM_CHECK_KIND(kIo, hello.size() == kHelloBytes, "a HELLO of ", hello.size(), " bytes");
  TANDEM_CHECK_KIND(kIo, std::memcmp(hello.data(), kMagic, sizeof(kMagic)) == 0,
                    "no cluster-key handshake (is the peer started without the cluster key, or "
                    "not a tandem process?)");
  TANDEM_CHECK_KIND(kIo, hello[8] == kVersion, "handshake version ", int(hello[8]), " (this build ",
                    int(kVersion), ")");
  TANDEM_CHECK_KIND(kIo, hello[9] == static_cast<uint8_t>(channel_), "a handshake for the ",
                    channel_name(static_cast<Channel>(hello[9])), " channel on a ",
                    channel_name(channel_), " port");
  std::memcpy(client_nonce_.data(), hello.data() + 12, kNonceBytes);
  nonce_ = fresh_nonce();
  std::array<uint8_t, kChallengeBytes> out{};
  std::memcpy(out.data(), nonce_.data(), kNonceBytes);
  const auto m = handshake_mac(key_, 'S', channel_, client_nonce_, nonce_);
  std::memcpy(out.data() + kNonceBytes, m.data(), kMacBytes);
  challenged_ = true;
  return out;
}

void ServerHandshake::verify(std::span<const uint8_t> proof) const {
  TANDEM_CHECK_KIND(kIo, challenged_, "a PROOF before the HELLO");
  const auto expect = handshake_mac(key_, 'C', channel_, client_nonce_, nonce_);
  TANDEM_CHECK_KIND(kIo, same(expect, proof), "wrong cluster key (the client's proof is wrong)");
}

void authenticate_client(int fd, const ClusterKey& key, Channel channel, const std::string& peer,
                         std::chrono::milliseconds timeout) {
  ClientHandshake hs(key, channel);
  if (!send_all(fd, hs.hello().data(), hs.hello().size())) {
    fail(channel, peer, "sending the HELLO failed");
  }
  std::array<uint8_t, kChallengeBytes> challenge{};
  const std::string err = read_exact(fd, challenge.data(), challenge.size(),
                                     std::chrono::steady_clock::now() + timeout);
  if (!err.empty()) fail(channel, peer, err + " (does the server hold the cluster key?)");
  std::array<uint8_t, kProofBytes> proof{};
  try {
    proof = hs.respond(challenge);
  } catch (const Error& e) {
    fail(channel, peer, e.message());
  }
  if (!send_all(fd, proof.data(), proof.size())) fail(channel, peer, "sending the PROOF failed");
}

void authenticate_server(int fd, const ClusterKey& key, Channel channel, const std::string& peer,
                         std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  ServerHandshake hs(key, channel);
  std::array<uint8_t, kHelloBytes> hello{};
  std::string err = read_exact(fd, hello.data(), hello.size(), until);
  if (!err.empty()) fail(channel, peer, err);
  std::array<uint8_t, kChallengeBytes> challenge{};
  try {
    challenge = hs.challenge(hello);
  } catch (const Error& e) {
    fail(channel, peer, e.message());
  }
  if (!send_all(fd, challenge.data(), challenge.size())) {
    fail(channel, peer, "sending the CHALLENGE failed");
  }
  std::array<uint8_t, kProofBytes> proof{};
  err = read_exact(fd, proof.data(), proof.size(), until);
  if (!err.empty()) fail(channel, peer, err + " (does the client hold the cluster key?)");
  try {
    hs.verify(proof);
  } catch (const Error& e) {
    fail(channel, peer, e.message());
  }
}

std::string peer_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "unknown peer";
  char host[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {  // a dual-stack listener's IPv4 peer
      ::inet_ntop(AF_INET, a->sin6_addr.s6_addr + 12, host, sizeof(host));
      return std::string(host) + ":" + std::to_string(ntohs(a->sin6_port));
    }
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  return "unknown peer";
}

void record_failure(Channel channel, const std::string& peer, const std::string& why) {
  const auto i = static_cast<size_t>(channel);
  g_failures[i < std::size(g_failures) ? i : 0].fetch_add(1);
  const std::string line = std::string("tandem: refused ") + channel_name(channel) +
                           " connection with " + peer + ": " + why;
  std::lock_guard<std::mutex> lock(g_log_mu);
  if (g_log) {
    g_log(line);
  } else {
    std::cerr << line + "\n" << std::flush;
  }
}

uint64_t failures(Channel channel) {
  const auto i = static_cast<size_t>(channel);
  return i < std::size(g_failures) ? g_failures[i].load() : 0;
}

uint64_t failures_total() {
  uint64_t n = 0;
  for (const auto& f : g_failures) n += f.load();
  return n;
}

std::string metrics_text() {
  std::ostringstream o;
  o << "# HELP tandem_auth_failures_total Internal connections refused by the cluster-key "
       "handshake.\n# TYPE tandem_auth_failures_total counter\n";
  for (int c = 1; c <= kNumChannels; ++c) {
    o << "tandem_auth_failures_total{channel=\"" << channel_name(static_cast<Channel>(c)) << "\"} "
      << g_failures[c].load() << "\n";
  }
  return o.str();
}

std::function<void(const std::string&)> set_log(std::function<void(const std::string&)> sink) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  std::swap(g_log, sink);
  return sink;
}

std::string open_listener_warning(const KeyRef& key, const std::string& host, const char* what) {
  if (key) return {};
  const bool loopback = host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
  if (loopback) return {};
  return std::string("tandem: WARNING: ") + what + " listens on " + host +
         " without a cluster key: anyone who can reach it can submit, cancel or write KV. "
         "Give every router and instance --cluster-key-file (or TANDEM_CLUSTER_KEY_FILE) and "
         "restrict the ports with a network policy (docs/operations.md, Security).";
}

}  // namespace tandem::net
