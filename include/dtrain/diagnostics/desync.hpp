#pragma once
/// @file
/// Desync analysis: from every rank's ring of last collectives (or its
/// silence), which rank is behind, which collective it never started, what
/// the others wait in, and which sequence numbers were called with different
/// arguments. Pure functions over the rings, so they are unit-tested on the
/// host; diagnostics.hpp gathers the rings through the store and prints.

#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>
#include <dtrain/detail/wire.hpp>
#include <dtrain/diagnostics/ring.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail {

/// One rank's ring as the diagnostics round received it; `answered` false
/// when the rank did not publish in time (its process is gone or frozen).
struct rank_ring {
  int rank = 0;
  bool answered = false;
  std::vector<call_record> calls;  ///< oldest first
};

/// What the analysis found: one line for the person at 3 a.m., and the details.
struct desync_report {
  std::string
      summary;  ///< "rank 2 is at #41 ...; ranks 0, 1, 3 wait in #42 ...: rank 2 never started #42"
  std::vector<std::string> details;  ///< one line per rank, then one per mismatched sequence number
  /// How much the summary explains: 4 a mismatch, 3 a rank behind, 2 a silent
  /// rank while others wait, 1 a silent rank, 0 nothing wrong seen.
  int severity = 0;
};

/// "rank 2", "ranks 0, 1, 3".
DTRAIN_DETAIL_INLINE std::string name_ranks(std::span<const int> ranks);

namespace desync {

DTRAIN_DETAIL_INLINE std::string at(const call_record& r, bool with_op = false);

// What differs between two calls with the same sequence number, for the summary.
DTRAIN_DETAIL_INLINE std::string difference(const call_record& a, const call_record& b);

// Ranks grouped by what they called as number `seq`, the largest group first
// (on a tie the group of the lowest rank): the odd ones out come after.
struct call_group {
  const call_record* call;
  std::vector<int> ranks;
};
DTRAIN_DETAIL_INLINE std::vector<call_group> group_calls(std::span<const rank_ring> rings,
                                                         std::int64_t seq);

}  // namespace desync

/// Analyses the rings of every rank of a communicator (`rings[i]` is rank
/// rings[i].rank). Never throws on odd input: a ring may be empty, partial or
/// missing; what cannot be decided is said so.
DTRAIN_DETAIL_INLINE desync_report analyse(std::span<const rank_ring> rings);

/// The table a diagnostics round prints: `header`, the summary, then the details, indented.
DTRAIN_DETAIL_INLINE std::string format_report(std::string_view header,
                                               const desync_report& report);

/// The rings one rank publishes: its world communicator's and its splits', by name.
using named_rings = std::vector<std::pair<std::string, std::vector<call_record>>>;

/// What one rank published in a diagnostics round (`answered` false: nothing in time).
struct rank_publication {
  int rank = 0;
  bool answered = false;
  named_rings rings;
};

/// Rings as they travel through the store (detail/wire.hpp): version u8 (1),
/// ring count u32, then per communicator its name bytes32, call count u32 and
/// per call seq i64, kind bytes32, type u8, count u64, op i64, root i64,
/// state u8, label bytes32.
DTRAIN_DETAIL_INLINE std::string encode_rings(const named_rings& rings);

/// The rings of encode_rings' value; nothing when it is not such a value (the
/// rank then counts as not answering: diagnostics never throw).
DTRAIN_DETAIL_INLINE std::optional<named_rings> decode_rings(std::string_view value);

/// Analyses every communicator the ranks published (the world's first, then
/// the splits, by name) and returns the report of the one that explains most
/// (a mismatch, then a rank behind, then silent ranks), its details preceded
/// by the others' findings. Silent ranks count as members of the world and
/// of every split that all answering ranks have (DistributedDataParallel's
/// own split); a split that only some ranks have (a node's) is analysed over them.
DTRAIN_DETAIL_INLINE desync_report analyse_job(std::span<const rank_publication> ranks);

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/diagnostics/desync-inl.hpp>
#endif
