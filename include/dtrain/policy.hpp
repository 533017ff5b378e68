#pragma once
/// @file
/// dtrain::policy<Launch, Backend, Topology>: the compile-time choices of a
/// job. Each slot is a small tag type; a combination that cannot work is a
/// static_assert that says why, not a run-time surprise.

#include <dtrain/config.hpp>
#include <dtrain/backend/gloo.hpp>
#include <dtrain/backend/mpi.hpp>
#include <dtrain/backend/nccl.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/topology/flat.hpp>

#include <string_view>
#include <type_traits>

namespace dtrain {

namespace launch {
/// Every process was started by the outside launcher (mpirun, srun, torchrun).
struct per_process {
  static constexpr launch_mode mode = launch_mode::per_process;
};
/// This process is its node's agent and starts the node's workers.
struct per_node {
  static constexpr launch_mode mode = launch_mode::per_node;
};
}  // namespace launch

namespace backend {
template <class Tag>
struct communicator_of {
  static_assert(!std::is_same_v<Tag, Tag>, "not a dtrain backend: use backend::mpi, backend::gloo or backend::nccl");
};

/// MPI (host memory; device memory too when CUDA is available).
struct mpi {
  static constexpr bool available = DTRAIN_HAS_MPI() != 0;
  static constexpr std::string_view name = "mpi";
  static constexpr std::string_view missing =
      "dtrain was built without MPI: install Open MPI (Debian: libopenmpi-dev) and link dtrain::dtrain, "
      "or define DTRAIN_WITH_MPI=1 and link MPI yourself";
};
/// Gloo over TCP (host memory).
struct gloo {
  static constexpr bool available = DTRAIN_HAS_GLOO() != 0;
  static constexpr std::string_view name = "gloo";
  static constexpr std::string_view missing =
      "dtrain was built without Gloo: install it (Debian: libgloo-dev) and link dtrain::dtrain, or define "
      "DTRAIN_WITH_GLOO=1 and link gloo yourself";
};
/// NCCL (device memory).
struct nccl {
  static constexpr bool available = DTRAIN_HAS_NCCL() != 0;
  static constexpr std::string_view name = "nccl";
  static constexpr std::string_view missing =
      "dtrain was built without NCCL: install the CUDA toolkit with NCCL and link dtrain::dtrain, or define "
      "DTRAIN_WITH_NCCL=1 and link nccl and cudart yourself";
};

#if DTRAIN_HAS_MPI()
template <>
struct communicator_of<mpi> {
  using type = mpi_communicator;
};
#endif
#if DTRAIN_HAS_GLOO()
template <>
struct communicator_of<gloo> {
  using type = gloo_communicator;
};
#endif
#if DTRAIN_HAS_NCCL()
template <>
struct communicator_of<nccl> {
  using type = nccl_communicator;
};
#endif
}  // namespace backend

template <class T>
concept launch_policy = std::is_same_v<T, launch::per_process> || std::is_same_v<T, launch::per_node>;
template <class T>
concept backend_policy = std::is_same_v<T, backend::mpi> || std::is_same_v<T, backend::gloo> ||
                         std::is_same_v<T, backend::nccl>;
template <class T>
concept topology_policy = std::is_same_v<T, topology::flat>;

/// The choices of a job, e.g. policy<launch::per_node, backend::nccl, topology::flat>.
template <launch_policy Launch, backend_policy Backend, topology_policy Topology = topology::flat>
struct policy {
  static_assert(Backend::available,
                "the backend of this dtrain::policy is not compiled in: see the backend's `missing` text "
                "(backend::mpi needs DTRAIN_WITH_MPI, backend::gloo DTRAIN_WITH_GLOO, backend::nccl "
                "DTRAIN_WITH_NCCL)");
  static_assert(!(std::is_same_v<Launch, launch::per_node> && std::is_same_v<Backend, backend::mpi>),
                "launch::per_node starts the workers itself, but MPI processes must be started by "
                "mpirun or srun: use launch::per_process with backend::mpi, or backend::gloo / "
                "backend::nccl with launch::per_node");
  using launch_type = Launch;
  using backend_type = Backend;
  using topology_type = Topology;
  using communicator_type = typename backend::communicator_of<Backend>::type;
  static_assert(communicator<communicator_type>);
  /// Whether gradients may live on the GPU with this backend.
  static constexpr bool reaches_device_memory = communicator_type::reaches_device_memory;
};

}  // namespace dtrain
