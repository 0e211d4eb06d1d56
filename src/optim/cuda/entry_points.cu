// The CUDA optimizer backend's entry points (graphsafe/optim.h): the step (its checks, the steps counted and the
// schedules advanced ahead of the updates, then the kernel family of its algorithm and state width: launchers.h), the
// layer-wise norms of a sharded step's first phase, and the standalone 8-bit quantisation and dequantisation.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/cuda_check.h"
#include "common/launch.h"
#include "graphsafe/optim.h"
#include "graphsafe/optim_sparse.h"
#include "optim/backend.h"
#include "optim/blockwise.h"
#include "optim/cuda/launch_table.cuh"
#include "optim/cuda/launchers.h"
#include "optim/cuda/policy.cuh"
#include "optim/cuda/quantization_maps.cuh"
#include "optim/layout.h"
#include "optim/rules.h"
#include "optim/sparse.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

constexpr int kThreads = UtilityPolicy::kThreads;

// Adds 1 to up to kMaxSteps steps per launch, ahead of the updates: the steps the update kernels do not count
// (optim_step_cuda).
struct StepTable {
  int count;
  float* step[UtilityPolicy::kMaxSteps];
};
static_assert(sizeof(StepTable) + sizeof(LearningRate) < 4000, "kernel arguments stay under 4 KB");

__global__ void increment_steps_kernel(StepTable table, LearningRate lr) {
  if (!learning_rate_usable(lr, *lr.value)) return;
  for (int i = threadIdx.x; i < table.count; i += blockDim.x) *table.step[i] += 1.0f;
}

void increment_steps(const std::vector<float*>& steps, const LearningRate& lr, cudaStream_t stream) {
  const int count = static_cast<int>(steps.size());
  for (int first = 0; first < count; first += UtilityPolicy::kMaxSteps) {
    StepTable table{};
    table.count = std::min(UtilityPolicy::kMaxSteps, count - first);
    for (int i = 0; i < table.count; ++i) table.step[i] = steps[first + i];
    GS_LAUNCH(increment_steps_kernel, 1, kThreads, stream, table, lr);
    GS_CUDA_CHECK_LAUNCH();
  }
}

// An algorithm with a schedule: ahead of the updates, each tensor's step counted (with increment_steps) and its
// schedule advanced for that step number, the result the update reads (advance_schedule) written to
// weights[first + i], kMaxSchedules tensors per launch.
struct ScheduleTable {
  int count, first;
  float* step[UtilityPolicy::kMaxSchedules];
  double* values[kMaxScheduleValues][UtilityPolicy::kMaxSchedules];
};
static_assert(sizeof(ScheduleTable) + sizeof(OptimOptions) + sizeof(LearningRate) + 16 < 4000,
              "kernel arguments stay under 4 KB");

__global__ void advance_schedules_kernel(OptimOptions o, LearningRate lr, ScheduleTable table, bool increment,
                                         double* weights) {
  const float rate = *lr.value;
  if (!learning_rate_usable(lr, rate)) return;
  const int size = schedule_size(o.algorithm);
  for (int i = threadIdx.x; i < table.count; i += blockDim.x) {
    if (increment) *table.step[i] += 1.0f;
    double* values[kMaxScheduleValues] = {};
    for (int j = 0; j < size; ++j) values[j] = table.values[j][i];
    weights[table.first + i] = advance_schedule_at(o, rate, *table.step[i], values, size);
  }
}

void advance_schedules(const OptimStepArgs& a, const OptimTensor* tensors, int count, double* weights,
                       cudaStream_t stream) {
  for (int first = 0; first < count; first += UtilityPolicy::kMaxSchedules) {
    ScheduleTable table{};
    table.count = std::min(UtilityPolicy::kMaxSchedules, count - first);
    table.first = first;
    for (int i = 0; i < table.count; ++i) {
      table.step[i] = tensors[first + i].step;
      for (int j = 0; j < kMaxScheduleValues; ++j) table.values[j][i] = tensors[first + i].schedule[j];
    }
    GS_LAUNCH(advance_schedules_kernel, 1, kThreads, stream, a.options, learning_rate(a), table, a.increment_steps,
              weights);
    GS_CUDA_CHECK_LAUNCH();
  }
}

// Standalone quantisation (state_dict conversions, graphsafe.ops): one thread per quantisation block, the
// CPU's quantize_block (the same rules as the fused step).
__global__ void quantize_kernel(const float* x, int64_t numel, int block_size, bool is_signed, uint8_t* codes,
                                float* absmax) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= block_count(numel, block_size)) return;
  const int64_t begin = b * block_size, end = min(numel, begin + block_size);
  absmax[b] = quantize_block(kSharedMapsImage.words(is_signed), is_signed, x + begin, end - begin, codes + begin);
}

__global__ void dequantize_kernel(const uint8_t* codes, const float* absmax, int64_t numel, int block_size,
                                  bool is_signed, float* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < numel) out[i] = dequantize_value(kSharedMapsImage.value(is_signed), codes[i], absmax[i / block_size]);
}

}  // namespace

void optim_step_cuda(const OptimStepArgs& a, const OptimTensor* tensors, int count, void* workspace,
                     std::size_t workspace_bytes, StreamHandle stream) {
  check_step_args(a, tensors, count);
  const LayerwiseLayout layout = check_workspace(Backend::Cuda, a, tensors, count, workspace, workspace_bytes);
  auto* ws = static_cast<float*>(workspace);
  const auto s = static_cast<cudaStream_t>(stream);
  double* schedule_weights = nullptr;  // an algorithm with a schedule: one per tensor, in the workspace
  if (optim_schedule_size(a.options.algorithm) > 0) {
    schedule_weights = static_cast<double*>(workspace);
    advance_schedules(a, tensors, count, schedule_weights, s);  // counts the steps too
  } else if (a.increment_steps) {  // the steps the update kernels do not count: all of them, or the empty tensors'
    std::vector<float*> ahead;
    for (int t = 0; t < count; ++t)
      if (!update_counts_steps(a) || tensors[t].numel == 0) ahead.push_back(tensors[t].step);
    if (!ahead.empty()) increment_steps(ahead, learning_rate(a), s);
  }
  if (is_layerwise(a.options.algorithm)) {
    launch_layerwise_step(a, tensors, count, ws, layout.factors_offset, s);
  } else if (a.state_bits == 8) {
    launch_quantized_elementwise_step(a, tensors, count, s);
  } else {
    launch_elementwise_step(a, tensors, count, schedule_weights, s);
  }
}

void optim_step_sparse_cuda(const OptimStepArgs& a, const OptimTensor& t, const OptimSparseGradient& g, void* workspace,
                            std::size_t workspace_bytes, StreamHandle stream) {
  check_sparse_step_args(Backend::Cuda, a, t, g, workspace, workspace_bytes);
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    throw std::invalid_argument("sparse optimizer step: the CUDA workspace must be 256-byte aligned");
  const auto s = static_cast<cudaStream_t>(stream);
  const SparseWorkspaceLayout layout = sparse_workspace_layout(Backend::Cuda, a.options, a.param_dtype, t.numel);
  char* const ws = static_cast<char*>(workspace);
  // The list's valid prefix first: every kernel after steps only those rows (sparse.cu says why).
  auto* valid_rows = reinterpret_cast<unsigned long long*>(ws + layout.valid_rows);
  GS_CUDA_CHECK(cudaMemsetAsync(valid_rows, 0xff, sizeof(unsigned long long), s));
  if (g.capacity > 0) launch_sparse_valid_rows(a, t, g, valid_rows, s);
  if (sparse_step_goes_dense(a.options)) {  // LAMB, LARS: the rows scattered into a dense gradient, the dense step
    OptimTensor dense = t;
    dense.grad = ws + layout.dense_gradient;
    GS_CUDA_CHECK(cudaMemsetAsync(ws + layout.dense_gradient, 0,
                                  static_cast<std::size_t>(t.numel) * dtype_size(a.param_dtype), s));
    if (g.capacity > 0) launch_sparse_scatter(a, t, g, valid_rows, ws + layout.dense_gradient, s);
    OptimStepArgs dense_args = a;
    dense_args.finish_counter = nullptr;
    optim_step_cuda(dense_args, &dense, 1, ws + layout.step_workspace, workspace_bytes - layout.step_workspace,
                    stream);
    return;
  }
  // The step counted (and a schedule advanced) ahead, as the dense step does without a finish counter.
  double* schedule_weight = nullptr;
  if (optim_schedule_size(a.options.algorithm) > 0) {
    schedule_weight = reinterpret_cast<double*>(ws + layout.step_workspace);
    advance_schedules(a, &t, 1, schedule_weight, s);
  } else {
    increment_steps({t.step}, learning_rate(a), s);
  }
  if (g.capacity == 0 || t.numel == 0) return;
  if (a.state_bits == 8) launch_sparse_quantized_step(a, t, g, valid_rows, s);
  else launch_sparse_elementwise_step(a, t, g, valid_rows, schedule_weight, s);
}

void optim_layerwise_norms_cuda(const OptimStepArgs& a, const OptimTensor* tensors, int count, void* workspace,
                                std::size_t workspace_bytes, float* norms, StreamHandle stream) {
  check_layerwise_norms_args(a, tensors, count, norms);
  check_workspace(Backend::Cuda, a, tensors, count, workspace, workspace_bytes);
  if (count == 0) return;
  launch_layerwise_norms(a, tensors, count, static_cast<float*>(workspace), norms, static_cast<cudaStream_t>(stream));
}

void quantize_blockwise_cuda(const float* x, int64_t numel, int block_size, bool is_signed, uint8_t* codes,
                             float* absmax, StreamHandle stream) {
  check_block_size("quantize_blockwise", block_size);
  const int64_t blocks = block_count(numel, block_size);
  if (blocks == 0) return;
  GS_LAUNCH(quantize_kernel, (blocks + kThreads - 1) / kThreads, kThreads, static_cast<cudaStream_t>(stream), x,
            numel, block_size, is_signed, codes, absmax);
  GS_CUDA_CHECK_LAUNCH();
}

void dequantize_blockwise_cuda(const uint8_t* codes, const float* absmax, int64_t numel, int block_size,
                               bool is_signed, float* out, StreamHandle stream) {
  check_block_size("dequantize_blockwise", block_size);
  if (numel == 0) return;
  GS_LAUNCH(dequantize_kernel, (numel + kThreads - 1) / kThreads, kThreads, static_cast<cudaStream_t>(stream), codes,
            absmax, numel, block_size, is_signed, out);
  GS_CUDA_CHECK_LAUNCH();
}

}  // namespace graphsafe
