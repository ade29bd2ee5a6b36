"""Imports: no cycles in the package (function-local imports included, read with ast), lazy
subpackages, the studies and benchmarks importable as packages and runnable as scripts."""

from __future__ import annotations

import ast
import os
import shutil
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


def _entry_points() -> list[str]:
  """Every study's and benchmark's module that runs as a program (`python -m ...`)."""
  found = []
  for top in ("studies", "benchmarks"):
    for folder, _, names in os.walk(os.path.join(ROOT, top)):
      for name in sorted(names):
        path = os.path.join(folder, name)
        if name.endswith(".py") and 'if __name__ == "__main__":' in open(path).read():
          found.append(os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."))
  return sorted(found)


def test_every_study_and_benchmark_runs_from_a_fresh_clone_elsewhere(tmp_path):
  """A clone of the committed files in another folder: from its root, every study and
  benchmark starts as `python -m <module>` (its --help) with no path set up for it, and
  imports the clone's sparsejax, not this checkout's."""
  modules = _entry_points()
  assert len(modules) >= 20, modules
  clone = tmp_path / "elsewhere" / "clone"
  clone.mkdir(parents=True)
  files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True,
                         check=True).stdout.decode().split("\0")
  for name in filter(None, files):
    if os.path.exists(os.path.join(ROOT, name)) and "/results/" not in name:
      (clone / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(os.path.join(ROOT, name), clone / name)
  code = f"""
import contextlib, io, runpy, sys
bad = []
for module in {modules!r}:
  sys.argv = [module, "--help"]
  out = io.StringIO()
  try:
    with contextlib.redirect_stdout(out):
      runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    if e.code not in (0, None):
      bad.append((module, "exit", e.code))
  except Exception as e:  # noqa: BLE001
    bad.append((module, type(e).__name__, str(e)[:200]))
  if "usage:" not in out.getvalue():
    bad.append((module, "no usage", out.getvalue()[:200]))
import sparsejax
assert sparsejax.__file__.startswith({str(clone)!r}), sparsejax.__file__
assert not bad, bad
print("ok", len({modules!r}))
"""
  res = _run(["-c", code], str(clone))
  assert res.returncode == 0 and res.stdout.strip() == f"ok {len(modules)}", res.stderr[-3000:]


def test_no_study_or_benchmark_edits_the_import_path():
  """Studies and benchmarks run as modules from the checkout's root; none edits `sys.path`
  (or sets PYTHONPATH for a child) to find the checkout."""
  bad = []
  for top in ("studies", "benchmarks", "sparsejax"):
    for folder, _, names in os.walk(os.path.join(ROOT, top)):
      for name in names:
        if name.endswith(".py"):
          text = open(os.path.join(folder, name)).read()
          if "sys.path" in text or "PYTHONPATH" in text:
            bad.append(os.path.relpath(os.path.join(folder, name), ROOT))
  assert not bad, bad
