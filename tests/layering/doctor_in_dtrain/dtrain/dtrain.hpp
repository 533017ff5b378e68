#pragma once
// A fixture of layering.catches_doctor_in_dtrain_hpp: dtrain.hpp reaches the doctor through runtime/run.hpp.
#include <dtrain/runtime/run.hpp>
