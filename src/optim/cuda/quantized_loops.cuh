// The two 8-bit loops of the optimizer's CUDA kernels and what they share: dequantising a block's states,
// agreeing on its new absmax across the threads that share it (group_max, agree_on_block), and requantising
// (Requantizer). for_each at the end picks the loop for a kernel's state width.
#pragma once

#include <cstdint>
#include <cstring>

#include "optim/blockwise.h"
#include "optim/cuda/element_loop.cuh"
#include "optim/cuda/launch_table.cuh"
#include "optim/cuda/policy.cuh"
#include "optim/cuda/quantization_maps.cuh"
#include "optim/cuda/vector_access.cuh"
#include "optim/layout.h"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

// The options with what algorithm A and a count of States states imply written as constants (the algorithm;
// Adam's amsgrad; RMSprop's centered), so that the compiler folds the tests on them (state_is_signed's switch,
// the rules' option branches) out of the 8-bit element loops (dense and row-sparse) instead of testing them per element.
template <OptimAlgorithm A, int States>
__device__ OptimOptions with_known_options(const OptimOptions& o) {
  OptimOptions known = o;
  known.algorithm = A;
  if constexpr (A == OptimAlgorithm::Adam || A == OptimAlgorithm::AdamW) known.amsgrad = States == 3;
  if constexpr (A == OptimAlgorithm::RMSprop && States != 2) known.centered = States == 3;
  return known;
}

// Per value k, the absmax_combine over the `group` consecutive threads (a power of two from 4 to 128) that
// share a quantisation block; all N values in one exchange, so a group wider than a warp meets at two
// barriers per pass whatever N is (within a warp: one REDUX per value, or shuffles below 32). Every thread of the
// block calls it; all get their group's results. Values are absmax keys from absmax_step (or 0 or 1).
template <int N>
__device__ void group_max(float (&v)[N], int group, float (&exchange)[N][QuantizedLoopPolicy::kMaxWarps]) {
  if (group >= 32) {  // a whole warp: absmax_combine is an unsigned max of the bits, one REDUX per value
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = bits_float(__reduce_max_sync(0xffffffffu, float_bits(v[k])));
  } else {
    for (int offset = group / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = absmax_combine(v[k], __shfl_xor_sync(0xffffffffu, v[k], offset));
    }
  }
  if (group <= 32) return;
  const int warp = threadIdx.x / 32, warps = group / 32, first = warp & ~(warps - 1);  // warps: a power of two
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) exchange[k][warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    v[k] = exchange[k][first];
    for (int w = first + 1; w < first + warps; ++w) v[k] = absmax_combine(v[k], exchange[k][w]);
  }
  __syncthreads();  // exchange[] is reused by the next pass
}

// After an 8-bit pass, what the `group` threads sharing a quantisation block agree on (all threads call it):
// reduced[0] is 1 if any of them updated an element, reduced[1 + j] state j's new absmax over the block's
// valid elements (an absmax key for absmax_finish: non-finite values take no part).
template <int N, int V>  // N: the states + 1
__device__ void agree_on_block(bool any, const float (&s)[V][4], const bool (&valid)[V], int group,
                               float (&exchange)[N][QuantizedLoopPolicy::kMaxWarps], float (&reduced)[N]) {
  reduced[0] = any ? 1.0f : 0.0f;
#pragma unroll
  for (int j = 0; j + 1 < N; ++j) {
    reduced[1 + j] = 0.0f;
#pragma unroll
    for (int e = 0; e < V; ++e) if (valid[e]) reduced[1 + j] = absmax_step(reduced[1 + j], s[e][j]);
  }
  group_max(reduced, group, exchange);
}

// The codes in byte 2 of four code sums (blockwise.h, code_sum; their byte 3 is 0), packed into one word, the first
// in its lowest byte: three byte permutes on the GPU, instead of a shift and a byte move per code.
__device__ uint32_t codes_of_sums(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(__byte_perm(a, b, 0x0062), __byte_perm(c, d, 0x0062), 0x5410);
#else
  return (a >> 16) | ((b >> 8) & 0xff00u) | (c & 0xff0000u) | (d << 8 & 0xff000000u);
#endif
}

// Requantising state j of one quantisation block after a pass, shared by both 8-bit loops: from the absmax key
// agree_on_block gathered (finite values only), the block's new absmax and scale; codes<N>(s, first) are state
// j's codes of elements first .. first + N - 1 of the thread's s[][], as quantize_block gives them (a
// non-finite value becomes NaN in normalized_or_nan_fused and gets the code of 0 from code_sum: no branch).
struct Requantizer {
  int j;
  bool is_signed;
  const uint32_t* words;
  float absmax;
  BlockScale scale;

  __device__ Requantizer(const OptimOptions& o, const SharedMaps* maps, int state, float absmax_key)
      : j(state), is_signed(state_is_signed(o, state)), words(maps->words(is_signed)),
        absmax(absmax_finish(absmax_key)), scale(block_scale(absmax)) {}

  template <int N, int V>
  __device__ Pack<uint8_t, N> codes(const float (&s)[V][4], int first) const {
    static_assert(N % 4 == 0, "codes are packed four at a time");
    float x[N];
    // One fused multiply-add per value where the block's absmax is a normal float (all but vanishingly rare
    // blocks): normalized's prescale is 1 there, and value * 1 is value exactly, so the codes are the same.
    if (scale.prescale == 1.0f) {
#pragma unroll
      for (int i = 0; i < N; ++i) x[i] = fma_f(s[first + i][j], scale.inverse, s[first + i][j] - s[first + i][j]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) x[i] = normalized_or_nan_fused(s[first + i][j], scale);
    }
    // Four codes per word: setting the codes byte by byte made the compiler take every packed word apart again.
    uint32_t packed[N / 4];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      uint32_t sum[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        sum[k] = is_signed ? code_sum<true>(words, x[4 * i + k]) : code_sum<false>(words, x[4 * i + k]);
      packed[i] = codes_of_sums(sum[0], sum[1], sum[2], sum[3]);
    }
    Pack<uint8_t, N> c;
    memcpy(&c, packed, N);
    return c;
  }
};

// The 8-bit counterpart of for_each_element: each of the block's Threads threads owns V consecutive elements per
// pass of Threads * V; the block_size / V threads of one quantisation block dequantise their states, run body
// (false: skipped, p and s unchanged), and, with Writes, store the updated elements' parameters and, when
// any element of the block was updated, agree on the new absmax and requantise. An all-skipped block keeps
// codes and absmax bit-identical. V: QuantizedLoopPolicy's kWritingVector for writing passes, kMeasuringVector
// for the measuring pass (Writes false, LAMB/LARS pass 1). Every thread runs every pass (group reductions wider
// than a warp need them all); elements past the tensor's end take no part.
template <class T, int States, bool Writes, int Threads, class Body, class Table>
__device__ void for_each_quantized_element(const OptimOptions& o, const Table& table, const BlockWork& w,
                                           int block_size, const SharedMaps* maps, Body body) {
  constexpr int V = Writes ? QuantizedLoopPolicy::kWritingVector : QuantizedLoopPolicy::kMeasuringVector;
  __shared__ float exchange[States + 1][QuantizedLoopPolicy::kMaxWarps];
  T* param = static_cast<T*>(table.tensor[w.tensor].param);
  const T* grad = static_cast<const T*>(table.tensor[w.tensor].grad);
  const bool wide = pack_aligned<T, V>(param) && pack_aligned<T, V>(grad);
  bool wide_codes = true;
#pragma unroll
  for (int j = 0; j < States; ++j) wide_codes = wide_codes && pack_aligned<uint8_t, V>(static_cast<uint8_t*>(table.tensor[w.tensor].state[j]));
  const int group = block_size / V;
  const int block_shift = __ffs(block_size) - 1;  // block_size is a power of two: no 64-bit division per pass
  for (int64_t pass = w.begin; pass < w.end; pass += Threads * V) {
    const int64_t base = pass + int64_t(threadIdx.x) * V;
    const int64_t quant_block = base >> block_shift;
    const bool full = base + V <= w.end;
    // How many of the V elements exist: 32-bit compares per element instead of 64-bit ones.
    const int present = full ? V : (base < w.end ? int(w.end - base) : 0);
    float g[V] = {}, p[V] = {}, s[V][4] = {}, scale[4] = {};
    bool valid[V], updated[V] = {};
#pragma unroll
    for (int e = 0; e < V; ++e) valid[e] = e < present;
    Pack<T, V> p_raw{};  // the parameters as loaded: skipped elements are stored back with their own bits
    if (wide && full) {
      const Pack<T, V> g_raw = load_pack<T, V>(grad + base);
      p_raw = load_pack<T, V>(param + base);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        g[e] = ElementTraits<T>::load(g_raw.v[e]);
        p[e] = ElementTraits<T>::load(p_raw.v[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (valid[e]) {
          g[e] = ElementTraits<T>::load(grad[base + e]);
          p[e] = ElementTraits<T>::load(param[base + e]);
        }
    }
#pragma unroll
    for (int j = 0; j < States; ++j) {
      const float* map = maps->value(state_is_signed(o, j));
      const uint8_t* codes = static_cast<const uint8_t*>(table.tensor[w.tensor].state[j]);
      if (base < w.end) scale[j] = table.tensor[w.tensor].absmax[j][quant_block];
      Pack<uint8_t, V> c{};
      if (full && wide_codes) {
        c = load_pack<uint8_t, V>(codes + base);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) if (valid[e]) c.v[e] = codes[base + e];
      }
#pragma unroll
      for (int e = 0; e < V; ++e) s[e][j] = dequantize_value(map, c.v[e], scale[j]);
    }
    bool any = false;
#pragma unroll
    for (int e = 0; e < V; ++e)
      if (valid[e] && body(g[e], p[e], s[e])) updated[e] = any = true;  // false: p and s as they were
    if (Writes && any) {
      if (wide && full) {
#pragma unroll
        for (int e = 0; e < V; ++e) if (updated[e]) p_raw.v[e] = ElementTraits<T>::store(p[e]);
        store_pack<T, V>(param + base, p_raw);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) if (updated[e]) param[base + e] = ElementTraits<T>::store(p[e]);
      }
    }
    if constexpr (Writes && States > 0) {
      float reduced[States + 1];
      agree_on_block(any, s, valid, group, exchange, reduced);
      if (reduced[0] == 0.0f || base >= w.end) continue;  // all skipped: codes and absmax stay as they are
#pragma unroll
      for (int j = 0; j < States; ++j) {
        const Requantizer q(o, maps, j, reduced[1 + j]);
        uint8_t* codes = static_cast<uint8_t*>(table.tensor[w.tensor].state[j]);
        const Pack<uint8_t, V> c = q.codes<V>(s, 0);
        if (full && wide_codes) {
          store_pack<uint8_t, V>(codes + base, c);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) if (valid[e]) codes[base + e] = c.v[e];
        }
        if ((base & (block_size - 1)) == 0) table.tensor[w.tensor].absmax[j][quant_block] = q.absmax;
      }
    }
  }
}

// The 8-bit writing pass over a whole chunk (kChunkElements elements) of a tensor whose parameters and
// gradients take 16-byte accesses and whose codes take piece-sized ones, with quantisation blocks of whole warps
// (block_size a multiple of 256): nearly all of a large step. Same results as for_each_quantized_element (the
// same rules, per-block absmax and quantiser), with less work per element:
// - a warp takes 256 consecutive elements per pass, lane l the 16-byte pieces l, l + 32, ... of them (2 pieces
//   of 4 fp32 elements, or 1 of 8 fp16/bf16 ones), so each load and store instruction of a warp is contiguous
//   (8 consecutive elements per lane spread each fp32 load over twice the sectors);
// - a block's absmax and "any element updated" are one warp reduction each (group_max: REDUX), larger blocks
//   combining their warps through shared memory;
// - no per-element bounds tests (the chunk is whole).
template <class T, int States, int Threads, class Body, class Table>
__device__ void for_each_quantized_element_of_whole_chunk(const OptimOptions& o, const Table& table,
                                                           const BlockWork& w, int block_size,
                                                           const SharedMaps* maps, Body body) {
  constexpr int V = QuantizedLoopPolicy::kWritingVector, kWarpElements = QuantizedLoopPolicy::kWarpElements;
  constexpr int kPiece = 16 / int(sizeof(T)), kPieces = V / kPiece, kPieceStride = 32 * kPiece;
  static_assert(kChunkElements % (Threads * V) == 0, "passes cover a chunk exactly");
  __shared__ float exchange[States + 1][QuantizedLoopPolicy::kMaxWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps_per_block = block_size / kWarpElements;
  const int block_shift = __ffs(block_size) - 1;  // block_size is a power of two: no 64-bit division per pass
  T* param = static_cast<T*>(table.tensor[w.tensor].param) + w.begin;
  const T* grad = static_cast<const T*>(table.tensor[w.tensor].grad) + w.begin;
  for (int pass = 0; pass < int(kChunkElements); pass += Threads * V) {
    const int warp_first = pass + warp * kWarpElements, first = warp_first + lane * kPiece;  // piece k at first + k * kPieceStride
    const int64_t quant_block = (w.begin + warp_first) >> block_shift;
    float g[V], p[V], s[V][4] = {};
    Pack<T, kPiece> p_raw[kPieces];  // the parameters as loaded: skipped elements are stored back with their own bits
#pragma unroll
    for (int k = 0; k < kPieces; ++k) {
      const Pack<T, kPiece> g_raw = load_streaming(reinterpret_cast<const Pack<T, kPiece>*>(grad + first + k * kPieceStride));
      p_raw[k] = load_streaming(reinterpret_cast<const Pack<T, kPiece>*>(param + first + k * kPieceStride));
#pragma unroll
      for (int i = 0; i < kPiece; ++i) {
        g[k * kPiece + i] = ElementTraits<T>::load(g_raw.v[i]);
        p[k * kPiece + i] = ElementTraits<T>::load(p_raw[k].v[i]);
      }
    }
#pragma unroll
    for (int j = 0; j < States; ++j) {
      const float* map = maps->value(state_is_signed(o, j));
      const uint8_t* codes = static_cast<const uint8_t*>(table.tensor[w.tensor].state[j]) + w.begin;
      const float scale = table.tensor[w.tensor].absmax[j][quant_block];
#pragma unroll
      for (int k = 0; k < kPieces; ++k) {
        const Pack<uint8_t, kPiece> c = load_streaming(reinterpret_cast<const Pack<uint8_t, kPiece>*>(codes + first + k * kPieceStride));
#pragma unroll
        for (int i = 0; i < kPiece; ++i) s[k * kPiece + i][j] = dequantize_value(map, c.v[i], scale);
      }
    }
    bool any = false;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      // Through a copy, not on s[e] in place: with AdEMAMix's three states the in-place form made the compiler
      // version the loop once more, a slower step.
      float st[4] = {s[e][0], s[e][1], s[e][2], s[e][3]};
      float pe = p[e];
      if (body(g[e], pe, st)) {
        any = true;
        p_raw[e / kPiece].v[e % kPiece] = ElementTraits<T>::store(pe);
#pragma unroll
        for (int j = 0; j < States; ++j) s[e][j] = st[j];
      }
    }
    if (any) {
#pragma unroll
      for (int k = 0; k < kPieces; ++k)
        store_streaming(reinterpret_cast<Pack<T, kPiece>*>(param + first + k * kPieceStride), p_raw[k]);
    }
    if constexpr (States > 0) {
      // A quantisation block is block_size / V threads here too (one warp or several).
      constexpr bool kAll[V] = {true, true, true, true, true, true, true, true};
      static_assert(V == 8, "kAll lists every element");
      float reduced[States + 1];
      agree_on_block(any, s, kAll, block_size / V, exchange, reduced);
      if (reduced[0] == 0.0f) continue;  // all skipped: codes and absmax stay as they are
#pragma unroll
      for (int j = 0; j < States; ++j) {
        const Requantizer q(o, maps, j, reduced[1 + j]);
        uint8_t* codes = static_cast<uint8_t*>(table.tensor[w.tensor].state[j]) + w.begin;
#pragma unroll
        for (int k = 0; k < kPieces; ++k)
          store_streaming(reinterpret_cast<Pack<uint8_t, kPiece>*>(codes + first + k * kPieceStride),
                          q.codes<kPiece>(s, k * kPiece));
        // warps_per_block is a power of two: a mask, not the integer division (about 25 instructions) of `%`.
        if (lane == 0 && (warp & (warps_per_block - 1)) == 0) table.tensor[w.tensor].absmax[j][quant_block] = q.absmax;
      }
    }
  }
}

// Whether a writing 8-bit pass over the chunk can take for_each_quantized_element_of_whole_chunk.
template <class T, int States, class Table>
__device__ bool whole_chunk_path(const Table& table, const BlockWork& w, int block_size) {
  if (w.end - w.begin != kChunkElements || block_size % QuantizedLoopPolicy::kWarpElements != 0) return false;
  bool ok = aligned(table.tensor[w.tensor].param, 16) && aligned(table.tensor[w.tensor].grad, 16);
#pragma unroll
  for (int j = 0; j < States; ++j) ok = ok && aligned(table.tensor[w.tensor].state[j], 16 / sizeof(T));
  return ok;
}

// The element loop of the kernels, for fp32 (Bits 32), bf16 (Bits 16) or 8-bit (Bits 8) states: body(g, p, s)
// returns whether it updated the element; with Writes the updates are stored, without, nothing is. Threads: the
// block's (only the 8-bit loops take other than ChunkPolicy::kThreads).
template <class T, int States, int Bits, bool Writes, int Threads = ChunkPolicy::kThreads, class Body, class Table>
__device__ void for_each(const OptimOptions& o, const Table& table, const BlockWork& w, int block_size,
                         const SharedMaps* maps, Body body) {
  if constexpr (Bits == 8) {
    if constexpr (Writes) {
      if (whole_chunk_path<T, States>(table, w, block_size)) {
        for_each_quantized_element_of_whole_chunk<T, States, Threads>(o, table, w, block_size, maps, body);
        return;
      }
    }
    for_each_quantized_element<T, States, Writes, Threads>(o, table, w, block_size, maps, body);
  } else {
    for_each_element<T, StateType<Bits>, States>(table, w, [&](float g, float& p, float* s) { return body(g, p, s) && Writes; });
  }
}

}  // namespace
}  // namespace graphsafe
