#pragma once
// One rank's part in a store exchange that uses every operation. The store
// tests run it in threads and, through dtrain_store_peer, in processes.

#include <dtrain/dtrain.hpp>

#include <string>
#include <vector>

namespace dtrain_test {

/// Runs rank `rank` of `world` against `store`; returns "" or what went wrong.
template <dtrain::store Store>
std::string store_workload(Store& store, int rank, int world) {
  auto name = [](const char* what, int r) { return std::string(what) + "/" + std::to_string(r); };
  std::vector<std::string> all_ranks;
  for (int r = 0; r < world; ++r) all_ranks.push_back(name("rank", r));

  store.add("arrived", 1);
  store.barrier("start", world);
  store.set(name("rank", rank), std::to_string(rank * rank));
  store.wait(all_ranks);
  if (!store.check(all_ranks)) return "check() is false after wait() returned";
  for (int r = 0; r < world; ++r) {
    auto value = store.get(name("rank", r));
    if (value != std::to_string(r * r)) return name("rank", r) + " is '" + value + "'";
  }
  // Exactly one rank wins the election; everyone sees the same winner.
  store.set(name("saw", rank), store.compare_set("leader", "", std::to_string(rank)));
  store.set(name("scratch", rank), "x");
  if (!store.erase(name("scratch", rank)))
    return "erase() of an existing key said it did not exist";
  if (store.erase(name("scratch", rank))) return "a second erase() said the key existed";
  if (store.num_keys() < world) return "num_keys() is below the number of ranks";
  store.barrier("end", world);
  return {};
}

}  // namespace dtrain_test
