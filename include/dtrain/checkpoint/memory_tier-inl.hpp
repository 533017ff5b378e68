#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/memory_tier.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/memory_tier.hpp, not this file.

#include <dtrain/checkpoint/memory_tier.hpp>
#include <dtrain/checkpoint/retention.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/rendezvous/options.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <span>
#include <string_view>
#include <utility>

namespace dtrain::detail::ckpt {

DTRAIN_DETAIL_INLINE memory_tier::memory_tier(tier_context& context, std::filesystem::path dir,
                                              std::string buddy)
    : tier(context), dir_(std::move(dir)), buddy_endpoint_(std::move(buddy)) {}

DTRAIN_DETAIL_INLINE const std::vector<int>& memory_tier::node() {
  if (!node_.empty()) return node_;
  // Ranks with the same host name and memory directory are on one node
  // (each agent makes its own directory, its pid in the name).
  const std::int64_t mine = static_cast<std::int64_t>(std::hash<std::string>{}(
      detail::host_name().value_or("") + ":" + dir_.lexically_normal().string()));
  std::vector<std::int64_t> all(static_cast<std::size_t>(context_.plane.size()));
  context_.plane.allgather(std::span<const std::int64_t>(&mine, 1), all);
  for (int r = 0; r < context_.plane.size(); ++r) {
    if (all[static_cast<std::size_t>(r)] == mine) node_.push_back(r);
  }
  return node_;
}

DTRAIN_DETAIL_INLINE bool memory_tier::writes_replicated() {
  return node().front() == context_.plane.rank();
}

DTRAIN_DETAIL_INLINE std::filesystem::path memory_tier::copy_dir(std::uint64_t step,
                                                                 int rank) const {
  return dir_ / (step_name(step) + ".rank-" + std::to_string(rank));
}

DTRAIN_DETAIL_INLINE std::filesystem::path memory_tier::where(std::uint64_t step) const {
  const auto found = replicated_copy_.find(step);  // a restore without per-rank entries
  return found != replicated_copy_.end() ? found->second : copy_dir(step, context_.plane.rank());
}

DTRAIN_DETAIL_INLINE std::filesystem::path memory_tier::staging(std::uint64_t step) const {
  return copy_dir(step, context_.plane.rank()).string() + std::string(partial_suffix);
}

DTRAIN_DETAIL_INLINE std::string memory_tier::resumed(std::uint64_t step) const {
  return "resumed from the memory copy of step " + std::to_string(step) + " in " + dir_.string() +
         " (nothing read from " + context_.options.dir.string() + ")";
}

DTRAIN_DETAIL_INLINE void memory_tier::seal(pending_save& p) {
  try {
    if (!p.problem.empty()) throw checkpoint_error(p.problem);
    manifest m{p.step, context_.plane.size(), {}};
    if (p.replicated_file) m.files.push_back(*p.replicated_file);
    if (p.per_rank_file) m.files.push_back(*p.per_rank_file);
    const std::string text = render(m);
    atomic_file written(p.partial / manifest_name);
    written.write(text.data(), text.size());
    static_cast<void>(written.finish());
    const std::filesystem::path done = copy_dir(p.step, context_.plane.rank());
    remove_checkpoint_tree(done);  // an older run's copy of this step
    rename_path(p.partial, done);
    // This rank's copies beyond the 2 newest (and any numbered after this
    // one: an older run's), and its saves that died.
    const std::string suffix = ".rank-" + std::to_string(context_.plane.rank());
    for (const std::filesystem::path& stale : stale_steps(dir_, p.step, 2, suffix))
      remove_checkpoint_tree(stale);
  } catch (const std::exception& e) {
    p.problem = e.what();
    static_cast<void>(detail::remove_tree(p.partial.c_str()));
    return;
  }
  // Replicated state needs no buddy: any node's copy serves (share()).
  if (p.per_rank_file) send_to_buddy(p.step, copy_dir(p.step, context_.plane.rank()));
}

DTRAIN_DETAIL_INLINE store_client& memory_tier::buddy() {
  if (!buddy_) {
    const detail::host_port at = detail::split_host_port(
        "checkpoint_options::memory_buddy=" + buddy_endpoint_, buddy_endpoint_);
    if (!at.port) {
      throw config_error("checkpoint_options::memory_buddy=" + buddy_endpoint_ +
                         " has no port (HOST:PORT)");
    }
    // The job's token (DTRAIN_STORE_TOKEN); short waits: a buddy that is
    // gone must not hold a save, or a restore, for the store's timeout.
    store_options options = store_options{}.with_env(environment::from_process());
    options.timeout = std::chrono::seconds(5);
    options.io_timeout = std::chrono::seconds(5);
    options.progress_interval = std::chrono::milliseconds(0);
    buddy_.emplace(at.host, *at.port, std::move(options));
  }
  return *buddy_;
}

DTRAIN_DETAIL_INLINE std::string memory_tier::held_prefix(std::uint64_t step) const {
  return "dtrain/memory/rank-" + std::to_string(context_.plane.rank()) + "/" + step_name(step) +
         "/";
}

DTRAIN_DETAIL_INLINE std::string memory_tier::held_newest() const {
  return "dtrain/memory/rank-" + std::to_string(context_.plane.rank()) + "/newest";
}

namespace memory_detail {
/// The buddy's pieces of a file: at most 4 MiB each (a store value may be 64).
inline constexpr std::uint64_t piece_bytes = std::uint64_t{4} << 20;
inline std::string piece_key(const std::string& prefix, const std::string& file,
                             std::uint64_t piece) {
  return prefix + file + "/" + std::to_string(piece);
}
inline std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) throw checkpoint_error("checkpoint: cannot read " + file.string());
  return text;
}
}  // namespace memory_detail

DTRAIN_DETAIL_INLINE void memory_tier::send_to_buddy(std::uint64_t step,
                                                     const std::filesystem::path& copy) {
  if (buddy_endpoint_.empty() || buddy_lost_) return;
  using memory_detail::piece_bytes;
  try {
    store_client& store = buddy();
    if (!held_) {  // what an earlier worker of this rank left there, dropped below
      const std::string newest = held_newest();
      if (store.check(std::span(&newest, 1))) held_ = std::stoull(store.get(newest));
    }
    const std::string text = memory_detail::read_text(copy / manifest_name);
    const manifest m = parse_manifest(text, copy / manifest_name);
    const std::string prefix = held_prefix(step);
    std::string piece;
    for (const file_record& f : m.files) {
      std::ifstream in(copy / f.name, std::ios::binary);
      for (std::uint64_t at = 0, i = 0; at < f.bytes; ++i) {
        piece.resize(static_cast<std::size_t>(std::min(piece_bytes, f.bytes - at)));
        if (!in.read(piece.data(), static_cast<std::streamsize>(piece.size())))
          throw checkpoint_error("checkpoint: cannot read " + (copy / f.name).string());
        store.set(memory_detail::piece_key(prefix, f.name, i), piece);
        at += piece.size();
      }
    }
    // The manifest last: a copy is whole at the buddy once the newest names it.
    store.set(prefix + std::string(manifest_name), text);
    store.set(held_newest(), std::to_string(step));
    const std::optional<std::uint64_t> before = std::exchange(held_, step);
    if (before && *before != step) {
      const std::string old = held_prefix(*before);
      const std::string key = old + std::string(manifest_name);
      if (store.check(std::span(&key, 1))) {
        const manifest gone = parse_manifest(store.get(key), key);
        store.erase(key);
        for (const file_record& f : gone.files) {
          for (std::uint64_t i = 0; i * piece_bytes < f.bytes; ++i)
            store.erase(memory_detail::piece_key(old, f.name, i));
        }
      }
    }
  } catch (const std::exception& e) {
    buddy_lost_ = true;
    buddy_.reset();
    tell("its memory copy of step " + std::to_string(step) + " was not sent to its buddy (" +
         buddy_endpoint_ + ", another node's agent): " + e.what() +
         "; from now on this rank's copies are on its own node only (said once)");
  }
}

DTRAIN_DETAIL_INLINE std::int64_t memory_tier::take_from_buddy() {
  if (buddy_endpoint_.empty()) return -1;
  const int rank = context_.plane.rank();
  std::optional<std::uint64_t> step;
  std::filesystem::path partial;
  try {
    store_client& store = buddy();
    const std::string newest = held_newest();
    if (!store.check(std::span(&newest, 1))) return -1;  // it holds none of this rank
    step = std::stoull(store.get(newest));
    held_ = step;
    // A copy on this node at least as new: nothing to take (a worker restarted on its node).
    const auto own = committed_steps(dir_, ".rank-" + std::to_string(rank));
    if (!own.empty() && own.front().first >= *step) return -1;
    const std::string prefix = held_prefix(*step);
    const std::string text = store.get(prefix + std::string(manifest_name));
    const manifest m = parse_manifest(text, prefix + std::string(manifest_name));
    if (m.step != *step || m.world_size != context_.plane.size()) {
      throw checkpoint_error("it holds step " + std::to_string(m.step) + " of " +
                             std::to_string(m.world_size) + " ranks, and this job has " +
                             std::to_string(context_.plane.size()));
    }
    partial = staging(*step);
    make_directory(partial, false);
    for (const file_record& f : m.files) {
      atomic_file out(partial / f.name);
      for (std::uint64_t at = 0, i = 0; at < f.bytes; ++i) {
        const std::string piece = store.get(memory_detail::piece_key(prefix, f.name, i));
        out.write(piece.data(), piece.size());
        at += std::max<std::uint64_t>(piece.size(), 1);
      }
      const file_record got = out.finish();
      if (got.bytes != f.bytes || got.checksum != f.checksum) {
        throw checkpoint_error(f.name + " arrived damaged (" + std::to_string(got.bytes) + " of " +
                               std::to_string(f.bytes) + " bytes, checksum " +
                               (got.checksum == f.checksum ? "the same)" : "differs)"));
      }
    }
    atomic_file written(partial / manifest_name);
    written.write(text.data(), text.size());
    static_cast<void>(written.finish());
    const std::filesystem::path copy = copy_dir(*step, rank);
    remove_checkpoint_tree(copy);
    rename_path(partial, copy);
    return static_cast<std::int64_t>(*step);
  } catch (const std::exception& e) {
    if (!partial.empty()) static_cast<void>(detail::remove_tree(partial.c_str()));
    buddy_.reset();
    tell("memory copy: rank " + std::to_string(rank) + "'s copy" +
         (step ? " of step " + std::to_string(*step) : std::string()) + " at its buddy (" +
         buddy_endpoint_ + ", another node's agent): " + e.what() + "; not used");
    return -1;
  }
}

DTRAIN_DETAIL_INLINE void memory_tier::finish(std::unique_ptr<pending_save> p, bool next_save) {
  static_cast<void>(next_save);
  static_cast<void>(join_writer(*p));
  if (p->problem.empty()) return;
  if (++failures_ == 1 && !context_.options.quiet) {
    std::fprintf(stderr,
                 "dtrain checkpoint on rank %d: its memory copy of step %llu was not written "
                 "(%s); its older copies and the disk stay. Said once; "
                 "checkpoint::memory_failures() counts them all\n",
                 context_.plane.rank(), static_cast<unsigned long long>(p->step),
                 p->problem.c_str());
    std::fflush(stderr);
  }
}

DTRAIN_DETAIL_INLINE std::array<std::int64_t, 2> memory_tier::usable() {
  std::array<std::int64_t, 2> out{-1, -1};
  const int rank = context_.plane.rank();
  const int leader = node().front();
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> copies;
  try {
    copies = committed_steps(dir_, ".rank-" + std::to_string(rank));
  } catch (const std::exception&) {
    // No copies here that can be read: as none (the disk's, as ever).
  }
  std::size_t found = 0;
  for (const auto& [step, path] : copies) {
    if (found == out.size()) break;
    try {
      const manifest m = verify_step(path);
      if (m.step != step || m.world_size != context_.plane.size()) {
        throw checkpoint_error("checkpoint: " + path.string() + " holds step " +
                               std::to_string(m.step) + " of " + std::to_string(m.world_size) +
                               " ranks, and this job has " + std::to_string(context_.plane.size()));
      }
      if (leader != rank) {  // the replicated part, from the node's first rank
        const manifest l = verify_step(copy_dir(step, leader));
        if (l.step != step || !l.find(replicated_name)) {
          throw checkpoint_error("checkpoint: " + copy_dir(step, leader).string() +
                                 " holds no replicated part of step " + std::to_string(step));
        }
      }
      out[found++] = static_cast<std::int64_t>(step);
    } catch (const std::exception& e) {
      tell(std::string("memory copy: ") + e.what() + "; not used");
    }
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::array<std::int64_t, 2> memory_tier::usable_replicated() {
  std::array<std::int64_t, 2> out{-1, -1};
  replicated_copy_.clear();
  // Every copy in the directory by step, of any rank: of this job, or of a
  // round of another size that ran on this node before.
  std::map<std::uint64_t, std::vector<std::filesystem::path>, std::greater<>> copies;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::size_t at = name.find(".rank-");
    if (at == std::string::npos) continue;
    const std::string_view rank = std::string_view(name).substr(at + 6);
    if (rank.empty() || !std::ranges::all_of(rank, [](char c) { return c >= '0' && c <= '9'; }))
      continue;  // a save that died (.partial), or not a copy
    if (auto step = step_of(std::string_view(name).substr(0, at)))
      copies[*step].push_back(it->path());
  }
  std::size_t found = 0;
  for (auto& [step, paths] : copies) {
    if (found == out.size()) break;
    std::sort(paths.begin(), paths.end());
    std::string why;
    for (const std::filesystem::path& path : paths) {
      try {
        const manifest m = verify_step(path);
        if (m.step == step && m.find(replicated_name)) {
          replicated_copy_[step] = path;
          break;
        }
      } catch (const std::exception& e) {
        if (why.empty()) why = e.what();
      }
    }
    if (replicated_copy_.contains(step)) {
      out[found++] = static_cast<std::int64_t>(step);
    } else {
      tell("memory copy: " +
           (why.empty() ? "no copy of step " + std::to_string(step) + " in " + dir_.string() +
                              " holds its replicated part"
                        : why) +
           "; not used");
    }
  }
  return out;
}

DTRAIN_DETAIL_INLINE void memory_tier::tell(const std::string& line) const {
  if (context_.options.quiet) return;
  std::fprintf(stderr, "dtrain checkpoint on rank %d: %s\n", context_.plane.rank(), line.c_str());
  std::fflush(stderr);
}

DTRAIN_DETAIL_INLINE std::optional<std::uint64_t> memory_tier::newest(std::int64_t floor,
                                                                      const registry& entries) {
  const bool own = entries.has_scope(checkpoint_scope::per_rank);
  const int size = context_.plane.size();
  if (own) {
    // Ranks whose node lost their copies (it replaces a lost one) take them
    // from their buddies, before any rank looks at its node's (a node's
    // first rank's copy holds the replicated part the others read).
    const std::int64_t took = take_from_buddy();
    std::vector<std::int64_t> taken(static_cast<std::size_t>(size));
    context_.plane.allgather(std::span<const std::int64_t>(&took, 1), taken);
    std::vector<int> takers;
    for (int r = 0; r < size; ++r) {
      if (taken[static_cast<std::size_t>(r)] >= 0) takers.push_back(r);
    }
    if (!takers.empty()) {
      context_.say("memory tier: rank(s) " + list(takers) +
                   " had no copy of their newest step on their node (it is new, or came "
                   "back): each took its own (step " +
                   std::to_string(taken[static_cast<std::size_t>(takers.front())]) +
                   ") from its buddy, another node's agent");
    }
  }
  const std::array<std::int64_t, 2> mine = own ? usable() : usable_replicated();
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size));
  context_.plane.allgather(mine, all);
  if (std::ranges::none_of(all, [](std::int64_t v) { return v >= 0; })) {
    // A job's first start, or every node's copies gone (the whole job
    // restarted, or every node that held one lost): the disk's, as ever.
    context_.say(
        "memory tier: no rank has a memory copy (a new job, or every node that held "
        "one is gone): using " +
        context_.options.dir.string());
    return std::nullopt;
  }
  auto without = [&](std::int64_t step) {
    std::vector<int> ranks;
    for (int r = 0; r < size; ++r) {
      const auto at = 2 * static_cast<std::size_t>(r);
      if (all[at] != step && all[at + 1] != step) ranks.push_back(r);
    }
    return ranks;
  };
  // With per-rank entries, the newest step that every rank holds whole (a
  // rank killed in its save has the one before, which the others keep).
  // Without, the newest that any rank holds: the ranks without it (their node
  // is new, or came back) get its replicated part from one that has it.
  std::vector<std::int64_t> candidates(all.begin(), all.end());
  std::ranges::sort(candidates, std::greater<>());
  std::int64_t best = -1;
  std::string missing;
  for (const std::int64_t candidate : candidates) {
    if (candidate < 0) break;
    const std::vector<int> lacking = without(candidate);
    if (lacking.empty() || !own) {
      best = candidate;
      break;
    }
    if (missing.empty())
      missing = "step " + std::to_string(candidate) + " is not whole on rank(s) " + list(lacking);
  }
  const std::string fallback = "using " + context_.options.dir.string() + " instead";
  if (best < 0) {
    context_.say("memory tier: no step is whole in every rank's memory copies (" + missing +
                 "): " + fallback);
    return std::nullopt;
  }
  if (best < floor) {
    context_.say("memory tier: the memory copies (step " + std::to_string(best) +
                 ") are older than the disk checkpoint (step " + std::to_string(floor) +
                 "): " + fallback);
    return std::nullopt;
  }
  if (const std::vector<int> lacking = without(best); !lacking.empty()) {
    int root = 0;
    while (std::ranges::find(lacking, root) != lacking.end()) ++root;
    if (!share(static_cast<std::uint64_t>(best), root, lacking)) return std::nullopt;
  }
  return static_cast<std::uint64_t>(best);
}

DTRAIN_DETAIL_INLINE bool memory_tier::share(std::uint64_t step, int root,
                                             const std::vector<int>& lacking) {
  const int rank = context_.plane.rank();
  const bool receiving = std::ranges::find(lacking, rank) != lacking.end();
  const std::string fallback = "using " + context_.options.dir.string() + " instead";
  // The root's replicated part: its size, checksum and the world size of the job that wrote it.
  std::array<std::int64_t, 3> head{-1, 0, 0};
  std::ifstream in;
  std::string problem;
  if (rank == root) {
    try {
      const std::filesystem::path copy = replicated_copy_.at(step);
      const manifest m = read_manifest(copy);
      const file_record* r = m.find(replicated_name);
      if (!r) throw checkpoint_error("checkpoint: " + copy.string() + " lists no replicated part");
      in.open(copy / replicated_name, std::ios::binary);
      if (!in)
        throw checkpoint_error("checkpoint: cannot open " + (copy / replicated_name).string());
      head = {static_cast<std::int64_t>(r->bytes), std::bit_cast<std::int64_t>(r->checksum),
              m.world_size};
    } catch (const std::exception& e) {
      problem = e.what();
      tell("memory copy: cannot send step " + std::to_string(step) + ": " + problem);
    }
  }
  std::array<std::uint8_t, sizeof head> wire{};
  std::memcpy(wire.data(), head.data(), sizeof head);
  context_.plane.broadcast(wire, root);
  std::memcpy(head.data(), wire.data(), sizeof head);
  if (head[0] < 0) {
    context_.say("memory tier: rank " + std::to_string(root) + " could not send its copy of step " +
                 std::to_string(step) + " to rank(s) " + list(lacking) +
                 " (its error says why): " + fallback);
    return false;
  }
  // In pieces of at most 4 MiB: what the control plane holds at a time
  // (through the store, for NCCL's jobs) stays bounded.
  const auto bytes = static_cast<std::uint64_t>(head[0]);
  const std::filesystem::path partial = staging(step);
  std::optional<atomic_file> out;
  if (receiving) {
    try {
      make_directory(partial, false);
      out.emplace(partial / replicated_name);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  std::vector<std::uint8_t> piece(
      static_cast<std::size_t>(std::min<std::uint64_t>(bytes, 4u << 20)));
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(piece.size(), bytes - at));
    if (rank == root &&
        !in.read(reinterpret_cast<char*>(piece.data()), static_cast<std::streamsize>(n)))
      std::fill_n(piece.begin(), n, std::uint8_t{0});  // its checksum fails where it arrives
    context_.plane.broadcast(std::span<std::uint8_t>(piece.data(), n), root);
    if (out && problem.empty()) {
      try {
        out->write(piece.data(), n);
      } catch (const std::exception& e) {
        problem = e.what();
      }
    }
    at += n;
  }
  if (receiving && problem.empty()) {
    try {
      file_record got = out->finish();
      if (got.bytes != bytes || got.checksum != std::bit_cast<std::uint64_t>(head[1])) {
        throw checkpoint_error("checkpoint: the replicated part of step " + std::to_string(step) +
                               " from rank " + std::to_string(root) + " arrived damaged (" +
                               std::to_string(got.bytes) + " bytes, checksum differs)");
      }
      got.name = std::string(replicated_name);
      const std::string text = render(manifest{step, static_cast<int>(head[2]), {got}});
      atomic_file written(partial / manifest_name);
      written.write(text.data(), text.size());
      static_cast<void>(written.finish());
      const std::filesystem::path copy = copy_dir(step, rank);
      remove_checkpoint_tree(copy);
      rename_path(partial, copy);
      replicated_copy_[step] = copy;
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  out.reset();
  if (receiving && !problem.empty()) {
    static_cast<void>(detail::remove_tree(partial.c_str()));
    tell("memory copy: could not take step " + std::to_string(step) + " from rank " +
         std::to_string(root) + ": " + problem + "; not used");
  }
  const std::int64_t ok = problem.empty() ? 1 : 0;
  std::vector<std::int64_t> oks(static_cast<std::size_t>(context_.plane.size()));
  context_.plane.allgather(std::span<const std::int64_t>(&ok, 1), oks);
  if (std::ranges::find(oks, 0) != oks.end()) {
    context_.say("memory tier: rank(s) " + list(lacking) + " could not take step " +
                 std::to_string(step) + " from rank " + std::to_string(root) +
                 " (each said why): " + fallback);
    return false;
  }
  context_.say("memory tier: rank(s) " + list(lacking) + " had no copy of step " +
               std::to_string(step) + " (their node is new, or came back): rank " +
               std::to_string(root) + " sent them its replicated part (" + std::to_string(bytes) +
               " bytes)");
  return true;
}

DTRAIN_DETAIL_INLINE std::string memory_tier::list(const std::vector<int>& ranks) {
  std::string out;
  for (const int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

DTRAIN_DETAIL_INLINE std::vector<std::filesystem::path> memory_tier::files(
    std::uint64_t step, const registry& entries) {
  if (!entries.has_scope(checkpoint_scope::per_rank)) {
    const auto found = replicated_copy_.find(step);
    if (found == replicated_copy_.end()) {
      throw checkpoint_error("checkpoint: no copy of step " + std::to_string(step) + " in " +
                             dir_.string() + " holds its replicated part");
    }
    const std::filesystem::path copy = found->second;
    return entries.check(
        read_manifest(copy), [&](const std::string& name) { return copy / name; }, copy,
        context_.plane.size());
  }
  const std::filesystem::path mine = copy_dir(step, context_.plane.rank());
  const std::filesystem::path leader = copy_dir(step, node().front());
  // This rank's manifest, and the replicated part from its node's first rank's.
  manifest m = read_manifest(mine);
  const manifest theirs = read_manifest(leader);
  const std::string replicated(replicated_name);
  if (const auto* r = theirs.find(replicated); r && !m.find(replicated)) m.files.push_back(*r);
  return entries.check(
      m, [&](const std::string& name) { return (name == replicated ? leader : mine) / name; }, mine,
      context_.plane.size());
}

}  // namespace dtrain::detail::ckpt
