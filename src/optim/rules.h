// The update rules, written once for both backends (include/graphsafe/optim.h describes the contract).
//
// Each rule works on one element: the raw gradient g, the parameter p and the fp32 states s[], as floats.
// The CPU backend loops over elements; the CUDA backend calls the same functions from its kernels.
// Formulas follow torch.optim where torch has the algorithm (same operations in the same order, and the
// same fp32 constants: torch forms 1 - beta, lr / bias_correction, ... in double and rounds once; so does
// `coefficients`), and the papers otherwise. docs/optim.md writes them out. One exception: the CUDA 8-bit
// element-wise kernels take square roots and quotients the GPU's approximate way (FastMath below).
#pragma once

#include <cmath>

#include "common/numeric.h"
#include "graphsafe/optim.h"

namespace graphsafe::optim_detail {

#if defined(__CUDA_ARCH__)
GS_HD float sqrt_f(float x) { return sqrtf(x); }
GS_HD double pow_d(double x, double y) { return pow(x, y); }
GS_HD double exp_d(double x) { return exp(x); }
GS_HD double log_d(double x) { return log(x); }
GS_HD double sqrt_d(double x) { return sqrt(x); }
#else
GS_HD float sqrt_f(float x) { return std::sqrt(x); }
GS_HD double pow_d(double x, double y) { return std::pow(x, y); }
GS_HD double exp_d(double x) { return std::exp(x); }
GS_HD double log_d(double x) { return std::log(x); }
GS_HD double sqrt_d(double x) { return std::sqrt(x); }
#endif

GS_HD float max_f(float a, float b) { return (a != a || a > b) ? a : b; }  // NaN propagates, as torch.maximum
GS_HD double min_d(double a, double b) { return a < b ? a : b; }
GS_HD float sign_f(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }

// How a rule takes square roots and quotients.
// ExactMath: IEEE square root and division, torch's numerics. The fp32-state kernels and the CPU backend use it.
// FastMath: the CUDA 8-bit element-wise kernels, which are instruction-bound (an IEEE square root and
//   division take about 10 instructions each, with a branch to a slow path; these take 1 to 4). On the GPU:
//   the approximate square root (sqrt.approx.ftz.f32, relative error within 2^-23; a subnormal input counts as 0,
//   see fast_math_applies), quotients
//   as a times the approximate reciprocal of b (rcp.approx.ftz.f32, within 1 ulp; b and 1 / b must be normal
//   floats, or b infinite: every divisor of the rules below is at least eps and at most eps + 1.8e27 (the
//   square root of a float, times at most 1 / sqrt(2^-53)) or infinite, and the kernels take FastMath only for
//   eps in [FLT_MIN, 1e30], fast_math_applies), and a division by a per-tensor constant as a multiply by its inverse (formed in
//   double). So CUDA's 8-bit steps differ from the CPU's by a few fp32 ulps of each update, well inside one
//   quantisation step; each backend stays bitwise repeatable. On the host FastMath is ExactMath (the CPU
//   backend's bits, and CI's emulation of the kernels, are those of the exact rules).
//   A product (or a division by a constant) and a sum are one fused multiply-add there: one rounding instead of
//   two, and one instruction. ExactMath's four forms are the plain expressions, operands in the order written
//   (the rules keep torch's; on the CPU the order picks which NaN's payload a sum of two NaNs keeps).
struct ExactMath {
  static GS_HD float sqrt(float x) { return sqrt_f(x); }
  static GS_HD float divide(float a, float b) { return a / b; }
  static GS_HD float divide_by_constant(float a, float b, float /*inverse_b*/) { return a / b; }
  static GS_HD float multiply_add(float a, float b, float c) { return a * b + c; }
  static GS_HD float add_product(float c, float a, float b) { return c + a * b; }
  static GS_HD float subtract_product(float c, float a, float b) { return c - a * b; }
  static GS_HD float divide_by_constant_add(float a, float b, float /*inverse_b*/, float c) { return a / b + c; }
};

#if defined(__CUDA_ARCH__)
struct FastMath {
  static __device__ float sqrt(float x) {
    float r;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
  }
  static __device__ float divide(float a, float b) {
    float inverse;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inverse) : "f"(b));
    return a * inverse;
  }
  static __device__ float divide_by_constant(float a, float /*b*/, float inverse_b) { return a * inverse_b; }
  static __device__ float multiply_add(float a, float b, float c) { return __fmaf_rn(a, b, c); }
  static __device__ float add_product(float c, float a, float b) { return __fmaf_rn(a, b, c); }
  static __device__ float subtract_product(float c, float a, float b) { return __fmaf_rn(-a, b, c); }
  static __device__ float divide_by_constant_add(float a, float /*b*/, float inverse_b, float c) {
    return __fmaf_rn(a, inverse_b, c);
  }
};
#else
struct FastMath : ExactMath {};
#endif

// Whether FastMath may serve a step with these options. Its reciprocal flushes subnormal inputs and results,
// so the divisors (in [eps, eps + 1.8e27], or infinite) must stay between FLT_MIN and 2^126. Its square root
// takes a subnormal input (a second moment below 2^-126) as 0: every root is divided by a bias correction (or
// by 1) and then added to eps, so that drops less than 2^-63 times the largest inverse bias correction,
// 1 / sqrt(1 - beta2) (Adam, AdamW and AdEMAMix at their first step); that must stay below 2^-25 of eps, at most
// half an ulp of the sum it is added to whatever eps's mantissa (eps >= 1.2e-10 with beta2 = 0.999, 1.2e-9 with
// beta2 = 0.99999, 3.6e-12 without bias correction).
GS_HD bool fast_math_applies(const OptimOptions& o) {
  if (!(o.eps >= 1.1754943508222875e-38 && o.eps <= 1e30)) return false;
  const bool bias_corrected = o.algorithm == OptimAlgorithm::Adam || o.algorithm == OptimAlgorithm::AdamW ||
                              o.algorithm == OptimAlgorithm::AdEMAMix;
  const double largest_inverse_correction = bias_corrected ? 1.0 / sqrt_d(1.0 - o.beta2) : 1.0;
  return 1.0842021724855044e-19 * largest_inverse_correction <= o.eps * 2.9802322387695312e-08;  // 2^-63, 2^-25
}

// torch.lerp's formula (two forms, for accuracy near either end): self + weight * (end - self) below 0.5,
// else end - (end - self) * (1 - weight), written as end + (end - self) * -(1 - weight) (the same bits: IEEE
// negation is exact) so that the forms differ only in a start and a factor that depend on weight alone, which
// the CUDA kernels choose once per tensor instead of computing both forms per element.
template <class Math = ExactMath>
GS_HD float lerp(float self, float end, float weight) {
  const bool low = weight < 0.5f;
  return Math::add_product(low ? self : end, end - self, low ? weight : -(1.0f - weight));
}

// skip_zeros tests the raw gradient element: +0.0 and -0.0 are skipped, NaN is not.
GS_HD bool skipped(const OptimOptions& o, float raw_grad) { return o.skip_zeros && raw_grad == 0.0f; }

// The fp32 constants of one parameter's step, formed in double from the options, lr and its step number.
struct Coefficients {
  float lr, step;
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float eps, weight_decay, momentum, one_minus_dampening, alpha, one_minus_alpha, trust_coefficient;
  float decay_factor;           // 1 - lr * weight_decay (decoupled decay)
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction1;       // 1 - beta1^step
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float inverse_bias_correction1, inverse_bias_correction2_sqrt;  // their inverses (FastMath divides by them)
  float neg_adagrad_lr;         // -lr / (1 + (step - 1) * lr_decay)
  float mix_alpha;              // AdEMAMix alpha after warm-up
  float beta3, one_minus_beta3; // AdEMAMix beta3 after warm-up
  // An algorithm with a schedule (the table's per-tensor values, advance_schedule):
  float schedule_weight;        // what advance_schedule returned for the tensor
  float neg_scheduled_lr;       // -lr after warm-up (scheduled_lr)
  float y_step;                 // Schedule-Free AdamW: scheduled lr * (beta1 * (1 - schedule_weight) - 1)
  float bias_correction2;       // 1 - beta2^step
};

// The learning rate of step `step` after a linear warm-up over warmup_steps steps (Schedule-Free AdamW's, as
// the schedulefree package forms it: lr * (step / warmup_steps) while step - 1 < warmup_steps).
GS_HD double scheduled_lr(const OptimOptions& o, double lr, double step) {
  return step - 1.0 < o.warmup_steps ? lr * (step / o.warmup_steps) : lr;
}

// schedule_weight: the tensor's value from advance_schedule (0 for an algorithm without a schedule).
GS_HD Coefficients coefficients(const OptimOptions& o, float lr_value, float step_value, double schedule_weight = 0.0) {
  const double lr = lr_value, step = step_value;
  Coefficients k{};
  k.lr = lr_value;
  k.step = step_value;
  // First, so that schedule_weight is not kept alive through the rest (the measuring pass of the 8-bit LAMB
  // kernel went from 48 to 62 registers when these came last).
  k.schedule_weight = static_cast<float>(schedule_weight);
  if (o.algorithm == OptimAlgorithm::AdamWScheduleFree) {
    const double lr_t = scheduled_lr(o, lr, step);
    k.neg_scheduled_lr = static_cast<float>(-lr_t);
    k.y_step = static_cast<float>(lr_t * (o.beta1 * (1.0 - schedule_weight) - 1.0));
    k.bias_correction2 = static_cast<float>(1.0 - pow_d(o.beta2, step));
  }
  k.beta1 = static_cast<float>(o.beta1);
  k.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  k.beta2 = static_cast<float>(o.beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  k.eps = static_cast<float>(o.eps);
  k.weight_decay = static_cast<float>(o.weight_decay);
  k.momentum = static_cast<float>(o.momentum);
  k.one_minus_dampening = static_cast<float>(1.0 - o.dampening);
  k.alpha = static_cast<float>(o.alpha);
  k.one_minus_alpha = static_cast<float>(1.0 - o.alpha);
  k.trust_coefficient = static_cast<float>(o.trust_coefficient);
  k.decay_factor = static_cast<float>(1.0 - lr * o.weight_decay);
  const bool corrected = o.algorithm != OptimAlgorithm::LAMB || o.bias_correction;
  const double bc1 = corrected ? 1.0 - pow_d(o.beta1, step) : 1.0;
  const double bc2 = corrected ? 1.0 - pow_d(o.beta2, step) : 1.0;
  k.bias_correction1 = static_cast<float>(bc1);
  k.bias_correction2_sqrt = static_cast<float>(sqrt_d(bc2));
  k.inverse_bias_correction1 = static_cast<float>(1.0 / bc1);
  k.inverse_bias_correction2_sqrt = static_cast<float>(1.0 / sqrt_d(bc2));
  k.neg_step_size = static_cast<float>(-(lr / bc1));
  k.neg_adagrad_lr = static_cast<float>(-(lr / (1.0 + (step - 1.0) * o.lr_decay)));
  // AdEMAMix (Pagliardini et al. 2024, Algorithm 1): alpha rises linearly over T_alpha steps; beta3 rises
  // from beta1 so that the slow EMA's half-life grows linearly over T_beta3 steps.
  k.mix_alpha = static_cast<float>(o.alpha_warmup > 0.0 ? min_d(step * o.mix_alpha / o.alpha_warmup, o.mix_alpha)
                                                         : o.mix_alpha);
  double beta3 = o.beta3;
  if (o.beta3_warmup > 0.0) {
    const double t = min_d(step / o.beta3_warmup, 1.0);
    const double log_start = log_d(o.beta1), log_end = log_d(o.beta3);
    beta3 = min_d(exp_d(log_start * log_end / ((1.0 - t) * log_end + t * log_start)), o.beta3);
  }
  k.beta3 = static_cast<float>(beta3);
  k.one_minus_beta3 = static_cast<float>(1.0 - beta3);
  return k;
}

// ---- Schedules: per-tensor float64 values (the table's `schedule`) advanced once per tensor and step, before
// its update; the backends load them into v[], call advance_schedule and store them back. ----

// Schedule-Free AdamW's weight of the running average x (the schedulefree package's AdamWScheduleFree, with the
// group's sums kept per tensor): v[0] = weight_sum, v[1] = lr_max (0 before the first step, where the package
// starts at -1: the same maximum, as lr >= 0). Returns c = weight / weight_sum, 0 while the sum is 0.
GS_HD double schedule_free_advance(const OptimOptions& o, float lr, float step, double* v) {
  const double lr_t = scheduled_lr(o, lr, step);
  const double lr_max = v[1] < lr_t ? lr_t : v[1];
  const double weight = pow_d(static_cast<double>(step), o.r) * pow_d(lr_max, o.weight_lr_power);
  const double weight_sum = v[0] + weight;
  v[0] = weight_sum;
  v[1] = lr_max;
  return weight_sum != 0.0 ? weight / weight_sum : 0.0;
}

// Advances the algorithm's schedule values for step number `step` (after its increment) and returns what its
// rule reads as Coefficients::schedule_weight; 0, touching nothing, for an algorithm without a schedule.
GS_HD double advance_schedule(const OptimOptions& o, float lr, float step, double* v) {
  if (o.algorithm == OptimAlgorithm::AdamWScheduleFree) return schedule_free_advance(o, lr, step, v);
  return 0.0;
}

// advance_schedule on one tensor's values where they live (values[j]: the address of value j).
GS_HD double advance_schedule_at(const OptimOptions& o, float lr, float step, double* const* values, int size) {
  double v[kMaxScheduleValues] = {};
  for (int j = 0; j < size; ++j) v[j] = *values[j];
  const double weight = advance_schedule(o, lr, step, v);
  for (int j = 0; j < size; ++j) *values[j] = v[j];
  return weight;
}

// ---- Element-wise rules (all but LAMB and LARS). s[] holds optim_state_count() states. ----

template <class Math>
GS_HD void adam(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s, bool decoupled) {
  if (o.maximize) g = -g;
  // Decoupled decay multiplies by 1 - lr * weight_decay even without decay, where that is exactly 1 and p * 1 is p
  // (a NaN p stays NaN): no test of weight_decay per element in the instruction-bound 8-bit kernels. (Only an
  // infinite lr tells: 1 - inf * 0 is NaN, so p becomes NaN where torch, which skips the multiply, gives +-inf.)
  if (decoupled) p = p * k.decay_factor;
  else if (o.weight_decay != 0.0) g = g + k.weight_decay * p;
  const float m = lerp<Math>(s[0], g, k.one_minus_beta1);
  const float v = Math::multiply_add(s[1], k.beta2, k.one_minus_beta2 * (g * g));
  float v_used = v;
  if (o.amsgrad) {
    s[2] = max_f(s[2], v);
    v_used = s[2];
  }
  const float denom = Math::divide_by_constant_add(Math::sqrt(v_used), k.bias_correction2_sqrt,
                                                    k.inverse_bias_correction2_sqrt, k.eps);
  p = Math::add_product(p, k.neg_step_size, Math::divide(m, denom));
  s[0] = m;
  s[1] = v;
}

GS_HD void sgd(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
  if (o.maximize) g = -g;
  if (o.weight_decay != 0.0) g = g + k.weight_decay * p;
  if (o.momentum != 0.0) {
    // torch starts the buffer as a copy of the parameter's first gradient.
    const float buf = k.step == 1.0f ? g : s[0] * k.momentum + k.one_minus_dampening * g;
    s[0] = buf;
    g = o.nesterov ? g + k.momentum * buf : buf;
  }
  p = p + (-k.lr) * g;
}

// Centered, the variance estimate square_avg - grad_avg^2 is >= 0 as long as square_avg >= grad_avg^2 (an
// average of g^2 is at least the square of the average of g). fp32 states keep that up to rounding; states
// rounded to 8 bits one by one need not, and the square root then turned NaN (and, through the absmax, its
// whole block). So the stored square_avg is taken as at least grad_avg^2, and the estimate as at least 0.
// For fp32 states both only act where rounding broke the invariant (where torch's square root may give NaN).
template <class Math>
GS_HD void rmsprop(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
  if (o.maximize) g = -g;
  if (o.weight_decay != 0.0) g = g + k.weight_decay * p;
  const float previous_square_avg = o.centered ? max_f(s[0], s[1] * s[1]) : s[0];
  const float square_avg = Math::multiply_add(previous_square_avg, k.alpha, k.one_minus_alpha * (g * g));
  s[0] = square_avg;
  float avg;
  if (o.centered) {
    const float grad_avg = lerp<Math>(s[1], g, k.one_minus_alpha);
    s[1] = grad_avg;
    avg = Math::sqrt(max_f(square_avg + (-1.0f) * (grad_avg * grad_avg), 0.0f)) + k.eps;
  } else {
    avg = Math::sqrt(square_avg) + k.eps;
  }
  if (o.momentum > 0.0) {
    // The buffer is s[2] when centered, else s[1]; constant indices keep s[] in registers in the CUDA kernels.
    const float buf = Math::multiply_add(o.centered ? s[2] : s[1], k.momentum, Math::divide(g, avg));
    if (o.centered) s[2] = buf;
    else s[1] = buf;
    p = Math::add_product(p, -k.lr, buf);
  } else {
    p = Math::add_product(p, -k.lr, Math::divide(g, avg));
  }
}

template <class Math>
GS_HD void adagrad(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
  if (o.maximize) g = -g;
  if (o.weight_decay != 0.0) g = g + k.weight_decay * p;
  const float sum = Math::add_product(s[0], g, g);
  s[0] = sum;
  p = Math::add_product(p, k.neg_adagrad_lr, Math::divide(g, Math::sqrt(sum) + k.eps));
}

// Lion (Chen et al. 2023, Algorithm 2): the sign of an interpolation, decoupled weight decay.
GS_HD void lion(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
  if (o.maximize) g = -g;
  const float m = s[0];
  const float c = k.beta1 * m + k.one_minus_beta1 * g;
  p = p * k.decay_factor;
  p = p - k.lr * sign_f(c);
  s[0] = k.beta2 * m + k.one_minus_beta2 * g;
}

// AdEMAMix (Pagliardini et al. 2024, Algorithm 1): a fast and a slow EMA of the gradient, mixed by alpha.
template <class Math>
GS_HD void ademamix(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
  if (o.maximize) g = -g;
  const float m1 = Math::multiply_add(k.beta1, s[0], k.one_minus_beta1 * g);
  const float m2 = Math::multiply_add(k.beta3, s[1], k.one_minus_beta3 * g);
  const float v = Math::multiply_add(k.beta2, s[2], k.one_minus_beta2 * (g * g));
  const float denom = Math::divide_by_constant_add(Math::sqrt(v), k.bias_correction2_sqrt,
                                                    k.inverse_bias_correction2_sqrt, k.eps);
  const float update = Math::divide(
      Math::add_product(Math::divide_by_constant(m1, k.bias_correction1, k.inverse_bias_correction1), k.mix_alpha, m2),
      denom);
  p = Math::subtract_product(p, k.lr, Math::add_product(update, k.weight_decay, p));
  s[0] = m1;
  s[1] = m2;
  s[2] = v;
}

// Schedule-Free AdamW (Defazio et al. 2024, "The Road Less Scheduled"; the schedulefree package's
// AdamWScheduleFree): the parameter holds y, where the gradient is taken; s[0] = z, the base iterate (it starts
// as the parameter); s[1] = v, the second moment. x, the average the model is evaluated at, is not stored: the
// optimizer's eval() and train() move the parameter between y and x (python/graphsafe/optim/algorithms.py).
// c = k.schedule_weight. Weight decay is taken at y, as the package does.
template <class Math>
GS_HD void adamw_schedule_free(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
  if (o.maximize) g = -g;
  const float v = Math::multiply_add(s[1], k.beta2, k.one_minus_beta2 * (g * g));
  float u = Math::divide(g, Math::sqrt(v / k.bias_correction2) + k.eps);
  if (o.weight_decay != 0.0) u = u + k.weight_decay * p;
  const float z = s[0];
  p = Math::add_product(lerp<Math>(p, z, k.schedule_weight), k.y_step, u);  // y = lerp(y, z, c) + y_step * u
  s[0] = Math::add_product(z, k.neg_scheduled_lr, u);                       // z = z - lr * u
  s[1] = v;
}

// One element of element-wise algorithm A. A is a template argument so that a kernel's element loop holds
// one algorithm's arithmetic without branches between elements (the 8-bit kernels are instruction-bound).
template <OptimAlgorithm A, class Math = ExactMath>
GS_HD void elementwise_rule(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
  if constexpr (A == OptimAlgorithm::Adam) adam<Math>(o, k, g, p, s, false);
  else if constexpr (A == OptimAlgorithm::AdamW) adam<Math>(o, k, g, p, s, true);
  else if constexpr (A == OptimAlgorithm::SGD) sgd(o, k, g, p, s);
  else if constexpr (A == OptimAlgorithm::RMSprop) rmsprop<Math>(o, k, g, p, s);
  else if constexpr (A == OptimAlgorithm::Adagrad) adagrad<Math>(o, k, g, p, s);
  else if constexpr (A == OptimAlgorithm::Lion) lion(o, k, g, p, s);
  else if constexpr (A == OptimAlgorithm::AdEMAMix) ademamix<Math>(o, k, g, p, s);
  else if constexpr (A == OptimAlgorithm::AdamWScheduleFree) adamw_schedule_free<Math>(o, k, g, p, s);
  else static_assert(A == OptimAlgorithm::AdEMAMix, "LAMB and LARS use the layer-wise rules below");
}

// (The switches here and in can_keep_states are device code, which cannot read the algorithm table at run time;
// src/optim/common.cpp checks them against it at compile time.)
GS_HD constexpr bool is_layerwise(OptimAlgorithm a) { return a == OptimAlgorithm::LAMB || a == OptimAlgorithm::LARS; }

// Whether every state of algorithm a may be stored in 8 bits (the CUDA backend builds 8-bit kernels only for these).
GS_HD constexpr bool quantizable(OptimAlgorithm a) { return a != OptimAlgorithm::AdamWScheduleFree; }

// How many schedule values algorithm a keeps per tensor (advance_schedule).
GS_HD constexpr int schedule_size(OptimAlgorithm a) { return a == OptimAlgorithm::AdamWScheduleFree ? 2 : 0; }

// Whether element-wise algorithm a takes square roots and quotients (so that a Math choice changes its code).
GS_HD constexpr bool takes_roots(OptimAlgorithm a) { return a != OptimAlgorithm::SGD && a != OptimAlgorithm::Lion; }

// The one switch over algorithms: calls f(AlgorithmTag<a>{}), so f can pick a rule at compile time.
template <OptimAlgorithm A>
struct AlgorithmTag {
  static constexpr OptimAlgorithm value = A;
};

template <class F>
GS_HD void with_algorithm(OptimAlgorithm a, F&& f) {
  using A = OptimAlgorithm;
  switch (a) {
    case A::Adam: f(AlgorithmTag<A::Adam>{}); break;
    case A::AdamW: f(AlgorithmTag<A::AdamW>{}); break;
    case A::SGD: f(AlgorithmTag<A::SGD>{}); break;
    case A::RMSprop: f(AlgorithmTag<A::RMSprop>{}); break;
    case A::Adagrad: f(AlgorithmTag<A::Adagrad>{}); break;
    case A::Lion: f(AlgorithmTag<A::Lion>{}); break;
    case A::LAMB: f(AlgorithmTag<A::LAMB>{}); break;
    case A::LARS: f(AlgorithmTag<A::LARS>{}); break;
    case A::AdEMAMix: f(AlgorithmTag<A::AdEMAMix>{}); break;
    case A::AdamWScheduleFree: f(AlgorithmTag<A::AdamWScheduleFree>{}); break;
  }
}

// Any element-wise algorithm with (Scheduled) or without a schedule, chosen per element at run time. The fp32-state
// kernels use this form: they are memory-bound, and the switch keeps them at 46 registers (5 blocks per SM); with
// one algorithm inlined per loop they took 60-80 registers and AdamW at 64M parameters went from 0.50 to 0.73 ms on
// the H200. The algorithms with a schedule (Schedule-Free AdamW) have kernels of their own: in the one kernel for
// all, their code made the others' loop slower (docs/benchmarks.md, the optim run of 2026-12-02).
template <bool Scheduled>
GS_HD void elementwise_step(const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
  if (skipped(o, g)) return;
  with_algorithm(o.algorithm, [&](auto algorithm) {
    constexpr OptimAlgorithm A = decltype(algorithm)::value;
    // LAMB, LARS: layer-wise rules below
    if constexpr (!is_layerwise(A) && (schedule_size(A) > 0) == Scheduled) elementwise_rule<A>(o, k, g, p, s);
  });
}

// ---- Layer-wise rules: pass 1 gathers squared norms per tensor, pass 2 applies the update. ----

struct SquaredNorms {
  float param;   // sum of p^2 over the tensor
  float update;  // LAMB: sum of u^2 over non-skipped elements; LARS: sum of g^2 over non-skipped elements
};

GS_HD float lamb_direction(const Coefficients& k, float m, float v, float p) {
  return (m / k.bias_correction1) / (sqrt_f(v) / k.bias_correction2_sqrt + k.eps) + k.weight_decay * p;
}

// LAMB's new moments from the stored ones (g already sign-adjusted for maximize).
GS_HD void lamb_moments(const Coefficients& k, float g, const float* s, float& m, float& v) {
  m = k.beta1 * s[0] + k.one_minus_beta1 * g;
  v = k.beta2 * s[1] + k.one_minus_beta2 * (g * g);
}

// Pass 1 for one element; it writes nothing. LAMB (You et al. 2019, Algorithm 2) measures the update
// direction u formed from the new moments, including the decoupled weight decay; LARS (You et al. 2017)
// measures the gradient. A skipped element adds only its parameter to the norms.
template <OptimAlgorithm A>
GS_HD SquaredNorms layerwise_measure(const OptimOptions& o, const Coefficients& k, float g, float p, const float* s) {
  static_assert(A == OptimAlgorithm::LAMB || A == OptimAlgorithm::LARS, "a layer-wise algorithm");
  if (skipped(o, g)) return {p * p, 0.0f};
  if (o.maximize) g = -g;
  if constexpr (A == OptimAlgorithm::LARS) return {p * p, g * g};
  float m, v;
  lamb_moments(k, g, s, m, v);
  const float u = lamb_direction(k, m, v, p);
  return {p * p, u * u};
}

// The per-tensor factor of pass 2: LAMB's trust ratio ||p|| / ||u||, LARS's local learning rate
// eta * ||w|| / (||g|| + wd * ||w|| + eps); 1 when a norm is zero.
GS_HD float layerwise_factor(const OptimOptions& o, const Coefficients& k, SquaredNorms n) {
  const float param_norm = sqrt_f(n.param), other_norm = sqrt_f(n.update);
  if (!(param_norm > 0.0f && other_norm > 0.0f)) return 1.0f;
  if (o.algorithm == OptimAlgorithm::LAMB) return param_norm / other_norm;
  return k.trust_coefficient * param_norm / (other_norm + k.weight_decay * param_norm + k.eps);
}

// Pass 2 for one element; skipped elements are left untouched. LAMB forms the same new moments pass 1
// measured (from the same stored ones), stores them and takes p -= lr * ratio * u; so pass 1 writes
// nothing, and with 8-bit states pass 2 updates with the fp32 moments pass 1 measured, not with requantised
// ones (those could round a second moment to 0 and take a step of m / eps).
// LARS: v = momentum * v + lr * local_lr * (g + wd * p); p -= v.
template <OptimAlgorithm A>
GS_HD void layerwise_apply(const OptimOptions& o, const Coefficients& k, float factor, float g, float& p, float* s) {
  static_assert(A == OptimAlgorithm::LAMB || A == OptimAlgorithm::LARS, "a layer-wise algorithm");
  if (skipped(o, g)) return;
  if (o.maximize) g = -g;
  if constexpr (A == OptimAlgorithm::LAMB) {
    float m, v;
    lamb_moments(k, g, s, m, v);
    s[0] = m;
    s[1] = v;
    p = p - k.lr * factor * lamb_direction(k, m, v, p);
  } else {
    const float v = k.momentum * s[0] + k.lr * factor * (g + k.weight_decay * p);
    s[0] = v;
    p = p - v;
  }
}

// Whether algorithm a can keep `states` states (optim_state_count, over its options).
GS_HD constexpr bool can_keep_states(OptimAlgorithm a, int states) {
  switch (a) {
    case OptimAlgorithm::Adam:
    case OptimAlgorithm::AdamW: return states == 2 || states == 3;  // amsgrad adds one
    case OptimAlgorithm::SGD: return states <= 1;                      // momentum buffer or none
    case OptimAlgorithm::RMSprop: return states >= 1 && states <= 3;   // centered and momentum add one each
    case OptimAlgorithm::LAMB: return states == 2;
    case OptimAlgorithm::AdEMAMix: return states == 3;
    case OptimAlgorithm::AdamWScheduleFree: return states == 2;
    default: return states == 1;                                       // Adagrad, Lion, LARS
  }
}

// The element-wise (or layer-wise) algorithms that can keep States states: a kernel instantiated for States
// states dispatches only among these, each with its own element loop. f receives AlgorithmTag<A>{}. The CUDA
// backend also dispatches with these on the host (one 8-bit kernel per algorithm), so f may be host-only: the
// pragma tells nvcc not to check a host f called from this host-and-device code.
template <int States, bool Layerwise, class F>
struct AlgorithmsKeeping {
  F& f;
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
  template <class Tag>
  GS_HD void operator()(Tag algorithm) const {
    if constexpr (is_layerwise(Tag::value) == Layerwise && can_keep_states(Tag::value, States)) f(algorithm);
  }
};

template <int States, class F>
GS_HD void with_elementwise_algorithm(OptimAlgorithm a, F&& f) {
  with_algorithm(a, AlgorithmsKeeping<States, false, F>{f});
}

template <int States, class F>
GS_HD void with_layerwise_algorithm(OptimAlgorithm a, F&& f) {
  with_algorithm(a, AlgorithmsKeeping<States, true, F>{f});
}

}  // namespace graphsafe::optim_detail
