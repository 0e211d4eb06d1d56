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

// Workspace layouts: one definition serves both the size query and the carving.
struct CpuWorkspaceLayout {
  std::size_t sorted = 0;      // packed (row << 32 | position) records, uint64 per index
  std::size_t row_starts = 0;  // start of every row's run, int64 per index + 1
  std::size_t total = 0;
};

inline CpuWorkspaceLayout cpu_workspace_layout(int64_t num_indices) {
  const auto n = static_cast<std::size_t>(num_indices);
  CpuWorkspaceLayout l;
  l.row_starts = round_up_256(n * sizeof(uint64_t));
  l.total = l.row_starts + round_up_256((n + 1) * sizeof(int64_t));
  return l;
}

// Byte offsets into the CUDA workspace (which must be 256-byte aligned). The dense result flags the rows that
// occur (num_row_flags = num_weights); the row-sparse one flags none but numbers the runs with a prefix sum
// (scan_bytes of CUB scratch), whose input and output reuse keys_in and positions_in: the sort has consumed them.
struct CudaWorkspaceLayout {
  std::size_t keys_in = 0, keys_sorted = 0, positions_in = 0, positions_sorted = 0;
  std::size_t sort_scratch = 0, sort_bytes = 0;  // CUB's radix sort scratch
  std::size_t row_occurs = 0;                   // one "row occurs" byte per flagged row
  std::size_t tile_pieces = 0;                  // uint2 per tile: rows of its partial slots
  std::size_t tile_partials = 0, group_partials = 0;  // two partial rows per tile / per group
  std::size_t scan_scratch = 0, scan_bytes = 0;  // CUB's prefix-sum scratch (row-sparse only)
  std::size_t total = 0;
};

inline CudaWorkspaceLayout cuda_workspace_layout(int64_t num_indices, int64_t dim, int64_t num_row_flags,
                                                 std::size_t acc_bytes, std::size_t sort_bytes,
                                                 std::size_t scan_bytes = 0) {
  const auto n = static_cast<std::size_t>(num_indices);
  const std::size_t ids = round_up_256(n * sizeof(uint32_t));
  const std::size_t row_bytes = static_cast<std::size_t>(dim) * acc_bytes;
  CudaWorkspaceLayout l;
  l.keys_sorted = ids;
  l.positions_in = 2 * ids;
  l.positions_sorted = 3 * ids;
  l.sort_scratch = 4 * ids;
  l.sort_bytes = sort_bytes;
  l.row_occurs = l.sort_scratch + round_up_256(sort_bytes);
  l.tile_pieces = l.row_occurs + round_up_256(static_cast<std::size_t>(num_row_flags));
  l.tile_partials = l.tile_pieces + round_up_256(static_cast<std::size_t>(tile_count(num_indices)) * 8);
  l.group_partials = l.tile_partials + round_up_256(2 * static_cast<std::size_t>(tile_count(num_indices)) * row_bytes);
  l.scan_scratch = l.group_partials + round_up_256(2 * static_cast<std::size_t>(tile_group_count(num_indices)) * row_bytes);
  l.scan_bytes = scan_bytes;
  l.total = l.scan_scratch + round_up_256(scan_bytes);
  return l;
}

// Slots of the row-sparse result: no more distinct rows than occurrences, nor than rows.
inline int64_t sparse_capacity(int64_t num_indices, int64_t num_weights) {
  return num_indices < num_weights ? num_indices : num_weights;
}

// Throws std::invalid_argument for a null row-sparse output that will be written (shared by both backends).
void check_sparse_outputs(const EmbeddingBackwardArgs& args, int64_t capacity, const int64_t* rows,
                          const void* row_grads, const int64_t* count);

// Final step for one element of a row: optional division by the occurrence count, then one rounding.
// A NaN result becomes the canonical NaN: x86 and CUDA arithmetic produce different NaN payloads.
template <class T>
GS_HD T finish_element(typename ElementTraits<T>::Acc total, int64_t count, bool scale_grad_by_freq) {
  using Acc = typename ElementTraits<T>::Acc;
  if (scale_grad_by_freq) total = total / static_cast<Acc>(count);
  if (total != total) return ElementTraits<T>::canonical_nan();
  return ElementTraits<T>::store(total);
}

}  // namespace graphsafe::embedding_detail

namespace graphsafe {
// Scratch bytes of the CUDA backend's radix sort and of its prefix sum over sorted positions (defined in cuda.cu,
// or stand-ins without CUDA).
std::size_t embedding_backward_cuda_sort_bytes(int64_t num_indices, int64_t num_weights);
std::size_t embedding_backward_cuda_scan_bytes(int64_t num_indices);
// The dense result's CUDA workspace, the one layout both the size query and the run use. The small path (few
// indices) runs neither CUB's sort nor the row flags, so it asks for neither (and for no CUB size query).
embedding_detail::CudaWorkspaceLayout embedding_backward_dense_cuda_layout(DType grad_dtype, int64_t num_indices,
                                                                           int64_t dim, int64_t num_weights);
}  // namespace graphsafe
