"""`topk_allreduce` in the most common data-parallel step, over ONE axis: `jax.pmap(...,
axis_name="batch")` and `shard_map` over a 1-D `("data",)` mesh, 8 workers; and gradient
accumulation with `sparsejax.multi_steps` (the selection runs once per accumulated step)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import sparsejax as sj
from sparsejax.flat import FlatLayout

SHAPES = {"w": (37, 11), "b": (11,), "s": ()}


def worker_grads(rng, steps=2):
  """float32 gradients of 8 workers for `steps` steps: {leaf: [8, steps, *shape]}."""
  return {k: rng.standard_normal((8, steps) + s).astype(np.float32) for k, s in SHAPES.items()}


def run_one_axis(kind, fn, *stacked):
  """fn(*per_worker_args) once per worker over one axis named "batch" (pmap) or "data" (a 1-D
  mesh); every argument and output has a leading axis of 8 workers."""
  if kind == "pmap":
    return jax.tree.map(np.asarray, jax.pmap(fn, axis_name="batch")(*stacked))
  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  placed = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), stacked)

  def body(*args):
    out = fn(*jax.tree.map(lambda a: a[0], args))
    return jax.tree.map(lambda o: jnp.asarray(o)[None], out)

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              check_vma=False))(*placed)
  return jax.tree.map(np.asarray, out)


def axis(kind):
  return "batch" if kind == "pmap" else "data"


@pytest.mark.parametrize("algorithm", ["dense", "allgather"])
@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
def test_density_one_is_the_pmean(rng, kind, algorithm):
  grads = worker_grads(rng, steps=1)
  tx = sj.topk_allreduce(1.0, algorithm=algorithm, selector="exact", axis_name=axis(kind))

  def fn(g):
    g = jax.tree.map(lambda x: x[0], g)
    updates, _ = tx.update(g, tx.init(g))
    return updates, jax.tree.map(lambda x: jax.lax.pmean(x, axis(kind)), g)

  got, want = run_one_axis(kind, fn, grads)
  for k in SHAPES:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(got[k], np.broadcast_to(grads[k][:, 0].mean(0), got[k].shape),
                               rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("algorithm", ["dense", "allgather"])
@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
def test_error_feedback_conserves_every_value(rng, kind, algorithm):
  """Density 0.01, two steps: what was sent (mean x 8, both steps) plus every worker's residual
  equals the sum of all gradients (dense: nothing is kept, the mean is the pmean)."""
  grads = worker_grads(rng, steps=2)
  tx = sj.topk_allreduce(0.01, algorithm=algorithm, selector="exact", axis_name=axis(kind))

  def fn(g):
    state = tx.init(jax.tree.map(lambda x: x[0], g))
    sent = []
    for step in range(2):
      u, state = tx.update(jax.tree.map(lambda x, step=step: x[step], g), state)
      sent.append(u)
    return sent, None if state.feedback is None else state.feedback.residual

  sent, residual = run_one_axis(kind, fn, grads)
  layout = FlatLayout.from_tree({k: np.zeros(s, np.float32) for k, s in SHAPES.items()},
                                pad_to=8)
  total = sum(layout.ravel({k: grads[k][:, s].sum(0) for k in SHAPES}) for s in range(2))
  sent_flat = [np.asarray(layout.ravel({k: sent[s][k][w] for k in SHAPES}))
               for s in range(2) for w in range(8)]
  for s in range(2):  # every worker applies the same mean
    for w in range(8):
      np.testing.assert_array_equal(sent_flat[8 * s + w], sent_flat[8 * s])
  kept = np.zeros(layout.padded_size, np.float32) if residual is None else residual.sum(0)
  if algorithm == "dense":
    assert residual is None
  else:
    k = max(1, round(0.01 * layout.padded_size))
    assert k < layout.size and np.count_nonzero(kept) > layout.size - 2 * 8 * k
  np.testing.assert_allclose(8 * (sent_flat[0] + sent_flat[8]) + kept, np.asarray(total),
                             rtol=1e-5, atol=1e-5)


def test_one_axis_name_under_pmap(rng):
  """`topk_allreduce(1.0, algorithm="allgather", axis_name="batch")` under pmap: the mean."""
  grads = worker_grads(rng, steps=1)
  tx = sj.topk_allreduce(1.0, algorithm="allgather", axis_name="batch")
  got = run_one_axis("pmap", lambda g: tx.update(g, tx.init(g))[0],
                     jax.tree.map(lambda x: x[:, 0], grads))
  np.testing.assert_allclose(got["w"][3], grads["w"][:, 0].mean(0), rtol=1e-5, atol=1e-6)


def test_axes_errors_name_what_is_missing(rng):
  with pytest.raises(ValueError, match="'hitopk' needs two mesh axes.*'allgather'"):
    sj.topk_allreduce(0.1, algorithm="hitopk", axis_name="batch")
  with pytest.raises(ValueError, match="'hierarchical' needs two mesh axes"):
    sj.topk_allreduce(0.1, algorithm="hierarchical", axis_name="batch")
  with pytest.raises(TypeError, match="unexpected keyword argument 'node_axis'"):
    sj.topk_allreduce(0.1, algorithm="allgather", axis_name="batch", node_axis="x")
  with pytest.raises(ValueError, match="axis name or a tuple"):
    sj.topk_allreduce(0.1, algorithm="dense", axis_name=("batch", 3))
  with pytest.raises(ValueError, match="distinct"):
    sj.topk_allreduce(0.1, algorithm="dense", axis_name=("batch", "batch"))
  grads = jax.tree.map(lambda x: x[:, 0], worker_grads(rng, steps=1))
  tx = sj.topk_allreduce(0.1)  # hitopk over ("node", "local"), under a pmap that binds "batch"
  with pytest.raises(ValueError, match=r"'hitopk'.*axis 'node' is not bound.*jax\.pmap"):
    jax.pmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="batch")(grads)


def test_a_tuple_of_axes_spans_both_mesh_axes(rng):
  """axis_name=("node", "local") for allgather on a 2 x 4 mesh: the mean over all 8 workers."""
  from conftest import run_workers
  grads = jax.tree.map(lambda x: x[:, 0], worker_grads(rng, steps=1))
  tx = sj.topk_allreduce(1.0, algorithm="allgather", selector="exact",
                         axis_name=("node", "local"))
  got = run_workers(make_mesh(2, 4), lambda g: tx.update(g, tx.init(g))[0], grads)
  np.testing.assert_allclose(got["b"], np.broadcast_to(grads["b"].mean(0), got["b"].shape),
                             rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- accumulation


def counting_selector(calls):
  """The exact top-k, appending to `calls` each time it runs (once per worker and call)."""
  def select(x, k):
    jax.debug.callback(lambda: calls.append(1))
    return sj.exact_topk(x, k)
  return select


@pytest.mark.parametrize("kind", ["pmap", "shard_map 2x4"])
def test_multi_steps_selects_once_per_accumulated_step(rng, kind):
  """k = 4 over 8 micro-steps: the selection runs twice per worker (optax.MultiSteps: eight
  times), and the updates are those of optax.MultiSteps (to 1e-6)."""
  grads = rng.standard_normal((8, 8, 301)).astype(np.float32)  # worker, micro-step, value
  calls: list = []
  if kind == "pmap":
    axes = {"algorithm": "allgather", "axis_name": "batch"}
  else:
    axes = {"algorithm": "hitopk"}

  def run(wrap):
    inner = optax.chain(sj.topk_allreduce(0.05, selector=counting_selector(calls), **axes),
                        optax.sgd(0.1, momentum=0.9))
    tx = wrap(inner, 4)

    def fn(g):
      params = jnp.zeros(301)
      state, out = tx.init(params), []
      for i in range(8):
        u, state = tx.update(g[i], state, params)
        params = optax.apply_updates(params, u)
        out.append(u)
      return jnp.stack(out), state.gradient_step

    calls.clear()
    if kind == "pmap":
      out = jax.pmap(fn, axis_name="batch")(grads)
    else:  # check_vma=False: optax.MultiSteps' lax.cond fails shard_map's type check otherwise
      mesh, spec = make_mesh(2, 4), P(("node", "local"))
      out = jax.jit(jax.shard_map(lambda g: jax.tree.map(lambda o: o[None], fn(g[0])),
                                  mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))(
          jax.device_put(grads, NamedSharding(mesh, spec)))
    jax.effects_barrier()
    return jax.tree.map(np.asarray, out), len(calls)

  (want, want_steps), optax_calls = run(optax.MultiSteps)
  (got, got_steps), calls_made = run(sj.multi_steps)
  assert optax_calls == 8 * 8  # 8 workers x 8 micro-steps: the counter counts
  assert calls_made == 8 * 2   # 8 workers x 2 accumulated steps
  # A few ulp apart at most: XLA fuses the mean into the momentum update differently inside
  # multi_steps' lax.cond than beside optax.MultiSteps' select (bit for bit while topk_allreduce
  # still selected between the mean and zeros for non-finite steps), as for Adam below.
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  np.testing.assert_array_equal(got_steps, want_steps)
  assert np.all(got_steps == 2)
  assert np.all(np.any(got[:, [3, 7]] != 0, axis=-1)) and np.all(got[:, [0, 1, 2, 4, 5, 6]] == 0)


def test_multi_steps_is_optax_multisteps(rng):
  """Without collectives: a schedule of k, mean and sum accumulation, bf16 gradients, extra
  arguments passed on; the updates and state of optax.MultiSteps (to 1e-6), has_updated works."""
  schedule = lambda step: jnp.where(step < 1, 2, 3)  # noqa: E731
  params = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.bfloat16), "b": jnp.zeros(3)}
  inner = optax.adamw(0.1)
  for use_grad_mean in (True, False):
    ours = sj.multi_steps(inner, schedule, use_grad_mean=use_grad_mean)
    ref = optax.MultiSteps(inner, schedule, use_grad_mean=use_grad_mean)
    s1, s2 = ours.init(params), ref.init(params)
    update1, update2 = jax.jit(ours.update), jax.jit(ref.update)
    for i in range(5):
      g = jax.tree.map(lambda p, i=i: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
      u1, s1 = update1(g, s1, params, unused_extra=i)
      u2, s2 = update2(g, s2, params)
      for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2))):
        assert a.dtype == b.dtype
        # (1 ulp apart at most: XLA fuses Adam differently inside lax.cond than beside a select)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6, atol=0)
      assert bool(ref.has_updated(s1)) == (i in (1, 4))
  with pytest.raises(ValueError, match="every_k_schedule"):
    sj.multi_steps(inner, 0)
