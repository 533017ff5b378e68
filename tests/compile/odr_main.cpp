// Links with odr_a.cpp and odr_b.cpp; see there.
#include <dtrain/dtrain.hpp>

#include <iostream>
#include <string>

std::string odr_version_a();
std::string odr_version_b();

int main() {
  const std::string a = odr_version_a();
  const std::string b = odr_version_b();
  std::cout << "odr_a.cpp: dtrain " << a << "\nodr_b.cpp: dtrain " << b << '\n';
  return (a == DTRAIN_VERSION_STRING && b == DTRAIN_VERSION_STRING) ? 0 : 1;
}
