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

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/env/device-inl.hpp>
#endif
