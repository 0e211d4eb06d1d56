// CUDA backend of the optimizer step: the shared rules (rules.h) in multi-tensor kernels.
//
// Tensors go in launches of up to TensorTable::kCapacity; their pointers travel as a kernel argument (so a
// captured graph keeps them, and no metadata is copied to the device). As many blocks as the GPU holds at once
// take chunks of kChunkElements elements in turn, with 16-byte streaming accesses where alignment
// allows. lr and each tensor's step are read from device memory inside the kernel; with increment_steps
// and a finish counter the element-wise update's last block adds 1 to every step (finish_steps), otherwise
// one small launch ahead of the updates does. A NaN or negative lr makes every kernel write nothing and report
// it (learning_rate_usable). Layer-wise algorithms (LAMB, LARS) run
// three kernels: per-chunk squared norms (a fixed-order block reduction), per-tensor factor (one block
// per tensor combines its chunks in a fixed order), and the update.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/cuda_check.h"
#include "common/device_error.cuh"
#include "common/launch.h"
#include "graphsafe/optim.h"
#include "optim/blockwise.h"
#include "optim/layout.h"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int kIterations = static_cast<int>(kChunkElements / (kThreads * kVec));
static_assert(kIterations * kThreads * kVec == kChunkElements, "a block covers one chunk exactly");
static_assert(kThreads == kNormThreads && kVec == kNormVector, "the norm order of layout.h is this kernel's");
// The bytes of a launch's tensor table (the driver copies it, with the other arguments, into every launch). With
// OptimOptions (120 bytes) and the scalars the kernels' arguments come to about 4.1 KB, over the classic 4 KB
// limit: that needs CUDA 12.1 or later and a Volta or newer GPU (this project builds for Hopper with CUDA 13).
// The emulated kernels (tests/cpp/emulation) are built with a smaller table, so that their problems of 6 to 40
// tensors go out in several launches, as a real step's hundreds of tensors do.
#ifndef GRAPHSAFE_OPTIM_ARGUMENT_BYTES
#define GRAPHSAFE_OPTIM_ARGUMENT_BYTES 4000
#endif
constexpr int kArgumentBytes = GRAPHSAFE_OPTIM_ARGUMENT_BYTES;

// One launch's tensors: per tensor the pointers its kernels read, with slots for the States states only (and
// their 8-bit scales only with Bits 8), so that a launch takes as many tensors as fit in kArgumentBytes: 66 for
// SGD with momentum or RMSprop, 58 for Adam(W), 47 for 8-bit Adam(W), where one table for all took 32. A step of
// many small tensors is bound by the host, and every launch costs it a few microseconds.
template <int States, int Bits>
struct TensorTable {
  static constexpr int kStateSlots = States > 0 ? States : 1;
  static constexpr int kScaleSlots = Bits == 8 ? kStateSlots : 0;
  static constexpr int kHeaderBytes = 16, kBytesPerTensor = 8 * (6 + kStateSlots + kScaleSlots) + 4;
  // Besides the tensors: the header, first_block's last entry, the unused scale slot without 8-bit states, and
  // up to 4 bytes of padding after factor_index.
  static constexpr int kCapacity = (kArgumentBytes - kHeaderBytes - 8 - 8 - 4) / kBytesPerTensor;
  int count;
  // With a finish counter (OptimStepArgs::finish_counter) the steps are read as they were before this step
  // and 1 is added on reading (step_increment); the update's last block to finish writes step + 1 for all.
  float step_increment;
  uint32_t* finish_counter;
  void* param[kCapacity];
  const void* grad[kCapacity];
  void* state[kStateSlots][kCapacity];  // fp32 or bf16 states, or with 8-bit states their codes (uint8)
  // 8-bit states: one scale per quantisation block (one unused slot otherwise)
  float* absmax[kScaleSlots > 0 ? kScaleSlots : 1][kScaleSlots > 0 ? kCapacity : 1];
  float* step[kCapacity];
  int64_t numel[kCapacity];
  int64_t first_block[kCapacity + 1];  // blocks of this launch, one per chunk
  int64_t first_chunk[kCapacity];      // chunk index across the whole step (layer-wise partials)
  int factor_index[kCapacity];         // tensor index across the whole step (layer-wise factors)
};
static_assert(kArgumentBytes != 4000 || (TensorTable<1, 32>::kCapacity == 66 && TensorTable<2, 32>::kCapacity == 58 &&
                                          TensorTable<2, 8>::kCapacity == 47),
              "the capacities the comment above names");

// The states' storage type for Bits 32 and 16 (8-bit states are codes, read through their maps).
template <int Bits>
using StateType = std::conditional_t<Bits == 16, bf16_t, float>;

template <class S, class Table>
__device__ S* unquantized_state(const Table& table, int j, int t) { return static_cast<S*>(table.state[j][t]); }

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <class Table>
__device__ int tensor_of_block(const Table& table, int64_t block) {
  int t = 0;
  while (t + 1 < table.count && table.first_block[t + 1] <= block) ++t;
  return t;
}

__device__ bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The block's tensor and chunk, and the step's coefficients for that tensor (computed once per block).
struct BlockWork {
  int tensor;
  int64_t begin, end;
};

template <class Table>
__device__ BlockWork block_work(const Table& table, int64_t block) {
  const int t = tensor_of_block(table, block);
  const int64_t chunk = block - table.first_block[t];
  const int64_t begin = chunk * kChunkElements;
  return {t, begin, min(begin + kChunkElements, table.numel[t])};
}

// Tensor t's step number for this step's coefficients.
template <class Table>
__device__ float step_number(const Table& table, int t) { return *table.step[t] + table.step_increment; }

// The step's learning rate as its kernels get it: where to read it (device memory, at run time: a captured step
// follows what a scheduler writes there) and where to report an unusable one (OptimStepArgs::error).
struct LearningRate {
  const float* value;
  DeviceErrorRecord* error;
};

LearningRate learning_rate(const OptimStepArgs& a) { return {a.lr, a.error}; }

// Whether a kernel of the step may run with `rate`, the value read at lr.value; if not, block 0 reports it and
// every block returns before it writes anything. Every kernel of a step tests it (a layer-wise step's three
// and the step-counting launch ahead too), and all their threads read the same value (nothing writes it during
// the step), so they agree: no block of an element-wise update reaches finish_steps (its counter stays 0), no
// step is counted, no parameter or state is written.
__device__ bool learning_rate_usable(const LearningRate& lr, float rate) {
  if (usable_learning_rate(rate)) return true;
  if (blockIdx.x == 0 && threadIdx.x == 0 && lr.error != nullptr) report_invalid_learning_rate(lr.error, rate);
  return false;
}

// Blocks loop over chunks (the grid is capped at what the GPU holds at once), so the coefficients, which
// take double-precision powers, are formed once per tensor per block: by one thread, into shared memory.
template <class Table>
__device__ void share_coefficients(const OptimOptions& o, const float* lr, const Table& table, int t,
                                   int& current, Coefficients& shared) {
  if (t == current) return;
  __syncthreads();  // everyone is done with the previous tensor's coefficients
  if (threadIdx.x == 0) shared = coefficients(o, *lr, step_number(table, t));
  __syncthreads();
  current = t;
}

// An element-wise update kernel ends with this in every block (no block returns early, unless all do: an
// unusable learning rate; a no-op without a finish counter, see update_counts_steps):
// the block that finishes last, when every other block has read its steps (each block's thread 0 reads them,
// share_coefficients, before this), adds 1 to every step of the table and sets the counter back to 0. The
// fences order the other blocks' reads before the count, and the count before the writes.
template <class Table>
__device__ void finish_steps(const Table& table) {
  if (table.finish_counter == nullptr) return;
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(table.finish_counter, 1u) == gridDim.x - 1;
    __threadfence();
  }
  __syncthreads();
  if (!last) return;
  for (int i = threadIdx.x; i < table.count; i += blockDim.x) *table.step[i] += 1.0f;
  if (threadIdx.x == 0) *table.finish_counter = 0;
}

#define GS_FOR_EACH_CHUNK(table, total_blocks, w) \
  for (int64_t block_ = blockIdx.x; block_ < (total_blocks); block_ += gridDim.x) \
    if (const BlockWork w = block_work(table, block_); true)

// The kVec elements at `base` of one tensor: grad, param and the States states (fp32 or bf16, S) as loaded, in
// registers (raw: an element that is not updated is stored back with its own bits).
template <class T, class S, int States>
struct Packet {
  Pack<T, kVec> g, p;
  Pack<S, kVec> s[States > 0 ? States : 1];  // indexed only by unrolled constants: stays in registers
};

// 16- or 8-byte vector accesses marked evict-first (__ldcs/__stcs): a step touches every byte once, and
// on the H200 the hint took AdamW at 64M parameters from 89% to 91% of copy bandwidth.
template <class V>
__device__ V load_streaming(const V* p) {
  static_assert(sizeof(V) == 16 || sizeof(V) == 8 || sizeof(V) == 4, "vector accesses are 16, 8 or 4 bytes");
  using Raw = std::conditional_t<sizeof(V) == 16, float4, std::conditional_t<sizeof(V) == 8, float2, float>>;
  const Raw raw = __ldcs(reinterpret_cast<const Raw*>(p));
  V v;
  memcpy(&v, &raw, sizeof(V));
  return v;
}

template <class V>
__device__ void store_streaming(V* p, const V& v) {
  static_assert(sizeof(V) == 16 || sizeof(V) == 8 || sizeof(V) == 4, "vector accesses are 16, 8 or 4 bytes");
  using Raw = std::conditional_t<sizeof(V) == 16, float4, std::conditional_t<sizeof(V) == 8, float2, float>>;
  Raw raw;
  memcpy(&raw, &v, sizeof(V));
  __stcs(reinterpret_cast<Raw*>(p), raw);
}

template <class T, class S, int States, class Table>
__device__ void load_packet(const Table& table, int tensor, int64_t base, Packet<T, S, States>& x) {
  x.g = load_streaming(reinterpret_cast<const Pack<T, kVec>*>(static_cast<const T*>(table.grad[tensor]) + base));
  x.p = load_streaming(reinterpret_cast<const Pack<T, kVec>*>(static_cast<const T*>(table.param[tensor]) + base));
#pragma unroll
  for (int j = 0; j < States; ++j)
    x.s[j] = load_streaming(reinterpret_cast<const Pack<S, kVec>*>(unquantized_state<S>(table, j, tensor) + base));
}

// Runs body on the packet's elements and writes back what changed (skipped elements are not written).
template <class T, class S, int States, class Body, class Table>
__device__ void update_packet(const Table& table, int tensor, int64_t base, Packet<T, S, States>& x, Body& body) {
  bool changed = false;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    float s[4] = {};  // all four set: a rule never reads an undefined register (see optim.md)
#pragma unroll
    for (int j = 0; j < States; ++j) s[j] = ElementTraits<S>::load(x.s[j].v[e]);
    float p = ElementTraits<T>::load(x.p.v[e]);
    if (body(ElementTraits<T>::load(x.g.v[e]), p, s)) {
      changed = true;
      x.p.v[e] = ElementTraits<T>::store(p);
#pragma unroll
      for (int j = 0; j < States; ++j) x.s[j].v[e] = ElementTraits<S>::store(s[j]);
    }
  }
  if (!changed) return;
  store_streaming(reinterpret_cast<Pack<T, kVec>*>(static_cast<T*>(table.param[tensor]) + base), x.p);
#pragma unroll
  for (int j = 0; j < States; ++j)
    store_streaming(reinterpret_cast<Pack<S, kVec>*>(unquantized_state<S>(table, j, tensor) + base), x.s[j]);
}

// Calls body(g, p, s) for each element a thread owns; body returns whether it changed p and s. Aligned
// tensors go kVec elements at a time, their last partial packet and unaligned tensors one at a time. S: the
// states' storage type (fp32, or bf16 for 16-bit states).
template <class T, class S, int States, class Body, class Table>
__device__ void for_each_element(const Table& table, const BlockWork& w, Body body) {
  T* param = static_cast<T*>(table.param[w.tensor]);
  const T* grad = static_cast<const T*>(table.grad[w.tensor]);
  bool wide = aligned(param, sizeof(T) * kVec) && aligned(grad, sizeof(T) * kVec);
#pragma unroll
  for (int j = 0; j < States; ++j) wide = wide && aligned(unquantized_state<S>(table, j, w.tensor), sizeof(S) * kVec);
  for (int it = 0; it < kIterations; ++it) {
    const int64_t base = w.begin + (int64_t(it) * kThreads + threadIdx.x) * kVec;
    if (base >= w.end) break;
    if (wide && base + kVec <= w.end) {
      Packet<T, S, States> x;
      load_packet(table, w.tensor, base, x);
      update_packet(table, w.tensor, base, x, body);
    } else {
      for (int64_t i = base; i < min(base + kVec, w.end); ++i) {
        float s[4] = {};  // all four set: a rule never reads an undefined register (see optim.md)
#pragma unroll
        for (int j = 0; j < States; ++j) s[j] = ElementTraits<S>::load(unquantized_state<S>(table, j, w.tensor)[i]);
        float p = ElementTraits<T>::load(param[i]);
        if (body(ElementTraits<T>::load(grad[i]), p, s)) {
          param[i] = ElementTraits<T>::store(p);
#pragma unroll
          for (int j = 0; j < States; ++j) unquantized_state<S>(table, j, w.tensor)[i] = ElementTraits<S>::store(s[j]);
        }
      }
    }
  }
}

// ---- 8-bit states ----

// The two maps with their code words (blockwise.h), as each block of the step keeps them in shared memory
// (code_sum and dequantize_value read them at data-dependent positions): without the unsigned map's unused half
// (which would take the block past 48 KB of static shared memory).
struct alignas(16) SharedMaps {
  float unsigned_value[256];
  uint32_t unsigned_words[kBuckets];
  float signed_value[256];
  uint32_t signed_words[2 * kBuckets];
  __device__ const float* value(bool is_signed) const { return is_signed ? signed_value : unsigned_value; }
  __device__ const uint32_t* words(bool is_signed) const { return is_signed ? signed_words : unsigned_words; }
};
static_assert(sizeof(SharedMaps) % 16 == 0, "the maps are copied in 16-byte pieces");

constexpr SharedMaps make_shared_maps(const QuantizationMap& unsigned_map, const QuantizationMap& signed_map) {
  SharedMaps m{};
  for (int i = 0; i < 256; ++i) {
    m.unsigned_value[i] = unsigned_map.value[i];
    m.signed_value[i] = signed_map.value[i];
  }
  for (int i = 0; i < kBuckets; ++i) m.unsigned_words[i] = unsigned_map.code_word[i];
  for (int i = 0; i < 2 * kBuckets; ++i) m.signed_words[i] = signed_map.code_word[i];
  return m;
}

// The maps on the device, laid out as a block keeps them: each block of the step copies them into its shared
// memory in one flat copy, and the standalone kernels read them here. Global, not constant, memory: a warp's
// reads at 32 different addresses are one access there, 32 in turn in the constant cache. On the H200, 8-bit
// AdamW at 64M took 0.313 ms (fp32 parameters) and 0.232 ms (bf16) copying them from here in 16-byte pieces,
// against 0.333 and 0.253 ms copying them word by word from constant memory (same lease).
__device__ SharedMaps kSharedMapsImage = make_shared_maps(kUnsignedMap, kSignedMap);

// Called by every thread of the block (Threads of them). Each thread loads all its pieces before storing any,
// so the copy waits for the memory once, not once per piece.
template <int Threads>
__device__ const SharedMaps* load_maps_to_shared() {
  __shared__ SharedMaps maps;
  using Piece = Pack<uint32_t, 4>;
  constexpr int kPieces = int(sizeof(SharedMaps) / sizeof(Piece)), kPerThread = (kPieces + Threads - 1) / Threads;
  const Piece* from = reinterpret_cast<const Piece*>(&kSharedMapsImage);
  Piece* to = reinterpret_cast<Piece*>(&maps);
  Piece piece[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (threadIdx.x + k * Threads < kPieces) piece[k] = from[threadIdx.x + k * Threads];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (threadIdx.x + k * Threads < kPieces) to[threadIdx.x + k * Threads] = piece[k];
  __syncthreads();
  return &maps;
}

// The most warps an 8-bit kernel's block has (QuantizedElementwiseThreads): the size of the exchange arrays below.
constexpr int kMaxWarps = 512 / 32;

// Per value k, the absmax_combine over the `group` consecutive threads (a power of two from 4 to 128) that
// share a quantisation block; all N values in one exchange, so a group wider than a warp meets at two
// barriers per pass whatever N is (within a warp: one REDUX per value, or shuffles below 32). Every thread of the
// block calls it; all get their group's results. Values are absmax keys from absmax_step (or 0 or 1).
template <int N>
__device__ void group_max(float (&v)[N], int group, float (&exchange)[N][kMaxWarps]) {
  if (group >= 32) {  // a whole warp: absmax_combine is an unsigned max of the bits, one REDUX per value
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = bits_float(__reduce_max_sync(0xffffffffu, float_bits(v[k])));
  } else {
    for (int offset = group / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = absmax_combine(v[k], __shfl_xor_sync(0xffffffffu, v[k], offset));
    }
  }
  if (group <= 32) return;
  const int warp = threadIdx.x / 32, warps = group / 32, first = warp & ~(warps - 1);  // warps: a power of two
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) exchange[k][warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    v[k] = exchange[k][first];
    for (int w = first + 1; w < first + warps; ++w) v[k] = absmax_combine(v[k], exchange[k][w]);
  }
  __syncthreads();  // exchange[] is reused by the next pass
}

// After an 8-bit pass, what the `group` threads sharing a quantisation block agree on (all threads call it):
// reduced[0] is 1 if any of them updated an element, reduced[1 + j] state j's new absmax over the block's
// valid elements (an absmax key for absmax_finish: non-finite values take no part).
template <int N, int V>  // N: the states + 1
__device__ void agree_on_block(bool any, const float (&s)[V][4], const bool (&valid)[V], int group,
                               float (&exchange)[N][kMaxWarps], float (&reduced)[N]) {
  reduced[0] = any ? 1.0f : 0.0f;
#pragma unroll
  for (int j = 0; j + 1 < N; ++j) {
    reduced[1 + j] = 0.0f;
#pragma unroll
    for (int e = 0; e < V; ++e) if (valid[e]) reduced[1 + j] = absmax_step(reduced[1 + j], s[e][j]);
  }
  group_max(reduced, group, exchange);
}

// The codes in byte 2 of four code sums (blockwise.h, code_sum; their byte 3 is 0), packed into one word, the first
// in its lowest byte: three byte permutes on the GPU, instead of a shift and a byte move per code.
__device__ uint32_t codes_of_sums(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(__byte_perm(a, b, 0x0062), __byte_perm(c, d, 0x0062), 0x5410);
#else
  return (a >> 16) | ((b >> 8) & 0xff00u) | (c & 0xff0000u) | (d << 8 & 0xff000000u);
#endif
}

// Requantising state j of one quantisation block after a pass, shared by both 8-bit loops: from the absmax key
// agree_on_block gathered (finite values only), the block's new absmax and scale; codes<N>(s, first) are state
// j's codes of elements first .. first + N - 1 of the thread's s[][], as quantize_block gives them (a
// non-finite value becomes NaN in normalized_or_nan_fused and gets the code of 0 from code_sum: no branch).
struct Requantizer {
  int j;
  bool is_signed;
  const uint32_t* words;
  float absmax;
  BlockScale scale;

  __device__ Requantizer(const OptimOptions& o, const SharedMaps* maps, int state, float absmax_key)
      : j(state), is_signed(state_is_signed(o, state)), words(maps->words(is_signed)),
        absmax(absmax_finish(absmax_key)), scale(block_scale(absmax)) {}

  template <int N, int V>
  __device__ Pack<uint8_t, N> codes(const float (&s)[V][4], int first) const {
    static_assert(N % 4 == 0, "codes are packed four at a time");
    float x[N];
    // One fused multiply-add per value where the block's absmax is a normal float (all but vanishingly rare
    // blocks): normalized's prescale is 1 there, and value * 1 is value exactly, so the codes are the same.
    if (scale.prescale == 1.0f) {
#pragma unroll
      for (int i = 0; i < N; ++i) x[i] = fma_f(s[first + i][j], scale.inverse, s[first + i][j] - s[first + i][j]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) x[i] = normalized_or_nan_fused(s[first + i][j], scale);
    }
    // Four codes per word: setting the codes byte by byte made the compiler take every packed word apart again.
    uint32_t packed[N / 4];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      uint32_t sum[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        sum[k] = is_signed ? code_sum<true>(words, x[4 * i + k]) : code_sum<false>(words, x[4 * i + k]);
      packed[i] = codes_of_sums(sum[0], sum[1], sum[2], sum[3]);
    }
    Pack<uint8_t, N> c;
    memcpy(&c, packed, N);
    return c;
  }
};

// N elements of type T at p (aligned to min(16, N * sizeof(T)) bytes), loaded or stored in 16-byte (or
// smaller) streaming pieces.
template <class T, int N>
__device__ Pack<T, N> load_pack(const T* p) {
  constexpr int kPiece = 16 / sizeof(T) < N ? 16 / sizeof(T) : N;
  Pack<T, N> v;
#pragma unroll
  for (int i = 0; i < N; i += kPiece) {
    const Pack<T, kPiece> piece = load_streaming(reinterpret_cast<const Pack<T, kPiece>*>(p + i));
#pragma unroll
    for (int k = 0; k < kPiece; ++k) v.v[i + k] = piece.v[k];
  }
  return v;
}

template <class T, int N>
__device__ void store_pack(T* p, const Pack<T, N>& v) {
  constexpr int kPiece = 16 / sizeof(T) < N ? 16 / sizeof(T) : N;
#pragma unroll
  for (int i = 0; i < N; i += kPiece) {
    Pack<T, kPiece> piece;
#pragma unroll
    for (int k = 0; k < kPiece; ++k) piece.v[k] = v.v[i + k];
    store_streaming(reinterpret_cast<Pack<T, kPiece>*>(p + i), piece);
  }
}

template <class T, int N>
__device__ bool pack_aligned(const T* p) {
  return aligned(p, sizeof(T) * N < 16 ? int(sizeof(T) * N) : 16);
}

// The 8-bit counterpart of for_each_element: each of the block's Threads threads owns V consecutive elements per
// pass of Threads * V; the block_size / V threads of one quantisation block dequantise their states, run body
// (false: skipped, p and s unchanged), and, with Writes, store the updated elements' parameters and, when
// any element of the block was updated, agree on the new absmax and requantise. An all-skipped block keeps
// codes and absmax bit-identical. Writing passes take V = 8, so a 256-element block is one warp and its
// absmax needs shuffles only; the measuring pass (Writes false, LAMB/LARS pass 1) takes V = 4, layout.h's
// norm order. Every thread runs every pass (group reductions wider than a warp need them all); elements
// past the tensor's end take no part.
template <class T, int States, bool Writes, int Threads, class Body, class Table>
__device__ void for_each_quantized_element(const OptimOptions& o, const Table& table, const BlockWork& w,
                                           int block_size, const SharedMaps* maps, Body body) {
  constexpr int V = Writes ? 8 : kNormVector;
  __shared__ float exchange[States + 1][kMaxWarps];
  T* param = static_cast<T*>(table.param[w.tensor]);
  const T* grad = static_cast<const T*>(table.grad[w.tensor]);
  const bool wide = pack_aligned<T, V>(param) && pack_aligned<T, V>(grad);
  bool wide_codes = true;
#pragma unroll
  for (int j = 0; j < States; ++j) wide_codes = wide_codes && pack_aligned<uint8_t, V>(static_cast<uint8_t*>(table.state[j][w.tensor]));
  const int group = block_size / V;
  const int block_shift = __ffs(block_size) - 1;  // block_size is a power of two: no 64-bit division per pass
  for (int64_t pass = w.begin; pass < w.end; pass += Threads * V) {
    const int64_t base = pass + int64_t(threadIdx.x) * V;
    const int64_t quant_block = base >> block_shift;
    const bool full = base + V <= w.end;
    // How many of the V elements exist: 32-bit compares per element instead of 64-bit ones.
    const int present = full ? V : (base < w.end ? int(w.end - base) : 0);
    float g[V] = {}, p[V] = {}, s[V][4] = {}, scale[4] = {};
    bool valid[V], updated[V] = {};
#pragma unroll
    for (int e = 0; e < V; ++e) valid[e] = e < present;
    Pack<T, V> p_raw{};  // the parameters as loaded: skipped elements are stored back with their own bits
    if (wide && full) {
      const Pack<T, V> g_raw = load_pack<T, V>(grad + base);
      p_raw = load_pack<T, V>(param + base);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        g[e] = ElementTraits<T>::load(g_raw.v[e]);
        p[e] = ElementTraits<T>::load(p_raw.v[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (valid[e]) {
          g[e] = ElementTraits<T>::load(grad[base + e]);
          p[e] = ElementTraits<T>::load(param[base + e]);
        }
    }
#pragma unroll
    for (int j = 0; j < States; ++j) {
      const float* map = maps->value(state_is_signed(o, j));
      const uint8_t* codes = static_cast<const uint8_t*>(table.state[j][w.tensor]);
      if (base < w.end) scale[j] = table.absmax[j][w.tensor][quant_block];
      Pack<uint8_t, V> c{};
      if (full && wide_codes) {
        c = load_pack<uint8_t, V>(codes + base);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) if (valid[e]) c.v[e] = codes[base + e];
      }
#pragma unroll
      for (int e = 0; e < V; ++e) s[e][j] = dequantize_value(map, c.v[e], scale[j]);
    }
    bool any = false;
#pragma unroll
    for (int e = 0; e < V; ++e)
      if (valid[e] && body(g[e], p[e], s[e])) updated[e] = any = true;  // false: p and s as they were
    if (Writes && any) {
      if (wide && full) {
#pragma unroll
        for (int e = 0; e < V; ++e) if (updated[e]) p_raw.v[e] = ElementTraits<T>::store(p[e]);
        store_pack<T, V>(param + base, p_raw);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) if (updated[e]) param[base + e] = ElementTraits<T>::store(p[e]);
      }
    }
    if constexpr (Writes && States > 0) {
      float reduced[States + 1];
      agree_on_block(any, s, valid, group, exchange, reduced);
      if (reduced[0] == 0.0f || base >= w.end) continue;  // all skipped: codes and absmax stay as they are
#pragma unroll
      for (int j = 0; j < States; ++j) {
        const Requantizer q(o, maps, j, reduced[1 + j]);
        uint8_t* codes = static_cast<uint8_t*>(table.state[j][w.tensor]);
        const Pack<uint8_t, V> c = q.codes<V>(s, 0);
        if (full && wide_codes) {
          store_pack<uint8_t, V>(codes + base, c);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) if (valid[e]) codes[base + e] = c.v[e];
        }
        if ((base & (block_size - 1)) == 0) table.absmax[j][w.tensor][quant_block] = q.absmax;
      }
    }
  }
}

// The 8-bit writing pass over a whole chunk (kChunkElements elements) of a tensor whose parameters and
// gradients take 16-byte accesses and whose codes take piece-sized ones, with quantisation blocks of whole warps
// (block_size a multiple of 256): nearly all of a large step. Same results as for_each_quantized_element (the
// same rules, per-block absmax and quantiser), with less work per element:
// - a warp takes 256 consecutive elements per pass, lane l the 16-byte pieces l, l + 32, ... of them (2 pieces
//   of 4 fp32 elements, or 1 of 8 fp16/bf16 ones), so each load and store instruction of a warp is contiguous
//   (8 consecutive elements per lane spread each fp32 load over twice the sectors);
// - a block's absmax and "any element updated" are one warp reduction each (group_max: REDUX), larger blocks
//   combining their warps through shared memory;
// - no per-element bounds tests (the chunk is whole).
template <class T, int States, int Threads, class Body, class Table>
__device__ void for_each_quantized_element_of_whole_chunk(const OptimOptions& o, const Table& table,
                                                           const BlockWork& w, int block_size,
                                                           const SharedMaps* maps, Body body) {
  constexpr int kPiece = 16 / int(sizeof(T)), kPieces = 8 / kPiece, kPieceStride = 32 * kPiece;
  static_assert(kChunkElements % (Threads * 8) == 0, "passes cover a chunk exactly");
  __shared__ float exchange[States + 1][kMaxWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps_per_block = block_size / 256;
  const int block_shift = __ffs(block_size) - 1;  // block_size is a power of two: no 64-bit division per pass
  T* param = static_cast<T*>(table.param[w.tensor]) + w.begin;
  const T* grad = static_cast<const T*>(table.grad[w.tensor]) + w.begin;
  for (int pass = 0; pass < int(kChunkElements); pass += Threads * 8) {
    const int warp_first = pass + warp * 256, first = warp_first + lane * kPiece;  // piece k at first + k * kPieceStride
    const int64_t quant_block = (w.begin + warp_first) >> block_shift;
    float g[8], p[8], s[8][4] = {};
    Pack<T, kPiece> p_raw[kPieces];  // the parameters as loaded: skipped elements are stored back with their own bits
#pragma unroll
    for (int k = 0; k < kPieces; ++k) {
      const Pack<T, kPiece> g_raw = load_streaming(reinterpret_cast<const Pack<T, kPiece>*>(grad + first + k * kPieceStride));
      p_raw[k] = load_streaming(reinterpret_cast<const Pack<T, kPiece>*>(param + first + k * kPieceStride));
#pragma unroll
      for (int i = 0; i < kPiece; ++i) {
        g[k * kPiece + i] = ElementTraits<T>::load(g_raw.v[i]);
        p[k * kPiece + i] = ElementTraits<T>::load(p_raw[k].v[i]);
      }
    }
#pragma unroll
    for (int j = 0; j < States; ++j) {
      const float* map = maps->value(state_is_signed(o, j));
      const uint8_t* codes = static_cast<const uint8_t*>(table.state[j][w.tensor]) + w.begin;
      const float scale = table.absmax[j][w.tensor][quant_block];
#pragma unroll
      for (int k = 0; k < kPieces; ++k) {
        const Pack<uint8_t, kPiece> c = load_streaming(reinterpret_cast<const Pack<uint8_t, kPiece>*>(codes + first + k * kPieceStride));
#pragma unroll
        for (int i = 0; i < kPiece; ++i) s[k * kPiece + i][j] = dequantize_value(map, c.v[i], scale);
      }
    }
    bool any = false;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      // Through a copy, not on s[e] in place: with AdEMAMix's three states the in-place form made the compiler
      // version the loop once more, and the step took 0.578 instead of 0.525 ms on the H200 (same lease).
      float st[4] = {s[e][0], s[e][1], s[e][2], s[e][3]};
      float pe = p[e];
      if (body(g[e], pe, st)) {
        any = true;
        p_raw[e / kPiece].v[e % kPiece] = ElementTraits<T>::store(pe);
#pragma unroll
        for (int j = 0; j < States; ++j) s[e][j] = st[j];
      }
    }
    if (any) {
#pragma unroll
      for (int k = 0; k < kPieces; ++k)
        store_streaming(reinterpret_cast<Pack<T, kPiece>*>(param + first + k * kPieceStride), p_raw[k]);
    }
    if constexpr (States > 0) {
      // A quantisation block is block_size / 8 threads here too (one warp or several).
      constexpr bool kAll[8] = {true, true, true, true, true, true, true, true};
      float reduced[States + 1];
      agree_on_block(any, s, kAll, block_size / 8, exchange, reduced);
      if (reduced[0] == 0.0f) continue;  // all skipped: codes and absmax stay as they are
#pragma unroll
      for (int j = 0; j < States; ++j) {
        const Requantizer q(o, maps, j, reduced[1 + j]);
        uint8_t* codes = static_cast<uint8_t*>(table.state[j][w.tensor]) + w.begin;
#pragma unroll
        for (int k = 0; k < kPieces; ++k)
          store_streaming(reinterpret_cast<Pack<uint8_t, kPiece>*>(codes + first + k * kPieceStride),
                          q.codes<kPiece>(s, k * kPiece));
        // warps_per_block is a power of two: a mask, not the integer division (about 25 instructions) of `%`.
        if (lane == 0 && (warp & (warps_per_block - 1)) == 0) table.absmax[j][w.tensor][quant_block] = q.absmax;
      }
    }
  }
}

// Whether a writing 8-bit pass over the chunk can take for_each_quantized_element_of_whole_chunk.
template <class T, int States, class Table>
__device__ bool whole_chunk_path(const Table& table, const BlockWork& w, int block_size) {
  if (w.end - w.begin != kChunkElements || block_size % 256 != 0) return false;
  bool ok = aligned(table.param[w.tensor], 16) && aligned(table.grad[w.tensor], 16);
#pragma unroll
  for (int j = 0; j < States; ++j) ok = ok && aligned(table.state[j][w.tensor], 16 / sizeof(T));
  return ok;
}

// The element loop of the kernels below, for fp32 (Bits 32), bf16 (Bits 16) or 8-bit (Bits 8) states: body(g, p, s)
// returns whether it updated the element; with Writes the updates are stored, without, nothing is. Threads: the
// block's (only the 8-bit loops take other than kThreads).
template <class T, int States, int Bits, bool Writes, int Threads = kThreads, class Body, class Table>
__device__ void for_each(const OptimOptions& o, const Table& table, const BlockWork& w, int block_size,
                         const SharedMaps* maps, Body body) {
  if constexpr (Bits == 8) {
    if constexpr (Writes) {
      if (whole_chunk_path<T, States>(table, w, block_size)) {
        for_each_quantized_element_of_whole_chunk<T, States, Threads>(o, table, w, block_size, maps, body);
        return;
      }
    }
    for_each_quantized_element<T, States, Writes, Threads>(o, table, w, block_size, maps, body);
  } else {
    for_each_element<T, StateType<Bits>, States>(table, w, [&](float g, float& p, float* s) { return body(g, p, s) && Writes; });
  }
}

// The options with what algorithm A and a count of States states imply written as constants (the algorithm;
// Adam's amsgrad; RMSprop's centered), so that the compiler folds the tests on them (state_is_signed's switch,
// the rules' option branches) out of the 8-bit element loops instead of testing them per element.
template <OptimAlgorithm A, int States>
__device__ OptimOptions with_known_options(const OptimOptions& o) {
  OptimOptions known = o;
  known.algorithm = A;
  if constexpr (A == OptimAlgorithm::Adam || A == OptimAlgorithm::AdamW) known.amsgrad = States == 3;
  if constexpr (A == OptimAlgorithm::RMSprop && States != 2) known.centered = States == 3;
  return known;
}

// The 8-bit kernels are instruction-bound and hide latency with more resident warps: their registers are
// capped so that 3 blocks fit on an SM (85 registers; the compiler alone took 92, 2 blocks, on the H200; a cap at
// 4 blocks spilled 340 bytes per thread in AdamW). The fp32- and bf16-state kernels are capped at 5 blocks (46 registers).
// The element-wise 8-bit kernels with FastMath fit 1024 threads per SM (64 registers, no spill with 2 states, 4
// bytes with 3): as 4 blocks of 256, on the H200 AdamW at 64M went from 0.377 to 0.357 ms (fp32) and 0.362 to 0.336
// ms (bf16) in one lease. They now run blocks of 512 threads, 2 per SM (the same 1024 threads): each block
// holds a copy of the maps (37 KB of shared memory), and 2 copies per SM instead of 4 likely leave the L1 cache
// more room for the loads in flight. On the H200, 8-bit AdamW at 64M (fp32 parameters) took 0.324 ms against 0.335 ms
// with 4 blocks of 256 (bf16: 0.232 and 0.236 ms; same lease).
template <int Bits>
constexpr int MinBlocksPerSM = Bits == 8 ? 3 : 5;
template <class Math>
constexpr int QuantizedElementwiseThreads = std::is_same_v<Math, FastMath> ? 512 : kThreads;
template <class Math>
constexpr int QuantizedElementwiseBlocksPerSM = std::is_same_v<Math, FastMath> ? 2 : MinBlocksPerSM<8>;
static_assert(QuantizedElementwiseThreads<FastMath> / 32 <= kMaxWarps, "the exchange arrays hold every warp");

// Element-wise algorithms with fp32 or bf16 states (Bits 32 or 16): memory-bound, so few registers matter more
// than branches (rules.h, elementwise_step switches per element).
template <class T, int States, int Bits>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSM<Bits>)
    elementwise_kernel(OptimOptions o, LearningRate lr, TensorTable<States, Bits> table, int64_t total_blocks, int block_size) {
  if (!learning_rate_usable(lr, *lr.value)) return;
  __shared__ Coefficients k;
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    share_coefficients(o, lr.value, table, w.tensor, current, k);
    for_each<T, States, Bits, true>(o, table, w, block_size, nullptr, [&](float g, float& p, float* s) {
      if (skipped(o, g)) return false;
      elementwise_step(o, k, g, p, s);
      return true;
    });
  }
  finish_steps(table);
}

// Asks the L2 cache to fetch bytes [p, p + bytes) (rounded inward to 16-byte boundaries, as the bulk prefetch
// needs) without waiting for them: cp.async.bulk.prefetch (Hopper), one instruction for the whole range, and no
// registers held while the bytes arrive.
__device__ void prefetch_to_l2(const void* p, int64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (a + 15) & ~uintptr_t(15), last = (a + uintptr_t(bytes)) & ~uintptr_t(15);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (last > first) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(first), "r"(uint32_t(last - first)) : "memory");
#else
  // Older GPUs (a build for them: CMAKE_CUDA_ARCHITECTURES) have no bulk prefetch, and the emulated kernels
  // (tests/cpp/emulation) no cache to warm: the step is the same without it.
  (void)first, (void)last;
#endif
}

// The inputs of chunk `block` of the launch (its gradients, parameters and codes) into L2, if it exists.
template <class T, int States, class Table>
__device__ void prefetch_chunk(const Table& table, int64_t block, int64_t total_blocks) {
  if (block >= total_blocks) return;
  const BlockWork w = block_work(table, block);
  const int64_t n = w.end - w.begin;
  prefetch_to_l2(static_cast<const T*>(table.grad[w.tensor]) + w.begin, n * int64_t(sizeof(T)));
  prefetch_to_l2(static_cast<const T*>(table.param[w.tensor]) + w.begin, n * int64_t(sizeof(T)));
#pragma unroll
  for (int j = 0; j < States; ++j) prefetch_to_l2(static_cast<const uint8_t*>(table.state[j][w.tensor]) + w.begin, n);
}

// Element-wise algorithm A with 8-bit states: instruction-bound, so one kernel per algorithm (its registers
// are allocated for its own loop alone: one kernel for all algorithms of a state count spilled), with the
// options that A and States imply folded into it and no branch between elements; and, where eps allows,
// FastMath's square roots and quotients (rules.h).
template <class T, int States, OptimAlgorithm A, class Math>
__global__ void __launch_bounds__(QuantizedElementwiseThreads<Math>, QuantizedElementwiseBlocksPerSM<Math>)
    quantized_elementwise_kernel(OptimOptions o, LearningRate lr, TensorTable<States, 8> table, int64_t total_blocks,
                                 int block_size) {
  __shared__ Coefficients k;
  const float rate = *lr.value;  // read while the maps are copied
  const SharedMaps* maps = load_maps_to_shared<QuantizedElementwiseThreads<Math>>();
  if (!learning_rate_usable(lr, rate)) return;
  const OptimOptions known = with_known_options<A, States>(o);
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    // The block's next chunk on its way into L2 while this one is worked on: on the H200, 8-bit AdamW at 64M
    // (fp32 parameters) took 0.313 instead of 0.324 ms (bf16 parameters: no change; two chunks ahead was slower).
    if (threadIdx.x == 0) prefetch_chunk<T, States>(table, block_ + gridDim.x, total_blocks);
    share_coefficients(known, lr.value, table, w.tensor, current, k);
    const Coefficients mine = k;  // in registers (the rule's few): not re-read from shared per element
    for_each<T, States, 8, true, QuantizedElementwiseThreads<Math>>(known, table, w, block_size, maps,
                                                                    [&](float g, float& p, float* s) {
      if (skipped(known, g)) return false;
      elementwise_rule<A, Math>(known, mine, g, p, s);
      return true;
    });
  }
  finish_steps(table);
}

// The block's per-thread norms added by a fixed tree (same bits on every run); every thread gets the sum.
__device__ SquaredNorms block_sum(SquaredNorms mine, float (&partial)[2][kThreads]) {
  partial[0][threadIdx.x] = mine.param;
  partial[1][threadIdx.x] = mine.update;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      partial[0][threadIdx.x] += partial[0][threadIdx.x + half];
      partial[1][threadIdx.x] += partial[1][threadIdx.x + half];
    }
    __syncthreads();
  }
  const SquaredNorms sum{partial[0][0], partial[1][0]};
  __syncthreads();  // partial[] may be reused right away
  return sum;
}

// Layer-wise pass 1: each block writes its chunk's squared norms (a fixed-order tree over the threads,
// layout.h's order); the tensors are not written (rules.h, layerwise_apply, says why).
template <class T, int States, int Bits>
__global__ void __launch_bounds__(kThreads) measure_kernel(OptimOptions o, LearningRate lr, TensorTable<States, Bits> table,
                                                          int64_t total_blocks, int block_size, float* chunk_norms) {
  __shared__ Coefficients k;
  __shared__ float partial[2][kThreads];
  const float rate = *lr.value;
  const SharedMaps* maps = nullptr;
  if constexpr (Bits == 8) maps = load_maps_to_shared<kThreads>();
  if (!learning_rate_usable(lr, rate)) return;
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    share_coefficients(o, lr.value, table, w.tensor, current, k);
    SquaredNorms mine{0.0f, 0.0f};
    with_layerwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
      for_each<T, States, Bits, false>(o, table, w, block_size, maps, [&](float g, float& p, float* s) {
        const SquaredNorms n = layerwise_measure<decltype(algorithm)::value>(o, k, g, p, s);
        mine.param += n.param;
        mine.update += n.update;
        return false;
      });
    });
    const SquaredNorms sum = block_sum(mine, partial);
    if (threadIdx.x == 0) {
      const int64_t chunk = table.first_chunk[w.tensor] + (block_ - table.first_block[w.tensor]);
      chunk_norms[2 * chunk] = sum.param;
      chunk_norms[2 * chunk + 1] = sum.update;
    }
  }
}

// Layer-wise pass 1b: one block per tensor combines its chunk norms in a fixed order (thread i adds
// chunks i, i + kThreads, ... in turn, then the same tree as pass 1) and stores the tensor's factor.
// (One thread adding a 64M-element tensor's 16384 chunks in sequence took longer than the update.)
template <class Table>
__global__ void __launch_bounds__(kThreads) factor_kernel(OptimOptions o, LearningRate lr, Table table,
                                                          const float* chunk_norms, float* factors) {
  if (!learning_rate_usable(lr, *lr.value)) return;
  __shared__ float partial[2][kThreads];
  const int t = blockIdx.x;
  const int64_t first = table.first_chunk[t], chunks = table.first_block[t + 1] - table.first_block[t];
  SquaredNorms mine{0.0f, 0.0f};
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    mine.param += chunk_norms[2 * (first + c)];
    mine.update += chunk_norms[2 * (first + c) + 1];
  }
  const SquaredNorms total = block_sum(mine, partial);
  if (threadIdx.x == 0) factors[table.factor_index[t]] = layerwise_factor(o, coefficients(o, *lr.value, step_number(table, t)), total);
}

// Layer-wise pass 2: LAMB forms and stores its new moments and updates; LARS updates its momentum.
template <class T, int States, int Bits>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSM<Bits>) apply_kernel(OptimOptions o, LearningRate lr, TensorTable<States, Bits> table,
                                                        int64_t total_blocks, int block_size, const float* factors) {
  __shared__ Coefficients k;
  const float rate = *lr.value;
  const SharedMaps* maps = nullptr;
  if constexpr (Bits == 8) maps = load_maps_to_shared<kThreads>();
  if (!learning_rate_usable(lr, rate)) return;
  int current = -1;
  GS_FOR_EACH_CHUNK(table, total_blocks, w) {
    share_coefficients(o, lr.value, table, w.tensor, current, k);
    const float factor = factors[table.factor_index[w.tensor]];
    with_layerwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
      for_each<T, States, Bits, true>(o, table, w, block_size, maps, [&](float g, float& p, float* s) {
        if (skipped(o, g)) return false;
        layerwise_apply<decltype(algorithm)::value>(o, k, factor, g, p, s);
        return true;
      });
    });
  }
}

// Adds 1 to up to kMaxSteps steps per launch, ahead of the updates: the steps the update kernels do not count
// (optim_step_cuda).
constexpr int kMaxSteps = 480;
struct StepTable {
  int count;
  float* step[kMaxSteps];
};
static_assert(sizeof(StepTable) + sizeof(LearningRate) < 4000, "kernel arguments stay under 4 KB");

__global__ void increment_steps_kernel(StepTable table, LearningRate lr) {
  if (!learning_rate_usable(lr, *lr.value)) return;
  for (int i = threadIdx.x; i < table.count; i += blockDim.x) *table.step[i] += 1.0f;
}

void increment_steps(const std::vector<float*>& steps, const LearningRate& lr, cudaStream_t stream) {
  const int count = static_cast<int>(steps.size());
  for (int first = 0; first < count; first += kMaxSteps) {
    StepTable table{};
    table.count = std::min(kMaxSteps, count - first);
    for (int i = 0; i < table.count; ++i) table.step[i] = steps[first + i];
    GS_LAUNCH(increment_steps_kernel, 1, kThreads, stream, table, lr);
    GS_CUDA_CHECK_LAUNCH();
  }
}

// Blocks one launch of `kernel` uses: all chunks, or as many blocks as the GPU holds at once if fewer.
// Capped at residency because blocks loop over chunks in a fixed stride: a block that only starts once
// others have finished all their chunks would run its own alone at the end.
// The residency is queried once per kernel and device (the queries cost more than a launch).
template <class Kernel>
int64_t grid_for(Kernel kernel, int64_t blocks, int threads = kThreads) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int64_t> resident;  // (kernel, device) -> blocks at once
  int device = 0;
  GS_CUDA_CHECK(cudaGetDevice(&device));
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), device};
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = resident.find(key);
  if (it == resident.end()) {  // entered only once both queries succeeded
    int sms = 0, per_sm = 0;
    GS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    GS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    it = resident.emplace(key, int64_t(sms) * std::max(per_sm, 1)).first;
  }
  return std::min(blocks, it->second);
}

// Whether the update kernels count the steps (finish_steps) instead of a launch of their own ahead: with a
// finish counter, for the element-wise algorithms. LAMB and LARS, three launches a step already, keep the
// launch ahead: finish_steps at the end of their update kernel made the fp32 LAMB one spill 16 bytes, and
// LAMB at 64M took 0.775 instead of 0.755 ms on the H200.
bool update_counts_steps(const OptimStepArgs& a) {
  return a.increment_steps && a.finish_counter != nullptr && !is_layerwise(a.options.algorithm);
}

template <class T, int States, int Bits>
void launch_table(const OptimStepArgs& a, const TensorTable<States, Bits>& table, int64_t blocks, float* workspace,
                  std::size_t factors_offset, cudaStream_t stream) {
  if (blocks == 0) return;
  constexpr auto measure = &measure_kernel<T, States, Bits>;  // named: GS_LAUNCH takes one token
  constexpr auto apply = &apply_kernel<T, States, Bits>;
  constexpr auto factor = &factor_kernel<TensorTable<States, Bits>>;
  const OptimOptions& o = a.options;
  const LearningRate lr = learning_rate(a);
  const int b = a.block_size;
  if (!is_layerwise(o.algorithm)) {
    if constexpr (Bits == 8) {
      with_elementwise_algorithm<States>(o.algorithm, [&](auto algorithm) {
        constexpr OptimAlgorithm A = decltype(algorithm)::value;
        auto launch = [&](auto kernel, int threads) {
          GS_LAUNCH(kernel, grid_for(kernel, blocks, threads), threads, stream, o, lr, table, blocks, b);
        };
        constexpr int kFast = QuantizedElementwiseThreads<FastMath>, kExact = QuantizedElementwiseThreads<ExactMath>;
        if constexpr (takes_roots(A)) {
          if (fast_math_applies(o)) launch(&quantized_elementwise_kernel<T, States, A, FastMath>, kFast);
          else launch(&quantized_elementwise_kernel<T, States, A, ExactMath>, kExact);
        } else {
          launch(&quantized_elementwise_kernel<T, States, A, ExactMath>, kExact);  // no roots or quotients to choose for
        }
      });
    } else {
      constexpr auto kernel = &elementwise_kernel<T, States, Bits>;
      GS_LAUNCH(kernel, grid_for(kernel, blocks), kThreads, stream, o, lr, table, blocks, b);
    }
    GS_CUDA_CHECK_LAUNCH();
    return;
  }
  GS_LAUNCH(measure, grid_for(measure, blocks), kThreads, stream, o, lr, table, blocks, b, workspace);
  GS_CUDA_CHECK_LAUNCH();
  GS_LAUNCH(factor, table.count, kThreads, stream, o, lr, table, workspace, workspace + factors_offset);
  GS_CUDA_CHECK_LAUNCH();
  GS_LAUNCH(apply, grid_for(apply, blocks), kThreads, stream, o, lr, table, blocks, b, workspace + factors_offset);
  GS_CUDA_CHECK_LAUNCH();
}

// The step's tensors in launches of TensorTable<States, Bits>::kCapacity.
template <class T, int States, int Bits>
void run(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* workspace,
         std::size_t factors_offset, cudaStream_t stream) {
  using Table = TensorTable<States, Bits>;
  static_assert(sizeof(Table) <= kArgumentBytes, "the tensor table fits its bytes");
  const auto new_table = [&] {
    Table table{};
    if (update_counts_steps(a)) {
      table.step_increment = 1.0f;
      table.finish_counter = a.finish_counter;
    }
    return table;
  };
  Table table = new_table();
  int64_t blocks = 0, chunk_base = 0;
  auto flush = [&]() {
    table.first_block[table.count] = blocks;
    launch_table<T, States, Bits>(a, table, blocks, workspace, factors_offset, stream);
    table = new_table();
    blocks = 0;
  };
  for (int t = 0; t < count; ++t) {
    const OptimTensor& x = tensors[t];
    if (x.numel == 0) continue;  // no update: its step is counted ahead (optim_step_cuda)
    const int i = table.count++;
    table.param[i] = x.param;
    table.grad[i] = x.grad;
    for (int j = 0; j < States; ++j) {
      if constexpr (Bits == 8) {
        table.state[j][i] = x.codes[j];
        table.absmax[j][i] = x.absmax[j];
      } else {
        table.state[j][i] = x.state[j];
      }
    }
    table.step[i] = x.step;
    table.numel[i] = x.numel;
    table.first_block[i] = blocks;
    table.first_chunk[i] = chunk_base;
    table.factor_index[i] = t;
    blocks += chunk_count(x.numel);
    chunk_base += chunk_count(x.numel);
    if (table.count == Table::kCapacity) flush();
  }
  if (table.count > 0) flush();
}

template <class T>
void run_typed(const OptimStepArgs& a, const OptimTensor* tensors, int count, float* ws, std::size_t factors,
               cudaStream_t stream) {
  const auto with_bits = [&](auto states) {
    constexpr int States = decltype(states)::value;
    if (a.state_bits == 8) run<T, States, 8>(a, tensors, count, ws, factors, stream);
    else if (a.state_bits == 16) run<T, States, 16>(a, tensors, count, ws, factors, stream);
    else run<T, States, 32>(a, tensors, count, ws, factors, stream);
  };
  switch (optim_state_count(a.options)) {
    case 0: with_bits(std::integral_constant<int, 0>{}); break;
    case 1: with_bits(std::integral_constant<int, 1>{}); break;
    case 2: with_bits(std::integral_constant<int, 2>{}); break;
    case 3: with_bits(std::integral_constant<int, 3>{}); break;
    default: throw std::logic_error("unexpected optimizer state count");
  }
}

// Standalone quantisation (state_dict conversions, graphsafe.ops): one thread per quantisation block, the
// CPU's quantize_block (the same rules as the fused step).
__global__ void quantize_kernel(const float* x, int64_t numel, int block_size, bool is_signed, uint8_t* codes,
                                float* absmax) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= block_count(numel, block_size)) return;
  const int64_t begin = b * block_size, end = min(numel, begin + block_size);
  absmax[b] = quantize_block(kSharedMapsImage.words(is_signed), is_signed, x + begin, end - begin, codes + begin);
}

__global__ void dequantize_kernel(const uint8_t* codes, const float* absmax, int64_t numel, int block_size,
                                  bool is_signed, float* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < numel) out[i] = dequantize_value(kSharedMapsImage.value(is_signed), codes[i], absmax[i / block_size]);
}

void check_block_size(const char* what, int block_size) {
  if (!valid_block_size(block_size))
    throw std::invalid_argument(std::string(what) + ": block_size must be a power of two from 32 to 1024, got " +
                                std::to_string(block_size));
}

}  // namespace

void optim_step_cuda(const OptimStepArgs& a, const OptimTensor* tensors, int count, void* workspace,
                     std::size_t workspace_bytes, StreamHandle stream) {
  check_step_args(a, tensors, count);
  std::vector<int64_t> numels(count);
  for (int t = 0; t < count; ++t) numels[t] = tensors[t].numel;
  const LayerwiseLayout layout = layerwise_layout(numels.data(), count);
  const std::size_t needed = optim_workspace_bytes(Backend::Cuda, a.options, numels.data(), count);
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr))
    throw std::invalid_argument("optimizer step: workspace of " + std::to_string(workspace_bytes) +
                                " bytes is smaller than the " + std::to_string(needed) + " required");
  auto* ws = static_cast<float*>(workspace);
  const auto s = static_cast<cudaStream_t>(stream);
  if (a.increment_steps) {  // the steps the update kernels do not count: all of them, or the empty tensors'
    std::vector<float*> ahead;
    for (int t = 0; t < count; ++t)
      if (!update_counts_steps(a) || tensors[t].numel == 0) ahead.push_back(tensors[t].step);
    if (!ahead.empty()) increment_steps(ahead, learning_rate(a), s);
  }
  switch (a.param_dtype) {
    case DType::Float32: run_typed<float>(a, tensors, count, ws, layout.factors_offset, s); break;
    case DType::Float16: run_typed<f16_t>(a, tensors, count, ws, layout.factors_offset, s); break;
    case DType::BFloat16: run_typed<bf16_t>(a, tensors, count, ws, layout.factors_offset, s); break;
    default: break;
  }
}

void quantize_blockwise_cuda(const float* x, int64_t numel, int block_size, bool is_signed, uint8_t* codes,
                             float* absmax, StreamHandle stream) {
  check_block_size("quantize_blockwise", block_size);
  const int64_t blocks = block_count(numel, block_size);
  if (blocks == 0) return;
  GS_LAUNCH(quantize_kernel, (blocks + kThreads - 1) / kThreads, kThreads, static_cast<cudaStream_t>(stream), x,
            numel, block_size, is_signed, codes, absmax);
  GS_CUDA_CHECK_LAUNCH();
}

void dequantize_blockwise_cuda(const uint8_t* codes, const float* absmax, int64_t numel, int block_size,
                               bool is_signed, float* out, StreamHandle stream) {
  check_block_size("dequantize_blockwise", block_size);
  if (numel == 0) return;
  GS_LAUNCH(dequantize_kernel, (numel + kThreads - 1) / kThreads, kThreads, static_cast<cudaStream_t>(stream), codes,
            absmax, numel, block_size, is_signed, out);
  GS_CUDA_CHECK_LAUNCH();
}

}  // namespace graphsafe
