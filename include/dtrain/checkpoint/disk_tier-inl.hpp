#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/disk_tier.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/disk_tier.hpp, not this file.

#include <dtrain/checkpoint/disk_tier.hpp>

#include <array>
#include <bit>
#include <chrono>
#include <cstdio>
#include <exception>
#include <utility>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::optional<checkpoint_found> latest_checkpoint(
    const std::filesystem::path& dir, std::vector<std::string>* skipped) {
  return detail::ckpt::newest_whole(dir, skipped, std::nullopt, true);
}

namespace detail::ckpt {

DTRAIN_DETAIL_INLINE std::optional<checkpoint_found> newest_whole(
    const std::filesystem::path& dir, std::vector<std::string>* skipped,
    std::optional<std::uint64_t> before, bool contents) {
  const auto steps = committed_steps(dir);
  for (const auto& [step, path] : steps) {
    if (before && step >= *before) continue;
    try {
      const manifest m = verify_step(path, contents);
      if (m.step != step) {
        throw checkpoint_error("checkpoint: " + (path / manifest_name).string() + " says step " +
                               std::to_string(m.step) + " in a directory for step " +
                               std::to_string(step));
      }
      return checkpoint_found{step, path, m.world_size};
    } catch (const checkpoint_error& e) {
      if (skipped) skipped->push_back(std::string(e.what()) + "; skipped");
    }
  }
  return std::nullopt;
}

DTRAIN_DETAIL_INLINE disk_tier::disk_tier(tier_context& context)
    : tier(context), cleaner_([&context](const std::string& line) { context.say(line); }) {}

DTRAIN_DETAIL_INLINE disk_tier::~disk_tier() {
  if (pending_) {
    // Unwinding (this rank failed): the other ranks are not here to agree,
    // so the save in flight is left uncommitted; the next save removes it.
    if (std::uncaught_exceptions() > 0) {
      static_cast<void>(join_writer(*pending_));
    } else {
      try {
        complete();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "dtrain checkpoint on rank %d: %s\n", context_.plane.rank(), e.what());
      }
    }
  }
  if (committer_.joinable()) committer_.join();
  if (!commit_failure_.empty()) {
    std::fprintf(stderr, "dtrain checkpoint on rank %d: %s\n", context_.plane.rank(),
                 commit_failure_.c_str());
  }
}

DTRAIN_DETAIL_INLINE std::filesystem::path disk_tier::staging(std::uint64_t step) const {
  return context_.options.dir / (step_name(step) + std::string(partial_suffix));
}

DTRAIN_DETAIL_INLINE std::filesystem::path disk_tier::where(std::uint64_t step) const {
  return context_.options.dir / step_name(step);
}

DTRAIN_DETAIL_INLINE std::string disk_tier::resumed(std::uint64_t step) const {
  return "resumed from " + where(step).string() + " (step " + std::to_string(step) + ")";
}

DTRAIN_DETAIL_INLINE std::int64_t disk_tier::newest_by_name() {
  std::int64_t newest = -1;
  if (context_.plane.rank() == 0) {
    try {
      const auto steps = committed_steps(context_.options.dir);
      if (!steps.empty()) newest = static_cast<std::int64_t>(steps.front().first);
    } catch (const std::exception&) {
      newest = -2;
    }
  }
  context_.broadcast_value(newest);
  return newest;
}

DTRAIN_DETAIL_INLINE std::optional<std::uint64_t> disk_tier::newest(std::int64_t floor,
                                                                    const registry& entries) {
  static_cast<void>(entries);  // the step is chosen by its files; load() checks the entries
  return newest_before(floor, std::nullopt);
}

DTRAIN_DETAIL_INLINE std::optional<std::uint64_t> disk_tier::newest_before(
    std::int64_t floor, std::optional<std::uint64_t> before) {
  constexpr std::int64_t failed = -2;
  std::int64_t chosen = -1;
  std::string problem;
  if (context_.plane.rank() == 0) {
    try {
      std::vector<std::string> skipped;
      // Sizes only: each rank checks the checksums of the files it loads
      // (registry::check()), so that no rank reads every rank's part.
      const auto found = newest_whole(context_.options.dir, &skipped, before, false);
      for (const std::string& line : skipped) context_.say(line);
      if (found) chosen = static_cast<std::int64_t>(found->step);
    } catch (const std::exception& e) {
      chosen = failed;
      problem = e.what();
    }
  }
  context_.broadcast_value(chosen);
  if (chosen == failed) {
    throw checkpoint_error(context_.plane.rank() == 0
                               ? problem
                               : "checkpoint: rank 0 could not look for checkpoints in " +
                                     context_.options.dir.string() + " (its error says why)");
  }
  if (chosen < 0 || chosen < floor) return std::nullopt;
  return static_cast<std::uint64_t>(chosen);
}

DTRAIN_DETAIL_INLINE std::vector<std::filesystem::path> disk_tier::files(std::uint64_t step,
                                                                         const registry& entries) {
  const std::filesystem::path step_dir = where(step);
  return entries.check(
      read_manifest(step_dir), [&](const std::string& name) { return step_dir / name; }, step_dir,
      context_.plane.size());
}

DTRAIN_DETAIL_INLINE void disk_tier::finish(std::unique_ptr<pending_save> owned, bool next_save) {
  pending_save& p = *owned;
  if (p.on_writer) {
    const double waited = join_writer(p);
    if (next_save) context_.timings.writer_wait_seconds += waited;
    if (next_save && waited > 0.001 && !warned_slow_writer_ && context_.plane.rank() == 0) {
      warned_slow_writer_ = true;
      std::fprintf(stderr,
                   "dtrain checkpoint: the asynchronous save of step %llu was still being "
                   "written when the next save came; the training waited %.0f ms "
                   "for it. Saves come faster than %s takes them: save less often "
                   "(checkpoint_options::every is %llu). Said once; "
                   "checkpoint::timings().writer_wait_seconds counts them all\n",
                   static_cast<unsigned long long>(p.step), 1e3 * waited,
                   context_.options.dir.string().c_str(),
                   static_cast<unsigned long long>(context_.options.every));
    }
  }
  join_committer();  // rank 0: the save before this one is committed (or this throws)
  const std::filesystem::path step_dir = context_.options.dir / step_name(p.step);
  const std::string what = "save step " + std::to_string(p.step) + " to " + step_dir.string();
  std::array<std::int64_t, 4> mine{1, 0, 0, 0};  // ok, has a file, bytes, checksum
  if (!p.problem.empty()) {
    mine[0] = 0;
    // Said before the agreement below, which no rank leaves before this one
    // joins it: the others then fail naming this rank, and their exit may
    // end the job (the node agent stops the rest) before this rank's own error.
    std::fprintf(stderr,
                 "dtrain checkpoint on rank %d: could not write its part of step %llu: %s\n",
                 context_.plane.rank(), static_cast<unsigned long long>(p.step), p.problem.c_str());
    std::fflush(stderr);
  } else if (p.per_rank_file) {
    mine = {1, 1, static_cast<std::int64_t>(p.per_rank_file->bytes),
            std::bit_cast<std::int64_t>(p.per_rank_file->checksum)};
  }
  const auto size = static_cast<std::size_t>(context_.plane.size());
  std::vector<std::int64_t> all(4 * size);
  context_.plane.allgather(mine, all);
  std::string failed_ranks;
  for (std::size_t r = 0; r < size; ++r) {
    if (all[4 * r] == 0) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
  }

  if (context_.plane.rank() != 0) {
    if (context_.options.asynchronous) return;  // rank 0 commits beside the training; it reports
    std::int64_t committed = 0;
    context_.broadcast_value(committed);
    if (!committed) {
      throw checkpoint_error(!p.problem.empty() ? p.problem + " (rank " +
                                                      std::to_string(context_.plane.rank()) + ")"
                                                : not_committed(what, failed_ranks));
    }
    return;
  }
  // Rank 0: the manifest and the rename, then the checkpoints beyond `keep`.
  auto commit = [this, owned = std::move(owned), all = std::move(all), failed_ranks,
                 what]() -> std::string {
    pending_save& q = *owned;
    std::string problem = q.problem;
    try {
      if (failed_ranks.empty()) {
        const std::uint64_t bytes = commit_on_disk(q, all);
        cleaner_.remove(stale_steps(context_.options.dir, q.step, context_.options.keep));
        const std::chrono::duration<double> took = std::chrono::steady_clock::now() - q.start;
        char line[160];
        std::snprintf(line, sizeof line, " (%llu bytes, %.3f s%s)",
                      static_cast<unsigned long long>(bytes), took.count(),
                      context_.options.asynchronous ? " until committed" : "");
        context_.say("saved " + (context_.options.dir / step_name(q.step)).string() + line);
        context_.committed(false, q.step);
        return "";
      }
      remove_checkpoint_tree(q.partial);
    } catch (const std::exception& e) {
      if (problem.empty()) problem = e.what();
      static_cast<void>(detail::remove_tree(q.partial.c_str()));
    }
    return !problem.empty() ? problem + " (rank 0)" : not_committed(what, failed_ranks);
  };
  if (context_.options.asynchronous) {
    committer_ =
        std::thread([this, commit = std::move(commit)]() mutable { commit_failure_ = commit(); });
    return;
  }
  const std::string problem = commit();
  std::int64_t committed = problem.empty() ? 1 : 0;
  context_.broadcast_value(committed);
  if (!committed) throw checkpoint_error(problem);
}

DTRAIN_DETAIL_INLINE std::string disk_tier::not_committed(const std::string& what,
                                                          const std::string& failed_ranks) {
  return "checkpoint: could not " + what +
         (failed_ranks.empty() ? ": rank 0 could not commit it (its error says why)"
                               : ": rank(s) " + failed_ranks +
                                     " could not write their part (each said why above, "
                                     "'dtrain checkpoint on rank N')") +
         "; the checkpoints before it are kept";
}

DTRAIN_DETAIL_INLINE std::uint64_t disk_tier::commit_on_disk(const pending_save& p,
                                                             const std::vector<std::int64_t>& all) {
  const std::filesystem::path step_dir = context_.options.dir / step_name(p.step);
  manifest m{p.step, context_.plane.size(), {*p.replicated_file}};
  std::uint64_t bytes = p.replicated_file->bytes;
  for (std::size_t r = 0; 4 * r < all.size(); ++r) {
    if (all[4 * r + 1] == 0) continue;
    m.files.push_back({rank_part_name(static_cast<int>(r)),
                       static_cast<std::uint64_t>(all[4 * r + 2]),
                       std::bit_cast<std::uint64_t>(all[4 * r + 3])});
    bytes += static_cast<std::uint64_t>(all[4 * r + 2]);
  }
  const std::string text = render(m);
  atomic_file manifest(p.partial / manifest_name);
  manifest.write(text.data(), text.size());
  static_cast<void>(manifest.finish());
  sync_directory(p.partial);
  if (std::filesystem::exists(step_dir)) {  // an older run's (its newest was damaged)
    const std::filesystem::path aside = step_dir.string() + ".replaced";
    remove_checkpoint_tree(aside);
    rename_path(step_dir, aside);
    remove_checkpoint_tree(aside);
  }
  rename_path(p.partial, step_dir);
  sync_directory(context_.options.dir);
  return bytes;
}

DTRAIN_DETAIL_INLINE void disk_tier::join_committer() {
  if (committer_.joinable()) committer_.join();
  if (!commit_failure_.empty())
    throw checkpoint_error(std::exchange(commit_failure_, std::string()));
}

}  // namespace detail::ckpt
}  // namespace dtrain
