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
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string_view>
#include <utility>

#include <unistd.h>

namespace dtrain::detail::ckpt {

DTRAIN_DETAIL_INLINE memory_tier::memory_tier(tier_context& context, std::filesystem::path dir,
                                              std::string buddy, std::string held,
                                              std::int64_t round)
    : tier(context),
      dir_(std::move(dir)),
      buddy_endpoint_(std::move(buddy)),
      held_endpoint_(std::move(held)),
      round_(round) {}

DTRAIN_DETAIL_INLINE const std::vector<int>& memory_tier::node() {
  if (!node_.empty()) return node_;
  // Ranks with the same host name and memory directory are on one node
  // (each agent makes its own directory, its pid in the name).
  const std::int64_t mine = static_cast<std::int64_t>(std::hash<std::string>{}(
      detail::host_name().value_or("") + ":" + dir_.lexically_normal().string()));
  // And a number of this worker's: the node's first rank's names the node's
  // slices (replicated_part()), so that slices of two sets of workers (two
  // rounds of a job) are never joined.
  std::uint64_t nonce =
      static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
      (static_cast<std::uint64_t>(::getpid()) << 32);
  try {
    std::random_device device;
    nonce ^= (std::uint64_t{device()} << 32) ^ device();
  } catch (const std::exception&) {
    // No device: the time and the pid.
  }
  const std::array<std::int64_t, 2> both{mine, std::bit_cast<std::int64_t>(nonce)};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(context_.plane.size()));
  context_.plane.allgather(both, all);
  for (int r = 0; r < context_.plane.size(); ++r) {
    if (all[2 * static_cast<std::size_t>(r)] == mine) node_.push_back(r);
  }
  slice_id_ =
      hex64(std::bit_cast<std::uint64_t>(all[2 * static_cast<std::size_t>(node_.front()) + 1]));
  return node_;
}

DTRAIN_DETAIL_INLINE replicated_share memory_tier::replicated_part() {
  const std::vector<int>& ranks = node();
  const int count = static_cast<int>(ranks.size());
  if (count == 1) return {true, {}, std::string(replicated_name)};
  const int index =
      static_cast<int>(std::ranges::find(ranks, context_.plane.rank()) - ranks.begin());
  return {true,
          {index, count},
          "replicated." + std::to_string(index) + "-of-" + std::to_string(count) + "." + slice_id_ +
              ".dtck"};
}

DTRAIN_DETAIL_INLINE std::optional<memory_tier::slice_name> memory_tier::parse_slice(
    std::string_view name) {
  constexpr std::string_view head = "replicated.", tail = ".dtck";
  if (!name.starts_with(head) || !name.ends_with(tail)) return std::nullopt;
  name = name.substr(head.size(), name.size() - head.size() - tail.size());
  const std::size_t dot = name.find('.');
  const std::size_t of = name.find("-of-");
  if (dot == std::string_view::npos || of == std::string_view::npos || of > dot)
    return std::nullopt;
  auto number = [](std::string_view digits) -> std::optional<int> {
    int v = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
    if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size())
      return std::nullopt;
    return v;
  };
  const auto index = number(name.substr(0, of));
  const auto count = number(name.substr(of + 4, dot - of - 4));
  const std::string_view id = name.substr(dot + 1);
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  if (!index || !count || *count < 2 || *index < 0 || *index >= *count || id.size() != 16 ||
      !std::ranges::all_of(id, hex))
    return std::nullopt;
  return slice_name{*index, *count, std::string(id)};
}

DTRAIN_DETAIL_INLINE std::filesystem::path memory_tier::copy_dir(std::uint64_t step,
                                                                 int rank) const {
  return dir_ / (step_name(step) + ".rank-" + std::to_string(rank));
}

DTRAIN_DETAIL_INLINE std::filesystem::path memory_tier::where(std::uint64_t step) const {
  if (!recut_dir_.empty()) return recut_dir_;      // gathered for a re-cut
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

DTRAIN_DETAIL_INLINE std::filesystem::path memory_tier::spare_dir() const {
  return dir_ / ("spare.rank-" + std::to_string(context_.plane.rank()));
}

DTRAIN_DETAIL_INLINE bool memory_tier::open_staging(pending_save& p) {
  const std::filesystem::path spare = spare_dir();
  std::error_code ec;
  if (own_ ? !spare_ : !std::filesystem::is_directory(spare, ec)) {
    make_directory(p.partial, false);
    return true;  // nothing to write over yet: each file is new
  }
  spare_ = false;  // taken: this save's copy
  // The copy seal() set aside is this one's: its files are written over
  // where they are (it is never read as a copy), and it is committed by its
  // rename. Its manifest is written anew at the commit; a part of it not
  // written now (the whole replicated part of a copy a restore took, a
  // slice of an earlier worker's, of another name) goes. A copy holds no
  // other files (commit_copy()). A copy this worker wrote since it listed
  // the directory holds the files this save writes, and no others: it is
  // not listed (a copy may be taken at every step).
  p.partial = spare;
  if (own_ && spare_known_) return true;
  const std::string mine = rank_part_name(context_.plane.rank());
  for (std::filesystem::directory_iterator it(spare, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool written = name == manifest_name || (name == mine && !p.per_rank.records.empty()) ||
                         (name == p.replicated_part.file && p.replicated_part.writes);
    if (!written && ::unlink(it->path().c_str()) != 0 && errno != ENOENT) {
      fail_os("cannot remove", it->path(), errno);
    }
  }
  if (ec) {
    throw checkpoint_error("checkpoint: cannot read directory " + spare.string() + ": " +
                           ec.message());
  }
  return true;
}

DTRAIN_DETAIL_INLINE void memory_tier::set_aside(std::uint64_t step) {
  const std::filesystem::path spare = spare_dir();
  if (own_) {
    // As the saves of this worker left them: no listing.
    own_->insert(own_->begin(), step);
    if (own_->size() <= 2) return;
    const std::uint64_t oldest_step = own_->back();
    const std::filesystem::path oldest = copy_dir(oldest_step, context_.plane.rank());
    own_->pop_back();
    if (spare_) {
      remove_checkpoint_tree(oldest);
    } else {
      rename_path(oldest, spare);
      spare_ = true;
      spare_known_ = oldest_step >= listed_at_;  // written by this worker since the listing
    }
    return;
  }
  // The first save (or the first since a restore): the directory is listed.
  // This rank's copies beyond the 2 newest (and any numbered after this
  // one: an older run's), and its saves that died. One copy is set aside,
  // renamed, for the next save to write over (open_staging()).
  const std::string suffix = ".rank-" + std::to_string(context_.plane.rank());
  std::error_code ec;
  spare_ = std::filesystem::exists(spare, ec);
  spare_known_ = false;  // an earlier worker's, or a copy not written by this one
  listed_at_ = step;
  for (const std::filesystem::path& stale : stale_steps(dir_, step, 2, suffix)) {
    if (!spare_ && stale.filename().string().ends_with(suffix)) {
      rename_path(stale, spare);
      spare_ = true;
    } else {
      remove_checkpoint_tree(stale);
    }
  }
  own_.emplace();
  for (const auto& kept : committed_steps(dir_, suffix)) own_->push_back(kept.first);
}

DTRAIN_DETAIL_INLINE void memory_tier::seal(pending_save& p) {
  try {
    if (!p.problem.empty()) throw checkpoint_error(p.problem);
    manifest m{p.step, context_.plane.size(), {}};
    if (p.replicated_file) m.files.push_back(*p.replicated_file);
    if (p.per_rank_file) m.files.push_back(*p.per_rank_file);
    commit_copy(p.partial, render(m), copy_dir(p.step, context_.plane.rank()));
    context_.committed(true, p.step);
    set_aside(p.step);
    if (!recut_dir_.empty()) {  // loaded at the restore: the copies are newer now
      remove_checkpoint_tree(recut_dir_);
      recut_dir_.clear();
    }
    for (const std::filesystem::path& joined : joined_)  // (as recut_dir_)
      static_cast<void>(detail::remove_tree(joined.c_str()));
    joined_.clear();
  } catch (const std::exception& e) {
    p.problem = e.what();
    static_cast<void>(detail::remove_tree(p.partial.c_str()));
    own_.reset();  // the directory is looked at again at the next save
    return;
  }
  // Replicated state needs no buddy: any node's copy serves (share()).
  if (p.per_rank_file) send_to_buddy(p.step, copy_dir(p.step, context_.plane.rank()));
}

DTRAIN_DETAIL_INLINE store_client& memory_tier::open(std::optional<store_client>& client,
                                                     const std::string& endpoint,
                                                     std::string_view option) {
  if (!client) {
    const std::string what = "checkpoint_options::" + std::string(option) + "=" + endpoint;
    const detail::host_port at = detail::split_host_port(what, endpoint);
    if (!at.port) throw config_error(what + " has no port (HOST:PORT)");
    // The job's token (DTRAIN_STORE_TOKEN); short waits: an agent that is
    // gone must not hold a save, or a restore, for the store's timeout.
    store_options options = store_options{}.with_env(environment::from_process());
    options.timeout = std::chrono::seconds(5);
    options.io_timeout = std::chrono::seconds(5);
    options.progress_interval = std::chrono::milliseconds(0);
    client.emplace(at.host, *at.port, std::move(options));
  }
  return *client;
}

DTRAIN_DETAIL_INLINE std::string memory_tier::held_prefix(int rank, const held_copy& copy) {
  return "dtrain/memory/rank-" + std::to_string(rank) + "/round-" + std::to_string(copy.round) +
         "/" + step_name(copy.step) + "/";
}

DTRAIN_DETAIL_INLINE std::string memory_tier::held_list(int rank) {
  return "dtrain/memory/rank-" + std::to_string(rank) + "/steps";
}

namespace memory_detail {
/// The buddy's pieces of a file: at most 4 MiB each (a store value may be 64).
inline constexpr std::uint64_t piece_bytes = std::uint64_t{4} << 20;
inline std::string piece_key(const std::string& prefix, const std::string& file,
                             std::uint64_t piece) {
  return prefix + file + "/" + std::to_string(piece);
}
/// The step and the rank of a copy's directory, "step-<N>.rank-<R>"; else
/// nullopt (a save that died, a copy set aside, a join, not a copy).
inline std::optional<std::pair<std::uint64_t, int>> copy_name(std::string_view name) {
  const std::size_t at = name.find(".rank-");
  if (at == std::string_view::npos) return std::nullopt;
  const std::string_view of = name.substr(at + 6);
  int rank = 0;
  const auto [end, ec] = std::from_chars(of.data(), of.data() + of.size(), rank);
  const auto step = step_of(name.substr(0, at));
  if (!step || of.empty() || ec != std::errc() || end != of.data() + of.size() || rank < 0)
    return std::nullopt;
  return std::pair{*step, rank};
}
/// The step of a join's directory, "step-<N>.node" (join_slices()).
inline std::optional<std::uint64_t> joined_name(std::string_view name) {
  if (!name.ends_with(".node")) return std::nullopt;
  return step_of(name.substr(0, name.size() - 5));
}
inline std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) throw checkpoint_error("checkpoint: cannot read " + file.string());
  return text;
}
}  // namespace memory_detail

DTRAIN_DETAIL_INLINE memory_tier::held_value memory_tier::held_steps(store_client& store,
                                                                     int rank) {
  const std::string key = held_list(rank);
  held_value out;
  if (!store.check(std::span(&key, 1))) return out;
  out.text = store.get(key);
  // "round <K>: <step>@<round> <step>@<round>"
  auto number = [&](std::string_view digits) -> std::uint64_t {
    std::uint64_t v = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
    if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() ||
        v > std::uint64_t{1} << 62) {
      throw checkpoint_error("checkpoint: the store's " + key + " is \"" + out.text +
                             "\", not \"round <K>: <step>@<round> <step>@<round>\"");
    }
    return v;
  };
  const std::string_view text = out.text;
  const std::size_t colon = text.find(':');
  if (!text.starts_with("round ") || colon == std::string_view::npos) number("");
  out.round = static_cast<std::int64_t>(number(text.substr(6, colon - 6)));
  for (const std::string& copy : detail::split(text.substr(colon + 1), ' ')) {
    if (copy.empty()) continue;
    const std::size_t at = copy.find('@');
    if (at == std::string::npos) number("");
    out.copies.push_back(
        {number(std::string_view(copy).substr(0, at)),
         static_cast<std::int64_t>(number(std::string_view(copy).substr(at + 1)))});
  }
  return out;
}

DTRAIN_DETAIL_INLINE bool memory_tier::name_held(store_client& store, held_value& seen,
                                                 std::optional<std::uint64_t> step,
                                                 std::vector<held_copy>& dropped) {
  const std::string key = held_list(context_.plane.rank());
  for (;;) {
    if (seen.round > round_) return false;
    std::vector<held_copy> kept;
    if (step) kept.push_back({*step, round_});
    for (const held_copy& held : seen.copies) {
      if ((!step || held.step < *step) && kept.size() < 2) kept.push_back(held);
    }
    std::string desired = "round " + std::to_string(round_) + ":";
    for (const held_copy& held : kept) {
      desired.append(" ").append(std::to_string(held.step));
      desired.append("@").append(std::to_string(held.round));
    }
    const std::string now = store.compare_set(key, seen.text, desired);
    if (now == desired) {
      dropped.clear();
      for (const held_copy& held : seen.copies) {
        if (std::ranges::find(kept, held) == kept.end()) dropped.push_back(held);
      }
      seen = {round_, std::move(kept), std::move(desired)};
      return true;
    }
    seen = held_steps(store, context_.plane.rank());  // written meanwhile: again, from that
  }
}

DTRAIN_DETAIL_INLINE void memory_tier::superseded(std::int64_t later) {
  buddy_lost_ = true;
  buddy_.reset();
  tell("its memory copies at its buddy (" + buddy_endpoint_ +
       ", another node's agent) are a later worker's, of round " + std::to_string(later) +
       ", and this worker is of round " + std::to_string(round_) +
       " (its host did not respond, and its node was replaced; or it outlived its round): it "
       "sends no more copies there, and leaves them be (said once)");
}

DTRAIN_DETAIL_INLINE void memory_tier::send_to_buddy(std::uint64_t step,
                                                     const std::filesystem::path& copy) {
  if (buddy_endpoint_.empty() || buddy_lost_) return;
  using memory_detail::piece_bytes;
  const int rank = context_.plane.rank();
  try {
    store_client& store = open(buddy_, buddy_endpoint_, "memory_buddy");
    // What an earlier worker of this rank left there, dropped below.
    if (!buddy_held_) buddy_held_ = held_steps(store, rank);
    if (buddy_held_->round > round_) return superseded(buddy_held_->round);
    const std::string text = memory_detail::read_text(copy / manifest_name);
    const manifest m = parse_manifest(text, copy / manifest_name);
    const std::string prefix = held_prefix(rank, {step, round_});
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
    // The manifest last: a copy is whole at the buddy once the list names
    // it. The 2 newest are kept, as on the node: a rank killed in its copy
    // leaves the step before, which the others still hold.
    store.set(prefix + std::string(manifest_name), text);
    // Not named: a later worker holds the list, and what this one sent is
    // no one's (its keys are its own: held_prefix has its round).
    std::vector<held_copy> dropped;
    const bool named = name_held(store, *buddy_held_, step, dropped);
    if (!named) dropped = {{step, round_}};
    for (const held_copy& gone : dropped) {
      const std::string old = held_prefix(rank, gone);
      const std::string key = old + std::string(manifest_name);
      if (!store.check(std::span(&key, 1))) continue;
      const manifest dropped_copy = parse_manifest(store.get(key), key);
      store.erase(key);
      for (const file_record& f : dropped_copy.files) {
        for (std::uint64_t i = 0; i * piece_bytes < f.bytes; ++i)
          store.erase(memory_detail::piece_key(old, f.name, i));
      }
    }
    if (!named) superseded(buddy_held_->round);  // closes `store`: last
  } catch (const std::exception& e) {
    buddy_lost_ = true;
    buddy_.reset();
    tell("its memory copy of step " + std::to_string(step) + " was not sent to its buddy (" +
         buddy_endpoint_ + ", another node's agent): " + e.what() +
         "; from now on this rank's copies are on its own node only (said once)");
  }
}

DTRAIN_DETAIL_INLINE std::int64_t memory_tier::take_from_buddy(std::int64_t floor) {
  if (buddy_endpoint_.empty()) return -1;
  const int rank = context_.plane.rank();
  std::int64_t taken = -1;
  std::optional<std::uint64_t> step;
  std::filesystem::path partial;
  try {
    store_client& store = open(buddy_, buddy_endpoint_, "memory_buddy");
    buddy_held_ = held_steps(store, rank);
    // The list is this worker's round's from now on: a worker of an earlier
    // round that wakes cannot name its copies there any more.
    std::vector<held_copy> unchanged;
    if (!name_held(store, *buddy_held_, std::nullopt, unchanged)) {
      superseded(buddy_held_->round);
      return -1;
    }
    // Only copies newer than this node's newest (none for a new node; a
    // worker restarted on its node has its own) and than the disk's (a
    // node back after a round without it finds its old ones there).
    const auto own = committed_steps(dir_, ".rank-" + std::to_string(rank));
    for (const auto& [held, by] : buddy_held_->copies) {
      step = held;
      if ((!own.empty() && own.front().first >= held) || static_cast<std::int64_t>(held) < floor)
        continue;
      const std::string prefix = held_prefix(rank, {held, by});
      const std::string text = store.get(prefix + std::string(manifest_name));
      const manifest m = parse_manifest(text, prefix + std::string(manifest_name));
      // Of a round of another size (an elastic job's): not this rank's to
      // load, and no fault; a re-cut gathers what it needs (recut()).
      if (m.step == held && m.world_size != context_.plane.size()) continue;
      if (m.step != held) {
        throw checkpoint_error("its manifest says step " + std::to_string(m.step));
      }
      partial = staging(held);
      make_directory(partial, false);
      for (const file_record& f : m.files)
        write_part(held_source([&]() -> store_client& { return store; }, prefix, f),
                   partial / f.name);
      commit_copy(partial, text, copy_dir(held, rank));
      partial.clear();
      taken = std::max(taken, static_cast<std::int64_t>(held));
    }
  } catch (const std::exception& e) {
    if (!partial.empty()) static_cast<void>(detail::remove_tree(partial.c_str()));
    buddy_.reset();
    tell("memory copy: rank " + std::to_string(rank) + "'s copy" +
         (step ? " of step " + std::to_string(*step) : std::string()) + " at its buddy (" +
         buddy_endpoint_ + ", another node's agent): " + e.what() + "; not used");
  }
  return taken;
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

DTRAIN_DETAIL_INLINE std::filesystem::path memory_tier::joined_dir(std::uint64_t step) const {
  return dir_ / (step_name(step) + ".node");
}

DTRAIN_DETAIL_INLINE file_record
memory_tier::join(const std::map<int, std::pair<std::filesystem::path, file_record>>& slices,
                  int count, const std::filesystem::path& partial) {
  struct joined_entry {
    entry_kind kind = entry_kind::values;
    dtype type = dtype::uint8;
    std::vector<std::uint64_t> shape;
    std::string data;
    std::uint64_t total = 0;  // a cut values entry's elements; 0: whole in one slice
    std::vector<std::pair<std::uint64_t, std::uint64_t>> got;  // its ranges joined
  };
  std::vector<std::string> order;
  std::map<std::string, joined_entry> entries;
  std::uint64_t budget = 0;  // the slices' bytes: no entry is made larger
  for (const auto& [index, at] : slices) budget += at.second.bytes;
  for (const auto& [index, at] : slices) {
    const std::filesystem::path file = at.first / at.second.name;
    static_cast<void>(read_checked_part(file, at.second));  // torn: said by name
    std::string payload;
    static_cast<void>(read_part(file, [&](const entry_header& h, checked_reader& in) {
      payload.assign(static_cast<std::size_t>(h.bytes), '\0');
      in.read(payload.data(), h.bytes, "entry '" + h.name + "'");
      const auto [it, fresh] = entries.try_emplace(h.name);
      joined_entry& e = it->second;
      if (fresh) order.push_back(h.name);
      if (h.kind != entry_kind::sharded) {  // dealt whole to this slice
        if (!fresh) in.malformed("entry '" + h.name + "' is in another slice too");
        e.kind = h.kind;
        e.type = h.type;
        e.shape = h.shape;
        e.data = std::move(payload);
        return;
      }
      const std::size_t element = size_of(h.type);
      const sharded_payload cut =
          parse_sharded(payload, element, "entry '" + h.name + "' of " + file.string());
      if (cut.ranges.size() != 1) in.malformed("entry '" + h.name + "' is not one range");
      if (fresh) {
        if (cut.total > budget / element)
          in.malformed("entry '" + h.name + "' claims " + std::to_string(cut.total) +
                       " elements, more than the slices hold");
        e.type = h.type;
        e.shape = h.shape;
        e.total = cut.total;
        e.data.assign(static_cast<std::size_t>(cut.total * element), '\0');
      } else if (e.total == 0 || e.type != h.type || e.total != cut.total || e.shape != h.shape) {
        in.malformed("entry '" + h.name + "' is cut otherwise in another slice");
      }
      const auto [global, n] = cut.ranges.front();
      std::memcpy(e.data.data() + global * element, payload.data() + cut.values_at,
                  static_cast<std::size_t>(n * element));
      e.got.emplace_back(global, global + n);
    }));
  }
  atomic_file out(partial / replicated_name, true);
  write_part_header(out, static_cast<std::uint32_t>(order.size()));
  for (const std::string& name : order) {
    joined_entry& e = entries.at(name);
    if (e.total > 0) {  // its ranges tile the whole, each once
      std::ranges::sort(e.got);
      std::uint64_t reached = 0;
      for (const auto& [lo, hi] : e.got) {
        if (lo != reached) break;
        reached = hi;
      }
      if (reached != e.total) {
        throw checkpoint_error("checkpoint: the " + std::to_string(count) +
                               " slices of the replicated part hold entry '" + name +
                               "' with a gap or an overlap at element " + std::to_string(reached) +
                               " of " + std::to_string(e.total));
      }
    }
    write_entry(out, name, e.kind, e.type, e.shape, e.data.data(), e.data.size());
  }
  return out.finish();
}

DTRAIN_DETAIL_INLINE void memory_tier::join_slices() {
  const std::vector<int>& ranks = node();
  if (ranks.front() == context_.plane.rank()) {
    // The slices in the node's copies, by step, then by the job's size and
    // the save (the id of the workers that wrote them): slice -> its copy.
    struct group {
      int count = 0;
      std::map<int, std::pair<std::filesystem::path, file_record>> slices;
    };
    std::map<std::uint64_t, std::map<std::pair<int, std::string>, group>, std::greater<>> steps;
    std::vector<std::filesystem::path> old;  // joins of a restore before
    std::error_code ec;
    for (std::filesystem::directory_iterator it(dir_, ec), end; !ec && it != end;
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.ends_with(".node") || name.ends_with(".node" + std::string(partial_suffix))) {
        old.push_back(it->path());
        continue;
      }
      const auto copy = memory_detail::copy_name(name);
      if (!copy) continue;
      const std::uint64_t step = copy->first;
      try {
        const manifest m = read_manifest(it->path());
        if (m.step != step) continue;
        for (const file_record& f : m.files) {
          const auto slice = parse_slice(f.name);
          if (!slice) continue;
          group& g = steps[step][{m.world_size, slice->id}];
          if (g.count == 0) g.count = slice->count;
          if (g.count == slice->count) g.slices[slice->index] = {it->path(), f};
        }
      } catch (const std::exception&) {
        // A torn manifest: its slice is missing below.
      }
    }
    for (const std::filesystem::path& path : old)
      static_cast<void>(detail::remove_tree(path.c_str()));
    joined_.clear();
    std::size_t joined = 0;
    for (const auto& [step, groups] : steps) {
      if (joined == 2) break;
      // This job's size first (its own copies), then any (for a re-cut).
      std::vector<std::pair<int, const group*>> tries;
      for (const auto& [key, g] : groups) {
        if (key.first == context_.plane.size())
          tries.insert(tries.begin(), {key.first, &g});
        else
          tries.emplace_back(key.first, &g);
      }
      std::string why;
      for (const auto& [world, g] : tries) {
        std::string missing;
        for (int k = 0; k < g->count; ++k) {
          if (!g->slices.contains(k)) missing += (missing.empty() ? "" : ", ") + std::to_string(k);
        }
        if (!missing.empty()) {
          if (why.empty())
            why = "slice(s) " + missing + " of " + std::to_string(g->count) +
                  " are in no copy on this node (a rank killed in its copy)";
          continue;
        }
        const std::filesystem::path partial =
            joined_dir(step).string() + std::string(partial_suffix);
        try {
          make_directory(partial, false);
          const file_record whole = join(g->slices, g->count, partial);
          commit_copy(partial, render(manifest{step, world, {whole}}), joined_dir(step));
          joined_.push_back(joined_dir(step));
          why.clear();
          break;
        } catch (const std::exception& e) {
          static_cast<void>(detail::remove_tree(partial.c_str()));
          if (why.empty()) why = e.what();
        }
      }
      if (why.empty()) {
        ++joined;
      } else {
        tell("memory copy: the replicated part of step " + std::to_string(step) +
             " is in slices on this node's copies, and " + why + "; not used");
      }
    }
  }
  static_cast<void>(all_ok(true));  // the joins are made before any rank looks for them
}

DTRAIN_DETAIL_INLINE std::filesystem::path memory_tier::whole_replicated(std::uint64_t step,
                                                                         bool verify) {
  const std::filesystem::path leader = copy_dir(step, node().front());
  const std::filesystem::path joined = joined_dir(step);
  std::error_code ec;
  const std::filesystem::path copy = std::filesystem::exists(joined, ec) ? joined : leader;
  const manifest m = verify ? verify_step(copy) : read_manifest(copy);
  if (m.step != step || !m.find(replicated_name)) {
    throw checkpoint_error("checkpoint: no copy in " + dir_.string() +
                           " holds the replicated part of step " + std::to_string(step) +
                           " whole (" + copy.string() + " does not)");
  }
  if (m.world_size != context_.plane.size()) {
    throw checkpoint_error("checkpoint: " + copy.string() + " holds the replicated part of step " +
                           std::to_string(step) + " of " + std::to_string(m.world_size) +
                           " ranks, and this job has " + std::to_string(context_.plane.size()));
  }
  return copy;
}

DTRAIN_DETAIL_INLINE std::array<std::int64_t, 2> memory_tier::usable(bool recuts) {
  std::array<std::int64_t, 2> out{-1, -1};
  const int rank = context_.plane.rank();
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
      if (recuts && m.step == step && m.world_size != context_.plane.size())
        continue;  // of a job of another size: recut() may gather it
      if (m.step != step || m.world_size != context_.plane.size()) {
        throw checkpoint_error("checkpoint: " + path.string() + " holds step " +
                               std::to_string(m.step) + " of " + std::to_string(m.world_size) +
                               " ranks, and this job has " + std::to_string(context_.plane.size()));
      }
      // The replicated part: the node's first rank's, or its slices joined.
      if (!m.find(replicated_name)) static_cast<void>(whole_replicated(step, true));
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
    if (const auto joined = memory_detail::joined_name(name)) {  // slices joined
      copies[*joined].push_back(it->path());
    } else if (const auto copy = memory_detail::copy_name(name)) {
      copies[copy->first].push_back(it->path());
    }
  }
  std::size_t found = 0;
  for (auto& [step, paths] : copies) {
    if (found == out.size()) break;
    std::sort(paths.begin(), paths.end());
    std::string why;
    for (const std::filesystem::path& path : paths) {
      try {
        if (!read_manifest(path).find(replicated_name)) continue;  // a slice (or none)
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
  own_.reset();  // a restore may commit copies (a buddy's, a share's): listed at the next save
  const bool own = entries.has_scope(checkpoint_scope::per_rank);
  const int size = context_.plane.size();
  if (own) {
    // Ranks whose node lost their copies (it replaces a lost one) take them
    // from their buddies, before any rank looks at its node's (a node's
    // first rank's copy holds the replicated part the others read).
    const std::int64_t took = take_from_buddy(floor);
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
  join_slices();
  const bool recuts = own && entries.per_rank_recuts();
  const std::array<std::int64_t, 2> mine = own ? usable(recuts) : usable_replicated();
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size));
  context_.plane.allgather(mine, all);
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
  if (best < 0 && recuts) {
    // No step whole on every rank in copies of this job's size (its size
    // changed, or a node replaced): the newest copies of any job, wherever
    // the ranks reach them, gathered and re-cut, as the disk's would be.
    const recut_result gathered = recut(floor, entries);
    if (gathered.said) return gathered.step;
  }
  if (std::ranges::none_of(all, [](std::int64_t v) { return v >= 0; })) {
    // A job's first start, or every node's copies gone (the whole job
    // restarted, or every node that held one lost): the disk's, as ever.
    context_.say(
        "memory tier: no rank has a memory copy (a new job, or every node that held "
        "one is gone): using " +
        context_.options.dir.string());
    return std::nullopt;
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

DTRAIN_DETAIL_INLINE bool memory_tier::send_part(int root, const part_source& source,
                                                 const std::filesystem::path& into,
                                                 file_record& got, std::int64_t& extra,
                                                 std::string& problem) {
  const int rank = context_.plane.rank();
  // The root's part: its size and checksum (-1: it cannot send it), and its `extra`.
  std::array<std::int64_t, 3> head{-1, 0, 0};
  if (rank == root && source.record && problem.empty()) {
    head = {static_cast<std::int64_t>(source.record->bytes),
            std::bit_cast<std::int64_t>(source.record->checksum), source.extra};
  }
  std::array<std::uint8_t, sizeof head> wire{};
  std::memcpy(wire.data(), head.data(), sizeof head);
  context_.plane.broadcast(wire, root);
  std::memcpy(head.data(), wire.data(), sizeof head);
  if (head[0] < 0) return false;
  // In pieces of at most 4 MiB: what the control plane holds at a time
  // (through the store, for NCCL's jobs) stays bounded.
  const auto bytes = static_cast<std::uint64_t>(head[0]);
  std::optional<atomic_file> out;
  if (!into.empty() && problem.empty()) {
    try {
      out.emplace(into);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  std::string piece;
  std::uint64_t index = 0;
  for (std::uint64_t at = 0; at < bytes; ++index) {
    const auto n = static_cast<std::size_t>(std::min(memory_detail::piece_bytes, bytes - at));
    if (rank == root) {
      try {
        piece = source.read(index);
      } catch (const std::exception&) {
        piece.clear();
      }
      piece.resize(n);  // a short read: its checksum fails where it arrives
    } else {
      piece.assign(n, '\0');
    }
    context_.plane.broadcast(
        std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(piece.data()), n), root,
        !into.empty());
    if (out && problem.empty()) {
      try {
        out->write(piece.data(), n);
      } catch (const std::exception& e) {
        problem = e.what();
      }
    }
    at += n;
  }
  if (out && problem.empty()) {
    try {
      got = out->finish();
      if (got.bytes != bytes || got.checksum != std::bit_cast<std::uint64_t>(head[1])) {
        problem = into.filename().string() + " from rank " + std::to_string(root) +
                  " arrived damaged (" + std::to_string(got.bytes) + " bytes, checksum differs)";
      }
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  got.bytes = bytes;
  got.checksum = std::bit_cast<std::uint64_t>(head[1]);
  extra = head[2];
  return true;
}

DTRAIN_DETAIL_INLINE memory_tier::part_source memory_tier::file_source(
    const std::filesystem::path& copy, const std::string& name) {
  part_source source;
  const manifest m = read_manifest(copy);
  const file_record* r = m.find(name);
  if (!r) throw checkpoint_error("checkpoint: " + copy.string() + " lists no " + name);
  source.record = *r;
  source.extra = m.world_size;
  const std::filesystem::path file = copy / name;
  source.read = [file](std::uint64_t index) {
    std::ifstream in(file, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(index * memory_detail::piece_bytes));
    std::string piece(static_cast<std::size_t>(memory_detail::piece_bytes), '\0');
    in.read(piece.data(), static_cast<std::streamsize>(piece.size()));
    piece.resize(static_cast<std::size_t>(in.gcount()));
    return piece;
  };
  return source;
}

DTRAIN_DETAIL_INLINE memory_tier::part_source memory_tier::held_source(
    std::function<store_client&()> store, std::string prefix, const file_record& record) {
  part_source source;
  source.record = record;
  source.read = [store = std::move(store), prefix = std::move(prefix),
                 name = record.name](std::uint64_t index) {
    return store().get(memory_detail::piece_key(prefix, name, index));
  };
  return source;
}

DTRAIN_DETAIL_INLINE void memory_tier::write_part(const part_source& source,
                                                  const std::filesystem::path& file) {
  const file_record& want = *source.record;
  atomic_file out(file);
  for (std::uint64_t at = 0, i = 0; at < want.bytes; ++i) {
    const std::string piece = source.read(i);
    if (piece.empty()) break;  // short: the check below says so
    out.write(piece.data(), piece.size());
    at += piece.size();
  }
  const file_record got = out.finish();
  if (got.bytes != want.bytes || got.checksum != want.checksum) {
    throw checkpoint_error(want.name + " arrived damaged (" + std::to_string(got.bytes) + " of " +
                           std::to_string(want.bytes) + " bytes, checksum " +
                           (got.checksum == want.checksum ? "the same)" : "differs)"));
  }
}

DTRAIN_DETAIL_INLINE void memory_tier::commit_copy(const std::filesystem::path& partial,
                                                   std::string_view manifest_text,
                                                   const std::filesystem::path& copy) {
  atomic_file written(partial / manifest_name, true);  // (the rename below commits it)
  written.write(manifest_text.data(), manifest_text.size());
  static_cast<void>(written.finish());
  if (::rename(partial.c_str(), copy.c_str()) == 0) return;
  remove_checkpoint_tree(copy);  // an older run's copy of this step
  rename_path(partial, copy);
}

DTRAIN_DETAIL_INLINE bool memory_tier::share(std::uint64_t step, int root,
                                             const std::vector<int>& lacking) {
  const int rank = context_.plane.rank();
  const bool receiving = std::ranges::find(lacking, rank) != lacking.end();
  const std::string fallback = "using " + context_.options.dir.string() + " instead";
  // The root's replicated part, and the world size of the job that wrote it.
  part_source source;
  std::string problem;
  if (rank == root) {
    try {
      source = file_source(replicated_copy_.at(step), std::string(replicated_name));
    } catch (const std::exception& e) {
      problem = e.what();
      tell("memory copy: cannot send step " + std::to_string(step) + ": " + problem);
    }
  }
  const std::filesystem::path partial = staging(step);
  if (receiving) {
    try {
      make_directory(partial, false);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  file_record got;
  std::int64_t world = 0;  // of the job that wrote the part
  if (!send_part(root, source, receiving ? partial / replicated_name : std::filesystem::path(), got,
                 world, problem)) {
    context_.say("memory tier: rank " + std::to_string(root) + " could not send its copy of step " +
                 std::to_string(step) + " to rank(s) " + list(lacking) +
                 " (its error says why): " + fallback);
    return false;
  }
  if (receiving && problem.empty()) {
    try {
      got.name = std::string(replicated_name);
      const std::filesystem::path copy = copy_dir(step, rank);
      commit_copy(partial, render(manifest{step, static_cast<int>(world), {got}}), copy);
      replicated_copy_[step] = copy;
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  if (receiving && !problem.empty()) {
    static_cast<void>(detail::remove_tree(partial.c_str()));
    tell("memory copy: could not take step " + std::to_string(step) + " from rank " +
         std::to_string(root) + ": " + problem + "; not used");
  }
  if (!all_ok(problem.empty() || !receiving)) {
    context_.say("memory tier: rank(s) " + list(lacking) + " could not take step " +
                 std::to_string(step) + " from rank " + std::to_string(root) +
                 " (each said why): " + fallback);
    return false;
  }
  context_.say("memory tier: rank(s) " + list(lacking) + " had no copy of step " +
               std::to_string(step) + " (their node is new, or came back): rank " +
               std::to_string(root) + " sent them its replicated part (" +
               std::to_string(got.bytes) + " bytes)");
  return true;
}

DTRAIN_DETAIL_INLINE bool memory_tier::all_ok(bool mine) {
  const std::int64_t ok = mine ? 1 : 0;
  std::vector<std::int64_t> oks(static_cast<std::size_t>(context_.plane.size()));
  context_.plane.allgather(std::span<const std::int64_t>(&ok, 1), oks);
  return std::ranges::find(oks, 0) == oks.end();
}

DTRAIN_DETAIL_INLINE memory_tier::recut_result memory_tier::recut(std::int64_t floor,
                                                                  const registry& entries) {
  const int rank = context_.plane.rank();
  const int size = context_.plane.size();
  const std::string fallback = "using " + context_.options.dir.string() + " instead";
  const std::string mine = ".recut-" + std::to_string(rank);
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().filename().string().find(mine) != std::string::npos)
      remove_checkpoint_tree(it->path());  // an assembly of a restore before
  }
  // 1. The copies this rank can reach, of a job of any size, by (step, that
  // job's size, its rank): its node's, and those its agent holds for the
  // node before it.
  struct reached {
    std::filesystem::path copy;  // in dir_; empty: at the agent, under `prefix` (held_prefix())
    manifest m;
    std::string prefix{};
  };
  std::map<std::pair<std::uint64_t, int>, std::map<int, reached>, std::greater<>> seen;
  // The replicated parts joined from slices (join_slices()), by (step, that job's size).
  std::map<std::pair<std::uint64_t, int>, std::filesystem::path> joined;
  for (std::filesystem::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const auto joined_step = memory_detail::joined_name(name);
    const auto copy = memory_detail::copy_name(name);
    if (!joined_step && !copy) continue;
    try {
      manifest m = read_manifest(it->path());
      if (joined_step && m.step == *joined_step) {
        joined[{m.step, m.world_size}] = it->path();
      } else if (copy && m.step == copy->first) {
        seen[{m.step, m.world_size}][copy->second] = {it->path(), std::move(m)};
      }
    } catch (const std::exception&) {
      // A torn copy: as none (the one who sends it would fail the checksum anyway).
    }
  }
  std::int64_t widest = 0;
  for (const auto& [key, ranks] : seen) widest = std::max<std::int64_t>(widest, key.second);
  std::vector<std::int64_t> widths(static_cast<std::size_t>(size));
  context_.plane.allgather(std::span<const std::int64_t>(&widest, 1), widths);
  widest = *std::ranges::max_element(widths);
  if (!held_endpoint_.empty() && widest > 0) {
    try {
      store_client& store = open(held_, held_endpoint_, "memory_held");
      for (int r = 0; r < widest; ++r) {
        for (const held_copy& held : held_steps(store, r).copies) {
          std::string prefix = held_prefix(r, held);
          const std::string key = prefix + std::string(manifest_name);
          manifest m = parse_manifest(store.get(key), key);
          auto& at = seen[{m.step, m.world_size}];
          if (!at.contains(r)) at[r] = {{}, std::move(m), std::move(prefix)};
        }
      }
    } catch (const std::exception& e) {
      tell("memory copy: the copies its node's agent holds (" + held_endpoint_ + "): " + e.what() +
           "; not used");
    }
  }
  // 2. The steps the ranks reached (each its 4 newest, with the size of
  // their job), newest first: the first whose every rank's copy some rank
  // reaches is gathered (a rank killed in its copy leaves the one before).
  constexpr std::size_t newest_few = 4;
  std::array<std::int64_t, 2 * newest_few> few{};
  std::ranges::fill(few, -1);
  std::size_t n = 0;
  for (auto it = seen.begin(); it != seen.end() && n < newest_few; ++it, ++n) {
    few[2 * n] = static_cast<std::int64_t>(it->first.first);
    few[2 * n + 1] = it->first.second;
  }
  std::vector<std::int64_t> fews(few.size() * static_cast<std::size_t>(size));
  context_.plane.allgather(few, fews);
  std::set<std::pair<std::int64_t, std::int64_t>, std::greater<>> candidates;
  for (std::size_t i = 0; i + 1 < fews.size(); i += 2) {
    if (fews[i] >= 0) candidates.emplace(fews[i], fews[i + 1]);
  }
  if (candidates.empty()) return {};  // no copy anywhere: newest() says so
  const std::map<int, reached> none;
  std::uint64_t step = 0;
  int world = 0;
  std::string which, missing;
  const std::map<int, reached>* here = &none;
  int replicated_of = -1;           // the old rank whose copy holds the replicated part, here
  std::filesystem::path joined_at;  // else its slices joined, here
  std::size_t words = 0;
  std::vector<std::int64_t> reaches;
  // The lowest rank that reaches bit `bit` (an old rank; `world`: the replicated part), or -1.
  auto holder = [&](int bit) {
    for (int r = 0; r < size; ++r) {
      if ((reaches[static_cast<std::size_t>(r) * words + static_cast<std::size_t>(bit / 64)] >>
           (bit % 64)) &
          1)
        return r;
    }
    return -1;
  };
  bool whole = false;
  for (const auto& [candidate, of] : candidates) {
    step = static_cast<std::uint64_t>(candidate);
    world = static_cast<int>(of);
    which = "step " + std::to_string(step) + " of the job of " + std::to_string(world) + " ranks";
    if (candidate < floor) {
      context_.say("memory tier: the memory copies (" + which + ") are older than the disk " +
                   "checkpoint (step " + std::to_string(floor) + ")" +
                   (missing.empty() ? std::string() : "; " + missing) + ": " + fallback);
      return {std::nullopt, true};
    }
    // 3. Who reaches which of its ranks' copies, and which holds its replicated part.
    words = static_cast<std::size_t>(world / 64 + 1);
    std::vector<std::int64_t> reach(words, 0);
    const auto found = seen.find({step, world});
    here = found == seen.end() ? &none : &found->second;
    replicated_of = -1;
    joined_at.clear();
    for (const auto& [r, copy] : *here) {
      if (r >= world) continue;
      reach[static_cast<std::size_t>(r / 64)] |= std::int64_t{1} << (r % 64);
      if (replicated_of < 0 && copy.m.find(replicated_name)) replicated_of = r;
    }
    if (const auto j = joined.find({step, world}); replicated_of < 0 && j != joined.end())
      joined_at = j->second;
    if (replicated_of >= 0 || !joined_at.empty())
      reach[static_cast<std::size_t>(world / 64)] |= std::int64_t{1} << (world % 64);
    reaches.assign(words * static_cast<std::size_t>(size), 0);
    context_.plane.allgather(reach, reaches);
    std::vector<int> lost;
    for (int r = 0; r < world; ++r) {
      if (holder(r) < 0) lost.push_back(r);
    }
    if (lost.empty() && holder(world) >= 0) {
      whole = true;
      break;
    }
    if (missing.empty()) {
      missing = "no rank reaches the copies of rank(s) " +
                (lost.empty() ? std::string("any with the replicated part") : list(lost)) + " of " +
                which;
    }
  }
  if (!whole) {
    context_.say("memory tier: " + missing +
                 " (their node and its buddy are gone, or it was killed in its copy), nor "
                 "all of an older one: " +
                 fallback);
    return {std::nullopt, true};
  }
  // 4. Every part from the lowest rank that reaches it, to every rank, which
  // writes them into one copy of its own (a sharded entry is re-cut from
  // the old ranks' parts, as from the disk's): the replicated part, and the
  // rank parts that hold some of its shards; it drops the others once read,
  // so that it holds about (old ranks / new ranks + 1) of them, not all.
  const std::filesystem::path partial =
      dir_ / (step_name(step) + mine + std::string(partial_suffix));
  std::string problem;
  try {
    make_directory(partial, false);
  } catch (const std::exception& e) {
    problem = e.what();
  }
  auto source_of = [&](int r, const std::string& name) {
    const reached& copy = here->at(r);
    if (!copy.copy.empty()) return file_source(copy.copy, name);
    const file_record* record = copy.m.find(name);
    if (!record)
      throw checkpoint_error("the copy of rank " + std::to_string(r) + " lists no " + name);
    return held_source(
        [this]() -> store_client& { return open(held_, held_endpoint_, "memory_held"); },
        copy.prefix, *record);
  };
  manifest assembled{step, world, {}};
  std::uint64_t sent = 0;
  std::uint64_t kept = 0;                      // of the rank parts' bytes
  for (int part = -1; part < world; ++part) {  // the replicated part first
    const std::string name = part < 0 ? std::string(replicated_name) : rank_part_name(part);
    const int root = holder(part < 0 ? world : part);
    part_source source;
    if (rank == root) {
      try {
        source = part < 0 && replicated_of < 0 ? file_source(joined_at, name)
                                               : source_of(part < 0 ? replicated_of : part, name);
      } catch (const std::exception& e) {
        tell("memory copy: cannot send " + name + " of " + which + ": " + e.what());
      }
    }
    file_record got;
    std::int64_t unused = 0;
    if (!send_part(root, source, problem.empty() ? partial / name : std::filesystem::path(), got,
                   unused, problem)) {
      static_cast<void>(detail::remove_tree(partial.c_str()));
      context_.say("memory tier: rank " + std::to_string(root) + " could not send " + name +
                   " of " + which + " (its error says why): " + fallback);
      return {std::nullopt, true};
    }
    sent += got.bytes;
    if (part >= 0 && problem.empty() && !entries.needs(partial / name)) {
      std::error_code ignored;
      std::filesystem::remove(partial / name, ignored);
      continue;
    }
    if (part >= 0) kept += got.bytes;
    got.name = name;
    assembled.files.push_back(got);
  }
  const std::filesystem::path copy = dir_ / (step_name(step) + mine);
  if (problem.empty()) {
    try {
      commit_copy(partial, render(assembled), copy);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  if (!problem.empty()) {
    static_cast<void>(detail::remove_tree(partial.c_str()));
    tell("memory copy: could not gather " + which + ": " + problem + "; not used");
  }
  if (!all_ok(problem.empty())) {
    context_.say("memory tier: some rank could not gather " + which +
                 " (each said why): " + fallback);
    return {std::nullopt, true};
  }
  recut_dir_ = copy;
  // (Said by rank 0, of what it kept: each rank keeps the parts its shards fall in.)
  context_.say("memory tier: no rank had a copy for a job of " + std::to_string(size) +
               " ranks: " + which + " gathered from the ranks that reach its copies (" +
               std::to_string(sent) + " bytes sent to every rank; rank 0 kept " +
               std::to_string(assembled.files.size() - 1) + " of the " + std::to_string(world) +
               " old ranks' parts, " + std::to_string(kept) +
               " bytes, those its shards fall in), to be re-cut");
  return {step, true};
}

DTRAIN_DETAIL_INLINE std::string memory_tier::list(const std::vector<int>& ranks) {
  std::string out;
  for (const int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

DTRAIN_DETAIL_INLINE std::vector<std::filesystem::path> memory_tier::files(
    std::uint64_t step, const registry& entries) {
  own_.reset();  // (as newest())
  if (!recut_dir_.empty()) {
    const manifest m = read_manifest(recut_dir_);
    if (m.step == step) {
      return entries.check(
          m, [&](const std::string& name) { return recut_dir_ / name; }, recut_dir_,
          context_.plane.size(), true);
    }
  }
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
  // This rank's manifest, and the replicated part from its node's first
  // rank's copy, or its slices joined (checked below, as this rank's part).
  manifest m = read_manifest(mine);
  const std::filesystem::path leader =
      m.find(replicated_name) ? mine : whole_replicated(step, false);
  const manifest theirs = read_manifest(leader);
  const std::string replicated(replicated_name);
  if (const auto* r = theirs.find(replicated); r && !m.find(replicated)) m.files.push_back(*r);
  return entries.check(
      m, [&](const std::string& name) { return (name == replicated ? leader : mine) / name; }, mine,
      context_.plane.size());
}

}  // namespace dtrain::detail::ckpt
