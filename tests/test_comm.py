"""Collectives on 8 CPU devices against numpy references, on every mesh shape."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, run_workers

from sparsejax import comm, topk
from sparsejax.feedback import Feedback, MomentumCorrection

MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
HLO_MESHES = MESHES + [(3, 2), (7, 1)]  # gTop-k's fold for a group that is not a power of two


def residual_array(result):
  """(total, Feedback) -> (total, the residual array)."""
  total, feedback = result
  return total, feedback.residual


def np_topk_pairs(acc, k):
  idx = np.argsort(-np.abs(acc), kind="stable")[:k]
  return acc[idx], idx


@pytest.mark.parametrize("nodes,local", MESHES)
def test_dense_and_hierarchical_equal_numpy_sum(rng, nodes, local):
  n = 1237 * local  # a prime shard length
  x = rng.standard_normal((nodes * local, n)).astype(np.float32)
  mesh = make_mesh(nodes, local)
  dense = run_workers(mesh, lambda v: comm.dense_allreduce(v, axes=("node", "local")), x)
  hier = run_workers(mesh, lambda v: comm.hierarchical_allreduce(
      v, node_axis="node", local_axis="local"), x)
  for out in (dense, hier):
    np.testing.assert_allclose(out, np.broadcast_to(x.sum(0), out.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nodes,local", MESHES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_topk_allgather_equals_numpy(rng, nodes, local, dtype):
  p, n, k = nodes * local, 1009, 23
  x = rng.standard_normal((p, n)).astype(dtype)
  res = rng.standard_normal((p, n)).astype(np.float32)
  mesh = make_mesh(nodes, local)
  total, new_res = run_workers(mesh, lambda v, r: residual_array(comm.topk_allgather(
      v, k, axes=("node", "local"), residual=Feedback(r), select="exact")), x, res)
  want = np.zeros(n, np.float32)
  for w in range(p):
    acc = x[w].astype(np.float32) + res[w]
    vals, idx = np_topk_pairs(acc, k)
    np.add.at(want, idx, vals)
    kept = acc.copy()
    kept[idx] = 0
    np.testing.assert_allclose(new_res[w], kept, rtol=1e-6)
  np.testing.assert_allclose(total, np.broadcast_to(want, total.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nodes,local", MESHES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_hitopk_equals_numpy(rng, nodes, local, dtype):
  p, shard, k = nodes * local, 1031, 19
  n = shard * local
  x = rng.standard_normal((p, n)).astype(dtype)
  res = rng.standard_normal((p, shard)).astype(np.float32)
  mesh = make_mesh(nodes, local)
  total, new_res = run_workers(mesh, lambda v, r: residual_array(comm.hitopk_allreduce(
      v, k, node_axis="node", local_axis="local", residual=Feedback(r), select="exact")), x, res)
  xs = x.astype(np.float32).reshape(nodes, local, n)
  want = np.zeros(n, np.float32)
  for node in range(nodes):
    node_sum = xs[node].sum(0)
    for i in range(local):
      w = node * local + i
      acc = node_sum[i * shard:(i + 1) * shard] + res[w]
      vals, idx = np_topk_pairs(acc, k)
      np.add.at(want, idx + i * shard, vals)
      kept = acc.copy()
      kept[idx] = 0
      tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
      np.testing.assert_allclose(new_res[w], kept, rtol=tol, atol=tol)
  tol = 5e-2 if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(total, np.broadcast_to(want, total.shape), rtol=tol, atol=tol)


def np_corrected_step(x, res, vel, k, momentum, nesterov, masking):
  """DGC momentum correction of one buffer, in numpy: returns (values, indices, res, vel)."""
  vel = momentum * vel + x
  acc = res + (x + momentum * vel if nesterov else vel)
  vals, idx = np_topk_pairs(acc, k)
  acc, vel = acc.copy(), vel.copy()
  acc[idx] = 0
  if masking:
    vel[idx] = 0
  return vals, idx, acc, vel


@pytest.mark.parametrize("algorithm,nesterov,masking", [
    ("allgather", False, True), ("allgather", True, False),
    ("hitopk", True, True), ("hitopk", False, False)])
def test_momentum_correction_equals_numpy(rng, algorithm, nesterov, masking):
  """Three steps of DGC momentum correction (velocity accumulated before selection, both
  buffers masked where sent) against a numpy reference, per worker and per shard."""
  nodes, local, shard, k, m = 2, 4, 1013, 17, 0.87
  p = nodes * local
  n = shard * local
  r = shard if algorithm == "hitopk" else n
  xs = [rng.standard_normal((p, n)).astype(np.float32) for _ in range(3)]
  mesh = make_mesh(nodes, local)

  def body(*steps):
    state = Feedback(jnp.zeros(r), jnp.zeros(r))
    totals = []
    for x in steps:
      if algorithm == "hitopk":
        total, state = comm.hitopk_allreduce(x, k, node_axis="node", local_axis="local",
                                             residual=state, select="exact",
                                             correction=MomentumCorrection(m, nesterov, masking))
      else:
        total, state = comm.topk_allgather(x, k, axes=("node", "local"), residual=state,
                                           select="exact",
                                           correction=MomentumCorrection(m, nesterov, masking))
      totals.append(total)
    return totals, state

  totals, state = run_workers(mesh, body, *xs)
  assert isinstance(state, Feedback) and state.velocity is not None
  res, vel = np.zeros((p, r)), np.zeros((p, r))
  for step, x in enumerate(xs):
    want = np.zeros(n)
    for w in range(p):
      node, i = divmod(w, local)
      if algorithm == "hitopk":
        node_sum = x[node * local:(node + 1) * local].sum(0)
        part, offset = node_sum[i * shard:(i + 1) * shard], i * shard
      else:
        part, offset = x[w], 0
      vals, idx, res[w], vel[w] = np_corrected_step(part.astype(np.float64), res[w], vel[w], k,
                                                    m, nesterov, masking)
      np.add.at(want, idx + offset, vals)
    np.testing.assert_allclose(totals[step], np.broadcast_to(want, totals[step].shape),
                               rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(state.residual, res, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(state.velocity, vel, rtol=1e-4, atol=1e-4)
  if masking:
    assert np.count_nonzero(state.velocity == 0) >= p * k  # masked where sent


@pytest.mark.parametrize("algorithm", ["allgather", "hitopk"])
def test_mstopk_inside_collectives_sends_what_it_keeps_back(rng, algorithm):
  """With MSTopK (recall < 1 allowed) the identity total + residuals = inputs still holds."""
  nodes, local, n, k = 2, 4, 4 * 3001, 29
  x = rng.standard_normal((8, n)).astype(np.float32)
  mesh = make_mesh(nodes, local)
  if algorithm == "allgather":
    total, res = run_workers(mesh, lambda v: residual_array(comm.topk_allgather(
        v, k, axes=("node", "local"), residual=Feedback(jnp.zeros(n)))), x)
    kept = res.sum(0)
  else:
    total, res = run_workers(mesh, lambda v: residual_array(comm.hitopk_allreduce(
        v, k, node_axis="node", local_axis="local", residual=Feedback(jnp.zeros(n // local)))),
        x)
    kept = res.reshape(nodes, local * (n // local)).sum(0)
  np.testing.assert_allclose(total[0] + kept, x.sum(0), rtol=1e-5, atol=1e-5)
  sent_per_worker = np.count_nonzero(total[0])
  assert sent_per_worker <= (8 if algorithm == "allgather" else nodes * local) * k


# --- wire bytes against the compiled HLO ---------------------------------------------------------

_COLLECTIVE = re.compile(
    r"= (?P<out>\(?[^=]*?\)?) (?P<op>all-reduce|all-gather|reduce-scatter)(?:-start)?\("
    r"(?P<args>[^)]*)\).*?replica_groups=(?P<groups>\{[^=]*?\}\}|\[[^\]]*\]<=\[[^\]]*\][^,]*)")
_PERMUTE = re.compile(r"= (?P<out>\S+) collective-permute(?:-start)?\(.*?source_target_pairs="
                      r"(?P<pairs>\{[\d,{}]*\}\})")
_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "u32": 4}


def _shape_bytes(text):
  total = 0
  for dt, dims in re.findall(r"(f32|s32|bf16|u32)\[([\d,]*)\]", text):
    total += _BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def _groups(text, num_devices):
  if text.startswith("{"):
    return [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", text[1:-1])]
  m = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](T\(([\d,]+)\))?", text)
  g, s = int(m.group(1)), int(m.group(2))
  dims = [int(d) for d in m.group(3).split(",")]
  ids = np.arange(num_devices).reshape(dims)
  if m.group(5):
    ids = ids.transpose([int(d) for d in m.group(5).split(",")])
  return ids.reshape(g, s).tolist()


def hlo_wire_bytes(hlo: str, local: int, num_devices: int):
  """Bytes one worker sends, from the collectives in compiled HLO (ring formulas)."""
  out = {"inter": 0.0, "intra": 0.0}
  for m in _COLLECTIVE.finditer(hlo):
    groups = _groups(m.group("groups"), num_devices)
    g = len(groups[0])
    if g == 1:
      continue
    spans = len({d // local for d in groups[0]}) > 1
    result = _shape_bytes(m.group("out"))  # compiled HLO names operands without their shapes
    if m.group("op") == "all-reduce":
      sent = 2 * (g - 1) / g * result
    elif m.group("op") == "reduce-scatter":
      sent = (g - 1) / g * (result * g)
    else:
      sent = (g - 1) * (result / g)
    out["inter" if spans else "intra"] += sent
  for m in _PERMUTE.finditer(hlo):  # worker 0's sends
    targets = [int(t) for s, t in re.findall(r"\{(\d+),(\d+)\}", m.group("pairs")) if s == "0"]
    for t in targets:
      out["inter" if t // local != 0 else "intra"] += _shape_bytes(m.group("out"))
  return out


@pytest.mark.parametrize("nodes,local", HLO_MESHES)
@pytest.mark.parametrize("algorithm", comm.ALGORITHMS)
def test_wire_bytes_match_compiled_hlo(nodes, local, algorithm):
  shard, k = 1013, 17
  n = shard * local
  mesh = make_mesh(nodes, local)
  spec = jax.sharding.PartitionSpec(("node", "local"))
  fns = {
      "dense": lambda v: comm.dense_allreduce(v, axes=("node", "local")),
      "hierarchical": lambda v: comm.hierarchical_allreduce(v, node_axis="node",
                                                            local_axis="local"),
      "allgather": lambda v: comm.topk_allgather(v, k, axes=("node", "local"))[0],
      "hitopk": lambda v: comm.hitopk_allreduce(v, k, node_axis="node", local_axis="local")[0],
      "gtopk": lambda v: comm.gtopk_allreduce(v, k, axes=("node", "local"))[0],
      "higtopk": lambda v: comm.higtopk_allreduce(v, k, node_axis="node", local_axis="local")[0],
  }
  f = jax.jit(jax.shard_map(fns[algorithm], mesh=mesh, in_specs=spec, out_specs=spec))
  x = jax.ShapeDtypeStruct((nodes * local * n,), jnp.float32,
                           sharding=jax.sharding.NamedSharding(mesh, spec))
  hlo = f.lower(x).compile().as_text()
  got = hlo_wire_bytes(hlo, local, nodes * local)
  want = comm.wire_bytes(algorithm, n=n, k=k, nodes=nodes, local=local)
  assert got == pytest.approx(want), hlo[:3000]


def test_gather_sum_drops_out_of_range_indices_on_both_paths(rng):
  """The kernel (CPU) and the XLA scatter of `_gather_sum` agree on every index: those outside
  [0, n), negative ones too, are dropped (jnp's `.at[].add` would wrap a negative index)."""
  from sparsejax import cpu_kernels
  assert cpu_kernels.available(), cpu_kernels.why_unavailable()
  p, n, m = 8, 1013, 57
  v = rng.standard_normal((p, m)).astype(np.float32)
  i = rng.integers(-n - 5, n + 5, (p, m)).astype(np.int32)
  i[:, :4] = [-1, -n, n, -n - 1]
  ok = (i >= 0) & (i < n)
  want = np.zeros(n, np.float32)
  np.add.at(want, i[ok], v[ok])
  mesh = make_mesh(2, 4)
  sum_ = lambda v, i: comm._gather_sum(v, i, n, ("node", "local"))  # noqa: E731
  kernel = run_workers(mesh, sum_, v, i)
  with cpu_kernels.disabled():  # the XLA path (a fresh trace)
    xla = run_workers(mesh, lambda v, i: sum_(v, i), v, i)
  for out in (kernel, xla):
    np.testing.assert_allclose(out, np.broadcast_to(want, out.shape), rtol=1e-5, atol=1e-5)


def test_bad_input():
  x = jnp.ones(12)
  with pytest.raises(ValueError, match="'node' is not bound"):
    comm.dense_allreduce(x, axes="node")
  with pytest.raises(ValueError, match="'local' is not bound"):
    comm.hitopk_allreduce(x, 3, node_axis="node", local_axis="local")
  with pytest.raises(ValueError, match="unknown algorithm 'ring'"):
    comm.wire_bytes("ring", n=10, nodes=2, local=2)
  mesh = make_mesh(2, 4)
  with pytest.raises(ValueError, match="1013 is not a multiple of the 'local' axis size 4"):
    run_workers(mesh, lambda v: comm.hitopk_allreduce(v, 3, node_axis="node", local_axis="local"),
                np.ones((8, 1013), np.float32))
  with pytest.raises(ValueError, match="k=300"):
    run_workers(mesh, lambda v: comm.hitopk_allreduce(v, 300, node_axis="node",
                                                      local_axis="local"),
                np.ones((8, 1012), np.float32))
  with pytest.raises(ValueError, match="1-D"):
    run_workers(mesh, lambda v: comm.topk_allgather(v, 3, axes="node"), np.ones((8, 3, 4)))
  assert topk.check_k(x, 3) == (12, 3)
  pair = Feedback(jnp.zeros(1012), jnp.zeros(1012))
  mc = MomentumCorrection
  for kwargs, match in (({"correction": mc(0.9)},
                         "needs residual=Feedback\\(residual, velocity\\)"),
                        ({"residual": pair}, "momentum is 0"),
                        ({"residual": jnp.zeros(1012)}, "must be a sparsejax.feedback.Feedback"),
                        ({"residual": pair, "correction": mc(1.0)},
                         "momentum must be a number in \\(0, 1\\), got 1.0"),
                        ({"residual": Feedback(jnp.zeros(1012), jnp.zeros(5)),
                          "correction": mc(0.5)}, "velocity must have shape \\(1012,\\)")):
    with pytest.raises(ValueError, match=match):
      run_workers(mesh, lambda v, kw=kwargs: comm.topk_allgather(v, 3, axes="node", **kw),
                  np.ones((8, 1012), np.float32))
