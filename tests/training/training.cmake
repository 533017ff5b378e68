# Training equivalence and the demo (issue 6): included from tests/CMakeLists.txt.
#
# training.equivalence.*: N ranks training examples/mlp.hpp with
# DistributedDataParallel end with the weights one process gets on the full
# batch (equivalence.cpp), under mpirun and over Gloo (dtrain_test_launch).
# training.demo.*: dtrain_train_mlp as a user runs it (check_demo.cmake).
set(training_dir "${CMAKE_CURRENT_SOURCE_DIR}/training")
include(dtrain_example_blas)  # the demo's model multiplies as the demo does
set(training_ranks 2 4)

if(DTRAIN_WITH_MPI)
  add_executable(dtrain_training_equivalence_mpi training/equivalence.cpp)
  target_link_libraries(dtrain_training_equivalence_mpi PRIVATE dtrain::dtrain dtrain_example_blas)
  target_include_directories(dtrain_training_equivalence_mpi PRIVATE "${PROJECT_SOURCE_DIR}/examples")
  dtrain_target_warnings(dtrain_training_equivalence_mpi)
  foreach(ranks IN LISTS training_ranks)
    dtrain_add_mpi_test(training.equivalence.mpi RANKS ${ranks}
      COMMAND $<TARGET_FILE:dtrain_training_equivalence_mpi> TIMEOUT 180)
  endforeach()
else()
  foreach(ranks IN LISTS training_ranks)
    dtrain_add_skipped_test(training.equivalence.mpi.${ranks}ranks "needs MPI (DTRAIN_WITH_MPI is OFF)")
  endforeach()
endif()

if(DTRAIN_WITH_GLOO)
  add_executable(dtrain_training_equivalence_gloo training/equivalence.cpp)
  target_link_libraries(dtrain_training_equivalence_gloo PRIVATE dtrain::dtrain dtrain_example_blas)
  target_include_directories(dtrain_training_equivalence_gloo PRIVATE "${PROJECT_SOURCE_DIR}/examples")
  target_compile_definitions(dtrain_training_equivalence_gloo PRIVATE DTRAIN_TEST_TRAINING_GLOO=1)
  dtrain_target_warnings(dtrain_training_equivalence_gloo)
  foreach(ranks IN LISTS training_ranks)
    dtrain_add_test(training.equivalence.gloo.${ranks}ranks
      COMMAND $<TARGET_FILE:dtrain_test_launch> ${ranks} $<TARGET_FILE:dtrain_training_equivalence_gloo>
      TIMEOUT 180
      PROPERTIES PROCESSORS ${ranks})
  endforeach()
else()
  foreach(ranks IN LISTS training_ranks)
    dtrain_add_skipped_test(training.equivalence.gloo.${ranks}ranks
      "needs Gloo (DTRAIN_WITH_GLOO is OFF; Debian: apt-get install libgloo-dev)")
  endforeach()
endif()

# The demo: its own per-node launcher with 4 Gloo workers, the MPI build under
# mpirun, and a bad flag (exit status 2, the flag named).
if(TARGET dtrain_train_mlp)
  foreach(case IN ITEMS gloo bad_flag sharding precision)
    dtrain_add_test(training.demo.${case}
      COMMAND "${CMAKE_COMMAND}" -DCASE=${case} "-DTRAIN=$<TARGET_FILE:dtrain_train_mlp>"
              -P "${training_dir}/check_demo.cmake"
      TIMEOUT 180
      PROPERTIES PROCESSORS 4)
  endforeach()
else()
  foreach(case IN ITEMS gloo bad_flag sharding precision)
    dtrain_add_skipped_test(training.demo.${case}
      "dtrain_train_mlp is not built (needs Gloo and DTRAIN_BUILD_EXAMPLES)")
  endforeach()
endif()
if(TARGET dtrain_train_mlp_mpi AND MPIEXEC_EXECUTABLE)
  set(mpiexec_args ${MPIEXEC_NUMPROC_FLAG} 2 ${MPIEXEC_PREFLAGS} ${DTRAIN_MPIEXEC_PREFLAGS})
  list(JOIN mpiexec_args "|" mpiexec_args)  # one -D argument; the driver splits it again
  dtrain_add_test(training.demo.mpi.2ranks
    COMMAND "${CMAKE_COMMAND}" -DCASE=mpi "-DTRAIN=$<TARGET_FILE:dtrain_train_mlp_mpi>"
            "-DMPIEXEC=${MPIEXEC_EXECUTABLE}" "-DMPIEXEC_ARGS=${mpiexec_args}"
            -P "${training_dir}/check_demo.cmake"
    TIMEOUT 180
    ENVIRONMENT ${DTRAIN_MPI_TEST_ENVIRONMENT}
    PROPERTIES PROCESSORS 2)
else()
  dtrain_add_skipped_test(training.demo.mpi.2ranks
    "dtrain_train_mlp_mpi is not built (needs MPI, mpiexec and DTRAIN_BUILD_EXAMPLES)")
endif()

# The DDP timeline (issue 13): the demo on 2 Gloo workers with DTRAIN_TIMELINE
# set leaves one Chrome trace per rank; check_timeline.py parses them and checks
# the kinds of events and that the spans nest. A directory that does not exist
# stops every rank at construction, naming the file and the rank.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(TARGET dtrain_train_mlp AND Python3_Interpreter_FOUND)
  dtrain_add_test(training.timeline.gloo.2ranks
    COMMAND "${Python3_EXECUTABLE}" "${training_dir}/check_timeline.py" 2
            "${CMAKE_CURRENT_BINARY_DIR}/timeline" --
            $<TARGET_FILE:dtrain_train_mlp> --nproc-per-node 2 --epochs 1 --samples 1024 --seed 5
    TIMEOUT 180
    ENVIRONMENT DTRAIN_NPROC_PER_NODE=2
    PROPERTIES PROCESSORS 2)
else()
  dtrain_add_skipped_test(training.timeline.gloo.2ranks
    "needs python3 and dtrain_train_mlp (Gloo and DTRAIN_BUILD_EXAMPLES)")
endif()
# bench/vs_pytorch.py compares the demo with a PyTorch DDP twin of it; this
# keeps the twin honest: both train 2 epochs on 2 ranks and must print the same
# losses (the first epoch's to 4 decimals; exit 1 otherwise; 77, skipped,
# without Debian's python3-torch).
if(TARGET dtrain_train_mlp AND EXISTS /usr/bin/python3)
  dtrain_add_test(training.vs_pytorch.parity
    COMMAND /usr/bin/python3 "${PROJECT_SOURCE_DIR}/bench/vs_pytorch.py"
            --demo $<TARGET_FILE:dtrain_train_mlp> --ranks 2 --models default --repeats 1
            --epochs 2
    TIMEOUT 240
    PROPERTIES PROCESSORS 2)
else()
  dtrain_add_skipped_test(training.vs_pytorch.parity
    "needs /usr/bin/python3 (Debian's, with python3-torch) and dtrain_train_mlp")
endif()
# A timeline that cannot be written. Under the demo's own agent the first rank
# that fails ends the job, and the other may be stopped before it says anything:
# what the agent guarantees is one rank's own line (naming its own file) and its
# summary of that failure. Every rank's line is checked where the ranks end
# independently (dtrain_test_launch --no-kill, the DDP peer).
set(bad_timeline "${CMAKE_CURRENT_BINARY_DIR}/no-such-dir/trace.json")
set(cannot_write "DTRAIN_TIMELINE=[^\n]*/no-such-dir/trace[.]json: rank")
if(TARGET dtrain_train_mlp)
  dtrain_add_test(training.timeline.bad_path
    COMMAND "${CMAKE_COMMAND}"
            "-DCOMMAND=$<TARGET_FILE:dtrain_train_mlp>|--nproc-per-node|2|--epochs|1|--samples|256"
            -DEXPECT_STATUS=2
            "-DEXPECT_1=(\\[rank 0/2\\] dtrain: ${cannot_write} 0 cannot write [^\n]*/no-such-dir/trace[.]rank0[.]json|\\[rank 1/2\\] dtrain: ${cannot_write} 1 cannot write [^\n]*/no-such-dir/trace[.]rank1[.]json): No such file"
            "-DEXPECT_2=\\[dtrain agent node 0/1\\] rank [01] [(]node 0, local rank [01], pid [0-9]+[)] exited with status 2: ${cannot_write} [01] cannot write [^\n]*; ending the job"
            -P "${scripts}/check_job.cmake"
    TIMEOUT 120
    ENVIRONMENT DTRAIN_NPROC_PER_NODE=2 "DTRAIN_TIMELINE=${bad_timeline}"
    PROPERTIES PROCESSORS 2)
else()
  dtrain_add_skipped_test(training.timeline.bad_path
    "dtrain_train_mlp is not built (needs Gloo and DTRAIN_BUILD_EXAMPLES)")
endif()
if(TARGET dtrain_ddp_peer AND DTRAIN_WITH_GLOO)
  dtrain_add_test(training.timeline.bad_path.every_rank
    COMMAND "${CMAKE_COMMAND}"
            "-DCOMMAND=$<TARGET_FILE:dtrain_test_launch>|--no-kill|2|$<TARGET_FILE:dtrain_ddp_peer>|--engine=gloo|--test-case=mean"
            -DEXPECT_STATUS=2
            "-DEXPECT_1=\\[rank 0/2\\] dtrain: ${cannot_write} 0 cannot write [^\n]*/no-such-dir/trace[.]rank0[.]json: No such file"
            "-DEXPECT_2=\\[rank 1/2\\] dtrain: ${cannot_write} 1 cannot write [^\n]*/no-such-dir/trace[.]rank1[.]json: No such file"
            -P "${scripts}/check_job.cmake"
    TIMEOUT 120
    ENVIRONMENT "DTRAIN_TIMELINE=${bad_timeline}"
    PROPERTIES PROCESSORS 2)
else()
  dtrain_add_skipped_test(training.timeline.bad_path.every_rank
    "dtrain_ddp_peer is not built (needs Gloo)")
endif()

# The program of README.md and docs/getting-started.md, run as the pages say.
if(DTRAIN_WITH_GLOO)
  foreach(ranks IN ITEMS 1 2)
    dtrain_add_test(training.quickstart.${ranks}ranks
      COMMAND $<TARGET_FILE:dtrain_quickstart> --nproc-per-node ${ranks}
      TIMEOUT 120
      PROPERTIES PROCESSORS ${ranks}
                 PASS_REGULAR_EXPRESSION "${ranks} ranks: w[^\n]*: learned")
  endforeach()
else()
  foreach(ranks IN ITEMS 1 2)
    dtrain_add_skipped_test(training.quickstart.${ranks}ranks "needs Gloo (DTRAIN_WITH_GLOO is OFF)")
  endforeach()
endif()

# training.resume.* (issue 33): the demo killed and resumed from its checkpoints
# ends bit-identical to an uninterrupted run (resume.sh says each case).
find_program(DTRAIN_BASH bash)
if(TARGET dtrain_train_mlp AND DTRAIN_BASH)
  foreach(case IN ITEMS kill_worker kill_worker_stage3 kill_worker_memory kill_worker_memory_beside
                       kill_worker_memory_budget kill_in_save disk_full memory_full)
    dtrain_add_test(training.resume.${case}
      COMMAND "${DTRAIN_BASH}" "${training_dir}/resume.sh" ${case} "$<TARGET_FILE:dtrain_train_mlp>"
      TIMEOUT 180
      PROPERTIES PROCESSORS 4)
  endforeach()
else()
  foreach(case IN ITEMS kill_worker kill_worker_stage3 kill_worker_memory kill_worker_memory_beside
                       kill_worker_memory_budget kill_in_save disk_full memory_full)
    dtrain_add_skipped_test(training.resume.${case}
      "dtrain_train_mlp is not built (needs Gloo and DTRAIN_BUILD_EXAMPLES), or no bash")
  endforeach()
endif()
if(TARGET dtrain_train_mlp AND TARGET dtrain_train_mlp_mpi AND MPIEXEC_EXECUTABLE AND DTRAIN_BASH)
  dtrain_add_test(training.resume.mpi.2ranks
    COMMAND "${DTRAIN_BASH}" "${training_dir}/resume.sh" mpi "$<TARGET_FILE:dtrain_train_mlp>"
            "$<TARGET_FILE:dtrain_train_mlp_mpi>" "${MPIEXEC_EXECUTABLE}" ${MPIEXEC_NUMPROC_FLAG} 2
            ${MPIEXEC_PREFLAGS} ${DTRAIN_MPIEXEC_PREFLAGS}
    TIMEOUT 180
    ENVIRONMENT ${DTRAIN_MPI_TEST_ENVIRONMENT}
    PROPERTIES PROCESSORS 2)
else()
  dtrain_add_skipped_test(training.resume.mpi.2ranks
    "dtrain_train_mlp_mpi is not built (needs MPI, mpiexec and DTRAIN_BUILD_EXAMPLES)")
endif()
# tests/scripts/sample_log.py counts the demo's --sample-log for resume.sh, the
# cluster tests and bench/recovery.sh and goodput.sh: the steps trained twice
# (a step is trained once some rank of its round began the next) and every
# sample once. On 3 rounds of 2, 1 and 2 ranks (sample_logs/resumed: one step
# trained twice at each change, a line cut by the kill), and on a job where it
# must fail (sample_logs/lost: 2 steps trained twice, a rank's line missing).
if(Python3_Interpreter_FOUND)
  set(sample_log "${Python3_EXECUTABLE}|${scripts}/sample_log.py")
  set(sample_logs "${training_dir}/sample_logs")
  dtrain_add_test(training.sample_log
    COMMAND "${CMAKE_COMMAND}"
            "-DCOMMAND=${sample_log}|check|${sample_logs}/resumed|--samples|16|--epochs|2|--most-twice|1"
            -DEXPECT_STATUS=0
            "-DEXPECT_1=steps trained twice when round 1 began: 1 \\[5\\]"
            "-DEXPECT_2=steps trained twice when round 2 began: 1 \\[7\\]"
            "-DEXPECT_3=epoch 1: 16 distinct samples of 16, 0 repeated [(]padding[)], 0 missing"
            -P "${scripts}/check_job.cmake"
    TIMEOUT 60)
  dtrain_add_test(training.sample_log.twice
    COMMAND "${CMAKE_COMMAND}" "-DCOMMAND=${sample_log}|twice|${sample_logs}/resumed"
            -DEXPECT_STATUS=0 "-DEXPECT_1=^2[^0-9]*$" -P "${scripts}/check_job.cmake"
    TIMEOUT 60)
  dtrain_add_test(training.sample_log.catches_lost_samples
    COMMAND "${CMAKE_COMMAND}"
            "-DCOMMAND=${sample_log}|check|${sample_logs}/lost|--samples|16|--epochs|2|--most-twice|1"
            -DEXPECT_STATUS=1
            "-DEXPECT_1=FAILED: round 1 began at step 4 and trained again 2 steps that earlier rounds had trained [(]4, 5[)]: at most 1 allowed"
            "-DEXPECT_2=FAILED: epoch 1: sample 0 was trained by no step the job kept: begun in step 6 of round 0 [(]rank 1, [^)]*round-0-rank-1.txt:6[)], superseded by round 1, which began at step 4"
            -P "${scripts}/check_job.cmake"
    TIMEOUT 60)
else()
  foreach(name IN ITEMS training.sample_log training.sample_log.twice
                        training.sample_log.catches_lost_samples)
    dtrain_add_skipped_test(${name} "needs python3 (Debian: apt-get install python3)")
  endforeach()
endif()
