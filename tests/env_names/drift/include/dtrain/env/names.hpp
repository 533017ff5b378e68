// A names.hpp that drifted from its reference and its readers (test docs.catches_env_name_drift).
#include <array>
#include <string_view>
namespace dtrain {
inline constexpr std::string_view a_variable = "DTRAIN_A";
inline constexpr std::string_view b_variable = "DTRAIN_B";
namespace detail {
inline constexpr std::array dtrain_variables{a_variable, b_variable};
}  // namespace detail
}  // namespace dtrain
