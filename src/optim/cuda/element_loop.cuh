// The element loop of the optimizer's CUDA kernels for fp32 or bf16 states (32- and 16-bit state_bits): a block
// walks its chunk ChunkPolicy::kVector elements per thread at a time, with 16-byte streaming accesses where the
// tensor's pointers allow (quantized_loops.cuh has the 8-bit counterparts).
#pragma once

#include <cstdint>
#include <type_traits>

#include "optim/cuda/launch_table.cuh"
#include "optim/cuda/policy.cuh"
#include "optim/cuda/vector_access.cuh"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

// The states' storage type for Bits 32 and 16 (8-bit states are codes, read through their maps).
template <int Bits>
using StateType = std::conditional_t<Bits == 16, bf16_t, float>;

template <class S, class Table>
__device__ S* unquantized_state(const Table& table, int j, int t) { return static_cast<S*>(table.tensor[t].state[j]); }

// The kVector elements at `base` of one tensor: grad, param and the States states (fp32 or bf16, S) as loaded,
// in registers (raw: an element that is not updated is stored back with its own bits).
template <class T, class S, int States>
struct Packet {
  Pack<T, ChunkPolicy::kVector> g, p;
  Pack<S, ChunkPolicy::kVector> s[States > 0 ? States : 1];  // indexed only by unrolled constants: stays in registers
};

template <class T, class S, int States, class Table>
__device__ void load_packet(const Table& table, int tensor, int64_t base, Packet<T, S, States>& x) {
  constexpr int kVec = ChunkPolicy::kVector;
  x.g = load_streaming(reinterpret_cast<const Pack<T, kVec>*>(static_cast<const T*>(table.tensor[tensor].grad) + base));
  x.p = load_streaming(reinterpret_cast<const Pack<T, kVec>*>(static_cast<const T*>(table.tensor[tensor].param) + base));
#pragma unroll
  for (int j = 0; j < States; ++j)
    x.s[j] = load_streaming(reinterpret_cast<const Pack<S, kVec>*>(unquantized_state<S>(table, j, tensor) + base));
}

// Runs body on the packet's elements and writes back what changed (skipped elements are not written).
template <class T, class S, int States, class Body, class Table>
__device__ void update_packet(const Table& table, int tensor, int64_t base, Packet<T, S, States>& x, Body& body) {
  constexpr int kVec = ChunkPolicy::kVector;
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
  store_streaming(reinterpret_cast<Pack<T, kVec>*>(static_cast<T*>(table.tensor[tensor].param) + base), x.p);
#pragma unroll
  for (int j = 0; j < States; ++j)
    store_streaming(reinterpret_cast<Pack<S, kVec>*>(unquantized_state<S>(table, j, tensor) + base), x.s[j]);
}

// Calls body(g, p, s) for each element a thread owns; body returns whether it changed p and s. Aligned
// tensors go kVector elements at a time, their last partial packet and unaligned tensors one at a time. S: the
// states' storage type (fp32, or bf16 for 16-bit states).
template <class T, class S, int States, class Body, class Table>
__device__ void for_each_element(const Table& table, const BlockWork& w, Body body) {
  constexpr int kThreads = ChunkPolicy::kThreads, kVec = ChunkPolicy::kVector;
  T* param = static_cast<T*>(table.tensor[w.tensor].param);
  const T* grad = static_cast<const T*>(table.tensor[w.tensor].grad);
  bool wide = aligned(param, sizeof(T) * kVec) && aligned(grad, sizeof(T) * kVec);
#pragma unroll
  for (int j = 0; j < States; ++j) wide = wide && aligned(unquantized_state<S>(table, j, w.tensor), sizeof(S) * kVec);
  for (int it = 0; it < ChunkPolicy::kIterations; ++it) {
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

}  // namespace
}  // namespace graphsafe
