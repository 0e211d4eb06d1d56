// Argument checks and workspace sizes shared by both embedding backends.
#include <limits>
#include <stdexcept>
#include <string>

#include "embedding/reduction.h"
#include "graphsafe/embedding.h"

namespace graphsafe {

int64_t validate_embedding_backward_args(const EmbeddingBackwardArgs& a) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("embedding_backward: " + msg); };
  if (a.grad_dtype != DType::Float32 && a.grad_dtype != DType::Float16 && a.grad_dtype != DType::BFloat16 &&
      a.grad_dtype != DType::Float64)
    fail(std::string("grad must be float32, float16, bfloat16 or float64, got ") + dtype_name(a.grad_dtype));
  if (a.index_dtype != DType::Int32 && a.index_dtype != DType::Int64)
    fail(std::string("indices must be int32 or int64, got ") + dtype_name(a.index_dtype));
  if (a.num_indices < 0 || a.dim < 0) fail("negative shape");
  if (a.num_weights < 0) fail("num_weights must be >= 0, got " + std::to_string(a.num_weights));
  // Sorted positions and keys (including the num_weights sentinel) are 32-bit.
  if (a.num_weights >= std::numeric_limits<int32_t>::max())
    fail("num_weights must be < 2^31 - 1, got " + std::to_string(a.num_weights));
  if (a.num_indices >= std::numeric_limits<int32_t>::max())
    fail("at most 2^31 - 2 indices per call, got " + std::to_string(a.num_indices));
  if (a.num_indices > 0 && a.dim > 0 && (a.grad == nullptr || a.indices == nullptr)) fail("null input pointer");
  // -1 means none; other negatives count from the end as in torch (-2 is the second-to-last row) and must
  // land on a row, not wrap around to -1.
  int64_t padding_idx = a.padding_idx;
  if (padding_idx < -1) padding_idx += a.num_weights;
  const bool valid = a.padding_idx == -1 || (padding_idx >= 0 && padding_idx < a.num_weights);
  if (!valid)
    fail("padding_idx " + std::to_string(a.padding_idx) + " is out of range for " +
         std::to_string(a.num_weights) + " rows (use -1 for none)");
  return padding_idx;
}

std::size_t embedding_backward_workspace_bytes(Backend backend, DType grad_dtype, int64_t num_indices,
                                               int64_t dim, int64_t num_weights) {
  EmbeddingBackwardArgs shape;  // the limits of validate_embedding_backward_args, before any size is computed
  shape.grad_dtype = grad_dtype;
  shape.num_indices = num_indices;
  shape.dim = dim;
  shape.num_weights = num_weights;
  shape.grad = shape.indices = &shape;  // shapes only: pointers are checked by the call itself
  validate_embedding_backward_args(shape);
  if (backend == Backend::Cpu) return embedding_detail::cpu_workspace_layout(num_indices).total;
  if (!cuda_backend_available()) throw std::runtime_error("graphsafe was built without its CUDA backend");
  return embedding_backward_dense_cuda_layout(grad_dtype, num_indices, dim, num_weights).total;
}

std::size_t embedding_backward_sparse_workspace_bytes(Backend backend, DType grad_dtype, int64_t num_indices,
                                                      int64_t dim, int64_t num_weights) {
  if (backend == Backend::Cpu)  // the same sort and runs as the dense result
    return embedding_backward_workspace_bytes(backend, grad_dtype, num_indices, dim, num_weights);
  embedding_backward_workspace_bytes(backend, grad_dtype, num_indices, dim, num_weights);  // the same checks
  const std::size_t acc_bytes = grad_dtype == DType::Float64 ? 8 : 4;
  return embedding_detail::cuda_workspace_layout(num_indices, dim, /*num_row_flags=*/0, acc_bytes,
                                                 embedding_backward_cuda_sort_bytes(num_indices, num_weights),
                                                 embedding_backward_cuda_scan_bytes(num_indices))
      .total;
}

namespace embedding_detail {

void check_sparse_outputs(const EmbeddingBackwardArgs& a, int64_t capacity, const int64_t* rows,
                          const void* row_grads, const int64_t* count) {
  if (count == nullptr) throw std::invalid_argument("embedding_backward: null row count output");
  if (capacity > 0 && rows == nullptr) throw std::invalid_argument("embedding_backward: null rows output");
  if (capacity * a.dim > 0 && row_grads == nullptr)
    throw std::invalid_argument("embedding_backward: null row_grads output");
  if (a.num_indices > 0 && a.indices == nullptr) throw std::invalid_argument("embedding_backward: null indices");
}

}  // namespace embedding_detail

DType dtype_from_name(const std::string& name) {
  for (DType t : {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64, DType::Int32, DType::Int64})
    if (name == dtype_name(t)) return t;
  throw std::invalid_argument("unsupported dtype '" + name + "'");
}

}  // namespace graphsafe
