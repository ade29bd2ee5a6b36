"""The README's example runs as written."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def run_first_python_block(heading: str, index: int = 0) -> dict:
  """Executes the first (or `index`-th) ```python block after `heading` in the README; returns
  its namespace."""
  text = README.read_text()
  code = re.findall(r"```python\n(.*?)```", text[text.index(heading):], re.S)[index]
  ns: dict = {}
  exec(compile(code, "README.md", "exec"), ns)
  return ns


def test_readme_shard_map_example_trains():
  ns = run_first_python_block("## Using `topk_allreduce`")
  losses = ns["losses"]
  assert losses.shape == (8,)
  np.testing.assert_allclose(losses, losses[0])  # identical on every worker
  assert losses[0] < 1.0  # the initial loss is exactly 1 (zero params, targets 1)
  params = ns["params"]
  assert np.all(np.isfinite(np.asarray(params["w"]))) and np.any(np.asarray(params["w"]) != 0)


def test_readme_fused_optimizer_example_matches_optax():
  ns = run_first_python_block("## Fused optimizers")
  diff = ns["jax"].tree.leaves(ns["jax"].tree.map(
      lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
      ns["layout"].unravel(ns["flat_updates"]), ns["want"]))
  assert max(diff) < 1e-7
  pytree = ns["jax"].tree.leaves(ns["updates"])
  assert all(np.all(np.isfinite(np.asarray(u))) for u in pytree)


def _trained(ns: dict, losses_shape: tuple) -> None:
  losses = np.asarray(ns["losses"])
  assert losses.shape == losses_shape
  np.testing.assert_allclose(losses, losses.reshape(-1)[0])  # identical on every worker
  assert losses.reshape(-1)[0] < 1.0  # the initial loss is exactly 1 (zero params, targets 1)


def test_readme_one_axis_pmap_example_trains():
  ns = run_first_python_block("### Use in your own step: one axis", 0)
  _trained(ns, (8,))
  w = np.asarray(ns["params"]["w"])
  assert w.shape == (8, 37, 11) and np.all(w == w[0])  # the replicas stay identical


def test_readme_one_axis_shard_map_example_accumulates():
  ns = run_first_python_block("### Use in your own step: one axis", 1)
  _trained(ns, (8,))
