// Small-problem path of the dense CUDA embedding backward: two launches where the general path (cuda.cu) needs
// seven to ten, for problems whose fixed cost would otherwise dominate. Same sums, same order, same bits.
//
// 1. sort_small (one block): turns the indices (at most kSmallMaxIndices; row and position fit 32 bits) into sort
//    keys (padding and out-of-range -> the sentinel row num_weights; out-of-range ones reported in the device
//    error record, as make_sort_keys does), sorts the (row, position) pairs in shared memory and writes them
//    where the general path's radix sort writes its output; it also clears the per-tile arrival counters of
//    step 2.
// 2. zero_and_reduce_small, two kinds of blocks side by side:
//    - reduce blocks (the first ones): one item per tile of kEmbeddingTile sorted positions does level 1 of the
//      order (sum_item_rows, shared with reduce_tiles, one tile per item). A row spanning several tiles leaves one
//      piece per tile; each tile then counts its pieces in at the row's first tile, and the item whose arrival
//      completes the row adds the row's pieces in the fixed nesting of embedding.h (tiles within a group, then
//      groups) and stores it. Which item finishes depends on scheduling; the order of the additions does not.
//    - zero blocks: the table's rows are cut into chunks of about kZeroChunkBytes, chunk c belonging to zero block
//      c % zero_blocks; each block scans all indices for the rows of its chunks that occur, and zero-fills the
//      others. They write no byte a reduce block writes and read nothing step 1 writes. Dealt out in turn, the
//      chunks the blocks resident at one time write lie side by side, one window sweeping the table from start to
//      end as in a plain fill, rather than one stream per block spread over the whole table.
//    Zero-filling the table is most of the work (a memset's worth of stores); the sums of a few thousand rows
//    run beside it instead of after it. Where the GPU allows it (sm_90+), step 2 is launched as a programmatic
//    dependent launch: its zero blocks start while step 1 still sorts, and only its reduce blocks wait for step 1
//    to finish (griddepcontrol.wait: step 1 complete and its writes visible). Elsewhere step 2 starts after step 1,
//    as stream order says; the bits are the same either way.
// Grids and the path itself are chosen from shapes alone; nothing is read back, so both launches can be captured.
#include <cub/block/block_radix_sort.cuh>

#include <type_traits>

#include "embedding/backward_kernels.cuh"

namespace graphsafe {
namespace {

// One block of kSmallThreads sorts; items per thread (kSortItemsMax at most) grow with N, so a short input does not
// sort thousands of padding items.
constexpr int kSmallThreads = 256;
constexpr int kSortItemsMax = 16;
constexpr int64_t kSmallMaxIndices = int64_t(kSmallThreads) * kSortItemsMax;
// Zero-filling blocks: chunks of whole rows, as many as fit kZeroChunkBytes (one 16-byte store per thread) rounded
// down to a power of two (a shift finds a row's chunk), or one row where rows are longer; at least
// kZeroBytesPerBlock of output a block, and at least 64 output bytes per index (each block reads all the indices),
// at most kZeroRowsMax rows a block (its "row occurs" bitmap is in shared memory).
constexpr int64_t kZeroChunkBytes = int64_t(16) * kSmallThreads;
constexpr int64_t kZeroBytesPerBlock = int64_t(64) << 10;
constexpr int64_t kZeroBytesPerIndex = 64;
constexpr int64_t kZeroRowsMax = 32768;

template <int kItems>
using SmallSort = cub::BlockRadixSort<uint32_t, kSmallThreads, kItems>;

// Rows per chunk, chunks, zero-filling blocks and the most rows one block owns: shapes only.
struct ZeroGrid {
  int chunk_shift;  // log2 of the rows per chunk
  int64_t chunks;
  int64_t blocks;
  int64_t rows_per_block;  // bits of a block's bitmap: its chunks (at most ceil(chunks / blocks)) times chunk_rows
};

ZeroGrid zero_grid(int64_t num_indices, int64_t num_weights, int64_t row_bytes) {
  int chunk_shift = 0;
  while ((int64_t{2} << chunk_shift) * row_bytes <= kZeroChunkBytes) ++chunk_shift;
  const int64_t chunk_rows = int64_t{1} << chunk_shift;
  const int64_t chunks = (num_weights + chunk_rows - 1) / chunk_rows;
  const int64_t per_block = std::max(kZeroBytesPerBlock, num_indices * kZeroBytesPerIndex);
  const int64_t chunks_per_block = std::clamp<int64_t>(per_block / (chunk_rows * std::max<int64_t>(row_bytes, 1)), 1,
                                                       std::max<int64_t>(kZeroRowsMax / chunk_rows, 1));
  const int64_t blocks = (chunks + chunks_per_block - 1) / chunks_per_block;
  return {chunk_shift, chunks, blocks, (chunks + blocks - 1) / blocks * chunk_rows};
}

// Bits of the composite sort key (row << position_bits | position), at most 32 on this path: 2^position_bits > n,
// so a real key never has all its bits set and the padding items (all ones) sort behind every real one. Keys are
// unique, so the order is (row, position) whatever the sort's stability.
int position_bits(int64_t n) { return sort_end_bit(n); }
int composite_key_bits(int64_t n, int64_t num_weights) { return position_bits(n) + sort_end_bit(num_weights); }

// Zero-fills the rows of [first_row, first_row + rows) whose bit in `occurs` (from bit first_bit on) is clear, with
// stores of U. +0 is all zero bits in every floating-point type, so the bytes need no element type. The stores are
// marked evict-first (__stcs): the fill streams the whole table through L2 and would otherwise evict what the reduce
// blocks read beside it (the gradient rows, the sorted keys and positions), whose chain of loads is the launch's
// other critical path.
template <class U>
__device__ void zero_rows_without_bit(char* __restrict__ out, int64_t first_row, uint32_t rows, uint32_t units_per_row,
                                      const uint32_t* __restrict__ occurs, uint32_t first_bit) {
  U* const dst = reinterpret_cast<U*>(out) + first_row * units_per_row;
  const uint32_t units = rows * units_per_row;
  for (uint32_t u = threadIdx.x; u < units; u += blockDim.x) {
    const uint32_t bit = first_bit + u / units_per_row;
    if (!((occurs[bit >> 5] >> (bit & 31)) & 1u)) __stcs(dst + u, U{});
  }
}

template <class Index, int kItems>
__global__ void __launch_bounds__(kSmallThreads)
    sort_small(const Index* __restrict__ indices, int n, int64_t num_weights, int64_t padding_idx, int pos_bits,
               int end_bit, uint32_t* __restrict__ keys_sorted, uint32_t* __restrict__ positions_sorted,
               uint32_t* __restrict__ counters, int64_t tiles, DeviceErrorRecord* error) {
  __shared__ typename SmallSort<kItems>::TempStorage sort_storage;
  let_next_kernel_start();  // its zero blocks need nothing from here; its reduce blocks wait for the whole kernel
  uint32_t items[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int i = threadIdx.x * kItems + k;
    items[k] = ~uint32_t{0};
    if (i < n) {
      const int64_t index = static_cast<int64_t>(indices[i]);
      if (index < 0 || index >= num_weights) report_index_out_of_range(error, index, num_weights);
      items[k] = sort_key(index, num_weights, padding_idx) << pos_bits | static_cast<uint32_t>(i);
    }
  }
  SmallSort<kItems>(sort_storage).Sort(items, 0, end_bit);
  const uint32_t position_mask = (uint32_t{1} << pos_bits) - 1;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {  // blocked arrangement: thread t holds sorted ranks t * kItems + k
    const int rank = threadIdx.x * kItems + k;
    if (rank < n) {
      keys_sorted[rank] = items[k] >> pos_bits;
      positions_sorted[rank] = items[k] & position_mask;
    }
  }
  for (int64_t t = threadIdx.x; t < tiles; t += blockDim.x) counters[t] = 0;
}

// What a zero block needs: the raw indices (int64 or int32), the chunks and how they are dealt, the store width.
struct ZeroFill {
  const void* indices;
  bool indices_are_int64;
  int n;
  int64_t num_weights, padding_idx;
  char* out;
  int chunk_shift;  // log2 of the rows per chunk
  int64_t chunks;
  uint32_t blocks;
  uint32_t units_per_row;
  int unit_bytes;
};

// Zero block `block`: chunks block, block + blocks, block + 2 * blocks, ...; the rows of them that no index names
// are zero-filled (the others get their sums from the reduce blocks). `occurs` is its bitmap in shared memory, bit
// k * chunk_rows + r for row r of its k-th chunk.
template <class U>
__device__ void zero_fill_chunks(const ZeroFill& z, int64_t block, uint32_t* __restrict__ occurs) {
  const int64_t chunk_rows = int64_t{1} << z.chunk_shift;
  const int64_t my_chunks = (z.chunks - block + z.blocks - 1) / z.blocks;  // >= 1: block < blocks <= chunks
  const auto bits = static_cast<uint32_t>(my_chunks * chunk_rows);
  for (uint32_t w = threadIdx.x; w < (bits + 31) / 32; w += blockDim.x) occurs[w] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < z.n; i += blockDim.x) {
    const int64_t index = z.indices_are_int64 ? static_cast<const int64_t*>(z.indices)[i]
                                              : static_cast<int64_t>(static_cast<const int32_t*>(z.indices)[i]);
    const uint32_t key = sort_key(index, z.num_weights, z.padding_idx);
    if (key >= z.num_weights) continue;  // padding or out of range: the sentinel row, in no chunk
    const uint32_t chunk = key >> z.chunk_shift, turn = chunk / z.blocks;  // 32-bit: keys are below 2^32
    if (chunk - turn * z.blocks != static_cast<uint32_t>(block)) continue;
    const uint32_t bit = (turn << z.chunk_shift) + (key & (uint32_t(chunk_rows) - 1));
    atomicOr(&occurs[bit >> 5], 1u << (bit & 31));
  }
  __syncthreads();
  for (int64_t k = 0; k < my_chunks; ++k) {
    const int64_t first_row = (block + k * z.blocks) * chunk_rows;
    const auto rows = static_cast<uint32_t>(min(chunk_rows, z.num_weights - first_row));
    zero_rows_without_bit<U>(z.out, first_row, rows, z.units_per_row, occurs, static_cast<uint32_t>(k * chunk_rows));
  }
}

__device__ void zero_fill_block(const ZeroFill& z, int64_t block, uint32_t* __restrict__ occurs) {
  switch (z.unit_bytes) {
    case 16: zero_fill_chunks<uint4>(z, block, occurs); break;
    case 8: zero_fill_chunks<uint2>(z, block, occurs); break;
    case 4: zero_fill_chunks<uint32_t>(z, block, occurs); break;
    default: zero_fill_chunks<uint16_t>(z, block, occurs); break;
  }
}

// acc += partials[piece_slot(t, t != first_of_row)] for t = first..last in order, read past L1: the pieces were
// written by other blocks of this launch.
template <class Acc, int VEC>
__device__ void add_pieces_in_order(Acc (&acc)[VEC], const Acc* __restrict__ partials, int64_t first, int64_t last,
                                    int64_t first_of_row, int64_t dim, int64_t v) {
  constexpr int kAhead = 4;
  for (int64_t ahead = first; ahead <= last; ahead += kAhead) {
    Acc pieces[kAhead][VEC];
#pragma unroll
    for (int b = 0; b < kAhead; ++b)
      if (ahead + b <= last) {
        const Acc* piece = partials + piece_slot(ahead + b, ahead + b != first_of_row) * dim + v * VEC;
#pragma unroll
        for (int k = 0; k < VEC; ++k) pieces[b][k] = __ldcg(piece + k);
      }
#pragma unroll
    for (int b = 0; b < kAhead; ++b)
      if (ahead + b <= last) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += pieces[b][k];
      }
  }
}

// A row whose run [start, end) of sorted positions spans tiles, from its per-tile pieces: levels 2 and 3 of the
// order, exactly as reduce_tile_groups and reduce_long_rows add them (a row inside one group is that group's sum;
// a longer one the sum of its per-group sums).
template <class T, int VEC>
__device__ void finish_spanning_row(T* __restrict__ out, const typename ElementTraits<T>::Acc* __restrict__ partials,
                                    uint32_t row, int64_t start, int64_t end, int64_t dim, bool scale_grad_by_freq,
                                    int lane, int group) {
  using Acc = typename ElementTraits<T>::Acc;
  const int64_t first_tile = start / kTile, last_tile = (end - 1) / kTile;
  const int64_t first_group = first_tile / kGroupTiles, last_group = last_tile / kGroupTiles;
  for (int64_t v = lane; v < dim / VEC; v += group) {
    Acc total[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) total[k] = Acc(0);
    for (int64_t g = first_group; g <= last_group; ++g) {
      Acc part[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) part[k] = Acc(0);
      const int64_t group_first = g * kGroupTiles, group_last = group_first + kGroupTiles - 1;
      add_pieces_in_order<Acc, VEC>(part, partials, first_tile > group_first ? first_tile : group_first,
                                    last_tile < group_last ? last_tile : group_last, first_tile, dim, v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) total[k] = first_group == last_group ? part[k] : total[k] + part[k];
    }
    store_row_vector<T, VEC>(out, row, dim, v, total, end - start, scale_grad_by_freq);
  }
}

// A tile's piece of a spanning row is counted in at the row's first tile; true when it is the row's last piece.
__device__ bool arrive(uint32_t* __restrict__ counters, int64_t start, int64_t end) {
  const auto pieces = static_cast<uint32_t>((end - 1) / kTile - start / kTile + 1);
  return atomicAdd(&counters[start / kTile], 1u) + 1 == pieces;
}

// Reduce block `block`: level 1 for its tiles, then the spanning rows whose last piece it counts in.
template <class T, int VEC>
__device__ void reduce_small_block(const T* __restrict__ grad, const uint32_t* __restrict__ keys,
                                   const uint32_t* __restrict__ positions, int64_t n, int64_t dim, uint32_t sentinel,
                                   bool scale_grad_by_freq, T* __restrict__ out,
                                   typename ElementTraits<T>::Acc* __restrict__ tile_partials,
                                   uint32_t* __restrict__ counters, int group, int64_t block) {
  struct Finish {  // up to two spanning rows this item completes: its first row (began earlier), its last row
    uint32_t row[2];
    int64_t start[2], end[2];
    bool completes[2];
  };
  __shared__ Finish finishes[kThreads];
  const int item = threadIdx.x / group, lane = threadIdx.x % group;
  const int64_t tile = block * (kThreads / group) + item;
  const int64_t begin = tile * kTile;
  const bool active = begin < n;
  const int64_t tile_end = min(begin + kTile, n);
  uint32_t first = sentinel, last = sentinel;
  bool first_began_earlier = false, last_goes_on = false;
  if (active) {
    sum_item_rows<T, VEC, DenseSlot, /*kMultiTile=*/false>(grad, keys, positions, n, dim, sentinel, scale_grad_by_freq,
                                                           out, tile_partials, /*row_occurs=*/nullptr,
                                                           /*first_tile=*/tile, /*tiles=*/1, lane, group, DenseSlot{});
    first = keys[begin];
    last = keys[tile_end - 1];
    // The same conditions under which sum_item_rows leaves pieces in slots piece_slot(tile, true / false).
    first_began_earlier = first != sentinel && key_at(keys, n, begin - 1, first);
    last_goes_on = last != sentinel && key_at(keys, n, tile_end, last) && !(first == last && first_began_earlier);
    // This thread's pieces are visible to every block before its tile is counted in. A tile without pieces has
    // written nothing another block reads, and skips the fence (a wait for its row stores on the critical path).
    if (first_began_earlier || last_goes_on) __threadfence();
  }
  __syncthreads();
  if (active && lane == 0) {
    Finish f{{sentinel, sentinel}, {0, 0}, {0, 0}, {false, false}};
    if (first_began_earlier) {
      f.row[0] = first;
      f.start[0] = lower_bound(keys, 0, begin, first);
      f.end[0] = upper_bound(keys, begin, n, first);
      f.completes[0] = arrive(counters, f.start[0], f.end[0]);
    }
    if (last_goes_on) {
      f.row[1] = last;
      f.start[1] = lower_bound(keys, begin, tile_end, last);
      f.end[1] = upper_bound(keys, tile_end, n, last);
      f.completes[1] = arrive(counters, f.start[1], f.end[1]);
    }
    finishes[item] = f;
  }
  __syncthreads();
  if (!active) return;
  const Finish& f = finishes[item];
  for (int role = 0; role < 2; ++role) {
    if (!f.completes[role]) continue;
    __threadfence();  // every piece of the row was counted in after being written: read them after the count
    finish_spanning_row<T, VEC>(out, tile_partials, f.row[role], f.start[role], f.end[role], dim, scale_grad_by_freq,
                                lane, group);
  }
}

// Step 2: blocks [0, reduce_blocks) reduce (after sort_small has finished), the rest zero-fill.
template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    zero_and_reduce_small(const T* __restrict__ grad, const uint32_t* __restrict__ keys,
                          const uint32_t* __restrict__ positions, int64_t n, int64_t dim, uint32_t sentinel,
                          bool scale_grad_by_freq, T* __restrict__ out,
                          typename ElementTraits<T>::Acc* __restrict__ tile_partials, uint32_t* __restrict__ counters,
                          int group, int64_t reduce_blocks, ZeroFill zero) {
  extern __shared__ uint32_t occurs[];
  if (blockIdx.x < reduce_blocks) {
    wait_for_preceding_kernel();  // the sorted pairs and the cleared counters
    reduce_small_block<T, VEC>(grad, keys, positions, n, dim, sentinel, scale_grad_by_freq, out, tile_partials,
                               counters, group, blockIdx.x);
  } else {
    zero_fill_block(zero, blockIdx.x - reduce_blocks, occurs);
  }
}

// The small path's vector width: 16-byte accesses, unless vectors half as wide still give each vector of a row its own
// thread of a block. With few tiles the reduce is bound by each thread's chain of loads and additions (a tile's
// positions one after another), and a row over twice the threads halves every chain; each element's additions stay
// the same, so the bits do too.
template <class T>
int small_path_vector(const EmbeddingBackwardArgs& a, const void* out) {
  constexpr int kWide = wide_vector<T>();
  if (!use_wide_vectors<T>(a, out)) return 1;
  return a.dim / kWide < kThreads && a.dim / (kWide / 2) <= kThreads ? kWide / 2 : kWide;
}

template <class T, int VEC>
void launch_zero_and_reduce(const EmbeddingBackwardArgs& a, const Workspace& w, void* out, const ZeroFill& zero,
                            int64_t zero_blocks, std::size_t occurs_bytes, cudaStream_t stream) {
  using Acc = typename ElementTraits<T>::Acc;
  const Geometry tiles = geometry_for(tile_count(a.num_indices), a.dim / VEC);
  launch_dependent(zero_and_reduce_small<T, VEC>, tiles.blocks + zero_blocks, kThreads, occurs_bytes, stream,
                   static_cast<const T*>(a.grad), w.keys_sorted, w.positions_sorted, a.num_indices, a.dim,
                   static_cast<uint32_t>(a.num_weights), a.scale_grad_by_freq, static_cast<T*>(out),
                   static_cast<Acc*>(w.tile_partials), reinterpret_cast<uint32_t*>(w.tile_pieces), tiles.group,
                   tiles.blocks, zero);
}

template <class T>
void zero_and_reduce_typed(const EmbeddingBackwardArgs& a, const Workspace& w, void* out, const ZeroFill& zero,
                           int64_t zero_blocks, std::size_t occurs_bytes, cudaStream_t stream) {
  constexpr int kWide = wide_vector<T>(), kHalf = kWide / 2;
  const int vec = small_path_vector<T>(a, out);
  if (vec == kWide) launch_zero_and_reduce<T, kWide>(a, w, out, zero, zero_blocks, occurs_bytes, stream);
  else if (vec == kHalf) launch_zero_and_reduce<T, kHalf>(a, w, out, zero, zero_blocks, occurs_bytes, stream);
  else launch_zero_and_reduce<T, 1>(a, w, out, zero, zero_blocks, occurs_bytes, stream);
}

// The widest store (at most 16 bytes) that divides the row and the output's alignment.
int zero_unit_bytes(const void* out, int64_t row_bytes) {
  int unit = 16;
  while (unit > 2 && (row_bytes % unit != 0 || reinterpret_cast<uintptr_t>(out) % unit != 0)) unit /= 2;
  return unit;
}

}  // namespace

bool embedding_backward_cuda_small_path(int64_t num_indices, int64_t dim, int64_t num_weights, std::size_t elem_bytes) {
  if (num_indices < 1 || num_indices > kSmallMaxIndices || dim < 1 || num_weights < 1) return false;
  if (composite_key_bits(num_indices, num_weights) > 32) return false;
  const int64_t row_bytes = dim * static_cast<int64_t>(elem_bytes);
  const ZeroGrid grid = zero_grid(num_indices, num_weights, row_bytes);
  // A zero-filling block counts a chunk's 2-byte units in 32 bits; the grid (zero blocks after at most one reduce block
  // per tile) fits in one dimension.
  return (int64_t{1} << grid.chunk_shift) * (row_bytes / 2) < (int64_t{1} << 31) &&
         grid.blocks + tile_count(num_indices) < (int64_t{1} << 31) - 1;
}

void embedding_backward_dense_cuda_small(const EmbeddingBackwardArgs& a, int64_t padding_idx, void* out,
                                         void* workspace, const embedding_detail::CudaWorkspaceLayout& layout,
                                         DeviceErrorRecord* error, cudaStream_t stream) {
  const Workspace w = carve(workspace, layout);
  const int64_t row_bytes = a.dim * static_cast<int64_t>(dtype_size(a.grad_dtype));
  const int n = static_cast<int>(a.num_indices);
  const int pos_bits = position_bits(a.num_indices), end_bit = composite_key_bits(a.num_indices, a.num_weights);
  auto* const counters = reinterpret_cast<uint32_t*>(w.tile_pieces);
  const auto sort = [&](auto kernel, const auto* indices) {
    kernel<<<1, kSmallThreads, 0, stream>>>(indices, n, a.num_weights, padding_idx, pos_bits, end_bit, w.keys_sorted,
                                            w.positions_sorted, counters, tile_count(a.num_indices), error);
  };
  const auto sort_for = [&](const auto* indices) {
    using Index = std::remove_cv_t<std::remove_pointer_t<decltype(indices)>>;
    if (n <= kSmallThreads) sort(sort_small<Index, 1>, indices);
    else if (n <= kSmallThreads * 4) sort(sort_small<Index, 4>, indices);
    else sort(sort_small<Index, kSortItemsMax>, indices);
  };
  if (a.index_dtype == DType::Int32) sort_for(static_cast<const int32_t*>(a.indices));
  else sort_for(static_cast<const int64_t*>(a.indices));
  GS_CUDA_CHECK_LAUNCH();

  const ZeroGrid grid = zero_grid(a.num_indices, a.num_weights, row_bytes);
  const int unit = zero_unit_bytes(out, row_bytes);
  const ZeroFill zero{a.indices, a.index_dtype == DType::Int64, n, a.num_weights, padding_idx, static_cast<char*>(out),
                      grid.chunk_shift, grid.chunks, static_cast<uint32_t>(grid.blocks),
                      static_cast<uint32_t>(row_bytes / unit), unit};
  const auto occurs_bytes = static_cast<std::size_t>((grid.rows_per_block + 31) / 32 * 4);
  switch (a.grad_dtype) {
    case DType::Float32: zero_and_reduce_typed<float>(a, w, out, zero, grid.blocks, occurs_bytes, stream); break;
    case DType::Float64: zero_and_reduce_typed<double>(a, w, out, zero, grid.blocks, occurs_bytes, stream); break;
    case DType::Float16: zero_and_reduce_typed<f16_t>(a, w, out, zero, grid.blocks, occurs_bytes, stream); break;
    case DType::BFloat16: zero_and_reduce_typed<bf16_t>(a, w, out, zero, grid.blocks, occurs_bytes, stream); break;
    default: throw std::invalid_argument("embedding_backward: unsupported grad dtype");
  }
}

}  // namespace graphsafe
