"""Experiment configs: Python files with `get_config()`, checked against `default_config()`.

A config is an `ml_collections.ConfigDict` with the keys of `default_config()` (and no others).
Unknown keys and wrong types are errors that name the closest known keys; `--set key=value`
overrides are parsed with the type of the default.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import ml_collections

from sparsejax import comm
from sparsejax.data import small

__all__ = ["default_config", "validate", "apply_overrides", "load_config", "TARGET_METRICS",
           "target_reached", "RENAMED", "RECIPES"]


def default_config() -> ml_collections.ConfigDict:
  """Every key a config may set, with its default."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = _model_defaults()
  c.data = _data_defaults()
  # Mesh ("node", "local"); -1 fills the rest of the devices. num_devices > 0 asks the CLI for
  # that many virtual CPU devices when only a CPU is present.
  c.mesh = ml_collections.ConfigDict({"nodes": 1, "local": -1, "num_devices": 0})
  c.batch_size = 128            # global, over all devices
  c.num_epochs = 10.0
  c.label_smoothing = 0.0
  c.optimizer = _optimizer_defaults()
  c.compression = _compression_defaults()
  c.auto = _auto_defaults()
  c.overlap = _overlap_defaults()
  c.experimental = _experimental_defaults()
  # a named recipe (sparsejax.train.recipes), applied by `validate` after every other key, so
  # that its phases follow the run's length: "" | "onebit_adam"
  c.recipe = ""
  c.log_every_steps = 10
  # Time to accuracy (DAWNBench): the wall time at which eval metric `target_metric` (e.g.
  # "top5_accuracy") first reaches `target_value` goes into summary.json. "" = not tracked;
  # "loss" is reached at or below the value, the accuracies at or above.
  c.target_metric = ""
  c.target_value = 0.0
  c.eval_at_stage_boundaries = False  # also evaluate where a resize stage ends
  c.eval_every_steps = 0        # 0: only at the end
  c.checkpoint_every_steps = 0  # 0: only at the end (and on Ctrl-C)
  c.keep_checkpoints = 3
  c.max_consecutive_skips = 10  # non-finite gradients this many steps in a row stop the run
  return c


def _model_defaults() -> ml_collections.ConfigDict:
  """The `model` group."""
  # num_filters: width of the first ResNet stage (0 = the model's own); smoke tests shrink it.
  # d_model, num_heads, d_ff, num_layers: Transformer sizes (0 = the model's own); dropout: the
  # Transformer's rate (-1 = the model's own). A language model's max_len is data.seq_len.
  # hidden: the MLP's layer widths (() = the model's own, (1024, 1024)).
  return ml_collections.ConfigDict({
      "name": "resnet20", "dtype": "float32", "num_filters": 0, "hidden": (),
      "d_model": 0, "num_heads": 0, "d_ff": 0, "num_layers": 0, "dropout": -1.0})


def _data_defaults() -> ml_collections.ConfigDict:
  """The `data` group."""
  # resize_schedule: progressive resizing, ((first_epoch, image_size), ...) sorted by epoch;
  # () keeps the dataset's own size.
  # path: IDX directory (idx, fashion_mnist) or TFDS data directory (imagenet2012).
  # The ImageNet pipeline: cache_dir ("" = no disk tier) and byte budgets per cache point,
  # grain worker processes and reader threads, eval split, and decoded_max_size: resolution
  # stages of at most this size read images pre-decoded at 1.25x their size (no JPEG decoding).
  return ml_collections.ConfigDict({
      "name": "digits", "path": "", "resize_schedule": (),
      # the in-memory image sets' training augmentation: "" | "crop_flip" (2-pixel pad, random
      # crop, left-right flip; sparsejax.data.small.augment)
      "augment": "",
      "cache_dir": "", "memory_cache_bytes": 1 << 30, "disk_cache_bytes": 100 << 30,
      "workers": 0, "threads": 8, "eval_split": "validation", "decoded_max_size": 160,
      # text (kjv, text): sequence length and BPE vocabulary (tokenizer cached under
      # data.cache_dir, default ~/.cache/sparsejax)
      "seq_len": 128, "vocab_size": 4096,
  })


def _optimizer_defaults() -> ml_collections.ConfigDict:
  """The `optimizer` group: the fused optimizer and its learning-rate schedule."""
  return ml_collections.ConfigDict({
      "name": "sgd",            # sgd | lars | lamb | adamw (the fused optimizers)
      "learning_rate": 0.1,     # peak, after warm-up
      "schedule": "cosine",     # cosine | linear | poly | step | constant, after the warm-up
      "warmup_epochs": 0.0,
      "end_learning_rate": 0.0,  # cosine/linear/poly end value
      "poly_power": 2.0,
      "step_epochs": (),        # step schedule: epochs where the rate is multiplied by step_factor
      "step_factor": 0.1,
      "momentum": 0.9,
      "nesterov": False,
      "weight_decay": 1e-4,     # never on BatchNorm parameters and biases (1-D leaves)
      "trust_coefficient": 0.001,
      "b1": 0.9, "b2": 0.999, "eps": 1e-8,
      # adamw: the second moment frozen after this many epochs (1-bit Adam's frozen variance:
      # Adam then is linear in the gradients, as error feedback needs); 0 = never
      "freeze_variance_epochs": 0.0,
  })


def _compression_defaults() -> ml_collections.ConfigDict:
  """The `compression` group: the exchange a user configures (its options sit in the `auto`,
  `overlap` and `experimental` groups)."""
  return ml_collections.ConfigDict({
      # hitopk | higtopk | allgather | gtopk | hierarchical | dense | auto (the `auto` group)
      "algorithm": "hitopk",
      "density": 0.01,
      "selector": "mstopk",     # mstopk | exact | sampled
      "error_feedback": True,
      # DGC momentum correction: the SGD momentum (and weight decay) is accumulated before top-k
      # selection instead of in the optimizer (optimizer sgd with momentum > 0; lars: each
      # worker's decayed, trust-ratio-scaled gradient); with adamw, each worker's Adam moments.
      # No effect with the dense algorithms (nothing is delayed there).
      "momentum_correction": False,
      "warmup_epochs": 0.0,     # DGC warm-up: density decays from warmup_density to density
      "warmup_density": 0.25,
      # the exchange's dense form (every candidate summed, the residual emptied) for the
      # first this-many epochs, then compressed: 1-bit Adam's dense start (recipe "onebit_adam")
      "dense_epochs": 0.0,
  })


def _auto_defaults() -> ml_collections.ConfigDict:
  """The `auto` group: how `compression.algorithm = "auto"` chooses (sparsejax.train.auto)."""
  return ml_collections.ConfigDict({
      # the sparse form auto chooses from (with the compression group's density, warm-up and
      # corrections); the other is its dense form
      "sparse": "hitopk",
      # switch only for a predicted gain over this share
      "margin": 0.05,
      # the share of the run's time the link measurements may take: the next measurement comes
      # after the fewest steps that keep them within it (0: chosen once at the start, on the
      # link's read alone, and where auto.schedule says "measured")
      "probe_budget": 0.02,
      # the sparse form's steps to the target over dense's, where the user knows it for this
      # task; 0: not set, taken at `step_factor_quantile` of the factors measured on the
      # study's tasks (auto.model.STEP_FACTORS)
      "step_factor": 0.0,
      # the risk: 0.5 assumes the measured factors' median (1.0), 0.75 (default) 1.09, 0.9
      # 1.23; higher keeps dense at more links where sparse would have paid, lower runs sparse
      # at more links where its extra steps cost more than its shorter step saves
      "step_factor_quantile": 0.75,
      # ((first_epoch, "dense" | "sparse" | "measured"), ...): the forms fixed by epoch instead
      # of measured ("measured": measured again from there); () measures throughout
      "schedule": (),
  })


def _overlap_defaults() -> ml_collections.ConfigDict:
  """The `overlap` group: the one-step pipelined exchange (sparsejax.train.pipelined)."""
  return ml_collections.ConfigDict({
      # each step computes its gradient while the previous step's is exchanged and applied
      # (staleness 1). "" off; "device": two devices per worker, the gradient on the second
      # (the CPU path; the CLI asks for twice mesh.num_devices, `sparsejax launch` needs
      # --devices-per-proc 2 x); "program": both halves in one program (XLA's async
      # collectives overlap them on GPU).
      "pipeline": "",
      # the first pipelined step, in epochs (the steps before it unpipelined)
      "from_epochs": 0.0,
      # weight prediction: each pipelined gradient taken at a guess of the parameters it will
      # be applied at. "" off; "last": extrapolated by the last update (SpecTrain, PipeMare);
      # "local": plus the optimizer's update of the worker's own late gradient (not with
      # compression.momentum_correction)
      "predict": "",
  })


def _experimental_defaults() -> ml_collections.ConfigDict:
  """The `experimental` group: exchange options from single studies (docs/pieces.md); the
  defaults are what the studies recommend."""
  return ml_collections.ConfigDict({
      # with momentum correction: zero the velocity where sent (DGC); False: it runs on
      "momentum_masking": True,
      # with adamw and momentum_correction: where Adam's first moment runs. "after": the
      # exchange sends gradients over each worker's sqrt(second moment) and the first moment
      # is a momentum after it; "before": both moments per worker, the candidates are whole
      # Adam directions.
      "adam_first_moment": "after",
      # "global": one top-k over the whole gradient; "tensor": each tensor's candidates scaled
      # to an RMS near 1 first, so each gets about its share (error feedback, plain or with
      # sgd's or lars's momentum correction)
      "balance": "global",
      # with lars and momentum_correction: the trust ratio each worker scales its gradient by
      # before the exchange. "worker": from its own gradient's norm (larger than the mean's, so
      # the step is shorter than LARS's); "mean": from the norm of the workers' mean gradient,
      # estimated from count sketches (sparsejax.sketch: 258 floats a kernel all-reduced)
      "lars_trust_ratio": "worker",
      # with momentum correction (sgd, lars): what the residual and velocity hold. "gradients":
      # the learning rate is applied when a value is sent; "steps": each gradient scaled by
      # its own step's learning rate before the exchange (error feedback in parameter space)
      "feedback_in": "gradients",
      # the leaves of one dimension (BatchNorm's scales and biases, biases) sent whole every
      # step beside the sparse exchange's pairs (an all-reduce of those values alone)
      "whole_vectors": False,
      # the pairs' wire format (sparsejax.wire): "pairs8" (float32 value, int32 index) or
      # "pairs4" (bfloat16 value, 16-bit index in its block, the rounding error kept in the
      # residual; hitopk and allgather, with error feedback); in pairs4 the exchange's dense
      # form (its dense levels and dense start) sends its values as bfloat16 too
      "wire": "pairs8",
  })


# Keys that moved or went: a config naming one fails with one line naming the new key.
RENAMED = {
    "compression.auto_sparse": "auto.sparse",
    "compression.auto_margin": "auto.margin",
    "compression.auto_probe_budget": "auto.probe_budget",
    "compression.auto_step_factor": "auto.step_factor (optional now: 0 leaves it unset)",
    "compression.auto_schedule": "auto.schedule (in epochs now)",
    "compression.auto_every_steps": "auto.probe_budget (the measurements' cadence follows it)",
    "auto.min_step_factor": "auto.step_factor_quantile (a quantile of the measured factors)",
    "compression.pipeline": "overlap.pipeline",
    "compression.pipeline_from_epochs": "overlap.from_epochs",
    "compression.pipeline_predict": "overlap.predict",
    "compression.momentum_masking": "experimental.momentum_masking",
    "compression.adam_first_moment": "experimental.adam_first_moment",
    "compression.balance": "experimental.balance",
}


def _close(key: str, known: list[str]) -> str:
  close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
  return f" (did you mean {', '.join(close)}?)" if close else ""


def _type_ok(value: Any, default: Any) -> bool:
  if isinstance(default, bool):
    return isinstance(value, bool)
  if isinstance(default, float):
    return isinstance(value, int | float) and not isinstance(value, bool)
  if isinstance(default, int):
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(default, tuple | list):
    return isinstance(value, tuple | list)
  return isinstance(value, type(default))


def validate(config: Any) -> ml_collections.ConfigDict:
  """Checks keys, types and values against `default_config()` (config: ConfigDict or dict);
  returns a full ConfigDict with the defaults filled in."""
  full = default_config()

  def walk(cfg: Any, ref: ml_collections.ConfigDict, prefix: str) -> None:
    for key in cfg.keys():
      name = prefix + key
      if key not in ref:
        _unknown(name, key, ref)
      value, default = cfg[key], ref[key]
      if isinstance(default, ml_collections.ConfigDict):
        if not isinstance(value, ml_collections.ConfigDict | dict):  # noqa: UP038
          raise ValueError(f"config key {name!r} must be a group of keys, got {value!r}")
        walk(value, default, name + ".")
      elif not _type_ok(value, default):
        raise ValueError(f"config key {name!r} must be of type {type(default).__name__}, "
                         f"got {value!r} ({type(value).__name__})")
      else:
        if isinstance(default, float):
          value = float(value)
        elif isinstance(default, tuple | list):
          value = tuple(value)
        ref[key] = value

  walk(config, full, "")
  _check_values(full)
  if full.recipe:
    from sparsejax.train import recipes
    full = recipes.apply(full)
    _check_values(full)
  return full


def _unknown(name: str, key: str, ref: Any) -> None:
  """Raises the error for an unknown key `name`: where it moved, if it did, else the closest
  known keys."""
  if name in RENAMED:
    raise ValueError(f"config key {name!r} is now {RENAMED[name]}")
  raise ValueError(f"unknown config key {name!r}{_close(key, list(ref.keys()))}")


# eval metrics a run can aim at ("" = none); "loss" is better lower, the others higher
TARGET_METRICS = ("", "accuracy", "top5_accuracy", "loss")
AUTO_FORMS = ("dense", "sparse", "measured")  # the forms of auto.schedule
RECIPES = ("", "onebit_adam")  # config.recipe (sparsejax.train.recipes)


def target_reached(metric: str, value: float, target: float) -> bool:
  """Whether eval `metric` at `value` has reached `target` (loss: at or below; else at or
  above)."""
  return value <= target if metric == "loss" else value >= target


def _check_values(c: ml_collections.ConfigDict) -> None:
  def need(ok: bool, key: str, allowed: str) -> None:
    if not ok:
      raise ValueError(f"config key {key!r} = {_get(c, key)!r}: must be {allowed}")
  need(c.batch_size > 0, "batch_size", "> 0")
  need(c.num_epochs > 0, "num_epochs", "> 0")
  need(0 <= c.label_smoothing < 1, "label_smoothing", "in [0, 1)")
  need(c.optimizer.name in ("sgd", "lars", "lamb", "adamw"), "optimizer.name",
       "one of sgd, lars, lamb, adamw")
  need(c.optimizer.schedule in ("cosine", "linear", "poly", "step", "constant"),
       "optimizer.schedule", "one of cosine, linear, poly, step, constant")
  need(c.optimizer.learning_rate >= 0, "optimizer.learning_rate", ">= 0")
  need(c.optimizer.warmup_epochs >= 0, "optimizer.warmup_epochs", ">= 0")
  need(c.compression.algorithm in comm.ALGORITHMS + ("auto",),
       "compression.algorithm", f"one of {', '.join(comm.ALGORITHMS)}, auto")
  _check_auto(c.auto, need)
  _check_pipeline_and_variance(c, need)
  need(0 < c.compression.density <= 1, "compression.density", "in (0, 1]")
  need(0 < c.compression.warmup_density <= 1, "compression.warmup_density", "in (0, 1]")
  need(c.compression.warmup_epochs >= 0, "compression.warmup_epochs", ">= 0")
  need(c.compression.dense_epochs >= 0, "compression.dense_epochs", ">= 0")
  need(c.recipe in RECIPES, "recipe", f"one of {', '.join(repr(r) for r in RECIPES)}")
  if c.compression.momentum_correction:
    need((c.optimizer.name in ("sgd", "lars") and 0 < c.optimizer.momentum < 1)
         or c.optimizer.name == "adamw", "optimizer.name",
         "sgd or lars with optimizer.momentum in (0, 1), or adamw, when "
         "compression.momentum_correction is True "
         f"(optimizer.name = {c.optimizer.name!r}, optimizer.momentum = {c.optimizer.momentum!r})")
    need(c.compression.error_feedback, "compression.error_feedback",
         "True when compression.momentum_correction is True")
  _check_experimental(c, need)
  need(c.mesh.nodes == -1 or c.mesh.nodes >= 1, "mesh.nodes", ">= 1 or -1")
  need(c.mesh.local == -1 or c.mesh.local >= 1, "mesh.local", ">= 1 or -1")
  need(c.log_every_steps >= 1, "log_every_steps", ">= 1")
  need(c.data.memory_cache_bytes > 0, "data.memory_cache_bytes", "> 0")
  need(c.data.disk_cache_bytes > 0, "data.disk_cache_bytes", "> 0")
  need(c.data.workers >= 0, "data.workers", ">= 0")
  need(c.data.threads >= 1, "data.threads", ">= 1")
  need(c.data.decoded_max_size >= 0, "data.decoded_max_size", ">= 0")
  need(c.data.seq_len >= 1, "data.seq_len", ">= 1")
  need(c.data.augment in small.AUGMENTS, "data.augment",
       f"one of {', '.join(repr(a) for a in small.AUGMENTS)}")
  need(c.data.vocab_size >= 8, "data.vocab_size", ">= 8")
  need(c.keep_checkpoints >= 1, "keep_checkpoints", ">= 1")
  need(c.target_metric in TARGET_METRICS, "target_metric",
       f"one of {', '.join(repr(m) for m in TARGET_METRICS)}")
  need(c.max_consecutive_skips >= 1, "max_consecutive_skips", ">= 1")
  stages = c.data.resize_schedule
  ok = all(isinstance(st, tuple | list) and len(st) == 2 and st[1] > 0 for st in stages)
  epochs = [st[0] for st in stages] if ok else []
  need(ok and epochs == sorted(epochs) and (not epochs or epochs[0] == 0),
       "data.resize_schedule", "((0, size), (epoch, size), ...) with rising epochs")
  if c.data.path and not os.path.exists(c.data.path):
    raise ValueError(f"config key 'data.path': {c.data.path!r} does not exist")


def _check_experimental(c: ml_collections.ConfigDict, need: Callable[..., None]) -> None:
  """The `experimental` group's values, and what each needs of the rest."""
  e = c.experimental
  need(e.adam_first_moment in ("before", "after"), "experimental.adam_first_moment",
       "'before' or 'after'")
  need(e.lars_trust_ratio in ("worker", "mean"), "experimental.lars_trust_ratio",
       "'worker' or 'mean'")
  if e.lars_trust_ratio == "mean":
    need(c.compression.momentum_correction and c.optimizer.name == "lars",
         "experimental.lars_trust_ratio", "'worker' unless compression.momentum_correction is "
         "True with optimizer.name lars (the ratio is taken before the exchange only there)")
  need(e.feedback_in in ("gradients", "steps"), "experimental.feedback_in",
       "'gradients' or 'steps'")
  if e.feedback_in == "steps":
    need(c.compression.momentum_correction and c.optimizer.name in ("sgd", "lars"),
         "experimental.feedback_in", "'gradients' unless compression.momentum_correction is "
         "True with optimizer.name sgd or lars")
  if e.whole_vectors:
    need(c.compression.error_feedback, "compression.error_feedback",
         "True when experimental.whole_vectors is True")
    need(c.compression.algorithm in comm.SPARSE_ALGORITHMS + ("auto",),
         "experimental.whole_vectors", "False with a dense compression.algorithm "
         f"({c.compression.algorithm!r}: nothing is held back)")
  need(e.wire in ("pairs8", "pairs4"), "experimental.wire", "'pairs8' or 'pairs4'")
  if e.wire == "pairs4":
    sparse = c.auto.sparse if c.compression.algorithm == "auto" else c.compression.algorithm
    need(sparse in comm.WIRE_ALGORITHMS and c.compression.error_feedback, "experimental.wire",
         f"'pairs8' unless the sparse algorithm is one of {', '.join(comm.WIRE_ALGORITHMS)} "
         f"with error feedback (got {sparse!r}, error_feedback "
         f"{c.compression.error_feedback!r})")
  need(e.balance in ("global", "tensor"), "experimental.balance", "'global' or 'tensor'")
  if e.balance == "tensor":
    need(c.compression.error_feedback and not (c.compression.momentum_correction
                                               and c.optimizer.name == "adamw"),
         "experimental.balance", "'global' without error feedback or with adamw's momentum "
         "correction (Adam directions)")


def _check_auto(c: ml_collections.ConfigDict, need: Callable[[bool, str, str], None]) -> None:
  """The `auto` group."""
  need(c.sparse in comm.SPARSE_ALGORITHMS, "auto.sparse",
       f"one of {', '.join(comm.SPARSE_ALGORITHMS)}")
  need(c.step_factor >= 0, "auto.step_factor", ">= 0 (0: not set)")
  need(0 <= c.step_factor_quantile <= 1, "auto.step_factor_quantile", "in [0, 1]")
  need(0 <= c.margin < 1, "auto.margin", "in [0, 1)")
  need(0 <= c.probe_budget < 1, "auto.probe_budget", "in [0, 1)")
  entries = c.schedule
  ok = all(isinstance(e, tuple | list) and len(e) == 2 and isinstance(e[0], int | float)
           and not isinstance(e[0], bool) and e[1] in AUTO_FORMS for e in entries)
  epochs = [e[0] for e in entries] if ok else []
  need(ok and epochs == sorted(set(epochs)) and (not epochs or epochs[0] == 0),
       "auto.schedule",
       "((0, form), (epoch, form), ...) with rising epochs, each form one of "
       f"{', '.join(AUTO_FORMS)}")


def _check_pipeline_and_variance(c: ml_collections.ConfigDict,
                                 need: Callable[[bool, str, str], None]) -> None:
  """The `overlap` group and `optimizer.freeze_variance_epochs`."""
  o = c.overlap
  need(c.optimizer.freeze_variance_epochs >= 0, "optimizer.freeze_variance_epochs", ">= 0")
  if c.optimizer.freeze_variance_epochs:
    need(c.optimizer.name == "adamw" and not c.compression.momentum_correction,
         "optimizer.freeze_variance_epochs",
         "0 unless optimizer.name is adamw without compression.momentum_correction")
  need(o.pipeline in ("", "program", "device"), "overlap.pipeline",
       "'' (off), 'program' or 'device'")
  need(o.from_epochs >= 0, "overlap.from_epochs", ">= 0")
  need(o.predict in ("", "last", "local"), "overlap.predict", "'' (off), 'last' or 'local'")
  need(not o.predict or o.pipeline, "overlap.predict", "'' unless overlap.pipeline is set")
  if o.predict == "local":
    need(not (c.compression.momentum_correction
              and c.compression.algorithm in comm.SPARSE_ALGORITHMS),
         "overlap.predict", "'' or 'last' with compression.momentum_correction "
         "(its optimizer is partly in the exchange: 'local' needs the optimizer alone)")
  if o.pipeline:
    need(c.compression.algorithm != "auto", "overlap.pipeline",
         "'' with compression.algorithm 'auto' (not pipelined yet)")


def _get(c: Any, dotted: str) -> Any:
  for part in dotted.split("."):
    c = c[part]
  return c


def apply_overrides(config: Any, overrides: list[str]) -> dict:
  """Applies `key.sub=value` strings to a config (ConfigDict or dict); returns a plain dict.

  Values are parsed as Python literals where the default is not a string (`0.1`, `True`, `(3, 6)`).
  """
  tree = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
  ref = default_config()
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"--set expects key=value, got {item!r}")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    node, ref_node = tree, ref
    for i, part in enumerate(parts):
      if part not in ref_node:
        _unknown(".".join(parts[:i + 1]), part, ref_node)
      if i < len(parts) - 1:
        ref_node = ref_node[part]
        node = node.setdefault(part, {})
    if isinstance(ref_node[parts[-1]], str):
      value: Any = text
    else:
      try:
        value = ast.literal_eval(text)
      except (ValueError, SyntaxError):
        value = text
    node[parts[-1]] = value
  return tree


def load_config(path: str) -> ml_collections.ConfigDict:
  """Imports a config file and returns its `get_config()`, validated."""
  if not os.path.isfile(path):
    raise ValueError(f"config file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location("sparsejax_user_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {path!r} has no get_config()")
  return module.get_config()
