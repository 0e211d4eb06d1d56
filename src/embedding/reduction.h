// The pieces of the embedding-backward reduction order that both backends must share exactly
// (the order itself is described in include/graphsafe/embedding.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/numeric.h"
#include "graphsafe/embedding.h"

namespace graphsafe::embedding_detail {

// Sort key of one occurrence: its row, or num_weights for occurrences that contribute nothing (padding
// rows; out-of-range indices on CUDA). Those sort behind every real row and are never read back.
GS_HD uint32_t sort_key(int64_t index, int64_t num_weights, int64_t padding_idx) {
  const bool contributes = index >= 0 && index < num_weights && index != padding_idx;
  return static_cast<uint32_t>(contributes ? index : num_weights);
}

// Slot of a chunk's partial sum in the partial buffer, for rows longer than one chunk. `chunk_start` is the
// chunk's first position in the sorted occurrence list, `row_start` that of its row. Any window of
// kEmbeddingChunk sorted positions holds at most two chunk starts of long rows, and if two, exactly one of
// them starts its row, so the slot is unique; the buffer needs partial_slots(n) entries.
GS_HD int64_t partial_slot(int64_t chunk_start, int64_t row_start) {
  return 2 * (chunk_start / kEmbeddingChunk) + (chunk_start == row_start ? 1 : 0);
}

// Workspace pieces start on 256-byte boundaries (CUB's and vector loads' alignment needs).
inline constexpr std::size_t round_up_256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

inline constexpr int64_t partial_slots(int64_t num_indices) {
  return 2 * ((num_indices + kEmbeddingChunk - 1) / kEmbeddingChunk);
}

// Final step for one element of a row: optional division by the occurrence count, then one rounding.
template <class T>
GS_HD T finish_element(typename ElementTraits<T>::Acc total, int64_t count, bool scale_grad_by_freq) {
  using Acc = typename ElementTraits<T>::Acc;
  if (scale_grad_by_freq) total = total / static_cast<Acc>(count);
  return ElementTraits<T>::store(total);
}

}  // namespace graphsafe::embedding_detail

namespace graphsafe {
// Scratch bytes of the CUDA backend's radix sort (defined in cuda.cu, or a stand-in without CUDA).
std::size_t embedding_backward_cuda_sort_bytes(int64_t num_indices, int64_t num_weights);
}  // namespace graphsafe
