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

// Workspace pieces start on 256-byte boundaries (CUB's and vector loads' alignment needs).
inline constexpr std::size_t round_up_256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

GS_HD int64_t tile_count(int64_t num_sorted) { return (num_sorted + kEmbeddingTile - 1) / kEmbeddingTile; }
GS_HD int64_t tile_group_count(int64_t num_sorted) {
  return (tile_count(num_sorted) + kEmbeddingTileGroup - 1) / kEmbeddingTileGroup;
}

// A tile (or group) holds at most two pieces of rows that reach beyond it: the row it starts with, if that
// row began earlier (slot 2i), and the row it ends with, if that row goes on and began inside it (slot 2i+1).
// Partial-sum buffers therefore hold two slots per tile (per group).
GS_HD int64_t piece_slot(int64_t tile_or_group, bool row_began_earlier) {
  return 2 * tile_or_group + (row_began_earlier ? 0 : 1);
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
