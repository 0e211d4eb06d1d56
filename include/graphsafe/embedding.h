// Deterministic, capture-safe embedding backward.
//
// Given grad[N, D] (the gradient of the looked-up rows) and indices[N], computes the dense weight gradient
// out[num_weights, D] = sum over i with indices[i] == r of grad[i], for every row r.
//
// Reduction order (identical on every backend, fixed by the input alone, so results agree bitwise).
// The contributing occurrences (padding and, on CUDA, out-of-range ones excluded) are sorted by
// (row, position); a row's occurrences then form a run [s, e) of sorted positions. Sorted positions are
// cut into aligned tiles of kEmbeddingTile, and tiles into aligned groups of kEmbeddingTileGroup tiles. Every sum below runs left to right from +0, in fp32 (fp64 for fp64):
//   * a row inside one tile: the sum of its occurrences;
//   * a row spanning tiles of one group: the sum of its per-tile sums;
//   * a row spanning groups: the sum of its per-group sums (each the sum of its per-tile sums there);
//   * with scale_grad_by_freq the row total is divided by its occurrence count e - s;
//   * the total is rounded once to grad's dtype (round to nearest even).
// Rows equal to padding_idx, and rows that never occur, are zero.
// The result is either dense ([num_weights, D]) or row-sparse (the rows that receive a contribution, their
// sums, and a device-side count); both come from the same sums in the same order.
#pragma once

#include <cstddef>
#include <cstdint>

#include "graphsafe/errors.h"
#include "graphsafe/types.h"

namespace graphsafe {

// Sorted positions per tile, and tiles per group, of the reduction order above. Part of the numerical contract.
inline constexpr int64_t kEmbeddingTile = 32;
inline constexpr int64_t kEmbeddingTileGroup = 32;

struct EmbeddingBackwardArgs {
  const void* grad = nullptr;     // [num_indices, dim], contiguous, dtype grad_dtype
  DType grad_dtype = DType::Float32;
  const void* indices = nullptr;  // [num_indices], contiguous, Int32 or Int64
  DType index_dtype = DType::Int64;
  int64_t num_indices = 0;
  int64_t dim = 0;
  int64_t num_weights = 0;
  int64_t padding_idx = -1;       // -1: none; other negatives count from the end, as in torch
  bool scale_grad_by_freq = false;
};

// Bytes of scratch space embedding_backward_dense needs. Depends on shapes and dtype only, never on the
// index values, so a caller can allocate it before any data exists (and inside a graph capture).
std::size_t embedding_backward_workspace_bytes(Backend backend, DType grad_dtype, int64_t num_indices,
                                               int64_t dim, int64_t num_weights);

// Validates shapes and dtypes; throws std::invalid_argument with a readable message on bad input.
// Returns padding_idx normalised to [0, num_weights) or -1.
int64_t validate_embedding_backward_args(const EmbeddingBackwardArgs& args);

// CPU backend. out: [num_weights, dim] in grad_dtype, fully overwritten. An index outside
// [0, num_weights) throws std::out_of_range before anything is written.
void embedding_backward_dense_cpu(const EmbeddingBackwardArgs& args, void* out, void* workspace,
                                  std::size_t workspace_bytes);

// CUDA backend, asynchronous on `stream`; never reads device memory on the host. All pointers are device
// pointers. An out-of-range index is excluded from the sum and recorded in `error` (see errors.h); all
// valid rows are still correct. Throws std::runtime_error without a CUDA backend.
void embedding_backward_dense_cuda(const EmbeddingBackwardArgs& args, void* out, void* workspace,
                                   std::size_t workspace_bytes, DeviceErrorRecord* error, StreamHandle stream);

// Row-sparse result of the same sums. U = min(num_indices, num_weights) slots:
//   rows[U] (int64): rows[0, count) are the distinct rows that receive a contribution (padding_idx left out; on
//     CUDA out-of-range indices too), strictly increasing; rows[count, U) are -1.
//   row_grads[U, dim] (grad_dtype): slot k < count holds, bit for bit, row rows[k] of the dense result (same
//     reduction order); slots [count, U) are +0.
//   count (one int64): the number of distinct rows, written on the device (never read back by the call).
// Workspace sizes, like the buffers, depend on shapes only.
std::size_t embedding_backward_sparse_workspace_bytes(Backend backend, DType grad_dtype, int64_t num_indices,
                                                      int64_t dim, int64_t num_weights);

// CPU backend of the row-sparse result. An index outside [0, num_weights) throws std::out_of_range before
// anything is written.
void embedding_backward_sparse_cpu(const EmbeddingBackwardArgs& args, int64_t* rows, void* row_grads,
                                   int64_t* count, void* workspace, std::size_t workspace_bytes);

// CUDA backend of the row-sparse result, asynchronous on `stream`, as embedding_backward_dense_cuda: an
// out-of-range index is left out (it gets no slot) and recorded in `error`; nothing is written out of bounds.
void embedding_backward_sparse_cuda(const EmbeddingBackwardArgs& args, int64_t* rows, void* row_grads,
                                    int64_t* count, void* workspace, std::size_t workspace_bytes,
                                    DeviceErrorRecord* error, StreamHandle stream);

// Forward lookup out[i, :] = weight[indices[i], :] (any element type: rows are copied as bytes).
struct EmbeddingLookupArgs {
  const void* weight = nullptr;   // [num_weights, dim], contiguous
  std::size_t element_bytes = 4;  // size of one weight element
  const void* indices = nullptr;  // [num_indices], contiguous, Int32 or Int64
  DType index_dtype = DType::Int64;
  int64_t num_indices = 0;
  int64_t dim = 0;
  int64_t num_weights = 0;
};

// CPU: an index outside [0, num_weights) throws std::out_of_range before anything is written.
void embedding_lookup_cpu(const EmbeddingLookupArgs& args, void* out);

// CUDA, asynchronous on `stream`: an out-of-range index yields a zero row and is recorded in `error`;
// nothing is read out of bounds.
void embedding_lookup_cuda(const EmbeddingLookupArgs& args, void* out, DeviceErrorRecord* error, StreamHandle stream);

}  // namespace graphsafe
