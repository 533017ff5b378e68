// ZeRO stage 3's fence (dtrain/ddp/fence.hpp, issue 48): where a model's
// value pointers point between gathers on the host. A place of its own for
// each parameter, in address space with no access and no memory behind it,
// gone with its fence; 64 fences alive at once, then none (null places, as
// without a fence); and on a stage-3 DDP at world size 1, the model's pointer
// is at the fence between gathers, at the values inside one, and null once
// DDP is gone. What a read at the fence prints is ddp.outside_*'s to check
// (it ends the process).

#include "solo.hpp"
#include "support.hpp"

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

using dtrain::detail::value_fence;

/// The permissions of the mapping that holds `p` in /proc/self/maps ("" if none).
std::string fence_mapping_of(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::uintptr_t from = 0, to = 0;
    char dash = 0;
    std::string permissions;
    in >> std::hex >> from >> dash >> to >> permissions;
    if (at >= from && at < to) return permissions;
  }
  return "";
}

std::vector<value_fence::place> fence_places() {
  return {{.name = "a", .unit = 0, .bytes = 400, .element = 4},
          {.name = "empty", .unit = 0, .bytes = 0, .element = 4},
          {.name = "c", .unit = 1, .bytes = 12, .element = 4}};
}

}  // namespace

TEST_CASE("stage 3's fence: a place of its own per parameter, with no access and no memory") {
  const void* first = nullptr;
  {
    const value_fence fence(fence_places(), 0, 1);
    const auto* a = static_cast<const std::byte*>(fence.at(0));
    REQUIRE(a != nullptr);
    CHECK(fence.at(1) == a + 448);  // 400 bytes, rounded up to 64
    CHECK(fence.at(2) == a + 512);  // an empty parameter has 64 bytes of its own
    CHECK(fence.at(3) == nullptr);
    for (std::size_t i = 0; i < 3; ++i) CHECK(value_fence::holds(fence.at(i)));
    CHECK(fence_mapping_of(a) == "---p");  // PROT_NONE, private: no access, no memory
    CHECK_FALSE(value_fence::holds(nullptr));
    const float local = 0;
    CHECK_FALSE(value_fence::holds(&local));
    first = a;
  }
  CHECK_FALSE(value_fence::holds(first));  // gone with its fence
}

TEST_CASE("stage 3's fence: 64 alive at once, then the next has no places, null as without one") {
  std::vector<std::unique_ptr<value_fence>> fences;
  while (fences.size() < 70) {
    fences.push_back(std::make_unique<value_fence>(fence_places(), 0, 1));
    if (fences.back()->at(0) == nullptr) break;
  }
  CHECK(fences.size() == 65);  // no other fence is alive in this process now
  CHECK(fences.back()->at(2) == nullptr);
  fences.erase(fences.begin());  // one goes: its slot is free again
  const value_fence again(fence_places(), 0, 1);
  CHECK(again.at(0) != nullptr);
  CHECK(value_fence::holds(again.at(0)));
}

TEST_CASE(
    "stage 3 at world size 1: the model's pointer at the fence between gathers, "
    "at the values inside one, null once DDP is gone") {
  dtrain_test::solo comm;
  std::vector<float> init(300, 0.5f);
  float* w = init.data();
  float* g = nullptr;
  {
    dtrain::basic_ddp<dtrain_test::solo_policy> ddp(comm, {dtrain::param("w", w, init.size(), g)},
                                                    {}, {.sharding = dtrain::sharding::parameters});
    CHECK(value_fence::holds(w));
    {
      auto held = ddp.gather({std::size_t{0}});
      REQUIRE_FALSE(value_fence::holds(w));
      CHECK(w != init.data());  // DDP's whole values, not the model's first storage
      CHECK(w[0] == 0.5f);
      CHECK(w[299] == 0.5f);
    }
    CHECK(value_fence::holds(w));
  }
  CHECK(w == nullptr);
}
