// Stand-ins for the CUDA backend when graphsafe is built without nvcc: every CUDA entry point
// fails with a clear message instead of being missing.
#include <stdexcept>
#include <string>

#include "embedding/reduction.h"
#include "graphsafe/embedding.h"
#include "graphsafe/errors.h"
#include "graphsafe/optim.h"
#include "graphsafe/optim_sparse.h"
#include "graphsafe/types.h"

namespace graphsafe {

namespace {
[[noreturn]] void no_cuda() { throw std::runtime_error("graphsafe was built without its CUDA backend"); }
}  // namespace

bool cuda_backend_available() { return false; }
DeviceErrorRecord* device_error_record() { no_cuda(); }
std::string take_device_error(bool) { return {}; }
std::size_t embedding_backward_cuda_sort_bytes(int64_t, int64_t) { no_cuda(); }
std::size_t embedding_backward_cuda_scan_bytes(int64_t) { no_cuda(); }
embedding_detail::CudaWorkspaceLayout embedding_backward_dense_cuda_layout(DType, int64_t, int64_t, int64_t) {
  no_cuda();
}
void optim_step_cuda(const OptimStepArgs&, const OptimTensor*, int, void*, std::size_t, StreamHandle) { no_cuda(); }
void optim_layerwise_norms_cuda(const OptimStepArgs&, const OptimTensor*, int, void*, std::size_t, float*,
                                StreamHandle) {
  no_cuda();
}
void optim_step_sparse_cuda(const OptimStepArgs&, const OptimTensor&, const OptimSparseGradient&, void*, std::size_t,
                            StreamHandle) {
  no_cuda();
}
void quantize_blockwise_cuda(const float*, int64_t, int, bool, uint8_t*, float*, StreamHandle) { no_cuda(); }
void dequantize_blockwise_cuda(const uint8_t*, const float*, int64_t, int, bool, float*, StreamHandle) { no_cuda(); }
void embedding_lookup_cuda(const EmbeddingLookupArgs&, void*, DeviceErrorRecord*, StreamHandle) { no_cuda(); }
void embedding_backward_dense_cuda(const EmbeddingBackwardArgs&, void*, void*, std::size_t, DeviceErrorRecord*,
                                   StreamHandle) {
  no_cuda();
}
void embedding_backward_sparse_cuda(const EmbeddingBackwardArgs&, int64_t*, void*, int64_t*, void*, std::size_t,
                                    DeviceErrorRecord*, StreamHandle) {
  no_cuda();
}

}  // namespace graphsafe
