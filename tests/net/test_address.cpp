// net/address.h: one host:port parser (IPv6 in brackets) for every transport;
// the POSIX connect with a timeout and the IPv4 listener of the raw-socket
// connections.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>

#include "core/error.h"
#include "net/address.h"

namespace tandem {
namespace {

TEST(Address, SplitsHostAndPortWithIpv6Brackets) {
  auto hp = net::split_host_port("10.0.0.1:8080", "address");
  EXPECT_EQ(hp.host, "10.0.0.1");
  EXPECT_EQ(hp.port, "8080");
  hp = net::split_host_port("[::1]:9", "address");
  EXPECT_EQ(hp.host, "::1");
  EXPECT_EQ(hp.port, "9");
  hp = net::split_host_port("decode-0.svc:65535", "address");
  EXPECT_EQ(hp.host, "decode-0.svc");
  for (const char* bad : {"nohost", ":80", "h:", "h:0", "h:65536", "h:8o", "h:123456"}) {
    try {
      net::split_host_port(bad, "KV receiver address");
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(e.message().find("KV receiver address '"), std::string::npos) << e.message();
    }
  }
  EXPECT_EQ(net::join_host_port("10.0.0.1", 5), "10.0.0.1:5");
  EXPECT_EQ(net::join_host_port("::1", 5), "[::1]:5");
  EXPECT_EQ(net::split_host_port(net::join_host_port("fe80::2", 77), "a").host, "fe80::2");
}

TEST(Address, ListensAndConnects) {
  int port = 0;
  const int lfd = net::listen_tcp("127.0.0.1", 0, 4, port, "test listener");
  ASSERT_GT(port, 0);
  const int fd = net::connect_tcp("127.0.0.1:" + std::to_string(port),
                                  std::chrono::milliseconds(1000), "test server");
  EXPECT_GE(fd, 0);
  ::close(fd);
  ::close(lfd);
  // Nobody listens there any more: Error(kIo) naming what and where.
  try {
    net::connect_tcp("127.0.0.1:" + std::to_string(port), std::chrono::milliseconds(1000),
                     "test server");
    ADD_FAILURE() << "connected";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_NE(e.message().find("cannot connect to test server 127.0.0.1:"), std::string::npos)
        << e.message();
  }
  EXPECT_THROW(net::listen_tcp("not-an-ip", 0, 4, port, "test listener"), Error);
}

}  // namespace
}  // namespace tandem
