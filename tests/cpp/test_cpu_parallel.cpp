// The CPU optimizer step's chunk pool (src/optim/cpu_parallel.h): every chunk of every job runs exactly once, with
// one or several callers at a time, nested jobs, and any thread count.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "optim/cpu_parallel.h"

namespace graphsafe::optim_detail {
namespace {

// Runs `jobs` jobs of 1 to 300 chunks on `threads` threads and checks each chunk ran once.
void run_jobs(int jobs, int threads, bool nested) {
  for (int job = 0; job < jobs; ++job) {
    const int64_t chunks = 1 + (job * 37) % 300;
    std::vector<std::atomic<int>> runs(static_cast<std::size_t>(chunks));
    std::atomic<int64_t> inner{0};
    using State = std::pair<std::vector<std::atomic<int>>*, std::atomic<int64_t>*>;
    State state(&runs, nested ? &inner : nullptr);
    ChunkPool::instance().run(chunks, threads, [](void* context, int64_t c) {
      auto* state = static_cast<State*>(context);
      (*state->first)[static_cast<std::size_t>(c)].fetch_add(1);
      if (state->second != nullptr) {
        // A job started from a chunk runs on that chunk's thread, whole.
        ChunkPool::instance().run(3, 2, [](void* counter, int64_t) {
          static_cast<std::atomic<int64_t>*>(counter)->fetch_add(1);
        }, state->second);
      }
    }, &state);
    for (int64_t c = 0; c < chunks; ++c) ASSERT_EQ(runs[static_cast<std::size_t>(c)].load(), 1) << "chunk " << c;
    if (nested) EXPECT_EQ(inner.load(), 3 * chunks);
  }
}

TEST(CpuChunkPool, EveryChunkOnce) {
  for (int threads : {1, 2, 3, 8}) run_jobs(200, threads, false);
}

TEST(CpuChunkPool, NestedJobsRunWhole) { run_jobs(100, 2, true); }

TEST(CpuChunkPool, ConcurrentCallers) {
  std::thread other([] { run_jobs(300, 2, false); });
  run_jobs(300, 2, false);
  other.join();
}

TEST(CpuChunkPool, ParallelChunksCoversTheRange) {
  std::vector<int> seen(1000, 0);
  parallel_chunks(1000, [&](int64_t c) { seen[static_cast<std::size_t>(c)] += 1; });
  for (int v : seen) ASSERT_EQ(v, 1);
}

}  // namespace
}  // namespace graphsafe::optim_detail
