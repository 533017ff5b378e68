#pragma once
/// @file
/// The non-template bodies of dtrain/env/world.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/env/world.hpp, not this file.

#include <dtrain/env/world.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::string world::describe() const {
  std::string out = "dtrain world from ";
  out += to_string(source);
  if (role != process_role::worker) {
    out += " (";
    out += to_string(role);
    out += ')';
  }
  out += ':';
  std::array<std::string, field_count> values;
  const std::array<const std::optional<int>*, 6> numbers{
      &rank, &world_size, &local_rank, &local_world_size, &node_rank, &num_nodes};
  for (std::size_t i = 0; i < numbers.size(); ++i) {
    values[i] = *numbers[i] ? std::to_string(**numbers[i]) : "?";
  }
  values[6] = master_addr.value_or("?");
  values[7] = master_port ? std::to_string(*master_port) : "?";
  // Consecutive fields with one origin share one parenthesis.
  for (std::size_t i = 0; i < field_count; ++i) {
    out += i == 0 ? " " : ", ";
    out += field_names[i];
    out += '=';
    out += values[i];
    if (i + 1 == field_count || origins[i + 1] != origins[i]) {
      out += origins[i].empty() ? std::string(" (unknown)") : " (" + origins[i] + ")";
    }
  }
  if (!notes.empty()) {
    out += "\n  note: ";
    out += notes;
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::string to_json(const world& w) {
  std::string out = "{";
  auto key = [&](std::string_view name) {
    if (out.size() > 1) out += ',';
    detail::json::write_string(out, name);
    out += ':';
  };
  auto number = [&](std::string_view name, const std::optional<int>& v) {
    key(name);
    out += v ? std::to_string(*v) : "null";
  };
  number("rank", w.rank);
  number("world_size", w.world_size);
  number("local_rank", w.local_rank);
  number("local_world_size", w.local_world_size);
  number("node_rank", w.node_rank);
  number("num_nodes", w.num_nodes);
  key("master_addr");
  if (w.master_addr) {
    detail::json::write_string(out, *w.master_addr);
  } else {
    out += "null";
  }
  number("master_port", w.master_port);
  key("source");
  detail::json::write_string(out, to_string(w.source));
  if (w.role != process_role::worker) {
    key("role");
    detail::json::write_string(out, to_string(w.role));
  }
  out += '}';
  return out;
}

}  // namespace dtrain
