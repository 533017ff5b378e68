#pragma once
inline bool throttles(int s) {
  return s == static_cast<int>(sharding::gradients);  // a stage branch in the core
}
