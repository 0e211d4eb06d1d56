// The CUDA kernels that the dense and the row-sparse embedding backward share (cuda.cu, cuda_sparse.cu):
// sort keys, the radix sort, and the three reduce levels of the order in include/graphsafe/embedding.h.
// A reduce kernel's destination is a template parameter (Slot): DenseSlot puts row r at out + r * dim, as the
// dense kernels always did, and adds no work to them; SparseSlot puts the k-th run at row_grads + k * dim.
// Everything here has internal linkage: each .cu file compiles its own copy of what it instantiates.
#pragma once

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/dependent_launch.cuh"
#include "common/device_error.cuh"
#include "embedding/reduction.h"
#include "graphsafe/embedding.h"

namespace graphsafe {
namespace {

using embedding_detail::finish_element;
using embedding_detail::piece_slot;
using embedding_detail::tile_count;
using embedding_detail::tile_group_count;
using embedding_detail::sort_key;

constexpr int kThreads = 256;
constexpr int64_t kTile = kEmbeddingTile;
constexpr int64_t kGroupTiles = kEmbeddingTileGroup;
// Gradient loads issued ahead of the additions that consume them (in order), per thread. Level 1 with one-tile
// items (few tiles: a wave or two of blocks, bound by latency) takes kBatch. With multi-tile items (many waves) it
// runs kMultiTileMinBlocks blocks per SM, whose register budget (64 per thread) holds kMultiTileBatch loads
// without spilling; there, more resident threads with fewer loads each keep more bytes in flight (docs/embedding.md).
constexpr int kBatch = 8;
constexpr int kMultiTileBatch = 4;
constexpr int kMultiTileMinBlocks = 4;

inline int sort_end_bit(int64_t num_weights) {
  // Keys go up to num_weights (the sentinel) and no further.
  int bits = 1;
  while ((int64_t{1} << bits) <= num_weights) ++bits;
  return bits;
}

// One (row, position) pair per occurrence. row_occurs (dense result; may be null): cleared here, for level 1 to flag
// the rows it sums (one launch fewer than a memset of its own).
template <class Index>
__global__ void make_sort_keys(const Index* __restrict__ indices, int64_t n, int64_t num_weights, int64_t padding_idx,
                               uint32_t* __restrict__ keys, uint32_t* __restrict__ positions,
                               uint8_t* __restrict__ row_occurs, DeviceErrorRecord* error) {
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) {
    const int64_t index = static_cast<int64_t>(indices[i]);
    if (index < 0 || index >= num_weights) report_index_out_of_range(error, index, num_weights);
    keys[i] = sort_key(index, num_weights, padding_idx);
    positions[i] = static_cast<uint32_t>(i);
  }
  if (row_occurs != nullptr) {  // 16 flags per store (the workspace carves it 256-byte aligned), then the rest
    const int64_t vectors = num_weights / 16;
    for (int64_t v = first; v < vectors; v += stride) reinterpret_cast<uint4*>(row_occurs)[v] = make_uint4(0, 0, 0, 0);
    for (int64_t row = vectors * 16 + first; row < num_weights; row += stride) row_occurs[row] = 0;
  }
}

__device__ bool key_at(const uint32_t* __restrict__ keys, int64_t n, int64_t p, uint32_t key) {
  return p >= 0 && p < n && keys[p] == key;
}

// First position in [lo, hi) whose key is >= key (keys are sorted).
__device__ int64_t lower_bound(const uint32_t* __restrict__ keys, int64_t lo, int64_t hi, uint32_t key) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// First position in [lo, hi) whose key is > key.
__device__ int64_t upper_bound(const uint32_t* __restrict__ keys, int64_t lo, int64_t hi, uint32_t key) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] <= key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// upper_bound(keys, lo, hi, key) for a run of `key` that most likely ends soon after lo (keys before lo are <= key):
// steps of doubling length find a bracket, then bisection inside it. A few dependent loads for a short run, where
// bisecting all of [lo, hi) takes log2(hi - lo).
__device__ int64_t upper_bound_near(const uint32_t* __restrict__ keys, int64_t lo, int64_t hi, uint32_t key) {
  int64_t probe = lo, step = 1;
  while (probe < hi && keys[probe] <= key) {
    lo = probe + 1;
    probe += step;
    step *= 2;
  }
  return upper_bound(keys, lo, min(probe, hi), key);
}

// VEC consecutive elements, moved with one wide memory access.
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Threads that share one work item (a tile, a group of tiles, an output row): enough to cover a row's
// vectors, at most a block.
struct Geometry {
  int group;            // threads per item
  int groups_per_block;
  int64_t blocks;
};

inline Geometry geometry_for(int64_t items, int64_t vectors_per_row) {
  int group = 1;
  while (group < vectors_per_row && group < kThreads) group *= 2;
  const int groups_per_block = kThreads / group;
  return {group, groups_per_block, std::max<int64_t>(1, (items + groups_per_block - 1) / groups_per_block)};
}


// Destinations of finished rows (the Slot of the reduce kernels), called with the row and a sorted position inside
// its run. Dense: the row itself. Row-sparse: the run's number among the runs, from the inclusive prefix sum of
// run starts over sorted positions (the same at every position of a run: no run starts inside another).
// kNeedsRunStart: whether the slot reads the sorted position (else levels 2 and 3 search for a row's start only to
// count its occurrences, for scale_grad_by_freq).
struct DenseSlot {
  static constexpr bool kNeedsRunStart = false;
  __device__ int64_t operator()(uint32_t row, int64_t /*sorted_position*/) const { return row; }
};

struct SparseSlot {
  static constexpr bool kNeedsRunStart = true;
  const uint32_t* __restrict__ runs_so_far;  // runs starting at or before each sorted position
  __device__ int64_t operator()(uint32_t /*row*/, int64_t sorted_position) const {
    return static_cast<int64_t>(runs_so_far[sorted_position]) - 1;
  }
};

template <class T, int VEC>
__device__ void store_row_vector(T* __restrict__ out, int64_t row, int64_t dim, int64_t v,
                                 const typename ElementTraits<T>::Acc (&total)[VEC], int64_t count,
                                 bool scale_grad_by_freq) {
  Pack<T, VEC> result;
#pragma unroll
  for (int k = 0; k < VEC; ++k) result.v[k] = finish_element<T>(total[k], count, scale_grad_by_freq);
  *reinterpret_cast<Pack<T, VEC>*>(out + row * dim + v * VEC) = result;
}

template <class Acc, int VEC>
__device__ void store_partial(Acc* __restrict__ partials, int64_t slot, int64_t dim, int64_t v, const Acc (&acc)[VEC]) {
  Pack<Acc, VEC> p;
#pragma unroll
  for (int k = 0; k < VEC; ++k) p.v[k] = acc[k];
  *reinterpret_cast<Pack<Acc, VEC>*>(partials + slot * dim + v * VEC) = p;
}

template <class Acc, int VEC>
__device__ void add_partial(Acc (&acc)[VEC], const Acc* __restrict__ partials, int64_t slot, int64_t dim, int64_t v) {
  const Pack<Acc, VEC> p = *reinterpret_cast<const Pack<Acc, VEC>*>(partials + slot * dim + v * VEC);
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] += p.v[k];
}

// acc += partials[slot(i)] for i = first..last in order; kAhead rows are loaded before they are added.
template <class Acc, int VEC, class Slot>
__device__ void add_partials_in_order(Acc (&acc)[VEC], const Acc* __restrict__ partials, int64_t first, int64_t last,
                                      Slot slot, int64_t dim, int64_t v) {
  constexpr int kAhead = 4;
  for (int64_t ahead = first; ahead <= last; ahead += kAhead) {
    Pack<Acc, VEC> pieces[kAhead];
#pragma unroll
    for (int b = 0; b < kAhead; ++b)
      if (ahead + b <= last) pieces[b] = *reinterpret_cast<const Pack<Acc, VEC>*>(partials + slot(ahead + b) * dim + v * VEC);
#pragma unroll
    for (int b = 0; b < kAhead; ++b)
      if (ahead + b <= last) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += pieces[b].v[k];
      }
  }
}

// Level 1 for one item: `tiles` consecutive tiles from first_tile (reduce_tiles; the small path's reduce blocks take
// one tile per item). A row's run is summed tile by tile in position order, each tile's sum from +0. A row that
// ends inside the item is finished here, its tile sums added in order on chip. What is left for level 2 is exactly
// the partial sums the order of embedding.h adds next:
//   - the item's first row, if it began before the item: one piece per tile it covers, slot piece_slot(t, true);
//   - the item's last row, if it began inside the item and goes on past it: the ordered sum of its tile sums so far,
//     in slot piece_slot(t, false) of the item's last tile t.
// So the bits do not depend on the item size; larger items only move fewer pieces through memory. An item never
// spans two tile groups. row_occurs (dense result; may be null): flags each row that begins inside the item.
// `lane` of `group` threads share the row's vectors. kMultiTile false: items of one tile (`tiles` is 1).
template <class T, int VEC, class Slot, bool kMultiTile>
__device__ void sum_item_rows(const T* __restrict__ grad, const uint32_t* __restrict__ keys,
                              const uint32_t* __restrict__ positions, int64_t n, int64_t dim, uint32_t sentinel,
                              bool scale_grad_by_freq, T* __restrict__ out,
                              typename ElementTraits<T>::Acc* __restrict__ tile_partials,
                              uint8_t* __restrict__ row_occurs, int64_t first_tile, int64_t tiles, int lane, int group,
                              Slot slot) {
  using Acc = typename ElementTraits<T>::Acc;
  constexpr int kLoadsAhead = kMultiTile ? kMultiTileBatch : kBatch;
  const int64_t begin = first_tile * kTile;
  const int64_t item_end = min(begin + tiles * kTile, n);
  // Sentinels (padding, out-of-range) sort last: their gradient rows are never read.
  if (keys[begin] == sentinel) return;
  const int64_t end = keys[item_end - 1] == sentinel ? lower_bound(keys, begin, item_end, sentinel) : item_end;
  const bool first_began_earlier = key_at(keys, n, begin - 1, keys[begin]);
  for (int64_t v = lane; v < dim / VEC; v += group) {
    Acc acc[VEC], earlier_tiles[VEC];  // this tile's sum of the run; the ordered sum of its earlier tiles' sums
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = earlier_tiles[k] = Acc(0);
    bool crossed_tile = false;  // the run (begun inside the item) has earlier tiles' sums in earlier_tiles
    int64_t run_start = begin;
    // One-tile items are bound by latency (few of them, each a chain of loads): the next batch's positions are
    // loaded while this batch's gradient rows are in flight, so a batch waits for one round trip, not two.
    uint32_t next_positions[kLoadsAhead];
    if constexpr (!kMultiTile) {
#pragma unroll
      for (int b = 0; b < kLoadsAhead; ++b)
        if (begin + b < end) next_positions[b] = positions[begin + b];
    }
    for (int64_t batch_start = begin; batch_start < end; batch_start += kLoadsAhead) {
      Pack<T, VEC> batch[kLoadsAhead];
#pragma unroll
      for (int b = 0; b < kLoadsAhead; ++b)
        if (batch_start + b < end) {
          const uint32_t position = kMultiTile ? positions[batch_start + b] : next_positions[b];
          batch[b] = *reinterpret_cast<const Pack<T, VEC>*>(grad + int64_t(position) * dim + v * VEC);
        }
      if constexpr (!kMultiTile) {
#pragma unroll
        for (int b = 0; b < kLoadsAhead; ++b)
          if (batch_start + kLoadsAhead + b < end) next_positions[b] = positions[batch_start + kLoadsAhead + b];
      }
#pragma unroll
      for (int b = 0; b < kLoadsAhead; ++b) {
        const int64_t j = batch_start + b;
        if (j >= end) break;
        const uint32_t key = keys[j];
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += ElementTraits<T>::load(batch[b].v[k]);
        const bool began_earlier = run_start == begin && first_began_earlier;
        if (j + 1 < end && keys[j + 1] == key) {  // the run goes on inside the item
          if (!kMultiTile || (j + 1) % kTile != 0) continue;
          // ... into the next tile: this tile's sum is done.
          if (began_earlier) {
            store_partial<Acc, VEC>(tile_partials, piece_slot(j / kTile, true), dim, v, acc);
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) earlier_tiles[k] += acc[k];
            crossed_tile = true;
          }
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] = Acc(0);
          continue;
        }
        if (crossed_tile) {  // a row inside one tile is its tile's sum, a longer one the sum of its tiles' sums
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] = earlier_tiles[k] + acc[k];
        }
        if (row_occurs != nullptr && v == 0 && !began_earlier) row_occurs[key] = 1;
        if (began_earlier)
          store_partial<Acc, VEC>(tile_partials, piece_slot(j / kTile, true), dim, v, acc);
        else if (key_at(keys, n, item_end, key))  // goes on past the item
          store_partial<Acc, VEC>(tile_partials, piece_slot(j / kTile, false), dim, v, acc);
        else
          store_row_vector<T, VEC>(out, slot(key, run_start), dim, v, acc, j + 1 - run_start, scale_grad_by_freq);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = earlier_tiles[k] = Acc(0);
        crossed_tile = false;
        run_start = j + 1;
      }
    }
  }
}

// Tiles per level-1 item: a power of two up to kMaxTilesPerItem (which divides kGroupTiles, so items never span
// groups), as large as leaves about kLevel1Threads threads of work to fill the GPU. The bits are the same for
// every choice (sum_item_rows).
constexpr int64_t kMaxTilesPerItem = 16;
constexpr int64_t kLevel1Threads = int64_t(1) << 19;
static_assert(kGroupTiles % kMaxTilesPerItem == 0, "items must not span tile groups");

inline int64_t tiles_per_item(int64_t tiles, int group) {
  int64_t per_item = 1;
  while (per_item < kMaxTilesPerItem && tiles / (2 * per_item) * group >= kLevel1Threads) per_item *= 2;
  return per_item;
}

// Level 1: one item per tiles_per_item tiles (sum_item_rows). Its first thread also records, for each of its tiles,
// the rows whose pieces it leaves in the tile's two slots (sentinel: slot unused), for reduce_tile_groups.
template <class T, int VEC, class Slot, bool kMultiTile>
__global__ void __launch_bounds__(kThreads, kMultiTile ? kMultiTileMinBlocks : 1)
    reduce_tiles(const T* __restrict__ grad, const uint32_t* __restrict__ keys, const uint32_t* __restrict__ positions,
                 int64_t n, int64_t dim, uint32_t sentinel, bool scale_grad_by_freq, T* __restrict__ out,
                 typename ElementTraits<T>::Acc* __restrict__ tile_partials, uint2* __restrict__ tile_pieces,
                 uint8_t* __restrict__ row_occurs, int64_t tiles_in_item, int group, Slot slot) {
  wait_for_preceding_kernel();  // the kernel ahead: the sort (dense), the run numbering (row-sparse)
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  const int64_t first_tile = item * tiles_in_item;
  const int64_t begin = first_tile * kTile;
  if (begin >= n) return;
  if (threadIdx.x % group == 0) {
    const int64_t item_end = min(begin + tiles_in_item * kTile, n);
    const uint32_t first = keys[begin], last = keys[item_end - 1];
    const bool first_began_earlier = first != sentinel && key_at(keys, n, begin - 1, first);
    const bool last_goes_on = last != sentinel && key_at(keys, n, item_end, last);
    const int64_t last_tile = (item_end - 1) / kTile;
    for (int64_t t = first_tile; t <= last_tile; ++t) {
      const bool first_row_piece = first_began_earlier && keys[t * kTile] == first;
      const bool last_row_piece = t == last_tile && last_goes_on && !(first == last && first_began_earlier);
      tile_pieces[t] = make_uint2(first_row_piece ? first : sentinel, last_row_piece ? last : sentinel);
    }
  }
  sum_item_rows<T, VEC, Slot, kMultiTile>(grad, keys, positions, n, dim, sentinel, scale_grad_by_freq, out,
                                          tile_partials, row_occurs, first_tile, tiles_in_item, threadIdx.x % group,
                                          group, slot);
}

// Level 2: rows longer than a level-1 item, within each group of kGroupTiles tiles. One thread group per level-1
// item (tiles_in_item tiles): it leads the row whose piece is in slot piece_slot(t, false) of the item's last tile t
// (the row began in the item and goes on), and, if the item starts a group, the row that reaches into the group
// from before (only those tiles' records can name a leader: reduce_tiles). A leader adds the row's pieces in order
// up to the end of the row or of the group: a row that lies inside the group is finished, a longer row leaves a
// piece in the group's slot.
template <class T, int VEC, class Slot>
__global__ void __launch_bounds__(kThreads)
    reduce_tile_groups(const uint32_t* __restrict__ keys, int64_t n, int64_t dim, uint32_t sentinel,
                       bool scale_grad_by_freq, T* __restrict__ out,
                       const typename ElementTraits<T>::Acc* __restrict__ tile_partials,
                       const uint2* __restrict__ tile_pieces,
                       typename ElementTraits<T>::Acc* __restrict__ group_partials, int64_t tiles_in_item, int group,
                       Slot slot) {
  using Acc = typename ElementTraits<T>::Acc;
  wait_for_preceding_kernel();  // level 1 (launch_dependent)
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  const int64_t tiles = tile_count(n);
  const int64_t first_tile = item * tiles_in_item;
  if (first_tile >= tiles) return;
  const int64_t last_tile = min(first_tile + tiles_in_item, tiles) - 1;
  const uint32_t earlier_row = first_tile % kGroupTiles == 0 ? tile_pieces[first_tile].x : sentinel;
  const uint32_t later_row = tile_pieces[last_tile].y;
  if (earlier_row == sentinel && later_row == sentinel) return;
  const int64_t tile_group = first_tile / kGroupTiles;
  const int64_t end_tile = min((tile_group + 1) * kGroupTiles, tiles);
  const int64_t group_end = min(end_tile * kTile, n);

  for (int role = 0; role < 2; ++role) {
    const bool began_earlier = role == 0;  // a group's first-tile "earlier" piece began before the group
    const uint32_t row = began_earlier ? earlier_row : later_row;
    if (row == sentinel) continue;
    const int64_t tile = began_earlier ? first_tile : last_tile;
    // The row's last tile inside the group: it goes on through tile t while t's record starts with it.
    int64_t last = tile;
    while (last + 1 < end_tile && tile_pieces[last + 1].x == row) ++last;
    const bool goes_on = last + 1 == end_tile && key_at(keys, n, group_end, row);
    int64_t count = 0, row_begin = 0;
    if (!began_earlier && !goes_on && (Slot::kNeedsRunStart || scale_grad_by_freq)) {
      // The row began inside this tile's level-1 item, which lies inside the group.
      const int64_t row_end = upper_bound(keys, tile * kTile, group_end, row);
      row_begin = lower_bound(keys, tile_group * kGroupTiles * kTile, group_end, row);
      count = row_end - row_begin;
    }
    for (int64_t v = threadIdx.x % group; v < dim / VEC; v += group) {
      Acc acc[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = Acc(0);
      add_partial<Acc, VEC>(acc, tile_partials, piece_slot(tile, began_earlier), dim, v);
      add_partials_in_order<Acc, VEC>(acc, tile_partials, tile + 1, last,
                                      [](int64_t t) { return piece_slot(t, true); }, dim, v);
      if (!began_earlier && !goes_on)
        store_row_vector<T, VEC>(out, slot(row, row_begin), dim, v, acc, count, scale_grad_by_freq);
      else
        store_partial<Acc, VEC>(group_partials, piece_slot(tile_group, began_earlier), dim, v, acc);
    }
  }
}

// Level 3: rows that span tile groups. The group in which such a row begins adds the row's group pieces
// in order and finishes it.
template <class T, int VEC, class Slot>
__global__ void __launch_bounds__(kThreads)
    reduce_long_rows(const uint32_t* __restrict__ keys, int64_t n, int64_t dim, uint32_t sentinel,
                     bool scale_grad_by_freq, T* __restrict__ out,
                     const typename ElementTraits<T>::Acc* __restrict__ group_partials, int group, Slot slot) {
  using Acc = typename ElementTraits<T>::Acc;
  constexpr int64_t kGroupSpan = kTile * kGroupTiles;
  wait_for_preceding_kernel();  // level 2, and through it level 1 (launch_dependent)
  const int64_t tile_group = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  const int64_t group_begin = tile_group * kGroupSpan;
  if (group_begin >= n) return;
  const int64_t group_end = min(group_begin + kGroupSpan, n);
  const uint32_t row = keys[group_end - 1];
  if (row == sentinel || !key_at(keys, n, group_end, row)) return;                // does not go on
  if (keys[group_begin] == row && key_at(keys, n, group_begin - 1, row)) return;  // began earlier
  const int64_t row_end = upper_bound_near(keys, group_end, n, row);
  const int64_t last_group = (row_end - 1) / kGroupSpan;
  const int64_t row_begin =
      Slot::kNeedsRunStart || scale_grad_by_freq ? lower_bound(keys, group_begin, group_end, row) : 0;
  const int64_t count = row_end - row_begin;  // (read only under scale_grad_by_freq)
  for (int64_t v = threadIdx.x % group; v < dim / VEC; v += group) {
    Acc total[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) total[k] = Acc(0);
    add_partial<Acc, VEC>(total, group_partials, piece_slot(tile_group, false), dim, v);
    add_partials_in_order<Acc, VEC>(total, group_partials, tile_group + 1, last_group,
                                    [](int64_t u) { return piece_slot(u, true); }, dim, v);
    store_row_vector<T, VEC>(out, slot(row, row_begin), dim, v, total, count, scale_grad_by_freq);
  }
}

struct Workspace {
  uint32_t* keys_in;
  uint32_t* keys_sorted;
  uint32_t* positions_in;
  uint32_t* positions_sorted;
  void* sort_scratch;
  std::size_t sort_bytes;
  uint8_t* row_occurs;
  uint2* tile_pieces;
  void* tile_partials;
  void* group_partials;
  void* scan_scratch;
  std::size_t scan_bytes;
};

inline Workspace carve(void* base, const embedding_detail::CudaWorkspaceLayout& l) {
  char* p = static_cast<char*>(base);
  return {reinterpret_cast<uint32_t*>(p + l.keys_in),     reinterpret_cast<uint32_t*>(p + l.keys_sorted),
          reinterpret_cast<uint32_t*>(p + l.positions_in), reinterpret_cast<uint32_t*>(p + l.positions_sorted),
          p + l.sort_scratch,                              l.sort_bytes,
          reinterpret_cast<uint8_t*>(p + l.row_occurs),    reinterpret_cast<uint2*>(p + l.tile_pieces),
          p + l.tile_partials,                             p + l.group_partials,
          p + l.scan_scratch,                              l.scan_bytes};
}

// Keys and positions of every occurrence (indices checked and errors recorded even where nothing is summed); clears
// row_occurs where it is not null (the dense result's row flags, w.row_occurs). Nothing is launched without indices.
inline void launch_make_sort_keys(const EmbeddingBackwardArgs& a, int64_t padding_idx, const Workspace& w,
                                  uint8_t* row_occurs, DeviceErrorRecord* error, cudaStream_t stream) {
  const int n = static_cast<int>(a.num_indices);
  if (n == 0) return;
  // Enough blocks for the keys and for the flags (16 a store; a table of millions of rows can come with few indices,
  // as the small path takes few indices only where row and position fit one 32-bit key).
  const int64_t flag_vectors = row_occurs != nullptr ? (a.num_weights + 15) / 16 : 0;
  const int key_blocks = static_cast<int>(
      std::min<int64_t>((std::max<int64_t>(a.num_indices, flag_vectors) + kThreads - 1) / kThreads, 65535));
  if (a.index_dtype == DType::Int32)
    make_sort_keys<int32_t><<<key_blocks, kThreads, 0, stream>>>(static_cast<const int32_t*>(a.indices), n,
                                                                 a.num_weights, padding_idx, w.keys_in, w.positions_in,
                                                                 row_occurs, error);
  else
    make_sort_keys<int64_t><<<key_blocks, kThreads, 0, stream>>>(static_cast<const int64_t*>(a.indices), n,
                                                                 a.num_weights, padding_idx, w.keys_in, w.positions_in,
                                                                 row_occurs, error);
  GS_CUDA_CHECK_LAUNCH();
}

// A stable radix sort of the pairs by row: each row's occurrences end up in increasing position.
inline void sort_by_row(const EmbeddingBackwardArgs& a, const Workspace& w, cudaStream_t stream) {
  std::size_t sort_bytes = w.sort_bytes;
  GS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(w.sort_scratch, sort_bytes, w.keys_in, w.keys_sorted,
                                                w.positions_in, w.positions_sorted, static_cast<int>(a.num_indices),
                                                0, sort_end_bit(a.num_weights), stream));
}

// The three reduce levels over the sorted pairs; `out` is the dense result or row_grads, as `slot` says. row_occurs
// (dense result, cleared beforehand; may be null): flags every row that receives a sum.
template <class T, int VEC, class Slot>
void reduce_sorted(const EmbeddingBackwardArgs& a, const Workspace& w, void* out, Slot slot, uint8_t* row_occurs,
                   cudaStream_t stream) {
  using Acc = typename ElementTraits<T>::Acc;
  const int64_t n = a.num_indices;
  const auto sentinel = static_cast<uint32_t>(a.num_weights);
  T* const result = static_cast<T*>(out);
  const int64_t vectors_per_row = a.dim / VEC;
  const int64_t tiles_in_item = tiles_per_item(tile_count(n), geometry_for(1, vectors_per_row).group);
  const Geometry items = geometry_for((tile_count(n) + tiles_in_item - 1) / tiles_in_item, vectors_per_row);
  // Each level is a dependent launch (common/dependent_launch.cuh): its blocks are scheduled while the kernel ahead
  // finishes, and every block waits for it before reading anything.
  launch_dependent(tiles_in_item > 1 ? reduce_tiles<T, VEC, Slot, true> : reduce_tiles<T, VEC, Slot, false>,
                   items.blocks, kThreads, 0, stream, static_cast<const T*>(a.grad), w.keys_sorted, w.positions_sorted,
                   n, a.dim, sentinel, a.scale_grad_by_freq, result, static_cast<Acc*>(w.tile_partials), w.tile_pieces,
                   row_occurs, tiles_in_item, items.group, slot);
  launch_dependent(reduce_tile_groups<T, VEC, Slot>, items.blocks, kThreads, 0, stream, w.keys_sorted, n, a.dim,
                   sentinel, a.scale_grad_by_freq, result, static_cast<const Acc*>(w.tile_partials), w.tile_pieces,
                   static_cast<Acc*>(w.group_partials), tiles_in_item, items.group, slot);
  const Geometry groups = geometry_for(tile_group_count(n), vectors_per_row);
  launch_dependent(reduce_long_rows<T, VEC, Slot>, groups.blocks, kThreads, 0, stream,
                   w.keys_sorted, n, a.dim, sentinel, a.scale_grad_by_freq, result,
                   static_cast<const Acc*>(w.group_partials), groups.group, slot);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elements per 16-byte access, and whether rows allow such accesses (the choice changes no bits).
template <class T>
constexpr int wide_vector() { return 16 / sizeof(T); }
template <class T>
bool use_wide_vectors(const EmbeddingBackwardArgs& a, const void* out) {
  return a.dim % wide_vector<T>() == 0 && aligned16(a.grad) && aligned16(out);
}

}  // namespace

// The small-problem path of the dense result (cuda_small.cu): two launches, the same sums in the same order.
// Taken when embedding_backward_cuda_small_path says so, from shapes alone.
bool embedding_backward_cuda_small_path(int64_t num_indices, int64_t dim, int64_t num_weights, std::size_t elem_bytes);
void embedding_backward_dense_cuda_small(const EmbeddingBackwardArgs& a, int64_t padding_idx, void* out,
                                         void* workspace, const embedding_detail::CudaWorkspaceLayout& layout,
                                         DeviceErrorRecord* error, cudaStream_t stream);

}  // namespace graphsafe
