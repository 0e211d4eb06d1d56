// The 8-bit quantiser (src/optim/blockwise.h): the constant-time quantize_value, which both backends use,
// gives reference_code's nearest-value code (a binary search over the map) for every float we try: a
// strided sweep over all floats in [-1, 1] and every float within 64 ulps of each map value, each
// decision point between neighbours and each bucket edge. And the block scale: the largest finite magnitude
// (non-finite values take no part), sign-blind (-0.0 included), independent of the order it is formed in; and a
// block's non-finite values stored as 0, against a plain reference loop.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "optim/blockwise.h"

using namespace graphsafe;
using namespace graphsafe::optim_detail;

namespace {

// Counts the floats among `candidates` whose fast code differs from the reference (and prints the first).
int mismatches(bool is_signed, const std::vector<float>& candidates) {
  const QuantizationMap& map = host_quantization_map(is_signed);
  int wrong = 0;
  for (float x : candidates) {
    const int fast = quantize_value(map, is_signed, x), reference = reference_code(map.value, is_signed, x);
    if (fast != reference && wrong++ == 0)
      ADD_FAILURE() << (is_signed ? "signed" : "unsigned") << " map, x = " << x << " (bits " << std::hex
                    << float_bits(x) << std::dec << "): fast " << fast << ", reference " << reference;
  }
  return wrong;
}

// Every float within `ulps` of v, both signs.
void add_neighbours(std::vector<float>& out, float v, int ulps) {
  const uint32_t bits = float_bits(std::fabs(v));
  for (int d = -ulps; d <= ulps; ++d) {
    if (d < 0 && bits < uint32_t(-d)) continue;
    const float x = bits_float(bits + d);
    out.push_back(x);
    out.push_back(-x);
  }
}

TEST(Quantization, FastCodeEqualsReferenceOnAStridedSweepOfAllFloats) {
  // Every 97th bit pattern with the sign bit clear, and the same with it set: [0, 1], the magnitudes at or
  // above 1 (the last table entry), ±inf and NaNs of either sign and many payloads (all 2^32 floats were
  // compared once with tools/quantizer_all_floats.cpp).
  std::vector<float> candidates;
  for (uint32_t u = 0; u <= 0x7fffffffu - 97; u += 97) {
    candidates.push_back(bits_float(u));
    candidates.push_back(bits_float(u | 0x80000000u));
  }
  for (uint32_t u : {0x7f800000u, 0x7fffffffu}) {
    candidates.push_back(bits_float(u));
    candidates.push_back(bits_float(u | 0x80000000u));
  }
  for (bool is_signed : {false, true}) EXPECT_EQ(mismatches(is_signed, candidates), 0);
}

TEST(Quantization, FastCodeEqualsReferenceAroundEveryValueDecisionPointAndBucketEdge) {
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
    std::vector<float> candidates;
    for (int c = 0; c < 256; ++c) {
      add_neighbours(candidates, map.value[c], 64);
      if (c < 255) add_neighbours(candidates, (map.value[c] + map.value[c + 1]) / 2, 64);
    }
    for (int b = 0; b <= kBuckets; ++b) add_neighbours(candidates, bits_float(kFirstBucketBits + (uint32_t(b) << 16)), 8);
    EXPECT_EQ(mismatches(is_signed, candidates), 0);
  }
}

TEST(Quantization, OutOfRangeAndSpecialInputs) {
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    EXPECT_EQ(quantize_value(map, is_signed, nan), zero_code(is_signed));
    EXPECT_EQ(quantize_value(map, is_signed, -nan), zero_code(is_signed)) << "NaN's sign plays no part";
    EXPECT_EQ(quantize_value(map, is_signed, 1.5f), 255);
    EXPECT_EQ(quantize_value(map, is_signed, inf), 255);
    EXPECT_EQ(quantize_value(map, is_signed, -inf), 0);
    EXPECT_EQ(quantize_value(map, is_signed, 0.0f), zero_code(is_signed));
    EXPECT_EQ(quantize_value(map, is_signed, -0.0f), zero_code(is_signed));
    EXPECT_EQ(quantize_value(map, is_signed, 1e-30f), zero_code(is_signed));
    for (int c = 0; c < 256; ++c) {
      if (!is_signed && map.value[c] < 0.0f) continue;
      EXPECT_EQ(quantize_value(map, is_signed, map.value[c]), c) << "a map value is its own code";
    }
  }
}

TEST(Quantization, BlockScaleIsTheLargestFiniteMagnitudeSignBlindAndOrderFree) {
  // A block's scale: absmax_step over its values, then absmax_finish.
  const auto scale_of = [](std::initializer_list<float> values) {
    float key = 0.0f;
    for (float v : values) key = absmax_step(key, v);
    return absmax_finish(key);
  };
  const float negative_nan = bits_float(0xffc00001u), payload_nan = bits_float(0x7f800123u);
  const float inf = std::numeric_limits<float>::infinity();
  for (float nan : {negative_nan, payload_nan, std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_EQ(float_bits(scale_of({nan})), 0u);
    EXPECT_EQ(scale_of({nan, 5.0f}), 5.0f);
    EXPECT_EQ(scale_of({-5.0f, nan}), 5.0f);
    EXPECT_EQ(float_bits(scale_of({inf, nan, -inf})), 0u);
  }
  EXPECT_EQ(float_bits(scale_of({})), 0u);
  EXPECT_EQ(float_bits(scale_of({-0.0f})), 0u) << "-0.0 must not become the largest bit pattern";
  EXPECT_EQ(float_bits(scale_of({-inf})), 0u);
  EXPECT_EQ(scale_of({2.0f, inf, -1e38f}), 1e38f);
  EXPECT_EQ(scale_of({-kLargestFloat, 1.0f, inf}), kLargestFloat);
  EXPECT_EQ(scale_of({-3.0f, 2.0f}), 3.0f);
  EXPECT_EQ(scale_of({-1e-45f, -inf}), 1e-45f) << "the smallest subnormal is still above every non-finite key";
  const std::vector<float> values = {0.5f, -7.25f, 1e-30f, -0.0f, inf, 3.0f, -1e20f, 2e-45f, negative_nan};
  float forward = 0.0f, backward = 0.0f;
  for (size_t i = 0; i < values.size(); ++i) {
    forward = absmax_step(forward, values[i]);
    backward = absmax_step(backward, values[values.size() - 1 - i]);
  }
  EXPECT_EQ(float_bits(forward), float_bits(backward));
  EXPECT_EQ(absmax_finish(forward), 1e20f);
}

// The contract of a quantisation block with non-finite values (docs/optim.md, "Non-finite values"), against a
// plain loop written from it: the absmax is the largest |v| over the finite values only, every finite value gets
// reference_code(v / absmax) (the binary search, with the documented v * (1 / absmax) and the subnormal
// prescale), and NaN and ±inf get the code of 0. So every finite value's code is what it would be with the
// non-finite ones replaced by 0. The CUDA step's branch-free form (normalized_or_nan_fused) gives the same codes.
TEST(Quantization, NonFiniteValuesAreStoredAsZeroAndLeaveTheBlockScaleAlone) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float specials[] = {nan, -nan, bits_float(0x7f800001u), bits_float(0xffffffffu), inf, -inf};
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> decade(-40, 38), position(0, 255);
  int blocks_checked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int n = trial % 3 == 0 ? 256 : 1 + position(rng);
    std::vector<float> values(n);
    const float magnitude = std::pow(10.0f, float(decade(rng) % 39));  // some blocks subnormal-scaled or huge
    for (float& v : values) v = normal(rng) * magnitude;
    if (trial % 7 == 0) std::fill(values.begin(), values.end(), 0.0f);  // only zeros besides the bad values
    const int bad_count = 1 + trial % 4;
    std::vector<int> bad;
    for (int k = 0; k < bad_count; ++k) {
      const int at = position(rng) % n;
      values[at] = specials[(trial + k) % 6];
      bad.push_back(at);
    }
    if (trial % 11 == 0) std::fill(values.begin(), values.end(), specials[trial % 6]);  // nothing finite
    for (bool is_signed : {false, true}) {
      const QuantizationMap& map = host_quantization_map(is_signed);
      // The reference, a plain loop.
      double largest = 0.0;
      for (float v : values)
        if (std::isfinite(v)) largest = std::max(largest, std::fabs(double(v)));
      const float expected_absmax = float(largest);
      const float prescale = expected_absmax < std::numeric_limits<float>::min() ? 16777216.0f : 1.0f;
      const float inverse = expected_absmax > 0.0f ? 1.0f / (expected_absmax * prescale) : 0.0f;
      std::vector<uint8_t> codes(n, 77), zeroed_codes(n, 77);
      const float absmax = quantize_block(map.code_word, is_signed, values.data(), n, codes.data());
      ASSERT_EQ(float_bits(absmax), float_bits(expected_absmax)) << "trial " << trial;
      // The same block with 0 in place of every non-finite value: the same absmax and codes.
      std::vector<float> zeroed(values);
      for (float& v : zeroed) if (!std::isfinite(v)) v = 0.0f;
      ASSERT_EQ(float_bits(quantize_block(map.code_word, is_signed, zeroed.data(), n, zeroed_codes.data())),
                float_bits(absmax)) << "trial " << trial;
      const BlockScale scale = block_scale(absmax);
      for (int i = 0; i < n; ++i) {
        const int expected = std::isfinite(values[i])
                                 ? reference_code(map.value, is_signed, (values[i] * prescale) * inverse)
                                 : zero_code(is_signed);
        ASSERT_EQ(int(codes[i]), expected) << "trial " << trial << " element " << i << " value " << values[i];
        ASSERT_EQ(codes[i], zeroed_codes[i]) << "trial " << trial << " element " << i;
        ASSERT_EQ(int(quantize_value(map, is_signed, normalized_or_nan_fused(values[i], scale))), expected)
            << "the fused form, trial " << trial << " element " << i << " value " << values[i];
      }
      ++blocks_checked;
    }
  }
  EXPECT_EQ(blocks_checked, 800);
}

TEST(Quantization, FusedNormalizationEqualsTheTestedOneOnASweepOfAllFloats) {
  // normalized_or_nan (a test per value, the CPU) and normalized_or_nan_fused (one fused add, the CUDA step)
  // give the same code for every value we try, for normal, subnormal and zero scales.
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
    for (float absmax : {1.0f, 3.7e-3f, 2.5e30f, 1e-39f, 0.0f}) {
      const BlockScale scale = block_scale(absmax);
      int wrong = 0;
      for (uint32_t u = 0; u <= 0xffffffffu - 4099; u += 4099) {
        float v = bits_float(u);
        if (std::isfinite(v) && std::fabs(v) > absmax) v = std::fmod(v, absmax > 0.0f ? absmax : 1.0f) * (absmax > 0.0f);
        if (quantize_value(map, is_signed, normalized_or_nan(v, scale)) !=
                quantize_value(map, is_signed, normalized_or_nan_fused(v, scale)) && wrong++ == 0)
          ADD_FAILURE() << "signed " << is_signed << " absmax " << absmax << " value " << v;
      }
      EXPECT_EQ(wrong, 0);
    }
  }
}

}  // namespace
