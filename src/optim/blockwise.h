// 8-bit blockwise quantisation of optimizer states, shared by both backends (docs/optim.md "8-bit states").
//
// A state tensor is cut into blocks of `block_size` consecutive elements. Each block keeps one fp32 absmax
// (the largest |value| among its finite values, 0 if it has none) and one 8-bit code per element; the value
// is map[code] * absmax. A value that is not finite (NaN, ±inf) is stored as 0 (the code of 0) and takes no
// part in the absmax: a block is quantised exactly as it would be with 0 in its place, so one non-finite
// element never changes its neighbours' scale or codes (docs/optim.md, "Non-finite values"). Why 0 and not
// the ends of the map (±absmax) for ±inf: a stored ±absmax would be the block's largest value again in the
// next step and keep setting its neighbours' scale; 0 is neutral for every state (moments, sums of squares),
// needs one rule for NaN and ±inf alike, and the element's parameter carries the damage anyway (as with
// 32-bit states: it is NaN or ±inf from that step on). The maps are non-linear ("dynamic": a sign, a decade and a linear fraction), dense
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

// |x| in [2^-23, 1) falls in one of kBuckets buckets: its float's exponent and top 7 mantissa bits, so a bucket
// holds the 2^16 floats that share the upper half of their bits. A bucket is narrower than the smallest gap
// between two neighbouring decision points of either map (the table check below proves it), so within one
// bucket the nearest-value code takes at most two values. Magnitudes outside that range are clamped into it
// first: every |x| below 2^-23 has the code of 2^-23 (that of 0), every |x| from 1 up that of the largest float
// below 1 (an end of the map); the check below proves both too.
inline constexpr int kBucketMantissaBits = 7;
inline constexpr int kBucketShift = 23 - kBucketMantissaBits;  // bits >> kBucketShift: exponent and top mantissa
inline constexpr int kSmallestBucketExponent = -23;           // |x| below 2^-23 always gets the code of 0
inline constexpr int kBuckets = -kSmallestBucketExponent << kBucketMantissaBits;
inline constexpr uint32_t kFirstBucketBits = static_cast<uint32_t>(127 + kSmallestBucketExponent) << 23;  // 2^-23
inline constexpr float kSmallestBucketValue = 1.0f / 8388608.0f;  // 2^-23
inline constexpr float kLargestBelowOne = 0.99999994f;            // 1 - 2^-24, the last bucket's largest float

// One map: its values, and per bucket the code words code_sum reads. A signed map keeps two words per bucket,
// code_word[bucket] for x >= 0 and code_word[kBuckets + bucket] for x < 0; an unsigned map one, code_word[bucket]
// (every x < 0 has the code of 0 there, as 2^-23 has), and the second half of its array is 0 and never read (the
// CUDA kernels leave it out of shared memory).
struct QuantizationMap {
  float value[256];  // strictly increasing
  uint32_t code_word[2 * kBuckets];
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

inline constexpr int kSignedZeroCode = 127;  // -1 and 126 negative levels come first
inline constexpr int kUnsignedZeroCode = 0;

GS_HD constexpr int zero_code(bool is_signed) { return is_signed ? kSignedZeroCode : kUnsignedZeroCode; }

// The definition of the code of x = value / absmax (|x| <= 1 up to rounding) in `map`: the nearest map
// value, the one nearer zero on an exact tie. Values outside [-1, 1] clamp to the ends; NaN gives the code
// of 0 whatever its sign (which the two backends' arithmetic may not agree on); quantize_block (below) sends
// every non-finite state value there as a NaN. A binary search; the fast quantize_value below gives
// the same code for every float (checked at compile time per bucket, over millions of floats in
// tests/cpp/test_quantization.cpp, and over all of them by tools/quantizer_all_floats.cpp).
constexpr uint8_t reference_code(const float* map, bool is_signed, float x) {
  if (!(x == x)) return static_cast<uint8_t>(zero_code(is_signed));
  int lo = 0, count = 256;  // lo becomes the first code whose value is >= x (256: none)
  while (count > 0) {
    const int half = count / 2;
    if (map[lo + half] < x) {
      lo += half + 1;
      count -= half + 1;
    } else {
      count = half;
    }
  }
  if (lo == 0) return 0;
  if (lo == 256) return 255;
  const float above = map[lo] - x, below = x - map[lo - 1];
  if (above < below) return static_cast<uint8_t>(lo);
  if (below < above) return static_cast<uint8_t>(lo - 1);
  return static_cast<uint8_t>(lo - 1 >= zero_code(is_signed) ? lo - 1 : lo);  // tie: toward zero
}

// 2^e for the bucket bounds, exactly (constexpr: no ldexp).
constexpr double power_of_two(int e) {
  double r = 1.0;
  for (; e > 0; --e) r *= 2.0;
  for (; e < 0; ++e) r /= 2.0;
  return r;
}

// The smallest and the largest float of bucket b.
constexpr float bucket_low(int b) {
  const int e = kSmallestBucketExponent + (b >> kBucketMantissaBits), m = b & ((1 << kBucketMantissaBits) - 1);
  return static_cast<float>(power_of_two(e) * (1.0 + m / double(1 << kBucketMantissaBits)));
}
constexpr float bucket_high(int b) {
  const int e = kSmallestBucketExponent + (b >> kBucketMantissaBits), m = b & ((1 << kBucketMantissaBits) - 1);
  return static_cast<float>(power_of_two(e) * (1.0 + (m + 1) / double(1 << kBucketMantissaBits)) - power_of_two(e - 23));
}

// The floats next to x (|x| in the normal range, as every threshold is), exactly and without bit casts, so
// that the thresholds below are constants on both compilers.
constexpr float ulp_of_binade(float magnitude) {  // the spacing of the floats in [2^e, 2^(e+1)) that holds it
  double low = 1.0;
  int e = 0;
  while (low > magnitude) { low /= 2.0; --e; }
  while (low * 2.0 <= magnitude) { low *= 2.0; ++e; }
  return static_cast<float>(power_of_two(e - 23));
}
constexpr float next_float_up(float x);
constexpr float next_float_down(float x) {
  if (x <= 0.0f) return -next_float_up(-x);
  const float spacing = ulp_of_binade(x);
  const bool binade_start = static_cast<double>(x) == static_cast<double>(spacing) * 8388608.0;  // x == 2^e
  return x - (binade_start ? spacing / 2.0f : spacing);
}
constexpr float next_float_up(float x) {
  if (x < 0.0f) return -next_float_down(-x);
  return x + ulp_of_binade(x);
}

// The smallest float whose reference code is above c: the decision point between value[c] and value[c + 1],
// found from their midpoint and then stepped float by float to where the code changes.
constexpr float code_threshold(const float* map, bool is_signed, int c) {
  float t = static_cast<float>((static_cast<double>(map[c]) + static_cast<double>(map[c + 1])) / 2.0);
  while (reference_code(map, is_signed, t) > c) t = next_float_down(t);
  while (reference_code(map, is_signed, t) <= c) t = next_float_up(t);
  return t;
}

// The code word of one bucket and sign (code_sum). Over the bucket's floats x, in the order of their key
// (the low 16 bits of |x|'s bits for x >= 0, those bits flipped for x < 0, so that x grows with the key), the
// code is `lower` up to the key `change` where it becomes lower + 1 (change = 2^16: it does not change in the
// bucket). (lower << 16) + 2^16 - change + key then holds the code in bits 16-23 (below 2^24: no carry out).
// code_sum adds the clamped float's bits for x >= 0 and their complement for x < 0, which are that key plus a
// constant of the bucket and sign: the bucket's first bits (x >= 0), or 2^32 - first - 2^16 (x < 0). The word
// is the number above less that constant, modulo 2^32.
constexpr uint32_t code_word(int lower, uint32_t change, uint32_t bucket_first_bits, bool negative) {
  const uint32_t coded = (static_cast<uint32_t>(lower) << 16) + (0x10000u - change);
  return negative ? coded + bucket_first_bits + 0x10000u : coded - bucket_first_bits;  // modulo 2^32
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
  float threshold[255] = {};  // threshold[c]: the smallest float whose code is above c
  for (int c = 0; c < 255; ++c) threshold[c] = code_threshold(m.value, is_signed, c);
  for (int b = 0; b < kBuckets; ++b) {
    // The bucket's floats are low, low + ulp, ..., high (2^16 of them, one binade); x < 0 runs from -high up to -low.
    const double low = bucket_low(b), high = bucket_high(b);
    const double ulp = power_of_two(kSmallestBucketExponent + (b >> kBucketMantissaBits) - 23);
    const uint32_t first_bits = kFirstBucketBits + (static_cast<uint32_t>(b) << kBucketShift);
    for (int negative = 0; negative < (is_signed ? 2 : 1); ++negative) {
      const double start = negative ? -high : low, end = negative ? -low : high;  // the bucket's smallest and largest x
      const int lower = reference_code(m.value, is_signed, static_cast<float>(start));
      // where the code changes: at threshold[lower] if that lies in the bucket (it is then one of its floats)
      const uint32_t change = lower < 255 && threshold[lower] <= end
                                  ? static_cast<uint32_t>((threshold[lower] - start) / ulp) : 0x10000u;
      m.code_word[negative * kBuckets + b] = code_word(lower, change, first_bits, negative);
    }
  }
  return m;
}

GS_HD float abs_f(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// x clamped to [low, high] (low > 0), and a quiet NaN (what arithmetic makes) to low. On the GPU fmax returns its
// number when the other operand is a quiet NaN: one instruction each way. On the host, comparisons give the same
// (any NaN to low) in a form the compiler vectorises (std::fmax and std::fmin are library calls there).
GS_HD float clamp_f(float x, float low, float high) {
#if defined(__CUDA_ARCH__)
  return fminf(fmaxf(x, low), high);
#else
  const float above = x > low ? x : low;
  return above < high ? above : high;
#endif
}

GS_HD float fma_f(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// x's code from a map's code words (reference_code's; quantize_value tests the whole map): the number whose
// bits 16-23 hold it (bits 24-31 are 0), as the CUDA kernels pack codes straight from it. |x| is clamped into
// the buckets' range (an unsigned map clamps x itself: every x < 0 has the code of 2^-23, that of 0), a quiet
// NaN to its bottom (either sign: the code of 0, as for ±2^-23); the bucket of the clamped float names the word, and the word plus the key is the number (code_word):
// the key is the clamped float's bits for x >= 0, their complement for x < 0. Branch-free, with one
// shared-memory read: the 8-bit kernels are instruction-bound.
template <bool Signed>
GS_HD uint32_t code_sum(const uint32_t* code_words, float x) {
  const uint32_t clamped = float_bits(clamp_f(Signed ? abs_f(x) : x, kSmallestBucketValue, kLargestBelowOne));
  const uint32_t bucket = (clamped >> kBucketShift) - (kFirstBucketBits >> kBucketShift);
  if constexpr (Signed) {
    const uint32_t negative = static_cast<uint32_t>(static_cast<int32_t>(float_bits(x)) >> 31);  // all ones for x < 0
    return code_words[bucket + (negative & static_cast<uint32_t>(kBuckets))] + (clamped ^ negative);
  } else {
    return code_words[bucket] + clamped;
  }
}

template <bool Signed>
GS_HD uint8_t code_of(const uint32_t* code_words, float x) { return static_cast<uint8_t>(code_sum<Signed>(code_words, x) >> 16); }

// What makes quantize_value equal reference_code for every float: the code is monotone in x, so a bucket
// whose two ends' codes differ by at most one holds at most one change of code; the smaller code is never
// 255 (so code + 1 exists); magnitudes below the first bucket all get the code of 0, as 2^-23 does; and
// magnitudes from 1 up the end codes, as the largest float below 1 does.
constexpr bool buckets_hold_one_change(const QuantizationMap& m, bool is_signed) {
  const float below_first = static_cast<float>(power_of_two(kSmallestBucketExponent) - power_of_two(kSmallestBucketExponent - 24));
  if (reference_code(m.value, is_signed, below_first) != zero_code(is_signed)) return false;
  if (reference_code(m.value, is_signed, -below_first) != zero_code(is_signed)) return false;
  if (reference_code(m.value, is_signed, kSmallestBucketValue) != zero_code(is_signed)) return false;
  if (reference_code(m.value, is_signed, -kSmallestBucketValue) != zero_code(is_signed)) return false;
  // |x| < 2^-23 (code of 0): the next code's value is more than twice 2^-23 away from 0, so 0 is the nearer for
  // either sign. |x| >= 1: 1 and -1 (0 when unsigned) are map values, and the largest float below 1 has the end codes.
  if (!(m.value[zero_code(is_signed) + 1] > 2.0f * kSmallestBucketValue)) return false;
  if (m.value[255] != 1.0f || (is_signed && m.value[0] != -1.0f)) return false;
  const float below_one = static_cast<float>(1.0 - power_of_two(-24));
  if (reference_code(m.value, is_signed, below_one) != 255 || reference_code(m.value, is_signed, -below_one) != 0) return false;
  for (int b = 0; b < kBuckets; ++b) {
    const int positive_low = reference_code(m.value, is_signed, bucket_low(b));
    const int positive_high = reference_code(m.value, is_signed, bucket_high(b));
    const int negative_low = reference_code(m.value, is_signed, -bucket_high(b));
    const int negative_high = reference_code(m.value, is_signed, -bucket_low(b));
    if (positive_high - positive_low > 1 || negative_high - negative_low > 1) return false;
    if (positive_low == 255 || negative_low == 255) return false;
  }
  return true;
}

inline constexpr QuantizationMap kSignedMap = make_quantization_map(true);
inline constexpr QuantizationMap kUnsignedMap = make_quantization_map(false);
#if !defined(__CUDACC__)  // nvcc's front end gives up on a loop this long; the C++ files (same tables) check it
static_assert(buckets_hold_one_change(kSignedMap, true) && buckets_hold_one_change(kUnsignedMap, false),
              "a quantisation bucket holds two changes of code: add mantissa bits to the buckets");
#endif

inline const QuantizationMap& host_quantization_map(bool is_signed) { return is_signed ? kSignedMap : kUnsignedMap; }

// Whether state j of the algorithm can be negative (a signed map) or not (an unsigned one).
GS_HD bool state_is_signed(const OptimOptions& o, int j) {
  switch (o.algorithm) {
    case OptimAlgorithm::Adam:
    case OptimAlgorithm::AdamW:
    case OptimAlgorithm::LAMB:
    case OptimAlgorithm::AdamWScheduleFree: return j == 0;  // exp_avg (z) | exp_avg_sq, max_exp_avg_sq
    case OptimAlgorithm::RMSprop: return j > 0;          // square_avg | grad_avg, momentum_buffer
    case OptimAlgorithm::Adagrad: return false;          // sum
    case OptimAlgorithm::AdEMAMix: return j < 2;         // exp_avg, exp_avg_slow | exp_avg_sq
    default: return true;                                // SGD, LARS momentum_buffer; Lion exp_avg
  }
}

// reference_code's code of x, in constant time, from a map's code words (code_of; NaN, signalling ones
// included, gets the code of 0): the host's maps, or the CUDA backend's copy of them (cuda.cu, SharedMaps).
GS_HD uint8_t quantize_value(const uint32_t* code_words, bool is_signed, float x) {
  if (!(x == x)) return static_cast<uint8_t>(zero_code(is_signed));
  return is_signed ? code_of<true>(code_words, x) : code_of<false>(code_words, x);
}

GS_HD uint8_t quantize_value(const QuantizationMap& m, bool is_signed, float x) {
  return quantize_value(m.code_word, is_signed, x);
}

inline constexpr float kLargestFloat = 3.40282347e+38f;  // FLT_MAX: |x| <= it exactly for the finite x

// A block's scale is the largest |value| among its finite values (0 if none). It is gathered over keys, one per
// value: 2 * bits(value) + 2^24, modulo 2^32. Doubling drops the sign bit, so the finite magnitudes order as
// their keys (from 2^24 for ±0 up to 2^32 - 2 for FLT_MAX), and the patterns whose exponent bits are all ones
// (±inf, every NaN) wrap around to below 2^24, under every finite value's key. Gathering is then one unsigned
// max per value, in any order, with 0 as the start; on the GPU the key is one integer multiply-add, as many
// instructions as clearing the sign bit, so leaving non-finite values out costs the reduction nothing.
// absmax_finish turns the largest key back into the magnitude (0 when no value was finite).
inline constexpr uint32_t kFiniteKeyOffset = 0x01000000u;  // 2^24

GS_HD float absmax_combine(float a, float b) {  // two keys (or 0)
  const uint32_t x = float_bits(a), y = float_bits(b);
  return bits_float(x > y ? x : y);
}

GS_HD float absmax_key(float value) { return bits_float(float_bits(value) * 2u + kFiniteKeyOffset); }

GS_HD float absmax_step(float running, float value) { return absmax_combine(running, absmax_key(value)); }

GS_HD float absmax_finish(float key) {
  const uint32_t bits = float_bits(key);
  return bits < kFiniteKeyOffset ? 0.0f : bits_float((bits - kFiniteKeyOffset) >> 1);
}

// The quantiser's input, value / absmax, is computed as value * (1 / absmax): a multiply per element instead
// of a division (the 8-bit kernels are instruction-bound), at the cost of one more rounding. A subnormal
// absmax, whose reciprocal may overflow, has both first scaled by 2^24 (exact: |value| <= absmax for every
// finite value). A block without a finite non-zero value gives 0.
inline constexpr float kSmallestNormalFloat = 1.17549435e-38f;
inline constexpr float kSubnormalPrescale = 16777216.0f;  // 2^24

struct BlockScale {
  float prescale = 1.0f, inverse = 0.0f;
};

GS_HD BlockScale block_scale(float absmax) {
  BlockScale b;
  if (absmax > 0.0f) {
    if (absmax < kSmallestNormalFloat) b.prescale = kSubnormalPrescale;
    b.inverse = 1.0f / (absmax * b.prescale);
  }
  return b;
}

// A finite value has |value| <= absmax and the inverse is finite (0 only when no value of the block is finite
// and non-zero), so the product is a number in [-1, 1] up to rounding.
GS_HD float normalized(float value, const BlockScale& b) { return (value * b.prescale) * b.inverse; }

// What a value is quantised as: normalized(value) for a finite value, NaN (so the code of 0) for any other.
// The CPU tests the value; the CUDA step (cuda.cu, Requantizer) computes the same with one add instead of a
// test and a select per value: normalized_or_nan_fused.
GS_HD float normalized_or_nan(float value, const BlockScale& b) {
  return abs_f(value) <= kLargestFloat ? normalized(value, b) : bits_float(0x7fc00000u);
}

// normalized_or_nan's code, branch-free: fma(value * prescale, inverse, value - value). value - value is +0 for
// a finite value, and adding +0 in the fused step rounds the product as the multiply alone does (only a -0
// product becomes +0: the code of 0 either way); for ±inf or NaN it is NaN, and so is the result (a quiet one,
// which code_sum gives the code of 0 without a test).
GS_HD float normalized_or_nan_fused(float value, const BlockScale& b) {
  return fma_f(value * b.prescale, b.inverse, value - value);
}

GS_HD float dequantize_value(const float* values, uint8_t code, float absmax) { return values[code] * absmax; }
GS_HD float dequantize_value(const QuantizationMap& m, uint8_t code, float absmax) {
  return dequantize_value(m.value, code, absmax);
}

// One quantisation block of n values in one thread (a map's code words): writes their codes, returns the
// block's absmax; a non-finite value gets the code of 0 and no part in the absmax. The CPU step and both
// backends' standalone quantisation use it (tests/cpp/emulation compares the two bit for bit), and the CUDA
// step shares a block among threads (cuda.cu, for_each_quantized_element) with the same absmax_step /
// absmax_finish and code_sum (cuda.cu's Requantizer, with normalized_or_nan_fused).
GS_HD float quantize_block(const uint32_t* code_words, bool is_signed, const float* values, int64_t n, uint8_t* codes) {
  float key = 0.0f;
  for (int64_t i = 0; i < n; ++i) key = absmax_step(key, values[i]);
  const float absmax = absmax_finish(key);
  const BlockScale block = block_scale(absmax);
  for (int64_t i = 0; i < n; ++i) codes[i] = quantize_value(code_words, is_signed, normalized_or_nan(values[i], block));
  return absmax;
}

// Block sizes both backends support: powers of two from 32 to 1024 (a block is covered by 4 to 128 CUDA
// threads of 8 elements each, inside one pass of a thread block over 2048 or 4096 elements; 8 to 256 threads of 4
// in the LAMB/LARS measuring pass).
GS_HD bool valid_block_size(int64_t b) { return b >= 32 && b <= 1024 && (b & (b - 1)) == 0; }

GS_HD int64_t block_count(int64_t numel, int64_t block_size) { return (numel + block_size - 1) / block_size; }

}  // namespace graphsafe::optim_detail
