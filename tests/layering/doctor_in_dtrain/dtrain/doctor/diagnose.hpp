#pragma once
// A fixture of layering.catches_doctor_in_dtrain_hpp: the doctor's checks, reached from dtrain.hpp.
