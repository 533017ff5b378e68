#pragma once
/// @file
/// The ring of a communicator's last collectives: what each rank publishes
/// when a collective times out or SIGUSR1 arrives, so that one table can name
/// the rank that is behind (see diagnostics/desync.hpp). Every engine records into
/// it at the one place that numbers its collectives.

#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// Where a collective comes from, when not straight from the user: "bucket" 3.
/// Set by label_scope on the thread that issues the collective.
struct call_label {
  const char* what = nullptr;  ///< a string literal ("bucket"); null: a user call
  std::int64_t index = -1;
};

/// The label the calling thread's collectives are recorded with.
DTRAIN_DETAIL_INLINE call_label& current_call_label() noexcept;

/// Labels the collectives this thread issues while it lives ("bucket 3").
class label_scope {
 public:
  label_scope(const char* what, std::int64_t index) noexcept : saved_(current_call_label()) {
    current_call_label() = {what, index};
  }
  explicit label_scope(call_label label) noexcept : saved_(current_call_label()) {
    current_call_label() = label;
  }
  ~label_scope() { current_call_label() = saved_; }
  label_scope(const label_scope&) = delete;
  label_scope& operator=(const label_scope&) = delete;

 private:
  call_label saved_;
};

/// How far one collective got on this rank.
enum class call_state : std::uint8_t { issued, completed, failed, timed_out };

inline constexpr std::string_view to_string(call_state s) noexcept {
  switch (s) {
    case call_state::issued: return "waiting";
    case call_state::completed: return "completed";
    case call_state::failed: return "failed";
    case call_state::timed_out: return "timed out";
  }
  return "?";
}

/// A collective's fingerprint as one rank saw it, "call #N: kind, type,
/// count", with where it came from and how far it got. The same struct for
/// every engine, in the ring, on the wire and in the analysis.
struct call_record {
  std::int64_t seq = 0;  ///< 1 for the communicator's first collective
  std::string kind;      ///< "allreduce"
  dtype type = dtype::float32;
  std::size_t count = 0;
  int op = -1;        ///< a reduce_op, or -1
  int root = -1;      ///< broadcast's root, or -1
  std::string label;  ///< "bucket 3"; empty: a user call
  call_state state = call_state::issued;

  /// What every rank must agree on for the same sequence number.
  [[nodiscard]] bool same_call(const call_record& o) const noexcept {
    return kind == o.kind && type == o.type && count == o.count && op == o.op && root == o.root;
  }
};

/// "allreduce(float32 × 65536, bucket 4)"; the op only when `with_op`.
DTRAIN_DETAIL_INLINE std::string describe_call(const call_record& r, bool with_op = false);

/// The last `capacity` collectives of one communicator. Thread-safe: the
/// engine records from the issuing thread, work handles settle from theirs,
/// the diagnostics thread takes snapshots. One short lock per collective.
class collective_ring {
 public:
  static constexpr std::size_t capacity = 64;
  static constexpr std::size_t kept_splits = 8;

  /// `name` tells the communicator apart from its splits: "world", "world/split 1 (color 0)".
  explicit collective_ring(std::string name = "world") : name_(std::move(name)) {}

  [[nodiscard]] const std::string& name() const noexcept { return name_; }

  /// The ring of a communicator split from this one with `color`. Its name
  /// counts this ring's splits, so every rank that splits in the same order
  /// (as it must) gives the same child the same name. This ring keeps the
  /// last `kept_splits` children, even once their communicators are gone:
  /// where a rank was on them still explains a stall.
  std::shared_ptr<collective_ring> make_child(int color);

  /// This ring and those of its kept splits (recursively), each with its name.
  [[nodiscard]] std::vector<std::pair<std::string, std::vector<call_record>>> snapshot_all() const;

  /// Records a new collective with the calling thread's label; returns its sequence number.
  std::int64_t issue(std::string_view kind, dtype type, std::size_t count, int op, int root);

  /// Marks collective `seq` finished (or failed, or given up); a no-op once it left the ring.
  void settle(std::int64_t seq, call_state state) noexcept;

  /// The recorded collectives, oldest first.
  [[nodiscard]] std::vector<call_record> snapshot() const;

  /// The sequence number of the last collective issued (0: none yet).
  [[nodiscard]] std::int64_t last() const;

 private:
  std::string name_;
  mutable std::mutex mutex_;
  std::array<call_record, capacity> slots_{};
  std::int64_t last_ = 0;
  std::int64_t splits_ = 0;
  std::vector<std::shared_ptr<collective_ring>> children_;
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/diagnostics/ring-inl.hpp>
#endif
