// Vector access for the optimizer's CUDA kernels: packs of elements loaded and stored in 16-byte (or smaller)
// streaming pieces where alignment allows.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cuda_check.h"

namespace graphsafe {
namespace {

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__host__ __device__ inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// 16-, 8- or 4-byte vector accesses marked evict-first (__ldcs/__stcs): a step touches every byte once, so
// keeping it in the caches only pushes out what later accesses need.
template <class V>
__device__ V load_streaming(const V* p) {
  static_assert(sizeof(V) == 16 || sizeof(V) == 8 || sizeof(V) == 4, "vector accesses are 16, 8 or 4 bytes");
  using Raw = std::conditional_t<sizeof(V) == 16, float4, std::conditional_t<sizeof(V) == 8, float2, float>>;
  const Raw raw = __ldcs(reinterpret_cast<const Raw*>(p));
  V v;
  memcpy(&v, &raw, sizeof(V));
  return v;
}

template <class V>
__device__ void store_streaming(V* p, const V& v) {
  static_assert(sizeof(V) == 16 || sizeof(V) == 8 || sizeof(V) == 4, "vector accesses are 16, 8 or 4 bytes");
  using Raw = std::conditional_t<sizeof(V) == 16, float4, std::conditional_t<sizeof(V) == 8, float2, float>>;
  Raw raw;
  memcpy(&raw, &v, sizeof(V));
  __stcs(reinterpret_cast<Raw*>(p), raw);
}

// N elements of type T at p (aligned to min(16, N * sizeof(T)) bytes: pack_aligned), loaded or stored in
// 16-byte (or smaller) streaming pieces.
template <class T, int N>
__device__ Pack<T, N> load_pack(const T* p) {
  constexpr int kPiece = 16 / sizeof(T) < N ? 16 / sizeof(T) : N;
  Pack<T, N> v;
#pragma unroll
  for (int i = 0; i < N; i += kPiece) {
    const Pack<T, kPiece> piece = load_streaming(reinterpret_cast<const Pack<T, kPiece>*>(p + i));
#pragma unroll
    for (int k = 0; k < kPiece; ++k) v.v[i + k] = piece.v[k];
  }
  return v;
}

template <class T, int N>
__device__ void store_pack(T* p, const Pack<T, N>& v) {
  constexpr int kPiece = 16 / sizeof(T) < N ? 16 / sizeof(T) : N;
#pragma unroll
  for (int i = 0; i < N; i += kPiece) {
    Pack<T, kPiece> piece;
#pragma unroll
    for (int k = 0; k < kPiece; ++k) piece.v[k] = v.v[i + k];
    store_streaming(reinterpret_cast<Pack<T, kPiece>*>(p + i), piece);
  }
}

template <class T, int N>
__device__ bool pack_aligned(const T* p) {
  return aligned(p, sizeof(T) * N < 16 ? int(sizeof(T) * N) : 16);
}

}  // namespace
}  // namespace graphsafe
