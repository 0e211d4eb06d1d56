// Shared by both optimizer backends: the fixed chunking of layer-wise norms and the workspace layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/numeric.h"
#include "graphsafe/optim.h"

namespace graphsafe::optim_detail {

// Elements per norm chunk (LAMB/LARS pass 1). Each chunk's squared norms are summed in a fixed order, and
// so are a tensor's chunk sums (NormTree below), so the norms never depend on scheduling. The CUDA backend
// also uses it as the elements one thread block updates.
inline constexpr int64_t kChunkElements = 4096;

inline int64_t chunk_count(int64_t numel) { return (numel + kChunkElements - 1) / kChunkElements; }

// The order in which LAMB/LARS squared norms are added, the same on both backends (so they agree bit for
// bit). It is the CUDA kernels' natural order: in a chunk, thread t of kNormThreads owns elements
// 4t..4t+3 of every 1024-element pass and adds its elements in increasing index; then a tree halves the
// kNormThreads partial sums (slot t += slot t + half, half = 128, 64, ..., 1). A tensor's chunk sums are
// combined the same way: slot t adds chunks t, t + kNormThreads, ... in order, then the tree.
inline constexpr int kNormThreads = 256;
inline constexpr int kNormVector = 4;  // consecutive elements per thread and pass

inline int norm_slot_of_element(int64_t offset_in_chunk) {
  return static_cast<int>(offset_in_chunk % (kNormThreads * kNormVector)) / kNormVector;
}

struct NormTree {
  float param[kNormThreads] = {};
  float update[kNormThreads] = {};
  void add(int slot, float p, float u) {
    param[slot] += p;
    update[slot] += u;
  }
  // The tree; the partial sums are consumed.
  void total(float& p, float& u) {
    for (int half = kNormThreads / 2; half > 0; half /= 2)
      for (int t = 0; t < half; ++t) {
        param[t] += param[t + half];
        update[t] += update[t + half];
      }
    p = param[0];
    u = update[0];
  }
};

// Workspace of a layer-wise step: two floats (param, update) per chunk of every tensor, then one factor
// per tensor. Element-wise algorithms need none.
struct LayerwiseLayout {
  int64_t total_chunks = 0;
  std::size_t bytes = 0;
  std::size_t factors_offset = 0;  // in floats
};

inline LayerwiseLayout layerwise_layout(const int64_t* numels, int count) {
  LayerwiseLayout l;
  for (int t = 0; t < count; ++t) l.total_chunks += chunk_count(numels[t]);
  l.factors_offset = static_cast<std::size_t>(2 * l.total_chunks);
  l.bytes = (l.factors_offset + static_cast<std::size_t>(count)) * sizeof(float);
  return l;
}

// Validates options, dtype and every tensor's pointers; throws std::invalid_argument (both backends).
void check_step_args(const OptimStepArgs& args, const OptimTensor* tensors, int count);

// check_step_args for optim_layerwise_norms_*, which also needs a layer-wise algorithm and a norms pointer.
void check_layerwise_norms_args(const OptimStepArgs& args, const OptimTensor* tensors, int count, const float* norms);

// Whether a step may run with this learning rate: >= 0, +inf included (NaN and negative values are refused, as
// torch refuses them). The CPU checks it on the host (check_learning_rate), the CUDA kernels on the device.
GS_HD bool usable_learning_rate(float lr) { return lr >= 0.0f; }

// Throws std::invalid_argument for an unusable learning rate (the CPU step, before it writes anything).
void check_learning_rate(float lr);

}  // namespace graphsafe::optim_detail
