// libFuzzer harness: embedding_backward_dense_cpu (include/graphsafe/embedding.h) against a plain reference.
//
// Fuzzed: grad dtype (fp32, fp16, bf16, fp64), index dtype (int32, int64), num_weights, D, number of indices,
// how many distinct rows they hit (few rows over many indices make runs that span tiles and groups),
// padding_idx (none, a row, counted from the end, invalid), scale_grad_by_freq, value families (NaN, inf,
// subnormals included), and out-of-range indices (negative, num_weights, beyond 2^31 and 2^32).
// Checked:
//   * bad padding_idx: std::invalid_argument; an index outside [0, num_weights): std::out_of_range naming the
//     first such index and its position; either way nothing written;
//   * otherwise the result equals, bit for bit, a transcription of docs/embedding.md's order (fp32 sums, fp64
//     for fp64, from +0 left to right: occurrences per tile, tiles per group, groups), divided by the count with
//     scale_grad_by_freq, rounded once (reference rounding of fuzz_common.h), NaN as the canonical NaN;
//   * and, for finite sums, the fp64 exact sum within the summation bound k * 2^-24 * sum|terms| plus the
//     final rounding (fp64 grads: 2^-53);
//   * the workspace and output buffers are exactly the sizes the API names (ASan catches a byte beyond).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fuzz_common.h"
#include "graphsafe/embedding.h"

using namespace graphsafe;

namespace {

// Storage of one element and the reference rounding of an accumulated total into it.
template <class T> struct Ref;
template <> struct Ref<float> {
  using Acc = float;
  static float load(float v) { return v; }
  static uint64_t store_bits(float total) {
    return total != total ? 0x7fc00000u : fuzz::bits_of(total);
  }
  static uint64_t bits(float v) { return fuzz::bits_of(v); }
  static constexpr double unit = 5.9604644775390625e-08;  // 2^-24
  static constexpr double smallest = 1.401298464324817e-45;
};
template <> struct Ref<double> {
  using Acc = double;
  static double load(double v) { return v; }
  static uint64_t store_bits(double total) {
    return total != total ? 0x7ff8000000000000ull : fuzz::bits_of(total);
  }
  static uint64_t bits(double v) { return fuzz::bits_of(v); }
  static constexpr double unit = 1.1102230246251565e-16;  // 2^-53
  static constexpr double smallest = 4.9406564584124654e-324;
};
template <> struct Ref<f16_t> {
  using Acc = float;
  static float load(f16_t v) {
    const uint16_t magnitude = v.bits & 0x7fff;
    const float sign = (v.bits & 0x8000) ? -1.0f : 1.0f;
    if (magnitude >= 0x7c00) return magnitude == 0x7c00 ? sign * INFINITY : NAN;
    return sign * static_cast<float>(fuzz::fp16_table().value[magnitude]);
  }
  static uint64_t store_bits(float total) { return total != total ? 0x7e00u : fuzz::fp16_table().round(total); }
  static uint64_t bits(f16_t v) { return v.bits; }
  static constexpr double unit = 4.8828125e-04;  // 2^-11
  static constexpr double smallest = 5.9604644775390625e-08;
};
template <> struct Ref<bf16_t> {
  using Acc = float;
  static float load(bf16_t v) { return fuzz::float_of(static_cast<uint32_t>(v.bits) << 16); }
  static uint64_t store_bits(float total) { return total != total ? 0x7fc0u : fuzz::bf16_table().round(total); }
  static uint64_t bits(bf16_t v) { return v.bits; }
  static constexpr double unit = 3.90625e-03;  // 2^-8
  static constexpr double smallest = 9.183549615799121e-41;
};

struct Case {
  int64_t num_weights = 0, dim = 0, padding_idx = -1;
  bool scale = false, int32_indices = false;
  std::vector<int64_t> indices;
};

// padding_idx as the library must normalise it, or -2 for an invalid one: -1 is none, other negatives count
// from the end and must land on a row.
int64_t expected_padding(int64_t padding_idx, int64_t num_weights) {
  if (padding_idx == -1) return -1;
  const int64_t p = padding_idx < -1 ? padding_idx + num_weights : padding_idx;
  return p >= 0 && p < num_weights ? p : -2;
}

// docs/embedding.md's order, written out: sorted (row, position) runs; tiles of kEmbeddingTile sorted
// positions, groups of kEmbeddingTileGroup tiles; every sum from +0, left to right.
template <class T>
std::vector<uint64_t> reference(const Case& c, int64_t padding, const std::vector<T>& grad) {
  using Acc = typename Ref<T>::Acc;
  const int64_t D = c.dim, TILE = kEmbeddingTile, GROUP = kEmbeddingTileGroup;
  std::vector<std::pair<int64_t, int64_t>> sorted;
  for (int64_t i = 0; i < static_cast<int64_t>(c.indices.size()); ++i)
    if (c.indices[i] != padding) sorted.emplace_back(c.indices[i], i);
  std::sort(sorted.begin(), sorted.end());
  std::vector<uint64_t> out(static_cast<std::size_t>(c.num_weights * D), 0);  // +0 in every dtype
  for (std::size_t s = 0; s < sorted.size();) {
    std::size_t e = s;
    while (e < sorted.size() && sorted[e].first == sorted[s].first) ++e;
    const int64_t begin = static_cast<int64_t>(s), end = static_cast<int64_t>(e);
    for (int64_t col = 0; col < D; ++col) {
      auto occurrences = [&](int64_t from, int64_t to) {
        Acc acc = 0;
        for (int64_t j = from; j < to; ++j) acc += Ref<T>::load(grad[sorted[j].second * D + col]);
        return acc;
      };
      auto tiles = [&](int64_t t0, int64_t t1) {
        Acc acc = 0;
        for (int64_t t = t0; t <= t1; ++t) acc += occurrences(std::max(begin, t * TILE), std::min(end, (t + 1) * TILE));
        return acc;
      };
      const int64_t t0 = begin / TILE, t1 = (end - 1) / TILE;
      Acc total = 0;
      if (t0 == t1) {
        total = occurrences(begin, end);
      } else if (t0 / GROUP == t1 / GROUP) {
        total = tiles(t0, t1);
      } else {
        for (int64_t g = t0 / GROUP; g <= t1 / GROUP; ++g)
          total += tiles(std::max(t0, g * GROUP), std::min(t1, (g + 1) * GROUP - 1));
      }
      if (c.scale) total = total / static_cast<Acc>(end - begin);
      out[sorted[s].first * D + col] = Ref<T>::store_bits(total);
    }
    s = e;
  }
  return out;
}

// The fp64 sum with the bound of any order of k fp32 (fp64) additions, plus the final rounding.
template <class T>
void check_accuracy(const Case& c, int64_t padding, const std::vector<T>& grad, const std::vector<T>& out) {
  const int64_t D = c.dim;
  std::vector<double> exact(static_cast<std::size_t>(c.num_weights * D), 0.0), magnitude(exact.size(), 0.0);
  std::vector<int64_t> count(static_cast<std::size_t>(c.num_weights), 0);
  for (std::size_t i = 0; i < c.indices.size(); ++i) {
    const int64_t r = c.indices[i];
    if (r == padding) continue;
    ++count[r];
    for (int64_t col = 0; col < D; ++col) {
      const double g = static_cast<double>(Ref<T>::load(grad[i * D + col]));
      exact[r * D + col] += g;
      magnitude[r * D + col] += std::fabs(g);
    }
  }
  const double acc_unit = sizeof(T) == 8 ? 1.1102230246251565e-16 : 5.9604644775390625e-08;
  for (int64_t r = 0; r < c.num_weights; ++r)
    for (int64_t col = 0; col < D; ++col) {
      const std::size_t at = static_cast<std::size_t>(r * D + col);
      const double got = static_cast<double>(Ref<T>::load(out[at]));
      if (!std::isfinite(magnitude[at]) || !std::isfinite(got) || magnitude[at] > 1e300) continue;
      const double k = static_cast<double>(count[r]);
      double want = exact[at], bound = k * acc_unit * magnitude[at];
      if (c.scale && k > 0) {
        want /= k;
        bound = bound / k + acc_unit * std::fabs(want);
      }
      bound += Ref<T>::unit * std::fabs(want) + Ref<T>::smallest;
      FUZZ_CHECK(std::fabs(got - want) <= bound * 1.0000001, "row %lld col %lld: %.17g, exact %.17g, bound %.3g\n",
                 (long long)r, (long long)col, got, want, bound);
    }
}

template <class T>
void run(FuzzedDataProvider& data, const Case& c, fuzz::Rng& rng) {
  // Gradients: one value family per problem, then raw fuzzed bits for as many elements as bytes remain.
  const int family = data.ConsumeIntegral<uint8_t>();
  const float scale = std::ldexp(1.0f, data.ConsumeIntegralInRange<int>(-30, 30));
  const int64_t n = static_cast<int64_t>(c.indices.size());
  std::vector<T> grad(static_cast<std::size_t>(n * c.dim));
  for (auto& g : grad) {
    const float v = fuzz::make_value(rng, family, scale);
    if constexpr (sizeof(T) == 8) g = static_cast<double>(v) * (1.0 + rng.uniform() * 1e-9);
    else if constexpr (sizeof(T) == 4) g = v;
    else g = ElementTraits<T>::store(v);
  }
  for (std::size_t i = 0; i < grad.size() && data.remaining_bytes() >= sizeof(T); ++i) {
    const auto raw = data.ConsumeBytes<uint8_t>(sizeof(T));
    std::memcpy(&grad[i], raw.data(), sizeof(T));
  }

  std::vector<int32_t> indices32(c.indices.begin(), c.indices.end());  // int32: out-of-range values stay in range of int32
  EmbeddingBackwardArgs a;
  a.grad = grad.data();
  a.grad_dtype = sizeof(T) == 8 ? DType::Float64 : sizeof(T) == 4 ? DType::Float32
               : std::is_same_v<T, f16_t> ? DType::Float16 : DType::BFloat16;
  a.indices = c.int32_indices ? static_cast<const void*>(indices32.data()) : c.indices.data();
  a.index_dtype = c.int32_indices ? DType::Int32 : DType::Int64;
  a.num_indices = n;
  a.dim = c.dim;
  a.num_weights = c.num_weights;
  a.padding_idx = c.padding_idx;
  a.scale_grad_by_freq = c.scale;

  const std::size_t ws_bytes =
      embedding_backward_workspace_bytes(Backend::Cpu, a.grad_dtype, n, c.dim, c.num_weights);
  std::vector<unsigned char> workspace(ws_bytes);
  // Poisoned output: on success every element must be written, on error none.
  std::vector<T> out(static_cast<std::size_t>(c.num_weights * c.dim));
  fuzz::fill_bytes(out.data(), 0xA5, out.size() * sizeof(T));
  const std::vector<T> poisoned = out;

  const int64_t padding = expected_padding(c.padding_idx, c.num_weights);
  int64_t first_bad = -1;
  for (int64_t i = 0; i < n && first_bad < 0; ++i) {
    const int64_t v = c.int32_indices ? indices32[i] : c.indices[i];
    if (v < 0 || v >= c.num_weights) first_bad = i;
  }
  auto untouched = [&] { return fuzz::same_bytes(out.data(), poisoned.data(), out.size() * sizeof(T)); };
  try {
    embedding_backward_dense_cpu(a, out.data(), workspace.data(), workspace.size());
  } catch (const std::invalid_argument& e) {
    FUZZ_CHECK(padding == -2, "unexpected invalid_argument: %s\n", e.what());
    FUZZ_CHECK(untouched(), "output written before invalid_argument\n");
    return;
  } catch (const std::out_of_range& e) {
    FUZZ_CHECK(padding != -2 && first_bad >= 0, "unexpected out_of_range: %s\n", e.what());
    const int64_t v = c.int32_indices ? indices32[first_bad] : c.indices[first_bad];
    const std::string want = "index " + std::to_string(v) + " at position " + std::to_string(first_bad);
    FUZZ_CHECK(std::string(e.what()).find(want) != std::string::npos, "message '%s' lacks '%s'\n", e.what(),
               want.c_str());
    FUZZ_CHECK(untouched(), "output written before out_of_range\n");
    return;
  }
  FUZZ_CHECK(padding != -2, "invalid padding_idx %lld accepted for %lld rows\n", (long long)c.padding_idx,
             (long long)c.num_weights);
  FUZZ_CHECK(first_bad < 0, "out-of-range index at position %lld accepted\n", (long long)first_bad);

  Case in_range = c;
  if (c.int32_indices) in_range.indices.assign(indices32.begin(), indices32.end());
  const std::vector<uint64_t> want = reference<T>(in_range, padding, grad);
  for (std::size_t i = 0; i < out.size(); ++i)
    FUZZ_CHECK(Ref<T>::bits(out[i]) == want[i], "element %zu (row %lld col %lld): bits %llx, documented order %llx\n",
               i, (long long)(i / c.dim), (long long)(i % c.dim), (unsigned long long)Ref<T>::bits(out[i]),
               (unsigned long long)want[i]);
  check_accuracy<T>(in_range, padding, grad, out);

  // Repeatable: a second call into a fresh poisoned buffer gives the same bits.
  std::vector<T> again(out.size());
  fuzz::fill_bytes(again.data(), 0x5A, again.size() * sizeof(T));
  embedding_backward_dense_cpu(a, again.data(), workspace.data(), workspace.size());
  FUZZ_CHECK(fuzz::same_bytes(again.data(), out.data(), out.size() * sizeof(T)), "second call differs\n");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  const int dtype = data.ConsumeIntegralInRange<int>(0, 3);
  Case c;
  c.int32_indices = data.ConsumeBool();
  c.scale = data.ConsumeBool();
  c.num_weights = data.ConsumeBool() ? data.ConsumeIntegralInRange<int64_t>(0, 8)
                                     : data.ConsumeIntegralInRange<int64_t>(0, 3000);
  c.dim = data.ConsumeBool() ? data.ConsumeIntegralInRange<int64_t>(0, 3) : data.ConsumeIntegralInRange<int64_t>(0, 40);
  // Up to 2600 indices (more than 2 groups of 1024 sorted positions), at most 40000 gradient elements.
  const int64_t max_n = c.dim > 0 ? std::min<int64_t>(2600, 40000 / c.dim) : 2600;
  const int64_t n = data.ConsumeIntegralInRange<int64_t>(0, max_n);
  const int64_t rows = c.num_weights > 0 ? data.ConsumeIntegralInRange<int64_t>(1, c.num_weights) : 0;
  const int padding_kind = data.ConsumeIntegralInRange<int>(0, 5);
  const int64_t padding_pick = data.ConsumeIntegral<int64_t>();
  switch (padding_kind) {
    case 0: case 1: c.padding_idx = -1; break;
    case 2: c.padding_idx = c.num_weights > 0 ? (padding_pick & 0x7fffffff) % c.num_weights : 0; break;
    case 3: c.padding_idx = c.num_weights > 0 ? -1 - (padding_pick & 0x7fffffff) % c.num_weights : -2; break;
    case 4: c.padding_idx = data.ConsumeBool() ? c.num_weights : -c.num_weights - 1; break;  // just outside
    default: c.padding_idx = padding_pick; break;
  }
  fuzz::Rng rng(data.ConsumeIntegral<uint64_t>());
  // Indices over the first `rows` rows, shuffled by row choice so hot rows are spread over positions.
  c.indices.resize(static_cast<std::size_t>(n));
  for (auto& i : c.indices) i = rows > 0 ? static_cast<int64_t>(rng.below(static_cast<uint32_t>(rows))) : 0;
  // Out-of-range indices: none usually, else a few, of the values that break a careless check.
  const int bad = data.ConsumeIntegralInRange<int>(-6, 3);
  for (int b = 0; b < bad && n > 0; ++b) {
    const int64_t at = data.ConsumeIntegralInRange<int64_t>(0, n - 1);
    const int64_t nw = c.num_weights;
    const int64_t choices[] = {-1, nw, nw + 1, INT32_MIN, INT32_MAX, nw + (int64_t{1} << 32),
                               -(int64_t{1} << 32), INT64_MIN, INT64_MAX, data.ConsumeIntegral<int64_t>()};
    int64_t v = choices[data.ConsumeIntegralInRange<int>(0, 9)];
    if (c.int32_indices) v = static_cast<int32_t>(std::clamp<int64_t>(v, INT32_MIN, INT32_MAX));
    c.indices[static_cast<std::size_t>(at)] = v;
  }
  switch (dtype) {
    case 0: run<float>(data, c, rng); break;
    case 1: run<f16_t>(data, c, rng); break;
    case 2: run<bf16_t>(data, c, rng); break;
    default: run<double>(data, c, rng); break;
  }
  return 0;
}
