#pragma once
/// @file
/// The non-template bodies of dtrain/launch/metrics_endpoint.hpp: included by it in
/// header-only mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/metrics_endpoint.hpp, not this file.

#include <dtrain/detail/net.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/metrics_endpoint.hpp>
#include <dtrain/rendezvous/security.hpp>
#include <dtrain/rendezvous/socket.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <vector>

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string merge_metric_files(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".prom") files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  struct family {
    std::string help, type, samples;
  };
  std::vector<std::string> order;  // families as first seen
  std::map<std::string, family> families;
  auto named = [&](const std::string& name) -> family& {
    auto [it, added] = families.try_emplace(name);
    if (added) order.push_back(name);
    return it->second;
  };
  for (const std::filesystem::path& file : files) {
    std::ifstream in(file);
    std::string line;
    std::string current;  // the family of the samples that follow
    while (std::getline(in, line)) {
      if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) {
        const std::size_t name_end = line.find(' ', 7);
        current = line.substr(7, name_end == std::string::npos ? std::string::npos : name_end - 7);
        std::string& kept = line[2] == 'H' ? named(current).help : named(current).type;
        if (kept.empty()) kept = line;
      } else if (!line.empty() && line.front() != '#') {
        const std::string name = line.substr(0, line.find_first_of("{ "));
        named(current.empty() ? name : current).samples += line + "\n";
      }
    }
  }
  std::string out;
  for (const std::string& name : order) {
    const family& f = families[name];
    if (f.samples.empty()) continue;
    if (!f.help.empty()) out += f.help + "\n";
    if (!f.type.empty()) out += f.type + "\n";
    out += f.samples;
  }
  return out;
}

DTRAIN_DETAIL_INLINE metrics_endpoint::metrics_endpoint(const std::string& bind, int port,
                                                        std::filesystem::path dir,
                                                        std::string token)
    : dir_(std::move(dir)), token_(std::move(token)) {
  const std::string where = endpoint_text(bind, port);
  if (token_.empty() && !is_loopback_address(bind)) {
    throw config_error(std::string(metrics_bind_variable) + "=" + bind +
                       ": the metrics endpoint listens on another address than loopback only "
                       "with a token that every scrape must send (" +
                       std::string(metrics_token_variable) +
                       "; Prometheus: authorization: {credentials: TOKEN})");
  }
  address_list addrs;
  if (const int rc = resolve(bind, port, true, addrs); rc != 0) {
    throw config_error("the metrics endpoint cannot listen on " + where + ": " +
                       ::gai_strerror(rc) + " (" + std::string(metrics_bind_variable) + ")");
  }
  const addrinfo* a = addrs.head;
  // Non-blocking: a client gone between poll() and accept() must not hold the thread.
  listen_.reset(
      DTRAIN_SYSCALL(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)));
  int one = 1;
  DTRAIN_SYSCALL(::setsockopt(listen_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
  if (::bind(listen_.get(), a->ai_addr, a->ai_addrlen) != 0) {
    const int err = errno;
    throw config_error("the metrics endpoint cannot listen on " + where + ": " +
                       std::strerror(err) + " (--metrics-port, " +
                       std::string(metrics_bind_variable) + ")");
  }
  DTRAIN_SYSCALL(::listen(listen_.get(), 16));
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  DTRAIN_SYSCALL(::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&bound), &length));
  port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  wake_.reset(DTRAIN_SYSCALL(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)));
  thread_ = std::thread([this] { serve(); });
}

DTRAIN_DETAIL_INLINE metrics_endpoint::~metrics_endpoint() {
  stopping_ = true;
  const std::uint64_t one = 1;
  static_cast<void>(!::write(wake_.get(), &one, sizeof one));
  thread_.join();
}

namespace metrics_http {
inline std::string response(std::string_view status, std::string_view extra_headers,
                            std::string_view body, std::string_view type = "text/plain") {
  std::string out = "HTTP/1.1 " + std::string(status) + "\r\nContent-Type: " + std::string(type) +
                    "\r\nContent-Length: " + std::to_string(body.size()) +
                    "\r\nConnection: close\r\n" + std::string(extra_headers) + "\r\n";
  out += body;
  return out;
}
inline std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}
inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}
}  // namespace metrics_http

DTRAIN_DETAIL_INLINE std::string metrics_endpoint::answer(std::string_view head) const {
  using metrics_http::response;
  const std::size_t line_end = head.find("\r\n");
  const std::string_view line = head.substr(0, line_end);
  const std::size_t first = line.find(' ');
  const std::size_t second = first == std::string_view::npos ? first : line.find(' ', first + 1);
  if (second == std::string_view::npos || !line.substr(second + 1).starts_with("HTTP/1.")) {
    return response("400 Bad Request", "", "not an HTTP/1 request\n");
  }
  const std::string_view method = line.substr(0, first);
  std::string_view path = line.substr(first + 1, second - first - 1);
  path = path.substr(0, path.find('?'));
  if (method != "GET") return response("405 Method Not Allowed", "Allow: GET\r\n", "GET only\n");
  if (!token_.empty()) {
    std::string_view credentials;
    std::string_view rest = line_end == std::string_view::npos ? "" : head.substr(line_end + 2);
    while (!rest.empty()) {
      const std::size_t end = rest.find("\r\n");
      const std::string_view header = rest.substr(0, end);
      rest = end == std::string_view::npos ? "" : rest.substr(end + 2);
      const std::size_t colon = header.find(':');
      if (colon == std::string_view::npos) continue;
      if (metrics_http::lower(header.substr(0, colon)) != "authorization") continue;
      const std::string_view value = metrics_http::trim(header.substr(colon + 1));
      if (metrics_http::lower(value.substr(0, 7)) == "bearer ")
        credentials = metrics_http::trim(value.substr(7));
    }
    if (!same_secret(credentials, token_)) {
      return response("401 Unauthorized", "WWW-Authenticate: Bearer realm=\"dtrain\"\r\n",
                      "a token is needed (Authorization: Bearer TOKEN)\n");
    }
  }
  if (path != "/metrics") return response("404 Not Found", "", "GET /metrics\n");
  return response("200 OK", "", merge_metric_files(dir_),
                  "text/plain; version=0.0.4; charset=utf-8");
}

DTRAIN_DETAIL_INLINE void metrics_endpoint::serve() {
  while (!stopping_) {
    pollfd fds[2] = {{listen_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (stopping_ || (fds[1].revents & POLLIN) != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    unique_fd client(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!client) {
      // Gone before it was taken (EAGAIN): the next. Out of descriptors: the
      // client waits in the queue; try again in a moment, not in a spin.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        pollfd wake{wake_.get(), POLLIN, 0};
        static_cast<void>(::poll(&wake, 1, 100));
      }
      continue;
    }
    handle(client.get());
  }
}

DTRAIN_DETAIL_INLINE void metrics_endpoint::handle(int client) const {
  const auto deadline = std::chrono::steady_clock::now() + client_time;
  // Waits until `client` is ready for `events` within the deadline (and the endpoint runs).
  auto ready = [&](short events) {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || stopping_) return false;
      pollfd fds[2] = {{client, events, 0}, {wake_.get(), POLLIN, 0}};
      const int n = ::poll(fds, 2, static_cast<int>(left.count()));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0 || (fds[1].revents & POLLIN) != 0) return false;
      return (fds[0].revents & (events | POLLHUP | POLLERR)) != 0;
    }
  };
  std::string head;
  std::string reply;
  while (reply.empty()) {
    if (head.find("\r\n\r\n") != std::string::npos) {
      reply = answer(head.substr(0, head.find("\r\n\r\n") + 2));
    } else if (head.size() > most_request_bytes) {
      reply = metrics_http::response("431 Request Header Fields Too Large", "",
                                     "at most 8192 bytes of request\n");
    } else {
      if (!ready(POLLIN)) return;  // too slow, or stopping: closed unanswered
      char buffer[2048];
      const ssize_t n = ::recv(client, buffer, sizeof buffer, 0);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0) return;  // gone
      head.append(buffer, static_cast<std::size_t>(n));
    }
  }
  std::string_view rest = reply;
  while (!rest.empty()) {
    if (!ready(POLLOUT)) return;
    const ssize_t n = ::send(client, rest.data(), rest.size(), MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return;
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
  // A lingering close: what the client still sends (a request cut off at the
  // limit) is read and dropped for a moment, so that the close does not
  // reset the connection before the client has read the answer.
  ::shutdown(client, SHUT_WR);
  const auto linger_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  for (std::size_t dropped = 0; dropped < 16 * most_request_bytes;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        linger_until - std::chrono::steady_clock::now());
    pollfd fds{client, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&fds, 1, static_cast<int>(left.count())) <= 0) return;
    char buffer[2048];
    const ssize_t n = ::recv(client, buffer, sizeof buffer, 0);
    if (n <= 0) return;
    dropped += static_cast<std::size_t>(n);
  }
}

}  // namespace dtrain::detail
