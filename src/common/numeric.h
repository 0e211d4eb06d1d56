// Element types and conversions shared by the CPU and CUDA backends.
//
// fp16 and bf16 travel as 16-bit storage structs in both backends so that kernels and CPU loops are the
// same templates. On the device the conversions use CUDA's intrinsics; on the host a bit-exact software
// version (round to nearest even, like the intrinsics), so both backends round every non-NaN value
// identically. NaN payloads may differ (the device returns a canonical NaN); results that must agree
// bitwise canonicalise NaN first (see ElementTraits::canonical_nan).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define GS_HD __host__ __device__ __forceinline__
#else
#define GS_HD inline
#endif

namespace graphsafe {

struct f16_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

GS_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u; std::memcpy(&u, &f, 4); return u;
#endif
}

GS_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; std::memcpy(&f, &u, 4); return f;
#endif
}

GS_HD float to_float(f16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h.bits));
#else
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu;
  const uint32_t mantissa = h.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_float(float_bits(magnitude) | sign);
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / nan
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

GS_HD f16_t to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return f16_t{__half_as_ushort(__float2half_rn(f))};
#else
  uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  if (x >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (x < 0x38800000u) {
    // Subnormal or zero result: adding 0.5 aligns the 10 kept bits at the bottom of the fp32 mantissa,
    // and the fp32 addition itself rounds to nearest even.
    const float aligned = bits_float(x) + bits_float(126u << 23);
    return f16_t{static_cast<uint16_t>(sign | (float_bits(aligned) - (126u << 23)))};
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias the exponent (-112 << 23) and round to nearest even
  return f16_t{static_cast<uint16_t>(sign | (x >> 13))};
#endif
}

GS_HD float to_float(bf16_t b) { return bits_float(static_cast<uint32_t>(b.bits) << 16); }

GS_HD bf16_t to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return bf16_t{__bfloat16_as_ushort(__float2bfloat16_rn(f))};
#else
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((x >> 16) | 0x0040u)};  // quiet nan
  return bf16_t{static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
#endif
}

// Accumulator type and conversions for each storage type: fp32 for the 16- and 32-bit types, fp64 for fp64.
template <class T> struct ElementTraits;
// canonical_nan(): the one NaN encoding results are normalised to, so that backends whose arithmetic
// produces different NaN payloads (x86 vs CUDA) still agree bit for bit.
template <> struct ElementTraits<float> {
  using Acc = float;
  static GS_HD float load(float v) { return v; }
  static GS_HD float store(float v) { return v; }
  static GS_HD float canonical_nan() { return bits_float(0x7fc00000u); }
};
template <> struct ElementTraits<double> {
  using Acc = double;
  static GS_HD double load(double v) { return v; }
  static GS_HD double store(double v) { return v; }
  static GS_HD double canonical_nan() {
#if defined(__CUDA_ARCH__)
    return __longlong_as_double(0x7ff8000000000000ll);
#else
    const uint64_t u = 0x7ff8000000000000ull;
    double d;
    std::memcpy(&d, &u, 8);
    return d;
#endif
  }
};
template <> struct ElementTraits<f16_t> {
  using Acc = float;
  static GS_HD float load(f16_t v) { return to_float(v); }
  static GS_HD f16_t store(float v) { return to_f16(v); }
  static GS_HD f16_t canonical_nan() { return f16_t{0x7e00}; }
};
template <> struct ElementTraits<bf16_t> {
  using Acc = float;
  static GS_HD float load(bf16_t v) { return to_float(v); }
  static GS_HD bf16_t store(float v) { return to_bf16(v); }
  static GS_HD bf16_t canonical_nan() { return bf16_t{0x7fc0}; }
};

}  // namespace graphsafe
