"""apply_if_finite_across: a NaN on one worker skips the step on every worker, leaving a user's
whole chain (clip, topk_allreduce, fused SGD) exactly as it was; finite steps are untouched."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sparsejax as sj

AXES = ("node", "local")


def user_chain():
  return optax.chain(optax.clip_by_global_norm(1.0),
                     sj.topk_allreduce(0.05, algorithm="hitopk"),
                     sj.fused_sgd(0.1, momentum=0.9, weight_decay=1e-4))


def grads_like(rng, p):
  return {"w": rng.standard_normal((p, 7, 13)).astype(np.float32),
          "b": rng.standard_normal((p, 13)).astype(np.float32)}


def steps(tx, params, grads_seq):
  """Per worker: init, then one update per gradient; returns params and state after each."""
  def body(params, *gs):
    state = tx.init(params)
    seen = [(params, state)]
    for g in gs:
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      seen.append((params, state))
    return seen
  # as a user's step: the fused kernels' outputs do not carry shard_map's varying-axis types,
  # so check_vma=False (as for any chain with topk_allreduce and a P() output)
  mesh, spec = make_mesh(2, 4), P(AXES)
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (8,) + x.shape), params)
  placed = jax.device_put((stacked, *grads_seq), NamedSharding(mesh, spec))

  def per_worker(*args):
    out = body(*jax.tree.map(lambda a: a[0], args))
    return jax.tree.map(lambda o: jnp.asarray(o)[None], out)

  out = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=spec, out_specs=spec,
                              check_vma=False))(*placed)
  return jax.tree.map(np.asarray, out)


def float_leaves(tree):
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


@pytest.mark.parametrize("bad,axes", [(np.nan, AXES), (np.inf, AXES), (np.nan, None)])
def test_nan_on_one_worker_leaves_params_and_every_state_bit_identical(rng, bad, axes):
  """With the axes given, and with the default (called like optax.apply_if_finite: the axes are
  the ones bound where update runs; before, the default decided per worker, that worker skipped
  the chain's collectives and XLA aborted the process after its 40 s rendezvous timeout)."""
  params = {"w": rng.standard_normal((7, 13)).astype(np.float32),
            "b": np.zeros(13, np.float32)}
  g1, g2, g3 = grads_like(rng, 8), grads_like(rng, 8), grads_like(rng, 8)
  g2["w"][5, 3, 4] = bad  # one value on one worker of eight
  tx = (sj.apply_if_finite_across(user_chain()) if axes is None else
        sj.apply_if_finite_across(user_chain(), axes))
  seen = steps(tx, params, [g1, g2, g3])
  (p1, s1), (p2, s2) = seen[1], seen[2]
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
    np.testing.assert_array_equal(a, b)  # every worker's params: bit-identical
  inner1, inner2 = float_leaves(s1.inner_state), float_leaves(s2.inner_state)
  assert len(inner1) >= 3  # the residual, the momentum, the exchange's byte counts at least
  for a, b in zip(inner1, inner2, strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(s1.inner_state), jax.tree.leaves(s2.inner_state), strict=True):
    np.testing.assert_array_equal(a, b)  # the counts too
  # every worker agreed: skipped, counted once, and the next finite step applies again
  assert not s2.last_finite.any() and (s2.notfinite_count == 1).all()
  assert (s2.total_notfinite == 1).all()
  p3, s3 = seen[3]
  assert s3.last_finite.all() and (s3.notfinite_count == 0).all()
  assert np.any(p3["w"] != p2["w"])
  for leaf in jax.tree.leaves(p3):  # the replicas stay identical
    assert np.all(leaf == leaf[:1])


def test_finite_steps_equal_the_unwrapped_chain(rng):
  params = {"w": rng.standard_normal((7, 13)).astype(np.float32),
            "b": np.zeros(13, np.float32)}
  seq = [grads_like(rng, 8) for _ in range(3)]
  wrapped = steps(sj.apply_if_finite_across(user_chain(), AXES), params, seq)
  plain = steps(user_chain(), params, seq)
  for (pw, sw), (pp, sp) in zip(wrapped, plain, strict=True):
    for a, b in zip(jax.tree.leaves(pw), jax.tree.leaves(pp), strict=True):
      np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(sw.inner_state), jax.tree.leaves(sp), strict=True):
      np.testing.assert_array_equal(a, b)


def test_under_pmap_the_default_agrees_over_the_pmapped_axis(rng):
  """pmap over 8 devices, a NaN in one device's gradient, the default axis_name: every device
  skips, so the momentum and the params stay as they were after the first step."""
  exchange = sj.topk_allreduce(0.2, algorithm="allgather", axis_name="batch")
  tx = sj.apply_if_finite_across(optax.chain(exchange, optax.sgd(0.1, momentum=0.9)))
  params = {"w": jnp.broadcast_to(jnp.asarray(rng.standard_normal(29), jnp.float32), (8, 29))}
  g1 = {"w": jnp.asarray(rng.standard_normal((8, 29)), jnp.float32)}
  g2 = {"w": g1["w"].at[6, 11].set(jnp.nan)}

  @functools.partial(jax.pmap, axis_name="batch")
  def two_steps(params, g1, g2):
    state = tx.init(params)
    u, state = tx.update(g1, state, params)
    p1 = optax.apply_updates(params, u)
    u, state2 = tx.update(g2, state, p1)
    return p1, optax.apply_updates(p1, u), state, state2

  p1, p2, s1, s2 = two_steps(params, g1, g2)
  np.testing.assert_array_equal(np.asarray(p1["w"]), np.asarray(p2["w"]))
  for a, b in zip(jax.tree.leaves(s1.inner_state), jax.tree.leaves(s2.inner_state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.asarray(s2.last_finite).any() and np.asarray(s2.total_notfinite).tolist() == [1] * 8


def test_axes_that_leave_out_a_varying_axis_are_refused_at_trace_time():
  """axis_name="local" on a (node, local) mesh whose updates vary over both: two nodes could
  decide differently, so the call is refused before anything runs, naming the axis to add."""
  mesh = make_mesh(2, 4)
  tx = sj.apply_if_finite_across(optax.sgd(0.1), "local")
  g = jax.device_put(np.ones((8, 5), np.float32), NamedSharding(mesh, P(AXES)))

  def per_worker(g):
    u, _ = tx.update(g, tx.init(g), g)
    return u

  with pytest.raises(ValueError, match=r"vary over mesh axes \['node'\].*axis_name=\("):
    jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))(g)


def test_outside_a_mapped_context_and_with_no_axes_it_is_optax_apply_if_finite():
  """No axis bound (plain jit), or axis_name=(): one process's decision, with optax's state and
  give-up rule."""
  params = {"w": jnp.ones(3)}
  bad = {"w": jnp.array([1.0, jnp.nan, 0.0])}
  for k, axes in ((0, None), (2, None), (2, ())):
    ours = jax.jit(sj.apply_if_finite_across(optax.sgd(0.1, momentum=0.9), axes,
                                             max_consecutive_errors=k).update)
    ref = optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), k)
    s_ours, s_ref = ref.init(params), ref.init(params)
    for g in (params, bad, bad, bad, params):
      u_ours, s_ours = ours(g, s_ours, params)
      u_ref, s_ref = ref.update(g, s_ref, params)
      for a, b in zip(jax.tree.leaves((u_ours, s_ours)), jax.tree.leaves((u_ref, s_ref)),
                      strict=True):
        np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="max_consecutive_errors must be an int >= 0 or None"):
    sj.apply_if_finite_across(optax.sgd(0.1), max_consecutive_errors=-1)
