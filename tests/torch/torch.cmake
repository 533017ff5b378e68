# dtrain/torch.hpp (issue 16): dtrain::torch::DistributedDataParallel on a
# LibTorch model. Included from tests/CMakeLists.txt; LibTorch is found (or
# not) by cmake/dtrain_torch.cmake.
#
# torch.ddp.<engine>.<N>ranks: N ranks end with the weights of one process on
#   the full batch (plain, no_sync, unused branch, compression), with backward()
#   alone completing each step, .grad() are bucket views, buffers are
#   broadcast, the first bucket starts inside backward(), a differing module
#   and an incomplete step are errors naming the parameters (torch_ddp.cpp).
# dtrain_torch_header_checks: each header under dtrain/torch/ compiles on its own.
# torch.demo: dtrain_train_torch under its own per-node launcher, 4 workers.
# compile.torch_strict_<engine>: the header under users' strict warnings, in a
#   file built as dtrain::torch builds a user's (dtrain::torch's part is built
#   with the same warnings).
# torch.ddp.nccl.1rank: CUDA tensors over NCCL (needs a LibTorch built with
#   CUDA, and a GPU at run time: exit 77, skipped, without one).
set(torch_ranks 2 4)
set(torch_tests torch.ddp.gloo.1rank torch.ddp.mpi.2ranks torch.ddp.mpi.4ranks torch.demo
                compile.torch_strict_gloo compile.torch_strict_nccl torch.ddp.nccl.1rank
                compiled.thin_torch_tu torch.resume.kill_worker.2ranks
                torch.resume.kill_worker_stage3.2ranks)
foreach(ranks IN LISTS torch_ranks)
  list(APPEND torch_tests torch.ddp.gloo.${ranks}ranks)
endforeach()
if(NOT DTRAIN_TORCH_FOUND)
  foreach(test IN LISTS torch_tests)
    dtrain_add_skipped_test(${test} "${DTRAIN_TORCH_MISSING}")
  endforeach()
  return()
endif()

# Each header under dtrain/torch/ on its own, as dtrain_header_checks does the others.
if(TARGET dtrain::gloo)
  file(GLOB torch_headers CONFIGURE_DEPENDS RELATIVE "${PROJECT_SOURCE_DIR}/include"
       "${PROJECT_SOURCE_DIR}/include/dtrain/torch/*.hpp")
  dtrain_add_header_checks(dtrain_torch_header_checks "${torch_headers}" dtrain::gloo
                           dtrain_torch_libraries)
endif()

# A multi-rank doctest program (tests/support/multirank.hpp) of one engine's policy.
function(add_torch_test_program target engine)
  add_executable(${target} torch/torch_ddp.cpp support/multirank_main.cpp)
  target_link_libraries(${target} PRIVATE dtrain_torch_part_${engine}  # dtrain::torch's compiled part
                                          doctest::doctest)
  string(TOUPPER "${engine}" upper)
  target_compile_definitions(${target} PRIVATE DTRAIN_TEST_TORCH_${upper}=1)
  dtrain_target_warnings(${target})
endfunction()

if(DTRAIN_WITH_GLOO)
  add_torch_test_program(dtrain_torch_ddp_gloo gloo)
  add_dependencies(dtrain_torch_ddp_gloo dtrain_test_launch)
endif()
if(DTRAIN_WITH_MPI)
  add_torch_test_program(dtrain_torch_ddp_mpi mpi)
endif()
dtrain_add_multirank_test(torch.ddp PROGRAM dtrain_torch_ddp_gloo CASE ddp ENGINES gloo
                          RANKS 1 NAME 1rank TIMEOUT 180)
dtrain_add_multirank_test(torch.ddp PROGRAM dtrain_torch_ddp_gloo CASE ddp ENGINES gloo
                          RANKS ${torch_ranks} TIMEOUT 180)
dtrain_add_multirank_test(torch.ddp PROGRAM dtrain_torch_ddp_mpi CASE ddp ENGINES mpi
                          RANKS ${torch_ranks} TIMEOUT 180)
# ZeRO stage 3: `ddp->forward(x)` around the wrapper ends each rank with status
# 1 and a line naming the first parameter it read, not a segmentation fault.
set(torch_outside
  "rank [01]: ddp[(]x[)] ran unit by unit"
  "\\[rank [01]/2\\] dtrain: parameter '0[.](weight|bias)' [(]unit 0[)] was read( or written)? outside a gather[(][)]")
dtrain_add_multirank_test(torch.outside PROGRAM dtrain_torch_ddp_gloo CASE outside ENGINES gloo
                          RANKS 2 NO_KILL TIMEOUT 180 EXPECT_STATUS 1 EXPECT ${torch_outside})
dtrain_add_multirank_test(torch.outside PROGRAM dtrain_torch_ddp_mpi CASE outside ENGINES mpi
                          RANKS 2 NO_KILL TIMEOUT 180 EXPECT_STATUS 1 EXPECT ${torch_outside})

if(TARGET dtrain_train_torch)
  dtrain_add_test(torch.demo
    COMMAND "${CMAKE_COMMAND}" -DCASE=torch "-DTRAIN=$<TARGET_FILE:dtrain_train_torch>"
            -P "${CMAKE_CURRENT_SOURCE_DIR}/training/check_demo.cmake"
    TIMEOUT 180
    PROPERTIES PROCESSORS 4)
  # --sharding 1 and 2 (torch::optim::SGD over shard_parameters()) end with --sharding 0's weights.
  dtrain_add_test(torch.demo.sharding
    COMMAND "${CMAKE_COMMAND}" -DCASE=torch_sharding "-DTRAIN=$<TARGET_FILE:dtrain_train_torch>"
            -P "${CMAKE_CURRENT_SOURCE_DIR}/training/check_demo.cmake"
    TIMEOUT 400
    PROPERTIES PROCESSORS 4)
  # --precision bf16 (and fp16 where LibTorch has its CPU kernels): float32
  # sums and master weights, within half a point of float32's accuracy.
  dtrain_add_test(torch.demo.precision
    COMMAND "${CMAKE_COMMAND}" -DCASE=torch_precision "-DTRAIN=$<TARGET_FILE:dtrain_train_torch>"
            -P "${CMAKE_CURRENT_SOURCE_DIR}/training/check_demo.cmake"
    TIMEOUT 600
    PROPERTIES PROCESSORS 4)
else()
  dtrain_add_skipped_test(torch.demo "dtrain_train_torch is not built (needs Gloo and DTRAIN_BUILD_EXAMPLES)")
  dtrain_add_skipped_test(torch.demo.sharding
                          "dtrain_train_torch is not built (needs Gloo and DTRAIN_BUILD_EXAMPLES)")
  dtrain_add_skipped_test(torch.demo.precision
                          "dtrain_train_torch is not built (needs Gloo and DTRAIN_BUILD_EXAMPLES)")
endif()

foreach(engine IN ITEMS GLOO NCCL)
  string(TOLOWER "${engine}" component)
  if(NOT TARGET dtrain::${component})
    dtrain_add_skipped_test(compile.torch_strict_${component} "DTRAIN_WITH_${engine} is OFF")
  elseif(engine STREQUAL "NCCL" AND NOT DTRAIN_TORCH_CUDA)
    dtrain_add_skipped_test(compile.torch_strict_${component}
      "LibTorch ${DTRAIN_TORCH_VERSION} has no CUDA headers (a CPU-only build)")
  elseif(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # LibTorch 1.13's own headers do not compile under clang in C++20.
    dtrain_add_skipped_test(compile.torch_strict_${component} "needs GCC (LibTorch's headers)")
  else()
    # Built as a user's file that links dtrain::torch is: the part itself
    # (module_ddp's members) is compiled with the same warnings (dtrain_torch.cmake).
    dtrain_add_strict_check(compile.torch_strict_${component} compile/strict_torch.cpp
                            dtrain_torch_part_${component} ${engine})
  endif()
endforeach()

# compiled.thin_torch_tu: a LibTorch user's training TU (bench/compile_time/torch_mlp.cpp)
# compiled as dtrain::torch gives it defines none of dtrain::torch's compiled part
# (module_ddp's members) nor of dtrain's library: what makes it compile fast.
# Optimised builds only, as compiled.thin_tu (tests/compiled/compiled.cmake).
if(NOT TARGET dtrain_torch_part_gloo OR DTRAIN_HEADER_ONLY)
  dtrain_add_skipped_test(compiled.thin_torch_tu "needs Gloo and the compiled library")
elseif(CMAKE_BUILD_TYPE STREQUAL "Debug")
  dtrain_add_skipped_test(compiled.thin_torch_tu
    "at -O0 GCC emits the store server's inline coroutines in every TU (build type Debug)")
else()
  add_library(dtrain_compiled_thin_torch_tu OBJECT
              "${PROJECT_SOURCE_DIR}/bench/compile_time/torch_mlp.cpp")
  # Usage requirements only: dtrain::gloo, LibTorch, DTRAIN_TORCH_SEPARATE_COMPILATION=1.
  target_link_libraries(dtrain_compiled_thin_torch_tu PRIVATE dtrain_torch_part_gloo)
  dtrain_target_warnings(dtrain_compiled_thin_torch_tu)
  set(torch_part_members "~module_ddp|before_forward|walks_graph|prepare_for_backward|synchronize"
                         "no_sync|zero_grad|gradient_written|collect|attach|complete_step|expose"
                         "broadcast_buffers|check_step_closed|find_units|enter_unit|leave_unit"
                         "unit_backward|release_units")
  list(JOIN torch_part_members "|" torch_part_members)
  dtrain_add_test(compiled.thin_torch_tu
    COMMAND "${CMAKE_COMMAND}" "-DOBJECTS=$<TARGET_OBJECTS:dtrain_compiled_thin_torch_tu>"
            "-DNM=${CMAKE_NM}"
            "-DMORE=dtrain::torch::module_ddp<[^()]*>::(${torch_part_members})\\("
            -P "${PROJECT_SOURCE_DIR}/tests/compiled/check_thin_tu.cmake")
endif()

if(TARGET dtrain::nccl AND DTRAIN_TORCH_CUDA)
  add_torch_test_program(dtrain_torch_ddp_nccl nccl)
  # bf16 compression of GPU buckets runs dtrain's kernels, which a .cu file brings.
  if(CMAKE_CUDA_COMPILER)
    target_sources(dtrain_torch_ddp_nccl PRIVATE torch/cuda_kernels.cu)
    dtrain_cuda_program(dtrain_torch_ddp_nccl)
    target_compile_definitions(dtrain_torch_ddp_nccl PRIVATE DTRAIN_TEST_TORCH_CUDA_KERNELS=1)
  endif()
  # Alone (world size 1, one GPU), with always_reduce: the buckets still go through NCCL.
  dtrain_add_test(torch.ddp.nccl.1rank COMMAND $<TARGET_FILE:dtrain_torch_ddp_nccl> --test-case=ddp
                  TIMEOUT 300)
else()
  dtrain_add_skipped_test(torch.ddp.nccl.1rank
    "needs NCCL and a LibTorch built with CUDA (LibTorch ${DTRAIN_TORCH_VERSION} is CPU-only)")
endif()

# torch.resume.kill_worker.2ranks (issue 33): the LibTorch example on 2 workers,
# one killed after its first checkpoint, resumes (module, optimizer, sampler
# through dtrain::torch) and ends bit-identical to an uninterrupted run;
# torch.resume.kill_worker_stage3.2ranks the same at ZeRO stage 3 (issue 48);
# torch.resume.kill_worker_memory.2ranks at stage 3 from the memory tier (issue 50).
find_program(DTRAIN_BASH bash)
foreach(case IN ITEMS kill_worker kill_worker_stage3 kill_worker_memory)
  if(TARGET dtrain_train_torch AND DTRAIN_BASH)
    dtrain_add_test(torch.resume.${case}.2ranks
      COMMAND "${DTRAIN_BASH}" "${PROJECT_SOURCE_DIR}/tests/training/resume.sh" torch_${case}
              "$<TARGET_FILE:dtrain_train_torch>"
      TIMEOUT 180
      PROPERTIES PROCESSORS 2)
  else()
    dtrain_add_skipped_test(torch.resume.${case}.2ranks
      "dtrain_train_torch is not built (needs Gloo and DTRAIN_BUILD_EXAMPLES), or no bash")
  endif()
endforeach()
