#pragma once
/// @file
/// How often the memory tier copies (checkpoint_options::memory_every and
/// memory_budget). With a budget, the ranks measure what a copy costs the
/// training (each step's time, between two step() calls, with a copy and
/// without) and agree every few steps on the fewest steps between copies
/// that keep that cost within the budget, at most memory_every: the same
/// interval on every rank, so that every rank copies the same steps.

#include <dtrain/config.hpp>
#include <dtrain/detail/stats.hpp>
#include <dtrain/error.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace dtrain::detail::ckpt {

class memory_interval {
 public:
  using clock = std::chrono::steady_clock;
  /// The fewest and the most steps between two agreements of a budget: the
  /// first comes `window` steps after the start (or a restore), the next as
  /// many steps later as keep an agreement's own cost (an allgather) within a
  /// tenth of the budget, at most `max_window`.
  static constexpr std::uint64_t window = 50, max_window = 10000;
  /// With a budget, the steps between copies until the first agreement (the
  /// bound when smaller): a few copies, and steps between them, to measure.
  static constexpr std::uint64_t first_every = 10;
  /// The first copies after a start or a restore make the files that the
  /// later ones write over: not measured.
  static constexpr int warm_up = 2;
  /// What a copy costs is the mean of the copies measured, the older ones
  /// weighing at most as much as this many.
  static constexpr int history_copies = 10;
  /// Numbers per rank in an agreement (pack()).
  static constexpr std::size_t packed = 3;

  /// `bound`: checkpoint_options::memory_every (0: no copies); `budget`:
  /// memory_budget (0: a copy every `bound` steps, always).
  memory_interval(std::uint64_t bound, double budget);

  /// Whether step `n` (step()'s count) copies into memory.
  [[nodiscard]] bool due(std::uint64_t n) const noexcept { return every_ > 0 && n % every_ == 0; }
  /// The steps between copies now (0: no copies).
  [[nodiscard]] std::uint64_t every() const noexcept { return every_; }
  [[nodiscard]] bool automatic() const noexcept { return budget_ppm_ > 0; }

  /// At the end of each step(), once its copy and its save (if any) are
  /// done: `copied` into memory at this step. The step's time is the time
  /// since the last call.
  void record(bool copied, clock::time_point now = clock::now());
  /// The next step's time is not a training step's alone (a save to disk, a
  /// save_to_memory() called by the program, an agreement): it is left out,
  /// and so is the step after it.
  void disturb() noexcept { disturbed_ = true; }
  /// After a restore of step `n`: the interval starts again (first_every,
  /// or the bound without a budget), and nothing measured before counts.
  void reset(std::uint64_t n);

  /// Whether the ranks agree at step `n` (the same answer on every rank).
  [[nodiscard]] bool agreement_due(std::uint64_t n) const noexcept {
    return automatic() && n >= next_agreement_;
  }
  /// The last agreement took `ns` on this rank (pack() says so).
  void agreed(std::int64_t ns) noexcept { agreement_ns_ = ns; }
  /// This rank's figures of the steps since the last agreement: what a copy
  /// costs and a step without one takes (ns; -1: unknown), and what the last
  /// agreement took (ns; 0: none yet). (Every rank has the same budget and
  /// bound: the checkpoint agrees on its options when it is made.)
  [[nodiscard]] std::vector<std::int64_t> pack();
  /// The step of the next agreement.
  [[nodiscard]] std::uint64_t next_agreement() const noexcept { return next_agreement_; }
  /// Every rank's pack(), in rank order, at step `n`: the interval becomes
  /// the fewest steps whose copy costs at most the budget on the costliest
  /// rank, within 1 and the bound (unchanged while no rank knows its
  /// figures), and the next agreement is set. Returns the
  /// line rank 0 says: the first choice, and each that moves more than 2x
  /// from the last said.
  std::optional<std::string> adopt(std::span<const std::int64_t> all, std::uint64_t n);

 private:
  std::uint64_t bound_;
  std::int64_t budget_ppm_;  // the budget in millionths (integers: alike on every rank)
  std::uint64_t every_;
  std::uint64_t said_ = 0;  // the interval said last (0: none yet)
  std::uint64_t next_agreement_ = window;
  std::int64_t agreement_ns_ = 0;  // the last agreement's time on this rank
  std::optional<clock::time_point> last_;
  bool disturbed_ = false;              // this step is not a training step's alone
  bool after_disturbed_ = false;        // the last one was not
  std::int64_t copy_ns_pending_ = -1;   // the last step copied: its time (else -1)
  int warm_copies_ = 0;                 // copies since the start (at most warm_up)
  std::vector<std::int64_t> clean_ns_;  // steps with no copy in them or just before
  std::vector<std::int64_t> copy_ns_;   // steps with a copy
  std::vector<std::int64_t> after_ns_;  // steps after one (that do not copy)
  std::int64_t baseline_ns_ = -1;       // a step without a copy (median), as last measured
  std::int64_t cost_ns_ = -1;           // what a copy adds, as measured so far
  double cost_weight_ = 0;              // the copies cost_ns_ stands for (at most history_copies)
};

}  // namespace dtrain::detail::ckpt

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/interval-inl.hpp>
#endif
