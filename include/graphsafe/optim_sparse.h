// Row-sparse optimizer steps: one parameter tensor updated from a gradient given as rows (an embedding table's
// gradient as embedding_backward_sparse returns it), touching only those rows.
//
// The tensor is `numel / row_length` rows of `row_length` elements. The gradient is `rows[0, count)` (distinct row
// indices, strictly increasing) with `row_grads[k]` the gradient of row rows[k]; every other row's gradient is
// zero. `count` lives in memory the step reads at run time (device memory on CUDA), so a captured step follows
// it; `capacity` rows are allocated, and rows[count, capacity) are not read.
//
// Contract: the result (parameter, every state, 8-bit codes and absmax, the step count, the schedule values) is
// bitwise identical to optim_step_* over this one tensor with the dense gradient those rows scatter into,
// options.skip_zeros on (required: without it every element of the tensor changes). What is touched:
// - element-wise algorithms, 32- and 16-bit states: the listed rows' elements only;
// - 8-bit states: the quantisation blocks that hold an element of a listed row (a block shared with an untouched
//   row is requantised as the dense step requantises it; a block size dividing row_length keeps rows apart);
// - LAMB and LARS: their trust ratio needs norms over the whole tensor, so the step scatters the rows into a dense
//   gradient in the workspace and runs the dense step (the same bits, but not row-sparse: it reads the whole
//   tensor and its states).
// The step count is incremented on every call, as the dense step increments it whatever the gradient.
// Invalid input (a row out of range, rows not increasing, count > capacity): the CPU throws std::invalid_argument
// before writing anything. CUDA, which reads the rows on the device only, steps the list's valid prefix (the entries
// before the first invalid one; a count above the capacity counts as the capacity), writes nothing out of bounds,
// and records the error (OptimStepArgs::error) for the host to raise later. The workspace
// (optim_sparse_workspace_bytes, 256-byte aligned on CUDA) holds that prefix's length.
#pragma once

#include <cstddef>
#include <cstdint>

#include "graphsafe/optim.h"

namespace graphsafe {

struct OptimSparseGradient {
  const int64_t* rows = nullptr;     // [capacity]
  const void* row_grads = nullptr;   // [capacity, row_length], the parameter's dtype
  const int64_t* count = nullptr;    // one int64: rows in use (<= capacity)
  int64_t capacity = 0;
  int64_t row_length = 0;            // > 0, divides the tensor's numel
};

// Scratch bytes of a sparse step over a tensor of `numel` elements (src/optim/sparse.h, SparseWorkspaceLayout: the
// valid prefix's length; LAMB and LARS: a dense gradient and the dense step's workspace; an algorithm with a
// schedule: one float64). Depends on sizes only; never 0.
std::size_t optim_sparse_workspace_bytes(Backend backend, const OptimOptions& options, DType param_dtype,
                                         int64_t numel);

// tensor.grad is not read (null is fine); args.increment_steps must be true (the sparse step always counts) and
// args.finish_counter and args.layerwise_norms are not used.
void optim_step_sparse_cpu(const OptimStepArgs& args, const OptimTensor& tensor, const OptimSparseGradient& gradient,
                           void* workspace, std::size_t workspace_bytes);

// Asynchronous on `stream` and capturable: reads nothing on the host; grids sized from capacity, threads past
// count exit.
void optim_step_sparse_cuda(const OptimStepArgs& args, const OptimTensor& tensor, const OptimSparseGradient& gradient,
                            void* workspace, std::size_t workspace_bytes, StreamHandle stream);

}  // namespace graphsafe
