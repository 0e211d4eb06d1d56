// LAMB and LARS, at any state width: three kernels per launch table. Pass 1 (measure_kernel) writes each chunk's
// squared norms (a fixed-order block reduction), pass 1b (factor_kernel) combines a tensor's chunks in a fixed
// order into its factor, one block per tensor, and pass 2 (apply_kernel) updates. The norms are added in
// layout.h's order, the CPU backend's, so both give the same bits.
#include <cstddef>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/launch.h"
#include "graphsafe/optim.h"
#include "optim/backend.h"
#include "optim/cuda/launch_table.cuh"
#include "optim/cuda/launchers.h"
#include "optim/cuda/policy.cuh"
#include "optim/cuda/quantization_maps.cuh"
#include "optim/cuda/quantized_loops.cuh"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

constexpr int kThreads = LayerwisePolicy::kThreads;

// The block's per-thread norms added by a fixed tree (same bits on every run); every thread gets the sum.
__device__ SquaredNorms block_sum(SquaredNorms mine, float (&partial)[2][kThreads]) {
  partial[0][threadIdx.x] = mine.param;
  partial[1][threadIdx.x] = mine.update;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      partial[0][threadIdx.x] += partial[0][threadIdx.x + half];
      partial[1][threadIdx.x] += partial[1][threadIdx.x + half];
    }
    __syncthreads();
  }
  const SquaredNorms sum{partial[0][0], partial[1][0]};
  __syncthreads();  // partial[] may be reused right away
  return sum;
}

// Layer-wise pass 1: each block writes its chunk's squared norms (a fixed-order tree over the threads,
// layout.h's order); the tensors are not written (rules.h, layerwise_apply, says why).
template <class T, int States, int Bits>
__global__ void __launch_bounds__(kThreads, LayerwisePolicy::kMeasureMinBlocksPerSM) measure_kernel(OptimOptions o, LearningRate lr, TensorTable<States, Bits> table,
                                                          int64_t total_blocks, int block_size, float* chunk_norms) {
  __shared__ Coefficients k;
  __shared__ float partial[2][kThreads];
  const float rate = *lr.value;
  const SharedMaps* maps = nullptr;
  if constexpr (Bits == 8) maps = load_maps_to_shared<kThreads>();
  if (!learning_rate_usable(lr, rate)) return;
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    share_coefficients(o, lr.value, table, w.tensor, current, k);
    SquaredNorms mine{0.0f, 0.0f};
    with_layerwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
      for_each<T, States, Bits, false>(o, table, w, block_size, maps, [&](float g, float& p, float* s) {
        const SquaredNorms n = layerwise_measure<decltype(algorithm)::value>(o, k, g, p, s);
        mine.param += n.param;
        mine.update += n.update;
        return false;
      });
    });
    const SquaredNorms sum = block_sum(mine, partial);
    if (threadIdx.x == 0) {
      const int64_t chunk = table.first_chunk[w.tensor] + (block_ - table.first_block[w.tensor]);
      chunk_norms[2 * chunk] = sum.param;
      chunk_norms[2 * chunk + 1] = sum.update;
    }
  }
}

// Layer-wise pass 1b: one block per tensor combines its chunk norms in a fixed order (thread i adds
// chunks i, i + kThreads, ... in turn, then the same tree as pass 1) and stores the tensor's factor (one
// thread adding a large tensor's chunks in sequence would take longer than the update).
template <class Table>
__global__ void __launch_bounds__(kThreads) factor_kernel(OptimOptions o, LearningRate lr, Table table,
                                                          const float* chunk_norms, float* factors) {
  if (!learning_rate_usable(lr, *lr.value)) return;
  __shared__ float partial[2][kThreads];
  const int t = blockIdx.x;
  const int64_t first = table.first_chunk[t], chunks = table.first_block[t + 1] - table.first_block[t];
  SquaredNorms mine{0.0f, 0.0f};
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    mine.param += chunk_norms[2 * (first + c)];
    mine.update += chunk_norms[2 * (first + c) + 1];
  }
  const SquaredNorms total = block_sum(mine, partial);
  if (threadIdx.x == 0) factors[table.factor_index[t]] = layerwise_factor(o, coefficients(o, *lr.value, step_number(table, t)), total);
}

// Layer-wise pass 2: LAMB forms and stores its new moments and updates; LARS updates its momentum.
template <class T, int States, int Bits>
__global__ void __launch_bounds__(kThreads, LayerwisePolicy::apply_min_blocks_per_sm(Bits))
    apply_kernel(OptimOptions o, LearningRate lr, TensorTable<States, Bits> table, int64_t total_blocks, int block_size,
                 const float* factors) {
  __shared__ Coefficients k;
  const float rate = *lr.value;
  const SharedMaps* maps = nullptr;
  if constexpr (Bits == 8) maps = load_maps_to_shared<kThreads>();
  if (!learning_rate_usable(lr, rate)) return;
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    share_coefficients(o, lr.value, table, w.tensor, current, k);
    const float factor = factors[table.factor_index[w.tensor]];
    with_layerwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
      for_each<T, States, Bits, true>(o, table, w, block_size, maps, [&](float g, float& p, float* s) {
        if (skipped(o, g)) return false;
        layerwise_apply<decltype(algorithm)::value>(o, k, factor, g, p, s);
        return true;
      });
    });
  }
}


template <class T, int States, int Bits>
void launch_tables(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace,
                   std::size_t factors_offset, cudaStream_t stream) {
  constexpr auto measure = &measure_kernel<T, States, Bits>;  // named: GS_LAUNCH takes one token
  constexpr auto apply = &apply_kernel<T, States, Bits>;
  constexpr auto factor = &factor_kernel<TensorTable<States, Bits>>;
  const OptimOptions& o = a.options;
  const LearningRate lr = learning_rate(a);
  const int b = a.block_size;
  for_each_table<States, Bits>(a, tensors, count, [&](const TensorTable<States, Bits>& table, int64_t blocks) {
    GS_LAUNCH(measure, grid_for(measure, blocks), kThreads, stream, o, lr, table, blocks, b, workspace);
    GS_CUDA_CHECK_LAUNCH();
    GS_LAUNCH(factor, table.count, kThreads, stream, o, lr, table, workspace, workspace + factors_offset);
    GS_CUDA_CHECK_LAUNCH();
    GS_LAUNCH(apply, grid_for(apply, blocks), kThreads, stream, o, lr, table, blocks, b, workspace + factors_offset);
    GS_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void optim_detail::launch_layerwise_step(const OptimStepArgs& a, const OptimTensor* tensors, int count,
                                         float* workspace, std::size_t factors_offset, cudaStream_t stream) {
  with_param_type(a.param_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    with_state_count(a.options, [&](auto states) {
      constexpr int States = decltype(states)::value;
      if (a.state_bits == 8) launch_tables<T, States, 8>(a, tensors, count, workspace, factors_offset, stream);
      else if (a.state_bits == 16) launch_tables<T, States, 16>(a, tensors, count, workspace, factors_offset, stream);
      else launch_tables<T, States, 32>(a, tensors, count, workspace, factors_offset, stream);
    });
  });
}

}  // namespace graphsafe
