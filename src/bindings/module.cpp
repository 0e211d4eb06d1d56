// nanobind module graphsafe._C: the boundary between Python and the C++ core.
//
// Tensors arrive as raw addresses plus dtype names and shapes: the Python layer (which owns every tensor
// and allocation, through torch) has already checked devices, contiguity and shapes; here the dtype names
// are parsed and the core re-checks everything it relies on. Passing addresses rather than DLPack capsules
// keeps the call free of stream synchronisation, so it stays legal while a CUDA graph is being captured.
// C++ exceptions become Python exceptions: invalid_argument -> ValueError, out_of_range -> IndexError,
// runtime_error -> RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(GRAPHSAFE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include "graphsafe/embedding.h"
#include "graphsafe/errors.h"
#include "graphsafe/types.h"

namespace nb = nanobind;
using namespace graphsafe;

namespace {

Backend backend_from_name(const std::string& device_type) {
  if (device_type == "cpu") return Backend::Cpu;
  if (device_type == "cuda") return Backend::Cuda;
  throw std::invalid_argument("graphsafe supports cpu and cuda tensors, got device type '" + device_type + "'");
}

// Runs `body` with `device_index` as the current CUDA device and restores the previous one.
template <class Body>
void on_device(int device_index, Body&& body) {
#if defined(GRAPHSAFE_WITH_CUDA)
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) throw std::runtime_error("cudaGetDevice failed");
  if (previous != device_index && cudaSetDevice(device_index) != cudaSuccess)
    throw std::runtime_error("cudaSetDevice failed for device " + std::to_string(device_index));
  try {
    body();
  } catch (...) {
    if (previous != device_index) cudaSetDevice(previous);
    throw;
  }
  if (previous != device_index) cudaSetDevice(previous);
#else
  (void)device_index;
  body();
#endif
}

void* as_pointer(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "graphsafe C++ core (internal; use graphsafe.ops)";

  m.def("cuda_available", &cuda_backend_available, "True when the core was built with its CUDA backend.");

  m.def(
      "embedding_backward_workspace_bytes",
      [](const std::string& device_type, const std::string& grad_dtype, int64_t num_indices, int64_t dim,
         int64_t num_weights) {
        return embedding_backward_workspace_bytes(backend_from_name(device_type), dtype_from_name(grad_dtype),
                                                  num_indices, dim, num_weights);
      },
      nb::arg("device_type"), nb::arg("grad_dtype"), nb::arg("num_indices"), nb::arg("dim"), nb::arg("num_weights"));

  m.def(
      "embedding_backward_dense",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, std::uintptr_t out,
         std::uintptr_t grad, const std::string& grad_dtype, std::uintptr_t indices, const std::string& index_dtype,
         int64_t num_indices, int64_t dim, int64_t num_weights, int64_t padding_idx, bool scale_grad_by_freq,
         std::uintptr_t workspace, std::size_t workspace_bytes) {
        EmbeddingBackwardArgs args;
        args.grad = as_pointer(grad);
        args.grad_dtype = dtype_from_name(grad_dtype);
        args.indices = as_pointer(indices);
        args.index_dtype = dtype_from_name(index_dtype);
        args.num_indices = num_indices;
        args.dim = dim;
        args.num_weights = num_weights;
        args.padding_idx = padding_idx;
        args.scale_grad_by_freq = scale_grad_by_freq;
        if (backend_from_name(device_type) == Backend::Cpu) {
          nb::gil_scoped_release release;
          embedding_backward_dense_cpu(args, as_pointer(out), as_pointer(workspace), workspace_bytes);
          return;
        }
        on_device(device_index, [&] {
          embedding_backward_dense_cuda(args, as_pointer(out), as_pointer(workspace), workspace_bytes,
                                        device_error_record(), reinterpret_cast<StreamHandle>(stream));
        });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("out"), nb::arg("grad"),
      nb::arg("grad_dtype"), nb::arg("indices"), nb::arg("index_dtype"), nb::arg("num_indices"), nb::arg("dim"),
      nb::arg("num_weights"), nb::arg("padding_idx"), nb::arg("scale_grad_by_freq"), nb::arg("workspace"),
      nb::arg("workspace_bytes"));

  m.def(
      "embedding_lookup",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, std::uintptr_t out,
         std::uintptr_t weight, std::size_t element_bytes, std::uintptr_t indices, const std::string& index_dtype,
         int64_t num_indices, int64_t dim, int64_t num_weights) {
        EmbeddingLookupArgs args;
        args.weight = as_pointer(weight);
        args.element_bytes = element_bytes;
        args.indices = as_pointer(indices);
        args.index_dtype = dtype_from_name(index_dtype);
        args.num_indices = num_indices;
        args.dim = dim;
        args.num_weights = num_weights;
        if (backend_from_name(device_type) == Backend::Cpu) {
          nb::gil_scoped_release release;
          embedding_lookup_cpu(args, as_pointer(out));
          return;
        }
        on_device(device_index, [&] {
          embedding_lookup_cuda(args, as_pointer(out), device_error_record(), reinterpret_cast<StreamHandle>(stream));
        });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("out"), nb::arg("weight"),
      nb::arg("element_bytes"), nb::arg("indices"), nb::arg("index_dtype"), nb::arg("num_indices"), nb::arg("dim"),
      nb::arg("num_weights"));

  m.def("take_device_error", &take_device_error, nb::arg("clear") = true,
        "Message of the error a kernel recorded, or '' (reads mapped host memory; never synchronises).");
}
