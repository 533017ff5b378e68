# CUDA examples (issue 6): included from examples/CMakeLists.txt.
#
# dtrain_train_mlp_cuda: the MLP demo on GPUs (cuBLAS for the linear layers,
# NCCL through DistributedDataParallel). Built wherever NCCL, nvcc and cuBLAS
# are found; it needs a GPU only to run (without one it exits 77, "SKIPPED").
if(NOT DTRAIN_WITH_NCCL)
  return()
endif()
include(dtrain_cuda)
dtrain_find_cuda()
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "dtrain_train_mlp_cuda: not built (no CUDA compiler; set CMAKE_CUDA_COMPILER)")
  return()
endif()
find_package(CUDAToolkit QUIET)
if(NOT TARGET CUDA::cublas)
  message(STATUS "dtrain_train_mlp_cuda: not built (cuBLAS not found in the CUDA toolkit)")
  return()
endif()

add_executable(dtrain_train_mlp_cuda train_mlp_cuda.cu)
target_link_libraries(dtrain_train_mlp_cuda PRIVATE dtrain::dtrain CUDA::cublas)
dtrain_cuda_program(dtrain_train_mlp_cuda)
dtrain_program_kind(dtrain_train_mlp_cuda gpu)
