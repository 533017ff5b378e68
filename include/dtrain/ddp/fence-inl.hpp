#pragma once
/// @file
/// The non-template bodies of dtrain/ddp/fence.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/ddp/fence.hpp, not this file.

#include <dtrain/ddp/fence.hpp>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <string_view>

namespace dtrain::detail {

/// The live fences, for the fault handler (which may take no lock).
DTRAIN_DETAIL_INLINE std::array<std::atomic<const value_fence*>, 64> live_fences{};
/// SIGSEGV's action before the fences' handler was installed (once, never removed).
DTRAIN_DETAIL_INLINE struct sigaction fence_previous_action {};
DTRAIN_DETAIL_INLINE std::once_flag fence_handler_once;

/// A message built without allocating, for a signal handler.
class signal_text {
 public:
  signal_text& operator<<(std::string_view s) noexcept {
    for (const char c : s) {
      if (used_ == text_.size()) break;
      text_[used_++] = c;
    }
    return *this;
  }
  signal_text& operator<<(std::uint64_t n) noexcept {
    char digits[20];
    std::size_t k = 0;
    do {
      digits[k++] = static_cast<char>('0' + n % 10);
      n /= 10;
    } while (n != 0);
    while (k > 0) *this << std::string_view(&digits[--k], 1);
    return *this;
  }
  void write_out() const noexcept {
    std::size_t done = 0;
    while (done < used_) {
      const ssize_t n = ::write(STDERR_FILENO, text_.data() + done, used_ - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      done += static_cast<std::size_t>(n);
    }
  }

 private:
  std::array<char, 2048> text_{};
  std::size_t used_ = 0;
};

DTRAIN_DETAIL_INLINE void on_fence_fault(int sig, siginfo_t* info, void* context) {
  const int saved = errno;
  if (info != nullptr && info->si_code > 0) {  // a fault, not a signal sent
    int access = 0;                            // 1 read, 2 write, 0 not known
#if defined(__x86_64__) && defined(REG_ERR)
    if (context != nullptr) {
      access = (static_cast<const ucontext_t*>(context)->uc_mcontext.gregs[REG_ERR] & 2) ? 2 : 1;
    }
#endif
    for (const std::atomic<const value_fence*>& slot : live_fences) {
      if (const value_fence* fence = slot.load(std::memory_order_acquire))
        fence->report_if_mine(info->si_addr, access);  // ends the process if it is
    }
  }
  // Not a fence's: what SIGSEGV did before.
  const struct sigaction& before = fence_previous_action;
  errno = saved;
  if ((before.sa_flags & SA_SIGINFO) != 0 && before.sa_sigaction != nullptr) {
    before.sa_sigaction(sig, info, context);
    return;
  }
  if ((before.sa_flags & SA_SIGINFO) == 0 && before.sa_handler != SIG_DFL &&
      before.sa_handler != SIG_IGN) {
    before.sa_handler(sig);
    return;
  }
  const bool sent = info == nullptr || info->si_code <= 0;
  if (sent && (before.sa_flags & SA_SIGINFO) == 0 && before.sa_handler == SIG_IGN) return;
  // The default: a fault happens again on return, now with it (a core
  // dump); a signal sent is sent again, delivered once this returns.
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(sig, &fallback, nullptr);
  if (sent) ::raise(sig);
  errno = saved;
}

DTRAIN_DETAIL_INLINE value_fence::value_fence(std::vector<place> places, int rank, int size)
    : places_(std::move(places)), rank_(rank), size_(size) {
  offsets_.reserve(places_.size());
  std::size_t at = 0;
  for (const place& p : places_) {
    offsets_.push_back(at);
    at += (std::max<std::size_t>(p.bytes, 1) + 63) / 64 * 64;  // a place of its own even if empty
  }
  if (at == 0) return;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t bytes = (at + page - 1) / page * page;
  void* reserved =
      ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) return;
  base_ = static_cast<std::byte*>(reserved);  // before it is published
  bytes_ = bytes;
  std::call_once(fence_handler_once, [] {
    ::sigaction(SIGSEGV, nullptr, &fence_previous_action);
    struct sigaction mine {};
    mine.sa_sigaction = on_fence_fault;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&mine.sa_mask);
    ::sigaction(SIGSEGV, &mine, nullptr);
  });
  for (std::size_t s = 0; s < live_fences.size(); ++s) {
    const value_fence* none = nullptr;
    if (live_fences[s].compare_exchange_strong(none, this, std::memory_order_acq_rel)) {
      slot_ = s;
      return;
    }
  }
  ::munmap(reserved, bytes);  // every slot taken: no fence
  base_ = nullptr;
  bytes_ = 0;
}

DTRAIN_DETAIL_INLINE value_fence::~value_fence() {
  if (base_ == nullptr) return;
  live_fences[slot_].store(nullptr, std::memory_order_release);
  ::munmap(base_, bytes_);
}

DTRAIN_DETAIL_INLINE void* value_fence::at(std::size_t i) const noexcept {
  return base_ != nullptr && i < offsets_.size() ? base_ + offsets_[i] : nullptr;
}

DTRAIN_DETAIL_INLINE bool value_fence::contains(const void* p) const noexcept {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const auto from = reinterpret_cast<std::uintptr_t>(base_);
  return base_ != nullptr && a >= from && a - from < bytes_;
}

DTRAIN_DETAIL_INLINE bool value_fence::holds(const void* p) noexcept {
  for (const std::atomic<const value_fence*>& slot : live_fences) {
    const value_fence* f = slot.load(std::memory_order_acquire);
    if (f != nullptr && f->contains(p)) return true;
  }
  return false;
}

DTRAIN_DETAIL_INLINE void value_fence::report_if_mine(const void* address,
                                                      int access) const noexcept {
  if (!contains(address) || offsets_.empty()) return;
  const auto at = static_cast<std::size_t>(reinterpret_cast<std::uintptr_t>(address) -
                                           reinterpret_cast<std::uintptr_t>(base_));
  const auto next = std::upper_bound(offsets_.begin(), offsets_.end(), at);
  const auto i = static_cast<std::size_t>(next - offsets_.begin()) - 1;  // offsets_[0] is 0
  const place& p = places_[i];
  const std::size_t element = std::max<std::size_t>(p.element, 1);
  signal_text out;
  out << "[rank " << static_cast<std::uint64_t>(rank_) << "/" << static_cast<std::uint64_t>(size_)
      << "] dtrain: parameter '" << p.name << "'";
  if (p.unit >= 0) out << " (unit " << static_cast<std::uint64_t>(p.unit) << ")";
  out << (access == 2   ? " was written"
          : access == 1 ? " was read"
                        : " was read or written")
      << " outside a gather() (at its element " << (at - offsets_[i]) / element << " of "
      << p.bytes / element
      << "): with ddp_options::sharding = parameters a rank holds only its shard of the values "
         "between gathers, and the parameter points at no memory; call the model through "
         "ddp(x), or hold a gather() of its unit while its values are used "
         "(docs/troubleshooting.md#a-parameter-used-outside-a-gather-at-zero-stage-3)\n";
  out.write_out();
  ::_exit(1);
}

}  // namespace dtrain::detail
