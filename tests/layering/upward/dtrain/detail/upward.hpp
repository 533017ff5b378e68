#pragma once
// A fixture for layering.catches_upward_include: a detail/ header that
// includes env/, which tests/scripts/check_layers.cmake must refuse.
#include <dtrain/error.hpp>
#include <dtrain/env/world.hpp>
