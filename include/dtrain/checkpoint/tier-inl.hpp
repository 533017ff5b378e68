#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/tier.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/tier.hpp, not this file.

#include <dtrain/checkpoint/retention.hpp>
#include <dtrain/checkpoint/tier.hpp>
#include <dtrain/diagnostics/metrics.hpp>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <utility>

namespace dtrain::detail::ckpt {

DTRAIN_DETAIL_INLINE void tier_context::say(const std::string& line) const {
  if (options.quiet || plane.rank() != 0) return;
  std::fprintf(stderr, "dtrain checkpoint: %s\n", line.c_str());
  std::fflush(stderr);
}

DTRAIN_DETAIL_INLINE void tier_context::committed(bool memory, std::uint64_t step) noexcept {
  if (metrics_file.empty()) return;
  const std::lock_guard lock(metrics_mutex_);
  if (metrics_failed_) return;
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  (memory ? memory_commit_ : disk_commit_) = {step, now};
  try {
    metrics_text m(metrics_labels);
    auto add = [&m](const std::string& tier, const std::string& what, const commit_mark& c) {
      if (c.unix_time == 0) return;
      m.add("dtrain_checkpoint_" + tier + "_step", "gauge", "The newest step of " + what + ".",
            static_cast<double>(c.step));
      m.add("dtrain_checkpoint_" + tier + "_timestamp_seconds", "gauge",
            "When the newest step of " + what +
                " was committed (Unix time): its age is time() minus this.",
            c.unix_time);
    };
    add("disk", "the job's checkpoint on disk (checkpoint_options::dir, committed by rank 0)",
        disk_commit_);
    add("memory", "this rank's memory copy (checkpoint_options::memory_every)", memory_commit_);
    write_file_whole(metrics_file, m.str(), metrics_setting_name, plane.rank());
  } catch (const std::exception& e) {
    metrics_failed_ = true;
    std::fprintf(stderr,
                 "dtrain checkpoint on rank %d: %s; its checkpoint metrics stop (said once)\n",
                 plane.rank(), e.what());
    std::fflush(stderr);
  }
}

DTRAIN_DETAIL_INLINE void tier_context::broadcast_value(std::int64_t& value) {
  std::array<std::uint8_t, sizeof(std::int64_t)> bytes{};
  std::memcpy(bytes.data(), &value, sizeof value);
  plane.broadcast(bytes, 0);
  std::memcpy(&value, bytes.data(), sizeof value);
}

namespace tier_detail {
inline file_record write_part(const std::filesystem::path& path, const part_snapshot& part,
                              bool in_place) {
  atomic_file file(path, in_place);
  write_part_header(file, static_cast<std::uint32_t>(part.records.size()));
  for (const part_record& r : part.records) {
    if (r.ranged) {  // a range of a values entry: as a sharded entry's payload
      write_entry_head(file, r.name, r.kind, r.type, r.shape, sizeof r.range + r.bytes);
      file.write(r.range.data(), sizeof r.range);
      if (r.bytes > 0) file.write(r.data, static_cast<std::size_t>(r.bytes));
    } else {
      write_entry(file, r.name, r.kind, r.type, r.shape, r.data, r.bytes);
    }
  }
  return file.finish();
}
}  // namespace tier_detail

DTRAIN_DETAIL_INLINE void read_gate::read_done() {
  {
    const std::lock_guard lock(mutex_);
    read_ = true;
  }
  changed_.notify_all();
}

DTRAIN_DETAIL_INLINE bool read_gate::wait_word() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [this] { return word_.has_value(); });
  return *word_;
}

DTRAIN_DETAIL_INLINE double read_gate::await_read() {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [this] { return read_; });
  return seconds_since(start);
}

DTRAIN_DETAIL_INLINE void read_gate::decide(bool released) {
  {
    const std::lock_guard lock(mutex_);
    if (word_) return;
    word_ = released;
  }
  changed_.notify_all();
}

DTRAIN_DETAIL_INLINE bool read_gate::decided() const {
  const std::lock_guard lock(mutex_);
  return word_.has_value();
}

DTRAIN_DETAIL_INLINE save_writer::~save_writer() {
  {
    const std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

DTRAIN_DETAIL_INLINE void save_writer::start(std::function<void()> job) {
  {
    const std::lock_guard lock(mutex_);
    job_ = std::move(job);
    running_ = true;
  }
  if (thread_.joinable()) {
    changed_.notify_all();
    return;
  }
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {  // no thread: no job in hand, or wait() would never return
    const std::lock_guard lock(mutex_);
    job_ = nullptr;
    running_ = false;
    throw;
  }
}

DTRAIN_DETAIL_INLINE double save_writer::wait() {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [this] { return !running_; });
  return seconds_since(start);
}

DTRAIN_DETAIL_INLINE void save_writer::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [this] { return stop_ || job_; });
    if (!job_) return;  // stopped, with nothing left to run
    std::function<void()> job = std::move(job_);
    job_ = nullptr;
    lock.unlock();
    job();  // (it catches what it throws: a save's problem is its pending_save's)
    lock.lock();
    running_ = false;
    changed_.notify_all();
  }
}

DTRAIN_DETAIL_INLINE void tier::write(std::unique_ptr<pending_save> p, bool asynchronous) {
  pending_ = std::move(p);
  if (!pending_->problem.empty()) return;
  auto job = [this, &p = *pending_, rank = context_.plane.rank()] {
    try {
      const bool in_place = open_staging(p);
      if (!p.per_rank.records.empty()) {
        p.per_rank_file =
            tier_detail::write_part(p.partial / rank_part_name(rank), p.per_rank, in_place);
      }
      if (p.replicated_part.writes) {
        p.replicated_file =
            tier_detail::write_part(p.partial / p.replicated_part.file, p.replicated, in_place);
      }
    } catch (const std::exception& e) {
      p.problem = e.what();
    }
    if (p.gate) {
      p.gate->read_done();
      if (!p.gate->wait_word() && p.problem.empty()) {
        p.problem =
            "the state may have changed while it was read: no checkpoint::before_update() came "
            "between the step() that began it and the next (checkpoint_options::"
            "memory_beside_step)";
      }
    }
    seal(p);
  };
  if (asynchronous) {
    writer_.start(std::move(job));
    pending_->on_writer = true;
  } else {
    job();
  }
}

DTRAIN_DETAIL_INLINE bool tier::open_staging(pending_save& p) {
  // A save of this step that died before may have left the directory:
  // its files are overwritten, and the manifest lists only this save's.
  make_directory(p.partial, false);
  return false;
}

DTRAIN_DETAIL_INLINE double tier::join_writer(pending_save& p) {
  if (!p.on_writer) return 0;
  p.on_writer = false;
  return writer_.wait();
}

}  // namespace dtrain::detail::ckpt
