// The CPU step's SIMD 8-bit loops (src/optim/cpu_quantize.h) against the portable definitions, for every instruction
// set this CPU can run (AVX-512 with or without VBMI, AVX2, portable): quantize_values_with returns quantize_block's
// absmax and writes its codes bit for bit (and quantize_with_absmax_with, given that absmax, the same codes); where
// the quotient is exact (blocks whose absmax is 1) the codes are reference_code's (the binary search over the map)
// for every value, non-finite ones included; dequantize_codes_with gives dequantize_value's values bit for bit.
// Blocks of every length class (whole vectors, a tail, shorter than one vector) are used, so both a loop's vector
// part and its portable tail are covered. The AVX-512 loops' linear step (cpu_quantize_linear.h) defers the values
// next to a decision point to an exact path (code_sum, or a compare with the threshold): the values at and around
// every threshold, alone and scaled by random absmaxes, take it (the tests count the deferred lanes), and the step
// itself is compared lane by lane.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "optim/blockwise.h"
#include "optim/cpu_quantize.h"
#include "optim/cpu_quantize_linear.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers start their results from self-initialised "undefined" vectors, which -Wuninitialized
// reports at each inlined intrinsic (GCC bug 105593); nothing here reads an uninitialised value.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

using namespace graphsafe;
using namespace graphsafe::optim_detail;

namespace {

const char* loops_name(QuantizeLoops loops) {
  switch (loops) {
    case QuantizeLoops::Avx512Vbmi: return "AVX-512 VBMI";
    case QuantizeLoops::Avx512: return "AVX-512";
    case QuantizeLoops::Avx2: return "AVX2";
    default: return "portable";
  }
}

std::vector<QuantizeLoops> loops_on_this_cpu() {
  std::vector<QuantizeLoops> out;
  for (QuantizeLoops loops :
       {QuantizeLoops::Avx512Vbmi, QuantizeLoops::Avx512, QuantizeLoops::Avx2, QuantizeLoops::Portable})
    if (quantize_loops_available(loops)) out.push_back(loops);
  return out;
}

// Block lengths cycled through: whole 16- and 8-lane vectors, vectors and a tail, less than one vector.
constexpr int kLengths[] = {256, 1024, 37, 1, 16, 15, 17, 8, 1000, 32, 7, 24, 512, 3};

// Quantises `values` in blocks (lengths from kLengths in turn) with every instruction set and compares each block's
// absmax and codes with quantize_block's; with exact_quotient, each block starts with ±1 (its absmax is 1, so the
// quotient is the value itself) and every code is also compared with reference_code. Returns the mismatches (and
// reports the first few).
int quantize_mismatches(const std::vector<float>& values, bool is_signed, bool exact_quotient,
                        const std::string& what) {
  const QuantizationMap& map = host_quantization_map(is_signed);
  int wrong = 0;
  std::vector<float> block;
  std::vector<uint8_t> expected(1024), got(1025);
  std::size_t next = 0;
  for (int b = 0; next < values.size(); ++b) {
    const int length = kLengths[b % (sizeof(kLengths) / sizeof(kLengths[0]))];
    block.assign(values.begin() + next, values.begin() + std::min(values.size(), next + length));
    next += block.size();
    if (exact_quotient) block[0] = b % 2 == 0 ? 1.0f : -1.0f;
    const int n = static_cast<int>(block.size());
    const float expected_absmax = quantize_block(map.code_word, is_signed, block.data(), n, expected.data());
    if (exact_quotient) {
      EXPECT_EQ(expected_absmax, 1.0f);
      for (int i = 0; i < n; ++i) {
        const float v = block[i];
        const int reference = std::isfinite(v) ? reference_code(map.value, is_signed, v) : zero_code(is_signed);
        if (expected[i] != reference && wrong++ < 3)
          ADD_FAILURE() << what << ": quantize_block's code " << int(expected[i]) << " for " << v << " (bits "
                        << std::hex << float_bits(v) << std::dec << "), reference " << reference;
      }
    }
    for (QuantizeLoops loops : loops_on_this_cpu()) {
      std::fill(got.begin(), got.end(), uint8_t(0xa5));
      const float absmax = quantize_values_with(loops, map.code_word, is_signed, block.data(), n, got.data());
      if (float_bits(absmax) != float_bits(expected_absmax) && wrong++ < 3)
        ADD_FAILURE() << what << ", " << loops_name(loops) << ": absmax " << absmax << ", expected " << expected_absmax;
      for (int i = 0; i < n; ++i)
        if (got[i] != expected[i] && wrong++ < 3)
          ADD_FAILURE() << what << ", " << loops_name(loops) << (is_signed ? ", signed" : ", unsigned")
                        << " map: value " << block[i] << " (bits " << std::hex << float_bits(block[i]) << std::dec
                        << ", element " << i << " of " << n << ") code " << int(got[i]) << ", expected "
                        << int(expected[i]);
      if (got[n] != 0xa5 && wrong++ < 3) ADD_FAILURE() << what << ", " << loops_name(loops) << ": wrote past the block";
      // The same codes from the absmax alone (the step gathers it while it computes the values).
      std::fill(got.begin(), got.end(), uint8_t(0xa5));
      quantize_with_absmax_with(loops, map.code_word, is_signed, block.data(), n, expected_absmax, got.data());
      for (int i = 0; i < n; ++i)
        if (got[i] != expected[i] && wrong++ < 3)
          ADD_FAILURE() << what << ", " << loops_name(loops) << ", given the absmax: value " << block[i] << " code "
                        << int(got[i]) << ", expected " << int(expected[i]);
      if (got[n] != 0xa5 && wrong++ < 3) ADD_FAILURE() << what << ", " << loops_name(loops) << ": wrote past the block";
    }
  }
  return wrong;
}

// Every float within `ulps` of v, both signs.
void add_neighbours(std::vector<float>& out, float v, int ulps) {
  const uint32_t bits = float_bits(std::fabs(v));
  for (int d = -ulps; d <= ulps; ++d) {
    if (d < 0 && bits < uint32_t(-d)) continue;
    out.push_back(bits_float(bits + d));
    out.push_back(-bits_float(bits + d));
  }
}

// Every float within `ulps` of each threshold (the smallest float of each code but the first), both signs.
std::vector<float> around_thresholds(bool is_signed, int ulps) {
  const QuantizationMap& map = host_quantization_map(is_signed);
  std::vector<float> values;
  for (int c = 0; c < 255; ++c) add_neighbours(values, code_threshold(map.value, is_signed, c), ulps);
  for (float& v : values) v = std::fabs(v) > 1.0f ? std::copysign(1.0f, v) : v;
  return values;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GS_TEST_LINEAR_STEP 1

// The linear step on values (whole vectors of 16) as normalised values: the lanes it defers, and those it does not
// defer whose code is not reference_code's (NaN: the code of 0), with the magnitudes of linear_magnitude.
__attribute__((target("avx512f"))) void linear_step_lanes(bool is_signed, const std::vector<float>& values,
                                                          long long* deferred, long long* wrong) {
  const QuantizationMap& map = host_quantization_map(is_signed);
  const LinearRegisters t = load_linear_registers(is_signed);
  for (std::size_t i = 0; i + 16 <= values.size(); i += 16) {
    const __m512 x = _mm512_loadu_ps(values.data() + i);
    __mmask16 lanes;
    alignas(64) uint32_t bits[16];
    _mm512_store_si512(bits, is_signed ? linear_code_bits<true>(t, x, linear_magnitude<true>(t, x), &lanes)
                                       : linear_code_bits<false>(t, x, linear_magnitude<false>(t, x), &lanes));
    for (int l = 0; l < 16; ++l) {
      const float v = values[i + l];
      const int reference = v == v ? reference_code(map.value, is_signed, v) : zero_code(is_signed);
      if (lanes >> l & 1) ++*deferred;
      else if (static_cast<int>(bits[l] >> kLinearFractionBits & 0xff) != reference && (*wrong)++ < 3)
        ADD_FAILURE() << (is_signed ? "signed" : "unsigned") << " map, linear step: code "
                      << (bits[l] >> kLinearFractionBits & 0xff) << " for " << v << " (bits " << std::hex
                      << float_bits(v) << std::dec << "), reference " << reference;
    }
  }
}

// The same with linear_magnitude_range (the signed map; AVX512DQ): its lanes that differ from linear_magnitude's.
__attribute__((target("avx512f,avx512dq"))) long long range_step_differences(const std::vector<float>& values) {
  const LinearRegisters t = load_linear_registers(true);
  long long differ = 0;
  for (std::size_t i = 0; i + 16 <= values.size(); i += 16) {
    const __m512 x = _mm512_loadu_ps(values.data() + i);
    __mmask16 plain, range;
    const __m512i a = linear_code_bits<true>(t, x, linear_magnitude<true>(t, x), &plain);
    const __m512i b = linear_code_bits<true>(t, x, linear_magnitude_range(t, x), &range);
    differ += plain != range || _mm512_cmpneq_epi32_mask(a, b) != 0;
  }
  return differ;
}
#else
#define GS_TEST_LINEAR_STEP 0
#endif

// The lanes of the linear step that values send to the exact path (0 where the CPU has no AVX-512).
long long deferred_lanes(bool is_signed, std::vector<float> values) {
  long long deferred = 0, wrong = 0;
#if GS_TEST_LINEAR_STEP
  values.resize(values.size() & ~std::size_t(15));
  if (quantize_loops_available(QuantizeLoops::Avx512)) linear_step_lanes(is_signed, values, &deferred, &wrong);
#else
  (void)is_signed;
  (void)values;
#endif
  return deferred;
}

TEST(QuantizationSimd, TheLoopsInUseRunHereAndThePortableOnesAlways) {
  EXPECT_TRUE(quantize_loops_available(quantize_loops_in_use()));
  EXPECT_TRUE(quantize_loops_available(QuantizeLoops::Portable));
  std::string names;
  for (QuantizeLoops loops : loops_on_this_cpu()) names += std::string(names.empty() ? "" : ", ") + loops_name(loops);
  std::printf("8-bit CPU loops checked here: %s (in use: %s)\n", names.c_str(), loops_name(quantize_loops_in_use()));
}

TEST(QuantizationSimd, CodesEqualTheReferenceOnASweepOfBitPatterns) {
  // Every 251st bit pattern of magnitude at most 1 and every non-finite one (±inf, NaNs of both signs and many
  // payloads), both signs, in blocks whose absmax is 1.
  std::vector<float> values;
  for (uint32_t u = 0; u <= 0x3f800000u; u += 251) {
    values.push_back(bits_float(u));
    values.push_back(bits_float(u | 0x80000000u));
  }
  for (uint32_t u = 0x7f800000u; u <= 0x7fffffffu; u += 4093) {
    values.push_back(bits_float(u));
    values.push_back(bits_float(u | 0x80000000u));
  }
  values.push_back(bits_float(0x7fffffffu));
  values.push_back(bits_float(0xffffffffu));
  std::mt19937 rng(11);
  std::shuffle(values.begin(), values.end(), rng);  // mixed magnitudes and specials in every block
  for (bool is_signed : {false, true}) EXPECT_EQ(quantize_mismatches(values, is_signed, true, "sweep"), 0);
}

TEST(QuantizationSimd, CodesEqualTheReferenceAroundEveryValueDecisionPointAndBucketEdge) {
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
    std::vector<float> values;
    for (int c = 0; c < 256; ++c) {
      add_neighbours(values, map.value[c], 64);
      if (c < 255) add_neighbours(values, (map.value[c] + map.value[c + 1]) / 2, 64);
    }
    for (int b = 0; b <= kBuckets; ++b) add_neighbours(values, bits_float(kFirstBucketBits + (uint32_t(b) << 16)), 8);
    for (float& v : values) v = std::fabs(v) > 1.0f ? std::copysign(1.0f, v) : v;  // keep the absmax at 1
    EXPECT_EQ(quantize_mismatches(values, is_signed, true, "decision points"), 0);
  }
}

TEST(QuantizationSimd, BlocksOfEveryScaleWithNonFiniteValuesEqualQuantizeBlock) {
  // Random blocks from subnormal to huge scales (a subnormal absmax takes the prescaled path), with zeros, -0.0 and
  // non-finite values mixed in, all-zero and all-non-finite blocks; against quantize_block, and each code against the
  // documented quotient (value * prescale) * inverse's reference_code.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float specials[] = {nan, -nan, bits_float(0x7f800001u), bits_float(0xffffffffu), inf, -inf, 0.0f, -0.0f};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> decade(-45, 38), position(0, 1 << 20);
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
    std::vector<float> values;
    for (int trial = 0; trial < 600; ++trial) {
      const int n = kLengths[trial % (sizeof(kLengths) / sizeof(kLengths[0]))];
      const float magnitude = std::pow(10.0f, float(decade(rng)));
      std::vector<float> block(n);
      for (float& v : block) v = normal(rng) * magnitude;
      if (trial % 5 == 1) for (float& v : block) v = std::fabs(v);
      if (trial % 9 == 0) std::fill(block.begin(), block.end(), 0.0f);
      for (int k = 0; k < 1 + trial % 5; ++k) block[position(rng) % n] = specials[(trial + k) % 8];
      if (trial % 13 == 0) std::fill(block.begin(), block.end(), specials[trial % 6]);
      std::vector<uint8_t> expected(n);
      const float absmax = quantize_block(map.code_word, is_signed, block.data(), n, expected.data());
      const float prescale = absmax < std::numeric_limits<float>::min() ? 16777216.0f : 1.0f;
      const float inverse = absmax > 0.0f ? 1.0f / (absmax * prescale) : 0.0f;
      for (int i = 0; i < n; ++i) {
        const int reference = std::isfinite(block[i])
                                  ? reference_code(map.value, is_signed, (block[i] * prescale) * inverse)
                                  : zero_code(is_signed);
        ASSERT_EQ(int(expected[i]), reference) << "trial " << trial << " element " << i;
      }
      values.insert(values.end(), block.begin(), block.end());
    }
    // The same blocks, cut at the same lengths (kLengths in turn), through every instruction set.
    EXPECT_EQ(quantize_mismatches(values, is_signed, false, "random blocks"), 0);
  }
}

TEST(QuantizationSimd, TheLinearStepGivesTheReferenceCodeWhereItDoesNotDefer) {
  // Lane by lane (tools/quantizer_simd_all_floats.cpp does all 2^32 floats): every 61st bit pattern of either sign,
  // the values around every threshold, and quiet NaNs of both signs. Signalling NaNs are left out: the step's x comes
  // from an fma, which never makes one.
#if GS_TEST_LINEAR_STEP
  if (!quantize_loops_available(QuantizeLoops::Avx512)) GTEST_SKIP() << "no AVX-512 here";
  for (bool is_signed : {false, true}) {
    std::vector<float> values = around_thresholds(is_signed, 16);
    for (uint32_t u = 0; u < 0x7f800000u; u += 61) {
      values.push_back(bits_float(u));
      values.push_back(bits_float(u | 0x80000000u));
    }
    for (uint32_t u : {0x7f800000u, 0x7fc00000u, 0x7fc12345u, 0x7fffffffu}) {
      values.push_back(bits_float(u));
      values.push_back(bits_float(u | 0x80000000u));
    }
    long long deferred = 0, wrong = 0;
    linear_step_lanes(is_signed, values, &deferred, &wrong);
    EXPECT_EQ(wrong, 0);
    EXPECT_GT(deferred, 0);
    if (is_signed && __builtin_cpu_supports("avx512dq")) {
      EXPECT_EQ(range_step_differences(values), 0);
    }
  }
#else
  GTEST_SKIP() << "no x86-64 intrinsics here";
#endif
}

TEST(QuantizationSimd, CodesEqualTheReferenceAtAndAroundEveryThreshold) {
  // Each threshold and its neighbours (the lanes the AVX-512 step defers, in blocks with other values), in blocks
  // whose absmax is 1.
  for (bool is_signed : {false, true}) {
    std::vector<float> values = around_thresholds(is_signed, 6);
    std::mt19937 rng(is_signed ? 3 : 4);
    std::shuffle(values.begin(), values.end(), rng);
    const long long deferred = deferred_lanes(is_signed, values);
    if (quantize_loops_available(QuantizeLoops::Avx512) && GS_TEST_LINEAR_STEP) {
      EXPECT_GT(deferred, 500);
    }
    EXPECT_EQ(quantize_mismatches(values, is_signed, true, "thresholds"), 0);
  }
}

TEST(QuantizationSimd, ThresholdsScaledByRandomAbsmaxesEqualQuantizeBlock) {
  // Blocks of thresholds (and their neighbours) times a random absmax, normal and subnormal, led by ±absmax: the
  // quotients lie at or next to the decision points, so many lanes take the exact path of the vectors around them.
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> ulps(-3, 3), decade(-44, 37);
  std::uniform_real_distribution<float> mantissa(1.0f, 10.0f);
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
    std::uniform_int_distribution<int> code(0, 254);
    std::vector<float> values, quotients;
    for (int block = 0; block < 420; ++block) {
      float absmax = mantissa(rng) * std::pow(10.0f, float(decade(rng)));
      if (!(absmax > 0.0f) || !std::isfinite(absmax)) absmax = 1.0f;
      const BlockScale scale = block_scale(absmax);
      const int n = kLengths[block % (sizeof(kLengths) / sizeof(kLengths[0]))];  // as quantize_mismatches cuts them
      for (int i = 0; i < n; ++i) {
        float v = block % 2 == 0 ? absmax : -absmax;
        if (i > 0) v = bits_float(float_bits(code_threshold(map.value, is_signed, code(rng)) * absmax) + ulps(rng));
        if (!(std::fabs(v) <= absmax)) v = std::copysign(absmax, v);  // (a step past ±0 is a NaN: absmax then)
        values.push_back(v);
        quotients.push_back((v * scale.prescale) * scale.inverse);
      }
    }
    if (quantize_loops_available(QuantizeLoops::Avx512) && GS_TEST_LINEAR_STEP) {
      EXPECT_GT(deferred_lanes(is_signed, quotients), 500);
    }
    EXPECT_EQ(quantize_mismatches(values, is_signed, false, "scaled thresholds"), 0);
  }
}

TEST(QuantizationSimd, DequantizedValuesEqualDequantizeValue) {
  std::mt19937 rng(7);
  std::vector<uint8_t> codes(4096);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i < 256 ? i : rng());
  const float scales[] = {1.0f, 3.7e-3f, 2.5e30f, 1e-40f, 0.0f, 3.40282347e+38f};
  for (bool is_signed : {false, true}) {
    const float* map = host_quantization_map(is_signed).value;
    for (float scale : scales) {
      for (int length : {256, 1024, 37, 1, 16, 15, 17, 8, 1000, 32, 7, 24, 512, 3, 64, 63, 65, 127, 129, 200}) {
        for (int start : {0, 1, 300}) {
          std::vector<float> got(length + 1, 7.0f);
          for (QuantizeLoops loops : loops_on_this_cpu()) {
            dequantize_codes_with(loops, is_signed, codes.data() + start, scale, length, got.data());
            for (int i = 0; i < length; ++i)
              ASSERT_EQ(float_bits(got[i]), float_bits(dequantize_value(map, codes[start + i], scale)))
                  << loops_name(loops) << " scale " << scale << " length " << length << " element " << i;
            ASSERT_EQ(got[length], 7.0f) << loops_name(loops) << ": wrote past the end";
          }
        }
      }
    }
  }
}

}  // namespace
