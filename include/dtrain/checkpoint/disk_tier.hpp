#pragma once
/// @file
/// The shared directory's tier (checkpoint_options::dir): every rank writes
/// its part into `DIR/step-<N>.partial`; the ranks agree that all parts were
/// written, and only then rank 0 writes the manifest and renames the
/// directory to `DIR/step-<N>` (a two-phase commit over the control plane);
/// the checkpoints beyond `keep` are removed beside the training after that.
/// An asynchronous save is committed at the next save, restore() or wait().
/// A restore takes the newest step whose manifest and files check out.

#include <dtrain/checkpoint/options.hpp>
#include <dtrain/checkpoint/retention.hpp>
#include <dtrain/checkpoint/tier.hpp>
#include <dtrain/config.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dtrain {

/// The newest checkpoint in `dir` whose manifest and files check out (sizes
/// and checksums), or nullopt. Each newer one that does not is skipped, with a
/// line naming the file and what is wrong appended to `skipped` when given.
/// Throws checkpoint_error when `dir` exists but cannot be read.
DTRAIN_DETAIL_INLINE std::optional<checkpoint_found> latest_checkpoint(
    const std::filesystem::path& dir, std::vector<std::string>* skipped = nullptr);

namespace detail::ckpt {

/// latest_checkpoint()'s look: the newest committed step in `dir` older than
/// `before` (any when nullopt) whose manifest reads and whose files are all
/// there at its sizes, and (`contents`) of its checksums, which reads every
/// file whole.
DTRAIN_DETAIL_INLINE std::optional<checkpoint_found> newest_whole(
    const std::filesystem::path& dir, std::vector<std::string>* skipped,
    std::optional<std::uint64_t> before, bool contents);

/// The shared directory's tier (the file's comment).
class disk_tier final : public tier {
 public:
  explicit disk_tier(tier_context& context);
  ~disk_tier() override;

  [[nodiscard]] std::filesystem::path staging(std::uint64_t step) const override;
  /// Rank 0 writes all of it.
  [[nodiscard]] replicated_share replicated_part() override {
    return {context_.plane.rank() == 0, {}, std::string(replicated_name)};
  }
  /// Rank 0 checks the steps, newest first, naming each one skipped; all hear
  /// its choice. It checks the manifest and the files' sizes: their checksums
  /// are checked by the ranks that load them (files()), a step whose files
  /// are damaged is then skipped for the one before (checkpoint::restore()).
  /// Throws checkpoint_error on every rank when it cannot read the directory.
  [[nodiscard]] std::optional<std::uint64_t> newest(std::int64_t floor,
                                                    const registry& entries) override;
  /// newest(), of the steps older than `before` (any: nullopt).
  [[nodiscard]] std::optional<std::uint64_t> newest_before(std::int64_t floor,
                                                           std::optional<std::uint64_t> before);
  /// The newest committed step by its name alone (nothing read), as rank 0
  /// sees it, on every rank: -1 for none, -2 when rank 0 cannot read the
  /// directory (a restore's own look says why).
  [[nodiscard]] std::int64_t newest_by_name();
  [[nodiscard]] std::vector<std::filesystem::path> files(std::uint64_t step,
                                                         const registry& entries) override;
  [[nodiscard]] std::filesystem::path where(std::uint64_t step) const override;
  [[nodiscard]] std::string resumed(std::uint64_t step) const override;

  /// Waits for rank 0's commit of the last asynchronous save; throws what it could not do.
  void join_committer();

 protected:
  /// Phases 2 and 3: all ranks learn what every rank wrote; rank 0 commits
  /// it (manifest, rename) or removes it; all hear which (asynchronous: rank
  /// 0 commits on a thread, and the next complete() hears it).
  void finish(std::unique_ptr<pending_save> p, bool next_save) override;

 private:
  static std::string not_committed(const std::string& what, const std::string& failed_ranks);
  /// Rank 0: the manifest into the partial directory, which is renamed to
  /// step-<N> (the commit), each fsync'd. Returns the checkpoint's bytes.
  std::uint64_t commit_on_disk(const pending_save& p, const std::vector<std::int64_t>& all);

  std::thread committer_;       // rank 0's commit of an asynchronous save
  std::string commit_failure_;  // what it could not do
  bool warned_slow_writer_ = false;
  cleaner cleaner_;  // removes what retention finds stale
};

}  // namespace detail::ckpt
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/disk_tier-inl.hpp>
#endif
