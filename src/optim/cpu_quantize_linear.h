// The AVX-512 quantiser's linear form of the maps (cpu_quantize.cpp, codes_avx512): its tables, the proof that its
// codes are reference_code's, and its step on 16 lanes (which tools/quantizer_simd_all_floats.cpp also runs on every
// float).
//
// Within one decade the levels of a map are equally spaced (blockwise.h, decade_levels), so there the nearest level's
// code is the floor of a linear function of |x| away from the decision points; the code of 0 and the codes of ±1 are
// constants. Per lane the step takes
//   a = |x| (x itself for the unsigned map) clamped to [kLinearLow, kLinearHigh], a quiet NaN to kLinearLow: code_sum's
//     clamps, so every magnitude below has the code of kLinearLow and every one above the code of ±1;
//   the region of a: a decade, the code of 0 or the code of ±1, on a's side of 0. A pair of binades (a's bits from 24
//     up; the sign flips bit 4, so the two sides' slots do not meet) holds at most one region boundary, so the pair's
//     slot names the region below its boundary and the boundary, and one compare tells the region: the next one from
//     the boundary on;
//   the region's slope, offset and clamp, and u = fma(min(a, clamp), slope, offset). The offset includes 2^23, so u
//     lies in [2^23, 2^24), where the floats are the integers: with the fma's one rounding u's bits hold t, the code
//     plus a fraction, in fixed point, the code in bits 15-22 and the fraction in bits 0-14. The clamp is the decade's
//     last level: that level's code reaches twice as far as the others' (half way to the next decade's first level),
//     and every magnitude from it to the region's end has that code. On the negative side of the signed map the codes
//     fall as |x| grows: its slopes are negative.
//
// The decision points are float-rounded midpoints of float-rounded levels, so they are not exactly where t crosses an
// integer, and the fma and the tables' constants add their roundings: a few units of 2^-15 in all (the floats next to
// a decision point lie up to 2^-23 |x| |slope| apart, less than 2^-15 even at the top of a decade; each rounding adds
// at most half a unit or a relative 2^-24). So a lane whose t lies within half of kLinearMargin units of an integer is
// deferred, and its code is found exactly elsewhere (cpu_quantize.cpp: code_sum, or resolve_deferred); the offsets
// add half the margin, so that the test is one: u's fraction bits below kLinearMargin. linear_tables_exact proves at
// compile time that every other lane has reference_code's code: u is monotone in a within a region (min, the fma and
// its rounding are), so it suffices that for every code c of every region, u's fixed point (t plus half the margin)
// at the first and at the last magnitude with that code, computed with the step's rounding, lies in [c, c + 1 +
// kLinearMargin units), and that the slots name each region exactly. The same bounds put the code of a deferred lane,
// whose fixed point lies in [c, c + kLinearMargin units) for an integer c, at c or c - 1; and as constants (fraction
// 1/2) are never deferred and every decade's codes are at least 1, c >= 1.
#pragma once

#include <bit>
#include <cstdint>

#include "optim/blockwise.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace graphsafe::optim_detail {

inline constexpr int kLinearFractionBits = 15;
inline constexpr double kLinearUnit = 1 << kLinearFractionBits;  // t's 1 in u's bits
inline constexpr double kLinearBase = 8388608.0;                 // 2^23: u's bits are 2^23's plus t in fixed point
inline constexpr uint32_t kLinearMargin = 4;                     // in units; a power of two (a bit test)
inline constexpr float kLinearLow = kSmallestBucketValue;        // 2^-23: below it the code of 0, as code_sum's
inline constexpr float kLinearHigh = 1.0f;
inline constexpr int kPairShift = 24;       // a's bits >> 24: its pair of binades (the sign bit is 0)
inline constexpr int kNegativeSlot = 16;    // flipped in a pair for x < 0: the negative side's slots
inline constexpr int kNegativeRegion = 16;  // the negative side's regions are 16 on
inline constexpr int kSideRegions = 9;      // at most, per side: the code of 0, decades 6 to 0, the code of ±1

struct LinearTables {
  alignas(64) float threshold[32];  // per slot: the region boundary in the pair (+inf if none)
  alignas(64) int32_t region[32];   // per slot: the region below it (region + 1 from it on)
  alignas(64) float slope[32];      // per region: t's change per unit of a, in units
  alignas(64) float offset[32];     // per region, in units, plus 2^23 and half the margin
  alignas(64) float clamp[32];      // per region: the largest a the line takes
  bool built;                       // false if the maps do not have the shape the tables assume
};

constexpr int pair_of(float a) { return static_cast<int>(std::bit_cast<uint32_t>(a) >> kPairShift); }
constexpr int slot_of(int pair, bool negative) { return (negative ? pair ^ kNegativeSlot : pair) & 31; }
constexpr float pair_start(int pair) { return std::bit_cast<float>(static_cast<uint32_t>(pair) << kPairShift); }

constexpr int side_code(const QuantizationMap& m, bool is_signed, bool negative, float a) {
  return reference_code(m.value, is_signed, negative ? -a : a);
}

// The smallest magnitude whose code comes after c on its side (above c for x >= 0, below it for x < 0).
constexpr float magnitude_after(const QuantizationMap& m, bool is_signed, bool negative, int c) {
  if (!negative) return code_threshold(m.value, is_signed, c);
  return next_float_up(-code_threshold(m.value, is_signed, c - 1));  // -a < that threshold: code below c
}

// fma(a, b, c) rounded once to float (to nearest even) as the instruction does: the product is exact in double,
// the sum exact as a double and its error (two-sum); only a sum exactly between two floats needs the error.
constexpr float fma_float(float a, float b, float c) {
  const double p = static_cast<double>(a) * b, s = p + c, pb = s - c, cb = s - pb;
  const double error = (p - pb) + (c - cb);
  const float f = static_cast<float>(s);
  if (error == 0.0 || static_cast<double>(f) == s) return f;
  const float other = s > f ? next_float_up(f) : next_float_down(f);
  if (s != (static_cast<double>(f) + other) / 2.0) return f;
  return (error > 0.0) == (other > f) ? other : f;
}

// The step's fixed-point t of magnitude a in region r: u's bits less 2^23's (exact: u is an integer).
constexpr double linear_fixed(const LinearTables& t, int r, float a) {
  return fma_float(a < t.clamp[r] ? a : t.clamp[r], t.slope[r], t.offset[r]) - kLinearBase;  // _mm512_min_ps
}

// One side's regions in ascending |x|: each one's start (its smallest magnitude) and first code, and its decade's
// levels (none for a constant: the code of 0, of ±1, or a decade of one level).
struct SideRegions {
  int count = 0;
  int first_code[kSideRegions] = {};
  int levels[kSideRegions] = {};
  float start[kSideRegions] = {};
  float level[kSideRegions][128] = {};
};

constexpr SideRegions side_regions(const QuantizationMap& m, bool is_signed, bool negative) {
  SideRegions s;
  for (int k = 0; k < kSideRegions; ++k) {  // the code of 0, decades 6 down to 0, the code of ±1
    float levels[128] = {};
    const int n = k == 0 || k == kSideRegions - 1 ? 0 : decade_levels(is_signed, kSideRegions - 2 - k, levels);
    const int code = side_code(m, is_signed, negative, k == kSideRegions - 1 ? 1.0f : levels[0]);
    if (s.count > 0 && code == s.first_code[s.count - 1]) continue;  // the negative side's decade 6 (no level)
    const int i = s.count++;
    s.first_code[i] = code;
    s.levels[i] = n > 1 ? n : 0;
    for (int j = 0; j < n; ++j) s.level[i][j] = levels[j];
    s.start[i] = i == 0 ? 0.0f : magnitude_after(m, is_signed, negative, negative ? code + 1 : code - 1);
  }
  return s;
}

constexpr int region_index(bool negative, int i) { return (negative ? kNegativeRegion : 0) + i; }

constexpr LinearTables make_linear_tables(bool is_signed) {
  const QuantizationMap& m = is_signed ? kSignedMap : kUnsignedMap;
  LinearTables t{};
  t.built = true;
  for (int slot = 0; slot < 32; ++slot) t.threshold[slot] = __builtin_inff();
  for (bool negative : {false, true}) {
    if (negative && !is_signed) break;
    const SideRegions side = side_regions(m, is_signed, negative);
    if (side.count > kNegativeRegion) t.built = false;
    // t = first + 1/2 at the first level, one more (less, for x < 0) per level.
    for (int i = 0; i < side.count; ++i) {
      const int r = region_index(negative, i), n = side.levels[i];
      const double step = n > 0 ? (n - 1) / (static_cast<double>(side.level[i][n - 1]) - side.level[i][0]) : 0.0;
      const double slope = negative ? -step : step;
      t.slope[r] = static_cast<float>(slope * kLinearUnit);
      t.offset[r] = static_cast<float>((side.first_code[i] + 0.5 - side.level[i][0] * slope) * kLinearUnit +
                                       kLinearMargin / 2 + kLinearBase);
      t.clamp[r] = n > 0 ? side.level[i][n - 1] : kLinearHigh;
    }
    for (int pair = pair_of(kLinearLow); pair <= pair_of(kLinearHigh); ++pair) {
      const float low = pair_start(pair), high = pair_start(pair + 1);
      int below = 0, inside = 0;
      for (int i = 0; i < side.count; ++i) {
        if (side.start[i] <= low) below = i;
        else if (side.start[i] < high) ++inside;
      }
      const int slot = slot_of(pair, negative);
      t.region[slot] = region_index(negative, below);
      if (inside > 1) t.built = false;
      if (inside == 1) t.threshold[slot] = side.start[below + 1];
    }
  }
  return t;
}

// Region i of one side is exact: for each of its codes c, t at the code's first and last magnitude (within
// [kLinearLow, kLinearHigh]) lies in [c, c + 1 + margin), so that the monotone t gives c or defers in between.
constexpr bool region_exact(const QuantizationMap& m, const LinearTables& t, bool is_signed, bool negative,
                            const SideRegions& side, int i) {
  const int r = region_index(negative, i);
  float a = side.start[i] < kLinearLow ? kLinearLow : side.start[i];
  float end = i + 1 < side.count ? next_float_down(side.start[i + 1]) : kLinearHigh;
  end = end > kLinearHigh ? kLinearHigh : end;
  for (int codes = 0; a <= end; ++codes) {
    const int c = side_code(m, is_signed, negative, a);
    if (codes == 0 && c != side.first_code[i]) return false;
    float last = kLinearHigh;  // the last magnitude with code c
    if (!negative && c < 255) last = next_float_down(code_threshold(m.value, is_signed, c));
    if (negative && c > 0) last = -code_threshold(m.value, is_signed, c - 1);
    last = last < end ? last : end;
    if (side_code(m, is_signed, negative, last) != c) return false;
    for (float x : {a, last}) {
      const double fixed = linear_fixed(t, r, x);
      if (fixed < c * kLinearUnit || fixed >= (c + 1) * kLinearUnit + kLinearMargin || fixed >= kLinearBase)
        return false;
      // A deferred lane lies in a decade, where every code is at least 1: a constant is never deferred.
      const auto fraction = static_cast<int64_t>(fixed) % static_cast<int64_t>(kLinearUnit);
      if (t.slope[r] == 0.0f ? fraction < kLinearMargin : c < 1) return false;
    }
    a = next_float_up(last);
  }
  return true;
}

constexpr bool linear_tables_exact(const LinearTables& t, bool is_signed) {
  const QuantizationMap& m = is_signed ? kSignedMap : kUnsignedMap;
  if (!t.built || pair_of(kLinearHigh) - pair_of(kLinearLow) >= kNegativeSlot) return false;  // slots stay apart
  for (int slot = 0; slot < 32; ++slot)  // the unsigned map's regions fit one register (linear_code_bits)
    if (!is_signed && t.region[slot] + 1 >= kNegativeRegion) return false;
  // (Every magnitude below kLinearLow has its code and every one above 1 that of 1: blockwise.h proves both for
  // code_sum's clamps, which are the same.)
  for (bool negative : {false, true}) {
    if (negative && !is_signed) break;
    const SideRegions side = side_regions(m, is_signed, negative);
    for (int i = 0; i < side.count; ++i)
      if (!region_exact(m, t, is_signed, negative, side, i)) return false;
  }
  return true;
}

inline constexpr LinearTables kSignedLinearTables = make_linear_tables(true);
inline constexpr LinearTables kUnsignedLinearTables = make_linear_tables(false);
static_assert(linear_tables_exact(kSignedLinearTables, true) && linear_tables_exact(kUnsignedLinearTables, false),
              "the linear quantiser is not exact: widen kLinearMargin, or the maps no longer have its shape");

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

// The tables in registers (load_linear_registers), for the step below.
struct LinearRegisters {
  __m512 threshold_low, threshold_high, slope_low, slope_high, offset_low, offset_high, clamp_low, clamp_high;
  __m512 low, high;
  __m512i region_low, region_high, fraction, one, negative_slot;
};

__attribute__((target("avx512f"))) inline LinearRegisters load_linear_registers(bool is_signed) {
  const LinearTables& t = is_signed ? kSignedLinearTables : kUnsignedLinearTables;
  LinearRegisters r;
  r.threshold_low = _mm512_load_ps(t.threshold);
  r.threshold_high = _mm512_load_ps(t.threshold + 16);
  r.region_low = _mm512_load_si512(t.region);
  r.region_high = _mm512_load_si512(t.region + 16);
  r.slope_low = _mm512_load_ps(t.slope);
  r.slope_high = _mm512_load_ps(t.slope + 16);
  r.offset_low = _mm512_load_ps(t.offset);
  r.offset_high = _mm512_load_ps(t.offset + 16);
  r.clamp_low = _mm512_load_ps(t.clamp);
  r.clamp_high = _mm512_load_ps(t.clamp + 16);
  r.low = _mm512_set1_ps(kLinearLow);
  r.high = _mm512_set1_ps(kLinearHigh);
  r.fraction = _mm512_set1_epi32(static_cast<int>((1u << kLinearFractionBits) - kLinearMargin));  // bits tested
  r.one = _mm512_set1_epi32(1);
  r.negative_slot = _mm512_set1_epi32(kNegativeSlot);
  return r;
}

// a for 16 normalised values x: |x| (x for the unsigned map) clamped to [kLinearLow, kLinearHigh], a NaN to kLinearLow.
template <bool Signed>
__attribute__((target("avx512f"))) inline __m512 linear_magnitude(const LinearRegisters& t, __m512 x) {
  // clamp_f's order of operands: max(a, low) is a > low ? a : low (NaN: low), min(b, high) is b < high ? b : high
  return _mm512_min_ps(_mm512_max_ps(Signed ? _mm512_abs_ps(x) : x, t.low), t.high);
}

// The same for the signed map with AVX512DQ's VRANGEPS, which takes max(|x|, low) in one instruction and, as max(x,
// low) does, gives low for a quiet NaN x (the only NaN arithmetic makes).
__attribute__((target("avx512f,avx512dq"))) inline __m512 linear_magnitude_range(const LinearRegisters& t, __m512 x) {
  return _mm512_min_ps(_mm512_range_ps(x, t.low, 0x0b), t.high);  // 0x0b: the larger magnitude, sign cleared
}

// The step (the top of this file) on 16 normalised values x and their a (linear_magnitude): u's bits, whose bits
// 15-22 hold the codes, and in *deferred the lanes whose codes it leaves to code_sum. The unsigned map's regions
// are all below 16 (one-register permutes).
template <bool Signed>
__attribute__((target("avx512f"))) inline __m512i linear_code_bits(const LinearRegisters& t, __m512 x, __m512 a,
                                                                  __mmask16* deferred) {
  __m512i slot = _mm512_srli_epi32(_mm512_castps_si512(a), kPairShift);
  if constexpr (Signed) {  // slot ^ (negative & 16), negative all ones for x < 0 (and a NaN with its sign bit set)
    slot = _mm512_ternarylogic_epi32(slot, _mm512_srai_epi32(_mm512_castps_si512(x), 31), t.negative_slot, 0x78);
  }
  const __mmask16 above =
      _mm512_cmp_ps_mask(a, _mm512_permutex2var_ps(t.threshold_low, slot, t.threshold_high), _CMP_GE_OQ);
  __m512i region = _mm512_permutex2var_epi32(t.region_low, slot, t.region_high);
  region = _mm512_mask_add_epi32(region, above, region, t.one);
  __m512 clamp, slope, offset;
  if constexpr (Signed) {
    clamp = _mm512_permutex2var_ps(t.clamp_low, region, t.clamp_high);
    slope = _mm512_permutex2var_ps(t.slope_low, region, t.slope_high);
    offset = _mm512_permutex2var_ps(t.offset_low, region, t.offset_high);
  } else {
    clamp = _mm512_permutexvar_ps(region, t.clamp_low);
    slope = _mm512_permutexvar_ps(region, t.slope_low);
    offset = _mm512_permutexvar_ps(region, t.offset_low);
  }
  const __m512i u = _mm512_castps_si512(_mm512_fmadd_round_ps(_mm512_min_ps(a, clamp), slope, offset,
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  *deferred = _mm512_testn_epi32_mask(u, t.fraction);
  return u;
}

#endif

}  // namespace graphsafe::optim_detail
