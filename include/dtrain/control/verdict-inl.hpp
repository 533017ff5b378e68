#pragma once
/// @file
/// The non-template bodies of dtrain/control/verdict.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/control/verdict.hpp, not this file.

#include <dtrain/control/verdict.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::string verdict::message(std::string_view what) const {
  if (ok()) return {};
  std::string ranks;
  for (const int r : failed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  std::string text = (failed.size() == 1 ? "rank " : "ranks ") + ranks + " could not " +
                     std::string(what) + ", so every rank stops";
  if (failed.size() > 1) text += "; rank " + std::to_string(first_failed()) + "'s error";
  return text + ": " + first_problem;
}

DTRAIN_DETAIL_INLINE std::vector<int> flagged_ranks(control_plane& plane, bool flag) {
  const std::int64_t mine = flag ? 1 : 0;
  std::vector<std::int64_t> all(static_cast<std::size_t>(plane.size()));
  plane.allgather(std::span<const std::int64_t>(&mine, 1), all);
  std::vector<int> flagged;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r] != 0) flagged.push_back(static_cast<int>(r));
  }
  return flagged;
}

DTRAIN_DETAIL_INLINE verdict gather_verdict(control_plane& plane, std::string_view problem) {
  verdict v;
  v.failed = flagged_ranks(plane, !problem.empty());
  if (v.ok()) return v;
  // The first failed rank's message to every rank: its length, then its bytes.
  const int first = v.first_failed();
  const std::string_view sent = problem.substr(0, verdict_text_limit);
  std::uint64_t length = plane.rank() == first ? sent.size() : 0;
  std::uint8_t length_bytes[sizeof length];
  std::memcpy(length_bytes, &length, sizeof length);
  plane.broadcast(length_bytes, first);
  std::memcpy(&length, length_bytes, sizeof length);
  if (length > verdict_text_limit) {
    throw rendezvous_error("verdict: rank " + std::to_string(first) + " sent a message of " +
                           std::to_string(length) + " bytes to rank " +
                           std::to_string(plane.rank()) + ", more than the " +
                           std::to_string(verdict_text_limit) +
                           " it may; the ranks called different control operations");
  }
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(length));
  if (plane.rank() == first) std::memcpy(bytes.data(), sent.data(), bytes.size());
  plane.broadcast(bytes, first);
  v.first_problem.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return v;
}

}  // namespace dtrain
