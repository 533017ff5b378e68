#pragma once
/// @file
/// The verdict: a collective on the host control plane in which every rank
/// says it is ok or names its problem, and every rank learns which ranks
/// failed and why the first of them did. agree_or_throw() turns a failed
/// verdict into an exception on every rank at once: the rank that failed
/// throws its own message; every other rank names the first failed rank
/// and carries its message, rather than waiting for a collective that rank
/// will never join.

#include <dtrain/config.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/error.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// Every rank's outcome of one step that all ranks take together: which ranks
/// named a problem, and the first one's message, the same on every rank.
struct verdict {
  /// The ranks that named a problem, in rank order; empty when every rank is ok.
  std::vector<int> failed;
  /// The first failed rank's problem, as it gave it (cut after
  /// `verdict_text_limit` bytes); empty when every rank is ok.
  std::string first_problem;

  [[nodiscard]] bool ok() const noexcept { return failed.empty(); }
  /// The lowest rank that named a problem; -1 when every rank is ok.
  [[nodiscard]] int first_failed() const noexcept { return failed.empty() ? -1 : failed.front(); }
  /// What a rank that did not fail reports: "rank 3 could not <what>, so every
  /// rank stops: <rank 3's problem>" ("ranks 1, 3 could not ..." when several
  /// failed). `what` is a verb phrase: "load /ckpt/step-5".
  [[nodiscard]] std::string message(std::string_view what) const;
};

/// The most of a failed rank's message that the others receive, in bytes.
inline constexpr std::size_t verdict_text_limit = 16 * 1024;

/// Collective over the host control plane: the ranks whose `flag` is set, in
/// rank order, the same on every rank (one allgather of one value). The
/// verdict's first step, and DistributedDataParallel::any_rank's whole.
DTRAIN_DETAIL_INLINE std::vector<int> flagged_ranks(control_plane& plane, bool flag);

/// Collective over the host control plane: this rank's `problem` (empty: ok)
/// against every other rank's. Every rank returns the same verdict. One
/// allgather when every rank is ok; when not, the first failed rank's message
/// follows in two broadcasts. Bounded by the plane's timeout; throws what
/// the plane throws.
DTRAIN_DETAIL_INLINE verdict gather_verdict(control_plane& plane, std::string_view problem);

/// An exception type agree_or_throw may throw: a dtrain::error made from its message.
template <class E>
concept verdict_error = std::derived_from<E, error> && std::constructible_from<E, std::string>;

/// Collective over the host control plane: returns when every rank is ok
/// (an empty `problem` on every rank). Otherwise throws `Error` on every rank:
/// a rank that failed throws its own `problem`, unchanged; every other rank
/// throws verdict::message(what), which names the first failed rank and
/// carries its problem. The caller chooses the type (config_error for a model
/// the ranks cannot take, checkpoint_error for a checkpoint they cannot load),
/// so every rank ends with the same exit status.
template <verdict_error Error = error>
void agree_or_throw(control_plane& plane, std::string_view what, const std::string& problem) {
  const verdict v = gather_verdict(plane, problem);
  if (v.ok()) return;
  if (!problem.empty()) throw Error(problem);
  throw Error(v.message(what));
}

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/control/verdict-inl.hpp>
#endif
