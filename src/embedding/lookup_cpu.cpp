// CPU embedding lookup (the forward of graphsafe.ops.embedding): copy each looked-up row.
#include <cstring>
#include <stdexcept>
#include <string>

#include "embedding/lookup.h"
#include "graphsafe/embedding.h"

namespace graphsafe {

void embedding_lookup_cpu(const EmbeddingLookupArgs& a, void* out) {
  embedding_detail::validate_lookup_args(a);
  const std::size_t row_bytes = static_cast<std::size_t>(a.dim) * a.element_bytes;
  auto index_at = [&](int64_t i) -> int64_t {
    return a.index_dtype == DType::Int32 ? static_cast<const int32_t*>(a.indices)[i]
                                         : static_cast<const int64_t*>(a.indices)[i];
  };
  for (int64_t i = 0; i < a.num_indices; ++i) {  // check everything before writing anything
    const int64_t r = index_at(i);
    if (r < 0 || r >= a.num_weights)
      throw std::out_of_range("embedding: index " + std::to_string(r) + " at position " + std::to_string(i) +
                              " is out of range for an embedding with " + std::to_string(a.num_weights) + " rows");
  }
  if (row_bytes == 0) return;
  const auto* weight = static_cast<const unsigned char*>(a.weight);
  auto* dst = static_cast<unsigned char*>(out);
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(row_bytes) * a.num_indices >= (1 << 18))
  for (int64_t i = 0; i < a.num_indices; ++i)
    std::memcpy(dst + i * row_bytes, weight + index_at(i) * row_bytes, row_bytes);
}

}  // namespace graphsafe
