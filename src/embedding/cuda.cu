// CUDA backend of the embedding backward, dense result (the row-sparse one is cuda_sparse.cu; the kernels both
// share are in backward_kernels.cuh).
//
// 1. make_sort_keys: one (row, position) pair per occurrence; padding and out-of-range occurrences get the
//    sentinel row num_weights (out-of-range ones are also reported in the device error record). It also clears
//    the row flags.
// 2. A stable radix sort of the pairs by row: each row's occurrences end up in increasing position.
// 3. reduce_tiles / reduce_tile_groups / reduce_long_rows: the three levels of the reduction order in
//    embedding.h. Each level finishes the rows that end inside its unit and leaves partial sums of longer
//    rows for the next level, so work stays spread evenly and searches are short and rare. Level 1 flags
//    each row it starts (one store per row, wherever its occurrences were).
// 4. zero_untouched_rows: zero every row that was not flagged (each output byte is written once).
// Steps 3 and 4 are dependent launches (common/dependent_launch.cuh), which hides the gaps between them.
// All buffers are sized from shapes; grids cover every tile and threads exit early, so nothing is read
// back to the host and the whole sequence can be captured in a CUDA graph.
// Small problems (few indices; embedding_backward_cuda_small_path decides from shapes) take cuda_small.cu's two
// launches instead, which use the same workspace layout and give the same bits.
#include <string>

#include "embedding/backward_kernels.cuh"

namespace graphsafe {
namespace {

// Zero-fills the rows no occurrence touches. Each warp takes 32 consecutive rows at a time, in a grid-stride loop: its
// lanes read the 32 row flags at once (one 32-byte access) and the warp stores the untouched rows, its lanes on
// consecutive vectors (rows of fewer than 32 vectors: the untouched rows' vectors of all 32 rows spread over the
// lanes). Where nearly every row is touched, as at large N, the fill is then one flag load per lane, where a loop
// that read one row's flag after another waited on each in turn.
constexpr int64_t kMaxZeroBlocks = 4096;
constexpr int kWarp = 32;

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    zero_untouched_rows(T* __restrict__ out, const uint8_t* __restrict__ row_occurs, int64_t num_weights,
                        int64_t vectors_per_row) {
  wait_for_preceding_kernel();  // level 3 (launch_dependent), after level 1 has flagged the rows it sums
  Pack<T, VEC> zero;
#pragma unroll
  for (int k = 0; k < VEC; ++k) zero.v[k] = ElementTraits<T>::store(0);
  Pack<T, VEC>* const vectors = reinterpret_cast<Pack<T, VEC>*>(out);
  const int lane = threadIdx.x % kWarp;
  const int64_t warps_in_grid = int64_t(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t first = (int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp) * kWarp;
       first < num_weights; first += warps_in_grid * kWarp) {  // warp-uniform: every lane takes part in the ballot
    unsigned untouched = __ballot_sync(0xffffffffu, first + lane < num_weights && !row_occurs[first + lane]);
    if (untouched == 0) continue;
    if (vectors_per_row >= kWarp) {
      for (; untouched != 0; untouched &= untouched - 1) {
        const int64_t row = first + __ffs(untouched) - 1;
        for (int64_t v = lane; v < vectors_per_row; v += kWarp) vectors[row * vectors_per_row + v] = zero;
      }
    } else {
      for (int64_t u = lane; u < kWarp * vectors_per_row; u += kWarp)
        if ((untouched >> (u / vectors_per_row)) & 1u) vectors[first * vectors_per_row + u] = zero;
    }
  }
}

template <class T, int VEC>
void zero_untouched(const EmbeddingBackwardArgs& a, const Workspace& w, void* out, cudaStream_t stream) {
  const int64_t warps = (a.num_weights + kWarp - 1) / kWarp;
  const int64_t blocks = std::min((warps + kThreads / kWarp - 1) / (kThreads / kWarp), kMaxZeroBlocks);
  launch_dependent(zero_untouched_rows<T, VEC>, blocks, kThreads, 0, stream, static_cast<T*>(out),
                   w.row_occurs, a.num_weights, a.dim / VEC);
}

// Sorts, reduces and zero-fills the untouched rows, with 16-byte accesses when rows allow it.
template <class T>
void run_typed(const EmbeddingBackwardArgs& a, const Workspace& w, void* out, cudaStream_t stream) {
  constexpr int kWide = wide_vector<T>();
  sort_by_row(a, w, stream);
  if (use_wide_vectors<T>(a, out)) {
    reduce_sorted<T, kWide>(a, w, out, DenseSlot{}, w.row_occurs, stream);
    zero_untouched<T, kWide>(a, w, out, stream);
  } else {
    reduce_sorted<T, 1>(a, w, out, DenseSlot{}, w.row_occurs, stream);
    zero_untouched<T, 1>(a, w, out, stream);
  }
}

}  // namespace

std::size_t embedding_backward_cuda_sort_bytes(int64_t num_indices, int64_t num_weights) {
  std::size_t bytes = 0;
  GS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), static_cast<int>(num_indices), 0,
                                                sort_end_bit(num_weights)));
  return bytes;
}

embedding_detail::CudaWorkspaceLayout embedding_backward_dense_cuda_layout(DType grad_dtype, int64_t num_indices,
                                                                           int64_t dim, int64_t num_weights) {
  const std::size_t acc_bytes = grad_dtype == DType::Float64 ? 8 : 4;
  if (embedding_backward_cuda_small_path(num_indices, dim, num_weights, dtype_size(grad_dtype)))
    return embedding_detail::cuda_workspace_layout(num_indices, dim, /*num_row_flags=*/0, acc_bytes, /*sort_bytes=*/0);
  return embedding_detail::cuda_workspace_layout(num_indices, dim, num_weights, acc_bytes,
                                                 embedding_backward_cuda_sort_bytes(num_indices, num_weights));
}

void embedding_backward_dense_cuda(const EmbeddingBackwardArgs& a, void* out, void* workspace,
                                   std::size_t workspace_bytes, DeviceErrorRecord* error, StreamHandle stream_handle) {
  const int64_t padding_idx = validate_embedding_backward_args(a);
  const auto layout = embedding_backward_dense_cuda_layout(a.grad_dtype, a.num_indices, a.dim, a.num_weights);
  const std::size_t needed = layout.total;
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr))
    throw std::invalid_argument("embedding_backward: workspace of " + std::to_string(workspace_bytes) +
                                " bytes is smaller than the " + std::to_string(needed) + " required");
  if (error == nullptr) throw std::invalid_argument("embedding_backward: the CUDA backend needs an error record");
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  if (a.num_weights * a.dim > 0 && out == nullptr) throw std::invalid_argument("embedding_backward: null output");
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    throw std::invalid_argument("embedding_backward: the CUDA workspace must be 256-byte aligned");
  if (embedding_backward_cuda_small_path(a.num_indices, a.dim, a.num_weights, dtype_size(a.grad_dtype))) {
    // Few indices: two launches, the same bits (cuda_small.cu).
    embedding_backward_dense_cuda_small(a, padding_idx, out, workspace, layout, error, stream);
    return;
  }
  const Workspace w = carve(workspace, layout);
  launch_make_sort_keys(a, padding_idx, w, w.row_occurs, error, stream);
  if (a.num_weights == 0 || a.dim == 0) return;  // nothing to write (indices were still checked)
  if (a.num_indices == 0) {  // no occurrence: every row is zero
    GS_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<std::size_t>(a.num_weights * a.dim) * dtype_size(a.grad_dtype),
                                  stream));
    return;
  }
  switch (a.grad_dtype) {
    case DType::Float32: run_typed<float>(a, w, out, stream); break;
    case DType::Float64: run_typed<double>(a, w, out, stream); break;
    case DType::Float16: run_typed<f16_t>(a, w, out, stream); break;
    case DType::BFloat16: run_typed<bf16_t>(a, w, out, stream); break;
    default: throw std::invalid_argument("embedding_backward: unsupported grad dtype");
  }
}

}  // namespace graphsafe
