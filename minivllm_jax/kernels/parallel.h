// Work split over XLA's own CPU thread pool: the pool that runs the program's other ops. A
// kernel with its own threads (OpenMP, as these had) competes with that pool for the cores:
// XLA runs independent ops at once (q, k and v projections), so each kernel's team found the
// cores taken and its barrier waited on a descheduled thread. Measured on 2 cores: a batch-1
// int8 decode step took 8.5 ms with OpenMP's 2 threads against 4.9 ms with one.
//
// `ParallelFor(pool, n, make_body)` runs `body(i)` for every i in [0, n): the caller takes items
// itself and asks the pool for helpers, which take items while any are left: one at a time, or
// with `in_runs` runs of consecutive items, each half of an even share of what is left (long
// runs first, single items at the end, so a helper that starts late still evens the load; as
// OpenMP's guided schedule). The matmuls want runs:
// neighbouring panels of a weight matrix are neighbours in memory, and when two cores took
// alternate ones each core's prefetcher streamed the other's too (measured: half the weights
// per second of two contiguous halves; batch-1 int8 decode 190 -> 231 tok/s). A helper the pool
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
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace minivllm {

template <typename MakeBody>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const MakeBody& make_body, bool in_runs = false) {
  if (n <= 0) return;
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  // Shared with the helpers, which may start after this call returns: they own it too.
  auto progress = std::make_shared<Progress>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  const int64_t shares = in_runs ? 2 * (helpers + 1) : 0;
  // The next run [i, end) to work on; i >= n when all are taken.
  auto take = [n, shares](Progress& p, int64_t* end) {
    int64_t i = p.next.load(std::memory_order_relaxed);
    while (i < n) {
      const int64_t run = shares ? std::max<int64_t>(1, (n - i) / shares) : 1;
      if (p.next.compare_exchange_weak(i, i + run, std::memory_order_relaxed)) {
        *end = std::min(n, i + run);
        return i;
      }
    }
    return i;
  };
  auto work = [n, take](Progress& p, const MakeBody& make) {
    int64_t end;
    int64_t i = take(p, &end);
    if (i >= n) return;  // all taken: do not touch `make`, the caller may be gone
    auto body = make();
    for (; i < n; i = take(p, &end)) {
      for (int64_t j = i; j < end; ++j) body(j);
      p.done.fetch_add(end - i, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([progress, work, &make_body] { work(*progress, make_body); });
  }
  work(*progress, make_body);
  while (progress->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Rows of x, for the matmuls of few rows: [0, T) in passes of up to kRowsPerPass rows, each
// pass a compile-time row count so that its accumulators stay in registers:
// `pass(std::integral_constant<int, rows>{}, first_row)`.
constexpr int kRowsPerPass = 4;

template <typename Pass>
void ForRowPasses(int64_t T, const Pass& pass) {
  for (int64_t t0 = 0; t0 < T; t0 += kRowsPerPass) {
    switch (std::min<int64_t>(kRowsPerPass, T - t0)) {
      case 1: pass(std::integral_constant<int, 1>{}, t0); break;
      case 2: pass(std::integral_constant<int, 2>{}, t0); break;
      case 3: pass(std::integral_constant<int, 3>{}, t0); break;
      default: pass(std::integral_constant<int, 4>{}, t0); break;
    }
  }
}

}  // namespace minivllm

#endif  // MINIVLLM_KERNELS_PARALLEL_H_
