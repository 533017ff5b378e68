#pragma once
/// @file
/// The non-template bodies of dtrain/diagnostics.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/diagnostics.hpp, not this file.

#include <dtrain/diagnostics.hpp>

#include <ctime>
#include <filesystem>
#include <system_error>

namespace dtrain {

DTRAIN_DETAIL_INLINE diagnostics_options
diagnostics_options::with_env(const environment& env) const {
  diagnostics_options out = *this;
  if (auto on = detail::read_flag(env, diagnostics_variable)) out.enabled = *on;
  if (auto t = detail::read_seconds(env, diagnostics_wait_variable)) out.wait = *t;
  out.dir = detail::read_setting(env, diagnostics_dir_variable, out.dir);
  return out;
}
}  // namespace dtrain

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE void on_diagnostics_signal(int) {
  const int saved = errno;
  const int fd = diagnostics_signal_fd.load();
  const std::uint64_t one = 1;
  if (fd >= 0) (void)!::write(fd, &one, sizeof one);
  errno = saved;
}

DTRAIN_DETAIL_INLINE rank_diagnostics::rank_diagnostics(
    const std::string& host, int port, store_options store, std::string prefix, int rank, int size,
    std::shared_ptr<collective_ring> ring, std::string name, diagnostics_options options,
    std::string node, std::shared_ptr<const flight_note> note)
    : client_(host, port, bounded(std::move(store), options.wait)),
      store_(client_, std::move(prefix)),
      rank_(rank),
      size_(size),
      ring_(std::move(ring)),
      name_(std::move(name)),
      options_(std::move(options)),
      node_(std::move(node)),
      note_(std::move(note)) {
  if (!options_.dir.empty()) {
    std::error_code ec;
    const bool directory = std::filesystem::is_directory(options_.dir, ec);
    if (!directory || ::access(options_.dir.c_str(), W_OK) != 0) {
      const int saved = errno;
      throw config_error(
          std::string(diagnostics_dir_variable) + " (or diagnostics_options::dir) = " +
          options_.dir + " on rank " + std::to_string(rank_) + ": " +
          (directory ? std::string("this rank cannot write there: ") + std::strerror(saved)
                     : std::string("not a directory")) +
          " (each rank writes its flight record there)");
    }
  }
  wake_ = DTRAIN_SYSCALL(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  previous_fd_ = diagnostics_signal_fd.exchange(wake_);
  struct sigaction sa {};
  sa.sa_handler = on_diagnostics_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGUSR1, &sa, &previous_action_);
  thread_ = std::thread([this] { serve(); });
}

DTRAIN_DETAIL_INLINE rank_diagnostics::~rank_diagnostics() {
  int mine = wake_;
  if (diagnostics_signal_fd.compare_exchange_strong(mine, previous_fd_)) {
    ::sigaction(SIGUSR1, &previous_action_, nullptr);
  }
  stopping_ = true;
  wake();
  thread_.join();
  ::close(wake_);
}

DTRAIN_DETAIL_INLINE bool rank_diagnostics::collective_failed() const {
  for (const auto& entry : ring_->snapshot_all()) {
    for (const call_record& c : entry.second) {
      if (c.state == call_state::failed || c.state == call_state::timed_out) return true;
    }
  }
  return false;
}

DTRAIN_DETAIL_INLINE std::string rank_diagnostics::explain(const std::string& reason) noexcept {
  try {
    record(reason);  // first: the store may be gone
    const std::int64_t round = join_round();
    const std::string reason_key = diagnostics_keys::of(round, "reason");
    const std::string why = wire::decode_text(
        "store key " + store_.prefix() + reason_key,
        store_.compare_set(reason_key, "", wire::encode_text(reason)), "a diagnostics reason");
    publish(round);
    const desync_report report = analyse_job(gather(round));
    const std::string header = "collective diagnostics, round " + std::to_string(round) +
                               ", after " + why + " (" + name_ + ", " + std::to_string(size_) +
                               " ranks; printed by rank " + std::to_string(rank_) + ")";
    const std::string table = format_report(header, report);
    const std::string closed = diagnostics_keys::of(round, "closed");
    const std::string me = wire::encode_int(rank_);
    if (store_.compare_set(diagnostics_keys::of(round, "printer"), "", me) == me) {
      std::fputs(table.c_str(), stderr);
      std::fflush(stderr);
      store_.set(closed, present_value());
    } else {
      // This rank may exit next, and a launcher stop the others: not before the table is out.
      store_.wait(std::span<const std::string>(&closed, 1), options_.wait);
    }
    return report.summary;
  } catch (const std::exception& e) {
    return std::string("no diagnostics: ") + e.what();
  }
}

DTRAIN_DETAIL_INLINE store_options rank_diagnostics::bounded(store_options o,
                                                             std::chrono::milliseconds wait) {
  o.timeout = std::min(o.timeout, wait);
  o.io_timeout = std::min(o.io_timeout, wait);
  return o;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::wake() noexcept {
  const std::uint64_t one = 1;
  (void)!::write(wake_, &one, sizeof one);
}

DTRAIN_DETAIL_INLINE std::int64_t rank_diagnostics::join_round() {
  const std::int64_t current = store_.add("round", 0);
  const std::string closed = diagnostics_keys::of(current, "closed");
  if (current > 0 && !store_.check(std::span<const std::string>(&closed, 1))) return current;
  const std::int64_t next = current + 1;
  const std::string me = wire::encode_int(rank_);
  if (store_.compare_set(diagnostics_keys::open(next), "", me) == me) {
    store_.add("round", 1);  // every rank's thread now publishes for it
  }
  return next;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::publish(std::int64_t round) {
  store_.set(diagnostics_keys::ring(round, rank_), encode_rings(ring_->snapshot_all()));
  published_ = std::max(published_.load(), round);
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::record(const std::string& reason) noexcept {
  if (options_.dir.empty()) return;
  const std::lock_guard lock(record_mutex_);
  if (record_failed_) return;
  try {
    const flight_record r{rank_,
                          size_,
                          name_,
                          node_,
                          reason,
                          static_cast<std::int64_t>(std::time(nullptr)),
                          ring_->snapshot_all(),
                          note_ ? note_->get() : std::string()};
    write_file_whole(flight_record_file(options_.dir, rank_).string(), encode_flight_record(r),
                     std::string(diagnostics_dir_variable) + " (or diagnostics_options::dir)",
                     rank_);
  } catch (const std::exception& e) {
    record_failed_ = true;
    std::fprintf(stderr, "[rank %d/%d] dtrain: no flight record: %s (said once)\n", rank_, size_,
                 e.what());
    std::fflush(stderr);
  }
}

DTRAIN_DETAIL_INLINE std::vector<rank_publication> rank_diagnostics::gather(std::int64_t round) {
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(diagnostics_keys::ring(round, r));
  try {
    store_.wait(keys, options_.wait);
  } catch (const timeout_error&) {
    // Some rank is silent: analysed as such below.
  }
  std::vector<rank_publication> ranks;
  for (int r = 0; r < size_; ++r) {
    rank_publication p{r, false, {}};
    const std::string& key = keys[static_cast<std::size_t>(r)];
    if (store_.check(std::span<const std::string>(&key, 1))) {
      if (auto rings = decode_rings(store_.get(key))) {
        p.answered = true;
        p.rings = std::move(*rings);
      }
    }
    ranks.push_back(std::move(p));
  }
  return ranks;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::serve() {
  pollfd p{wake_, POLLIN, 0};
  bool store_ok = true;
  while (!stopping_) {
    const int ready = ::poll(&p, 1, static_cast<int>(options_.poll.count()));
    if (stopping_) return;
    if (ready > 0) {
      std::uint64_t count = 0;
      (void)!::read(wake_, &count, sizeof count);
      if (!stopping_ && store_ok) {
        const std::string summary = explain("SIGUSR1 on rank " + std::to_string(rank_));
        std::fprintf(stderr, "[rank %d/%d] dtrain: SIGUSR1: %s\n", rank_, size_, summary.c_str());
        std::fflush(stderr);
      }
    }
    if (!store_ok) continue;
    try {
      const std::int64_t round = store_.add("round", 0);
      if (round > published_) {
        record("");  // another rank's round: this rank's flight record too
        publish(round);
      }
    } catch (const std::exception&) {
      store_ok = false;
    }
  }
}

}  // namespace detail
}  // namespace dtrain
