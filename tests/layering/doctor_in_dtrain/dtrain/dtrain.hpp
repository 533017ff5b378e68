#pragma once
// A fixture of layering.catches_doctor_in_dtrain_hpp: dtrain.hpp reaches the doctor through run.hpp.
#include <dtrain/run.hpp>
