"""The exchange and the trainer's whole chain, bit for bit against outputs recorded before the
exchange became a chain of pieces (tests/golden/exchange.npz).

Each case runs four steps on a (2, 4) mesh of fresh-but-fixed random gradients through either
`topk_allreduce` with the arguments the study systems use, or the whole optimizer chain a study
system's config builds; every output and every part of the final state must equal the recorded
arrays exactly. After an intended numerical change, rerecord with
`SPARSEJAX_RECORD_GOLDEN=1 python -m pytest -q tests/test_exchange_golden.py` and say why in the
commit.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, override
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax import optim
from sparsejax.comm import sparse_collective
from sparsejax.compress import (
  density_schedule,
  exchange,
  send_whole,
  tensor_balance,
  topk_allreduce,
)
from sparsejax.feedback import AdamCorrection, MomentumCorrection, error_feedback
from sparsejax.flat import FlatLayout
from sparsejax.train import config as config_lib
from sparsejax.train import make_plan

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "exchange.npz")
RECORD = os.environ.get("SPARSEJAX_RECORD_GOLDEN") == "1"
NODES, LOCAL, STEPS = 2, 4, 4
SHAPES = {"conv": (3, 3, 4, 6), "dense": (37, 11), "bias": (11,), "scale": (6,)}


def _tree(rng, lead=()):
  return {k: rng.standard_normal(lead + s).astype(np.float32) for k, s in SHAPES.items()}


def _warmup(start: float, end: float, steps: int):
  ratio = math.log(end / start)
  return lambda count: start * jnp.exp(ratio * jnp.minimum(jnp.asarray(count, jnp.float32)
                                                           / steps, 1.0))


def _whole_flags():
  layout = FlatLayout.from_tree(_tree(np.random.default_rng(0)))
  return layout.leaf_mask(lambda t: jax.tree.map(lambda x: len(x.shape) <= 1, t))


AXES = ("node", "local")


def _exchange(algorithm, density, schedule=None, dense_form=False, correction=None, **options):
  """`exchange` from its pieces (`feedback=None`: no error feedback)."""
  feedback = options.pop("feedback", error_feedback(correction))
  return exchange(sparse_collective(algorithm, AXES),
                  density_schedule(density, schedule, dense_form), feedback=feedback, **options)


# name -> (the transform, the density level of each step (None: the schedule's)), as the study
# systems use the exchange; the names are the cases recorded
EXCHANGES = {
    "hitopk-ef-levels": (lambda: topk_allreduce(0.05, schedule=_warmup(0.8, 0.05, 3)),
                         [2, 1, 0, 0]),
    "hitopk-ef-switch": (lambda: topk_allreduce(0.05, schedule=_warmup(0.8, 0.05, 3)),
                         [None] * 4),
    "allgather-ef": (lambda: topk_allreduce(0.02, algorithm="allgather"), [0] * 4),
    "gtopk-ef": (lambda: topk_allreduce(0.02, algorithm="gtopk"), [0] * 4),
    "higtopk-mc": (lambda: topk_allreduce(0.02, algorithm="higtopk",
                                          correction=MomentumCorrection(0.9, masking=False)),
                   [0] * 4),
    "hitopk-mc-nesterov": (lambda: topk_allreduce(
        0.04, correction=MomentumCorrection(0.9, nesterov=True)), [0] * 4),
    "hitopk-adam-after": (lambda: topk_allreduce(
        0.05, correction=AdamCorrection(0.0, 0.999, 1e-8)), [0] * 4),
    "hitopk-adam-before": (lambda: topk_allreduce(
        0.05, correction=AdamCorrection(0.9, 0.999, 1e-8)), [0] * 4),
    "hitopk-dense-start": (lambda: _exchange("hitopk", 0.1, dense_form=True), [1, 1, 0, 0]),
    "allgather-mc-dense-levels": (lambda: _exchange(
        "allgather", 0.05, _warmup(0.8, 0.05, 3), True, MomentumCorrection(0.9, masking=False)),
        [3, 1, 3, 0]),
    "allgather-balance": (lambda: _exchange("allgather", 0.05, balance=tensor_balance()),
                          [0] * 4),
    "hitopk-mc-balance": (lambda: _exchange("hitopk", 0.05, correction=MomentumCorrection(0.9),
                                            balance=tensor_balance()), [0] * 4),
    "hitopk-whole": (lambda: _exchange("hitopk", 0.05, whole=send_whole(_whole_flags())),
                     [0] * 4),
    "gtopk-whole": (lambda: _exchange("gtopk", 0.05, whole=send_whole(_whole_flags())),
                    [0] * 4),
    "allgather-exact-no-ef": (lambda: _exchange("allgather", 0.05, feedback=None,
                                                selector="exact"), [0] * 4),
    "hitopk-sampled": (lambda: topk_allreduce(0.05, selector="sampled"), [0] * 4),
    "dense": (lambda: topk_allreduce(1.0, algorithm="dense"), [None] * 4),
    "hierarchical": (lambda: topk_allreduce(1.0, algorithm="hierarchical"), [None] * 4),
}

_CNN_BEST = {"compression.algorithm": "hitopk", "compression.density": 0.04,
             "compression.momentum_correction": True, "experimental.momentum_masking": False,
             "experimental.lars_trust_ratio": "mean", "compression.warmup_epochs": 0.4}
# name -> (config file, overrides): the study systems' whole chains
CHAINS = {
    "mlp-hitopk": ("tta_fmnist_mlp.py", {}),
    "mlp-hitopk-mc": ("tta_fmnist_mlp.py", {"compression.momentum_correction": True,
                                            "experimental.momentum_masking": False}),
    "mlp-allgather-balance": ("tta_fmnist_mlp.py", {"compression.algorithm": "allgather",
                                                    "experimental.balance": "tensor"}),
    "mlp-gtopk": ("tta_fmnist_mlp.py", {"compression.algorithm": "gtopk"}),
    "mlp-dense": ("tta_fmnist_mlp.py", {"compression.algorithm": "dense"}),
    "cnn-best": ("tta_fmnist_resnet.py", _CNN_BEST),
    "cnn-best-whole-steps": ("tta_fmnist_resnet.py", {**_CNN_BEST,
                                                      "experimental.whole_vectors": True,
                                                      "experimental.feedback_in": "steps"}),
    "cnn-worker-ratio": ("tta_fmnist_resnet.py", {**_CNN_BEST,
                                                  "experimental.lars_trust_ratio": "worker"}),
    "cnn-hierarchical": ("tta_fmnist_resnet.py", {"compression.algorithm": "hierarchical"}),
    "lm-onebit": ("tta_kjv_lm.py", {"recipe": "onebit_adam", "compression.density": 0.1}),
    "lm-adam-after": ("tta_kjv_lm.py", {"compression.momentum_correction": True}),
    "lm-adam-before": ("tta_kjv_lm.py", {"compression.momentum_correction": True,
                                         "experimental.adam_first_moment": "before"}),
    "lm-auto": ("tta_kjv_lm.py", {"compression.algorithm": "auto",
                                  "compression.density": 0.05}),
}
SPE, TOTAL = 10, 40  # the chains' steps per epoch and run length


def run_workers(mesh, fn, *stacked):
  """`fn` once per worker inside shard_map over both axes, as the trainer runs its step
  (check_vma off); every argument and output has a leading worker axis."""
  spec = P(("node", "local"))
  placed = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), stacked)

  def body(*args):
    args = jax.tree.map(lambda a: a[0], args)
    return jax.tree.map(lambda o: jnp.asarray(o)[None], fn(*args))

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                              check_vma=False))(*placed)
  return jax.tree.map(np.asarray, out)


def _record_or_check(name: str, arrays: dict[str, np.ndarray]) -> None:
  if RECORD:
    store = dict(np.load(GOLDEN)) if os.path.exists(GOLDEN) else {}
    store = {k: v for k, v in store.items() if not k.startswith(name + "/")}
    store.update({f"{name}/{k}": v for k, v in arrays.items()})
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    np.savez_compressed(GOLDEN + ".tmp.npz", **store)
    os.replace(GOLDEN + ".tmp.npz", GOLDEN)
    return
  want = {k[len(name) + 1:]: v for k, v in np.load(GOLDEN).items()
          if k.startswith(name + "/")}
  assert sorted(want) == sorted(arrays), f"{name}: recorded {sorted(want)}, got {sorted(arrays)}"
  for key, value in arrays.items():
    np.testing.assert_array_equal(value, want[key], err_msg=f"{name}: {key}")


def _flatten(prefix: str, tree) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {prefix + jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_exchange_is_bit_for_bit_the_recorded_one(name):
  make, levels = EXCHANGES[name]
  rng = np.random.default_rng(sorted(EXCHANGES).index(name))
  seq = [_tree(rng, (NODES * LOCAL,)) for _ in range(STEPS)]
  tx = make()

  def body(*gs):
    state = tx.init(gs[0])
    outs = []
    for g, level in zip(gs, levels, strict=True):
      extra = {} if level is None else {"density_level": level}
      out, state = tx.update(g, state, **extra)
      outs.append(out)
    return outs, state

  outs, state = run_workers(make_mesh(NODES, LOCAL), body, *seq)
  _record_or_check("exchange/" + name, {**_flatten("out", outs), **_flatten("state", state)})


def _chain_config(file: str, overrides: dict):
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = config_lib.load_config(os.path.join(here, "configs", file))
  override(config, {"mesh.nodes": NODES, "mesh.local": LOCAL, "num_epochs": TOTAL / SPE,
                    **overrides})
  return config_lib.validate(config)


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chain_is_bit_for_bit_the_recorded_one(name):
  from sparsejax.train import optimizer as optimizer_lib
  config = _chain_config(*CHAINS[name])
  rng = np.random.default_rng(100 + sorted(CHAINS).index(name))
  params = _tree(rng)
  layout = optim.flat_layout(params, pad_to=LOCAL)
  plan = make_plan(config, SPE)
  assert plan.total_steps == TOTAL
  tx = optimizer_lib.build_optimizer(config, plan, layout)
  # the recorded runs' levels: the top one the dense form's where the config asks for it
  asks = config.compression.algorithm == "auto" or config.compression.dense_epochs > 0
  top = len(plan.levels) if asks else len(plan.levels) - 1
  levels = [top, max(top - 1, 0), 0, 0]
  flat = np.asarray(layout.ravel(params, jnp.float32))
  seq = [np.stack([np.asarray(layout.ravel(jax.tree.map(lambda a, i=i: a[i], g), jnp.float32))
                   for i in range(NODES * LOCAL)])
         for g in [_tree(rng, (NODES * LOCAL,)) for _ in range(STEPS)]]
  replicated = np.broadcast_to(flat, (NODES * LOCAL,) + flat.shape)

  def body(p, *gs):
    state = tx.init(p)
    outs = []
    for g, level in zip(gs, levels, strict=True):
      update, state = tx.update(g, state, p, density_level=level)
      p = p + update
      outs.append(update)
    return outs, state

  outs, state = run_workers(make_mesh(NODES, LOCAL), body, replicated, *seq)
  _record_or_check("chain/" + name, {**_flatten("out", outs), **_flatten("state", state)})

