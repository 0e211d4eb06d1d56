// Plain descriptions of what crosses the core's API: element types, backends and a CUDA stream handle.
// Nothing here depends on CUDA or on any framework, so every consumer can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace graphsafe {

enum class DType : int32_t { Float32, Float16, BFloat16, Float64, Int32, Int64 };

enum class Backend : int32_t { Cpu, Cuda };

// A cudaStream_t passed as an opaque handle so that this header needs no CUDA include.
using StreamHandle = void*;

inline std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Float64: return 8;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float64: return "float64";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
  }
  return "unknown";
}

// Parses the names dtype_name() prints (the same names torch uses without the "torch." prefix).
// Throws std::invalid_argument for anything else.
DType dtype_from_name(const std::string& name);

// True when the core was built with its CUDA backend.
bool cuda_backend_available();

}  // namespace graphsafe
