// The CPU's 8-bit block loops in AVX-512, AVX2 or portable C++ (cpu_quantize.h says why and what must hold).
#include "optim/cpu_quantize.h"

#include "optim/blockwise.h"

// The intrinsic loops: x86-64 with GCC or Clang (target attributes, __builtin_cpu_supports).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GS_QUANTIZE_X86 1
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers start their results from self-initialised "undefined" vectors, which -Wuninitialized
// reports at each inlined intrinsic (GCC bug 105593); nothing here reads an uninitialised value.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include "optim/cpu_quantize_linear.h"
#else
#define GS_QUANTIZE_X86 0
#endif

namespace graphsafe::optim_detail {
namespace {

void dequantize_portable(const float* map, const uint8_t* codes, float scale, int64_t begin, int64_t n, float* out) {
  for (int64_t i = begin; i < n; ++i) out[i] = dequantize_value(map, codes[i], scale);
}

// Elements [begin, n) of a block whose scale is known: quantize_block's second loop.
void quantize_portable(const uint32_t* code_words, bool is_signed, const float* values, int64_t begin, int64_t n,
                       const BlockScale& scale, uint8_t* codes) {
  for (int64_t i = begin; i < n; ++i)
    codes[i] = quantize_value(code_words, is_signed, normalized_or_nan(values[i], scale));
}

// The absmax key (blockwise.h, absmax_step) of `key` and values[begin, n).
float absmax_key_portable(float key, const float* values, int64_t begin, int64_t n) {
  for (int64_t i = begin; i < n; ++i) key = absmax_step(key, values[i]);
  return key;
}

#if GS_QUANTIZE_X86

// The vector loops cover whole vectors of a block; the few elements after the last whole vector (only a tensor's last
// block can have them) take the portable loops, which give the same bits.

#define GS_AVX512 __attribute__((target("avx512f")))
#define GS_AVX2 __attribute__((target("avx2")))

GS_AVX512 void dequantize_avx512(const float* map, const uint8_t* codes, float scale, int64_t n, float* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(index, map, 4), s));
  }
  _mm256_zeroupper();  // before any SSE code, which would otherwise run slowly
  if (i < n) dequantize_portable(map, codes, scale, i, n, out);
}

// The bytes of a table of 256 floats (a map's values, or its thresholds) as 16 vectors of 64: plane[k][c] is byte k
// (little-endian) of value[c], so that byte permutes read byte k of the value of 64 codes at once.
struct MapBytes {
  alignas(64) uint8_t plane[4][256];
};

MapBytes map_bytes(const float* map) {
  MapBytes b;
  for (int c = 0; c < 256; ++c)
    for (int k = 0; k < 4; ++k) b.plane[k][c] = static_cast<uint8_t>(float_bits(map[c]) >> (8 * k));
  return b;
}

const MapBytes& host_map_bytes(bool is_signed) {
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

constexpr UnpackOrder kUnpackOrder = unpack_order();

#define GS_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi")))

// Byte k of the values of 64 (reordered) codes, from the 4 vectors of that byte plane: codes below 128 read the
// first two, the others the last two (the top bit, from_high, chooses).
GS_AVX512_VBMI inline __m512i map_byte(const uint8_t* plane, __m512i codes, __mmask64 from_high) {
  const __m512i below = _mm512_permutex2var_epi8(_mm512_load_si512(plane), codes, _mm512_load_si512(plane + 64));
  const __m512i above =
      _mm512_permutex2var_epi8(_mm512_load_si512(plane + 128), codes, _mm512_load_si512(plane + 192));
  return _mm512_mask_blend_epi8(from_high, below, above);
}

// The 32-bit words of a table (as its byte planes) at 64 codes, in the codes' order: words[m] holds those of codes
// 16 m to 16 m + 15. Each byte comes from a permute over the 128 bytes of the codes below 128 and one over those of
// the codes from 128 (a 2-register permute reads 7 index bits), the code's top bit choosing; unpacking the four byte
// vectors gives the words. The unpacks interleave within 128-bit lanes, so the codes are first reordered (one
// permute, kUnpackOrder in order) for the words to come out in order.
GS_AVX512_VBMI inline void table_words(const MapBytes& bytes, __m512i order, __m512i codes, __m512i words[4]) {
  const __m512i reordered = _mm512_permutexvar_epi8(order, codes);
  const __mmask64 from_high = _mm512_movepi8_mask(reordered);
  const __m512i byte0 = map_byte(bytes.plane[0], reordered, from_high);
  const __m512i byte1 = map_byte(bytes.plane[1], reordered, from_high);
  const __m512i byte2 = map_byte(bytes.plane[2], reordered, from_high);
  const __m512i byte3 = map_byte(bytes.plane[3], reordered, from_high);
  const __m512i bytes01_low = _mm512_unpacklo_epi8(byte0, byte1), bytes01_high = _mm512_unpackhi_epi8(byte0, byte1);
  const __m512i bytes23_low = _mm512_unpacklo_epi8(byte2, byte3), bytes23_high = _mm512_unpackhi_epi8(byte2, byte3);
  words[0] = _mm512_unpacklo_epi16(bytes01_low, bytes23_low);
  words[1] = _mm512_unpackhi_epi16(bytes01_low, bytes23_low);
  words[2] = _mm512_unpacklo_epi16(bytes01_high, bytes23_high);
  words[3] = _mm512_unpackhi_epi16(bytes01_high, bytes23_high);
}

// dequantize_avx512 for 64 codes at a time, the values from the map's byte planes (table_words): the same values,
// times the same scale.
GS_AVX512_VBMI void dequantize_avx512_vbmi(bool is_signed, const uint8_t* codes, float scale, int64_t n, float* out) {
  const MapBytes& bytes = host_map_bytes(is_signed);
  const __m512i order = _mm512_load_si512(kUnpackOrder.byte);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512i values[4];
    table_words(bytes, order, _mm512_loadu_si512(codes + i), values);
    for (int m = 0; m < 4; ++m) _mm512_storeu_ps(out + i + 16 * m, _mm512_mul_ps(_mm512_castsi512_ps(values[m]), s));
  }
  dequantize_avx512(host_quantization_map(is_signed).value, codes + i, scale, n - i, out + i);
}

// normalized_or_nan_fused of 16 values. Prescaled: the block's prescale is not 1 (a subnormal absmax).
template <bool Prescaled>
GS_AVX512 inline __m512 normalized_avx512(const float* values, __m512 prescale, __m512 inverse) {
  const __m512 v = _mm512_loadu_ps(values);
  return _mm512_fmadd_ps(Prescaled ? _mm512_mul_ps(v, prescale) : v, inverse, _mm512_sub_ps(v, v));
}

// code_sum in 16 lanes: the codes of normalized_or_nan_fused(values[i]) for i in [0, n) (n a multiple of 16), as
// bytes. Also the exact path of the linear loops below, for the vectors they defer.
template <bool Signed, bool Prescaled>
GS_AVX512 void code_sums_avx512(const uint32_t* code_words, const float* values, int64_t n, const BlockScale& scale,
                                uint8_t* codes) {
  const __m512 prescale = _mm512_set1_ps(scale.prescale), inverse = _mm512_set1_ps(scale.inverse);
  const __m512 low = _mm512_set1_ps(kSmallestBucketValue), high = _mm512_set1_ps(kLargestBelowOne);
  const __m512i negative_words = _mm512_set1_epi32(kBuckets);
  // The word of bucket b is at code_words + b, where b is the clamped bits >> kBucketShift less kFirstBucketBits >>
  // kBucketShift: the gathers take the shifted bits as their index from an address that far before the table (an
  // address never read).
  const void* const words = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(code_words) -
                                                           (kFirstBucketBits >> kBucketShift) * sizeof(uint32_t));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 x = normalized_avx512<Prescaled>(values + i, prescale, inverse);
    // clamp_f: max(a, low) is a > low ? a : low, min(b, high) is b < high ? b : high (the operands' order matters)
    const __m512i clamped =
        _mm512_castps_si512(_mm512_min_ps(_mm512_max_ps(Signed ? _mm512_abs_ps(x) : x, low), high));
    const __m512i index = _mm512_srli_epi32(clamped, kBucketShift);
    __m512i sum;
    if constexpr (Signed) {
      const __m512i negative = _mm512_srai_epi32(_mm512_castps_si512(x), 31);
      const __m512i word = _mm512_i32gather_epi32(_mm512_add_epi32(index, _mm512_and_si512(negative, negative_words)),
                                                  words, 4);
      sum = _mm512_add_epi32(word, _mm512_xor_si512(clamped, negative));
    } else {
      sum = _mm512_add_epi32(_mm512_i32gather_epi32(index, words, 4), clamped);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(_mm512_srli_epi32(sum, 16)));
  }
}

// The largest absmax key (blockwise.h, absmax_step) of values[0, n), 16 lanes at a time.
GS_AVX512 float absmax_key_avx512(const float* values, int64_t n) {
  const int64_t whole = n & ~int64_t(15);
  __m512i largest = _mm512_setzero_si512();
  const __m512i key_offset = _mm512_set1_epi32(static_cast<int>(kFiniteKeyOffset));
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512i bits = _mm512_loadu_si512(values + i);
    largest = _mm512_max_epu32(largest, _mm512_add_epi32(_mm512_slli_epi32(bits, 1), key_offset));
  }
  const float key = bits_float(_mm512_reduce_max_epu32(largest));
  _mm256_zeroupper();
  return absmax_key_portable(key, values, whole, n);
}

// code_sums_avx512's codes from the linear step (cpu_quantize_linear.h) for values [begin, n), 16 lanes at a time,
// with the host's map (the step's tables, t, are that map's); a vector with a lane the step defers takes
// code_sums_avx512.
template <bool Signed, bool Prescaled>
GS_AVX512 inline __attribute__((always_inline)) void linear_codes_from(const LinearRegisters& t,
                                                                       const uint32_t* code_words, const float* values,
                                                                       int64_t begin, int64_t n,
                                                                       const BlockScale& scale, uint8_t* codes) {
  const __m512 prescale = _mm512_set1_ps(scale.prescale), inverse = _mm512_set1_ps(scale.inverse);
  for (int64_t i = begin; i < n; i += 16) {
    __mmask16 deferred;
    const __m512 x = normalized_avx512<Prescaled>(values + i, prescale, inverse);
    const __m512i bits = linear_code_bits<Signed>(t, x, linear_magnitude<Signed>(t, x), &deferred);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     _mm512_cvtepi32_epi8(_mm512_srli_epi32(bits, kLinearFractionBits)));
    if (deferred != 0) [[unlikely]]
      code_sums_avx512<Signed, Prescaled>(code_words, values + i, 16, scale, codes + i);
  }
}

// linear_codes_from over a block's whole vectors.
template <bool Signed, bool Prescaled>
GS_AVX512 void linear_codes_avx512(const uint32_t* code_words, const float* values, int64_t n,
                                   const BlockScale& scale, uint8_t* codes) {
  linear_codes_from<Signed, Prescaled>(load_linear_registers(Signed), code_words, values, 0, n, scale, codes);
}

// Byte permutes that pack the codes of four vectors of u's bits (bits 15-22): the first gathers bytes 1 and 2 of each
// word of two vectors (the first's, then the second's) into 16-bit words, whose low byte, shifted right by 7, is the
// code; the second takes those low bytes.
struct CodePacking {
  alignas(64) uint8_t word_bytes[64];
  alignas(64) uint8_t low_bytes[64];
};

constexpr CodePacking code_packing() {
  static_assert(kLinearFractionBits == 15, "the packing takes the codes from bits 15-22");
  CodePacking p{};
  for (int j = 0; j < 64; ++j) {
    const int word = j / 2;  // of the 32 in the result: word `word` of the first vector, then of the second
    p.word_bytes[j] = static_cast<uint8_t>((word < 16 ? 0 : 64) + 4 * (word % 16) + 1 + j % 2);
    p.low_bytes[j] = static_cast<uint8_t>(2 * j);
  }
  return p;
}

constexpr CodePacking kCodePacking = code_packing();

// Each map's thresholds: entry c is code_threshold(c), the smallest value whose code is above c (entry 255, above the
// last code, only ever meets lanes that were not deferred), and as byte planes for table_words.
struct CodeThresholds {
  float value[256];
};

constexpr CodeThresholds code_thresholds(bool is_signed) {
  CodeThresholds t{};
  const QuantizationMap& m = is_signed ? kSignedMap : kUnsignedMap;
  for (int c = 0; c < 255; ++c) t.value[c] = code_threshold(m.value, is_signed, c);
  t.value[255] = kLargestFloat;
  return t;
}

constexpr CodeThresholds kSignedThresholds = code_thresholds(true), kUnsignedThresholds = code_thresholds(false);

const MapBytes& host_threshold_bytes(bool is_signed) {
  static const MapBytes signed_bytes = map_bytes(kSignedThresholds.value),
                        unsigned_bytes = map_bytes(kUnsignedThresholds.value);
  return is_signed ? signed_bytes : unsigned_bytes;
}

// The codes of the lanes the linear step deferred among 64 values (deferred: their lanes), from the codes packed for
// them, without code_sum's gathers: a deferred lane's t lies within the margin of the integer c it was packed as, so
// its code is c or c - 1, c >= 1 (cpu_quantize_linear.h, linear_tables_exact), and it is c exactly when its x (the
// step's, computed again) is at least code_threshold(c - 1), read from the byte planes of the thresholds.
template <bool Prescaled>
GS_AVX512_VBMI inline void resolve_deferred(const MapBytes& thresholds, const float* values, const BlockScale& scale,
                                            __mmask64 deferred, uint8_t* codes) {
  const __m512 prescale = _mm512_set1_ps(scale.prescale), inverse = _mm512_set1_ps(scale.inverse);
  const __m512i packed = _mm512_loadu_si512(codes), lower = _mm512_sub_epi8(packed, _mm512_set1_epi8(1));
  __m512i threshold[4];
  table_words(thresholds, _mm512_load_si512(kUnpackOrder.byte), lower, threshold);
  __mmask64 reaches = 0;
  for (int m = 0; m < 4; ++m) {
    const __m512 x = normalized_avx512<Prescaled>(values + 16 * m, prescale, inverse);
    const __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(threshold[m]), _CMP_GE_OQ);
    reaches |= static_cast<__mmask64>(above) << (16 * m);
  }
  _mm512_storeu_si512(codes, _mm512_mask_blend_epi8(deferred & ~reaches, packed, lower));
}

// linear_codes_avx512 for 64 values at a time, with VRANGEPS for the signed map's magnitudes, byte permutes to pack
// the codes, and resolve_deferred for the lanes the step defers.
template <bool Signed, bool Prescaled>
GS_AVX512_VBMI void linear_codes_avx512_vbmi(const uint32_t* code_words, const float* values, int64_t n,
                                             const BlockScale& scale, uint8_t* codes) {
  const LinearRegisters t = load_linear_registers(Signed);
  const __m512 prescale = _mm512_set1_ps(scale.prescale), inverse = _mm512_set1_ps(scale.inverse);
  const __m512i word_bytes = _mm512_load_si512(kCodePacking.word_bytes);
  const __m512i low_bytes = _mm512_load_si512(kCodePacking.low_bytes);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __mmask16 deferred[4];
    __m512i bits[4];
    for (int j = 0; j < 4; ++j) {
      const __m512 x = normalized_avx512<Prescaled>(values + i + 16 * j, prescale, inverse);
      const __m512 a = Signed ? linear_magnitude_range(t, x) : linear_magnitude<false>(t, x);
      bits[j] = linear_code_bits<Signed>(t, x, a, &deferred[j]);
    }
    const __m512i low = _mm512_srli_epi16(_mm512_permutex2var_epi8(bits[0], word_bytes, bits[1]), 7);
    const __m512i high = _mm512_srli_epi16(_mm512_permutex2var_epi8(bits[2], word_bytes, bits[3]), 7);
    _mm512_storeu_si512(codes + i, _mm512_permutex2var_epi8(low, low_bytes, high));
    if ((deferred[0] | deferred[1] | deferred[2] | deferred[3]) != 0) [[unlikely]] {
      const __mmask64 lanes = static_cast<__mmask64>(deferred[0]) | static_cast<__mmask64>(deferred[1]) << 16 |
                              static_cast<__mmask64>(deferred[2]) << 32 | static_cast<__mmask64>(deferred[3]) << 48;
      resolve_deferred<Prescaled>(host_threshold_bytes(Signed), values + i, scale, lanes, codes + i);
    }
  }
  linear_codes_from<Signed, Prescaled>(t, code_words, values, i, n, scale, codes);
}

// quantize_block's codes for a block of the given absmax, 16 lanes at a time: those of the branch-free
// normalized_or_nan_fused (the CUDA step's form; the same codes as normalized_or_nan, test_quantization.cpp), from
// the linear step for the host's maps (with byte permutes to pack 64 at a time where the CPU has VBMI), from code_sum
// for other code words.
template <bool Signed, bool BytePermutes>
GS_AVX512 void codes_avx512(const uint32_t* code_words, const float* values, int64_t n, float absmax, uint8_t* codes) {
  const int64_t whole = n & ~int64_t(15);
  const BlockScale scale = block_scale(absmax);
  const bool prescaled = scale.prescale != 1.0f;
  if (code_words != host_quantization_map(Signed).code_word) {
    if (prescaled) code_sums_avx512<Signed, true>(code_words, values, whole, scale, codes);
    else code_sums_avx512<Signed, false>(code_words, values, whole, scale, codes);
  } else if (BytePermutes && whole >= 64) {
    if (prescaled) linear_codes_avx512_vbmi<Signed, true>(code_words, values, whole, scale, codes);
    else linear_codes_avx512_vbmi<Signed, false>(code_words, values, whole, scale, codes);
  } else {
    if (prescaled) linear_codes_avx512<Signed, true>(code_words, values, whole, scale, codes);
    else linear_codes_avx512<Signed, false>(code_words, values, whole, scale, codes);
  }
  _mm256_zeroupper();  // (GCC leaves it out here) before any SSE code, which would otherwise run slowly
  if (whole < n) quantize_portable(code_words, Signed, values, whole, n, scale, codes);
}

GS_AVX2 void dequantize_avx2(const float* map, const uint8_t* codes, float scale, int64_t n, float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(map, index, 4), s));
  }
  _mm256_zeroupper();  // before any SSE code, which would otherwise run slowly
  if (i < n) dequantize_portable(map, codes, scale, i, n, out);
}

// The largest absmax key (blockwise.h, absmax_step) of values[0, n), 8 lanes at a time.
GS_AVX2 float absmax_key_avx2(const float* values, int64_t n) {
  const int64_t whole = n & ~int64_t(7);
  __m256i largest = _mm256_setzero_si256();
  const __m256i key_offset = _mm256_set1_epi32(static_cast<int>(kFiniteKeyOffset));
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i));
    largest = _mm256_max_epu32(largest, _mm256_add_epi32(_mm256_slli_epi32(bits, 1), key_offset));
  }
  __m128i half = _mm_max_epu32(_mm256_castsi256_si128(largest), _mm256_extracti128_si256(largest, 1));
  half = _mm_max_epu32(half, _mm_shuffle_epi32(half, 0x4e));  // lanes 2, 3, 0, 1
  half = _mm_max_epu32(half, _mm_shuffle_epi32(half, 0xb1));  // lanes 1, 0, 3, 2
  const float key = bits_float(static_cast<uint32_t>(_mm_cvtsi128_si32(half)));
  _mm256_zeroupper();
  return absmax_key_portable(key, values, whole, n);
}

// quantize_block's codes for a block of the given absmax, 8 lanes at a time: per value normalized_or_nan with +0 (a
// bit mask) instead of NaN for a non-finite value (code_sum gives both the code of 0, as quantize_value does NaN),
// and code_sum.
template <bool Signed>
GS_AVX2 void codes_avx2(const uint32_t* code_words, const float* values, int64_t n, float absmax, uint8_t* codes) {
  const int64_t whole = n & ~int64_t(7);
  const BlockScale scale = block_scale(absmax);
  const __m256 prescale = _mm256_set1_ps(scale.prescale), inverse = _mm256_set1_ps(scale.inverse);
  const __m256 largest_float = _mm256_set1_ps(kLargestFloat);
  const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 low = _mm256_set1_ps(kSmallestBucketValue), high = _mm256_set1_ps(kLargestBelowOne);
  const __m256i first_bucket = _mm256_set1_epi32(static_cast<int>(kFirstBucketBits >> kBucketShift));
  const __m256i negative_words = _mm256_set1_epi32(kBuckets);
  // byte 2 of each 32-bit sum (its code) to the low 4 bytes of each 128-bit half
  const __m256i code_bytes = _mm256_setr_epi8(2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                              2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const int* words = reinterpret_cast<const int*>(code_words);
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(values + i);
    const __m256 finite = _mm256_cmp_ps(_mm256_and_ps(v, magnitude_bits), largest_float, _CMP_LE_OQ);
    const __m256 x = _mm256_and_ps(_mm256_mul_ps(_mm256_mul_ps(v, prescale), inverse), finite);
    const __m256 clamped_float =
        _mm256_min_ps(_mm256_max_ps(Signed ? _mm256_and_ps(x, magnitude_bits) : x, low), high);  // as clamp_f
    const __m256i clamped = _mm256_castps_si256(clamped_float);
    const __m256i bucket = _mm256_sub_epi32(_mm256_srli_epi32(clamped, kBucketShift), first_bucket);
    __m256i sum;
    if constexpr (Signed) {
      const __m256i negative = _mm256_srai_epi32(_mm256_castps_si256(x), 31);
      const __m256i word =
          _mm256_i32gather_epi32(words, _mm256_add_epi32(bucket, _mm256_and_si256(negative, negative_words)), 4);
      sum = _mm256_add_epi32(word, _mm256_xor_si256(clamped, negative));
    } else {
      sum = _mm256_add_epi32(_mm256_i32gather_epi32(words, bucket, 4), clamped);
    }
    const __m256i packed = _mm256_shuffle_epi8(sum, code_bytes);
    const __m128i eight = _mm_unpacklo_epi32(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), eight);
  }
  _mm256_zeroupper();  // (GCC leaves it out here) before any SSE code, which would otherwise run slowly
  if (whole < n) quantize_portable(code_words, Signed, values, whole, n, scale, codes);
}

#endif  // GS_QUANTIZE_X86

QuantizeLoops detect_loops() {
#if GS_QUANTIZE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    const bool byte_permutes = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
                               __builtin_cpu_supports("avx512dq");
    return byte_permutes ? QuantizeLoops::Avx512Vbmi : QuantizeLoops::Avx512;
  }
  if (__builtin_cpu_supports("avx2")) return QuantizeLoops::Avx2;
#endif
  return QuantizeLoops::Portable;
}

}  // namespace

QuantizeLoops quantize_loops_in_use() {
  static const QuantizeLoops loops = detect_loops();
  return loops;
}

bool quantize_loops_available(QuantizeLoops loops) {
  return static_cast<int>(loops) >= static_cast<int>(quantize_loops_in_use());  // each set's CPUs run those below it
}

void dequantize_codes_with(QuantizeLoops loops, bool is_signed, const uint8_t* codes, float scale, int64_t n,
                           float* out) {
  const float* map = host_quantization_map(is_signed).value;
#if GS_QUANTIZE_X86
  switch (loops) {
    case QuantizeLoops::Avx512Vbmi: return dequantize_avx512_vbmi(is_signed, codes, scale, n, out);
    case QuantizeLoops::Avx512: return dequantize_avx512(map, codes, scale, n, out);
    case QuantizeLoops::Avx2: return dequantize_avx2(map, codes, scale, n, out);
    default: break;
  }
#endif
  (void)loops;
  dequantize_portable(map, codes, scale, 0, n, out);
}

void quantize_with_absmax_with(QuantizeLoops loops, const uint32_t* code_words, bool is_signed, const float* values,
                               int64_t n, float absmax, uint8_t* codes) {
#if GS_QUANTIZE_X86
  if (loops == QuantizeLoops::Avx512Vbmi)
    return is_signed ? codes_avx512<true, true>(code_words, values, n, absmax, codes)
                     : codes_avx512<false, true>(code_words, values, n, absmax, codes);
  if (loops == QuantizeLoops::Avx512)
    return is_signed ? codes_avx512<true, false>(code_words, values, n, absmax, codes)
                     : codes_avx512<false, false>(code_words, values, n, absmax, codes);
  if (loops == QuantizeLoops::Avx2)
    return is_signed ? codes_avx2<true>(code_words, values, n, absmax, codes)
                     : codes_avx2<false>(code_words, values, n, absmax, codes);
#endif
  (void)loops;
  quantize_portable(code_words, is_signed, values, 0, n, block_scale(absmax), codes);
}

float quantize_values_with(QuantizeLoops loops, const uint32_t* code_words, bool is_signed, const float* values,
                           int64_t n, uint8_t* codes) {
  float key = 0.0f;
#if GS_QUANTIZE_X86
  if (loops == QuantizeLoops::Avx512Vbmi || loops == QuantizeLoops::Avx512) key = absmax_key_avx512(values, n);
  else if (loops == QuantizeLoops::Avx2) key = absmax_key_avx2(values, n);
  else key = absmax_key_portable(key, values, 0, n);
#else
  key = absmax_key_portable(key, values, 0, n);
#endif
  const float absmax = absmax_finish(key);
  quantize_with_absmax_with(loops, code_words, is_signed, values, n, absmax, codes);
  return absmax;
}

void dequantize_codes(bool is_signed, const uint8_t* codes, float scale, int64_t n, float* out) {
  dequantize_codes_with(quantize_loops_in_use(), is_signed, codes, scale, n, out);
}

float quantize_values(const uint32_t* code_words, bool is_signed, const float* values, int64_t n, uint8_t* codes) {
  return quantize_values_with(quantize_loops_in_use(), code_words, is_signed, values, n, codes);
}

void quantize_with_absmax(const uint32_t* code_words, bool is_signed, const float* values, int64_t n, float absmax,
                          uint8_t* codes) {
  quantize_with_absmax_with(quantize_loops_in_use(), code_words, is_signed, values, n, absmax, codes);
}

}  // namespace graphsafe::optim_detail
