#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/registry.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/registry.hpp, not this file.

#include <dtrain/checkpoint/registry.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>

namespace dtrain::detail::ckpt {

DTRAIN_DETAIL_INLINE void registry::add_values(std::string name, buffer values,
                                               checkpoint_scope scope,
                                               std::vector<std::uint64_t> shape) {
  if (values.where != memory::host) {
    throw config_error("checkpoint on rank " + std::to_string(rank_) + ": entry '" + name +
                       "' is in device memory; checkpoints hold host memory (copy it to the host "
                       "and add that copy)");
  }
  if (values.count > 0 && values.data == nullptr) {
    throw config_error("checkpoint on rank " + std::to_string(rank_) + ": entry '" + name +
                       "' has " + std::to_string(values.count) + " values and no data");
  }
  entry e;
  e.name = std::move(name);
  e.scope = scope;
  e.values = values;
  e.shape = std::move(shape);
  push(std::move(e));
}

DTRAIN_DETAIL_INLINE registry::entry& registry::push(entry e) {
  if (e.name.empty() || e.name.size() > max_name) {
    throw config_error("checkpoint on rank " + std::to_string(rank_) +
                       ": an entry's name must have 1 to " + std::to_string(max_name) + " bytes");
  }
  for (const entry& other : entries_) {
    if (other.name == e.name) {
      throw config_error("checkpoint on rank " + std::to_string(rank_) + ": entry '" + e.name +
                         "' is added twice");
    }
  }
  return entries_.emplace_back(std::move(e));
}

DTRAIN_DETAIL_INLINE void registry::add_sharded(std::string name, buffer values,
                                                std::vector<shard_range> ranges,
                                                std::uint64_t total) {
  for (const shard_range& r : ranges) {
    if (r.local > values.count || r.count > values.count - r.local || r.global > total ||
        r.count > total - r.global) {
      throw config_error("checkpoint on rank " + std::to_string(rank_) + ": sharded entry '" +
                         name + "': range " + std::to_string(r.global) + "+" +
                         std::to_string(r.count) + " (at " + std::to_string(r.local) +
                         " here) does not fit " + std::to_string(values.count) +
                         " values of a whole of " + std::to_string(total));
    }
  }
  add_values(name, values, checkpoint_scope::per_rank, {});
  entry& e = entries_.back();
  e.kind = entry_kind::sharded;
  e.ranges = std::move(ranges);
  e.total = total;
}

DTRAIN_DETAIL_INLINE void registry::add_bytes(std::string name, std::function<std::string()> save,
                                              std::function<void(std::string_view)> load,
                                              checkpoint_scope scope) {
  if (!save || !load) {
    throw config_error("checkpoint on rank " + std::to_string(rank_) + ": entry '" + name +
                       "' needs both a save and a load function");
  }
  entry e;
  e.name = std::move(name);
  e.scope = scope;
  e.kind = entry_kind::bytes;
  e.save = std::move(save);
  e.load = std::move(load);
  push(std::move(e));
}

DTRAIN_DETAIL_INLINE void registry::add_hooks(std::function<void()> before_save,
                                              std::function<void()> after_restore) {
  hooks_.push_back({std::move(before_save), std::move(after_restore)});
}

DTRAIN_DETAIL_INLINE std::span<std::byte> registry::scratch(std::size_t bytes) {
  auto& array = scratch_.emplace_back(bytes);
  return {array.data(), array.size()};
}

DTRAIN_DETAIL_INLINE void registry::before_save() const {
  for (const hook& h : hooks_) {
    if (h.before_save) h.before_save();
  }
}

DTRAIN_DETAIL_INLINE void registry::load(const std::vector<std::filesystem::path>& files) {
  recut_.clear();
  for (const std::filesystem::path& file : files) apply(file);
  check_recut();
  for (const hook& h : hooks_) {
    if (h.after_restore) h.after_restore();
  }
}

DTRAIN_DETAIL_INLINE bool registry::has_scope(checkpoint_scope scope) const {
  return std::ranges::any_of(entries_, [&](const entry& e) { return e.scope == scope; });
}

DTRAIN_DETAIL_INLINE bool registry::per_rank_recuts() const {
  return std::ranges::all_of(entries_, [](const entry& e) {
    return e.scope != checkpoint_scope::per_rank || e.kind == entry_kind::sharded;
  });
}

DTRAIN_DETAIL_INLINE part_snapshot registry::snapshot(checkpoint_scope scope, std::size_t live_from,
                                                      std::size_t slot, double& copy_seconds,
                                                      slice_of slice) {
  part_snapshot out;
  std::size_t owned = 0;
  for (const entry& e : entries_) owned += e.scope == scope ? 1 : 0;
  out.owned.reserve(owned);  // the records point into these strings: no reallocation
  std::vector<copy_job> copies;
  const auto index = static_cast<std::uint64_t>(slice.index);
  const auto count = static_cast<std::uint64_t>(std::max(slice.count, 1));
  std::uint64_t dealt = 0;  // entries dealt whole so far
  for (entry& e : entries_) {
    if (e.scope != scope) continue;
    part_record r{e.name, e.kind, e.values.type, e.shape, e.values.data, e.values.bytes()};
    if (count > 1 && e.kind == entry_kind::values && r.bytes >= slice_of::split_from) {
      const std::uint64_t n = e.values.count;
      const std::uint64_t lo = n * index / count, hi = n * (index + 1) / count;
      if (lo == hi) continue;
      const std::size_t element = size_of(e.values.type);
      r.kind = entry_kind::sharded;
      r.ranged = true;
      r.range = {n, 1, lo, hi - lo};
      r.data = static_cast<const char*>(e.values.data) + lo * element;
      r.bytes = (hi - lo) * element;
    } else if (count > 1 && dealt++ % count != index) {
      continue;
    }
    if (e.kind == entry_kind::bytes) {
      r.type = dtype::uint8;
      out.owned.push_back(e.save());
      r.data = out.owned.back().data();
      r.bytes = out.owned.back().size();
    } else if (e.kind == entry_kind::sharded) {
      out.owned.push_back(sharded_payload(e));
      r.data = out.owned.back().data();
      r.bytes = out.owned.back().size();
    } else if (r.bytes > 0 && r.bytes < live_from) {
      // The entry's own copy (of its range, in a slice), reused by each save
      // (one is in flight at a time): its pages are touched once per job,
      // not at every save.
      if (e.staged.size() <= slot) e.staged.resize(slot + 1);
      void* to = e.staged[slot].reserve(static_cast<std::size_t>(r.bytes));
      copies.push_back({to, r.data, static_cast<std::size_t>(r.bytes)});
      r.data = to;
    } else if (r.bytes > 0) {
      out.reads_live = true;
    }
    out.records.push_back(r);
  }
  if (!copies.empty()) {
    const auto start = std::chrono::steady_clock::now();
    copy_parallel(copies, copy_threads_);
    copy_seconds += seconds_since(start);
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::string registry::sharded_payload(const entry& e) {
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

DTRAIN_DETAIL_INLINE std::string registry::describe(entry_kind kind, dtype type,
                                                    const std::vector<std::uint64_t>& shape,
                                                    std::uint64_t bytes) {
  if (kind == entry_kind::bytes) return std::to_string(bytes) + " bytes of its own format";
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

DTRAIN_DETAIL_INLINE std::vector<std::filesystem::path> registry::check(
    const manifest& m, const std::function<std::filesystem::path(const std::string&)>& path_of,
    const std::filesystem::path& where, int world_size, bool listed_parts) const {
  std::vector<std::pair<std::string, checkpoint_scope>> wanted{
      {std::string(replicated_name), checkpoint_scope::replicated}};
  if (has_scope(checkpoint_scope::per_rank)) {
    if (m.world_size != world_size) {
      // Sharded entries are re-cut from every rank's part; other per-rank state cannot be.
      std::string names;
      for (const entry& e : entries_) {
        if (e.scope == checkpoint_scope::per_rank && e.kind != entry_kind::sharded)
          names += (names.empty() ? "'" : ", '") + e.name + "'";
      }
      if (!names.empty()) {
        throw checkpoint_error("checkpoint: " + where.string() + " was written by " +
                               std::to_string(m.world_size) + " ranks and this job has " +
                               std::to_string(world_size) + "; its per-rank state (" + names +
                               ") cannot be re-cut for another world size");
      }
      // The old ranks' parts that hold some of this rank's elements (their
      // headers read, not their values): the others are neither checked nor
      // read, so that a re-cut reads about (old ranks / new ranks + 1) parts
      // here, not every one. The kept parts' ranges must hold every element.
      std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> cover;
      const auto sharded = [this](const std::string& name) { return is_sharded(name); };
      bool can_tell = true;
      for (int r = 0; r < m.world_size; ++r) {
        const std::string name = rank_part_name(r);
        if (listed_parts && !m.find(name)) continue;
        const saved_ranges ranges = part_ranges(path_of(name), sharded);
        if (!needs(ranges)) continue;
        if (!ranges) can_tell = false;  // damaged: its check below names it
        for (const auto& [entry_name, held] : ranges ? *ranges : decltype(cover){})
          std::ranges::copy(held, std::back_inserter(cover[entry_name]));
        wanted.emplace_back(name, checkpoint_scope::per_rank);
      }
      if (can_tell) check_cover(cover);
    } else {
      wanted.emplace_back(rank_part_name(rank_), checkpoint_scope::per_rank);
    }
  }
  std::vector<std::filesystem::path> files;
  std::string problems;
  for (const auto& [name, scope] : wanted) {
    const std::filesystem::path path = path_of(name);
    const file_record* record = m.find(name);
    if (!record)
      throw checkpoint_error("checkpoint: " + (where / manifest_name).string() + " lists no " +
                             name);
    part_contents got;
    try {
      got = read_checked_part(path, *record);
    } catch (const checkpoint_error& e) {
      throw damaged_part(e.what());
    }
    std::vector<bool> matched(got.entries.size(), false);
    for (const entry& e : entries_) {
      if (e.scope != scope) continue;
      const auto it = std::ranges::find(got.entries, e.name, &entry_header::name);
      if (it == got.entries.end()) {
        problems += "\n  '" + e.name + "' is registered here and not in the checkpoint";
        continue;
      }
      matched[static_cast<std::size_t>(it - got.entries.begin())] = true;
      const bool same_kind = it->kind == e.kind;
      const bool same_values = e.kind == entry_kind::bytes ||
                               (e.kind == entry_kind::sharded && it->type == e.values.type) ||
                               (it->type == e.values.type && it->bytes == e.values.bytes() &&
                                (it->shape.empty() || e.shape.empty() || it->shape == e.shape));
      if (!same_kind || !same_values) {
        problems += "\n  '" + e.name + "' is " +
                    describe(it->kind, it->type, it->shape, it->bytes) + " in the checkpoint and " +
                    describe(e.kind, e.values.type, e.shape,
                             e.kind == entry_kind::bytes ? 0 : e.values.bytes()) +
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
    throw checkpoint_error("checkpoint: " + where.string() + " does not fit what rank " +
                           std::to_string(rank_) +
                           " registered (another model, or other state):" + problems);
  }
  return files;
}

DTRAIN_DETAIL_INLINE void registry::apply(const std::filesystem::path& path) {
  // (check() read its checksum: this pass reads the values alone.)
  read_part(
      path,
      [&](const entry_header& h, checked_reader& in) {
        const auto it = std::ranges::find(entries_, h.name, &entry::name);
        if (it == entries_.end()) {
          in.skip(h.bytes, "entry '" + h.name + "'");
          return;
        }
        if (it->kind == entry_kind::bytes) {
          std::string bytes(static_cast<std::size_t>(h.bytes), '\0');
          in.read(bytes.data(), h.bytes, "entry '" + h.name + "'");
          it->load(bytes);
        } else if (it->kind == entry_kind::sharded) {
          std::string bytes(static_cast<std::size_t>(h.bytes), '\0');
          in.read(bytes.data(), h.bytes, "entry '" + h.name + "'");
          recut(*it, bytes, path);
        } else {
          in.read(it->values.data, h.bytes, "entry '" + h.name + "'");
        }
      },
      false);
}

DTRAIN_DETAIL_INLINE saved_ranges part_ranges(
    const std::filesystem::path& path, const std::function<bool(const std::string&)>& sharded) {
  std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> out;
  try {
    static_cast<void>(read_part(
        path,
        [&](const entry_header& h, checked_reader& in) {
          std::uint64_t left = h.bytes;
          // A sharded payload: the whole's size, the number of ranges, the ranges
          // (global index, count), then their values (registry::sharded_payload()).
          if (h.kind == entry_kind::sharded && left >= 16 && sharded(h.name)) {
            std::array<std::uint64_t, 2> head{};
            in.read(head.data(), 16, "entry '" + h.name + "'");
            left -= 16;
            if (head[1] > left / 16)
              in.malformed("entry '" + h.name + "' is not a sharded payload");
            std::vector<std::uint64_t> ranges(2 * static_cast<std::size_t>(head[1]));
            in.read(ranges.data(), 16 * head[1], "entry '" + h.name + "'");
            left -= 16 * head[1];
            auto& into = out[h.name];
            for (std::size_t r = 0; r < ranges.size(); r += 2) {
              into.emplace_back(ranges[r], std::min(ranges[r + 1], UINT64_MAX - ranges[r]));
            }
          }
          in.skip(left, "entry '" + h.name + "'");
        },
        false));
  } catch (const std::exception&) {
    return std::nullopt;  // a damaged part: the check of the part names it
  }
  return out;
}

DTRAIN_DETAIL_INLINE bool registry::is_sharded(const std::string& name) const {
  const auto it = std::ranges::find(entries_, name, &entry::name);
  return it != entries_.end() && it->kind == entry_kind::sharded;
}

DTRAIN_DETAIL_INLINE bool registry::needs(const std::filesystem::path& part) const {
  return needs(part_ranges(part, [this](const std::string& name) { return is_sharded(name); }));
}

DTRAIN_DETAIL_INLINE bool registry::needs(const saved_ranges& ranges) const {
  if (!ranges) return true;  // it cannot tell: the part's check says why
  for (const auto& [name, held] : *ranges) {
    const auto it = std::ranges::find(entries_, name, &entry::name);
    if (it == entries_.end() || it->kind != entry_kind::sharded) continue;
    for (const auto& [lo, count] : held) {
      for (const shard_range& mine : it->ranges) {
        if (std::max(lo, mine.global) < std::min(lo + count, mine.global + mine.count)) return true;
      }
    }
  }
  return false;
}

DTRAIN_DETAIL_INLINE std::uint64_t registry::union_size(
    std::vector<std::pair<std::uint64_t, std::uint64_t>> got) {
  std::ranges::sort(got);
  std::uint64_t size = 0;
  std::uint64_t reached = 0;
  for (const auto& [lo, hi] : got) {
    const std::uint64_t from = std::max(lo, reached);
    if (hi > from) size += hi - from;
    reached = std::max(reached, hi);
  }
  return size;
}

DTRAIN_DETAIL_INLINE void registry::check_cover(
    const std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>>& saved)
    const {
  for (const entry& e : entries_) {
    if (e.kind != entry_kind::sharded) continue;
    std::uint64_t needed = 0;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> got;  // of this rank's elements
    for (const shard_range& mine : e.ranges) {
      needed += mine.count;
      if (const auto it = saved.find(e.name); it != saved.end()) {
        for (const auto& [lo, count] : it->second) {
          const std::uint64_t from = std::max(lo, mine.global);
          const std::uint64_t to = std::min(lo + count, mine.global + mine.count);
          if (from < to) got.emplace_back(from, to);
        }
      }
    }
    expect_cover(e, union_size(std::move(got)), needed);
  }
}

DTRAIN_DETAIL_INLINE void registry::expect_cover(const entry& e, std::uint64_t had,
                                                 std::uint64_t needed) const {
  if (had != needed) {
    throw checkpoint_error("checkpoint: sharded entry '" + e.name +
                           "': the checkpoint's ranks held " + std::to_string(had) + " of the " +
                           std::to_string(needed) + " elements rank " + std::to_string(rank_) +
                           " holds now (saved with another cut of the same whole?)");
  }
}

DTRAIN_DETAIL_INLINE void registry::recut(entry& e, std::string_view payload,
                                          const std::filesystem::path& file) {
  const std::size_t element = size_of(e.values.type);
  const dtrain::detail::ckpt::sharded_payload saved =
      parse_sharded(payload, element, "entry '" + e.name + "' of " + file.string());
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

DTRAIN_DETAIL_INLINE void registry::check_recut() const {
  for (const entry& e : entries_) {
    if (e.kind != entry_kind::sharded) continue;
    std::uint64_t needed = 0;
    for (const shard_range& r : e.ranges) needed += r.count;
    // Saved ranges may overlap (every rank held everything): count each element once.
    const auto it = recut_.find(e.name);
    expect_cover(e, it == recut_.end() ? 0 : union_size(it->second), needed);
  }
}

}  // namespace dtrain::detail::ckpt
