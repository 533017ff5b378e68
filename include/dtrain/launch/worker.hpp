#pragma once
/// @file
/// How a worker process ends its part in a job so that the job ends too:
/// it ignores SIGPIPE (a write to a dead peer becomes an error that names
/// the peer instead of a silent death), and a failed rank under MPI calls
/// MPI_Abort, so that mpirun ends every rank at once instead of leaving the
/// failed one blocked in MPI_Finalize while its peers wait out their timeout.
/// It also tells its agent how far its communicator got (collective_progress),
/// so that the agent can name a rank that left its peers waiting.

#include <dtrain/config.hpp>
#include <dtrain/diagnostics/ring.hpp>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#if DTRAIN_HAS_MPI()
#include <mpi.h>
#endif

namespace dtrain::detail {

/// Ignores SIGPIPE in this process: a peer that dies mid-write gives EPIPE,
/// which the engines and the store turn into an error naming the peer. Under
/// an agent, a worker killed by SIGPIPE would otherwise be blamed as the
/// root cause of a failure it only witnessed.
inline void ignore_sigpipe() noexcept { std::signal(SIGPIPE, SIG_IGN); }

/// Whether MPI is initialised and not yet finalised in this process (by
/// dtrain's MPI backend or by the user); false in a build without MPI.
DTRAIN_DETAIL_INLINE bool mpi_is_running() noexcept;

/// Ends the whole MPI job with `status` as MPI_Abort's error code (Open MPI's
/// mpirun exits with it) when MPI is running and `status` is not 0; returns
/// otherwise. Call it after the failure's one-line report: the report is
/// flushed first, since MPI_Abort does not return.
DTRAIN_DETAIL_INLINE void abort_mpi_job(int status) noexcept;

/// How far a worker's communicators got, as its agent reports it. Each is
/// named by its ring ("world", "world/split 1 (color 0)"): every rank that
/// splits in the same order gives the same split the same name, so counts
/// of the same name compare across ranks.
struct collective_progress {
  std::vector<std::pair<std::string, std::int64_t>> issued;  ///< collectives issued, by ring
  std::string failed_on;       ///< the ring of the first collective that failed or timed out
  std::int64_t failed_at = 0;  ///< that collective's number (#N); 0: none failed
};

/// The progress of `communicator` and its kept splits; nothing when there is
/// no communicator yet, or its engine keeps no ring of its collectives.
template <class Communicator>
collective_progress progress_of(const std::optional<Communicator>& communicator) {
  collective_progress p;
  if constexpr (requires { communicator->ring(); }) {
    const auto ring = communicator ? communicator->ring() : nullptr;
    if (!ring) return p;
    for (auto& [name, calls] : ring->snapshot_all()) {
      p.issued.emplace_back(name, calls.empty() ? 0 : calls.back().seq);
      for (const call_record& c : calls) {
        if (p.failed_at != 0) break;
        if (c.state == call_state::failed || c.state == call_state::timed_out) {
          p.failed_on = name;
          p.failed_at = c.seq;
        }
      }
    }
  }
  return p;
}

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/worker-inl.hpp>
#endif
