// Exact top-k by magnitude for XLA:CPU (radix select), called through the XLA FFI.
//
// The key of a value is its bit pattern with the sign cleared (left-aligned to 31 bits for 16-bit
// floats): for finite values, |a| < |b| exactly when key(a) < key(b). The k-th largest key is
// found digit by digit, most significant first: 11 bits (the exponent and 3 mantissa bits), then
// 10, then 10. Each digit is one histogram over the keys whose higher digits match the ones chosen
// so far, per thread, merged, and scanned from the top for the bucket holding the k-th largest.
//
// Passes over the buffer: one histogram pass over all n values; then, as soon as the keys at or
// above the chosen bucket number at most k + n/8 (any input but a few pathological ones: a narrow
// range of values, most of them equal), one compaction pass copies those (key, index) pairs, in
// index order, into a buffer, and the remaining digits are found on that buffer alone. Otherwise
// the next digit is another histogram pass over the buffer (three at most), and a last pass
// writes the selection directly. Either way the output is exact: every key above the k-th largest,
// then as many keys equal to it as are missing, the lowest indices first; indices in increasing
// order. Per-thread counts from the histograms give every thread its output offset, so the
// passes run on XLA's intra-op pool and the result does not depend on the thread count.
//
// Kernels:
//   SparsejaxTopK          x (f32/bf16/f16)[n] -> values (x's dtype)[k], indices s32[k]
//   SparsejaxTopKFeedback  x f32[n], r f32[n] -> values f32[k], indices s32[k], new_r f32[n]
//                          acc = x + r is selected from; new_r = acc with the selection zeroed
//                          (new_r may alias r). acc is written in the histogram pass itself.
//   SparsejaxScatterAdd    values f32[m], indices s32[m] -> out f32[n]: zeros, then out[i] += v
//                          in order (indices outside [0, n) are skipped, as XLA's scatter does).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <functional>
#include <vector>

#include <sys/mman.h>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using sparsejax::ParallelFor;
using sparsejax::Threads;

constexpr int kLevels = 3;
constexpr int kShift[kLevels] = {20, 10, 0};  // lowest bit of each digit
constexpr int kBits[kLevels] = {11, 10, 10};
constexpr int kMaxBins = 2048;
constexpr int64_t kBlock = 256;  // keys computed per block, then histogrammed

inline uint32_t KeyOf(uint32_t bits) { return bits & 0x7fffffffu; }
inline uint32_t KeyOf(uint16_t bits) { return static_cast<uint32_t>(bits & 0x7fffu) << 16; }
inline uint32_t FloatKey(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b & 0x7fffffffu;
}

inline uint32_t Digit(uint32_t key, int level) {
  return (key >> kShift[level]) & ((1u << kBits[level]) - 1);
}
// Whether `key`'s digits above `level` are `prefix` (every key at level 0).
inline bool InChain(uint32_t key, int level, uint32_t prefix) {
  return level == 0 || (key >> kShift[level - 1]) == prefix;
}

// Histogram of the digit at `level` of the keys in [lo, hi) on the chain `prefix`, added to h.
// keys(lo, m, buf) writes the m keys from lo into buf and returns the largest.
template <typename Keys>
void HistRange(Keys& keys, int64_t lo, int64_t hi, int level, uint32_t prefix, uint32_t* h) {
  uint32_t buf[kBlock];
  if (level == 0) {
    // Four interleaved histograms: runs of equal digits (common: most values share a few
    // exponents) do not wait on each other's increments.
    std::vector<uint32_t> sub(4 * kMaxBins, 0);
    uint32_t* s = sub.data();
    for (int64_t b = lo; b < hi; b += kBlock) {
      const int64_t m = std::min(kBlock, hi - b);
      keys(b, m, buf);
      int64_t j = 0;
      for (; j + 4 <= m; j += 4) {
        ++s[buf[j] >> 20];
        ++s[kMaxBins + (buf[j + 1] >> 20)];
        ++s[2 * kMaxBins + (buf[j + 2] >> 20)];
        ++s[3 * kMaxBins + (buf[j + 3] >> 20)];
      }
      for (; j < m; ++j) ++s[buf[j] >> 20];
    }
    for (int d = 0; d < kMaxBins; ++d) h[d] += s[d] + s[kMaxBins + d] + s[2 * kMaxBins + d] +
                                              s[3 * kMaxBins + d];
    return;
  }
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t m = std::min(kBlock, hi - b);
    keys(b, m, buf);
    for (int64_t j = 0; j < m; ++j) {
      if (InChain(buf[j], level, prefix)) ++h[Digit(buf[j], level)];
    }
  }
}

// The bucket of the `*need`-th largest key given the level's histogram; `*need` becomes the rank
// within that bucket. The histogram holds at least `*need` keys.
int Choose(const std::vector<int64_t>& hist, int64_t* need) {
  int64_t above = 0;
  for (int b = static_cast<int>(hist.size()) - 1; b >= 0; --b) {
    if (above + hist[b] >= *need) {
      *need -= above;
      return b;
    }
    above += hist[b];
  }
  return 0;
}

// Appends (key, index) of every key >= lower in [lo, hi) to ckey/cidx, in index order. Blocks
// whose largest key is below `lower` (almost all) cost one vectorised max.
template <typename Keys>
void CompactRange(Keys& keys, int64_t lo, int64_t hi, uint32_t lower, uint32_t* ckey,
                  int32_t* cidx, int64_t* count) {
  uint32_t buf[kBlock];
  int64_t o = *count;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t m = std::min(kBlock, hi - b);
    if (keys(b, m, buf) < lower) continue;
    for (int64_t j = 0; j < m; ++j) {
      if (buf[j] >= lower) {
        ckey[o] = buf[j];
        cidx[o++] = static_cast<int32_t>(b + j);
      }
    }
  }
  *count = o;
}

// A key that about 2k + 64 * stride of the n keys reach: the (2k/stride + 64)-th largest of a
// sample of 16 consecutive keys every 16 * stride (one cache line in `stride`). 0 when the
// sample is too small to tell.
template <typename Keys>
uint32_t SampleThreshold(Keys& keys, int64_t n, int64_t k, int64_t stride) {
  std::vector<uint32_t> sample;
  sample.reserve(n / stride + 16);
  uint32_t buf[16];
  for (int64_t b = 0; b + 16 <= n; b += 16 * stride) {
    keys(b, 16, buf);
    sample.insert(sample.end(), buf, buf + 16);
  }
  const int64_t rank = 2 * k / stride + 64;
  if (rank >= static_cast<int64_t>(sample.size())) return 0;
  std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<uint32_t>());
  return sample[rank];
}

// Candidate (key, index) pairs, in index order, possibly in several pieces (one per thread).
struct Pieces {
  std::vector<const uint32_t*> key;
  std::vector<const int32_t*> idx;
  std::vector<int64_t> size;
  template <typename Fn>
  void ForEachKey(Fn fn) const {
    for (size_t p = 0; p < size.size(); ++p) {
      for (int64_t i = 0; i < size[p]; ++i) fn(key[p][i]);
    }
  }
};

// Finds the remaining digits (from `level` on) among the candidates, then writes the selection:
// every key above the k-th largest, then `need` keys equal to it, in candidate (index) order.
void FinishFromBuffer(const Pieces& c, int level, uint32_t prefix, int64_t need,
                      int32_t* idx_out) {
  for (; level < kLevels; ++level) {
    std::vector<int64_t> merged(1 << kBits[level], 0);
    c.ForEachKey([&](uint32_t key) {
      if (InChain(key, level, prefix)) ++merged[Digit(key, level)];
    });
    prefix = (prefix << kBits[level]) | static_cast<uint32_t>(Choose(merged, &need));
  }
  const uint32_t kth = prefix;
  int64_t j = 0, ties = 0;
  for (size_t p = 0; p < c.size.size(); ++p) {
    for (int64_t i = 0; i < c.size[p]; ++i) {
      const uint32_t key = c.key[p][i];
      if (key > kth || (key == kth && ties++ < need)) idx_out[j++] = c.idx[p][i];
    }
  }
}

// [0, n) cut into `threads` ranges, their edges on 64-byte lines (no false sharing).
struct Split {
  int64_t n, threads;
  int64_t operator()(int64_t t) const { return t == threads ? n : n * t / threads / 16 * 16; }
};

// The sampled pass over [lo, hi): appends (key, index) of every key >= guess to key/idx (grown
// as needed), in index order, and returns their number; -1 once more than `cap` (then the rest
// of the range only runs `first`, which may write).
template <typename First>
int64_t CopyAbove(First& first, int64_t lo, int64_t hi, uint32_t guess, int64_t cap,
                  std::vector<uint32_t>& key, std::vector<int32_t>& idx) {
  // Counting first would cost a second pass; grow the lists instead. Blocks of 64: most hold no
  // candidate and cost one vectorised max; the others append without branches.
  constexpr int64_t kSmall = 64;
  int64_t o = 0;
  uint32_t buf[kSmall];
  for (int64_t b = lo; b < hi; b += kSmall) {
    const int64_t m = std::min(kSmall, hi - b);
    if (first(b, m, buf) < guess) continue;
    if (o + kSmall > static_cast<int64_t>(key.size())) {
      if (o > cap) {  // far too many: stop copying, finish the pass (it may write)
        for (b += kSmall; b < hi; b += kSmall) first(b, std::min(kSmall, hi - b), buf);
        return -1;
      }
      key.resize(2 * key.size());
      idx.resize(key.size());
    }
    uint32_t* kp = key.data();
    int32_t* ip = idx.data();
    for (int64_t j = 0; j < m; ++j) {
      kp[o] = buf[j];
      ip[o] = static_cast<int32_t>(b + j);
      o += buf[j] >= guess ? 1 : 0;
    }
  }
  return o;
}

// Fast path (one pass, running `first` on every key): a threshold from a 1/512 sample that ~2k
// keys reach; the pass copies the keys at or above it; if they number between k and `cap`, the
// radix select runs on them alone and writes idx_out: true. False: the histogram passes follow.
template <typename Sample, typename First>
bool SampledPass(ffi::ThreadPool& pool, const Split& split, int64_t k, int64_t cap,
                 Sample& sample, First& first, int32_t* idx_out) {
  constexpr int64_t kStride = 512;
  const int64_t threads = split.threads;
  const uint32_t guess = SampleThreshold(sample, split.n, k, kStride);
  std::vector<std::vector<uint32_t>> tkey(threads);
  std::vector<std::vector<int32_t>> tidx(threads);
  std::vector<int64_t> tcount(threads, 0);
  ParallelFor(pool, threads, [&](int64_t t) {
    tkey[t].resize(4 * k / threads + 1024);
    tidx[t].resize(tkey[t].size());
    tcount[t] = CopyAbove(first, split(t), split(t + 1), guess, cap, tkey[t], tidx[t]);
  });
  int64_t count = 0;
  for (int64_t t = 0; t < threads; ++t) {
    if (tcount[t] < 0) return false;
    count += tcount[t];
  }
  if (count < k || count > cap) return false;
  Pieces c;
  for (int64_t t = 0; t < threads; ++t) {
    c.key.push_back(tkey[t].data());
    c.idx.push_back(tidx[t].data());
    c.size.push_back(tcount[t]);
  }
  FinishFromBuffer(c, 0, 0, k, idx_out);
  return true;
}

// The radix select over the whole buffer so far: the digits of the k-th largest key chosen
// (`prefix`), how many keys equal to it the selection still needs (`need`), and per thread's
// range the keys above the chosen bucket (`above`) and in it (`inb`).
struct Radix {
  uint32_t prefix;
  int64_t need;
  std::vector<int64_t> above, inb;
};

// One histogram pass at `level` over the whole buffer (per thread, merged): chooses the digit
// and updates r. Returns the number of keys at or above the chosen bucket.
template <typename Keys>
int64_t HistogramLevel(ffi::ThreadPool& pool, const Split& split, Keys& keys, int level,
                       std::vector<uint32_t>& hist, Radix* r) {
  const int64_t threads = split.threads;
  std::fill(hist.begin(), hist.end(), 0u);
  ParallelFor(pool, threads, [&](int64_t t) {
    HistRange(keys, split(t), split(t + 1), level, r->prefix, &hist[t * kMaxBins]);
  });
  const int bins = 1 << kBits[level];
  std::vector<int64_t> merged(bins, 0);
  for (int64_t t = 0; t < threads; ++t) {
    for (int b = 0; b < bins; ++b) merged[b] += hist[t * kMaxBins + b];
  }
  const int chosen = Choose(merged, &r->need);
  r->prefix = (r->prefix << kBits[level]) | static_cast<uint32_t>(chosen);
  int64_t count = 0;
  for (int64_t t = 0; t < threads; ++t) {
    int64_t s = 0;
    for (int b = chosen + 1; b < bins; ++b) s += hist[t * kMaxBins + b];
    r->above[t] += s;
    r->inb[t] = hist[t * kMaxBins + chosen];
    count += r->above[t] + r->inb[t];
  }
  return count;
}

// Compaction after the histogram at `level`: the `count` keys >= the chosen bucket's lowest key,
// in index order (at offsets from the per-thread counts), then the remaining digits on them.
template <typename Keys>
void CompactAndFinish(ffi::ThreadPool& pool, const Split& split, Keys& keys, int level,
                      const Radix& r, int64_t count, int32_t* idx_out) {
  const int64_t threads = split.threads;
  std::vector<uint32_t> ckey(count);
  std::vector<int32_t> cidx(count);
  std::vector<int64_t> off(threads + 1, 0);
  for (int64_t t = 0; t < threads; ++t) off[t + 1] = off[t] + r.above[t] + r.inb[t];
  ParallelFor(pool, threads, [&](int64_t t) {
    int64_t o = off[t];
    CompactRange(keys, split(t), split(t + 1), r.prefix << kShift[level], ckey.data(),
                 cidx.data(), &o);
  });
  Pieces c;
  c.key.push_back(ckey.data());
  c.idx.push_back(cidx.data());
  c.size.push_back(count);
  FinishFromBuffer(c, level + 1, r.prefix, r.need, idx_out);
}

// Histogram passes over the whole buffer (the first by `first` unless `first_done`), level by
// level, until the keys at or above the chosen bucket fit in `cap`: compaction then finishes the
// selection (true). False: every digit came from the whole buffer, and r holds them.
template <typename First, typename Keys>
bool HistogramPasses(ffi::ThreadPool& pool, const Split& split, int64_t cap, bool first_done,
                     First& first, Keys& keys, Radix* r, int32_t* idx_out) {
  std::vector<uint32_t> hist(split.threads * kMaxBins);
  for (int level = 0; level < kLevels; ++level) {
    const int64_t count = level == 0 && !first_done
                              ? HistogramLevel(pool, split, first, level, hist, r)
                              : HistogramLevel(pool, split, keys, level, hist, r);
    if (level + 1 < kLevels && count <= cap) {
      CompactAndFinish(pool, split, keys, level, *r, count, idx_out);
      return true;
    }
  }
  return false;
}

// The last pass when every digit came from the whole buffer: r.above[t] keys > the k-th largest
// in thread t's range, r.inb[t] equal to it; the ties go to the lowest indices.
template <typename Keys>
void WriteSelection(ffi::ThreadPool& pool, const Split& split, Keys& keys, const Radix& r,
                    int32_t* idx_out) {
  const int64_t threads = split.threads;
  const uint32_t kth = r.prefix;
  std::vector<int64_t> quota(threads), off(threads + 1, 0);
  int64_t left = r.need;
  for (int64_t t = 0; t < threads; ++t) {
    quota[t] = std::min(r.inb[t], left);
    left -= quota[t];
    off[t + 1] = off[t] + r.above[t] + quota[t];
  }
  ParallelFor(pool, threads, [&](int64_t t) {
    uint32_t buf[kBlock];
    int64_t o = off[t], ties = 0;
    for (int64_t b = split(t); b < split(t + 1); b += kBlock) {
      const int64_t m = std::min(kBlock, split(t + 1) - b);
      keys(b, m, buf);
      for (int64_t j = 0; j < m; ++j) {
        if (buf[j] > kth || (buf[j] == kth && ties++ < quota[t])) {
          idx_out[o++] = static_cast<int32_t>(b + j);
        }
      }
    }
  });
}

// Selects the k largest keys of n. first(lo, m, buf) gives the keys in the first pass over the
// whole buffer (it may also write, e.g. acc = x + r, so it runs exactly once on every element),
// keys(lo, m, buf) in later passes, sample(lo, m, buf) before the first (it must not write).
// Writes k increasing indices.
//
// The sampled pass first (see SampledPass), unless n is small or k > n/16; where it does not
// finish the selection, the histogram passes, each level over the whole buffer until the keys
// at or above the chosen bucket fit in k + n/8; where none does, a last pass writes them.
template <typename Sample, typename First, typename Keys>
void SelectTopK(ffi::ThreadPool& pool, int64_t n, int64_t k, Sample sample, First first,
                Keys keys, int32_t* idx_out) {
  const Split split{n, Threads(pool, n)};
  const int64_t cap = k + n / 8;
  bool first_done = false;
  if (n >= (int64_t{1} << 16) && k <= n / 16) {
    if (SampledPass(pool, split, k, cap, sample, first, idx_out)) return;
    first_done = true;
  }
  Radix r{0, k, std::vector<int64_t>(split.threads, 0), std::vector<int64_t>(split.threads, 0)};
  if (HistogramPasses(pool, split, cap, first_done, first, keys, &r, idx_out)) return;
  WriteSelection(pool, split, keys, r, idx_out);
}

// Asks for transparent huge pages on [p, p + bytes) (whole 2 MB pages inside it). XLA:CPU hands a
// fresh buffer of n values to every call; its first touch then costs a page fault per 4 KB (more
// than the zeroing itself) or, with this, one per 2 MB. Only where THP is in "madvise" mode does
// it change anything; errors are ignored (it is a hint). Measured there (a probe removed once
// answered: experiments/bench_hugepages.py at commit 59ec3fc (git show 59ec3fc:experiments/bench_hugepages.py), 100 MiB output, 3 processes):
// the scatter-add takes 0.29-0.31x the time without it.
void HugePages(void* p, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
}

// The key blocks the passes read: keys(lo, m, buf) writes key_at(i) for i in [lo, lo + m) into
// buf and returns the largest (one vectorised loop; key_at may also write, as `first` does).
template <typename KeyAt>
auto KeyBlocks(KeyAt key_at) {
  return [key_at](int64_t lo, int64_t m, uint32_t* buf) {
    uint32_t top = 0;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < m; ++j) {
      buf[j] = key_at(lo + j);
      top = std::max(top, buf[j]);
    }
    return top;
  };
}

template <typename Raw>
void SelectRaw(ffi::ThreadPool& pool, const void* data, void* values, int64_t n, int64_t k,
               int32_t* idx) {
  const Raw* x = static_cast<const Raw*>(data);
  auto keys = KeyBlocks([x](int64_t i) { return KeyOf(x[i]); });
  SelectTopK(pool, n, k, keys, keys, keys, idx);
  Raw* v = static_cast<Raw*>(values);
  for (int64_t j = 0; j < k; ++j) v[j] = x[idx[j]];
}

ffi::Error CheckSizes(int64_t n, int64_t k, int64_t k2) {
  if (k < 1 || k > n || k != k2 || n > INT32_MAX) {
    return ffi::Error::InvalidArgument("top-k: need 1 <= k <= n < 2**31 and as many values as "
                                       "indices, got n=" + std::to_string(n) + ", k=" +
                                       std::to_string(k) + " and " + std::to_string(k2));
  }
  return ffi::Error::Success();
}

ffi::Error TopKImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> values,
                    ffi::ResultBuffer<ffi::S32> indices) {
  const int64_t n = x.element_count(), k = indices->element_count();
  if (auto e = CheckSizes(n, k, values->element_count()); e.failure()) return e;
  if (values->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("top-k: values must have the input's dtype");
  }
  int32_t* idx = indices->typed_data();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      SelectRaw<uint32_t>(pool, x.untyped_data(), values->untyped_data(), n, k, idx);
      break;
    case ffi::DataType::BF16:
    case ffi::DataType::F16:
      SelectRaw<uint16_t>(pool, x.untyped_data(), values->untyped_data(), n, k, idx);
      break;
    default:
      return ffi::Error::InvalidArgument("top-k: the kernel takes float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

ffi::Error TopKFeedbackImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> r, ffi::ResultBuffer<ffi::F32> values,
                            ffi::ResultBuffer<ffi::S32> indices,
                            ffi::ResultBuffer<ffi::F32> new_r) {
  const int64_t n = x.element_count(), k = indices->element_count();
  if (auto e = CheckSizes(n, k, values->element_count()); e.failure()) return e;
  if (static_cast<int64_t>(r.element_count()) != n ||
      static_cast<int64_t>(new_r->element_count()) != n) {
    return ffi::Error::InvalidArgument("top-k feedback: residual of the wrong length");
  }
  const float* g = x.typed_data();
  const float* res = r.typed_data();  // may be the same memory as acc (aliased)
  float* acc = new_r->typed_data();
  if (acc != res) HugePages(acc, n * sizeof(float));  // a fresh buffer: first touch below
  auto first = KeyBlocks([=](int64_t i) {  // writes acc: runs once on every element
    const float a = g[i] + res[i];
    acc[i] = a;
    return FloatKey(a);
  });
  auto keys = KeyBlocks([=](int64_t i) { return FloatKey(acc[i]); });
  auto sample = KeyBlocks([=](int64_t i) { return FloatKey(g[i] + res[i]); });  // no writes
  int32_t* idx = indices->typed_data();
  SelectTopK(pool, n, k, sample, first, keys, idx);
  float* v = values->typed_data();
  for (int64_t j = 0; j < k; ++j) {
    v[j] = acc[idx[j]];
    acc[idx[j]] = 0.0f;
  }
  return ffi::Error::Success();
}

ffi::Error ScatterAddImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> values,
                          ffi::Buffer<ffi::S32> indices, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t m = values.element_count(), n = out->element_count();
  if (static_cast<int64_t>(indices.element_count()) != m) {
    return ffi::Error::InvalidArgument("scatter-add: " + std::to_string(m) + " values but " +
                                       std::to_string(indices.element_count()) + " indices");
  }
  float* o = out->typed_data();
  HugePages(o, n * sizeof(float));
  const int64_t threads = Threads(pool, n);
  ParallelFor(pool, threads, [&](int64_t t) {
    const int64_t lo = n * t / threads / 16 * 16;
    const int64_t hi = t + 1 == threads ? n : n * (t + 1) / threads / 16 * 16;
    std::fill(o + lo, o + hi, 0.0f);
  });
  const float* v = values.typed_data();
  const int32_t* i = indices.typed_data();
  for (int64_t j = 0; j < m; ++j) {
    if (i[j] >= 0 && i[j] < n) o[i[j]] += v[j];
  }
  return ffi::Error::Success();
}

// Every handler runs its loops on XLA's intra-op thread pool.
auto OnPool() { return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(); }
using F32Buffer = ffi::Buffer<ffi::F32>;
using S32Buffer = ffi::Buffer<ffi::S32>;

}  // namespace

// x (float32, bfloat16 or float16) -> (its top-k values, their indices).
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxTopK, TopKImpl,
                              OnPool().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<S32Buffer>());

// (x, residual) -> (the top-k of x + residual, their indices, x + residual with them zeroed).
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxTopKFeedback, TopKFeedbackImpl,
                              OnPool().Arg<F32Buffer>().Arg<F32Buffer>()
                                  .Ret<F32Buffer>().Ret<S32Buffer>().Ret<F32Buffer>());

// (values, indices) -> a dense buffer with the values added at their indices.
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxScatterAdd, ScatterAddImpl,
                              OnPool().Arg<F32Buffer>().Arg<S32Buffer>().Ret<F32Buffer>());
