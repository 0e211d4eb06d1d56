// Compares the CPU's AVX-512 quantiser (src/optim/cpu_quantize_linear.h, and the loops of cpu_quantize.cpp) with its
// definition (reference_code; the code of 0 for NaN) on all 2^32 floats, for both maps:
//   each float as a normalised value through the linear step alone, lane by lane: a lane it does not defer must
//     have reference_code's code (what linear_tables_exact proves; this checks the instructions do what it models);
//   each float as a value of a block whose absmax is 1 (so the normalised value is the float itself; ±inf and NaN
//     get the code of 0) through quantize_with_absmax_with, for each AVX-512 instruction set this CPU has;
// and a block with each of a few subnormal absmaxes (the prescaled path) over every value of magnitude up to it,
// against reference_code of the documented quotient (value * 2^24) * (1 / (absmax * 2^24)). Too slow for CI (a few
// minutes on two cores); run it after changing src/optim/blockwise.h, cpu_quantize_linear.h or cpu_quantize.cpp, on
// a CPU with AVX-512:
//   g++ -O2 -std=c++20 -Isrc -Iinclude -c src/optim/cpu_quantize.cpp -o /tmp/cpu_quantize.o
//   g++ -O2 -std=c++20 -fopenmp -Isrc -Iinclude tools/quantizer_simd_all_floats.cpp /tmp/cpu_quantize.o -o /tmp/qsaf
//   /tmp/qsaf   # prints the mismatches (none) and exits 0 when there are none
#include <algorithm>
#include <cmath>
#include <cstdio>
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

constexpr int64_t kChunk = 1 << 16;  // floats per block (a multiple of 64: the vector loops only)

int expected_code(const QuantizationMap& map, bool is_signed, float x) {
  return x == x ? reference_code(map.value, is_signed, x) : zero_code(is_signed);
}

// The linear step on 16 lanes of x: for each lane, its code, or -1 where it defers.
__attribute__((target("avx512f"))) void lane_codes(__m512i bits, __mmask16 deferred, int* out) {
  alignas(64) uint32_t words[16];
  _mm512_store_si512(words, bits);
  for (int l = 0; l < 16; ++l)
    out[l] = deferred >> l & 1 ? -1 : static_cast<int>(words[l] >> kLinearFractionBits & 0xff);
}

template <bool Signed>
__attribute__((target("avx512f"))) void step_codes(const LinearRegisters& t, const float* x, int* out) {
  const __m512 v = _mm512_loadu_ps(x);
  __mmask16 deferred;
  const __m512i bits = linear_code_bits<Signed>(t, v, linear_magnitude<Signed>(t, v), &deferred);
  lane_codes(bits, deferred, out);
}

// The same with the magnitudes of linear_magnitude_range (the signed map, with AVX512DQ).
__attribute__((target("avx512f,avx512dq"))) void step_codes_range(const LinearRegisters& t, const float* x, int* out) {
  const __m512 v = _mm512_loadu_ps(x);
  __mmask16 deferred;
  const __m512i bits = linear_code_bits<true>(t, v, linear_magnitude_range(t, v), &deferred);
  lane_codes(bits, deferred, out);
}

}  // namespace

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("this CPU has no AVX-512: nothing to check\n");
    return 0;
  }
  const bool range = __builtin_cpu_supports("avx512dq");
  std::vector<QuantizeLoops> loop_sets;
  for (QuantizeLoops loops : {QuantizeLoops::Avx512Vbmi, QuantizeLoops::Avx512})
    if (quantize_loops_available(loops)) loop_sets.push_back(loops);
  long long mismatches = 0;
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
    long long step_wrong = 0, deferred = 0, loop_wrong = 0;
#pragma omp parallel reduction(+ : step_wrong, deferred, loop_wrong)
    {
      const LinearRegisters t = load_linear_registers(is_signed);
      std::vector<float> values(kChunk);
      std::vector<uint8_t> codes(kChunk);
      std::vector<int> expected(kChunk);
#pragma omp for schedule(dynamic, 16)
      for (long long chunk = 0; chunk < (1ll << 32) / kChunk; ++chunk) {
        for (int64_t i = 0; i < kChunk; ++i) {
          values[i] = bits_float(static_cast<uint32_t>(chunk * kChunk + i));
          expected[i] = expected_code(map, is_signed, values[i]);
        }
        for (int64_t i = 0; i < kChunk; i += 16) {
          int got[16], got_range[16];
          if (is_signed) step_codes<true>(t, values.data() + i, got);
          else step_codes<false>(t, values.data() + i, got);
          if (is_signed && range) step_codes_range(t, values.data() + i, got_range);
          for (int l = 0; l < 16; ++l) {
            deferred += got[l] < 0;
            step_wrong += got[l] >= 0 && got[l] != expected[i + l];
            // (VRANGEPS gives a signalling NaN back, quietened, instead of low; the step's x comes from an fma, which
            // never makes one.)
            const bool signalling = std::isnan(values[i + l]) && !(float_bits(values[i + l]) & 0x00400000u);
            if (is_signed && range && !signalling) step_wrong += got_range[l] != got[l];
          }
        }
        // A block of absmax 1: the normalised value of a finite float is itself, and a non-finite one gets the
        // code of 0 (expected_code of its NaN).
        for (int64_t i = 0; i < kChunk; ++i)
          if (!std::isfinite(values[i])) expected[i] = zero_code(is_signed);
        for (QuantizeLoops loops : loop_sets) {
          quantize_with_absmax_with(loops, map.code_word, is_signed, values.data(), kChunk, 1.0f, codes.data());
          for (int64_t i = 0; i < kChunk; ++i) loop_wrong += codes[i] != expected[i];
        }
      }
    }
    // Subnormal absmaxes: every value of magnitude up to the absmax, in blocks that start with it.
    long long prescaled_wrong = 0;
    for (float absmax : {bits_float(0x007fffffu), bits_float(0x00012345u), bits_float(0x00000001u)}) {
      const BlockScale scale = block_scale(absmax);
      const uint32_t count = 2 * float_bits(absmax) + 2;
      std::vector<float> values;
      for (uint32_t u = 0; u < count; ++u) values.push_back(bits_float((u >> 1) | (u & 1 ? 0x80000000u : 0u)));
      for (int64_t begin = 0; begin < static_cast<int64_t>(values.size()); begin += kChunk - 64) {
        std::vector<float> block(1, absmax);
        block.insert(block.end(), values.begin() + begin,
                     values.begin() + std::min<int64_t>(values.size(), begin + kChunk - 64));
        std::vector<uint8_t> codes(block.size());
        for (QuantizeLoops loops : loop_sets) {
          quantize_with_absmax_with(loops, map.code_word, is_signed, block.data(), block.size(), absmax, codes.data());
          for (std::size_t i = 0; i < block.size(); ++i)
            prescaled_wrong +=
                codes[i] != reference_code(map.value, is_signed, (block[i] * scale.prescale) * scale.inverse);
        }
      }
    }
    std::printf("%s map: linear step %lld wrong, %lld of 2^32 lanes deferred (%.2e); loops (%zu sets) %lld wrong over "
                "all floats, %lld with subnormal absmaxes\n",
                is_signed ? "signed" : "unsigned", step_wrong, deferred, deferred / 4294967296.0, loop_sets.size(),
                loop_wrong, prescaled_wrong);
    mismatches += step_wrong + loop_wrong + prescaled_wrong;
  }
  std::printf("mismatches: %lld\n", mismatches);
  return mismatches == 0 ? 0 : 1;
}
