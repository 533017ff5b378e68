# dtrain_example_blas: what examples/mlp.hpp multiplies matrices with. An
# INTERFACE target that brings a CBLAS (OpenBLAS first: Debian's
# libopenblas-dev; any BLAS with cblas.h otherwise) and MLP_CBLAS=1; without
# one it is empty and the MLP uses its plain loops (a message says so).
# Linked by the demo and by the tests that train the demo's model.
include_guard(GLOBAL)

set(BLA_VENDOR OpenBLAS)
find_package(BLAS QUIET)
unset(BLA_VENDOR)
if(NOT BLAS_FOUND)
  find_package(BLAS QUIET)
endif()
find_path(DTRAIN_CBLAS_INCLUDE_DIR cblas.h)

add_library(dtrain_example_blas INTERFACE)
if(BLAS_FOUND AND DTRAIN_CBLAS_INCLUDE_DIR)
  target_link_libraries(dtrain_example_blas INTERFACE ${BLAS_LIBRARIES})
  target_include_directories(dtrain_example_blas SYSTEM INTERFACE "${DTRAIN_CBLAS_INCLUDE_DIR}")
  target_compile_definitions(dtrain_example_blas INTERFACE MLP_CBLAS=1)
  message(STATUS "dtrain examples: the MLP multiplies with ${BLAS_LIBRARIES}")
else()
  message(STATUS "dtrain examples: no BLAS with cblas.h found (Debian: apt-get install "
                 "libopenblas-dev); the MLP demo multiplies with plain loops")
endif()
