// The embedding backward from C++: four lookups into a 5-row table, their gradient summed per row.
// Exits non-zero if the result differs from a sum written out by hand.
#include <graphsafe/embedding.h>

#include <cstdio>
#include <vector>

int main() {
  const int64_t num_weights = 5, dim = 3;
  const std::vector<int64_t> indices = {4, 1, 4, 2};
  std::vector<float> grad(indices.size() * dim);
  for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = 0.5f * static_cast<float>(i);

  graphsafe::EmbeddingBackwardArgs args;
  args.grad = grad.data();
  args.grad_dtype = graphsafe::DType::Float32;
  args.indices = indices.data();
  args.index_dtype = graphsafe::DType::Int64;
  args.num_indices = static_cast<int64_t>(indices.size());
  args.dim = dim;
  args.num_weights = num_weights;
  args.padding_idx = 2;  // row 2 gets no gradient

  std::vector<unsigned char> workspace(graphsafe::embedding_backward_workspace_bytes(
      graphsafe::Backend::Cpu, args.grad_dtype, args.num_indices, dim, num_weights));
  std::vector<float> out(num_weights * dim);
  graphsafe::embedding_backward_dense_cpu(args, out.data(), workspace.data(), workspace.size());

  // Row 4 = grad[0] + grad[2], row 1 = grad[1], everything else zero.
  std::vector<float> expected(num_weights * dim, 0.0f);
  for (int64_t c = 0; c < dim; ++c) {
    expected[4 * dim + c] = grad[0 * dim + c] + grad[2 * dim + c];
    expected[1 * dim + c] = grad[1 * dim + c];
  }
  for (int64_t r = 0; r < num_weights; ++r) {
    std::printf("row %lld:", static_cast<long long>(r));
    for (int64_t c = 0; c < dim; ++c) std::printf(" %6.2f", out[r * dim + c]);
    std::printf("\n");
  }
  if (out != expected) {
    std::printf("MISMATCH against the hand-written sum\n");
    return 1;
  }
  std::printf("ok (CUDA backend %s)\n", graphsafe::cuda_backend_available() ? "built" : "not built");
  return 0;
}
