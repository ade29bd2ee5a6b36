"""The fused optimizers: one common suite run on both faces and, as its control, on optax itself."""

import contextlib

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax import cpu_kernels, hlo, optim
from sparsejax.flat import FlatLayout

SHAPES = {"conv": (3, 3, 5, 7), "dense": {"kernel": (13, 11), "bias": (11,)}, "scale": (),
          "odd": (257,), "wide": (3, 301), "zero": (5,)}


def random_tree(rng, scale=1.0, zero_leaf=True):
  tree = jax.tree.map(lambda s: (scale * rng.standard_normal(s)).astype(np.float32), SHAPES,
                      is_leaf=lambda s: isinstance(s, tuple))
  if zero_leaf:
    tree["zero"] = np.zeros(5, np.float32)  # param norm 0: the trust ratio falls back to 1
  return tree


def matrices(tree):
  return jax.tree.map(lambda x: x.ndim > 1, tree)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.05, 3, 10)
PREFIX_MASK = {"conv": True, "dense": False, "scale": False, "odd": True, "wide": True,
               "zero": True}

# name -> list of (kwargs for the fused optimizer, the optax original built from the same kwargs)
CASES = {
    "sgd": [
        ({"learning_rate": 0.05}, lambda: optax.sgd(0.05)),
        ({"learning_rate": SCHEDULE, "momentum": 0.9, "weight_decay": 1e-2,
          "weight_decay_mask": matrices},
         lambda: optax.chain(optax.add_decayed_weights(1e-2, matrices),
                             optax.sgd(SCHEDULE, momentum=0.9))),
        ({"learning_rate": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 1e-3},
         lambda: optax.chain(optax.add_decayed_weights(1e-3),
                             optax.sgd(0.05, momentum=0.8, nesterov=True))),
    ],
    "lars": [
        ({"learning_rate": 0.5}, lambda: optax.lars(0.5)),
        ({"learning_rate": SCHEDULE, "weight_decay": 1e-2, "weight_decay_mask": matrices,
          "trust_coefficient": 0.02, "eps": 1e-6, "trust_ratio_mask": PREFIX_MASK,
          "momentum": 0.8, "nesterov": True},
         lambda: optax.lars(SCHEDULE, weight_decay=1e-2, weight_decay_mask=matrices,
                            trust_coefficient=0.02, eps=1e-6, trust_ratio_mask=PREFIX_MASK,
                            momentum=0.8, nesterov=True)),
    ],
    "lamb": [
        ({"learning_rate": 0.01}, lambda: optax.lamb(0.01)),
        ({"learning_rate": SCHEDULE, "b1": 0.8, "b2": 0.95, "eps": 1e-5, "eps_root": 1e-8,
          "weight_decay": 1e-2, "mask": PREFIX_MASK},
         lambda: optax.lamb(SCHEDULE, b1=0.8, b2=0.95, eps=1e-5, eps_root=1e-8,
                            weight_decay=1e-2, mask=PREFIX_MASK)),
    ],
    "adamw": [
        ({"learning_rate": 0.01}, lambda: optax.adamw(0.01)),
        ({"learning_rate": SCHEDULE, "b1": 0.5, "b2": 0.9, "eps": 1e-6, "eps_root": 1e-9,
          "weight_decay": 0.1, "mask": matrices},
         lambda: optax.adamw(SCHEDULE, b1=0.5, b2=0.9, eps=1e-6, eps_root=1e-9,
                             weight_decay=0.1, mask=matrices)),
    ],
}
FUSED = {"sgd": optim.fused_sgd, "lars": optim.fused_lars, "lamb": optim.fused_lamb,
         "adamw": optim.fused_adamw}
ALL_CASES = [(name, i) for name in CASES for i in range(len(CASES[name]))]
IMPLS = ["optax", "pytree", "flat"]


class FlatFace:
  """Presents the flat face with pytree inputs/outputs, raveling at the boundary (for tests)."""

  def __init__(self, make, layout):
    self.layout, self.tx = layout, make(layout)

  def init(self, params):
    return self.tx.init(self.layout.ravel(params, jnp.float32))

  def update(self, updates, state, params=None):
    lay = self.layout
    flat_p = None if params is None else lay.ravel(params, jnp.float32)
    u, state = self.tx.update(lay.ravel(updates, jnp.float32), state, flat_p)
    out = lay.unravel(u)
    return jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates), state


def make_impl(impl, name, case, params):
  kwargs, reference = CASES[name][case]
  if impl == "optax":
    return reference()
  if impl == "pytree":
    return FUSED[name](**kwargs)
  layout = FlatLayout.from_tree(params, pad_to=8, align=16)
  return FlatFace(lambda lay: FUSED[name](**kwargs, layout=lay), layout)


def run(tx, params, grads_seq):
  """Applies tx for len(grads_seq) jitted steps; returns the updates and params of each step."""
  state = tx.init(params)
  step = jax.jit(tx.update)
  updates, trajectory = [], []
  for g in grads_seq:
    u, state = step(g, state, params)
    params = optax.apply_updates(params, u)
    updates.append(u)
    trajectory.append(params)
  return updates, trajectory, state


@pytest.mark.parametrize("impl", ["pytree", "flat"])
@pytest.mark.parametrize("name,case", ALL_CASES)
def test_equals_optax_over_ten_steps(rng, impl, name, case):
  params = random_tree(rng)
  grads_seq = [random_tree(rng, zero_leaf=False) for _ in range(10)]
  grads_seq[3]["odd"] = np.zeros(257, np.float32)  # an all-zero gradient leaf at one step
  want_u, want_p, _ = run(make_impl("optax", name, case, params), params, grads_seq)
  got_u, got_p, _ = run(make_impl(impl, name, case, params), params, grads_seq)
  for step, (wu, gu, wp, gp) in enumerate(zip(want_u, got_u, want_p, got_p)):
    for path, w in jax.tree_util.tree_leaves_with_path(wu):
      g = _get(gu, path)
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-8,
                                 err_msg=f"update, step {step}, leaf {jax.tree_util.keystr(path)}")
    for w, g in zip(jax.tree.leaves(wp), jax.tree.leaves(gp)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _get(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_dtypes_kept_and_state_shapes_stable(rng, impl, name):
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim > 1 else x, random_tree(rng))
  grads = jax.tree.map(lambda x: jnp.asarray(x * 0.1, x.dtype), params)
  tx = make_impl(impl, name, len(CASES[name]) - 1, params)
  state = tx.init(params)
  before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
  update = jax.jit(tx.update)
  for _ in range(3):
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, grads)
  assert jax.tree.map(lambda x: x.dtype, params) == jax.tree.map(lambda x: x.dtype, grads)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == before
  if impl != "optax":  # the fused state is float32 whatever the parameter dtype
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(state))
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))


# Hyperparameters that converge on the quadratic within 200 steps, per optimizer.
QUADRATIC = {"sgd": {"learning_rate": 0.1, "momentum": 0.9},
             "lars": {"learning_rate": 5.0, "trust_coefficient": 0.02, "momentum": 0.9},
             "lamb": {"learning_rate": 0.05}, "adamw": {"learning_rate": 0.05, "weight_decay": 0.0}}
QUADRATIC_OPTAX = {"sgd": lambda: optax.sgd(0.1, momentum=0.9),
                   "lars": lambda: optax.lars(5.0, trust_coefficient=0.02, momentum=0.9),
                   "lamb": lambda: optax.lamb(0.05),
                   "adamw": lambda: optax.adamw(0.05, weight_decay=0.0)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_converges_on_a_quadratic(rng, impl, name):
  target = random_tree(rng, zero_leaf=False)
  curvature = jax.tree.map(lambda t: rng.uniform(0.5, 2.0, t.shape).astype(np.float32), target)
  params = jax.tree.map(lambda t: t + rng.standard_normal(t.shape).astype(np.float32), target)

  def loss(p):
    terms = jax.tree.map(lambda x, t, a: jnp.sum(a * (x - t) ** 2) / 2, p, target, curvature)
    return sum(jax.tree.leaves(terms))

  if impl == "optax":
    tx = QUADRATIC_OPTAX[name]()
  elif impl == "pytree":
    tx = FUSED[name](**QUADRATIC[name])
  else:
    layout = optim.flat_layout(params)
    tx = FlatFace(lambda lay: FUSED[name](**QUADRATIC[name], layout=lay), layout)
  state = tx.init(params)

  @jax.jit
  def step(p, s):
    u, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, u), s

  start = float(loss(params))
  for _ in range(200):
    params, state = step(params, state)
  assert float(loss(params)) < 1e-2 * start, (start, float(loss(params)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_inside_shard_map_on_eight_devices(rng, impl, name):
  """Each of 8 workers has its own gradient; the update of their mean is the same everywhere and
  equals the update computed outside shard_map."""
  mesh = make_mesh(2, 4)
  params = random_tree(rng)
  tx = make_impl(impl, name, len(CASES[name]) - 1, params)
  grads = jax.tree.map(lambda x: rng.standard_normal((8,) + x.shape).astype(np.float32), params)

  def body(g, p):
    g = jax.tree.map(lambda x: jax.lax.pmean(x[0], ("node", "local")), g)
    state = tx.init(p)
    u1, state = tx.update(g, state, p)
    u2, state = tx.update(g, state, optax.apply_updates(p, u1))
    return jax.tree.map(lambda x: x[None], (u1, u2))

  spec = P(("node", "local"))
  placed = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), grads)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec,
                             check_vma=False))
  got = jax.tree.map(np.asarray, fn(placed, params))
  mean = jax.tree.map(lambda x: x.mean(0), grads)
  want, _, _ = run(tx, params, [mean, mean])
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(g, np.broadcast_to(np.asarray(w), g.shape), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_state_survives_save_and_restore(rng, impl, name, tmp_path):
  params = random_tree(rng)
  grads_seq = [random_tree(rng, zero_leaf=False) for _ in range(6)]
  tx = make_impl(impl, name, len(CASES[name]) - 1, params)
  want_u, _, _ = run(tx, params, grads_seq)

  _, trajectory, state = run(tx, params, grads_seq[:3])
  path = tmp_path / "opt_state.msgpack"
  path.write_bytes(flax.serialization.to_bytes(state))
  template = jax.tree.map(jnp.zeros_like, tx.init(params))
  restored = flax.serialization.from_bytes(template, path.read_bytes())
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  got_u, _, _ = _continue(tx, trajectory[-1], restored, grads_seq[3:])
  for w, g in zip(jax.tree.leaves(want_u[3:]), jax.tree.leaves(got_u)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _continue(tx, params, state, grads_seq):
  step = jax.jit(tx.update)
  updates = []
  for g in grads_seq:
    u, state = step(g, state, params)
    params = optax.apply_updates(params, u)
    updates.append(u)
  return updates, params, state


@pytest.mark.parametrize("name", list(CASES))
def test_flat_face_is_a_handful_of_kernels_whatever_the_leaf_count(name):
  """300 leaves of odd sizes: the flat update compiles to at most 10 fusions and custom calls."""
  rng = np.random.default_rng(0)
  tree = {f"w{i}": jax.ShapeDtypeStruct((int(rng.integers(1, 700)),), jnp.float32)
          for i in range(300)}
  layout = optim.flat_layout(tree)
  kwargs = {k: (matrices if v is PREFIX_MASK else v) for k, v in CASES[name][-1][0].items()}
  tx = FUSED[name](**kwargs, layout=layout)
  flat = jax.ShapeDtypeStruct((layout.padded_size,), jnp.float32)
  state = jax.eval_shape(tx.init, flat)
  counts = hlo.kernel_counts(jax.jit(tx.update).lower(flat, state, flat).compile())
  launched = counts.get("fusion", 0) + counts.get("custom-call", 0)
  assert launched <= 10, counts
  assert sum(counts.values()) <= 14, counts


def test_flat_face_state_is_one_buffer_per_moment():
  params = random_tree(np.random.default_rng(1))
  layout = optim.flat_layout(params)
  flat = layout.ravel(params, jnp.float32)
  state = optim.fused_lamb(0.1, layout=layout).init(flat)
  assert isinstance(state, optim.FusedAdamState)
  assert state.mu.shape == state.nu.shape == (layout.padded_size,)
  assert state.mu.dtype == jnp.float32
  # The pytree face keeps the same flat state.
  pstate = optim.fused_lamb(0.1).init(params)
  assert pstate.mu.shape == (layout.padded_size,)
  sstate = optim.fused_sgd(0.1).init(params)
  assert sstate.momentum is None  # no zero-size buffer


@pytest.mark.parametrize("make,kwargs,match", [
    (optim.fused_sgd, {"learning_rate": -0.1}, "learning_rate"),
    (optim.fused_sgd, {"learning_rate": 0.1, "weight_decay": -1e-4}, "weight_decay"),
    (optim.fused_sgd, {"learning_rate": 0.1, "momentum": 1.0}, "momentum"),
    (optim.fused_lars, {"learning_rate": float("nan")}, "learning_rate"),
    (optim.fused_lars, {"learning_rate": 0.1, "weight_decay": -1.0}, "weight_decay"),
    (optim.fused_lars, {"learning_rate": 0.1, "trust_coefficient": -1.0}, "trust_coefficient"),
    (optim.fused_lamb, {"learning_rate": 0.1, "b1": 1.0}, "b1"),
    (optim.fused_lamb, {"learning_rate": 0.1, "b2": -0.1}, "b2"),
    (optim.fused_adamw, {"learning_rate": 0.1, "b2": 1.5}, "b2"),
    (optim.fused_adamw, {"learning_rate": 0.1, "eps": -1.0}, "eps"),
    (optim.fused_adamw, {"learning_rate": "0.1"}, "learning_rate"),
    (optim.fused_adamw, {"learning_rate": 0.1, "layout": "flat"}, "layout"),
])
def test_bad_hyperparameters_name_the_argument(make, kwargs, match):
  params = random_tree(np.random.default_rng(2))
  with pytest.raises(ValueError, match=match):
    make(**kwargs).init(params)


@pytest.mark.parametrize("make,kwargs,match", [
    (optim.fused_sgd, {"weight_decay": 0.1, "weight_decay_mask": {"conv": True}},
     "weight_decay_mask"),
    (optim.fused_lars, {"trust_ratio_mask": {"conv": True, "nope": False}}, "trust_ratio_mask"),
    (optim.fused_lamb, {"mask": lambda p: [True, False]}, "mask"),
    (optim.fused_adamw, {"mask": {"conv": 1, "dense": True, "scale": True, "odd": True,
                                  "wide": True, "zero": True}}, "mask"),
])
@pytest.mark.parametrize("face", ["pytree", "flat"])
def test_mask_that_does_not_match_params_fails_at_init(make, kwargs, match, face):
  params = random_tree(np.random.default_rng(3))
  if face == "pytree":
    with pytest.raises(ValueError, match=match):
      make(0.1, **kwargs).init(params)
  else:
    layout = optim.flat_layout(params)
    with pytest.raises(ValueError, match=match):
      make(0.1, **kwargs, layout=layout).init(layout.ravel(params, jnp.float32))


def test_flat_face_rejects_buffers_of_the_wrong_length():
  params = random_tree(np.random.default_rng(4))
  layout = optim.flat_layout(params)
  tx = optim.fused_lars(0.1, layout=layout)
  with pytest.raises(ValueError, match=str(layout.padded_size)):
    tx.init(jnp.zeros(layout.padded_size - 1))
  state = tx.init(jnp.zeros(layout.padded_size))
  with pytest.raises(ValueError, match="params"):
    tx.update(jnp.zeros(layout.padded_size), state)


@pytest.mark.parametrize("path", ["kernel", "xla"])
@pytest.mark.parametrize("impl", ["pytree", "flat"])
def test_adamw_with_a_frozen_variance_equals_numpy(rng, impl, path):
  """freeze_variance_after=F: Adam's second moment (and its bias correction) stop changing
  after F steps; the first moment and the decay run on; once frozen each coordinate's direction
  is clipped to the bound it had while the variance ran (here 1.566). Checked against numpy,
  on the CPU kernel and on the XLA path (GPU's), with gradients after the freeze 30x those
  before at some coordinates (a token absent until then), so that the clip acts."""
  lr, b1, b2, eps, wd, freeze = 0.01, 0.8, 0.95, 1e-6, 0.02, 3
  params = random_tree(rng)
  grads_seq = [random_tree(rng, zero_leaf=False) for _ in range(7)]
  outgrown = [rng.random(x.shape) < 0.3 for x in jax.tree.leaves(params)]
  grads_seq[freeze:] = [jax.tree.unflatten(jax.tree.structure(g), [
      np.where(o, 30.0, 1.0).astype(np.float32) * np.asarray(x)
      for o, x in zip(outgrown, jax.tree.leaves(g))]) for g in grads_seq[freeze:]]
  bound = (1 - b1) / np.sqrt((1 - b2) * (1 - b1 * b1 / b2))
  assert float(optim.frozen_bound(b1, b2)) == pytest.approx(bound, rel=1e-6)
  assert float(optim.frozen_bound(b1, b2, nesterov=True)) == pytest.approx(
      b1 * bound + max(1.0, (1 - b1) / np.sqrt(1 - b2)), rel=1e-6)
  assert float(optim.frozen_bound(0.99, 0.95)) == np.inf  # b1^2 >= b2: Adam has no bound
  clipped = 0
  kwargs = dict(learning_rate=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd,
                freeze_variance_after=freeze)
  if impl == "pytree":
    tx = optim.fused_adamw(**kwargs)
  else:
    layout = FlatLayout.from_tree(params, pad_to=8, align=16)
    tx = FlatFace(lambda lay: optim.fused_adamw(**kwargs, layout=lay), layout)
  with contextlib.ExitStack() as stack:
    if path == "xla":
      stack.enter_context(cpu_kernels.disabled())
    _, got_p, _ = run(tx, params, grads_seq)

  p = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
  m, v2 = [np.zeros_like(x) for x in p], [np.zeros_like(x) for x in p]
  for t, g in enumerate(grads_seq, start=1):
    for i, gi in enumerate(jax.tree.leaves(g)):
      gi = np.asarray(gi, np.float64)
      m[i] = b1 * m[i] + (1 - b1) * gi
      if t <= freeze:
        v2[i] = b2 * v2[i] + (1 - b2) * gi * gi
      m_hat, v_hat = m[i] / (1 - b1 ** t), v2[i] / (1 - b2 ** min(t, freeze))
      direction = m_hat / (np.sqrt(v_hat) + eps)
      if t > freeze:
        clipped += int(np.sum(np.abs(direction) > bound))
        direction = np.clip(direction, -bound, bound)
      p[i] = p[i] - lr * (direction + wd * p[i])
    for i, got in enumerate(jax.tree.leaves(got_p[t - 1])):
      np.testing.assert_allclose(np.asarray(got), p[i], rtol=2e-5, atol=1e-6,
                                 err_msg=f"step {t}, leaf {i}")
  assert clipped > 0  # (the clip acted: without it the test's reference would differ)
  with pytest.raises(ValueError, match="freeze_variance_after.*0"):
    optim.fused_adamw(0.1, freeze_variance_after=0)
