#!/usr/bin/env python3
"""Regenerates docs/architecture.md's module table and layer diagram, and docs/configuration.md's settings table, from the source tree.

    python tools/gen_architecture.py          # rewrite the generated blocks
    python tools/gen_architecture.py --check  # exit 1 when the docs and the tree differ

The module table lists every Python module under ``fastpersist/`` and every
file under ``native/`` with one sentence: the first sentence of its docstring
(Python) or of its leading comment / ``@brief`` (C++). The diagram lists, per
layer, which layers its modules import (read with ``ast``, function-level
imports included). Both go between ``<!-- fastpersist:modules -->`` /
``<!-- fastpersist:layers -->`` and ``<!-- /fastpersist -->`` in
docs/architecture.md. A module without a docstring is an error: write one.
The settings table (``<!-- fastpersist:settings -->`` in docs/configuration.md)
lists every field of ``fastpersist.config.Settings`` with its environment
variable, default and the field's docstring (read with ``ast``, so a copied
tree without the compiled core is enough).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join("docs", "architecture.md")
SETTINGS_DOC = os.path.join("docs", "configuration.md")
NATIVE_SUFFIXES = (".hpp", ".cpp", ".h", ".cc")


def first_sentence(text: str) -> str:
    """The first sentence of the first paragraph, on one line, markup of reST roles removed."""
    paragraph = re.split(r"\n\s*\n", text.strip(), maxsplit=1)[0]
    paragraph = " ".join(line.strip() for line in paragraph.splitlines())
    paragraph = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", paragraph).replace("``", "`")
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    sentence = match.group(1) if match else paragraph
    return sentence.replace("|", "\\|")


def python_modules(root: str) -> list[tuple[str, str]]:
    """(path, sentence) of every module under fastpersist/, sorted by path.

    Raises:
        ValueError: a module has no docstring.
    """
    rows = []
    for directory, dirs, files in os.walk(os.path.join(root, "fastpersist")):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as f:
                doc = ast.get_docstring(ast.parse(f.read()))
            relative = os.path.relpath(path, root)
            if not doc:
                raise ValueError(f"{relative} has no module docstring; its first sentence goes into {DOC}")
            rows.append((relative, first_sentence(doc)))
    return sorted(rows)


def _leading_comment(text: str) -> str | None:
    """The file's opening comment: its ``@brief`` (Doxygen block), else its ``//`` lines up to one ending in ':'."""
    head = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("/*", "*", "//", "#pragma")) or not stripped:
            head.append(line)
            continue
        break
    block = "\n".join(head)
    brief = re.search(r"@brief\s+(.*?)(?:\n\s*\*\s*\n|\*/|@)", block, re.DOTALL)
    if brief:
        return re.sub(r"\s*\n\s*\*?\s*", " ", brief.group(1)).strip()
    lines = []
    for line in head:
        if line.startswith("//"):
            lines.append(line[2:].strip())
            if lines[-1].endswith(":"):
                lines[-1] = lines[-1][:-1] + "."
                break
        elif lines:
            break
    return " ".join(lines) or None


def native_files(root: str) -> list[tuple[str, str]]:
    """(path, sentence) of every C++ file under native/; an implementation file without a comment
    is described by the header it implements."""
    rows = []
    for directory, dirs, files in os.walk(os.path.join(root, "native")):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(NATIVE_SUFFIXES):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            relative = os.path.relpath(path, root)
            comment = _leading_comment(text)
            if comment is None:
                header = re.search(r'#include "(fastpersist/[\w.]+\.hpp)"', text)
                if not header:
                    raise ValueError(f"{relative} has no leading comment; add one line saying what it holds")
                comment = f"Implements `{header.group(1)}`."
            rows.append((relative, first_sentence(comment)))
    return sorted(rows)


BASE = {"errors", "config", "tensors", "system", "display", "_version"}
"""The low-level top-level modules every layer may use (they import no other layer but each other)."""


def layer_of(module: str) -> str:
    """The layer of a dotted module name: ``facade`` (the package's ``__init__``), ``cli`` (its ``__main__``
    and ``run``, the launcher), ``base``
    (the low-level top-level modules), ``_native``, ``io.engine``, or the subpackage (``io``, ``api``, ...)."""
    parts = module.split(".")
    if parts[0] != "fastpersist" or len(parts) == 1:
        return "facade"
    if parts[1] in ("__main__", "run"):
        return "cli"  # ``python -m fastpersist`` and ``python -m fastpersist.run``: the command line
    if parts[1] == "_native":
        return "_native"
    if parts[1:3] == ["io", "engine"]:
        return "io.engine"
    if len(parts) == 2 and parts[1] in BASE:
        return "base"
    return parts[1]


def _is_module(root: str, name: str) -> bool:
    path = os.path.join(root, *name.split("."))
    return os.path.isdir(path) or os.path.exists(path + ".py") or name == "fastpersist._native"


def _imports(root: str, path: str, module: str) -> set[str]:
    """The fastpersist modules that ``path`` (module ``module``) imports, anywhere in its body."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if _is_module(root, f"{base}.{alias.name}")]
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(base)  # names defined in base itself
    return {n for n in found if (n == "fastpersist" or n.startswith("fastpersist.")) and _is_module(root, n)}


def module_graph(root: str) -> dict[str, set[str]]:
    """Module -> the fastpersist modules it imports (function-level imports included)."""
    graph: dict[str, set[str]] = {}
    for path, _ in python_modules(root):
        module = path[:-3].replace(os.sep, ".").removesuffix(".__init__")
        graph[module] = {name for name in _imports(root, os.path.join(root, path), module) if name != module}
    return graph


def import_cycles(root: str) -> list[list[str]]:
    """Every set of modules that import each other, directly or through others (Tarjan's components).

    A package's ``__init__`` counts as the module named like the package;
    importing a submodule is not counted as importing its package.
    """
    graph = module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def layer_graph(root: str) -> dict[str, set[str]]:
    """Layer -> the other layers its modules import."""
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph(root).items():
        layer = layer_of(module)
        graph.setdefault(layer, set()).update({layer_of(name) for name in targets} - {layer})
    graph.setdefault("_native", set())
    return graph


LAYER_ORDER = [
    "cli",
    "bench",
    "tuning",
    "integrations",
    "facade",
    "dcp",
    "offload",
    "api",
    "distributed",
    "deepnvme",
    "io",
    "format",
    "io.engine",
    "base",
    "_native",
]
"""Highest first: a layer may import only layers after it (checked by tests/docs/test_architecture_doc.py)."""


def _layer_name(layer: str) -> str:
    return {
        "facade": "fastpersist (the package: public names)",
        "base": "fastpersist.{" + ", ".join(sorted(BASE - {"_version"})) + "}",
        "_native": "fastpersist._native (C++)",
    }.get(layer, f"fastpersist.{layer}")


def layers_block(root: str) -> str:
    """Which layer imports which, highest first: the package's dependency diagram."""
    graph = layer_graph(root)
    rank = {name: index for index, name in enumerate(LAYER_ORDER)}
    names = sorted(graph, key=lambda n: (rank.get(n, len(LAYER_ORDER)), n))
    width = max(len(_layer_name(n)) for n in names)
    lines = ["```"]
    for name in names:
        targets = sorted(graph[name], key=lambda n: (rank.get(n, len(LAYER_ORDER)), n))
        shown = ", ".join(_layer_name(t) for t in targets) or "(no other layer)"
        lines.append(f"{_layer_name(name):<{width}}  ->  {shown}")
    lines.append("```")
    return "\n".join(lines) + "\n"


def modules_block(root: str) -> str:
    lines = ["| path | what it holds |", "| --- | --- |"]
    lines += [f"| `{path}` | {sentence} |" for path, sentence in python_modules(root) + native_files(root)]
    return "\n".join(lines) + "\n"


def _size_text(value: int) -> str:
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def settings_rows(root: str) -> list[tuple[str, str, str]]:
    """(name, default as the docs show it, description) of every field of config.Settings, in order."""
    with open(os.path.join(root, "fastpersist", "config.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    constants = {}
    for node in tree.body:  # module-level integer constants the defaults use (_MiB)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = eval(
                    compile(ast.Expression(node.value), "config", "eval"), {}, dict(constants)
                )
            except Exception:  # noqa: BLE001 - not a constant expression
                pass
    settings = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    rows = []
    for node, after in zip(settings.body, settings.body[1:]):
        if not isinstance(node, ast.AnnAssign):
            continue
        value = eval(compile(ast.Expression(node.value), "config", "eval"), {}, dict(constants))
        name = node.target.id
        shown = (
            str(value).lower()
            if isinstance(value, bool)
            else _size_text(value)
            if name.endswith("_size")
            else str(value)
        )
        text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
        if not text:
            raise ValueError(f"config.Settings.{name} has no docstring; its text goes into {SETTINGS_DOC}")
        rows.append((name, shown, " ".join(text.split()).replace("``", "`").replace("|", "\\|")))
    return rows


def settings_block(root: str) -> str:
    lines = ["| name | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [
        f"| `{name}` | `FASTPERSIST_{name.upper()}` | `{default}` | {text} |"
        for name, default, text in settings_rows(root)
    ]
    return "\n".join(lines) + "\n"


_BLOCK = re.compile(r"(<!-- fastpersist:(modules|layers|settings) -->\n)(.*?)(<!-- /fastpersist -->)", re.DOTALL)


def render(text: str, root: str = ROOT, doc: str = DOC) -> str:
    """``text`` (the page ``doc``) with its generated blocks rebuilt from the tree at ``root``."""
    makers = {"modules": modules_block, "layers": layers_block} if doc == DOC else {"settings": settings_block}
    found = {m.group(2) for m in _BLOCK.finditer(text)}
    missing = set(makers) - found
    if missing:
        raise ValueError(
            f"{doc} lacks the block(s) {sorted(missing)}: add '<!-- fastpersist:NAME -->' + '<!-- /fastpersist -->'"
        )
    blocks = {name: make(root) for name, make in makers.items()}
    return _BLOCK.sub(
        lambda m: m.group(1) + blocks[m.group(2)] + m.group(4) if m.group(2) in blocks else m.group(0), text
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated page differs from the tree")
    parser.add_argument("--root", default=ROOT, help="repository root")
    args = parser.parse_args(argv)
    status = 0
    for doc in (DOC, SETTINGS_DOC):
        path = os.path.join(args.root, doc)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            new = render(text, args.root, doc)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if new == text:
            print(f"{doc} matches the tree")
            continue
        if args.check:
            print(f"{doc} differs from the tree: run python tools/gen_architecture.py", file=sys.stderr)
            status = 1
            continue
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        print(f"{doc} regenerated")
    return status


if __name__ == "__main__":
    sys.exit(main())
