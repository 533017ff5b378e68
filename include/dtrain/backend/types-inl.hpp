#pragma once
/// @file
/// The non-template bodies of dtrain/backend/types.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/types.hpp, not this file.

#include <dtrain/backend/types.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::uint16_t float16::from_float(float f) noexcept {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (abs < 0x38800000u) {                                                    // subnormal or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);
    std::uint32_t mant = (abs & 0x007fffffu) | 0x00800000u;
    int shift = 126 - static_cast<int>(abs >> 23);  // 14 .. 24
    std::uint32_t half = mant >> shift;
    std::uint32_t rest = mant & ((1u << shift) - 1);
    std::uint32_t mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t half = ((abs - 0x38000000u) >> 13);
  std::uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<std::uint16_t>(sign | half);
}

DTRAIN_DETAIL_INLINE float float16::to_float(std::uint16_t h) noexcept {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    float value = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -value : value;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

DTRAIN_DETAIL_INLINE std::uint16_t bfloat16::from_float(float f) noexcept {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}
}  // namespace dtrain

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE void divide_host(buffer b, int n) noexcept {
  visit(b.type, [&]<class T>() {
    if constexpr (std::same_as<T, float16> || std::same_as<T, bfloat16>) {
      auto* p = static_cast<T*>(b.data);
      for (std::size_t i = 0; i < b.count; ++i)
        p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
    } else if constexpr (std::floating_point<T>) {
      auto* p = static_cast<T*>(b.data);
      for (std::size_t i = 0; i < b.count; ++i) p[i] /= static_cast<T>(n);
    }
  });
}

}  // namespace detail
}  // namespace dtrain
