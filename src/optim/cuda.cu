// CUDA backend of the optimizer step: the shared rules (rules.h) in multi-tensor kernels.
//
// Tensors go in launches of up to kMaxTensors; their pointers travel as a kernel argument (so a captured
// graph keeps them, and no metadata is copied to the device). Blocks take chunks of kChunkElements
// elements of one tensor in turn, with 16-byte accesses where alignment allows. lr and each
// tensor's step are read from device memory inside the kernel. Layer-wise algorithms (LAMB, LARS) run
// three kernels: per-chunk squared norms (a fixed-order block reduction), per-tensor factor (chunks added
// in order), and the update.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "common/launch.h"
#include "graphsafe/optim.h"
#include "optim/layout.h"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int kIterations = static_cast<int>(kChunkElements / (kThreads * kVec));
static_assert(kIterations * kThreads * kVec == kChunkElements, "a block covers one chunk exactly");
constexpr int kMaxTensors = 32;

struct TensorTable {
  int count;
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  float* state[4][kMaxTensors];
  const float* step[kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t first_block[kMaxTensors + 1];  // blocks of this launch, one per chunk
  int64_t first_chunk[kMaxTensors];      // chunk index across the whole step (layer-wise partials)
  int factor_index[kMaxTensors];         // tensor index across the whole step (layer-wise factors)
};
static_assert(sizeof(TensorTable) < 4000, "kernel arguments stay under 4 KB");

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ int tensor_of_block(const TensorTable& table, int64_t block) {
  int t = 0;
  while (t + 1 < table.count && table.first_block[t + 1] <= block) ++t;
  return t;
}

__device__ bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The block's tensor and chunk, and the step's coefficients for that tensor (computed once per block).
struct BlockWork {
  int tensor;
  int64_t begin, end;
};

__device__ BlockWork block_work(const TensorTable& table, int64_t block) {
  const int t = tensor_of_block(table, block);
  const int64_t chunk = block - table.first_block[t];
  const int64_t begin = chunk * kChunkElements;
  return {t, begin, min(begin + kChunkElements, table.numel[t])};
}

// Blocks loop over chunks (the grid is capped at what the GPU holds at once), so the coefficients, which
// take double-precision powers, are formed once per tensor per block: by one thread, into shared memory.
__device__ void share_coefficients(const OptimOptions& o, const float* lr, const TensorTable& table, int t,
                                   int& current, Coefficients& shared) {
  if (t == current) return;
  __syncthreads();  // everyone is done with the previous tensor's coefficients
  if (threadIdx.x == 0) shared = coefficients(o, *lr, *table.step[t]);
  __syncthreads();
  current = t;
}

#define GS_FOR_EACH_CHUNK(table, total_blocks, w) \
  for (int64_t block_ = blockIdx.x; block_ < (total_blocks); block_ += gridDim.x) \
    if (const BlockWork w = block_work(table, block_); true)

// Calls body(i, g, p, s) for each element a thread owns, loading and storing kVec elements at a time
// when the tensor's pointers allow; body returns whether it changed p and s (skipped elements are not
// written back).
template <class T, int States, class Body>
__device__ void for_each_element(const TensorTable& table, const BlockWork& w, Body body) {
  T* param = static_cast<T*>(table.param[w.tensor]);
  const T* grad = static_cast<const T*>(table.grad[w.tensor]);
  bool wide = aligned(param, sizeof(T) * kVec) && aligned(grad, sizeof(T) * kVec);
#pragma unroll
  for (int j = 0; j < States; ++j) wide = wide && aligned(table.state[j][w.tensor], 16);
  for (int it = 0; it < kIterations; ++it) {
    const int64_t base = w.begin + (int64_t(it) * kThreads + threadIdx.x) * kVec;
    if (base >= w.end) break;
    if (wide && base + kVec <= w.end) {
      const Pack<T, kVec> g4 = *reinterpret_cast<const Pack<T, kVec>*>(grad + base);
      Pack<T, kVec> p4 = *reinterpret_cast<const Pack<T, kVec>*>(param + base);
      // States as plain per-element registers (indexed only by unrolled constants), moved as float4.
      float sv[States > 0 ? States : 1][kVec];
#pragma unroll
      for (int j = 0; j < States; ++j) {
        const float4 v = *reinterpret_cast<const float4*>(table.state[j][w.tensor] + base);
        sv[j][0] = v.x; sv[j][1] = v.y; sv[j][2] = v.z; sv[j][3] = v.w;
      }
      bool changed = false;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float s[4] = {};  // all four set: a rule never reads an undefined register (see optim.md)
#pragma unroll
        for (int j = 0; j < States; ++j) s[j] = sv[j][e];
        float p = ElementTraits<T>::load(p4.v[e]);
        if (body(ElementTraits<T>::load(g4.v[e]), p, s)) {
          changed = true;
          p4.v[e] = ElementTraits<T>::store(p);
#pragma unroll
          for (int j = 0; j < States; ++j) sv[j][e] = s[j];
        }
      }
      if (changed) {
        *reinterpret_cast<Pack<T, kVec>*>(param + base) = p4;
#pragma unroll
        for (int j = 0; j < States; ++j)
          __stwb(reinterpret_cast<float4*>(table.state[j][w.tensor] + base), make_float4(sv[j][0], sv[j][1], sv[j][2], sv[j][3]));
      }
    } else {
      for (int64_t i = base; i < min(base + kVec, w.end); ++i) {
        float s[4] = {};  // all four set: a rule never reads an undefined register (see optim.md)
#pragma unroll
        for (int j = 0; j < States; ++j) s[j] = table.state[j][w.tensor][i];
        float p = ElementTraits<T>::load(param[i]);
        if (body(ElementTraits<T>::load(grad[i]), p, s)) {
          param[i] = ElementTraits<T>::store(p);
#pragma unroll
          for (int j = 0; j < States; ++j) table.state[j][w.tensor][i] = s[j];
        }
      }
    }
  }
}

template <class T, int States>
__global__ void __launch_bounds__(kThreads)
    elementwise_kernel(OptimOptions o, const float* lr, TensorTable table, int64_t total_blocks) {
  __shared__ Coefficients k;
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    share_coefficients(o, lr, table, w.tensor, current, k);
    for_each_element<T, States>(table, w, [&](float g, float& p, float* s) {
      if (skipped(o, g)) return false;
      elementwise_step(o, k, g, p, s);
      return true;
    });
  }
}

// Layer-wise pass 1: each block writes its chunk's squared norms (a fixed-order tree over the threads).
template <class T, int States>
__global__ void __launch_bounds__(kThreads) measure_kernel(OptimOptions o, const float* lr, TensorTable table,
                                                          int64_t total_blocks, float* chunk_norms) {
  __shared__ Coefficients k;
  __shared__ float partial[2][kThreads];
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
  share_coefficients(o, lr, table, w.tensor, current, k);
  SquaredNorms mine{0.0f, 0.0f};
  for_each_element<T, States>(table, w, [&](float g, float& p, float* s) {
    const SquaredNorms n = layerwise_measure(o, k, g, p, s);
    mine.param += n.param;
    mine.update += n.update;
    return o.algorithm == OptimAlgorithm::LAMB && !skipped(o, g);  // LAMB stores its moments now
  });
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
  if (threadIdx.x == 0) {
    const int64_t chunk = table.first_chunk[w.tensor] + (block_ - table.first_block[w.tensor]);
    chunk_norms[2 * chunk] = partial[0][0];
    chunk_norms[2 * chunk + 1] = partial[1][0];
  }
  __syncthreads();  // partial[] is reused by the next chunk
  }
}

// Layer-wise pass 1b: one thread per tensor adds its chunks in order and stores the tensor's factor.
__global__ void factor_kernel(OptimOptions o, const float* lr, TensorTable table, const float* chunk_norms,
                              float* factors) {
  const int t = threadIdx.x;
  if (t >= table.count) return;
  SquaredNorms total{0.0f, 0.0f};
  const int64_t chunks = table.first_block[t + 1] - table.first_block[t];
  for (int64_t c = table.first_chunk[t]; c < table.first_chunk[t] + chunks; ++c) {
    total.param += chunk_norms[2 * c];
    total.update += chunk_norms[2 * c + 1];
  }
  factors[table.factor_index[t]] = layerwise_factor(o, coefficients(o, *lr, *table.step[t]), total);
}

// Layer-wise pass 2.
template <class T, int States>
__global__ void __launch_bounds__(kThreads) apply_kernel(OptimOptions o, const float* lr, TensorTable table,
                                                        int64_t total_blocks, const float* factors) {
  __shared__ Coefficients k;
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    share_coefficients(o, lr, table, w.tensor, current, k);
    const float factor = factors[table.factor_index[w.tensor]];
    for_each_element<T, States>(table, w, [&](float g, float& p, float* s) {
      if (skipped(o, g)) return false;
      layerwise_apply(o, k, factor, g, p, s);
      return true;
    });
  }
}

// Blocks one launch uses: all chunks, at most 8 blocks of 256 per SM (about what fits resident; the
// register-heavier LAMB/LARS kernels fit fewer, and the extra blocks simply wait).
int64_t grid_for(int64_t blocks) {
  int device = 0, sms = 0;
  GS_CUDA_CHECK(cudaGetDevice(&device));
  GS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::min<int64_t>(blocks, int64_t(sms) * 8);
}

template <class T, int States>
void launch_table(const OptimStepArgs& a, const TensorTable& table, int64_t blocks, float* workspace,
                  std::size_t factors_offset, cudaStream_t stream) {
  if (blocks == 0) return;
  constexpr auto elementwise = &elementwise_kernel<T, States>;  // named: GS_LAUNCH takes one token
  constexpr auto measure = &measure_kernel<T, States>;
  constexpr auto apply = &apply_kernel<T, States>;
  const OptimOptions& o = a.options;
  const int64_t grid = grid_for(blocks);
  if (!is_layerwise(o.algorithm)) {
    GS_LAUNCH(elementwise, grid, kThreads, stream, o, a.lr, table, blocks);
    GS_CUDA_CHECK_LAUNCH();
    return;
  }
  GS_LAUNCH(measure, grid, kThreads, stream, o, a.lr, table, blocks, workspace);
  GS_CUDA_CHECK_LAUNCH();
  GS_LAUNCH(factor_kernel, 1, kMaxTensors, stream, o, a.lr, table, workspace, workspace + factors_offset);
  GS_CUDA_CHECK_LAUNCH();
  GS_LAUNCH(apply, grid, kThreads, stream, o, a.lr, table, blocks, workspace + factors_offset);
  GS_CUDA_CHECK_LAUNCH();
}

template <class T, int States>
void run(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace,
         std::size_t factors_offset, cudaStream_t stream) {
  TensorTable table{};
  int64_t blocks = 0, chunk_base = 0;
  auto flush = [&]() {
    table.first_block[table.count] = blocks;
    launch_table<T, States>(a, table, blocks, workspace, factors_offset, stream);
    table = TensorTable{};
    blocks = 0;
  };
  for (int t = 0; t < count; ++t) {
    const OptimTensor& x = tensors[t];
    if (x.numel == 0) continue;
    const int i = table.count++;
    table.param[i] = x.param;
    table.grad[i] = x.grad;
    for (int j = 0; j < 4; ++j) table.state[j][i] = x.state[j];
    table.step[i] = x.step;
    table.numel[i] = x.numel;
    table.first_block[i] = blocks;
    table.first_chunk[i] = chunk_base;
    table.factor_index[i] = t;
    blocks += chunk_count(x.numel);
    chunk_base += chunk_count(x.numel);
    if (table.count == kMaxTensors) flush();
  }
  if (table.count > 0) flush();
}

template <class T>
void run_typed(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* ws, std::size_t factors,
               cudaStream_t stream) {
  switch (optim_state_count(a.options)) {
    case 0: run<T, 0>(a, tensors, count, ws, factors, stream); break;
    case 1: run<T, 1>(a, tensors, count, ws, factors, stream); break;
    case 2: run<T, 2>(a, tensors, count, ws, factors, stream); break;
    case 3: run<T, 3>(a, tensors, count, ws, factors, stream); break;
    default: throw std::logic_error("unexpected optimizer state count");
  }
}

}  // namespace

void optim_step_cuda(const OptimStepArgs& a, const OptimTensor* tensors, int count, void* workspace,
                     std::size_t workspace_bytes, StreamHandle stream) {
  check_step_args(a, tensors, count);
  std::vector<int64_t> numels(count);
  for (int t = 0; t < count; ++t) numels[t] = tensors[t].numel;
  const LayerwiseLayout layout = layerwise_layout(numels.data(), count);
  const std::size_t needed = optim_workspace_bytes(Backend::Cuda, a.options, numels.data(), count);
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr))
    throw std::invalid_argument("optimizer step: workspace of " + std::to_string(workspace_bytes) +
                                " bytes is smaller than the " + std::to_string(needed) + " required");
  auto* ws = static_cast<float*>(workspace);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (a.param_dtype) {
    case DType::Float32: run_typed<float>(a, tensors, count, ws, layout.factors_offset, s); break;
    case DType::Float16: run_typed<f16_t>(a, tensors, count, ws, layout.factors_offset, s); break;
    case DType::BFloat16: run_typed<bf16_t>(a, tensors, count, ws, layout.factors_offset, s); break;
    default: break;
  }
}

}  // namespace graphsafe
