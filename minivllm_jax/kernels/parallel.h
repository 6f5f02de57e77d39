// Work split over XLA's own CPU thread pool: the pool that runs the program's other ops. A
// kernel with its own threads (OpenMP, as these had) competes with that pool for the cores:
// XLA runs independent ops at once (q, k and v projections), so each kernel's team found the
// cores taken and its barrier waited on a descheduled thread. Measured on 2 cores: a batch-1
// int8 decode step took 8.5 ms with OpenMP's 2 threads against 4.9 ms with one.
//
// `ParallelFor(pool, n, make_body)` runs `body(i)` for every i in [0, n): the caller takes items
// itself and asks the pool for helpers, which take items while any are left. A helper the pool
// starts late finds none and returns, so nothing waits for a thread that never comes (the pool
// may be busy, have one thread, or run tasks inline), and the caller waits only for items already
// being worked on. `make_body()` is called once per participant: its result holds that
// participant's scratch.

#ifndef MINIVLLM_KERNELS_PARALLEL_H_
#define MINIVLLM_KERNELS_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace minivllm {

template <typename MakeBody>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const MakeBody& make_body) {
  if (n <= 0) return;
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  // Shared with the helpers, which may start after this call returns: they own it too.
  auto progress = std::make_shared<Progress>();
  auto work = [n](Progress& p, const MakeBody& make) {
    int64_t i = p.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n) return;  // all taken: do not touch `make`, the caller may be gone
    auto body = make();
    for (; i < n; i = p.next.fetch_add(1, std::memory_order_relaxed)) {
      body(i);
      p.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([progress, work, &make_body] { work(*progress, make_body); });
  }
  work(*progress, make_body);
  while (progress->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace minivllm

#endif  // MINIVLLM_KERNELS_PARALLEL_H_
