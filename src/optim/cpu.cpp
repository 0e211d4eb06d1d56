// CPU backend of the optimizer step: the shared rules in a loop, parallel with OpenMP over a large tensor's
// elements, or over the tensors of a step of many small ones.
// Layer-wise norms are summed per fixed chunk and the chunks in order, so every run gives the same bits.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "graphsafe/optim.h"
#include "optim/backend.h"
#include "optim/blockwise.h"
#include "optim/cpu_quantize.h"
#include "optim/layout.h"
#include "optim/rules.h"
#include "optim/sparse.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

// Below this many elements a parallel region costs more than it saves (and oversubscribed machines make idle OpenMP
// threads very expensive), so small tensors run on the calling thread.
constexpr int64_t kParallelMinElements = 1 << 16;

// Runs body(c) for every c in [0, chunks) on OpenMP's threads, each claiming the next chunk when it is free (a
// dynamic schedule): on a machine shared with other work a thread that loses its core for a while leaves its share
// to the others instead of holding up the step. OpenMP's threads, not threads of graphsafe's own: torch runs on the
// same OpenMP threads, and a pool of its own lost time to them (they spin after each torch region on the cores its
// helpers needed) when torch work and steps alternate, as in training.
template <class Body>
void parallel_chunks(int64_t chunks, Body body) {
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) body(c);
}

// The elements of one chunk of a parallel loop: 512 KB of each fp32 array, so that claiming a chunk costs nothing
// next to it, and a step of one large tensor has enough chunks that a descheduled thread leaves little to wait on.
constexpr int64_t kChunkOfElements = int64_t(1) << 17;

// Runs body(i) for every i in [0, n) (n items covering numel elements in all): on the step's threads, in chunks of
// about kChunkOfElements elements, for numel >= kParallelMinElements; else in a plain loop on this thread.
template <class Body>
void for_each_index(int64_t n, int64_t numel, Body body) {
  if (numel < kParallelMinElements || n < 2) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  const int64_t per_chunk = std::max<int64_t>(1, n * kChunkOfElements / numel);
  parallel_chunks((n + per_chunk - 1) / per_chunk, [&](int64_t c) {
    const int64_t end = std::min(n, (c + 1) * per_chunk);
    for (int64_t i = c * per_chunk; i < end; ++i) body(i);
  });
}

// Runs body(begin, end) over [0, n) in contiguous ranges of kChunkOfElements: on the step's threads for
// n >= kParallelMinElements, else the whole range at once on this thread.
template <class Body>
void for_each_range(int64_t n, Body body) {
  if (n < kParallelMinElements) {
    body(int64_t(0), n);
    return;
  }
  parallel_chunks((n + kChunkOfElements - 1) / kChunkOfElements, [&](int64_t c) {
    body(c * kChunkOfElements, std::min(n, (c + 1) * kChunkOfElements));
  });
}

// One tensor's elements with States states stored as S (fp32, or bf16 for 16-bit states); States is the
// algorithm's state count, fixed at compile time so the loops over states unroll and the element loop can
// vectorise.
template <class T, class S, int States>
struct ElementView {
  const OptimTensor& t;
  float grad(int64_t i) const { return ElementTraits<T>::load(static_cast<const T*>(t.grad)[i]); }
  float param(int64_t i) const { return ElementTraits<T>::load(static_cast<T*>(t.param)[i]); }
  S* state(int j) const { return static_cast<S*>(t.state[j]); }
  void load_states(int64_t i, float* s) const {
    for (int j = 0; j < States; ++j) s[j] = ElementTraits<S>::load(state(j)[i]);
  }
};

// The element loops are compiled for AVX-512 and AVX2 as well as the baseline, chosen on the running CPU when the
// library loads (GCC's function clones; Clang does not clone function templates, so its builds, the fuzzers',
// take the baseline only); the same operations in wider registers, so the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GS_CPU_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GS_CPU_VECTOR_CLONES
#endif

constexpr int kTile = 256;

// Applies rule(o, k, g, p, s) to every element whose gradient is not skipped. Without skip_zeros, in one loop that
// loads, updates and stores each element (no copies of tiles: the step is bound by memory traffic and division). With
// it, in tiles of kTile elements with three loops each, so that the compiler vectorises them: which elements are
// skipped; the rule on every element (their loaded bits kept); then each element's new values or, if skipped, its
// loaded bits (a skipped NaN parameter or 16-bit state keeps its exact payload). Written as one loop, the skipping
// did not vectorise: the compiler turns a select of the value just loaded from the same place into a conditional
// store, and the test of the gradient into branches. Each range works on its own copies of the options and
// coefficients: read through references, a store to a parameter or state might change them (as far as the compiler
// knows).
template <class T, class S, int States, class Rule>
GS_CPU_VECTOR_CLONES void update_range(const OptimOptions& o, const Coefficients& k, const ElementView<T, S, States>& e,
                                       Rule rule, int64_t begin, int64_t end) {
  constexpr int kSlots = States > 0 ? States : 1;
  const OptimOptions options = o;
  const Coefficients coefficients = k;
  T* const param = static_cast<T*>(e.t.param);
  const T* const grad = static_cast<const T*>(e.t.grad);
  S* state[kSlots] = {};
  for (int j = 0; j < States; ++j) state[j] = e.state(j);
  if (!options.skip_zeros) {
    for (int64_t i = begin; i < end; ++i) {
      float p = ElementTraits<T>::load(param[i]), s[4] = {};
      for (int j = 0; j < States; ++j) s[j] = ElementTraits<S>::load(state[j][i]);
      rule(options, coefficients, ElementTraits<T>::load(grad[i]), p, s);
      param[i] = ElementTraits<T>::store(p);
      for (int j = 0; j < States; ++j) state[j][i] = ElementTraits<S>::store(s[j]);
    }
    return;
  }
  int32_t keep[kTile];
  T p_before[kTile], p_after[kTile];
  S s_before[kSlots][kTile], s_after[kSlots][kTile];
  for (int64_t tile = begin; tile < end; tile += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - tile));
    for (int i = 0; i < n; ++i) keep[i] = skipped(options, ElementTraits<T>::load(grad[tile + i])) ? 1 : 0;
    for (int i = 0; i < n; ++i) {
      p_before[i] = param[tile + i];
      float p = ElementTraits<T>::load(p_before[i]), s[4] = {};
      for (int j = 0; j < States; ++j) {
        s_before[j][i] = state[j][tile + i];
        s[j] = ElementTraits<S>::load(s_before[j][i]);
      }
      rule(options, coefficients, ElementTraits<T>::load(grad[tile + i]), p, s);
      p_after[i] = ElementTraits<T>::store(p);
      for (int j = 0; j < States; ++j) s_after[j][i] = ElementTraits<S>::store(s[j]);
    }
    for (int i = 0; i < n; ++i) {
      param[tile + i] = keep[i] ? p_before[i] : p_after[i];
      for (int j = 0; j < States; ++j) state[j][tile + i] = keep[i] ? s_before[j][i] : s_after[j][i];
    }
  }
}

template <class T, class S, int States, class Rule>
void update_elements(const OptimOptions& o, const Coefficients& k, const ElementView<T, S, States>& e, Rule rule) {
  for_each_range(e.t.numel, [&](int64_t begin, int64_t end) { update_range(o, k, e, rule, begin, end); });
}

// ---- 8-bit states: one quantisation block at a time ----

// Calls visit(g, p, s) on the elements of quantisation block `b` in order, with the block's states dequantised;
// writes nothing (LAMB/LARS measuring pass).
template <class T, int States, class Visit>
void visit_quantized_block(const OptimOptions& o, const OptimTensor& t, int block_size, int64_t b, Visit visit) {
  const int64_t begin = b * block_size, end = std::min(t.numel, begin + block_size);
  float values[4][1024];
  for (int j = 0; j < States; ++j)
    dequantize_codes(state_is_signed(o, j), t.codes[j] + begin, t.absmax[j][b], end - begin, values[j]);
  const T* const param = static_cast<const T*>(t.param);
  const T* const grad = static_cast<const T*>(t.grad);
  for (int64_t i = begin; i < end; ++i) {
    float s[4] = {};
    for (int j = 0; j < States; ++j) s[j] = values[j][i - begin];
    visit(ElementTraits<T>::load(grad[i]), ElementTraits<T>::load(param[i]), s);
  }
}

// The writing pass over quantisation block `b` for an element-wise rule(o, k, g, p, s), in loops the compiler
// vectorises (as update_range's), between the SIMD loops of cpu_quantize.h: the states dequantised; with skip_zeros,
// which elements are skipped; the rule on every element; each element's new values or, if skipped, its old ones
// (with no element skipped, the rule's loop stores the new values itself: the same bits, one loop fewer); then the
// states requantised. The loop that leaves the new values also gathers each state's absmax key (absmax_step's, an
// unsigned max in any order), so requantising reads them once. An all-skipped block keeps its codes and absmax
// bit-identical.
template <class T, int States, class Rule>
GS_CPU_VECTOR_CLONES void update_quantized_block(const OptimOptions& o, const Coefficients& k, const OptimTensor& t,
                                                 int block_size, int64_t b, Rule rule) {
  constexpr int kSlots = States > 0 ? States : 1;
  const OptimOptions options = o;
  const Coefficients coefficients = k;
  const int64_t begin = b * block_size;
  const int n = static_cast<int>(std::min<int64_t>(t.numel - begin, block_size));
  T* const param = static_cast<T*>(t.param) + begin;
  const T* const grad = static_cast<const T*>(t.grad) + begin;
  float values[4][1024], updated[4][1024];
  int32_t keep[1024];
  T p_after[1024];
  uint32_t key[kSlots] = {};  // the bits of absmax_key(value): 2 * bits + kFiniteKeyOffset
  int32_t skipped_count = 0;
  if (options.skip_zeros) {
    for (int i = 0; i < n; ++i) {
      keep[i] = skipped(options, ElementTraits<T>::load(grad[i])) ? 1 : 0;
      skipped_count += keep[i];
    }
    if (skipped_count == n) return;  // all skipped: codes and absmax stay bit-identical
  }
  for (int j = 0; j < States; ++j)
    dequantize_codes(state_is_signed(options, j), t.codes[j] + begin, t.absmax[j][b], n, values[j]);
  if (skipped_count == 0) {
    for (int i = 0; i < n; ++i) {
      float p = ElementTraits<T>::load(param[i]), s[4] = {};
      for (int j = 0; j < States; ++j) s[j] = values[j][i];
      rule(options, coefficients, ElementTraits<T>::load(grad[i]), p, s);
      param[i] = ElementTraits<T>::store(p);
      for (int j = 0; j < States; ++j) {
        values[j][i] = s[j];
        key[j] = std::max(key[j], float_bits(s[j]) * 2u + kFiniteKeyOffset);
      }
    }
  } else {
    for (int i = 0; i < n; ++i) {
      float p = ElementTraits<T>::load(param[i]), s[4] = {};
      for (int j = 0; j < States; ++j) s[j] = values[j][i];
      rule(options, coefficients, ElementTraits<T>::load(grad[i]), p, s);
      p_after[i] = ElementTraits<T>::store(p);
      for (int j = 0; j < States; ++j) updated[j][i] = s[j];
    }
    for (int i = 0; i < n; ++i) {
      param[i] = keep[i] ? param[i] : p_after[i];
      for (int j = 0; j < States; ++j) {
        values[j][i] = keep[i] ? values[j][i] : updated[j][i];
        key[j] = std::max(key[j], float_bits(values[j][i]) * 2u + kFiniteKeyOffset);
      }
    }
  }
  for (int j = 0; j < States; ++j) {
    const bool is_signed = state_is_signed(options, j);
    const float absmax = absmax_finish(bits_float(key[j]));
    quantize_with_absmax(host_quantization_map(is_signed).code_word, is_signed, values[j], n, absmax,
                         t.codes[j] + begin);
    t.absmax[j][b] = absmax;
  }
}

// ---- the element loops, for fp32 or bf16 states and for 8-bit states ----

// Calls f with the tensor's ElementView for the unquantised storage of a.state_bits (bf16 for 16, fp32 for 32).
template <class T, int States, class F>
void with_element_view(const OptimStepArgs& a, const OptimTensor& t, F f) {
  if (a.state_bits == 16) f(ElementView<T, bf16_t, States>{t});
  else f(ElementView<T, float, States>{t});
}

// Updates every element of the tensor whose gradient is not skipped with rule(o, k, g, p, s).
template <class T, int States, class Rule>
void update_tensor(const OptimOptions& o, const Coefficients& k, const OptimTensor& t, const OptimStepArgs& a,
                   Rule rule) {
  if (a.state_bits == 8) {
    for_each_index(block_count(t.numel, a.block_size), t.numel,
                   [&](int64_t b) { update_quantized_block<T, States>(o, k, t, a.block_size, b, rule); });
    return;
  }
  with_element_view<T, States>(a, t, [&](const auto& e) { update_elements(o, k, e, rule); });
}

// Calls visit(offset, g, p, s) for the elements of [begin, end) (a chunk: whole quantisation blocks) in
// increasing order, with their states; writes nothing.
template <class T, int States, class Visit>
void visit_chunk(const OptimOptions& o, const OptimTensor& t, const OptimStepArgs& a, int64_t begin, int64_t end,
                 Visit visit) {
  if (a.state_bits == 8) {
    int64_t offset = 0;
    for (int64_t b = begin / a.block_size; b * a.block_size < end; ++b)
      visit_quantized_block<T, States>(o, t, a.block_size, b,
                                       [&](float g, float p, const float* s) { visit(offset++, g, p, s); });
    return;
  }
  with_element_view<T, States>(a, t, [&](const auto& e) {
    for (int64_t i = begin; i < end; ++i) {
      float s[4] = {};
      e.load_states(i, s);
      visit(i - begin, e.grad(i), e.param(i), s);
    }
  });
}

// The algorithm is chosen once per tensor, not per element.
template <class T, int States>
void elementwise(const OptimOptions& o, const Coefficients& k, const OptimTensor& t, const OptimStepArgs& a) {
  with_elementwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
    constexpr OptimAlgorithm A = decltype(algorithm)::value;
    update_tensor<T, States>(o, k, t, a, [](const OptimOptions& o, const Coefficients& k, float g, float& p,
                                            float* s) { elementwise_rule<A>(o, k, g, p, s); });
  });
}

// LAMB/LARS pass 1 over one tensor: each chunk's squared norms in the shared order (layout.h), written to
// chunk_norms, then the chunk sums combined in that order. Writes nothing else (rules.h, layerwise_apply, says why).
template <class T, int States, OptimAlgorithm A>
SquaredNorms measure_tensor(const OptimOptions& o, const Coefficients& k, const OptimTensor& t, const OptimStepArgs& a,
                            float* chunk_norms) {
  const int64_t chunks = chunk_count(t.numel);
  for_each_index(chunks, t.numel, [&](int64_t c) {
    NormTree tree;
    const int64_t begin = c * kChunkElements, end = std::min(t.numel, begin + kChunkElements);
    visit_chunk<T, States>(o, t, a, begin, end, [&](int64_t offset, float g, float p, const float* s) {
      const SquaredNorms n = layerwise_measure<A>(o, k, g, p, s);
      tree.add(norm_slot_of_element(offset), n.param, n.update);
    });
    tree.total(chunk_norms[2 * c], chunk_norms[2 * c + 1]);
  });
  NormTree tree;
  for (int64_t c = 0; c < chunks; ++c)
    tree.add(static_cast<int>(c % kNormThreads), chunk_norms[2 * c], chunk_norms[2 * c + 1]);
  SquaredNorms total{0.0f, 0.0f};
  tree.total(total.param, total.update);
  return total;
}

// LAMB/LARS: the tensor's squared norms, measured (pass 1) or, on shards, the caller's totals (given: 2 floats,
// OptimStepArgs::layerwise_norms); its factor from them; pass 2 updates.
template <class T, int States, OptimAlgorithm A>
void layerwise_tensor(const OptimOptions& o, const Coefficients& k, const OptimTensor& t, const OptimStepArgs& a,
                      float* chunk_norms, const float* given, float* factor) {
  const SquaredNorms total =
      given != nullptr ? SquaredNorms{given[0], given[1]} : measure_tensor<T, States, A>(o, k, t, a, chunk_norms);
  const float f = *factor = layerwise_factor(o, k, total);
  update_tensor<T, States>(o, k, t, a, [f](const OptimOptions& o, const Coefficients& k, float g, float& p, float* s) {
    layerwise_apply<A>(o, k, f, g, p, s);
  });
}

template <class T, int States>
void layerwise(const OptimOptions& o, const Coefficients& k, const OptimTensor& t, const OptimStepArgs& a,
               float* chunk_norms, const float* given, float* factor) {
  with_layerwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
    layerwise_tensor<T, States, decltype(algorithm)::value>(o, k, t, a, chunk_norms, given, factor);
  });
}

// One tensor's step counted (with increment_steps) and its schedule advanced; the coefficients of that step.
Coefficients count_step(const OptimStepArgs& a, const OptimTensor& t) {
  const OptimOptions& o = a.options;
  const float lr = *a.lr;
  const int schedule = optim_schedule_size(o.algorithm);
  if (a.increment_steps) *t.step += 1.0f;
  const float step = *t.step;
  const double weight = schedule > 0 ? advance_schedule_at(o, lr, step, t.schedule, schedule) : 0.0;
  return coefficients(o, lr, step, weight);
}

template <class T, int States>
void run(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace, std::size_t factors_offset) {
  const OptimOptions& o = a.options;
  // Each tensor's first chunk in the workspace (layer-wise norms), fixed before any tensor runs: tensors may run
  // in any order, and on any thread.
  std::vector<int64_t> chunk_base(static_cast<std::size_t>(count) + 1, 0);
  for (int t = 0; t < count; ++t) chunk_base[t + 1] = chunk_base[t] + chunk_count(tensors[t].numel);
  const auto step_tensor = [&](int t) {
    const Coefficients k = count_step(a, tensors[t]);
    if (is_layerwise(o.algorithm)) {
      const float* given = a.layerwise_norms != nullptr ? a.layerwise_norms + 2 * t : nullptr;
      layerwise<T, States>(o, k, tensors[t], a, workspace + 2 * chunk_base[t], given, workspace + factors_offset + t);
    } else {
      elementwise<T, States>(o, k, tensors[t], a);
    }
  };
  // A tensor of kParallelMinElements elements or more spreads its own elements over the threads (for_each_range,
  // for_each_index); smaller ones run on one thread each, so a step of many small tensors spreads the tensors over
  // the threads, in one parallel loop (when there is enough work for one). Every tensor's result is the same on any thread.
  std::vector<int> small;
  int64_t small_elements = 0;
  for (int t = 0; t < count; ++t) {
    if (tensors[t].numel >= kParallelMinElements) {
      step_tensor(t);
    } else {
      small.push_back(t);
      small_elements += tensors[t].numel;
    }
  }
  const int n = static_cast<int>(small.size());
  if (n > 1 && small_elements >= kParallelMinElements) {
    parallel_chunks(n, [&](int64_t i) { step_tensor(small[i]); });
  } else {
    for (int i = 0; i < n; ++i) step_tensor(small[i]);
  }
}

// optim_layerwise_norms_cpu: each tensor's measured norms, with the coefficients of the step number the step will
// use (the layer-wise algorithms keep no schedule).
template <class T, int States>
void measure_all(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace, float* norms) {
  const OptimOptions& o = a.options;
  int64_t chunk_base = 0;
  for (int t = 0; t < count; ++t) {
    const float step = a.increment_steps ? *tensors[t].step + 1.0f : *tensors[t].step;
    const Coefficients k = coefficients(o, *a.lr, step);
    with_layerwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
      const SquaredNorms n = measure_tensor<T, States, decltype(algorithm)::value>(o, k, tensors[t], a,
                                                                                    workspace + 2 * chunk_base);
      norms[2 * t] = n.param;
      norms[2 * t + 1] = n.update;
    });
    chunk_base += chunk_count(tensors[t].numel);
  }
}

// ---- row-sparse steps (graphsafe/optim_sparse.h) ----
//
// Element-wise rules read nothing but their element and the tensor's coefficients, and 8-bit blocks nothing beyond
// their own elements, so the dense step's loops run unchanged on views: for 32/16-bit states a listed row is a
// tensor of row_length elements (its gradient row_grads[k]); for 8-bit states a span of whole quantisation blocks
// that listed rows touch is a tensor whose gradient is those rows scattered into a buffer of the span's size.

// Throws std::invalid_argument unless rows[0, count) are strictly increasing rows of the tensor and count lies in
// [0, capacity]: read before anything is written.
void check_sparse_rows(const OptimSparseGradient& g, int64_t num_rows, int64_t count) {
  if (count < 0 || count > g.capacity)
    throw std::invalid_argument("sparse optimizer step: count " + std::to_string(count) + " is outside [0, " +
                                std::to_string(g.capacity) + "]");
  for (int64_t k = 0; k < count; ++k) {
    const int64_t row = g.rows[k];
    if (row < 0 || row >= num_rows)
      throw std::invalid_argument("sparse optimizer step: row " + std::to_string(row) + " (entry " +
                                  std::to_string(k) + ") is out of range for a tensor of " +
                                  std::to_string(num_rows) + " rows");
    if (k > 0 && row <= g.rows[k - 1])
      throw std::invalid_argument("sparse optimizer step: rows must be strictly increasing, but entry " +
                                  std::to_string(k) + " (" + std::to_string(row) + ") follows " +
                                  std::to_string(g.rows[k - 1]));
  }
}

// The view of elements [begin, end) of t (begin a multiple of the block size for 8-bit states) with gradient grad.
OptimTensor element_range(const OptimTensor& t, const OptimStepArgs& a, int64_t begin, int64_t end, const void* grad) {
  OptimTensor v = t;
  const std::size_t param_bytes = dtype_size(a.param_dtype), state_bytes = a.state_bits == 16 ? 2 : 4;
  v.param = static_cast<char*>(t.param) + begin * param_bytes;
  v.grad = grad;
  v.numel = end - begin;
  for (int j = 0; j < kMaxOptimStates; ++j) {
    if (t.state[j] != nullptr) v.state[j] = static_cast<char*>(t.state[j]) + begin * state_bytes;
    if (t.codes[j] != nullptr) v.codes[j] = t.codes[j] + begin;
    if (t.absmax[j] != nullptr) v.absmax[j] = t.absmax[j] + begin / a.block_size;
  }
  return v;
}

template <class T, int States>
void sparse_elementwise(const OptimStepArgs& a, const OptimTensor& t, const OptimSparseGradient& g, int64_t count) {
  const OptimOptions& o = a.options;
  const Coefficients k = count_step(a, t);
  const int64_t d = g.row_length;
  const T* row_grads = static_cast<const T*>(g.row_grads);
  if (a.state_bits != 8) {
    for_each_index(count, count * d, [&](int64_t r) {
      const int64_t begin = g.rows[r] * d;
      elementwise<T, States>(o, k, element_range(t, a, begin, begin + d, row_grads + r * d), a);
    });
    return;
  }
  // Spans: runs of listed rows whose quantisation blocks touch or overlap, each [first, last) rows of the list.
  const int64_t bs = a.block_size;
  std::vector<int64_t> span_starts;
  for (int64_t r = 0; r < count; ++r)
    if (r == 0 || (g.rows[r] * d) / bs > (g.rows[r - 1] * d + d - 1) / bs) span_starts.push_back(r);
  span_starts.push_back(count);
  const int64_t spans = static_cast<int64_t>(span_starts.size()) - 1;
  for_each_index(spans, count * d, [&](int64_t i) {
    const int64_t first = span_starts[i], last = span_starts[i + 1];
    const int64_t begin = (g.rows[first] * d) / bs * bs;
    const int64_t end = std::min(t.numel, ((g.rows[last - 1] * d + d - 1) / bs + 1) * bs);
    std::vector<T> grad(static_cast<std::size_t>(end - begin), ElementTraits<T>::store(0.0f));
    for (int64_t r = first; r < last; ++r)
      std::copy(row_grads + r * d, row_grads + (r + 1) * d, grad.begin() + (g.rows[r] * d - begin));
    elementwise<T, States>(o, k, element_range(t, a, begin, end, grad.data()), a);
  });
}

// LAMB and LARS: the rows scattered into a dense gradient (in the workspace), then the dense step.
template <class T>
void sparse_through_dense(const OptimStepArgs& a, const OptimTensor& t, const OptimSparseGradient& g, int64_t count,
                          char* workspace, std::size_t workspace_bytes, const SparseWorkspaceLayout& layout) {
  T* dense = reinterpret_cast<T*>(workspace + layout.dense_gradient);
  std::fill(dense, dense + t.numel, ElementTraits<T>::store(0.0f));
  const T* row_grads = static_cast<const T*>(g.row_grads);
  for (int64_t r = 0; r < count; ++r)
    std::copy(row_grads + r * g.row_length, row_grads + (r + 1) * g.row_length, dense + g.rows[r] * g.row_length);
  OptimTensor with_dense = t;
  with_dense.grad = dense;
  optim_step_cpu(a, &with_dense, 1, workspace + layout.step_workspace, workspace_bytes - layout.step_workspace);
}

}  // namespace

void quantize_blockwise_cpu(const float* x, int64_t numel, int block_size, bool is_signed, uint8_t* codes,
                            float* absmax) {
  check_block_size("quantize_blockwise", block_size);
  const QuantizationMap& map = host_quantization_map(is_signed);
  for_each_index(block_count(numel, block_size), numel, [&](int64_t b) {
    const int64_t begin = b * block_size, end = std::min(numel, begin + block_size);
    absmax[b] = quantize_values(map.code_word, is_signed, x + begin, end - begin, codes + begin);
  });
}

void dequantize_blockwise_cpu(const uint8_t* codes, const float* absmax, int64_t numel, int block_size,
                              bool is_signed, float* out) {
  check_block_size("dequantize_blockwise", block_size);
  for_each_index(block_count(numel, block_size), numel, [&](int64_t b) {
    const int64_t begin = b * block_size, end = std::min(numel, begin + block_size);
    dequantize_codes(is_signed, codes + begin, absmax[b], end - begin, out + begin);
  });
}

void optim_step_cpu(const OptimStepArgs& a, const OptimTensor* tensors, int count, void* workspace,
                    std::size_t workspace_bytes) {
  check_step_args(a, tensors, count);
  check_learning_rate(*a.lr);  // before anything is written: a refused step changes nothing
  const LayerwiseLayout layout = check_workspace(Backend::Cpu, a, tensors, count, workspace, workspace_bytes);
  auto* ws = static_cast<float*>(workspace);
  with_param_type(a.param_dtype, [&](auto type) {
    with_state_count(a.options, [&](auto states) {
      run<typename decltype(type)::type, decltype(states)::value>(a, tensors, count, ws, layout.factors_offset);
    });
  });
}

void optim_layerwise_norms_cpu(const OptimStepArgs& a, const OptimTensor* tensors, int count, void* workspace,
                               std::size_t workspace_bytes, float* norms) {
  check_layerwise_norms_args(a, tensors, count, norms);
  check_learning_rate(*a.lr);  // as the step refuses it, before anything is written
  check_workspace(Backend::Cpu, a, tensors, count, workspace, workspace_bytes);
  auto* ws = static_cast<float*>(workspace);
  with_param_type(a.param_dtype, [&](auto type) {
    with_state_count(a.options, [&](auto states) {
      measure_all<typename decltype(type)::type, decltype(states)::value>(a, tensors, count, ws, norms);
    });
  });
}

void optim_step_sparse_cpu(const OptimStepArgs& a, const OptimTensor& t, const OptimSparseGradient& g, void* workspace,
                           std::size_t workspace_bytes) {
  check_sparse_step_args(Backend::Cpu, a, t, g, workspace, workspace_bytes);
  check_learning_rate(*a.lr);  // before anything is written: a refused step changes nothing
  const int64_t count = *g.count;
  check_sparse_rows(g, t.numel / g.row_length, count);
  const SparseWorkspaceLayout layout = sparse_workspace_layout(Backend::Cpu, a.options, a.param_dtype, t.numel);
  with_param_type(a.param_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    if (sparse_step_goes_dense(a.options)) {
      sparse_through_dense<T>(a, t, g, count, static_cast<char*>(workspace), workspace_bytes, layout);
      return;
    }
    with_state_count(a.options, [&](auto states) { sparse_elementwise<T, decltype(states)::value>(a, t, g, count); });
  });
}

}  // namespace graphsafe
