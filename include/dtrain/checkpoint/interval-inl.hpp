#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/interval.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/interval.hpp, not this file.

#include <dtrain/checkpoint/interval.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

namespace dtrain::detail::ckpt {

namespace interval_detail {
/// `ns` in milliseconds, as "0.42 ms".
inline std::string ms_text(std::int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f ms", static_cast<double>(ns) / 1e6);
  return text;
}
/// The mean of `ns` (not empty).
inline std::int64_t mean(const std::vector<std::int64_t>& ns) {
  std::int64_t sum = 0;
  for (const std::int64_t n : ns) sum += n;
  return sum / static_cast<std::int64_t>(ns.size());
}
/// A share in millionths, as "3%" or "0.5%".
inline std::string percent_text(std::int64_t ppm) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g%%", static_cast<double>(ppm) / 1e4);
  return text;
}
}  // namespace interval_detail

DTRAIN_DETAIL_INLINE memory_interval::memory_interval(std::uint64_t bound, double budget)
    : bound_(bound),
      budget_ppm_(budget > 0 ? std::max<std::int64_t>(1, std::llround(budget * 1e6)) : 0),
      every_(budget_ppm_ > 0 ? std::min(bound, first_every) : bound) {}

DTRAIN_DETAIL_INLINE void memory_interval::record(bool copied, clock::time_point now) {
  if (!automatic()) return;
  const bool disturbed = std::exchange(disturbed_, false);
  if (last_) {
    const std::int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - *last_).count();
    const bool measured = !disturbed && !after_disturbed_;  // a training step's time alone
    if (copy_ns_pending_ >= 0) {
      // The last step copied: this one holds what its write left (a thread
      // beside it), unless it copies too (then this copy's step holds it).
      if (measured && warm_copies_ >= warm_up) {
        copy_ns_.push_back(copy_ns_pending_);
        if (!copied) after_ns_.push_back(ns);
      }
      warm_copies_ = std::min(warm_copies_ + 1, warm_up);
      copy_ns_pending_ = -1;
    } else if (measured && !copied) {
      clean_ns_.push_back(ns);
    }
    if (measured && copied) copy_ns_pending_ = ns;
  }
  last_ = now;
  after_disturbed_ = disturbed;
}

DTRAIN_DETAIL_INLINE void memory_interval::reset(std::uint64_t n) {
  every_ = automatic() ? std::min(bound_, first_every) : bound_;
  next_agreement_ = n + window;
  agreement_ns_ = 0;
  last_.reset();
  disturbed_ = after_disturbed_ = false;
  copy_ns_pending_ = -1;
  warm_copies_ = 0;
  clean_ns_.clear();
  copy_ns_.clear();
  after_ns_.clear();
  baseline_ns_ = cost_ns_ = -1;
  cost_weight_ = 0;
}

DTRAIN_DETAIL_INLINE std::vector<std::int64_t> memory_interval::pack() {
  // A step without a copy is their median; the steps with one are taken at
  // their mean: a copy that is slow now and then (a page fault) costs the
  // training what the mean says. A step slowed by the host (another
  // process) then counts against the copies when it is one of theirs, and
  // not at all otherwise: the interval errs on the side of the budget, and a
  // slow step among those without a copy cannot make copies look free.
  if (!clean_ns_.empty()) baseline_ns_ = detail::median(std::move(clean_ns_));
  if (!copy_ns_.empty() && baseline_ns_ > 0) {
    // The mean step with a copy, and the mean step after one, each against
    // a step without.
    std::int64_t extra = interval_detail::mean(copy_ns_) - baseline_ns_;
    if (!after_ns_.empty()) extra += interval_detail::mean(after_ns_) - baseline_ns_;
    // This window's copies, averaged with the last ones' (at most as many as
    // history_copies weigh): a copy slowed once moves the interval little.
    const double cost = std::max(0.0, static_cast<double>(extra));
    const double weight = static_cast<double>(copy_ns_.size());
    const double mean = cost_ns_ < 0
                            ? cost
                            : (static_cast<double>(cost_ns_) * cost_weight_ + cost * weight) /
                                  (cost_weight_ + weight);
    cost_ns_ = std::llround(mean);
    cost_weight_ = std::min(cost_weight_ + weight, static_cast<double>(history_copies));
  }
  clean_ns_.clear();
  copy_ns_.clear();
  after_ns_.clear();
  return {cost_ns_, baseline_ns_, agreement_ns_};
}

DTRAIN_DETAIL_INLINE std::optional<std::string> memory_interval::adopt(
    std::span<const std::int64_t> all, std::uint64_t n) {
  const std::size_t ranks = all.size() / packed;
  // Decided from the same numbers on every rank, in integers: the same interval.
  bool known = false;
  std::int64_t want = 1, cost = 0, baseline = 0;
  std::uint64_t apart = window;  // steps to the next agreement
  for (std::size_t r = 0; r < ranks; ++r) {
    const std::int64_t* at = all.data() + r * packed;
    if (at[1] <= 0) continue;
    // An agreement costs at most a tenth of the budget: as many steps apart.
    const double steps_apart =
        std::ceil(static_cast<double>(at[2]) * 1e7 /
                  (static_cast<double>(budget_ppm_) * static_cast<double>(at[1])));
    if (steps_apart > static_cast<double>(apart))
      apart = steps_apart >= static_cast<double>(max_window)
                  ? max_window
                  : static_cast<std::uint64_t>(steps_apart);
    if (at[0] < 0) continue;
    known = true;
    // The fewest steps k with cost <= budget * k * baseline.
    const double steps = std::ceil(static_cast<double>(at[0]) * 1e6 /
                                   (static_cast<double>(budget_ppm_) * static_cast<double>(at[1])));
    const std::int64_t k = steps >= static_cast<double>(bound_)
                               ? static_cast<std::int64_t>(bound_)
                               : std::max<std::int64_t>(1, static_cast<std::int64_t>(steps));
    if (k >= want) {
      want = k;
      cost = at[0];
      baseline = at[1];
    }
  }
  next_agreement_ = n + apart;
  if (!known) return std::nullopt;
  every_ = static_cast<std::uint64_t>(
      std::clamp<std::int64_t>(want, 1, static_cast<std::int64_t>(bound_)));
  if (said_ != 0 && every_ * 2 > said_ && every_ < said_ * 2) return std::nullopt;
  said_ = every_;
  const std::int64_t share_ppm =
      baseline > 0 ? cost * 1000000 / (static_cast<std::int64_t>(every_) * baseline) : 0;
  std::string line = "memory tier: a copy every " + std::to_string(every_) +
                     (every_ == 1 ? " step" : " steps") + " (a copy costs " +
                     interval_detail::ms_text(cost) + ", a step without one takes " +
                     interval_detail::ms_text(baseline) + ": " +
                     interval_detail::percent_text(share_ppm) + " of the steps";
  if (share_ppm > budget_ppm_) {
    line += ", over memory_budget's " + interval_detail::percent_text(budget_ppm_) +
            ": memory_every " + std::to_string(bound_) + " is the most steps between copies";
  } else {
    line += "; memory_budget " + interval_detail::percent_text(budget_ppm_);
  }
  return line + "); a failure costs at most " + std::to_string(every_) +
         (every_ == 1 ? " step" : " steps");
}

}  // namespace dtrain::detail::ckpt
