#pragma once
/// @file
/// The non-template bodies of dtrain/detail/hostlist.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/detail/hostlist.hpp, not this file.

#include <dtrain/detail/hostlist.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE hostlist hostlist::parse(std::string_view text, const std::string& what) {
  hostlist list;
  if (text.empty()) throw config_error(what + " is an empty host list");
  std::size_t start = 0;
  int depth = 0;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    if (i < text.size() && text[i] == '[') {
      if (++depth > 1) throw config_error(what + " has nested '[' at offset " + std::to_string(i));
    } else if (i < text.size() && text[i] == ']') {
      if (--depth < 0)
        throw config_error(what + " has ']' without '[' at offset " + std::to_string(i));
    } else if (i == text.size() || (text[i] == ',' && depth == 0)) {
      if (depth != 0) throw config_error(what + " has '[' without ']'");
      list.patterns_.push_back(parse_pattern(text.substr(start, i - start), what));
      start = i + 1;
    }
  }
  return list;
}

DTRAIN_DETAIL_INLINE std::size_t hostlist::size() const {
  std::size_t total = 0;
  for (const auto& p : patterns_) total = saturating_add(total, pattern_size(p));
  return total;
}

DTRAIN_DETAIL_INLINE std::string hostlist::front() const {
  std::string host;
  for (const auto& pc : patterns_.front()) {
    host += pc.ranges.empty() ? pc.literal : pc.ranges.front().format(pc.ranges.front().first);
  }
  return host;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> hostlist::expand(std::size_t limit) const {
  if (size() > limit) {
    throw config_error("host list of " + std::to_string(size()) + " hosts exceeds the limit of " +
                       std::to_string(limit));
  }
  std::vector<std::string> hosts;
  for (const auto& p : patterns_) {
    std::vector<std::string> partial{""};
    for (const auto& pc : p) {
      std::vector<std::string> next;
      if (pc.ranges.empty()) {
        for (auto& s : partial) next.push_back(s + pc.literal);
      } else {
        for (auto& s : partial) {
          for (const auto& r : pc.ranges) {
            for (std::uint64_t n = r.first; n <= r.last; ++n) next.push_back(s + r.format(n));
          }
        }
      }
      partial = std::move(next);
    }
    hosts.insert(hosts.end(), partial.begin(), partial.end());
  }
  return hosts;
}

DTRAIN_DETAIL_INLINE std::string hostlist::range::format(std::uint64_t n) const {
  std::string digits = std::to_string(n);
  if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
  return digits;
}

DTRAIN_DETAIL_INLINE std::size_t hostlist::saturating_add(std::size_t a, std::size_t b) {
  return a > std::numeric_limits<std::size_t>::max() - b ? std::numeric_limits<std::size_t>::max()
                                                         : a + b;
}

DTRAIN_DETAIL_INLINE std::size_t hostlist::saturating_mul(std::size_t a, std::size_t b) {
  return b != 0 && a > std::numeric_limits<std::size_t>::max() / b
             ? std::numeric_limits<std::size_t>::max()
             : a * b;
}

DTRAIN_DETAIL_INLINE std::size_t hostlist::pattern_size(const pattern& p) {
  std::size_t n = 1;
  for (const auto& pc : p) {
    if (pc.ranges.empty()) continue;
    std::size_t in_bracket = 0;
    for (const auto& r : pc.ranges) in_bracket = saturating_add(in_bracket, r.count());
    n = saturating_mul(n, in_bracket);
  }
  return n;
}

DTRAIN_DETAIL_INLINE std::uint64_t hostlist::parse_bound(std::string_view digits,
                                                         const std::string& what) {
  if (digits.empty() || digits.size() > 18 ||
      digits.find_first_not_of("0123456789") != std::string_view::npos) {
    throw config_error(what + " has a bad range bound '" + std::string(digits) + "'");
  }
  return std::stoull(std::string(digits));
}

DTRAIN_DETAIL_INLINE auto hostlist::parse_pattern(std::string_view text, const std::string& what)
    -> pattern {
  if (text.empty()) throw config_error(what + " has an empty host name");
  pattern p;
  std::size_t i = 0;
  while (i < text.size()) {
    if (text[i] != '[') {
      auto next = text.find('[', i);
      p.push_back(piece{std::string(text.substr(i, next - i)), {}});
      i = next == std::string_view::npos ? text.size() : next;
      continue;
    }
    auto close = text.find(']', i);
    auto body = text.substr(i + 1, close - i - 1);
    if (body.empty()) throw config_error(what + " has an empty '[]'");
    piece bracket;
    std::size_t s = 0;
    while (s <= body.size()) {
      auto comma = body.find(',', s);
      auto item =
          body.substr(s, comma == std::string_view::npos ? std::string_view::npos : comma - s);
      auto dash = item.find('-');
      auto lo = item.substr(0, dash);
      auto hi = dash == std::string_view::npos ? lo : item.substr(dash + 1);
      range r{parse_bound(lo, what), parse_bound(hi, what), lo.size()};
      if (r.last < r.first) {
        throw config_error(what + " has a descending range '" + std::string(item) + "'");
      }
      bracket.ranges.push_back(r);
      if (comma == std::string_view::npos) break;
      s = comma + 1;
    }
    p.push_back(std::move(bracket));
    i = close + 1;
  }
  return p;
}

DTRAIN_DETAIL_INLINE std::vector<int> parse_tasks_per_node(std::string_view text,
                                                           const std::string& what,
                                                           std::size_t limit) {
  std::vector<int> counts;
  if (text.empty()) throw config_error(what + " is empty");
  std::size_t start = 0;
  while (start <= text.size()) {
    auto comma = text.find(',', start);
    auto item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    int repeat = 1;
    auto paren = item.find('(');
    if (paren != std::string_view::npos) {
      if (item.size() < paren + 4 || item.substr(paren, 2) != "(x" || item.back() != ')') {
        throw config_error(what + " has a malformed item '" + std::string(item) +
                           "' (expected N or N(xM))");
      }
      repeat = parse_non_negative(what + " (repeat count in '" + std::string(item) + "')",
                                  item.substr(paren + 2, item.size() - paren - 3));
      item = item.substr(0, paren);
    }
    int count = parse_non_negative(what + " (task count '" + std::string(item) + "')", item);
    if (repeat == 0 || count == 0) {
      throw config_error(what + " lists a node with zero tasks or a zero repeat");
    }
    if (counts.size() + static_cast<std::size_t>(repeat) > limit) {
      throw config_error(what + " describes more than " + std::to_string(limit) + " nodes");
    }
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), count);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return counts;
}

}  // namespace dtrain::detail
