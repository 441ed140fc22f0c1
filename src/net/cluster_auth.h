// The cluster key: mutual authentication of every internal connection (router <-> instance
// control, instance <-> instance KV / state / hidden-state transfer, the CUDA IPC control
// socket, the rank group's TCP store). docs/operations.md, "Security", says what it covers.
//
// Handshake (before the connection's own protocol; the connecting side is the client):
//   client -> server  HELLO      "TNDMAUTH" | u8 version (1) | u8 channel | u16 0 | nonce_c[32]
//   server -> client  CHALLENGE  nonce_s[32] | HMAC(K, "tandem-auth-v1" | 'S' | channel |
//                                                   nonce_c | nonce_s)
//   client -> server  PROOF      HMAC(K, "tandem-auth-v1" | 'C' | channel | nonce_c | nonce_s)
// HMAC-SHA256 (OpenSSL), fresh random nonces from both sides, constant-time comparison; the key
// never travels. The role byte makes a reflected handshake fail (the server's MAC is never a
// valid client proof), the server's fresh nonce makes a replayed one fail, and the channel byte
// keeps a handshake made for one kind of connection from being accepted by another. It
// authenticates the peer when the connection opens; it does not encrypt or sign what follows
// (an attacker on the path could still read or inject: the network policy covers that).
//
// Each side closes a connection whose handshake fails, logs it with the peer's address and
// counts it (tandem_auth_failures_total on /metrics). Without a key (null KeyRef) no handshake
// takes place: the behaviour from before the key existed.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

namespace tandem::net {

/// The shared secret (the bytes of --cluster-key-file, trailing whitespace dropped).
class ClusterKey {
 public:
  static constexpr size_t kMinBytes = 16;
  static constexpr size_t kMaxBytes = 4096;
  /// Throws Error(kInvalidArgument) naming the file when it cannot be read or the key is
  /// shorter than kMinBytes or longer than kMaxBytes.
  static std::shared_ptr<const ClusterKey> from_file(const std::string& path);
  /// The same checks on the bytes themselves (tests).
  static std::shared_ptr<const ClusterKey> from_bytes(std::string bytes);

  /// HMAC-SHA256 of data under the key.
  std::array<uint8_t, 32> mac(std::span<const uint8_t> data) const;

 private:
  explicit ClusterKey(std::string bytes) : bytes_(std::move(bytes)) {}
  std::string bytes_;
};

/// Null: no key (connections are not authenticated).
using KeyRef = std::shared_ptr<const ClusterKey>;

/// What a connection carries (bound into the MACs).
enum class Channel : uint8_t {
  kControl = 1,     // router <-> instance (disagg/instance_api)
  kKvTransfer = 2,  // host TCP KV transfer (transfer/tcp_transfer)
  kIpcControl = 3,  // CUDA IPC transfer's control socket (transfer/cuda)
  kStore = 4,       // the rank group's TCP store (comm/tcp_store)
};
constexpr int kNumChannels = 4;
/// "control", "kv-transfer", "ipc-control", "store".
const char* channel_name(Channel channel);

constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kHelloBytes = 8 + 4 + kNonceBytes;
constexpr size_t kChallengeBytes = kNonceBytes + kMacBytes;
constexpr size_t kProofBytes = kMacBytes;
/// How long a server waits for a client's HELLO and PROOF (and a client for the CHALLENGE).
constexpr std::chrono::milliseconds kHandshakeTimeout{10000};

/// The client's side as messages (no I/O): hello(), then respond() to the challenge. The key
/// must outlive the object (it keeps a reference).
class ClientHandshake {
 public:
  ClientHandshake(const ClusterKey& key, Channel channel);
  const std::array<uint8_t, kHelloBytes>& hello() const { return hello_; }
  /// Checks the server's MAC; returns the PROOF. Throws Error(kIo) when the server does not
  /// hold the key.
  std::array<uint8_t, kProofBytes> respond(std::span<const uint8_t> challenge) const;

 private:
  const ClusterKey& key_;
  Channel channel_;
  std::array<uint8_t, kNonceBytes> nonce_{};
  std::array<uint8_t, kHelloBytes> hello_{};
};

/// The server's side as messages (no I/O): challenge() for the HELLO, then verify() the PROOF.
class ServerHandshake {
 public:
  ServerHandshake(const ClusterKey& key, Channel channel);
  /// Throws Error(kIo) when the bytes are not a HELLO of this version and channel.
  std::array<uint8_t, kChallengeBytes> challenge(std::span<const uint8_t> hello);
  /// Throws Error(kIo) when the PROOF is wrong (or challenge() was not called).
  void verify(std::span<const uint8_t> proof) const;

 private:
  const ClusterKey& key_;
  Channel channel_;
  bool challenged_ = false;
  std::array<uint8_t, kNonceBytes> client_nonce_{}, nonce_{};
};

/// Blocking handshakes on a connected socket, each step bounded by `timeout`. On failure they
/// count and log it (record_failure) and throw Error(kIo); the caller closes the socket.
void authenticate_client(int fd, const ClusterKey& key, Channel channel, const std::string& peer,
                         std::chrono::milliseconds timeout = kHandshakeTimeout);
void authenticate_server(int fd, const ClusterKey& key, Channel channel, const std::string& peer,
                         std::chrono::milliseconds timeout = kHandshakeTimeout);

/// "ip:port" of a socket's peer ("unknown peer" when it has none).
std::string peer_of(int fd);

/// One failed handshake: counted per channel and logged ("tandem: refused <channel> connection
/// with <peer>: <why>").
void record_failure(Channel channel, const std::string& peer, const std::string& why);
/// Failed handshakes in this process so far.
uint64_t failures(Channel channel);
uint64_t failures_total();
/// tandem_auth_failures_total{channel="..."} in the Prometheus text format.
std::string metrics_text();
/// Where record_failure() logs (null: stderr). Returns the previous sink. Tests.
std::function<void(const std::string&)> set_log(std::function<void(const std::string&)> sink);

/// The warning for a listener on a non-loopback address without a key ("" when none is due):
/// anyone who reaches host:port may use it.
std::string open_listener_warning(const KeyRef& key, const std::string& host, const char* what);

}  // namespace tandem::net
