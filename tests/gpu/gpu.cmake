# GPU programs as tests (issues 6 and 11): included from tests/CMakeLists.txt.
# NCCL at world size 1 (one GPU cannot host two NCCL ranks), MPI with ranks
# sharing a GPU. Without a GPU every program prints "SKIPPED: no CUDA device
# (...)" and exits 77: a visible skip. tools/gpu-check runs them all, each
# under compute-sanitizer, on a machine with a GPU.
set(gpu_tests gpu.ddp.1rank gpu.watchdog_hang gpu.mpi_device.2ranks gpu.train_mlp_cuda.1rank
              gpu.demo_accuracy)

if(NOT DTRAIN_WITH_NCCL)
  foreach(test IN LISTS gpu_tests)
    dtrain_add_skipped_test(${test} "needs NCCL and the CUDA toolkit (DTRAIN_WITH_NCCL is OFF)")
  endforeach()
  return()
endif()
if(NOT CMAKE_CUDA_COMPILER)
  foreach(test IN LISTS gpu_tests)
    dtrain_add_skipped_test(${test} "nvcc not found (set CMAKE_CUDA_COMPILER)")
  endforeach()
  return()
endif()

# dtrain_gpu_tests: DDP over NCCL on the device, the watchdog on a real hang,
# MPI with device buffers (tests/gpu/gpu_main.cpp says what each mode checks).
add_executable(dtrain_gpu_tests gpu/gpu_main.cpp gpu/gpu_casts.cu)
target_link_libraries(dtrain_gpu_tests PRIVATE dtrain::dtrain doctest::doctest)
dtrain_cuda_program(dtrain_gpu_tests)
dtrain_program_kind(dtrain_gpu_tests gpu)
dtrain_add_test(gpu.ddp.1rank COMMAND dtrain_gpu_tests TIMEOUT 300)
dtrain_add_test(gpu.watchdog_hang COMMAND dtrain_gpu_tests --hang TIMEOUT 120)
if(DTRAIN_WITH_MPI)
  dtrain_add_mpi_test(gpu.mpi_device RANKS 2 COMMAND $<TARGET_FILE:dtrain_gpu_tests> --mpi TIMEOUT 300)
else()
  dtrain_add_skipped_test(gpu.mpi_device.2ranks "needs MPI (DTRAIN_WITH_MPI is OFF)")
endif()

# dtrain_nccl_ranks --gpu mean16 (tools/gpu-check --ranks N) divides 16-bit
# data on the GPUs at a job size that is not a power of 2: dtrain's kernel
# comes with an nvcc unit, the same one.
if(TARGET dtrain_nccl_ranks)
  target_sources(dtrain_nccl_ranks PRIVATE gpu/gpu_casts.cu)
  dtrain_cuda_program(dtrain_nccl_ranks)
endif()

if(TARGET dtrain_train_mlp_cuda)
  # A rank whose gradients were not averaged, or not applied, leaves the test
  # accuracy near chance (1/8); the weights check fails the run on its own.
  dtrain_add_test(gpu.train_mlp_cuda.1rank
    COMMAND dtrain_train_mlp_cuda --epochs 3 --min-accuracy 0.5
    TIMEOUT 300
    ENVIRONMENT DTRAIN_NPROC_PER_NODE=1)
  # The CUDA demo against the CPU demo: same data, weights and shards, so the
  # same accuracy up to float rounding (cuBLAS sums in another order).
  if(TARGET dtrain_train_mlp)
    dtrain_add_test(gpu.demo_accuracy
      COMMAND "${CMAKE_COMMAND}" -DCASE=cuda_vs_cpu "-DTRAIN=$<TARGET_FILE:dtrain_train_mlp>"
              "-DTRAIN_CUDA=$<TARGET_FILE:dtrain_train_mlp_cuda>"
              -P "${CMAKE_CURRENT_SOURCE_DIR}/training/check_demo.cmake"
      TIMEOUT 300)
  else()
    dtrain_add_skipped_test(gpu.demo_accuracy "dtrain_train_mlp is not built (needs Gloo)")
  endif()
elseif(NOT DTRAIN_BUILD_EXAMPLES)
  foreach(test IN ITEMS gpu.train_mlp_cuda.1rank gpu.demo_accuracy)
    dtrain_add_skipped_test(${test} "dtrain_train_mlp_cuda is not built (DTRAIN_BUILD_EXAMPLES=OFF)")
  endforeach()
else()
  foreach(test IN ITEMS gpu.train_mlp_cuda.1rank gpu.demo_accuracy)
    dtrain_add_skipped_test(${test} "dtrain_train_mlp_cuda is not built (needs cuBLAS)")
  endforeach()
endif()
