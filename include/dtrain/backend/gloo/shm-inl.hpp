#pragma once
/// @file
/// The non-template bodies of dtrain/backend/gloo/shm.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/gloo/shm.hpp, not this file.

#include <dtrain/backend/gloo/shm.hpp>

#if DTRAIN_HAS_SHM()
namespace dtrain::detail {

DTRAIN_DETAIL_INLINE shm_segment::~shm_segment() {
  if (base_) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

DTRAIN_DETAIL_INLINE shm_segment shm_segment::create(const std::string& name, int size) {
  shm_segment s;
  s.rank_ = 0;
  s.size_ = size;
  s.slot_ = shm_slot_bytes(size);
  s.bytes_ = data_offset(size) + (static_cast<std::size_t>(size) + 1) * s.slot_;
  s.fd_ = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, S_IRUSR | S_IWUSR);
  if (s.fd_ < 0) fail_call("shm_open(" + name + ", O_CREAT | O_EXCL, 0600)");
  try {
    // Reserve every page now: a tmpfs that is full (a container's 64 MiB
    // /dev/shm) fails here, not with SIGBUS on a later write.
    if (const int e = ::posix_fallocate(s.fd_, 0, static_cast<off_t>(s.bytes_)); e != 0) {
      errno = e;
      fail_call("posix_fallocate(" + name + ", " + std::to_string(s.bytes_) + " bytes)");
    }
    s.map(name);
    auto* c = new (s.base_) control{};
    c->size = static_cast<std::uint32_t>(size);
    c->slot_bytes = s.slot_;
    for (int r = 0; r < size; ++r) new (&s.flags(r)) rank_flags{};
    c->magic = magic;  // last: a segment with the magic is complete
    s.lock_own_byte(name);
  } catch (...) {
    unlink(name);  // nothing of a segment that failed stays behind
    throw;
  }
  return s;
}

DTRAIN_DETAIL_INLINE shm_segment shm_segment::open(const std::string& name, int rank, int size) {
  shm_segment s;
  s.rank_ = rank;
  s.size_ = size;
  s.slot_ = shm_slot_bytes(size);
  s.bytes_ = data_offset(size) + (static_cast<std::size_t>(size) + 1) * s.slot_;
  s.fd_ = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (s.fd_ < 0) fail_call("shm_open(" + name + ", O_RDWR)");
  struct stat st {};
  if (::fstat(s.fd_, &st) != 0) fail_call("fstat(" + name + ")");
  if (static_cast<std::size_t>(st.st_size) != s.bytes_) {
    throw shm_failure("segment " + name + " holds " + std::to_string(st.st_size) +
                          " bytes, not the " + std::to_string(s.bytes_) + " of a group of " +
                          std::to_string(size),
                      false);
  }
  s.map(name);
  const control& c = s.head();
  if (c.magic != magic || c.size != static_cast<std::uint32_t>(size) || c.slot_bytes != s.slot_) {
    throw shm_failure(
        "segment " + name + " was not made by dtrain for a group of " + std::to_string(size),
        false);
  }
  s.lock_own_byte(name);
  return s;
}

DTRAIN_DETAIL_INLINE void shm_segment::abandon(std::string_view why, bool timed_out) noexcept {
  if (!base_) return;
  control& c = head();
  if (c.claimed.exchange(1) == 0) {
    const std::size_t n = why.size() < sizeof c.why - 1 ? why.size() : sizeof c.why - 1;
    std::memcpy(c.why, why.data(), n);
    c.why[n] = '\0';
    c.timed_out.store(timed_out ? 1 : 0, std::memory_order_relaxed);
    c.abandoned_by.store(static_cast<std::uint32_t>(rank_) + 1, std::memory_order_release);
  }
  for (int r = 0; r < size_; ++r) {
    wake(flags(r).arrived);
    wake(flags(r).reduced);
  }
}

DTRAIN_DETAIL_INLINE void shm_segment::map(const std::string& name) {
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) fail_call("mmap(" + name + ")");
  base_ = p;
}

DTRAIN_DETAIL_INLINE void shm_segment::lock_own_byte(const std::string& name) {
  struct flock l {};
  l.l_type = F_WRLCK;
  l.l_whence = SEEK_SET;
  l.l_start = rank_;
  l.l_len = 1;
  if (::fcntl(fd_, F_OFD_SETLK, &l) != 0) fail_call("fcntl(" + name + ", F_OFD_SETLK)");
}

DTRAIN_DETAIL_INLINE bool shm_segment::alive(int peer) const noexcept {
  struct flock l {};
  l.l_type = F_WRLCK;
  l.l_whence = SEEK_SET;
  l.l_start = peer;
  l.l_len = 1;
  if (::fcntl(fd_, F_OFD_GETLK, &l) != 0) return true;
  return l.l_type != F_UNLCK;
}

DTRAIN_DETAIL_INLINE auto shm_segment::flags(int r) const noexcept -> rank_flags& {
  auto* p = static_cast<unsigned char*>(base_) + sizeof(control) +
            static_cast<std::size_t>(r) * sizeof(rank_flags);
  return *std::launder(reinterpret_cast<rank_flags*>(p));
}

DTRAIN_DETAIL_INLINE long shm_segment::futex(std::atomic<std::uint32_t>& word, int op,
                                             std::uint32_t value, const timespec* wait) noexcept {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), op, value, wait, nullptr, 0);
}

DTRAIN_DETAIL_INLINE void shm_segment::publish(flag& f, std::uint32_t k) noexcept {
  f.value.store(k, std::memory_order_seq_cst);
  if (f.sleepers.load(std::memory_order_seq_cst) != 0) wake(f);
}

DTRAIN_DETAIL_INLINE void shm_segment::wait_all(flag rank_flags::*which, std::uint32_t k,
                                                std::chrono::steady_clock::time_point deadline,
                                                std::chrono::milliseconds timeout,
                                                const char* phase, std::size_t c,
                                                std::size_t chunks) {
  for (int q = 0; q < size_; ++q) {
    flag& f = flags(q).*which;
    for (int spin = 0; spin < 256 && !reached(f.value.load(std::memory_order_acquire), k); ++spin) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    while (!reached(f.value.load(std::memory_order_acquire), k)) {
      // The rank waited for first: its death is the cause, another's giving up a consequence.
      if (!alive(q)) {
        std::string why = where(q, phase, c, chunks) + ": rank " + std::to_string(q) +
                          " exited or closed its communicator (its lock on the segment is gone)";
        abandon(why);
        throw shm_failure(why, false);
      }
      if (const std::uint32_t by = head().abandoned_by.load(std::memory_order_acquire); by != 0) {
        const char* why = head().why;
        throw shm_failure("rank " + std::to_string(by - 1) + " gave up on this allreduce: " +
                              std::string(why, ::strnlen(why, sizeof head().why)),
                          head().timed_out.load(std::memory_order_relaxed) != 0);
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        std::string why = where(q, phase, c, chunks) + ": rank " + std::to_string(q) +
                          " did not come within the timeout (" + std::to_string(timeout.count()) +
                          " ms): timed out";
        abandon(why, true);
        throw shm_failure(why, true);
      }
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
      const auto slice = left < std::chrono::milliseconds(20)
                             ? left
                             : std::chrono::nanoseconds(std::chrono::milliseconds(20));
      const timespec wait{static_cast<time_t>(slice.count() / 1'000'000'000),
                          static_cast<long>(slice.count() % 1'000'000'000)};
      f.sleepers.fetch_add(1, std::memory_order_seq_cst);
      const std::uint32_t seen = f.value.load(std::memory_order_seq_cst);
      if (!reached(seen, k)) futex(f.value, FUTEX_WAIT, seen, &wait);
      f.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
}

DTRAIN_DETAIL_INLINE std::string shm_segment::where(int q, const char* phase, std::size_t c,
                                                    std::size_t chunks) const {
  return "shared memory, rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
         " waiting for rank " + std::to_string(q) + " to " + phase + " chunk " +
         std::to_string(c + 1) + " of " + std::to_string(chunks);
}

DTRAIN_DETAIL_INLINE std::string shm_segment::describe_shape(std::uint64_t shape) {
  static constexpr std::string_view kinds[] = {"allreduce", "reduce_scatter", "allgather",
                                               "alltoall", "?"};
  const auto kind = static_cast<std::size_t>(std::min<std::uint64_t>(shape >> 60, 4));
  const auto type = static_cast<dtype>((shape >> 52) & 0xff);
  const auto op = static_cast<reduce_op>((shape >> 48) & 0xf);
  const std::uint64_t count = shape & ((std::uint64_t{1} << 48) - 1);
  const bool bytes = kind == 2 || kind == 3;
  return std::string(kinds[kind]) + "(" + std::to_string(count) +
         (bytes ? " bytes"
                : " x " + std::string(to_string(type)) + ", " + std::string(to_string(op))) +
         ")";
}

DTRAIN_DETAIL_INLINE void shm_segment::arrive(std::uint32_t k, std::uint64_t shape,
                                              std::chrono::steady_clock::time_point deadline,
                                              std::chrono::milliseconds timeout, std::size_t c,
                                              std::size_t chunks) {
  // (A rank writes its next shape only after every rank announced this
  // chunk reduced, so after each read this one.)
  flags(rank_).shape.store(shape, std::memory_order_relaxed);
  publish(flags(rank_).arrived, k);
  wait_all(&rank_flags::arrived, k, deadline, timeout, "copy in", c, chunks);
  const std::uint64_t first = flags(0).shape.load(std::memory_order_relaxed);
  for (int q = 1; q < size_; ++q) {
    const std::uint64_t theirs = flags(q).shape.load(std::memory_order_relaxed);
    if (theirs == first) continue;
    // The same words on every rank: the same message on every rank.
    std::string why = "shared memory: rank 0 called " + describe_shape(first) + " and rank " +
                      std::to_string(q) + " " + describe_shape(theirs) +
                      ": every rank must call the same collectives, with the same counts, in "
                      "the same order";
    abandon(why);
    throw shm_failure(why, false);
  }
}

DTRAIN_DETAIL_INLINE void shm_segment::swap(shm_segment& o) noexcept {
  std::swap(base_, o.base_);
  std::swap(bytes_, o.bytes_);
  std::swap(slot_, o.slot_);
  std::swap(fd_, o.fd_);
  std::swap(rank_, o.rank_);
  std::swap(size_, o.size_);
  std::swap(chunk_, o.chunk_);
}

}  // namespace dtrain::detail
#endif
