// Row-sparse embedding backward (embedding_backward_sparse_*) against the dense CPU entry point: the listed rows
// are exactly the rows the dense result touches, strictly increasing, each bit for bit the dense row; unused
// slots are -1 and +0. CUDA against CPU, bitwise, where a GPU and the CUDA backend exist.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "graphsafe/embedding.h"
#include "graphsafe/errors.h"

#if defined(GRAPHSAFE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace graphsafe;

namespace {

struct Problem {
  int64_t num_weights = 0, dim = 0;
  std::vector<int64_t> indices;
  std::vector<double> grad;  // [indices.size(), dim], stored as double, converted per test dtype
};

// Indices from a skewed distribution: row k drawn with probability ~ 1/(k+1), so some rows repeat thousands of
// times (runs over tiles and tile groups) and many occur once.
Problem make_problem(int64_t num_weights, int64_t dim, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p;
  p.num_weights = num_weights;
  p.dim = dim;
  p.indices.resize(n);
  p.grad.resize(n * dim);
  std::vector<double> weights(num_weights);
  for (int64_t k = 0; k < num_weights; ++k) weights[k] = 1.0 / static_cast<double>(k + 1);
  std::discrete_distribution<int64_t> row(weights.begin(), weights.end());
  std::normal_distribution<double> value(0.0, 1.0);
  for (auto& i : p.indices) i = (row(rng) * 7919) % num_weights;  // scatter the hot rows over the table
  for (auto& g : p.grad) g = value(rng);
  return p;
}

template <class T>
struct Sparse {
  std::vector<int64_t> rows;
  std::vector<T> row_grads;
  int64_t count = -123;
};

template <class T, class Index>
EmbeddingBackwardArgs args_for(const Problem& p, const std::vector<T>& grad, const std::vector<Index>& indices,
                               int64_t padding_idx, bool scale) {
  EmbeddingBackwardArgs a;
  a.grad = grad.data();
  a.grad_dtype = std::is_same_v<T, double> ? DType::Float64 : DType::Float32;
  a.indices = indices.data();
  a.index_dtype = std::is_same_v<Index, int32_t> ? DType::Int32 : DType::Int64;
  a.num_indices = static_cast<int64_t>(indices.size());
  a.dim = p.dim;
  a.num_weights = p.num_weights;
  a.padding_idx = padding_idx;
  a.scale_grad_by_freq = scale;
  return a;
}

template <class T>
std::vector<T> dense_cpu(const EmbeddingBackwardArgs& a) {
  std::vector<unsigned char> ws(
      embedding_backward_workspace_bytes(Backend::Cpu, a.grad_dtype, a.num_indices, a.dim, a.num_weights));
  std::vector<T> out(a.num_weights * a.dim, T(-7));
  embedding_backward_dense_cpu(a, out.data(), ws.data(), ws.size());
  return out;
}

int64_t capacity_of(const EmbeddingBackwardArgs& a) { return std::min(a.num_indices, a.num_weights); }

template <class T>
Sparse<T> sparse_cpu(const EmbeddingBackwardArgs& a) {
  std::vector<unsigned char> ws(
      embedding_backward_sparse_workspace_bytes(Backend::Cpu, a.grad_dtype, a.num_indices, a.dim, a.num_weights));
  const int64_t u = capacity_of(a);
  Sparse<T> s{std::vector<int64_t>(u, 99), std::vector<T>(u * a.dim, T(-7))};  // poisoned: all must be written
  embedding_backward_sparse_cpu(a, s.rows.data(), s.row_grads.data(), &s.count, ws.data(), ws.size());
  return s;
}

bool same_bits(const void* a, const void* b, std::size_t bytes) { return bytes == 0 || std::memcmp(a, b, bytes) == 0; }

// The sparse result is the dense one, compacted: every check of the contract against an independent reading of
// the dense buffer.
template <class T>
void expect_sparse_matches_dense(const EmbeddingBackwardArgs& a, const Sparse<T>& s, const std::vector<T>& dense,
                                 const std::string& what) {
  const int64_t u = capacity_of(a), d = a.dim;
  const int64_t pad = a.padding_idx < -1 ? a.padding_idx + a.num_weights : a.padding_idx;
  std::vector<bool> occurs(a.num_weights, false);
  const auto* idx64 = static_cast<const int64_t*>(a.indices);
  const auto* idx32 = static_cast<const int32_t*>(a.indices);
  for (int64_t i = 0; i < a.num_indices; ++i) {
    const int64_t r = a.index_dtype == DType::Int32 ? idx32[i] : idx64[i];
    if (r != pad) occurs[r] = true;
  }
  std::vector<int64_t> expected_rows;
  for (int64_t r = 0; r < a.num_weights; ++r)
    if (occurs[r]) expected_rows.push_back(r);
  ASSERT_EQ(s.count, static_cast<int64_t>(expected_rows.size())) << what;
  ASSERT_EQ(static_cast<int64_t>(s.rows.size()), u) << what;
  for (int64_t k = 0; k < u; ++k) {
    if (k < s.count) {
      ASSERT_EQ(s.rows[k], expected_rows[k]) << what << " slot " << k;
      if (d > 0)  // (D = 0: nothing to compare, and no element to take the address of)
        EXPECT_TRUE(same_bits(s.row_grads.data() + k * d, dense.data() + s.rows[k] * d, d * sizeof(T)))
            << what << " slot " << k;
    } else {
      ASSERT_EQ(s.rows[k], -1) << what << " slot " << k;
      for (int64_t c = 0; c < d; ++c) {
        const T zero = T(0);
        EXPECT_TRUE(same_bits(&s.row_grads[k * d + c], &zero, sizeof(T))) << what << " unused slot " << k;
      }
    }
  }
}

template <class T, class Index>
void check_case(const Problem& p, int64_t padding_idx, bool scale, const std::string& what) {
  std::vector<T> grad(p.grad.begin(), p.grad.end());
  std::vector<Index> indices(p.indices.begin(), p.indices.end());
  const EmbeddingBackwardArgs a = args_for<T, Index>(p, grad, indices, padding_idx, scale);
  expect_sparse_matches_dense<T>(a, sparse_cpu<T>(a), dense_cpu<T>(a), what);
}

}  // namespace

TEST(EmbeddingSparseCpu, MatchesDenseBitwise) {
  // (num_weights, dim, N): N > V, N < V, hot rows past a tile group, V not a multiple of anything.
  for (auto [v, d, n] : {std::tuple<int64_t, int64_t, int64_t>{97, 5, 3000}, {1000, 16, 300}, {3, 8, 5000},
                         {1, 4, 2100}, {4099, 3, 20000}, {50, 1, 7}}) {
    const Problem p = make_problem(v, d, n, static_cast<uint32_t>(v * 31 + d));
    for (auto [pad, scale] : {std::pair<int64_t, bool>{-1, false}, {-1, true}, {p.indices[0], false},
                              {p.indices[0], true}, {v >= 2 ? -2 : -1, true}}) {
      const std::string what = "V=" + std::to_string(v) + " D=" + std::to_string(d) + " N=" + std::to_string(n) +
                               " pad=" + std::to_string(pad) + " scale=" + std::to_string(scale);
      check_case<float, int64_t>(p, pad, scale, what + " f32/i64");
      check_case<float, int32_t>(p, pad, scale, what + " f32/i32");
      check_case<double, int64_t>(p, pad, scale, what + " f64/i64");
    }
  }
}

TEST(EmbeddingSparseCpu, EdgeShapes) {
  Problem empty;  // N = 0
  empty.num_weights = 5;
  empty.dim = 3;
  check_case<float, int64_t>(empty, -1, false, "N=0");
  Problem no_rows = make_problem(4, 3, 6, 1);  // V = 0 needs N = 0 (any index would be out of range)
  no_rows.num_weights = 0;
  no_rows.indices.clear();
  no_rows.grad.clear();
  check_case<float, int64_t>(no_rows, -1, false, "V=0");
  Problem no_dim = make_problem(9, 0, 20, 2);  // D = 0: rows and count still right
  check_case<float, int64_t>(no_dim, 3, false, "D=0");
  Problem all_padding = make_problem(9, 4, 20, 3);
  for (auto& i : all_padding.indices) i = 6;
  check_case<float, int64_t>(all_padding, 6, true, "all padding");
  Problem single = make_problem(9, 4, 1, 4);
  check_case<float, int32_t>(single, -1, false, "single index");
}

TEST(EmbeddingSparseCpu, OutOfRangeThrowsBeforeWriting) {
  Problem p = make_problem(10, 4, 50, 5);
  p.indices[37] = 10;
  std::vector<float> grad(p.grad.begin(), p.grad.end());
  const EmbeddingBackwardArgs a = args_for<float, int64_t>(p, grad, p.indices, -1, false);
  std::vector<unsigned char> ws(embedding_backward_sparse_workspace_bytes(Backend::Cpu, a.grad_dtype, 50, 4, 10));
  std::vector<int64_t> rows(10, 99);
  std::vector<float> row_grads(40, -7.0f);
  int64_t count = -123;
  EXPECT_THROW(embedding_backward_sparse_cpu(a, rows.data(), row_grads.data(), &count, ws.data(), ws.size()),
               std::out_of_range);
  EXPECT_EQ(count, -123);
  EXPECT_EQ(rows, std::vector<int64_t>(10, 99));
  EXPECT_EQ(row_grads, std::vector<float>(40, -7.0f));
}

TEST(EmbeddingSparseCpu, RejectsMissingOutputsAndWorkspace) {
  const Problem p = make_problem(10, 4, 50, 6);
  std::vector<float> grad(p.grad.begin(), p.grad.end());
  const EmbeddingBackwardArgs a = args_for<float, int64_t>(p, grad, p.indices, -1, false);
  std::vector<unsigned char> ws(embedding_backward_sparse_workspace_bytes(Backend::Cpu, a.grad_dtype, 50, 4, 10));
  std::vector<int64_t> rows(10);
  std::vector<float> row_grads(40);
  int64_t count = 0;
  EXPECT_THROW(embedding_backward_sparse_cpu(a, rows.data(), row_grads.data(), nullptr, ws.data(), ws.size()),
               std::invalid_argument);
  EXPECT_THROW(embedding_backward_sparse_cpu(a, nullptr, row_grads.data(), &count, ws.data(), ws.size()),
               std::invalid_argument);
  EXPECT_THROW(embedding_backward_sparse_cpu(a, rows.data(), nullptr, &count, ws.data(), ws.size()),
               std::invalid_argument);
  EXPECT_THROW(embedding_backward_sparse_cpu(a, rows.data(), row_grads.data(), &count, ws.data(), ws.size() - 1),
               std::invalid_argument);
}

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

template <class T>
std::vector<T> to_host(const T* d, std::size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// The row-sparse CUDA result of a float32 problem, with a canary block on both sides of every output buffer;
// the canaries are checked unchanged.
Sparse<float> sparse_cuda(const EmbeddingBackwardArgs& host_args) {
  constexpr int64_t kCanary = 64;  // elements of 0x5a bytes before and after each buffer
  const int64_t u = capacity_of(host_args), d = host_args.dim;
  EmbeddingBackwardArgs a = host_args;
  const auto* grad = static_cast<const float*>(host_args.grad);
  const auto* indices = static_cast<const int64_t*>(host_args.indices);
  float* d_grad = to_device(std::vector<float>(grad, grad + a.num_indices * d));
  int64_t* d_indices = to_device(std::vector<int64_t>(indices, indices + a.num_indices));
  a.grad = d_grad;
  a.indices = d_indices;
  int64_t *d_rows = nullptr, *d_count = nullptr;
  float* d_row_grads = nullptr;
  EXPECT_EQ(cudaMalloc(&d_rows, (u + 2 * kCanary) * sizeof(int64_t)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_row_grads, (u * d + 2 * kCanary) * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_count, (1 + 2 * kCanary) * sizeof(int64_t)), cudaSuccess);
  cudaMemset(d_rows, 0x5a, (u + 2 * kCanary) * sizeof(int64_t));
  cudaMemset(d_row_grads, 0x5a, (u * d + 2 * kCanary) * sizeof(float));
  cudaMemset(d_count, 0x5a, (1 + 2 * kCanary) * sizeof(int64_t));
  const std::size_t ws_bytes =
      embedding_backward_sparse_workspace_bytes(Backend::Cuda, a.grad_dtype, a.num_indices, d, a.num_weights);
  void* d_ws = nullptr;
  EXPECT_EQ(cudaMalloc(&d_ws, std::max<std::size_t>(1, ws_bytes)), cudaSuccess);
  embedding_backward_sparse_cuda(a, d_rows + kCanary, d_row_grads + kCanary, d_count + kCanary, d_ws, ws_bytes,
                                 device_error_record(), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto rows = to_host(d_rows, u + 2 * kCanary);
  const auto row_grads = to_host(d_row_grads, u * d + 2 * kCanary);
  const auto count = to_host(d_count, 1 + 2 * kCanary);
  auto canary_intact = [](const void* p, std::size_t bytes) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < bytes; ++i)
      if (b[i] != 0x5a) return false;
    return true;
  };
  EXPECT_TRUE(canary_intact(rows.data(), kCanary * 8) && canary_intact(rows.data() + kCanary + u, kCanary * 8));
  EXPECT_TRUE(canary_intact(row_grads.data(), kCanary * 4) &&
              canary_intact(row_grads.data() + kCanary + u * d, kCanary * 4));
  EXPECT_TRUE(canary_intact(count.data(), kCanary * 8) && canary_intact(count.data() + kCanary + 1, kCanary * 8));
  Sparse<float> s{std::vector<int64_t>(rows.begin() + kCanary, rows.begin() + kCanary + u),
                  std::vector<float>(row_grads.begin() + kCanary, row_grads.begin() + kCanary + u * d),
                  count[kCanary]};
  cudaFree(d_grad); cudaFree(d_indices); cudaFree(d_rows); cudaFree(d_row_grads); cudaFree(d_count); cudaFree(d_ws);
  return s;
}

}  // namespace

TEST(EmbeddingSparseCuda, MatchesCpuBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (auto [v, d, n] : {std::tuple<int64_t, int64_t, int64_t>{97, 5, 3000}, {1000, 16, 300}, {3, 8, 5000},
                         {4099, 64, 20000}, {9, 0, 20}, {5, 3, 0}}) {
    const Problem p = make_problem(v, d, n, static_cast<uint32_t>(v + d));
    std::vector<float> grad(p.grad.begin(), p.grad.end());
    for (auto [pad, scale] : {std::pair<int64_t, bool>{-1, false}, {n > 0 ? p.indices[0] : -1, true}}) {
      const EmbeddingBackwardArgs a = args_for<float, int64_t>(p, grad, p.indices, pad, scale);
      const Sparse<float> cpu = sparse_cpu<float>(a);
      const Sparse<float> cuda = sparse_cuda(a);
      EXPECT_EQ(cuda.count, cpu.count);
      EXPECT_EQ(cuda.rows, cpu.rows);
      EXPECT_TRUE(same_bits(cuda.row_grads.data(), cpu.row_grads.data(), cpu.row_grads.size() * sizeof(float)));
    }
  }
  EXPECT_EQ(take_device_error(true), "");
}

TEST(EmbeddingSparseCuda, OutOfRangeIndexIsReportedAndGetsNoSlot) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Problem p = make_problem(10, 4, 6, 7);
  p.indices = {1, 2, 12, 1, -3, 9};
  std::vector<float> grad(p.grad.begin(), p.grad.end());
  const Sparse<float> cuda = sparse_cuda(args_for<float, int64_t>(p, grad, p.indices, -1, false));
  const std::string message = take_device_error(true);
  EXPECT_NE(message.find("out of range"), std::string::npos) << message;
  Problem valid = p;
  valid.indices = {1, 2, 1, 9};
  std::vector<float> valid_grad;
  for (std::size_t i : {0, 1, 3, 5}) valid_grad.insert(valid_grad.end(), grad.begin() + i * 4, grad.begin() + (i + 1) * 4);
  const Sparse<float> expected = sparse_cpu<float>(args_for<float, int64_t>(valid, valid_grad, valid.indices, -1, false));
  EXPECT_EQ(cuda.count, 3);
  EXPECT_EQ(std::vector<int64_t>(cuda.rows.begin(), cuda.rows.begin() + 4), expected.rows);  // 1, 2, 9, -1
  EXPECT_EQ(cuda.rows[4], -1);
  EXPECT_EQ(cuda.rows[5], -1);
  EXPECT_TRUE(same_bits(cuda.row_grads.data(), expected.row_grads.data(), 4 * 4 * sizeof(float)));
  for (std::size_t i = 16; i < cuda.row_grads.size(); ++i) EXPECT_EQ(cuda.row_grads[i], 0.0f);
  EXPECT_EQ(take_device_error(true), "");
}
#else
TEST(EmbeddingSparseCuda, SkippedWithoutCudaBackend) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
