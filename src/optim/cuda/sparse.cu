// The row-sparse step's kernels (graphsafe/optim_sparse.h): element-wise algorithms with fp32 or bf16 states, a
// packet of consecutive elements of a listed row per thread (the dense loop's packets); with 8-bit states, a team
// of threads (a warp for blocks of up to 256 elements) per quantisation block that a listed row touches; and the
// scatter of the rows into a dense gradient for LAMB and LARS. Each applies the rule the dense kernels apply
// (rules.h), with the same coefficients and, for 8-bit states, the same Math and quantiser, so the bits are the
// dense step's. Grids are sized from the capacity; threads past the device-side count exit.
#include <cstdint>

#include "common/cuda_check.h"
#include "common/device_error.cuh"
#include "common/launch.h"
#include "graphsafe/optim.h"
#include "graphsafe/optim_sparse.h"
#include "optim/backend.h"
#include "optim/blockwise.h"
#include "optim/cuda/element_loop.cuh"
#include "optim/cuda/launch_table.cuh"
#include "optim/cuda/launchers.h"
#include "optim/cuda/policy.cuh"
#include "optim/cuda/quantization_maps.cuh"
#include "optim/cuda/quantized_loops.cuh"
#include "optim/cuda/vector_access.cuh"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

constexpr int kThreads = SparsePolicy::kThreads;

// One tensor's pointers as the sparse kernels take them.
struct SparseTarget {
  void* param;
  void* state[kMaxOptimStates];
  uint8_t* codes[kMaxOptimStates];
  float* absmax[kMaxOptimStates];
  const float* step;
  int64_t numel;
};

struct SparseRows {
  const int64_t* rows;
  const void* row_grads;
  const int64_t* count;
  int64_t capacity, row_length;
};

SparseTarget target_of(const OptimTensor& t) {
  SparseTarget x{};
  x.param = t.param;
  for (int j = 0; j < kMaxOptimStates; ++j) {
    x.state[j] = t.state[j];
    x.codes[j] = t.codes[j];
    x.absmax[j] = t.absmax[j];
  }
  x.step = t.step;
  x.numel = t.numel;
  return x;
}

SparseRows rows_of(const OptimSparseGradient& g) { return {g.rows, g.row_grads, g.count, g.capacity, g.row_length}; }

// The entries of the list the step uses: [0, count) clamped to the capacity. The kernels step only the list's
// valid prefix, up to the first entry that is not a row of the tensor above the entry before it: a later entry
// cannot be trusted either (a repeat of an earlier row further on would be stepped twice, and the 8-bit kernel's
// block ownership and gradient lookup assume an increasing list), and the prefix is what find_valid_rows_kernel
// leaves in *valid_rows.
__device__ int64_t entries(const SparseRows& r) {
  const int64_t count = *r.count;
  return count < 0 ? 0 : (count > r.capacity ? r.capacity : count);
}

__device__ int64_t rows_in_use(const SparseRows& r, const unsigned long long* valid_rows) {
  const int64_t count = entries(r);
  const unsigned long long valid = *valid_rows;
  return valid < static_cast<unsigned long long>(count) ? static_cast<int64_t>(valid) : count;
}

// The valid prefix's length: the smallest index of an invalid entry (atomicMin: the same in any order), left at
// all ones when every entry is valid. Invalid entries, and a count above the capacity, are reported.
__global__ void __launch_bounds__(kThreads)
    find_valid_rows_kernel(SparseRows r, int64_t num_rows, unsigned long long* valid_rows, DeviceErrorRecord* error) {
  const int64_t count = *r.count;
  if (count > r.capacity && blockIdx.x == 0 && threadIdx.x == 0 && error != nullptr)
    report_index_out_of_range(error, count, r.capacity + 1);
  const int64_t n = entries(r);
  for (int64_t k = int64_t(blockIdx.x) * kThreads + threadIdx.x; k < n; k += int64_t(gridDim.x) * kThreads) {
    const int64_t row = r.rows[k];
    if (row >= 0 && row < num_rows && (k == 0 || r.rows[k - 1] < row)) continue;
    atomicMin(valid_rows, static_cast<unsigned long long>(k));
    if (error != nullptr) report_index_out_of_range(error, row, num_rows);
  }
}

// The coefficients of the tensor's step (its step was counted by the launch ahead), formed once per block.
__device__ void share_sparse_coefficients(const OptimOptions& o, float rate, const SparseTarget& t,
                                          const double* schedule_weight, Coefficients& shared) {
  if (threadIdx.x == 0) shared = coefficients(o, rate, *t.step, schedule_weight != nullptr ? *schedule_weight : 0.0);
  __syncthreads();
}

// load_packet / update_packet's view of one packet: element e of the table and its states, and its gradient at
// entry i of row_grads (the packet's slot of the list).
struct PacketView {
  struct {
    void* param;
    const void* grad;
    void* state[kMaxOptimStates];
  } tensor[1];
};

// fp32 (Bits 32) or bf16 (Bits 16) states: elementwise_step as the dense kernel (elementwise.cu) runs it, on the
// elements of the listed rows. Wide (the rows' length a multiple of kVector and every pointer aligned for
// packets): one packet of kVector consecutive elements of a row per thread, through the dense loop's
// load_packet / update_packet; otherwise one element per thread.
template <class T, int States, int Bits, bool Scheduled>
__global__ void __launch_bounds__(kThreads)
    sparse_elementwise_kernel(OptimOptions o, LearningRate lr, SparseTarget t, SparseRows r,
                              const unsigned long long* valid_rows, const double* schedule_weight, bool wide) {
  using S = StateType<Bits>;
  constexpr int kVec = ChunkPolicy::kVector;
  const float rate = *lr.value;
  if (!learning_rate_usable(lr, rate)) return;
  __shared__ Coefficients k;
  share_sparse_coefficients(o, rate, t, schedule_weight, k);
  const auto body = [&](float g, float& p, float* s) {
    if (skipped(o, g)) return false;
    elementwise_step<Scheduled>(o, k, g, p, s);
    return true;
  };
  const int64_t d = r.row_length, used = rows_in_use(r, valid_rows);
  T* param = static_cast<T*>(t.param);
  const T* row_grads = static_cast<const T*>(r.row_grads);
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x, stride = int64_t(gridDim.x) * kThreads;
  if (wide) {
    const int64_t per_row = d / kVec;
    for (int64_t q = first; q < used * per_row; q += stride) {
      const int64_t slot = q / per_row, column = (q - slot * per_row) * kVec, e = r.rows[slot] * d + column;
      PacketView view{};
      view.tensor[0].param = param + e;
      view.tensor[0].grad = row_grads + slot * d + column;
#pragma unroll
      for (int j = 0; j < States; ++j) view.tensor[0].state[j] = static_cast<S*>(t.state[j]) + e;
      Packet<T, S, States> x;
      load_packet(view, 0, 0, x);
      update_packet(view, 0, 0, x, body);
    }
    return;
  }
  for (int64_t i = first; i < used * d; i += stride) {
    const int64_t slot = i / d;
    const int64_t e = r.rows[slot] * d + (i - slot * d);
    float s[4] = {};  // all four set: a rule never reads an undefined register (see optim.md)
#pragma unroll
    for (int j = 0; j < States; ++j) s[j] = ElementTraits<S>::load(static_cast<S*>(t.state[j])[e]);
    float p = ElementTraits<T>::load(param[e]);
    if (!body(ElementTraits<T>::load(row_grads[i]), p, s)) continue;
    param[e] = ElementTraits<T>::store(p);
#pragma unroll
    for (int j = 0; j < States; ++j) static_cast<S*>(t.state[j])[e] = ElementTraits<S>::store(s[j]);
  }
}

// 8-bit states: a team of threads per quantisation block that a listed row touches. Blocks of up to 256 elements:
// a team is one warp (a thread block holds kThreads / 32 teams), each lane owning block_size / 32 elements;
// larger blocks: a team is the whole thread block of block_size / kPerLane threads. Team thread t owns elements
// t, t + team_threads, ... of the block, so that each load and store instruction of a warp is contiguous.
// The block's "any element updated" and absmax are unsigned maxima (exact in any order): one REDUX per warp, then,
// for teams of several warps, through shared memory.
struct QuantizedTeam {
  static constexpr int kPerLane = 8;                   // elements per thread at most (registers)
  static constexpr int kWarpBlock = 32 * kPerLane;     // the largest block one warp takes
  int warps, threads, per_thread;

  __host__ __device__ explicit QuantizedTeam(int block_size)
      : warps(block_size > kWarpBlock ? block_size / kWarpBlock : 1), threads(32 * warps),
        per_thread(block_size / threads) {}
  __host__ __device__ int block_threads() const { return warps == 1 ? kThreads : threads; }
};

__device__ uint32_t team_max(uint32_t v, const QuantizedTeam& team, uint32_t* scratch) {
  v = __reduce_max_sync(0xffffffffu, v);
  if (team.warps == 1) return v;  // (the team is the thread block below: the barriers are uniform)
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  for (int w = 0; w < team.warps; ++w) v = scratch[w] > v ? scratch[w] : v;
  __syncthreads();  // read by all before the next call overwrites it
  return v;
}

// Division of non-negative numbers in 32 bits where both fit (nearly always): a 64-bit division is a long
// instruction sequence, and the 8-bit kernel is instruction-bound.
__device__ int64_t divide(int64_t a, int64_t b) {
  if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

// The list entries around an item's slot: the previous entry's row (-1 for the first), the slot's, the next one's
// (INT64_MAX past the list's end). The kernel loads them for its next item while it works on the current one, so
// an item starts without waiting for them.
struct ItemRows {
  int64_t slot = 0, previous = -1, row = -1, next = INT64_MAX;
};

__device__ ItemRows load_item_rows(const SparseRows& r, int64_t count, int64_t slot) {
  ItemRows x;
  x.slot = slot;
  x.previous = slot > 0 ? r.rows[slot - 1] : -1;
  x.row = r.rows[slot];
  if (slot + 1 < count) x.next = r.rows[slot + 1];
  return x;
}

// A work item of the 8-bit kernel: quantisation block b (elements start, ...), its first element's row and
// column, and the list entries around rows.slot, the entry of the first listed row that touches it (its owner).
struct QuantizedItem {
  ItemRows rows;
  int64_t b, start, first_row;
  uint32_t first_column;  // < row_length
};

// The list entries of a block's rows, walked forward from the item's slot: rows increase along the list, and
// each thread asks for its elements' rows in increasing order, so `listed` (rows[j], or INT64_MAX past the end
// of the list) is read once per entry passed, not once per element. The entry after j is read ahead (`next`), so
// that a block of two rows (the recommender's rows of 128 in blocks of 256) finds its second row's entry without
// waiting for a load between the block's own loads and that row's gradient.
struct EntryCursor {
  const int64_t* rows;
  int64_t count, j, listed, next;

  __device__ EntryCursor(const SparseRows& r, int64_t count, const ItemRows& x)
      : rows(r.rows), count(count), j(x.slot), listed(x.row), next(x.next) {}
  // Whether element_row is listed (at entry j then).
  __device__ bool find(int64_t element_row) {
    while (listed < element_row) {
      ++j;
      listed = next;
      next = j + 1 < count ? rows[j + 1] : INT64_MAX;
    }
    return listed == element_row;
  }
};

// The block's new absmax key for one state (absmax_step over the thread's present elements, then team_max).
template <int V>
__device__ float team_absmax_key(const float (&s)[V][4], const bool (&present)[V], int state, const QuantizedTeam& team,
                                 uint32_t* scratch) {
  float key = 0.0f;
#pragma unroll
  for (int m = 0; m < V; ++m)
    if (present[m]) key = absmax_step(key, s[m][state]);
  return bits_float(team_max(float_bits(key), team, scratch));
}

// One item whose block lies whole in the tensor, for blocks of whole warps (block_size a multiple of 256), rows a
// multiple of kPiece long and every pointer aligned for pieces: the dense whole-chunk loop's layout
// (quantized_loops.cuh), lane l of each warp taking the 16-byte pieces l, l + 32, ... of the warp's 256 elements.
// A piece lies in one row, so its gradient is one load from the row's list entry, or 0 when the row is not
// listed. Everything is loaded before anything is stored.
template <class T, int States, OptimAlgorithm A, class Math>
__device__ void step_whole_block(const OptimOptions& o, const Coefficients& k, const SparseTarget& t,
                                 const SparseRows& r, int64_t count, const QuantizedItem& item,
                                 const QuantizedTeam& team, int member, uint32_t* scratch) {
  constexpr int V = QuantizedTeam::kPerLane, kPiece = 16 / int(sizeof(T)), kPieces = V / kPiece;
  constexpr int kPieceStride = 32 * kPiece;
  const int first = (member / 32) * QuantizedTeam::kWarpBlock + (member % 32) * kPiece;  // piece i: + i * kPieceStride
  const int64_t d = r.row_length;
  const uint32_t d32 = static_cast<uint32_t>(d);
  T* param = static_cast<T*>(t.param) + item.start + first;
  const T* row_grads = static_cast<const T*>(r.row_grads);
  float g[V], p[V], s[V][4] = {};
  Pack<T, kPiece> p_raw[kPieces];  // skipped elements are stored back with their own bits
  EntryCursor entry(r, count, item.rows);
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    p_raw[i] = load_streaming(reinterpret_cast<const Pack<T, kPiece>*>(param + i * kPieceStride));
    const uint32_t x = item.first_column + first + i * kPieceStride, rows_on = x / d32;  // x < d + block_size
    Pack<T, kPiece> g_raw{};
    if (entry.find(item.first_row + rows_on))
      g_raw = load_streaming(reinterpret_cast<const Pack<T, kPiece>*>(row_grads + entry.j * d + (x - rows_on * d32)));
#pragma unroll
    for (int e = 0; e < kPiece; ++e) {
      g[i * kPiece + e] = ElementTraits<T>::load(g_raw.v[e]);
      p[i * kPiece + e] = ElementTraits<T>::load(p_raw[i].v[e]);
    }
  }
#pragma unroll
  for (int q = 0; q < States; ++q) {
    const float* map = kSharedMapsImage.value(state_is_signed(o, q));
    const uint8_t* codes = t.codes[q] + item.start + first;
    const float absmax = t.absmax[q][item.b];
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const Pack<uint8_t, kPiece> c = load_streaming(reinterpret_cast<const Pack<uint8_t, kPiece>*>(codes + i * kPieceStride));
#pragma unroll
      for (int e = 0; e < kPiece; ++e) s[i * kPiece + e][q] = dequantize_value(map, c.v[e], absmax);
    }
  }
  bool updated[kPieces] = {};  // per piece: a piece of an unlisted row (the other half of a shared block) is not
                               // stored back
#pragma unroll
  for (int e = 0; e < V; ++e) {
    if (skipped(o, g[e])) continue;
    float st[4] = {s[e][0], s[e][1], s[e][2], s[e][3]};  // through a copy, as the dense loop (quantized_loops.cuh)
    elementwise_rule<A, Math>(o, k, g[e], p[e], st);
    p_raw[e / kPiece].v[e % kPiece] = ElementTraits<T>::store(p[e]);
#pragma unroll
    for (int q = 0; q < States; ++q) s[e][q] = st[q];
    updated[e / kPiece] = true;
  }
  bool any = false;
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    if (!updated[i]) continue;
    store_streaming(reinterpret_cast<Pack<T, kPiece>*>(param + i * kPieceStride), p_raw[i]);
    any = true;
  }
  if (team_max(any ? 1u : 0u, team, scratch) == 0) return;  // an all-skipped block keeps codes and absmax
  constexpr bool kAll[V] = {true, true, true, true, true, true, true, true};
#pragma unroll
  for (int q = 0; q < States; ++q) {
    const Requantizer requantize(o, &kSharedMapsImage, q, team_absmax_key(s, kAll, q, team, scratch));
    uint8_t* codes = t.codes[q] + item.start + first;
#pragma unroll
    for (int i = 0; i < kPieces; ++i)
      store_streaming(reinterpret_cast<Pack<uint8_t, kPiece>*>(codes + i * kPieceStride),
                      requantize.codes<kPiece>(s, i * kPiece));
    if (member == 0) t.absmax[q][item.b] = requantize.absmax;
  }
}

// Any other item (the tensor's partial last block, small blocks, rows not a multiple of kPiece, unaligned
// pointers): team thread m owns elements m, m + team.threads, ... of the block, one at a time.
template <class T, int States, OptimAlgorithm A, class Math>
__device__ void step_block_elementwise(const OptimOptions& o, const Coefficients& k, const SparseTarget& t,
                                       const SparseRows& r, int64_t count, const QuantizedItem& item,
                                       const QuantizedTeam& team, int member, uint32_t* scratch) {
  constexpr int V = QuantizedTeam::kPerLane;
  const int64_t d = r.row_length;
  const uint32_t d32 = static_cast<uint32_t>(d);
  T* param = static_cast<T*>(t.param);
  const T* row_grads = static_cast<const T*>(r.row_grads);
  float g[V], p[V], s[V][4];
  bool present[V], updated[V];
  EntryCursor entry(r, count, item.rows);
#pragma unroll
  for (int m = 0; m < V; ++m) {
    g[m] = p[m] = s[m][0] = s[m][1] = s[m][2] = s[m][3] = 0.0f;
    updated[m] = false;
    const uint32_t offset = member + m * team.threads;
    present[m] = m < team.per_thread && item.start + offset < t.numel;
    if (!present[m]) continue;
    const uint32_t x = item.first_column + offset, rows_on = x / d32;  // x < d + block_size
    const int64_t e = item.start + offset;
    if (entry.find(item.first_row + rows_on)) g[m] = ElementTraits<T>::load(row_grads[entry.j * d + (x - rows_on * d32)]);
    p[m] = ElementTraits<T>::load(param[e]);
#pragma unroll
    for (int q = 0; q < States; ++q)
      s[m][q] = dequantize_value(kSharedMapsImage.value(state_is_signed(o, q)), t.codes[q][e], t.absmax[q][item.b]);
  }
  bool any = false;
#pragma unroll
  for (int m = 0; m < V; ++m) {
    if (!present[m] || skipped(o, g[m])) continue;
    elementwise_rule<A, Math>(o, k, g[m], p[m], s[m]);
    updated[m] = any = true;
  }
#pragma unroll
  for (int m = 0; m < V; ++m)
    if (updated[m]) param[item.start + member + m * team.threads] = ElementTraits<T>::store(p[m]);
  if (team_max(any ? 1u : 0u, team, scratch) == 0) return;  // an all-skipped block keeps codes and absmax
#pragma unroll
  for (int q = 0; q < States; ++q) {
    const bool is_signed = state_is_signed(o, q);
    const float absmax = absmax_finish(team_absmax_key(s, present, q, team, scratch));
    const BlockScale scale = block_scale(absmax);
#pragma unroll
    for (int m = 0; m < V; ++m)
      if (present[m])
        t.codes[q][item.start + member + m * team.threads] =
            quantize_value(kSharedMapsImage.words(is_signed), is_signed, normalized_or_nan(s[m][q], scale));
    if (member == 0) t.absmax[q][item.b] = absmax;
  }
}

// Work item (k, i): block i of those row k's elements touch; a block that the previous listed row touches too is
// that row's. Elements of rows not listed (in a block shared with a listed row) have gradient 0: skipped, as the
// dense step skips them. The block's states are dequantised, the rule applied (elementwise_rule<A, Math>, the
// dense kernel's, with the options the algorithm implies folded in: with_known_options), and, if any element was
// updated, the states requantised with quantize_block's absmax and codes. `whole`: blocks of whole warps, rows
// and pointers fit for pieces (launch_sparse_quantized_step); then every block inside the tensor takes
// step_whole_block. Rows are at most INT32_MAX long (the launch checks): columns are 32-bit.
// Registers capped as the dense 8-bit kernels' (QuantizedLoopPolicy): the kernel waits on memory at each item, and
// more resident warps hide more of it.
template <class T, int States, OptimAlgorithm A, class Math>
__global__ void __launch_bounds__(kThreads, QuantizedLoopPolicy::kMinBlocksPerSM)
    sparse_quantized_kernel(OptimOptions options, LearningRate lr, SparseTarget t, SparseRows r,
                            const unsigned long long* valid_rows, int block_size, int64_t blocks_per_row, bool whole) {
  const float rate = *lr.value;
  if (!learning_rate_usable(lr, rate)) return;
  const OptimOptions o = with_known_options<A, States>(options);
  __shared__ Coefficients shared_k;
  __shared__ uint32_t scratch[kThreads / 32];
  share_sparse_coefficients(o, rate, t, nullptr, shared_k);
  const Coefficients k = shared_k;  // in registers: not re-read from shared memory after every store
  const QuantizedTeam team(block_size);
  const int teams_per_block = blockDim.x / team.threads, member = threadIdx.x % team.threads;
  const int block_shift = __ffs(block_size) - 1;  // a power of two
  const int64_t d = r.row_length, count = rows_in_use(r, valid_rows);
  const int64_t items = count * blocks_per_row, stride = int64_t(gridDim.x) * teams_per_block;
  int64_t item = int64_t(blockIdx.x) * teams_per_block + threadIdx.x / team.threads;
  ItemRows rows = item < items ? load_item_rows(r, count, divide(item, blocks_per_row)) : ItemRows{};
  for (; item < items; item += stride) {
    const ItemRows current = rows;
    if (item + stride < items) rows = load_item_rows(r, count, divide(item + stride, blocks_per_row));  // ahead
    const int64_t row_start = current.row * d;
    const int64_t b = (row_start >> block_shift) + (item - current.slot * blocks_per_row);
    if (b > (row_start + d - 1) >> block_shift) continue;  // past the row
    if (current.previous >= 0 && (current.previous * d + d - 1) >> block_shift >= b) continue;  // the previous entry's
    const int64_t start = b << block_shift, first_row = divide(start, d);
    const QuantizedItem it{current, b, start, first_row, static_cast<uint32_t>(start - first_row * d)};
    if (whole && start + block_size <= t.numel) step_whole_block<T, States, A, Math>(o, k, t, r, count, it, team, member, scratch);
    else step_block_elementwise<T, States, A, Math>(o, k, t, r, count, it, team, member, scratch);
  }
}

// LAMB and LARS: the listed rows into a zeroed dense gradient (the step after it is the dense one).
template <class T>
__global__ void __launch_bounds__(kThreads)
    scatter_rows_kernel(SparseRows r, const unsigned long long* valid_rows, T* dense) {
  const int64_t d = r.row_length, total = rows_in_use(r, valid_rows) * d;
  const T* row_grads = static_cast<const T*>(r.row_grads);
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    const int64_t slot = i / d;
    dense[r.rows[slot] * d + (i - slot * d)] = row_grads[i];
  }
}

// Blocks for `items` work items, capped (blocks loop over the rest).
int64_t grid_of(int64_t items) { return items < 1 ? 1 : (items < SparsePolicy::kMaxBlocks ? items : SparsePolicy::kMaxBlocks); }

}  // namespace

void optim_detail::launch_sparse_valid_rows(const OptimStepArgs& a, const OptimTensor& tensor,
                                            const OptimSparseGradient& g, unsigned long long* valid_rows,
                                            cudaStream_t stream) {
  const auto kernel = &find_valid_rows_kernel;
  GS_LAUNCH(kernel, grid_of((g.capacity + kThreads - 1) / kThreads), kThreads, stream, rows_of(g),
            tensor.numel / g.row_length, valid_rows, a.error);
  GS_CUDA_CHECK_LAUNCH();
}

void optim_detail::launch_sparse_elementwise_step(const OptimStepArgs& a, const OptimTensor& tensor,
                                                  const OptimSparseGradient& g, const unsigned long long* valid_rows,
                                                  const double* schedule_weight, cudaStream_t stream) {
  constexpr int kVec = ChunkPolicy::kVector;
  const SparseTarget t = target_of(tensor);
  const SparseRows r = rows_of(g);
  const LearningRate lr = learning_rate(a);
  const int param_bytes = static_cast<int>(dtype_size(a.param_dtype)), state_bytes = a.state_bits / 8;
  bool wide = g.row_length % kVec == 0 && aligned(t.param, param_bytes * kVec) &&
              aligned(g.row_grads, param_bytes * kVec);
  for (int j = 0; j < kMaxOptimStates; ++j)
    wide = wide && (t.state[j] == nullptr || aligned(t.state[j], state_bytes * kVec));
  const int64_t per_thread = wide ? kVec : 1;
  const int64_t blocks = grid_of((g.capacity * (g.row_length / per_thread) + kThreads - 1) / kThreads);
  with_param_type(a.param_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    with_state_count(a.options, [&](auto states) {
      constexpr int States = decltype(states)::value;
      const auto launch = [&](auto kernel) {
        GS_LAUNCH(kernel, blocks, kThreads, stream, a.options, lr, t, r, valid_rows, schedule_weight, wide);
      };
      const bool scheduled = schedule_weight != nullptr;  // (the dense kernels' split: elementwise.cu)
      if (a.state_bits == 16) {
        if (scheduled) launch(&sparse_elementwise_kernel<T, States, 16, true>);
        else launch(&sparse_elementwise_kernel<T, States, 16, false>);
      } else {
        if (scheduled) launch(&sparse_elementwise_kernel<T, States, 32, true>);
        else launch(&sparse_elementwise_kernel<T, States, 32, false>);
      }
      GS_CUDA_CHECK_LAUNCH();
    });
  });
}

void optim_detail::launch_sparse_quantized_step(const OptimStepArgs& a, const OptimTensor& tensor,
                                                const OptimSparseGradient& g, const unsigned long long* valid_rows,
                                                cudaStream_t stream) {
  const SparseTarget t = target_of(tensor);
  const SparseRows r = rows_of(g);
  const LearningRate lr = learning_rate(a);
  const OptimOptions& o = a.options;
  // A row of d elements touches at most ceil(d / block_size) + 1 blocks; exactly ceil(d / block_size) when one of
  // d and block_size divides the other (no block boundary falls inside a row but at multiples of the block size
  // from its start). Items past a row's last block are work the kernel skips, each at the cost of a load.
  const int64_t d = g.row_length, bs = a.block_size;
  const int64_t blocks_per_row = (d + bs - 1) / bs + (d % bs == 0 || bs % d == 0 ? 0 : 1);
  const QuantizedTeam team(a.block_size);
  const int threads = team.block_threads();
  const int64_t blocks = grid_of((g.capacity * blocks_per_row + threads / team.threads - 1) / (threads / team.threads));
  const int b = a.block_size;
  with_param_type(a.param_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    // step_whole_block's conditions (pieces of 16 bytes of parameters and gradients, of their element count of codes).
    constexpr int kPiece = 16 / int(sizeof(T));
    bool whole = b % QuantizedTeam::kWarpBlock == 0 && g.row_length % kPiece == 0 && aligned(t.param, 16) &&
                 aligned(g.row_grads, 16);
    for (int j = 0; j < kMaxOptimStates; ++j) whole = whole && (t.codes[j] == nullptr || aligned(t.codes[j], kPiece));
    with_state_count(o, [&](auto states) {
      constexpr int States = decltype(states)::value;
      with_elementwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
        constexpr OptimAlgorithm A = decltype(algorithm)::value;
        if constexpr (quantizable(A)) {  // (check_step_args refuses the others' 8-bit steps)
          // The dense 8-bit kernels' choice of Math (quantized_elementwise.cu), so that the bits are theirs.
          const auto kernel = takes_roots(A) && fast_math_applies(o) ? &sparse_quantized_kernel<T, States, A, FastMath>
                                                                     : &sparse_quantized_kernel<T, States, A, ExactMath>;
          // As many blocks as fit on the GPU at once (each loops over items): no last partial wave of blocks.
          GS_LAUNCH(kernel, grid_for(kernel, blocks, threads), threads, stream, o, lr, t, r, valid_rows, b, blocks_per_row,
                    whole);
          GS_CUDA_CHECK_LAUNCH();
        }
      });
    });
  });
}

void optim_detail::launch_sparse_scatter(const OptimStepArgs& a, const OptimTensor&, const OptimSparseGradient& g,
                                         const unsigned long long* valid_rows, void* dense, cudaStream_t stream) {
  const SparseRows r = rows_of(g);
  const int64_t blocks = grid_of((g.capacity * g.row_length + kThreads - 1) / kThreads);
  with_param_type(a.param_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    const auto kernel = &scatter_rows_kernel<T>;
    GS_LAUNCH(kernel, blocks, kThreads, stream, r, valid_rows, static_cast<T*>(dense));
    GS_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace graphsafe
