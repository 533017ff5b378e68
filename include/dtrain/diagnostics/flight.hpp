#pragma once
/// @file
/// Flight records: each rank's ring of last collectives written to a file of
/// its own whenever a diagnostics round runs (a timeout, a failed collective,
/// SIGUSR1), so that the table a live round prints can be printed again after
/// the job, and its store, are gone: `dtrun --flight-records DIR` reads a
/// job's files and analyses them as the live round does (analyse_job).

#include <dtrain/config.hpp>
#include <dtrain/diagnostics/desync.hpp>

#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// A line that a part of the training adds to its rank's flight records
/// (DistributedDataParallel: its straggler watch's last window): set on the
/// training thread, read by the diagnostics thread.
class flight_note {
 public:
  void set(std::string text) {
    const std::lock_guard lock(mutex_);
    text_ = std::move(text);
  }
  [[nodiscard]] std::string get() const {
    const std::lock_guard lock(mutex_);
    return text_;
  }

 private:
  mutable std::mutex mutex_;
  std::string text_;
};

/// What one rank wrote: who it is, why, when, and its rings.
struct flight_record {
  int rank = 0;
  int size = 0;
  std::string communicator;    ///< the engine's name ("gloo")
  std::string host;            ///< the rank's node (DTRAIN_NODE_NAME, else the host name)
  std::string reason;          ///< "a timeout on rank 0", "SIGUSR1 on rank 2"
  std::int64_t unix_time = 0;  ///< seconds since 1970, when it was written
  named_rings rings;
  std::string note;  ///< flight_note's text then (the straggler window); empty: none
};

/// The file's bytes (detail/wire.hpp): the text "dtrain flight record", version
/// u8 (1), rank i64, size i64, communicator, host and reason bytes32, unix
/// time i64, encode_rings' value as bytes32, then the note as bytes32.
DTRAIN_DETAIL_INLINE std::string encode_flight_record(const flight_record& record);

/// The record in `value`; throws dtrain::error naming `where` (the file) and
/// what is wrong when it is not one.
DTRAIN_DETAIL_INLINE flight_record decode_flight_record(std::string_view where,
                                                        std::string_view value);

/// `dir`/dtrain_flight_rank<R>.bin
DTRAIN_DETAIL_INLINE std::filesystem::path flight_record_file(const std::filesystem::path& dir,
                                                              int rank);

/// What a directory of flight records says.
struct flight_reading {
  std::string table;    ///< the diagnostics table, as a live round prints it; empty: no record read
  std::string summary;  ///< its one line
  std::vector<std::string> problems;  ///< files not used, each named with why
};

/// Reads every dtrain_flight_rank<R>.bin in `dir` and analyses them as one
/// job's diagnostics round: the job is the newest record's (its size and
/// communicator); a rank without a record is one that did not answer; a file
/// that is damaged or of another job is named in `problems`, not used. The
/// newest record's note (the straggler window) follows the table.
/// Throws config_error naming `dir` when it cannot be listed.
DTRAIN_DETAIL_INLINE flight_reading read_flight_records(const std::filesystem::path& dir);

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/diagnostics/flight-inl.hpp>
#endif
