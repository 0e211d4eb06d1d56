// The element-wise algorithms with fp32 or bf16 states (state_bits 32 or 16): one kernel per parameter type, state
// count and state width, the algorithm chosen per element (rules.h, elementwise_step). These kernels are
// memory-bound, so few registers matter more than the branch.
#include <cstdint>

#include "common/cuda_check.h"
#include "common/launch.h"
#include "graphsafe/optim.h"
#include "optim/backend.h"
#include "optim/cuda/element_loop.cuh"
#include "optim/cuda/launch_table.cuh"
#include "optim/cuda/launchers.h"
#include "optim/cuda/policy.cuh"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

template <class T, int States, int Bits, bool Scheduled>
__global__ void __launch_bounds__(ElementwisePolicy::kThreads, ElementwisePolicy::kMinBlocksPerSM)
    elementwise_kernel(OptimOptions o, LearningRate lr, TensorTable<States, Bits> table, int64_t total_blocks,
                       int /*block_size: 8-bit states only*/, const double* schedule_weights) {
  if (!learning_rate_usable(lr, *lr.value)) return;
  __shared__ Coefficients k;
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    share_coefficients(o, lr.value, table, w.tensor, current, k, schedule_weights);
    for_each_element<T, StateType<Bits>, States>(table, w, [&](float g, float& p, float* s) {
      if (skipped(o, g)) return false;
      elementwise_step<Scheduled>(o, k, g, p, s);
      return true;
    });
  }
  finish_steps(table);
}

template <class T, int States, int Bits>
void launch_tables(const OptimStepArgs& a, const OptimTensor* tensors, int count, const double* schedule_weights,
                   cudaStream_t stream) {
  const OptimOptions& o = a.options;
  const LearningRate lr = learning_rate(a);
  const int b = a.block_size;
  for_each_table<States, Bits>(a, tensors, count, [&](const TensorTable<States, Bits>& table, int64_t blocks) {
    const auto launch = [&](auto kernel) {
      GS_LAUNCH(kernel, grid_for(kernel, blocks), ElementwisePolicy::kThreads, stream, o, lr, table, blocks, b,
                schedule_weights);
    };
    if (optim_schedule_size(o.algorithm) > 0) launch(&elementwise_kernel<T, States, Bits, true>);
    else launch(&elementwise_kernel<T, States, Bits, false>);
    GS_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void optim_detail::launch_elementwise_step(const OptimStepArgs& a, const OptimTensor* tensors, int count,
                                           const double* schedule_weights, cudaStream_t stream) {
  with_param_type(a.param_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    with_state_count(a.options, [&](auto states) {
      constexpr int States = decltype(states)::value;
      if (a.state_bits == 16) launch_tables<T, States, 16>(a, tensors, count, schedule_weights, stream);
      else launch_tables<T, States, 32>(a, tensors, count, schedule_weights, stream);
    });
  });
}

}  // namespace graphsafe
