// One client pipelines N requests to an in-process store_server in as few
// writes as the socket takes, while a second thread reads the replies; then
// a good client checks the server still serves. Built at -O0 and with
// AddressSanitizer (tests/CMakeLists.txt): the server's stack must stay
// bounded without the optimiser's help.
//
//   dtrain_store_pipeline [requests=1000000] [op=ping|get]

#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/protocol.hpp>
#include <dtrain/rendezvous/server.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "store_pipeline: %s\n", what.c_str());
  std::exit(1);
}

void send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) die(std::string("send: ") + std::strerror(errno));
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

std::size_t recv_some(int fd, char* buf, std::size_t size) {
  for (;;) {
    ssize_t n = ::recv(fd, buf, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die(std::string("recv: ") + std::strerror(errno));
    if (n == 0) die("the server closed the connection");
    return static_cast<std::size_t>(n);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const long requests = argc > 1 ? std::atol(argv[1]) : 1'000'000;
  const std::string op = argc > 2 ? argv[2] : "ping";
  if (requests < 1 || (op != "ping" && op != "get"))
    die("usage: store_pipeline [requests] [ping|get]");

  const std::string token = "pipeline-test-token";
  dtrain::store_server server("127.0.0.1", 0, {.token = token});
  {
    dtrain::store_client setter("127.0.0.1", server.port(), {.token = token});
    setter.set("k", "value");
  }

  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(server.port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    die(std::string("connect: ") + std::strerror(errno));

  std::string hello;
  dtrain::detail::wire::writer(hello)
      .u32(dtrain::detail::wire::magic)
      .u16(dtrain::detail::wire::version)
      .bytes16(token);
  send_all(fd, hello);
  char reply[3 + 8];  // status, version, the server's instance
  std::size_t got = 0;
  while (got < sizeof reply) got += recv_some(fd, reply + got, sizeof reply - got);
  if (reply[0] != 0) die("handshake refused");

  std::string body(1, static_cast<char>(op == "ping" ? dtrain::detail::wire::op::ping
                                                     : dtrain::detail::wire::op::get));
  if (op == "get") dtrain::detail::wire::writer(body).bytes32("k").u64(0);
  const std::string frame = dtrain::detail::wire::frame(body);
  const std::size_t reply_size = op == "ping" ? 5 : 5 + 4 + 5;  // length, status[, bytes32 value]

  // Writes in 64 KiB batches, so the server finds thousands of whole requests per read.
  std::thread writer([&] {
    const long per_batch = static_cast<long>(65536 / frame.size());
    std::string batch;
    for (long i = 0; i < per_batch; ++i) batch += frame;
    long left = requests;
    while (left > 0) {
      long n = std::min(left, per_batch);
      send_all(fd, std::string_view(batch).substr(0, static_cast<std::size_t>(n) * frame.size()));
      left -= n;
    }
  });

  const std::size_t expected = static_cast<std::size_t>(requests) * reply_size;
  std::size_t received = 0;
  char buf[65536];
  std::string tail;  // checks every reply's status byte
  while (received < expected) {
    std::size_t n = recv_some(fd, buf, sizeof buf);
    for (std::size_t i = 0; i < n; ++i) {
      if ((received + i) % reply_size == 4 && buf[i] != 0) die("a reply's status is not ok");
    }
    received += n;
  }
  writer.join();
  ::close(fd);

  dtrain::store_client good("127.0.0.1", server.port(), {.token = token});
  if (good.get("k") != "value") die("the server no longer serves good clients");
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  std::printf(
      "served %ld pipelined %s requests on one connection; a good client is still served; "
      "max RSS %ld MiB\n",
      requests, op.c_str(), usage.ru_maxrss / 1024);
  return 0;
}
