// 8-bit blockwise quantisation of optimizer states, shared by both backends (docs/optim.md "8-bit states").
//
// A state tensor is cut into blocks of `block_size` consecutive elements. Each block keeps one fp32 absmax
// (the largest |value|, NaN if any value is NaN) and one 8-bit code per element; the value is
// map[code] * absmax. The maps are non-linear ("dynamic": a sign, a decade and a linear fraction), dense
// near zero where optimizer moments live and exact at 0 and ±1:
//   unsigned (second moments, sums of squares): 0, 1, and in each decade [0.1, 1] * 10^-d, d = 0..6,
//     2^(7-d) levels at the midpoints of equal steps (128 + 64 + ... + 2 = 254 levels);
//   signed (first moments, momentum): 0, ±1, positive levels as above with 2^(6-d) per decade for d = 0..6
//     (127), negative levels the same without the smallest (126).
// Quantising picks the nearest map value to value / absmax; on an exact tie, the one nearer zero.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/numeric.h"
#include "graphsafe/optim.h"

namespace graphsafe::optim_detail {

struct QuantizationMap {
  float value[256];  // strictly increasing
};

constexpr int kLevelsPerDecade(bool is_signed, int decade) { return 1 << ((is_signed ? 6 : 7) - decade); }

// The positive levels of decade d (ascending), written into out; returns how many.
constexpr int decade_levels(bool is_signed, int decade, float* out) {
  double scale = 1.0;
  for (int i = 0; i < decade; ++i) scale /= 10.0;
  const int n = kLevelsPerDecade(is_signed, decade);
  for (int i = 0; i < n; ++i) out[i] = static_cast<float>(scale * (0.1 + 0.9 * (i + 0.5) / n));
  return n;
}

constexpr QuantizationMap make_quantization_map(bool is_signed) {
  float positive[256] = {};  // ascending positive levels, smallest decade first
  int count = 0;
  for (int d = 6; d >= 0; --d) count += decade_levels(is_signed, d, positive + count);
  // unsigned: 0, 254 levels, 1; signed: -1, 126 negative levels (the smallest left out), 0, 127 positive, 1
  QuantizationMap m{};
  int k = 0;
  if (is_signed) {
    m.value[k++] = -1.0f;
    for (int i = count - 1; i >= 1; --i) m.value[k++] = -positive[i];
  }
  m.value[k++] = 0.0f;
  for (int i = 0; i < count; ++i) m.value[k++] = positive[i];
  m.value[k++] = 1.0f;
  return m;
}

inline constexpr QuantizationMap kSignedMap = make_quantization_map(true);
inline constexpr QuantizationMap kUnsignedMap = make_quantization_map(false);

// Whether state j of the algorithm can be negative (a signed map) or not (an unsigned one).
GS_HD bool state_is_signed(const OptimOptions& o, int j) {
  switch (o.algorithm) {
    case OptimAlgorithm::Adam:
    case OptimAlgorithm::AdamW:
    case OptimAlgorithm::LAMB: return j == 0;            // exp_avg | exp_avg_sq, max_exp_avg_sq
    case OptimAlgorithm::RMSprop: return j > 0;          // square_avg | grad_avg, momentum_buffer
    case OptimAlgorithm::Adagrad: return false;          // sum
    case OptimAlgorithm::AdEMAMix: return j < 2;         // exp_avg, exp_avg_slow | exp_avg_sq
    default: return true;                                // SGD, LARS momentum_buffer; Lion exp_avg
  }
}

inline constexpr int kSignedZeroCode = 127;  // -1 and 126 negative levels come first
inline constexpr int kUnsignedZeroCode = 0;

GS_HD int zero_code(bool is_signed) { return is_signed ? kSignedZeroCode : kUnsignedZeroCode; }

#if defined(__CUDA_ARCH__)
GS_HD float log10_f(float x) { return log10f(x); }
GS_HD float floor_f(float x) { return floorf(x); }
#else
GS_HD float log10_f(float x) { return std::log10(x); }
GS_HD float floor_f(float x) { return std::floor(x); }
#endif

// A first guess at the code of x (|x| < 1, not 0 or NaN) from the maps' structure: the decade from log10,
// the level from the linear fraction. It is usually the answer or a neighbour; quantize_value then walks
// to the exact one, so a poor guess costs time, never a different code.
GS_HD int guess_code(bool is_signed, float x) {
  const float a = x < 0.0f ? -x : x;
  int d = static_cast<int>(floor_f(-log10_f(a)));
  d = d < 0 ? 0 : (d > 6 ? 6 : d);
  float t = a;
  for (int i = 0; i < d; ++i) t = t * 10.0f;  // a * 10^d, in [0.1, 1) up to rounding
  const int n = 1 << ((is_signed ? 6 : 7) - d);
  int i = static_cast<int>((t - 0.1f) / 0.9f * static_cast<float>(n));
  i = i < 0 ? 0 : (i >= n ? n - 1 : i);
  if (!is_signed) return (1 << (7 - d)) - 1 + i;  // decade d's levels start at code 2^(7-d) - 1
  const int positive = 128 + (1 << (6 - d)) - 1 + i;
  return x > 0.0f ? positive : (positive == 128 ? kSignedZeroCode : 255 - positive);  // negatives mirror
}

// The code of x = value / absmax (|x| <= 1 up to rounding) in `map`: the nearest map value, the one nearer
// zero on an exact tie. Values outside [-1, 1] clamp to the ends; NaN gives the code of 0 (the block's
// absmax is NaN then, so the value decodes to NaN anyway). Found as the first code whose value is >= x,
// walking from guess_code (a few reads of the map instead of a binary search's eight).
GS_HD uint8_t quantize_value(const float* map, bool is_signed, float x) {
  if (!(x == x)) return static_cast<uint8_t>(zero_code(is_signed));
  int lo;
  if (x == 0.0f) lo = zero_code(is_signed);
  else if (x >= 1.0f) lo = 255;
  else if (x <= -1.0f) lo = 0;
  else lo = guess_code(is_signed, x);
  while (lo > 0 && map[lo - 1] >= x) --lo;
  while (lo < 256 && map[lo] < x) ++lo;
  if (lo == 0) return 0;
  if (lo == 256) return 255;
  const float above = map[lo] - x, below = x - map[lo - 1];
  if (above < below) return static_cast<uint8_t>(lo);
  if (below < above) return static_cast<uint8_t>(lo - 1);
  return static_cast<uint8_t>(lo - 1 >= zero_code(is_signed) ? lo - 1 : lo);  // tie: toward zero
}

// States are stored finite: ±inf is kept as ±FLT_MAX (an inf absmax would decode every other element of
// its block as 0 * inf = NaN). NaN stays NaN.
inline constexpr float kLargestFloat = 3.40282347e+38f;
GS_HD float finite_value(float v) { return v > kLargestFloat ? kLargestFloat : (v < -kLargestFloat ? -kLargestFloat : v); }

// The block's scale: NaN if any value is NaN, else the largest |value| (at most FLT_MAX).
GS_HD float absmax_step(float running, float value) {
  value = finite_value(value);
  const float a = value < 0.0f ? -value : value;
  if (a != a) return a;
  if (running != running) return running;
  return a > running ? a : running;
}

// value / absmax, the quantiser's input; 0 for an all-zero block.
GS_HD float normalized(float value, float absmax) { return absmax > 0.0f ? finite_value(value) / absmax : 0.0f; }

GS_HD float dequantize_value(const float* map, uint8_t code, float absmax) { return map[code] * absmax; }

// Block sizes both backends support: powers of two from 32 to 1024 (a block is covered by 8 to 256 CUDA
// threads of 4 elements each, inside one 1024-element pass of a thread block).
GS_HD bool valid_block_size(int64_t b) { return b >= 32 && b <= 1024 && (b & (b - 1)) == 0; }

GS_HD int64_t block_count(int64_t numel, int64_t block_size) { return (numel + block_size - 1) / block_size; }

}  // namespace graphsafe::optim_detail
