// bench/rendezvous: how the store scales with the number of clients.
//
// For N clients (threads, one connection each) against one in-process server,
// three phases, each timed from the moment every client is released until the
// last one finishes: connect (incl. handshake), a barrier through the store,
// and a round of set + get of a 128-byte value per client. Prints the median
// of a few repeats as milliseconds and microseconds per client, so growth with
// N is visible. Everything shares this machine's cores with the server.
//
//   rendezvous [max_clients] [repeats]

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <pthread.h>
#include <sys/resource.h>

using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

namespace {

// Threads with small stacks: thousands of std::threads would reserve 8 MiB each.
class small_thread {
 public:
  explicit small_thread(std::function<void()> body) : body_(std::move(body)) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    if (pthread_create(&id_, &attr, &small_thread::run, this) != 0) {
      std::perror("pthread_create");
      std::exit(1);
    }
    pthread_attr_destroy(&attr);
  }
  void join() { pthread_join(id_, nullptr); }

 private:
  static void* run(void* self) {
    static_cast<small_thread*>(self)->body_();
    return nullptr;
  }
  std::function<void()> body_;
  pthread_t id_{};
};

struct phases {
  double connect_ms, barrier_ms, setget_ms;
};

phases run_once(int clients) {
  dtrain::store_server server("127.0.0.1", 0, {.timeout = 120s});
  const int port = server.port();
  std::vector<steady::time_point> marks;
  marks.reserve(4);
  std::barrier sync(clients + 1, [&]() noexcept { marks.push_back(steady::now()); });
  std::atomic<int> failures{0};
  const std::string value(128, 'v');
  std::vector<std::unique_ptr<small_thread>> threads;
  for (int i = 0; i < clients; ++i) {
    threads.push_back(std::make_unique<small_thread>([&, i] {
      try {
        sync.arrive_and_wait();  // release
        dtrain::store_client c("127.0.0.1", port, {.timeout = 120s});
        sync.arrive_and_wait();  // connected
        c.barrier("bench", clients);
        sync.arrive_and_wait();  // through the barrier
        c.set("value/" + std::to_string(i), value);
        if (c.get("value/" + std::to_string((i + 1) % clients)).size() != value.size()) ++failures;
        sync.arrive_and_wait();  // round done
      } catch (const std::exception& e) {
        std::fprintf(stderr, "client %d: %s\n", i, e.what());
        std::exit(1);
      }
    }));
  }
  for (int phase = 0; phase < 4; ++phase) sync.arrive_and_wait();
  for (auto& t : threads) t->join();
  if (failures != 0) {
    std::fprintf(stderr, "%d clients read a wrong value\n", failures.load());
    std::exit(1);
  }
  auto ms = [&](int a, int b) {
    return std::chrono::duration<double, std::milli>(marks[b] - marks[a]).count();
  };
  return {ms(0, 1), ms(1, 2), ms(2, 3)};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int max_clients = argc > 1 ? std::atoi(argv[1]) : 8192;
  int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  setrlimit(RLIMIT_NOFILE, &files);
  getrlimit(RLIMIT_NOFILE, &files);
  // Two descriptors per client in one process (its socket and the server's end), plus slack.
  int fd_cap = static_cast<int>(std::min<rlim_t>(files.rlim_cur, 1 << 20) / 2) - 64;
  std::vector<int> sizes{16, 64, 256, 1024};
  for (int n = 2048; n <= std::min(max_clients, fd_cap); n *= 2) sizes.push_back(n);
  std::erase_if(sizes, [&](int n) { return n > std::min(max_clients, fd_cap); });

  std::printf("rendezvous store: median of %d runs; descriptor limit %llu allows %d clients\n",
              repeats, static_cast<unsigned long long>(files.rlim_cur), fd_cap);
  std::printf("%8s | %10s %10s | %10s %10s | %10s %10s\n", "clients", "connect ms", "us/client",
              "barrier ms", "us/client", "set+get ms", "us/client");
  for (int n : sizes) {
    std::vector<double> c, b, s;
    for (int r = 0; r < repeats; ++r) {
      auto p = run_once(n);
      c.push_back(p.connect_ms);
      b.push_back(p.barrier_ms);
      s.push_back(p.setget_ms);
    }
    double cm = median(c), bm = median(b), sm = median(s);
    std::printf("%8d | %10.2f %10.1f | %10.2f %10.1f | %10.2f %10.1f\n", n, cm, 1000 * cm / n, bm,
                1000 * bm / n, sm, 1000 * sm / n);
    std::fflush(stdout);
  }
  return 0;
}
