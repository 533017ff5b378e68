# NCCL at two ranks and more without a GPU (issue 31): the NCCL engine itself
# (dtrain::basic_nccl_communicator) over a host fake of CUDA and NCCL
# (engines/fake_nccl.hpp), under dtrain::run and dtrain_test_launch. Each test
# injects what only a peer can cause and checks how the job ends, with
# scripts/check_job.cmake; each test's TIMEOUT is what a hang runs into.
# Included from tests/CMakeLists.txt where DTRAIN_WITH_NCCL is on.
add_executable(dtrain_nccl_ranks engines/nccl_ranks.cpp)
target_link_libraries(dtrain_nccl_ranks PRIVATE dtrain::dtrain)
dtrain_target_warnings(dtrain_nccl_ranks)
add_dependencies(dtrain_nccl_ranks dtrain_test_launch)

set(nccl_ranks_meet "${CMAKE_CURRENT_BINARY_DIR}/fake_nccl")
set(nccl_ranks_check "${scripts}/check_job.cmake")

# nccl_ranks_test(<name> <ranks> <mode> STATUS <regex> EXPECT <regex>... [NO_KILL]
#                 [NODES <a,b,...>] [ENVIRONMENT <var=value>...])
# NODES runs the ranks as simulated nodes (for topology::hierarchical).
function(nccl_ranks_test name ranks mode)
  cmake_parse_arguments(PARSE_ARGV 3 arg "NO_KILL" "STATUS;NODES" "EXPECT;ENVIRONMENT")
  set(launch "$<TARGET_FILE:dtrain_test_launch>")
  if(arg_NO_KILL)
    string(APPEND launch "|--no-kill")
  endif()
  if(arg_NODES)
    string(APPEND launch "|--nodes|${arg_NODES}")
  endif()
  set(expects "")
  set(n 0)
  foreach(e IN LISTS arg_EXPECT)
    math(EXPR n "${n} + 1")
    list(APPEND expects "-DEXPECT_${n}=${e}")
  endforeach()
  set(test nccl.ranks.${name}.${ranks}ranks)
  dtrain_add_test(${test}
    COMMAND "${CMAKE_COMMAND}" "-DCOMMAND=${launch}|${ranks}|$<TARGET_FILE:dtrain_nccl_ranks>|${mode}"
            "-DEXPECT_STATUS=${arg_STATUS}" ${expects} "-DCLEAN_DIR=${nccl_ranks_meet}/${test}"
            -P "${nccl_ranks_check}"
    TIMEOUT 60
    ENVIRONMENT "FAKE_NCCL_DIR=${nccl_ranks_meet}/${test}" ${arg_ENVIRONMENT}
    PROPERTIES PROCESSORS ${ranks})
endfunction()

# Every collective at 2, 3 and 4 ranks against the serial answer.
foreach(ranks IN ITEMS 2 3 4)
  nccl_ranks_test(collectives ${ranks} collectives STATUS 0
    EXPECT "rank 0 of ${ranks}: every collective matches the serial answer")
endforeach()
# Item 1: rank 0's third enqueue blocks inside NCCL (a launch queue of 2) behind
# collectives rank 1 never joins; the watchdog's timeout aborts the communicator
# from its own thread and the blocked call ends with timeout_error and the
# diagnostics table. (With the lock held across the enqueue, the abort waited
# for it: a hang.)
nccl_ranks_test(blocked_enqueue 2 blocked-enqueue STATUS "[1-9][0-9]*"
  EXPECT "[[]rank 0/2[]] dtrain: allreduce[^\n]*the communicator was aborted [(][^\n]*timed out[)]"
         "rank 1 never started #1"
         "collective diagnostics, round 1, after a timeout on rank 0"
  ENVIRONMENT FAKE_NCCL_LAUNCH_QUEUE=2 DTRAIN_COLLECTIVE_TIMEOUT=2)
# Issue 47, item 3: the same in NCCL's blocking mode, where the blocked call
# holds the communicator while the watchdog aborts it: the abort stops it
# (ncclCommRevoke) and the call, once out, frees it. (Before: ncclCommAbort
# freed it under the call, which then used it: the fake ends the process.)
nccl_ranks_test(blocked_enqueue_blocking 2 blocked-enqueue STATUS "[1-9][0-9]*"
  EXPECT "[[]rank 0/2[]] dtrain: allreduce[^\n]*the communicator was aborted [(][^\n]*timed out[)]"
         "collective diagnostics, round 1, after a timeout on rank 0"
  ENVIRONMENT FAKE_NCCL_LAUNCH_QUEUE=2 DTRAIN_COLLECTIVE_TIMEOUT=2 NCCL_COMM_BLOCKING=1)
# Item 2: a watchdog stuck in an abort that never returns (NCCL's threads)
# ends the process with a message DTRAIN_WATCHDOG_HEARTBEAT after the
# deadline, instead of holding it for ever.
nccl_ranks_test(watchdog_stuck 2 blocked-enqueue STATUS "[1-9][0-9]*"
  EXPECT "dtrain: the watchdog following allreduce[^\n]*on rank 0 of 2[^\n]*is stuck 2.0 s past its deadline[^\n]*ending the process [(]DTRAIN_WATCHDOG_HEARTBEAT[)]"
         "dtrain_test_launch: rank 0 exited with status 1"
  ENVIRONMENT FAKE_NCCL_LAUNCH_QUEUE=2 DTRAIN_COLLECTIVE_TIMEOUT=2 DTRAIN_WATCHDOG_HEARTBEAT=2
              FAKE_NCCL_ABORT_HANGS=1)
# Item 1: the host runs at most max_in_flight (64) collectives ahead of the device.
nccl_ranks_test(in_flight_bound 2 in-flight STATUS "[1-9][0-9]*"
  EXPECT "[[]rank 0/2[]] dtrain: [^\n]*at most nccl_options::max_in_flight = 64 unfinished[^\n]*did not finish within 2.0 s"
  ENVIRONMENT DTRAIN_COLLECTIVE_TIMEOUT=2)
# Item 2: a rank whose training function throws, with a collective still waiting
# for its peer, exits at once (its communicator is aborted, not finalized after
# the 300 s collective timeout).
nccl_ranks_test(failed_rank_exits 2 throws STATUS "[1-9][0-9]*"
  EXPECT "[[]rank 0/2[]] dtrain: rank 0 fails on purpose" "dtrain_test_launch: rank 0 exited with status 1"
  ENVIRONMENT DTRAIN_COLLECTIVE_TIMEOUT=300)
# An asynchronous NCCL error (a peer's network gone) ends the wait with NCCL's words.
nccl_ranks_test(async_error 2 async-error STATUS "[1-9][0-9]*"
  EXPECT "[[]rank [01]/2[]] dtrain: allreduce[^\n]*failed: NCCL reports remote process exited or there was a network error"
  ENVIRONMENT FAKE_NCCL_ASYNC_ERROR_AT=2)
# Item 4: rank 0 has no device, or cannot make the id: every rank fails at once
# with rank 0's own message. Rank 0 hosts the store, and stays (at most 10 s)
# until they have read it: here they start half a second after it has failed.
nccl_ranks_test(rank0_no_device 2 start NO_KILL STATUS 1
  EXPECT "[[]rank 1/2[]] dtrain: rank 0 could not provide the NCCL unique id: [^\n]*no usable CUDA device"
  ENVIRONMENT FAKE_CUDA_NO_DEVICE_RANK=0 NCCL_RANKS_LATE_PEERS_MS=500)
nccl_ranks_test(rank0_id_fails 3 start NO_KILL STATUS 1
  EXPECT "[[]rank 1/3[]] dtrain: rank 0 could not provide the NCCL unique id: NCCL call `ncclGetUniqueId[(]&id[)]` failed"
         "[[]rank 2/3[]] dtrain: rank 0 could not provide the NCCL unique id: NCCL call `ncclGetUniqueId[(]&id[)]` failed"
  ENVIRONMENT FAKE_NCCL_ID_FAILS=1 NCCL_RANKS_LATE_PEERS_MS=500)
# Item 5: two ranks shown the same GPU (CUDA_VISIBLE_DEVICES=2,2) are a config_error
# on every rank, naming the GPU and both ranks' CUDA_VISIBLE_DEVICES.
nccl_ranks_test(shared_gpu 2 start NO_KILL STATUS 2
  EXPECT "[[]rank 0/2[]] dtrain: ranks 0 and 1 on host [^\n]* both use GPU GPU-fake2-[^\n]*CUDA_VISIBLE_DEVICES=2,2"
         "[[]rank 1/2[]] dtrain: ranks 0 and 1 on host [^\n]* both use GPU GPU-fake2-"
  ENVIRONMENT CUDA_VISIBLE_DEVICES=2,2)
# A rank that cannot read its GPU: rank 0 reports rank 1's reason, and when it is
# rank 0 itself, the others fail at once with its message (nobody waits for it).
nccl_ranks_test(gpu_unreadable_rank1 2 start NO_KILL STATUS 1
  EXPECT "[[]rank 0/2[]] dtrain: rank 1 cannot use its GPU: CUDA call `device_identity[^\n]*cudaErrorECCUncorrectable"
         "[[]rank 1/2[]] dtrain: CUDA call `device_identity[(]device, gpu.uuid, gpu.pci_bus[)]` failed: cudaErrorECCUncorrectable"
  ENVIRONMENT FAKE_CUDA_IDENTITY_FAILS_RANK=1)
nccl_ranks_test(gpu_unreadable_rank0 2 start NO_KILL STATUS 1
  EXPECT "[[]rank 1/2[]] dtrain: rank 0 could not provide the check that every rank has a GPU of its own: CUDA call `device_identity[^\n]*cudaErrorECCUncorrectable"
  ENVIRONMENT FAKE_CUDA_IDENTITY_FAILS_RANK=0 NCCL_RANKS_LATE_PEERS_MS=500)
nccl_ranks_test(own_gpus 2 start NO_KILL STATUS 0
  EXPECT "rank 1 of 2: the communicator is up on device 1"
  ENVIRONMENT CUDA_VISIBLE_DEVICES=2,3)
# A rank whose NCCL init fails (after the id and the GPU check) publishes its
# error in the store; the others, still waiting for init, fail naming it at
# once instead of after DTRAIN_NCCL_INIT_TIMEOUT (300 s, past this test's TIMEOUT).
nccl_ranks_test(init_fails_rank1 3 start NO_KILL STATUS 1
  EXPECT "[[]rank 0/3[]] dtrain: creating the NCCL communicator of rank 0 of 3[^\n]*: rank 1 failed[^\n]*ncclCommInitRankConfig[^\n]*unhandled system error"
         "[[]rank 2/3[]] dtrain: creating the NCCL communicator of rank 2 of 3[^\n]*: rank 1 failed[^\n]*ncclCommInitRankConfig"
         "[[]rank 1/3[]] dtrain: creating the NCCL communicator of rank 1 of 3[^\n]*ncclCommInitRankConfig"
  ENVIRONMENT FAKE_NCCL_INIT_FAILS_RANK=1 DTRAIN_NCCL_INIT_TIMEOUT=300)
# Rank 0 hosts the store: when its init fails, it stays until the others have read why.
nccl_ranks_test(init_fails_rank0 3 start NO_KILL STATUS 1
  EXPECT "[[]rank 1/3[]] dtrain: creating the NCCL communicator of rank 1 of 3[^\n]*: rank 0 failed[^\n]*ncclCommInitRankConfig"
         "[[]rank 2/3[]] dtrain: creating the NCCL communicator of rank 2 of 3[^\n]*: rank 0 failed[^\n]*ncclCommInitRankConfig"
  ENVIRONMENT FAKE_NCCL_INIT_FAILS_RANK=0 DTRAIN_NCCL_INIT_TIMEOUT=300)

# Issue 47: DistributedDataParallel through the NCCL engine (its split, device
# memory, non-blocking launches, groups): every step's means, and ZeRO's
# values after the gathers, flat at 2-4 ranks and hierarchical on 2 nodes of 2;
# item 7: the steps after the first send no request to the store.
foreach(ranks IN ITEMS 2 3 4)
  foreach(mode IN ITEMS ddp zero1 zero2 zero3)
    set(sharding_name none)
    if(mode STREQUAL "zero1")
      set(sharding_name optimizer)
    elseif(mode STREQUAL "zero2")
      set(sharding_name gradients)
    elseif(mode STREQUAL "zero3")
      set(sharding_name parameters)
    endif()
    nccl_ranks_test(${mode} ${ranks} ${mode} STATUS 0
      EXPECT "rank 0 of ${ranks}: 3 DDP steps [(]sharding ${sharding_name}[)] averaged right")
  endforeach()
endforeach()
# Item 6: FAKE_NCCL_ONE_COMM_AT_A_TIME ends a rank whose local and cross
# collectives run at once (ZeRO's reduce-scatter and allgather pipelines did,
# across buckets).
foreach(mode IN ITEMS ddp zero1 zero2 zero3)
  nccl_ranks_test(${mode}_hierarchical 4 ${mode}-hierarchical NODES 2,2 STATUS 0
    EXPECT "rank 0 of 4: 3 DDP steps [^\n]* on 2 node[(]s[)], hierarchical"
    ENVIRONMENT FAKE_NCCL_ONE_COMM_AT_A_TIME=1)
endforeach()
# Item 1: rank 0 throws mid-step with a DDP bucket and a collective of its own
# waiting for rank 1, under a 300 s collective timeout: it exits within the
# test's limit (before: ~watchdog followed the bucket to its deadline, and an
# abort of one communicator waited behind the other's spinning collective).
nccl_ranks_test(ddp_throws 2 ddp-throws STATUS "[1-9][0-9]*"
  EXPECT "[[]rank 0/2[]] dtrain: rank 0 fails on purpose in the middle of a DDP step"
         "dtrain_test_launch: rank 0 exited with status 1"
  ENVIRONMENT DTRAIN_COLLECTIVE_TIMEOUT=300)
# Issue 49: ddp_options::accumulate = float32 through the engine's alltoall,
# each rank's sum on the communicator's stream: every mean the float32 sum of
# the 16-bit inputs rounded once, bit for bit, flat and on 2 nodes of 2.
foreach(ranks IN ITEMS 2 3 4)
  nccl_ranks_test(accumulate ${ranks} accumulate STATUS 0
    EXPECT "rank 0 of ${ranks}: float32 accumulation, flat: every mean is the float32 sum")
endforeach()
nccl_ranks_test(accumulate_hierarchical 4 accumulate-hierarchical NODES 2,2 STATUS 0
  EXPECT "rank 0 of 4: float32 accumulation, hierarchical: every mean is the float32 sum"
  ENVIRONMENT FAKE_NCCL_ONE_COMM_AT_A_TIME=1)
# Item 4: 16-bit means that do not depend on the job size: at 3 ranks ncclAvg
# would multiply by bf16(1/3) = 0.333984 (+0.195 %); at 4, 1/4 is exact.
foreach(ranks IN ITEMS 3 4)
  nccl_ranks_test(mean16 ${ranks} mean16 STATUS 0
    EXPECT "rank 0 of ${ranks}: 16-bit means are unbiased")
endforeach()
# Issue 51: the timeline's device time through the engine. Each collective
# takes 20 ms on the fake's stream: every bucket's span ends with its device
# span, which holds the collective it times, from its start to its completion
# (the host enqueues at once, before the collective has even started).
nccl_ranks_test(timeline 2 timeline STATUS 0
  EXPECT "rank 0 of 2: [0-9]+ bucket spans end with their device time, each after its collective completed"
  ENVIRONMENT FAKE_NCCL_COLLECTIVE_MS=20)
# The same over topology::hierarchical, whose steps (node-local and
# cross-node, on two streams) are enqueued at once: the span ends with the last.
nccl_ranks_test(timeline_hierarchical 4 timeline-hierarchical NODES 2,2 STATUS 0
  EXPECT "rank 0 of 4: [0-9]+ bucket spans end with their device time, each after its collective completed"
  ENVIRONMENT FAKE_NCCL_COLLECTIVE_MS=20)
