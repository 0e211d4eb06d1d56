// The optimizer core through its C++ API: skip_zeros leaves skipped elements bit-identical for every
// algorithm, repeated runs agree bitwise, (with a GPU) the CUDA backend matches the CPU backend, and LAMB/LARS's
// two phases on shards (optim_layerwise_norms_cpu, OptimStepArgs::layerwise_norms) give the plain step's bits.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <random>
#include <vector>

#include "graphsafe/errors.h"
#include "graphsafe/optim.h"
#include "emulation/layerwise_problem.h"
#include "optim/blockwise.h"
#include "optim/layout.h"
#include "optim/rules.h"

#if defined(GRAPHSAFE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace graphsafe;

namespace {

const OptimAlgorithm kAll[] = {OptimAlgorithm::Adam,    OptimAlgorithm::AdamW,   OptimAlgorithm::SGD,
                               OptimAlgorithm::RMSprop, OptimAlgorithm::Adagrad, OptimAlgorithm::Lion,
                               OptimAlgorithm::LAMB,    OptimAlgorithm::LARS,    OptimAlgorithm::AdEMAMix,
                               OptimAlgorithm::AdamWScheduleFree};
static_assert(sizeof(kAll) / sizeof(kAll[0]) == kOptimAlgorithmCount, "kAll lists every algorithm of the table");

OptimOptions options_for(OptimAlgorithm a, bool skip_zeros) {
  OptimOptions o;
  o.algorithm = a;
  o.weight_decay = 0.1;
  o.momentum = (a == OptimAlgorithm::SGD || a == OptimAlgorithm::RMSprop || a == OptimAlgorithm::LARS) ? 0.9 : 0.0;
  o.centered = a == OptimAlgorithm::RMSprop;
  o.amsgrad = a == OptimAlgorithm::Adam;
  o.alpha_warmup = o.beta3_warmup = a == OptimAlgorithm::AdEMAMix ? 10.0 : 0.0;
  o.skip_zeros = skip_zeros;
  return o;
}

// A float32 problem: one tensor, its states, and a gradient per step with zeros at every third element.
struct OptimRun {
  std::vector<float> param, lr{0.01f}, step{0.0f};
  std::vector<std::vector<float>> states;
  std::vector<double> schedule = std::vector<double>(kMaxScheduleValues, 0.0);
};

// core_increments: the step adds 1 to the step count itself (OptimStepArgs::increment_steps) instead of
// the caller.
OptimRun run_cpu(OptimAlgorithm a, bool skip_zeros, int steps, int64_t n, bool core_increments = false) {
  const OptimOptions o = options_for(a, skip_zeros);
  OptimRun r;
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  r.param.resize(n);
  for (auto& p : r.param) p = normal(rng);
  r.states.assign(optim_state_count(o), std::vector<float>(n, 0.0f));
  std::vector<float> grad(n);
  std::vector<unsigned char> ws(optim_workspace_bytes(Backend::Cpu, o, &n, 1));
  for (int s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < n; ++i) grad[i] = i % 3 == 0 ? (s % 2 ? -0.0f : 0.0f) : normal(rng);
    if (!core_increments) r.step[0] += 1.0f;
    OptimTensor t;
    t.param = r.param.data();
    t.grad = grad.data();
    for (std::size_t j = 0; j < r.states.size(); ++j) t.state[j] = r.states[j].data();
    t.step = r.step.data();
    for (int j = 0; j < kMaxScheduleValues; ++j) t.schedule[j] = &r.schedule[j];
    t.numel = n;
    OptimStepArgs args;
    args.options = o;
    args.lr = r.lr.data();
    args.increment_steps = core_increments;
    optim_step_cpu(args, &t, 1, ws.data(), ws.size());
  }
  return r;
}

uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// Whether every state of algorithm a may be stored in state_bits bits (the table's storage widths).
bool stores_in(OptimAlgorithm a, int state_bits) {
  const uint8_t width = state_bits == 32 ? kStorage32 : state_bits == 16 ? kStorage16 : kStorage8;
  for (const OptimStateSpec& s : optim_algorithm_spec(a).states)
    if ((s.storage & width) == 0) return false;
  return true;
}

}  // namespace

TEST(OptimCpu, SkipZerosKeepsSkippedElementsBitIdentical) {
  for (OptimAlgorithm a : kAll) {
    const OptimRun before = run_cpu(a, true, 0, 1000);
    const OptimRun after = run_cpu(a, true, 7, 1000);
    const OptimRun unskipped = run_cpu(a, false, 7, 1000);
    int changed = 0;
    for (int64_t i = 0; i < 1000; ++i) {
      if (i % 3 == 0) {
        ASSERT_EQ(bits(after.param[i]), bits(before.param[i])) << "algorithm " << int(a) << " element " << i;
        for (std::size_t j = 0; j < after.states.size(); ++j)
          ASSERT_EQ(bits(after.states[j][i]), 0u) << "algorithm " << int(a) << " state " << j;
      } else {
        changed += after.param[i] != before.param[i];
      }
    }
    EXPECT_GT(changed, 600) << "algorithm " << int(a) << ": the other elements must move";
    // Without skip_zeros, weight decay moves the zero-gradient elements too.
    int decayed = 0;
    for (int64_t i = 0; i < 1000; i += 3) decayed += unskipped.param[i] != before.param[i];
    EXPECT_GT(decayed, 300) << "algorithm " << int(a);
  }
}

TEST(OptimCpu, IncrementStepsEqualsTheCallerIncrementing) {
  for (OptimAlgorithm a : kAll) {
    const OptimRun caller = run_cpu(a, true, 4, 5000), core = run_cpu(a, true, 4, 5000, true);
    EXPECT_EQ(core.step[0], 4.0f) << int(a);
    EXPECT_EQ(std::memcmp(caller.param.data(), core.param.data(), caller.param.size() * 4), 0) << int(a);
  }
}

TEST(OptimCpu, RepeatsBitwise) {
  for (OptimAlgorithm a : kAll) {
    const OptimRun x = run_cpu(a, false, 5, 9000), y = run_cpu(a, false, 5, 9000);  // > 2 norm chunks
    EXPECT_EQ(std::memcmp(x.param.data(), y.param.data(), x.param.size() * 4), 0) << int(a);
  }
}

// The kernels dispatch the algorithm among those that keep their States count (rules.h); an algorithm or
// option that changed its state count without updating the dispatch would silently skip the update.
template <int States>
int dispatched(const OptimOptions& o) {
  int calls = 0;
  optim_detail::with_elementwise_algorithm<States>(o.algorithm, [&](auto) { ++calls; });
  optim_detail::with_layerwise_algorithm<States>(o.algorithm, [&](auto) { ++calls; });
  return calls;
}

TEST(OptimCpu, EveryAlgorithmAndStateCountIsDispatchedOnce) {
  for (OptimAlgorithm a : kAll)
    for (int variant = 0; variant < 8; ++variant) {
      OptimOptions o;
      o.algorithm = a;
      o.amsgrad = variant & 1;
      o.centered = variant & 2;
      o.momentum = variant & 4 ? 0.9 : 0.0;
      int calls = -1;
      switch (optim_state_count(o)) {
        case 0: calls = dispatched<0>(o); break;
        case 1: calls = dispatched<1>(o); break;
        case 2: calls = dispatched<2>(o); break;
        case 3: calls = dispatched<3>(o); break;
      }
      EXPECT_EQ(calls, 1) << "algorithm " << int(a) << " variant " << variant;
    }
}

// FastMath's square root takes a subnormal second moment as 0: fast_math_applies admits eps only where what that
// drops (under 2^-63 times the largest inverse bias correction, 1 / sqrt(1 - beta2)) stays under 2^-25 of eps (at
// most half an ulp of eps, whatever its mantissa).
TEST(OptimCpu, FastMathAppliesWhereAFlushedSecondMomentIsBelowHalfAnUlpOfEps) {
  const auto applies = [](OptimAlgorithm a, double eps, double beta2) {
    OptimOptions o;
    o.algorithm = a;
    o.eps = eps;
    o.beta2 = beta2;
    return optim_detail::fast_math_applies(o);
  };
  const double bound = std::ldexp(1.0, -38);  // 2^-63 / 2^-25
  for (OptimAlgorithm a : {OptimAlgorithm::Adam, OptimAlgorithm::AdamW, OptimAlgorithm::AdEMAMix})
    for (double beta2 : {0.0, 0.9, 0.999, 0.99999}) {
      const double least = bound / std::sqrt(1.0 - beta2);
      EXPECT_TRUE(applies(a, least * 1.0001, beta2)) << int(a) << " beta2 " << beta2;
      EXPECT_FALSE(applies(a, least * 0.9999, beta2)) << int(a) << " beta2 " << beta2;
    }
  EXPECT_TRUE(applies(OptimAlgorithm::AdamW, 1e-8, 0.999));  // torch's defaults
  for (OptimAlgorithm a : {OptimAlgorithm::RMSprop, OptimAlgorithm::Adagrad}) {  // no bias correction
    EXPECT_TRUE(applies(a, bound * 1.0001, 0.999999));
    EXPECT_FALSE(applies(a, bound * 0.9999, 0.0));
  }
  EXPECT_FALSE(applies(OptimAlgorithm::AdamW, 0.0, 0.999));
  EXPECT_FALSE(applies(OptimAlgorithm::AdamW, 1e31, 0.999));  // the reciprocal's range
}

TEST(OptimCpu, RejectsInvalidHyperparameters) {
  OptimOptions o;
  o.beta1 = 1.0;
  EXPECT_THROW(validate_optim_options(o), std::invalid_argument);
  o = OptimOptions{};
  o.eps = -1.0;
  EXPECT_THROW(validate_optim_options(o), std::invalid_argument);
  o = OptimOptions{};
  o.algorithm = OptimAlgorithm::SGD;
  o.nesterov = true;
  EXPECT_THROW(validate_optim_options(o), std::invalid_argument);
  OptimStepArgs args;
  float lr = 0.1f, step = 1.0f, p = 1.0f, g = 1.0f;
  OptimTensor t;
  t.param = &p;
  t.grad = &g;
  t.step = &step;
  t.numel = 1;
  args.lr = &lr;
  EXPECT_THROW(optim_step_cpu(args, &t, 1, nullptr, 0), std::invalid_argument);  // Adam needs two states
}

// A NaN or negative learning rate is refused before anything is written, 8-bit states included; +inf and -0.0
// are usable learning rates (as in torch).
TEST(OptimCpu, RefusesAnInvalidLearningRateBeforeWritingAnything) {
  for (OptimAlgorithm a : kAll) {
    for (int state_bits : {32, 8}) {
      if (!stores_in(a, state_bits)) continue;
      const OptimOptions o = options_for(a, false);
      const int64_t n = 600;
      const int states = optim_state_count(o);
      std::vector<float> param(n, 0.5f), grad(n, 0.25f), state_values(n, 0.125f), step{3.0f};
      std::vector<std::vector<float>> fp32_states(states, state_values), absmax(states, std::vector<float>(3));
      std::vector<std::vector<uint8_t>> codes(states, std::vector<uint8_t>(n));
      OptimTensor t;
      t.param = param.data();
      t.grad = grad.data();
      for (int j = 0; j < states; ++j) {
        t.state[j] = fp32_states[j].data();
        quantize_blockwise_cpu(state_values.data(), n, 256, optim_state_is_signed(o, j), codes[j].data(), absmax[j].data());
        t.codes[j] = codes[j].data();
        t.absmax[j] = absmax[j].data();
      }
      t.step = step.data();
      std::vector<double> schedule(kMaxScheduleValues, 0.0);
      for (int j = 0; j < kMaxScheduleValues; ++j) t.schedule[j] = &schedule[j];
      t.numel = n;
      std::vector<unsigned char> ws(optim_workspace_bytes(Backend::Cpu, o, &n, 1));
      OptimStepArgs args;
      args.options = o;
      args.increment_steps = true;
      args.state_bits = state_bits;
      const auto param_before = param;
      const auto fp32_before = fp32_states;
      const auto codes_before = codes;
      const auto absmax_before = absmax;
      for (float lr : {std::nanf(""), -1.0f, -1e-30f, -std::numeric_limits<float>::infinity()}) {
        args.lr = &lr;
        try {
          optim_step_cpu(args, &t, 1, ws.data(), ws.size());
          ADD_FAILURE() << "lr " << lr << " accepted, algorithm " << int(a);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("invalid learning rate"), std::string::npos) << e.what();
        }
        EXPECT_EQ(step[0], 3.0f);
        EXPECT_EQ(schedule, std::vector<double>(kMaxScheduleValues, 0.0));
        EXPECT_TRUE(param == param_before && fp32_states == fp32_before && codes == codes_before &&
                    absmax == absmax_before)
            << "algorithm " << int(a) << " state bits " << state_bits << " lr " << lr;
      }
      for (float lr : {std::numeric_limits<float>::infinity(), -0.0f}) {
        args.lr = &lr;
        const float step_before = step[0];
        EXPECT_NO_THROW(optim_step_cpu(args, &t, 1, ws.data(), ws.size()));
        EXPECT_EQ(step[0], step_before + 1.0f);
      }
    }
  }
}

#if defined(GRAPHSAFE_WITH_CUDA)
// On the GPU a NaN or negative learning rate makes every kernel of the step write nothing (no parameter, state or
// step; the finish counter stays 0) and is recorded for the host (take_device_error); the next usable one steps.
TEST(OptimCuda, AnInvalidLearningRateWritesNothingAndIsRecorded) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  take_device_error(true);
  const int64_t n = 10001;
  for (OptimAlgorithm a : kAll) {
    for (int state_bits : {32, 8}) {
      if (!stores_in(a, state_bits)) continue;
      const OptimOptions o = options_for(a, false);
      const int states = optim_state_count(o);
      const int64_t blocks = (n + 255) / 256;
      std::vector<float> param(n, 0.5f), grad(n, 0.25f), zeros(n, 0.0f);
      float *d_param, *d_grad, *d_lr, *d_step, *d_states[4] = {}, *d_absmax[4] = {};
      double* d_schedule;
      uint8_t* d_codes[4] = {};
      uint32_t* d_counter;
      void* d_ws = nullptr;
      const std::size_t ws_bytes = optim_workspace_bytes(Backend::Cuda, o, &n, 1);
      cudaMalloc(&d_param, n * 4); cudaMalloc(&d_grad, n * 4); cudaMalloc(&d_lr, 4); cudaMalloc(&d_step, 4);
      cudaMalloc(&d_counter, 4); cudaMemset(d_counter, 0, 4);
      cudaMalloc(&d_schedule, 8 * kMaxScheduleValues); cudaMemset(d_schedule, 0, 8 * kMaxScheduleValues);
      cudaMalloc(&d_ws, ws_bytes + 4);
      for (int j = 0; j < states; ++j) {
        cudaMalloc(&d_states[j], n * 4); cudaMemset(d_states[j], 0, n * 4);
        cudaMalloc(&d_codes[j], n); cudaMemset(d_codes[j], 0, n);
        cudaMalloc(&d_absmax[j], blocks * 4); cudaMemset(d_absmax[j], 0, blocks * 4);
      }
      cudaMemcpy(d_param, param.data(), n * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_grad, grad.data(), n * 4, cudaMemcpyHostToDevice);
      cudaMemset(d_step, 0, 4);
      OptimTensor t;
      t.param = d_param;
      t.grad = d_grad;
      for (int j = 0; j < states; ++j) {
        t.state[j] = d_states[j];
        t.codes[j] = d_codes[j];
        t.absmax[j] = d_absmax[j];
      }
      t.step = d_step;
      for (int j = 0; j < kMaxScheduleValues; ++j) t.schedule[j] = d_schedule + j;
      t.numel = n;
      OptimStepArgs args;
      args.options = o;
      args.lr = d_lr;
      args.increment_steps = true;
      args.finish_counter = d_counter;
      args.error = device_error_record();
      args.state_bits = state_bits;
      for (float lr : {std::nanf(""), -2.0f, 0.01f}) {
        cudaMemcpy(d_lr, &lr, 4, cudaMemcpyHostToDevice);
        optim_step_cuda(args, &t, 1, d_ws, ws_bytes, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        float step = 0.0f;
        uint32_t counter = 1;
        std::vector<float> after(n);
        cudaMemcpy(&step, d_step, 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(&counter, d_counter, 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(after.data(), d_param, n * 4, cudaMemcpyDeviceToHost);
        EXPECT_EQ(counter, 0u);
        const std::string message = take_device_error(true);
        const std::string what = "algorithm " + std::to_string(int(a)) + " bits " + std::to_string(state_bits);
        if (lr >= 0.0f) {
          EXPECT_EQ(message, "") << what;
          EXPECT_EQ(step, 1.0f) << what;
          EXPECT_NE(after, param) << what;
          continue;
        }
        EXPECT_EQ(message.rfind("invalid learning rate", 0), 0u) << what << ": " << message;
        EXPECT_EQ(step, 0.0f) << what;
        EXPECT_EQ(after, param) << what;
        for (int j = 0; j < states; ++j) {
          std::vector<float> s(n, 1.0f), scale(blocks, 1.0f);
          std::vector<uint8_t> c(n, 1);
          cudaMemcpy(s.data(), d_states[j], n * 4, cudaMemcpyDeviceToHost);
          cudaMemcpy(c.data(), d_codes[j], n, cudaMemcpyDeviceToHost);
          cudaMemcpy(scale.data(), d_absmax[j], blocks * 4, cudaMemcpyDeviceToHost);
          EXPECT_EQ(s, zeros) << what;
          EXPECT_EQ(c, std::vector<uint8_t>(n, 0)) << what;
          EXPECT_EQ(scale, std::vector<float>(blocks, 0.0f)) << what;
        }
      }
      cudaFree(d_param); cudaFree(d_grad); cudaFree(d_lr); cudaFree(d_step); cudaFree(d_ws); cudaFree(d_counter);
      cudaFree(d_schedule);
      for (int j = 0; j < states; ++j) { cudaFree(d_states[j]); cudaFree(d_codes[j]); cudaFree(d_absmax[j]); }
    }
  }
}

TEST(OptimCuda, MatchesCpu) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 10001;  // not a multiple of 4: the scalar tail runs too
  for (OptimAlgorithm a : kAll) {
    const OptimOptions o = options_for(a, true);
    const OptimRun start = run_cpu(a, true, 0, n);
    const OptimRun cpu = run_cpu(a, true, 3, n);
    // Replay the same three steps on the GPU (same gradients: run_cpu draws them from the same seed).
    std::mt19937 rng(42);
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < n; ++i) (void)normal(rng);  // the initial params
    const int states = optim_state_count(o);
    float *d_param, *d_grad, *d_lr, *d_step, *d_states[4] = {};
    double* d_schedule;
    void* d_ws = nullptr;
    const std::size_t ws_bytes = optim_workspace_bytes(Backend::Cuda, o, &n, 1);
    cudaMalloc(&d_param, n * 4); cudaMalloc(&d_grad, n * 4); cudaMalloc(&d_lr, 4); cudaMalloc(&d_step, 4);
    cudaMalloc(&d_ws, ws_bytes + 4);
    cudaMalloc(&d_schedule, 8 * kMaxScheduleValues); cudaMemset(d_schedule, 0, 8 * kMaxScheduleValues);
    for (int j = 0; j < states; ++j) { cudaMalloc(&d_states[j], n * 4); cudaMemset(d_states[j], 0, n * 4); }
    cudaMemcpy(d_param, start.param.data(), n * 4, cudaMemcpyHostToDevice);
    const float lr = 0.01f;
    cudaMemcpy(d_lr, &lr, 4, cudaMemcpyHostToDevice);
    std::vector<float> grad(n);
    cudaMemset(d_step, 0, 4);  // the step kernel counts it up (increment_steps)
    for (int s = 0; s < 3; ++s) {
      for (int64_t i = 0; i < n; ++i) grad[i] = i % 3 == 0 ? (s % 2 ? -0.0f : 0.0f) : normal(rng);
      cudaMemcpy(d_grad, grad.data(), n * 4, cudaMemcpyHostToDevice);
      OptimTensor t;
      t.param = d_param;
      t.grad = d_grad;
      for (int j = 0; j < states; ++j) t.state[j] = d_states[j];
      t.step = d_step;
      for (int j = 0; j < kMaxScheduleValues; ++j) t.schedule[j] = d_schedule + j;
      t.numel = n;
      OptimStepArgs args;
      args.options = o;
      args.lr = d_lr;
      args.increment_steps = true;
      optim_step_cuda(args, &t, 1, d_ws, ws_bytes, nullptr);
    }
    float step_after = 0.0f;
    ASSERT_EQ(cudaMemcpy(&step_after, d_step, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(step_after, 3.0f);
    std::vector<float> gpu(n);
    ASSERT_EQ(cudaMemcpy(gpu.data(), d_param, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    double diff = 0.0, norm = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      diff += (double(gpu[i]) - cpu.param[i]) * (double(gpu[i]) - cpu.param[i]);
      norm += double(cpu.param[i]) * cpu.param[i];
      if (i % 3 == 0) ASSERT_EQ(bits(gpu[i]), bits(start.param[i])) << "skipped element moved on CUDA";
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-6) << "algorithm " << int(a);
    cudaFree(d_param); cudaFree(d_grad); cudaFree(d_lr); cudaFree(d_step); cudaFree(d_ws); cudaFree(d_schedule);
    for (int j = 0; j < states; ++j) cudaFree(d_states[j]);
  }
}
#endif

// ---- LAMB and LARS on shards: optim_layerwise_norms_cpu, then the step given the summed norms ----

namespace {
using namespace graphsafe::layerwise_test;

struct ShardCase {
  OptimAlgorithm algorithm;
  DType dtype;
  int state_bits;
  std::string name() const {
    return std::string(optim_algorithm_spec(algorithm).name) + " " + dtype_name(dtype) + " " +
           std::to_string(state_bits) + "-bit states";
  }
};

// LAMB and LARS, fp32 and bf16 parameters, 32/16/8-bit states, skip_zeros on, weight decay (and LARS momentum).
std::vector<ShardCase> shard_cases() {
  std::vector<ShardCase> cases;
  for (OptimAlgorithm a : {OptimAlgorithm::LAMB, OptimAlgorithm::LARS})
    for (DType dtype : {DType::Float32, DType::BFloat16})
      for (int bits : {32, 16, 8}) cases.push_back({a, dtype, bits});
  return cases;
}

OptimOptions shard_options(OptimAlgorithm a) {
  OptimOptions o = options_for(a, true);
  o.trust_coefficient = 0.02;
  return o;
}

bool near(double a, double b, double tolerance) { return std::fabs(a - b) <= tolerance * std::fabs(b); }
}  // namespace

// (a) Phase 1 then the step given its norms is the plain step, bit for bit (params, states, steps), with and
// without increment_steps, over several tensors (more than a chunk, an empty one); (c) phase 1 writes nothing.
TEST(OptimLayerwiseNorms, NormsThenTheGivenStepIsThePlainStep) {
  for (const ShardCase& c : shard_cases()) {
    for (bool increment : {true, false}) {
      const Problem start = make_problem(shard_options(c.algorithm), c.dtype, c.state_bits, {12800, 0, 4097, 300}, 7);
      Problem plain = start, two_phase = start;
      cpu_step(plain, increment);
      const std::vector<float> norms = cpu_norms(two_phase, increment);
      for (int t = 0; t < start.count(); ++t)
        EXPECT_TRUE(same_bits(two_phase.tensors[t], start.tensors[t])) << c.name() << ": phase 1 wrote tensor " << t;
      EXPECT_TRUE(norms[2] == 0.0f && norms[3] == 0.0f) << c.name() << ": the empty tensor's norms";
      for (float n : norms) EXPECT_TRUE(std::isfinite(n) && n >= 0.0f) << c.name();
      cpu_step(two_phase, increment, norms.data());
      for (int t = 0; t < start.count(); ++t)
        EXPECT_TRUE(same_bits(two_phase.tensors[t], plain.tensors[t]))
            << c.name() << " increment " << increment << ": tensor " << t << " differs from the plain step";
    }
  }
}

// (b) A tensor of 200 rows of 64 in two shards of 100 rows, each with its own states: the partials measured per
// shard and added in shard order, each shard stepped with the totals. Both shards get the same factor,
// layerwise_factor of the totals; the shards together are the whole tensor stepped with those totals, bit for
// bit; and they differ from the whole tensor's plain step only by the order its norms were added in.
TEST(OptimLayerwiseNorms, ShardsSteppedWithSummedPartialsMatchTheWholeTensor) {
  const int64_t rows = 200, cols = 64, half = rows / 2 * cols;  // 6400: a multiple of the 8-bit block (256)
  for (const ShardCase& c : shard_cases()) {
    const OptimOptions o = shard_options(c.algorithm);
    const Problem whole = make_problem(o, c.dtype, c.state_bits, {rows * cols}, 11);
    Problem shards = whole;
    shards.tensors = {slice(whole, whole.tensors[0], 0, half), slice(whole, whole.tensors[0], half, rows * cols)};
    const std::vector<float> partials = cpu_norms(shards, true);
    const float totals[2] = {partials[0] + partials[2], partials[1] + partials[3]};
    const float given[4] = {totals[0], totals[1], totals[0], totals[1]};
    const std::vector<float> workspace = cpu_step(shards, true, given);

    // The norms and the factor against docs/optim.md's formulas at the step's number (3 + 1).
    const std::array<double, 2> reference = reference_norms(whole, whole.tensors[0], 4.0);
    EXPECT_TRUE(near(totals[0], reference[0], 1e-5) && near(totals[1], reference[1], 1e-5))
        << c.name() << ": " << totals[0] << ", " << totals[1] << " against " << reference[0] << ", " << reference[1];
    const int64_t numels[2] = {half, half};
    const std::size_t factors = optim_detail::layerwise_layout(numels, 2).factors_offset;
    const float factor = optim_detail::layerwise_factor(o, optim_detail::coefficients(o, whole.lr, 4.0f),
                                                        optim_detail::SquaredNorms{totals[0], totals[1]});
    EXPECT_EQ(bits(workspace[factors]), bits(factor)) << c.name();
    EXPECT_EQ(bits(workspace[factors + 1]), bits(factor)) << c.name();
    EXPECT_TRUE(near(factor, reference_factor(o, reference[0], reference[1]), 1e-5)) << c.name();

    Problem whole_given = whole, whole_plain = whole;
    cpu_step(whole_given, true, totals);
    EXPECT_TRUE(same_bits(slice(whole_given, whole_given.tensors[0], 0, half), shards.tensors[0])) << c.name();
    EXPECT_TRUE(same_bits(slice(whole_given, whole_given.tensors[0], half, rows * cols), shards.tensors[1]))
        << c.name();

    Problem measured = whole;
    const std::vector<float> whole_norms = cpu_norms(measured, true);
    EXPECT_TRUE(near(totals[0], whole_norms[0], 1e-6) && near(totals[1], whole_norms[1], 1e-6)) << c.name();
    cpu_step(whole_plain, true);
    double diff = 0.0, norm = 0.0;
    int apart = 0;  // bf16 parameters: elements more than one bf16 step apart
    for (int64_t i = 0; i < rows * cols; ++i) {
      const double a = load_element(c.dtype, whole_plain.tensors[0].param, i);
      const double b = load_element(c.dtype, whole_given.tensors[0].param, i);
      diff += (a - b) * (a - b);
      norm += a * a;
      if (c.dtype == DType::BFloat16) {
        const auto* x = reinterpret_cast<const uint16_t*>(whole_plain.tensors[0].param.data());
        const auto* y = reinterpret_cast<const uint16_t*>(whole_given.tensors[0].param.data());
        apart += std::abs(int(x[i]) - int(y[i])) > 1;
      }
    }
    if (c.dtype == DType::Float32) EXPECT_LE(std::sqrt(diff / norm), 1e-6) << c.name();
    EXPECT_EQ(apart, 0) << c.name();
  }
}

// Phase 1 writes its 2 floats per tensor and nothing past them; it is refused for element-wise algorithms, as is
// a step given norms, and for an unusable learning rate (before writing anything).
TEST(OptimLayerwiseNorms, WritesOnlyItsNormsAndRefusesWhatTheStepRefuses) {
  Problem p = make_problem(shard_options(OptimAlgorithm::LAMB), DType::Float32, 32, {5000, 17}, 3);
  std::vector<float> norms(5, NAN), workspace(p.workspace_bytes(Backend::Cpu) / 4 + 1);
  std::vector<OptimTensor> views = p.views();
  optim_layerwise_norms_cpu(p.args(true), views.data(), 2, workspace.data(), p.workspace_bytes(Backend::Cpu),
                            norms.data());
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(std::isnan(norms[i]));
  EXPECT_TRUE(std::isnan(norms[4]));
  for (float lr : {std::nanf(""), -1.0f}) {
    p.lr = lr;
    std::vector<float> untouched(4, -5.0f);
    EXPECT_THROW(optim_layerwise_norms_cpu(p.args(true), views.data(), 2, workspace.data(),
                                           p.workspace_bytes(Backend::Cpu), untouched.data()),
                 std::invalid_argument);
    EXPECT_EQ(untouched, std::vector<float>(4, -5.0f));
  }
  Problem adamw = make_problem(options_for(OptimAlgorithm::AdamW, true), DType::Float32, 32, {100}, 3);
  std::vector<OptimTensor> adamw_views = adamw.views();
  EXPECT_THROW(optim_layerwise_norms_cpu(adamw.args(true), adamw_views.data(), 1, nullptr, 0, norms.data()),
               std::invalid_argument);
  EXPECT_THROW(optim_step_cpu(adamw.args(true, norms.data()), adamw_views.data(), 1, nullptr, 0),
               std::invalid_argument);
}
