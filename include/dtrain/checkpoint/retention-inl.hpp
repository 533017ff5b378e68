#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/retention.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/retention.hpp, not this file.

#include <dtrain/checkpoint/retention.hpp>

#include <algorithm>
#include <cstring>
#include <system_error>

namespace dtrain::detail::ckpt {

namespace retention_detail {
/// The step of `name` when it is `step-<N><suffix><tail>`.
inline std::optional<std::uint64_t> step_with(std::string_view name, std::string_view suffix,
                                              std::string_view tail = {}) {
  if (!name.ends_with(tail)) return std::nullopt;
  name.remove_suffix(tail.size());
  if (!name.ends_with(suffix)) return std::nullopt;
  name.remove_suffix(suffix.size());
  return step_of(name);
}
}  // namespace retention_detail

DTRAIN_DETAIL_INLINE std::vector<std::pair<std::uint64_t, std::filesystem::path>> committed_steps(
    const std::filesystem::path& dir, std::string_view suffix) {
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
    if (auto step = retention_detail::step_with(it->path().filename().string(), suffix)) {
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

DTRAIN_DETAIL_INLINE std::vector<std::filesystem::path> stale_steps(
    const std::filesystem::path& dir, std::uint64_t newest, int keep, std::string_view suffix) {
  std::vector<std::uint64_t> kept;
  std::vector<std::filesystem::path> stale;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code not_a_directory;
    if (!it->is_directory(not_a_directory)) continue;  // not a checkpoint's: left alone
    const std::string name = it->path().filename().string();
    if (auto step = retention_detail::step_with(name, suffix)) {
      if (*step > newest) {
        stale.push_back(it->path());
      } else {
        kept.push_back(*step);
      }
    } else if (name.ends_with(".replaced") || name.ends_with(".removing")) {
      // What an earlier removal left: a step, or a save that died, renamed.
      std::string_view was = std::string_view(name).substr(0, name.size() - 9);
      if (was.ends_with(partial_suffix)) was.remove_suffix(partial_suffix.size());
      if (retention_detail::step_with(was, suffix)) stale.push_back(it->path());
    } else if (auto died = retention_detail::step_with(name, suffix, partial_suffix)) {
      if (*died <= newest) stale.push_back(it->path());
    }
  }
  std::sort(kept.begin(), kept.end(), std::greater<>());
  for (std::size_t i = static_cast<std::size_t>(std::max(keep, 0)); i < kept.size(); ++i) {
    stale.push_back(dir / (step_name(kept[i]) + std::string(suffix)));
  }
  return stale;
}

DTRAIN_DETAIL_INLINE void make_directory(const std::filesystem::path& dir, bool fresh) {
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

DTRAIN_DETAIL_INLINE void remove_checkpoint_tree(const std::filesystem::path& path) {
  if (const int err = remove_tree(path.c_str()); err != 0) {
    throw checkpoint_error("checkpoint: cannot remove " + path.string() + ": " +
                           std::strerror(err));
  }
}

DTRAIN_DETAIL_INLINE void cleaner::remove(const std::vector<std::filesystem::path>& stale) {
  join();
  std::vector<std::filesystem::path> doomed;
  std::error_code ec;
  for (const std::filesystem::path& path : stale) {
    if (path.string().ends_with(".removing")) {
      doomed.push_back(path);
      continue;
    }
    const std::filesystem::path renamed = path.string() + ".removing";
    std::filesystem::rename(path, renamed, ec);
    if (ec) {
      say_("could not remove " + path.string() + ": " + ec.message());
    } else {
      doomed.push_back(renamed);
    }
  }
  if (doomed.empty()) return;
  thread_ = std::thread([this, doomed = std::move(doomed)] {
    for (const std::filesystem::path& path : doomed) {
      if (const int err = detail::remove_tree(path.c_str()); err != 0) {
        say_("could not remove " + path.string() + ": " + std::strerror(err));
      }
    }
  });
}

}  // namespace dtrain::detail::ckpt
