// libFuzzer harness: optimizer steps through the public C++ API (optim_step_cpu, include/graphsafe/optim.h).
//
// Fuzzed: the algorithm (all nine: element-wise Adam, AdamW, SGD, RMSprop, Adagrad, Lion, AdEMAMix; layer-wise
// LAMB, LARS), its options (within torch's valid ranges), fp32/fp16/bf16 parameters, 32-, 16- or 8-bit states
// and the block size, 1 to 4 tensors of odd sizes (0, 1, block size +-1, a 4096-element chunk +-1, any), zero
// gradients for skip_zeros, zero or random starting states, the learning rate, the step number, and who counts
// steps (increment_steps). Two steps are taken.
// Checked at each step:
//   * one call with every tensor == one call per tensor, bit for bit (params, states, codes, absmax, steps);
//   * skip_zeros: where the raw gradient is 0 or -0 the parameter is bit-identical, and so are its 32/16-bit
//     states; with 8-bit states a block whose gradients are all zero keeps its codes and absmax bit-identical;
//   * skip_zeros on with no zero gradient == skip_zeros off, bit for bit;
//   * finite inputs of moderate size (at most 1e6; 1e3 for fp16 parameters) give finite parameters and states
//     (not for fp16 parameters with 8-bit states: a second moment rounded to 0 may take one past 65504);
//   * SGD, Adam and AdamW with 32/16-bit states equal a transcription of torch.optim's single-tensor formulas,
//     bit for bit (fp32 arithmetic, states rounded to bf16 once with 16-bit states);
//   * 32/16-bit states, element-wise algorithms: NaN/inf gradient elements damage only their own elements (the
//     rest are bit-identical to a run where those gradients are 0). 8-bit states get finite gradients only: how a
//     non-finite gradient treats its block is src/optim's own contract, tested there.
// Every buffer has exactly the size the API names (ASan), and empty tensors pass null pointers.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fuzz_common.h"
#include "graphsafe/optim.h"

using namespace graphsafe;

namespace {

struct Problem {
  OptimStepArgs args;  // lr set per call
  float lr = 0.01f;
  std::vector<int64_t> numel;
  int elem_bytes = 4;
};

struct Tensor {
  std::vector<uint8_t> param, grad;
  std::vector<std::vector<uint8_t>> state;   // 32-bit: fp32, 16-bit: bf16, per state
  std::vector<std::vector<uint8_t>> codes;   // 8-bit
  std::vector<std::vector<float>> absmax;    // 8-bit
  float step = 0.0f;
};
using World = std::vector<Tensor>;

int64_t blocks_of(const Problem& p, int64_t numel) { return (numel + p.args.block_size - 1) / p.args.block_size; }

float load_param(const Problem& p, const std::vector<uint8_t>& v, int64_t i) {
  if (p.args.param_dtype == DType::Float32) {
    float x;
    std::memcpy(&x, v.data() + 4 * i, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, v.data() + 2 * i, 2);
  return p.args.param_dtype == DType::BFloat16 ? to_float(bf16_t{h}) : to_float(f16_t{h});
}

void store_param(const Problem& p, std::vector<uint8_t>& v, int64_t i, float x) {
  if (p.args.param_dtype == DType::Float32) {
    std::memcpy(v.data() + 4 * i, &x, 4);
    return;
  }
  const uint16_t h = p.args.param_dtype == DType::BFloat16 ? to_bf16(x).bits : to_f16(x).bits;
  std::memcpy(v.data() + 2 * i, &h, 2);
}

// The 16-bit reference rounding of fuzz_common.h (independent of the library's), NaN left to the library's.
uint16_t round_half(const Problem& p, float x, bool bf16) {
  (void)p;
  if (x != x) return bf16 ? to_bf16(x).bits : to_f16(x).bits;
  return bf16 ? fuzz::bf16_table().round(x) : fuzz::fp16_table().round(x);
}

float load_state(const Problem& p, const Tensor& t, int j, int64_t i) {
  if (p.args.state_bits == 32) {
    float x;
    std::memcpy(&x, t.state[j].data() + 4 * i, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, t.state[j].data() + 2 * i, 2);
  return to_float(bf16_t{h});
}

std::vector<OptimTensor> views(const Problem& p, World& w, int first, int count) {
  std::vector<OptimTensor> v(static_cast<std::size_t>(count));
  const int states = optim_state_count(p.args.options);
  for (int k = 0; k < count; ++k) {
    Tensor& t = w[first + k];
    OptimTensor& o = v[k];
    o.param = t.param.empty() ? nullptr : t.param.data();
    o.grad = t.grad.empty() ? nullptr : t.grad.data();
    for (int j = 0; j < states; ++j) {
      if (p.args.state_bits == 8) {
        o.codes[j] = t.codes[j].empty() ? nullptr : t.codes[j].data();
        o.absmax[j] = t.absmax[j].empty() ? nullptr : t.absmax[j].data();
      } else {
        o.state[j] = t.state[j].empty() ? nullptr : t.state[j].data();
      }
    }
    o.step = &t.step;
    o.numel = p.numel[first + k];
  }
  return v;
}

// One step: every tensor in one call, or one call each (each with its own exactly sized workspace).
void step(const Problem& p, World& w, bool one_call, bool skip_zeros) {
  OptimStepArgs args = p.args;
  args.options.skip_zeros = skip_zeros;
  args.lr = &p.lr;
  if (!args.increment_steps)
    for (Tensor& t : w) t.step += 1.0f;
  const int n = static_cast<int>(w.size());
  for (int first = 0; first < n; first += one_call ? n : 1) {
    const int count = one_call ? n : 1;
    std::vector<OptimTensor> v = views(p, w, first, count);
    const std::size_t bytes = optim_workspace_bytes(Backend::Cpu, args.options, p.numel.data() + first, count);
    std::vector<uint8_t> workspace(bytes);
    optim_step_cpu(args, v.data(), count, workspace.empty() ? nullptr : workspace.data(), bytes);
  }
}

bool same(const World& a, const World& b) {
  for (std::size_t t = 0; t < a.size(); ++t) {
    if (a[t].param != b[t].param || a[t].state != b[t].state || a[t].codes != b[t].codes) return false;
    if (fuzz::bits_of(a[t].step) != fuzz::bits_of(b[t].step)) return false;
    for (std::size_t j = 0; j < a[t].absmax.size(); ++j)
      if (a[t].absmax[j].size() != b[t].absmax[j].size() ||
          !fuzz::same_bytes(a[t].absmax[j].data(), b[t].absmax[j].data(), a[t].absmax[j].size() * 4))
        return false;
  }
  return true;
}

bool is_zero_grad(const Problem& p, const Tensor& t, int64_t i) { return load_param(p, t.grad, i) == 0.0f; }

// torch.optim's single-tensor SGD / Adam / AdamW for one element, fp32 (the library's documented numerics:
// constants formed in double and rounded to fp32 once, torch's lerp, no fused multiply-add).
void reference_element(const Problem& p, float step_number, float g, float& param, float* s) {
  const OptimOptions& o = p.args.options;
  const double lr = p.lr;
  if (o.skip_zeros && g == 0.0f) return;
  if (o.maximize) g = -g;
  if (o.algorithm == OptimAlgorithm::SGD) {
    if (o.weight_decay != 0.0) g = g + static_cast<float>(o.weight_decay) * param;
    if (o.momentum != 0.0) {
      const float buf = step_number == 1.0f ? g
                                            : s[0] * static_cast<float>(o.momentum) +
                                                  static_cast<float>(1.0 - o.dampening) * g;
      s[0] = buf;
      g = o.nesterov ? g + static_cast<float>(o.momentum) * buf : buf;
    }
    param = param + static_cast<float>(-lr) * g;
    return;
  }
  // Adam / AdamW
  if (o.algorithm == OptimAlgorithm::AdamW) param = param * static_cast<float>(1.0 - lr * o.weight_decay);
  else if (o.weight_decay != 0.0) g = g + static_cast<float>(o.weight_decay) * param;
  const float w = static_cast<float>(1.0 - o.beta1);
  const float m = w < 0.5f ? s[0] + w * (g - s[0]) : g - (g - s[0]) * (1.0f - w);
  const float v = s[1] * static_cast<float>(o.beta2) + static_cast<float>(1.0 - o.beta2) * (g * g);
  float v_used = v;
  if (o.amsgrad) {
    s[2] = (s[2] != s[2] || s[2] > v) ? s[2] : v;
    v_used = s[2];
  }
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step_number));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step_number));
  const float denom = std::sqrt(v_used) / static_cast<float>(std::sqrt(bc2)) + static_cast<float>(o.eps);
  param = param + static_cast<float>(-(lr / bc1)) * (m / denom);
  s[0] = m;
  s[1] = v;
}

// Applies the reference to a copy of the world before the step and compares with the library's result.
void check_reference(const Problem& p, const World& before, const World& after) {
  const int states = optim_state_count(p.args.options);
  for (std::size_t t = 0; t < before.size(); ++t) {
    Tensor want = before[t];
    const float step_number = after[t].step;
    for (int64_t i = 0; i < p.numel[t]; ++i) {
      float param = load_param(p, want.param, i), s[4] = {};
      for (int j = 0; j < states; ++j) s[j] = load_state(p, want, j, i);
      reference_element(p, step_number, load_param(p, want.grad, i), param, s);
      if (p.args.options.skip_zeros && is_zero_grad(p, want, i)) continue;
      if (p.args.param_dtype == DType::Float32) {
        store_param(p, want.param, i, param);
      } else {
        const uint16_t h = round_half(p, param, p.args.param_dtype == DType::BFloat16);
        std::memcpy(want.param.data() + 2 * i, &h, 2);
      }
      for (int j = 0; j < states; ++j) {
        if (p.args.state_bits == 32) {
          std::memcpy(want.state[j].data() + 4 * i, &s[j], 4);
        } else {
          const uint16_t h = round_half(p, s[j], true);
          std::memcpy(want.state[j].data() + 2 * i, &h, 2);
        }
      }
    }
    for (int64_t i = 0; i < p.numel[t]; ++i) {
      const float got = load_param(p, after[t].param, i), expected = load_param(p, want.param, i);
      FUZZ_CHECK(fuzz::same_bytes(after[t].param.data() + p.elem_bytes * i, want.param.data() + p.elem_bytes * i,
                             p.elem_bytes),
                 "algorithm %d tensor %zu element %lld: param %a, torch's formula %a\n", int(p.args.options.algorithm),
                 t, (long long)i, got, expected);
    }
    for (int j = 0; j < states; ++j)
      FUZZ_CHECK(after[t].state[j] == want.state[j], "algorithm %d tensor %zu: state %d differs from torch's formula\n",
                 int(p.args.options.algorithm), t, j);
  }
}

void check_skipped(const Problem& p, const World& before, const World& after) {
  const int states = optim_state_count(p.args.options);
  for (std::size_t t = 0; t < before.size(); ++t) {
    const int64_t numel = p.numel[t];
    for (int64_t i = 0; i < numel; ++i) {
      if (!is_zero_grad(p, before[t], i)) continue;
      FUZZ_CHECK(fuzz::same_bytes(before[t].param.data() + p.elem_bytes * i, after[t].param.data() + p.elem_bytes * i,
                             p.elem_bytes),
                 "tensor %zu element %lld: skipped parameter changed\n", t, (long long)i);
      const int bytes = p.args.state_bits / 8;
      for (int j = 0; p.args.state_bits != 8 && j < states; ++j)
        FUZZ_CHECK(fuzz::same_bytes(before[t].state[j].data() + bytes * i, after[t].state[j].data() + bytes * i, bytes),
                   "tensor %zu element %lld state %d: skipped state changed\n", t, (long long)i, j);
    }
    if (p.args.state_bits != 8) continue;
    for (int64_t b = 0; b < blocks_of(p, numel); ++b) {
      const int64_t begin = b * p.args.block_size, end = std::min(numel, begin + p.args.block_size);
      bool all_skipped = true;
      for (int64_t i = begin; i < end && all_skipped; ++i) all_skipped = is_zero_grad(p, before[t], i);
      if (!all_skipped) continue;
      for (int j = 0; j < states; ++j) {
        FUZZ_CHECK(fuzz::bits_of(before[t].absmax[j][b]) == fuzz::bits_of(after[t].absmax[j][b]),
                   "tensor %zu block %lld state %d: an all-skipped block's absmax changed\n", t, (long long)b, j);
        FUZZ_CHECK(fuzz::same_bytes(before[t].codes[j].data() + begin, after[t].codes[j].data() + begin, end - begin),
                   "tensor %zu block %lld state %d: an all-skipped block's codes changed\n", t, (long long)b, j);
      }
    }
  }
}

// Whether every input of the step is finite and at most 1e6 in magnitude (1e3 for fp16 parameters): then nothing
// the rules compute (squares, norms over 5000 elements, m / eps) comes near fp32's range, nor a step's change of
// an fp16 parameter near 65504 (LARS with lr 1 and a zero parameter norm steps by the whole gradient, and its
// momentum adds half of that again on the next step), and the outputs must be finite.
bool moderate(const Problem& p, const World& w) {
  const int states = optim_state_count(p.args.options);
  const float bound = p.args.param_dtype == DType::Float16 ? 1e3f : 1e6f;
  auto ok = [bound](float x) { return std::fabs(x) <= bound; };  // false for NaN
  for (std::size_t t = 0; t < w.size(); ++t)
    for (int64_t i = 0; i < p.numel[t]; ++i) {
      if (!ok(load_param(p, w[t].param, i)) || !ok(load_param(p, w[t].grad, i))) return false;
      for (int j = 0; p.args.state_bits != 8 && j < states; ++j)
        if (!ok(load_state(p, w[t], j, i))) return false;
      for (int j = 0; p.args.state_bits == 8 && j < states; ++j)
        if (!ok(w[t].absmax[j][i / p.args.block_size])) return false;
    }
  return true;
}

// Finite parameters and states after the step (the gradients are the step's, not checked here).
void check_finite(const Problem& p, const World& w) {
  const int states = optim_state_count(p.args.options);
  for (std::size_t t = 0; t < w.size(); ++t)
    for (int64_t i = 0; i < p.numel[t]; ++i) {
      FUZZ_CHECK(std::isfinite(load_param(p, w[t].param, i)), "algorithm %d tensor %zu element %lld: param %g\n",
                 int(p.args.options.algorithm), t, (long long)i, load_param(p, w[t].param, i));
      for (int j = 0; p.args.state_bits != 8 && j < states; ++j)
        FUZZ_CHECK(std::isfinite(load_state(p, w[t], j, i)), "algorithm %d tensor %zu element %lld: state %d %g\n",
                   int(p.args.options.algorithm), t, (long long)i, j, load_state(p, w[t], j, i));
      for (int j = 0; p.args.state_bits == 8 && j < states; ++j)
        FUZZ_CHECK(std::isfinite(w[t].absmax[j][i / p.args.block_size]), "algorithm %d tensor %zu state %d: absmax %g\n",
                   int(p.args.options.algorithm), t, j, w[t].absmax[j][i / p.args.block_size]);
    }
}

template <class T>
T pick(FuzzedDataProvider& data, std::initializer_list<T> values) {
  const auto k = data.ConsumeIntegralInRange<std::size_t>(0, values.size() - 1);
  return *(values.begin() + k);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  Problem p;
  OptimOptions& o = p.args.options;
  o.algorithm = static_cast<OptimAlgorithm>(data.ConsumeIntegralInRange<int>(0, 8));
  p.args.param_dtype = pick(data, {DType::Float32, DType::Float16, DType::BFloat16});
  p.elem_bytes = p.args.param_dtype == DType::Float32 ? 4 : 2;
  p.args.state_bits = pick(data, {32, 16, 8});
  p.args.block_size = 32 << data.ConsumeIntegralInRange<int>(0, 5);
  p.args.increment_steps = data.ConsumeBool();
  o.beta1 = pick(data, {0.0, 0.5, 0.9, 0.95});
  o.beta2 = pick(data, {0.9, 0.99, 0.999});
  o.beta3 = pick(data, {0.9, 0.999, 0.9999});
  o.eps = pick(data, {1e-8, 1e-6, 1e-3});
  o.weight_decay = pick(data, {0.0, 0.01, 0.1, 1.0});
  o.momentum = pick(data, {0.0, 0.5, 0.9});
  o.dampening = pick(data, {0.0, 0.1, 0.5});
  o.nesterov = data.ConsumeBool() && o.momentum > 0.0 && o.dampening == 0.0;
  o.alpha = pick(data, {0.9, 0.99});
  o.centered = data.ConsumeBool();
  o.amsgrad = data.ConsumeBool();
  o.maximize = data.ConsumeBool();
  o.bias_correction = data.ConsumeBool();
  o.lr_decay = pick(data, {0.0, 0.01});
  o.mix_alpha = pick(data, {0.0, 5.0});
  o.alpha_warmup = pick(data, {0.0, 10.0});
  o.beta3_warmup = o.beta1 > 0.0 ? pick(data, {0.0, 10.0}) : 0.0;
  o.trust_coefficient = pick(data, {0.001, 0.02, 1.0});
  o.skip_zeros = data.ConsumeBool();
  p.lr = pick(data, {0.0f, 1e-3f, 0.1f, 1.0f});
  const float first_step = pick(data, {0.0f, 0.0f, 9.0f, 999.0f});  // the step before the first one taken here

  // Sizes that meet every edge: empty, one element, a quantisation block +-1, a 4096-element norm chunk +-1.
  const int tensors = data.ConsumeIntegralInRange<int>(1, 4);
  const int64_t b = p.args.block_size;
  for (int t = 0; t < tensors; ++t) {
    const int kind = data.ConsumeIntegralInRange<int>(0, 9);
    const int64_t sizes[] = {0, 1, b - 1, b, b + 1, 4095, 4096, 4097, 2 * b + 3};
    p.numel.push_back(kind < 9 ? sizes[kind] : data.ConsumeIntegralInRange<int64_t>(0, 5000));
  }
  const int states = optim_state_count(o);
  // Gradients: a value family and a share of exact zeros; non-finite ones only with 32/16-bit states.
  const int family = data.ConsumeIntegral<uint8_t>() % 6;
  const int zero_share = data.ConsumeIntegralInRange<int>(0, 4);  // in quarters
  const bool non_finite = p.args.state_bits != 8 && data.ConsumeBool();
  const float grad_scale = pick(data, {1e-20f, 1e-3f, 1.0f, 1e3f});
  const float param_scale = pick(data, {0.0f, 1e-3f, 1.0f, 100.0f});
  // Random starting states for fp32/bf16 parameters (an fp16 parameter can overflow from an arbitrary Adam state).
  const bool random_states = p.args.param_dtype != DType::Float16 && data.ConsumeBool();
  fuzz::Rng rng(data.ConsumeIntegral<uint64_t>());

  if (std::getenv("GRAPHSAFE_FUZZ_VERBOSE")) {  // describe the problem when reproducing a failure
    std::fprintf(stderr, "algorithm %d dtype %s state_bits %d block %d increment %d lr %g first_step %g skip_zeros %d\n"
                 "beta1 %g beta2 %g beta3 %g eps %g wd %g momentum %g dampening %g nesterov %d alpha %g centered %d "
                 "amsgrad %d maximize %d bias_correction %d lr_decay %g mix_alpha %g warmups %g %g trust %g\n"
                 "grad family %d scale %g zeros %d/4 non_finite %d param scale %g random_states %d numel",
                 int(o.algorithm), dtype_name(p.args.param_dtype), p.args.state_bits, p.args.block_size,
                 int(p.args.increment_steps), p.lr, first_step, int(o.skip_zeros), o.beta1, o.beta2, o.beta3, o.eps,
                 o.weight_decay, o.momentum, o.dampening, int(o.nesterov), o.alpha, int(o.centered), int(o.amsgrad),
                 int(o.maximize), int(o.bias_correction), o.lr_decay, o.mix_alpha, o.alpha_warmup, o.beta3_warmup,
                 o.trust_coefficient, family, grad_scale, zero_share, int(non_finite), param_scale, int(random_states));
    for (int64_t n : p.numel) std::fprintf(stderr, " %lld", (long long)n);
    std::fprintf(stderr, "\n");
  }

  World world(static_cast<std::size_t>(tensors));
  for (int t = 0; t < tensors; ++t) {
    Tensor& x = world[t];
    const int64_t n = p.numel[t];
    x.step = first_step;
    x.param.resize(static_cast<std::size_t>(n * p.elem_bytes));
    x.grad.resize(x.param.size());
    for (int64_t i = 0; i < n; ++i) store_param(p, x.param, i, rng.normal() * param_scale);
    x.state.resize(states);
    x.codes.resize(states);
    x.absmax.resize(states);
    for (int j = 0; j < states; ++j) {
      const bool is_signed = optim_state_is_signed(o, j);
      std::vector<float> start(static_cast<std::size_t>(n), 0.0f);
      if (random_states)
        for (auto& s : start) s = is_signed ? rng.normal() : std::fabs(rng.normal());
      if (p.args.state_bits == 8) {
        x.codes[j].resize(static_cast<std::size_t>(n));
        x.absmax[j].resize(static_cast<std::size_t>(blocks_of(p, n)));
        quantize_blockwise_cpu(start.data(), n, p.args.block_size, is_signed, x.codes[j].data(), x.absmax[j].data());
      } else if (p.args.state_bits == 16) {
        x.state[j].resize(static_cast<std::size_t>(2 * n));
        for (int64_t i = 0; i < n; ++i) {
          const uint16_t h = to_bf16(start[i]).bits;
          std::memcpy(x.state[j].data() + 2 * i, &h, 2);
        }
      } else {
        x.state[j].resize(static_cast<std::size_t>(4 * n));
        if (n > 0) std::memcpy(x.state[j].data(), start.data(), 4 * n);
      }
    }
  }

  const bool has_reference = p.args.state_bits != 8 && (o.algorithm == OptimAlgorithm::SGD ||
                                                        o.algorithm == OptimAlgorithm::Adam ||
                                                        o.algorithm == OptimAlgorithm::AdamW);
  const bool elementwise = o.algorithm != OptimAlgorithm::LAMB && o.algorithm != OptimAlgorithm::LARS;
  const bool finite_promised = p.args.param_dtype != DType::Float16 || p.args.state_bits != 8;
  for (int s = 0; s < 2; ++s) {
    bool any_zero = false, any_non_finite = false;
    std::vector<std::vector<char>> bad(static_cast<std::size_t>(tensors));
    for (int t = 0; t < tensors; ++t) {
      bad[t].assign(static_cast<std::size_t>(p.numel[t]), 0);
      for (int64_t i = 0; i < p.numel[t]; ++i) {
        float g = rng.below(4) < static_cast<uint32_t>(zero_share) ? (rng.below(2) ? 0.0f : -0.0f)
                                                                     : fuzz::make_value(rng, family, grad_scale);
        if (family == 3 && !non_finite && !std::isfinite(g)) g = 1.0f;  // raw bits: keep them finite here
        if (non_finite && rng.below(50) == 0) g = pick(data, {NAN, INFINITY, -INFINITY});
        if (!std::isfinite(g) && !non_finite) g = grad_scale;
        store_param(p, world[t].grad, i, g);
        const float stored = load_param(p, world[t].grad, i);  // fp16 may round a large value to inf
        if (!non_finite && !std::isfinite(stored)) store_param(p, world[t].grad, i, 1.0f);
        any_zero |= load_param(p, world[t].grad, i) == 0.0f;
        bad[t][i] = !std::isfinite(load_param(p, world[t].grad, i));
        any_non_finite |= bad[t][i];
      }
    }
    const World before = world;
    World separate = world;
    step(p, world, /*one_call=*/true, o.skip_zeros);
    step(p, separate, /*one_call=*/false, o.skip_zeros);
    FUZZ_CHECK(same(world, separate), "algorithm %d step %d: one call and one call per tensor differ\n",
               int(o.algorithm), s);
    if (o.skip_zeros) {
      check_skipped(p, before, world);
      if (!any_zero) {
        World plain = before;
        step(p, plain, true, false);
        FUZZ_CHECK(same(world, plain), "algorithm %d step %d: skip_zeros without zeros differs from skip_zeros off\n",
                   int(o.algorithm), s);
      }
    }
    if (finite_promised && moderate(p, before)) check_finite(p, world);
    if (has_reference && moderate(p, before)) check_reference(p, before, world);
    if (any_non_finite && elementwise) {
      // The same step with the non-finite gradients replaced by 0 (skip_zeros then skips them; without it they
      // take an ordinary step): every other element must come out bit-identical.
      World clean = before;
      for (int t = 0; t < tensors; ++t)
        for (int64_t i = 0; i < p.numel[t]; ++i)
          if (bad[t][i]) store_param(p, clean[t].grad, i, 0.0f);
      step(p, clean, true, o.skip_zeros);
      for (int t = 0; t < tensors; ++t)
        for (int64_t i = 0; i < p.numel[t]; ++i) {
          if (bad[t][i]) continue;
          FUZZ_CHECK(fuzz::same_bytes(clean[t].param.data() + p.elem_bytes * i, world[t].param.data() + p.elem_bytes * i,
                                 p.elem_bytes),
                     "algorithm %d tensor %d element %lld: a neighbour's non-finite gradient changed this parameter\n",
                     int(o.algorithm), t, (long long)i);
          const int bytes = p.args.state_bits / 8;
          for (int j = 0; j < states; ++j)
            FUZZ_CHECK(fuzz::same_bytes(clean[t].state[j].data() + bytes * i, world[t].state[j].data() + bytes * i,
                                   bytes),
                       "algorithm %d tensor %d element %lld state %d: a neighbour's non-finite gradient changed it\n",
                       int(o.algorithm), t, (long long)i, j);
        }
    }
  }
  return 0;
}
