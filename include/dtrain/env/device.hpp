#pragma once
/// @file
/// Which CUDA device a rank uses: a pure function of its local rank, the
/// number of ranks on its node and the devices it can see, so every launcher
/// and GPU binding is unit-testable without a GPU; and how many devices and
/// cores this process has, for an agent that starts one worker per GPU.

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include <dlfcn.h>
#include <sched.h>

namespace dtrain {

/// The CUDA device of local rank `local_rank` of `local_world_size` when the
/// process sees `visible` devices:
/// - the local rank, when at least one device per local rank is visible (one
///   process per GPU with every GPU visible: torchrun, mpirun, dtrun);
/// - device 0, when exactly one is visible (per-task binding: SLURM
///   `--gpus-per-task`, Kubernetes, CUDA_VISIBLE_DEVICES set per rank);
/// - otherwise config_error naming CUDA_VISIBLE_DEVICES (`cuda_visible_devices`,
///   as the environment has it, or unset), the local rank and the counts.
[[nodiscard]] DTRAIN_DETAIL_INLINE int select_device(
    int local_rank, int local_world_size, int visible,
    std::optional<std::string_view> cuda_visible_devices);
#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

/// What this process can give workers: the CUDA devices it sees and the CPU
/// cores it may run on.
struct local_devices {
  int gpus = 0;
  int cpus = 1;
};

/// Counts this process's devices: the GPUs through the CUDA driver
/// (libcuda.so.1, loaded at run time, so that no program links it; it applies
/// CUDA_VISIBLE_DEVICES), 0 without a driver or a device; the cores from the
/// affinity mask (taskset, cgroup cpusets), at least 1. Initialises the
/// driver in this process (cuInit), as cudaGetDeviceCount does.
[[nodiscard]] DTRAIN_DETAIL_INLINE local_devices count_local_devices();
#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
