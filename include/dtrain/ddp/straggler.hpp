#pragma once
/// @file
/// Which rank is slow while training is healthy. A collective inside the
/// backward pass makes every rank's step take the same wall time, so tools
/// outside the library see a slow rank's delay spread over all of them;
/// DistributedDataParallel sees when each rank's last gradients are ready,
/// which is when it arrives at the step's last collective. Each rank records,
/// per step, that arrival and the step's length on its own clock, from the end
/// of the step before (which every rank leaves together, as a collective
/// completes everywhere at once); every few steps the ranks exchange them in
/// one small allgather, and each rank analyses the same figures alike (only
/// rank 0 speaks).

#include <dtrain/config.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/timeline.hpp>
#include <dtrain/detail/stats.hpp>
#include <dtrain/env/environment.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

namespace dtrain {

/// One rank's pace over the last straggler_options::steps steps
/// (DistributedDataParallel::stragglers()).
struct rank_pace {
  int rank = 0;
  std::string node;    ///< its node name (DTRAIN_NODE_NAME, else the host name)
  int local_rank = 0;  ///< its place among the ranks of its node, in rank order
  /// The median, over those steps, of how long after the other ranks (the
  /// median of their arrivals) its last gradients were ready: what the job
  /// waits for it each step. 0 when it was not late.
  double delay_seconds = 0;
  double share = 0;   ///< delay_seconds over the median step time
  bool slow = false;  ///< reported as a straggler, not yet recovered
  /// The step at which its present run of late steps began (0: none).
  std::uint64_t slow_since = 0;
};

/// What the straggler watch knows after its latest exchange (the same on every rank).
struct straggler_figures {
  std::uint64_t step = 0;       ///< the last step exchanged (0: no exchange yet)
  std::uint64_t exchanges = 0;  ///< allgathers so far
  std::size_t every = 0;        ///< steps between exchanges now
  double step_seconds = 0;      ///< the median step time (over the ranks, then the steps)
  /// The median time from the last rank's arrival to the end of the step:
  /// the step's collectives after the backward pass, its exposed communication.
  double communication_seconds = 0;
  /// The lowest such median seen so far: what the collectives took when healthy.
  double communication_baseline_seconds = 0;
  /// The collectives are slow while every rank's gradients come on time (a
  /// slow link or a busy network, not a rank's compute): reported, not yet recovered.
  bool communication_slow = false;
  std::uint64_t communication_slow_since = 0;
  std::vector<rank_pace> ranks;  ///< in rank order; empty before the first exchange
};

namespace detail {

/// straggler_options and DTRAIN_STRAGGLERS ("off", "auto", or a number of
/// steps between exchanges: it wins over the option) resolved: 0 steps when
/// off. Throws config_error naming the variable, its value and `rank`.
struct straggler_setting {
  bool on = false;
  std::size_t every = 0;  ///< 0: automatic
  /// For the agreement of DDP's options: "stragglers exchanged every 4 steps", "stragglers off".
  [[nodiscard]] std::string describe() const;
  /// The default: on, every few steps as the exchange's cost allows.
  [[nodiscard]] bool automatic() const noexcept { return on && every == 0; }
  [[nodiscard]] static straggler_setting of(const environment& env,
                                            const straggler_options& options, int rank);
};

/// One rank's straggler watch: records its steps, packs them for the
/// exchange, and analyses every rank's records (the same figures and the same
/// next exchange on every rank; rank 0's report lines are returned).
class straggler_watch {
 public:
  straggler_watch() = default;
  straggler_watch(straggler_setting setting, const straggler_options& options, int rank, int size,
                  std::string node);

  [[nodiscard]] bool on() const noexcept { return setting_.on; }
  [[nodiscard]] const straggler_setting& setting() const noexcept { return setting_; }

  /// A bucket became ready (its last gradient marked): this step's arrival so far.
  void bucket_ready() noexcept {
    if (setting_.on) last_ready_ = timeline::now();
  }
  /// The step `step` (1 for the first) is complete on this rank; whether an
  /// exchange is due now (the same answer on every rank).
  bool step_done(std::uint64_t step);
  /// This rank's part of the exchange (the same length on every rank).
  [[nodiscard]] std::vector<std::int64_t> pack() const;
  /// Every rank's pack(), in rank order, and how long this rank's exchange
  /// took: updates the figures; the lines rank 0 prints (without their prefix).
  std::vector<std::string> absorb(std::span<const std::int64_t> all, std::int64_t exchange_ns);

  [[nodiscard]] const straggler_figures& figures() const noexcept { return figures_; }
  /// The figures as one line, for a flight record: "straggler watch at step
  /// 120 (exchanged every 5 steps): step 15.9 ms, collectives 0.3 ms after the
  /// last rank (best 0.2 ms); latest: rank 4 (n1, local rank 0) 2.4 ms (15 %,
  /// slow since step 59), ..." (the 4 latest ranks; empty before the first judgement).
  [[nodiscard]] std::string window() const;

  /// Per rank: the steps before an exchange automatically, at most.
  static constexpr std::size_t max_every = 50;
  /// The share of a step the automatic exchange may cost.
  static constexpr double exchange_budget = 0.005;
  /// The collectives are judged over this many times straggler_options::steps.
  static constexpr std::size_t communication_steps = 3;
  /// The node name's bytes sent at the first exchange.
  static constexpr std::size_t name_words = 8;

 private:
  struct step_record {
    std::int64_t arrival = 0;  // from the end of the step before to its last bucket ready
    std::int64_t length = 0;   // from the end of the step before to its end
  };
  struct rank_history {
    std::deque<std::int64_t> late;  // ns after the median of the others, per step (3 x steps)
    std::uint64_t run_start = 0;    // first step of the present run of late steps
  };

  void analyse_step(std::uint64_t step, std::span<const step_record> by_rank,
                    std::vector<std::string>& lines);
  [[nodiscard]] std::string who(int rank) const;

  straggler_setting setting_{};
  straggler_options options_{};
  int rank_ = 0;
  int size_ = 1;
  std::string node_;
  // Recording (the training thread, under DDP's lock).
  std::int64_t last_ready_ = 0;
  std::int64_t step_end_ = 0;       // the end of the step before; 0: none yet
  std::uint64_t first_step_ = 0;    // of the records not yet exchanged
  std::vector<step_record> steps_;  // not yet exchanged
  std::size_t every_ = 1;           // steps between exchanges now
  std::int64_t exchange_ns_ = 0;    // this rank's last exchange
  // Analysis (every rank alike).
  std::vector<rank_history> history_;
  std::deque<std::int64_t> step_lengths_;     // median over the ranks, per step
  std::deque<std::int64_t> communication_;    // after the last arrival, per step
  std::int64_t communication_baseline_ = -1;  // ns; -1: none yet
  std::uint64_t communication_run_start_ = 0;
  straggler_figures figures_{};
};

}  // namespace detail
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/ddp/straggler-inl.hpp>
#endif
