// Turns CUDA runtime errors into C++ exceptions that the bindings turn into Python exceptions.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define GS_CUDA_CHECK(expr)                                                                             \
  do {                                                                                                  \
    const cudaError_t gs_status_ = (expr);                                                              \
    if (gs_status_ != cudaSuccess)                                                                      \
      throw std::runtime_error(std::string("CUDA error in ") + #expr + ": " + cudaGetErrorString(gs_status_)); \
  } while (0)

// After a launch: reports a bad configuration without synchronising (legal during graph capture).
#define GS_CUDA_CHECK_LAUNCH() GS_CUDA_CHECK(cudaGetLastError())
