// The host transfer backend: KV pieces over TCP (Boost.Asio), for CPU instances and tests.
//
// Each sender and each receiver runs one I/O thread. A request opens one connection per
// (source rank, destination rank) that owes data, carrying HELLO, the layers and FINISH
// (transfer/wire.h); the receiver acknowledges the FINISH, or answers the first problem with
// an error message. So a lost connection, a refused or timed-out transfer concerns exactly
// one request: the others, on their own connections, carry on.
//   Sender: send_layer packs this rank's head run of the layer (kv_pack.h) on the calling
//     thread and queues it; the I/O thread connects and writes in order.
//   Receiver: reads each piece into a staging buffer and copies it into the pages under the
//     request's lock, so a truncated piece never reaches the pages and cancel() is exact.
// Timeouts: a transfer fails when work is pending without progress for `timeout` - on the
// sender connecting, writing, or awaiting the acknowledgement (not while it waits for the
// next layer from prefill); on the receiver from expect() or the last piece received, so
// there it also bounds prefill queueing and compute between pieces: size it for that.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "net/cluster_auth.h"
#include "transfer/transfer.h"

namespace tandem::transfer {

struct HostTcpOptions {
  std::string bind_host = "127.0.0.1";  // receivers listen here ("0.0.0.0" for all)
  int port = 0;                         // 0: a free port per receiver (see address())
  std::string advertise_host;           // host in address(); empty: bind_host
  /// How long pending work may go without progress before its transfer fails.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  /// The cluster key (null: none): every connection starts with the mutual handshake
  /// (net/cluster_auth.h); a sender that fails it is closed before its first byte is read.
  net::KeyRef key;
};

/// The "host-tcp" backend.
std::unique_ptr<TransferBackend> make_host_tcp_backend(HostTcpOptions options = {});

}  // namespace tandem::transfer
