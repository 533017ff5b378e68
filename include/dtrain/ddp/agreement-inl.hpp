#pragma once
/// @file
/// The non-template bodies of dtrain/ddp/agreement.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/ddp/agreement.hpp, not this file.

#include <dtrain/ddp/agreement.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string parameter_entry(const parameter& p, std::string_view kind) {
  std::string entry = std::string(kind) + " " + p.name + " (";
  if (p.shape.empty()) {
    entry += std::to_string(p.values.count) + " x ";
  } else {
    entry += "[";
    for (std::size_t d = 0; d < p.shape.size(); ++d) {
      if (d > 0) entry += ", ";
      entry += std::to_string(p.shape[d]);
    }
    entry += "] ";
  }
  entry += to_string(p.values.type);
  entry += p.values.where == memory::host ? " on the host" : " on a GPU";
  if (p.unit >= 0) entry += ", unit " + std::to_string(p.unit);
  entry += p.values.data ? ")" : ", values from the shard)";  // stage 3's deferred values
  return entry;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> model_entries(std::span<const parameter> params,
                                                            std::span<const parameter> buffers) {
  std::vector<std::string> entries;
  for (const parameter& p : params) entries.push_back(parameter_entry(p, "parameter"));
  for (const parameter& b : buffers) entries.push_back(parameter_entry(b, "buffer"));
  return entries;
}

DTRAIN_DETAIL_INLINE std::int64_t fnv1a(const std::vector<std::string>& entries) {
  std::uint64_t h = 1469598103934665603ull;
  for (const std::string& e : entries) {
    for (char c : e) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    h = (h ^ 0x0au) * 1099511628211ull;
  }
  return static_cast<std::int64_t>(h >> 1);
}

DTRAIN_DETAIL_INLINE std::string model_problem(std::span<const parameter> params,
                                               std::span<const parameter> buffers,
                                               const ddp_options& options, int rank,
                                               std::string_view backend, bool on_device,
                                               int device) {
  const std::string who = "DistributedDataParallel on rank " + std::to_string(rank) + ": ";
  std::unordered_map<std::string_view, std::size_t> names;
  std::unordered_map<const void*, std::size_t> data;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const parameter& p = params[i];
    const std::string what = "parameter #" + std::to_string(i) + " '" + p.name + "'";
    if (p.name.empty()) return who + what + " has no name";
    if (auto [it, fresh] = names.emplace(p.name, i); !fresh) {
      return who + "two parameters are called '" + p.name + "' (#" + std::to_string(it->second) +
             " and #" + std::to_string(i) + ")";
    }
    if (p.values.count == 0) return who + what + " has no values";
    if (!p.values.data) {
      // Stage 3 may start from the shard (deferred initialisation): the
      // values are written through shard(), no rank ever holds them whole.
      if (options.sharding != sharding::parameters || !p.values_rebindable()) {
        return who + what + " has no values" +
               (options.sharding == sharding::parameters
                    ? ""
                    : " (null values are for ddp_options::sharding = parameters, which starts "
                      "them at zero in each rank's shard)");
      }
    } else if (!data.emplace(p.values.data, i).second) {
      return who + what + " shares its values with another parameter";
    }
    if (!is_floating(p.values.type)) {
      return who + what + " is " + std::string(to_string(p.values.type)) +
             ": only floating-point parameters have gradients to average (declare it in buffers())";
    }
    if (!p.gradient && !p.rebindable()) return who + what + " has no gradient buffer";
    if (!p.gradient && !options.gradient_as_bucket_view) {
      return who + what +
             " has a null gradient pointer, which needs ddp_options::gradient_as_bucket_view";
    }
    if (on_device && p.values.where != memory::device) {
      return who + what +
             " is in host memory, but backend::nccl reduces GPU memory: use dtrain::device_param";
    }
    if (on_device && p.device != device) {
      return who + what + " is on GPU " + std::to_string(p.device) +
             ", but this rank's NCCL communicator is on GPU " + std::to_string(device);
    }
    if (!on_device && p.values.where != memory::host) {
      return who + what + " is in GPU memory, but backend " + std::string(backend) +
             " reduces host memory: keep gradients on the host, or use backend::nccl";
    }
  }
  for (const parameter& b : buffers) {
    if (!b.values.data && b.values.count) return who + "buffer '" + b.name + "' has no values";
    if (b.values.where == memory::device && !on_device) {
      return who + "buffer '" + b.name + "' is in GPU memory, but backend " + std::string(backend) +
             " reaches host memory only";
    }
  }
  if (options.sharding != sharding::none && options.sharding != sharding::optimizer &&
      options.sharding != sharding::gradients && options.sharding != sharding::parameters) {
    return who + "ddp_options::sharding is " + std::to_string(static_cast<int>(options.sharding)) +
           ", not none (0), optimizer (1), gradients (2) or parameters (3)";
  }
  if ((options.sharding == sharding::gradients || options.sharding == sharding::parameters) &&
      options.compression != gradient_compression::none &&
      options.accumulate != accumulation::float32) {
    return who + "ddp_options::sharding is " + std::string(to_string(options.sharding)) +
           " and ddp_options::compression is " + std::string(to_string(options.compression)) +
           ": a compressed reduce-scatter keeps this rank's part of the mean in float32, "
           "which needs ddp_options::accumulate = accumulation::float32 (or sharding::optimizer, "
           "or no compression)";
  }
  if (options.accumulate != accumulation::wire && options.accumulate != accumulation::float32) {
    return who + "ddp_options::accumulate is " +
           std::to_string(static_cast<int>(options.accumulate)) + ", not wire (0) or float32 (1)";
  }
  if (options.sharding == sharding::parameters) {
    // Stage 3: DDP holds the values, and points the model's values there.
    for (const parameter& p : params) {
      if (!p.values_rebindable()) {
        return who + "parameter '" + p.name +
               "' gives its values as storage, but ddp_options::sharding = parameters holds "
               "the values itself: declare it with dtrain::param(name, values_pointer, count, "
               "gradient_pointer" +
               (p.values.where == memory::device ? ", device)" : ")");
      }
    }
  }
  try {
    (void)mib_to_bytes(options.bucket_cap_mb, "bucket_cap_mb");
    (void)mib_to_bytes(options.first_bucket_cap_mb, "first_bucket_cap_mb");
  } catch (const config_error& e) {
    return who + e.what();
  }
  return {};
}

DTRAIN_DETAIL_INLINE void agree_on_model(control_plane& comm, std::span<const parameter> params,
                                         std::span<const parameter> buffers,
                                         std::string_view settings) {
  const int size = comm.size();
  std::vector<std::string> entries = model_entries(params, buffers);
  const std::size_t model_count = entries.size();
  if (!settings.empty()) entries.emplace_back(settings);  // options every rank must share
  const std::int64_t mine[2] = {static_cast<std::int64_t>(entries.size()), fnv1a(entries)};
  std::vector<std::int64_t> all(static_cast<std::size_t>(size) * 2);
  comm.allgather(mine, all);
  bool same = true;
  for (int r = 1; r < size; ++r) {
    same = same && std::equal(&all[0], &all[2], &all[static_cast<std::size_t>(r) * 2]);
  }
  if (same) return;

  // Rank 0's list to everyone; each rank finds where it departs from it.
  std::string joined;
  for (const std::string& e : entries) joined += e + '\n';
  std::int64_t length = static_cast<std::int64_t>(joined.size());
  std::uint8_t length_bytes[sizeof length];
  std::memcpy(length_bytes, &length, sizeof length);
  comm.broadcast(length_bytes, 0);
  std::memcpy(&length, length_bytes, sizeof length);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(length));
  if (comm.rank() == 0) std::memcpy(bytes.data(), joined.data(), bytes.size());
  comm.broadcast(bytes, 0);
  std::vector<std::string> reference;
  std::string current;
  for (std::uint8_t c : bytes) {
    if (c == '\n') {
      reference.push_back(std::move(current));
      current.clear();
    } else {
      current += static_cast<char>(c);
    }
  }
  std::int64_t first = -1;
  for (std::size_t i = 0; i < std::max(reference.size(), entries.size()); ++i) {
    if (i >= reference.size() || i >= entries.size() || reference[i] != entries[i]) {
      first = static_cast<std::int64_t>(i);
      break;
    }
  }
  std::vector<std::int64_t> firsts(static_cast<std::size_t>(size));
  comm.allgather(std::span<const std::int64_t>(&first, 1), firsts);
  int culprit = -1;
  std::string differing;
  for (int r = 0; r < size; ++r) {
    if (firsts[static_cast<std::size_t>(r)] < 0) continue;
    if (culprit < 0) culprit = r;
    differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (culprit < 0) return;  // equal lists after all (a hash collision)
  const auto at = static_cast<std::size_t>(firsts[static_cast<std::size_t>(culprit)]);
  // The culprit's entry to everyone, so that every rank prints the same message.
  std::vector<std::uint8_t> text(512, 0);
  if (comm.rank() == culprit) {
    const std::string e = at < entries.size() ? entries[at] : "nothing";
    std::memcpy(text.data(), e.data(), std::min(e.size(), text.size() - 1));
  }
  comm.broadcast(text, culprit);
  const std::string theirs(reinterpret_cast<const char*>(text.data()));
  const std::string ours = at < reference.size() ? reference[at] : "nothing";
  if (at == model_count && !settings.empty() && at < reference.size()) {
    throw config_error("DistributedDataParallel: the ranks' options differ: rank 0 has " + ours +
                       "; rank " + std::to_string(culprit) + " has " + theirs +
                       " (ranks that differ from rank 0: " + differing +
                       "); every rank must give DistributedDataParallel the same ddp_options");
  }
  throw config_error("DistributedDataParallel: the models differ across ranks at entry #" +
                     std::to_string(at) + ": rank 0 has " + ours + ", rank " +
                     std::to_string(culprit) + " has " + theirs +
                     " (ranks that differ from rank 0: " + differing +
                     "); every rank must build the same model in the same order");
}

DTRAIN_DETAIL_INLINE std::vector<std::size_t> agree_on_order(control_plane& control,
                                                             std::span<const std::size_t> order,
                                                             std::size_t n) {
  std::string text;
  wire::writer w(text);
  for (std::size_t i : order) w.u64(i);
  std::vector<std::uint8_t> bytes(text.begin(), text.end());
  if (control.size() > 1) control.broadcast(bytes, 0);
  const std::string where =
      "rank 0's ready order (sent to rank " + std::to_string(control.rank()) + ")";
  std::vector<std::size_t> agreed = wire::decode_value(
      where, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
      "a list of parameter indices", [](wire::reader& r) {
        std::vector<std::size_t> out;
        while (!r.at_end()) out.push_back(static_cast<std::size_t>(r.u64("a parameter index")));
        return out;
      });
  check_order(agreed, n, where);
  return agreed;
}

}  // namespace dtrain::detail
