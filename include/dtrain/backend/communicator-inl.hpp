#pragma once
/// @file
/// The non-template bodies of dtrain/backend/communicator.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/communicator.hpp, not this file.

#include <dtrain/backend/communicator.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE void throw_invalid(const std::string& what, bool left_out) {
  throw config_error(what + (left_out ? ": this rank passed a negative color to split() "
                                        "and belongs to no communicator"
                                      : ": the communicator was moved from"));
}

DTRAIN_DETAIL_INLINE std::int64_t collective_kind_code(std::string_view kind) noexcept {
  for (std::size_t i = 1; i < std::size(collective_kinds); ++i) {
    if (collective_kinds[i] == kind) return static_cast<std::int64_t>(i);
  }
  return 0;
}

DTRAIN_DETAIL_INLINE void argument_check::same_type(const buffer& in, const buffer& out) const {
  if (in.type != out.type)
    fail("input is " + std::string(to_string(in.type)) + ", output " +
         std::string(to_string(out.type)));
  if (in.where != out.where) fail("input and output live in different memories (host and device)");
}

DTRAIN_DETAIL_INLINE void argument_check::count(const buffer& b, std::size_t expected,
                                                std::string_view which) const {
  if (b.count != expected) {
    fail(std::string(which) + " has " + std::to_string(b.count) + " elements, expected " +
         std::to_string(expected));
  }
}

DTRAIN_DETAIL_INLINE void argument_check::op_fits(reduce_op op, dtype t) const {
  if (op == reduce_op::avg && !is_floating(t)) {
    fail("avg of " + std::string(to_string(t)) +
         " would truncate; average floating-point data, or sum and divide");
  }
}

DTRAIN_DETAIL_INLINE void argument_check::reachable(const buffer& b, std::string_view which,
                                                    const memory_reach& reach,
                                                    std::ptrdiff_t index) const {
  const bool on_host = b.where == memory::host;
  if (!(on_host ? reach.host : reach.device)) {
    fail(name(which, index) + (on_host ? " is host memory, and " : " is device memory, and ") +
         std::string(reach.rule));
  }
  if (b.data == nullptr && b.count > 0)
    fail(name(which, index) + " is a null pointer with " + std::to_string(b.count) + " elements");
}

DTRAIN_DETAIL_INLINE void argument_check::root(int r, int size) const {
  if (r < 0 || r >= size) fail("root " + std::to_string(r) + " is not a rank of this communicator");
}

DTRAIN_DETAIL_INLINE void argument_check::apart(const buffer& in, const buffer& out) const {
  if (in.bytes() == 0 || out.bytes() == 0) return;
  const auto* a = static_cast<const std::byte*>(in.data);
  const auto* b = static_cast<const std::byte*>(out.data);
  if (a < b + out.bytes() && b < a + in.bytes())
    fail("input and output overlap; it runs out of place: pass separate buffers");
}

DTRAIN_DETAIL_INLINE collective_info collective_call::info(std::string_view engine, int rank,
                                                           int size) const noexcept {
  buffer counted = kind == collective_kind::reduce_scatter ? out : in;
  if (kind == collective_kind::allreduce_many) {
    counted = {};
    if (!many.empty()) counted.type = many.front().type;
    for (const buffer& b : many) counted.count += b.count;
  }
  return {collective_kinds[static_cast<std::size_t>(kind)], engine, rank, size, counted.count,
          static_cast<std::uint8_t>(counted.type),          op,     root};
}

DTRAIN_DETAIL_INLINE bool collective_call::moves_data() const noexcept {
  switch (kind) {
    case collective_kind::barrier:
    case collective_kind::split:
    case collective_kind::other: return true;
    case collective_kind::allreduce:
    case collective_kind::broadcast:
    case collective_kind::allgather:
    case collective_kind::alltoall: return in.count > 0;
    case collective_kind::reduce_scatter: return out.count > 0;
    case collective_kind::allreduce_many:
      for (const buffer& b : many) {
        if (b.count > 0) return true;
      }
      return false;
  }
  return true;
}

DTRAIN_DETAIL_INLINE void check_arguments(const collective_call& call, const collective_info& info,
                                          const memory_reach& reach) {
  const argument_check check{info};
  const auto ranks = static_cast<std::size_t>(info.size);
  const auto op = static_cast<reduce_op>(call.op);
  switch (call.kind) {
    case collective_kind::allreduce:
      check.reachable(call.in, "input", reach);
      check.reachable(call.out, "output", reach);
      check.same_type(call.in, call.out);
      check.count(call.out, call.in.count, "output");
      check.op_fits(op, call.in.type);
      return;
    case collective_kind::broadcast:
      check.reachable(call.in, "data", reach);
      check.root(call.root, info.size);
      return;
    case collective_kind::allgather:
      check.reachable(call.in, "input", reach);
      check.reachable(call.out, "output", reach);
      check.same_type(call.in, call.out);
      check.count(call.out, call.in.count * ranks, "output");
      return;
    case collective_kind::reduce_scatter:
      check.reachable(call.in, "input", reach);
      check.reachable(call.out, "output", reach);
      check.same_type(call.in, call.out);
      check.count(call.in, call.out.count * ranks, "input");
      check.op_fits(op, call.out.type);
      return;
    case collective_kind::alltoall:
      check.reachable(call.in, "input", reach);
      check.reachable(call.out, "output", reach);
      check.same_type(call.in, call.out);
      check.count(call.out, call.in.count, "output");
      if (ranks > 0 && call.in.count % ranks != 0) {
        check.fail("input has " + std::to_string(call.in.count) +
                   " elements, not a multiple of the " + std::to_string(ranks) +
                   " ranks (one block each)");
      }
      check.apart(call.in, call.out);
      return;
    case collective_kind::allreduce_many:
      for (std::size_t i = 0; i < call.many.size(); ++i) {
        check.reachable(call.many[i], "buffer", reach, static_cast<std::ptrdiff_t>(i));
        check.op_fits(op, call.many[i].type);
      }
      return;
    case collective_kind::barrier:
    case collective_kind::split:
    case collective_kind::other: return;
  }
}

DTRAIN_DETAIL_INLINE signature signature_of(std::int64_t seq,
                                            const collective_info& info) noexcept {
  return {seq,
          collective_kind_code(info.collective),
          static_cast<std::int64_t>(info.count),
          static_cast<std::int64_t>(info.type),
          info.op,
          info.root};
}

DTRAIN_DETAIL_INLINE std::string describe_collective(const signature& s) {
  const auto kind = static_cast<std::size_t>(s.kind);
  call_record r;
  r.seq = s.seq;
  r.kind = kind < std::size(collective_kinds) ? collective_kinds[kind] : collective_kinds[0];
  r.type = static_cast<dtype>(s.type);
  r.count = static_cast<std::size_t>(s.count);
  r.op = static_cast<int>(s.op);
  r.root = static_cast<int>(s.root);
  return "collective #" + std::to_string(s.seq) + ": " + describe_call(r, true);
}

}  // namespace detail
}  // namespace dtrain
