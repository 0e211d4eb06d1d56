// CUDA backend of the embedding backward.
//
// 1. make_sort_keys: one (row, position) pair per occurrence; padding and out-of-range occurrences get the
//    sentinel row num_weights (out-of-range ones are also reported in the device error record).
// 2. A stable radix sort of the pairs by row: each row's occurrences end up in increasing position.
// 3. sum_chunks: every kEmbeddingChunk-th occurrence of a row leads a chunk and sums it. A row that fits
//    in one chunk is finished and written here; longer rows leave their chunk sums in a partial buffer.
// 4. combine_partials: each long row adds its chunk sums in order and is written.
// All buffers are sized from shapes; grids cover every sorted position and threads exit early, so nothing
// is read back to the host and the whole sequence can be captured in a CUDA graph.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <string>

#include "common/cuda_check.h"
#include "embedding/reduction.h"
#include "graphsafe/embedding.h"

namespace graphsafe {
namespace {

using embedding_detail::finish_element;
using embedding_detail::partial_slot;
using embedding_detail::round_up_256;
using embedding_detail::sort_key;

constexpr int kThreads = 256;
constexpr int64_t kChunk = kEmbeddingChunk;

int sort_end_bit(int64_t num_weights) {
  // Keys go up to num_weights (the sentinel) and no further.
  int bits = 1;
  while ((int64_t{1} << bits) <= num_weights) ++bits;
  return bits;
}

__device__ void report_index_error(DeviceErrorRecord* error, int64_t value, int64_t bound) {
  volatile DeviceErrorRecord* record = error;
  record->bad_value = value;
  record->upper_bound = bound;
  __threadfence_system();  // the details land before the code that announces them
  record->code = static_cast<int64_t>(DeviceErrorCode::IndexOutOfRange);
}

template <class Index>
__global__ void make_sort_keys(const Index* __restrict__ indices, int64_t n, int64_t num_weights, int64_t padding_idx,
                               uint32_t* __restrict__ keys, uint32_t* __restrict__ positions,
                               DeviceErrorRecord* error) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t index = static_cast<int64_t>(indices[i]);
    if (index < 0 || index >= num_weights) report_index_error(error, index, num_weights);
    keys[i] = sort_key(index, num_weights, padding_idx);
    positions[i] = static_cast<uint32_t>(i);
  }
}

// First position in [0, i] whose key equals keys[i] (keys are sorted).
__device__ int64_t row_start_of(const uint32_t* __restrict__ keys, int64_t i, uint32_t key) {
  if (i == 0 || keys[i - 1] != key) return i;
  int64_t lo = 0, hi = i - 1;  // keys[hi] == key
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// One past the last position in [i, n) whose key equals keys[i].
__device__ int64_t row_end_of(const uint32_t* __restrict__ keys, int64_t n, int64_t i, uint32_t key) {
  if (i + 1 >= n || keys[i + 1] != key) return i + 1;
  int64_t lo = i + 1, hi = n;  // keys[lo] == key; answer in (lo, hi]
  while (lo + 1 < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] == key) lo = mid; else hi = mid;
  }
  return hi;
}

// VEC consecutive elements, moved with one wide memory access.
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Threads that share one sorted position (one row-chunk): enough to cover the row's vectors, at most a block.
struct Geometry {
  int group;            // threads per sorted position
  int groups_per_block;
  int64_t blocks;
};

Geometry geometry_for(int64_t n, int64_t vectors_per_row) {
  int group = 1;
  while (group < vectors_per_row && group < kThreads) group *= 2;
  const int groups_per_block = kThreads / group;
  return {group, groups_per_block, (n + groups_per_block - 1) / groups_per_block};
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    sum_chunks(const T* __restrict__ grad, const uint32_t* __restrict__ keys, const uint32_t* __restrict__ positions,
               int64_t n, int64_t dim, uint32_t sentinel, bool scale_grad_by_freq, T* __restrict__ out,
               typename ElementTraits<T>::Acc* __restrict__ partials, int group) {
  using Acc = typename ElementTraits<T>::Acc;
  const int64_t i = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if (i >= n) return;
  const uint32_t key = keys[i];
  if (key == sentinel) return;
  const int64_t row_start = row_start_of(keys, i, key);
  if ((i - row_start) % kChunk != 0) return;  // not the first occurrence of a chunk
  const int64_t row_end = row_end_of(keys, n, i, key);
  const int64_t count = row_end - row_start;
  const int64_t chunk_end = min(i + kChunk, row_end);
  const int64_t vectors = dim / VEC;
  for (int64_t v = threadIdx.x % group; v < vectors; v += group) {
    Acc acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = Acc(0);
    // Loads are issued a batch ahead of the additions, which stay in position order.
    constexpr int kBatch = 4;
    for (int64_t j = i; j < chunk_end; j += kBatch) {
      Pack<T, VEC> batch[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (j + b < chunk_end)
          batch[b] = *reinterpret_cast<const Pack<T, VEC>*>(grad + int64_t(positions[j + b]) * dim + v * VEC);
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (j + b < chunk_end) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] += ElementTraits<T>::load(batch[b].v[k]);
        }
    }
    if (count <= kChunk) {
      Pack<T, VEC> result;
#pragma unroll
      for (int k = 0; k < VEC; ++k) result.v[k] = finish_element<T>(acc[k], count, scale_grad_by_freq);
      *reinterpret_cast<Pack<T, VEC>*>(out + int64_t(key) * dim + v * VEC) = result;
    } else {
      Pack<Acc, VEC> partial;
#pragma unroll
      for (int k = 0; k < VEC; ++k) partial.v[k] = acc[k];
      *reinterpret_cast<Pack<Acc, VEC>*>(partials + partial_slot(i, row_start) * dim + v * VEC) = partial;
    }
  }
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    combine_partials(const uint32_t* __restrict__ keys, int64_t n, int64_t dim, uint32_t sentinel,
                     bool scale_grad_by_freq, T* __restrict__ out,
                     const typename ElementTraits<T>::Acc* __restrict__ partials, int group) {
  using Acc = typename ElementTraits<T>::Acc;
  const int64_t i = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if (i >= n) return;
  const uint32_t key = keys[i];
  if (key == sentinel || (i > 0 && keys[i - 1] == key)) return;  // only the start of a row
  if (i + kChunk >= n || keys[i + kChunk] != key) return;        // short rows were finished by sum_chunks
  const int64_t row_end = row_end_of(keys, n, i, key);
  const int64_t count = row_end - i;
  const int64_t vectors = dim / VEC;
  for (int64_t v = threadIdx.x % group; v < vectors; v += group) {
    Acc total[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) total[k] = Acc(0);
    constexpr int kBatch = 4;
    for (int64_t start = i; start < row_end; start += kBatch * kChunk) {
      Pack<Acc, VEC> batch[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (start + b * kChunk < row_end)
          batch[b] = *reinterpret_cast<const Pack<Acc, VEC>*>(partials + partial_slot(start + b * kChunk, i) * dim +
                                                              v * VEC);
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (start + b * kChunk < row_end) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) total[k] += batch[b].v[k];
        }
    }
    Pack<T, VEC> result;
#pragma unroll
    for (int k = 0; k < VEC; ++k) result.v[k] = finish_element<T>(total[k], count, scale_grad_by_freq);
    *reinterpret_cast<Pack<T, VEC>*>(out + int64_t(key) * dim + v * VEC) = result;
  }
}

struct Workspace {
  uint32_t* keys_in;
  uint32_t* keys_sorted;
  uint32_t* positions_in;
  uint32_t* positions_sorted;
  void* sort_scratch;
  std::size_t sort_bytes;
  void* partials;
};

Workspace carve(void* base, int64_t n, int64_t num_weights) {
  char* p = static_cast<char*>(base);
  const std::size_t ids = round_up_256(static_cast<std::size_t>(n) * sizeof(uint32_t));
  Workspace w{};
  w.keys_in = reinterpret_cast<uint32_t*>(p);
  w.keys_sorted = reinterpret_cast<uint32_t*>(p + ids);
  w.positions_in = reinterpret_cast<uint32_t*>(p + 2 * ids);
  w.positions_sorted = reinterpret_cast<uint32_t*>(p + 3 * ids);
  w.sort_scratch = p + 4 * ids;
  w.sort_bytes = embedding_backward_cuda_sort_bytes(n, num_weights);
  w.partials = p + 4 * ids + round_up_256(w.sort_bytes);
  return w;
}

template <class T, int VEC>
void reduce_sorted(const EmbeddingBackwardArgs& a, const Workspace& w, void* out, cudaStream_t stream) {
  using Acc = typename ElementTraits<T>::Acc;
  const Geometry g = geometry_for(a.num_indices, a.dim / VEC);
  const auto sentinel = static_cast<uint32_t>(a.num_weights);
  sum_chunks<T, VEC><<<g.blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(a.grad), w.keys_sorted, w.positions_sorted, a.num_indices, a.dim, sentinel,
      a.scale_grad_by_freq, static_cast<T*>(out), static_cast<Acc*>(w.partials), g.group);
  GS_CUDA_CHECK_LAUNCH();
  combine_partials<T, VEC><<<g.blocks, kThreads, 0, stream>>>(w.keys_sorted, a.num_indices, a.dim, sentinel,
                                                              a.scale_grad_by_freq, static_cast<T*>(out),
                                                              static_cast<const Acc*>(w.partials), g.group);
  GS_CUDA_CHECK_LAUNCH();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <class T>
void reduce_sorted_dispatch(const EmbeddingBackwardArgs& a, const Workspace& w, void* out, cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(T);
  if (a.dim % kWide == 0 && aligned16(a.grad) && aligned16(out))
    reduce_sorted<T, kWide>(a, w, out, stream);
  else
    reduce_sorted<T, 1>(a, w, out, stream);
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

void embedding_backward_dense_cuda(const EmbeddingBackwardArgs& a, void* out, void* workspace,
                                   std::size_t workspace_bytes, DeviceErrorRecord* error, StreamHandle stream_handle) {
  const int64_t padding_idx = validate_embedding_backward_args(a);
  const std::size_t needed =
      embedding_backward_workspace_bytes(Backend::Cuda, a.grad_dtype, a.num_indices, a.dim, a.num_weights);
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr))
    throw std::invalid_argument("embedding_backward: workspace of " + std::to_string(workspace_bytes) +
                                " bytes is smaller than the " + std::to_string(needed) + " required");
  if (error == nullptr) throw std::invalid_argument("embedding_backward: the CUDA backend needs an error record");
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  const std::size_t out_bytes = static_cast<std::size_t>(a.num_weights * a.dim) * dtype_size(a.grad_dtype);
  if (out_bytes > 0) {
    if (out == nullptr) throw std::invalid_argument("embedding_backward: null output");
    GS_CUDA_CHECK(cudaMemsetAsync(out, 0, out_bytes, stream));  // all-zero bits are +0
  }
  if (a.num_indices == 0) return;

  const Workspace w = carve(workspace, a.num_indices, a.num_weights);
  const int n = static_cast<int>(a.num_indices);
  const int key_blocks = static_cast<int>(std::min<int64_t>((a.num_indices + kThreads - 1) / kThreads, 65535));
  if (a.index_dtype == DType::Int32)
    make_sort_keys<int32_t><<<key_blocks, kThreads, 0, stream>>>(static_cast<const int32_t*>(a.indices), n,
                                                                 a.num_weights, padding_idx, w.keys_in,
                                                                 w.positions_in, error);
  else
    make_sort_keys<int64_t><<<key_blocks, kThreads, 0, stream>>>(static_cast<const int64_t*>(a.indices), n,
                                                                 a.num_weights, padding_idx, w.keys_in,
                                                                 w.positions_in, error);
  GS_CUDA_CHECK_LAUNCH();
  if (a.dim == 0) return;  // indices were still checked
  std::size_t sort_bytes = w.sort_bytes;
  GS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(w.sort_scratch, sort_bytes, w.keys_in, w.keys_sorted,
                                                w.positions_in, w.positions_sorted, n, 0,
                                                sort_end_bit(a.num_weights), stream));
  switch (a.grad_dtype) {
    case DType::Float32: reduce_sorted_dispatch<float>(a, w, out, stream); break;
    case DType::Float64: reduce_sorted_dispatch<double>(a, w, out, stream); break;
    case DType::Float16: reduce_sorted_dispatch<f16_t>(a, w, out, stream); break;
    case DType::BFloat16: reduce_sorted_dispatch<bf16_t>(a, w, out, stream); break;
    default: throw std::invalid_argument("embedding_backward: unsupported grad dtype");
  }
}

}  // namespace graphsafe
