// bench/allreduce_mpi: dtrain's MPI allreduce against the raw engine calls on
// the same buffer in the same run.
//
//   mpirun -np N build/bench/allreduce_mpi [max_bytes]
//
// For float32 buffers of 4 B .. 256 MiB (x4 steps), times in-place sum
// allreduces three ways, interleaved round by round (median of the rounds):
// raw MPI_Allreduce (blocking), raw MPI_Iallreduce + MPI_Wait (the engine path
// dtrain drives), and dtrain::allreduce(...).wait(). Each time is the slowest
// rank's. Prints, on rank 0, time per call, algbw = bytes / time, busbw =
// algbw x 2(n-1)/n (nccl-tests' definition) and the ratios dtrain / raw.

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <span>
#include <vector>

#include <mpi.h>

namespace {

double timed(MPI_Comm comm, int iterations, const std::function<void()>& call) {
  MPI_Barrier(comm);
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) call();
  double mine =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
  double slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return slowest;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  auto comm = dtrain::mpi_communicator::world();
  const std::size_t max_bytes =
      argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (std::size_t{256} << 20);
  const int n = comm.size();
  MPI_Comm raw = comm.native();
  if (comm.rank() == 0) {
    std::printf(
        "allreduce (sum, float32, in place), %d ranks, Open MPI; times per call, median of "
        "interleaved rounds\n",
        n);
    std::printf("%10s | %11s %11s %11s | %9s %9s | %12s %13s\n", "bytes", "MPI_Allred",
                "MPI_Iallred", "dtrain", "algbw", "busbw", "dtrain/", "dtrain/");
    std::printf("%10s | %11s %11s %11s | %9s %9s | %12s %13s\n", "", "us", "+Wait us", "us", "GB/s",
                "GB/s", "MPI_Allred", "MPI_Iallred");
  }
  std::vector<float> data(max_bytes / sizeof(float) + 1, 1.0f);
  for (std::size_t bytes = 4; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / sizeof(float);
    std::span<float> buf(data.data(), count);
    const int iterations =
        static_cast<int>(std::clamp<std::size_t>((std::size_t{32} << 20) / bytes, 1, 2000));
    const int rounds = bytes >= (std::size_t{16} << 20) ? 3 : 7;
    auto blocking = [&] {
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw);
    };
    auto nonblocking = [&] {
      MPI_Request r;
      MPI_Iallreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw,
                     &r);
      MPI_Wait(&r, MPI_STATUS_IGNORE);
    };
    auto ours = [&] { dtrain::allreduce(comm, buf).wait(); };
    blocking();
    nonblocking();
    ours();  // warm up every path
    std::vector<double> a, b, c;
    for (int r = 0; r < rounds; ++r) {
      a.push_back(timed(raw, iterations, blocking));
      b.push_back(timed(raw, iterations, nonblocking));
      c.push_back(timed(raw, iterations, ours));
    }
    const double ta = median(a), tb = median(b), tc = median(c);
    if (comm.rank() == 0) {
      const double algbw = static_cast<double>(bytes) / tc / 1e9;
      const double busbw = algbw * 2.0 * (n - 1) / n;
      std::printf("%10zu | %11.2f %11.2f %11.2f | %9.3f %9.3f | %12.3f %13.3f\n", bytes, ta * 1e6,
                  tb * 1e6, tc * 1e6, algbw, busbw, tc / ta, tc / tb);
      std::fflush(stdout);
    }
  }
  return 0;
}
