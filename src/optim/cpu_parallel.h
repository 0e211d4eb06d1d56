// The CPU optimizer step's threads (cpu.cpp): the calling thread and helper threads claim chunks of a job from a
// shared counter, and the caller waits only for chunks that a helper has claimed and not yet finished, never for a
// helper to wake up.
//
// Why not an OpenMP `parallel for`: a parallel region (static or dynamic schedule alike) ends in a barrier that
// every thread of the team must reach, so on a machine shared with other work (2 cores and a compiler, say) a step
// waits for a descheduled thread to get a core back before it returns. Here a helper that has not started by the time
// the caller has claimed every chunk simply finds the job finished; the step then takes what one core takes instead
// of a scheduler's time slice. Which thread runs a chunk never changes its bits: every chunk's work (elements,
// quantisation blocks, norm chunks, tensors) is independent of the others and of the thread.
//
// What must hold: a job's fields are written only while no helper can read them (the job closed and `users_` zero);
// a helper counts itself in `users_` before it reads the state word, so the caller's wait on `users_` after closing
// covers every helper that could still see the job open. Jobs nest by running serially (a chunk that starts a job,
// or a second thread calling while a job runs, runs the inner one on its own thread). After fork() the child starts
// a new pool (the helpers are not copied); the old one is abandoned, as is the pool at exit (helpers block on a
// condition variable, so no thread joins are needed and nothing is destroyed under them).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__unix__)
#include <pthread.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace graphsafe::optim_detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// The threads a job may use, the caller's included: OpenMP's setting where the build has OpenMP (OMP_NUM_THREADS,
// and torch.set_num_threads, which sets it), else the hardware's.
inline int cpu_step_threads() {
#if defined(_OPENMP)
  return std::max(1, omp_get_max_threads());
#else
  return std::max(1u, std::thread::hardware_concurrency());
#endif
}

class ChunkPool {
 public:
  using Body = void (*)(void* context, int64_t chunk);

  // Runs body(context, c) for every c in [0, chunks), each once, on this thread and up to threads - 1 helpers.
  void run(int64_t chunks, int threads, Body body, void* context) {
    if (chunks <= 0) return;
    const auto serially = [&] {
      for (int64_t c = 0; c < chunks; ++c) body(context, c);
    };
    if (chunks == 1 || threads <= 1 || inside_job()) return serially();
    std::unique_lock<std::mutex> busy(submit_, std::try_to_lock);
    if (!busy.owns_lock()) return serially();
    ensure_helpers(threads - 1);
    body_ = body;
    context_ = context;
    chunks_ = chunks;
    helpers_allowed_ = threads - 1;
    next_.store(0);
    finished_.store(0);
    generation_ += 1;
    state_.store(generation_ << 1 | 1);  // open
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      wake_.notify_all();
    }
    inside_job() = true;
    std::exception_ptr failure;
    try {
      work();
    } catch (...) {  // (allocation failures): the job is closed first, as helpers may still read `context`
      failure = std::current_exception();
      const int64_t claimed = std::min(next_.exchange(chunks), chunks);  // this one's chunk, and those left
      finished_.fetch_add(1 + (chunks - claimed));
    }
    inside_job() = false;
    while (finished_.load() < chunks) cpu_relax();  // only chunks a running helper claimed are left
    state_.store(generation_ << 1);                 // closed
    while (users_.load() != 0) cpu_relax();
    if (failure) std::rethrow_exception(failure);
  }

  // The process's pool (a new one in a child after fork()).
  static ChunkPool& instance() {
    static std::once_flag registered;
    std::call_once(registered, [] {
#if defined(__unix__)
      pthread_atfork(nullptr, nullptr, [] { current() = nullptr; });
#endif
    });
    ChunkPool*& pool = current();
    if (pool == nullptr) pool = new ChunkPool;  // never deleted (the header comment says why)
    return *pool;
  }

 private:
  static ChunkPool*& current() {
    static ChunkPool* pool = nullptr;
    return pool;
  }

  static bool& inside_job() {
    thread_local bool inside = false;
    return inside;
  }

  // Claims and runs chunks until none is left.
  void work() {
    for (int64_t c = next_.fetch_add(1); c < chunks_; c = next_.fetch_add(1)) {
      body_(context_, c);
      finished_.fetch_add(1);
    }
  }

  void ensure_helpers(int wanted) {
    while (static_cast<int>(helpers_.size()) < wanted) {
      const int id = static_cast<int>(helpers_.size());
      helpers_.emplace_back([this, id] { helper(id); });
      helpers_.back().detach();
    }
  }

  void helper(int id) {
    inside_job() = true;  // a chunk's own jobs run serially
    uint64_t seen = 0;
    for (;;) {
      // Spin a little (the next job of a step often follows at once), then sleep until one is posted.
      bool posted = false;
      for (int spin = 0; spin < (1 << 14) && !posted; ++spin) {
        posted = (state_.load(std::memory_order_relaxed) >> 1) != seen;
        if (!posted) cpu_relax();
      }
      if (!posted) {
        std::unique_lock<std::mutex> lock(wake_mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return (state_.load() >> 1) != seen; });
        sleepers_.fetch_sub(1);
      }
      users_.fetch_add(1);
      const uint64_t state = state_.load();
      seen = state >> 1;
      if ((state & 1) != 0 && id < helpers_allowed_) work();
      users_.fetch_sub(1);
    }
  }

  std::mutex submit_;  // held by the thread whose job runs
  std::vector<std::thread> helpers_;
  uint64_t generation_ = 0;
  // The job: written by its caller only while closed and unused (the header comment).
  Body body_ = nullptr;
  void* context_ = nullptr;
  int64_t chunks_ = 0;
  int helpers_allowed_ = 0;
  std::atomic<int64_t> next_{0}, finished_{0};
  std::atomic<uint64_t> state_{0};  // generation << 1 | open
  std::atomic<int> users_{0}, sleepers_{0};
  std::mutex wake_mutex_;
  std::condition_variable wake_;
};

// Runs body(c) for every c in [0, chunks) on the step's threads (ChunkPool).
template <class Body>
void parallel_chunks(int64_t chunks, Body body) {
  ChunkPool::instance().run(chunks, cpu_step_threads(), [](void* b, int64_t c) { (*static_cast<Body*>(b))(c); },
                            &body);
}

}  // namespace graphsafe::optim_detail
