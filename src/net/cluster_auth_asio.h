// The cluster-key handshake (cluster_auth.h) on a Boost.Asio socket, asynchronously: for the
// connections served by an io_context (the host TCP KV transfer). Header-only, so only the
// users of Asio include Asio.
//
//   net::async_authenticate(sock, key, net::Channel::kKvTransfer, /*server=*/true, peer,
//                           [c](const std::string& error) { ... "" : authenticated });
//
// The handler runs once on the socket's executor. A failure (wrong key, garbage, no answer
// within kHandshakeTimeout) is counted and logged (record_failure) and closes the socket before
// the handler runs. The socket must outlive the handshake (the handler may own it).
#pragma once

// clang-format off
#include <utility>  // NOTE: first: Boost 1.74's asio/awaitable.hpp uses std::exchange without it
#include <boost/asio.hpp>
// clang-format on

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "core/error.h"
#include "net/cluster_auth.h"

namespace tandem::net {

namespace detail {

template <typename Socket>
class AsyncAuth : public std::enable_shared_from_this<AsyncAuth<Socket>> {
 public:
  using Done = std::function<void(const std::string&)>;
  AsyncAuth(Socket& sock, const ClusterKey& key, Channel channel, bool server, std::string peer,
            Done done)
      : sock_(sock),
        channel_(channel),
        server_(server),
        peer_(std::move(peer)),
        done_(std::move(done)),
        timer_(sock.get_executor()) {
    if (server_) {
      server_hs_.emplace(key, channel);
    } else {
      client_hs_.emplace(key, channel);
    }
  }

  void start(std::chrono::milliseconds timeout) {
    auto self = this->shared_from_this();
    timer_.expires_after(timeout);
    timer_.async_wait([self](const boost::system::error_code& ec) {
      if (!ec) self->finish("no answer within the handshake timeout");
    });
    if (server_) {
      boost::asio::async_read(sock_, boost::asio::buffer(hello_),
                              [self](const boost::system::error_code& ec, size_t) {
                                if (ec) return self->finish(self->io_error(ec));
                                self->on_hello();
                              });
    } else {
      boost::asio::async_write(sock_, boost::asio::buffer(client_hs_->hello()),
                               [self](const boost::system::error_code& ec, size_t) {
                                 if (ec) return self->finish(self->io_error(ec));
                                 self->read_challenge();
                               });
    }
  }

 private:
  std::string io_error(const boost::system::error_code& ec) const {
    if (ec == boost::asio::error::eof) {
      return "the peer closed the connection during the handshake";
    }
    return "handshake I/O: " + ec.message();
  }

  // Server: HELLO -> CHALLENGE, then the PROOF.
  void on_hello() {
    try {
      challenge_ = server_hs_->challenge(hello_);
    } catch (const Error& e) {
      return finish(e.message());
    }
    auto self = this->shared_from_this();
    boost::asio::async_write(sock_, boost::asio::buffer(challenge_),
                             [self](const boost::system::error_code& ec, size_t) {
                               if (ec) return self->finish(self->io_error(ec));
                               boost::asio::async_read(
                                   self->sock_, boost::asio::buffer(self->proof_),
                                   [self](const boost::system::error_code& ec, size_t) {
                                     if (ec) return self->finish(self->io_error(ec));
                                     try {
                                       self->server_hs_->verify(self->proof_);
                                     } catch (const Error& e) {
                                       return self->finish(e.message());
                                     }
                                     self->finish("");
                                   });
                             });
  }

  // Client: CHALLENGE -> PROOF.
  void read_challenge() {
    auto self = this->shared_from_this();
    boost::asio::async_read(sock_, boost::asio::buffer(challenge_),
                            [self](const boost::system::error_code& ec, size_t) {
                              if (ec) return self->finish(self->io_error(ec));
                              try {
                                self->proof_ = self->client_hs_->respond(self->challenge_);
                              } catch (const Error& e) {
                                return self->finish(e.message());
                              }
                              boost::asio::async_write(
                                  self->sock_, boost::asio::buffer(self->proof_),
                                  [self](const boost::system::error_code& ec, size_t) {
                                    self->finish(ec ? self->io_error(ec) : "");
                                  });
                            });
  }

  void finish(const std::string& error) {
    if (finished_) return;
    finished_ = true;
    timer_.cancel();
    if (!error.empty()) {
      record_failure(channel_, peer_, error);
      boost::system::error_code ignored;
      sock_.close(ignored);
    }
    Done done = std::move(done_);
    done_ = nullptr;
    done(error);
  }

  Socket& sock_;
  Channel channel_;
  bool server_;
  std::string peer_;
  Done done_;
  boost::asio::steady_timer timer_;
  std::optional<ServerHandshake> server_hs_;
  std::optional<ClientHandshake> client_hs_;
  std::array<uint8_t, kHelloBytes> hello_{};
  std::array<uint8_t, kChallengeBytes> challenge_{};
  std::array<uint8_t, kProofBytes> proof_{};
  bool finished_ = false;
};

}  // namespace detail

/// Runs the handshake on a connected socket (server: the accepting side); see above.
template <typename Socket>
void async_authenticate(Socket& sock, const ClusterKey& key, Channel channel, bool server,
                        std::string peer, std::function<void(const std::string&)> done,
                        std::chrono::milliseconds timeout = kHandshakeTimeout) {
  std::make_shared<detail::AsyncAuth<Socket>>(sock, key, channel, server, std::move(peer),
                                              std::move(done))
      ->start(timeout);
}

}  // namespace tandem::net
