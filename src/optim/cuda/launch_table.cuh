// The launch tables of the optimizer's CUDA kernels: how a step's tensors reach a launch, how a block finds its
// chunk, and what every kernel of a step shares (the learning-rate test, the per-tensor coefficients, the step
// count).
//
// Tensors go in launches of up to TensorTable::kCapacity; their pointers travel as a kernel argument (so a
// captured graph keeps them, and no metadata is copied to the device). As many blocks as the GPU holds at once
// take chunks of kChunkElements elements in turn. lr and each tensor's step are read from device memory inside
// the kernel; with increment_steps and a finish counter the element-wise update's last block adds 1 to every
// step (finish_steps), otherwise one small launch ahead of the updates does (entry_points.cu), which also
// advances the schedules of an algorithm that has them. A NaN or negative lr
// makes every kernel write nothing and report it (learning_rate_usable).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "common/cuda_check.h"
#include "common/device_error.cuh"
#include "common/launch.h"
#include "graphsafe/optim.h"
#include "optim/cuda/policy.cuh"
#include "optim/layout.h"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

// What every chunk of a tensor reads besides its first block: its data pointers and element count, side by side, so
// that a chunk reads one to three lines of the constant cache. (Kept as one array per field, the fields of a tensor
// lay a table's length apart, and at some lengths they shared the cache's sets: with 65 tensors a table, arrays
// 520 bytes apart, bf16 AdamW's update ran 8% slower than with 58.) With 8-bit states also the scales.
template <int StateSlots, bool Scales>
struct TensorPointers {
  void* param;
  const void* grad;
  void* state[StateSlots];  // fp32 or bf16 states, or with 8-bit states their codes (uint8)
  int64_t numel;
};
template <int StateSlots>
struct TensorPointers<StateSlots, true> {
  void* param;
  const void* grad;
  void* state[StateSlots];
  int64_t numel;
  float* absmax[StateSlots];  // one scale per quantisation block
};

// One launch's tensors: per tensor the pointers its kernels read, with slots for the States states only (and
// their 8-bit scales only with Bits 8), so that a launch takes as many tensors as fit in the argument bytes
// (76 for SGD with momentum or RMSprop, 66 for Adam(W), 58 for AdEMAMix): a step of many small tensors is bound by
// the host, and every launch costs it a few microseconds. An 8-bit table holds as many tensors as its 32-bit
// twin, its scales taking up to kScaleBytes (about 1.4 KB) past the argument bytes, so that fewer state bytes
// never cost more launches. (Larger tables for every width made GPU-bound steps of 200 tensors slower: the
// table's walk, tensor_of_block, grows with it.) So that the table stays small, a tensor's chunk index across
// the step is worked out from one header field, first_chunk, rather than kept per tensor.
template <int States, int Bits>
struct TensorTable {
  static constexpr int kStateSlots = States > 0 ? States : 1;
  static constexpr int kScaleSlots = Bits == 8 ? kStateSlots : 0;
  static constexpr int kHeaderBytes = 24, kBytesPerTensorUnscaled = 8 * (5 + kStateSlots) + 4;
  // Besides the tensors: the header, first_block's last entry and up to 4 bytes of padding after factor_index.
  static constexpr int kCapacity =
      (LaunchTablePolicy::kArgumentBytes - kHeaderBytes - 8 - 4) / kBytesPerTensorUnscaled;
  static constexpr int kScaleBytes = kCapacity * kScaleSlots * 8;  // taken past the argument bytes
  int count;
  // With a finish counter (OptimStepArgs::finish_counter) the steps are read as they were before this step
  // and 1 is added on reading (step_increment); the update's last block to finish writes step + 1 for all.
  float step_increment;
  uint32_t* finish_counter;
  // The step's index of this launch's first chunk (layer-wise partials): tensor i's first chunk across the whole
  // step is first_chunk + first_block[i], the launch's blocks being its chunks in the step's order.
  int64_t first_chunk;
  TensorPointers<kStateSlots, Bits == 8> tensor[kCapacity];
  float* step[kCapacity];
  int64_t first_block[kCapacity + 1];  // blocks of this launch, one per chunk
  int factor_index[kCapacity];         // tensor index across the whole step (layer-wise factors, schedules)
};
static_assert(LaunchTablePolicy::kArgumentBytes != 4000 ||
                  (TensorTable<1, 32>::kCapacity == 76 && TensorTable<2, 32>::kCapacity == 66 &&
                   TensorTable<3, 32>::kCapacity == 58 && TensorTable<1, 8>::kCapacity == 76 &&
                   TensorTable<2, 8>::kCapacity == 66 && TensorTable<3, 8>::kCapacity == 58),
              "the capacities the comment above names");

template <class Table>
__device__ int tensor_of_block(const Table& table, int64_t block) {
  int t = 0;
  while (t + 1 < table.count && table.first_block[t + 1] <= block) ++t;
  return t;
}

// The block's tensor and chunk, and the step's coefficients for that tensor (computed once per block).
struct BlockWork {
  int tensor;
  int64_t begin, end;
};

template <class Table>
__device__ BlockWork block_work(const Table& table, int64_t block) {
  const int t = tensor_of_block(table, block);
  const int64_t chunk = block - table.first_block[t];
  const int64_t begin = chunk * kChunkElements;
  return {t, begin, min(begin + kChunkElements, table.tensor[t].numel)};
}

// Tensor t's step number for this step's coefficients.
template <class Table>
__device__ float step_number(const Table& table, int t) { return *table.step[t] + table.step_increment; }

// The step's learning rate as its kernels get it: where to read it (device memory, at run time: a captured step
// follows what a scheduler writes there) and where to report an unusable one (OptimStepArgs::error).
struct LearningRate {
  const float* value;
  DeviceErrorRecord* error;
};

LearningRate learning_rate(const OptimStepArgs& a) { return {a.lr, a.error}; }

// Whether a kernel of the step may run with `rate`, the value read at lr.value; if not, block 0 reports it and
// every block returns before it writes anything. Every kernel of a step tests it (a layer-wise step's three
// and the step-counting launch ahead too), and all their threads read the same value (nothing writes it during
// the step), so they agree: no block of an element-wise update reaches finish_steps (its counter stays 0), no
// step is counted, no parameter or state is written.
__device__ bool learning_rate_usable(const LearningRate& lr, float rate) {
  if (usable_learning_rate(rate)) return true;
  if (blockIdx.x == 0 && threadIdx.x == 0 && lr.error != nullptr) report_invalid_learning_rate(lr.error, rate);
  return false;
}

// Blocks loop over chunks (the grid is capped at what the GPU holds at once), so the coefficients, which
// take double-precision powers, are formed once per tensor per block: by one thread, into shared memory.
// schedule_weights: an algorithm with a schedule, what the launch ahead advanced for each tensor of the step
// (advance_schedule), by factor_index; null otherwise.
template <class Table>
__device__ void share_coefficients(const OptimOptions& o, const float* lr, const Table& table, int t,
                                   int& current, Coefficients& shared, const double* schedule_weights = nullptr) {
  if (t == current) return;
  __syncthreads();  // everyone is done with the previous tensor's coefficients
  if (threadIdx.x == 0)
    shared = coefficients(o, *lr, step_number(table, t),
                          schedule_weights != nullptr ? schedule_weights[table.factor_index[t]] : 0.0);
  __syncthreads();
  current = t;
}

// An element-wise update kernel ends with this in every block (no block returns early, unless all do: an
// unusable learning rate; a no-op without a finish counter, see update_counts_steps):
// the block that finishes last, when every other block has read its steps (each block's thread 0 reads them,
// share_coefficients, before this), adds 1 to every step of the table and sets the counter back to 0. The
// fences order the other blocks' reads before the count, and the count before the writes.
template <class Table>
__device__ void finish_steps(const Table& table) {
  if (table.finish_counter == nullptr) return;
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(table.finish_counter, 1u) == gridDim.x - 1;
    __threadfence();
  }
  __syncthreads();
  if (!last) return;
  for (int i = threadIdx.x; i < table.count; i += blockDim.x) *table.step[i] += 1.0f;
  if (threadIdx.x == 0) *table.finish_counter = 0;
}

// The chunks of a launch, each block taking every gridDim.x-th: w is the chunk's BlockWork, block_ its index.
#define GS_FOR_EACH_CHUNK(table, total_blocks, w) \
  for (int64_t block_ = blockIdx.x; block_ < (total_blocks); block_ += gridDim.x) \
    if (const BlockWork w = block_work(table, block_); true)

// ---- host side ----

// Whether the update kernels count the steps (finish_steps) instead of a launch of their own ahead: with a
// finish counter, for the element-wise algorithms without a schedule. LAMB and LARS, three launches a step
// already, keep the launch ahead: finish_steps at the end of their update kernel made the fp32 LAMB kernel spill
// and run slower. An algorithm with a schedule has a launch ahead anyway (advancing it), which counts the steps.
bool update_counts_steps(const OptimStepArgs& a) {
  return a.increment_steps && a.finish_counter != nullptr && !is_layerwise(a.options.algorithm) &&
         optim_schedule_size(a.options.algorithm) == 0;
}

// Blocks one launch of `kernel` uses: all chunks, or as many blocks as the GPU holds at once if fewer.
// Capped at residency because blocks loop over chunks in a fixed stride: a block that only starts once
// others have finished all their chunks would run its own alone at the end.
// The residency is queried once per kernel and device (the queries cost more than a launch).
template <class Kernel>
int64_t grid_for(Kernel kernel, int64_t blocks, int threads = ChunkPolicy::kThreads) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int64_t> resident;  // (kernel, device) -> blocks at once
  int device = 0;
  GS_CUDA_CHECK(cudaGetDevice(&device));
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), device};
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = resident.find(key);
  if (it == resident.end()) {  // entered only once both queries succeeded
    int sms = 0, per_sm = 0;
    GS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    GS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    it = resident.emplace(key, int64_t(sms) * std::max(per_sm, 1)).first;
  }
  return std::min(blocks, it->second);
}

// The step's tensors in tables of TensorTable<States, Bits>::kCapacity: launch(table, blocks) for each, blocks
// being the table's chunks. Empty tensors are left out (their steps are counted ahead, optim_step_cuda).
template <int States, int Bits, class Launch>
void for_each_table(const OptimStepArgs& a, const OptimTensor* tensors, int count, Launch launch) {
  using Table = TensorTable<States, Bits>;
  static_assert(sizeof(Table) <= LaunchTablePolicy::kArgumentBytes + Table::kScaleBytes,
                "the tensor table fits its bytes");
  int64_t blocks = 0, chunk_base = 0;  // this launch's chunks so far; the step's before this launch and in it
  const auto new_table = [&] {
    Table table{};
    if (update_counts_steps(a)) {
      table.step_increment = 1.0f;
      table.finish_counter = a.finish_counter;
    }
    table.first_chunk = chunk_base;
    return table;
  };
  Table table = new_table();
  auto flush = [&]() {
    table.first_block[table.count] = blocks;
    if (blocks > 0) launch(static_cast<const Table&>(table), blocks);
    table = new_table();
    blocks = 0;
  };
  for (int t = 0; t < count; ++t) {
    const OptimTensor& x = tensors[t];
    if (x.numel == 0) continue;  // no update: its step is counted ahead (optim_step_cuda)
    const int i = table.count++;
    table.tensor[i].param = x.param;
    table.tensor[i].grad = x.grad;
    for (int j = 0; j < States; ++j) {
      if constexpr (Bits == 8) {
        table.tensor[i].state[j] = x.codes[j];
        table.tensor[i].absmax[j] = x.absmax[j];
      } else {
        table.tensor[i].state[j] = x.state[j];
      }
    }
    table.step[i] = x.step;
    table.tensor[i].numel = x.numel;
    table.first_block[i] = blocks;
    table.factor_index[i] = t;
    blocks += chunk_count(x.numel);
    chunk_base += chunk_count(x.numel);
    if (table.count == Table::kCapacity) flush();
  }
  if (table.count > 0) flush();
}

}  // namespace
}  // namespace graphsafe
