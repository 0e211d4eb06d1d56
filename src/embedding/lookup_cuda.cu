// CUDA embedding lookup: one group of threads per looked-up row copies it in the widest unit the row's
// size and alignment allow. An out-of-range index produces a zero row and an entry in the error record,
// so a bad batch inside a replayed graph never reads out of bounds or stops the process.
#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/device_error.cuh"
#include "embedding/lookup.h"
#include "graphsafe/embedding.h"

namespace graphsafe {
namespace {

constexpr int kThreads = 256;

template <class Unit, class Index>
__global__ void __launch_bounds__(kThreads)
    gather_rows(const Unit* __restrict__ weight, const Index* __restrict__ indices, int64_t num_indices,
                int64_t num_weights, int64_t units_per_row, Unit* __restrict__ out, int group,
                DeviceErrorRecord* error) {
  const int64_t i = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if (i >= num_indices) return;
  const int64_t row = static_cast<int64_t>(indices[i]);
  const bool valid = row >= 0 && row < num_weights;
  if (!valid && threadIdx.x % group == 0) report_index_out_of_range(error, row, num_weights);
  for (int64_t u = threadIdx.x % group; u < units_per_row; u += group)
    out[i * units_per_row + u] = valid ? weight[row * units_per_row + u] : Unit{};
}

template <class Unit>
void launch(const EmbeddingLookupArgs& a, void* out, DeviceErrorRecord* error, cudaStream_t stream) {
  const int64_t units = static_cast<int64_t>(a.dim * a.element_bytes / sizeof(Unit));
  int group = 1;
  while (group < units && group < kThreads) group *= 2;
  const int64_t rows_per_block = kThreads / group;
  const int64_t blocks = (a.num_indices + rows_per_block - 1) / rows_per_block;
  const auto* weight = static_cast<const Unit*>(a.weight);
  auto* dst = static_cast<Unit*>(out);
  if (a.index_dtype == DType::Int32)
    gather_rows<Unit, int32_t><<<blocks, kThreads, 0, stream>>>(weight, static_cast<const int32_t*>(a.indices),
                                                                a.num_indices, a.num_weights, units, dst, group, error);
  else
    gather_rows<Unit, int64_t><<<blocks, kThreads, 0, stream>>>(weight, static_cast<const int64_t*>(a.indices),
                                                                a.num_indices, a.num_weights, units, dst, group, error);
  GS_CUDA_CHECK_LAUNCH();
}

}  // namespace

void embedding_lookup_cuda(const EmbeddingLookupArgs& a, void* out, DeviceErrorRecord* error, StreamHandle stream) {
  embedding_detail::validate_lookup_args(a);
  if (error == nullptr) throw std::invalid_argument("embedding: the CUDA backend needs an error record");
  const std::size_t row_bytes = static_cast<std::size_t>(a.dim) * a.element_bytes;
  if (a.num_indices == 0 || row_bytes == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  // The widest unit that divides the row and the alignment of both base pointers.
  const auto alignment = reinterpret_cast<uintptr_t>(a.weight) | reinterpret_cast<uintptr_t>(out) | row_bytes;
  if (alignment % 16 == 0) launch<uint4>(a, out, error, s);
  else if (alignment % 8 == 0) launch<uint2>(a, out, error, s);
  else if (alignment % 4 == 0) launch<uint32_t>(a, out, error, s);
  else if (alignment % 2 == 0) launch<uint16_t>(a, out, error, s);
  else launch<uint8_t>(a, out, error, s);
}

}  // namespace graphsafe
