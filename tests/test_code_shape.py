"""The shape of the code: no function or method in sparsejax/ has a body over 60 lines."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 60


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """Lines from the first statement after the docstring to the end of the function (nested
  functions count towards the function they are in)."""
  body = node.body
  if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    body = body[1:]
  if not body:
    return 0
  first = min([body[0].lineno] + [d.lineno for d in getattr(body[0], "decorator_list", [])])
  return node.end_lineno - first + 1


def _functions(tree: ast.AST, prefix: str = ""):
  """(qualified name, node) of every function and method, nested ones included."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      yield prefix + node.name, node
      yield from _functions(node, f"{prefix}{node.name}.")
    elif isinstance(node, ast.ClassDef):
      yield from _functions(node, f"{prefix}{node.name}.")
    else:
      yield from _functions(node, prefix)


def long_functions(root: pathlib.Path, max_lines: int = MAX_LINES) -> list[str]:
  """`file:function:length` of every function under `root` whose body is over `max_lines`."""
  out = []
  for path in sorted(root.rglob("*.py")):
    for name, node in _functions(ast.parse(path.read_text(), str(path))):
      n = body_lines(node)
      if n > max_lines:
        out.append(f"{path.relative_to(root)}:{name}:{n}")
  return out


def test_no_function_in_sparsejax_is_over_60_lines():
  too_long = long_functions(ROOT / "sparsejax")
  assert not too_long, "functions over 60 lines (file:function:length):\n" + "\n".join(too_long)


def test_the_check_sees_long_functions_and_methods(tmp_path):
  (tmp_path / "m.py").write_text("def f():\n  '''doc'''\n" + "  x = 1\n" * 61)
  (tmp_path / "ok.py").write_text("def g():\n  '''doc'''\n" + "  x = 1\n" * 60)
  (tmp_path / "c.py").write_text("class C:\n  def h(self):\n" + "    x = 1\n" * 61)
  assert long_functions(tmp_path) == ["c.py:C.h:61", "m.py:f:61"]
