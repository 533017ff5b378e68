// The g++ unit of dtrain_mixed_link (see mixed_unit.hpp).
#include "mixed_unit.hpp"

std::string mixed_host_report();
std::string mixed_host_report() { return mixed_unit_report(); }
