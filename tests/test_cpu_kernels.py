"""The C++ fused-update kernels (`sparsejax.cpu_kernels`) against the XLA path of `sparsejax.optim`.

`tests/test_optim.py` checks every fused optimizer against optax with the kernels in use (the
default on CPU); here the kernels are compared with the pure-XLA path on buffers large enough to
use both threads and the split two-pass schedule, and the fallback without a compiler is checked.
"""

import os
import re
import subprocess
import sys
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparsejax import apply_if_finite_across, cpu_kernels, optim

# One leaf above the kernels' split size (131,072 values), 266,534 values in all (above the
# 262,144 from which the kernels use every thread of XLA's pool), odd sizes, a scalar.
SHAPES = {"big": (389, 401), "conv": (3, 3, 7, 13), "bias": (13,), "scale": (), "dense": (97, 1131),
          "tail": (5,)}


def tree(rng, scale=1.0):
  return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


SCHEDULE = optax.linear_schedule(0.2, 0.05, 3)
NO_BIAS = {"big": True, "conv": True, "bias": False, "scale": False, "dense": True, "tail": True}
CASES = {
    "sgd": dict(learning_rate=SCHEDULE, momentum=0.9, weight_decay=1e-3,
                weight_decay_mask=NO_BIAS),
    "sgd-nesterov-nodecay": dict(learning_rate=0.1, momentum=0.8, nesterov=True),
    "lars": dict(learning_rate=SCHEDULE, weight_decay=1e-3, weight_decay_mask=NO_BIAS,
                 trust_ratio_mask=NO_BIAS, momentum=0.9),
    "lars-nesterov-eps": dict(learning_rate=0.3, trust_coefficient=0.02, eps=1e-6,
                              nesterov=True),
    "adamw": dict(learning_rate=SCHEDULE, weight_decay=1e-2, mask=NO_BIAS),
    "adamw-nodecay-eps0": dict(learning_rate=0.01, weight_decay=0.0, eps=0.0, eps_root=1e-8),
    "adamw-nesterov": dict(learning_rate=SCHEDULE, weight_decay=1e-2, mask=NO_BIAS,
                           nesterov=True),
    "lamb": dict(learning_rate=SCHEDULE, weight_decay=1e-2, mask=NO_BIAS),
}
FACTORY = {"sgd": optim.fused_sgd, "lars": optim.fused_lars, "adamw": optim.fused_adamw,
           "lamb": optim.fused_lamb}


def make(case, layout):
  return FACTORY[case.split("-")[0]](**CASES[case], layout=layout)


@pytest.fixture(scope="module")
def layout():
  assert cpu_kernels.available(), cpu_kernels.why_unavailable()
  return optim.flat_layout(tree(np.random.default_rng(0)))


def run(case, layout, grads, params, face):
  """Jitted updates of one face inside `apply_if_finite_across` (a step with a non-finite
  gradient is skipped); returns (updates per step as flat arrays, the optimizer's states after
  each step)."""
  tx = apply_if_finite_across(make(case, layout if face == "flat" else None))
  if face == "pytree":
    grads = [layout.unravel(g) for g in grads]
    params = layout.unravel(params)
  state = tx.init(params)
  update = jax.jit(tx.update)
  outs, states = [], []
  for g in grads:
    u, state = update(g, state, params)
    outs.append(np.asarray(u if face == "flat" else layout.ravel(u)))
    states.append([np.asarray(x) for x in jax.tree.leaves(state.inner_state)])
    params = optax.apply_updates(params, u)
  return outs, states


@pytest.mark.parametrize("face", ["flat", "pytree"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_equal_the_xla_path(layout, case, face):
  rng = np.random.default_rng(zlib.crc32(case.encode()))
  params = layout.ravel(tree(rng))
  grads = [layout.ravel(tree(rng, scale=s)) for s in (1.0, 0.3, 2.0, 0.7)]
  grads[1] = grads[1].at[7].set(jnp.nan)  # the skipped step's gradient is not finite
  got, got_states = run(case, layout, grads, params, face)
  with cpu_kernels.disabled():
    want, want_states = run(case, layout, grads, params, face)
  for step, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=f"{case} step {step}")
    assert np.all(a[~layout.valid_mask] == 0.0), f"{case}: padding of the updates not zero"
  for step, (xs, ys) in enumerate(zip(got_states, want_states)):
    for a, b in zip(xs, ys):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=f"{case} state {step}")
  # A skipped step: zero updates, the state (count included) exactly as before it.
  assert np.all(got[1] == 0.0)
  for a, b in zip(got_states[0], got_states[1]):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("face", ["flat", "pytree"])
@pytest.mark.parametrize("name", list(FACTORY))
def test_the_update_is_one_custom_call_on_cpu(layout, name, face):
  """On CPU the update is the kernel (the pytree face too: the leaves go in as they are)."""
  case = next(c for c in CASES if c.split("-")[0] == name)
  params = jnp.zeros(layout.padded_size, jnp.float32)
  if face == "pytree":
    params = layout.unravel(params)

  def compiled():
    tx = make(case, layout if face == "flat" else None)
    return jax.jit(tx.update).lower(params, tx.init(params), params).compile()

  with_kernel = compiled()
  assert f"sparsejax_fused_{name}" in with_kernel.as_text()
  if face == "pytree":  # no concatenate of the leaves into a flat buffer
    flat_type = f"f32[{layout.padded_size}]"
    text = with_kernel.as_text()
    assert f"= {flat_type}{{0}} concatenate(" not in text
    assert not re.search(rf"%\S*concatenate\S* = {re.escape(flat_type)}", text)
  with cpu_kernels.disabled():
    assert "sparsejax_fused" not in compiled().as_text()


def test_lowered_for_a_gpu_the_update_is_xla(layout):
  """The kernel is the CPU branch of `lax.platform_dependent`: a GPU lowering never sees it."""
  tx = optim.fused_lamb(0.1, layout=layout)
  params = jnp.zeros(layout.padded_size, jnp.float32)
  traced = jax.jit(tx.update).trace(params, tx.init(params), params)
  assert "sparsejax_fused_lamb" in traced.lower(lowering_platforms=("cpu",)).as_text()
  assert "sparsejax_fused" not in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.integration  # end to end: a process of its own for each (about 3 s)
@pytest.mark.parametrize("cxx,why", [("", "no C++ compiler"), ("/bin/false", "failed")])
def test_without_a_compiler_the_xla_path_is_used(tmp_path, cxx, why):
  """No compiler, or one that fails, and an empty cache: a warning naming why, the XLA path."""
  script = textwrap.dedent("""
      import warnings
      import jax, jax.numpy as jnp, numpy as np
      from sparsejax import apply_if_finite_across, cpu_kernels, optim
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not cpu_kernels.available()
      assert any("XLA path" in str(w.message) for w in caught), [str(w.message) for w in caught]
      print("why:", cpu_kernels.why_unavailable())
      layout = optim.flat_layout({"w": np.zeros((7, 3), np.float32)})
      tx = optim.fused_lars(0.1, layout=layout)
      p = jnp.ones(layout.padded_size)
      u, _ = jax.jit(tx.update)(p, tx.init(p), p)
      assert "sparsejax_fused" not in jax.jit(tx.update).lower(p, tx.init(p), p).as_text()
      assert np.all(np.isfinite(np.asarray(u)))
      print("ok")
  """)
  env = dict(os.environ, CXX=cxx, SPARSEJAX_CACHE_DIR=str(tmp_path),
             PATH=os.path.dirname(sys.executable) + ":/nonexistent")
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "ok" in proc.stdout
  assert why in proc.stdout, proc.stdout


def test_malformed_operands_are_clear_errors():
  """The kernel's own checks of its operands against the segment table (optim never trips them)."""
  assert cpu_kernels.available(), cpu_kernels.why_unavailable()
  f32 = lambda n: jnp.zeros(n, jnp.float32)  # noqa: E731
  table = (np.array([0, 5, 8, 16]), np.ones(3, np.float32), np.array([1, 0, 1], np.int32))
  scalars = jnp.array([0.1, 0.9, 0.0], jnp.float32)

  def sgd(state, grads, params, table=table, flat=False):
    return jax.jit(lambda s, g, p: cpu_kernels.update(
        "sgd", scalars, s, g, p, table=table, flat=flat, nesterov=False,
        decayed=p is not None))(state, grads, params)

  sgd([f32(16)], [f32(5), f32(8)], [f32(5), f32(8)])  # well formed: two real leaves
  sgd([f32(16)], [f32(16)], None, flat=True)
  for args, kw, match in [
      (([f32(16)], [f32(5), f32(8)], None), {"table": (table[0], table[1][:2], table[2])},
       "malformed segment table"),
      (([f32(16)], [f32(5)], None), {}, "expected 3 operands and 3 results, got 2 and 2"),
      (([f32(15)], [f32(5), f32(8)], None), {}, "state buffer of the wrong length"),
      (([f32(16)], [f32(5), f32(7)], None), {}, "leaf 1 has 7 values, the segment table says 8"),
      (([f32(16)], [f32(16)], [f32(15)]), {"flat": True}, "params leaf of the wrong length"),
  ]:
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
      sgd(*args, **kw)
