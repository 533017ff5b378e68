#pragma once
/// @file
/// The non-template bodies of dtrain/diagnostics/desync.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/diagnostics/desync.hpp, not this file.

#include <dtrain/diagnostics/desync.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string name_ranks(std::span<const int> ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}
}  // namespace dtrain::detail

namespace dtrain::detail {
namespace desync {

DTRAIN_DETAIL_INLINE std::string at(const call_record& r, bool with_op) {
  // Appended, not `"#" + std::to_string(...)`: GCC 12 reports a false -Wrestrict for that shape
  // at -O2 (bug 105329), which users' -Werror builds would turn into an error.
  std::string out = "#";
  out += std::to_string(r.seq);
  out += ' ';
  out += describe_call(r, with_op);
  return out;
}

DTRAIN_DETAIL_INLINE std::string difference(const call_record& a, const call_record& b) {
  if (a.kind != b.kind) return "the collectives differ";
  if (a.type != b.type) return "the types differ";
  if (a.count != b.count) return "the sizes differ";
  if (a.op != b.op) return "the reduce ops differ";
  return "the roots differ";
}

DTRAIN_DETAIL_INLINE std::vector<call_group> group_calls(std::span<const rank_ring> rings,
                                                         std::int64_t seq) {
  std::vector<call_group> groups;
  for (const rank_ring& r : rings) {
    for (const call_record& c : r.calls) {
      if (c.seq != seq) continue;
      auto same = std::find_if(groups.begin(), groups.end(),
                               [&](const call_group& g) { return g.call->same_call(c); });
      if (same == groups.end()) {
        groups.push_back({&c, {r.rank}});
      } else {
        same->ranks.push_back(r.rank);
      }
    }
  }
  std::stable_sort(groups.begin(), groups.end(), [](const call_group& a, const call_group& b) {
    return a.ranks.size() > b.ranks.size();
  });
  return groups;
}
}  // namespace desync
}  // namespace dtrain::detail

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE desync_report analyse(std::span<const rank_ring> rings) {
  desync_report report;
  std::vector<int> silent;
  std::vector<const rank_ring*> live;
  for (const rank_ring& r : rings) {
    if (r.answered) {
      live.push_back(&r);
    } else {
      silent.push_back(r.rank);
    }
  }
  auto top = [](const rank_ring& r) -> std::int64_t {
    return r.calls.empty() ? 0 : r.calls.back().seq;
  };

  // One row per rank: the last collective it issued and how far it got.
  for (const rank_ring& r : rings) {
    std::string row = "rank " + std::to_string(r.rank) + ": ";
    if (!r.answered) {
      row += "no answer (process gone, or frozen where its diagnostics thread cannot run)";
    } else if (r.calls.empty()) {
      row += "no collective issued yet";
    } else {
      const call_record& last = r.calls.back();
      row += desync::at(last) + " " + std::string(to_string(last.state));
      if (r.calls.size() > 1) {
        const call_record& before = r.calls[r.calls.size() - 2];
        row +=
            " (before it " + desync::at(before) + " " + std::string(to_string(before.state)) + ")";
      }
    }
    report.details.push_back(std::move(row));
  }

  // Sequence numbers called with different arguments, oldest first.
  std::string mismatch;
  std::int64_t lowest = 0, highest = 0;
  for (const rank_ring* r : live) {
    if (r->calls.empty()) continue;
    lowest = lowest == 0 ? r->calls.front().seq : std::min(lowest, r->calls.front().seq);
    highest = std::max(highest, top(*r));
  }
  for (std::int64_t seq = lowest; seq > 0 && seq <= highest; ++seq) {
    auto groups = desync::group_calls(rings, seq);
    if (groups.size() < 2) continue;
    bool ops = false;
    for (const auto& g : groups) ops = ops || g.call->op != groups[0].call->op;
    std::string line;
    for (std::size_t i = groups.size(); i-- > 0;) {  // the odd ones out first
      if (!line.empty()) line += "; ";
      line += name_ranks(groups[i].ranks);
      line += groups[i].ranks.size() == 1 ? " is in " : " are in ";
      line += desync::at(*groups[i].call, ops);
    }
    line += ": " + desync::difference(*groups.back().call, *groups[0].call) +
            " for the same collective";
    report.details.push_back("mismatch: " + line);
    if (mismatch.empty()) mismatch = line;
  }

  // The rank(s) behind: the lowest last sequence number among those that answered.
  std::string behind;
  if (!live.empty()) {
    std::int64_t low = top(*live.front()), high = low;
    for (const rank_ring* r : live) {
      low = std::min(low, top(*r));
      high = std::max(high, top(*r));
    }
    if (low < high) {
      std::vector<int> late, waiting, past;
      const call_record* missing = nullptr;
      const call_record* last_late = nullptr;
      for (const rank_ring* r : live) {
        if (top(*r) == low) {
          late.push_back(r->rank);
          if (!r->calls.empty() && !last_late) last_late = &r->calls.back();
          continue;
        }
        for (const call_record& c : r->calls) {
          if (c.seq != low + 1) continue;
          if (!missing) missing = &c;
          (c.state == call_state::completed ? past : waiting).push_back(r->rank);
        }
      }
      const bool one = late.size() == 1;
      behind = name_ranks(late) + (one ? " is at " : " are at ") +
               (last_late ? desync::at(*last_late) : std::string("no collective yet"));
      if (!waiting.empty())
        behind += "; " + name_ranks(waiting) + (waiting.size() == 1 ? " waits in " : " wait in ");
      if (waiting.empty() && !past.empty()) behind += "; " + name_ranks(past) + " finished ";
      if (missing) {
        behind += desync::at(*missing);
      } else {
        behind += "; the others are past #" + std::to_string(low + 1) + " (it left their rings)";
      }
      behind += ": " + name_ranks(late) + " never started #" + std::to_string(low + 1);
    }
  }

  std::string gone;
  if (!silent.empty()) {
    gone = name_ranks(silent) + " did not answer (process gone, or frozen)";
    std::vector<int> waiting;
    const call_record* in = nullptr;
    for (const rank_ring* r : live) {
      if (r->calls.empty() || r->calls.back().state == call_state::completed) continue;
      waiting.push_back(r->rank);
      if (!in) in = &r->calls.back();
    }
    if (in)
      gone += "; " + name_ranks(waiting) + (waiting.size() == 1 ? " waits in " : " wait in ") +
              desync::at(*in);
  }

  if (!mismatch.empty()) {
    report.summary = mismatch;
    report.severity = 4;
  } else if (!behind.empty()) {
    report.summary = behind;
    report.severity = 3;
  } else if (!gone.empty()) {
    report.summary = gone;
    report.severity = gone.find(" wait") != std::string::npos ? 2 : 1;
  } else if (!live.empty() && !live.front()->calls.empty()) {
    const call_record& last = live.front()->calls.back();
    report.summary =
        "every rank is at " + desync::at(last) + ": none is behind, and the calls match";
  } else {
    report.summary = "no rank has issued a collective yet";
  }
  if (!gone.empty() && report.summary != gone) report.details.push_back("also: " + gone);
  return report;
}

DTRAIN_DETAIL_INLINE std::string format_report(std::string_view header,
                                               const desync_report& report) {
  std::string out = "dtrain: " + std::string(header) + "\n  " + report.summary + "\n";
  for (const std::string& d : report.details) out += "    " + d + "\n";
  return out;
}

DTRAIN_DETAIL_INLINE std::string encode_rings(const named_rings& rings) {
  std::string out;
  wire::writer w(out);
  w.u8(1).u32(static_cast<std::uint32_t>(rings.size()));
  for (const auto& [name, calls] : rings) {
    w.bytes32(name).u32(static_cast<std::uint32_t>(calls.size()));
    for (const call_record& c : calls) {
      w.i64(c.seq)
          .bytes32(c.kind)
          .u8(static_cast<std::uint8_t>(c.type))
          .u64(c.count)
          .i64(c.op)
          .i64(c.root)
          .u8(static_cast<std::uint8_t>(c.state))
          .bytes32(c.label);
    }
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::optional<named_rings> decode_rings(std::string_view value) {
  try {
    return wire::decode_value("a diagnostics ring", value, "rings", [](wire::reader& r) {
      if (const auto version = r.u8("the version"); version != 1) {
        throw wire::violation("version " + std::to_string(version) + " is not 1");
      }
      named_rings rings;
      const std::uint32_t count = r.u32("the ring count");
      for (std::uint32_t i = 0; i < count; ++i) {
        auto& [name, calls] =
            rings.emplace_back(std::string(r.bytes32("a ring's name")), std::vector<call_record>{});
        const std::uint32_t n = r.u32("the call count");
        for (std::uint32_t k = 0; k < n; ++k) {
          call_record c;
          c.seq = r.i64("seq");
          c.kind = r.bytes32("kind");
          const std::uint8_t type = r.u8("type");
          if (type > static_cast<std::uint8_t>(dtype::uint8)) throw wire::violation("a bad type");
          c.type = static_cast<dtype>(type);
          c.count = static_cast<std::size_t>(r.u64("count"));
          c.op = static_cast<int>(r.i64("op"));
          c.root = static_cast<int>(r.i64("root"));
          const std::uint8_t state = r.u8("state");
          if (state > static_cast<std::uint8_t>(call_state::timed_out)) {
            throw wire::violation("a bad state");
          }
          c.state = static_cast<call_state>(state);
          c.label = r.bytes32("label");
          calls.push_back(std::move(c));
        }
      }
      return rings;
    });
  } catch (const rendezvous_error&) {
    return std::nullopt;
  }
}

DTRAIN_DETAIL_INLINE desync_report analyse_job(std::span<const rank_publication> ranks) {
  std::vector<std::string> names;
  int answering = 0;
  for (const rank_publication& p : ranks) {
    answering += p.answered ? 1 : 0;
    for (const auto& entry : p.rings) {
      if (p.answered && std::find(names.begin(), names.end(), entry.first) == names.end())
        names.push_back(entry.first);
    }
  }
  if (names.empty()) names.push_back("world");
  std::vector<std::pair<std::string, desync_report>> reports;
  for (const std::string& name : names) {
    std::vector<rank_ring> rings;
    for (const rank_publication& p : ranks) {
      if (!p.answered) {
        rings.push_back({p.rank, false, {}});
        continue;
      }
      for (const auto& entry : p.rings) {
        if (entry.first == name) rings.push_back({p.rank, true, entry.second});
      }
    }
    const auto members =
        std::count_if(rings.begin(), rings.end(), [](const rank_ring& r) { return r.answered; });
    if (members < answering) {
      std::erase_if(rings, [](const rank_ring& r) { return !r.answered; });
    }
    reports.emplace_back(name, analyse(rings));
  }
  std::size_t best = 0;
  for (std::size_t i = 1; i < reports.size(); ++i) {
    if (reports[i].second.severity > reports[best].second.severity) best = i;
  }
  desync_report out = reports[best].second;
  if (reports.size() > 1) {
    out.summary += " (on communicator " + reports[best].first + ")";
    out.details.clear();
    for (const auto& [name, report] : reports) {
      out.details.push_back("communicator " + name + ":" +
                            (report.severity > 0 ? " " + report.summary : ""));
      for (const std::string& d : report.details) out.details.push_back("  " + d);
    }
  }
  return out;
}

}  // namespace dtrain::detail
