// What each translation unit of dtrain_mixed_link does, compiled once by g++
// (mixed_host.cpp) and once by nvcc (mixed_nvcc.cu). Everything here has
// internal linkage: each unit must run its own copy and report which
// compiler built the dtrain it sees.
#pragma once

#include <dtrain/dtrain.hpp>

#include <string>
#include <vector>

namespace {

struct mixed_model {
  std::vector<float> w = std::vector<float>(300, 1.0f);
  float* grad = nullptr;
  std::vector<dtrain::parameter> parameters() { return {dtrain::param("w", w, grad)}; }
};

/// "<compiler> <checks>": a world of one over Gloo, DDP with bf16 compression
/// (instantiated in both units), one step; then what this unit sees.
std::string mixed_unit_report() {
  using job = dtrain::policy<dtrain::launch::per_process, dtrain::backend::gloo>;
  dtrain::store_server server("127.0.0.1", 0);
  dtrain::store_client client("127.0.0.1", server.port());
  dtrain::gloo_communicator comm(client, 0, 1);
  mixed_model model;
  std::string report(dtrain::detail::compiled_by());
  {
    dtrain::DistributedDataParallel<mixed_model, job> ddp(
        comm, model, {.compression = dtrain::gradient_compression::bfloat16});
    for (std::size_t i = 0; i < model.w.size(); ++i) model.grad[i] = 1.0f + 1.0f / 1024.0f;
    ddp.mark_ready(std::size_t{0});
    ddp.synchronize();
    // bf16 keeps 8 significant bits: 1 + 2^-10 rounds to 1.
    report += model.grad[0] == 1.0f ? " compressed" : " NOT-compressed";
    report += dtrain::DistributedDataParallel<mixed_model, job>::compression_available()
                  ? " host-casts"
                  : " no-host-casts";
  }
  report += dtrain::detail::device_casts_available() ? " device-casts" : " no-device-casts";
  return report;
}

}  // namespace
