"""No product function is longer than LIMIT lines (its docstring aside), but the few listed in ALLOWED.

Run as a script to list every one over the limit: ``python tests/docs/test_function_length.py``.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 100
EXCLUDED = ("fastpersist/bench/",)  # the benchmarks: a leaf outside the product (test_the_benchmarks_are_a_leaf)

# Functions still over LIMIT, each being restructured by other work. This list must only shrink: a function
# split below the limit is removed from it (the test fails until it is), and nothing is ever added.
ALLOWED: set[str] = set()


def function_length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line, its docstring's lines left out (decorators are not counted)."""
    length = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        length -= first.end_lineno - first.lineno + 1
    return length


def long_functions(root: str = ROOT, limit: int = LIMIT) -> dict[str, int]:
    """``"path:qualified.name"`` -> length of every function under fastpersist/ (EXCLUDED aside) over ``limit``.

    Nested functions and methods count on their own (``Class.method``, ``outer.inner``); an outer function's
    length includes them.
    """
    found: dict[str, int] = {}

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                length = function_length(child)
                if length > limit:
                    found[f"{path}:{name}"] = length
                visit(child, path, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, path, prefix + child.name + ".")
            else:
                visit(child, path, prefix)

    for directory, dirs, files in os.walk(os.path.join(root, "fastpersist")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for file_name in sorted(files):
            path = os.path.relpath(os.path.join(directory, file_name), root).replace(os.sep, "/")
            if not file_name.endswith(".py") or path.startswith(EXCLUDED):
                continue
            with open(os.path.join(root, path), encoding="utf-8") as f:
                visit(ast.parse(f.read()), path, "")
    return found


def test_no_function_is_longer_than_the_limit():
    found = long_functions()
    over = {name: length for name, length in found.items() if name not in ALLOWED}
    assert over == {}, f"split these into well-named helpers (at most {LIMIT} lines each, docstring aside)"


def test_the_allowed_list_is_exact():
    """A listed function no longer over the limit leaves the list, so that the list can only shrink."""
    assert sorted(ALLOWED - set(long_functions())) == []


def _lines(count: int, indent: str) -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(count))


def test_the_measure(tmp_path):
    source = (
        # def + LIMIT - 1 lines: at the limit, however long its docstring
        'def at_the_limit():\n    """A docstring\n    of three\n    lines."""\n'
        + _lines(LIMIT - 1, "    ")
        + "\n\nclass C:\n    def over(self):\n"  # def + LIMIT lines: over it
        + _lines(LIMIT, "        ")
        + "\n\ndef outer():\n    def inner():\n"  # inner: def + LIMIT lines; outer: 1 + inner + return
        + _lines(LIMIT, "        ")
        + "    return inner\n"
    )
    (tmp_path / "fastpersist" / "bench").mkdir(parents=True)
    (tmp_path / "fastpersist" / "module.py").write_text(source)
    (tmp_path / "fastpersist" / "bench" / "excluded.py").write_text(source)
    assert long_functions(str(tmp_path)) == {
        "fastpersist/module.py:C.over": LIMIT + 1,
        "fastpersist/module.py:outer.inner": LIMIT + 1,
        "fastpersist/module.py:outer": LIMIT + 3,
    }


if __name__ == "__main__":
    for name, length in sorted(long_functions().items(), key=lambda item: -item[1]):
        print(f"{length:5d}  {name}{'  (allowed)' if name in ALLOWED else ''}")
