#pragma once
/// @file
/// The non-template bodies of dtrain/ddp/loss_scaler.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/ddp/loss_scaler.hpp, not this file.

#include <dtrain/ddp/loss_scaler.hpp>
#include <dtrain/detail/parse.hpp>

#include <charconv>
#include <concepts>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <system_error>
#include <vector>

namespace dtrain {

namespace detail {

/// `value` as C's %a prints it: every bit of a double, read back by strtod.
DTRAIN_DETAIL_INLINE std::string exact_double(double value) {
  char text[64];
  const int n = std::snprintf(text, sizeof text, "%a", value);
  return std::string(text, n > 0 ? static_cast<std::size_t>(n) : 0);
}

}  // namespace detail

DTRAIN_DETAIL_INLINE loss_scaler::loss_scaler(loss_scaler_options options)
    : options_(options), scale_(options.init_scale) {
  const auto bad = [](const char* field, const std::string& value, const char* rule) {
    throw config_error(std::string("loss_scaler: loss_scaler_options::") + field + " = " + value +
                       ": " + rule);
  };
  const auto text = [](double v) { return std::to_string(v); };
  if (!(std::isfinite(options.init_scale) && options.init_scale >= lowest_scale))
    bad("init_scale", text(options.init_scale), "must be finite and at least 2^-24");
  if (!(std::isfinite(options.growth_factor) && options.growth_factor > 1))
    bad("growth_factor", text(options.growth_factor), "must be finite and more than 1");
  if (!(options.backoff_factor > 0 && options.backoff_factor < 1))
    bad("backoff_factor", text(options.backoff_factor), "must be between 0 and 1 (both excluded)");
  if (options.growth_interval == 0) bad("growth_interval", "0", "must be at least 1 step");
}

DTRAIN_DETAIL_INLINE std::string loss_scaler::who() const {
  return rank_ >= 0 ? "loss_scaler on rank " + std::to_string(rank_) : std::string("loss_scaler");
}

DTRAIN_DETAIL_INLINE void loss_scaler::throw_twice() const {
  throw error(who() +
              ": unscale() or check() called twice in one step (call update() after each "
              "step's: the gradients would be divided by the scale twice)");
}

DTRAIN_DETAIL_INLINE void loss_scaler::divisible(const buffer& g, std::string_view name) const {
  if (g.count == 0) return;
  if (g.where != memory::host) {
    throw config_error(who() + ": parameter '" + std::string(name) +
                       "' has its gradients in device memory; unscale() divides host memory "
                       "only: on a GPU, call check(ddp) instead and multiply the gradients "
                       "by 1 / scale() in the optimizer's update");
  }
  if (!is_floating(g.type)) {
    throw config_error(who() + ": parameter '" + std::string(name) + "' has " +
                       std::string(to_string(g.type)) +
                       " gradients; unscale() reads float32, float64, bfloat16 and float16");
  }
}

DTRAIN_DETAIL_INLINE void loss_scaler::divide(const buffer& g) const noexcept {
  const double inverse = 1.0 / scale_;  // a power of 2 on the default schedule: exact
  detail::visit(g.type, [&]<class T>() {
    if constexpr (std::same_as<T, double>) {
      for (double& x : std::span(static_cast<double*>(g.data), g.count)) x *= inverse;
    } else if constexpr (std::same_as<T, float> || std::same_as<T, float16> ||
                         std::same_as<T, bfloat16>) {           // others: refused by divisible()
      for (T& x : std::span(static_cast<T*>(g.data), g.count))  // rounded once to T
        x = T(static_cast<float>(static_cast<double>(static_cast<float>(x)) * inverse));
    }
  });
}

/// What update() makes of the state after this step's decision; `floor`:
/// the scale would fall below lowest_scale (the state is left as it was).
DTRAIN_DETAIL_INLINE loss_scaler::counters loss_scaler::updated(bool& floor) const {
  counters next{scale_, tracker_, skipped_};
  floor = false;
  if (!options_.enabled || !checked_) return next;
  if (found_inf_) {
    ++next.skipped;
    next.tracker = 0;
    const double backed_off = scale_ * options_.backoff_factor;
    floor = backed_off < lowest_scale;
    if (!floor) next.scale = backed_off;
    return next;
  }
  if (++next.tracker >= options_.growth_interval) {
    next.tracker = 0;
    // As GradScaler: a growth that would overflow a double is not taken.
    if (const double grown = scale_ * options_.growth_factor; std::isfinite(grown))
      next.scale = grown;
  }
  return next;
}

DTRAIN_DETAIL_INLINE void loss_scaler::update() {
  if (!checked_) {
    throw error(who() +
                ": update() without unscale(ddp) or check(ddp) in this step (they tell "
                "whether the step had an inf or a NaN, which update() needs)");
  }
  bool floor = false;
  const counters next = updated(floor);
  checked_ = false;
  if (floor) {
    skipped_ = next.skipped;
    throw error(who() +
                ": the averaged gradients held an inf or a NaN at every step while the "
                "loss scale fell from " +
                std::to_string(options_.init_scale) + " to " + detail::exact_double(scale_) + " (" +
                std::to_string(skipped_) +
                " steps skipped in all): no scale cures that; look for a NaN in the model, "
                "its inputs or its loss");
  }
  scale_ = next.scale;
  tracker_ = next.tracker;
  skipped_ = next.skipped;
}

DTRAIN_DETAIL_INLINE std::string loss_scaler::state() const {
  bool floor = false;
  const counters next = updated(floor);  // mid-step: as this step's update() will leave it
  return "dtrain.loss_scaler 1 scale " + detail::exact_double(next.scale) + " growth_tracker " +
         std::to_string(next.tracker) + " skipped " + std::to_string(next.skipped);
}

DTRAIN_DETAIL_INLINE void loss_scaler::load_state(std::string_view text) {
  const auto refuse = [&](const std::string& why) {
    throw config_error(who() + ": the saved state '" + std::string(text.substr(0, 120)) +
                       "' is not a loss scaler's: " + why);
  };
  const std::vector<std::string> words = detail::split(text, ' ');
  if (words.size() != 8 || words[0] != "dtrain.loss_scaler" || words[2] != "scale" ||
      words[4] != "growth_tracker" || words[6] != "skipped")
    refuse("expected 'dtrain.loss_scaler 1 scale <hex float> growth_tracker <n> skipped <n>'");
  if (words[1] != "1") refuse("version " + words[1] + " (this dtrain reads version 1)");
  char* end = nullptr;
  const double scale = std::strtod(words[3].c_str(), &end);
  if (end != words[3].c_str() + words[3].size() || !std::isfinite(scale) || scale < lowest_scale)
    refuse("the scale '" + words[3] + "' is not a finite number of at least 2^-24");
  const auto count = [&](const std::string& word, const char* what) {
    std::uint64_t n = 0;
    const auto [p, ec] = std::from_chars(word.data(), word.data() + word.size(), n);
    if (ec != std::errc() || p != word.data() + word.size())
      refuse(std::string("the ") + what + " '" + word + "' is not a count");
    return n;
  };
  const std::uint64_t tracker = count(words[5], "growth tracker");
  const std::uint64_t skipped = count(words[7], "skipped steps");
  scale_ = scale;
  tracker_ = tracker;
  skipped_ = skipped;
  checked_ = false;
  found_inf_ = false;
}

}  // namespace dtrain
