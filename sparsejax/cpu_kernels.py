"""The fused optimizer updates as C++ kernels for XLA:CPU, called through the XLA FFI.

XLA cannot fuse a reduction with the elementwise pass that consumes it, so on CPU LARS and LAMB
read the big buffers twice from memory (norms, then update) and the Adam family pays for a
multi-output fusion. `csrc/fused_update.cc` walks the flat buffer segment by segment (one segment
per parameter tensor; or the leaves themselves, for the pytree face) and does the whole update of
a segment at once: the norms, then the update while the segment is still in cache, on XLA's own
intra-op thread pool. `csrc/topk_select.cc` holds the top-k selection kernels (`topk`,
`topk_feedback`, `scatter_add`, used by `sparsejax.topk` and `sparsejax.comm` on CPU).

The sources are compiled on first use with the system C++ compiler (`$CXX`, else `c++`/`g++`) into
`$SPARSEJAX_CACHE_DIR` (default `~/.cache/sparsejax`), keyed by a hash of the source, the flags,
the jaxlib version and the CPU, and written atomically (a crash leaves no half-written library).
Without a compiler, or with `SPARSEJAX_CPU_KERNELS=0`, `available()` is False and `sparsejax.optim`
uses its pure-XLA path (the same math, checked against it in the tests). Other platforms (GPU)
always use the XLA path: there XLA's fusions already are the fused operator.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence
from importlib import metadata, resources
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["available", "disabled", "enabled", "library_path", "scatter_add", "topk",
           "topk_feedback", "update", "why_unavailable"]

_SOURCES = ("fused_update.cc", "topk_select.cc")  # compiled together into one library
_HEADERS = ("parallel.h",)
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared",
          "-fPIC", "-Wno-attributes", "-Wno-return-type")
_TARGETS = {"sgd": "SparsejaxFusedSgd", "lars": "SparsejaxFusedLars",
            "adamw": "SparsejaxFusedAdamw", "lamb": "SparsejaxFusedLamb"}
# The selection kernels of csrc/topk_select.cc: FFI target name -> symbol.
_SELECT_TARGETS = {"sparsejax_topk": "SparsejaxTopK",
                   "sparsejax_topk_feedback": "SparsejaxTopKFeedback",
                   "sparsejax_scatter_add": "SparsejaxScatterAdd"}

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("model name", "flags")):
          return line
  except OSError:
    pass
  return platform.processor()


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _build(cxx: str) -> str:
  """Compiles the source (once per source/flags/jaxlib/CPU) and returns the library's path."""
  csrc = resources.files("sparsejax").joinpath("csrc")
  files = {name: csrc.joinpath(name).read_bytes() for name in (*_SOURCES, *_HEADERS)}
  include = jax.ffi.include_dir()
  key = hashlib.sha256(b"\0".join([
      *files.values(), " ".join(_FLAGS).encode(), metadata.version("jaxlib").encode(),
      _cpu_model().encode(), cxx.encode()])).hexdigest()[:16]
  cache = os.environ.get("SPARSEJAX_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "sparsejax")
  path = os.path.join(cache, f"fused_update-{key}.so")
  if os.path.exists(path):
    return path
  os.makedirs(cache, exist_ok=True)
  # One builder at a time (test workers, processes of a run); the others then find the library.
  with open(os.path.join(cache, "fused_update.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(path):
      _compile(cxx, files, include, cache, path)
  return path


def _compile(cxx: str, files: dict[str, bytes], include: str, cache: str, path: str) -> None:
  with tempfile.TemporaryDirectory(dir=cache) as tmp:
    for name, text in files.items():
      with open(os.path.join(tmp, name), "wb") as f:
        f.write(text)
    out = os.path.join(tmp, "lib.so")
    srcs = [os.path.join(tmp, name) for name in _SOURCES]
    proc = subprocess.run([cxx, *_FLAGS, f"-I{include}", f"-I{tmp}", *srcs, "-o", out],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
      raise RuntimeError(f"{cxx} failed on {', '.join(_SOURCES)}:\n{proc.stderr[:2000]}")
    os.replace(out, path)  # atomic: a crash never leaves a half-written library under `path`


def available() -> bool:
  """True when the kernels are compiled, loaded and registered for the CPU platform."""
  with _lock:
    if "ok" in _state:
      return bool(_state["ok"])
    _state["ok"] = False
    if os.environ.get("SPARSEJAX_CPU_KERNELS", "1") == "0":
      _state["why"] = "disabled by SPARSEJAX_CPU_KERNELS=0"
      return False
    try:
      cxx = _compiler()
      if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
      path = _build(cxx)
      lib = ctypes.cdll.LoadLibrary(path)
      for name, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(f"sparsejax_fused_{name}",
                                    jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
      for target, symbol in _SELECT_TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: use the XLA path, and say why
      _state["why"] = f"{type(e).__name__}: {e}"
      warnings.warn(f"sparsejax: CPU fused-update kernels unavailable, using the XLA path "
                    f"({_state['why']})", RuntimeWarning, stacklevel=2)
      return False
    _state.update(ok=True, path=path, lib=lib)
    return True


@contextlib.contextmanager
def disabled():
  """Within this context, updates traced by `sparsejax.optim` use the XLA path even on CPU (for
  comparing the two paths; jit caches what was traced, so trace fresh functions inside)."""
  _state["disabled"] = _state.get("disabled", 0) + 1
  try:
    yield
  finally:
    _state["disabled"] -= 1


def enabled() -> bool:
  """True when `sparsejax.optim` should use the kernels on CPU: available and not `disabled()`."""
  return not _state.get("disabled") and available()


def library_path() -> str | None:
  """Path of the loaded kernel library, or None (see `why_unavailable`)."""
  return _state.get("path") if available() else None


def why_unavailable() -> str | None:
  """Why `available()` is False (None when it is True)."""
  return None if available() else str(_state.get("why"))


# --------------------------------------------------------------------------- calls


def update(name: str, scalars: jax.Array, state: Sequence[jax.Array], grads: Sequence[jax.Array],
           params: Sequence[jax.Array] | None, *, table: tuple[np.ndarray, ...], flat: bool,
           **attrs: Any) -> tuple[tuple[jax.Array, ...], list[jax.Array]]:
  """One fused update by the kernel `name` (sgd, lars, adamw, lamb) -> (new state, updates).

  Args:
    scalars: float32[k], the traced hyperparameters in the kernel's order (sgd: learning rate,
      momentum, weight decay; lars: learning rate, momentum, weight decay, trust coefficient, eps;
      adamw and lamb: learning rate, the three bias-correction factors cm, cv, cg, b1, b2, eps,
      eps_root, weight decay; adamw then the direction's bound, `optim.frozen_bound` or
      infinite). Traced, so that `optax.inject_hyperparams` can change them.
    state: the flat float32 state buffers (momentum; or mu, nu), each of length padded_size.
    grads: float32 buffers: one flat buffer (`flat=True`) or one per leaf, in leaf order.
    params: like `grads`, or None when the update does not read params.
    table: (starts int64[S + 1], decay_mask float32[S], flags int32[S]) of the layout
      (`sparsejax.optim` builds it; decay_mask: 1 where the weight decay applies; flags: 1 = a
      real leaf, 2 = the trust ratio applies).
    flat: whether grads/params are the flat layout or the leaves.
    **attrs: the kernel's static attributes (bools: nesterov, decayed; lamb has none).
  The new state is written over the old and the updates over the gradient (aliased operands).
  """
  if name not in _TARGETS:
    raise ValueError(f"unknown fused-update kernel {name!r}; allowed: {sorted(_TARGETS)}")
  k, n = len(state), len(grads)
  out = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (*state, *grads)]
  aliases = {1 + i: i for i in range(k + n)}  # operand 0 is `scalars`
  starts, decay_mask, flags = table
  # The kernels still read a skip flag as their last scalar (csrc/fused_update.cc, SkipStep);
  # skipping is `sparsejax.apply_if_finite_across`'s job now, so it is always 0 here.
  scalars = jnp.concatenate([jnp.reshape(scalars, (-1,)).astype(jnp.float32),
                             jnp.zeros((1,), jnp.float32)])
  res = jax.ffi.ffi_call(f"sparsejax_fused_{name}", out, input_output_aliases=aliases,
                         vmap_method="sequential")(
      scalars, *state, *grads, *(params or ()), starts=starts, decay_mask=decay_mask, flags=flags,
      flat=bool(flat), **attrs)
  return tuple(res[:k]), list(res[k:])


def _like(x, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
  """A result of `shape` and `dtype` varying over the same manual mesh axes as `x` (inside
  shard_map, as XLA ops computing it from `x` would be)."""
  aval = jax.typeof(x)
  if aval.manual_axis_type.empty:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=aval.sharding,
                              manual_axis_type=aval.manual_axis_type)


def topk(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-k by |x| of a 1-D float32/bfloat16/float16 array (`csrc/topk_select.cc`).

  Returns `(x[idx], idx)` with idx int32[k] increasing; ties at the k-th magnitude go to the lowest
  indices. CPU only: call it where `enabled()` and the computation runs on CPU.
  """
  out = (_like(x, (k,), x.dtype), _like(x, (k,), jnp.int32))
  return jax.ffi.ffi_call("sparsejax_topk", out, vmap_method="sequential")(x)


def topk_feedback(x: jax.Array, residual: jax.Array,
                  k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Error-feedback selection in one kernel: acc = x + residual (float32[n] each), its exact
  top-k by |acc| as `topk`, and acc with the selected entries zeroed (written over `residual`
  when XLA can reuse its buffer). Returns `(values, indices, new_residual)`."""
  n = x.shape[0]
  like = x + residual  # only its type is used (the mesh axes it varies over); XLA drops it
  out = (_like(like, (k,), jnp.float32), _like(like, (k,), jnp.int32),
         _like(like, (n,), jnp.float32))
  return jax.ffi.ffi_call("sparsejax_topk_feedback", out, input_output_aliases={1: 2},
                          vmap_method="sequential")(x, residual)


def scatter_add(values: jax.Array, indices: jax.Array, n: int) -> jax.Array:
  """float32[n]: zeros with `values` (float32[m]) added at `indices` (int32[m]) in order;
  indices outside [0, n) are dropped, negative ones too (as XLA's scatter does; jnp's
  `.at[i].add` wraps negative indices unless given `wrap_negative_indices=False`)."""
  out = _like(values + indices.astype(values.dtype), (n,), jnp.float32)  # type only, as above
  return jax.ffi.ffi_call("sparsejax_scatter_add", out, vmap_method="sequential")(values, indices)
