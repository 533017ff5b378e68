#pragma once
/// @file
/// Which CUDA device a rank uses: a pure function of its local rank, the
/// number of ranks on its node and the devices it can see, so every launcher
/// and GPU binding is unit-testable without a GPU.

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <optional>
#include <string>
#include <string_view>

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
  throw config_error(
      "local rank " + std::to_string(local_rank) + " of " + std::to_string(local_world_size) +
      " ranks on this node sees " + std::to_string(visible) + " GPUs (" + cvd +
      "): expose one GPU per rank (the launcher's per-task binding) or all of them, or "
      "start no more ranks per node than it has GPUs");
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
