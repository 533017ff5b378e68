#pragma once
/// @file
/// ZeRO stage 3 on the host: where a parameter's values point while no
/// gather() holds them. Not null but a place of its own in address space
/// reserved with no access (never backed by memory), so that a read or a
/// write there (a layer computed outside its guard, `ddp->forward(x)` around
/// the wrapper, printing a tensor) is caught: the fault handler the first
/// fence installs names the parameter, its unit and the rank on stderr and
/// ends the process with status 1, where it used to be a bare segmentation
/// fault nothing could name. A fault anywhere else goes on to the handler
/// that was there before (by default a core dump, as without dtrain).

#include <dtrain/config.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::detail {

class value_fence {
 public:
  /// What a fault at a place names.
  struct place {
    std::string name;
    std::int64_t unit = -1;
    std::size_t bytes = 0;    ///< the parameter's values
    std::size_t element = 1;  ///< bytes per value
  };

  /// Reserves a place for each parameter (in order, 64-byte aligned). With
  /// no address space to reserve, or 64 fences alive at once, it holds none
  /// and at() is null (a read there faults unnamed, as before).
  value_fence(std::vector<place> places, int rank, int size);
  ~value_fence();
  value_fence(const value_fence&) = delete;
  value_fence& operator=(const value_fence&) = delete;

  /// Parameter i's place, or null.
  [[nodiscard]] void* at(std::size_t i) const noexcept;
  /// Whether `p` lies in a live fence: a stage-3 value pointer between
  /// gathers (a checkpoint refuses to read it).
  [[nodiscard]] static bool holds(const void* p) noexcept;
  /// The fault handler's part: writes the report and ends the process when
  /// `address` is in this fence; async-signal-safe.
  void report_if_mine(const void* address, int access) const noexcept;

 private:
  [[nodiscard]] bool contains(const void* p) const noexcept;

  std::vector<place> places_;
  std::vector<std::size_t> offsets_;
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  int rank_ = 0;
  int size_ = 0;
  std::size_t slot_ = 0;
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/ddp/fence-inl.hpp>
#endif
