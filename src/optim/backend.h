// What both optimizer backends (cpu.cpp, cuda/) do the same way around their loops: the checks of a step's
// workspace and of a quantisation block size, and the switches from a step's run-time parameter dtype and
// state count to the compile-time ones their loops are instantiated for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/numeric.h"
#include "graphsafe/optim.h"
#include "optim/blockwise.h"
#include "optim/layout.h"

namespace graphsafe::optim_detail {

// Throws std::invalid_argument if the step's workspace is smaller than optim_workspace_bytes asks for (or
// missing where it asks for any); returns the layer-wise workspace layout of the step's tensors.
inline LayerwiseLayout check_workspace(Backend backend, const OptimStepArgs& a, const OptimTensor* tensors, int count,
                                       const void* workspace, std::size_t workspace_bytes) {
  std::vector<int64_t> numels(count);
  for (int t = 0; t < count; ++t) numels[t] = tensors[t].numel;
  const std::size_t needed = optim_workspace_bytes(backend, a.options, numels.data(), count);
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr))
    throw std::invalid_argument("optimizer step: workspace of " + std::to_string(workspace_bytes) +
                                " bytes is smaller than the " + std::to_string(needed) + " required");
  return layerwise_layout(numels.data(), count);
}

// Throws std::invalid_argument unless block_size is a valid quantisation block size (what: the operation).
inline void check_block_size(const char* what, int block_size) {
  if (!valid_block_size(block_size))
    throw std::invalid_argument(std::string(what) + ": block_size must be a power of two from 32 to 1024, got " +
                                std::to_string(block_size));
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the parameters' element type T; does nothing for another dtype (check_step_args
// refuses those before a step).
template <class F>
void with_param_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: f(TypeTag<float>{}); break;
    case DType::Float16: f(TypeTag<f16_t>{}); break;
    case DType::BFloat16: f(TypeTag<bf16_t>{}); break;
    default: break;
  }
}

// Calls f(std::integral_constant<int, States>{}) with the step's state count (optim_state_count).
template <class F>
void with_state_count(const OptimOptions& o, F&& f) {
  switch (optim_state_count(o)) {
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: throw std::logic_error("unexpected optimizer state count");
  }
}

}  // namespace graphsafe::optim_detail
