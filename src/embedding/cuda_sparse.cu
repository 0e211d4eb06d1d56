// CUDA backend of the embedding backward, row-sparse result (rows, row_grads, count; include/graphsafe/embedding.h).
//
// 1. make_sort_keys and the radix sort, as for the dense result (backward_kernels.cuh), without row flags.
// 2. mark_run_starts: 1 at each sorted position where a real row's run begins (sentinels never begin one);
//    CUB's inclusive prefix sum turns it into runs_so_far, so run k (0-based, in increasing row order) owns
//    slot runs_so_far[p] - 1 at each of its positions p, and runs_so_far[n - 1] is the count.
// 3. write_row_ids: rows[slot] at each run start, the count, and -1 / +0 in the unused slots [count, U).
// 4. The three reduce levels of the dense result, each writing a finished row to row_grads + slot * dim
//    where the dense one writes out + row * dim (SparseSlot): same sums, same order, same bits.
// Untouched rows have no slot, so nothing is zero-filled beyond the unused slots. Buffers and grids are sized from
// shapes (U = min(N, num_weights)); no value is read back to the host, so the sequence can be captured.
#include <cub/device/device_scan.cuh>

#include <string>

#include "embedding/backward_kernels.cuh"

namespace graphsafe {
namespace {

__global__ void __launch_bounds__(kThreads)
    mark_run_starts(const uint32_t* __restrict__ keys, int64_t n, uint32_t sentinel, uint32_t* __restrict__ starts) {
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < n; p += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t key = keys[p];
    starts[p] = key != sentinel && (p == 0 || keys[p - 1] != key) ? 1u : 0u;
  }
}

// Grid-stride over the larger of the n sorted positions and the unused slots' elements. Every write lands in
// [0, capacity): a slot is at most the number of distinct real rows, which is at most min(n, num_weights).
template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    write_row_ids(const uint32_t* __restrict__ keys, const uint32_t* __restrict__ starts,
                  const uint32_t* __restrict__ runs_so_far, int64_t n, int64_t capacity, int64_t vectors_per_row,
                  int64_t* __restrict__ rows, T* __restrict__ row_grads, int64_t* __restrict__ count) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t used = runs_so_far[n - 1];
  for (int64_t p = first; p < n; p += stride)
    if (starts[p]) rows[runs_so_far[p] - 1] = keys[p];
  if (first == 0) *count = used;
  for (int64_t k = used + first; k < capacity; k += stride) rows[k] = -1;
  Pack<T, VEC> zero;
#pragma unroll
  for (int k = 0; k < VEC; ++k) zero.v[k] = ElementTraits<T>::store(0);
  for (int64_t u = used * vectors_per_row + first; u < capacity * vectors_per_row; u += stride)
    reinterpret_cast<Pack<T, VEC>*>(row_grads)[u] = zero;
}

template <class T, int VEC>
void finish_typed(const EmbeddingBackwardArgs& a, const Workspace& w, int64_t capacity, int64_t* rows, void* row_grads,
                  int64_t* count, cudaStream_t stream) {
  const uint32_t* starts = w.keys_in;
  const uint32_t* runs_so_far = w.positions_in;
  const int64_t vectors_per_row = a.dim / VEC;
  const int64_t items = std::max(a.num_indices, capacity * vectors_per_row);
  const auto blocks = static_cast<int>(std::min<int64_t>((items + kThreads - 1) / kThreads, 65535));
  write_row_ids<T, VEC><<<blocks, kThreads, 0, stream>>>(w.keys_sorted, starts, runs_so_far, a.num_indices, capacity,
                                                         vectors_per_row, rows, static_cast<T*>(row_grads), count);
  GS_CUDA_CHECK_LAUNCH();
  if (a.dim > 0) reduce_sorted<T, VEC>(a, w, row_grads, SparseSlot{runs_so_far}, /*row_occurs=*/nullptr, stream);
}

// Row ids, count, unused slots and row sums, with 16-byte accesses when rows allow it (the choice changes no bits).
template <class T>
void finish(const EmbeddingBackwardArgs& a, const Workspace& w, int64_t capacity, int64_t* rows, void* row_grads,
            int64_t* count, cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(T);
  if (a.dim % kWide == 0 && aligned16(a.grad) && aligned16(row_grads))
    finish_typed<T, kWide>(a, w, capacity, rows, row_grads, count, stream);
  else
    finish_typed<T, 1>(a, w, capacity, rows, row_grads, count, stream);
}

}  // namespace

std::size_t embedding_backward_cuda_scan_bytes(int64_t num_indices) {
  std::size_t bytes = 0;
  GS_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                              static_cast<uint32_t*>(nullptr), static_cast<int>(num_indices)));
  return bytes;
}

void embedding_backward_sparse_cuda(const EmbeddingBackwardArgs& a, int64_t* rows, void* row_grads, int64_t* count,
                                    void* workspace, std::size_t workspace_bytes, DeviceErrorRecord* error,
                                    StreamHandle stream_handle) {
  const int64_t padding_idx = validate_embedding_backward_args(a);
  const int64_t capacity = embedding_detail::sparse_capacity(a.num_indices, a.num_weights);
  embedding_detail::check_sparse_outputs(a, capacity, rows, row_grads, count);
  const std::size_t needed =
      embedding_backward_sparse_workspace_bytes(Backend::Cuda, a.grad_dtype, a.num_indices, a.dim, a.num_weights);
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr))
    throw std::invalid_argument("embedding_backward: workspace of " + std::to_string(workspace_bytes) +
                                " bytes is smaller than the " + std::to_string(needed) + " required");
  if (error == nullptr) throw std::invalid_argument("embedding_backward: the CUDA backend needs an error record");
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    throw std::invalid_argument("embedding_backward: the CUDA workspace must be 256-byte aligned");
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  const std::size_t acc_bytes = a.grad_dtype == DType::Float64 ? 8 : 4;
  const Workspace w = carve(workspace, embedding_detail::cuda_workspace_layout(
                                           a.num_indices, a.dim, /*num_row_flags=*/0, acc_bytes,
                                           embedding_backward_cuda_sort_bytes(a.num_indices, a.num_weights),
                                           embedding_backward_cuda_scan_bytes(a.num_indices)));
  launch_make_sort_keys(a, padding_idx, w, /*row_occurs=*/nullptr, error, stream);
  if (capacity == 0) {  // no slot (N or num_weights is 0; indices were still checked)
    GS_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(int64_t), stream));
    return;
  }
  sort_by_row(a, w, stream);
  const int n = static_cast<int>(a.num_indices);
  const auto blocks = static_cast<int>(std::min<int64_t>((a.num_indices + kThreads - 1) / kThreads, 65535));
  // The sort has consumed keys_in and positions_in: they hold the run starts and their prefix sum now.
  mark_run_starts<<<blocks, kThreads, 0, stream>>>(w.keys_sorted, a.num_indices, static_cast<uint32_t>(a.num_weights),
                                                   w.keys_in);
  GS_CUDA_CHECK_LAUNCH();
  std::size_t scan_bytes = w.scan_bytes;
  GS_CUDA_CHECK(cub::DeviceScan::InclusiveSum(w.scan_scratch, scan_bytes, w.keys_in, w.positions_in, n, stream));
  switch (a.grad_dtype) {
    case DType::Float32: finish<float>(a, w, capacity, rows, row_grads, count, stream); break;
    case DType::Float64: finish<double>(a, w, capacity, rows, row_grads, count, stream); break;
    case DType::Float16: finish<f16_t>(a, w, capacity, rows, row_grads, count, stream); break;
    case DType::BFloat16: finish<bf16_t>(a, w, capacity, rows, row_grads, count, stream); break;
    default: throw std::invalid_argument("embedding_backward: unsupported grad dtype");
  }
}

}  // namespace graphsafe
