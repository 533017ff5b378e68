// select_device: which GPU a rank uses, from its local rank and what it sees; and
// host_memory's pages (stage 2's transient buckets) when the system refuses them.
#include "support.hpp"

#include <dtrain/dtrain.hpp>

#include <cerrno>
#include <cstring>
#include <string>

using dtrain::select_device;

TEST_CASE("select_device: one GPU per local rank, all visible: the local rank") {
  CHECK(select_device(0, 4, 4, std::nullopt) == 0);
  CHECK(select_device(3, 4, 4, std::nullopt) == 3);
  CHECK(select_device(1, 2, 8, "0,1,2,3,4,5,6,7") == 1);  // more GPUs than ranks
}

TEST_CASE("select_device: per-task binding (one visible GPU) is device 0 for every rank") {
  CHECK(select_device(0, 4, 1, "2") == 0);
  CHECK(select_device(3, 4, 1, "GPU-8f1c") == 0);
  CHECK(select_device(0, 1, 1, std::nullopt) == 0);
}

TEST_CASE(
    "select_device: fewer GPUs than ranks is a config_error naming CUDA_VISIBLE_DEVICES and the "
    "counts") {
  std::string text;
  try {
    (void)select_device(2, 4, 2, "0,1");
  } catch (const dtrain::config_error& e) {
    text = e.what();
  }
  CHECK_CONTAINS(text, "local rank 2 of 4");
  CHECK_CONTAINS(text, "sees 2 GPUs");
  CHECK_CONTAINS(text, "CUDA_VISIBLE_DEVICES=0,1");

  text.clear();
  try {
    (void)select_device(0, 2, 0, std::nullopt);
  } catch (const dtrain::config_error& e) {
    text = e.what();
  }
  CHECK_CONTAINS(text, "sees none");
  CHECK_CONTAINS(text, "CUDA_VISIBLE_DEVICES unset");

  CHECK_THROWS_AS((void)select_device(4, 4, 8, std::nullopt), dtrain::config_error);
  CHECK_THROWS_AS((void)select_device(-1, 4, 8, std::nullopt), dtrain::config_error);
}

TEST_CASE("staging_block_bytes: powers of two from 64 KiB, never smaller than asked") {
  using dtrain::detail::staging_block_bytes;
  static_assert(staging_block_bytes(1) == 64 * 1024);
  CHECK(staging_block_bytes(0) == 64 * 1024);
  CHECK(staging_block_bytes(64 * 1024) == 64 * 1024);
  CHECK(staging_block_bytes(64 * 1024 + 1) == 128 * 1024);
  CHECK(staging_block_bytes(std::size_t{3} << 20) == std::size_t{4} << 20);
  CHECK(staging_block_bytes(std::size_t{1} << 30) == std::size_t{1} << 30);
  const std::size_t huge = (~std::size_t{0} >> 1) + 2;  // no power of two above it
  CHECK(staging_block_bytes(huge) == huge);
}

TEST_CASE(
    "host_memory: pages the system refuses are a backend_error with errno, not a config_error") {
  // More than any address space: mmap says ENOMEM whatever the machine has.
  const std::size_t too_many = std::size_t{1} << 62;
  try {
    (void)dtrain::host_memory::allocate_pages(too_many);
    FAIL("a mapping of 4 EiB was made");
  } catch (const dtrain::config_error&) {
    FAIL("a refused mapping was reported as a config_error");
  } catch (const dtrain::backend_error& e) {
    CHECK(e.engine_code() == ENOMEM);
    CHECK_CONTAINS(e.what(), "mmap(" + std::to_string(too_many) + " bytes of gradient memory");
    CHECK_CONTAINS(e.what(), std::strerror(ENOMEM));
  }
  void* some = dtrain::host_memory::allocate_pages(4096);
  CHECK(static_cast<const unsigned char*>(some)[4095] == 0);
  dtrain::host_memory::release_pages(some, 4096);
}
