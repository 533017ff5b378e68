// dtrain_mixed_link: a g++ and an nvcc translation unit that both include
// dtrain and instantiate DistributedDataParallel with compression, linked in
// both orders (two programs). Each unit must run its own compiler's code: a
// symbol with two bodies (one per compiler) would make the link order decide.
#include <cstdio>
#include <string>

std::string mixed_host_report();
std::string mixed_nvcc_report();

int main() {
  const std::string host = mixed_host_report();
  const std::string nvcc = mixed_nvcc_report();
  std::printf("g++ unit:  %s\nnvcc unit: %s\n", host.c_str(), nvcc.c_str());
  // Both units see the kernels the nvcc unit registered: a DDP built in the
  // g++ unit can compress GPU buckets too.
  const bool ok = host == "host compressed host-casts device-casts" &&
                  nvcc == "nvcc compressed host-casts device-casts";
  std::printf("%s\n",
              ok ? "each unit took its own body" : "FAIL: a unit ran the other compiler's code");
  return ok ? 0 : 1;
}
