"""Top-k selection by magnitude on a 1-D array: MSTopK, exact, and DGC's sampled threshold.

Every selector returns exactly `k` `(values, indices)` with `values == x[indices]`, distinct int32
indices, static shapes; all work under `jit` and `vmap` for float32, bfloat16 and float16. Inputs
must be finite (the compression transform checks that before selecting).

`mstopk` has three implementations (`method=`), all returning exactly k distinct indices:
  - on CPU, where `sparsejax.cpu_kernels` are available ("auto" there): an exact radix select in
    C++ (`csrc/topk_select.cc`), about one pass over memory: a threshold from a 1/512 sample, one
    pass copying the keys above it, the exact k-th magnitude found digit by digit on those alone
    (with histogram passes over the whole array for inputs the sample misjudges). Recall 1; ties
    go to the lowest indices;
  - "radix": the same radix select in XLA, built for GPUs (fixed passes, no data-dependent
    loop): one pass of block maxima, the exact k-th largest block maximum by three digit
    histograms, a gather of the blocks that reach it, and the radix select and a one-pass
    compaction on those; the whole array radix-selected where ties leave too many blocks;
  - "search" (the default elsewhere): the paper's threshold search in XLA. On XLA's CPU backend a
    fused reduction over the whole array costs about one memory pass, but anything that
    materialises an array of the input's size (a mask, `abs(x)`, a slice, a cumsum) costs 6-10
    passes. So the search never touches the full array: one pass computes the maximum |x| of each
    block of `block` elements, the search runs on those block maxima, the (few) blocks that can
    hold a top-k element are gathered, and the search and compaction run on those only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from sparsejax import cpu_kernels

__all__ = ["mstopk", "exact_topk", "sampled_topk", "radix_topk", "select_feedback", "METHODS",
           "SELECTORS", "get_selector", "check_k"]

METHODS = ("auto", "search", "radix")
_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

Selector = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]

# Below this size the whole array is the candidate set (no block filtering).
_MIN_BLOCKED = 1 << 16


def check_k(x: jax.Array, k: int) -> tuple[int, int]:
  """Validates a 1-D float input and `k`; returns `(n, k)`. Errors name the bad value."""
  if isinstance(k, bool) or not isinstance(k, int):
    try:
      k = int(k)  # numpy / concrete integers
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
      raise TypeError(f"k must be a static Python int, got {k!r}") from e
  if jnp.ndim(x) != 1:
    raise ValueError(f"top-k selection expects a 1-D array, got shape {jnp.shape(x)}; "
                     "ravel it first (sparsejax.flat.FlatLayout)")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"top-k selection expects a floating dtype, got {x.dtype}")
  n = x.shape[0]
  if not 1 <= k <= n:
    raise ValueError(f"k must satisfy 1 <= k <= n = {n}, got k={k}")
  return n, k


def _count_above(a: jax.Array, t: jax.Array) -> jax.Array:
  """int32: number of elements of `a` strictly above `t`, as one fused reduction.

  `sign(max(a - t, 0))` is 1 where a > t and 0 elsewhere; XLA:CPU vectorises this sum, but not a
  sum of a boolean compare (7x slower). Partial sums stay far below 2**24, so float32 is exact.
  """
  return jnp.sum(jnp.sign(jnp.maximum(a - t, 0.0)), dtype=jnp.float32).astype(jnp.int32)


def _search(a: jax.Array, k: int, lo, c_lo, hi, *, num_iters: int, stop: Callable):
  """Threshold search on `a` (float32, 1-D), the core of MSTopK.

  Invariant: count(a > lo) = c_lo >= k and count(a > hi) = c_hi <= k. Each probe is one fused
  count over `a`. Probes interpolate log(count) linearly between the ends (counts of magnitudes fall
  off roughly exponentially), and bisect whenever the last probe failed to halve the bracket, so the
  search never does worse than bisection every other probe. Stops after `num_iters` probes or when
  `stop(c_lo, c_hi)` holds. Returns `(lo, c_lo, hi, c_hi)`.
  """
  log_k = jnp.log(jnp.float32(k))

  def cond(state):
    i, lo, c_lo, hi, c_hi, _ = state
    return (i < num_iters) & ~stop(c_lo, c_hi) & (hi > lo)

  def body(state):
    i, lo, c_lo, hi, c_hi, width_before = state
    width = hi - lo
    l_lo = jnp.log(c_lo.astype(jnp.float32))
    l_hi = jnp.log(c_hi.astype(jnp.float32) + 0.5)
    frac = jnp.clip((l_lo - log_k) / jnp.maximum(l_lo - l_hi, 1e-6), 1 / 64, 63 / 64)
    frac = jnp.where(width <= 0.5 * width_before, frac, 0.5)
    mid = lo + width * frac
    c = _count_above(a, mid)
    go_up = c >= k
    return (i + 1, jnp.where(go_up, mid, lo), jnp.where(go_up, c, c_lo),
            jnp.where(go_up, hi, mid), jnp.where(go_up, c_hi, c), width)

  c_hi = _count_above(a, hi)
  # Derive the constants from traced values so they carry the same varying mesh axes (shard_map).
  state = (c_hi * 0, lo, c_lo, hi, c_hi, (hi - lo) + jnp.inf)
  _, lo, c_lo, hi, c_hi, _ = lax.while_loop(cond, body, state)
  return lo, c_lo, hi, c_hi


def _initial_lower(a: jax.Array, k: int):
  """The paper's lower end, mean(a), if at least k elements exceed it, else -1 (all of `a`)."""
  mean = jnp.mean(a)
  c_mean = _count_above(a, mean)
  ok = c_mean >= k
  return jnp.where(ok, mean, -1.0), jnp.where(ok, c_mean, _count_above(a, jnp.float32(-1.0)))


def _first_true(mask: jax.Array, size: int) -> jax.Array:
  """int32[size]: positions of the first `size` True entries of a 1-D mask, in order; positions
  past the last True are len(mask). Same result as `jnp.nonzero(mask, size=size)`, about twice as
  fast on CPU: an associative-scan prefix count, then a binary search per output slot."""
  ranks = lax.associative_scan(jnp.add, mask.astype(jnp.int32))
  return jnp.searchsorted(ranks, jnp.arange(1, size + 1, dtype=jnp.int32),
                          side="left", method="scan").astype(jnp.int32)


def _compact(a: jax.Array, k: int, lo, hi, c_hi) -> jax.Array:
  """k distinct positions of `a`: every a > hi (c_hi <= k of them), then the first ones in the
  band lo < a <= hi to fill the rest (the band holds enough when count(a > lo) >= k)."""
  above = a > hi
  band = (a > lo) & ~above
  i_above = _first_true(above, k)
  i_band = _first_true(band, k)
  j = jnp.arange(k, dtype=jnp.int32)
  from_band = i_band[jnp.clip(j - c_hi, 0, k - 1)]
  return jnp.where(j < c_hi, i_above, from_band)


def _band_stop(k: int, tol: int):
  """Stop when at most `tol` picks can fall outside the true top-k (recall >= 1 - tol/k)."""
  return lambda c_lo, c_hi: jnp.minimum(c_lo - k, k - c_hi) <= tol


def default_block(n: int, k: int) -> int:
  """Block size that balances the block-maxima search (n/block) and the candidates (~k*block)."""
  if n < _MIN_BLOCKED:
    return 1
  b = 2 ** round(math.log2(math.sqrt(n / k)))
  return int(b) if b >= 4 else 1


def _block_maxima(x: jax.Array, block: int) -> jax.Array:
  """float32[ceil(n/block)]: max |x| per block, from one pass of raw max and min."""
  n = x.shape[0]
  if n % block == 0:
    rows = x.reshape(n // block, block)
    mx, mn = jnp.max(rows, axis=1), jnp.min(rows, axis=1)
  else:  # reduce_window pads the tail block; slicing instead would copy the whole array
    pad = [(0, (-n) % block)]
    mx = lax.reduce_window(x, jnp.array(-jnp.inf, x.dtype), lax.max, (block,), (block,), pad)
    mn = lax.reduce_window(x, jnp.array(jnp.inf, x.dtype), lax.min, (block,), (block,), pad)
  return jnp.maximum(mx, -mn).astype(jnp.float32)


def _gather_blocks(x: jax.Array, bmax: jax.Array, t0, block: int, cap: int):
  """Positions and |values| (float32, -1 for positions past the end) of the <= cap blocks with
  block maximum > t0, as flat arrays of length cap * block."""
  n = x.shape[0]
  blocks = _first_true(bmax > t0, cap)  # past the last: nb, gathered as out of range
  pos = (blocks[:, None] * block + jnp.arange(block, dtype=blocks.dtype)[None, :]).reshape(-1)
  vals = x.at[pos].get(mode="fill", fill_value=0)
  a = jnp.where(pos < n, jnp.abs(vals).astype(jnp.float32), -1.0)
  return pos.astype(jnp.int32), a


def _select_candidates(a: jax.Array, k: int, lo, c_lo, hi, *, num_iters: int, tol: int):
  """The paper's search and compaction on a candidate set that holds every element > lo."""
  lo, c_lo, hi, c_hi = _search(a, k, lo, c_lo, hi, num_iters=num_iters, stop=_band_stop(k, tol))
  return _compact(a, k, lo, hi, c_hi)


def exact_topk(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k largest |x| by `lax.top_k` (the reference). Returns `(x[idx], idx)`, idx int32[k]."""
  check_k(x, k)
  _, idx = lax.top_k(jnp.abs(x), k)
  idx = idx.astype(jnp.int32)
  return x[idx], idx


def mstopk(x: jax.Array, k: int, *, num_iters: int = 30, block: int | None = None,
           tolerance: float = 1e-3, method: str = "auto") -> tuple[jax.Array, jax.Array]:
  """MSTopK (Shi et al., 2021): sort-free top-k by a search for the threshold.

  `method`: "auto" runs the C++ radix select on CPU where `sparsejax.cpu_kernels` are available
  (exact: recall 1, indices increasing, ties to the lowest indices) and "search" elsewhere;
  "radix" is the XLA radix select (`radix_topk`, the design for GPUs); "search" is the paper's
  threshold search below, which `num_iters` and `tolerance` control.

  Searches thresholds between mean(|x|) and max(|x|), keeping the best `lo` with count(|x| > lo)
  >= k and the best `hi` with count(|x| > hi) <= k; takes every element above `hi` and fills the
  remaining slots from the band (lo, hi]. Counts are exact, so the output always has exactly k
  distinct indices; only band picks can miss the true top-k, and the search stops once at most
  `tolerance * k` of them can (recall >= 1 - tolerance), or after `num_iters` probes.

  For large inputs the search runs first on the maximum |x| of each `block` elements (one pass),
  finding a threshold t0 that at least k blocks exceed; those blocks (about k * block elements)
  hold every element above t0 and so every top-k element, and the search continues on them alone.
  If ties make that candidate set too large, it falls back to `exact_topk`.

  Args:
    x: 1-D floating array of length n (finite values).
    k: number of elements to select, 1 <= k <= n (static).
    num_iters: maximum bisection probes in each search phase.
    block: block size for the candidate filter; default balances both phases (1 = no filter).
    tolerance: fraction of k allowed to come from the band's arbitrary fill.
    method: "auto", "search" or "radix" (see above).

  Returns:
    `(values, indices)`: `values = x[indices]` (x's dtype), `indices` int32[k], distinct.

  Example:
    >>> x = jax.random.normal(jax.random.key(0), (100_003,))
    >>> values, indices = mstopk(x, 100)
  """
  n, k = check_k(x, k)
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if num_iters < 1:
    raise ValueError(f"num_iters must be >= 1, got {num_iters}")
  if not 0 <= tolerance < 1:
    raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
  block = default_block(n, k) if block is None else int(block)
  if block < 1:
    raise ValueError(f"block must be >= 1, got {block}")
  tol = int(tolerance * k)
  if method == "radix":
    return radix_topk(x, k, block=block)

  def search(x):
    return _search_topk(x, k, num_iters=num_iters, block=block, tol=tol)

  if method == "auto" and _kernel_ok(x):
    return lax.platform_dependent(x, cpu=lambda x: cpu_kernels.topk(x, k), default=search)
  return search(x)


def _kernel_ok(x: jax.Array) -> bool:
  """Whether the C++ selection can take `x` (when the computation runs on CPU)."""
  return (cpu_kernels.enabled() and x.dtype in _KERNEL_DTYPES and x.shape[0] < 2**31)


def _search_topk(x: jax.Array, k: int, *, num_iters: int, block: int, tol: int):
  """MSTopK's threshold search on the XLA path (see `mstopk`)."""
  n = x.shape[0]
  if block == 1 or n <= k * block * 2:
    a = jnp.abs(x).astype(jnp.float32)
    lo, c_lo = _initial_lower(a, k)
    idx = _select_candidates(a, k, lo, c_lo, jnp.max(a), num_iters=num_iters, tol=tol)
    return x[idx], idx

  # Phase 1: a threshold t0 that between k and cap blocks exceed (so >= k elements exceed it).
  bmax = _block_maxima(x, block)
  cap = k + max(k // 8, 64)
  b_lo, b_clo = _initial_lower(bmax, k)
  t0, c0, _, _ = _search(bmax, k, b_lo, b_clo, jnp.max(bmax), num_iters=num_iters,
                         stop=lambda c_lo, c_hi: c_lo <= cap)

  # Phase 2: the paper's search and compaction on the gathered candidate blocks only.
  def fast(x):
    pos, a = _gather_blocks(x, bmax, t0, block, cap)
    c_lo = _count_above(a, t0)
    local = _select_candidates(a, k, t0, c_lo, jnp.max(a), num_iters=num_iters, tol=tol)
    return pos[local]

  def fallback(x):
    return lax.top_k(jnp.abs(x), k)[1].astype(jnp.int32)

  idx = lax.cond(c0 <= cap, fast, fallback, x)
  return x[idx], idx


# ------------------------------------------------------------------------ radix select in XLA
# The key of |v| is its float32 bit pattern with the sign cleared: for finite values, |a| < |b|
# exactly when key(a) < key(b). Digits from the top: 11 bits (exponent and 3 mantissa bits), 10, 10.
_DIGITS = ((20, 11), (10, 10), (0, 10))  # (lowest bit, bits)


def _keys(x: jax.Array) -> jax.Array:
  """int32 keys of |x| (non-negative, order-preserving); 16-bit floats left-aligned."""
  if x.dtype in (jnp.bfloat16, jnp.float16):
    bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32)
    return (bits & 0x7FFF) << 16
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return bits & 0x7FFFFFFF


def _radix_kth(keys: jax.Array, valid: jax.Array | None, k: int):
  """The k-th largest of the (valid) keys and how many keys equal to it belong to the top k.

  One histogram per digit over the keys whose higher digits match the ones chosen so far (a
  scatter-add into at most 2048 bins); the bucket holding the k-th largest is the highest one
  whose count of keys at or above it reaches k. Returns `(kth, ties)`, int32 scalars.
  """
  prefix = keys[0] * 0  # a traced zero, varying like keys (shard_map)
  need = prefix + k
  for level, (shift, bits) in enumerate(_DIGITS):
    bins = 1 << bits
    digit = (keys >> shift) & (bins - 1)
    member = (jnp.ones_like(keys, dtype=bool) if level == 0
              else (keys >> (shift + bits)) == prefix)
    if valid is not None:
      member = member & valid
    hist = jnp.zeros(bins, jnp.int32).at[digit].add(member.astype(jnp.int32))
    at_or_above = jnp.cumsum(hist[::-1])[::-1]
    chosen = jnp.sum(at_or_above >= need).astype(jnp.int32) - 1
    need = need - (at_or_above[chosen] - hist[chosen])
    prefix = (prefix << bits) | chosen
  return prefix, need


def _radix_compact(keys: jax.Array, valid: jax.Array | None, k: int) -> jax.Array:
  """int32[k] increasing positions of the k largest keys, ties to the lowest positions."""
  kth, ties = _radix_kth(keys, valid, k)
  equal = keys == kth
  if valid is not None:
    equal = equal & valid
  tie_rank = jnp.cumsum(equal.astype(jnp.int32))
  take = (keys > kth) | (equal & (tie_rank <= ties))
  if valid is not None:
    take = take & valid
  return _first_true(take, k)


def radix_topk(x: jax.Array, k: int, *, block: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Exact top-k by |x| as a radix select in XLA, the selection designed for GPUs.

  A fixed sequence of passes, no data-dependent loop: the maximum key of each `block` elements
  (one pass over x), the exact k-th largest block maximum t by three digit histograms over the
  block maxima, a gather of the first `cap` blocks whose maximum reaches t (they hold every
  element >= the k-th largest |x|, so every top-k element and every tie), then the radix select
  and one cumsum compaction on those candidates. Where ties leave more than `cap` such blocks (all
  zeros, say), the radix select runs on the whole array instead (`lax.cond`).

  Args:
    x: 1-D floating array of length n (finite values).
    k: number of elements to select, 1 <= k <= n (static).
    block: block size of the candidate filter; default `default_block(n, k)` (1 = no filter).

  Returns:
    `(values, indices)`: `values = x[indices]`, `indices` int32[k] increasing; exactly the k
    largest |x|, ties at the k-th magnitude resolved to the lowest indices.
  """
  n, k = check_k(x, k)
  block = default_block(n, k) if block is None else int(block)
  if block < 1:
    raise ValueError(f"block must be >= 1, got {block}")

  def whole(x):
    return _radix_compact(_keys(x), None, k)

  if block == 1 or n <= k * block * 2:
    idx = whole(x)
    return x[idx], idx
  nb = -(-n // block)
  pad = nb * block - n
  bkeys = _keys(x)
  if pad:  # padding keys -1: below every real key
    bkeys = jnp.concatenate([bkeys, jnp.full((pad,), -1, jnp.int32)])
  bmax = jnp.max(bkeys.reshape(nb, block), axis=1)
  cap = k + max(k // 8, 64)
  t, _ = _radix_kth(bmax, None, k)
  reach = bmax >= t

  def gathered(x):
    blocks = _first_true(reach, cap)  # past the last: nb (out of range)
    pos = (blocks[:, None] * block + jnp.arange(block, dtype=jnp.int32)[None, :]).reshape(-1)
    valid = pos < n
    keys = jnp.where(valid, _keys(x.at[pos].get(mode="fill", fill_value=0)), 0)
    return pos[_radix_compact(keys, valid, k)]

  idx = lax.cond(jnp.sum(reach) <= cap, gathered, whole, x)
  return x[idx], idx


def select_feedback(select: str | Selector, x: jax.Array, residual: jax.Array, k: int,
                    weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Error-feedback selection: acc = x + residual, its top k, and acc with those zeroed.

  With `mstopk` on CPU (float32 x and residual, C++ kernels available) one kernel does it all in
  about one pass over memory (acc is written in the selection pass); otherwise `select(acc, k)`
  and a scatter. With `weights` (powers of two, one per element: exact to apply and undo) the k
  largest |weights * acc| are selected; values and the new residual are acc's own. Returns
  `(values, indices, new_residual)` with `values = acc[indices]`.
  """
  check_k(x, k)
  if weights is not None:
    values, indices, kept = select_feedback(select, x * weights, residual * weights, k)
    return values / weights[indices], indices, kept / weights
  select = get_selector(select)

  def generic(x, residual):
    acc = x + residual
    values, indices = select(acc, k)
    return values, indices, acc.at[indices].set(0, unique_indices=True)

  if (select is mstopk and _kernel_ok(x) and x.dtype == jnp.float32
      and residual.dtype == jnp.float32):
    return lax.platform_dependent(
        x, residual, cpu=lambda x, r: cpu_kernels.topk_feedback(x, r, k), default=generic)
  return generic(x, residual)


def sampled_topk(x: jax.Array, k: int, *, sample_fraction: float = 0.01,
                 margin: float = 0.1, block: int | None = None) -> tuple[jax.Array, jax.Array]:
  """DGC's selection (Lin et al., 2018): the threshold is estimated on a strided sample.

  The thresholds come from the sample's ranks k*f*(1 -+ margin) (f = sample size / n) instead of
  a search; each is checked with one exact count over x and widened to max|x| / -1 if the sample
  was unrepresentative. Selection then proceeds as in `mstopk` (everything above the upper
  threshold, fill from the band, on gathered candidate blocks), so the output has exactly k
  distinct indices; recall depends on how well the sample represents x.

  Args:
    x: 1-D floating array of length n (finite values).
    k: number of elements to select, 1 <= k <= n (static).
    sample_fraction: fraction of x in the strided sample, in (0, 1]; the stride is capped so
      the sample holds at least ~64 elements of the top-k.
    margin: relative half-width of the rank band taken from the sample, in [0, 1).
    block: candidate block size, as in `mstopk`.

  Returns:
    `(values, indices)` as `mstopk`.
  """
  n, k = check_k(x, k)
  if not 0 < sample_fraction <= 1:
    raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction}")
  if not 0 <= margin < 1:
    raise ValueError(f"margin must be in [0, 1), got {margin}")
  stride = max(1, min(int(round(1 / sample_fraction)), k // 64))
  sample = jnp.abs(x[::stride]).astype(jnp.float32)
  m = sample.shape[0]
  r_hi = min(m, max(1, int(k / stride * (1 - margin))))
  r_lo = min(m, max(r_hi, int(math.ceil(k / stride * (1 + margin)))))
  top = lax.top_k(sample, r_lo)[0]
  hi, lo = top[r_hi - 1], top[r_lo - 1]
  c_hi, c_lo = _count_above(jnp.abs(x), hi), _count_above(jnp.abs(x), lo)
  hi_ok, lo_ok = c_hi <= k, c_lo >= k
  hi = jnp.where(hi_ok, hi, jnp.max(jnp.abs(x)).astype(jnp.float32))
  c_hi = jnp.where(hi_ok, c_hi, 0)
  lo = jnp.where(lo_ok, lo, -1.0)

  def whole(x):
    return _compact(jnp.abs(x).astype(jnp.float32), k, lo, hi, c_hi)

  block = default_block(n, k) if block is None else int(block)
  if block <= 1 or n <= k * block * 2:
    idx = whole(x)
  else:
    bmax = _block_maxima(x, block)
    cap = k + max(k // 4, 64)

    def gathered(x):
      pos, a = _gather_blocks(x, bmax, lo, block, cap)
      return pos[_compact(a, k, lo, hi, c_hi)]

    idx = lax.cond(_count_above(bmax, lo) <= cap, gathered, whole, x)
  return x[idx], idx


SELECTORS: dict[str, Selector] = {"mstopk": mstopk, "exact": exact_topk, "sampled": sampled_topk,
                                  "radix": radix_topk}


def get_selector(name: str | Selector) -> Selector:
  """A selector by name (`"mstopk" | "exact" | "sampled" | "radix"`) or the callable itself."""
  if callable(name):
    return name
  if name not in SELECTORS:
    raise ValueError(f"unknown selector {name!r}; allowed: {sorted(SELECTORS)}")
  return SELECTORS[name]
