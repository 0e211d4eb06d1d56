// Shared by the libFuzzer harnesses: a failure report that ends the run (libFuzzer then saves the input), a
// small deterministic generator seeded from the input (so short inputs still make large problems), value
// generators that reach the awkward floats, and an independent reference rounding to fp16 / bf16.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "common/numeric.h"

namespace fuzz {

// A property failed: print what and where, then abort (libFuzzer reports a crash and writes the input).
[[noreturn]] inline void fail(const char* file, int line, const char* what) {
  std::fprintf(stderr, "\n%s:%d: property failed: %s\n", file, line, what);
  std::fflush(stderr);
  std::abort();
}
#define FUZZ_CHECK(cond, ...)                                        \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::fprintf(stderr, "check failed: " #cond "\n" __VA_ARGS__); \
      ::fuzz::fail(__FILE__, __LINE__, #cond);                       \
    }                                                                \
  } while (0)

// splitmix64: fast, and the same sequence on every machine.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint32_t below(uint32_t n) { return n == 0 ? 0 : static_cast<uint32_t>(next() % n); }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  // Roughly normal (sum of uniforms), enough for test values.
  float normal() { return (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7320508f; }
};

// memcmp / memset that take empty (possibly null) buffers: the C library's must not be given a null pointer.
inline bool same_bytes(const void* a, const void* b, std::size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }
inline void fill_bytes(void* p, int value, std::size_t n) {
  if (n > 0) std::memset(p, value, n);
}

inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float float_of(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline uint64_t bits_of(double x) { uint64_t u; std::memcpy(&u, &x, 8); return u; }

// Value families (selected by a fuzzed byte): small integers (sums exact), normal values of one scale,
// values over many decades, raw bit patterns (NaN, inf, subnormals included), and a mix of zeros.
inline float make_value(Rng& rng, int family, float scale) {
  switch (family % 6) {
    case 0: return static_cast<float>(static_cast<int>(rng.below(17)) - 8);
    case 1: return rng.normal() * scale;
    case 2: return rng.normal() * std::ldexp(1.0f, static_cast<int>(rng.below(60)) - 40);
    case 3: return float_of(static_cast<uint32_t>(rng.next()));  // any float, NaN and inf included
    case 4: return rng.below(3) == 0 ? (rng.below(2) ? 0.0f : -0.0f) : rng.normal() * scale;
    default: {
      static const float special[] = {0.0f, -0.0f, 1.0f, -1.0f, 1e-45f, -1e-45f, 1.17549435e-38f, 3.4028235e38f,
                                      -3.4028235e38f, 65504.0f, 65520.0f, 1e-8f, 0.5f, 2.0f, 3.0f};
      return rng.below(2) ? special[rng.below(sizeof(special) / sizeof(special[0]))] : rng.normal() * scale;
    }
  }
}

// Reference rounding of a float to fp16 or bf16, round to nearest even, written independently of
// common/numeric.h: every finite non-negative encoding decoded with ldexp into a table, the nearest entry found
// by search (ties to the even encoding), values from the first one past the largest finite up rounding to inf.
struct HalfTable {
  std::vector<double> value;  // value[e] for encodings 0 .. inf (the inf entry holds 2^(emax+1))
  uint16_t inf_bits;
  static HalfTable fp16() {
    HalfTable t{{}, 0x7c00};
    for (uint32_t e = 0; e <= 0x7c00; ++e) {
      const int exponent = static_cast<int>(e >> 10), mantissa = static_cast<int>(e & 0x3ff);
      t.value.push_back(exponent == 0 ? std::ldexp(double(mantissa), -24)
                                      : std::ldexp(1.0 + mantissa / 1024.0, exponent - 15));
    }
    return t;
  }
  static HalfTable bf16() {
    HalfTable t{{}, 0x7f80};
    for (uint32_t e = 0; e <= 0x7f80; ++e) {
      const int exponent = static_cast<int>(e >> 7), mantissa = static_cast<int>(e & 0x7f);
      t.value.push_back(exponent == 0 ? std::ldexp(double(mantissa), -133)
                                      : std::ldexp(1.0 + mantissa / 128.0, exponent - 127));
    }
    return t;
  }
  // The encoding of x (not NaN).
  uint16_t round(float x) const {
    const double a = std::fabs(static_cast<double>(x));
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    if (a >= value.back()) return sign | inf_bits;
    const auto above = static_cast<uint16_t>(std::lower_bound(value.begin(), value.end(), a) - value.begin());
    if (value[above] == a) return sign | above;
    const uint16_t below = above - 1;
    const double up = value[above] - a, down = a - value[below];
    const uint16_t pick = up < down ? above : down < up ? below : ((below & 1) ? above : below);
    return sign | pick;
  }
};

inline const HalfTable& fp16_table() { static const HalfTable t = HalfTable::fp16(); return t; }
inline const HalfTable& bf16_table() { static const HalfTable t = HalfTable::bf16(); return t; }

}  // namespace fuzz
