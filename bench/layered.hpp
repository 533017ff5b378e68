#pragma once
// The benches' layered model and Adam (bench/sharding, bench/precision): L
// layers of P elements of T, their values and gradients as pointers DDP may
// repoint (gradients into its buckets; values, at stage 3, into its gathered
// ones), and Adam's two float32 moments over the rank's shard, updating each
// piece's master (its values, or with ddp_options::master_weights their
// float32 copy).

#include <dtrain/dtrain.hpp>

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

namespace dtrain_bench {

/// L layers of P elements of T; at stage 3 the values are DDP's (the model
/// holds none: each rank writes its shard's initial values through shard()).
template <class T>
struct layered_model {
  std::vector<std::vector<T>> values;
  std::vector<T*> held, grads;
  std::size_t per_layer;
  layered_model(std::size_t layers, std::size_t n, bool deferred)
      : values(deferred ? 0 : layers, std::vector<T>(n, T(0.5f))),
        held(layers, nullptr),
        grads(layers, nullptr),
        per_layer(n) {
    for (std::size_t l = 0; l < values.size(); ++l) held[l] = values[l].data();
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t l = 0; l < held.size(); ++l) {
      std::string name = "layer";  // (not "layer" + to_string: GCC 12's -Wrestrict at -O2)
      name += std::to_string(l);
      out.push_back(dtrain::param(name, held[l], per_layer, grads[l]));
    }
    return out;
  }
  [[nodiscard]] std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& v : values) n += v.size() * sizeof(T);
    return n;
  }
};

/// Adam's two float32 moments over the rank's shard, updating the pieces'
/// float32 master from gradients of type T.
template <class T>
struct adam {
  std::vector<float> m, v;
  int t = 0;
  explicit adam(std::size_t elements) : m(elements), v(elements) {}
  void update(const dtrain::shard_piece& piece) {
    auto* w = static_cast<float*>(piece.master.data);
    const auto* g = static_cast<const T*>(piece.gradients.data);
    const float c1 = 1.0f - std::pow(0.9f, static_cast<float>(t));
    const float c2 = std::sqrt(1.0f - std::pow(0.999f, static_cast<float>(t)));
    float* mk = m.data() + piece.state_offset;
    float* vk = v.data() + piece.state_offset;
    for (std::size_t k = 0; k < piece.master.count; ++k) {
      const auto gk = static_cast<float>(g[k]);
      mk[k] = 0.9f * mk[k] + 0.1f * gk;
      vk[k] = 0.999f * vk[k] + 0.001f * gk * gk;
      w[k] -= 1e-3f / c1 * mk[k] / (std::sqrt(vk[k]) / c2 + 1e-8f);
    }
  }
  [[nodiscard]] std::size_t bytes() const { return (m.size() + v.size()) * sizeof(float); }
};

}  // namespace dtrain_bench
