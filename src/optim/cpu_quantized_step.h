// The CPU step's 8-bit writing pass over a run of whole quantisation blocks, fused and pipelined, for CPUs with
// AVX-512 and byte permutes (QuantizeLoops::Avx512Vbmi); cpu.cpp's update_quantized_block is the same pass one block
// at a time, on every CPU, and what this must equal bit for bit.
//
// Why: one block at a time, the step is a row of loops that each leave most of the core idle: the rule's loop is
// bound by the divider (two divisions and a square root per element for Adam), and the requantising loops after it
// by the gathers and the other ports, with the divider idle; a block's requantising waits for its last update (its
// absmax), and its loops are too long for the out-of-order window to reach the next block's divisions. Here each
// block's rule runs in steps of 64 elements, and each step also requantises 64 elements of the block before it
// (whose absmax is known by then) and dequantises the 64 codes it updates, so that the out-of-order core may work on
// the previous block's codes while the divider works on this block's quotients (the commit that added it says how much
// it gained: little; on the 2-core development machine the step stayed bound by its total vector work).
//
// The same operations on every element as update_quantized_block: dequantised values are map[code] * absmax
// (dequantize64_vbmi, as dequantize_codes); the rule is the same inlined function on the same floats (its loop
// vectorised by the compiler, which keeps IEEE operations and their order: -ffp-contract=off); the absmax is the
// unsigned max of the same keys (in any order, so the same max); the codes are code_sums16's (as
// quantize_with_absmax). With skip_zeros an all-skipped block is not touched (codes and absmax bit-identical), and in
// a partly skipped one a skipped element keeps its parameter bits and its dequantised states, as there.
#pragma once

#include <algorithm>
#include <cstdint>

#include "graphsafe/optim.h"
#include "optim/backend.h"
#include "optim/blockwise.h"
#include "optim/cpu_quantize.h"
#include "optim/cpu_quantize_x86.h"
#include "optim/rules.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers start their results from self-initialised "undefined" vectors, which -Wuninitialized
// reports at each inlined intrinsic (GCC bug 105593); nothing here reads an uninitialised value.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace graphsafe::optim_detail {

#if GS_QUANTIZE_X86

// The quantisation blocks the fused pass takes (others: update_quantized_block): a whole multiple of its 64-element
// step.
inline bool fused_quantized_step_applies(int block_size) {
  return block_size % 64 == 0 && block_size <= 1024 && quantize_loops_in_use() == QuantizeLoops::Avx512Vbmi;
}

// One block's state j requantised, `n` values from `values` with absmax `absmax` (quantize_with_absmax's codes).
GS_AVX512 inline void requantize_whole_block(bool is_signed, const float* values, int n, float absmax, uint8_t* codes) {
  quantize_with_absmax(host_quantization_map(is_signed).code_word, is_signed, values, n, absmax, codes);
}

// A block whose updated states wait in a buffer for their codes, 64 elements at a time.
template <int Slots>
struct PendingBlock {
  bool waiting = false;
  int64_t begin = 0;  // its first element
  __m512 inverse[Slots];
  const float* values[Slots];
};

// Requantises elements [i, i + 64) of each state of `pending` into its codes (words: each state's gather_base).
template <int States, int Slots>
GS_AVX512 inline void requantize64(const OptimTensor& t, const bool* is_signed, const void* const* words,
                                   const PendingBlock<Slots>& pending, int i) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int j = 0; j < States; ++j) {
    uint8_t* codes = t.codes[j] + pending.begin + i;
    const float* values = pending.values[j] + i;
    for (int q = 0; q < 64; q += 16) {
      if (is_signed[j]) x86::code_sums16<true, false>(words[j], values + q, one, pending.inverse[j], codes + q);
      else x86::code_sums16<false, false>(words[j], values + q, one, pending.inverse[j], codes + q);
    }
  }
}

// The writing pass (update_quantized_block's) over blocks [first, last), all whole blocks of `block_size` elements
// (fused_quantized_step_applies(block_size)), with rule(o, k, g, p, s).
template <class T, int States, class Rule>
GS_AVX512_VBMI void update_quantized_blocks_fused(const OptimOptions& o, const Coefficients& k, const OptimTensor& t,
                                                  int block_size, int64_t first, int64_t last, Rule rule) {
  constexpr int kSlots = States > 0 ? States : 1;
  const OptimOptions options = o;
  const Coefficients coefficients = k;
  T* const param = static_cast<T*>(t.param);
  const T* const grad = static_cast<const T*>(t.grad);
  const int n = block_size;
  // Two buffers of updated states: the block being updated writes one while the other's codes are written.
  alignas(64) float updated[2][kSlots][1024];
  alignas(64) float loaded[kSlots][64];  // dequantised states of the current 64 elements
  int32_t keep[1024];
  const x86::MapBytes* bytes[kSlots];
  bool is_signed[kSlots] = {};
  const void* words[kSlots];
  for (int j = 0; j < States; ++j) {
    is_signed[j] = state_is_signed(options, j);
    bytes[j] = &x86::host_map_bytes(is_signed[j]);
    words[j] = x86::gather_base(host_quantization_map(is_signed[j]).code_word);
  }
  PendingBlock<kSlots> pending;
  int buffer = 0;
  // Requantises the pending block alone (the last one, or one whose absmax is subnormal).
  const auto flush = [&]() {
    if (!pending.waiting) return;
    for (int j = 0; j < States; ++j) {
      const float absmax = t.absmax[j][pending.begin / n];
      requantize_whole_block(is_signed[j], pending.values[j], n, absmax, t.codes[j] + pending.begin);
    }
    pending.waiting = false;
  };
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = b * n;
    int32_t skipped_count = 0;
    if (options.skip_zeros) {
      for (int i = 0; i < n; ++i) {
        keep[i] = skipped(options, ElementTraits<T>::load(grad[begin + i])) ? 1 : 0;
        skipped_count += keep[i];
      }
      if (skipped_count == n) continue;  // all skipped: codes and absmax stay bit-identical
    }
    __m512 scale[kSlots];
    __m512i key[kSlots];
    for (int j = 0; j < States; ++j) {
      scale[j] = _mm512_set1_ps(t.absmax[j][b]);
      key[j] = _mm512_setzero_si512();
    }
    float(*const out)[1024] = updated[buffer];
    for (int i = 0; i < n; i += 64) {
      for (int j = 0; j < States; ++j) x86::dequantize64_vbmi(*bytes[j], t.codes[j] + begin + i, scale[j], loaded[j]);
      T* const p64 = param + begin + i;
      const T* const g64 = grad + begin + i;
      if (skipped_count == 0) {
        for (int l = 0; l < 64; ++l) {
          float p = ElementTraits<T>::load(p64[l]), s[4] = {};
          for (int j = 0; j < States; ++j) s[j] = loaded[j][l];
          rule(options, coefficients, ElementTraits<T>::load(g64[l]), p, s);
          p64[l] = ElementTraits<T>::store(p);
          for (int j = 0; j < States; ++j) out[j][i + l] = s[j];
        }
      } else {
        const int32_t* const keep64 = keep + i;
        for (int l = 0; l < 64; ++l) {
          const T p_before = p64[l];
          float p = ElementTraits<T>::load(p_before), s[4] = {};
          for (int j = 0; j < States; ++j) s[j] = loaded[j][l];
          rule(options, coefficients, ElementTraits<T>::load(g64[l]), p, s);
          p64[l] = keep64[l] ? p_before : ElementTraits<T>::store(p);
          for (int j = 0; j < States; ++j) out[j][i + l] = keep64[l] ? loaded[j][l] : s[j];
        }
      }
      for (int j = 0; j < States; ++j)
        for (int q = 0; q < 64; q += 16) key[j] = x86::absmax_keys16(key[j], out[j] + i + q);
      if (pending.waiting) requantize64<States>(t, is_signed, words, pending, i);
    }
    pending.waiting = false;
    bool prescaled = false;
    for (int j = 0; j < States; ++j) {
      const float absmax = absmax_finish(bits_float(_mm512_reduce_max_epu32(key[j])));
      t.absmax[j][b] = absmax;
      const BlockScale scale_of_block = block_scale(absmax);
      prescaled = prescaled || scale_of_block.prescale != 1.0f;
      pending.inverse[j] = _mm512_set1_ps(scale_of_block.inverse);
      pending.values[j] = out[j];
    }
    pending.begin = begin;
    pending.waiting = true;
    buffer ^= 1;
    if (prescaled) flush();  // a subnormal absmax: quantize_with_absmax's prescaled loop
  }
  flush();
  _mm256_zeroupper();
}

#endif  // GS_QUANTIZE_X86

}  // namespace graphsafe::optim_detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
