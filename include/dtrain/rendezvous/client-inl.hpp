#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/client.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/client.hpp, not this file.

#include <dtrain/rendezvous/client.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE void store_client::set(std::string_view key, std::string_view value) {
  std::string body = begin(detail::wire::op::set);
  detail::wire::writer(body).bytes32(key).bytes32(value);
  call(body, milliseconds(0), "set(\"" + std::string(key) + "\")");
}

DTRAIN_DETAIL_INLINE std::string store_client::get(std::string_view key, milliseconds timeout) {
  std::string body = begin(detail::wire::op::get);
  detail::wire::writer(body).bytes32(key).u64(as_ms(timeout));
  auto what = "get(\"" + std::string(key) + "\")";
  auto reply = call(body, timeout, what);
  if (!reply)
    throw timeout_error(what + " on the store at " + endpoint() + " waited " + seconds(timeout) +
                        " and the key was never set");
  detail::wire::reader r(*reply);
  auto value = r.bytes32("value", UINT32_MAX);
  return std::string(value);
}

DTRAIN_DETAIL_INLINE std::int64_t store_client::add(std::string_view key, std::int64_t delta) {
  std::string body = begin(detail::wire::op::add);
  detail::wire::writer(body).bytes32(key).i64(delta);
  auto reply = call(body, milliseconds(0), "add(\"" + std::string(key) + "\")");
  return detail::wire::reader(*reply).i64("counter");
}

DTRAIN_DETAIL_INLINE std::string store_client::compare_set(std::string_view key,
                                                           std::string_view expected,
                                                           std::string_view desired) {
  auto reply = call(compare_set_body(key, expected, desired), milliseconds(0),
                    "compare_set(\"" + std::string(key) + "\")");
  detail::wire::reader r(*reply);
  return std::string(r.bytes32("value", UINT32_MAX));
}

DTRAIN_DETAIL_INLINE void store_client::wait(std::span<const std::string> keys,
                                             milliseconds timeout) {
  std::string body = begin(detail::wire::op::wait);
  detail::wire::writer w(body);
  w.u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) w.bytes32(k);
  w.u64(as_ms(timeout));
  auto what = "wait(" + key_list(keys) + ")";
  if (!call(body, timeout, what)) {
    throw timeout_error(what + " on the store at " + endpoint() + " waited " + seconds(timeout) +
                        "; missing keys are never set, or their setters are slow or dead");
  }
}

DTRAIN_DETAIL_INLINE bool store_client::check(std::span<const std::string> keys) {
  std::string body = begin(detail::wire::op::check);
  detail::wire::writer w(body);
  w.u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) w.bytes32(k);
  auto reply = call(body, milliseconds(0), "check(" + key_list(keys) + ")");
  return detail::wire::reader(*reply).u8("present") != 0;
}

DTRAIN_DETAIL_INLINE bool store_client::erase(std::string_view key) {
  std::string body = begin(detail::wire::op::erase);
  detail::wire::writer(body).bytes32(key);
  auto reply = call(body, milliseconds(0), "erase(\"" + std::string(key) + "\")");
  return detail::wire::reader(*reply).u8("existed") != 0;
}

DTRAIN_DETAIL_INLINE std::string store_client::lease_body(std::string_view key,
                                                          std::string_view value) {
  std::string body = begin(detail::wire::op::lease);
  detail::wire::writer w(body);
  w.bytes32(key);
  w.bytes32(value);
  return body;
}

DTRAIN_DETAIL_INLINE std::string store_client::compare_set_body(std::string_view key,
                                                                std::string_view expected,
                                                                std::string_view desired) {
  std::string body = begin(detail::wire::op::compare_set);
  detail::wire::writer(body).bytes32(key).bytes32(expected).bytes32(desired);
  return body;
}

DTRAIN_DETAIL_INLINE void store_client::lease(std::string_view key, std::string_view value) {
  call(lease_body(key, value), milliseconds(0), "lease(\"" + std::string(key) + "\")");
  std::lock_guard lock(mutex_);
  auto held =
      std::find_if(leases_.begin(), leases_.end(), [&](const auto& kv) { return kv.first == key; });
  if (held == leases_.end()) {
    leases_.emplace_back(std::string(key), std::string(value));
  } else {
    held->second = value;
  }
}

DTRAIN_DETAIL_INLINE std::int64_t store_client::num_keys() {
  auto reply = call(begin(detail::wire::op::num_keys), milliseconds(0), "num_keys()");
  return static_cast<std::int64_t>(detail::wire::reader(*reply).u64("count"));
}

DTRAIN_DETAIL_INLINE void store_client::barrier(std::string_view name, int count,
                                                milliseconds timeout) {
  if (count < 1)
    throw config_error("barrier(\"" + std::string(name) + "\") count " + std::to_string(count) +
                       " must be at least 1");
  const std::string arrived = std::string(name) + "/arrived";
  std::int64_t n = add(arrived, 1);
  std::int64_t generation = (n - 1) / count;
  const std::string done = std::string(name) + "/done/" + std::to_string(generation);
  if (n % count == 0) set(done, "1");
  try {
    std::string keys[] = {done};
    wait(keys, timeout);
  } catch (const timeout_error&) {
    std::int64_t now = add(arrived, 0) - generation * count;
    throw timeout_error("barrier(\"" + std::string(name) + "\") on the store at " + endpoint() +
                        " timed out after " + seconds(timeout) + ": " +
                        std::to_string(std::min<std::int64_t>(now, count)) + " of " +
                        std::to_string(count) + " arrived");
  }
}

DTRAIN_DETAIL_INLINE std::string store_client::seconds(milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(t.count()) / 1000.0);
  return text;
}

DTRAIN_DETAIL_INLINE std::string store_client::key_list(std::span<const std::string> keys) {
  std::string out;
  for (std::size_t i = 0; i < keys.size() && i < 3; ++i)
    out += (i ? ", \"" : "\"") + keys[i] + "\"";
  if (keys.size() > 3) out += ", ... (" + std::to_string(keys.size()) + " keys)";
  return out;
}

DTRAIN_DETAIL_INLINE void store_client::connect(milliseconds patience, bool until_refused) {
  const auto deadline = steady::now() + patience;
  std::minstd_rand jitter(
      static_cast<unsigned>(std::hash<std::thread::id>{}(std::this_thread::get_id()) ^
                            static_cast<unsigned>(steady::now().time_since_epoch().count())));
  milliseconds backoff(10);
  std::string last_error;
  // A name the resolver does not know will not appear by waiting: fail at
  // once. A temporary resolver failure (EAI_AGAIN) gets a few seconds.
  const auto start = steady::now();
  const auto resolve_deadline = std::min(deadline, start + resolver_retry);
  auto next_report = start + options_.progress_interval;
  for (;;) {
    int resolver_rc = 0;
    bool refused = false;
    last_error = try_connect(deadline, resolver_rc, refused);
    if (resolver_rc != 0 && (resolver_rc != EAI_AGAIN || steady::now() >= resolve_deadline)) {
      throw config_error("cannot resolve \"" + host_ + "\", the host of the store at " +
                         endpoint() + ": " + ::gai_strerror(resolver_rc) +
                         "; check MASTER_ADDR (dtrun --master-addr)");
    }
    // Nobody listens there now: a server that closed an idle connection
    // still would, so the one this client knew has ended.
    if (refused && until_refused) {
      throw rendezvous_error("nothing listens at " + endpoint() + " any more (" + last_error +
                             "): the process that served the store has ended");
    }
    // A server at its connection cap closes newcomers unanswered: knock again.
    if (last_error.empty()) last_error = try_handshake(deadline);
    if (last_error.empty()) return;
    const auto now = steady::now();
    auto left = deadline - now;
    if (left <= steady::duration::zero()) {
      throw timeout_error("could not reach the store at " + endpoint() + " within " +
                          seconds(patience) + " (last error: " + last_error +
                          "); check that the process hosting it (rank 0, or the node-0 agent) "
                          "is running, "
                          "that MASTER_ADDR and MASTER_PORT are the same on every rank, "
                          "and that no firewall blocks the port");
    }
    if (options_.progress_interval > milliseconds::zero() && now >= next_report) {
      detail::say(options_.progress,
                  "still trying to connect to the store at " + endpoint() + " (" +
                      detail::whole_seconds(std::chrono::duration_cast<milliseconds>(now - start)) +
                      " of " + detail::whole_seconds(patience) + "; last error: " + last_error +
                      ")");
      next_report = now + options_.progress_interval;
    }
    // Jittered exponential backoff, so a thousand workers do not knock in step.
    auto pause =
        backoff / 2 + milliseconds(jitter() % static_cast<unsigned>(backoff.count() / 2 + 1));
    std::this_thread::sleep_for(std::min<steady::duration>(pause, left));
    backoff = std::min(backoff * 2, milliseconds(1000));
  }
}

DTRAIN_DETAIL_INLINE std::string store_client::try_handshake(steady::time_point deadline) {
  try {
    handshake(deadline);
    return {};
  } catch (const error& e) {  // lost, or no answer in time
    if (refused_) throw;
    fd_.reset();
    broken_ = false;
    return e.what();
  }
}

DTRAIN_DETAIL_INLINE std::string store_client::try_connect(steady::time_point deadline,
                                                           int& resolver_rc, bool& refused) {
  refused = false;
  detail::address_list addrs;
  if (int rc = detail::resolve(host_, port_, false, addrs); rc != 0) {
    resolver_rc = rc;
    return std::string("cannot resolve ") + host_ + ": " + ::gai_strerror(rc);
  }
  std::string why;
  for (const addrinfo* a = addrs.head; a; a = a->ai_next) {
    detail::unique_fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
      why = std::strerror(errno);
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        refused = errno == ECONNREFUSED;
        why = std::strerror(errno);
        continue;
      }
      pollfd p{fd.get(), POLLOUT, 0};
      int left = remaining_ms(deadline);
      if (::poll(&p, 1, std::min(left, 5000)) <= 0) {
        why = "connect timed out";
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        refused = err == ECONNREFUSED;
        why = std::strerror(err);
        continue;
      }
    }
    detail::set_no_delay(fd.get());
    fd_ = std::move(fd);
    return {};
  }
  return why.empty() ? "no address" : why;
}

DTRAIN_DETAIL_INLINE int store_client::remaining_ms(steady::time_point deadline) {
  auto left = std::chrono::ceil<milliseconds>(deadline - steady::now()).count();
  return static_cast<int>(std::clamp<std::int64_t>(left, 0, 1 << 30));
}

DTRAIN_DETAIL_INLINE void store_client::handshake(steady::time_point connect_deadline) {
  std::string hello;
  detail::wire::writer(hello)
      .u32(detail::wire::magic)
      .u16(detail::wire::version)
      .bytes16(options_.token);
  auto deadline = std::min(connect_deadline, steady::now() + options_.io_timeout);
  send_all(hello, deadline, "the handshake");
  std::string reply = recv_exact(3, deadline, "the handshake reply");
  detail::wire::reader r(reply);
  auto s = static_cast<detail::wire::status>(r.u8("status"));
  auto version = r.u16("version");
  refused_ = s != detail::wire::status::ok;
  if (s == detail::wire::status::bad_token) {
    broken_ = true;
    throw token_error("the store at " + endpoint() +
                      " rejected this client's token; set the same DTRAIN_STORE_TOKEN "
                      "(or token option) on every rank");
  }
  if (s == detail::wire::status::bad_version) {
    broken_ = true;
    throw rendezvous_error("the store at " + endpoint() + " speaks protocol version " +
                           std::to_string(version) + ", this client " +
                           std::to_string(detail::wire::version) +
                           "; build every rank with the same dtrain");
  }
  if (s != detail::wire::status::ok) {
    broken_ = true;
    throw rendezvous_error("the store at " + endpoint() + " answered the handshake with status " +
                           std::to_string(static_cast<int>(s)));
  }
  const std::uint64_t instance =
      detail::wire::reader(recv_exact(8, deadline, "the handshake reply")).u64("instance");
  if (instance_ != 0 && instance != instance_) {
    // Reconnected to another server at the same address: it holds none of
    // this client's keys (a replaced node 0 agent, a restarted rank 0).
    // Knocking again cannot help.
    refused_ = true;
    broken_ = true;
    throw rendezvous_error("the store at " + endpoint() +
                           " is no longer the one this client joined: its server was restarted, "
                           "and the new one holds none of the keys of the old");
  }
  instance_ = instance;
}

DTRAIN_DETAIL_INLINE std::optional<std::string> store_client::call(const std::string& body,
                                                                   milliseconds server_wait,
                                                                   const std::string& what) {
  std::lock_guard lock(mutex_);
  if (broken_)
    throw rendezvous_error(what + ": the connection to the store at " + endpoint() +
                           " was lost earlier");
  // After a silence the server may have closed the connection as idle:
  // reopen it rather than fail. If it closes just as this request leaves,
  // no reply byte arrives, and the request is sent again once.
  const bool was_idle = steady::now() - last_reply_ > milliseconds(100);
  requests_.fetch_add(1, std::memory_order_relaxed);
  if (closed_by_server()) reopen(what);
  try {
    auto reply = exchange(body, server_wait, what);
    last_reply_ = steady::now();
    return reply;
  } catch (const rendezvous_error&) {
    if (!was_idle || reply_started_ || !broken_) throw;
    reopen(what);
    auto reply = exchange(body, server_wait, what);
    last_reply_ = steady::now();
    return reply;
  }
}

DTRAIN_DETAIL_INLINE bool store_client::closed_by_server() const {
  char byte;
  ssize_t n = ::recv(fd_.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

DTRAIN_DETAIL_INLINE void store_client::reopen(const std::string& what) {
  fd_.reset();
  broken_ = false;
  try {
    connect(options_.io_timeout, true);
    // The close released them. Each is leased again unless another client
    // set its key since (a node agent that took this one's place while it
    // was frozen): the key is theirs then, and no longer this client's lease.
    for (auto it = leases_.begin(); it != leases_.end();) {
      const auto& [key, value] = *it;
      const std::string what_key = "lease(\"" + key + "\")";
      const auto now = exchange(compare_set_body(key, "", value), milliseconds(0), what_key);
      if (detail::wire::reader(*now).bytes32("value", UINT32_MAX) != value) {
        it = leases_.erase(it);
        continue;
      }
      (void)exchange(lease_body(key, value), milliseconds(0), what_key);
      ++it;
    }
  } catch (const error& e) {
    broken_ = true;
    throw rendezvous_error(what + ": the store at " + endpoint() +
                           " closed this connection, and it cannot be reopened: " + e.what());
  }
}

DTRAIN_DETAIL_INLINE std::optional<std::string> store_client::exchange(const std::string& body,
                                                                       milliseconds server_wait,
                                                                       const std::string& what) {
  reply_started_ = false;
  // The reply may take the server-side wait, plus the io timeout before the server is presumed
  // dead.
  auto deadline = steady::now() + server_wait + options_.io_timeout;
  try {
    send_all(detail::wire::frame(body), deadline, what);
    std::string head = recv_exact(4, deadline, what);
    std::uint32_t length = detail::wire::frame_length(head);
    if (length == 0 || length > options_.limits.max_frame_size()) {
      throw rendezvous_error(what + ": the store at " + endpoint() + " sent a reply of " +
                             std::to_string(length) + " bytes");
    }
    std::string reply = recv_exact(length, deadline, what);
    auto s = static_cast<detail::wire::status>(static_cast<unsigned char>(reply[0]));
    std::string_view payload = std::string_view(reply).substr(1);
    switch (s) {
      case detail::wire::status::ok: return std::string(payload);
      case detail::wire::status::timeout: return std::nullopt;
      case detail::wire::status::error:
      case detail::wire::status::shutting_down: {
        detail::wire::reader r(payload);
        auto message = std::string(r.bytes32("message", UINT32_MAX));
        if (s == detail::wire::status::shutting_down) broken_ = true;
        throw rendezvous_error(what + " on the store at " + endpoint() + ": " + message);
      }
      default:
        throw rendezvous_error(what + ": the store at " + endpoint() +
                               " answered with unknown status " +
                               std::to_string(static_cast<int>(s)));
    }
  } catch (const detail::wire::violation& e) {
    broken_ = true;
    throw rendezvous_error(what + ": malformed reply from the store at " + endpoint() + ": " +
                           e.what());
  } catch (const timeout_error&) {
    broken_ = true;  // a reply may still arrive; the stream can no longer be trusted
    throw;
  }
}

DTRAIN_DETAIL_INLINE void store_client::send_all(std::string_view data, steady::time_point deadline,
                                                 const std::string& what) {
  while (!data.empty()) {
    ssize_t n = ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) lost(what, std::strerror(errno));
    await(POLLOUT, deadline, what);
  }
}

DTRAIN_DETAIL_INLINE std::string store_client::recv_exact(std::size_t size,
                                                          steady::time_point deadline,
                                                          const std::string& what) {
  std::string out;
  char chunk[16384];
  while (out.size() < size) {
    ssize_t n = ::recv(fd_.get(), chunk, std::min(sizeof chunk, size - out.size()), 0);
    if (n > 0) {
      out.append(chunk, static_cast<std::size_t>(n));
      reply_started_ = true;
      continue;
    }
    if (n == 0) lost(what, "the server closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) lost(what, std::strerror(errno));
    await(POLLIN, deadline, what);
  }
  return out;
}

DTRAIN_DETAIL_INLINE void store_client::await(short events, steady::time_point deadline,
                                              const std::string& what) {
  pollfd p{fd_.get(), events, 0};
  for (;;) {
    int left = remaining_ms(deadline);
    int rc = ::poll(&p, 1, left);
    if (rc > 0) return;
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) lost(what, std::strerror(errno));
    broken_ = true;
    throw timeout_error(what + ": no reply from the store at " + endpoint() +
                        " in time; the server is overloaded, hung or unreachable");
  }
}

DTRAIN_DETAIL_INLINE void store_client::lost(const std::string& what, const std::string& why) {
  broken_ = true;
  throw rendezvous_error(what + ": lost the connection to the store at " + endpoint() + " (" + why +
                         "); did the process hosting it exit?");
}

}  // namespace dtrain
