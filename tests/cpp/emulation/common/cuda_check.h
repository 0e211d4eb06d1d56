// CPU stand-in for the CUDA runtime, for compiling a CUDA backend file as C++ (GRAPHSAFE_CUDA_EMULATION).
// It takes the place of src/common/cuda_check.h (this folder comes first on the include path). Each block
// runs as blockDim.x std::threads with a real barrier, one block after another, so kernels' indexing,
// barriers and shared-memory use are exercised; the GPU's memory model and compiler are not.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct EmuDim { unsigned x = 0, y = 0, z = 0; };
inline thread_local EmuDim threadIdx, blockIdx;
inline EmuDim gridDim, blockDim;
inline std::barrier<>* emu_block_barrier = nullptr;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one copy for all threads: blocks run one after another (emu_launch)
#define __restrict__
#define __constant__

// A warp shuffle among the block's threads (every thread of the block must call it, as graphsafe's
// kernels do): each publishes its value, all meet, each reads its partner's, all meet again.
inline float emu_shuffle_values[1024];
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  emu_shuffle_values[threadIdx.x] = v;
  __syncthreads();
  const float partner = emu_shuffle_values[threadIdx.x ^ static_cast<unsigned>(lane_mask)];
  __syncthreads();
  return partner;
}

// A warp-wide unsigned max (REDUX): each thread publishes its value, the warp's threads meet (a barrier per warp,
// so that warps may call it a different number of times, as on the GPU), each takes the max over its warp, the
// warp meets again. Every thread of a warp calls it, as graphsafe's kernels do.
inline unsigned emu_warp_values[1024];
inline std::vector<std::unique_ptr<std::barrier<>>> emu_warp_barriers;
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  std::barrier<>& warp = *emu_warp_barriers[threadIdx.x / 32];
  emu_warp_values[threadIdx.x] = v;
  warp.arrive_and_wait();
  const unsigned first = threadIdx.x / 32 * 32, end = std::min(first + 32, blockDim.x);
  unsigned r = emu_warp_values[first];
  for (unsigned i = first + 1; i < end; ++i) r = r > emu_warp_values[i] ? r : emu_warp_values[i];
  warp.arrive_and_wait();
  return r;
}
inline int __ffs(int x) { return __builtin_ffs(x); }
// Blocks run one after another, and only one thread of a block counts (finish_steps): a plain add will do.
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  const unsigned old = *address;
  *address = old + value;
  return old;
}
// A block's threads run at once: a real atomic minimum (std::atomic_ref).
inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  std::atomic_ref<unsigned long long> target(*address);
  unsigned long long old = target.load();
  while (value < old && !target.compare_exchange_weak(old, value)) {
  }
  return old;
}
inline void __threadfence() {}
inline void __threadfence_system() {}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline void __stwb(float4* p, float4 v) { *p = v; }
template <class V> inline V __ldcs(const V* p) { return *p; }
template <class V> inline void __stcs(V* p, V v) { *p = v; }
struct float2 { float x, y; };
struct alignas(4) uchar4 { unsigned char x, y, z, w; };
inline uchar4 make_uchar4(unsigned char x, unsigned char y, unsigned char z, unsigned char w) { return uchar4{x, y, z, w}; }
template <class A, class B> inline auto min(A a, B b) { return a < b ? a : b; }

using cudaStream_t = void*;
using cudaError_t = int;
constexpr int cudaDevAttrMultiProcessorCount = 0;
inline int cudaGetDevice(int* device) { *device = 0; return 0; }
inline int cudaDeviceGetAttribute(int* value, int, int) { *value = 2; return 0; }  // 2 SMs: grids stay small
template <class Kernel>
inline int cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, std::size_t) { *blocks = 3; return 0; }
inline int cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return 0;
}
#define GS_CUDA_CHECK(expr) (void)(expr)
#define GS_CUDA_CHECK_LAUNCH() (void)0

// Runs `kernel` for every block of the grid, each block as `threads` threads meeting at real barriers.
inline void emu_launch(int64_t grid, int threads, const std::function<void()>& kernel) {
  gridDim.x = static_cast<unsigned>(grid);
  blockDim.x = static_cast<unsigned>(threads);
  for (int64_t b = 0; b < grid; ++b) {
    std::barrier<> barrier(threads);
    emu_block_barrier = &barrier;
    emu_warp_barriers.clear();
    for (int first = 0; first < threads; first += 32)
      emu_warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32, threads - first)));
    std::vector<std::thread> block;
    for (int t = 0; t < threads; ++t)
      block.emplace_back([&, b, t] {
        blockIdx.x = static_cast<unsigned>(b);
        threadIdx.x = static_cast<unsigned>(t);
        kernel();
      });
    for (auto& thread : block) thread.join();
  }
}
