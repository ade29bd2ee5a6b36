// Fused optimizer updates for XLA:CPU, called through the XLA FFI (jax.ffi.ffi_call).
//
// Each kernel does the whole update of one parameter tensor (a "segment") at once: for LARS and
// LAMB the per-tensor norms first, then the elementwise update while the tensor is still in cache.
// XLA cannot fuse a reduction with the elementwise pass that consumes it, so on CPU it reads the
// big buffers twice from memory; here the second read mostly hits the cache.
//
// Two layouts of the same segments (sparsejax/cpu_kernels.py builds the calls):
//   flat: one float32 buffer each for the gradient, the params and the updates, laid out by a
//         sparsejax FlatLayout: `starts` (int64[S + 1]) cuts it into the leaves and the padding
//         between them;
//   tree: one float32 buffer per leaf for the gradient, the params and the updates (the optax
//         drop-in face: no ravel into a flat buffer and back); padding segments are skipped.
// The optimizer state is always flat (one buffer per moment, laid out by `starts`).
// `decay_mask` (float[S]) multiplies the weight decay of each segment (1 where it applies, 0 where
// masked and in padding); `flags` (int32[S]): bit 0 set for a real parameter tensor, bit 1 where
// the trust ratio applies. Every hyperparameter is a traced scalar (so that optax's
// inject_hyperparams can change it without recompiling): they come in a small float32 buffer, in
// the order each kernel's `*Impl` documents, the skip flag last.
//
// Operands: scalars, then the state buffers, the gradient leaves, the param leaves (when the
// update reads params). Results: the new state buffers (aliased to the old ones), then the
// updates (aliased to the gradient). Work is spread over the XLA:CPU intra-op thread pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using sparsejax::ParallelFor;
using sparsejax::Threads;

constexpr int kReal = 1;
constexpr int kTrust = 2;
constexpr int64_t kBlock = 1024;
constexpr int64_t kLanes = 32;
constexpr int64_t kSplit = int64_t{1} << 17;  // 512 KB of float32
constexpr int kMaxState = 2;

// One segment: pointers to its first value in every buffer the update touches.
struct Seg {
  const float* g;
  const float* p;  // null when the update does not read params
  float* u;
  const float* in[kMaxState];
  float* out[kMaxState];
  int64_t n;
  float decay;
  int32_t flags;
};

// A segment's buffers under the names the updates use: the gradient, the params, the first
// state buffer (the momentum trace, or Adam's first moment) and the second (Adam's second
// moment; null for SGD and LARS) in and out, the update, and the segment's weight decay.
struct Buffers {
  const float* g;
  const float* p;
  const float* m_in;
  const float* v_in;
  float* m_out;
  float* v_out;
  float* u;
  float d;
  explicit Buffers(const Seg& s)
      : g(s.g), p(s.p), m_in(s.in[0]), v_in(s.in[1]), m_out(s.out[0]), v_out(s.out[1]), u(s.u),
        d(s.decay) {}
};

// Sums of squares of the two values f(i, x, y) gives for i in [lo, hi): kLanes float partial sums
// (several independent vector accumulators) within blocks of kBlock values, double across blocks
// (accurate for tensors of millions of values).
template <typename F>
inline void SumSquares2(int64_t lo, int64_t hi, F f, double* out_a, double* out_b) {
  double sa = 0.0, sb = 0.0;
  for (int64_t blo = lo; blo < hi; blo += kBlock) {
    const int64_t bhi = blo + kBlock < hi ? blo + kBlock : hi;
    float a[kLanes] = {0.0f}, b[kLanes] = {0.0f};
    int64_t i = blo;
    for (; i + kLanes <= bhi; i += kLanes) {
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) {
        float x, y;
        f(i + j, x, y);
        a[j] += x * x;
        b[j] += y * y;
      }
    }
    for (; i < bhi; ++i) {
      float x, y;
      f(i, x, y);
      a[0] += x * x;
      b[0] += y * y;
    }
    for (int64_t j = 0; j < kLanes; ++j) {
      sa += a[j];
      sb += b[j];
    }
  }
  *out_a = sa;
  *out_b = sb;
}

// optax.scale_by_trust_ratio's factor: 1 where masked, padding, or either norm is zero.
inline float TrustRatio(int flags, double pn2, double un2, float coeff, float eps) {
  if (!(flags & kTrust) || !(flags & kReal)) return 1.0f;
  float pn = std::sqrt(static_cast<float>(pn2)), un = std::sqrt(static_cast<float>(un2));
  if (pn == 0.0f || un == 0.0f) return 1.0f;
  return coeff * pn / (un + eps);
}

// Runs body(seg) for the segments in `list`, cut into `threads` runs of about equal size.
template <typename Body>
void ForSegments(ffi::ThreadPool& pool, const std::vector<const Seg*>& list, int64_t threads,
                 Body body) {
  int64_t total = 0;
  for (const Seg* s : list) total += s->n;
  std::vector<size_t> cut(threads + 1, list.size());
  cut[0] = 0;
  size_t k = 0;
  int64_t done = 0;
  for (int64_t t = 1; t < threads; ++t) {
    while (k < list.size() && done + list[k]->n <= total * t / threads) done += list[k++]->n;
    cut[t] = k;
  }
  ParallelFor(pool, threads, [&](int64_t t) {
    for (size_t j = cut[t]; j < cut[t + 1]; ++j) body(*list[j]);
  });
}

int64_t TotalSize(const std::vector<Seg>& segs) {
  int64_t n = 0;
  for (const Seg& s : segs) n += s.n;
  return n;
}

// One pass: body(seg, lo, hi) for every segment, over [0, seg.n).
template <typename Body>
void OnePass(ffi::ThreadPool& pool, const std::vector<Seg>& segs, Body body) {
  std::vector<const Seg*> all;
  for (const Seg& s : segs) all.push_back(&s);
  ForSegments(pool, all, Threads(pool, TotalSize(segs)),
              [&](const Seg& s) { body(s, int64_t{0}, s.n); });
}

// Two passes: norms(seg, lo, hi, &a, &b) sums squares over [lo, hi), then apply(seg, lo, hi, a, b)
// with the whole segment's sums. Segments of at least kSplit values are split across the threads
// (both passes, in turn), so that the second pass finds the segment in the shared L3 cache; two
// threads on two big segments at once would evict each other's. Smaller segments (they fit in a
// core's L2) are spread over the threads whole.
template <typename Norms, typename Apply>
void TwoPass(ffi::ThreadPool& pool, const std::vector<Seg>& segs, Norms norms, Apply apply) {
  const int64_t threads = Threads(pool, TotalSize(segs));
  std::vector<const Seg*> whole, split;
  for (const Seg& s : segs) (threads > 1 && s.n >= kSplit ? split : whole).push_back(&s);
  ForSegments(pool, whole, threads, [&](const Seg& s) {
    double a, b;
    norms(s, 0, s.n, &a, &b);
    apply(s, 0, s.n, a, b);
  });
  std::vector<double> part_a(threads), part_b(threads);
  for (const Seg* s : split) {
    auto bound = [&](int64_t t) {  // chunk edges on 64-byte lines (no false sharing)
      return t == threads ? s->n : s->n * t / threads / 16 * 16;
    };
    ParallelFor(pool, threads, [&](int64_t t) {
      norms(*s, bound(t), bound(t + 1), &part_a[t], &part_b[t]);
    });
    double a = 0.0, b = 0.0;
    for (int64_t t = 0; t < threads; ++t) {
      a += part_a[t];
      b += part_b[t];
    }
    ParallelFor(pool, threads, [&](int64_t t) { apply(*s, bound(t), bound(t + 1), a, b); });
  }
}

// The `num_state` state buffers (operands and results 0 .. num_state - 1), `padded` values each.
ffi::Error DecodeState(ffi::RemainingArgs args, ffi::RemainingRets rets, int num_state,
                       int64_t padded, const float** in, float** out) {
  for (int i = 0; i < num_state; ++i) {
    auto a = args.get<ffi::Buffer<ffi::F32>>(i);
    auto r = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (a.has_error()) return a.error();
    if (r.has_error()) return r.error();
    if (static_cast<int64_t>(a->element_count()) != padded ||
        static_cast<int64_t>((*r)->element_count()) != padded) {
      return ffi::Error::InvalidArgument("fused update: state buffer of the wrong length");
    }
    in[i] = a->typed_data();
    out[i] = (*r)->typed_data();
  }
  return ffi::Error::Success();
}

// Points `seg` at its values in gradient, update (and, when `has_params`, params) leaf j, which
// must hold `want` values; `at`: the segment's offset inside them (the flat layout's one buffer).
ffi::Error DecodeLeaf(ffi::RemainingArgs args, ffi::RemainingRets rets, int num_state,
                      int64_t leaves, int64_t j, int64_t at, int64_t want, bool has_params,
                      Seg* seg) {
  auto g = args.get<ffi::Buffer<ffi::F32>>(num_state + j);
  auto u = rets.get<ffi::Buffer<ffi::F32>>(num_state + j);
  if (g.has_error()) return g.error();
  if (u.has_error()) return u.error();
  if (static_cast<int64_t>(g->element_count()) != want ||
      static_cast<int64_t>((*u)->element_count()) != want) {
    return ffi::Error::InvalidArgument("fused update: leaf " + std::to_string(j) + " has " +
                                       std::to_string(g->element_count()) +
                                       " values, the segment table says " +
                                       std::to_string(want));
  }
  seg->g = g->typed_data() + at;
  seg->u = (*u)->typed_data() + at;
  if (has_params) {
    auto p = args.get<ffi::Buffer<ffi::F32>>(num_state + leaves + j);
    if (p.has_error()) return p.error();
    if (static_cast<int64_t>(p->element_count()) != want) {
      return ffi::Error::InvalidArgument("fused update: params leaf of the wrong length");
    }
    seg->p = p->typed_data() + at;
  }
  return ffi::Error::Success();
}

// Decodes the operands into segments. `num_state` state buffers, then the gradient leaves, then
// the param leaves when `has_params`; results: the new state, then the update leaves.
ffi::Error Decode(ffi::RemainingArgs args, ffi::RemainingRets rets,
                  ffi::Span<const int64_t> starts, ffi::Span<const float> decay,
                  ffi::Span<const int32_t> flags, float weight_decay, int num_state,
                  bool has_params, bool flat, std::vector<Seg>* segs) {
  const int64_t num_segments = static_cast<int64_t>(starts.size()) - 1;
  if (num_segments < 1 || static_cast<int64_t>(decay.size()) != num_segments ||
      static_cast<int64_t>(flags.size()) != num_segments || starts[0] != 0) {
    return ffi::Error::InvalidArgument("fused update: malformed segment table");
  }
  const int64_t padded = starts[num_segments];
  int64_t num_real = 0;
  for (int64_t s = 0; s < num_segments; ++s) num_real += (flags[s] & kReal) ? 1 : 0;
  const int64_t leaves = flat ? 1 : num_real;
  const int64_t want_args = num_state + leaves * (has_params ? 2 : 1);
  if (static_cast<int64_t>(args.size()) != want_args ||
      static_cast<int64_t>(rets.size()) != num_state + leaves) {
    return ffi::Error::InvalidArgument(
        "fused update: expected " + std::to_string(want_args) + " operands and " +
        std::to_string(num_state + leaves) + " results, got " + std::to_string(args.size()) +
        " and " + std::to_string(rets.size()));
  }
  const float* in[kMaxState] = {nullptr, nullptr};
  float* out[kMaxState] = {nullptr, nullptr};
  if (auto e = DecodeState(args, rets, num_state, padded, in, out); e.failure()) return e;
  int64_t leaf = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t lo = starts[s], n = starts[s + 1] - lo;
    if (!flat && !(flags[s] & kReal)) continue;  // tree: padding exists only in the state
    Seg seg{nullptr, nullptr, nullptr, {nullptr, nullptr}, {nullptr, nullptr}, n,
            weight_decay * decay[s], flags[s]};
    // flat: the segment sits at `lo` in the one buffer; tree: it is leaf `leaf`, whole.
    if (auto e = DecodeLeaf(args, rets, num_state, leaves, flat ? 0 : leaf++, flat ? lo : 0,
                            flat ? padded : n, has_params, &seg);
        e.failure()) {
      return e;
    }
    for (int i = 0; i < num_state; ++i) {
      seg.in[i] = in[i] + lo;
      seg.out[i] = out[i] + lo;
    }
    segs->push_back(seg);
  }
  return ffi::Error::Success();
}

ffi::Error CheckScalars(ffi::Buffer<ffi::F32>& scalars, int64_t want) {
  if (static_cast<int64_t>(scalars.element_count()) != want) {
    return ffi::Error::InvalidArgument("fused update: expected " + std::to_string(want) +
                                       " traced scalars, got " +
                                       std::to_string(scalars.element_count()));
  }
  return ffi::Error::Success();
}

// The last traced scalar is the skip flag. Nonzero (a step with a non-finite gradient): zero
// updates and the state left as it is, which costs nothing since it is updated in place.
bool SkipStep(ffi::Buffer<ffi::F32>& scalars, ffi::ThreadPool& pool,
              const std::vector<Seg>& segs) {
  if (scalars.typed_data()[scalars.element_count() - 1] == 0.0f) return false;
  OnePass(pool, segs, [](const Seg& s, int64_t lo, int64_t hi) {
    std::fill(s.u + lo, s.u + hi, 0.0f);
  });
  return true;
}

// The operands every update takes after the pool and the traced scalars, in the order
// SPARSEJAX_BIND (at the end of this file) binds them, and the same passed on.
#define SPARSEJAX_OPERAND_PARAMS                                                          \
  ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> starts,     \
      ffi::Span<const float> decay, ffi::Span<const int32_t> flags, bool flat
#define SPARSEJAX_OPERANDS args, rets, starts, decay, flags, flat

// What `Begin` found: the segments, or `done` with the error to return (Success for a skipped
// step, whose updates are already zeroed).
struct Begun {
  std::vector<Seg> segs;
  bool done = false;
  ffi::Error error;
};

// The start every update shares: the count of traced scalars, the segments (`num_state` state
// buffers; the weight decay is scalar `decay_at`) and the skip flag.
Begun Begin(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& scalars, int64_t num_scalars,
            int decay_at, int num_state, bool has_params, SPARSEJAX_OPERAND_PARAMS) {
  Begun b;
  b.error = CheckScalars(scalars, num_scalars);
  if (b.error.failure()) {
    b.done = true;
    return b;
  }
  b.error = Decode(args, rets, starts, decay, flags, scalars.typed_data()[decay_at], num_state,
                   has_params, flat, &b.segs);
  b.done = b.error.failure() || SkipStep(scalars, pool, b.segs);
  return b;
}

// ---------------------------------------------------------------------------------------- SGD
// v = g + decay * p; t = v + m * trace; u = -lr * (nesterov ? v + m * t : t). State: trace.
template <bool kDecayed>
void SgdRange(const Seg& s, int64_t lo, int64_t hi, float lr, float momentum, bool nesterov) {
  const Buffers b(s);
  const float mn = nesterov ? momentum : 0.0f;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float v = kDecayed ? b.g[i] + b.d * b.p[i] : b.g[i];
    const float t = v + momentum * b.m_in[i];
    b.m_out[i] = t;
    b.u[i] = -lr * (nesterov ? v + mn * t : t);
  }
}

// Scalars: learning rate, momentum, weight decay, skip.
ffi::Error SgdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, SPARSEJAX_OPERAND_PARAMS,
                   bool nesterov, bool decayed) {
  Begun begun = Begin(pool, scalars, 4, 2, 1, decayed, SPARSEJAX_OPERANDS);
  if (begun.done) return begun.error;
  const std::vector<Seg>& segs = begun.segs;
  const float* sc = scalars.typed_data();
  const float lr = sc[0], momentum = sc[1];
  OnePass(pool, segs, [&](const Seg& s, int64_t lo, int64_t hi) {
    if (decayed) {
      SgdRange<true>(s, lo, hi, lr, momentum, nesterov);
    } else {
      SgdRange<false>(s, lo, hi, lr, momentum, nesterov);
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------- LARS
// v = g + decay * p; r = trust ratio of (p, v) per segment; v *= r * -lr; then momentum as SGD.
// Scalars: learning rate, momentum, weight decay, trust coefficient, eps, skip.
ffi::Error LarsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, SPARSEJAX_OPERAND_PARAMS,
                    bool nesterov) {
  Begun begun = Begin(pool, scalars, 6, 2, 1, true, SPARSEJAX_OPERANDS);
  if (begun.done) return begun.error;
  const std::vector<Seg>& segs = begun.segs;
  const float* sc = scalars.typed_data();
  const float lr = sc[0], momentum = sc[1], trust_coefficient = sc[3], eps = sc[4];
  auto norms = [&](const Seg& s, int64_t lo, int64_t hi, double* pn2, double* un2) {
    const Buffers b(s);
    SumSquares2(lo, hi, [&](int64_t i, float& x, float& y) {
      x = b.p[i];
      y = b.g[i] + b.d * b.p[i];
    }, pn2, un2);
  };
  auto apply = [&](const Seg& s, int64_t lo, int64_t hi, double pn2, double un2) {
    const Buffers b(s);
    const float scale = TrustRatio(s.flags, pn2, un2, trust_coefficient, eps) * -lr;
    const float mn = nesterov ? momentum : 0.0f;
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const float v = (b.g[i] + b.d * b.p[i]) * scale;
      const float t = v + momentum * b.m_in[i];
      b.m_out[i] = t;
      b.u[i] = nesterov ? v + mn * t : t;
    }
  };
  TwoPass(pool, segs, norms, apply);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------- Adam
// cm, cg: the first moment's bias-corrected estimate is m * cm (cm = 1 / (1 - b1**t)), with
// Nesterov m * cm + g * cg (cm = b1 / (1 - b1**(t + 1)), cg = (1 - b1) / (1 - b1**t));
// cv = 1 / (1 - b2**t). LAMB has no Nesterov form (cg = 0, unused).
struct Adam {
  float b1, b2, eps, eps_root, cm, cv, cg;
  // Scalars: learning rate, cm, cv, cg, b1, b2, eps, eps_root, weight decay, skip (adamw: the
  // direction's bound before skip).
  static Adam From(const float* sc) { return Adam{sc[4], sc[5], sc[6], sc[7], sc[1], sc[2], sc[3]}; }
  inline float Mu(float g, float mu) const { return (1.0f - b1) * g + b1 * mu; }
  inline float Nu(float g, float nu) const { return (1.0f - b2) * (g * g) + b2 * nu; }
  // optax.scale_by_adam's direction from the updated moments.
  inline float Direction(float m, float v) const {
    return (m * cm) / (std::sqrt(v * cv + eps_root) + eps);
  }
  // The same with Nesterov momentum (reads the gradient too).
  inline float NesterovDirection(float m, float g, float v) const {
    return (m * cm + g * cg) / (std::sqrt(v * cv + eps_root) + eps);
  }
};

// Padding segments (flat layout only): the moments as everywhere (zero gradients there keep them
// zero), u = 0 (0/0 with eps = 0 must not reach the updates).
void MomentsOnly(const Adam& adam, const Seg& s, int64_t lo, int64_t hi) {
  const Buffers b(s);
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    b.m_out[i] = adam.Mu(b.g[i], b.m_in[i]);
    b.v_out[i] = adam.Nu(b.g[i], b.v_in[i]);
    b.u[i] = 0.0f;
  }
}

// AdamW: u = -lr * (adam(g) + decay * p); p is not read when kDecayed is false. adam(g) is
// clipped to [-bound, bound] (infinite but with a frozen second moment: optim.frozen_bound);
// a NaN stays NaN (both comparisons false).
template <bool kDecayed, bool kNesterov>
void AdamwRange(const Adam& adam, const Seg& s, int64_t lo, int64_t hi, float lr, float bound) {
  const Buffers b(s);
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float m = adam.Mu(b.g[i], b.m_in[i]), v = adam.Nu(b.g[i], b.v_in[i]);
    b.m_out[i] = m;
    b.v_out[i] = v;
    float step = kNesterov ? adam.NesterovDirection(m, b.g[i], v) : adam.Direction(m, v);
    step = step > bound ? bound : (step < -bound ? -bound : step);
    b.u[i] = -lr * (kDecayed ? step + b.d * b.p[i] : step);
  }
}

ffi::Error AdamwImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, SPARSEJAX_OPERAND_PARAMS,
                     bool decayed, bool nesterov) {
  // Scalars: learning rate, cm, cv, cg, b1, b2, eps, eps_root, weight decay, bound, skip.
  Begun begun = Begin(pool, scalars, 11, 8, 2, decayed, SPARSEJAX_OPERANDS);
  if (begun.done) return begun.error;
  const std::vector<Seg>& segs = begun.segs;
  const float lr = scalars.typed_data()[0], bound = scalars.typed_data()[9];
  const Adam adam = Adam::From(scalars.typed_data());
  OnePass(pool, segs, [&](const Seg& s, int64_t lo, int64_t hi) {
    if (!(s.flags & kReal)) {
      MomentsOnly(adam, s, lo, hi);
    } else if (nesterov) {
      if (decayed) {
        AdamwRange<true, true>(adam, s, lo, hi, lr, bound);
      } else {
        AdamwRange<false, true>(adam, s, lo, hi, lr, bound);
      }
    } else if (decayed) {
      AdamwRange<true, false>(adam, s, lo, hi, lr, bound);
    } else {
      AdamwRange<false, false>(adam, s, lo, hi, lr, bound);
    }
  });
  return ffi::Error::Success();
}

// LAMB: moments, direction w = adam + decay * p, per-segment ratio ||p|| / ||w||, u = w * r * -lr.
// The first pass writes the moments and w (into u) and sums the squares; the second scales u.
ffi::Error LambImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars,
                    SPARSEJAX_OPERAND_PARAMS) {
  Begun begun = Begin(pool, scalars, 10, 8, 2, true, SPARSEJAX_OPERANDS);
  if (begun.done) return begun.error;
  const std::vector<Seg>& segs = begun.segs;
  const float lr = scalars.typed_data()[0];
  const Adam adam = Adam::From(scalars.typed_data());
  auto norms = [&](const Seg& s, int64_t lo, int64_t hi, double* pn2, double* un2) {
    *pn2 = *un2 = 0.0;
    if (!(s.flags & kReal)) {
      MomentsOnly(adam, s, lo, hi);
      return;
    }
    const Buffers b(s);
    SumSquares2(lo, hi, [&](int64_t i, float& x, float& y) {
      const float m = adam.Mu(b.g[i], b.m_in[i]), v = adam.Nu(b.g[i], b.v_in[i]);
      const float w = adam.Direction(m, v) + b.d * b.p[i];
      b.m_out[i] = m;
      b.v_out[i] = v;
      b.u[i] = w;
      x = b.p[i];
      y = w;
    }, pn2, un2);
  };
  auto apply = [&](const Seg& s, int64_t lo, int64_t hi, double pn2, double un2) {
    if (!(s.flags & kReal)) return;
    float* u = s.u;
    const float scale = TrustRatio(s.flags | kTrust, pn2, un2, 1.0f, 0.0f) * -lr;
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) u[i] *= scale;
  };
  TwoPass(pool, segs, norms, apply);
  return ffi::Error::Success();
}

}  // namespace

#define SPARSEJAX_BIND                                                             \
  ffi::Ffi::Bind()                                                                 \
      .Ctx<ffi::ThreadPool>()                                                      \
      .Arg<ffi::Buffer<ffi::F32>>()                                                \
      .RemainingArgs()                                                             \
      .RemainingRets()                                                             \
      .Attr<ffi::Span<const int64_t>>("starts")                                    \
      .Attr<ffi::Span<const float>>("decay_mask")                                  \
      .Attr<ffi::Span<const int32_t>>("flags")                                     \
      .Attr<bool>("flat")

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxFusedSgd, SgdImpl,
                              SPARSEJAX_BIND.Attr<bool>("nesterov").Attr<bool>("decayed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxFusedLars, LarsImpl,
                              SPARSEJAX_BIND.Attr<bool>("nesterov"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxFusedAdamw, AdamwImpl,
                              SPARSEJAX_BIND.Attr<bool>("decayed").Attr<bool>("nesterov"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxFusedLamb, LambImpl, SPARSEJAX_BIND);
