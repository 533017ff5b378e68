#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/tier.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/tier.hpp, not this file.

#include <dtrain/checkpoint/retention.hpp>
#include <dtrain/checkpoint/tier.hpp>

#include <array>
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

DTRAIN_DETAIL_INLINE void tier_context::broadcast_value(std::int64_t& value) {
  std::array<std::uint8_t, sizeof(std::int64_t)> bytes{};
  std::memcpy(bytes.data(), &value, sizeof value);
  plane.broadcast(bytes, 0);
  std::memcpy(&value, bytes.data(), sizeof value);
}

namespace tier_detail {
inline file_record write_part(const std::filesystem::path& path, const part_snapshot& part) {
  atomic_file file(path);
  write_part_header(file, static_cast<std::uint32_t>(part.records.size()));
  for (const part_record& r : part.records) {
    write_entry(file, r.name, r.kind, r.type, r.shape, r.data, r.bytes);
  }
  return file.finish();
}
}  // namespace tier_detail

DTRAIN_DETAIL_INLINE void tier::write(std::unique_ptr<pending_save> p, bool asynchronous) {
  pending_ = std::move(p);
  if (!pending_->problem.empty()) return;
  auto job = [this, &p = *pending_, rank = context_.plane.rank()] {
    try {
      // A save of this step that died before may have left the directory:
      // its files are overwritten, and the manifest lists only this save's.
      make_directory(p.partial, false);
      if (!p.per_rank.records.empty()) {
        p.per_rank_file = tier_detail::write_part(p.partial / rank_part_name(rank), p.per_rank);
      }
      if (p.writes_replicated)
        p.replicated_file = tier_detail::write_part(p.partial / replicated_name, p.replicated);
    } catch (const std::exception& e) {
      p.problem = e.what();
    }
    seal(p);
  };
  if (asynchronous) {
    pending_->writer = std::thread(std::move(job));
  } else {
    job();
  }
}

DTRAIN_DETAIL_INLINE double tier::join_writer(pending_save& p) {
  if (!p.writer.joinable()) return 0;
  const auto start = std::chrono::steady_clock::now();
  p.writer.join();
  return seconds_since(start);
}

}  // namespace dtrain::detail::ckpt
