// The 8-bit quantiser (src/optim/blockwise.h): the constant-time quantize_value, which both backends use,
// gives reference_code's nearest-value code (a binary search over the map) for every float we try: a
// strided sweep over all floats in [-1, 1] and every float within 64 ulps of each map value, each
// decision point between neighbours and each bucket edge. And the block scale: NaN-propagating with one
// canonical NaN, sign-blind (-0.0 included), finite, independent of the order it is formed in.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
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

TEST(Quantization, BlockScaleIsCanonicalNaNSignBlindFiniteAndOrderFree) {
  // A block's scale: absmax_step over its values, then absmax_finish.
  const auto scale_of = [](std::initializer_list<float> values) {
    float raw = 0.0f;
    for (float v : values) raw = absmax_step(raw, v);
    return absmax_finish(raw);
  };
  const float negative_nan = bits_float(0xffc00001u), payload_nan = bits_float(0x7f800123u);
  const float inf = std::numeric_limits<float>::infinity();
  for (float nan : {negative_nan, payload_nan, std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_EQ(float_bits(scale_of({nan})), kCanonicalNaNBits);
    EXPECT_EQ(float_bits(scale_of({nan, 5.0f})), kCanonicalNaNBits);
    EXPECT_EQ(float_bits(scale_of({5.0f, nan})), kCanonicalNaNBits);
    EXPECT_EQ(float_bits(scale_of({inf, nan, -inf})), kCanonicalNaNBits);
  }
  EXPECT_EQ(float_bits(scale_of({-0.0f})), 0u) << "-0.0 must not become the largest bit pattern";
  EXPECT_EQ(scale_of({-inf}), kLargestFloat);
  EXPECT_EQ(scale_of({2.0f, inf, -1e38f}), kLargestFloat);
  EXPECT_EQ(scale_of({-kLargestFloat, 1.0f}), kLargestFloat);
  EXPECT_EQ(scale_of({-3.0f, 2.0f}), 3.0f);
  const std::vector<float> values = {0.5f, -7.25f, 1e-30f, -0.0f, 3.0f, -1e20f, 2e-45f};
  float forward = 0.0f, backward = 0.0f;
  for (size_t i = 0; i < values.size(); ++i) {
    forward = absmax_step(forward, values[i]);
    backward = absmax_step(backward, values[values.size() - 1 - i]);
  }
  EXPECT_EQ(float_bits(forward), float_bits(backward));
  EXPECT_EQ(absmax_finish(forward), 1e20f);
}

TEST(Quantization, InfiniteValuesGetTheCodesOfTheLargestFloat) {
  // normalized() does not clamp ±inf to ±FLT_MAX: the block holding it has absmax FLT_MAX (or NaN), and there
  // both give the same code.
  const float inf = std::numeric_limits<float>::infinity();
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
    for (float absmax : {kLargestFloat, bits_float(kCanonicalNaNBits)}) {
      const BlockScale block = block_scale(absmax);
      for (float sign : {1.0f, -1.0f})
        EXPECT_EQ(quantize_value(map, is_signed, normalized(sign * inf, block)),
                  quantize_value(map, is_signed, normalized(sign * kLargestFloat, block)))
            << "signed " << is_signed << " absmax " << absmax << " sign " << sign;
    }
  }
}

}  // namespace
