// Deterministic, capture-safe embedding backward.
//
// Given grad[N, D] (the gradient of the looked-up rows) and indices[N], computes the dense weight gradient
// out[num_weights, D] = sum over i with indices[i] == r of grad[i], for every row r.
//
// Reduction order (identical on every backend, fixed by the input alone, so results agree bitwise):
//   * the occurrences of row r, taken in increasing position i, are split into chunks of
//     kEmbeddingChunk consecutive occurrences;
//   * each chunk is summed left to right into an accumulator that starts at +0 (fp32, or fp64 for fp64);
//   * a row with at most kEmbeddingChunk occurrences takes its single chunk sum; a longer row sums its chunk
//     sums left to right, again from +0;
//   * with scale_grad_by_freq the row total is divided by its occurrence count;
//   * the total is rounded once to grad's dtype (round to nearest even).
// Rows equal to padding_idx, and rows that never occur, are zero.
#pragma once

#include <cstddef>
#include <cstdint>

#include "graphsafe/errors.h"
#include "graphsafe/types.h"

namespace graphsafe {

// Occurrences summed sequentially before partial sums are combined. Part of the numerical contract.
inline constexpr int64_t kEmbeddingChunk = 32;

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

}  // namespace graphsafe
