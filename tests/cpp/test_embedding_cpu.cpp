// CPU backend of the embedding backward against two independent references: a float64 sum (accuracy) and
// a plain transcription of the documented reduction order (bitwise).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "common/numeric.h"
#include "graphsafe/embedding.h"

using namespace graphsafe;

namespace {

struct Problem {
  int64_t num_weights, dim;
  std::vector<int64_t> indices;
  std::vector<float> grad;  // [indices.size(), dim]
};

Problem make_problem(int64_t num_weights, int64_t dim, int64_t n, int64_t distinct_rows, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p{num_weights, dim, std::vector<int64_t>(n), std::vector<float>(n * dim)};
  std::uniform_int_distribution<int64_t> row(0, std::min(distinct_rows, num_weights) - 1);
  std::normal_distribution<float> value(0.0f, 1.0f);
  for (auto& i : p.indices) i = row(rng);
  for (auto& g : p.grad) g = value(rng);
  return p;
}

// The dense backward of p into `out` (num_weights * dim floats).
void run_cpu_into(const Problem& p, int64_t padding_idx, bool scale, float* out, DType index_dtype = DType::Int64) {
  std::vector<int32_t> indices32(p.indices.begin(), p.indices.end());
  EmbeddingBackwardArgs a;
  a.grad = p.grad.data();
  a.grad_dtype = DType::Float32;
  a.indices = index_dtype == DType::Int64 ? static_cast<const void*>(p.indices.data()) : indices32.data();
  a.index_dtype = index_dtype;
  a.num_indices = static_cast<int64_t>(p.indices.size());
  a.dim = p.dim;
  a.num_weights = p.num_weights;
  a.padding_idx = padding_idx;
  a.scale_grad_by_freq = scale;
  std::vector<unsigned char> ws(
      embedding_backward_workspace_bytes(Backend::Cpu, a.grad_dtype, a.num_indices, a.dim, a.num_weights));
  embedding_backward_dense_cpu(a, out, ws.data(), ws.size());
}

std::vector<float> run_cpu(const Problem& p, int64_t padding_idx, bool scale, DType index_dtype = DType::Int64) {
  std::vector<float> out(p.num_weights * p.dim, -7.0f);  // poisoned: every element must be written
  run_cpu_into(p, padding_idx, scale, out.data(), index_dtype);
  return out;
}

// The order of include/graphsafe/embedding.h, written out directly: sorted runs, tiles of 32 positions,
// groups of 32 tiles, each sum from +0 left to right.
std::vector<float> documented_order(const Problem& p, int64_t padding_idx, bool scale) {
  const int64_t T = kEmbeddingTile, G = kEmbeddingTileGroup, D = p.dim;
  std::vector<std::pair<int64_t, int64_t>> sorted;  // (row, position)
  for (int64_t i = 0; i < static_cast<int64_t>(p.indices.size()); ++i)
    if (p.indices[i] != padding_idx) sorted.emplace_back(p.indices[i], i);
  std::sort(sorted.begin(), sorted.end());
  std::vector<float> out(p.num_weights * D, 0.0f);
  for (int64_t c = 0; c < D; ++c) {
    for (std::size_t s = 0; s < sorted.size();) {
      std::size_t e = s;
      while (e < sorted.size() && sorted[e].first == sorted[s].first) ++e;
      auto occurrences = [&](int64_t from, int64_t to) {
        float acc = 0.0f;
        for (int64_t j = from; j < to; ++j) acc += p.grad[sorted[j].second * D + c];
        return acc;
      };
      auto tiles = [&](int64_t t0, int64_t t1) {
        float acc = 0.0f;
        for (int64_t t = t0; t <= t1; ++t)
          acc += occurrences(std::max<int64_t>(s, t * T), std::min<int64_t>(e, (t + 1) * T));
        return acc;
      };
      const int64_t t0 = s / T, t1 = (e - 1) / T;
      float total;
      if (t0 == t1) {
        total = occurrences(s, e);
      } else if (t0 / G == t1 / G) {
        total = tiles(t0, t1);
      } else {
        total = 0.0f;
        for (int64_t u = t0 / G; u <= t1 / G; ++u) total += tiles(std::max(t0, u * G), std::min(t1, (u + 1) * G - 1));
      }
      if (scale) total /= static_cast<float>(e - s);
      out[sorted[s].first * D + c] = total;
      s = e;
    }
  }
  return out;
}

}  // namespace

TEST(EmbeddingCpu, FollowsTheDocumentedOrderBitwise) {
  // Few distinct rows over many indices: runs span tiles and groups (> 1024 occurrences).
  for (auto [n, rows] : {std::pair<int64_t, int64_t>{500, 50}, {5000, 3}, {3000, 1}, {40, 40}}) {
    const Problem p = make_problem(60, 5, n, rows, static_cast<uint32_t>(n));
    for (auto [pad, scale] : {std::pair<int64_t, bool>{-1, false}, {1, true}, {0, false}}) {
      EXPECT_EQ(run_cpu(p, pad, scale), documented_order(p, pad, scale)) << n << " " << rows << " " << pad;
    }
  }
}

TEST(EmbeddingCpu, CloseToFloat64Sum) {
  const Problem p = make_problem(1000, 16, 20000, 700, 7);
  const auto out = run_cpu(p, 3, false, DType::Int32);
  std::vector<double> exact(p.num_weights * p.dim, 0.0), magnitude(p.num_weights * p.dim, 0.0);
  std::map<int64_t, int64_t> count;
  for (std::size_t i = 0; i < p.indices.size(); ++i) {
    if (p.indices[i] == 3) continue;
    ++count[p.indices[i]];
    for (int64_t c = 0; c < p.dim; ++c) {
      exact[p.indices[i] * p.dim + c] += p.grad[i * p.dim + c];
      magnitude[p.indices[i] * p.dim + c] += std::fabs(p.grad[i * p.dim + c]);
    }
  }
  for (int64_t r = 0; r < p.num_weights; ++r)
    for (int64_t c = 0; c < p.dim; ++c) {
      // A k-term fp32 sum errs by at most ~k * eps32 * sum|terms| (plus the final rounding).
      const double k = static_cast<double>(count.count(r) ? count[r] : 0);
      const double bound = (k + 1) * 6e-8 * magnitude[r * p.dim + c];
      EXPECT_NEAR(out[r * p.dim + c], exact[r * p.dim + c], bound) << r << "," << c;
    }
  for (int64_t c = 0; c < p.dim; ++c) EXPECT_EQ(out[3 * p.dim + c], 0.0f);  // padding row
}

TEST(EmbeddingCpu, RepeatableAndEmptyInputsWork) {
  const Problem p = make_problem(100, 8, 3000, 10, 3);
  EXPECT_EQ(run_cpu(p, -1, true), run_cpu(p, -1, true));
  Problem empty{10, 4, {}, {}};
  EXPECT_EQ(run_cpu(empty, -1, false), std::vector<float>(40, 0.0f));
  const Problem narrow = make_problem(7, 1, 100, 7, 4);  // D = 1
  EXPECT_EQ(run_cpu(narrow, -2, false), documented_order(narrow, 5, false));  // -2 means row 5
}

TEST(EmbeddingCpu, RejectsBadInputWithClearErrors) {
  Problem p = make_problem(10, 4, 20, 10, 5);
  p.indices[7] = 10;
  try {
    run_cpu(p, -1, false);
    FAIL() << "no exception";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("index 10 at position 7"), std::string::npos) << e.what();
  }
  p.indices[7] = -1;
  EXPECT_THROW(run_cpu(p, -1, false), std::out_of_range);
  p.indices[7] = 0;
  EXPECT_THROW(run_cpu(p, 10, false), std::invalid_argument);   // padding_idx == num_weights
  EXPECT_THROW(run_cpu(p, -11, false), std::invalid_argument);  // normalises below zero

  EmbeddingBackwardArgs a;
  a.grad = p.grad.data();
  a.indices = p.indices.data();
  a.num_indices = 20;
  a.dim = 4;
  a.num_weights = 10;
  std::vector<float> out(40);
  std::vector<unsigned char> ws(4);
  EXPECT_THROW(embedding_backward_dense_cpu(a, out.data(), ws.data(), ws.size()), std::invalid_argument);
  a.index_dtype = DType::Float32;
  EXPECT_THROW(validate_embedding_backward_args(a), std::invalid_argument);
  a.index_dtype = DType::Int64;
  a.grad_dtype = DType::Int32;
  EXPECT_THROW(validate_embedding_backward_args(a), std::invalid_argument);
}

TEST(EmbeddingCpu, HalfPrecisionRoundsOnceFromFp32) {
  // fp16 grads whose fp16 running sum would lose the small terms: the fp32 accumulation keeps them.
  const int64_t n = 2048;
  std::vector<f16_t> grad(n);
  for (int64_t i = 0; i < n; ++i) grad[i] = to_f16(i == 0 ? 1024.0f : 0.25f);
  std::vector<int64_t> indices(n, 0);
  EmbeddingBackwardArgs a;
  a.grad = grad.data();
  a.grad_dtype = DType::Float16;
  a.indices = indices.data();
  a.num_indices = n;
  a.dim = 1;
  a.num_weights = 1;
  std::vector<unsigned char> ws(embedding_backward_workspace_bytes(Backend::Cpu, a.grad_dtype, n, 1, 1));
  f16_t out{};
  embedding_backward_dense_cpu(a, &out, ws.data(), ws.size());
  // The exact sum 1535.75 rounds once to 1536; an fp16 running sum would have stayed at 1024.
  EXPECT_EQ(to_float(out), 1536.0f);
}

// An empty result (no rows, or rows of width 0) may come with a null output pointer, which the C library's
// memset must not be handed even for 0 bytes (UBSan's nonnull-attribute check; CI's sanitizer stage).
TEST(EmbeddingCpu, EmptyResultWithNullOutput) {
  std::vector<unsigned char> ws(embedding_backward_workspace_bytes(Backend::Cpu, DType::Float32, 3, 0, 5));
  const int64_t indices[3] = {4, 0, 4};
  EmbeddingBackwardArgs a;
  a.indices = indices;
  a.num_indices = 3;
  a.dim = 0;  // D = 0: rows of width 0, grad may be null
  a.num_weights = 5;
  EXPECT_NO_THROW(embedding_backward_dense_cpu(a, nullptr, ws.data(), ws.size()));
  a.num_indices = 0;
  a.dim = 4;
  a.num_weights = 0;  // no rows at all
  EXPECT_NO_THROW(embedding_backward_dense_cpu(a, nullptr, ws.data(), ws.size()));
  a.num_indices = 3;
  a.dim = 0;
  a.num_weights = 4;  // index 4 is out of range even though nothing would be written
  EXPECT_THROW(embedding_backward_dense_cpu(a, nullptr, ws.data(), ws.size()), std::out_of_range);
}

// Dense outputs of 4 MB and more are written once, each row its sum or zeros, with streaming stores where the
// output's memory is resident and plain ones where its last page is not (src/embedding/cpu.cpp). Both must write
// every element: a NaN-poisoned vector (resident), and a fresh mapping poisoned except its last page (judged fresh).
// Sizes just under and over 4 MB, 524-byte rows (streamed rows start off 16-byte boundaries), touched rows at both
// ends, the padding row, and no row at all to sum (every index on the padding row; no index).
TEST(EmbeddingCpu, LargeOutputsAreWrittenOnce) {
  const int64_t dim = 131, row_bytes = dim * 4, four_mb = int64_t(1) << 22;
  for (const int64_t num_weights : {four_mb / row_bytes, four_mb / row_bytes + 1, int64_t(9000)}) {
    Problem touched = make_problem(num_weights, dim, 3000, num_weights, 7);
    touched.indices[0] = 0;
    touched.indices[1] = num_weights - 1;
    touched.indices[2] = touched.indices[3] = 5;  // the padding row below
    Problem all_padding = make_problem(num_weights, dim, 40, 1, 8);
    for (auto& i : all_padding.indices) i = 5;
    const Problem no_index{num_weights, dim, {}, {}};
    for (const Problem* p : std::initializer_list<const Problem*>{&touched, &all_padding, &no_index}) {
      const std::vector<float> expected = documented_order(*p, 5, false);
      const std::size_t bytes = expected.size() * sizeof(float);
      std::vector<float> reused(expected.size(), std::nanf(""));
      run_cpu_into(*p, 5, false, reused.data());
      EXPECT_EQ(std::memcmp(reused.data(), expected.data(), bytes), 0) << num_weights << " rows, resident";
#if defined(__linux__)
      const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
      const std::size_t mapped = (bytes + page - 1) / page * page;
      void* fresh = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      ASSERT_NE(fresh, MAP_FAILED);
      (void)madvise(fresh, mapped, MADV_NOHUGEPAGE);  // poisoning must not bring the last page in with a huge one
      auto* poisoned = static_cast<float*>(fresh);
      std::fill(poisoned, poisoned + (mapped - page) / sizeof(float), std::nanf(""));
      run_cpu_into(*p, 5, false, poisoned);
      EXPECT_EQ(std::memcmp(poisoned, expected.data(), bytes), 0) << num_weights << " rows, fresh";
      munmap(fresh, mapped);
#endif
    }
  }
}
