"""The pairs' 4-byte wire format (`sparsejax.wire`, `experimental.wire="pairs4"`): the words
and block counts against numpy, the exchange against a numpy reference (what is sent plus what
is kept is the candidates to the bit), and the bytes on the wire read from the compiled
program against `comm.wire_bytes`."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh, run_workers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax import comm, hlo, wire
from sparsejax.compress import density_levels, density_schedule, exchange
from sparsejax.feedback import MomentumCorrection, error_feedback

AXES = ("node", "local")


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("length,k,first", [
    (200_003, 777, 0), (65_536, 301, 0), (1_000, 17, 0), (131_073, 5, 0),
    (200_003, 150_001, 0), (70_001, 6_007, 0),  # dense enough to order by a prefix count
    (262_147, 301, 140_000), (262_147, 120_007, 131_000)])  # empty blocks before the pairs
def test_words_and_block_counts_give_back_every_pair(rng, length, k, first):
  """Three workers' pairs packed, concatenated as an all-gather gives them, unpacked: the
  indices exactly, the values rounded to bfloat16 (numpy's ml_dtypes), in index order."""
  values, indices, words = [], [], []
  pack = jax.jit(wire.pack, static_argnums=2)  # as in the exchange's step (not op by op)
  for _ in range(3):
    idx = (first + rng.choice(length - first, size=k, replace=False)).astype(np.int32)
    val = (rng.standard_normal(k) * 10.0 ** rng.integers(-3, 3, k)).astype(np.float32)
    values.append(val)
    indices.append(idx)
    words.append(np.asarray(pack(jnp.asarray(val), jnp.asarray(idx), length)))
  assert all(w.dtype == np.uint32 and w.shape == (k + wire.blocks(length),) for w in words)
  got_v, got_i = jax.jit(wire.unpack, static_argnums=(1, 2))(jnp.asarray(np.concatenate(words)),
                                                             k, length)
  for w in range(3):
    order = np.argsort(indices[w])
    np.testing.assert_array_equal(np.asarray(got_i)[w * k:(w + 1) * k], indices[w][order])
    np.testing.assert_array_equal(np.asarray(got_v)[w * k:(w + 1) * k], _bf16(values[w][order]))
  sent, error = wire.round_values(jnp.asarray(values[0]))
  np.testing.assert_array_equal(np.asarray(sent) + np.asarray(error), values[0])  # exact
  assert wire.blocks(length) == (0 if length <= 65_536 else -(-length // 65_536))


def _run(mesh, tx, seq):
  spec = P(AXES)

  def body(*gs):
    gs = [g[0] for g in gs]
    state = tx.init(gs[0])
    outs = []
    for g in gs:
      out, state = tx.update(g, state)
      outs.append(out[None])
    return outs, state.feedback.residual[None]

  placed = [jax.device_put(g, NamedSharding(mesh, spec)) for g in seq]
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  return fn, jax.tree.map(np.asarray, fn(*placed)), placed


def test_topk_allgather_in_pairs4_sends_the_rounded_top_k_and_keeps_the_rest(rng):
  """One step from an empty memory, 8 workers: each worker's residual is its gradient with
  the top k replaced by their rounding error (to the bit: sent plus kept is the gradient), and
  the output is the mean of the rounded top k (numpy: exact top-k, ml_dtypes bfloat16)."""
  n, k, p = 200_003, 2000, 8
  x = rng.standard_normal((p, n)).astype(np.float32)
  tx = exchange(comm.sparse_collective("allgather", AXES, "pairs4"),
                density_schedule(k / n), feedback=error_feedback(), selector="exact")
  _, (outs, residual), _ = _run(make_mesh(2, 4), tx, [x])
  want_sum, kk = np.zeros(n, np.float64), max(1, round(k / n * residual.shape[1]))
  for w in range(p):
    top = np.argsort(-np.abs(x[w]), kind="stable")[:kk]
    sent = _bf16(x[w][top])
    want_r = x[w].copy()
    want_r[top] = x[w][top] - sent
    np.testing.assert_array_equal(residual[w][:n], want_r)
    np.testing.assert_array_equal(residual[w][:n] + np.where(np.isin(np.arange(n), top),
                                                             _bf16(x[w]), 0.0), x[w])
    np.add.at(want_sum, top, sent)
  np.testing.assert_allclose(outs[0][0], want_sum / p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
@pytest.mark.parametrize("algorithm", ["hitopk", "allgather"])
def test_nothing_is_lost_over_steps_with_momentum_correction(rng, nodes, local, algorithm):
  """Six steps with momentum correction (unmasked): the outputs times the workers plus what
  every worker keeps is the sum of the velocities, as with pairs8."""
  p, n, m = nodes * local, 12_345, 0.9
  seq = [rng.standard_normal((p, n)).astype(np.float32) for _ in range(6)]
  tx = exchange(comm.sparse_collective(algorithm, AXES, "pairs4"), density_schedule(0.02),
                feedback=error_feedback(MomentumCorrection(m, masking=False)))
  _, (outs, residual), _ = _run(make_mesh(nodes, local), tx, seq)
  velocity, total = np.zeros(n), np.zeros(n)
  for g in seq:
    velocity = m * velocity + g.sum(0).astype(np.float64)
    total += velocity
  kept = (residual.reshape(nodes, -1).sum(0) if algorithm == "hitopk"
          else residual.sum(0))[:n]
  sent = sum(o[0] for o in outs) * p
  np.testing.assert_allclose(sent + kept, total, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("algorithm,nodes,local", [("allgather", 2, 4), ("hitopk", 4, 2),
                                                   ("hitopk", 2, 4)])
@pytest.mark.parametrize("form", wire.WIRES)
def test_the_bytes_on_the_wire_are_the_compiled_program_s(rng, algorithm, nodes, local, form):
  """The pairs' all-gather in the compiled step (its element type and count, its group) sends
  per worker what `comm.wire_bytes` counts for the pairs: (group - 1) x one worker's piece;
  pairs4 half of pairs8 but for the block counts."""
  n, density = 300_007, 0.01
  x = rng.standard_normal((nodes * local, n)).astype(np.float32)
  tx = exchange(comm.sparse_collective(algorithm, AXES, form), density_schedule(density),
                feedback=error_feedback())
  fn, _, placed = _run(make_mesh(nodes, local), tx, [x])
  gathers = [c for c in hlo.collectives(fn.lower(*placed).compile())
             if c["op"] == "all-gather" and c["dtype"] in ("u32", "s32")]
  pairs_group = nodes if algorithm == "hitopk" else nodes * local
  [pairs] = [c for c in gathers if c["group"] == pairs_group and c["elements"] < n]
  sent = pairs["bytes"] * (pairs_group - 1) // pairs_group
  padded = -(-n // local) * local
  part = padded // local if algorithm == "hitopk" else padded
  k = max(1, round(density * part))
  want = comm.wire_bytes(algorithm, n=padded, k=k, nodes=nodes, local=local, wire=form)
  dense_parts = (comm.wire_bytes("hierarchical", n=padded, nodes=nodes, local=local)["intra"]
                 if algorithm == "hitopk" else 0.0)
  assert sent == want["inter"] + want["intra"] - dense_parts
  assert pairs["dtype"] == ("u32" if form == "pairs4" else "s32")


def _dense_sum_reference(x, groups):
  """numpy's `comm.dense_sum` in pairs4 over each group of workers (rows of `x`): every value
  rounded to bfloat16, chunk j of the group's rounded values summed in float32 by the group's
  j-th worker and rounded again; each worker keeps its values' rounding error plus, on its
  chunk, the sum's. Returns (total, kept) per worker."""
  total, kept = np.zeros_like(x), np.zeros_like(x)
  n = x.shape[1]
  for group in groups:
    g = len(group)
    chunk = -(-n // g)
    sent = _bf16(x[group])
    exact = sent.sum(0, dtype=np.float32)
    rounded = _bf16(exact)
    for j, w in enumerate(group):
      total[w] = rounded
      kept[w] = x[w] - sent[j]
      mine = slice(j * chunk, (j + 1) * chunk)
      kept[w][mine] += exact[mine] - rounded[mine]
  return total, kept


@pytest.mark.parametrize("nodes,local,parties", [(2, 4, ("node",)), (4, 2, ("node",)),
                                                 (2, 4, ("node", "local")), (3, 1, ("node",))])
def test_the_dense_form_in_pairs4_sums_bfloat16_and_keeps_every_rounding_error(
    rng, nodes, local, parties):
  """`comm.dense_sum` in pairs4 against numpy (a buffer that no group size divides): the total
  bit for bit, the same on every worker of a group, what each keeps bit for bit, and the total
  plus what the group keeps is the group's sum of the inputs. (The inputs are bfloat16
  values of exponents -4..4 plus less than half their spacing, so that every float32 sum of
  them is exact whatever its order, and the reference's order need not be XLA's.)"""
  n, p = 10_007, nodes * local
  exponent = rng.integers(-4, 5, (p, n)).astype(np.float64)
  base = (rng.choice([-1.0, 1.0], (p, n)) * 2.0 ** exponent
          * (1 + rng.integers(0, 128, (p, n)) / 128))
  x = (base + np.sign(base) * 2.0 ** (exponent - 7) * rng.uniform(0.05, 0.45, (p, n))
       ).astype(np.float32)  # (away from zero: within the binade, under half the spacing)
  assert (_bf16(x) == base).all()
  total, kept = run_workers(make_mesh(nodes, local),
                            lambda v: comm.dense_sum(v, parties, "pairs4"), x)
  workers = np.arange(p).reshape(nodes, local)
  groups = [list(workers[:, i]) for i in range(local)] if parties == ("node",) else [list(range(p))]
  want_total, want_kept = _dense_sum_reference(x, groups)
  np.testing.assert_array_equal(total, want_total)
  np.testing.assert_array_equal(kept, want_kept)
  assert kept.any()
  for group in groups:  # (to the float32 rounding of a worker's two errors' sum, < 2^-24)
    np.testing.assert_allclose(total[group[0]].astype(np.float64)
                               + kept[group].astype(np.float64).sum(0),
                               x[group].astype(np.float64).sum(0), rtol=0, atol=2.0 ** -22)
  plain_total, plain_kept = run_workers(make_mesh(nodes, local),
                                        lambda v: comm.dense_sum(v, parties), x)
  assert not plain_kept.any()
  np.testing.assert_allclose(plain_total[groups[0][0]], x[groups[0]].sum(0), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("algorithm,nodes,local", [("allgather", 2, 4), ("hitopk", 4, 2),
                                                   ("hitopk", 2, 4)])
def test_the_dense_form_s_bytes_in_pairs4_are_the_compiled_program_s(rng, algorithm, nodes,
                                                                     local):
  """The dense form of an exchange in pairs4 (a forced dense level): its all-to-all and
  all-gather of bfloat16 bits (uint16: XLA:CPU would carry bfloat16 as float32) across the
  dense parties send per worker what `comm.wire_bytes` counts for the form with that wire
  (half of float32's all-reduce), and no float32 value crosses them."""
  n = 300_008  # (each party's part divides into the group's chunks)
  x = rng.standard_normal((nodes * local, n)).astype(np.float32)
  tx = exchange(comm.sparse_collective(algorithm, AXES, "pairs4"),
                density_schedule(0.01, dense_form=True), feedback=error_feedback())
  mesh, spec = make_mesh(nodes, local), P(AXES)

  def body(g):
    out, state = tx.update(g[0], tx.init(g[0]), density_level=1)
    return out[None], state.bytes_sent[None]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  placed = jax.device_put(x, NamedSharding(mesh, spec))
  group = nodes if algorithm == "hitopk" else nodes * local
  found = [c for c in hlo.collectives(fn.lower(placed).compile()) if c["group"] == group]
  assert {(c["op"], c["dtype"]) for c in found} == {("all-to-all", "u16"),
                                                    ("all-gather", "u16")}
  sent = sum(c["bytes"] * (group - 1) // group for c in found)
  form = comm.dense_form(algorithm)
  want = comm.wire_bytes(form, n=n, nodes=nodes, local=local, wire="pairs4")
  local_part = (comm.wire_bytes(form, n=n, nodes=nodes, local=local)["intra"]
                if algorithm == "hitopk" else 0.0)
  assert sent == want["inter"] + want["intra"] - local_part
  assert want["inter"] == comm.wire_bytes(form, n=n, nodes=nodes, local=local)["inter"] / 2
  assert float(np.asarray(fn(placed)[1])[0]) == want["inter"] + want["intra"]


@pytest.mark.parametrize("correction", [None, MomentumCorrection(0.9)])
def test_the_steady_step_sums_bfloat16_only_without_a_correction(rng, correction):
  """pairs4's steady dense step (level 2 after the dense form): without a correction its sum
  crosses as bfloat16 and keeps the roundings; with one (the residual holds the correction's
  candidates, not gradients) it sums float32 and leaves the residual as the dense form left it.
  Each step's `bytes_sent` says which."""
  nodes, local, n = 2, 4, 20_011
  seq = [rng.standard_normal((nodes * local, n)).astype(np.float32) for _ in range(2)]
  tx = exchange(comm.sparse_collective("hitopk", AXES, "pairs4"),
                density_schedule(0.01, dense_form=True), feedback=error_feedback(correction))

  def body(g0, g1):
    state = tx.init(g0)
    _, state = tx.update(g0, state, density_level=1)
    after_dense = state.feedback.residual
    _, state = tx.update(g1, state, density_level=2)
    return after_dense, state.feedback.residual, state.bytes_sent

  after_dense, after_steady, sent = run_workers(make_mesh(nodes, local), body, *seq)
  padded = -(-n // local) * local
  wire_of_steady = "pairs4" if correction is None else "pairs8"
  want = comm.wire_bytes("hierarchical", n=padded, nodes=nodes, local=local, wire=wire_of_steady)
  assert float(sent[0]) == want["inter"] + want["intra"]
  assert after_dense.any()  # (the dense form's roundings)
  if correction is None:
    assert not np.array_equal(after_steady, after_dense)  # its own roundings kept
  else:
    np.testing.assert_array_equal(after_steady, after_dense)


def test_pairs4_is_refused_where_it_cannot_keep_its_rounding_error():
  with pytest.raises(ValueError, match="unknown wire format 'pairs2'"):
    comm.sparse_collective("hitopk", AXES, "pairs2")
  with pytest.raises(ValueError, match="wire 'pairs4' is for allgather, hitopk, got 'gtopk'"):
    comm.sparse_collective("gtopk", AXES, "pairs4")
  with pytest.raises(ValueError, match="wire 'pairs4' needs error feedback"):
    exchange(comm.sparse_collective("hitopk", AXES, "pairs4"), density_schedule(0.01))


def test_the_config_s_wire_reaches_the_plan_and_is_checked():
  """`experimental.wire="pairs4"`: its pairs are half pairs8's bytes and its dense form sends
  bfloat16 values, half float32's, so the pairs break even with the dense form at the density
  they do in pairs8 (HiTopKComm at 2 nodes: about 0.5, so a warm-up's 0.8 runs the dense form
  in both); with a momentum correction the dense form's steady steps sum float32, so 0.8's
  pairs run;
  refused for gTop-k and without error feedback."""
  from conftest import override

  from sparsejax.train import config as config_lib
  from sparsejax.train import make_plan
  base = {"compression.warmup_epochs": 1.0, "compression.warmup_density": 0.8,
          "mesh.nodes": 2, "mesh.local": 4}
  eight = make_plan(config_lib.validate(override(config_lib.default_config(), base)), 100)
  four = make_plan(config_lib.validate(override(config_lib.default_config(),
                                                {**base, "experimental.wire": "pairs4"})), 100)
  assert eight.levels == four.levels == density_levels(0.01, 0.8) and len(four.levels) == 6
  assert eight.dense_levels == four.dense_levels == (4,)
  corrected = make_plan(config_lib.validate(override(config_lib.default_config(), {
      **base, "experimental.wire": "pairs4", "compression.momentum_correction": True})), 100)
  assert corrected.dense_levels == ()  # (its steady steps sum float32: 0.8's pairs are less)
  assert (eight.wire, eight.dense_wire, four.wire, four.dense_wire) == (
      "pairs8", "pairs8", "pairs4", "pairs4")
  assert (corrected.wire, corrected.dense_wire) == ("pairs4", "pairs8")  # (auto's model reads)
  for bad, match in (({"compression.algorithm": "gtopk"}, "'pairs8' unless the sparse"),
                     ({"compression.error_feedback": False}, "error_feedback False")):
    config = override(config_lib.default_config(), {"experimental.wire": "pairs4", **bad})
    with pytest.raises(ValueError, match=match):
      config_lib.validate(config)


@pytest.mark.integration  # end to end: trains through the trainer (10-40 s on 2 cores)
def test_a_run_in_pairs4_logs_the_bytes_it_sends(tmp_path):
  """Three steps of the quickstart's recipe (2 x 4 workers, HiTopKComm at 0.01) with
  `experimental.wire="pairs4"`, its ResNet-20 swapped for a small MLP (a ResNet's compile was
  ~15 of this test's ~20 s on 2 cores; the bytes follow the flat gradient's length, whatever the
  model): finite losses, and each step's bytes are `comm.wire_bytes` of pairs4 at its level."""
  import os

  from conftest import override

  from sparsejax.train import Run
  from sparsejax.train import config as config_lib
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = config_lib.validate(override(
      config_lib.load_config(os.path.join(root, "configs", "quickstart.py")),
      {"model.name": "mlp", "model.hidden": (64,), "experimental.wire": "pairs4",
       "compression.warmup_epochs": 0.0}))
  run = Run(config)
  layout = run.setup.layout
  k = max(1, round(0.01 * (layout.padded_size // 4)))
  want = comm.wire_bytes("hitopk", n=layout.padded_size, k=k, nodes=2, local=4, wire="pairs4")
  for step in range(3):
    metrics, = run.step(step)
    assert np.isfinite(float(metrics["loss"]))
    assert float(metrics["bytes_sent"]) == pytest.approx(want["inter"] + want["intra"])
