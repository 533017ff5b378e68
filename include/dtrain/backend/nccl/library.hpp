#pragma once
/// @file
/// NCCL as one narrow seam: DTRAIN_NCCL_CHECK, and `nccl_library`, every
/// CUDA and NCCL call the NCCL engine makes as static members of the same
/// names. The engine's classes (engine.hpp, nccl.hpp) take such a
/// runtime as their template argument `Api`: this one in production, a host
/// fake in the tests of NCCL at several ranks (tests/engines/fake_nccl.hpp).
/// Compiles to nothing unless DTRAIN_HAS_NCCL().

#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/memory.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <cstddef>
#include <string>

#if DTRAIN_HAS_NCCL()
#include <cuda_runtime.h>
#include <nccl.h>

namespace dtrain::detail {

/// "NCCL call `ncclAllReduce(...)` failed: invalid usage (...); NCCL's last
/// error: ... (ncclResult_t 5, at file:line)".
DTRAIN_DETAIL_INLINE std::string nccl_error_text(ncclResult_t code, const char* call,
                                                 const char* file, int line);

[[noreturn]] inline void throw_nccl_error(ncclResult_t code, const char* call, const char* file,
                                          int line) {
  throw backend_error(nccl_error_text(code, call, file, line), static_cast<int>(code));
}

}  // namespace dtrain::detail

/// Evaluates `call` (an NCCL function) and yields its ncclResult_t. Throws
/// dtrain::backend_error with the call as written, file:line, NCCL's error
/// string and last error, and the code (backend_error::engine_code()), unless
/// the result is ncclSuccess or ncclInProgress (a non-blocking communicator
/// still working in the background: poll ncclCommGetAsyncError).
#define DTRAIN_NCCL_CHECK(call)                                                           \
  ([&]() -> ncclResult_t {                                                                \
    const ncclResult_t dtrain_nccl_status_ = (call);                                      \
    if (dtrain_nccl_status_ != ncclSuccess && dtrain_nccl_status_ != ncclInProgress)      \
      ::dtrain::detail::throw_nccl_error(dtrain_nccl_status_, #call, __FILE__, __LINE__); \
    return dtrain_nccl_status_;                                                           \
  }())

namespace dtrain::detail {

/// The NCCL calls the engine makes, with the CUDA runtime's (cuda_library):
/// the seam that tests replace with a host fake (tests/engines/fake_nccl.hpp).
/// Each member is the NCCL function of the same name and signature; error
/// texts (ncclGetErrorString, ncclGetLastError) are not part of the seam.
struct nccl_library : cuda_library {
  static ncclResult_t ncclGetUniqueId(ncclUniqueId* id) { return ::ncclGetUniqueId(id); }
  static ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int size, ncclUniqueId id, int rank,
                                             ncclConfig_t* config) {
    return ::ncclCommInitRankConfig(comm, size, id, rank, config);
  }
  static ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
    return ::ncclCommGetAsyncError(comm, state);
  }
  static ncclResult_t ncclCommAbort(ncclComm_t comm) { return ::ncclCommAbort(comm); }
#if defined(NCCL_REVOKE_DEFAULT)
  /// NCCL 2.28 and later: stops the communicator's work without freeing it
  /// (and without waiting for other communicators' kernels).
  static constexpr bool has_revoke = true;
  static ncclResult_t ncclCommRevoke(ncclComm_t comm, int flags) {
    return ::ncclCommRevoke(comm, flags);
  }
#else
  static constexpr bool has_revoke = false;
#endif
  static ncclResult_t ncclCommFinalize(ncclComm_t comm) { return ::ncclCommFinalize(comm); }
  static ncclResult_t ncclCommDestroy(ncclComm_t comm) { return ::ncclCommDestroy(comm); }
  static ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out,
                                    ncclConfig_t* config) {
    return ::ncclCommSplit(comm, color, key, out, config);
  }
  static ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
    return ::ncclCommUserRank(comm, rank);
  }
  static ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
    return ::ncclCommCount(comm, count);
  }
  static ncclResult_t ncclAllReduce(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                    cudaStream_t stream) {
    return ::ncclAllReduce(in, out, count, type, op, comm, stream);
  }
  static ncclResult_t ncclBroadcast(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, int root, ncclComm_t comm,
                                    cudaStream_t stream) {
    return ::ncclBroadcast(in, out, count, type, root, comm, stream);
  }
  static ncclResult_t ncclAllGather(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
    return ::ncclAllGather(in, out, count, type, comm, stream);
  }
  static ncclResult_t ncclReduceScatter(const void* in, void* out, std::size_t count,
                                        ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t stream) {
    return ::ncclReduceScatter(in, out, count, type, op, comm, stream);
  }
  /// Block j of `in` (size blocks of `count`) to rank j, block i of `out`
  /// from rank i: one NCCL group of a send and a receive per peer (NCCL 2.7's
  /// point-to-point calls; ncclAlltoAll is newer than the NCCL dtrain supports).
  static ncclResult_t alltoall(const void* in, void* out, std::size_t count, ncclDataType_t type,
                               std::size_t width, int size, ncclComm_t comm, cudaStream_t stream) {
    ncclResult_t r = ::ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (int peer = 0; peer < size && r == ncclSuccess; ++peer) {
      const std::size_t at = static_cast<std::size_t>(peer) * count * width;
      r = ::ncclSend(static_cast<const char*>(in) + at, count, type, peer, comm, stream);
      if (r == ncclSuccess)
        r = ::ncclRecv(static_cast<char*>(out) + at, count, type, peer, comm, stream);
    }
    const ncclResult_t end = ::ncclGroupEnd();  // a group left open would swallow later calls
    return r != ncclSuccess ? r : end;
  }
  /// dtrain's own kernel, not NCCL's: out[i] = in[i] / divisor for 16-bit
  /// `type`, on `stream` (the average of 16-bit data divides each element
  /// first). The kernel exists where a unit of the program was compiled by
  /// nvcc (detail::device_casts); config_error otherwise.
  static cudaError_t divide(void* out, const void* in, std::size_t count, dtype type, float divisor,
                            cudaStream_t stream) {
    registered_device_casts().divide(out, in, count, type, divisor, stream);
    return cudaSuccess;
  }
  /// Whether divide() can run (some unit of the program was compiled by nvcc).
  [[nodiscard]] static bool can_divide() noexcept { return device_casts_available(); }
  static ncclResult_t ncclGroupStart() { return ::ncclGroupStart(); }
  static ncclResult_t ncclGroupEnd() { return ::ncclGroupEnd(); }
};

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_NCCL()

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/nccl/library-inl.hpp>
#endif
