#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/checkpoint.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/checkpoint.hpp, not this file.

#include <dtrain/checkpoint/checkpoint.hpp>
#include <dtrain/env/variables.hpp>

#include <system_error>

#include <unistd.h>

namespace dtrain {

DTRAIN_DETAIL_INLINE checkpoint_options checkpoint::with_copy_threads(checkpoint_options options,
                                                                      int local_size) {
  if (options.copy_threads == 0) {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    options.copy_threads = std::clamp(cores / std::max(1, local_size), 1, 8);
  }
  return options;
}

DTRAIN_DETAIL_INLINE checkpoint::checkpoint(dtrain::control_plane plane, checkpoint_options options)
    : context_{plane, std::move(options), {}},
      entries_(plane.rank(), std::max(1, context_.options.copy_threads)),
      interval_(context_.options.memory_every, context_.options.memory_budget),
      disk_(context_) {
  // Options that differ across the ranks (the same text on every rank), else
  // this rank's own bad options or environment: every rank learns of the
  // first problem and throws (one verdict), none waits for a rank that failed.
  std::string problem = differing_options();
  if (problem.empty()) {
    try {
      take_options();
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  agree_or_throw<config_error>(context_.plane, "take its checkpoint_options", problem);
  add_values("dtrain.step", {&steps_, 1, dtype::int64, memory::host}, checkpoint_scope::replicated,
             {});
}

namespace detail::ckpt {
/// Makes `dir` (and its parents) if need be; why it cannot be a directory
/// (`writable`: one this process may write in), or no error.
inline std::error_code usable_directory(const std::filesystem::path& dir, bool writable) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!ec && !std::filesystem::is_directory(dir, ec))
    ec = std::make_error_code(std::errc::not_a_directory);
  if (!ec && writable && ::access(dir.c_str(), W_OK | X_OK) != 0)
    ec = {errno, std::generic_category()};
  return ec;
}
}  // namespace detail::ckpt

DTRAIN_DETAIL_INLINE void checkpoint::take_options() {
  const checkpoint_options& o = context_.options;
  const dtrain::control_plane& plane = context_.plane;
  if (o.dir.empty()) {
    throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                       ": checkpoint_options::dir is empty");
  }
  // A directory that cannot be made (a file in its path) fails now, not at
  // the first save, after a restore that found nothing there. (Not checked
  // for writing: a restore alone may read a checkpoint it cannot write.)
  if (const std::error_code ec = detail::ckpt::usable_directory(o.dir, false)) {
    throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                       ": checkpoint_options::dir " + o.dir.string() +
                       " cannot be made a directory: " + ec.message());
  }
  if (o.keep < 1) {
    throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                       ": checkpoint_options::keep is " + std::to_string(o.keep) +
                       "; at least 1 checkpoint must be kept");
  }
  if (o.copy_threads < 0) {
    throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                       ": checkpoint_options::copy_threads is " + std::to_string(o.copy_threads) +
                       "; 0 (automatic) or more");
  }
  if (o.copy_threads == 0) context_.options.copy_threads = 1;
  if (o.memory_beside_step && o.memory_every == 0) {
    throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                       ": checkpoint_options::memory_beside_step is set and memory_every is 0: "
                       "there is no memory copy to read beside the step (set memory_every)");
  }
  if (!(o.memory_budget >= 0 && o.memory_budget < 1)) {
    throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                       ": checkpoint_options::memory_budget is " + std::to_string(o.memory_budget) +
                       "; a share of the step time, at least 0 (none) and below 1 (e.g. 0.03)");
  }
  if (o.memory_budget > 0 && o.memory_every < 3) {
    throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                       ": checkpoint_options::memory_budget is set and memory_every is " +
                       std::to_string(o.memory_every) +
                       ": the budget chooses between 1 and memory_every steps between copies, "
                       "and memory_every must be at least 3 (a step between copies, and one "
                       "after it, to measure a step without a copy)");
  }
  const environment env = environment::from_process();
  // The memory tier's places: an option, else the variable dtrun's agent sets.
  auto given = [&env](const std::string& option, std::string_view variable) {
    if (!option.empty()) return option;
    return std::string(env.get(variable).value_or(""));
  };
  if (const std::string dir = given(o.memory_dir.string(), memory_checkpoint_variable);
      !dir.empty()) {
    // The round (dtrun's agent numbers them): the buddy's fence against a
    // worker of an earlier one.
    std::int64_t round = 0;
    try {
      if (const auto r = detail::read_int(env, restart_count_variable)) round = r->value;
    } catch (const config_error& e) {
      throw config_error("checkpoint on rank " + std::to_string(plane.rank()) + ": " + e.what());
    }
    // A directory this rank cannot use fails now, on every rank, not at the first copy.
    if (const std::error_code ec = detail::ckpt::usable_directory(dir, true)) {
      throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                         ": the memory tier's directory " + dir + " (" +
                         (o.memory_dir.empty() ? std::string(memory_checkpoint_variable)
                                               : std::string("checkpoint_options::memory_dir")) +
                         ") cannot be used: " + ec.message());
    }
    memory_ = std::make_unique<detail::ckpt::memory_tier>(
        context_, dir, given(o.memory_buddy, memory_buddy_variable),
        given(o.memory_held, memory_held_variable), round);
  } else if (o.memory_every > 0) {
    throw config_error("checkpoint on rank " + std::to_string(plane.rank()) +
                       ": checkpoint_options::memory_every is " + std::to_string(o.memory_every) +
                       " and the memory tier has no directory: run under dtrun (its node agent "
                       "sets " +
                       std::string(memory_checkpoint_variable) +
                       "), or set checkpoint_options::memory_dir");
  }
  // The metrics file: a directory that cannot take it fails now, on every rank.
  if (const std::string dir = detail::read_setting(env, metrics_dir_variable, o.metrics_dir);
      !dir.empty()) {
    const int rank = plane.rank();
    context_.metrics_file =
        (std::filesystem::path(dir) / ("dtrain_checkpoint_rank" + std::to_string(rank) + ".prom"))
            .string();
    context_.metrics_labels = detail::metrics_text::labels(rank, node_name_or_unknown(env));
    detail::write_file_whole(context_.metrics_file, "", detail::ckpt::metrics_setting_name, rank);
  }
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::add(std::string name, buffer values,
                                                 checkpoint_scope scope,
                                                 std::vector<std::size_t> shape) {
  std::vector<std::uint64_t> dims(shape.begin(), shape.end());
  return add_values(std::move(name), values, scope, std::move(dims));
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::add_sharded(std::string name, buffer values,
                                                         std::vector<shard_range> ranges,
                                                         std::uint64_t total) {
  entries_.add_sharded(std::move(name), values, std::move(ranges), total);
  return *this;
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::add_hooks(std::function<void()> before_save,
                                                       std::function<void()> after_restore) {
  entries_.add_hooks(std::move(before_save), std::move(after_restore));
  return *this;
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::add(distributed_sampler& sampler, std::string name) {
  return add(
      std::move(name),
      [&sampler] {
        const sampler_position p = sampler.position();
        std::string out(2 * sizeof(std::uint64_t), '\0');
        std::memcpy(out.data(), &p.epoch, sizeof p.epoch);
        std::memcpy(out.data() + sizeof p.epoch, &p.offset, sizeof p.offset);
        return out;
      },
      [&sampler](std::string_view bytes) {
        sampler_position p;
        if (bytes.size() != sizeof p.epoch + sizeof p.offset) {
          throw checkpoint_error("checkpoint: the sampler's position has " +
                                 std::to_string(bytes.size()) + " bytes, not 16");
        }
        std::memcpy(&p.epoch, bytes.data(), sizeof p.epoch);
        std::memcpy(&p.offset, bytes.data() + sizeof p.epoch, sizeof p.offset);
        sampler.set_position(p);
      });
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::add(loss_scaler& scaler, std::string name) {
  return add(
      name, [&scaler] { return scaler.state(); },
      [&scaler, name](std::string_view text) {
        try {
          scaler.load_state(text);
        } catch (const config_error& e) {
          throw checkpoint_error("checkpoint: entry '" + name + "': " + e.what());
        }
      });
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::add(std::string name,
                                                 std::function<std::string()> save,
                                                 std::function<void(std::string_view)> load,
                                                 checkpoint_scope scope) {
  entries_.add_bytes(std::move(name), std::move(save), std::move(load), scope);
  return *this;
}

DTRAIN_DETAIL_INLINE std::optional<std::uint64_t> checkpoint::restore() {
  wait();
  // The memory copy when it is as new as the newest step on disk (by its
  // name: nothing on disk is read then), else the disk's, checked.
  if (memory_ && context_.options.memory_every > 0) {
    if (const std::int64_t on_disk = disk_.newest_by_name(); on_disk != -2) {
      if (const auto step = memory_->newest(on_disk, entries_); step && load(*memory_, *step)) {
        interval_.reset(*step);
        return step;
      }  // (a copy whose files are damaged was said to be skipped: the disk's)
    }    // else the disk's own look below says why it cannot be read
  }
  // Rank 0 picks the newest step by its manifest and its files' sizes; each
  // rank checks the checksums of the files it loads. A step with a damaged
  // file is skipped for the one before it.
  std::optional<std::uint64_t> before;
  for (;;) {
    const auto step = disk_.newest_before(-1, before);
    if (!step) {
      // Committed steps that are all damaged are not a fresh start: the
      // first save would remove them (steps numbered after it are stale).
      if (const std::int64_t named = disk_.newest_by_name(); named >= 0) {
        throw checkpoint_error(
            "checkpoint: no committed step in " + context_.options.dir.string() +
            " could be loaded (the newest is step-" + std::to_string(named) +
            "; each was skipped for the reason said" +
            (context_.options.quiet ? ", with checkpoint_options::quiet off" : "") +
            "): mend them, or move them away to start from the beginning");
      }
      context_.say("no checkpoint in " + context_.options.dir.string() +
                   ": starting from the beginning");
      interval_.reset(static_cast<std::uint64_t>(steps_));
      return std::nullopt;
    }
    if (load(disk_, *step)) {
      interval_.reset(*step);
      return step;
    }
    before = *step;
  }
}

DTRAIN_DETAIL_INLINE bool checkpoint::load(detail::ckpt::tier& t, std::uint64_t step) {
  const std::string what = "load " + t.where(step).string();
  std::vector<std::filesystem::path> files;
  std::string problem;
  bool ok = true;
  bool damaged = false;
  try {
    files = t.files(step, entries_);
  } catch (const detail::ckpt::damaged_part& e) {
    damaged = true;
    problem = e.what();
  } catch (const std::exception& e) {
    ok = false;
    problem = e.what();
  }
  // State that does not fit what a rank registered ends the restore on every
  // rank; a damaged file (some rank's) skips the step.
  agree(ok, problem, what);
  const verdict files_whole = gather_verdict(
      context_.plane,
      damaged ? problem + " (rank " + std::to_string(context_.plane.rank()) + ")" : "");
  if (!files_whole.ok()) {
    context_.say(files_whole.first_problem + "; skipped");
    return false;
  }
  try {
    entries_.load(files);
  } catch (const std::exception& e) {
    ok = false;
    problem = std::string(e.what()) + " (while loading: this rank's state is now partly loaded)";
  }
  agree(ok, problem, what);
  steps_ = static_cast<std::int64_t>(step);
  context_.say(t.resumed(step));
  return true;
}

DTRAIN_DETAIL_INLINE void checkpoint::check_released(std::string_view call) {
  if (!word_due_) return;
  word_due_ = false;
  // The state may have changed under the copy's reader: the copy is
  // dropped. (A copy that read nothing where it lives, every entry small
  // enough to be copied at step(), stands; the call is refused all the same,
  // so that a program is not right only while its state is small.)
  const bool dropped = memory_->awaits_word();
  if (dropped) {
    memory_->revoke_reads();
    memory_->complete();
  }
  throw config_error("checkpoint on rank " + std::to_string(context_.plane.rank()) +
                     ": checkpoint_options::memory_beside_step reads the state for the memory "
                     "copy of step " +
                     std::to_string(steps_) +
                     " beside the next step, and no before_update() came "
                     "before this " +
                     std::string(call) +
                     ": call ckpt.before_update() before the state changes (the optimizer's "
                     "step)" +
                     (dropped ? "; that copy is not used" : ""));
}

DTRAIN_DETAIL_INLINE bool checkpoint::step() {
  check_released("step()");
  ++steps_;
  const auto n = static_cast<std::uint64_t>(steps_);
  const bool to_disk = context_.options.every > 0 && n % context_.options.every == 0;
  const bool copies = interval_.due(n);
  if (copies) {
    // A step saved to disk synchronously writes its memory copy within
    // step() too, not beside the next step, and before the disk's: a rank
    // killed during the disk's save, or in the next step, leaves that copy
    // whole, and the job resumes from memory, not from this save on disk.
    copy_to_memory(context_.options.memory_beside_step &&
                   !(to_disk && !context_.options.asynchronous));
  }
  if (to_disk) save();  // (the interval leaves this step out: save() disturbs it)
  if (interval_.automatic()) {
    interval_.record(copies);
    if (interval_.agreement_due(n)) {
      // Every rank's figures, and from them the same interval everywhere.
      const auto start = std::chrono::steady_clock::now();
      const std::vector<std::int64_t> mine = interval_.pack();
      std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(context_.plane.size()));
      context_.plane.allgather(mine, all);
      if (const auto line = interval_.adopt(all, n)) context_.say(*line);
      interval_.agreed(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - start)
                           .count());
      interval_.disturb();  // the agreement's time falls in the next step
    }
  }
  return to_disk;
}

DTRAIN_DETAIL_INLINE void checkpoint::before_update() {
  word_due_ = false;
  if (!memory_ || !memory_->awaits_word()) return;
  const double waited = memory_->release_reads();
  context_.timings.blocked_seconds += waited;
  context_.timings.memory_seconds += waited;
}

DTRAIN_DETAIL_INLINE void checkpoint::save_into(detail::ckpt::tier& t, std::size_t slot,
                                                bool beside) {
  const auto start = std::chrono::steady_clock::now();
  t.complete(true);
  auto p = std::make_unique<detail::ckpt::pending_save>();
  p->step = static_cast<std::uint64_t>(steps_);
  p->start = start;
  p->partial = t.staging(p->step);
  p->replicated_part = t.replicated_part();
  // Where the writer reads each entry: copied now (asynchronous), where it
  // lives (synchronous), or where it lives if large (beside the step).
  const bool asynchronous = beside || context_.options.asynchronous;
  const std::size_t live_from = beside                          ? beside_copy_below
                                : context_.options.asynchronous ? detail::ckpt::registry::never_live
                                                                : 0;
  try {
    entries_.before_save();
    p->per_rank = entries_.snapshot(checkpoint_scope::per_rank, live_from, slot,
                                    context_.timings.copy_seconds);
    if (p->replicated_part.writes) {
      p->replicated = entries_.snapshot(checkpoint_scope::replicated, live_from, slot,
                                        context_.timings.copy_seconds, p->replicated_part.slice);
    }
  } catch (const std::exception& e) {
    p->problem = e.what();
  }
  // The writer waits for the training's word only when it reads the state
  // where it lives; with every entry copied it commits as soon as it is written.
  if (beside && (p->per_rank.reads_live || p->replicated.reads_live))
    p->gate = std::make_unique<detail::ckpt::read_gate>();
  // A snapshot that failed is committed (refused on every rank) now, as a synchronous save is.
  const bool failed = !p->problem.empty();
  t.write(std::move(p), asynchronous);
  if (!asynchronous || failed) t.complete();
}

DTRAIN_DETAIL_INLINE void checkpoint::save_to_memory() {
  interval_.disturb();  // a copy the program asked for: not one step() measures
  copy_to_memory(context_.options.memory_beside_step);
}

DTRAIN_DETAIL_INLINE void checkpoint::copy_to_memory(bool beside) {
  if (!memory_) {
    throw config_error("checkpoint on rank " + std::to_string(context_.plane.rank()) +
                       ": the memory tier has no directory: run under dtrun (its node agent "
                       "sets " +
                       std::string(memory_checkpoint_variable) +
                       "), or set checkpoint_options::memory_dir");
  }
  check_released("save_to_memory()");
  // Each rank commits its own copy (no collective): restore() takes the
  // newest step whole on every rank. Asynchronous: the copy here, the files
  // on a thread beside the next step (a rank killed then loses two steps).
  const auto start = std::chrono::steady_clock::now();
  save_into(*memory_, memory_slot, beside);
  // before_update() is due at every copy with the option, read beside the
  // step or not (a step saved to disk), so that a program is not right only
  // at some steps.
  word_due_ = context_.options.memory_beside_step;
  context_.timings.memory_seconds += detail::ckpt::seconds_since(start);
}

DTRAIN_DETAIL_INLINE void checkpoint::save() {
  interval_.disturb();  // the memory tier's interval does not measure this step
  const auto start = std::chrono::steady_clock::now();
  ++context_.timings.saves;
  // What the training thread spends here, whatever way it leaves.
  struct blocked_clock {
    checkpoint_timings& t;
    std::chrono::steady_clock::time_point start;
    ~blocked_clock() { t.blocked_seconds += detail::ckpt::seconds_since(start); }
  } blocked{context_.timings, start};
  {
    const auto commit_start = std::chrono::steady_clock::now();
    disk_.complete(true);  // the asynchronous save before this one
    disk_.join_committer();
    context_.timings.commit_seconds += detail::ckpt::seconds_since(commit_start);
  }
  save_into(disk_, disk_slot);
}

DTRAIN_DETAIL_INLINE void checkpoint::wait() {
  const auto start = std::chrono::steady_clock::now();
  word_due_ = false;  // the training waits here: a copy read beside the step is released
  if (memory_) memory_->complete();
  const auto commit_start = std::chrono::steady_clock::now();
  disk_.complete();
  disk_.join_committer();
  context_.timings.commit_seconds += detail::ckpt::seconds_since(commit_start);
  context_.timings.blocked_seconds += detail::ckpt::seconds_since(start);
}

DTRAIN_DETAIL_INLINE checkpoint::~checkpoint() = default;

DTRAIN_DETAIL_INLINE std::string checkpoint::differing_options() {
  // What makes the ranks save, commit and copy at the same steps: a rank
  // given other values would wait at a save or a copy's agreement that the
  // others never make, or copy steps the others do not.
  const checkpoint_options& o = context_.options;
  const std::array<std::int64_t, 4> mine{static_cast<std::int64_t>(o.every), o.asynchronous ? 1 : 0,
                                         static_cast<std::int64_t>(o.memory_every),
                                         std::bit_cast<std::int64_t>(o.memory_budget)};
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(context_.plane.size()));
  context_.plane.allgather(mine, all);
  auto text = [&](std::size_t r) {
    const std::int64_t* at = all.data() + r * mine.size();
    char budget[32];
    std::snprintf(budget, sizeof budget, "%g", std::bit_cast<double>(at[3]));
    return "rank " + std::to_string(r) + ": every " + std::to_string(at[0]) + ", asynchronous " +
           (at[1] != 0 ? "true" : "false") + ", memory_every " + std::to_string(at[2]) +
           ", memory_budget " + budget;
  };
  for (std::size_t r = 1; r * mine.size() < all.size(); ++r) {
    if (!std::equal(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(mine.size()),
                    all.begin() + static_cast<std::ptrdiff_t>(r * mine.size()))) {
      return "checkpoint on rank " + std::to_string(context_.plane.rank()) +
             ": the ranks were given other checkpoint_options (" + text(0) + "; " + text(r) +
             "): every rank saves, commits and copies into memory at the same steps; give "
             "every rank the same options";
    }
  }
  return {};
}

DTRAIN_DETAIL_INLINE void checkpoint::agree(bool ok, const std::string& problem,
                                            const std::string& what) {
  agree_or_throw<checkpoint_error>(
      context_.plane, what,
      ok ? std::string() : problem + " (rank " + std::to_string(context_.plane.rank()) + ")");
}

}  // namespace dtrain
