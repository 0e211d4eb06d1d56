// Programmatic dependent launch (sm_90+): a kernel launched this way may be scheduled before the kernel ahead of it
// in the stream has finished, and waits for it where it must (wait_for_preceding_kernel). That hides the gap between
// two dependent launches. Kernels launched by launch_dependent must call wait_for_preceding_kernel in every block
// before reading what the kernel ahead writes, and before writing what it reads or writes; a kernel whose blocks may
// all return without waiting can finish before the kernel ahead of it, so later kernels must not rely on it having
// waited.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "common/cuda_check.h"

namespace graphsafe {
namespace {

// The kernel after this one in the stream may start now; it still sees this kernel's writes only after
// wait_for_preceding_kernel. No-op where the GPU code is older than sm_90.
__device__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// Waits until the preceding kernel has finished and its writes are visible (griddepcontrol.wait). Without a
// programmatic launch, stream order already guarantees that, and this returns at once.
__device__ void wait_for_preceding_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}

// Whether `kernel` may be a programmatic dependent launch on the current device: only if the GPU code it runs there
// was compiled for sm_90 or later, where wait_for_preceding_kernel really waits (code JIT-compiled from older PTX
// would not). Asked once per device and kernel signature (the kernels of one build share their PTX version).
constexpr int kMaxDevices = 64;

template <class Kernel>
bool dependent_launch_allowed(Kernel kernel) {
  static std::atomic<int8_t> known[kMaxDevices] = {};  // 0 not asked yet, 1 no, 2 yes
  int device = 0;
  GS_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return false;
  int8_t answer = known[device].load(std::memory_order_relaxed);
  if (answer == 0) {
    cudaFuncAttributes attributes{};
    GS_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    answer = attributes.ptxVersion >= 90 ? 2 : 1;
    known[device].store(answer, std::memory_order_relaxed);
  }
  return answer == 2;
}

// kernel<<<blocks, threads, shared_bytes, stream>>>(args...), as a programmatic dependent launch where allowed.
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), int64_t blocks, int threads, std::size_t shared_bytes,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = dependent_launch_allowed(kernel) ? 1 : 0;
  const cudaError_t status = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (status != cudaSuccess) (void)cudaGetLastError();  // reported once, here, not again at the next launch check
  GS_CUDA_CHECK(status);
}

}  // namespace
}  // namespace graphsafe
