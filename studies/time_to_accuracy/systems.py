"""The time-to-accuracy study's systems and task (run.py beside it drives them, analysis.py
reads their results): each system's runtime and config overrides,
the task's config with a system's overrides and the mesh it may have (its node count: 2 to
200), the density each step runs at, and the link bandwidths named on the command line."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# the emulated nodes, one process each: the task's mesh.nodes (the committed configs: 2) up to
# what sparsejax.cluster.EmulatedCluster builds
MIN_NODES, MAX_NODES = 2, 200
KJV_STEPS_PER_EPOCH = 457  # the Transformer task's (configs/tta_kjv_lm.py): steps named below
_CNN_BEST = {"compression.algorithm": "hitopk", "compression.density": 0.04,
             "compression.momentum_correction": True, "experimental.momentum_masking": False,
             "experimental.lars_trust_ratio": "mean", "compression.warmup_epochs": 2 * 6 / 28}
# system -> (runtime, config overrides / options). Each sparse system keeps the config's DGC
# density warm-up and error feedback.
SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("jax", {"compression.algorithm": "dense"}),
    "hierarchical": ("jax", {"compression.algorithm": "hierarchical"}),
    "allgather-0.01": ("jax", {"compression.algorithm": "allgather", "compression.density": 0.01}),
    "allgather-0.001": ("jax", {"compression.algorithm": "allgather",
                                "compression.density": 0.001}),
    "hitopk-0.01": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.01}),
    "hitopk-0.001": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.001}),
    "hitopk-0.05": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.05}),
    # a longer density warm-up (half the Transformer's recipe; from 0.2, a level of 0.05's, so
    # no step runs at the 0.8 level that 0.25 rounds up to)
    "hitopk-0.05-w0.5": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.05,
                                 "compression.warmup_epochs": 0.5,
                                 "compression.warmup_density": 0.2}),
    # AdamW's momentum correction: each worker's Adam moments before selection (Adam directions
    # are the candidates), AdamW's decay and learning rate after the exchange
    "hitopk-0.01-ac": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.01,
                               "compression.momentum_correction": True}),
    # with DGC's momentum correction (the velocity accumulated before selection; without
    # masking, sent plus kept is exactly momentum SGD's update): the optimizer runs without
    # momentum of its own
    "hitopk-0.01-mc": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.01,
                               "compression.momentum_correction": True,
                               "experimental.momentum_masking": False}),
    "hitopk-0.001-mc": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.001,
                                "compression.momentum_correction": True,
                                "experimental.momentum_masking": False}),
    # the CNN task's (LARS) closest to dense at the end: density 0.04, every worker LARS's
    # trust ratio of the workers' mean (experimental.lars_trust_ratio) and the density
    # warm-up 3x the recipe's (6/28 of the run: 0.43 of its 2 epochs)
    "hitopk-0.04-mc-mean-w3": ("jax", _CNN_BEST),
    # ... at half its bytes: density 0.02, the same warm-up's length from 0.08
    "hitopk-0.02-mc-mean-w3": ("jax", {**_CNN_BEST, "compression.density": 0.02,
                                       "compression.warmup_density": 0.08}),
    # HiTopKComm with gTop-k between the nodes (benchmarks/scale.py): k global positions
    # a step, the sums of what the nodes selected there, instead of every node's k pairs
    "higtopk-0.01-mc": ("jax", {"compression.algorithm": "higtopk", "compression.density": 0.01,
                                "compression.momentum_correction": True,
                                "experimental.momentum_masking": False}),
    "higtopk-0.001-mc": ("jax", {"compression.algorithm": "higtopk",
                                 "compression.density": 0.001,
                                 "compression.momentum_correction": True,
                                 "experimental.momentum_masking": False}),
    # a diagnostic: gTop-k keeping as many positions as HiTopKComm 0.01 can send on 2 nodes
    "higtopk-0.02-mc": ("jax", {"compression.algorithm": "higtopk", "compression.density": 0.02,
                                "compression.momentum_correction": True,
                                "experimental.momentum_masking": False}),
    # compression.algorithm=auto (sparsejax.train.auto): the form chosen by measurement
    # between dense and the sparse system named (no step factor: the run measures its lag)
    "auto-0.01-mc": ("jax", {"compression.algorithm": "auto", "compression.density": 0.01,
                             "compression.momentum_correction": True,
                             "experimental.momentum_masking": False}),
    "auto-0.05": ("jax", {"compression.algorithm": "auto", "compression.density": 0.05}),
    # the CNN task's: auto between dense and its best sparse system (hitopk-0.04-mc-mean-w3)
    "auto-0.04-mc-mean-w3": ("jax", {**_CNN_BEST, "compression.algorithm": "auto"}),
    # the CNN task's without momentum correction: HiTopKComm 0.001 or its dense form
    "auto-0.001": ("jax", {"compression.algorithm": "auto", "compression.density": 0.001}),
    "higtopk-0.001": ("jax", {"compression.algorithm": "higtopk",
                              "compression.density": 0.001}),
    # a dense finish: HiTopKComm (its density warm-up kept) to the step named of the
    # Transformer task's 457 a epoch, then its dense form (every candidate all-reduced, the
    # residual emptied) to the end of the recipe
    **{f"hitopk-{d}{w}-d{at}": ("jax", {
        "compression.algorithm": "auto", "compression.density": d,
        "auto.schedule": ((0.0, "sparse"), (at / KJV_STEPS_PER_EPOCH, "dense")),
        **({"compression.warmup_epochs": 0.5, "compression.warmup_density": 0.2} if w else {})})
       for d, w, at in [(0.05, "-w0.5", 300), (0.05, "-w0.5", 375), (0.1, "-w0.5", 375),
                        (0.05, "", 300)]},
    # a dense start: the dense form to the step named (of 457), then HiTopKComm (no density
    # warm-up)
    **{f"hitopk-{d}-s{at}": ("jax", {
        "compression.algorithm": "hitopk", "compression.density": d,
        "compression.warmup_epochs": 0.0,
        "compression.dense_epochs": at / KJV_STEPS_PER_EPOCH})
       for d, at in [(0.05, 60), (0.05, 114), (0.1, 60), (0.05, 57), (0.1, 57)]},
    # 1-bit Adam's recipe (Tang et al., 2021) on HiTopKComm, the named recipe "onebit_adam":
    # dense for the first eighth of the run, AdamW's second moment frozen from there, then
    # HiTopKComm with error feedback (with the variance frozen Adam is linear in the gradients,
    # so a delayed gradient moves the parameters as far as the gradients it holds)
    "hitopk-0.05-1bit": ("jax", {"recipe": "onebit_adam", "compression.algorithm": "hitopk",
                                 "compression.density": 0.05}),
    # (the recipe with a density warm-up over half the run after its dense start)
    "hitopk-0.05-1bit-w0.5": ("jax", {
        "compression.algorithm": "hitopk", "compression.density": 0.05,
        "compression.warmup_epochs": 0.5, "compression.warmup_density": 0.2,
        "optimizer.freeze_variance_epochs": 0.125, "compression.dense_epochs": 0.125}),
    "hitopk-0.1-1bit": ("jax", {"recipe": "onebit_adam", "compression.algorithm": "hitopk",
                                "compression.density": 0.1}),
    # the same recipe with the form measured after the dense start: HiTopKComm 0.1 where the
    # link is slow, dense (with the frozen variance: dense-fv) where it is fast
    "auto-0.1-1bit": ("jax", {"recipe": "onebit_adam", "compression.algorithm": "auto",
                              "compression.density": 0.1}),
    "dense-fv": ("jax", {"compression.algorithm": "dense",
                         "optimizer.freeze_variance_epochs": 0.125}),
    # the one-step pipelined exchange (sparsejax.train.pipelined) on two devices per worker:
    # each gradient computed while the previous one is exchanged and applied
    "dense-pipe": ("jax", {"compression.algorithm": "dense", "overlap.pipeline": "device"}),
    # ... with weight prediction: each gradient taken at the parameters extrapolated by the
    # last update (overlap.predict)
    "dense-pipe-p": ("jax", {"compression.algorithm": "dense", "overlap.pipeline": "device",
                             "overlap.predict": "last"}),
    # ... with the optimizer's update of each worker's own late gradient as the guess
    # (overlap.predict "local")
    "dense-pipe-l": ("jax", {"compression.algorithm": "dense", "overlap.pipeline": "device",
                             "overlap.predict": "local"}),
    "hitopk-0.05-pipe-l": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.05,
                                   "overlap.pipeline": "device",
                                   "overlap.predict": "local"}),
    "hitopk-0.05-w0.5-pipe-p": ("jax", {"compression.algorithm": "hitopk",
                                        "compression.density": 0.05,
                                        "compression.warmup_epochs": 0.5,
                                        "compression.warmup_density": 0.2,
                                        "overlap.pipeline": "device",
                                        "overlap.predict": "last"}),
    "dense-pipe-f0.25": ("jax", {"compression.algorithm": "dense", "overlap.pipeline": "device",
                                 "overlap.from_epochs": 0.25}),
    "hitopk-0.05-w0.5-pipe": ("jax", {"compression.algorithm": "hitopk",
                                      "compression.density": 0.05,
                                      "compression.warmup_epochs": 0.5,
                                      "compression.warmup_density": 0.2,
                                      "overlap.pipeline": "device"}),
    "hitopk-0.01-mc-pipe": ("jax", {"compression.algorithm": "hitopk", "compression.density": 0.01,
                                    "compression.momentum_correction": True,
                                    "experimental.momentum_masking": False,
                                    "overlap.pipeline": "device"}),
    "torch-ddp": ("torch", {"powersgd": False}),
    "torch-powersgd": ("torch", {"powersgd": True}),
}
DEFAULT_BANDWIDTHS = "unlimited,5gbit,2gbit,1gbit,500mbit,200mbit"
# --quick: the same code paths on scikit-learn's digits (no download, no system package), 36 steps
QUICK_SETS = ["data.name=digits", "model.hidden=(256,)", "batch_size=64", "num_epochs=1.6",
              "eval_every_steps=12", "target_value=0.5", "optimizer.warmup_epochs=0.0",
              "compression.warmup_epochs=0.4"]
PEERS_INSTALL = "pip install -e '.[peers]' torch==2.13.0"


# ----------------------------------------------------------------------------- shared set-up

def system_spec(name: str) -> tuple[str, dict[str, Any]]:
  """(runtime, options) of a system: a name of SYSTEMS, optionally followed by `+key=value`
  config overrides of its own (a variant: "hitopk-0.01+experimental.balance=tensor")."""
  base, *extra = name.split("+")
  if base not in SYSTEMS:
    raise ValueError(f"unknown system {base!r}; allowed: {', '.join(SYSTEMS)} (each optionally "
                     "followed by +key=value overrides)")
  runtime, options = SYSTEMS[base]
  bad = [e for e in extra if "=" not in e]
  if bad or (extra and runtime != "jax"):
    raise ValueError(f"system {name!r}: overrides are +key=value, for sparsejax systems only")
  return runtime, {**options, **dict(e.split("=", 1) for e in extra)}


def load_task(config_path: str, sets: list[str], system: str | None = None,
              seed: int | None = None):
  """The validated config of the task (`--config` + `--set`), with `system`'s overrides;
  mesh.num_devices is mesh.nodes x mesh.local (the study's mesh, `check_mesh`)."""
  from sparsejax.train import config as config_lib
  overrides = list(sets)
  if system is not None and system_spec(system)[0] == "jax":
    overrides += [f"{k}={v}" for k, v in system_spec(system)[1].items()]
  elif system is not None:  # the PyTorch peer's all-reduce is dense
    overrides.append("compression.algorithm=dense")
  if seed is not None:
    overrides.append(f"seed={seed}")
  tree = config_lib.apply_overrides(config_lib.load_config(config_path), overrides)
  config = config_lib.validate(tree)
  # each process gets mesh.local devices from the launcher (the parity phase: from itself), so
  # mesh.num_devices, the devices `sparsejax train` asks for in one process, follows the mesh
  if config.mesh.nodes >= 1 and config.mesh.local >= 1:
    config.mesh.num_devices = config.mesh.nodes * config.mesh.local
  return config


def check_mesh(config) -> None:
  """Raises ValueError where the task's mesh cannot run on the emulated cluster: mesh.nodes (one
  process per node) in [MIN_NODES, MAX_NODES], mesh.local >= 1, and the global batch divisible
  by nodes x local (every worker the same share)."""
  nodes, local, batch = config.mesh.nodes, config.mesh.local, config.batch_size
  if not MIN_NODES <= nodes <= MAX_NODES:
    raise ValueError(f"mesh.nodes = {nodes}: the study runs one process on each of "
                     f"{MIN_NODES} to {MAX_NODES} emulated nodes (e.g. --set mesh.nodes=8)")
  if local < 1:
    raise ValueError(f"mesh.local = {local}: the study needs the workers per node, an integer "
                     ">= 1")
  if batch % (nodes * local):
    raise ValueError(f"batch_size = {batch} is not divisible by mesh.nodes x mesh.local = "
                     f"{nodes} x {local} = {nodes * local}; set a batch_size that is")


def model_size(config, inputs=None) -> int:
  """The number of parameters of the task's model (`inputs`: its opened data, else opened)."""
  import jax

  from sparsejax import data as data_lib
  from sparsejax.train.state import build_model
  inputs = inputs or data_lib.open_inputs(config)
  model = build_model(config, inputs.num_classes)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), inputs.example(None),
                                             train=False))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


def density_per_step(config, steps_per_epoch: int, total: int) -> np.ndarray:
  """The density each step runs at (1.0 for the dense exchanges, the dense form and PyTorch),
  from the run's plan; `total` steps."""
  from sparsejax.train import make_plan
  from sparsejax.train.auto import measuring
  plan = make_plan(config, steps_per_epoch)
  fixed = plan.dense_form and not measuring(plan)  # the forms fixed by step
  if not plan.sparse or (config.compression.algorithm == "auto" and not fixed):
    return np.ones(total)
  levels = plan.levels + (1.0, 1.0)  # the dense form and its steady step: everything sent
  return np.asarray([levels[plan.level(s)] for s in range(total)])


def size_per_step(config, steps_per_epoch: int, total: int) -> list[int | None]:
  """The image size each step trains at (progressive resizing; None without a schedule)."""
  from sparsejax.train import make_plan
  plan = make_plan(config, steps_per_epoch)
  return [plan.image_size(s) for s in range(total)]


def level_steps(config, steps_per_epoch: int, total: int) -> list[list[Any]]:
  """[[density, first step at it], ...] for the levels a run passes through; with progressive
  resizing a level is a density at an image size: [[density, first step, size], ...]."""
  dens = density_per_step(config, steps_per_epoch, total)
  sizes = size_per_step(config, steps_per_epoch, total)
  out: list[list[Any]] = []
  for s, (d, size) in enumerate(zip(dens, sizes)):
    if not out or (out[-1][0], out[-1][2:]) != (d, [size] if size else []):
      out.append([float(d), s] + ([size] if size else []))
  return out


def levels_to(config, steps_per_epoch: int, total: int, steps: int) -> list[list[Any]]:
  """How many of the first `steps` steps run at each level: [[density, steps], ...], or with
  progressive resizing [[density, size, steps], ...]."""
  dens = density_per_step(config, steps_per_epoch, total)[:steps]
  sizes = size_per_step(config, steps_per_epoch, total)[:steps]
  counts: dict[tuple, int] = {}
  for d, size in zip(dens, sizes):
    key = (float(d),) + ((size,) if size else ())
    counts[key] = counts.get(key, 0) + 1
  return [[*key, n] for key, n in sorted(counts.items())]


def parse_link_change(text: str) -> tuple[tuple[str, int | None], float]:
  """`RATE@FRACTION` -> ((name, bits/s or None), fraction of the recipe's steps)."""
  rate, sep, frac = text.partition("@")
  try:
    fraction = float(frac)
  except ValueError:
    fraction = -1.0
  if not sep or not 0 < fraction < 1:
    raise ValueError(f"--link-change {text!r}: give RATE@FRACTION with 0 < FRACTION < 1 "
                     "(e.g. 100mbit@0.33)")
  return parse_bandwidths(rate)[0], fraction


def parse_bandwidths(text: str) -> list[tuple[str, int | None]]:
  from sparsejax import cluster
  out = []
  for name in text.split(","):
    name = name.strip()
    out.append((name, None if name == "unlimited" else cluster.parse_rate(name)))
  return out
