// A LAMB/LARS problem in host memory, for the tests of the two-phase step on shards (optim_layerwise_norms_* and
// OptimStepArgs::layerwise_norms): tests/cpp/test_optim.cpp (the CPU backend, against the formulas below) and
// optim_kernels_vs_cpu.cpp (the emulated CUDA kernels against the CPU). Tensors of fp32, bf16 or fp16 parameters
// with 32-, 16- or 8-bit states, random values, every buffer kept as bytes so that results compare bit for bit.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/numeric.h"
#include "graphsafe/optim.h"

namespace graphsafe::layerwise_test {

inline std::size_t element_bytes(DType dtype) { return dtype == DType::Float32 ? 4 : 2; }

inline float load_element(DType dtype, const std::vector<unsigned char>& bytes, int64_t i) {
  if (dtype == DType::Float32) return ElementTraits<float>::load(reinterpret_cast<const float*>(bytes.data())[i]);
  if (dtype == DType::BFloat16) return ElementTraits<bf16_t>::load(reinterpret_cast<const bf16_t*>(bytes.data())[i]);
  return ElementTraits<f16_t>::load(reinterpret_cast<const f16_t*>(bytes.data())[i]);
}

inline void store_element(DType dtype, std::vector<unsigned char>& bytes, int64_t i, float v) {
  if (dtype == DType::Float32) reinterpret_cast<float*>(bytes.data())[i] = v;
  else if (dtype == DType::BFloat16) reinterpret_cast<bf16_t*>(bytes.data())[i] = ElementTraits<bf16_t>::store(v);
  else reinterpret_cast<f16_t*>(bytes.data())[i] = ElementTraits<f16_t>::store(v);
}

struct Tensor {
  int64_t numel = 0;
  std::vector<unsigned char> param, grad;          // the problem's dtype
  std::vector<std::vector<unsigned char>> state;   // state_bits 32: fp32, 16: bf16
  std::vector<std::vector<uint8_t>> codes;         // state_bits 8
  std::vector<std::vector<float>> absmax;          // state_bits 8: one per quantisation block
  float step = 0.0f;
};

// Whether two tensors hold the same bits everywhere (params, grads, states, codes, scales, step).
inline bool same_bits(const Tensor& a, const Tensor& b) {
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
  };
  if (a.numel != b.numel || !same(a.param, b.param) || !same(a.grad, b.grad) || a.state.size() != b.state.size() ||
      a.codes.size() != b.codes.size() || std::memcmp(&a.step, &b.step, 4) != 0)
    return false;
  for (std::size_t j = 0; j < a.state.size(); ++j)
    if (!same(a.state[j], b.state[j])) return false;
  for (std::size_t j = 0; j < a.codes.size(); ++j)
    if (!same(a.codes[j], b.codes[j]) || !same(a.absmax[j], b.absmax[j])) return false;
  return true;
}

struct Problem {
  OptimOptions options;
  DType dtype = DType::Float32;
  int state_bits = 32, block_size = 256;
  float lr = 0.02f;
  std::vector<Tensor> tensors;

  int count() const { return static_cast<int>(tensors.size()); }
  std::vector<int64_t> numels() const {
    std::vector<int64_t> n;
    for (const Tensor& t : tensors) n.push_back(t.numel);
    return n;
  }
  std::size_t workspace_bytes(Backend backend) const {
    const std::vector<int64_t> n = numels();
    return optim_workspace_bytes(backend, options, n.data(), count());
  }
  // The step's arguments; lr points into this problem (so a copy of the problem needs its own).
  OptimStepArgs args(bool increment_steps, const float* layerwise_norms = nullptr) const {
    OptimStepArgs a;
    a.options = options;
    a.param_dtype = dtype;
    a.lr = &lr;
    a.increment_steps = increment_steps;
    a.state_bits = state_bits;
    a.block_size = block_size;
    a.layerwise_norms = layerwise_norms;
    return a;
  }
  std::vector<OptimTensor> views() {
    std::vector<OptimTensor> v(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      Tensor& t = tensors[i];
      v[i].param = t.param.data();
      v[i].grad = t.grad.data();
      for (std::size_t j = 0; j < t.state.size(); ++j) v[i].state[j] = t.state[j].data();
      for (std::size_t j = 0; j < t.codes.size(); ++j) {
        v[i].codes[j] = t.codes[j].data();
        v[i].absmax[j] = t.absmax[j].data();
      }
      v[i].step = &t.step;
      v[i].numel = t.numel;
    }
    return v;
  }
};

// Random tensors of these sizes: params ~ N(0, 0.25), gradients ~ N(0, 1) with a quarter of them ±0 under
// skip_zeros, states as after some steps (signed ones ~ N(0, 0.01), the second moment ~ 0.01 |N(0, 1)|; quantised
// for 8 bits), every step at `step`.
inline Problem make_problem(const OptimOptions& o, DType dtype, int state_bits, const std::vector<int64_t>& numels,
                            uint32_t seed, float step = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  Problem p;
  p.options = o;
  p.dtype = dtype;
  p.state_bits = state_bits;
  p.lr = o.algorithm == OptimAlgorithm::LARS ? 1.0f : 0.02f;
  const int states = optim_state_count(o);
  for (int64_t n : numels) {
    Tensor t;
    t.numel = n;
    t.step = step;
    t.param.resize(n * element_bytes(dtype));
    t.grad.resize(n * element_bytes(dtype));
    for (int64_t i = 0; i < n; ++i) {
      store_element(dtype, t.param, i, 0.5f * normal(rng));
      float g = normal(rng);
      if (o.skip_zeros && rng() % 4 == 0) g = rng() % 2 ? 0.0f : -0.0f;
      store_element(dtype, t.grad, i, g);
    }
    for (int j = 0; j < states; ++j) {
      const bool is_signed = optim_state_is_signed(o, j);
      std::vector<float> values(n);
      for (float& v : values) v = is_signed ? 0.1f * normal(rng) : 0.01f * std::fabs(normal(rng));
      if (state_bits == 8) {
        t.codes.emplace_back(n);
        t.absmax.emplace_back((n + p.block_size - 1) / p.block_size);
        quantize_blockwise_cpu(values.data(), n, p.block_size, is_signed, t.codes.back().data(),
                               t.absmax.back().data());
      } else {
        const DType storage = state_bits == 16 ? DType::BFloat16 : DType::Float32;
        t.state.emplace_back(n * element_bytes(storage));
        for (int64_t i = 0; i < n; ++i) store_element(storage, t.state.back(), i, values[i]);
      }
    }
    p.tensors.push_back(std::move(t));
  }
  return p;
}

// Elements [begin, end) of a tensor as a tensor of their own (a shard of rows of a row-major tensor), with its own
// states; with 8-bit states begin must start a quantisation block (blocks never straddle a shard boundary).
inline Tensor slice(const Problem& p, const Tensor& t, int64_t begin, int64_t end) {
  if (p.state_bits == 8 && begin % p.block_size != 0) throw std::invalid_argument("slice: a block straddles it");
  const auto bytes = [](const std::vector<unsigned char>& v, int64_t from, int64_t to, std::size_t width) {
    return std::vector<unsigned char>(v.begin() + from * width, v.begin() + to * width);
  };
  Tensor s;
  s.numel = end - begin;
  s.step = t.step;
  s.param = bytes(t.param, begin, end, element_bytes(p.dtype));
  s.grad = bytes(t.grad, begin, end, element_bytes(p.dtype));
  for (const auto& state : t.state) s.state.push_back(bytes(state, begin, end, p.state_bits == 16 ? 2 : 4));
  for (std::size_t j = 0; j < t.codes.size(); ++j) {
    s.codes.emplace_back(t.codes[j].begin() + begin, t.codes[j].begin() + end);
    s.absmax.emplace_back(t.absmax[j].begin() + begin / p.block_size,
                          t.absmax[j].begin() + (end + p.block_size - 1) / p.block_size);
  }
  return s;
}

// The CPU backend's phase 1: 2 floats per tensor.
inline std::vector<float> cpu_norms(Problem& p, bool increment_steps) {
  std::vector<float> norms(2 * p.count(), NAN);
  std::vector<float> workspace(p.workspace_bytes(Backend::Cpu) / 4 + 1);
  std::vector<OptimTensor> views = p.views();
  optim_layerwise_norms_cpu(p.args(increment_steps), views.data(), p.count(), workspace.data(),
                            p.workspace_bytes(Backend::Cpu), norms.data());
  return norms;
}

// A CPU step (given norms: phase 2); returns its workspace (layout.h: the tensors' factors after the chunks').
inline std::vector<float> cpu_step(Problem& p, bool increment_steps, const float* layerwise_norms = nullptr) {
  std::vector<float> workspace(p.workspace_bytes(Backend::Cpu) / 4 + 1);
  std::vector<OptimTensor> views = p.views();
  optim_step_cpu(p.args(increment_steps, layerwise_norms), views.data(), p.count(), workspace.data(),
                 p.workspace_bytes(Backend::Cpu));
  return workspace;
}

// An independent reference for the tests: a tensor's squared norms (param², update²) from docs/optim.md's formulas,
// in double, at step number `step` (LAMB's update from the new moments, LARS's gradient; a skipped element adds
// only its parameter), and the factor of pass 2 from them.
inline std::array<double, 2> reference_norms(const Problem& p, const Tensor& t, double step) {
  const OptimOptions& o = p.options;
  std::vector<std::vector<float>> s(optim_state_count(o), std::vector<float>(t.numel));
  for (std::size_t j = 0; j < s.size(); ++j)
    for (int64_t i = 0; i < t.numel; ++i) {
      if (p.state_bits == 8)
        s[j][i] = quantization_map(optim_state_is_signed(o, j))[t.codes[j][i]] * t.absmax[j][i / p.block_size];
      else s[j][i] = load_element(p.state_bits == 16 ? DType::BFloat16 : DType::Float32, t.state[j], i);
    }
  double pp = 0.0, uu = 0.0;
  for (int64_t i = 0; i < t.numel; ++i) {
    const double raw = load_element(p.dtype, t.grad, i), w = load_element(p.dtype, t.param, i);
    pp += w * w;
    if (o.skip_zeros && raw == 0.0) continue;
    const double g = o.maximize ? -raw : raw;
    if (o.algorithm == OptimAlgorithm::LARS) {
      uu += g * g;
      continue;
    }
    const double m = o.beta1 * s[0][i] + (1.0 - o.beta1) * g, v = o.beta2 * s[1][i] + (1.0 - o.beta2) * g * g;
    const double bc1 = o.bias_correction ? 1.0 - std::pow(o.beta1, step) : 1.0;
    const double bc2 = o.bias_correction ? 1.0 - std::pow(o.beta2, step) : 1.0;
    const double u = (m / bc1) / (std::sqrt(v) / std::sqrt(bc2) + o.eps) + o.weight_decay * w;
    uu += u * u;
  }
  return {pp, uu};
}

inline double reference_factor(const OptimOptions& o, double pp, double uu) {
  const double w = std::sqrt(pp), u = std::sqrt(uu);
  if (o.algorithm == OptimAlgorithm::LAMB) return w / u;
  return o.trust_coefficient * w / (u + o.weight_decay * w + o.eps);
}

}  // namespace graphsafe::layerwise_test
