#pragma once
/// @file
/// basic_ddp's step, as a state machine under its lock: parameters are marked
/// ready (by the user, by autograd's hooks, or as unused), buckets launch in
/// turn, synchronize() completes the step, the first step's order rebuilds the
/// buckets once, and no_sync() accumulates instead. Out-of-class members of
/// basic_ddp (see ddp/basic_ddp.hpp for why out of class).

#include <dtrain/ddp/basic_ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <span>
#include <vector>

namespace dtrain {

template <class Policy>
void basic_ddp<Policy>::mark(std::size_t i) {
  bool last = false;
  bool throttle = false;
  {
    const std::lock_guard lock(mutex_);
    last = ready(i);
    throttle = shards_.throttles() && no_sync_depth_ == 0 && !sends_nothing();
  }
  // Transient buckets: a backward pass that writes gradients faster than the
  // buckets travel waits here, so that at most two buckets launched and not
  // yet reduced hold their pages (besides those being written).
  if (throttle) runner_->throttle(shards_.in_flight);
  if (last && all_marked_) all_marked_();
}

/// The hot path of mark_ready, under the lock. Returns whether it marked the
/// step's last parameter outside no_sync().
template <class Policy>
bool basic_ddp<Policy>::ready(std::size_t i) {
  check_usable_locked();
  variable& v = vars_[i];
  shards_.on_mark_locked(i, in_bulk_);  // stage 3: refused where no gather() held it
  const auto span = timeline_.mark_ready(i, v.bucket);
  any_touched_ = true;
  if (no_sync_depth_ > 0) {
    v.touched = true;
    return false;
  }
  if (v.unused) {
    throw error("DistributedDataParallel::mark_ready: parameter '" + v.param.name + "' on rank " +
                std::to_string(rank_) +
                " was marked ready after prepare_for_backward() listed it as not reached by step " +
                std::to_string(steps_) + " (it is sent as zero)");
  }
  if (v.marked) marked_twice(i);
  if (!any_marked_ && unused_pending_) {
    // The step's first gradient: what the backward pass does not reach is ready now
    // (c10d's Reducer), with a zero contribution or what no_sync() accumulated.
    unused_pending_ = false;
    for (std::size_t k = 0; k < vars_.size(); ++k) {
      if (!vars_[k].unused) continue;
      if (!vars_[k].touched) zero_contribution(k);
      record_mark(k, false);
    }
  }
  record_mark(i, true);
  return unmarked_ == 0;
}

/// Parameter i is ready: counted in its bucket, which launches in its turn.
/// `by_rank`: this rank gave it a gradient (not a zero for an unused one).
template <class Policy>
void basic_ddp<Policy>::record_mark(std::size_t i, bool by_rank) {
  variable& v = vars_[i];
  v.marked = true;
  if (by_rank) v.touched = true;
  any_marked_ = true;
  --unmarked_;
  if (recording()) ready_order_.push_back(i);
  bucket& b = buckets_[v.bucket];
  if (--b.pending == 0) {
    b.ready = true;
    pace_.bucket_ready();
    if (options_.overlap) launch_ready();
  }
}

template <class Policy>
void basic_ddp<Policy>::no_such_index(std::size_t index) const {
  throw error("DistributedDataParallel::mark_ready: parameter #" + std::to_string(index) +
              " does not exist on rank " + std::to_string(rank_) + " (the model has " +
              std::to_string(vars_.size()) + ")");
}

template <class Policy>
void basic_ddp<Policy>::no_such_name(std::string_view name) const {
  throw error("DistributedDataParallel::mark_ready: rank " + std::to_string(rank_) +
              " has no parameter named '" + std::string(name) + "'");
}

template <class Policy>
void basic_ddp<Policy>::not_a_parameter(const parameter& p) const {
  throw error("DistributedDataParallel::mark_ready: parameter '" + p.name + "' on rank " +
              std::to_string(rank_) +
              " is not one of the model's parameters (its values are elsewhere)");
}

template <class Policy>
void basic_ddp<Policy>::marked_twice(std::size_t i) const {
  throw error("DistributedDataParallel::mark_ready: parameter '" + vars_[i].param.name + "' (#" +
              std::to_string(i) + ") was marked ready twice in step " + std::to_string(steps_) +
              " on rank " + std::to_string(rank_) +
              "; mark each gradient once per step (accumulate inside no_sync())");
}

/// What may only happen between steps (after synchronize(), before the next mark).
template <class Policy>
void basic_ddp<Policy>::check_between_steps(const char* what) const {
  if (any_marked_ && no_sync_depth_ == 0) {
    throw error("DistributedDataParallel::" + std::string(what) + " on rank " +
                std::to_string(rank_) +
                " in the middle of a step (after mark_ready, before synchronize())");
  }
}

template <class Policy>
void basic_ddp<Policy>::mark_all_ready() {
  // Last first, as a backward pass finishes them and as the first layout
  // fills the buckets: recorded for the rebuild, this order changes nothing.
  // The backward pass is over: the caller reduces these buckets itself in
  // synchronize(), without waking the communication thread.
  const std::lock_guard lock(mutex_);
  in_bulk_ = true;
  try {
    for (std::size_t i = vars_.size(); i-- > 0;) {
      if (!vars_[i].marked && !vars_[i].unused) ready(i);
    }
  } catch (...) {
    in_bulk_ = false;
    throw;
  }
  in_bulk_ = false;
}

template <class Policy>
void basic_ddp<Policy>::synchronize() {
  const std::lock_guard lock(mutex_);
  synchronize_locked();
}

template <class Policy>
void basic_ddp<Policy>::synchronize_locked() {
  if (no_sync_depth_ > 0) return;
  {
    const auto span = timeline_.synchronize(steps_);
    device_spans_.poll();  // the device times of earlier buckets, without waiting
    check_usable_locked();
    complete_marks();
    if (auto e = complete_buckets()) fail(e);
    end_step();
  }
  if (pace_.step_done(steps_)) exchange_pace();
  if (!metrics_.file.empty()) {
    if (!sends_nothing()) metrics_.bytes += metrics_.step_bytes;
    try {
      write_metrics(false);
    } catch (const std::exception& e) {
      // The training matters more than its metrics: said once, and no more files.
      std::fprintf(stderr, "[rank %d/%d] dtrain: %s; this rank writes no more metrics\n", rank_,
                   size_, e.what());
      metrics_.file.clear();
    }
  }
  if (options_.find_unused_parameters && options_.report_unused_parameters &&
      steps_ <= unused_report_steps)
    report_unused();
}

/// ddp_options::stream becomes the compute stream, as set_stream() makes one
/// (the first broadcast is ordered after it); what is wrong with it, for the
/// agreement to stop every rank.
template <class Policy>
std::string basic_ddp<Policy>::take_stream() {
  const std::string what =
      "DistributedDataParallel on rank " + std::to_string(rank_) + ": ddp_options::stream";
  if constexpr (memory_space::on_stream) {
    static_assert(std::is_same_v<stream_type, stream_handle>,
                  "a memory space on streams takes ddp_options::stream (a stream_handle)");
    try {
      change_stream(options_.stream);
    } catch (const config_error& e) {
      return what + ": " + e.what();
    }
  } else if (options_.stream != nullptr) {
    return what + " is set, but " + std::string(communicator_type::name) +
           " reduces host memory and orders after no stream: leave it null";
  }
  return {};
}

template <class Policy>
void basic_ddp<Policy>::change_stream(stream_type compute) {
  if (compute == stream_) return;
  if (any_marked_) {
    throw config_error("DistributedDataParallel::set_stream on rank " + std::to_string(rank_) +
                       " in the middle of step " + std::to_string(steps_) +
                       " (after mark_ready, before synchronize()): "
                       "buckets already launched are ordered after the old stream; "
                       "set the stream before the step");
  }
  memory_space::check_stream(device_, compute);
  // What the old stream still does with the buckets comes first; their
  // storage is released on the new one from now on.
  memory_space::order_after(device_, compute, stream_);
  for (bucket& b : buckets_) {
    b.grads.set_stream(compute);
    b.wire.set_stream(compute);
    b.shard.set_stream(compute);
  }
  shards_.set_stream(compute);
  stream_ = compute;
}

template <class Policy>
void basic_ddp<Policy>::synchronize_on(stream_type compute) {
  const std::lock_guard lock(mutex_);
  if (compute != stream_ && (any_marked_ || next_launch_ > 0) && no_sync_depth_ == 0) {
    throw config_error("DistributedDataParallel::synchronize(stream) on rank " +
                       std::to_string(rank_) + " with a stream other than the one step " +
                       std::to_string(steps_) +
                       " was marked on: call set_stream(stream) before the step instead");
  }
  change_stream(compute);
  synchronize_locked();
}

template <class Policy>
void basic_ddp<Policy>::wait() {
  const std::lock_guard lock(mutex_);
  if (auto e = runner_drain()) fail(e);
  memory_space::synchronize(device_, stream_);
}

template <class Policy>
typename basic_ddp<Policy>::no_sync_guard basic_ddp<Policy>::no_sync() {
  const std::lock_guard lock(mutex_);
  if (any_marked_) {
    throw error("DistributedDataParallel::no_sync() on rank " + std::to_string(rank_) +
                " in the middle of a synchronized step (after mark_ready, before synchronize())");
  }
  ++no_sync_depth_;
  return no_sync_guard(*this);
}

template <class Policy>
void basic_ddp<Policy>::zero_grad() {
  const std::lock_guard lock(mutex_);
  check_between_steps("zero_grad()");
  for (bucket& b : buckets_) b.grads.clear(stream_);  // transient buckets: pages given back
  for (const variable& v : vars_) {
    if (!v.view) memory_space::zero(v.param.gradient, v.param.bytes(), v.param.device, stream_);
  }
}

template <class Policy>
void basic_ddp<Policy>::register_comm_hook(comm_hook hook) {
  const std::lock_guard lock(mutex_);
  if (any_marked_ || next_launch_ > 0) {
    throw config_error("DistributedDataParallel::register_comm_hook on rank " +
                       std::to_string(rank_) + " in the middle of step " + std::to_string(steps_) +
                       " (after mark_ready, before synchronize()): register it between steps");
  }
  shards_.check_hook();
  if (options_.compression != gradient_compression::none) {
    throw config_error("DistributedDataParallel::register_comm_hook: ddp_options::compression is " +
                       std::string(to_string(options_.compression)) +
                       "; a hook replaces the reduction, so compress inside the hook instead");
  }
  if (options_.accumulate != accumulation::wire) {
    throw config_error("DistributedDataParallel::register_comm_hook: ddp_options::accumulate is " +
                       std::string(to_string(options_.accumulate)) +
                       "; a hook replaces the reduction, so sum in float32 inside the hook "
                       "(topology::flat's allreduce_accumulated) instead");
  }
  hook_ = std::move(hook);
}

template <class Policy>
void basic_ddp<Policy>::prepare_for_backward(std::span<const std::size_t> unused) {
  const std::lock_guard lock(mutex_);
  if (!options_.find_unused_parameters) {
    throw config_error("DistributedDataParallel::prepare_for_backward on rank " +
                       std::to_string(rank_) +
                       " without ddp_options::find_unused_parameters: "
                       "set it to leave parameters out of a step");
  }
  check_between_steps("prepare_for_backward()");
  for (variable& v : vars_) v.unused = false;
  for (std::size_t i : unused) {
    if (i >= vars_.size()) no_such_index(i);
    vars_[i].unused = true;
  }
  unused_pending_ = !unused.empty();
}

template <class Policy>
void basic_ddp<Policy>::on_all_marked(std::function<void()> callback) {
  const std::lock_guard lock(mutex_);
  all_marked_ = std::move(callback);
}

template <class Policy>
bool basic_ddp<Policy>::marked(std::size_t i) const {
  const std::lock_guard lock(mutex_);
  return i < vars_.size() && vars_[i].marked;
}

template <class Policy>
bool basic_ddp<Policy>::declared_unused(std::size_t i) const {
  const std::lock_guard lock(mutex_);
  return i < vars_.size() && vars_[i].unused;
}

template <class Policy>
std::size_t basic_ddp<Policy>::unmarked() const {
  const std::lock_guard lock(mutex_);
  return unmarked_;
}

template <class Policy>
bool basic_ddp<Policy>::step_open() const {
  const std::lock_guard lock(mutex_);
  return any_marked_;
}

template <class Policy>
bool basic_ddp<Policy>::idle() const {
  const std::lock_guard lock(mutex_);
  return !any_touched_;
}

template <class Policy>
bool basic_ddp<Policy>::accumulating() const {
  const std::lock_guard lock(mutex_);
  return no_sync_depth_ > 0;
}

template <class Policy>
std::vector<bool> basic_ddp<Policy>::used_anywhere() {
  const std::lock_guard lock(mutex_);
  check_usable_locked();
  return used_anywhere_locked();
}

/// The counts of the last completed step: this rank's `touched_last`, summed
/// over the ranks once (in the memory space of the engine, which may reach
/// device memory only), then kept for that step.
template <class Policy>
std::vector<bool> basic_ddp<Policy>::used_anywhere_locked() {
  if (!options_.find_unused_parameters) return std::vector<bool>(vars_.size(), true);
  if (used_step_ != steps_) {
    std::vector<std::int32_t> counts(vars_.size());
    for (std::size_t i = 0; i < vars_.size(); ++i) counts[i] = vars_[i].touched_last ? 1 : 0;
    if (size_ > 1 && !counts.empty()) {
      const detail::label_scope label("parameters used in step",
                                      static_cast<std::int64_t>(steps_) - 1);
      through_engine(std::span(counts), dtype::int32,
                     [&](const buffer& b) { sum_in_place(b).wait(); });
    }
    used_counts_ = std::move(counts);
    used_step_ = steps_;
  }
  std::vector<bool> used(vars_.size());
  for (std::size_t i = 0; i < used.size(); ++i) used[i] = used_counts_[i] > 0;
  return used;
}

/// The unmarked parameters of this step: an error, or (find_unused_parameters)
/// zero contributions, marked now in index order on every rank.
template <class Policy>
void basic_ddp<Policy>::complete_marks() {
  if (unmarked_ > 0 && !options_.find_unused_parameters) {
    const std::string names =
        detail::pick_names(parameters(), [&](std::size_t i) { return !vars_[i].marked; }).names;
    throw error("DistributedDataParallel::synchronize: rank " + std::to_string(rank_) +
                " never marked " + std::to_string(unmarked_) + " of " +
                std::to_string(vars_.size()) + " parameters ready in step " +
                std::to_string(steps_) + ": " + names +
                "; call mark_ready for every parameter (or mark_all_ready() "
                "after the backward pass), or set ddp_options::find_unused_parameters");
  }
  for (std::size_t i = 0; i < vars_.size(); ++i) {
    if (vars_[i].marked) continue;
    // Nothing accumulated in no_sync() either: this rank contributes zero.
    if (!vars_[i].touched) zero_contribution(i);
    const auto span = timeline_.mark_ready(i, vars_[i].bucket);
    record_mark(i, false);
  }
  for (bucket& b : buckets_) b.ready = true;
  in_bulk_ = true;  // synchronize() reduces these on the caller's thread next
  launch_ready();
  in_bulk_ = false;
}

/// After each of the first unused_report_steps steps, what some rank used
/// (used_anywhere(), collective: every rank reaches it in the same step);
/// after the last of them, rank 0 names the parameters that no rank marked.
template <class Policy>
void basic_ddp<Policy>::report_unused() {
  const std::vector<bool> used = used_anywhere_locked();
  for (std::size_t i = 0; i < vars_.size(); ++i) vars_[i].used = vars_[i].used || used[i];
  if (steps_ != unused_report_steps || rank_ != 0) return;
  const auto [names, count] =
      detail::pick_names(parameters(), [&](std::size_t i) { return !vars_[i].used; });
  if (count == 0) return;
  std::fprintf(
      stderr,
      "[rank 0/%d] dtrain: DistributedDataParallel: "
      "no rank marked %s %s ready in the first %zu steps; "
      "with find_unused_parameters %s treated as unused and %s zeroed. "
      "If a mark_ready was forgotten, add it (or call mark_all_ready() after the backward pass); "
      "if the parameter is unused on purpose, "
      "set ddp_options::report_unused_parameters = false to silence this\n",
      size_, count == 1 ? "parameter" : "parameters", names.c_str(), unused_report_steps,
      count == 1 ? "it is" : "they are", count == 1 ? "its gradient" : "their gradients");
  std::fflush(stderr);
}

/// After every bucket is averaged: the one rebuild, then a fresh step.
template <class Policy>
void basic_ddp<Policy>::end_step() {
  const bool rebuild = recording();
  ++steps_;
  shards_.step_end_locked();  // the shard may be updated once; stage 3's values dropped
  for (variable& v : vars_) v.touched_last = v.touched;
  if (rebuild) {
    // Rank 0's order wins, so that every rank lays its buckets out alike.
    const std::vector<std::size_t> agreed =
        detail::agree_on_order(control_, ready_order_, vars_.size());
    rebuilt_ = true;
    // The buckets of this step are done with (host memory) or ordered
    // before everything that follows on the compute stream (streams), where
    // lay_out() copies out of them and releases them.
    if (agreed != layout_order()) lay_out(agreed);
  }
  reset_step();
}

template <class Policy>
void basic_ddp<Policy>::reset_step() {
  for (variable& v : vars_) v.marked = v.touched = v.zeroed = v.unused = false;
  for (bucket& b : buckets_) {
    b.pending = b.info.parameters.size();
    b.ready = false;
  }
  ready_order_.clear();
  next_launch_ = 0;
  unmarked_ = vars_.size();
  any_marked_ = any_touched_ = unused_pending_ = false;
}

template <class Policy>
void basic_ddp<Policy>::unusable() const {
  throw error("DistributedDataParallel on rank " + std::to_string(rank_) +
              " is unusable after an earlier failure: " + broken_message_);
}

template <class Policy>
void basic_ddp<Policy>::fail(std::exception_ptr e) {
  broken_ = true;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    broken_message_ = x.what();
    throw;
  }
}

template <class Policy>
bool basic_ddp<Policy>::any_rank(bool mine) {
  check_usable();
  if constexpr (communicator_type::reaches_host_memory) {
    return !flagged_ranks(control_, mine).empty();
  } else {
    const std::vector<std::int64_t> all = gather_scalar(mine ? 1 : 0);
    return std::any_of(all.begin(), all.end(), [](std::int64_t f) { return f != 0; });
  }
}

template <class Policy>
std::vector<std::int64_t> basic_ddp<Policy>::gather_values(std::span<const std::int64_t> mine) {
  const std::size_t n = mine.size();
  std::vector<std::int64_t> all(static_cast<std::size_t>(size_) * n);
  if constexpr (communicator_type::reaches_host_memory) {
    control_.allgather(mine, all);
  } else {
    std::copy(mine.begin(), mine.end(),
              all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rank_) * n));
    if (size_ == 1 || n == 0) return all;
    through_engine(std::span(all), dtype::int64, [&](const buffer& whole) {
      buffer slot = whole;  // in place: this rank's part of the whole
      slot.data = static_cast<std::byte*>(whole.data) +
                  static_cast<std::size_t>(rank_) * n * sizeof(std::int64_t);
      slot.count = n;
      comm_.allgather(slot, whole, stream_).wait();
    });
  }
  return all;
}

template <class Policy>
void basic_ddp<Policy>::write_metrics(bool always) {
  const std::int64_t now = detail::timeline::now();
  if (!always && metrics_.written != 0 && now - metrics_.written < 1'000'000'000) return;
  metrics_.written = now;
  const straggler_figures& f = pace_.figures();
  const rank_pace mine = f.ranks.empty() ? rank_pace{} : f.ranks[static_cast<std::size_t>(rank_)];
  detail::metrics_text m(metrics_.labels);
  m.add("dtrain_step", "gauge", "The last step this rank completed (synchronize()).",
        static_cast<double>(steps_));
  m.add("dtrain_step_timestamp_seconds", "gauge",
        "When this file was written, at the end of a step (Unix time): alert when it stops moving.",
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  m.add("dtrain_world_size", "gauge", "The ranks of the job.", size_);
  m.add("dtrain_restarts", "gauge",
        "The node agent's restarts of the workers (DTRAIN_RESTART_COUNT).", metrics_.restarts);
  m.add("dtrain_gradient_bytes_total", "counter",
        "The gradient bytes this rank averaged over the ranks (its buckets' payload).",
        static_cast<double>(metrics_.bytes));
  m.add("dtrain_step_seconds", "gauge",
        "The median step time over the ranks and the straggler watch's last steps.",
        f.step_seconds);
  m.add("dtrain_exposed_communication_seconds", "gauge",
        "The median time from the last rank's gradients to the end of a step.",
        f.communication_seconds);
  m.add("dtrain_straggler_delay_seconds", "gauge",
        "How long after the other ranks' this rank's last gradients are ready (median).",
        mine.delay_seconds);
  m.add("dtrain_straggler_share", "gauge", "That delay as a share of the step time.", mine.share);
  m.add("dtrain_straggler_slow", "gauge", "1 while this rank is reported slow.", mine.slow ? 1 : 0);
  m.add("dtrain_collectives_slow", "gauge",
        "1 while the collectives are reported slow with every rank on time.",
        f.communication_slow ? 1 : 0);
  detail::write_metrics(metrics_.file, m.str(), rank_);
}

/// The ranks' step records, exchanged and judged alike everywhere; rank 0
/// says what changed. A failure here is the step's: DDP is unusable after it.
template <class Policy>
void basic_ddp<Policy>::exchange_pace() {
  try {
    const detail::label_scope label("straggler records after step",
                                    static_cast<std::int64_t>(steps_));
    const std::int64_t start = detail::timeline::now();
    const std::vector<std::int64_t> all = gather_values(pace_.pack());
    const std::vector<std::string> lines = pace_.absorb(all, detail::timeline::now() - start);
    if (flight_note_) flight_note_->set(pace_.window());
    if (rank_ != 0 || !options_.stragglers.report) return;
    for (const std::string& line : lines)
      std::fprintf(stderr, "[rank 0/%d] dtrain: straggler: %s\n", size_, line.c_str());
    if (!lines.empty()) std::fflush(stderr);
  } catch (...) {
    fail(std::current_exception());
  }
}

}  // namespace dtrain
