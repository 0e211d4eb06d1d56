// The CPU backend's 8-bit block loops (cpu.cpp): dequantising codes and quantising a block, in SIMD where the
// CPU has it, with results bit for bit those of blockwise.h's dequantize_value and quantize_block.
//
// quantize_block's requantisation is a table read per value at an index computed from it (code_sum), which
// compilers do not vectorise from the portable form (nor the byte-indexed map read of dequantising); so these
// loops are written with AVX-512 and AVX2 intrinsics, each behind a target attribute, and chosen once on the running
// CPU (cpu_quantize.cpp). Elsewhere (another architecture, or a CPU without AVX2) they are the portable loops
// themselves. AVX2 gathers code_sum's words. AVX-512 quantises the host's maps by their linear form
// (cpu_quantize_linear.h: per value one fma with constants permuted out of registers, whose floor is the code) and
// finds the codes of the values next to a decision point otherwise: by code_sum's gathers, or with AVX512-VBMI by one
// compare with a threshold from byte permutes (which also dequantise there). The intrinsic loops form the same absmax
// (an unsigned max of the same keys), the same quotient value * (1 / absmax) for every finite value (AVX-512 as the
// CUDA step does, normalized_or_nan_fused, which sends a non-finite value to NaN; AVX2 by a mask that sends it to 0:
// both the code of 0), and the same codes (code_sum's, or the linear form's, which cpu_quantize_linear.h proves equal
// to reference_code's wherever it does not defer), so every value gets quantize_block's code and every code
// dequantize_value's value: tests/cpp/test_quantization_simd.cpp checks each path the CPU has against quantize_block
// and reference_code over sweeps of bit patterns, special values, the values at and around every decision point,
// subnormal scales and block lengths, and tools/quantizer_simd_all_floats.cpp the AVX-512 loops over all floats.
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
// VBMI) and AVX512DQ, which dequantise 64 codes from the map's bytes held in registers instead of gathering 16 at a
// time, and pack 64 codes at a time when quantising (with VRANGEPS for the signed map's magnitudes). Portable: the
// loops of blockwise.h.
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
