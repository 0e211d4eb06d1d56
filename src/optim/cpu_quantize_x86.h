// The AVX-512 pieces of the CPU's 8-bit loops, for one vector of values or codes at a time: cpu_quantize.cpp builds
// its block loops from them, and cpu_quantized_step.h its fused step over runs of blocks, so that both give the same
// bits (cpu_quantize.h says which and why). x86-64 with GCC or Clang only (GS_QUANTIZE_X86), each function behind a
// target attribute: callers compiled for that instruction set (or a larger one) inline them.
#pragma once

#include <cstdint>

#include "optim/blockwise.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GS_QUANTIZE_X86 1
#include <immintrin.h>
#else
#define GS_QUANTIZE_X86 0
#endif

#if GS_QUANTIZE_X86

#define GS_AVX512 __attribute__((target("avx512f")))
#define GS_AVX2 __attribute__((target("avx2")))
#define GS_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers start their results from self-initialised "undefined" vectors, which -Wuninitialized
// reports at each inlined intrinsic (GCC bug 105593); nothing here reads an uninitialised value.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace graphsafe::optim_detail::x86 {

// The bytes of a map's values as 16 vectors of 64: plane[k][c] is byte k (little-endian) of value[c], so that byte
// permutes read byte k of the value of 64 codes at once.
struct MapBytes {
  alignas(64) uint8_t plane[4][256];
};

inline MapBytes map_bytes(const float* map) {
  MapBytes b;
  for (int c = 0; c < 256; ++c)
    for (int k = 0; k < 4; ++k) b.plane[k][c] = static_cast<uint8_t>(float_bits(map[c]) >> (8 * k));
  return b;
}

inline const MapBytes& host_map_bytes(bool is_signed) {
  static const MapBytes signed_bytes = map_bytes(kSignedMap.value), unsigned_bytes = map_bytes(kUnsignedMap.value);
  return is_signed ? signed_bytes : unsigned_bytes;
}

// After the unpacks below, float r of 128-bit lane L of output vector m (r, L, m in 0..3) is the code at position
// 16 L + 4 m + r of the reordered codes; it must be code 16 m + 4 L + r, which this order puts there.
struct UnpackOrder {
  alignas(64) uint8_t byte[64];
};

constexpr UnpackOrder unpack_order() {
  UnpackOrder o{};
  for (int l = 0; l < 4; ++l)
    for (int m = 0; m < 4; ++m)
      for (int r = 0; r < 4; ++r) o.byte[16 * l + 4 * m + r] = static_cast<uint8_t>(16 * m + 4 * l + r);
  return o;
}

inline constexpr UnpackOrder kUnpackOrder = unpack_order();

// Byte k of the values of 64 (reordered) codes, from the 4 vectors of that byte plane: codes below 128 read the
// first two, the others the last two (the top bit, from_high, chooses).
GS_AVX512_VBMI inline __m512i map_byte(const uint8_t* plane, __m512i codes, __mmask64 from_high) {
  const __m512i below = _mm512_permutex2var_epi8(_mm512_load_si512(plane), codes, _mm512_load_si512(plane + 64));
  const __m512i above =
      _mm512_permutex2var_epi8(_mm512_load_si512(plane + 128), codes, _mm512_load_si512(plane + 192));
  return _mm512_mask_blend_epi8(from_high, below, above);
}

GS_AVX512_VBMI inline void store_scaled(float* out, __m512i value_bits, __m512 scale) {
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_castsi512_ps(value_bits), scale));
}

// out[i] = map value of codes[i], times scale, for i in [0, 64) (dequantize_value's values): each byte of the 64
// values comes from a permute over the 128 bytes of the codes below 128 and one over those of the codes from 128 (a
// 2-register permute reads 7 index bits), the code's top bit choosing; unpacking the four byte vectors gives the
// floats. The unpacks interleave within 128-bit lanes, so the codes are first reordered (one permute) for the floats
// to come out in order.
GS_AVX512_VBMI inline void dequantize64_vbmi(const MapBytes& bytes, const uint8_t* codes, __m512 scale, float* out) {
  const __m512i reordered =
      _mm512_permutexvar_epi8(_mm512_load_si512(kUnpackOrder.byte), _mm512_loadu_si512(codes));
  const __mmask64 from_high = _mm512_movepi8_mask(reordered);
  const __m512i byte0 = map_byte(bytes.plane[0], reordered, from_high);
  const __m512i byte1 = map_byte(bytes.plane[1], reordered, from_high);
  const __m512i byte2 = map_byte(bytes.plane[2], reordered, from_high);
  const __m512i byte3 = map_byte(bytes.plane[3], reordered, from_high);
  const __m512i bytes01_low = _mm512_unpacklo_epi8(byte0, byte1), bytes01_high = _mm512_unpackhi_epi8(byte0, byte1);
  const __m512i bytes23_low = _mm512_unpacklo_epi8(byte2, byte3), bytes23_high = _mm512_unpackhi_epi8(byte2, byte3);
  store_scaled(out, _mm512_unpacklo_epi16(bytes01_low, bytes23_low), scale);
  store_scaled(out + 16, _mm512_unpackhi_epi16(bytes01_low, bytes23_low), scale);
  store_scaled(out + 32, _mm512_unpacklo_epi16(bytes01_high, bytes23_high), scale);
  store_scaled(out + 48, _mm512_unpackhi_epi16(bytes01_high, bytes23_high), scale);
}

// The address code_sums16 gathers from: the word of bucket b is at code_words + b, where b is the clamped bits >>
// kBucketShift less kFirstBucketBits >> kBucketShift, so the gathers take the shifted bits as their index from an
// address that far before the table (an address never read).
inline const void* gather_base(const uint32_t* code_words) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(code_words) -
                                       (kFirstBucketBits >> kBucketShift) * sizeof(uint32_t));
}

// code_sum in 16 lanes: the codes of normalized_or_nan_fused(values[i]) for i in [0, 16), stored as 16 bytes.
// Prescaled: the block's prescale is not 1 (a subnormal absmax). words: gather_base(code_words).
template <bool Signed, bool Prescaled>
GS_AVX512 inline void code_sums16(const void* words, const float* values, __m512 prescale, __m512 inverse,
                                  uint8_t* codes) {
  const __m512 low = _mm512_set1_ps(kSmallestBucketValue), high = _mm512_set1_ps(kLargestBelowOne);
  const __m512 v = _mm512_loadu_ps(values);
  const __m512 x = _mm512_fmadd_ps(Prescaled ? _mm512_mul_ps(v, prescale) : v, inverse, _mm512_sub_ps(v, v));
  // clamp_f: max(a, low) is a > low ? a : low, min(b, high) is b < high ? b : high (the operands' order matters)
  const __m512i clamped = _mm512_castps_si512(_mm512_min_ps(_mm512_max_ps(Signed ? _mm512_abs_ps(x) : x, low), high));
  const __m512i index = _mm512_srli_epi32(clamped, kBucketShift);
  __m512i sum;
  if constexpr (Signed) {
    const __m512i negative = _mm512_srai_epi32(_mm512_castps_si512(x), 31);
    const __m512i word = _mm512_i32gather_epi32(
        _mm512_add_epi32(index, _mm512_and_si512(negative, _mm512_set1_epi32(kBuckets))), words, 4);
    sum = _mm512_add_epi32(word, _mm512_xor_si512(clamped, negative));
  } else {
    sum = _mm512_add_epi32(_mm512_i32gather_epi32(index, words, 4), clamped);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(_mm512_srli_epi32(sum, 16)));
}

// The unsigned max of `largest` and the absmax keys (blockwise.h, absmax_key) of values[0, 16), lane by lane.
GS_AVX512 inline __m512i absmax_keys16(__m512i largest, const float* values) {
  const __m512i bits = _mm512_loadu_si512(values);
  return _mm512_max_epu32(largest,
                          _mm512_add_epi32(_mm512_slli_epi32(bits, 1), _mm512_set1_epi32(static_cast<int>(kFiniteKeyOffset))));
}

}  // namespace graphsafe::optim_detail::x86

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // GS_QUANTIZE_X86
