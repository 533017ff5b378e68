#pragma once
/// @file
/// The non-template bodies of dtrain/backend/work.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/work.hpp, not this file.

#include <dtrain/backend/work.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE collective_options collective_options::with_env(const environment& env) const {
  collective_options out = *this;
  if (auto t = detail::read_seconds(env, collective_timeout_variable)) out.timeout = *t;
  if (auto flag = detail::read_flag(env, check_collectives_variable)) out.check = *flag;
  return out;
}
}  // namespace dtrain

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::string describe(std::string_view what, std::string_view detail, int rank,
                                          int size, std::string_view engine) {
  return std::string(what) + "(" + std::string(detail) + ") on rank " + std::to_string(rank) +
         " of " + std::to_string(size) + " (" + std::string(engine) + ")";
}

DTRAIN_DETAIL_INLINE std::string describe(const collective_info& info) {
  std::string detail;
  if (info.op >= 0) detail = std::string(to_string(static_cast<reduce_op>(info.op))) + ", ";
  if (info.collective != "barrier") {
    detail +=
        std::to_string(info.count) + " x " + std::string(to_string(static_cast<dtype>(info.type)));
  }
  if (info.root >= 0) detail += ", root " + std::to_string(info.root);
  return describe(info.collective, detail, info.rank, info.size, info.engine);
}

DTRAIN_DETAIL_INLINE std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

DTRAIN_DETAIL_INLINE void failure_cause::set(std::string&& text) noexcept {
  if (!*this) {
    text_ = std::move(text);
    has_text_ = true;
  }
}

DTRAIN_DETAIL_INLINE void failure_cause::set(const collective_info& call,
                                             const char* how) noexcept {
  if (!*this) {
    call_ = call;
    how_ = how;
  }
}

DTRAIN_DETAIL_INLINE void failure_cause::set(const char* what, int rank) noexcept {
  if (!*this) {
    call_ = collective_info{};
    call_.rank = rank;
    how_ = what;
  }
}

DTRAIN_DETAIL_INLINE std::string failure_cause::text() const {
  if (error_) return message_of(error_);
  if (has_text_) return text_;
  if (how_ == nullptr) return {};
  if (call_.collective.empty()) return std::string(how_) + " on rank " + std::to_string(call_.rank);
  return describe(call_) + " " + how_;
}

DTRAIN_DETAIL_INLINE bool work_state::wait_until(std::chrono::steady_clock::time_point deadline) {
  backoff pause;
  for (;;) {
    if (poll()) return true;
    if (std::chrono::steady_clock::now() > deadline) return poll();
    pause();
  }
}

DTRAIN_DETAIL_INLINE const std::string& work_state::description() const {
  if (description_.empty()) description_ = describe(info_);
  return description_;
}

DTRAIN_DETAIL_INLINE void work_state::track(std::shared_ptr<collective_ring> ring,
                                            std::int64_t seq) noexcept {
  ring_ = std::move(ring);
  seq_ = seq;
}

DTRAIN_DETAIL_INLINE void work_state::see_done(call_state state) noexcept {
  std::lock_guard lock(end_mutex_);
  if (seen_done_.load(std::memory_order_relaxed)) return;
  seen_done_.store(true, std::memory_order_release);
  settle(state);
}

DTRAIN_DETAIL_INLINE bool work_state::see_timeout(std::exception_ptr timeout) noexcept {
  std::lock_guard lock(end_mutex_);
  if (seen_done_.load(std::memory_order_relaxed)) return false;
  timed_out_ = std::move(timeout);
  seen_done_.store(true, std::memory_order_release);
  settle(call_state::timed_out);
  return true;
}

DTRAIN_DETAIL_INLINE std::exception_ptr work_state::timed_out() const noexcept {
  std::lock_guard lock(end_mutex_);
  return timed_out_;
}
}  // namespace detail
}  // namespace dtrain

namespace dtrain {

DTRAIN_DETAIL_INLINE bool work::test() {
  if (!state_ || state_->seen_done()) return true;
  if (state_->poll()) ended();
  return state_->seen_done();
}

DTRAIN_DETAIL_INLINE void work::wait(std::chrono::milliseconds timeout) {
  if (!finish_within(timeout)) give_up(timeout);
  if (auto e = exception()) std::rethrow_exception(e);
}

DTRAIN_DETAIL_INLINE bool work::finish_within(std::chrono::milliseconds timeout) {
  if (!state_ || test()) return true;
  if (!state_->wait_until(std::chrono::steady_clock::now() + timeout)) return false;
  ended();
  return true;
}

DTRAIN_DETAIL_INLINE std::exception_ptr work::timeout_exception(
    std::chrono::milliseconds timeout) const {
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f s", static_cast<double>(timeout.count()) / 1000.0);
  return std::make_exception_ptr(
      timeout_error((state_ ? state_->description() : std::string("a collective")) +
                    " did not finish within " + seconds +
                    "; a peer is slow, dead or called a different collective "
                    "(DTRAIN_CHECK_COLLECTIVES=1 compares what every rank passed)"));
}

DTRAIN_DETAIL_INLINE void work::give_up(std::chrono::milliseconds timeout) {
  auto e = timeout_exception(timeout);
  if (state_ && state_->see_timeout(e)) state_->on_timeout();
  std::rethrow_exception(e);
}

DTRAIN_DETAIL_INLINE std::exception_ptr work::exception() const noexcept {
  if (!state_ || !state_->seen_done()) return nullptr;
  if (auto e = state_->timed_out()) return e;
  return state_->error();
}

}  // namespace dtrain
