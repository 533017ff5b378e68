# Desync and hang diagnostics (issue 13): included from tests/CMakeLists.txt.
#
# desync.<case>.<backend>.4ranks runs tests/desync/desync_peer.cpp on 4 ranks,
# under mpirun for MPI and dtrain_test_launch for Gloo and NCCL (its host fake),
# with a short collective timeout; rank 2 skips a step, sleeps past the
# timeout, stalls past it between two buckets, calls with a different size
# (not on NCCL), exits, or skips and sends itself SIGUSR1. The job must fail and print
# one diagnostics table whose summary names rank 2 and what it did, and the
# failing ranks' error lines carry the summary (tests/scripts/check_job.cmake
# checks the status and the regexes).
set(desync_backends "")
if(DTRAIN_WITH_MPI AND MPIEXEC_EXECUTABLE)
  list(APPEND desync_backends mpi)
endif()
if(DTRAIN_WITH_GLOO)
  list(APPEND desync_backends gloo)
endif()
# nccl: the NCCL engine over its host fake (engines/fake_nccl.hpp), DDP's
# buckets in the fake's device memory (issue 47).
if(DTRAIN_WITH_NCCL)
  list(APPEND desync_backends nccl)
endif()

if(desync_backends)
  add_executable(dtrain_desync_peer desync/desync_peer.cpp)
  target_link_libraries(dtrain_desync_peer PRIVATE dtrain::dtrain)
  dtrain_target_warnings(dtrain_desync_peer)
  add_dependencies(dtrain_desync_peer dtrain_test_launch)
endif()

# What every table shows for each case: <case>:<regexes, separated by '!'>.
# "[^\n]" keeps a match on one line, "." stands for ';' (a CMake list separator); the bucket numbers are DDP's (layer1
# is marked first, so it is bucket 0).
set(desync_bucket "allreduce\\(float32 .+ 65536, bucket 0\\)")
set(desync_cases
  "skip:collective diagnostics, round 1, after a (timeout|failed collective) on rank [013]!rank 2 is at #[0-9]+ allreduce\\(float32 [^\n]+ 262144, bucket 1\\). ranks 0, 1, 3 wait in #[0-9]+ ${desync_bucket}: rank 2 never started #[0-9]+"
  "stall:collective diagnostics, round 1, after a (timeout|failed collective) on rank [013]!rank 2 is at #[0-9]+ ${desync_bucket}. ranks 0, 1, 3 wait in #[0-9]+ allreduce\\(float32 [^\n]+ 262144, bucket 1\\): rank 2 never started"
  "sleep:collective diagnostics, round 1, after a (timeout|failed collective) on rank [013]!rank 2 is at #[0-9]+ [^\n]+. ranks 0, 1, 3 wait in #[0-9]+ ${desync_bucket}: rank 2 never started"
  "size:collective diagnostics, round 1, after a (timeout|failed collective) on rank [0-3]!rank 2 is in #[0-9]+ allreduce\\(float32 [^\n]+ 0\\). ranks 0, 1, 3 are in #[0-9]+ allreduce\\(float32 [^\n]+ 1000\\): the sizes differ"
  "gone:collective diagnostics, round 1, after a (timeout|failed collective) on rank [013]!rank 2 did not answer \\(process gone, or frozen\\). ranks 0, 1, 3 wait in #[0-9]+ ${desync_bucket}"
  "signal:collective diagnostics, round 1, after SIGUSR1 on rank 2!rank 2 is at #[0-9]+ [^\n]+. ranks 0, 1, 3 wait in #[0-9]+ ${desync_bucket}: rank 2 never started")

foreach(backend IN ITEMS mpi gloo nccl)
  foreach(entry IN LISTS desync_cases)
    string(REGEX MATCH "^([^:]+):(.*)$" matched "${entry}")
    set(case "${CMAKE_MATCH_1}")
    set(regexes "${CMAKE_MATCH_2}")
    if(backend STREQUAL "nccl" AND case STREQUAL "size")
      continue()  # NCCL's answer to a size mismatch is a hang or garbage: nothing to compare
    endif()
    if(NOT backend IN_LIST desync_backends)
      dtrain_add_skipped_test(desync.${case}.${backend}.4ranks "needs ${backend} (DTRAIN_WITH_${backend} is OFF or no mpiexec)")
      continue()
    endif()
    string(REPLACE "!" ";" regexes "${regexes}")
    set(clean "")  # the fake's meeting directory (nccl), removed before the job
    # Every run also says the same on the failing ranks' own error line.
    list(APPEND regexes "\\[rank [0-3]/4\\] dtrain: [^\n]+. diagnostics: ")
    if(backend STREQUAL "mpi")
      # Any failure. A rank that gave up a collective leaves without
      # MPI_Finalize and mpirun aborts the job, during which Open MPI 4.1.4's
      # mpirun itself sometimes crashes in PMIx_server_finalize.
      set(status "[1-9][0-9]*|Segmentation fault")
      set(job "${MPIEXEC_EXECUTABLE}" ${MPIEXEC_NUMPROC_FLAG} 4 ${MPIEXEC_PREFLAGS} ${DTRAIN_MPIEXEC_PREFLAGS}
              $<TARGET_FILE:dtrain_desync_peer> mpi ${case} ${MPIEXEC_POSTFLAGS})
      set(env ${DTRAIN_MPI_TEST_ENVIRONMENT})
    elseif(backend STREQUAL "nccl")
      # Every rank ends on its own, as under Gloo. The peers' buckets time out
      # on DDP's watchdog (the host does not wait for them), after the
      # training function has returned: run() fails the rank with that timeout
      # (before: exit 0, the last step's gradients never averaged). The rank
      # that slept wakes after its peers have failed: its collectives time
      # out or (the fake keeps the peers' parts) complete, and then rank 0's
      # store is gone with rank 0: DTRAIN_STORE_IO_TIMEOUT bounds the search.
      set(job $<TARGET_FILE:dtrain_test_launch> --no-kill 4 $<TARGET_FILE:dtrain_desync_peer> nccl ${case})
      set(fake_dir "${CMAKE_CURRENT_BINARY_DIR}/fake_nccl/desync.${case}")
      set(env "FAKE_NCCL_DIR=${fake_dir}" DTRAIN_STORE_IO_TIMEOUT=5)
      set(clean "-DCLEAN_DIR=${fake_dir}")
      set(status 1)
    else()
      # --no-kill: every rank ends on its own (status 1), so the status says how the job ended.
      set(job $<TARGET_FILE:dtrain_test_launch> --no-kill 4 $<TARGET_FILE:dtrain_desync_peer> gloo ${case})
      set(env "")
      set(status 1)
    endif()
    set(expect_args ${clean})
    set(n 0)
    foreach(regex IN LISTS regexes)
      math(EXPR n "${n} + 1")
      list(APPEND expect_args "-DEXPECT_${n}=${regex}")
    endforeach()
    list(JOIN job "|" job)
    dtrain_add_test(desync.${case}.${backend}.4ranks
      COMMAND "${CMAKE_COMMAND}" "-DCOMMAND=${job}" "-DEXPECT_STATUS=${status}" ${expect_args}
              -P "${scripts}/check_job.cmake"
      TIMEOUT 120
      ENVIRONMENT DTRAIN_COLLECTIVE_TIMEOUT=4 DTRAIN_DIAGNOSTICS_WAIT=3 DTRAIN_STORE_TIMEOUT=30 ${env}
      PROPERTIES PROCESSORS 4)
  endforeach()
endforeach()

# SIGUSR1 to dtrun: forwarded to the workers, who print the table (tests/launch/cases.sh).
if("gloo" IN_LIST desync_backends AND DTRAIN_BASH AND TARGET dtrun)
  dtrain_add_test(desync.sigusr1.dtrun.4ranks COMMAND "${DTRAIN_BASH}" "${launch_cases}" dtrun_sigusr1
    TIMEOUT 120 ENVIRONMENT DTRUN=$<TARGET_FILE:dtrun> DESYNC=$<TARGET_FILE:dtrain_desync_peer>
    PROPERTIES PROCESSORS 4)
  # Rank 2 stops calling collectives: the flight records it and the others wrote
  # (dtrun --log-dir) name it after the job as the live table did (issue 51).
  dtrain_add_test(desync.flight.dtrun.4ranks COMMAND "${DTRAIN_BASH}" "${launch_cases}" dtrun_flight
    TIMEOUT 120 ENVIRONMENT DTRUN=$<TARGET_FILE:dtrun> DESYNC=$<TARGET_FILE:dtrain_desync_peer>
    PROPERTIES PROCESSORS 4)
  # Rank 2 returns 0 one step short: dtrun's summary names it before the rank that waited for it.
  dtrain_add_test(desync.exit.dtrun.4ranks COMMAND "${DTRAIN_BASH}" "${launch_cases}" dtrun_exit
    TIMEOUT 120 ENVIRONMENT DTRUN=$<TARGET_FILE:dtrun> DESYNC=$<TARGET_FILE:dtrain_desync_peer>
    PROPERTIES PROCESSORS 4)
else()
  dtrain_add_skipped_test(desync.sigusr1.dtrun.4ranks "needs Gloo, bash and the example dtrun")
  dtrain_add_skipped_test(desync.exit.dtrun.4ranks "needs Gloo, bash and the example dtrun")
  dtrain_add_skipped_test(desync.flight.dtrun.4ranks "needs Gloo, bash and the example dtrun")
endif()
