// LAMB and LARS, at any state width: three kernels per launch table. Pass 1 (measure_kernel) writes each chunk's
// squared norms (a fixed-order block reduction), pass 1b (factor_kernel) combines a tensor's chunks in a fixed
// order into its factor, one block per tensor, and pass 2 (apply_kernel) updates. The norms are added in
// layout.h's order, the CPU backend's, so both give the same bits. On shards (OptimStepArgs::layerwise_norms) the
// two phases come apart: optim_layerwise_norms_cuda runs pass 1 and combines each tensor's chunks into its norms
// (norm_totals_kernel); the step given the summed norms forms the factors from them (given_factor_kernel) and
// runs pass 2.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

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
      const int64_t chunk = table.first_chunk + block_;  // (the launch's blocks are its chunks)
      chunk_norms[2 * chunk] = sum.param;
      chunk_norms[2 * chunk + 1] = sum.update;
    }
  }
}

// A tensor's chunk sums (pass 1's partials at chunk_norms[2 * (first + c)], c < chunks) combine in layout.h's
// fixed order: thread i adds chunks i, i + kThreads, ... in turn (this function, into mine, which starts at 0),
// then block_sum's tree (one thread adding a large tensor's chunks in sequence would take longer than the
// update). factor_kernel and norm_totals_kernel both combine this way, so a tensor's norms measured whole or
// given (OptimStepArgs::layerwise_norms) give the same factor. (It adds into the caller's accumulator: a function
// returning the sum by value compiled factor_kernel differently.)
__device__ void add_chunks(const float* chunk_norms, int64_t first, int64_t chunks, SquaredNorms& mine) {
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    mine.param += chunk_norms[2 * (first + c)];
    mine.update += chunk_norms[2 * (first + c) + 1];
  }
}

// Layer-wise pass 1b: one block per tensor combines its chunk norms and stores the tensor's factor.
template <class Table>
__global__ void __launch_bounds__(kThreads) factor_kernel(OptimOptions o, LearningRate lr, Table table,
                                                          const float* chunk_norms, float* factors) {
  if (!learning_rate_usable(lr, *lr.value)) return;
  __shared__ float partial[2][kThreads];
  const int t = blockIdx.x;
  const int64_t first = table.first_chunk + table.first_block[t];
  const int64_t chunks = table.first_block[t + 1] - table.first_block[t];
  SquaredNorms mine{0.0f, 0.0f};
  add_chunks(chunk_norms, first, chunks, mine);
  const SquaredNorms total = block_sum(mine, partial);
  if (threadIdx.x == 0) factors[table.factor_index[t]] = layerwise_factor(o, coefficients(o, *lr.value, step_number(table, t)), total);
}

// Pass 1b of a step given the whole tensors' norms (OptimStepArgs::layerwise_norms, 2 floats per tensor of the
// step): one thread per tensor of the table forms its factor from them, as factor_kernel from its own.
template <class Table>
__global__ void __launch_bounds__(kThreads) given_factor_kernel(OptimOptions o, LearningRate lr, Table table,
                                                                const float* norms, float* factors) {
  const float rate = *lr.value;
  if (!learning_rate_usable(lr, rate)) return;
  for (int t = threadIdx.x; t < table.count; t += blockDim.x) {
    const int i = table.factor_index[t];
    const SquaredNorms total{norms[2 * i], norms[2 * i + 1]};
    factors[i] = layerwise_factor(o, coefficients(o, rate, step_number(table, t)), total);
  }
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

// optim_layerwise_norms_cuda's second kernel: tensors first .. first + count - 1 of the step (empty ones
// included), tensor first + i's chunks first_chunk[i] .. first_chunk[i + 1] - 1 of the step's partials.
struct ChunkRanges {
  static constexpr int kCapacity = LayerwisePolicy::kNormRangesPerLaunch;
  int count, first;
  int64_t first_chunk[kCapacity + 1];
};
static_assert(sizeof(ChunkRanges) + sizeof(LearningRate) + 2 * sizeof(float*) <= LaunchTablePolicy::kArgumentBytes,
              "the chunk ranges fit the argument bytes");

// One block per tensor: its chunks combined as factor_kernel combines them, written as its 2 norms (an empty
// tensor, no chunks: 0, 0).
__global__ void __launch_bounds__(kThreads) norm_totals_kernel(LearningRate lr, ChunkRanges ranges,
                                                               const float* chunk_norms, float* norms) {
  if (!learning_rate_usable(lr, *lr.value)) return;
  __shared__ float partial[2][kThreads];
  const int i = blockIdx.x;
  const int64_t first = ranges.first_chunk[i];
  SquaredNorms mine{0.0f, 0.0f};
  add_chunks(chunk_norms, first, ranges.first_chunk[i + 1] - first, mine);
  const SquaredNorms total = block_sum(mine, partial);
  if (threadIdx.x == 0) {
    norms[2 * (ranges.first + i)] = total.param;
    norms[2 * (ranges.first + i) + 1] = total.update;
  }
}

template <class T, int States, int Bits>
void launch_tables(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace,
                   std::size_t factors_offset, cudaStream_t stream) {
  constexpr auto measure = &measure_kernel<T, States, Bits>;  // named: GS_LAUNCH takes one token
  constexpr auto apply = &apply_kernel<T, States, Bits>;
  constexpr auto factor = &factor_kernel<TensorTable<States, Bits>>;
  constexpr auto given_factor = &given_factor_kernel<TensorTable<States, Bits>>;
  const OptimOptions& o = a.options;
  const LearningRate lr = learning_rate(a);
  const int b = a.block_size;
  for_each_table<States, Bits>(a, tensors, count, [&](const TensorTable<States, Bits>& table, int64_t blocks) {
    if (a.layerwise_norms != nullptr) {
      GS_LAUNCH(given_factor, 1, kThreads, stream, o, lr, table, a.layerwise_norms, workspace + factors_offset);
      GS_CUDA_CHECK_LAUNCH();
    } else {
      GS_LAUNCH(measure, grid_for(measure, blocks), kThreads, stream, o, lr, table, blocks, b, workspace);
      GS_CUDA_CHECK_LAUNCH();
      GS_LAUNCH(factor, table.count, kThreads, stream, o, lr, table, workspace, workspace + factors_offset);
      GS_CUDA_CHECK_LAUNCH();
    }
    GS_LAUNCH(apply, grid_for(apply, blocks), kThreads, stream, o, lr, table, blocks, b, workspace + factors_offset);
    GS_CUDA_CHECK_LAUNCH();
  });
}

// Pass 1 of a step (the same kernel, with the step number the step will use: its launch ahead has not run), then
// each tensor's chunks combined into its norms.
template <class T, int States, int Bits>
void launch_norm_tables(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace, float* norms,
                        cudaStream_t stream) {
  constexpr auto measure = &measure_kernel<T, States, Bits>;
  const LearningRate lr = learning_rate(a);
  for_each_table<States, Bits>(a, tensors, count, [&](const TensorTable<States, Bits>& table, int64_t blocks) {
    TensorTable<States, Bits> counted = table;
    counted.step_increment = a.increment_steps ? 1.0f : 0.0f;
    GS_LAUNCH(measure, grid_for(measure, blocks), kThreads, stream, a.options, lr, counted, blocks, a.block_size,
              workspace);
    GS_CUDA_CHECK_LAUNCH();
  });
  int64_t chunk_base = 0;
  for (int first = 0; first < count; first += ChunkRanges::kCapacity) {
    ChunkRanges ranges{};
    ranges.count = std::min(ChunkRanges::kCapacity, count - first);
    ranges.first = first;
    for (int i = 0; i < ranges.count; ++i) {
      ranges.first_chunk[i] = chunk_base;
      chunk_base += chunk_count(tensors[first + i].numel);
    }
    ranges.first_chunk[ranges.count] = chunk_base;
    GS_LAUNCH(norm_totals_kernel, ranges.count, kThreads, stream, lr, ranges, workspace, norms);
    GS_CUDA_CHECK_LAUNCH();
  }
}

// Calls launch(TypeTag<T>, States, Bits) (std::integral_constant) for the step's parameter type, state count and
// state width.
template <class Launch>
void with_layerwise_kernels(const OptimStepArgs& a, Launch launch) {
  with_param_type(a.param_dtype, [&](auto type) {
    with_state_count(a.options, [&](auto states) {
      if (a.state_bits == 8) launch(type, states, std::integral_constant<int, 8>{});
      else if (a.state_bits == 16) launch(type, states, std::integral_constant<int, 16>{});
      else launch(type, states, std::integral_constant<int, 32>{});
    });
  });
}

}  // namespace

void optim_detail::launch_layerwise_step(const OptimStepArgs& a, const OptimTensor* tensors, int count,
                                         float* workspace, std::size_t factors_offset, cudaStream_t stream) {
  with_layerwise_kernels(a, [&](auto type, auto states, auto bits) {
    launch_tables<typename decltype(type)::type, decltype(states)::value, decltype(bits)::value>(
        a, tensors, count, workspace, factors_offset, stream);
  });
}

void optim_detail::launch_layerwise_norms(const OptimStepArgs& a, const OptimTensor* tensors, int count,
                                          float* workspace, float* norms, cudaStream_t stream) {
  with_layerwise_kernels(a, [&](auto type, auto states, auto bits) {
    launch_norm_tables<typename decltype(type)::type, decltype(states)::value, decltype(bits)::value>(
        a, tensors, count, workspace, norms, stream);
  });
}

}  // namespace graphsafe
