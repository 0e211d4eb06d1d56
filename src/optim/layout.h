// Shared by both optimizer backends: the fixed chunking of layer-wise norms and the workspace layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include "graphsafe/optim.h"

namespace graphsafe::optim_detail {

// Elements per norm chunk (LAMB/LARS pass 1). Each chunk's squared norms are summed in a fixed order and
// the chunks of a tensor are added in order, so the norms never depend on scheduling. The CUDA backend
// also uses it as the elements one thread block updates.
inline constexpr int64_t kChunkElements = 4096;

inline int64_t chunk_count(int64_t numel) { return (numel + kChunkElements - 1) / kChunkElements; }

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

}  // namespace graphsafe::optim_detail
