// What both backends' row-sparse steps (graphsafe/optim_sparse.h) share: the checks of a call and the workspace
// layout (the valid prefix's length on CUDA, the LAMB/LARS route's dense gradient, the dense step's workspace).
#pragma once

#include <cstddef>
#include <cstdint>

#include "graphsafe/optim.h"
#include "graphsafe/optim_sparse.h"
#include "optim/layout.h"
#include "optim/rules.h"

namespace graphsafe::optim_detail {

// LAMB and LARS take the dense route (optim_sparse.h says why).
inline bool sparse_step_goes_dense(const OptimOptions& o) { return is_layerwise(o.algorithm); }

inline std::size_t round_up_to_256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// The workspace of a sparse step, the same on both backends: from valid_rows (CUDA) the length of the list's valid
// prefix as a uint64 (sparse.cu); for the dense route from dense_gradient the dense gradient (numel elements of the
// parameter's dtype); from step_workspace the dense step's own workspace (LAMB/LARS norms, a schedule's float64).
// Every piece starts on a 256-byte boundary of a 256-byte aligned workspace.
struct SparseWorkspaceLayout {
  std::size_t valid_rows = 0, dense_gradient = 0, step_workspace = 0;
  std::size_t bytes = 0;
};

inline SparseWorkspaceLayout sparse_workspace_layout(Backend backend, const OptimOptions& o, DType param_dtype,
                                                     int64_t numel) {
  SparseWorkspaceLayout l;
  l.dense_gradient = l.step_workspace = 256;
  if (sparse_step_goes_dense(o))
    l.step_workspace += round_up_to_256(static_cast<std::size_t>(numel) * dtype_size(param_dtype));
  l.bytes = l.step_workspace + optim_workspace_bytes(backend, o, &numel, 1);
  return l;
}

// The checks both backends make before anything is launched or written (std::invalid_argument): the step's own
// (check_step_args over the one tensor), skip_zeros on, increment_steps on, the gradient's sizes and pointers, and
// the workspace. The rows and the count are data: the CPU checks them itself, CUDA in its kernels.
void check_sparse_step_args(Backend backend, const OptimStepArgs& args, const OptimTensor& tensor,
                            const OptimSparseGradient& gradient, const void* workspace, std::size_t workspace_bytes);

}  // namespace graphsafe::optim_detail
