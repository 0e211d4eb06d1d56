// CPU backend of the embedding backward: same reduction order as the CUDA backend (embedding.h), so the
// two agree bitwise. Rows are independent, so they are spread over OpenMP threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "embedding/reduction.h"
#include "graphsafe/embedding.h"

namespace graphsafe {
namespace {

using embedding_detail::finish_element;
using embedding_detail::sort_key;

template <class Acc>
struct RowScratch {
  std::vector<Acc> total, group_sum, tile_sum;
  explicit RowScratch(int64_t dim) : total(dim), group_sum(dim), tile_sum(dim) {}
};

// Sorts the (row << 32 | position) keys, appended in increasing position, by row: a stable LSD radix sort over
// the row bits (11 at a time), so each row's positions stay in increasing order, the order a full sort of the keys
// gives (the documented reduction order). Linear in n, where std::sort took most of a large backward's time.
void sort_by_row(uint64_t* keys, int64_t n, int64_t num_weights) {
  if (n < 2) return;  // (nothing to order; keys may be null for n = 0)
  constexpr int kDigitBits = 11;
  constexpr uint32_t kDigits = 1u << kDigitBits;
  int row_bits = 0;
  while (row_bits < 32 && (uint64_t{1} << row_bits) < static_cast<uint64_t>(num_weights)) ++row_bits;
  std::vector<uint64_t> scratch(static_cast<std::size_t>(n));
  std::vector<int64_t> start(kDigits);
  uint64_t* from = keys;
  uint64_t* to = scratch.data();
  for (int shift = 32; shift < 32 + row_bits; shift += kDigitBits) {
    std::fill(start.begin(), start.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++start[(from[i] >> shift) & (kDigits - 1)];
    int64_t total = 0;
    for (uint32_t d = 0; d < kDigits; ++d) {
      const int64_t count = start[d];
      start[d] = total;
      total += count;
    }
    for (int64_t i = 0; i < n; ++i) to[start[(from[i] >> shift) & (kDigits - 1)]++] = from[i];
    std::swap(from, to);
  }
  if (from != keys) std::memcpy(keys, from, static_cast<std::size_t>(n) * sizeof(uint64_t));
}

template <class Index>
void check_indices_in_range(const Index* indices, int64_t n, int64_t num_weights) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(indices[i]);
    if (v < 0 || v >= num_weights)
      throw std::out_of_range("embedding_backward: index " + std::to_string(v) + " at position " +
                              std::to_string(i) + " is out of range for an embedding with " +
                              std::to_string(num_weights) + " rows");
  }
}

// Sums one row's run sorted[begin, end) (positions in the low 32 bits) into out_row, in the tile / group
// order documented in embedding.h (the CUDA backend's three kernels produce the same three levels).
template <class T>
void reduce_row(const T* grad, int64_t dim, const uint64_t* sorted, int64_t begin, int64_t end,
                bool scale_grad_by_freq, T* out_row, RowScratch<typename ElementTraits<T>::Acc>& scratch) {
  using Acc = typename ElementTraits<T>::Acc;
  // Plain references, not a structured binding: clang before 16 (the fuzz build's) cannot capture one in a lambda.
  auto& total = scratch.total;
  auto& group_sum = scratch.group_sum;
  auto& tile_sum = scratch.tile_sum;
  auto sum_occurrences = [&](std::vector<Acc>& acc, int64_t from, int64_t to) {
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t j = from; j < to; ++j) {
      const T* g = grad + static_cast<int64_t>(sorted[j] & 0xffffffffu) * dim;
      for (int64_t c = 0; c < dim; ++c) acc[c] += ElementTraits<T>::load(g[c]);
    }
  };
  auto add_into = [dim](std::vector<Acc>& acc, const std::vector<Acc>& part) {
    for (int64_t c = 0; c < dim; ++c) acc[c] += part[c];
  };
  // Sum of the row's per-tile sums over tiles [first_tile, last_tile].
  auto sum_tiles = [&](std::vector<Acc>& acc, int64_t first_tile, int64_t last_tile) {
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t t = first_tile; t <= last_tile; ++t) {
      sum_occurrences(tile_sum, std::max(begin, t * kEmbeddingTile), std::min(end, (t + 1) * kEmbeddingTile));
      add_into(acc, tile_sum);
    }
  };
  const int64_t first_tile = begin / kEmbeddingTile, last_tile = (end - 1) / kEmbeddingTile;
  const int64_t first_group = first_tile / kEmbeddingTileGroup, last_group = last_tile / kEmbeddingTileGroup;
  if (first_tile == last_tile) {
    sum_occurrences(total, begin, end);
  } else if (first_group == last_group) {
    sum_tiles(total, first_tile, last_tile);
  } else {
    std::fill(total.begin(), total.end(), Acc(0));
    for (int64_t u = first_group; u <= last_group; ++u) {
      sum_tiles(group_sum, std::max(first_tile, u * kEmbeddingTileGroup),
                std::min(last_tile, (u + 1) * kEmbeddingTileGroup - 1));
      add_into(total, group_sum);
    }
  }
  for (int64_t c = 0; c < dim; ++c) out_row[c] = finish_element<T>(total[c], end - begin, scale_grad_by_freq);
}

// Where finished rows go. Dense: row r at dense + r * dim, every other row +0. Row-sparse:
// the r-th distinct row, in increasing row order, at slot r of row_grads, its id at rows[r]; slots from the
// row count up to capacity = min(N, num_weights) hold row id -1 and +0.
template <class T>
struct Destination {
  T* dense = nullptr;
  int64_t* rows = nullptr;
  T* row_grads = nullptr;
  int64_t* count = nullptr;
  int64_t capacity = 0;
  bool sparse = false;
};

// Asks Linux to back [p, p + bytes) with 2 MB pages where it can (the 2 MB-aligned part inside). A large dense
// output is usually fresh memory whose pages the zeroing below touches first: one fault per 2 MB instead of one per
// 4 KB, which on a fresh allocation took more time than the zeroing itself. Only advice: pages already there stay
// as they are, and a refusal (THP off, an older kernel) changes nothing but the speed.
void advise_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

// Large dense outputs are written once: each row either its sum or zeros. Where the output's memory has been used
// before, with streaming stores, which write whole lines to memory without reading them into the cache first (a
// plain store's read for ownership doubles a fill's traffic). Fresh memory (a large allocation is usually a new
// mapping) is different: the kernel zeroes each page when it is first touched, which leaves the page in the
// cache, where plain stores then land; streaming stores would write it to memory a second time. Whether the
// memory is fresh is judged by whether its last page is resident (the first holds the allocator's header); only
// the kind of store depends on it. Each thread fences its streaming stores (finish_streaming) before the region's
// closing barrier, so they are ordered before anything after the region.
constexpr int64_t kWriteOnceFrom = int64_t(1) << 22;

bool resident(const void* p) {
#if defined(__linux__)
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  unsigned char state = 0;
  return mincore(reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1)), 1, &state) == 0 &&
         (state & 1) != 0;
#else
  (void)p;
  return false;
#endif
}

// Writes bytes to `to`: a copy of `from`, or zeros where `from` is null. With `streaming`, the 16-byte aligned middle
// goes out as streaming stores where the platform has them (x86-64's SSE2), the ends as plain stores; otherwise all
// of it as plain stores.
void write_bytes(unsigned char* to, const unsigned char* from, int64_t bytes, bool streaming) {
  auto plain = [&](int64_t offset, int64_t count) {
    if (from != nullptr) std::memcpy(to + offset, from + offset, static_cast<std::size_t>(count));
    else std::memset(to + offset, 0, static_cast<std::size_t>(count));
  };
#if defined(__SSE2__)
  if (streaming) {
    const int64_t head = std::min(bytes, static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(to) & 15)) & 15));
    const int64_t body_end = head + ((bytes - head) & ~int64_t(15));
    plain(0, head);
    for (int64_t i = head; i < body_end; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i),
                       from != nullptr ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))
                                       : _mm_setzero_si128());
    plain(body_end, bytes - body_end);
    return;
  }
#endif
  (void)streaming;
  plain(0, bytes);
}

void finish_streaming() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Zeroes the rows of a large dense output [num_weights, dim] that no kept index touches, each byte once, in
// parallel over parts of about kPart bytes, with streaming or plain stores. touched_row(r) is the r-th touched row
// (increasing, r < rows).
template <class T, class TouchedRow>
void zero_untouched_rows(T* out, int64_t num_weights, int64_t dim, int64_t rows, TouchedRow touched_row,
                         bool streaming) {
  constexpr int64_t kPart = int64_t(1) << 22;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  const int64_t rows_per_part = std::max<int64_t>(1, kPart / row_bytes);
  const int64_t parts = (num_weights + rows_per_part - 1) / rows_per_part;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t first = part * rows_per_part, last = std::min(num_weights, first + rows_per_part);
      // The first touched row at or after `first`, by bisection over the increasing touched rows.
      int64_t lo = 0, hi = rows;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (touched_row(mid) < first) lo = mid + 1;
        else hi = mid;
      }
      int64_t from = first;
      for (int64_t r = lo; from < last; ++r) {
        const int64_t to = r < rows ? std::min(last, touched_row(r)) : last;
        if (to > from)
          write_bytes(reinterpret_cast<unsigned char*>(out + from * dim), nullptr, (to - from) * row_bytes, streaming);
        from = to + 1;
      }
    }
    if (streaming) finish_streaming();
  }
}

template <class T, class Index>
void run(const EmbeddingBackwardArgs& a, int64_t padding_idx, const Destination<T>& to, uint64_t* sorted,
         int64_t* row_starts) {
  const auto* indices = static_cast<const Index*>(a.indices);
  const auto* grad = static_cast<const T*>(a.grad);
  const int64_t n = a.num_indices, dim = a.dim;
  check_indices_in_range(indices, n, a.num_weights);
  const bool dense = !to.sparse;
  const int64_t out_bytes = dense ? a.num_weights * dim * static_cast<int64_t>(sizeof(T)) : 0;
  // A large dense output is written once (kWriteOnceFrom); a small one is zeroed first (all-zero bits are +0) and
  // its touched rows written over. An empty result may come with a null `out`, which memset must not get even for 0
  // bytes.
  const bool write_once = out_bytes >= kWriteOnceFrom;
  const bool streaming = write_once && resident(reinterpret_cast<const unsigned char*>(to.dense) + out_bytes - 1);
  if (write_once) advise_huge_pages(to.dense, out_bytes);
  if (dense && !write_once && out_bytes > 0) std::memset(to.dense, 0, static_cast<std::size_t>(out_bytes));
  if (dense && !write_once && (n == 0 || dim == 0)) return;

  // Sorting (row, position) pairs orders each row's occurrences by position: the documented order.
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = sort_key(static_cast<int64_t>(indices[i]), a.num_weights, padding_idx);
    if (key != static_cast<uint32_t>(a.num_weights)) sorted[kept++] = (uint64_t{key} << 32) | uint64_t(i);
  }
  sort_by_row(sorted, kept, a.num_weights);

  int64_t rows = 0;
  for (int64_t i = 0; i < kept; ++i)
    if (i == 0 || (sorted[i] >> 32) != (sorted[i - 1] >> 32)) row_starts[rows++] = i;
  row_starts[rows] = kept;
  auto touched_row = [&](int64_t r) { return static_cast<int64_t>(sorted[row_starts[r]] >> 32); };

  if (write_once) zero_untouched_rows(to.dense, a.num_weights, dim, rows, touched_row, streaming);
  if (!dense) {
    // rows <= capacity: distinct contributing rows are at most N and at most num_weights.
    for (int64_t r = 0; r < rows; ++r) to.rows[r] = touched_row(r);
    for (int64_t r = rows; r < to.capacity; ++r) to.rows[r] = -1;
    advise_huge_pages(to.row_grads, to.capacity * dim * static_cast<int64_t>(sizeof(T)));  // written whole below
    const std::size_t unused_bytes = static_cast<std::size_t>((to.capacity - rows) * dim) * sizeof(T);
    if (unused_bytes > 0) std::memset(to.row_grads + rows * dim, 0, unused_bytes);
    *to.count = rows;
  }
  // Nothing to sum: return before the per-thread scratch rows (dim elements each) are allocated.
  if (rows == 0 || dim == 0) return;

  // Small problems stay on the calling thread: a parallel region costs more than it saves there.
#pragma omp parallel if (n * dim >= (1 << 16))
  {
    RowScratch<typename ElementTraits<T>::Acc> scratch(dim);
    std::vector<T> finished(streaming ? static_cast<std::size_t>(dim) : 0);  // a streamed row, before its copy
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t begin = row_starts[r], end = row_starts[r + 1];
      T* const destination = dense ? to.dense + touched_row(r) * dim : to.row_grads + r * dim;
      reduce_row<T>(grad, dim, sorted, begin, end, a.scale_grad_by_freq, streaming ? finished.data() : destination,
                    scratch);
      if (streaming)
        write_bytes(reinterpret_cast<unsigned char*>(destination),
                    reinterpret_cast<const unsigned char*>(finished.data()), dim * static_cast<int64_t>(sizeof(T)),
                    /*streaming=*/true);
    }
    if (streaming) finish_streaming();
  }
}

// Checks the workspace, carves it, and runs the dtype's instantiation; `make_destination` turns the type-erased
// outputs into a Destination<T>.
template <class MakeDestination>
void dispatch(const EmbeddingBackwardArgs& a, int64_t padding_idx, void* workspace, std::size_t workspace_bytes,
              MakeDestination make_destination) {
  const std::size_t needed =
      embedding_backward_workspace_bytes(Backend::Cpu, a.grad_dtype, a.num_indices, a.dim, a.num_weights);
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr))
    throw std::invalid_argument("embedding_backward: workspace of " + std::to_string(workspace_bytes) +
                                " bytes is smaller than the " + std::to_string(needed) + " required");
  const auto layout = embedding_detail::cpu_workspace_layout(a.num_indices);
  auto* sorted = static_cast<uint64_t*>(workspace);
  auto* row_starts = reinterpret_cast<int64_t*>(static_cast<char*>(workspace) + layout.row_starts);
  auto typed = [&](auto zero) {
    using T = decltype(zero);
    const Destination<T> to = make_destination(zero);
    if (a.index_dtype == DType::Int32)
      run<T, int32_t>(a, padding_idx, to, sorted, row_starts);
    else
      run<T, int64_t>(a, padding_idx, to, sorted, row_starts);
  };
  switch (a.grad_dtype) {
    case DType::Float32: typed(float{}); break;
    case DType::Float64: typed(double{}); break;
    case DType::Float16: typed(f16_t{}); break;
    case DType::BFloat16: typed(bf16_t{}); break;
    default: throw std::invalid_argument("embedding_backward: unsupported grad dtype");
  }
}

}  // namespace

void embedding_backward_dense_cpu(const EmbeddingBackwardArgs& a, void* out, void* workspace,
                                  std::size_t workspace_bytes) {
  const int64_t padding_idx = validate_embedding_backward_args(a);
  if (a.num_weights * a.dim > 0 && out == nullptr) throw std::invalid_argument("embedding_backward: null output");
  dispatch(a, padding_idx, workspace, workspace_bytes, [&](auto zero) {
    Destination<decltype(zero)> to;
    to.dense = static_cast<decltype(zero)*>(out);
    return to;
  });
}

void embedding_backward_sparse_cpu(const EmbeddingBackwardArgs& a, int64_t* rows, void* row_grads, int64_t* count,
                                   void* workspace, std::size_t workspace_bytes) {
  const int64_t padding_idx = validate_embedding_backward_args(a);
  const int64_t capacity = embedding_detail::sparse_capacity(a.num_indices, a.num_weights);
  embedding_detail::check_sparse_outputs(a, capacity, rows, row_grads, count);
  dispatch(a, padding_idx, workspace, workspace_bytes, [&](auto zero) {
    Destination<decltype(zero)> to;
    to.rows = rows;
    to.row_grads = static_cast<decltype(zero)*>(row_grads);
    to.count = count;
    to.capacity = capacity;
    to.sparse = true;
    return to;
  });
}

}  // namespace graphsafe
