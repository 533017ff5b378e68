// A second nvcc unit in the programs of compile.nvcc*: whatever dtrain.hpp
// defines for the device must have one definition however many .cu files of
// a program include it (a non-template __global__ defined in the header is
// defined once per unit, and the program does not link).
#include <dtrain/dtrain.hpp>

int dtrain_second_nvcc_unit();
int dtrain_second_nvcc_unit() { return dtrain::detail::device_casts_available() ? 1 : 0; }
