#pragma once
/// @file
/// The non-template bodies of dtrain/env/device.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/env/device.hpp, not this file.

#include <dtrain/env/device.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE int select_device(int local_rank, int local_world_size, int visible,
                                       std::optional<std::string_view> cuda_visible_devices) {
  const std::string cvd = cuda_visible_devices
                              ? "CUDA_VISIBLE_DEVICES=" + std::string(*cuda_visible_devices)
                              : std::string("CUDA_VISIBLE_DEVICES unset");
  if (local_rank < 0 || local_world_size < 1 || local_rank >= local_world_size) {
    throw config_error("local rank " + std::to_string(local_rank) + " of " +
                       std::to_string(local_world_size) +
                       " ranks on this node cannot pick a GPU (" + cvd + ")");
  }
  if (visible >= local_world_size) return local_rank;
  if (visible == 1) return 0;
  if (visible <= 0) {
    throw config_error("local rank " + std::to_string(local_rank) +
                       " needs a GPU, but this process sees none (" + cvd +
                       "); check the driver (nvidia-smi) and what the launcher exposes");
  }
  throw config_error("local rank " + std::to_string(local_rank) + " of " +
                     std::to_string(local_world_size) + " ranks on this node sees " +
                     std::to_string(visible) + " GPUs (" + cvd +
                     "): expose one GPU per rank (the launcher's per-task binding) or all of them, "
                     "or start no more ranks per node than it has GPUs");
}

DTRAIN_DETAIL_INLINE local_devices count_local_devices() {
  local_devices found;
  // Kept loaded: the driver, once initialised, must not be unloaded under its threads.
  if (void* driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
    using init_fn = int (*)(unsigned);
    using count_fn = int (*)(int*);
    auto* init = reinterpret_cast<init_fn>(::dlsym(driver, "cuInit"));
    auto* count = reinterpret_cast<count_fn>(::dlsym(driver, "cuDeviceGetCount"));
    int n = 0;
    if (init != nullptr && count != nullptr && init(0) == 0 && count(&n) == 0 && n > 0) {
      found.gpus = n;
    }
  }
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof(mask), &mask) == 0 && CPU_COUNT(&mask) > 0) {
    found.cpus = CPU_COUNT(&mask);
  } else if (const unsigned cores = std::thread::hardware_concurrency(); cores > 0) {
    found.cpus = static_cast<int>(cores);
  }
  return found;
}

}  // namespace dtrain
