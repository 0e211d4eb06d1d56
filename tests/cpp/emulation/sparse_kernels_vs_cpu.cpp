// The row-sparse step (graphsafe/optim_sparse.h): the emulated CUDA kernels of src/optim/cuda/sparse.cu against
// optim_step_sparse_cpu and against the dense optim_step_cpu on the scattered gradient (skip_zeros on), bit for
// bit on parameters, fp32/bf16 states, 8-bit codes and absmax, the step count and the schedule values. Every
// algorithm of the table with every state its options can create, 32/16/8-bit states (the table permitting), fp32
// and bf16 parameters; tables of 13 rows of 24 (block 32: blocks straddle rows, the last block partial) and, with
// 8-bit states and fp32 parameters, of 5 rows of 64 (block 32: rows apart), and the shapes for_each_problem lists; several steps on one table, with lists below capacity (tail rows -1, NaN
// gradients: must not be read), empty, full, with the first and last rows and with exact zeros in listed rows.
// Then invalid lists: the CPU throws and writes nothing; CUDA skips the bad rows, steps the others, writes nothing
// out of bounds (canary elements around every buffer) and records the error. Sizes stay small: every emulated
// CUDA thread is a std::thread.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "graphsafe/errors.h"
#include "graphsafe/optim.h"
#include "graphsafe/optim_sparse.h"

using namespace graphsafe;

namespace {

constexpr int64_t kPad = 8;              // canary elements on each side of every buffer
constexpr unsigned char kCanary = 0xA5;  // their bytes (a finite value in fp32 and bf16, not a code of 0)

bool quantizable(OptimAlgorithm a) {
  for (const OptimStateSpec& s : optim_algorithm_spec(a).states)
    if (s.name != nullptr && (s.storage & kStorage8) == 0) return false;
  return true;
}

// One problem's fixed parts: the options (every state their algorithm has turned on), the widths, the shape.
struct Problem {
  OptimOptions o;
  DType dtype = DType::Float32;
  int bits = 32, block = 32;
  int64_t rows = 13, d = 24;
  float lr = 0.02f;

  int64_t numel() const { return rows * d; }
  int states() const { return optim_state_count(o); }
  std::size_t psize() const { return dtype == DType::Float32 ? 4 : 2; }
  std::string name() const {
    return std::string(optim_algorithm_spec(o.algorithm).name) + " " + dtype_name(dtype) + " " +
           std::to_string(bits) + "-bit states, " + std::to_string(rows) + "x" + std::to_string(d) + " block " +
           std::to_string(block);
  }
  OptimStepArgs args() const {
    OptimStepArgs a;
    a.options = o;
    a.param_dtype = dtype;
    a.lr = &lr;
    a.increment_steps = true;  // the sparse step requires it; the dense reference counts its own too
    a.state_bits = bits;
    a.block_size = block;
    return a;
  }
};

OptimOptions options_with_every_state(OptimAlgorithm a) {
  OptimOptions o;
  o.algorithm = a;
  o.skip_zeros = true;
  o.weight_decay = 0.1;
  o.momentum = (a == OptimAlgorithm::SGD || a == OptimAlgorithm::RMSprop || a == OptimAlgorithm::LARS) ? 0.9 : 0.0;
  o.dampening = a == OptimAlgorithm::SGD ? 0.1 : 0.0;
  o.centered = a == OptimAlgorithm::RMSprop;
  o.amsgrad = a == OptimAlgorithm::Adam || a == OptimAlgorithm::AdamW;
  o.alpha_warmup = o.beta3_warmup = a == OptimAlgorithm::AdEMAMix ? 6.0 : 0.0;
  o.trust_coefficient = 0.02;
  o.lr_decay = a == OptimAlgorithm::Adagrad ? 0.01 : 0.0;
  o.warmup_steps = a == OptimAlgorithm::AdamWScheduleFree ? 2.0f : 0.0f;
  o.r = a == OptimAlgorithm::AdamWScheduleFree ? 0.5f : 0.0f;
  return o;
}

// A buffer of n elements of esize bytes between kPad canary elements on each side.
struct Buf {
  std::size_t esize;
  std::vector<unsigned char> bytes;
  Buf(std::size_t e, int64_t n) : esize(e), bytes((n + 2 * kPad) * e, kCanary) {}
  unsigned char* data() { return bytes.data() + kPad * esize; }
};

// The tensor: bufs[0] the parameter, then per state its fp32/bf16 buffer or (8-bit) its codes, then its absmax.
struct Table {
  std::vector<Buf> bufs;
  float step = 0.0f;
  double schedule[kMaxScheduleValues] = {};

  OptimTensor view(const Problem& s) {
    OptimTensor t;
    t.param = bufs[0].data();
    for (int j = 0; j < s.states(); ++j) {
      if (s.bits == 8) {
        t.codes[j] = bufs[1 + j].data();
        t.absmax[j] = reinterpret_cast<float*>(bufs[1 + s.states() + j].data());
      } else {
        t.state[j] = bufs[1 + j].data();
      }
    }
    t.step = &step;
    for (int j = 0; j < kMaxScheduleValues; ++j) t.schedule[j] = &schedule[j];
    t.numel = s.numel();
    return t;
  }
};

void store(DType dtype, void* p, int64_t i, float v) {
  if (dtype == DType::Float32) static_cast<float*>(p)[i] = v;
  else static_cast<bf16_t*>(p)[i] = ElementTraits<bf16_t>::store(v);
}

// Aligned scratch (the CUDA dense route wants 256 bytes), filled with 0xFF bytes (NaN in fp32 and bf16) so that a
// dense gradient not zeroed first shows.
struct Workspace {
  std::vector<unsigned char> bytes;
  std::size_t size;
  explicit Workspace(std::size_t n) : bytes(n + 512, 0xFF), size(n) {}
  void* data() { return bytes.data() + (256 - reinterpret_cast<uintptr_t>(bytes.data()) % 256); }
};

void dense_step(const Problem& s, Table& t, const void* grad) {
  OptimTensor v = t.view(s);
  v.grad = grad;
  const int64_t n = s.numel();
  Workspace ws(optim_workspace_bytes(Backend::Cpu, s.o, &n, 1));
  optim_step_cpu(s.args(), &v, 1, ws.data(), ws.size);
}

// Random parameters, zero states (8-bit: quantised zeros), then a dense step with a gradient that is nowhere zero,
// so every state (and Schedule-Free's schedule values) starts the sparse steps non-trivial.
Table make_table(const Problem& s, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Table t;
  const int64_t n = s.numel(), blocks = (n + s.block - 1) / s.block;
  t.bufs.emplace_back(s.psize(), n);
  for (int64_t i = 0; i < n; ++i) store(s.dtype, t.bufs[0].data(), i, 0.5f * normal(rng));
  for (int j = 0; j < s.states(); ++j) {
    t.bufs.emplace_back(s.bits == 8 ? 1 : s.bits / 8, n);
    std::memset(t.bufs.back().data(), 0, n * t.bufs.back().esize);
  }
  for (int j = 0; s.bits == 8 && j < s.states(); ++j) {
    t.bufs.emplace_back(4, blocks);
    const std::vector<float> zeros(n, 0.0f);
    quantize_blockwise_cpu(zeros.data(), n, s.block, optim_state_is_signed(s.o, j), t.bufs[1 + j].data(),
                           reinterpret_cast<float*>(t.bufs.back().data()));
  }
  std::vector<unsigned char> grad(n * s.psize());
  for (int64_t i = 0; i < n; ++i) store(s.dtype, grad.data(), i, normal(rng) + (normal(rng) > 0 ? 0.1f : -0.1f));
  dense_step(s, t, grad.data());
  return t;
}

// The first difference between two tables (canaries, step and schedule included), or "".
std::string difference(const Table& a, const Table& b) {
  if (std::memcmp(&a.step, &b.step, 4) != 0) return "step " + std::to_string(a.step) + " vs " + std::to_string(b.step);
  for (int j = 0; j < kMaxScheduleValues; ++j)
    if (std::memcmp(&a.schedule[j], &b.schedule[j], 8) != 0)
      return "schedule value " + std::to_string(j) + ": " + std::to_string(a.schedule[j]) + " vs " +
             std::to_string(b.schedule[j]);
  for (std::size_t k = 0; k < a.bufs.size(); ++k) {
    const std::size_t e = a.bufs[k].esize;
    for (std::size_t i = 0; i < a.bufs[k].bytes.size(); i += e) {
      if (std::memcmp(&a.bufs[k].bytes[i], &b.bufs[k].bytes[i], e) == 0) continue;
      uint64_t x = 0, y = 0;
      std::memcpy(&x, &a.bufs[k].bytes[i], e);
      std::memcpy(&y, &b.bufs[k].bytes[i], e);
      char bits[64];
      std::snprintf(bits, sizeof bits, ": bits 0x%llx vs 0x%llx", (unsigned long long)x, (unsigned long long)y);
      const int64_t element = int64_t(i / e) - kPad;  // < 0 or >= the buffer's size: a canary
      return "buffer " + std::to_string(k) + " (0: param, then states or codes, then absmax) element " +
             std::to_string(element) + bits;
    }
  }
  return "";
}

// Whether every canary element still holds its bytes (checked on its own, so a reference writing out of bounds
// too cannot hide it).
bool canaries_intact(const Table& t) {
  for (const Buf& b : t.bufs)
    for (std::size_t i = 0; i < kPad * b.esize; ++i)
      if (b.bytes[i] != kCanary || b.bytes[b.bytes.size() - 1 - i] != kCanary) return false;
  return true;
}

// A gradient as rows: `rows` (capacity entries), `count`, capacity * d row gradients. Entries from `listed` on
// are -1 with NaN gradients (never to be read); listed rows' gradients are random with every 7th element an
// exact zero (+0 and -0 in turn), which the step must skip.
struct Rows {
  std::vector<int64_t> rows;
  std::vector<unsigned char> grads;
  int64_t count = 0, capacity = 0;

  OptimSparseGradient gradient(const Problem& s) const {
    OptimSparseGradient g;
    g.rows = capacity > 0 ? rows.data() : nullptr;
    g.row_grads = capacity > 0 ? grads.data() : nullptr;
    g.count = &count;
    g.capacity = capacity;
    g.row_length = s.d;
    return g;
  }
  // Whether the CUDA kernels step entry k: it lies in the list's valid prefix (sparse.cu: every entry up to it is a
  // row of the tensor above the entry before).
  bool usable(const Problem& s, int64_t k) const {
    for (int64_t j = 0; j <= k; ++j)
      if (!(rows[j] >= 0 && rows[j] < s.rows && (j == 0 || rows[j - 1] < rows[j]))) return false;
    return true;
  }
  // The dense gradient the usable entries of [0, min(count, capacity)) scatter into.
  std::vector<unsigned char> scattered(const Problem& s) const {
    std::vector<unsigned char> dense(s.numel() * s.psize(), 0);
    for (int64_t k = 0; k < std::min(count, capacity); ++k)
      if (usable(s, k))
        std::memcpy(&dense[rows[k] * s.d * s.psize()], &grads[k * s.d * s.psize()], s.d * s.psize());
    return dense;
  }
};

// `entries` rows (the first `listed` of them given gradients), then -1 up to the capacity; count = listed.
Rows make_rows(const Problem& s, std::vector<int64_t> entries, int64_t capacity, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Rows r;
  r.count = static_cast<int64_t>(entries.size());
  r.capacity = capacity;
  entries.resize(std::max<int64_t>(capacity, r.count), -1);
  r.rows = entries;
  r.grads.resize(r.rows.size() * s.d * s.psize());
  for (int64_t i = 0; i < int64_t(r.rows.size()) * s.d; ++i)
    store(s.dtype, r.grads.data(), i, i >= r.count * s.d ? NAN : i % 7 == 3 ? (i % 2 ? 0.0f : -0.0f) : normal(rng));
  return r;
}

void sparse_step_cpu(const Problem& s, Table& t, const Rows& r) {
  Workspace ws(optim_sparse_workspace_bytes(Backend::Cpu, s.o, s.dtype, s.numel()));
  optim_step_sparse_cpu(s.args(), t.view(s), r.gradient(s), ws.data(), ws.size);
}

void sparse_step_emulated(const Problem& s, Table& t, const Rows& r, DeviceErrorRecord* record) {
  Workspace ws(optim_sparse_workspace_bytes(Backend::Cuda, s.o, s.dtype, s.numel()));
  OptimStepArgs a = s.args();
  a.error = record;
  optim_step_sparse_cuda(a, t.view(s), r.gradient(s), ws.data(), ws.size, nullptr);
}

// Every problem the table allows, in these shapes (rows, d, quantisation block).
template <class F>
void for_each_problem(F&& f) {
  struct Shape { int64_t rows, d; int block; };
  for (int algorithm = 0; algorithm < kOptimAlgorithmCount; ++algorithm)
    for (int bits : {32, 16, 8})
      for (DType dtype : {DType::Float32, DType::BFloat16})
        for (Shape shape : {Shape{13, 24, 32}, Shape{5, 64, 32}, Shape{9, 100, 256}, Shape{40, 30, 1024},
                            Shape{6, 7, 32}, Shape{10, 128, 256}, Shape{40, 32, 1024}}) {
          Problem s;
          s.o = options_with_every_state(OptimAlgorithm(algorithm));
          if (bits == 8 && !quantizable(s.o.algorithm)) continue;
          // Emulated threads are costly: each other shape where it matters, with fp32 parameters (bf16 takes the
          // first shape, and the default block of 256 too). Rows apart in their blocks, blocks of a warp's 8
          // elements per lane (256) and of a team of warps (1024): 8-bit states only (the block size means
          // nothing to the others). Rows whose length is not a multiple of 4: one element per thread, fp32 and
          // bf16 states.
          if (shape.d == 64 && (bits != 8 || dtype != DType::Float32)) continue;
          if (shape.block == 256 && bits != 8) continue;
          if (shape.block == 1024 && (bits != 8 || dtype != DType::Float32)) continue;
          if (shape.d == 7 && (bits == 8 || dtype != DType::Float32)) continue;
          // Whole blocks in 16-byte pieces (sparse.cu, step_whole_block): 8-bit states, rows of two pieces of fp32 and
          // bf16 per block of 256 (block shared by two rows, as in the recommender case) and a team of warps.
          if (shape.d == 128 && bits != 8) continue;
          if (shape.d == 32 && (bits != 8 || dtype != DType::Float32)) continue;
          s.dtype = dtype;
          s.bits = bits;
          s.rows = shape.rows;
          s.d = shape.d;
          s.block = shape.block;
          s.lr = s.o.algorithm == OptimAlgorithm::LARS ? 1.0f : 0.02f;
          f(s);
        }
}

// An invalid list: the memory behind rows (entries past the capacity there too, never to be read), the count,
// the capacity, and the (bad_value, upper_bound) pairs the error record may hold.
struct InvalidCase {
  const char* what;
  std::vector<int64_t> rows;
  int64_t count, capacity;
  std::vector<std::pair<int64_t, int64_t>> reports;
};

// CUDA: every usable entry (the list's valid prefix) stepped exactly as the dense step on
// their scattered gradient steps it, nothing else written (canaries), the error recorded with one of the offending
// values. CPU: std::invalid_argument, the table unchanged. AdamW and RMSprop (three states each) for the
// element-wise kernels, LAMB for the dense route's scatter; 32-bit states with fp32 parameters, 16 with bf16, 8.
void check_invalid(const InvalidCase& c) {
  for (OptimAlgorithm algorithm : {OptimAlgorithm::AdamW, OptimAlgorithm::RMSprop, OptimAlgorithm::LAMB}) {
    for (int bits : {32, 16, 8}) {
      Problem s;
      s.o = options_with_every_state(algorithm);
      s.bits = bits;
      s.dtype = bits == 16 ? DType::BFloat16 : DType::Float32;
      const std::string what = s.name() + ", " + c.what;
      std::mt19937 rng(77);
      const Table start = make_table(s, rng);
      Rows r = make_rows(s, c.rows, c.capacity, rng);
      r.count = c.count;

      Table cpu = start;
      EXPECT_THROW(sparse_step_cpu(s, cpu, r), std::invalid_argument) << what;
      EXPECT_EQ(difference(start, cpu), "") << what << ": the refused CPU step wrote";

      Table emu = start, dense = start;
      DeviceErrorRecord record{0, 0, 0};
      sparse_step_emulated(s, emu, r, &record);
      const std::vector<unsigned char> grad = r.scattered(s);
      dense_step(s, dense, grad.data());
      EXPECT_TRUE(canaries_intact(emu)) << what;
      EXPECT_EQ(difference(dense, emu), "") << what << ": CPU dense on the usable rows vs emulated CUDA sparse";
      EXPECT_EQ(record.code, int64_t(DeviceErrorCode::IndexOutOfRange)) << what;
      bool named = false;
      for (const auto& [value, bound] : c.reports) named |= record.bad_value == value && record.upper_bound == bound;
      EXPECT_TRUE(named) << what << ": recorded " << record.bad_value << " (bound " << record.upper_bound << ")";
    }
  }
}

}  // namespace

// Five steps on one table (the states carried): a list below capacity with the first and last rows and two
// adjacent rows, every row, an empty list, a capacity of 0 (null pointers), a random subset. After each step the
// emulated CUDA table equals the CPU's, which equals the dense step's, canaries included; nothing is recorded.
TEST(SparseKernelsEmulated, EveryAlgorithmMatchesTheCpuAndTheDenseStep) {
  int problems = 0;
  for_each_problem([&](const Problem& s) {
    ++problems;
    std::mt19937 rng(1000 + problems);
    Table emu = make_table(s, rng), cpu = emu, dense = emu;
    std::vector<int64_t> all(s.rows), subset;
    for (int64_t i = 0; i < s.rows; ++i) all[i] = i;
    for (int64_t i = 0; i < s.rows; ++i)
      if (rng() % 2) subset.push_back(i);
    const std::vector<std::pair<std::vector<int64_t>, int64_t>> lists = {
        {{0, s.rows / 3, s.rows / 3 + 1, s.rows - 1}, 7}, {all, s.rows}, {{}, 4}, {{}, 0},
        {subset, int64_t(subset.size()) + 1}};
    for (std::size_t k = 0; k < lists.size(); ++k) {
      const Rows r = make_rows(s, lists[k].first, lists[k].second, rng);
      DeviceErrorRecord record{0, 0, 0};
      sparse_step_emulated(s, emu, r, &record);
      sparse_step_cpu(s, cpu, r);
      const std::vector<unsigned char> grad = r.scattered(s);
      dense_step(s, dense, grad.data());
      const std::string what = s.name() + ", step " + std::to_string(k);
      EXPECT_EQ(record.code, 0) << what;
      EXPECT_TRUE(canaries_intact(emu)) << what;
      const std::string vs_cpu = difference(cpu, emu), vs_dense = difference(dense, cpu);
      EXPECT_EQ(vs_cpu, "") << what << ": CPU sparse vs emulated CUDA sparse";
      EXPECT_EQ(vs_dense, "") << what << ": CPU dense vs CPU sparse";
      if (!vs_cpu.empty() || !vs_dense.empty()) return;  // the first difference of a problem says it all
    }
  });
  // 32/16 bits: 2 dtypes on the first shape, fp32 on the odd rows; 8 bits (not Schedule-Free AdamW): 2 dtypes on the
  // first shape, on blocks of 256 and on whole blocks of 256, fp32 on rows apart, on blocks of 1024 and on whole
  // blocks of 1024.
  EXPECT_EQ(problems, 2 * 3 * kOptimAlgorithmCount + 9 * (kOptimAlgorithmCount - 1));
}

// On a 13x24 table (13 rows).
TEST(SparseKernelsEmulated, InvalidRowsAreSkippedRecordedAndNothingIsWrittenOutOfBounds) {
  check_invalid({"out of range", {-2, 3, 7, 13, 40}, 5, 5, {{-2, 13}, {13, 13}, {40, 13}}});
  check_invalid({"a repeated row", {2, 6, 6, 9}, 4, 4, {{6, 13}}});
  check_invalid({"a decreasing row", {1, 8, 4, 11}, 4, 4, {{4, 13}}});
  // Rows 10-12 lie past the capacity (with gradients): stepping them would read out of bounds.
  check_invalid({"count above the capacity", {1, 5, 8, 10, 11, 12}, 6, 3, {{6, 4}}});
}

// Rows {4, 6, 5, 7}, block 32: row 7 (elements 168-191) shares quantisation block 5 with the end of row 6. Entry 2
// (row 5) is invalid, so the valid prefix is rows {4, 6}: row 7 must not be stepped, although the 8-bit kernel's
// work item for row 6 covers block 5 (once stepped twice: by that item, which found row 7's gradient past the
// invalid entry, and by row 7's own). And a repeat that is not adjacent, {5, 9, 8, 9}: row 9 stepped once.
TEST(SparseKernelsEmulated, ARefusedRowBetweenRowsSharingABlockLeavesTheNextRowSteppedOnce) {
  check_invalid({"a decreasing row between rows sharing a block", {4, 6, 5, 7}, 4, 4, {{5, 13}}});
  check_invalid({"a repeat further on", {5, 9, 8, 9}, 4, 4, {{8, 13}}});
}

// The CUDA dense route (LAMB, LARS) refuses a workspace off 256-byte alignment before writing anything.
TEST(SparseKernelsEmulated, TheDenseRouteWantsAnAlignedWorkspace) {
  Problem s;
  s.o = options_with_every_state(OptimAlgorithm::LAMB);
  std::mt19937 rng(5);
  const Table start = make_table(s, rng);
  Table emu = start;
  const Rows r = make_rows(s, {1, 2}, 2, rng);
  Workspace ws(optim_sparse_workspace_bytes(Backend::Cuda, s.o, s.dtype, s.numel()) + 16);
  EXPECT_THROW(optim_step_sparse_cuda(s.args(), emu.view(s), r.gradient(s), static_cast<char*>(ws.data()) + 16,
                                      ws.size - 16, nullptr),
               std::invalid_argument);
  EXPECT_EQ(difference(start, emu), "");
}
