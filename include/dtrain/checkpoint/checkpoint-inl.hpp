#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/checkpoint.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/checkpoint.hpp, not this file.

#include <dtrain/checkpoint/checkpoint.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::vector<std::pair<std::uint64_t, std::filesystem::path>>
detail::ckpt::committed_steps(const std::filesystem::path& dir) {
  std::error_code ec;
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> steps;
  if (!std::filesystem::exists(dir, ec)) return steps;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    throw checkpoint_error("checkpoint: cannot read directory " + dir.string() + ": " +
                           ec.message());
  }
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    if (auto step = detail::ckpt::step_of(it->path().filename().string())) {
      if (it->is_directory(ec)) steps.emplace_back(*step, it->path());
    }
  }
  if (ec) {
    throw checkpoint_error("checkpoint: cannot read directory " + dir.string() + ": " +
                           ec.message());
  }
  std::sort(steps.begin(), steps.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  return steps;
}

DTRAIN_DETAIL_INLINE std::optional<checkpoint_found> latest_checkpoint(
    const std::filesystem::path& dir, std::vector<std::string>* skipped) {
  const auto steps = detail::ckpt::committed_steps(dir);
  for (const auto& [step, path] : steps) {
    try {
      const detail::ckpt::manifest m = detail::ckpt::verify_step(path);
      if (m.step != step) {
        throw checkpoint_error("checkpoint: " + (path / detail::ckpt::manifest_name).string() +
                               " says step " + std::to_string(m.step) +
                               " in a directory for step " + std::to_string(step));
      }
      return checkpoint_found{step, path, m.world_size};
    } catch (const checkpoint_error& e) {
      if (skipped) skipped->push_back(std::string(e.what()) + "; skipped");
    }
  }
  return std::nullopt;
}

DTRAIN_DETAIL_INLINE checkpoint_options checkpoint::with_copy_threads(checkpoint_options options,
                                                                      int local_size) {
  if (options.copy_threads == 0) {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    options.copy_threads = std::clamp(cores / std::max(1, local_size), 1, 8);
  }
  return options;
}

DTRAIN_DETAIL_INLINE checkpoint::checkpoint(dtrain::control_plane plane, checkpoint_options options)
    : plane_(plane), options_(std::move(options)) {
  if (options_.dir.empty()) {
    throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                       ": checkpoint_options::dir is empty");
  }
  if (options_.keep < 1) {
    throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                       ": checkpoint_options::keep is " + std::to_string(options_.keep) +
                       "; at least 1 checkpoint must be kept");
  }
  if (options_.copy_threads < 0) {
    throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                       ": checkpoint_options::copy_threads is " +
                       std::to_string(options_.copy_threads) + "; 0 (automatic) or more");
  }
  if (options_.copy_threads == 0) options_.copy_threads = 1;
  memory_dir_ = options_.memory_dir;
  if (memory_dir_.empty()) {
    const std::string name(memory_checkpoint_variable);
    if (const char* dir = std::getenv(name.c_str()); dir != nullptr) memory_dir_ = dir;
  }
  add_values("dtrain.step", {&steps_, 1, dtype::int64, memory::host}, checkpoint_scope::replicated,
             {});
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
  for (const shard_range& r : ranges) {
    if (r.local > values.count || r.count > values.count - r.local || r.global > total ||
        r.count > total - r.global) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                         ": sharded entry '" + name + "': range " + std::to_string(r.global) + "+" +
                         std::to_string(r.count) + " (at " + std::to_string(r.local) +
                         " here) does not fit " + std::to_string(values.count) +
                         " values of a whole of " + std::to_string(total));
    }
  }
  add_values(name, values, checkpoint_scope::per_rank, {});
  entry& e = entries_.back();
  e.kind = detail::ckpt::entry_kind::sharded;
  e.ranges = std::move(ranges);
  e.total = total;
  return *this;
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::add_hooks(std::function<void()> before_save,
                                                       std::function<void()> after_restore) {
  hooks_.push_back({std::move(before_save), std::move(after_restore)});
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
  if (!save || !load) {
    throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": entry '" + name +
                       "' needs both a save and a load function");
  }
  entry e;
  e.name = std::move(name);
  e.scope = scope;
  e.kind = detail::ckpt::entry_kind::bytes;
  e.save = std::move(save);
  e.load = std::move(load);
  return push(std::move(e));
}

DTRAIN_DETAIL_INLINE std::optional<std::uint64_t> checkpoint::restore() {
  wait();
  if (options_.memory_every > 0 && !memory_dir_.empty()) {
    // The memory copy when it is as new as the newest step on disk (by its
    // name: nothing on disk is read then), else the disk's, checked.
    std::int64_t on_disk = no_checkpoint;
    if (plane_.rank() == 0) {
      try {
        const auto steps = detail::ckpt::committed_steps(options_.dir);
        if (!steps.empty()) on_disk = static_cast<std::int64_t>(steps.front().first);
      } catch (const std::exception&) {
        on_disk = failed;  // the disk's own look below says why
      }
    }
    broadcast_value(on_disk);
    if (on_disk != failed) {
      if (const auto step = choose_memory_copy(on_disk)) {
        const std::filesystem::path mine = memory_copy_dir(*step, plane_.rank());
        const std::filesystem::path leader = memory_copy_dir(*step, memory_node().front());
        load(
            [&] {
              // This rank's manifest, and the replicated part from its node's first rank's.
              detail::ckpt::manifest m = detail::ckpt::read_manifest(mine);
              const detail::ckpt::manifest theirs = detail::ckpt::read_manifest(leader);
              const std::string replicated(detail::ckpt::replicated_name);
              if (const auto* r = theirs.find(replicated); r && !m.find(replicated)) {
                m.files.push_back(*r);
              }
              return check_for_load(
                  m,
                  [&](const std::string& name) {
                    return (name == replicated ? leader : mine) / name;
                  },
                  mine);
            },
            mine);
        steps_ = static_cast<std::int64_t>(*step);
        say("resumed from the memory copy of step " + std::to_string(*step) + " in " +
            memory_dir_.string() + " (nothing read from " + options_.dir.string() + ")");
        return step;
      }
    }
  }
  // Rank 0 finds the newest checkpoint whose files check out; every rank hears the verdict.
  std::int64_t chosen = no_checkpoint;
  std::string problem;
  if ((plane_.rank() == 0)) {
    try {
      std::vector<std::string> skipped;
      const auto found = latest_checkpoint(options_.dir, &skipped);
      for (const std::string& line : skipped) say(line);
      if (found) chosen = static_cast<std::int64_t>(found->step);
    } catch (const std::exception& e) {
      chosen = failed;
      problem = e.what();
    }
  }
  broadcast_value(chosen);
  if (chosen == failed) {
    throw checkpoint_error((plane_.rank() == 0)
                               ? problem
                               : "checkpoint: rank 0 could not look for checkpoints in " +
                                     options_.dir.string() + " (its error says why)");
  }
  if (chosen == no_checkpoint) {
    say("no checkpoint in " + options_.dir.string() + ": starting from the beginning");
    return std::nullopt;
  }
  const auto step = static_cast<std::uint64_t>(chosen);
  const std::filesystem::path step_dir = options_.dir / detail::ckpt::step_name(step);
  load(step_dir);
  steps_ = static_cast<std::int64_t>(step);
  say("resumed from " + step_dir.string() + " (step " + std::to_string(step) + ")");
  return step;
}

DTRAIN_DETAIL_INLINE void checkpoint::load(const std::filesystem::path& step_dir) {
  load([&] { return check_for_load(step_dir); }, step_dir);
}

DTRAIN_DETAIL_INLINE void checkpoint::load(
    const std::function<std::vector<std::filesystem::path>()>& check,
    const std::filesystem::path& step_dir) {
  // Each rank checks what it will read against what it registered; all agree before anything
  // changes.
  std::vector<std::filesystem::path> files;
  std::string problem;
  std::int64_t ok = 1;
  try {
    files = check();
  } catch (const std::exception& e) {
    ok = 0;
    problem = e.what();
  }
  agree(ok, problem, "load " + step_dir.string());

  ok = 1;
  try {
    recut_.clear();
    for (const std::filesystem::path& file : files) apply(file);
    check_recut();
    for (const hook& h : hooks_) {
      if (h.after_restore) h.after_restore();
    }
  } catch (const std::exception& e) {
    ok = 0;
    problem = std::string(e.what()) + " (while loading: this rank's state is now partly loaded)";
  }
  agree(ok, problem, "load " + step_dir.string());
}

DTRAIN_DETAIL_INLINE const std::vector<int>& checkpoint::memory_node() {
  if (!memory_node_.empty()) return memory_node_;
  // Ranks with the same host name and memory directory are on one node
  // (each agent makes its own directory, its pid in the name).
  const std::int64_t mine = static_cast<std::int64_t>(std::hash<std::string>{}(
      detail::host_name().value_or("") + ":" + memory_dir_.lexically_normal().string()));
  std::vector<std::int64_t> all(static_cast<std::size_t>(plane_.size()));
  plane_.allgather(std::span<const std::int64_t>(&mine, 1), all);
  for (int r = 0; r < plane_.size(); ++r) {
    if (all[static_cast<std::size_t>(r)] == mine) memory_node_.push_back(r);
  }
  return memory_node_;
}

DTRAIN_DETAIL_INLINE std::filesystem::path checkpoint::memory_copy_dir(std::uint64_t step,
                                                                       int rank) const {
  return memory_dir_ / (detail::ckpt::step_name(step) + ".rank-" + std::to_string(rank));
}

DTRAIN_DETAIL_INLINE std::vector<std::uint64_t> checkpoint::memory_copies(int rank,
                                                                          bool partial) const {
  std::vector<std::uint64_t> steps;
  const std::string suffix = ".rank-" + std::to_string(rank) +
                             (partial ? std::string(detail::ckpt::partial_suffix) : std::string());
  std::error_code ec;
  for (std::filesystem::directory_iterator it(memory_dir_, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.ends_with(suffix)) continue;
    if (auto step =
            detail::ckpt::step_of(std::string_view(name).substr(0, name.size() - suffix.size())))
      steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end(), std::greater<>());
  return steps;
}

DTRAIN_DETAIL_INLINE std::array<std::int64_t, 2> checkpoint::usable_memory_copies() {
  std::array<std::int64_t, 2> out{-1, -1};
  const int leader = memory_node().front();
  std::size_t found = 0;
  for (const std::uint64_t step : memory_copies(plane_.rank())) {
    if (found == out.size()) break;
    try {
      const detail::ckpt::manifest m =
          detail::ckpt::verify_step(memory_copy_dir(step, plane_.rank()));
      if (m.step != step || m.world_size != plane_.size()) {
        throw checkpoint_error("checkpoint: " + memory_copy_dir(step, plane_.rank()).string() +
                               " holds step " + std::to_string(m.step) + " of " +
                               std::to_string(m.world_size) + " ranks, and this job has " +
                               std::to_string(plane_.size()));
      }
      if (leader != plane_.rank()) {  // the replicated part, from the node's first rank
        const detail::ckpt::manifest l = detail::ckpt::verify_step(memory_copy_dir(step, leader));
        if (l.step != step || !l.find(detail::ckpt::replicated_name)) {
          throw checkpoint_error("checkpoint: " + memory_copy_dir(step, leader).string() +
                                 " holds no replicated part of step " + std::to_string(step));
        }
      }
      out[found++] = static_cast<std::int64_t>(step);
    } catch (const std::exception& e) {
      if (!options_.quiet) {
        std::fprintf(stderr, "dtrain checkpoint on rank %d: memory copy: %s; not used\n",
                     plane_.rank(), e.what());
        std::fflush(stderr);
      }
    }
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::optional<std::uint64_t> checkpoint::choose_memory_copy(
    std::int64_t disk) {
  const std::array<std::int64_t, 2> mine = usable_memory_copies();
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(plane_.size()));
  plane_.allgather(mine, all);
  // The newest step that every rank holds whole (a rank killed in its save
  // has the one before, which the others still keep).
  std::int64_t best = -1;
  std::string missing;
  for (const std::int64_t candidate : {all[0], all[1]}) {
    if (candidate < 0) continue;
    std::string without;
    for (int r = 0; r < plane_.size(); ++r) {
      const auto at = 2 * static_cast<std::size_t>(r);
      if (all[at] != candidate && all[at + 1] != candidate)
        without += (without.empty() ? "" : ", ") + std::to_string(r);
    }
    if (without.empty()) {
      best = std::max(best, candidate);
    } else if (missing.empty()) {
      missing = "step " + std::to_string(candidate) + " is not whole on rank(s) " + without;
    }
  }
  bool any = false;
  for (const std::int64_t v : all) any = any || v >= 0;
  if (!any) return std::nullopt;  // no memory copy anywhere: the disk's, as ever
  const std::string fallback = "using " + options_.dir.string() + " instead";
  if (best < 0) {
    say("memory tier: no step is whole in every rank's memory copies (" +
        (missing.empty() ? std::string("some ranks have none: their node is new, or lost them")
                         : missing) +
        "): " + fallback);
    return std::nullopt;
  }
  if (best < disk) {
    say("memory tier: the memory copies (step " + std::to_string(best) +
        ") are older than the disk checkpoint (step " + std::to_string(disk) + "): " + fallback);
    return std::nullopt;
  }
  return static_cast<std::uint64_t>(best);
}

DTRAIN_DETAIL_INLINE bool checkpoint::step() {
  ++steps_;
  const auto n = static_cast<std::uint64_t>(steps_);
  if (options_.memory_every > 0 && n % options_.memory_every == 0) save_to_memory();
  if (options_.every > 0 && n % options_.every == 0) {
    save();
    return true;
  }
  return false;
}

DTRAIN_DETAIL_INLINE void checkpoint::save_to_memory() {
  if (memory_dir_.empty()) {
    throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                       ": the memory tier has no directory: run under dtrun (its node agent "
                       "sets " +
                       std::string(memory_checkpoint_variable) +
                       "), or set checkpoint_options::memory_dir");
  }
  const auto start = std::chrono::steady_clock::now();
  const bool leader = memory_node().front() == plane_.rank();  // writes the replicated part
  join_memory_writer();
  // Each rank commits its own copy (no collective): restore() takes the
  // newest step whole on every rank. Asynchronous: the copy here, the files
  // on a thread beside the next step (a rank killed then loses two steps).
  memory_pending_ = std::make_unique<pending_save>();
  pending_save& p = *memory_pending_;
  p.step = static_cast<std::uint64_t>(steps_);
  p.start = start;
  p.partial =
      memory_copy_dir(p.step, plane_.rank()).string() + std::string(detail::ckpt::partial_suffix);
  try {
    for (const hook& h : hooks_) {
      if (h.before_save) h.before_save();
    }
    const bool copy = options_.asynchronous;
    p.per_rank = snapshot(checkpoint_scope::per_rank, copy, true);
    if (leader) p.replicated = snapshot(checkpoint_scope::replicated, copy, true);
  } catch (const std::exception& e) {
    p.problem = e.what();
  }
  if (p.problem.empty()) {
    auto write = [this, &p, leader] {
      try {
        make_directory(p.partial, false);
        write_parts(p, plane_.rank(), leader);
        if (!p.problem.empty()) throw checkpoint_error(p.problem);
        detail::ckpt::manifest m{p.step, plane_.size(), {}};
        if (p.replicated_file) m.files.push_back(*p.replicated_file);
        if (p.per_rank_file) m.files.push_back(*p.per_rank_file);
        const std::string text = detail::ckpt::render(m);
        detail::ckpt::atomic_file manifest(p.partial / detail::ckpt::manifest_name);
        manifest.write(text.data(), text.size());
        static_cast<void>(manifest.finish());
        const std::filesystem::path done = memory_copy_dir(p.step, plane_.rank());
        remove_tree(done);  // an older run's copy of this step
        detail::ckpt::rename_path(p.partial, done);
        // This rank's copies beyond the 2 newest (and any numbered after this
        // one: an older run's), and its saves that died.
        const std::vector<std::uint64_t> kept = memory_copies(plane_.rank());
        for (std::size_t i = 0; i < kept.size(); ++i) {
          if (i >= 2 || kept[i] > p.step) remove_tree(memory_copy_dir(kept[i], plane_.rank()));
        }
        for (const std::uint64_t died : memory_copies(plane_.rank(), true)) {
          remove_tree(memory_copy_dir(died, plane_.rank()).string() +
                      std::string(detail::ckpt::partial_suffix));
        }
      } catch (const std::exception& e) {
        p.problem = e.what();
        static_cast<void>(detail::remove_tree(p.partial.c_str()));
      }
    };
    if (options_.asynchronous) {
      memory_writer_ = std::thread(std::move(write));
    } else {
      write();
    }
  }
  if (!options_.asynchronous) join_memory_writer();
  timings_.memory_seconds += detail::ckpt::seconds_since(start);
}

DTRAIN_DETAIL_INLINE void checkpoint::join_memory_writer() noexcept {
  if (!memory_pending_) return;
  if (memory_writer_.joinable()) memory_writer_.join();
  const pending_save& p = *memory_pending_;
  if (!p.problem.empty()) ++memory_failures_;
  if (!p.problem.empty() && !options_.quiet && memory_failures_ == 1) {
    std::fprintf(stderr,
                 "dtrain checkpoint on rank %d: its memory copy of step %llu was not written "
                 "(%s); its older copies and the disk stay. Said once; "
                 "checkpoint::memory_failures() counts them all\n",
                 plane_.rank(), static_cast<unsigned long long>(p.step), p.problem.c_str());
    std::fflush(stderr);
  }
  memory_pending_.reset();
}

DTRAIN_DETAIL_INLINE void checkpoint::save() {
  const auto start = std::chrono::steady_clock::now();
  ++timings_.saves;
  // What the training thread spends here, whatever way it leaves.
  struct blocked_clock {
    checkpoint_timings& t;
    std::chrono::steady_clock::time_point start;
    ~blocked_clock() { t.blocked_seconds += detail::ckpt::seconds_since(start); }
  } blocked{timings_, start};
  wait_pending(true);
  const auto step = static_cast<std::uint64_t>(steps_);
  pending_ = std::make_unique<pending_save>();
  pending_save& p = *pending_;
  p.step = step;
  p.start = start;
  p.partial =
      options_.dir / (detail::ckpt::step_name(step) + std::string(detail::ckpt::partial_suffix));

  // 1. Every rank makes the partial directory (a save of this step that
  // died before may have left it: its files are overwritten, and the
  // manifest lists only this save's).
  try {
    make_directory(p.partial, false);
  } catch (const std::exception& e) {
    p.problem = e.what();
  }

  // 2. Every rank writes its part (now, or from a copy on a thread).
  try {
    if (p.problem.empty()) {
      for (const hook& h : hooks_) {
        if (h.before_save) h.before_save();
      }
      p.per_rank = snapshot(checkpoint_scope::per_rank, options_.asynchronous);
      if (plane_.rank() == 0)
        p.replicated = snapshot(checkpoint_scope::replicated, options_.asynchronous);
    }
  } catch (const std::exception& e) {
    p.problem = e.what();
  }
  if (options_.asynchronous && p.problem.empty()) {
    p.writer = std::thread([&p, rank = plane_.rank()] { write_parts(p, rank, rank == 0); });
    return;
  }
  if (p.problem.empty()) write_parts(p, plane_.rank(), plane_.rank() == 0);
  commit();
}

DTRAIN_DETAIL_INLINE void checkpoint::wait() {
  const auto start = std::chrono::steady_clock::now();
  join_memory_writer();
  wait_pending();
  timings_.blocked_seconds += detail::ckpt::seconds_since(start);
}

DTRAIN_DETAIL_INLINE checkpoint::~checkpoint() {
  join_memory_writer();
  finish_pending();
  if (committer_.joinable()) committer_.join();
  if (!commit_failure_.empty()) {
    std::fprintf(stderr, "dtrain checkpoint on rank %d: %s\n", plane_.rank(),
                 commit_failure_.c_str());
  }
  if (cleaner_.joinable()) cleaner_.join();
}

DTRAIN_DETAIL_INLINE void checkpoint::finish_pending() noexcept {
  if (!pending_) return;
  // Unwinding (this rank failed): the other ranks are not here to agree,
  // so the save in flight is left uncommitted; the next save removes it.
  if (std::uncaught_exceptions() > 0) {
    if (pending_->writer.joinable()) pending_->writer.join();
    return;
  }
  try {
    commit();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain checkpoint on rank %d: %s\n", plane_.rank(), e.what());
  }
}

DTRAIN_DETAIL_INLINE void checkpoint::wait_pending(bool next_save) {
  const auto start = std::chrono::steady_clock::now();
  if (pending_) commit(next_save);
  join_committer();
  timings_.commit_seconds += detail::ckpt::seconds_since(start);
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::add_values(std::string name, buffer values,
                                                        checkpoint_scope scope,
                                                        std::vector<std::uint64_t> shape) {
  if (values.where != memory::host) {
    throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": entry '" + name +
                       "' is in device memory; checkpoints hold host memory (copy it to the host "
                       "and add that copy)");
  }
  if (values.count > 0 && values.data == nullptr) {
    throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": entry '" + name +
                       "' has " + std::to_string(values.count) + " values and no data");
  }
  entry e;
  e.name = std::move(name);
  e.scope = scope;
  e.values = values;
  e.shape = std::move(shape);
  return push(std::move(e));
}

DTRAIN_DETAIL_INLINE checkpoint& checkpoint::push(entry e) {
  if (e.name.empty() || e.name.size() > detail::ckpt::max_name) {
    throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                       ": an entry's name must have 1 to " +
                       std::to_string(detail::ckpt::max_name) + " bytes");
  }
  for (const entry& other : entries_) {
    if (other.name == e.name) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": entry '" +
                         e.name + "' is added twice");
    }
  }
  entries_.push_back(std::move(e));
  return *this;
}

DTRAIN_DETAIL_INLINE bool checkpoint::has_scope(checkpoint_scope scope) const {
  return std::ranges::any_of(entries_, [&](const entry& e) { return e.scope == scope; });
}

DTRAIN_DETAIL_INLINE checkpoint::part_snapshot checkpoint::snapshot(checkpoint_scope scope,
                                                                    bool copy, bool memory) {
  part_snapshot out;
  std::size_t owned = 0;
  for (const entry& e : entries_) owned += e.scope == scope ? 1 : 0;
  out.owned.reserve(owned);  // the records point into these strings: no reallocation
  std::vector<detail::ckpt::copy_job> copies;
  for (entry& e : entries_) {
    if (e.scope != scope) continue;
    part_record r{e.name, e.kind, e.values.type, e.shape, e.values.data, e.values.bytes()};
    if (e.kind == detail::ckpt::entry_kind::bytes) {
      r.type = dtype::uint8;
      out.owned.push_back(e.save());
      r.data = out.owned.back().data();
      r.bytes = out.owned.back().size();
    } else if (e.kind == detail::ckpt::entry_kind::sharded) {
      out.owned.push_back(sharded_payload(e));
      r.data = out.owned.back().data();
      r.bytes = out.owned.back().size();
    } else if (copy && r.bytes > 0) {
      // The entry's own copy, reused by each save (one is in flight at a
      // time): its pages are touched once per job, not at every save.
      void* to = (memory ? e.memory_staged : e.staged).reserve(e.values.bytes());
      copies.push_back({to, e.values.data, e.values.bytes()});
      r.data = to;
    }
    out.records.push_back(r);
  }
  if (!copies.empty()) {
    const auto start = std::chrono::steady_clock::now();
    detail::ckpt::copy_parallel(copies, options_.copy_threads);
    timings_.copy_seconds += detail::ckpt::seconds_since(start);
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::string checkpoint::sharded_payload(const entry& e) {
  const std::size_t element = size_of(e.values.type);
  std::string out;
  auto word = [&](std::uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  word(e.total);
  word(e.ranges.size());
  for (const shard_range& r : e.ranges) {
    word(r.global);
    word(r.count);
  }
  for (const shard_range& r : e.ranges) {
    out.append(static_cast<const char*>(e.values.data) + r.local * element,
               static_cast<std::size_t>(r.count * element));
  }
  return out;
}

DTRAIN_DETAIL_INLINE detail::ckpt::file_record checkpoint::write_part(
    const std::filesystem::path& path, const part_snapshot& part) {
  detail::ckpt::atomic_file file(path);
  detail::ckpt::write_part_header(file, static_cast<std::uint32_t>(part.records.size()));
  for (const part_record& r : part.records) {
    detail::ckpt::write_entry(file, r.name, r.kind, r.type, r.shape, r.data, r.bytes);
  }
  return file.finish();
}

DTRAIN_DETAIL_INLINE void checkpoint::write_parts(pending_save& p, int rank, bool replicated) {
  try {
    if (!p.per_rank.records.empty()) {
      p.per_rank_file = write_part(p.partial / detail::ckpt::rank_part_name(rank), p.per_rank);
    }
    if (replicated)
      p.replicated_file = write_part(p.partial / detail::ckpt::replicated_name, p.replicated);
  } catch (const std::exception& e) {
    p.problem = e.what();
  }
}

DTRAIN_DETAIL_INLINE void checkpoint::commit(bool next_save) {
  std::unique_ptr<pending_save> owned = std::move(pending_);
  pending_save& p = *owned;
  if (p.writer.joinable()) {
    const auto start = std::chrono::steady_clock::now();
    p.writer.join();
    const double waited = detail::ckpt::seconds_since(start);
    if (next_save) timings_.writer_wait_seconds += waited;
    if (next_save && waited > 0.001 && !warned_slow_writer_ && plane_.rank() == 0) {
      warned_slow_writer_ = true;
      std::fprintf(stderr,
                   "dtrain checkpoint: the asynchronous save of step %llu was still being "
                   "written when the next save came; the training waited %.0f ms "
                   "for it. Saves come faster than %s takes them: save less often "
                   "(checkpoint_options::every is %llu). Said once; "
                   "checkpoint::timings().writer_wait_seconds counts them all\n",
                   static_cast<unsigned long long>(p.step), 1e3 * waited,
                   options_.dir.string().c_str(), static_cast<unsigned long long>(options_.every));
    }
  }
  join_committer();  // rank 0: the save before this one is committed (or this throws)
  const std::filesystem::path step_dir = options_.dir / detail::ckpt::step_name(p.step);
  const std::string what = "save step " + std::to_string(p.step) + " to " + step_dir.string();
  std::array<std::int64_t, 4> mine{1, 0, 0, 0};  // ok, has a file, bytes, checksum
  if (!p.problem.empty()) {
    mine[0] = 0;
    // Said before the agreement below, which no rank leaves before this one
    // joins it: the others then fail naming this rank, and their exit may
    // end the job (the node agent stops the rest) before this rank's own error.
    std::fprintf(stderr,
                 "dtrain checkpoint on rank %d: could not write its part of step %llu: %s\n",
                 plane_.rank(), static_cast<unsigned long long>(p.step), p.problem.c_str());
    std::fflush(stderr);
  } else if (p.per_rank_file) {
    mine = {1, 1, static_cast<std::int64_t>(p.per_rank_file->bytes),
            std::bit_cast<std::int64_t>(p.per_rank_file->checksum)};
  }
  const auto size = static_cast<std::size_t>(plane_.size());
  std::vector<std::int64_t> all(4 * size);
  plane_.allgather(mine, all);
  std::string failed_ranks;
  for (std::size_t r = 0; r < size; ++r) {
    if (all[4 * r] == 0) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
  }

  if (plane_.rank() != 0) {
    if (options_.asynchronous) return;  // rank 0 commits beside the training; it reports
    std::int64_t committed = 0;
    broadcast_value(committed);
    if (!committed) {
      throw checkpoint_error(!p.problem.empty()
                                 ? p.problem + " (rank " + std::to_string(plane_.rank()) + ")"
                                 : not_committed(what, failed_ranks));
    }
    return;
  }
  // Rank 0: the manifest and the rename, then the checkpoints beyond `keep`.
  auto finish = [this, owned = std::move(owned), all = std::move(all), failed_ranks,
                 what]() -> std::string {
    pending_save& q = *owned;
    std::string problem = q.problem;
    try {
      if (failed_ranks.empty()) {
        const std::uint64_t bytes = commit_on_disk(q, all);
        prune(q.step);
        const std::chrono::duration<double> took = std::chrono::steady_clock::now() - q.start;
        char line[160];
        std::snprintf(line, sizeof line, " (%llu bytes, %.3f s%s)",
                      static_cast<unsigned long long>(bytes), took.count(),
                      options_.asynchronous ? " until committed" : "");
        say("saved " + (options_.dir / detail::ckpt::step_name(q.step)).string() + line);
        return "";
      }
      remove_tree(q.partial);
    } catch (const std::exception& e) {
      if (problem.empty()) problem = e.what();
      static_cast<void>(detail::remove_tree(q.partial.c_str()));
    }
    return !problem.empty() ? problem + " (rank 0)" : not_committed(what, failed_ranks);
  };
  if (options_.asynchronous) {
    committer_ =
        std::thread([this, finish = std::move(finish)]() mutable { commit_failure_ = finish(); });
    return;
  }
  const std::string problem = finish();
  std::int64_t committed = problem.empty() ? 1 : 0;
  broadcast_value(committed);
  if (!committed) throw checkpoint_error(problem);
}

DTRAIN_DETAIL_INLINE std::string checkpoint::not_committed(const std::string& what,
                                                           const std::string& failed_ranks) {
  return "checkpoint: could not " + what +
         (failed_ranks.empty() ? ": rank 0 could not commit it (its error says why)"
                               : ": rank(s) " + failed_ranks +
                                     " could not write their part (each said why above, "
                                     "'dtrain checkpoint on rank N')") +
         "; the checkpoints before it are kept";
}

DTRAIN_DETAIL_INLINE std::uint64_t checkpoint::commit_on_disk(
    const pending_save& p, const std::vector<std::int64_t>& all) {
  const std::filesystem::path step_dir = options_.dir / detail::ckpt::step_name(p.step);
  detail::ckpt::manifest m{p.step, plane_.size(), {*p.replicated_file}};
  std::uint64_t bytes = p.replicated_file->bytes;
  for (std::size_t r = 0; 4 * r < all.size(); ++r) {
    if (all[4 * r + 1] == 0) continue;
    m.files.push_back({detail::ckpt::rank_part_name(static_cast<int>(r)),
                       static_cast<std::uint64_t>(all[4 * r + 2]),
                       std::bit_cast<std::uint64_t>(all[4 * r + 3])});
    bytes += static_cast<std::uint64_t>(all[4 * r + 2]);
  }
  const std::string text = detail::ckpt::render(m);
  detail::ckpt::atomic_file manifest(p.partial / detail::ckpt::manifest_name);
  manifest.write(text.data(), text.size());
  static_cast<void>(manifest.finish());
  detail::ckpt::sync_directory(p.partial);
  if (std::filesystem::exists(step_dir)) {  // an older run's (its newest was damaged)
    const std::filesystem::path aside = step_dir.string() + ".replaced";
    remove_tree(aside);
    detail::ckpt::rename_path(step_dir, aside);
    remove_tree(aside);
  }
  detail::ckpt::rename_path(p.partial, step_dir);
  detail::ckpt::sync_directory(options_.dir);
  return bytes;
}

DTRAIN_DETAIL_INLINE void checkpoint::join_committer() {
  if (committer_.joinable()) committer_.join();
  if (!commit_failure_.empty())
    throw checkpoint_error(std::exchange(commit_failure_, std::string()));
}

DTRAIN_DETAIL_INLINE void checkpoint::broadcast_value(std::int64_t& value) {
  std::array<std::uint8_t, sizeof(std::int64_t)> bytes{};
  std::memcpy(bytes.data(), &value, sizeof value);
  plane_.broadcast(bytes, 0);
  std::memcpy(&value, bytes.data(), sizeof value);
}

DTRAIN_DETAIL_INLINE std::string checkpoint::describe(detail::ckpt::entry_kind kind, dtype type,
                                                      const std::vector<std::uint64_t>& shape,
                                                      std::uint64_t bytes) {
  if (kind == detail::ckpt::entry_kind::bytes)
    return std::to_string(bytes) + " bytes of its own format";
  std::string out;
  if (shape.empty()) {
    out = std::to_string(bytes / size_of(type));
  } else {
    out = "[";
    for (std::size_t i = 0; i < shape.size(); ++i)
      out += (i ? ", " : "") + std::to_string(shape[i]);
    out += "]";
  }
  return out + " " + std::string(to_string(type));
}

DTRAIN_DETAIL_INLINE std::vector<std::filesystem::path> checkpoint::check_for_load(
    const std::filesystem::path& step_dir) {
  return check_for_load(
      detail::ckpt::read_manifest(step_dir),
      [&](const std::string& name) { return step_dir / name; }, step_dir);
}

DTRAIN_DETAIL_INLINE std::vector<std::filesystem::path> checkpoint::check_for_load(
    const detail::ckpt::manifest& m,
    const std::function<std::filesystem::path(const std::string&)>& path_of,
    const std::filesystem::path& step_dir) {
  std::vector<std::pair<std::string, checkpoint_scope>> wanted{
      {std::string(detail::ckpt::replicated_name), checkpoint_scope::replicated}};
  if (has_scope(checkpoint_scope::per_rank)) {
    if (m.world_size != plane_.size()) {
      // Sharded entries are re-cut from every rank's part; other per-rank state cannot be.
      std::string names;
      for (const entry& e : entries_) {
        if (e.scope == checkpoint_scope::per_rank && e.kind != detail::ckpt::entry_kind::sharded)
          names += (names.empty() ? "'" : ", '") + e.name + "'";
      }
      if (!names.empty()) {
        throw checkpoint_error("checkpoint: " + step_dir.string() + " was written by " +
                               std::to_string(m.world_size) + " ranks and this job has " +
                               std::to_string(plane_.size()) + "; its per-rank state (" + names +
                               ") cannot be re-cut for another world size");
      }
      for (int r = 0; r < m.world_size; ++r)
        wanted.emplace_back(detail::ckpt::rank_part_name(r), checkpoint_scope::per_rank);
    } else {
      wanted.emplace_back(detail::ckpt::rank_part_name(plane_.rank()), checkpoint_scope::per_rank);
    }
  }
  std::vector<std::filesystem::path> files;
  std::string problems;
  for (const auto& [name, scope] : wanted) {
    const std::filesystem::path path = path_of(name);
    const detail::ckpt::file_record* record = m.find(name);
    if (!record)
      throw checkpoint_error("checkpoint: " + (step_dir / detail::ckpt::manifest_name).string() +
                             " lists no " + name);
    const detail::ckpt::part_contents got = detail::ckpt::read_checked_part(path, *record);
    std::vector<bool> matched(got.entries.size(), false);
    for (const entry& e : entries_) {
      if (e.scope != scope) continue;
      const auto it = std::ranges::find(got.entries, e.name, &detail::ckpt::entry_header::name);
      if (it == got.entries.end()) {
        problems += "\n  '" + e.name + "' is registered here and not in the checkpoint";
        continue;
      }
      matched[static_cast<std::size_t>(it - got.entries.begin())] = true;
      const bool same_kind = it->kind == e.kind;
      const bool same_values =
          e.kind == detail::ckpt::entry_kind::bytes ||
          (e.kind == detail::ckpt::entry_kind::sharded && it->type == e.values.type) ||
          (it->type == e.values.type && it->bytes == e.values.bytes() &&
           (it->shape.empty() || e.shape.empty() || it->shape == e.shape));
      if (!same_kind || !same_values) {
        problems += "\n  '" + e.name + "' is " +
                    describe(it->kind, it->type, it->shape, it->bytes) + " in the checkpoint and " +
                    describe(e.kind, e.values.type, e.shape,
                             e.kind == detail::ckpt::entry_kind::bytes ? 0 : e.values.bytes()) +
                    " here";
      }
    }
    for (std::size_t i = 0; i < got.entries.size(); ++i) {
      if (!matched[i]) {
        problems +=
            "\n  '" + got.entries[i].name + "' is in the checkpoint and not registered here";
      }
    }
    files.push_back(path);
  }
  if (!problems.empty()) {
    throw checkpoint_error("checkpoint: " + step_dir.string() + " does not fit what rank " +
                           std::to_string(plane_.rank()) +
                           " registered (another model, or other state):" + problems);
  }
  return files;
}

DTRAIN_DETAIL_INLINE void checkpoint::apply(const std::filesystem::path& path) {
  detail::ckpt::read_part(
      path, [&](const detail::ckpt::entry_header& h, detail::ckpt::checked_reader& in) {
        const auto it = std::ranges::find(entries_, h.name, &entry::name);
        if (it == entries_.end()) {
          in.read(nullptr, h.bytes, "entry '" + h.name + "'");
          return;
        }
        if (it->kind == detail::ckpt::entry_kind::bytes) {
          std::string bytes(static_cast<std::size_t>(h.bytes), '\0');
          in.read(bytes.data(), h.bytes, "entry '" + h.name + "'");
          it->load(bytes);
        } else if (it->kind == detail::ckpt::entry_kind::sharded) {
          std::string bytes(static_cast<std::size_t>(h.bytes), '\0');
          in.read(bytes.data(), h.bytes, "entry '" + h.name + "'");
          recut(*it, bytes, path);
        } else {
          in.read(it->values.data, h.bytes, "entry '" + h.name + "'");
        }
      });
}

DTRAIN_DETAIL_INLINE void checkpoint::recut(entry& e, std::string_view payload,
                                            const std::filesystem::path& file) {
  const std::size_t element = size_of(e.values.type);
  const detail::ckpt::sharded_payload saved =
      detail::ckpt::parse_sharded(payload, element, "entry '" + e.name + "' of " + file.string());
  if (saved.total != e.total) {
    throw checkpoint_error("checkpoint: sharded entry '" + e.name + "' of " + file.string() +
                           " is a whole of " + std::to_string(saved.total) +
                           " elements, and here of " + std::to_string(e.total));
  }
  auto& covered = recut_[e.name];    // the global intervals of this rank's elements it got
  std::size_t at = saved.values_at;  // the saved range's values in the payload
  for (const auto& [global, count] : saved.ranges) {
    for (const shard_range& mine : e.ranges) {
      const std::uint64_t lo = std::max(global, mine.global);
      const std::uint64_t hi = std::min(global + count, mine.global + mine.count);
      if (lo >= hi) continue;
      std::memcpy(static_cast<char*>(e.values.data) + (mine.local + lo - mine.global) * element,
                  payload.data() + at + (lo - global) * element, (hi - lo) * element);
      covered.emplace_back(lo, hi);
    }
    at += static_cast<std::size_t>(count * element);
  }
}

DTRAIN_DETAIL_INLINE void checkpoint::check_recut() const {
  for (const entry& e : entries_) {
    if (e.kind != detail::ckpt::entry_kind::sharded) continue;
    std::uint64_t needed = 0;
    for (const shard_range& r : e.ranges) needed += r.count;
    // Saved ranges may overlap (every rank held everything): count each element once.
    std::uint64_t got = 0;
    if (auto it = recut_.find(e.name); it != recut_.end()) {
      auto intervals = it->second;
      std::ranges::sort(intervals);
      std::uint64_t reached = 0;
      for (const auto& [lo, hi] : intervals) {
        const std::uint64_t from = std::max(lo, reached);
        if (hi > from) got += hi - from;
        reached = std::max(reached, hi);
      }
    }
    if (got != needed) {
      throw checkpoint_error(
          "checkpoint: sharded entry '" + e.name + "': the checkpoint's ranks held " +
          std::to_string(got) + " of the " + std::to_string(needed) + " elements rank " +
          std::to_string(plane_.rank()) + " holds now (saved with another cut of the same whole?)");
    }
  }
}

DTRAIN_DETAIL_INLINE void checkpoint::agree(std::int64_t ok, const std::string& problem,
                                            const std::string& what) {
  agree_or_throw<checkpoint_error>(
      plane_, what, ok ? std::string() : problem + " (rank " + std::to_string(plane_.rank()) + ")");
}

DTRAIN_DETAIL_INLINE void checkpoint::make_directory(const std::filesystem::path& dir, bool fresh) {
  std::error_code ec;
  if (fresh) {
    if (!std::filesystem::create_directory(dir, ec) && !ec) {
      ec = std::make_error_code(std::errc::file_exists);
    }
  } else {
    std::filesystem::create_directories(dir, ec);
  }
  if (ec) {
    throw checkpoint_error("checkpoint: cannot create directory " + dir.string() + ": " +
                           ec.message());
  }
}

DTRAIN_DETAIL_INLINE void checkpoint::remove_tree(const std::filesystem::path& path) {
  if (const int err = detail::remove_tree(path.c_str()); err != 0) {
    throw checkpoint_error("checkpoint: cannot remove " + path.string() + ": " +
                           std::strerror(err));
  }
}

DTRAIN_DETAIL_INLINE void checkpoint::prune(std::uint64_t newest) {
  if (cleaner_.joinable()) cleaner_.join();
  std::vector<std::uint64_t> kept;
  std::vector<std::filesystem::path> stale;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(options_.dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (auto step = detail::ckpt::step_of(name)) {
      if (*step > newest) {
        stale.push_back(it->path());
      } else {
        kept.push_back(*step);
      }
    } else if (name.ends_with(".replaced") || name.ends_with(".removing")) {
      if (name.starts_with("step-")) stale.push_back(it->path());
    } else if (name.ends_with(detail::ckpt::partial_suffix)) {
      // A save that died; not one in flight (an asynchronous save's next
      // step is being written by the other ranks while this runs).
      const auto of = detail::ckpt::step_of(
          std::string_view(name).substr(0, name.size() - detail::ckpt::partial_suffix.size()));
      if (of && *of <= newest) stale.push_back(it->path());
    }
  }
  std::sort(kept.begin(), kept.end(), std::greater<>());
  for (std::size_t i = static_cast<std::size_t>(options_.keep); i < kept.size(); ++i) {
    stale.push_back(options_.dir / detail::ckpt::step_name(kept[i]));
  }
  std::vector<std::filesystem::path> doomed;
  for (const std::filesystem::path& path : stale) {
    if (path.string().ends_with(".removing")) {
      doomed.push_back(path);
      continue;
    }
    const std::filesystem::path renamed = path.string() + ".removing";
    std::filesystem::rename(path, renamed, ec);
    if (ec) {
      say("could not remove " + path.string() + ": " + ec.message());
    } else {
      doomed.push_back(renamed);
    }
  }
  if (doomed.empty()) return;
  cleaner_ = std::thread([this, doomed = std::move(doomed)] {
    for (const std::filesystem::path& path : doomed) {
      if (const int err = detail::remove_tree(path.c_str()); err != 0) {
        say("could not remove " + path.string() + ": " + std::strerror(err));
      }
    }
  });
}

DTRAIN_DETAIL_INLINE void checkpoint::say(const std::string& line) const {
  if (options_.quiet || !(plane_.rank() == 0)) return;
  std::fprintf(stderr, "dtrain checkpoint: %s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace dtrain
