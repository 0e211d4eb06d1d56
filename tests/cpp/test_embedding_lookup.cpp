// The embedding lookup copies rows: CPU against a hand-written gather, CUDA against the CPU; a bad index
// throws on the CPU and gives a zero row plus an error record on CUDA.
#include <gtest/gtest.h>

#include <random>
#include <stdexcept>
#include <vector>

#include "graphsafe/embedding.h"
#include "graphsafe/errors.h"

#if defined(GRAPHSAFE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace graphsafe;

namespace {
EmbeddingLookupArgs lookup_args(const std::vector<float>& weight, const std::vector<int32_t>& indices, int64_t dim) {
  EmbeddingLookupArgs a;
  a.weight = weight.data();
  a.element_bytes = sizeof(float);
  a.indices = indices.data();
  a.index_dtype = DType::Int32;
  a.num_indices = static_cast<int64_t>(indices.size());
  a.dim = dim;
  a.num_weights = static_cast<int64_t>(weight.size()) / dim;
  return a;
}
}  // namespace

TEST(EmbeddingLookup, CpuCopiesRows) {
  const int64_t dim = 3;
  std::vector<float> weight(8 * dim);
  for (std::size_t i = 0; i < weight.size(); ++i) weight[i] = static_cast<float>(i);
  const std::vector<int32_t> indices = {7, 0, 7, 2};
  std::vector<float> out(indices.size() * dim, -1.0f);
  embedding_lookup_cpu(lookup_args(weight, indices, dim), out.data());
  for (std::size_t i = 0; i < indices.size(); ++i)
    for (int64_t c = 0; c < dim; ++c) EXPECT_EQ(out[i * dim + c], weight[indices[i] * dim + c]);
}

TEST(EmbeddingLookup, CpuRejectsOutOfRangeBeforeWriting) {
  std::vector<float> weight(8 * 2, 1.0f);
  const std::vector<int32_t> indices = {1, 8};
  std::vector<float> out(4, -1.0f);
  EXPECT_THROW(embedding_lookup_cpu(lookup_args(weight, indices, 2), out.data()), std::out_of_range);
  EXPECT_EQ(out, std::vector<float>(4, -1.0f));
}

#if defined(GRAPHSAFE_WITH_CUDA)
TEST(EmbeddingLookup, CudaMatchesCpuAndZeroesBadRows) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t dim = 5, rows = 40;  // 20-byte rows: the narrow copy path
  std::vector<float> weight(rows * dim);
  std::mt19937 rng(3);
  for (auto& w : weight) w = static_cast<float>(rng() % 1000);
  std::vector<int32_t> indices = {0, 39, 12, 40, 5, -2};
  float *d_weight, *d_out;
  int32_t* d_indices;
  ASSERT_EQ(cudaMalloc(&d_weight, weight.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, indices.size() * dim * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_indices, indices.size() * 4), cudaSuccess);
  cudaMemcpy(d_weight, weight.data(), weight.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(d_indices, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice);
  EmbeddingLookupArgs a = lookup_args(weight, indices, dim);
  a.weight = d_weight;
  a.indices = d_indices;
  embedding_lookup_cuda(a, d_out, device_error_record(), nullptr);
  std::vector<float> out(indices.size() * dim);
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (std::size_t i = 0; i < indices.size(); ++i)
    for (int64_t c = 0; c < dim; ++c) {
      const bool valid = indices[i] >= 0 && indices[i] < rows;
      EXPECT_EQ(out[i * dim + c], valid ? weight[indices[i] * dim + c] : 0.0f) << i;
    }
  EXPECT_NE(take_device_error(true).find("out of range for an embedding with 40 rows"), std::string::npos);
  cudaFree(d_weight); cudaFree(d_out); cudaFree(d_indices);
}
#endif
