// The CUDA optimizer step's kernel families, each in its own translation unit: entry_points.cu checks a step and
// counts its steps ahead where needed, then hands the tensors to the family of the step's algorithm and state
// width. Each family packs the tensors into launch tables (launch_table.cuh) and launches its kernels on stream.
#pragma once

#include <cstddef>

#include "common/cuda_check.h"
#include "graphsafe/optim.h"
#include "graphsafe/optim_sparse.h"

namespace graphsafe::optim_detail {

// elementwise.cu: the element-wise algorithms with fp32 or bf16 states (state_bits 32 or 16). schedule_weights:
// for an algorithm with a schedule, each tensor's advance_schedule result (written by the launch ahead), else null.
void launch_elementwise_step(const OptimStepArgs& a, const OptimTensor* tensors, int count,
                             const double* schedule_weights, cudaStream_t stream);

// quantized_elementwise.cu: the element-wise algorithms with 8-bit states.
void launch_quantized_elementwise_step(const OptimStepArgs& a, const OptimTensor* tensors, int count,
                                       cudaStream_t stream);

// layerwise.cu: LAMB and LARS at any state width, three kernels per launch table; workspace holds the chunks'
// squared norms and, from factors_offset (in floats), the tensors' factors (layout.h, LayerwiseLayout).
// With a.layerwise_norms the factors come from those totals instead of the measuring pass.
void launch_layerwise_step(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace,
                           std::size_t factors_offset, cudaStream_t stream);

// layerwise.cu: optim_layerwise_norms_cuda's kernels, the step's measuring pass into workspace (the chunks'
// partials) and then each tensor's 2 norms into norms.
void launch_layerwise_norms(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace,
                            float* norms, cudaStream_t stream);

// sparse.cu: the row-sparse step (graphsafe/optim_sparse.h) of one tensor. launch_sparse_valid_rows writes the
// length of the list's valid prefix to valid_rows (set to all ones before), which the others read: the element-wise
// algorithms with fp32 or bf16 states (schedule_weight: an algorithm with a schedule, the tensor's advance_schedule
// result in device memory, else null) and with 8-bit states, whose step the launch ahead counted, and the scatter of
// the rows into a zeroed dense gradient (the LAMB/LARS route).
void launch_sparse_valid_rows(const OptimStepArgs& a, const OptimTensor& tensor, const OptimSparseGradient& g,
                              unsigned long long* valid_rows, cudaStream_t stream);
void launch_sparse_elementwise_step(const OptimStepArgs& a, const OptimTensor& tensor, const OptimSparseGradient& g,
                                    const unsigned long long* valid_rows, const double* schedule_weight,
                                    cudaStream_t stream);
void launch_sparse_quantized_step(const OptimStepArgs& a, const OptimTensor& tensor, const OptimSparseGradient& g,
                                  const unsigned long long* valid_rows, cudaStream_t stream);
void launch_sparse_scatter(const OptimStepArgs& a, const OptimTensor& tensor, const OptimSparseGradient& g,
                           const unsigned long long* valid_rows, void* dense, cudaStream_t stream);

}  // namespace graphsafe::optim_detail
