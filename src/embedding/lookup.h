// Argument checks shared by the CPU and CUDA embedding lookups.
#pragma once

#include <stdexcept>
#include <string>

#include "graphsafe/embedding.h"

namespace graphsafe::embedding_detail {

inline void validate_lookup_args(const EmbeddingLookupArgs& a) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("embedding: " + msg); };
  if (a.index_dtype != DType::Int32 && a.index_dtype != DType::Int64)
    fail(std::string("indices must be int32 or int64, got ") + dtype_name(a.index_dtype));
  if (a.num_indices < 0 || a.dim < 0 || a.num_weights < 0) fail("negative shape");
  if (a.element_bytes == 0 || a.element_bytes > 16) fail("unsupported element size");
  // A table of 0 rows has no storage (a null weight): every index is then out of range, which the backends
  // report as such without reading the table.
  if (a.num_indices > 0 && a.indices == nullptr) fail("null indices pointer");
  if (a.num_indices > 0 && a.dim > 0 && a.num_weights > 0 && a.weight == nullptr) fail("null weight pointer");
}

}  // namespace graphsafe::embedding_detail
