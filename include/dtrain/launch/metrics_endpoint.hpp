#pragma once
/// @file
/// A node agent's metrics endpoint (dtrun --metrics-port): Prometheus scrapes
/// GET /metrics, answered with the metrics files its workers write
/// (DTRAIN_METRICS_DIR: DDP's dtrain_rank<R>.prom, the checkpoint's
/// dtrain_checkpoint_rank<R>.prom) merged into one exposition. Safe as the
/// store is: on a loopback address by default; on any other only with a
/// token, which every request must carry (Authorization: Bearer TOKEN). It
/// holds one connection at a time, at most 8 KiB of its request, for at most
/// 5 seconds.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>

namespace dtrain::detail {

/// The metric files (*.prom) of `dir` as one exposition in the Prometheus
/// text format: each family once (its HELP and TYPE from the first file that
/// has it), followed by every file's samples of it, the files in name order.
/// A file that cannot be read is left out (a writer's .tmp is not *.prom).
DTRAIN_DETAIL_INLINE std::string merge_metric_files(const std::filesystem::path& dir);

/// The endpoint (the file's comment).
class metrics_endpoint {
 public:
  /// The most bytes of a request's line and headers.
  static constexpr std::size_t most_request_bytes = 8192;
  /// How long one client may take to send its request and read the answer.
  static constexpr std::chrono::seconds client_time{5};

  /// Listens on `bind`:`port` (0: a free one) and serves `dir` on a thread of
  /// its own. Throws config_error when `bind` is not a loopback address and
  /// `token` is empty, or when it cannot listen there (both named).
  metrics_endpoint(const std::string& bind, int port, std::filesystem::path dir, std::string token);
  metrics_endpoint(const metrics_endpoint&) = delete;
  metrics_endpoint& operator=(const metrics_endpoint&) = delete;
  ~metrics_endpoint();

  [[nodiscard]] int port() const noexcept { return port_; }

  /// The whole HTTP response to the request `head` (its line and headers):
  /// 200 with the merged files for GET /metrics with the token (when one is
  /// set), 401 without it, 404 for another path, 405 for another method, 400
  /// for what is not an HTTP request.
  [[nodiscard]] std::string answer(std::string_view head) const;

 private:
  void serve();
  void handle(int client) const;

  std::filesystem::path dir_;
  std::string token_;
  unique_fd listen_;
  unique_fd wake_;  // an eventfd: the destructor stops the thread
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/metrics_endpoint-inl.hpp>
#endif
