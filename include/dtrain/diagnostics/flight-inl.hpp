#pragma once
/// @file
/// The non-template bodies of dtrain/diagnostics/flight.hpp: included by it in
/// header-only mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/diagnostics/flight.hpp, not this file.

#include <dtrain/detail/wire.hpp>
#include <dtrain/diagnostics/flight.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iterator>
#include <map>
#include <system_error>
#include <utility>

namespace dtrain::detail {

namespace flight {
inline constexpr std::string_view magic = "dtrain flight record";
/// A record holds rings of at most a few thousand calls: far below this.
inline constexpr std::uintmax_t most_bytes = 64u << 20;

/// "2026-11-28 18:50:01 UTC"
inline std::string utc(std::int64_t unix_time) {
  const auto t = static_cast<std::time_t>(unix_time);
  std::tm tm{};
  char out[40] = "?";
  if (::gmtime_r(&t, &tm) != nullptr) std::strftime(out, sizeof out, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return out;
}
}  // namespace flight

DTRAIN_DETAIL_INLINE std::string encode_flight_record(const flight_record& record) {
  std::string out(flight::magic);
  wire::writer w(out);
  w.u8(1)
      .i64(record.rank)
      .i64(record.size)
      .bytes32(record.communicator)
      .bytes32(record.host)
      .bytes32(record.reason)
      .i64(record.unix_time)
      .bytes32(encode_rings(record.rings))
      .bytes32(record.note);
  return out;
}

DTRAIN_DETAIL_INLINE flight_record decode_flight_record(std::string_view where,
                                                        std::string_view value) {
  auto bad = [&](const std::string& why) {
    return error(std::string(where) + " is not a whole dtrain flight record (" +
                 std::to_string(value.size()) + " bytes): " + why);
  };
  if (!value.starts_with(flight::magic))
    throw bad("it does not begin with \"dtrain flight record\"");
  flight_record record;
  std::string rings;
  try {
    wire::reader r(value.substr(flight::magic.size()));
    if (const auto version = r.u8("the version"); version != 1) {
      throw wire::violation("version " + std::to_string(version) + " is not 1");
    }
    const std::int64_t rank = r.i64("the rank");
    const std::int64_t size = r.i64("the size");
    if (size < 1 || size > (1 << 24) || rank < 0 || rank >= size) {
      throw wire::violation("rank " + std::to_string(rank) + " of " + std::to_string(size) +
                            " ranks");
    }
    record.rank = static_cast<int>(rank);
    record.size = static_cast<int>(size);
    record.communicator = r.bytes32("the communicator", 256);
    record.host = r.bytes32("the host", 4096);
    record.reason = r.bytes32("the reason", 1 << 16);
    record.unix_time = r.i64("the time");
    rings = r.bytes32("the rings");
    record.note = r.bytes32("the note", 1 << 16);
    r.finish("the record");
  } catch (const wire::violation& e) {
    throw bad(e.what());
  }
  auto decoded = decode_rings(rings);
  if (!decoded) throw bad("its rings are damaged");
  record.rings = std::move(*decoded);
  return record;
}

DTRAIN_DETAIL_INLINE std::filesystem::path flight_record_file(const std::filesystem::path& dir,
                                                              int rank) {
  return dir / ("dtrain_flight_rank" + std::to_string(rank) + ".bin");
}

DTRAIN_DETAIL_INLINE flight_reading read_flight_records(const std::filesystem::path& dir) {
  flight_reading out;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    throw config_error("flight records: cannot list " + dir.string() + ": " + ec.message());
  }
  std::vector<flight_record> records;
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    constexpr std::string_view prefix = "dtrain_flight_rank";
    if (!name.starts_with(prefix) || !name.ends_with(".bin")) continue;
    const std::string where = entry.path().string();
    int rank = -1;
    const char* first = name.data() + prefix.size();
    const char* last = name.data() + name.size() - 4;
    const auto [end, parse] = std::from_chars(first, last, rank);
    if (parse != std::errc{} || end != last) continue;  // not one of ours
    try {
      const std::uintmax_t bytes = std::filesystem::file_size(entry.path());
      if (bytes > flight::most_bytes) {
        throw error(where + " is " + std::to_string(bytes) + " bytes, more than a flight record " +
                    "holds (" + std::to_string(flight::most_bytes) + ")");
      }
      std::ifstream in(entry.path(), std::ios::binary);
      std::string value((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!in.good() && !in.eof()) throw error("cannot read " + where);
      flight_record record = decode_flight_record(where, value);
      if (record.rank != rank) {
        throw error(where + " holds rank " + std::to_string(record.rank) + "'s record, not rank " +
                    std::to_string(rank) + "'s");
      }
      records.push_back(std::move(record));
    } catch (const std::exception& e) {
      out.problems.push_back(std::string(e.what()) + "; not used");
    }
  }
  if (records.empty()) return out;
  // The job is the newest record's: a record of another size or engine is an
  // older job's (or another's) in the same directory.
  const flight_record& newest = *std::max_element(
      records.begin(), records.end(),
      [](const flight_record& a, const flight_record& b) { return a.unix_time < b.unix_time; });
  const int size = newest.size;
  const std::string communicator = newest.communicator;
  std::vector<rank_publication> ranks(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<std::size_t>(r)].rank = r;
  std::int64_t earliest = 0;
  std::int64_t latest = 0;
  std::vector<int> present;
  std::vector<std::pair<std::int64_t, std::string>> asked;  // (when, why) of the ranks that asked
  for (flight_record& record : records) {
    if (record.size != size || record.communicator != communicator) {
      out.problems.push_back(flight_record_file(dir, record.rank).string() + " is of a job of " +
                             std::to_string(record.size) + " ranks on " + record.communicator +
                             ", not the newest record's (" + std::to_string(size) + " on " +
                             communicator + "); not used");
      continue;
    }
    rank_publication& p = ranks[static_cast<std::size_t>(record.rank)];
    p.answered = true;
    p.rings = std::move(record.rings);
    if (!record.reason.empty()) asked.emplace_back(record.unix_time, record.reason);
    earliest = present.empty() ? record.unix_time : std::min(earliest, record.unix_time);
    latest = present.empty() ? record.unix_time : std::max(latest, record.unix_time);
    present.push_back(record.rank);
  }
  std::sort(present.begin(), present.end());
  std::sort(asked.begin(), asked.end());
  std::string why;
  for (const auto& [when, reason] : asked) {
    if (why.find(reason) == std::string::npos) why += (why.empty() ? "" : "; ") + reason;
  }
  if (why.empty()) why = "a round no record's rank asked for";
  const desync_report report = analyse_job(ranks);
  const std::string when = earliest == latest
                               ? flight::utc(latest)
                               : flight::utc(earliest) + " to " + flight::utc(latest);
  const std::string header = "collective diagnostics from the flight records in " + dir.string() +
                             ", after " + why + " (" + communicator + ", " + std::to_string(size) +
                             " ranks; records of " + name_ranks(present) + ", written " + when +
                             ")";
  out.table = format_report(header, report);
  if (!newest.note.empty()) {
    out.table += "  rank " + std::to_string(newest.rank) + "'s note: " + newest.note + "\n";
  }
  out.summary = report.summary;
  return out;
}

}  // namespace dtrain::detail
