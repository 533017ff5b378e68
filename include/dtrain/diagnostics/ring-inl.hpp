#pragma once
/// @file
/// The non-template bodies of dtrain/diagnostics/ring.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/diagnostics/ring.hpp, not this file.

#include <dtrain/diagnostics/ring.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE call_label& current_call_label() noexcept {
  thread_local call_label label;
  return label;
}

DTRAIN_DETAIL_INLINE std::string describe_call(const call_record& r, bool with_op) {
  std::string out = r.kind + "(";
  if (with_op && r.op >= 0) out += std::string(to_string(static_cast<reduce_op>(r.op))) + ", ";
  if (r.kind != "barrier")
    out += std::string(to_string(r.type)) + " \u00d7 " + std::to_string(r.count);
  if (r.root >= 0) out += ", root " + std::to_string(r.root);
  if (!r.label.empty()) out += (r.kind != "barrier" ? ", " : "") + r.label;
  return out + ")";
}

DTRAIN_DETAIL_INLINE std::shared_ptr<collective_ring> collective_ring::make_child(int color) {
  std::lock_guard lock(mutex_);
  auto child = std::make_shared<collective_ring>(name_ + "/split " + std::to_string(++splits_) +
                                                 " (color " + std::to_string(color) + ")");
  if (children_.size() == kept_splits) children_.erase(children_.begin());
  children_.push_back(child);
  return child;
}

DTRAIN_DETAIL_INLINE std::vector<std::pair<std::string, std::vector<call_record>>>
collective_ring::snapshot_all() const {
  std::vector<std::pair<std::string, std::vector<call_record>>> out;
  out.emplace_back(name_, snapshot());
  std::vector<std::shared_ptr<collective_ring>> children;
  {
    std::lock_guard lock(mutex_);
    children = children_;
  }
  for (const auto& ring : children) {
    for (auto& entry : ring->snapshot_all()) out.push_back(std::move(entry));
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::int64_t collective_ring::issue(std::string_view kind, dtype type,
                                                         std::size_t count, int op, int root) {
  const call_label label = current_call_label();
  std::lock_guard lock(mutex_);
  const std::int64_t seq = ++last_;
  call_record& r = slots_[static_cast<std::size_t>(seq) % capacity];
  r.seq = seq;
  r.kind.assign(kind);  // short names: no allocation (small-string buffer)
  r.type = type;
  r.count = count;
  r.op = op;
  r.root = root;
  r.label.clear();
  if (label.what) r.label.append(label.what).append(" ").append(std::to_string(label.index));
  r.state = call_state::issued;
  return seq;
}

DTRAIN_DETAIL_INLINE void collective_ring::settle(std::int64_t seq, call_state state) noexcept {
  std::lock_guard lock(mutex_);
  call_record& r = slots_[static_cast<std::size_t>(seq) % capacity];
  if (r.seq == seq && r.state == call_state::issued) r.state = state;
}

DTRAIN_DETAIL_INLINE std::vector<call_record> collective_ring::snapshot() const {
  std::lock_guard lock(mutex_);
  std::vector<call_record> out;
  const std::int64_t first = last_ >= static_cast<std::int64_t>(capacity)
                                 ? last_ - static_cast<std::int64_t>(capacity) + 1
                                 : 1;
  for (std::int64_t s = first; s <= last_; ++s)
    out.push_back(slots_[static_cast<std::size_t>(s) % capacity]);
  return out;
}

DTRAIN_DETAIL_INLINE std::int64_t collective_ring::last() const {
  std::lock_guard lock(mutex_);
  return last_;
}

}  // namespace dtrain::detail
