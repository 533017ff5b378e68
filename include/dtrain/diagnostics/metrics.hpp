#pragma once
/// @file
/// A rank's metrics as a text file that Prometheus's node-exporter textfile
/// collector reads (the Prometheus text format, version 0.0.4): written
/// whole beside itself and renamed into place, so that a scrape never reads
/// half of one. DistributedDataParallel writes one per rank when
/// DTRAIN_METRICS_DIR (or ddp_options::metrics_dir) names a directory.

#include <dtrain/config.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace dtrain::detail {

/// The text of one file: families of one sample each, every sample with the
/// same labels (`rank="3",node="n1",local_rank="1"`).
class metrics_text {
 public:
  explicit metrics_text(std::string labels) : labels_(std::move(labels)) {}
  /// `name`'s HELP and TYPE ("gauge" or "counter"; a counter's name ends in _total), and its value.
  void add(std::string_view name, std::string_view type, std::string_view help, double value);
  [[nodiscard]] const std::string& str() const noexcept { return text_; }
  /// `value` quoted as a label value (backslash, quote and newline escaped).
  [[nodiscard]] static std::string quoted(std::string_view value);
  /// The labels of a rank's samples: `rank="3",node="vm"` (`node` quoted).
  [[nodiscard]] static std::string labels(int rank, std::string_view node) {
    return "rank=\"" + std::to_string(rank) + "\",node=" + quoted(node);
  }

 private:
  std::string labels_;
  std::string text_;
};

/// Writes `text` to `file` through `file`.tmp and a rename. Throws
/// dtrain::error naming the file, the setting and `rank`.
DTRAIN_DETAIL_INLINE void write_metrics(const std::filesystem::path& file, const std::string& text,
                                        int rank);

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/diagnostics/metrics-inl.hpp>
#endif
