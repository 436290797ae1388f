#!/usr/bin/env python3
"""Regenerates docs/architecture.md's module table and layer diagram from the source tree.

    python tools/gen_architecture.py          # rewrite the generated blocks
    python tools/gen_architecture.py --check  # exit 1 when the docs and the tree differ

The module table lists every Python module under ``fastpersist/`` and every
file under ``native/`` with one sentence: the first sentence of its docstring
(Python) or of its leading comment / ``@brief`` (C++). The diagram lists, per
layer, which layers its modules import (read with ``ast``, function-level
imports included). Both go between ``<!-- fastpersist:modules -->`` /
``<!-- fastpersist:layers -->`` and ``<!-- /fastpersist -->`` in
docs/architecture.md. A module without a docstring is an error: write one.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join("docs", "architecture.md")
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


def layer_of(module: str) -> str:
    """The layer of a dotted module name: ``fastpersist._native``, ``io.engine``, ``io``, ``format``, ...,
    or ``fastpersist`` for the top-level modules."""
    parts = module.split(".")
    if parts[0] != "fastpersist" or len(parts) == 1:
        return "fastpersist"
    if parts[1] == "_native":
        return "_native"
    if parts[1:3] == ["io", "engine"]:
        return "io.engine"
    if len(parts) == 2 and not os.path.isdir(os.path.join(ROOT, "fastpersist", parts[1])):
        return "fastpersist"
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


def layer_graph(root: str) -> dict[str, set[str]]:
    """Layer -> the other layers its modules import."""
    graph: dict[str, set[str]] = {}
    for path, _ in python_modules(root):
        module = path[:-3].replace(os.sep, ".").removesuffix(".__init__")
        layer = layer_of(module)
        targets = {layer_of(name) for name in _imports(root, os.path.join(root, path), module)}
        graph.setdefault(layer, set()).update(targets - {layer})
    graph.setdefault("_native", set())
    return graph


LAYER_ORDER = ["cli", "bench", "fastpersist", "format", "io", "io.engine", "_native"]


def _layer_name(layer: str) -> str:
    return {"fastpersist": "fastpersist (top-level modules)", "_native": "fastpersist._native (C++)"}.get(
        layer, f"fastpersist.{layer}"
    )


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


_BLOCK = re.compile(r"(<!-- fastpersist:(modules|layers) -->\n)(.*?)(<!-- /fastpersist -->)", re.DOTALL)


def render(text: str, root: str = ROOT) -> str:
    """``text`` (docs/architecture.md) with its generated blocks rebuilt from the tree at ``root``."""
    blocks = {"modules": modules_block(root), "layers": layers_block(root)}
    found = {m.group(2) for m in _BLOCK.finditer(text)}
    missing = set(blocks) - found
    if missing:
        raise ValueError(f"{DOC} lacks the block(s) {sorted(missing)}: add '<!-- fastpersist:NAME -->' + '<!-- /fastpersist -->'")
    return _BLOCK.sub(lambda m: m.group(1) + blocks[m.group(2)] + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/architecture.md differs from the tree")
    parser.add_argument("--root", default=ROOT, help="repository root")
    args = parser.parse_args(argv)
    path = os.path.join(args.root, DOC)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        new = render(text, args.root)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if new == text:
        print(f"{DOC} matches the tree")
        return 0
    if args.check:
        print(f"{DOC} differs from the tree: run python tools/gen_architecture.py", file=sys.stderr)
        return 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"{DOC} regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
