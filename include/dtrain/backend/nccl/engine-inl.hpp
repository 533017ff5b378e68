#pragma once
/// @file
/// The non-template bodies of dtrain/backend/nccl/engine.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/nccl/engine.hpp, not this file.

#include <dtrain/backend/nccl/engine.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE nccl_options nccl_options::with_env(const environment& env) const {
  nccl_options out = *this;
  out.collectives = collectives.with_env(env);
  if (auto t = detail::read_seconds(env, nccl_init_timeout_variable)) out.init_timeout = *t;
  if (auto v = env.get("CUDA_VISIBLE_DEVICES")) out.cuda_visible_devices = std::string(*v);
  return out;
}
}  // namespace dtrain

#if DTRAIN_HAS_NCCL()
namespace dtrain::detail {

DTRAIN_DETAIL_INLINE backend_error nccl_with_context(const std::string& what,
                                                     const backend_error& e) {
  if (std::string_view(e.what()).starts_with(what)) return e;
  return backend_error(what + ": " + e.what(), e.engine_code());
}

DTRAIN_DETAIL_INLINE config_error nccl_no_divide(const std::string& what, dtype type, int ranks) {
  const std::string n = std::to_string(ranks);
  return config_error(
      what + ": the average of " + std::string(to_string(type)) + " data over " + n +
      " ranks divides each element by " + n +
      " before the sum (NCCL's own average multiplies by 1/" + n + " rounded to " +
      std::string(to_string(type)) +
      ", which is off by up to 0.2 % and makes the mean depend on the job size), and that needs "
      "dtrain's CUDA kernel, which exists only where a unit of the program was compiled by nvcc: "
      "include <dtrain/dtrain.hpp> in one .cu file linked into the program, or average float32 "
      "data, or reduce with sum and divide yourself");
}

DTRAIN_DETAIL_INLINE void nccl_check_rank(int rank, int size) {
  if (size < 1)
    throw config_error("NCCL communicator size " + std::to_string(size) + " is not at least 1");
  if (rank < 0 || rank >= size) {
    throw config_error("NCCL rank " + std::to_string(rank) + " is not in 0.." +
                       std::to_string(size - 1) + " (size " + std::to_string(size) + ")");
  }
}

DTRAIN_DETAIL_INLINE void nccl_check_placement(int rank, int size, int device) {
  nccl_check_rank(rank, size);
  if (device < 0) {
    throw config_error("CUDA device " + std::to_string(device) + " of NCCL rank " +
                       std::to_string(rank) + " is negative; pass the local rank");
  }
}

DTRAIN_DETAIL_INLINE ncclUniqueId nccl_unique_id_from(const std::string& value,
                                                      std::string_view key) {
  ncclUniqueId id{};
  if (value.size() != sizeof id.internal) {
    throw rendezvous_error("the value under store key \"" + std::string(key) + "\" has " +
                           std::to_string(value.size()) + " bytes, but an NCCL unique id has " +
                           std::to_string(sizeof id.internal) +
                           ": something else wrote that key; give each communicator its own key "
                           "(nccl_options::store_key) or prefix_store");
  }
  value.copy(id.internal, sizeof id.internal);
  return id;
}

DTRAIN_DETAIL_INLINE std::string nccl_seconds(std::chrono::milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(t.count()) / 1000.0);
  return text;
}

}  // namespace dtrain::detail
#endif
