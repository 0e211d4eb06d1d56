// CUDA backend against the CPU backend, bitwise; and out-of-range indices reported, not written.
// Skipped when the core has no CUDA backend or the machine has no GPU.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "graphsafe/embedding.h"
#include "graphsafe/errors.h"

#if defined(GRAPHSAFE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace graphsafe;

#if defined(GRAPHSAFE_WITH_CUDA)
namespace {

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<std::size_t>(1, host.size() * sizeof(T))), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

// Runs both backends on the same float32 problem; returns {cpu, cuda} results.
std::pair<std::vector<float>, std::vector<float>> run_both(const std::vector<int64_t>& indices,
                                                           const std::vector<float>& grad, int64_t num_weights,
                                                           int64_t dim, int64_t padding_idx, bool scale,
                                                           bool check_indices_on_cpu = true) {
  EmbeddingBackwardArgs a;
  a.grad = grad.data();
  a.indices = indices.data();
  a.num_indices = static_cast<int64_t>(indices.size());
  a.dim = dim;
  a.num_weights = num_weights;
  a.padding_idx = padding_idx;
  a.scale_grad_by_freq = scale;
  std::vector<float> cpu(num_weights * dim);
  if (check_indices_on_cpu) {
    std::vector<unsigned char> ws(embedding_backward_workspace_bytes(Backend::Cpu, a.grad_dtype, a.num_indices, dim, num_weights));
    embedding_backward_dense_cpu(a, cpu.data(), ws.data(), ws.size());
  }
  float* d_grad = to_device(grad);
  int64_t* d_indices = to_device(indices);
  float* d_out = nullptr;
  void* d_ws = nullptr;
  const std::size_t ws_bytes =
      embedding_backward_workspace_bytes(Backend::Cuda, a.grad_dtype, a.num_indices, dim, num_weights);
  EXPECT_EQ(cudaMalloc(&d_out, cpu.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_ws, std::max<std::size_t>(1, ws_bytes)), cudaSuccess);
  a.grad = d_grad;
  a.indices = d_indices;
  embedding_backward_dense_cuda(a, d_out, d_ws, ws_bytes, device_error_record(), nullptr);
  std::vector<float> cuda(cpu.size());
  EXPECT_EQ(cudaMemcpy(cuda.data(), d_out, cuda.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_grad); cudaFree(d_indices); cudaFree(d_out); cudaFree(d_ws);
  return {cpu, cuda};
}

}  // namespace

TEST(EmbeddingCuda, MatchesCpuBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  std::normal_distribution<float> value;
  for (auto [n, rows, dim] : {std::tuple<int64_t, int64_t, int64_t>{1000, 300, 64}, {20000, 3, 8}, {50000, 2000, 5},
                              {3000, 1, 128}}) {
    std::uniform_int_distribution<int64_t> row(0, rows - 1);
    std::vector<int64_t> indices(n);
    for (auto& i : indices) i = row(rng);
    std::vector<float> grad(n * dim);
    for (auto& g : grad) g = value(rng);
    for (auto [pad, scale] : {std::pair<int64_t, bool>{-1, false}, {0, true}}) {
      auto [cpu, cuda] = run_both(indices, grad, rows + 5, dim, pad, scale);
      EXPECT_EQ(cpu, cuda) << "n=" << n << " rows=" << rows << " dim=" << dim;
    }
  }
  EXPECT_EQ(take_device_error(true), "");
}

TEST(EmbeddingCuda, OutOfRangeIndexIsReportedAndLeftOut) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t rows = 10, dim = 4;
  std::vector<int64_t> indices = {1, 2, 12, 1, -3, 9};
  std::vector<float> grad(indices.size() * dim);
  for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(i);
  std::vector<int64_t> valid = {1, 2, 1, 9};
  std::vector<float> valid_grad;
  for (std::size_t i : {0, 1, 3, 5}) valid_grad.insert(valid_grad.end(), grad.begin() + i * dim, grad.begin() + (i + 1) * dim);
  auto [unused, cuda] = run_both(indices, grad, rows, dim, -1, false, /*check_indices_on_cpu=*/false);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto [expected, unused2] = run_both(valid, valid_grad, rows, dim, -1, false);
  EXPECT_EQ(cuda, expected);
  const std::string message = take_device_error(true);
  EXPECT_NE(message.find("out of range"), std::string::npos) << message;
  EXPECT_EQ(take_device_error(true), "");
}
TEST(EmbeddingCuda, RejectsAMisalignedWorkspace) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  EmbeddingBackwardArgs a;
  a.num_indices = 8;
  a.dim = 8;
  a.num_weights = 4;
  a.grad_dtype = DType::BFloat16;
  const std::size_t bytes = embedding_backward_workspace_bytes(Backend::Cuda, a.grad_dtype, 8, 8, 4);
  char* base = nullptr;
  ASSERT_EQ(cudaMalloc(&base, bytes + 256), cudaSuccess);
  void *grad = nullptr, *indices = nullptr, *out = nullptr;
  cudaMalloc(&grad, 8 * 8 * 2); cudaMalloc(&indices, 8 * 8); cudaMalloc(&out, 4 * 8 * 2);
  cudaMemset(indices, 0, 8 * 8);
  a.grad = grad;
  a.indices = indices;
  EXPECT_THROW(embedding_backward_dense_cuda(a, out, base + 16, bytes, device_error_record(), nullptr),
               std::invalid_argument);
  EXPECT_NO_THROW(embedding_backward_dense_cuda(a, out, base, bytes, device_error_record(), nullptr));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(base); cudaFree(grad); cudaFree(indices); cudaFree(out);
}
#else
TEST(EmbeddingCuda, SkippedWithoutCudaBackend) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
