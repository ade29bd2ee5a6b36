"""The examples of the README and of docs/ run as written."""

import json
import pathlib
import re
import shlex

import numpy as np
import pytest

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
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
           *sorted((ROOT / "studies").glob("*/README.md")), ROOT / "benchmarks" / "README.md",
           ROOT / "configs" / "README.md"]
  for page in pages:
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
      if not target.startswith("http"):
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def _bash_lines(page: str) -> list[str]:
  """The commands of the ```bash blocks in `page` (comments dropped)."""
  blocks = re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), re.S)
  return [line.split("#")[0].strip() for b in blocks for line in b.splitlines()
          if line.split("#")[0].strip()]


def test_readme_front_page_is_short_and_installs_early():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) < 150
  assert any(line == "## Install" for line in lines[:40])
  text = "\n".join(lines)
  assert text.index("**R**") < text.index(" R ")  # R is defined where it is first used


def _pyproject_table(name: str) -> str:
  """The lines of one table of pyproject.toml (no TOML parser on Python 3.10)."""
  text = (ROOT / "pyproject.toml").read_text()
  return text.split(f"[{name}]\n", 1)[1].split("\n[", 1)[0]


def test_readme_install_commands_name_extras_that_exist():
  extras = re.findall(r"^([\w-]+) = \[", _pyproject_table("project.optional-dependencies"), re.M)
  installs = [line for line in _bash_lines("README.md") if line.startswith("pip install")]
  assert installs
  for line in installs:
    named = re.search(r'"\.\[([^]]+)\]"', line).group(1).split(",")
    assert set(named) <= set(extras), (line, sorted(extras))


def test_readme_test_command_is_this_suites():
  assert "python -m pytest -q" in _bash_lines("README.md")
  markers = re.findall(r'^  "(\w+):', _pyproject_table("tool.pytest.ini_options"), re.M)
  named = re.findall(r"pytest[^`\n]*?-m (\w+)", (ROOT / "README.md").read_text())
  assert named and set(named) <= set(markers), (named, markers)


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(tmp_path, monkeypatch):
  """The quickstart command, as the README gives it, run from the repository's root (its
  workdir moved into a temporary folder): it trains to the accuracy the README states. (Slow:
  about 70 s on 2 cores, which CI's 15 minutes cannot spare; the shortened recipe runs in
  tests/test_train.py.)"""
  from sparsejax import cli
  line, = [line for line in _bash_lines("README.md") if line.startswith("sparsejax train")]
  argv = shlex.split(line)[1:]
  argv[argv.index("--workdir") + 1] = str(tmp_path / "quickstart")
  monkeypatch.chdir(ROOT)
  assert cli.main(argv + ["--no-progress"]) == 0
  summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
  assert summary["final_eval"]["accuracy"] >= 0.95, summary["final_eval"]


def _pages() -> list[pathlib.Path]:
  return sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md"),
                 *ROOT.glob("studies/*/README.md"), *ROOT.glob("benchmarks/README.md"),
                 *ROOT.glob("configs/README.md")])


def test_every_relative_link_of_the_docs_names_a_file_of_the_checkout():
  """A result file that leaves the tree takes the links to it along (README, docs/, the studies'
  and benchmarks' READMEs): a link to a file that is gone fails here."""
  assert len(_pages()) > 10
  broken = []
  for page in _pages():
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue  # a web address or an anchor of the page itself
      path = (page.parent / target.split("#")[0]).resolve()
      if not path.exists():
        broken.append(f"{page.relative_to(ROOT)}: {target}")
  assert not broken, "links to files not in the checkout:\n" + "\n".join(broken)


def test_every_result_file_the_docs_name_is_in_the_checkout():
  """`results/<name>.md` (or .json, .png) in backticks names a result file beside the page, at
  the root, or in a study's or the benchmarks' folder: the name must still be there."""
  folders = [ROOT, *ROOT.glob("studies/*"), ROOT / "benchmarks"]
  named, gone = 0, []
  for page in _pages():
    if page.name == "CHANGELOG.md":
      continue  # history: names what has since left the tree
    for name in re.findall(r"`([\w./-]*results/[\w./-]+\.(?:md|json|png))`", page.read_text()):
      named += 1
      if not any((folder / name).exists() for folder in [page.parent, *folders]):
        gone.append(f"{page.relative_to(ROOT)}: {name}")
  assert named > 20
  assert not gone, "result files the docs name that are not in the checkout:\n" + "\n".join(gone)
