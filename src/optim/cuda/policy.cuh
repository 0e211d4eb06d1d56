// The tuning constants of the optimizer's CUDA kernels, one policy per kernel family. Changing one changes
// the generated code of that family only; the static_asserts name the constants that other code depends on.
// Measurements behind the choices: docs/benchmarks.md.
#pragma once

#include <type_traits>

#include "optim/layout.h"
#include "optim/rules.h"

namespace graphsafe {
namespace {

using namespace optim_detail;

// The bytes of a launch's kernel arguments that its tensor table may take (launch_table.cuh, TensorTable: the
// driver copies the table, with the other arguments, into every launch); an 8-bit table's scales come on top
// (TensorTable::kScaleBytes, up to about 1.4 KB). With OptimOptions and the scalars the arguments come to over
// the classic 4 KB limit (and well under the 32 KB of CUDA 12.1): that needs CUDA 12.1 or later and a Volta or
// newer GPU (this project builds for Hopper with CUDA 13). The emulated kernels (tests/cpp/emulation) are built with a
// smaller table, so that their problems of a few dozen tensors go out in several launches, as a real step's
// hundreds of tensors do.
#ifndef GRAPHSAFE_OPTIM_ARGUMENT_BYTES
#define GRAPHSAFE_OPTIM_ARGUMENT_BYTES 4000
#endif
struct LaunchTablePolicy {
  static constexpr int kArgumentBytes = GRAPHSAFE_OPTIM_ARGUMENT_BYTES;
};

// The chunk walk of the fp32/bf16-state loop (element_loop.cuh, for_each_element) and of every kernel built on
// it: a block of kThreads threads covers one chunk of kChunkElements elements (layout.h) in kIterations passes,
// each thread kVector consecutive elements (one 16-byte access of fp32) per pass. The layer-wise norms are added
// in this order on both backends, so these are layout.h's norm constants.
struct ChunkPolicy {
  static constexpr int kThreads = 256;
  static constexpr int kVector = 4;
  static constexpr int kIterations = static_cast<int>(kChunkElements / (kThreads * kVector));
};
static_assert(ChunkPolicy::kIterations * ChunkPolicy::kThreads * ChunkPolicy::kVector == kChunkElements,
              "a block covers one chunk exactly");
static_assert(ChunkPolicy::kThreads == kNormThreads && ChunkPolicy::kVector == kNormVector,
              "the norm order of layout.h is this kernel's");

// Element-wise algorithms with fp32 or bf16 states (elementwise.cu): memory-bound, so their registers are capped
// to keep kMinBlocksPerSM blocks resident on an SM; more resident warps hide more of the memory latency.
struct ElementwisePolicy {
  static constexpr int kThreads = ChunkPolicy::kThreads;
  static constexpr int kMinBlocksPerSM = 5;
};

// The 8-bit loops (quantized_loops.cuh). A writing pass gives each thread kWritingVector consecutive elements,
// so that a 256-element quantisation block is one warp and its absmax needs shuffles only; the measuring pass
// (LAMB/LARS pass 1) takes kMeasuringVector, layout.h's norm order. The whole-chunk loop gives a warp
// kWarpElements consecutive elements per pass. kMaxThreads bounds every 8-bit kernel's block (the size of the
// loops' shared exchange arrays).
struct QuantizedLoopPolicy {
  static constexpr int kWritingVector = 8;
  static constexpr int kMeasuringVector = kNormVector;
  static constexpr int kWarpElements = 32 * kWritingVector;
  static constexpr int kMaxThreads = 512;
  static constexpr int kMaxWarps = kMaxThreads / 32;
  // The 8-bit kernels are instruction-bound and hide latency with more resident warps: their registers are
  // capped so that kMinBlocksPerSM blocks of ChunkPolicy::kThreads fit on an SM (the compiler alone fits fewer,
  // and a cap one block higher spills).
  static constexpr int kMinBlocksPerSM = 3;
};

// Element-wise algorithms with 8-bit states (quantized_elementwise.cu), per Math (rules.h). With FastMath the
// kernels fit 1024 threads per SM without spilling (two states; three spill a little): as 2 blocks of 512
// rather than 4 of 256, because each block holds a copy of the maps in shared memory (quantized_loops.cuh,
// SharedMaps), and fewer copies leave the L1 cache more room for the loads in flight. ExactMath needs more
// registers and keeps the 8-bit loops' general cap.
template <class Math>
struct QuantizedElementwisePolicy {
  static constexpr bool kFast = std::is_same_v<Math, FastMath>;
  static constexpr int kThreads = kFast ? 512 : ChunkPolicy::kThreads;
  static constexpr int kMinBlocksPerSM = kFast ? 2 : QuantizedLoopPolicy::kMinBlocksPerSM;
};
static_assert(QuantizedElementwisePolicy<FastMath>::kThreads <= QuantizedLoopPolicy::kMaxThreads &&
                  QuantizedElementwisePolicy<ExactMath>::kThreads <= QuantizedLoopPolicy::kMaxThreads,
              "the exchange arrays hold every warp");

// LAMB and LARS (layerwise.cu): three kernels over the chunk walk (their norms are added in ChunkPolicy's
// order, layout.h). The update kernel is capped as the element-wise kernel of its state width.
struct LayerwisePolicy {
  static constexpr int kThreads = ChunkPolicy::kThreads;
  // The measuring pass (pass 1) keeps kMeasureMinBlocksPerSM blocks resident: left free, the compiler's register
  // count for the 8-bit one moved with unrelated changes (to 62 once: 4 blocks per SM, a slower 8-bit LAMB step).
  static constexpr int kMeasureMinBlocksPerSM = 5;
  // optim_layerwise_norms_cuda's combining kernel takes this many tensors' chunk ranges (8 bytes each) a launch.
  static constexpr int kNormRangesPerLaunch = (LaunchTablePolicy::kArgumentBytes - 64) / 8 - 1;
  static constexpr int apply_min_blocks_per_sm(int bits) {
    return bits == 8 ? QuantizedLoopPolicy::kMinBlocksPerSM : ElementwisePolicy::kMinBlocksPerSM;
  }
};

// The small kernels of entry_points.cu: counting steps and advancing schedules ahead of the updates (kMaxSteps
// and kMaxSchedules tensors per launch, so that the tables stay under 4 KB of arguments) and standalone
// quantisation (one thread per quantisation block or element).
struct UtilityPolicy {
  static constexpr int kThreads = 256;
  static constexpr int kMaxSteps = 480;
  static constexpr int kMaxSchedules = 128;
};

// The row-sparse step's kernels (sparse.cu): element-wise and scatter kernels of kThreads threads; every kernel's
// grid is capped at kMaxBlocks blocks, which loop over the rest (a capacity's grid is mostly blocks that exit:
// rows past the device-side count).
struct SparsePolicy {
  static constexpr int kThreads = 256;
  static constexpr int64_t kMaxBlocks = 4096;
};

}  // namespace
}  // namespace graphsafe
