"""Imports: no cycles in the package (function-local imports included, read with ast), lazy
subpackages, the studies and benchmarks importable as packages and runnable as scripts."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "sparsejax"


def package_modules(root: str = ROOT, package: str = PACKAGE) -> dict[str, str]:
  """{dotted module name: file path} of every .py file under the package."""
  out = {}
  for dirpath, _, files in os.walk(os.path.join(root, package)):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
        out[".".join(rel)] = os.path.join(dirpath, name)
  return out


def imported_modules(module: str, path: str, known: set[str]) -> set[str]:
  """The package modules that `module` imports anywhere in its file (relative imports resolved;
  `from p import x` counts p.x when that is a module, else p)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  is_package = os.path.basename(path) == "__init__.py"
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = module.split(".")
        parts = parts if is_package else parts[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      for alias in node.names:
        out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
  return {m for m in out if m in known and m != module}


def import_graph(root: str = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
  modules = package_modules(root, package)
  return {m: imported_modules(m, p, set(modules)) for m, p in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component of more than one module (Tarjan's algorithm),
  as a closed path [a, b, ..., a]."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        components.append(component)

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return [cycle_in(graph, set(c)) for c in components]


def cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
  """A closed path through `component` (a strongly connected set), found breadth-first."""
  start = min(component)
  parents: dict[str, str] = {}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v] & component):
        if w == start:
          chain = [v]
          while chain[-1] != start:
            chain.append(parents[chain[-1]])
          return [*reversed(chain), start]
        if w not in parents:
          parents[w] = v
          nxt.append(w)
    frontier = nxt
  raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_package_has_no_import_cycles():
  graph = import_graph()
  assert len(graph) > 20 and "sparsejax.data.cache" in graph["sparsejax.data"]
  cycles = find_cycles(graph)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("files, expected", [
    ({"a.py": "from p import b\n", "b.py": "def f():\n  from p.c import x\n",
      "c.py": "from . import a\n"}, ["p.a", "p.b", "p.c", "p.a"]),
    ({"a.py": "import p.b\n", "b.py": "from .a import y\n"}, ["p.a", "p.b", "p.a"]),
    ({"a.py": "from p import b\n", "b.py": "import os\n", "__init__.py": "from p.a import z\n"},
     None),
])
def test_the_cycle_finder_sees_local_and_relative_imports(tmp_path, files, expected):
  """The checker itself: a cycle through a function-local import or a relative one is found."""
  (tmp_path / "p").mkdir()
  (tmp_path / "p" / "__init__.py").write_text("")
  for name, text in files.items():
    (tmp_path / "p" / name).write_text(text)
  cycles = find_cycles(import_graph(str(tmp_path), "p"))
  assert cycles == ([] if expected is None else [expected])


def _run(code_or_args: list[str], cwd: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([sys.executable, *code_or_args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=120)


def test_sparsejax_data_is_reachable_after_import_sparsejax_and_loads_lazily(tmp_path):
  code = f"""
import sys
sys.path.insert(0, {ROOT!r})
import sparsejax
assert sparsejax.__file__.startswith({ROOT!r}), sparsejax.__file__
heavy = ("grain", "tensorflow_datasets", "sparsejax.data")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
assert "data" in dir(sparsejax)
cache = sparsejax.data.TieredCache(list(range(5)), memory_bytes=100, key="five")
assert cache[3] == 3 and "sparsejax.data" in sys.modules
assert not [m for m in ("grain", "tensorflow_datasets") if m in sys.modules]
assert sparsejax.models.__name__ == "sparsejax.models"
try:
  sparsejax.no_such_thing
except AttributeError as e:
  assert "no attribute 'no_such_thing'" in str(e)
else:
  raise AssertionError("no AttributeError")
print("ok")
"""
  res = _run(["-c", code], str(tmp_path))
  assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("script", [("studies", "scaling_model", "run.py"),
                                    ("benchmarks", "merge.py")])
def test_a_study_or_benchmark_runs_as_a_script_from_anywhere(tmp_path, script):
  """`python studies/<study>/run.py` and `python benchmarks/<x>.py` work from any folder (tests
  import the same files as `studies.<study>.run` and `benchmarks.<x>`)."""
  res = _run([os.path.join(ROOT, *script), "--help"], str(tmp_path))
  assert res.returncode == 0 and f"usage: {script[-1]}" in res.stdout, res.stderr
