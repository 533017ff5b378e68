#pragma once
/// @file
/// dtrain::policy<Launch, Backend, Topology>: the compile-time choices of a
/// job. Each slot is a small tag type; a combination that cannot work is a
/// static_assert that says why, not a run-time surprise.

#include <dtrain/backend/gloo/gloo.hpp>
#include <dtrain/backend/memory.hpp>
#include <dtrain/backend/mpi/mpi.hpp>
#include <dtrain/backend/nccl/nccl.hpp>
#include <dtrain/config.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/rendezvous/broadcast.hpp>
#include <dtrain/topology/flat.hpp>
#include <dtrain/topology/hierarchical.hpp>

#include <concepts>
#include <string>
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
/// MPI (host memory; device memory too when CUDA is available).
struct mpi {
  static constexpr bool available = DTRAIN_HAS_MPI() != 0;
  static constexpr std::string_view name = "mpi";
  static constexpr std::string_view missing =
      "dtrain was built without MPI: install Open MPI (Debian: libopenmpi-dev) "
      "and link dtrain::dtrain, or define DTRAIN_WITH_MPI=1 and link MPI yourself";
};
/// Gloo over TCP (host memory).
struct gloo {
  static constexpr bool available = DTRAIN_HAS_GLOO() != 0;
  static constexpr std::string_view name = "gloo";
  static constexpr std::string_view missing =
      "dtrain was built without Gloo: install it (Debian: libgloo-dev) and link dtrain::dtrain, "
      "or define DTRAIN_WITH_GLOO=1 and link gloo yourself";
};
/// NCCL (device memory).
struct nccl {
  static constexpr bool available = DTRAIN_HAS_NCCL() != 0;
  static constexpr std::string_view name = "nccl";
  static constexpr std::string_view missing =
      "dtrain was built without NCCL: "
      "install the CUDA toolkit with NCCL and link dtrain::dtrain, "
      "or define DTRAIN_WITH_NCCL=1 and link nccl and cudart yourself";
};

}  // namespace backend

/// What a context hands a backend to build its communicator from.
template <class Store>
struct communicator_setup {
  Store* store = nullptr;  ///< the job's store; null where the backend needs none (MPI)
  int rank = 0;
  int size = 1;
  int device = -1;  ///< the CUDA device of this rank (backends that use GPUs), else -1
  collective_options collectives{};
  std::string master_addr;  ///< MASTER_ADDR as discovered, or empty
  const environment* env = nullptr;
};

/// Everything a backend implies, in one place: its communicator, the memory
/// space DistributedDataParallel keeps gradients in (which also decides how
/// buckets travel: a host thread, or CUDA streams), whether ranks use GPUs,
/// whether the communicator needs the store (needs_store), how it is made,
/// and, optionally, a channel that works before any store exists
/// (pre_store_relay, see detail::has_pre_store_relay). Adding an engine adds
/// one specialisation here. A backend of one's own (tests do) specialises it
/// too; what it does not declare is off.
template <class Backend>
struct backend_traits;

namespace detail {
/// Whether backend traits `T` can broadcast before the store exists:
/// `T::pre_store_relay(communicator&)` returns a broadcast_relay from rank 0
/// (rendezvous/broadcast.hpp). With it, rank 0 sends the others the store
/// token and, without MASTER_ADDR, the store's address; the communicator is
/// then made before the store (needs_store = false). MPI has one.
template <class T>
concept has_pre_store_relay = requires(typename T::communicator& c) {
  { T::pre_store_relay(c) } -> broadcast_relay;
};
}  // namespace detail

#if DTRAIN_HAS_MPI()
template <>
struct backend_traits<backend::mpi> {
  using communicator = mpi_communicator;
  using memory_space = host_memory;
  static constexpr bool uses_gpus = false;
  /// MPI knows its world before any store exists...
  static constexpr bool needs_store = false;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    mpi_options options{.collectives = s.collectives};
    if (s.env) options = options.with_env(*s.env);
    return mpi_communicator::world(std::move(options));
  }
  /// ... and carries rank 0's store token and address to every rank.
  static detail::mpi_relay pre_store_relay(communicator& c) {
    return detail::mpi_relay(c.native(), 0);
  }
};
#endif
#if DTRAIN_HAS_GLOO()
template <>
struct backend_traits<backend::gloo> {
  using communicator = gloo_communicator;
  using memory_space = host_memory;
  static constexpr bool uses_gpus = false;
  static constexpr bool needs_store = true;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    return gloo_communicator(*s.store, s.rank, s.size,
                             gloo_options{.collectives = s.collectives,
                                          .master_addr = s.master_addr,
                                          .env = s.env ? *s.env : environment{}});
  }
};
#endif
#if DTRAIN_HAS_NCCL()
template <>
struct backend_traits<backend::nccl> {
  using communicator = nccl_communicator;
  using memory_space = cuda_memory;
  static constexpr bool uses_gpus = true;
  static constexpr bool needs_store = true;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    return nccl_communicator(*s.store, s.rank, s.size, s.device,
                             nccl_options{.collectives = s.collectives}.with_env(*s.env));
  }
};
#endif

namespace detail {
/// What policy<> uses in place of backend_traits<B> when B is not compiled in:
/// a communicator that is only declared, so that the policy's static_assert
/// is the one error, not the first of many. Nothing here is ever defined.
struct missing_backend_traits {
  struct communicator {
    static constexpr bool reaches_device_memory = false;
    static constexpr bool reaches_host_memory = true;
    static constexpr std::string_view name = "not compiled in";
    int rank() const;
    int size() const;
    bool valid() const;
    work allreduce(buffer, buffer, reduce_op);
    work broadcast(buffer, int);
    work allgather(buffer, buffer);
    work reduce_scatter(buffer, buffer, reduce_op);
    work alltoall(buffer, buffer);
    work barrier();
    communicator split(int, int);
  };
  using memory_space = host_memory;
  static constexpr bool uses_gpus = false;
  static constexpr bool needs_store = false;
  template <class Store>
  static communicator make(const communicator_setup<Store>&);
};
}  // namespace detail

template <class T>
concept launch_policy =
    std::is_same_v<T, launch::per_process> || std::is_same_v<T, launch::per_node>;
/// A backend tag: backend::mpi, backend::gloo, backend::nccl, or one's own
/// with a backend_traits specialisation.
template <class T>
concept backend_policy = requires {
  { T::name } -> std::convertible_to<std::string_view>;
  { T::available } -> std::convertible_to<bool>;
};
/// A topology tag: topology::flat or topology::hierarchical.
template <class T>
concept topology_policy =
    std::is_same_v<T, topology::flat> || std::is_same_v<T, topology::hierarchical>;

/// The choices of a job, e.g. policy<launch::per_node, backend::nccl, topology::flat>.
template <launch_policy Launch, backend_policy Backend, topology_policy Topology = topology::flat>
struct policy {
  static_assert(
      Backend::available,
      "the backend of this dtrain::policy is not compiled in: see the backend's `missing` text "
      "(backend::mpi needs DTRAIN_WITH_MPI, backend::gloo DTRAIN_WITH_GLOO, "
      "backend::nccl DTRAIN_WITH_NCCL)");
  static_assert(!(std::is_same_v<Launch, launch::per_node> &&
                  std::is_same_v<Backend, backend::mpi>),
                "launch::per_node starts the workers itself, "
                "but MPI processes must be started by mpirun or srun: "
                "use launch::per_process with backend::mpi, "
                "or backend::gloo / backend::nccl with launch::per_node");
  using launch_type = Launch;
  using backend_type = Backend;
  using topology_type = Topology;
  // A backend that is not compiled in has no traits: a stand-in keeps the
  // static_assert above the only error, instead of the first of many.
  using traits = std::conditional_t<Backend::available, backend_traits<Backend>,
                                    detail::missing_backend_traits>;
  using communicator_type = typename traits::communicator;
  static_assert(communicator<communicator_type>);
  static_assert(!detail::has_pre_store_relay<traits> || !traits::needs_store,
                "a backend whose traits have a pre_store_relay carries values before the store "
                "exists, so its communicator must be made without one: set needs_store = false");
  /// Where DistributedDataParallel keeps gradients: host_memory or cuda_memory.
  using memory_space = typename traits::memory_space;
  /// Whether gradients may live on the GPU with this backend.
  static constexpr bool reaches_device_memory = communicator_type::reaches_device_memory;
  static_assert(!std::is_same_v<Topology, topology::hierarchical> || !memory_space::on_stream ||
                    detail::stream_ordered<communicator_type>,
                "topology::hierarchical enqueues its three steps on streams at once, "
                "each after the last: "
                "a backend whose buckets travel on streams needs a communicator that orders its "
                "collectives after the stream it is given (stream_ordered and stream(), "
                "as nccl_communicator)");
};

}  // namespace dtrain
