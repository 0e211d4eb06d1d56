// The 8-bit quantisation maps (blockwise.h) as the optimizer's CUDA kernels read them: one image in global
// memory, which each block of an 8-bit step copies into its shared memory.
#pragma once

#include <cstdint>

#include "optim/blockwise.h"
#include "optim/cuda/vector_access.cuh"

namespace graphsafe {
namespace {

using namespace optim_detail;

// The two maps with their code words (blockwise.h), as each block of the step keeps them in shared memory
// (code_sum and dequantize_value read them at data-dependent positions): without the unsigned map's unused half
// (which would take the block past 48 KB of static shared memory).
struct alignas(16) SharedMaps {
  float unsigned_value[256];
  uint32_t unsigned_words[kBuckets];
  float signed_value[256];
  uint32_t signed_words[2 * kBuckets];
  __device__ const float* value(bool is_signed) const { return is_signed ? signed_value : unsigned_value; }
  __device__ const uint32_t* words(bool is_signed) const { return is_signed ? signed_words : unsigned_words; }
};
static_assert(sizeof(SharedMaps) % 16 == 0, "the maps are copied in 16-byte pieces");

constexpr SharedMaps make_shared_maps(const QuantizationMap& unsigned_map, const QuantizationMap& signed_map) {
  SharedMaps m{};
  for (int i = 0; i < 256; ++i) {
    m.unsigned_value[i] = unsigned_map.value[i];
    m.signed_value[i] = signed_map.value[i];
  }
  for (int i = 0; i < kBuckets; ++i) m.unsigned_words[i] = unsigned_map.code_word[i];
  for (int i = 0; i < 2 * kBuckets; ++i) m.signed_words[i] = signed_map.code_word[i];
  return m;
}

// The maps on the device, laid out as a block keeps them: each block of the step copies them into its shared
// memory in one flat copy, and the standalone kernels read them here. Global, not constant, memory: a warp's
// reads at 32 different addresses are one access there, 32 in turn in the constant cache. (Every translation
// unit that uses it has its own copy: device code is not linked across units.)
__device__ SharedMaps kSharedMapsImage = make_shared_maps(kUnsignedMap, kSignedMap);

// Called by every thread of the block (Threads of them). Each thread loads all its pieces before storing any,
// so the copy waits for the memory once, not once per piece.
template <int Threads>
__device__ const SharedMaps* load_maps_to_shared() {
  __shared__ SharedMaps maps;
  using Piece = Pack<uint32_t, 4>;
  constexpr int kPieces = int(sizeof(SharedMaps) / sizeof(Piece)), kPerThread = (kPieces + Threads - 1) / Threads;
  const Piece* from = reinterpret_cast<const Piece*>(&kSharedMapsImage);
  Piece* to = reinterpret_cast<Piece*>(&maps);
  Piece piece[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (threadIdx.x + k * Threads < kPieces) piece[k] = from[threadIdx.x + k * Threads];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (threadIdx.x + k * Threads < kPieces) to[threadIdx.x + k * Threads] = piece[k];
  __syncthreads();
  return &maps;
}

}  // namespace
}  // namespace graphsafe
