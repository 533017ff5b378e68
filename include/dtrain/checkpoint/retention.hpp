#pragma once
/// @file
/// What a checkpoint directory keeps: its committed steps, found by name, and
/// what no resume can use any more (steps beyond the newest kept ones, steps
/// numbered after the newest, saves that died), removed by each tier its own
/// way: the shared directory's beside the training, a memory copy's at once.

#include <dtrain/checkpoint/format.hpp>
#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace dtrain::detail::ckpt {

/// The committed step directories of `dir` named `step-<N><suffix>` (by
/// name, unchecked), newest first; none when `dir` does not exist. Throws
/// checkpoint_error when it cannot be read.
DTRAIN_DETAIL_INLINE std::vector<std::pair<std::uint64_t, std::filesystem::path>> committed_steps(
    const std::filesystem::path& dir, std::string_view suffix = {});

/// What no resume can use any more of the copies named `step-<N><suffix>` in
/// `dir`: committed steps beyond the newest `keep` up to `newest`, steps
/// numbered after it (left by a run that this one resumed before), saves
/// that died (`.partial`, up to `newest`: a later one may be in flight), and
/// what an earlier removal left (`.removing`, `.replaced`); directories
/// only (anything else is not a checkpoint's). Unreadable: none.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::vector<std::filesystem::path> stale_steps(
    const std::filesystem::path& dir, std::uint64_t newest, int keep, std::string_view suffix = {});

/// Creates `dir` (and its parents); with `fresh`, `dir` itself must not exist yet.
DTRAIN_DETAIL_INLINE void make_directory(const std::filesystem::path& dir, bool fresh);
/// Removes `path` and what is under it; throws checkpoint_error naming it when it cannot.
DTRAIN_DETAIL_INLINE void remove_checkpoint_tree(const std::filesystem::path& path);

/// Removes directories on a thread beside the training, one batch at a time
/// (the next batch waits for the one before); each is renamed to
/// NAME.removing first, so that no resume reads it. What it cannot remove
/// is said through `say`, not thrown: the checkpoint that made it stale is committed.
class cleaner {
 public:
  explicit cleaner(std::function<void(const std::string&)> say) : say_(std::move(say)) {}
  cleaner(const cleaner&) = delete;
  cleaner& operator=(const cleaner&) = delete;
  ~cleaner() { join(); }

  void remove(const std::vector<std::filesystem::path>& stale);
  void join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::function<void(const std::string&)> say_;
  std::thread thread_;
};

}  // namespace dtrain::detail::ckpt

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/retention-inl.hpp>
#endif
