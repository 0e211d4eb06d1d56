// The host fp16/bf16 conversions must round exactly like the CUDA intrinsics (round to nearest even),
// since the backends' bitwise agreement rests on them. References: GCC's _Float16 for fp16, and a
// nearest-neighbour search in double precision for bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "common/numeric.h"

using namespace graphsafe;

namespace {
float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
uint32_t to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// bf16 value nearest to x, ties to the even encoding, by comparing the two bf16 neighbours of x.
uint16_t reference_bf16(float x) {
  const uint32_t u = to_bits(x);
  const uint16_t down = static_cast<uint16_t>(u >> 16);  // truncation: toward zero
  const uint16_t up = static_cast<uint16_t>(down + 1);   // next encoding away from zero
  const double d_down = std::fabs(static_cast<double>(from_bits(uint32_t{down} << 16)) - x);
  const double d_up = std::fabs(static_cast<double>(from_bits(uint32_t{up} << 16)) - x);
  if (d_down < d_up) return down;
  if (d_up < d_down) return up;
  return (down & 1) ? up : down;
}
}  // namespace

TEST(Numeric, HalfToFloatMatchesFloat16ForEveryEncoding) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    _Float16 h;
    const uint16_t b = static_cast<uint16_t>(bits);
    std::memcpy(&h, &b, 2);
    const float expected = static_cast<float>(h);
    const float got = to_float(f16_t{b});
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << bits;
    } else {
      EXPECT_EQ(to_bits(got), to_bits(expected)) << "encoding " << bits;
    }
  }
}

TEST(Numeric, FloatToHalfMatchesFloat16) {
  std::mt19937 rng(1234);
  auto check = [](float x) {
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t expected;
    std::memcpy(&expected, &h, 2);
    ASSERT_EQ(to_f16(x).bits, expected) << "x = " << x << " bits " << to_bits(x);
  };
  // Every exponent (normal, subnormal, overflow), random mantissas, and exact halfway points.
  for (int i = 0; i < 2000000; ++i) check(from_bits(static_cast<uint32_t>(rng()) & 0xff7fffffu));
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // halfway between consecutive fp16 values, both signs
    const float lo = to_float(f16_t{static_cast<uint16_t>(h)});
    const float hi = to_float(f16_t{static_cast<uint16_t>(h + 1)});
    const float mid = lo + (hi - lo) / 2;
    check(mid);
    check(-mid);
  }
  check(65504.0f); check(65519.99f); check(65520.0f); check(1e30f); check(-0.0f);
  check(from_bits(0x7f800000u)); check(from_bits(0xff800000u));
}

TEST(Numeric, FloatToBf16RoundsToNearestEven) {
  std::mt19937 rng(99);
  for (int i = 0; i < 2000000; ++i) {
    const float x = from_bits(static_cast<uint32_t>(rng()) & 0xff7fffffu);  // finite
    if (std::fabs(x) > 3.38e38f) continue;  // rounding up would reach inf; checked below
    ASSERT_EQ(to_bf16(x).bits, reference_bf16(x)) << "x = " << x;
  }
  for (uint32_t b = 0; b < 0x7f80; b += 7) {  // exact halfway points
    const uint32_t mid = (b << 16) | 0x8000u;
    ASSERT_EQ(to_bf16(from_bits(mid)).bits, reference_bf16(from_bits(mid)));
  }
  EXPECT_EQ(to_bf16(from_bits(0x7f7fffffu)).bits, 0x7f80u);  // max float rounds to inf
  EXPECT_TRUE(std::isnan(to_float(to_bf16(std::nanf("")))));
  EXPECT_EQ(to_float(to_bf16(1.5f)), 1.5f);
}
