#pragma once
/// @file
/// The non-template bodies of dtrain/env/placement.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/env/placement.hpp, not this file.

#include <dtrain/env/placement.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::string node_name(const environment& env) {
  if (auto name = env.get(node_name_variable); name && !name->empty()) return std::string(*name);
  auto host = detail::host_name();
  if (!host) throw error("gethostname failed; set DTRAIN_NODE_NAME");
  return *host;
}

DTRAIN_DETAIL_INLINE std::string node_name_or_unknown(const environment& env) {
  try {
    return node_name(env);
  } catch (const error&) {
    return "?";
  }
}

DTRAIN_DETAIL_INLINE std::string rank_report::encode() const {
  std::string out;
  detail::wire::writer w(out);
  w.bytes32(node_name);
  const auto numbers = slots(self);
  for (std::size_t i = 0; i < numbers.size(); ++i) {
    w.u8(*numbers[i] ? 1 : 0);
    if (*numbers[i]) w.i64(**numbers[i]);
    w.bytes32(self.origin(fields[i]));
  }
  return out;
}

DTRAIN_DETAIL_INLINE rank_report rank_report::decode(std::string_view text,
                                                     const std::string& where) {
  return detail::wire::decode_value(where, text, "a rank report", [](detail::wire::reader& in) {
    rank_report r;
    r.node_name = in.bytes32("the node name");
    const auto numbers = slots(r.self);
    for (std::size_t i = 0; i < numbers.size(); ++i) {
      const char* name = world::field_names[static_cast<std::size_t>(fields[i])].data();
      const std::uint8_t known = in.u8(name);
      if (known > 1)
        throw detail::wire::violation(std::string(name) + "'s known flag is not 0 or 1");
      if (known == 1) {
        const std::int64_t value = in.i64(name);
        if (value < 0 || value > max_world_size) {
          throw detail::wire::violation(std::string(name) + " " + std::to_string(value) +
                                        " is not in 0.." + std::to_string(max_world_size));
        }
        *numbers[i] = static_cast<int>(value);
      }
      r.self.origins[static_cast<std::size_t>(fields[i])] = in.bytes32(name);
    }
    return r;
  });
}

DTRAIN_DETAIL_INLINE std::string encode_placements(const std::vector<placement>& ranks) {
  std::string out;
  detail::wire::writer w(out);
  w.u8(1).u32(static_cast<std::uint32_t>(ranks.size()));
  for (const placement& p : ranks)
    w.i64(p.node_rank).i64(p.num_nodes).i64(p.local_rank).i64(p.local_world_size);
  return out;
}

DTRAIN_DETAIL_INLINE std::string encode_placement_error(std::string_view message) {
  std::string out;
  detail::wire::writer(out).u8(0).bytes32(message);
  return out;
}

DTRAIN_DETAIL_INLINE placement decode_placement(const std::string& where, std::string_view value,
                                                int rank, int size) {
  std::optional<std::string> failure;
  placement mine =
      detail::wire::decode_value(where, value, "a placement table", [&](detail::wire::reader& in) {
        placement out;
        if (in.u8("the ok flag") == 0) {
          failure = in.bytes32("rank 0's error");
          return out;
        }
        const std::uint32_t n = in.u32("the rank count");
        if (static_cast<std::int64_t>(n) != size) {
          throw detail::wire::violation("it places " + std::to_string(n) + " ranks, not " +
                                        std::to_string(size));
        }
        for (std::uint32_t r = 0; r < n; ++r) {
          std::int64_t f[4];
          for (std::int64_t& v : f) {
            v = in.i64("a placement");
            if (v < 0 || v > max_world_size)
              throw detail::wire::violation("a placement field is " + std::to_string(v));
          }
          if (static_cast<int>(r) == rank) {
            out = {static_cast<int>(f[0]), static_cast<int>(f[1]), static_cast<int>(f[2]),
                   static_cast<int>(f[3])};
          }
        }
        return out;
      });
  if (failure) throw config_error(*failure);
  return mine;
}

DTRAIN_DETAIL_INLINE std::vector<placement> place_ranks(const std::vector<rank_report>& reports) {
  const int n = static_cast<int>(reports.size());
  for (std::size_t r = 0; r < reports.size(); ++r) {
    const auto& ws = reports[r].self.world_size;
    if (ws && *ws != n) {
      throw config_error("rank " + std::to_string(r) + " says the world has " +
                         std::to_string(*ws) + " ranks (" +
                         reports[r].self.origin(world::field::world_size) + "), but " +
                         std::to_string(n) + " ranks met at rendezvous");
    }
  }
  std::vector<placement> out(static_cast<std::size_t>(n));
  bool all_complete = true;
  for (const auto& r : reports) all_complete = all_complete && r.placed();
  if (all_complete) {
    for (std::size_t r = 0; r < reports.size(); ++r) {
      const world& w = reports[r].self;
      out[r] = {*w.node_rank, *w.num_nodes, *w.local_rank, *w.local_world_size};
    }
    return out;
  }
  std::map<std::string, int> node_of;  // node name -> node index
  std::vector<int> node_size;
  for (std::size_t r = 0; r < reports.size(); ++r) {
    auto [it, fresh] =
        node_of.try_emplace(reports[r].node_name, static_cast<int>(node_size.size()));
    if (fresh) node_size.push_back(0);
    out[r].node_rank = it->second;
    out[r].local_rank = node_size[static_cast<std::size_t>(it->second)]++;
  }
  for (std::size_t r = 0; r < reports.size(); ++r) {
    out[r].num_nodes = static_cast<int>(node_size.size());
    out[r].local_world_size = node_size[static_cast<std::size_t>(out[r].node_rank)];
  }
  // A field the launcher did give must match: otherwise the node names are wrong.
  for (std::size_t r = 0; r < reports.size(); ++r) {
    const world& w = reports[r].self;
    auto check = [&](world::field f, const std::optional<int>& known, int grouped,
                     std::string_view what) {
      if (known && *known != grouped) {
        throw config_error("rank " + std::to_string(r) + ": " + w.origin(f) + " gives " +
                           std::string(what) + " " + std::to_string(*known) +
                           ", but grouping the ranks by node name (\"" + reports[r].node_name +
                           "\", the host name unless DTRAIN_NODE_NAME is set) gives " +
                           std::to_string(grouped) +
                           "; give every node a distinct DTRAIN_NODE_NAME, or set NODE_RANK");
      }
    };
    check(world::field::local_rank, w.local_rank, out[r].local_rank, "local rank");
    check(world::field::local_world_size, w.local_world_size, out[r].local_world_size,
          "local world size");
    check(world::field::node_rank, w.node_rank, out[r].node_rank, "node rank");
    check(world::field::num_nodes, w.num_nodes, out[r].num_nodes, "node count");
  }
  return out;
}

}  // namespace dtrain
