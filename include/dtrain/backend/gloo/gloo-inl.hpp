#pragma once
/// @file
/// The non-template bodies of dtrain/backend/gloo/gloo.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/gloo/gloo.hpp, not this file.

#include <dtrain/backend/gloo/gloo.hpp>

#if DTRAIN_HAS_GLOO()
namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE sigpipe_blocked::sigpipe_blocked() noexcept {
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe, &previous_);
}

DTRAIN_DETAIL_INLINE std::string mapped_file_of(const void* address) {
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (!maps) return {};
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::string found;
  char line[4096];
  while (found.empty() && std::fgets(line, sizeof line, maps)) {
    unsigned long long begin = 0, end = 0;
    int path_at = 0;
    if (std::sscanf(line, "%llx-%llx %*s %*s %*s %*s %n", &begin, &end, &path_at) < 2) continue;
    if (at < begin || at >= end || path_at <= 0) continue;
    found = line + path_at;
    while (!found.empty() && (found.back() == '\n' || found.back() == ' ')) found.pop_back();
  }
  std::fclose(maps);
  return found;
}

DTRAIN_DETAIL_INLINE void check_gloo_library(int rank) {
  using create_device =
      std::shared_ptr<::gloo::transport::Device> (*)(const ::gloo::transport::tcp::attr&);
  const create_device create = &::gloo::transport::tcp::CreateDevice;
  const void* code = nullptr;
  std::memcpy(&code, &create, sizeof code);
  const std::string file = mapped_file_of(code);
  const std::string base = file.substr(file.find_last_of('/') + 1);
  if (!base.starts_with("libtorch")) return;
  throw config_error(
      "gloo_communicator on rank " + std::to_string(rank) + ": Gloo's functions resolve to " +
      file +
      ", the copy of Gloo inside LibTorch, not to the libgloo dtrain was compiled against "
      "(another version: its calls would crash). Link libgloo before LibTorch (CMake: "
      "list dtrain::gloo before the torch libraries), "
      "or use dtrain's MPI or NCCL engine with this LibTorch");
}

DTRAIN_DETAIL_INLINE shm_mode shm_mode_of(const gloo_options& o) {
  std::optional<bool> on = o.shared_memory;
  if (!on) on = read_flag(o.env, gloo_shm_variable);
  if (!on) return shm_mode::automatic;
  return *on ? shm_mode::required : shm_mode::off;
}

DTRAIN_DETAIL_INLINE std::string shm_host_identity() {
  std::string id;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {};
    if (std::fgets(boot, sizeof boot, f)) id += boot;
    std::fclose(f);
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) == 0) id += host;
  for (const char* ns : {"/proc/self/ns/net", "/proc/self/ns/mnt"}) {
    char link[128] = {};
    const auto n = ::readlink(ns, link, sizeof link - 1);
    id += "|";
    if (n > 0) id.append(link, static_cast<std::size_t>(n));
  }
  return id;
}

DTRAIN_DETAIL_INLINE void shm_put(std::uint8_t* record, char status, const std::string& text) {
  std::memset(record, 0, shm_record_bytes);
  record[0] = static_cast<std::uint8_t>(status);
  std::memcpy(record + 1, text.data(), std::min(text.size(), shm_record_bytes - 2));
}

DTRAIN_DETAIL_INLINE std::string shm_text_of(const std::uint8_t* record) {
  const char* text = reinterpret_cast<const char*>(record + 1);
  return std::string(text, ::strnlen(text, shm_record_bytes - 1));
}

DTRAIN_DETAIL_INLINE std::string gloo_join_shm(gloo_state& s, shm_mode mode) {
  if (s.size == 1) return "off (a world of one)";
#if !DTRAIN_HAS_SHM()
  if (mode == shm_mode::required) {
    throw config_error("DTRAIN_GLOO_SHM=1 (or gloo_options::shared_memory) on rank " +
                       std::to_string(s.rank) + ": this platform has no shared-memory path");
  }
  return "off (not on this platform)";
#else
  const auto ranks = static_cast<std::size_t>(s.size);
  const auto everyone = [&](const std::uint8_t* own, std::vector<std::uint8_t>& into) {
    into.assign(ranks * shm_record_bytes, 0);
    gloo_run_allgather_tcp(s,
                           buffer{const_cast<std::uint8_t*>(own), shm_record_bytes, dtype::uint8},
                           buffer{into.data(), into.size(), dtype::uint8}, s.timeout);
  };
  const auto record = [&](const std::vector<std::uint8_t>& records, int r) {
    return records.data() + static_cast<std::size_t>(r) * shm_record_bytes;
  };
  std::uint8_t mine[shm_record_bytes];
  std::vector<std::uint8_t> all;
  // 1. Does every rank allow it, and run on this host?
  shm_put(mine, static_cast<char>(mode), shm_host_identity());
  everyone(mine, all);
  int required_by = -1;
  std::string why_not;
  for (int r = 0; r < s.size; ++r) {
    const auto m = static_cast<shm_mode>(record(all, r)[0]);
    if (m == shm_mode::required && required_by < 0) required_by = r;
    if (m == shm_mode::off && why_not.empty())
      why_not =
          "DTRAIN_GLOO_SHM=0 or gloo_options::shared_memory = false on rank " + std::to_string(r);
  }
  for (int r = 1; r < s.size && why_not.empty(); ++r) {
    if (shm_text_of(record(all, r)) != shm_text_of(record(all, 0)))
      why_not = "ranks 0 and " + std::to_string(r) + " run on different hosts";
  }
  // 2. Rank 0 makes the segment and tells the others its name, or why not.
  if (why_not.empty()) {
    if (s.rank == 0) {
      try {
        const std::string name = "/dtrain-gloo-" + new_store_token();
        s.shm = shm_segment::create(name, s.size);
        shm_put(mine, 'y', name);
      } catch (const shm_failure& e) {
        shm_put(mine, 'n', std::string("rank 0: ") + e.what());
      }
    }
    gloo_run_broadcast(s, buffer{mine, shm_record_bytes, dtype::uint8}, 0, s.timeout);
    if (mine[0] != 'y') why_not = shm_text_of(mine);
  }
  // 3. The others open it; every rank hears how each fared; rank 0 unlinks.
  if (why_not.empty()) {
    const std::string made = shm_text_of(mine);
    std::uint8_t status[shm_record_bytes];
    shm_put(status, 'y', "");
    if (s.rank != 0) {
      try {
        s.shm = shm_segment::open(made, s.rank, s.size);
      } catch (const shm_failure& e) {
        shm_put(status, 'n', "rank " + std::to_string(s.rank) + ": " + e.what());
      }
    }
    everyone(status, all);
    if (s.rank == 0) shm_segment::unlink(made);
    for (int r = 0; r < s.size && why_not.empty(); ++r) {
      if (record(all, r)[0] != 'y') why_not = shm_text_of(record(all, r));
    }
  }
  if (!why_not.empty()) {
    s.shm = shm_segment{};
    if (required_by >= 0) {
      throw config_error("DTRAIN_GLOO_SHM=1 (or gloo_options::shared_memory = true) on rank " +
                         std::to_string(required_by) +
                         ", but shared memory cannot be used: " + why_not);
    }
    return "off (" + why_not + ")";
  }
  return "on (" + std::to_string(s.shm.bytes() >> 10) + " KiB segment, " +
         std::to_string(s.shm.slot_bytes() >> 10) + " KiB slots)";
#endif
}

DTRAIN_DETAIL_INLINE gloo_self::~gloo_self() {
  if (state) {
    {
      std::lock_guard lock(state->mutex);
      state->stopping = true;
    }
    state->wake.notify_all();
  }
  if (worker.joinable()) worker.join();
}
}  // namespace detail
}  // namespace dtrain
#endif

#if DTRAIN_HAS_GLOO()
namespace dtrain {

DTRAIN_DETAIL_INLINE std::string gloo_communicator::describe() const {
  if (!self_) return left_out_ ? "gloo, this rank left out by split()" : "gloo, moved from";
  return "gloo rank " + std::to_string(rank()) + " of " + std::to_string(size()) + ", " +
         self_->state->device->str() + " (" + self_->endpoint.origin + "), keys under " +
         self_->keys + ", shared memory " + self_->state->shm_text;
}

DTRAIN_DETAIL_INLINE work gloo_communicator::allreduce(buffer in, buffer out, reduce_op op) {
  return collective(detail::collective_call::allreduce(in, out, op),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::visit(c.in.type, [&]<class T>() {
                        detail::gloo_run_allreduce<T>(s, c.in, c.out, reduce_op(c.op), timeout);
                      });
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::broadcast(buffer data, int root) {
  return collective(detail::collective_call::broadcast(data, root),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::gloo_run_broadcast(s, c.out, c.root, timeout);
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::reduce_scatter(buffer in, buffer out, reduce_op op) {
  return collective(detail::collective_call::reduce_scatter(in, out, op),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::visit(c.in.type, [&]<class T>() {
                        detail::gloo_run_reduce_scatter<T>(s, c.in, c.out, reduce_op(c.op),
                                                           timeout);
                      });
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::barrier() {
  return collective(detail::collective_call::barrier(),
                    [](detail::gloo_state& s, const detail::collective_call&, ms timeout) {
                      detail::gloo_run_barrier(s, timeout);
                    });
}

DTRAIN_DETAIL_INLINE gloo_communicator gloo_communicator::split(int color, int key) {
  std::int64_t mine[2] = {color, key};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
  buffer in{mine, 2, dtype::int64, memory::host};
  buffer out{all.data(), all.size(), dtype::int64, memory::host};
  // An allgather of (color, key), told apart from a user's in check mode.
  // Throws when not valid().
  const detail::collective_call exchange{
      .kind = detail::collective_kind::split, .in = in, .out = out};
  collective(exchange, &run_allgather).wait();
  // Every rank counts the split, left out or not: the next one's keys must agree.
  const auto number = self_->splits++;
  if (color < 0) return gloo_communicator(left_out_tag{});
  std::vector<std::pair<std::int64_t, int>> members;  // (key, rank here)
  for (int r = 0; r < size(); ++r) {
    if (all[2 * static_cast<std::size_t>(r)] == color)
      members.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
  }
  std::sort(members.begin(), members.end());
  int new_rank = 0;
  while (members[static_cast<std::size_t>(new_rank)].second != rank()) ++new_rank;
  std::string keys = self_->keys + "/split/" + std::to_string(number) + "/" + std::to_string(color);
  gloo_communicator child(self_->store, new_rank, static_cast<int>(members.size()), self_->options,
                          self_->endpoint, std::move(keys));
  child.self_->state->ring = self_->state->ring->make_child(color);
  return child;
}

DTRAIN_DETAIL_INLINE gloo_communicator::gloo_communicator(
    std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size, gloo_options options) {
  if (size < 1)
    throw config_error("gloo_communicator: size " + std::to_string(size) + " must be at least 1");
  if (rank < 0 || rank >= size) {
    throw config_error("gloo_communicator: rank " + std::to_string(rank) + " is not below size " +
                       std::to_string(size));
  }
  (void)detail::shm_mode_of(options);  // a bad DTRAIN_GLOO_SHM fails before the store counts
  auto endpoint =
      detail::choose_gloo_endpoint(options.interface, options.master_addr, options.env, size);
  // Every rank counts the communicators it made under this prefix, so the
  // n-th one of every rank meets under the same namespace.
  const std::int64_t n = store->add(options.prefix + "/made/" + std::to_string(rank), 1) - 1;
  std::string keys = options.prefix + "/" + std::to_string(n);
  connect(std::move(store), rank, size, std::move(options), std::move(endpoint), std::move(keys));
}

DTRAIN_DETAIL_INLINE void gloo_communicator::connect(
    std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size, gloo_options options,
    detail::gloo_endpoint endpoint, std::string keys) {
  // Gloo 0.5 writes to its sockets without MSG_NOSIGNAL: a peer that died
  // would kill this process with SIGPIPE. Its threads and the worker start
  // with SIGPIPE blocked (threads inherit the mask); such a write then fails
  // with EPIPE, which Gloo reports as an error.
  detail::sigpipe_blocked quiet;
  detail::check_gloo_library(rank);
  const detail::shm_mode shm = detail::shm_mode_of(options);  // DTRAIN_GLOO_SHM=bad fails here
  auto state = std::make_shared<detail::gloo_state>();
  state->rank = rank;
  state->size = size;
  state->timeout = options.collectives.timeout;
  state->check = options.collectives.check;
  const std::string where = "connecting gloo rank " + std::to_string(rank) + " of " +
                            std::to_string(size) + " (interface: " + endpoint.origin +
                            "; store keys under " + keys + "/): ";
  try {
    ::gloo::transport::tcp::attr attr;
    if (!endpoint.iface.empty()) {
      attr.iface = endpoint.iface;
    } else {
      attr.hostname = endpoint.hostname;
    }
    DTRAIN_GLOO_CHECK(state->device = ::gloo::transport::tcp::CreateDevice(attr));
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    context->setTimeout(state->timeout);
    detail::gloo_store_adapter adapter(*store, keys, state->timeout);
    DTRAIN_GLOO_CHECK(context->connectFullMesh(adapter, state->device));
    state->context = context;
    // Once every rank has connected, every rank has read every address: a
    // barrier proves it, and the addresses can leave the store.
    detail::gloo_run_barrier(*state, state->timeout);
    for (const auto& key : adapter.written()) store->erase(key);
    state->shm_text = detail::gloo_join_shm(*state, shm);
  } catch (const timeout_error& e) {
    throw timeout_error(where + e.what());
  } catch (const rendezvous_error& e) {
    throw rendezvous_error(where + e.what());
  } catch (const error&) {
    throw;
  } catch (const std::exception& e) {  // Gloo's, through DTRAIN_GLOO_CHECK
    throw backend_error(where + "Gloo: " + e.what(), 0);
  }
  self_ = std::make_unique<detail::gloo_self>();
  self_->state = state;
  self_->store = std::move(store);
  self_->options = std::move(options);
  self_->endpoint = std::move(endpoint);
  self_->keys = std::move(keys);
  self_->worker = std::thread([state] { detail::gloo_serve(state); });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::collective(const detail::collective_call& call,
                                                        detail::gloo_runner run) {
  const detail::collective_info what = call.info(name, rank(), size());
  if (!self_) detail::throw_invalid(detail::describe(what), left_out_);
  detail::check_arguments(call, what, host_memory);
  detail::gloo_state& s = *self_->state;
  if (s.unusable.load()) throw backend_error(detail::describe(what) + ": " + s.unusable_text(), 0);
  std::unique_lock lock(s.mutex);
  const std::int64_t seq = detail::record(*s.ring, what);
  if (!call.moves_data() && !s.check) {
    s.ring->settle(seq, detail::call_state::completed);
    return work{};
  }
  auto w = std::make_shared<detail::gloo_work>(what, s.timeout, self_->state);
  w->track(s.ring, seq);
  s.queue.push_back({w, detail::signature_of(seq, what), call, run});
  const bool idle = !s.running;
  lock.unlock();
  if (idle) s.wake.notify_one();
  return work(std::move(w));
}

}  // namespace dtrain
#endif
