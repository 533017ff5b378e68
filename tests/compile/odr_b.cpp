// Another of three translation units that each include all of dtrain: anything
// a header defines that is neither inline nor a template becomes a duplicate
// symbol when dtrain_odr links.
#include <dtrain/dtrain.hpp>

#include <string>

std::string odr_version_b();
std::string odr_version_b() { return DTRAIN_VERSION_STRING; }
