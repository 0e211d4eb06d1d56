// The CPU backend's 8-bit block loops (cpu.cpp): dequantising codes and quantising a block, in SIMD where the
// CPU has it, with results bit for bit those of blockwise.h's dequantize_value and quantize_block.
//
// quantize_block's requantisation is a table read per value at an index computed from it (code_sum), which
// compilers do not vectorise from the portable form (nor the byte-indexed map read of dequantising); so these
// loops are written with AVX-512 and AVX2 intrinsics (gathers; with AVX512-VBMI, byte permutes for dequantising),
// each behind a target attribute, and chosen once on the running CPU (cpu_quantize.cpp). Elsewhere (another architecture, or a CPU without AVX2) they are the
// portable loops themselves. The intrinsic loops form the same absmax (an unsigned max of the same keys), the same
// quotient value * (1 / absmax) for every finite value (AVX-512 as the CUDA step does, normalized_or_nan_fused, which
// sends a non-finite value to NaN; AVX2 by a mask that sends it to 0: both the code of 0), and the same code_sum
// (max-then-min clamps, one table word, one add), so every value gets quantize_block's code and every code
// dequantize_value's value: tests/cpp/test_quantization_simd.cpp checks each path the CPU has against quantize_block
// and reference_code over sweeps of bit patterns, special values, subnormal scales and block lengths.
#pragma once

#include <cstdint>

namespace graphsafe::optim_detail {

// out[i] = dequantize_value(map, codes[i], scale) for i in [0, n), with the host's signed or unsigned map.
void dequantize_codes(bool is_signed, const uint8_t* codes, float scale, int64_t n, float* out);

// quantize_block's codes (into codes[0, n)) and returned absmax for values[0, n), any n >= 0.
float quantize_values(const uint32_t* code_words, bool is_signed, const float* values, int64_t n, uint8_t* codes);

// quantize_values' codes when the block's absmax is known (quantize_block's: absmax_finish of the largest absmax_key
// of values[0, n), which the caller gathered as it computed them).
void quantize_with_absmax(const uint32_t* code_words, bool is_signed, const float* values, int64_t n, float absmax,
                          uint8_t* codes);

// The instruction sets the loops above can take, best first. Avx512Vbmi: AVX-512 with byte permutes (AVX512BW and
// VBMI), which dequantise 64 codes from the map's bytes held in registers instead of gathering 16 at a time; its
// quantize_values is Avx512's. Portable: the loops of blockwise.h.
enum class QuantizeLoops { Avx512Vbmi, Avx512, Avx2, Portable };

// The set dequantize_codes and quantize_values use on this CPU (the best it has).
QuantizeLoops quantize_loops_in_use();

// Whether this CPU (and build) can run `loops`.
bool quantize_loops_available(QuantizeLoops loops);

// The loops above in one fixed instruction set (quantize_loops_available(loops) must hold): for the tests.
void dequantize_codes_with(QuantizeLoops loops, bool is_signed, const uint8_t* codes, float scale, int64_t n,
                           float* out);
float quantize_values_with(QuantizeLoops loops, const uint32_t* code_words, bool is_signed, const float* values,
                           int64_t n, uint8_t* codes);
void quantize_with_absmax_with(QuantizeLoops loops, const uint32_t* code_words, bool is_signed, const float* values,
                               int64_t n, float absmax, uint8_t* codes);

}  // namespace graphsafe::optim_detail
