#pragma once
/// @file
/// The non-template bodies of dtrain/ddp/timeline.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/ddp/timeline.hpp, not this file.

#include <dtrain/ddp/timeline.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string timeline_file(std::string_view path, int rank) {
  const std::size_t slash = path.rfind('/');
  const std::size_t name = slash == std::string_view::npos ? 0 : slash + 1;
  const std::size_t dot = path.rfind('.');
  const std::string tag = ".rank" + std::to_string(rank);
  if (dot == std::string_view::npos || dot <= name) return std::string(path) + tag + ".json";
  return std::string(path.substr(0, dot)) + tag + std::string(path.substr(dot));
}

DTRAIN_DETAIL_INLINE timeline::timeline(std::string_view path, int rank, int size,
                                        std::vector<std::string> parameter_names)
    : state_(std::make_unique<state>()) {
  state_->file = timeline_file(path, rank);
  state_->setting = std::string(timeline_variable) + "=" + std::string(path);
  state_->rank = rank;
  state_->size = size;
  state_->names = std::move(parameter_names);
  if (std::FILE* f = std::fopen(state_->file.c_str(), "w")) {
    std::fclose(f);
  } else {
    throw config_error(state_->setting + ": rank " + std::to_string(rank) + " cannot write " +
                       state_->file + ": " + std::strerror(errno));
  }
}

DTRAIN_DETAIL_INLINE std::int64_t timeline::now() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

DTRAIN_DETAIL_INLINE std::uint64_t timeline::bucket_launched(std::size_t bucket,
                                                             std::size_t elements) {
  if (!state_) return 0;
  const std::uint64_t id = ++state_->launches;
  append(
      track::training,
      {.what = kind::bucket_begin, .start = now(), .index = bucket, .detail = elements, .id = id});
  return id;
}

DTRAIN_DETAIL_INLINE void timeline::bucket_done(std::size_t bucket, std::uint64_t id,
                                                std::int64_t started, bool on_thread) {
  if (!state_) return;
  const std::int64_t end = now();
  if (on_thread) {
    append(track::communication,
           {.what = kind::reduce, .start = started, .end = end, .index = bucket});
  }
  append(track::communication, {.what = kind::bucket_end, .start = end, .index = bucket, .id = id});
}

DTRAIN_DETAIL_INLINE void timeline::device_done(std::size_t bucket, std::uint64_t id,
                                                std::int64_t start, std::int64_t end) {
  if (!state_) return;
  append(track::device, {.what = kind::device, .start = start, .end = end, .index = bucket});
  append(track::communication, {.what = kind::bucket_end, .start = end, .index = bucket, .id = id});
}

DTRAIN_DETAIL_INLINE void timeline::device_clock(std::int64_t uncertainty_ns) {
  if (state_) state_->device_clock = uncertainty_ns;
}

DTRAIN_DETAIL_INLINE void timeline::write() const {
  if (!state_) return;
  const std::string text = render();
  std::FILE* f = std::fopen(state_->file.c_str(), "w");
  bool ok = f != nullptr && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int code = errno;
  if (f != nullptr && std::fclose(f) != 0) ok = false;
  if (!ok) {
    throw error("rank " + std::to_string(state_->rank) + " could not write its timeline to " +
                state_->file + " (" + state_->setting + "): " + std::strerror(code));
  }
}

DTRAIN_DETAIL_INLINE void timeline::write_at_exit() const noexcept {
  try {
    write();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] dtrain: %s\n", state_->rank, e.what());
  }
}

DTRAIN_DETAIL_INLINE void timeline::append(track t, const event& e) {
  buffer& b = state_->tracks[static_cast<std::size_t>(t) - 1];
  std::lock_guard lock(b.mutex);
  if (b.count < max_events) {
    if (b.chunks.empty() || b.chunks.back().size() == chunk_events) {
      b.chunks.emplace_back().reserve(chunk_events);
    }
    b.chunks.back().push_back(e);
    ++b.count;
  } else {
    ++b.dropped;
  }
}

DTRAIN_DETAIL_INLINE void timeline::mark_done(std::int64_t start, std::uint64_t index,
                                              std::uint64_t bucket) {
  if (state_->step_start < 0) state_->step_start = start;
  append(track::training,
         {.what = kind::mark, .start = start, .end = now(), .index = index, .detail = bucket});
}

DTRAIN_DETAIL_INLINE void timeline::synchronize_done(std::int64_t start, std::uint64_t step,
                                                     std::uint64_t) {
  const std::int64_t end = now();
  append(track::training, {.what = kind::synchronize, .start = start, .end = end, .index = step});
  // A step runs from its first mark_ready (or synchronize(), when it marked them all) to here.
  const std::int64_t from =
      state_->step_start >= 0 && state_->step_start < start ? state_->step_start : start;
  append(track::training, {.what = kind::step, .start = from, .end = end, .index = step});
  state_->step_start = -1;
}

DTRAIN_DETAIL_INLINE void timeline::microseconds(std::string& out, std::int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof text, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000));
  out += text;
}

DTRAIN_DETAIL_INLINE std::string timeline::name_of(const event& e) const {
  switch (e.what) {
    case kind::step: return "step " + std::to_string(e.index);
    case kind::mark:
      return e.index < state_->names.size() ? state_->names[e.index]
                                            : "parameter #" + std::to_string(e.index);
    case kind::synchronize: return "synchronize";
    case kind::wait: return "wait for buckets";
    case kind::reduce: return "allreduce bucket " + std::to_string(e.index);
    case kind::bucket_begin:
    case kind::bucket_end: return "bucket " + std::to_string(e.index);
    case kind::device: return "bucket " + std::to_string(e.index) + " on the device";
  }
  return "?";
}

DTRAIN_DETAIL_INLINE const char* timeline::category_of(kind k) {
  switch (k) {
    case kind::step: return "step";
    case kind::mark: return "mark_ready";
    case kind::synchronize:
    case kind::wait: return "synchronize";
    case kind::reduce:
    case kind::bucket_begin:
    case kind::bucket_end: return "bucket";
    case kind::device: return "device";
  }
  return "?";
}

DTRAIN_DETAIL_INLINE void timeline::render_event(std::string& out, track t, const event& e) const {
  out += ",\n{\"name\":";
  json::write_string(out, name_of(e));
  out += ",\"cat\":\"";
  out += category_of(e.what);
  out += "\",\"pid\":" + std::to_string(state_->rank) +
         ",\"tid\":" + std::to_string(static_cast<int>(t)) + ",\"ts\":";
  microseconds(out, e.start);
  if (e.what == kind::bucket_begin || e.what == kind::bucket_end) {
    out += e.what == kind::bucket_begin ? ",\"ph\":\"b\"" : ",\"ph\":\"e\"";
    out += ",\"id\":" + std::to_string(e.id);
  } else {
    out += ",\"ph\":\"X\",\"dur\":";
    microseconds(out, e.end - e.start);
  }
  switch (e.what) {
    case kind::mark:
      out += ",\"args\":{\"index\":" + std::to_string(e.index) +
             ",\"bucket\":" + std::to_string(e.detail) + "}";
      break;
    case kind::bucket_begin:
      out += ",\"args\":{\"elements\":" + std::to_string(e.detail) + "}";
      break;
    case kind::wait: out += ",\"args\":{\"buckets\":" + std::to_string(e.detail) + "}"; break;
    case kind::device: out += ",\"args\":{\"bucket\":" + std::to_string(e.index) + "}"; break;
    default: break;
  }
  out += "}";
}

DTRAIN_DETAIL_INLINE void timeline::metadata(std::string& out, const char* what, int tid,
                                             std::string_view name) const {
  out += ",\n{\"name\":\"";
  out += what;
  out += "\",\"ph\":\"M\",\"pid\":" + std::to_string(state_->rank) +
         ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":";
  json::write_string(out, name);
  out += "}}";
}

DTRAIN_DETAIL_INLINE std::string timeline::render() const {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"generator\":\"dtrain\",";
  std::size_t dropped = 0;
  for (const buffer& b : state_->tracks) {
    std::lock_guard lock(b.mutex);
    dropped += b.dropped;
  }
  out += "\"rank\":" + std::to_string(state_->rank) +
         ",\"world_size\":" + std::to_string(state_->size) +
         ",\"dropped_events\":" + std::to_string(dropped);
  if (state_->device_clock >= 0) {
    // The device track's times are tied to the host's clock within this.
    out += ",\"device_clock_uncertainty_us\":";
    microseconds(out, state_->device_clock);
  }
  out += "},\n\"traceEvents\":[";
  out += "\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + std::to_string(state_->rank) +
         ",\"tid\":0,\"args\":{\"sort_index\":" + std::to_string(state_->rank) + "}}";
  metadata(out, "process_name", 0, "rank " + std::to_string(state_->rank));
  metadata(out, "thread_name", static_cast<int>(track::training), "training");
  metadata(out, "thread_name", static_cast<int>(track::communication), "communication");
  if (state_->device_clock >= 0)
    metadata(out, "thread_name", static_cast<int>(track::device), "device");
  for (std::size_t t = 0; t < state_->tracks.size(); ++t) {
    const buffer& b = state_->tracks[t];
    std::lock_guard lock(b.mutex);
    for (const std::vector<event>& chunk : b.chunks) {
      for (const event& e : chunk) render_event(out, static_cast<track>(t + 1), e);
    }
  }
  out += "\n]}\n";
  return out;
}

}  // namespace dtrain::detail
