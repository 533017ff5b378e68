// The nvcc unit of dtrain_mixed_link (see mixed_unit.hpp). Its presence
// registers dtrain's CUDA casts for the whole program.
#include "mixed_unit.hpp"

std::string mixed_nvcc_report();
std::string mixed_nvcc_report() { return mixed_unit_report(); }
