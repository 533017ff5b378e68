# GPU programs as tests (issue 6): included from tests/CMakeLists.txt. World
# size 1 (one GPU cannot host two NCCL ranks). Without a GPU the program
# prints "SKIPPED: no CUDA device (...)" and exits 77: a visible skip.
if(TARGET dtrain_train_mlp_cuda)
  # A rank whose gradients were not averaged, or not applied, leaves the test
  # accuracy near chance (1/8); the weights check fails the run on its own.
  dtrain_add_test(gpu.train_mlp_cuda.1rank
    COMMAND dtrain_train_mlp_cuda --epochs 3 --min-accuracy 0.5
    TIMEOUT 300
    ENVIRONMENT DTRAIN_NPROC_PER_NODE=1)
elseif(NOT DTRAIN_WITH_NCCL)
  dtrain_add_skipped_test(gpu.train_mlp_cuda.1rank "needs NCCL and the CUDA toolkit (DTRAIN_WITH_NCCL is OFF)")
elseif(NOT DTRAIN_BUILD_EXAMPLES)
  dtrain_add_skipped_test(gpu.train_mlp_cuda.1rank "dtrain_train_mlp_cuda is not built (DTRAIN_BUILD_EXAMPLES=OFF)")
else()
  dtrain_add_skipped_test(gpu.train_mlp_cuda.1rank "dtrain_train_mlp_cuda is not built (needs nvcc and cuBLAS)")
endif()
