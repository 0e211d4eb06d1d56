// The optimizer's CUDA kernels (the units of src/optim/cuda/ compiled as C++ against emulation/common/cuda_check.h)
// against the CPU backend, on problems chosen to reach every path: every algorithm of the table, fp32/bf16/fp16,
// skip_zeros on and off, sizes below, at and above a 4096-element chunk and not multiples of 4, pointers off
// 16-byte alignment, more tensors than one launch holds (5 to 9 here: tests/cpp/CMakeLists.txt), and empty
// tensors; bf16 states (state_bits = 16);
// and 8-bit states (state_bits = 8) with block sizes 32 to 1024; steps counted by the update kernels (a finish counter) or by a
// launch ahead; schedules (advanced by the launch ahead); NaN and ±inf gradient elements (8-bit states: the same codes and scales on both backends); LAMB/LARS's
// two phases on shards (optim_layerwise_norms_cuda, OptimStepArgs::layerwise_norms); and a
// NaN or negative learning rate, which every kernel must refuse without writing anything. This is CI's check of the
// kernels' logic (indexing, barriers, shared memory, launch tables); the GPU itself is checked by
// tests/python/test_optim_cuda_*.py on a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "graphsafe/errors.h"
#include "graphsafe/optim.h"
#include "layerwise_problem.h"

using namespace graphsafe;

namespace {

// With 16-bit states and skip_zeros, elements kNanSeedElement, + 97, ... hold a NaN payload and never update.
constexpr int64_t kNanSeedElement = 5;

// Problem sizes. Sanitizer builds (GRAPHSAFE_EMULATION_SMALL: tests/cpp/CMakeLists.txt), where every emulated
// thread is costly, run every case with at most 5 tensors (their smaller table holds 2 to 4 a launch, so still
// several launches), 2 steps (both ways of counting steps) and tensors of at most a 4096-element chunk and a few.
#if defined(GRAPHSAFE_EMULATION_SMALL)
constexpr int kMaxTensors = 5, kMaxSteps = 2, kLargeChunks = 1, kSmallNumel = 700;
#else
constexpr int kMaxTensors = 1 << 20, kMaxSteps = 1 << 20, kLargeChunks = 3, kSmallNumel = 3000;
#endif

// Whether every state of algorithm a may be stored in 8 bits (the table's storage widths).
bool quantizable(OptimAlgorithm a) {
  for (const OptimStateSpec& s : optim_algorithm_spec(a).states)
    if ((s.storage & kStorage8) == 0) return false;
  return true;
}

template <class T>
uint32_t raw_bits(T x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(T));
  return u;
}

// Runs `steps` steps of the same problem through both backends; returns the number of mismatches. With
// state_bits = 16 the states are bf16 (in the float buffers' bytes), with state_bits = 8 blockwise 8-bit codes
// of block_size elements. Both backends run the same fp32 operations in the same order, so parameters, states
// (or codes and absmax) must agree bit for bit. With non_finite, every 331st gradient element (a different one
// each step) is NaN, +inf or -inf, and parameters are compared element by element (NaN with NaN).
template <class T>
int compare(OptimOptions o, int tensors, int steps, uint32_t seed, DType dtype, int state_bits = 32,
            int block_size = 256, bool non_finite = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  tensors = tensors < kMaxTensors ? tensors : kMaxTensors;
  steps = steps < kMaxSteps ? steps : kMaxSteps;
  const int states = optim_state_count(o);
  std::vector<int64_t> numel(tensors);
  std::vector<int> offset(tensors);  // elements: an offset of 1-2 breaks 16-byte alignment
  for (int t = 0; t < tensors; ++t) {
    const int kind = rng() % 6;
    numel[t] = kind == 0 ? 0 : kind == 1 ? 4096 * (1 + rng() % kLargeChunks) + rng() % 7 : 1 + rng() % kSmallNumel;
    offset[t] = rng() % 3 == 0 ? 1 + rng() % 2 : 0;
  }
  std::vector<std::vector<T>> param_cpu(tensors), param_emu(tensors), param_start(tensors), grad(tensors);
  std::vector<std::vector<std::vector<float>>> state_cpu(tensors), state_emu(tensors);
  std::vector<std::vector<std::vector<uint8_t>>> codes_cpu(tensors), codes_emu(tensors);
  std::vector<std::vector<std::vector<float>>> absmax_cpu(tensors), absmax_emu(tensors);
  std::vector<std::vector<double>> schedule_cpu(tensors, std::vector<double>(kMaxScheduleValues, 0.0));
  std::vector<std::vector<double>> schedule_emu = schedule_cpu;
  for (int t = 0; t < tensors; ++t) {
    if (state_bits == 8) {  // zero states, quantised (codes of 0, absmax 0)
      const int64_t blocks = (numel[t] + block_size - 1) / block_size;
      const std::vector<float> zeros(numel[t], 0.0f);
      codes_cpu[t].assign(states, std::vector<uint8_t>(numel[t] + 4, 0));
      absmax_cpu[t].assign(states, std::vector<float>(blocks + 1, 0.0f));
      for (int j = 0; j < states; ++j)
        quantize_blockwise_cpu(zeros.data(), numel[t], block_size, optim_state_is_signed(o, j),
                               codes_cpu[t][j].data() + (offset[t] ? 1 : 0), absmax_cpu[t][j].data());
      codes_emu[t] = codes_cpu[t];
      absmax_emu[t] = absmax_cpu[t];
    }
    param_cpu[t].resize(numel[t] + offset[t]);
    for (auto& x : param_cpu[t]) x = ElementTraits<T>::store(0.5f * normal(rng));
    param_emu[t] = param_start[t] = param_cpu[t];
    grad[t].resize(numel[t] + offset[t]);
    state_cpu[t].assign(states, std::vector<float>(numel[t] + 4, 0.0f));
    // 16-bit states with skip_zeros: every 97th element starts as a signalling-NaN pattern and its gradient is
    // always zero, so its raw bits must survive every step on both backends (the byte comparison below).
    for (int j = 0; state_bits == 16 && o.skip_zeros && j < states; ++j) {
      auto* bits = reinterpret_cast<uint16_t*>(state_cpu[t][j].data()) + (offset[t] ? 1 : 0);
      for (int64_t i = kNanSeedElement; i < numel[t]; i += 97) bits[i] = 0x7F81;
    }
    state_emu[t] = state_cpu[t];
  }
  float lr = o.algorithm == OptimAlgorithm::LARS ? 1.0f : 0.02f;
  std::vector<float> step_cpu(tensors, 0.0f), step_emu(tensors, 0.0f);
  const std::size_t workspace_bytes = optim_workspace_bytes(Backend::Cpu, o, numel.data(), tensors);
  std::vector<float> workspace_cpu(workspace_bytes / 4 + 1, NAN), workspace_emu(workspace_bytes / 4 + 1, NAN);
  std::vector<std::vector<char>> never_updated(tensors);
  for (int t = 0; t < tensors; ++t) never_updated[t].assign(numel[t], 1);

  for (int s = 0; s < steps; ++s) {
    std::vector<OptimTensor> cpu(tensors), emu(tensors);
    for (int t = 0; t < tensors; ++t) {
      for (int64_t i = 0; i < numel[t]; ++i) {
        float g = normal(rng);
        if (o.skip_zeros && rng() % 4 == 0) g = rng() % 2 ? 0.0f : -0.0f;
        if (state_bits == 16 && o.skip_zeros && i % 97 == kNanSeedElement) g = 0.0f;
        if (non_finite && i % 331 == 7 * s + 3) g = (i / 331 + s) % 3 == 0 ? NAN : (i / 331 + s) % 3 == 1 ? INFINITY : -INFINITY;
        grad[t][offset[t] + i] = ElementTraits<T>::store(g);
        if (g != 0.0f) never_updated[t][i] = 0;
      }
      step_cpu[t] += 1.0f;  // the emulated CUDA step counts its own (increment_steps)
      cpu[t].param = param_cpu[t].data() + offset[t];
      emu[t].param = param_emu[t].data() + offset[t];
      cpu[t].grad = emu[t].grad = grad[t].data() + offset[t];
      for (int j = 0; j < states; ++j) {
        if (state_bits == 16) {  // bf16 states in the float buffers' (zeroed) bytes, one element off alignment
          cpu[t].state[j] = reinterpret_cast<bf16_t*>(state_cpu[t][j].data()) + (offset[t] ? 1 : 0);
          emu[t].state[j] = reinterpret_cast<bf16_t*>(state_emu[t][j].data()) + (offset[t] ? 1 : 0);
        } else {
          cpu[t].state[j] = state_cpu[t][j].data() + (offset[t] ? 1 : 0);
          emu[t].state[j] = state_emu[t][j].data() + (offset[t] ? 1 : 0);
        }
        if (state_bits == 8) {  // codes off 4-byte alignment too (the scalar path)
          cpu[t].codes[j] = codes_cpu[t][j].data() + (offset[t] ? 1 : 0);
          emu[t].codes[j] = codes_emu[t][j].data() + (offset[t] ? 1 : 0);
          cpu[t].absmax[j] = absmax_cpu[t][j].data();
          emu[t].absmax[j] = absmax_emu[t][j].data();
        }
      }
      cpu[t].step = &step_cpu[t];
      emu[t].step = &step_emu[t];
      for (int j = 0; j < kMaxScheduleValues; ++j) {
        cpu[t].schedule[j] = &schedule_cpu[t][j];
        emu[t].schedule[j] = &schedule_emu[t][j];
      }
      cpu[t].numel = emu[t].numel = numel[t];
    }
    OptimStepArgs args;
    args.options = o;
    args.lr = &lr;
    args.param_dtype = dtype;
    args.state_bits = state_bits;
    args.block_size = block_size;
    optim_step_cpu(args, cpu.data(), tensors, workspace_cpu.data(), workspace_bytes);
    args.increment_steps = true;
    // Steps alternate between the two ways of counting steps: the update kernels' finish counter (odd steps)
    // and a launch of their own ahead (even steps); the counter is back at 0 after each step.
    uint32_t finish_counter = 0;
    args.finish_counter = s % 2 == 1 ? &finish_counter : nullptr;
    optim_step_cuda(args, emu.data(), tensors, workspace_emu.data(), workspace_bytes, nullptr);
    if (finish_counter != 0) {
      ADD_FAILURE() << "step " << s << ": finish counter left at " << finish_counter;
      return 1;
    }
  }

  int mismatches = 0;
  for (int t = 0; t < tensors; ++t) {
    if (step_emu[t] != step_cpu[t]) {
      ADD_FAILURE() << "tensor " << t << ": step " << step_emu[t] << " after increment_steps, expected " << step_cpu[t];
      ++mismatches;
    }
    if (std::memcmp(schedule_emu[t].data(), schedule_cpu[t].data(), kMaxScheduleValues * sizeof(double)) != 0) {
      ADD_FAILURE() << "algorithm " << int(o.algorithm) << " tensor " << t << ": the backends' schedules differ";
      ++mismatches;
    }
    double diff = 0.0, norm = 0.0;
    for (int64_t i = 0; i < numel[t]; ++i) {
      const float c = ElementTraits<T>::load(param_cpu[t][offset[t] + i]);
      const float e = ElementTraits<T>::load(param_emu[t][offset[t] + i]);
      if (non_finite) {
        if (!(raw_bits(c) == raw_bits(e) || (std::isnan(c) && std::isnan(e)))) {
          ADD_FAILURE() << "algorithm " << int(o.algorithm) << " tensor " << t << " element " << i << ": param " << c
                        << " (cpu) and " << e << " (emulated cuda)";
          return mismatches + 1;
        }
        continue;
      }
      diff += double(c - e) * (c - e);
      norm += double(c) * c;
      // skip_zeros: an element whose gradient was zero on every step keeps its exact bits on both backends.
      if (never_updated[t][i] && raw_bits(param_emu[t][offset[t] + i]) != raw_bits(param_start[t][offset[t] + i]))
        ++mismatches;
    }
    // fp32 or bf16 states: every byte of their buffers (what lies past the states is 0 on both); the seeded NaN
    // payloads of never-updated elements as they were.
    for (int j = 0; state_bits == 16 && o.skip_zeros && j < states; ++j) {
      const auto* bits = reinterpret_cast<const uint16_t*>(state_emu[t][j].data()) + (offset[t] ? 1 : 0);
      for (int64_t i = kNanSeedElement; i < numel[t]; i += 97)
        if (bits[i] != 0x7F81) {
          ADD_FAILURE() << "algorithm " << int(o.algorithm) << " tensor " << t << " state " << j << " element " << i
                        << ": a skipped element's NaN payload became " << bits[i];
          return mismatches + 1;
        }
    }
    for (int j = 0; state_bits != 8 && j < states; ++j) {
      if (std::memcmp(state_cpu[t][j].data(), state_emu[t][j].data(), state_cpu[t][j].size() * sizeof(float)) != 0) {
        ADD_FAILURE() << "algorithm " << int(o.algorithm) << " " << state_bits << "-bit states, tensor " << t
                      << " state " << j << ": the backends' states differ";
        return mismatches + 1;
      }
    }
    for (int j = 0; state_bits == 8 && j < states; ++j) {
      for (int64_t i = 0; i < numel[t]; ++i) {
        const int c = codes_cpu[t][j][i + (offset[t] ? 1 : 0)], e = codes_emu[t][j][i + (offset[t] ? 1 : 0)];
        if (c != e) {
          ADD_FAILURE() << "algorithm " << int(o.algorithm) << " tensor " << t << " state " << j << " element " << i
                        << ": codes " << c << " (cpu) and " << e << " (emulated cuda)";
          return mismatches + 1;
        }
      }
      for (std::size_t b = 0; b + 1 < absmax_cpu[t][j].size(); ++b) {
        const float c = absmax_cpu[t][j][b], e = absmax_emu[t][j][b];
        if (raw_bits(c) != raw_bits(e)) {
          ADD_FAILURE() << "algorithm " << int(o.algorithm) << " tensor " << t << " state " << j << " block " << b
                        << ": absmax " << c << " (cpu) and " << e << " (emulated cuda)";
          return mismatches + 1;
        }
      }
    }
    // Same rules, same fp32 arithmetic, LAMB/LARS norms in the same order (optim/layout.h): the same bits.
    if (norm > 0 && diff != 0.0) {
      ADD_FAILURE() << "algorithm " << int(o.algorithm) << " dtype " << dtype_name(dtype) << " tensor " << t
                    << " numel " << numel[t] << " offset " << offset[t] << ": relative difference "
                    << std::sqrt(diff / norm);
      ++mismatches;
    }
  }
  return mismatches;
}

}  // namespace

TEST(OptimKernelsEmulated, MatchTheCpuBackend) {
  for (int algorithm = 0; algorithm < kOptimAlgorithmCount; ++algorithm) {
    for (bool skip_zeros : {false, true}) {
      OptimOptions o;
      o.algorithm = OptimAlgorithm(algorithm);
      o.weight_decay = 0.1;
      o.skip_zeros = skip_zeros;
      o.momentum = (o.algorithm == OptimAlgorithm::SGD || o.algorithm == OptimAlgorithm::RMSprop ||
                    o.algorithm == OptimAlgorithm::LARS) ? 0.9 : 0.0;
      o.dampening = o.algorithm == OptimAlgorithm::SGD ? 0.1 : 0.0;
      o.centered = o.algorithm == OptimAlgorithm::RMSprop;
      o.amsgrad = o.algorithm == OptimAlgorithm::Adam;
      o.alpha_warmup = o.beta3_warmup = o.algorithm == OptimAlgorithm::AdEMAMix ? 6.0 : 0.0;
      o.trust_coefficient = 0.02;
      o.lr_decay = o.algorithm == OptimAlgorithm::Adagrad ? 0.01 : 0.0;
      o.warmup_steps = o.algorithm == OptimAlgorithm::AdamWScheduleFree ? 2.0f : 0.0f;
      o.r = o.algorithm == OptimAlgorithm::AdamWScheduleFree ? 0.5f : 0.0f;
      const uint32_t seed = 100 + 10 * algorithm + skip_zeros;
      EXPECT_EQ(compare<float>(o, 40, 3, seed, DType::Float32), 0) << "fp32, algorithm " << algorithm;
      EXPECT_EQ(compare<bf16_t>(o, 36, 2, seed + 1, DType::BFloat16), 0) << "bf16, algorithm " << algorithm;
      EXPECT_EQ(compare<f16_t>(o, 6, 2, seed + 2, DType::Float16), 0) << "fp16, algorithm " << algorithm;
      EXPECT_EQ(compare<float>(o, 12, 2, seed + 6, DType::Float32, 16), 0) << "16-bit fp32, algorithm " << algorithm;
      EXPECT_EQ(compare<bf16_t>(o, 36, 2, seed + 7, DType::BFloat16, 16), 0) << "16-bit bf16, algorithm " << algorithm;
      if (!quantizable(o.algorithm)) continue;
      // fp32 params cycle through block sizes 32 (4 threads per block) to 512 (groups across warps), 256 being
      // one warp, the widest group without a barrier; bf16 takes 1024, fp16 256.
      const int kBlockSizes[] = {32, 64, 128, 256, 512};
      const int block_size = kBlockSizes[(algorithm + 2 * skip_zeros) % 5];
      EXPECT_EQ(compare<float>(o, 12, 2, seed + 3, DType::Float32, 8, block_size), 0)
          << "8-bit fp32, algorithm " << algorithm << " block " << block_size;
      EXPECT_EQ(compare<bf16_t>(o, 8, 2, seed + 4, DType::BFloat16, 8, 1024), 0)
          << "8-bit bf16, algorithm " << algorithm;
      EXPECT_EQ(compare<f16_t>(o, 6, 2, seed + 5, DType::Float16, 8, 256), 0)
          << "8-bit fp16, algorithm " << algorithm;
    }
  }
}

// Only empty tensors: no update kernel runs, yet with a finish counter their steps are counted (by the launch
// of its own), and the counter stays 0.
TEST(OptimKernelsEmulated, EmptyTensorsStepsAreCountedWithAFinishCounter) {
  for (OptimAlgorithm algorithm : {OptimAlgorithm::AdamW, OptimAlgorithm::LAMB}) {
    OptimOptions o;
    o.algorithm = algorithm;
    float lr = 0.1f, steps[2] = {3.0f, 0.0f}, workspace[64];
    OptimTensor tensors[2];
    for (int t = 0; t < 2; ++t) tensors[t].step = &steps[t];
    const int64_t numels[2] = {0, 0};
    ASSERT_LE(optim_workspace_bytes(Backend::Cuda, o, numels, 2), sizeof(workspace));
    uint32_t finish_counter = 0;
    OptimStepArgs args;
    args.options = o;
    args.lr = &lr;
    args.increment_steps = true;
    args.finish_counter = &finish_counter;
    optim_step_cuda(args, tensors, 2, workspace, sizeof(workspace), nullptr);
    EXPECT_EQ(steps[0], 4.0f);
    EXPECT_EQ(steps[1], 1.0f);
    EXPECT_EQ(finish_counter, 0u);
  }
}

// Standalone blockwise quantisation (state_dict conversions, graphsafe.ops), one thread per block, against the
// CPU: the same codes and absmax bit for bit, and the same decoded values, for every block size, a length that
// is not a multiple of it, and special values (±0, ±inf, NaN, subnormals, values far apart in one block).
TEST(OptimKernelsEmulated, StandaloneQuantizationMatchesTheCpu) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const int64_t numel = 5000;
  std::vector<float> x(numel);
  for (auto& v : x) v = normal(rng) * std::pow(10.0f, float(int(rng() % 9) - 4));
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, -3e-39f, 3.4e38f};
  for (int i = 0; i < 8; ++i) x[97 * i + 3] = specials[i];
  for (int block_size = 32; block_size <= 1024; block_size *= 2) {
    for (bool is_signed : {false, true}) {
      const int64_t blocks = (numel + block_size - 1) / block_size;
      std::vector<uint8_t> codes_cpu(numel), codes_emu(numel);
      std::vector<float> absmax_cpu(blocks), absmax_emu(blocks), out_cpu(numel), out_emu(numel);
      quantize_blockwise_cpu(x.data(), numel, block_size, is_signed, codes_cpu.data(), absmax_cpu.data());
      quantize_blockwise_cuda(x.data(), numel, block_size, is_signed, codes_emu.data(), absmax_emu.data(), nullptr);
      dequantize_blockwise_cpu(codes_cpu.data(), absmax_cpu.data(), numel, block_size, is_signed, out_cpu.data());
      dequantize_blockwise_cuda(codes_emu.data(), absmax_emu.data(), numel, block_size, is_signed, out_emu.data(),
                                nullptr);
      for (int64_t b = 0; b < blocks; ++b)
        ASSERT_EQ(raw_bits(absmax_cpu[b]), raw_bits(absmax_emu[b])) << "block size " << block_size << " block " << b;
      for (int64_t i = 0; i < numel; ++i) {
        ASSERT_EQ(codes_cpu[i], codes_emu[i]) << "block size " << block_size << " element " << i;
        ASSERT_EQ(raw_bits(out_cpu[i]), raw_bits(out_emu[i])) << "block size " << block_size << " element " << i;
      }
    }
  }
}

// Non-finite gradient elements with 8-bit states: both backends leave the non-finite states out of the block's
// absmax and give them the code of 0 (the CUDA step through its branch-free normalized_or_nan_fused), so codes,
// absmax and parameters agree bit for bit, for every algorithm, block sizes across and within warps, fp32 and bf16.
TEST(OptimKernelsEmulated, NonFiniteGradientsWith8BitStatesMatchTheCpuBackend) {
  for (int algorithm = 0; algorithm < kOptimAlgorithmCount; ++algorithm) {
    if (!quantizable(OptimAlgorithm(algorithm))) continue;
    OptimOptions o;
    o.algorithm = OptimAlgorithm(algorithm);
    o.weight_decay = 0.1;
    o.momentum = (o.algorithm == OptimAlgorithm::SGD || o.algorithm == OptimAlgorithm::RMSprop ||
                  o.algorithm == OptimAlgorithm::LARS) ? 0.9 : 0.0;
    o.centered = o.algorithm == OptimAlgorithm::RMSprop;
    o.amsgrad = o.algorithm == OptimAlgorithm::Adam;
    o.trust_coefficient = 0.02;
    const uint32_t seed = 500 + algorithm;
    EXPECT_EQ(compare<float>(o, 6, 3, seed, DType::Float32, 8, algorithm % 2 ? 256 : 64, true), 0)
        << "8-bit fp32, algorithm " << algorithm;
    EXPECT_EQ(compare<bf16_t>(o, 4, 2, seed + 1, DType::BFloat16, 8, 512, true), 0)
        << "8-bit bf16, algorithm " << algorithm;
  }
}

// A NaN or negative learning rate in device memory: every kernel of the step (element-wise with and without a
// finish counter, LAMB/LARS's three, the step-counting launch ahead) writes nothing, the finish counter stays
// 0, and the error record names the value; +inf is a usable learning rate.
TEST(OptimKernelsEmulated, AnInvalidLearningRateWritesNothingAndIsRecorded) {
  for (OptimAlgorithm algorithm : {OptimAlgorithm::AdamW, OptimAlgorithm::SGD, OptimAlgorithm::LAMB, OptimAlgorithm::LARS}) {
    for (int state_bits : {32, 16, 8}) {
      for (bool counter : {false, true}) {
        for (float lr : {NAN, -1.0f, -0.0f, INFINITY}) {
          OptimOptions o;
          o.algorithm = algorithm;
          o.momentum = 0.9;
          o.weight_decay = 0.1;
          const int states = optim_state_count(o);
          const int64_t numels[3] = {5000, 0, 4096};
          std::vector<std::vector<float>> param(3), grad(3), state(3 * states);
          std::vector<std::vector<uint8_t>> codes(3 * states);
          std::vector<std::vector<float>> absmax(3 * states);
          float steps[3] = {4.0f, 0.0f, 7.0f};
          OptimTensor tensors[3];
          std::mt19937 rng(9);
          std::normal_distribution<float> normal;
          for (int t = 0; t < 3; ++t) {
            param[t].resize(numels[t]);
            grad[t].resize(numels[t]);
            for (auto& x : param[t]) x = normal(rng);
            for (auto& x : grad[t]) x = normal(rng);
            tensors[t].param = param[t].data();
            tensors[t].grad = grad[t].data();
            tensors[t].step = &steps[t];
            tensors[t].numel = numels[t];
            for (int j = 0; j < states; ++j) {
              auto& st = state[t * states + j];
              st.resize(numels[t] + 1);
              for (auto& x : st) x = std::fabs(normal(rng));
              codes[t * states + j].assign(numels[t] + 1, 0);
              absmax[t * states + j].assign(numels[t] / 32 + 2, 0.0f);
              if (state_bits == 8) {
                quantize_blockwise_cpu(st.data(), numels[t], 256, optim_state_is_signed(o, j), codes[t * states + j].data(),
                                       absmax[t * states + j].data());
                tensors[t].codes[j] = codes[t * states + j].data();
                tensors[t].absmax[j] = absmax[t * states + j].data();
              } else {
                tensors[t].state[j] = st.data();  // bf16 states read the same bytes as pairs of halves
              }
            }
          }
          const auto param_before = param;
          const auto state_before = state;
          const auto codes_before = codes;
          const auto absmax_before = absmax;
          std::vector<float> workspace(optim_workspace_bytes(Backend::Cuda, o, numels, 3) / 4 + 1, 0.0f);
          uint32_t finish_counter = 0;
          DeviceErrorRecord record{0, 0, 0};
          OptimStepArgs args;
          args.options = o;
          args.lr = &lr;
          args.increment_steps = true;
          args.finish_counter = counter ? &finish_counter : nullptr;
          args.error = &record;
          args.state_bits = state_bits;
          optim_step_cuda(args, tensors, 3, workspace.data(), workspace.size() * 4, nullptr);
          const std::string what = "algorithm " + std::to_string(int(algorithm)) + " bits " +
                                   std::to_string(state_bits) + " counter " + std::to_string(counter) + " lr " +
                                   std::to_string(lr);
          EXPECT_EQ(finish_counter, 0u) << what;
          if (lr >= 0.0f) {  // -0.0 and +inf are usable: the step ran
            EXPECT_EQ(record.code, 0) << what;
            EXPECT_EQ(steps[0], 5.0f) << what;
            EXPECT_EQ(steps[1], 1.0f) << what;
            continue;
          }
          EXPECT_EQ(record.code, int64_t(DeviceErrorCode::InvalidLearningRate)) << what;
          EXPECT_EQ(uint32_t(record.bad_value), raw_bits(lr)) << what;
          EXPECT_EQ(steps[0], 4.0f) << what;
          EXPECT_EQ(steps[1], 0.0f) << what;
          EXPECT_EQ(steps[2], 7.0f) << what;
          EXPECT_TRUE(param == param_before) << what;
          for (std::size_t k = 0; k < state.size(); ++k) {
            EXPECT_EQ(std::memcmp(state[k].data(), state_before[k].data(), state[k].size() * 4), 0) << what;
            EXPECT_TRUE(codes[k] == codes_before[k]) << what;
            EXPECT_EQ(std::memcmp(absmax[k].data(), absmax_before[k].data(), absmax[k].size() * 4), 0) << what;
          }
        }
      }
    }
  }
}

// LAMB and LARS on shards, against the CPU: optim_layerwise_norms_cuda's norms, and the step given norms
// (OptimStepArgs::layerwise_norms: params, states or codes and scales, steps), bit for bit; with more tensors than
// a launch holds (the step's tables take 6 to 9 here; the norms' chunk ranges 66) and empty tensors; phase 1
// writes nothing but its norms. With an unusable learning rate neither phase writes anything, and both report it.
TEST(OptimKernelsEmulated, LayerwiseNormsAndTheStepGivenThemMatchTheCpu) {
  using namespace graphsafe::layerwise_test;
  struct Case { OptimAlgorithm algorithm; DType dtype; int state_bits, tensors; };
  const Case cases[] = {{OptimAlgorithm::LAMB, DType::Float32, 32, 70}, {OptimAlgorithm::LARS, DType::BFloat16, 16, 20},
                        {OptimAlgorithm::LAMB, DType::BFloat16, 8, 20}, {OptimAlgorithm::LARS, DType::Float32, 8, 20},
                        {OptimAlgorithm::LAMB, DType::Float16, 16, 12}, {OptimAlgorithm::LARS, DType::Float32, 32, 12}};
  for (const Case& c : cases) {
    const std::string what = std::string(optim_algorithm_spec(c.algorithm).name) + " " + dtype_name(c.dtype) + " " +
                             std::to_string(c.state_bits) + "-bit states";
    std::mt19937 rng(31 + c.tensors + c.state_bits);
    std::vector<int64_t> numels(c.tensors < kMaxTensors ? c.tensors : kMaxTensors);
    for (std::size_t t = 0; t < numels.size(); ++t) {
      const int kind = t == 1 ? 0 : rng() % 6;  // tensor 1 is empty; tensor 0 takes several chunks
      numels[t] = kind == 0 ? 0 : (t == 0 || kind == 1) ? 4096 * (1 + rng() % kLargeChunks) + rng() % 7
                                                        : 1 + rng() % kSmallNumel;
    }
    OptimOptions o;
    o.algorithm = c.algorithm;
    o.weight_decay = 0.1;
    o.momentum = 0.9;
    o.trust_coefficient = 0.02;
    o.skip_zeros = true;
    Problem cpu = make_problem(o, c.dtype, c.state_bits, numels, 17 + c.tensors), emu = cpu;
    const Problem start = cpu;
    const std::vector<float> norms_cpu = cpu_norms(cpu, true);
    const std::size_t bytes = emu.workspace_bytes(Backend::Cuda);
    std::vector<float> workspace(bytes / 4 + 1, NAN), norms_emu(norms_cpu.size() + 1, NAN);
    std::vector<OptimTensor> views = emu.views();
    optim_layerwise_norms_cuda(emu.args(true), views.data(), emu.count(), workspace.data(), bytes, norms_emu.data(),
                               nullptr);
    EXPECT_EQ(std::memcmp(norms_emu.data(), norms_cpu.data(), norms_cpu.size() * 4), 0) << what << ": the norms";
    EXPECT_TRUE(std::isnan(norms_emu.back())) << what << ": written past the last tensor's norms";
    for (int t = 0; t < emu.count(); ++t)
      EXPECT_TRUE(same_bits(emu.tensors[t], start.tensors[t])) << what << ": phase 1 wrote tensor " << t;

    cpu_step(cpu, true, norms_cpu.data());
    optim_step_cuda(emu.args(true, norms_emu.data()), views.data(), emu.count(), workspace.data(), bytes, nullptr);
    for (int t = 0; t < emu.count(); ++t)
      EXPECT_TRUE(same_bits(emu.tensors[t], cpu.tensors[t])) << what << ": tensor " << t << " after the step";

    const Problem before = emu;
    for (float lr : {NAN, -1.0f}) {
      emu.lr = lr;
      DeviceErrorRecord record{0, 0, 0};
      OptimStepArgs args = emu.args(true);
      args.error = &record;
      std::vector<float> untouched(norms_cpu.size(), -5.0f);
      optim_layerwise_norms_cuda(args, views.data(), emu.count(), workspace.data(), bytes, untouched.data(), nullptr);
      EXPECT_EQ(untouched, std::vector<float>(norms_cpu.size(), -5.0f)) << what;
      EXPECT_EQ(record.code, int64_t(DeviceErrorCode::InvalidLearningRate)) << what;
      record = DeviceErrorRecord{0, 0, 0};
      args.layerwise_norms = norms_cpu.data();
      optim_step_cuda(args, views.data(), emu.count(), workspace.data(), bytes, nullptr);
      EXPECT_EQ(record.code, int64_t(DeviceErrorCode::InvalidLearningRate)) << what;
      for (int t = 0; t < emu.count(); ++t)
        EXPECT_TRUE(same_bits(emu.tensors[t], before.tensors[t])) << what << ": lr " << lr << " wrote tensor " << t;
    }
  }
}
