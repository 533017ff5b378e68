#pragma once
/// @file
/// The non-template bodies of dtrain/ddp/straggler.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/ddp/straggler.hpp, not this file.

#include <dtrain/ddp/straggler.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string straggler_setting::describe() const {
  if (!on) return "stragglers off";
  if (every == 0) return "stragglers exchanged automatically";
  return "stragglers exchanged every " + std::to_string(every) + " steps";
}

DTRAIN_DETAIL_INLINE straggler_setting straggler_setting::of(const environment& env,
                                                             const straggler_options& options,
                                                             int rank) {
  const std::string where = " on rank " + std::to_string(rank);
  if (!(options.threshold > 0 && options.threshold <= 1)) {
    throw config_error("ddp_options::stragglers.threshold = " + std::to_string(options.threshold) +
                       where + ": a share of the step time, above 0 and at most 1");
  }
  if (options.min_delay.count() < 0) {
    throw config_error(
        "ddp_options::stragglers.min_delay = " + std::to_string(options.min_delay.count()) + " us" +
        where + ": a duration, 0 or more");
  }
  if (options.steps < 3 || options.steps > 1000) {
    throw config_error("ddp_options::stragglers.steps = " + std::to_string(options.steps) + where +
                       ": the steps a judgement looks back over, 3 to 1000");
  }
  straggler_setting s{options.enabled, options.every};
  const auto value = env.get(stragglers_variable);
  if (!value) return s;
  const std::string_view v = *value;
  std::size_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v == "off") {
    s = {false, 0};
  } else if (v == "auto") {
    s = {true, 0};
  } else if (ec == std::errc{} && end == v.data() + v.size() && n >= 1 && n <= 1000000) {
    s = {true, n};
  } else {
    throw config_error(std::string(stragglers_variable) + "=" + std::string(v) + where +
                       ": expected off, auto, or the steps between the ranks' exchanges "
                       "(1 or more)");
  }
  return s;
}

DTRAIN_DETAIL_INLINE straggler_watch::straggler_watch(straggler_setting setting,
                                                      const straggler_options& options, int rank,
                                                      int size, std::string node)
    : setting_(setting),
      options_(options),
      rank_(rank),
      size_(size),
      node_(std::move(node)),
      every_(setting.every > 0 ? setting.every : 4) {
  if (size_ < 2) setting_.on = false;  // no one to wait for
}

DTRAIN_DETAIL_INLINE bool straggler_watch::step_done(std::uint64_t step) {
  if (!setting_.on) return false;
  const std::int64_t t = timeline::now();
  // The first step (and its rebuild of the buckets) starts at no common
  // moment: the records begin with the second.
  if (step_end_ != 0) {
    if (steps_.empty()) first_step_ = step;
    steps_.push_back({std::max<std::int64_t>(last_ready_ - step_end_, 0), t - step_end_});
  }
  step_end_ = t;
  return steps_.size() >= every_;
}

DTRAIN_DETAIL_INLINE std::vector<std::int64_t> straggler_watch::pack() const {
  std::vector<std::int64_t> out;
  out.reserve(1 + name_words + 2 * steps_.size());
  out.push_back(exchange_ns_);
  if (figures_.exchanges == 0) {
    char name[name_words * sizeof(std::int64_t)] = {};
    std::memcpy(name, node_.data(), std::min(node_.size(), sizeof name));
    for (std::size_t i = 0; i < name_words; ++i) {
      std::int64_t word = 0;
      std::memcpy(&word, name + i * sizeof word, sizeof word);
      out.push_back(word);
    }
  }
  for (const step_record& r : steps_) {
    out.push_back(r.arrival);
    out.push_back(r.length);
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::string straggler_watch::who(int rank) const {
  const rank_pace& p = figures_.ranks[static_cast<std::size_t>(rank)];
  return "rank " + std::to_string(rank) + " (" + p.node + ", local rank " +
         std::to_string(p.local_rank) + ")";
}

namespace straggler_text {
/// "2.1 ms"
inline std::string ms(std::int64_t ns) {
  char out[32];
  std::snprintf(out, sizeof out, "%.1f ms", static_cast<double>(ns) / 1e6);
  return out;
}
/// "17 %"
inline std::string percent(std::int64_t part, std::int64_t whole) {
  char out[32];
  std::snprintf(out, sizeof out, "%.0f %%",
                whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0);
  return out;
}
}  // namespace straggler_text

DTRAIN_DETAIL_INLINE std::string straggler_watch::window() const {
  using straggler_text::ms;
  using straggler_text::percent;
  if (figures_.step_seconds <= 0) return {};
  auto ns = [](double seconds) { return static_cast<std::int64_t>(seconds * 1e9); };
  const std::int64_t step = ns(figures_.step_seconds);
  std::string out = "straggler watch at step " + std::to_string(figures_.step) +
                    " (exchanged every " + std::to_string(figures_.every) + " steps): step " +
                    ms(step) + ", collectives " + ms(ns(figures_.communication_seconds)) +
                    " after the last rank (best " +
                    ms(ns(figures_.communication_baseline_seconds)) + ")";
  if (figures_.communication_slow) {
    out += ", slow since step " + std::to_string(figures_.communication_slow_since);
  }
  std::vector<const rank_pace*> latest;
  for (const rank_pace& p : figures_.ranks) latest.push_back(&p);
  std::stable_sort(latest.begin(), latest.end(), [](const rank_pace* a, const rank_pace* b) {
    return a->delay_seconds > b->delay_seconds;
  });
  latest.resize(std::min<std::size_t>(latest.size(), 4));
  out += "; latest:";
  for (const rank_pace* p : latest) {
    out += (p == latest.front() ? " " : ", ") + who(p->rank) + " " + ms(ns(p->delay_seconds)) +
           " (" + percent(ns(p->delay_seconds), step) +
           (p->slow ? ", slow since step " + std::to_string(p->slow_since) : std::string()) + ")";
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> straggler_watch::absorb(
    std::span<const std::int64_t> all, std::int64_t exchange_ns) {
  std::vector<std::string> lines;
  const bool first = figures_.exchanges == 0;
  const std::size_t n = steps_.size();
  const std::size_t stride = 1 + (first ? name_words : 0) + 2 * n;
  const auto size = static_cast<std::size_t>(size_);
  if (all.size() != stride * size) {
    throw error("DistributedDataParallel's straggler exchange on rank " + std::to_string(rank_) +
                ": " + std::to_string(all.size()) + " numbers arrived, " +
                std::to_string(stride * size) + " expected (the ranks' steps differ)");
  }
  if (first) {
    figures_.ranks.resize(size);
    history_.resize(size);
    std::map<std::string, int> on_node;  // ranks seen per node, in rank order
    for (std::size_t r = 0; r < size; ++r) {
      char name[name_words * sizeof(std::int64_t) + 1] = {};
      std::memcpy(name, all.data() + r * stride + 1, name_words * sizeof(std::int64_t));
      rank_pace& p = figures_.ranks[r];
      p.rank = static_cast<int>(r);
      p.node = name;
      p.local_rank = on_node[p.node]++;
    }
  }
  const std::size_t records = 1 + (first ? name_words : 0);
  std::vector<step_record> by_rank(size);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t r = 0; r < size; ++r) {
      const std::int64_t* at = all.data() + r * stride + records + 2 * i;
      by_rank[r] = {at[0], at[1]};
    }
    analyse_step(first_step_ + i, by_rank, lines);
  }
  if (n > 0) figures_.step = first_step_ + n - 1;
  ++figures_.exchanges;
  // The next exchange, alike on every rank (integers from the same numbers):
  // the fewest steps whose time is 1 / exchange_budget of the costliest last exchange.
  if (setting_.every > 0) {
    every_ = setting_.every;
  } else {
    std::int64_t cost = 0;
    for (std::size_t r = 0; r < size; ++r) cost = std::max(cost, all[r * stride]);
    const std::int64_t step =
        step_lengths_.empty() ? 0 : median({step_lengths_.begin(), step_lengths_.end()});
    constexpr auto inverse = static_cast<std::int64_t>(1 / exchange_budget + 0.5);
    const std::int64_t want = step > 0 ? (cost * inverse + step - 1) / step : 1;
    every_ = static_cast<std::size_t>(
        std::clamp<std::int64_t>(want, 1, static_cast<std::int64_t>(max_every)));
  }
  figures_.every = every_;
  exchange_ns_ = exchange_ns;
  steps_.clear();
  step_end_ =
      timeline::now();  // the allgather ended together everywhere: the next step starts here
  return lines;
}

DTRAIN_DETAIL_INLINE void straggler_watch::analyse_step(std::uint64_t step,
                                                        std::span<const step_record> by_rank,
                                                        std::vector<std::string>& lines) {
  using straggler_text::ms;
  using straggler_text::percent;
  const std::size_t size = by_rank.size();
  const std::size_t keep = options_.steps;
  // The first steps warm up (allocators, thread pools, caches) on each rank
  // at its own pace: judged from the window after them.
  if (step <= keep) return;
  auto push = [](std::deque<std::int64_t>& d, std::int64_t v, std::size_t most) {
    d.push_back(v);
    if (d.size() > most) d.pop_front();
  };
  std::vector<std::int64_t> lengths(size);
  std::int64_t communication = -1;
  for (std::size_t r = 0; r < size; ++r) {
    lengths[r] = by_rank[r].length;
    const std::int64_t after = std::max<std::int64_t>(by_rank[r].length - by_rank[r].arrival, 0);
    communication = communication < 0 ? after : std::min(communication, after);
  }
  const std::int64_t length = median(lengths);
  push(step_lengths_, length, keep);
  // The collectives are judged over 3 times as many steps: a busy host slows
  // every rank's collectives for a few steps at a time, and that is no link's doing.
  push(communication_, communication, communication_steps * keep);
  const std::int64_t floor =
      std::chrono::duration_cast<std::chrono::nanoseconds>(options_.min_delay).count();
  const std::int64_t bar =
      std::max(static_cast<std::int64_t>(options_.threshold * static_cast<double>(length)), floor);
  std::vector<std::int64_t> others;
  for (std::size_t r = 0; r < size; ++r) {
    others.clear();
    for (std::size_t q = 0; q < size; ++q)
      if (q != r) others.push_back(by_rank[q].arrival);
    const std::int64_t late = std::max<std::int64_t>(by_rank[r].arrival - median(others), 0);
    rank_history& h = history_[r];
    push(h.late, late, communication_steps * keep);
    if (late <= bar) {
      h.run_start = 0;
    } else if (h.run_start == 0) {
      h.run_start = step;
    }
  }
  if (step_lengths_.size() < keep) return;  // too few steps to judge yet

  const std::int64_t typical = median({step_lengths_.begin(), step_lengths_.end()});
  const double whole = static_cast<double>(typical);
  figures_.step_seconds = whole / 1e9;
  // A rank is named slow in one of two ways. Soon: late in every step of the
  // last `steps` (each by at least half the bar, their median above it),
  // which is what a rank late by one cause (a slower device, a throttled
  // core, a sleep) looks like. Later: late in most of the last 3 x `steps`
  // (their median above the bar, and the last `steps`' too: still late), for
  // a rank late most of the time but not every step. A host busy with other work delays each rank
  // now and then, for a few steps in a row: the median of 5 steps alone named such ranks (8 ranks
  // on 2 cores beside a build, CI at 9fb7422).
  const std::int64_t bar_now =
      std::max(static_cast<std::int64_t>(options_.threshold * whole), floor);
  bool any_slow = false;
  for (std::size_t r = 0; r < size; ++r) {
    rank_pace& p = figures_.ranks[r];
    const rank_history& h = history_[r];
    const auto recent = h.late.end() - static_cast<std::ptrdiff_t>(std::min(keep, h.late.size()));
    const std::int64_t delay = median({recent, h.late.end()});
    const std::int64_t lowest = *std::min_element(recent, h.late.end());
    const bool long_full = h.late.size() == communication_steps * keep;
    const std::int64_t long_delay = long_full ? median({h.late.begin(), h.late.end()}) : 0;
    p.delay_seconds = static_cast<double>(delay) / 1e9;
    p.share = whole > 0 ? static_cast<double>(delay) / whole : 0;
    const bool every_step = delay > bar_now && lowest > bar_now / 2;
    const bool most_steps = long_full && long_delay > bar_now && delay > bar_now;
    if (!p.slow && (every_step || most_steps)) {
      const std::int64_t shown = every_step ? delay : long_delay;
      p.slow = true;
      p.slow_since = h.run_start != 0 ? h.run_start : step;
      lines.push_back(who(static_cast<int>(r)) + " is slow since step " +
                      std::to_string(p.slow_since) + ": its gradients are ready " + ms(shown) +
                      " after the other ranks' (the median of the last " +
                      std::to_string(every_step ? keep : communication_steps * keep) +
                      " steps), which costs the job about " + ms(shown) + " of each " +
                      ms(typical) + " step (" + percent(shown, typical) + ")");
    } else if (p.slow && (p.share < options_.threshold / 2 || delay < floor / 2)) {
      p.slow = false;
      lines.push_back(who(static_cast<int>(r)) + " keeps pace again at step " +
                      std::to_string(step) + " (slow since step " + std::to_string(p.slow_since) +
                      ")");
      p.slow_since = 0;
    }
    any_slow = any_slow || p.slow;
  }

  // The collectives after the last arrival: slower than at their best while
  // every rank arrives on time is the link's (or the network's) doing.
  if (communication_.size() < communication_steps * keep) return;
  const std::int64_t after = median({communication_.begin(), communication_.end()});
  figures_.communication_seconds = static_cast<double>(after) / 1e9;
  if (!any_slow && !figures_.communication_slow)
    communication_baseline_ =
        communication_baseline_ < 0 ? after : std::min(communication_baseline_, after);
  const std::int64_t base = std::max<std::int64_t>(communication_baseline_, 0);
  figures_.communication_baseline_seconds = static_cast<double>(base) / 1e9;
  const std::int64_t extra = after - base;
  if (communication - base <= bar) {
    communication_run_start_ = 0;
  } else if (communication_run_start_ == 0) {
    communication_run_start_ = step;
  }
  const double extra_share = whole > 0 ? static_cast<double>(extra) / whole : 0;
  if (!figures_.communication_slow && !any_slow && extra_share > options_.threshold &&
      extra >= floor) {
    figures_.communication_slow = true;
    figures_.communication_slow_since =
        communication_run_start_ != 0 ? communication_run_start_ : step;
    lines.push_back("the collectives are slow since step " +
                    std::to_string(figures_.communication_slow_since) +
                    ", with every rank's gradients on time: after the last rank's are ready they "
                    "take " +
                    ms(after) + " a step, " + ms(extra) + " more than at their best (" +
                    percent(extra, typical) + " of each " + ms(typical) +
                    " step); a slow link or a busy network, not a rank's compute");
  } else if (figures_.communication_slow &&
             (extra_share < options_.threshold / 2 || extra < floor / 2)) {
    figures_.communication_slow = false;
    lines.push_back("the collectives keep pace again at step " + std::to_string(step) +
                    " (slow since step " + std::to_string(figures_.communication_slow_since) + ")");
    figures_.communication_slow_since = 0;
  }
}

}  // namespace dtrain::detail
