// A second translation unit for the link check (common.cmake): compiled for
// dtrain::dtrain and linked beside main.cpp compiled for dtrain::gloo, the
// program must not link (their libraries hold code built for other engines).
#include <dtrain/dtrain.hpp>

int dtrain_consumer_other_unit() {
  return DTRAIN_HAS_GLOO() + DTRAIN_HAS_MPI() + DTRAIN_HAS_NCCL();
}
