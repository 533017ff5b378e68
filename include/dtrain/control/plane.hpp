#pragma once
/// @file
/// The host control plane: small blocking collectives on host memory for
/// what is metadata rather than gradients (model agreement, the bucket
/// rebuild order, checksums, bootstrap). A device engine such as NCCL never
/// carries them. Two channels: `store_channel` (over the rendezvous store;
/// works for every backend) and `communicator_channel` (over a communicator
/// that reaches host memory: MPI, Gloo). `control_plane` refers to either.

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <concepts>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

namespace dtrain {

/// Blocking host collectives among the ranks of a job. Every rank calls the
/// same operations in the same order; each is bounded by the channel's
/// timeout (the store's, or the communicator's collective timeout).
template <class C>
concept host_channel = requires(C& c, const C& cc, std::span<const std::int64_t> in,
                                std::span<std::int64_t> out, std::span<std::uint8_t> bytes) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.allgather(in, out);   // out: size() * in.size(), in rank order
  c.broadcast(bytes, 0);  // every rank passes the same length
};

/// Host collectives through the rendezvous store: allgather is a key per
/// rank, broadcast one key from the root. The last rank to read a round
/// erases its keys, so the store holds at most one round per channel.
template <store Store>
class store_channel {
 public:
  /// `prefix` names this channel's keys; every rank must use the same one.
  store_channel(Store& store, int rank, int size, std::string prefix = "control")
      : store_(store), rank_(rank), size_(size), prefix_(std::move(prefix) + "/") {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }

  void allgather(std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    const std::string round = next_round();
    const std::size_t bytes = in.size_bytes();
    if (out.size() != in.size() * static_cast<std::size_t>(size_)) {
      throw config_error("store_channel::allgather on rank " + std::to_string(rank_) +
                         ": output has " + std::to_string(out.size()) + " elements, expected " +
                         std::to_string(in.size() * static_cast<std::size_t>(size_)));
    }
    store_.set(round + std::to_string(rank_),
               std::string_view(reinterpret_cast<const char*>(in.data()), bytes));
    for (int r = 0; r < size_; ++r) {
      const std::string key = round + std::to_string(r);
      const std::string value = r == rank_
                                    ? std::string(reinterpret_cast<const char*>(in.data()), bytes)
                                    : store_.get(key);
      expect_length(key, value, bytes, r);
      std::memcpy(out.data() + static_cast<std::size_t>(r) * in.size(), value.data(), bytes);
    }
    finish(round, [&] {
      for (int r = 0; r < size_; ++r) store_.erase(round + std::to_string(r));
    });
  }

  void broadcast(std::span<std::uint8_t> data, int root) { broadcast(data, root, true); }

  /// broadcast() where a rank that does not `want` the bytes leaves `data`
  /// as it is and reads nothing from the store: the root's key is read by
  /// the ranks that want it alone (a part sent to a few ranks of many).
  void broadcast(std::span<std::uint8_t> data, int root, bool wanted) {
    if (root < 0 || root >= size_) {
      throw config_error("store_channel::broadcast: root " + std::to_string(root) +
                         " is not a rank of " + std::to_string(size_));
    }
    const std::string round = next_round();
    const std::string key = round + "root";
    // (A rank that does not want it counts as a read all the same: the last
    // read erases the key, and the root counts only once it has set it.)
    if (rank_ == root) {
      store_.set(key, std::string_view(reinterpret_cast<const char*>(data.data()), data.size()));
    } else if (wanted) {
      const std::string value = store_.get(key);
      expect_length(key, value, data.size(), root);
      if (!data.empty()) std::memcpy(data.data(), value.data(), data.size());
    }
    finish(round, [&] { store_.erase(key); });
  }

 private:
  std::string next_round() { return prefix_ + std::to_string(++round_) + "/"; }

  void expect_length(const std::string& key, const std::string& value, std::size_t bytes,
                     int from) const {
    if (value.size() != bytes) {
      throw rendezvous_error("control plane: store key " + key + " from rank " +
                             std::to_string(from) + " has " + std::to_string(value.size()) +
                             " bytes, rank " + std::to_string(rank_) + " expected " +
                             std::to_string(bytes) +
                             "; the ranks called different control operations, "
                             "or another program wrote under this prefix");
    }
  }

  template <class Erase>
  void finish(const std::string& round, Erase&& erase) {
    const std::string read = round + "read";
    if (store_.add(read, 1) == size_) {
      erase();
      store_.erase(read);
    }
  }

  Store& store_;
  int rank_;
  int size_;
  std::string prefix_;
  std::uint64_t round_ = 0;
};

/// Host collectives on a communicator that reaches host memory, each waited
/// for within its collective timeout.
template <communicator C>
class communicator_channel {
  static_assert(C::reaches_host_memory,
                "communicator_channel needs a communicator that reaches host memory (MPI, Gloo); "
                "for NCCL use the context's control plane or a store_channel");

 public:
  explicit communicator_channel(C& comm) noexcept : comm_(comm) {}
  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int size() const { return comm_.size(); }
  void allgather(std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    dtrain::allgather(comm_, in, out).wait();
  }
  void broadcast(std::span<std::uint8_t> data, int root) {
    if (!data.empty()) dtrain::broadcast(comm_, data, root).wait();
  }

 private:
  C& comm_;
};

class control_plane;

/// A host_channel other than control_plane itself (which copies instead).
template <class C>
concept channel_to_refer_to = host_channel<C> && !std::same_as<C, control_plane>;

/// A reference to any host_channel, for code that must not be a template on
/// it (DistributedDataParallel keeps one). The channel must outlive it.
class control_plane {
 public:
  template <channel_to_refer_to Channel>
  explicit control_plane(Channel& channel) noexcept
      : channel_(&channel),
        rank_(channel.rank()),
        size_(channel.size()),
        allgather_([](void* c, std::span<const std::int64_t> in, std::span<std::int64_t> out) {
          static_cast<Channel*>(c)->allgather(in, out);
        }),
        broadcast_([](void* c, std::span<std::uint8_t> data, int root, bool wanted) {
          if constexpr (requires(Channel & ch) { ch.broadcast(data, root, wanted); }) {
            static_cast<Channel*>(c)->broadcast(data, root, wanted);
          } else {
            static_cast<Channel*>(c)->broadcast(data, root);
          }
        }) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  void allgather(std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    allgather_(channel_, in, out);
  }
  void broadcast(std::span<std::uint8_t> data, int root) { broadcast_(channel_, data, root, true); }
  /// A broadcast whose bytes only the ranks that `want` them need: every
  /// rank calls it, and a rank that does not want them may find `data` as it
  /// was (the store's channel reads nothing for it; a communicator's
  /// collective brings them to every rank all the same).
  void broadcast(std::span<std::uint8_t> data, int root, bool wanted) {
    broadcast_(channel_, data, root, wanted);
  }

 private:
  void* channel_;
  int rank_;
  int size_;
  void (*allgather_)(void*, std::span<const std::int64_t>, std::span<std::int64_t>);
  void (*broadcast_)(void*, std::span<std::uint8_t>, int, bool);
};

static_assert(host_channel<control_plane>);

}  // namespace dtrain
