// The element-wise algorithms with 8-bit states: instruction-bound, so one kernel per algorithm (its registers
// are allocated for its own loop alone: one kernel for all algorithms of a state count spilled), with the options
// that the algorithm and its state count imply folded into it and no branch between elements; and, where eps
// allows, FastMath's square roots and quotients (rules.h). Blocks copy the quantisation maps into shared memory
// and prefetch their next chunk into L2 while they work on one.

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

// Asks the L2 cache to fetch bytes [p, p + bytes) (rounded inward to 16-byte boundaries, as the bulk prefetch
// needs) without waiting for them: cp.async.bulk.prefetch (Hopper), one instruction for the whole range, and no
// registers held while the bytes arrive.
__device__ void prefetch_to_l2(const void* p, int64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (a + 15) & ~uintptr_t(15), last = (a + uintptr_t(bytes)) & ~uintptr_t(15);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (last > first) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(first), "r"(uint32_t(last - first)) : "memory");
#else
  // Older GPUs (a build for them: CMAKE_CUDA_ARCHITECTURES) have no bulk prefetch, and the emulated kernels
  // (tests/cpp/emulation) no cache to warm: the step is the same without it.
  (void)first, (void)last;
#endif
}

// The inputs of chunk `block` of the launch (its gradients, parameters and codes) into L2, if it exists.
template <class T, int States, class Table>
__device__ void prefetch_chunk(const Table& table, int64_t block, int64_t total_blocks) {
  if (block >= total_blocks) return;
  const BlockWork w = block_work(table, block);
  const int64_t n = w.end - w.begin;
  prefetch_to_l2(static_cast<const T*>(table.tensor[w.tensor].grad) + w.begin, n * int64_t(sizeof(T)));
  prefetch_to_l2(static_cast<const T*>(table.tensor[w.tensor].param) + w.begin, n * int64_t(sizeof(T)));
#pragma unroll
  for (int j = 0; j < States; ++j) prefetch_to_l2(static_cast<const uint8_t*>(table.tensor[w.tensor].state[j]) + w.begin, n);
}

// Element-wise algorithm A with 8-bit states, States of them, parameters of type T, Math's roots and quotients.
template <class T, int States, OptimAlgorithm A, class Math>
__global__ void __launch_bounds__(QuantizedElementwisePolicy<Math>::kThreads, QuantizedElementwisePolicy<Math>::kMinBlocksPerSM)
    quantized_elementwise_kernel(OptimOptions o, LearningRate lr, TensorTable<States, 8> table, int64_t total_blocks,
                                 int block_size) {
  __shared__ Coefficients k;
  const float rate = *lr.value;  // read while the maps are copied
  const SharedMaps* maps = load_maps_to_shared<QuantizedElementwisePolicy<Math>::kThreads>();
  if (!learning_rate_usable(lr, rate)) return;
  const OptimOptions known = with_known_options<A, States>(o);
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    // The block's next chunk on its way into L2 while this one is worked on (one chunk ahead: two was slower).
    if (threadIdx.x == 0) prefetch_chunk<T, States>(table, block_ + gridDim.x, total_blocks);
    share_coefficients(known, lr.value, table, w.tensor, current, k);
    const Coefficients mine = k;  // in registers (the rule's few): not re-read from shared per element
    for_each<T, States, 8, true, QuantizedElementwisePolicy<Math>::kThreads>(known, table, w, block_size, maps,
                                                                             [&](float g, float& p, float* s) {
      if (skipped(known, g)) return false;
      elementwise_rule<A, Math>(known, mine, g, p, s);
      return true;
    });
  }
  finish_steps(table);
}


template <class T, int States>
void launch_tables(const OptimStepArgs& a, const OptimTensor* tensors, int count, cudaStream_t stream) {
  const OptimOptions& o = a.options;
  const LearningRate lr = learning_rate(a);
  const int b = a.block_size;
  for_each_table<States, 8>(a, tensors, count, [&](const TensorTable<States, 8>& table, int64_t blocks) {
    with_elementwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
      constexpr OptimAlgorithm A = decltype(algorithm)::value;
      if constexpr (quantizable(A)) {  // (the others' 8-bit steps are refused by check_step_args: no kernel)
        auto launch = [&](auto kernel, int threads) {
          GS_LAUNCH(kernel, grid_for(kernel, blocks, threads), threads, stream, o, lr, table, blocks, b);
        };
        constexpr int kFast = QuantizedElementwisePolicy<FastMath>::kThreads;
        constexpr int kExact = QuantizedElementwisePolicy<ExactMath>::kThreads;
        if constexpr (takes_roots(A)) {
          if (fast_math_applies(o)) launch(&quantized_elementwise_kernel<T, States, A, FastMath>, kFast);
          else launch(&quantized_elementwise_kernel<T, States, A, ExactMath>, kExact);
        } else {
          launch(&quantized_elementwise_kernel<T, States, A, ExactMath>, kExact);  // no roots or quotients to choose for
        }
      }
    });
    GS_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void optim_detail::launch_quantized_elementwise_step(const OptimStepArgs& a, const OptimTensor* tensors, int count,
                                                     cudaStream_t stream) {
  with_param_type(a.param_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    with_state_count(a.options, [&](auto states) {
      launch_tables<T, decltype(states)::value>(a, tensors, count, stream);
    });
  });
}

}  // namespace graphsafe
