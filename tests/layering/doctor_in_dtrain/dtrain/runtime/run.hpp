#pragma once
// A fixture of layering.catches_doctor_in_dtrain_hpp: a runtime header that includes the doctor.
#include <dtrain/doctor/diagnose.hpp>
