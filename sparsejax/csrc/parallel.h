// Work sharing on XLA:CPU's intra-op thread pool, for the kernels of fused_update.cc and
// topk_select.cc.

#ifndef SPARSEJAX_CSRC_PARALLEL_H_
#define SPARSEJAX_CSRC_PARALLEL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace sparsejax {

// Runs fn(t) for t in [0, tasks) on the intra-op pool and the calling thread together. Tasks are
// claimed from a shared counter, so the calling thread can run all of them itself and only ever
// waits for tasks that another thread has started: no deadlock when every pool thread is busy
// (e.g. running this same kernel for another device). A pool thread that starts after all tasks
// are claimed returns at once; the counters it touches live on the heap, not on this stack.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t tasks, Fn fn) {
  if (tasks <= 1) {
    if (tasks == 1) fn(0);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  Fn* body = &fn;  // only used for claimed tasks, all of which finish before this function returns
  auto work = [shared, tasks, body] {
    for (int64_t t; (t = shared->next.fetch_add(1)) < tasks;) {
      (*body)(t);
      if (shared->done.fetch_add(1) + 1 == tasks) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    }
  };
  for (int64_t t = 0; t + 1 < tasks; ++t) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == tasks; });
}

// Number of threads for a buffer of n values: the intra-op pool's, or 1 below 256K values (where
// a second thread costs more than it saves).
inline int64_t Threads(xla::ffi::ThreadPool& pool, int64_t n) {
  const int64_t threads = pool.num_threads();
  return (threads < 1 || n < (int64_t{1} << 18)) ? 1 : threads;
}

}  // namespace sparsejax

#endif  // SPARSEJAX_CSRC_PARALLEL_H_
