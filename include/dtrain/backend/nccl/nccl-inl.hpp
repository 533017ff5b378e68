#pragma once
/// @file
/// The non-template bodies of dtrain/backend/nccl/nccl.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/nccl/nccl.hpp, not this file.

#include <dtrain/backend/nccl/nccl.hpp>

#if DTRAIN_HAS_NCCL()
namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::string nccl_creating(int rank, int size, int device) {
  return "creating the NCCL communicator of rank " + std::to_string(rank) + " of " +
         std::to_string(size) + " on CUDA device " + std::to_string(device);
}

DTRAIN_DETAIL_INLINE std::string nccl_gpu::encode() const {
  std::string out;
  wire::writer(out).bytes32(uuid).bytes32(pci_bus).bytes32(host).i64(device).bytes32(visible);
  return out;
}

DTRAIN_DETAIL_INLINE nccl_gpu nccl_gpu::decode(std::string_view where, std::string_view value) {
  return wire::decode_value(where, value, "a rank's GPU", [](wire::reader& r) {
    nccl_gpu g;
    g.uuid = std::string(r.bytes32("the GPU's UUID"));
    g.pci_bus = std::string(r.bytes32("its PCI bus id"));
    g.host = std::string(r.bytes32("the host name"));
    g.device = static_cast<int>(r.i64("the CUDA device"));
    g.visible = std::string(r.bytes32("CUDA_VISIBLE_DEVICES"));
    return g;
  });
}

DTRAIN_DETAIL_INLINE std::string nccl_shared_gpu_problem(const std::vector<nccl_gpu>& gpus) {
  for (std::size_t a = 0; a < gpus.size(); ++a) {
    for (std::size_t b = a + 1; b < gpus.size(); ++b) {
      if (gpus[a].uuid != gpus[b].uuid) continue;
      auto as = [&](std::size_t r) {
        return "rank " + std::to_string(r) + " as CUDA device " + std::to_string(gpus[r].device) +
               " (CUDA_VISIBLE_DEVICES=" + gpus[r].visible + ")";
      };
      return "ranks " + std::to_string(a) + " and " + std::to_string(b) + " on host " +
             gpus[a].host + " both use GPU " + gpus[a].uuid + " (PCI bus " + gpus[a].pci_bus +
             "): " + as(a) + ", " + as(b) +
             "; NCCL needs a GPU of its own for every rank: "
             "start no more ranks on a node than it has GPUs, and give each its own device "
             "(the local rank, or a CUDA_VISIBLE_DEVICES of its own)";
    }
  }
  return {};
}

DTRAIN_DETAIL_INLINE std::string nccl_shared_gpu_problem(
    const std::vector<std::pair<std::string, std::string>>& records) {
  std::vector<nccl_gpu> gpus;
  for (std::size_t r = 0; r < records.size(); ++r) {
    const auto& [where, record] = records[r];
    const wire::outcome got = wire::outcome::decode(where, record, "a rank's GPU");
    if (!got.ok)
      throw rendezvous_error("rank " + std::to_string(r) + " cannot use its GPU: " + got.text);
    gpus.push_back(nccl_gpu::decode(where, got.text));
  }
  return nccl_shared_gpu_problem(gpus);
}
}  // namespace detail
}  // namespace dtrain
#endif

#if DTRAIN_HAS_NCCL()
#if DTRAIN_HAS_MPI()
namespace dtrain {

DTRAIN_DETAIL_INLINE ncclUniqueId broadcast_nccl_unique_id(MPI_Comm comm, int root) {
  return nccl_communicator::exchange_unique_id(comm, root);
}

}  // namespace dtrain
#endif
#endif
