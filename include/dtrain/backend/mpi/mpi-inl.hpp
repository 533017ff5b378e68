#pragma once
/// @file
/// The non-template bodies of dtrain/backend/mpi/mpi.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/mpi/mpi.hpp, not this file.

#include <dtrain/backend/mpi/mpi.hpp>

#if DTRAIN_HAS_MPI()
namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

DTRAIN_DETAIL_INLINE std::string mpi_thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "thread level " + std::to_string(level);
}
}  // namespace detail
}  // namespace dtrain
#endif

#if DTRAIN_HAS_MPI()
namespace dtrain {

DTRAIN_DETAIL_INLINE mpi_options mpi_options::with_env(const environment& env) const {
  mpi_options out = *this;
  if (env.contains(open_mpi_iallreduce_variable)) out.tune_open_mpi = false;
  return out;
}

DTRAIN_DETAIL_INLINE mpi_environment::mpi_environment(int required_level, bool tune_open_mpi)
    : unwinding_(std::uncaught_exceptions()) {
  int initialized = 0;
  DTRAIN_MPI_CHECK(MPI_Initialized(&initialized), "checking whether MPI is initialised");
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    // The one write to the process's environment in dtrain, and why: Open MPI
    // takes MCA parameters at MPI_Init_thread from the environment (or
    // parameter files) only; MPI_Init_thread has no argument for them, and
    // MPI_T can write this one only where an Open MPI version registers it
    // as settable. Set just before dtrain itself initialises MPI, never when
    // the user's environment (options.with_env) or the process has it already.
    if (tune_open_mpi) ::setenv(mpi_options::open_mpi_iallreduce_variable, "1", 0);
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS)
      throw backend_error("MPI_Init_thread failed: " + detail::mpi_error_text(rc), rc);
    owned_ = true;
  } else {
    DTRAIN_MPI_CHECK(MPI_Query_thread(&provided), "querying MPI's thread level");
  }
  if (provided < required_level) {
    throw backend_error(
        "MPI provides " + detail::mpi_thread_level_name(provided) + " but dtrain needs " +
            detail::mpi_thread_level_name(required_level) +
            (owned_ ? "; use an MPI built with thread support"
                    : "; initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)"),
        provided);
  }
}

DTRAIN_DETAIL_INLINE mpi_environment::~mpi_environment() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && !finalized && std::uncaught_exceptions() <= unwinding_) MPI_Finalize();
}

DTRAIN_DETAIL_INLINE bool mpi_environment::cuda_aware() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

DTRAIN_DETAIL_INLINE mpi_communicator mpi_communicator::world(mpi_options options) {
  auto env =
      std::make_shared<mpi_environment>(options.required_thread_level, options.tune_open_mpi);
  return mpi_communicator(std::move(env), MPI_COMM_WORLD, std::move(options));
}

DTRAIN_DETAIL_INLINE mpi_communicator mpi_communicator::from(MPI_Comm comm, mpi_options options) {
  auto env = std::make_shared<mpi_environment>(options.required_thread_level);
  return mpi_communicator(std::move(env), comm, std::move(options));
}

DTRAIN_DETAIL_INLINE mpi_communicator::~mpi_communicator() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Op& op : ops_) {
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  }
  // A request given up after a timeout may still be progressed by MPI: keep
  // the communicator allocated for it (a deliberate leak of a dead communicator).
  if (comm_ != MPI_COMM_NULL && !(health_ && health_->abandoned)) MPI_Comm_free(&comm_);
}

DTRAIN_DETAIL_INLINE std::size_t mpi_communicator::staging_bytes() const {
#if DTRAIN_HAS_CUDA()
  return staging_->pool.held_bytes();
#else
  return 0;
#endif
}

DTRAIN_DETAIL_INLINE work mpi_communicator::allreduce(buffer in, buffer out, reduce_op op,
                                                      stream_handle stream) {
  return collective(
      detail::collective_call::allreduce(in, out, op), stream,
      [&](request& w, const detail::collective_info& what) {
        const void* send = w.src.data == w.dst.data ? MPI_IN_PLACE : w.src.data;
        if (w.direct) {
          DTRAIN_MPI_CHECK(MPI_Allreduce(send, w.dst.data, count(out, what), datatype(out.type),
                                         mpi_op(op, out.type), comm_),
                           what);
        } else {
          DTRAIN_MPI_CHECK(MPI_Iallreduce(send, w.dst.data, count(out, what), datatype(out.type),
                                          mpi_op(op, out.type), comm_, &w.req),
                           what);
        }
      });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::broadcast(buffer data, int root, stream_handle stream) {
  return collective(
      detail::collective_call::broadcast(data, root), stream,
      [&](request& w, const detail::collective_info& what) {
        if (w.direct) {
          DTRAIN_MPI_CHECK(
              MPI_Bcast(w.dst.data, count(data, what), datatype(data.type), root, comm_), what);
        } else {
          DTRAIN_MPI_CHECK(
              MPI_Ibcast(w.dst.data, count(data, what), datatype(data.type), root, comm_, &w.req),
              what);
        }
      });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::allgather(buffer in, buffer out, stream_handle stream) {
  return collective(detail::collective_call::allgather(in, out), stream,
                    [&](request& w, const detail::collective_info& what) {
                      const int n = count(in, what);
                      if (w.direct) {
                        DTRAIN_MPI_CHECK(MPI_Allgather(w.src.data, n, datatype(in.type), w.dst.data,
                                                       n, datatype(in.type), comm_),
                                         what);
                      } else {
                        DTRAIN_MPI_CHECK(
                            MPI_Iallgather(w.src.data, n, datatype(in.type), w.dst.data, n,
                                           datatype(in.type), comm_, &w.req),
                            what);
                      }
                    });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::reduce_scatter(buffer in, buffer out, reduce_op op,
                                                           stream_handle stream) {
  return collective(
      detail::collective_call::reduce_scatter(in, out, op), stream,
      [&](request& w, const detail::collective_info& what) {
        if (w.direct) {
          DTRAIN_MPI_CHECK(
              MPI_Reduce_scatter_block(w.src.data, w.dst.data, count(out, what), datatype(out.type),
                                       mpi_op(op, out.type), comm_),
              what);
        } else {
          DTRAIN_MPI_CHECK(
              MPI_Ireduce_scatter_block(w.src.data, w.dst.data, count(out, what),
                                        datatype(out.type), mpi_op(op, out.type), comm_, &w.req),
              what);
        }
      });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::alltoall(buffer in, buffer out, stream_handle stream) {
  return collective(detail::collective_call::alltoall(in, out), stream,
                    [&](request& w, const detail::collective_info& what) {
                      buffer block = in;
                      block.count = in.count / static_cast<std::size_t>(size_);
                      const int n = count(block, what);
                      if (w.direct) {
                        DTRAIN_MPI_CHECK(MPI_Alltoall(w.src.data, n, datatype(in.type), w.dst.data,
                                                      n, datatype(in.type), comm_),
                                         what);
                      } else {
                        DTRAIN_MPI_CHECK(MPI_Ialltoall(w.src.data, n, datatype(in.type), w.dst.data,
                                                       n, datatype(in.type), comm_, &w.req),
                                         what);
                      }
                    });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::barrier() {
  return collective(detail::collective_call::barrier(), nullptr,
                    [&](request& w, const detail::collective_info& what) {
                      DTRAIN_MPI_CHECK(MPI_Ibarrier(comm_, &w.req), what);
                    });
}

DTRAIN_DETAIL_INLINE mpi_communicator mpi_communicator::split(int color, int key) {
  auto what =
      detail::describe("split", "color " + std::to_string(color) + ", key " + std::to_string(key),
                       rank_, size_, name);
  if (!valid()) detail::throw_invalid(what, rank_ < 0);
  usable(what);
  MPI_Comm child = MPI_COMM_NULL;
  DTRAIN_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child), what);
  if (child == MPI_COMM_NULL) return mpi_communicator(env_, options_);
  mpi_communicator out(env_, child, options_);
  out.ring_ = ring_->make_child(color);
  MPI_Comm_free(&child);  // `out` holds its own duplicate
  return out;
}

DTRAIN_DETAIL_INLINE mpi_communicator::request::~request() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (req != MPI_REQUEST_NULL && !finalized && !abandoned) {
    // A handle dropped before completion: MPI still writes into the
    // buffers, so finish it, for at most the timeout, rather than leave
    // MPI holding freed memory.
    auto deadline = std::chrono::steady_clock::now() + timeout();
    int flag = 0;
    while (!flag && MPI_Test(&req, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS &&
           std::chrono::steady_clock::now() < deadline) {
    }
    if (!flag) abandon();
  }
  if (!abandoned) release_staging();  // an abandoned request may still write into them
}

DTRAIN_DETAIL_INLINE void mpi_communicator::request::stage([[maybe_unused]] buffer in, buffer out,
                                                           [[maybe_unused]] bool host_math,
                                                           [[maybe_unused]] stream_handle stream) {
  user_out = out;
  src = in;
  dst = out;
#if DTRAIN_HAS_CUDA()
  if (out.where != memory::device) return;
  try {
    device = out.device;
    if (device < 0) DTRAIN_CUDA_CHECK(cudaGetDevice(&device));
    detail::device_guard on(device);
    if (staging_->direct && !host_math) {
      direct = true;  // MPI reads the device memory now: the caller's work first
      DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
      return;
    }
    staged = true;
    const bool same = in.data == out.data;
    dst.data = take(out.bytes(), dst_block);
    dst.where = memory::host;
    src.data = same ? dst.data : take(in.bytes(), src_block);
    src.where = memory::host;
    if (in.bytes() > 0) {
      DTRAIN_CUDA_CHECK(cudaMemcpyAsync(src.data, in.data, in.bytes(), cudaMemcpyDefault, stream));
      DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  } catch (const backend_error& e) {
    throw backend_error(
        description() + ": staging the device buffer through pinned host memory: " + e.what(),
        e.engine_code());
  }
#endif
}

DTRAIN_DETAIL_INLINE bool mpi_communicator::request::poll() {
  if (finished) return true;
  if (req != MPI_REQUEST_NULL) {
    int flag = 0;
    int rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      fail(std::make_exception_ptr(
          backend_error(description() + ": " + detail::mpi_error_text(rc), rc)));
      health_->broken = true;
      health_->why.set(info(), "failed");
      finished = true;
      return true;
    }
    if (!flag) return false;
  }
  try {
    if (divide_by > 0) detail::divide_host(dst, divide_by);
#if DTRAIN_HAS_CUDA()
    if (staged && user_out.bytes() > 0) {
      detail::device_guard on(device);
      cudaStream_t copy = staging_->pool.copy_stream(device);
      DTRAIN_CUDA_CHECK(
          cudaMemcpyAsync(user_out.data, dst.data, user_out.bytes(), cudaMemcpyDefault, copy));
      DTRAIN_CUDA_CHECK(cudaStreamSynchronize(copy));
    }
#endif
  } catch (const backend_error& e) {
    fail(std::make_exception_ptr(backend_error(
        description() + ": copying the result back to the device: " + e.what(), e.engine_code())));
  } catch (...) {
    fail(std::current_exception());
  }
  release_staging();
  finished = true;
  return true;
}

DTRAIN_DETAIL_INLINE void mpi_communicator::request::abandon() noexcept {
  abandoned = true;
  health_->abandoned = true;
  health_->broken = true;
  health_->why.set(info(), "timed out");
}

DTRAIN_DETAIL_INLINE void mpi_communicator::request::release_staging() noexcept {
#if DTRAIN_HAS_CUDA()
  staging_->pool.give(std::exchange(src_block.data, nullptr), src_block.bytes);
  staging_->pool.give(std::exchange(dst_block.data, nullptr), dst_block.bytes);
#endif
}

DTRAIN_DETAIL_INLINE mpi_communicator::mpi_communicator(std::shared_ptr<mpi_environment> env,
                                                        MPI_Comm base, mpi_options options)
    : env_(std::move(env)),
      options_(std::move(options)),
      health_(std::make_shared<health>()),
      staging_(std::make_shared<staging>()) {
  if (options_.cuda_aware_direct) {
    if (!DTRAIN_HAS_CUDA() || !mpi_environment::cuda_aware()) {
      throw config_error(
          "mpi_options::cuda_aware_direct is set, but " +
          std::string(DTRAIN_HAS_CUDA()
                          ? "this MPI is not CUDA-aware (MPIX_Query_cuda_support() is not 1)"
                          : "dtrain is built without CUDA") +
          ": unset it, and device buffers are staged through pinned host memory");
    }
    staging_->direct = true;
  }
  DTRAIN_MPI_CHECK(MPI_Comm_dup(base, &comm_), "duplicating the MPI communicator");
  DTRAIN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "setting MPI_ERRORS_RETURN");
  DTRAIN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  DTRAIN_MPI_CHECK(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

DTRAIN_DETAIL_INLINE int mpi_communicator::count(const buffer& b,
                                                 const detail::collective_info& what) {
  if (b.count > static_cast<std::size_t>(INT_MAX)) {
    throw config_error(detail::describe(what) + ": " + std::to_string(b.count) +
                       " elements exceed MPI's int count; split the buffer");
  }
  return static_cast<int>(b.count);
}

DTRAIN_DETAIL_INLINE MPI_Datatype mpi_communicator::datatype(dtype t) {
  switch (t) {
    case dtype::float32: return MPI_FLOAT;
    case dtype::float64: return MPI_DOUBLE;
    case dtype::int32: return MPI_INT32_T;
    case dtype::int64: return MPI_INT64_T;
    case dtype::uint8: return MPI_UINT8_T;
    case dtype::float16:
    case dtype::bfloat16: return MPI_UINT16_T;  // reduced by dtrain's own MPI_Op
  }
  return MPI_DATATYPE_NULL;
}

DTRAIN_DETAIL_INLINE MPI_Op mpi_communicator::mpi_op(reduce_op op, dtype t) {
  if (t != dtype::float16 && t != dtype::bfloat16) {
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg: return MPI_SUM;
      case reduce_op::min: return MPI_MIN;
      case reduce_op::max: return MPI_MAX;
      case reduce_op::prod: return MPI_PROD;
    }
  }
  // Custom ops for the 16-bit floats, created on first use: [type][sum, min, max, prod].
  const std::size_t slot = (t == dtype::bfloat16 ? 4u : 0u) + (op == reduce_op::min    ? 1u
                                                               : op == reduce_op::max  ? 2u
                                                               : op == reduce_op::prod ? 3u
                                                                                       : 0u);
  if (ops_[slot] == MPI_OP_NULL) {
    static MPI_User_function* const functions[8] = {
        &reduce_16bit<float16, reduce_op::sum>,  &reduce_16bit<float16, reduce_op::min>,
        &reduce_16bit<float16, reduce_op::max>,  &reduce_16bit<float16, reduce_op::prod>,
        &reduce_16bit<bfloat16, reduce_op::sum>, &reduce_16bit<bfloat16, reduce_op::min>,
        &reduce_16bit<bfloat16, reduce_op::max>, &reduce_16bit<bfloat16, reduce_op::prod>};
    DTRAIN_MPI_CHECK(MPI_Op_create(functions[slot], 1, &ops_[slot]),
                     "creating the 16-bit float MPI_Op");
  }
  return ops_[slot];
}

DTRAIN_DETAIL_INLINE std::int64_t mpi_communicator::verify(const detail::collective_info& info) {
  const std::int64_t sequence = detail::record(*ring_, info);
  if (!options_.collectives.check) return sequence;
  detail::compare_signatures(
      detail::signature_of(sequence, info), rank_, size_, info,
      [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
        DTRAIN_MPI_CHECK(MPI_Allgather(in.data(), static_cast<int>(in.size()), MPI_INT64_T,
                                       out.data(), static_cast<int>(in.size()), MPI_INT64_T, comm_),
                         detail::describe(info) + " (check mode)");
      });
  return sequence;
}

DTRAIN_DETAIL_INLINE std::array<MPI_Op, 8> mpi_communicator::no_ops() noexcept {
  std::array<MPI_Op, 8> ops;
  ops.fill(MPI_OP_NULL);
  return ops;
}
}  // namespace dtrain
#endif

#if DTRAIN_HAS_MPI()
namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE mpi_relay::mpi_relay(MPI_Comm comm, int root) : comm_(comm), root_(root) {
  DTRAIN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_),
                   "MPI_Comm_rank for a broadcast from rank " + std::to_string(root));
}

DTRAIN_DETAIL_INLINE void mpi_relay::carry(std::string& message, const std::string& what) {
  std::uint64_t length = message.size();
  DTRAIN_MPI_CHECK(MPI_Bcast(&length, 1, MPI_UINT64_T, root_, comm_), what);
  if (length > max_length) {
    throw backend_error(what + ": rank " + std::to_string(root_) + " sent a value of " +
                            std::to_string(length) + " bytes, more than the 1 MiB allowed",
                        0);
  }
  message.resize(static_cast<std::size_t>(length));
  if (length > 0) {
    DTRAIN_MPI_CHECK(MPI_Bcast(message.data(), static_cast<int>(length), MPI_BYTE, root_, comm_),
                     what);
  }
}

DTRAIN_DETAIL_INLINE int mpi_rank(MPI_Comm comm) {
  int rank = -1;
  DTRAIN_MPI_CHECK(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  return rank;
}

DTRAIN_DETAIL_INLINE int mpi_size(MPI_Comm comm) {
  int size = 0;
  DTRAIN_MPI_CHECK(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  return size;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> mpi_gather_text(MPI_Comm comm,
                                                              const std::string& mine, int root,
                                                              const std::string& what) {
  const bool is_root = mpi_rank(comm) == root;
  const int length = static_cast<int>(mine.size());
  std::vector<int> lengths(is_root ? static_cast<std::size_t>(mpi_size(comm)) : 0);
  DTRAIN_MPI_CHECK(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, root, comm), what);
  std::vector<int> offsets(lengths.size());
  std::string all;
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    offsets[r] = static_cast<int>(all.size());
    all.resize(all.size() + static_cast<std::size_t>(lengths[r]));
  }
  DTRAIN_MPI_CHECK(MPI_Gatherv(mine.data(), length, MPI_BYTE, all.data(), lengths.data(),
                               offsets.data(), MPI_BYTE, root, comm),
                   what);
  std::vector<std::string> out;
  for (std::size_t r = 0; r < lengths.size(); ++r)
    out.push_back(
        all.substr(static_cast<std::size_t>(offsets[r]), static_cast<std::size_t>(lengths[r])));
  return out;
}

}  // namespace detail
}  // namespace dtrain
#endif
