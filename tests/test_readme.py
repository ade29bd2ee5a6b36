"""The examples of the README and of docs/ run as written."""

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_python_block(page: str, heading: str, index: int = 0) -> dict:
  """Executes the first (or `index`-th) ```python block after `heading` in `page` (a path from
  the repository's root); returns its namespace."""
  text = (ROOT / page).read_text()
  code = re.findall(r"```python\n(.*?)```", text[text.index(heading):], re.S)[index]
  ns: dict = {}
  exec(compile(code, page, "exec"), ns)
  return ns


def _trained(ns: dict, losses_shape: tuple) -> None:
  losses = np.asarray(ns["losses"])
  assert losses.shape == losses_shape
  np.testing.assert_allclose(losses, losses.reshape(-1)[0])  # identical on every worker
  assert losses.reshape(-1)[0] < 1.0  # the initial loss is exactly 1 (zero params, targets 1)


def test_readme_one_axis_pmap_example_trains():
  ns = run_python_block("README.md", "## Use it in your own training step")
  _trained(ns, (8,))
  w = np.asarray(ns["params"]["w"])
  assert w.shape == (8, 37, 11) and np.all(w == w[0])  # the replicas stay identical


def test_own_step_shard_map_example_trains():
  ns = run_python_block("docs/own-step.md", "# Using `topk_allreduce`")
  losses = ns["losses"]
  assert losses.shape == (8,)
  np.testing.assert_allclose(losses, losses[0])  # identical on every worker
  assert losses[0] < 1.0  # the initial loss is exactly 1 (zero params, targets 1)
  params = ns["params"]
  assert np.all(np.isfinite(np.asarray(params["w"]))) and np.any(np.asarray(params["w"]) != 0)


def test_own_step_one_axis_shard_map_example_accumulates():
  ns = run_python_block("docs/own-step.md", "## Use in your own step: one axis")
  _trained(ns, (8,))


def test_optimizers_example_matches_optax():
  ns = run_python_block("docs/optimizers.md", "# Fused optimizers")
  diff = ns["jax"].tree.leaves(ns["jax"].tree.map(
      lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
      ns["layout"].unravel(ns["flat_updates"]), ns["want"]))
  assert max(diff) < 1e-7
  pytree = ns["jax"].tree.leaves(ns["updates"])
  assert all(np.all(np.isfinite(np.asarray(u))) for u in pytree)


def test_docs_links_point_at_files_that_exist():
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  for page in pages:
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
      if not target.startswith("http"):
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
