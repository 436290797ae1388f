"""Every package under fastpersist, and every module with ``__all__``: ``from ... import *`` works and each
name in ``__all__`` exists; the submodules a package's docstring names exist."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The modules an optional extra installs (pyproject.toml's [project.optional-dependencies]) -> the extra.
OPTIONAL_MODULES = {"safetensors": "safetensors", "lightning": "lightning", "boto3": "s3", "botocore": "s3"}


def _public_modules() -> list[tuple[str, bool]]:
    """(dotted name, is a package) of every package and every module that sets ``__all__``, read with ``ast``."""
    found = []
    for directory, dirs, files in os.walk(os.path.join(ROOT, "fastpersist")):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for name in sorted(files):
            if not name.endswith(".py") or name == "__main__.py":  # __main__ runs a command when imported
                continue
            path = os.path.join(directory, name)
            dotted = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
            package = name == "__init__.py"
            if package:
                dotted = dotted[: -len(".__init__")]
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            sets_all = any(_assigns_all(node) for node in tree.body)
            if package or sets_all:
                found.append((dotted, package))
    return found


def _assigns_all(node: ast.stmt) -> bool:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    else:
        return False
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


MODULES = _public_modules()


def _import(name: str):
    """``name`` imported; skipped (with the reason) only where it needs an optional extra that is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top in OPTIONAL_MODULES and importlib.util.find_spec(top) is None:
            pytest.skip(f"{name} needs the [{OPTIONAL_MODULES[top]}] extra ({top} is not installed)")
        raise


def test_the_walk_finds_the_packages_and_modules():
    names = dict(MODULES)
    assert names["fastpersist"] and names["fastpersist.io"] and names["fastpersist.distributed"]
    assert "fastpersist.io.engine" in names and not names["fastpersist.io.engine"]
    assert "fastpersist.__main__" not in names


@pytest.mark.parametrize("name", [name for name, _ in MODULES])
def test_star_import_gives_exactly_all(name):
    module = _import(name)
    exported = getattr(module, "__all__", None)
    namespace: dict = {}
    exec(f"from {name} import *", namespace)
    if exported is None:  # a package without __all__: star-import its public names, which must work too
        return
    assert all(isinstance(n, str) for n in exported), f"{name}.__all__ holds a non-string"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    assert sorted(n for n in exported if not hasattr(module, n)) == []
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(exported)


@pytest.mark.parametrize("name", [name for name, package in MODULES if package])
def test_the_submodules_a_package_docstring_names_exist(name):
    path = os.path.join(ROOT, *name.split("."), "__init__.py")
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    named = re.findall(r":mod:`\.(\w+)`", doc)
    missing = [n for n in named if importlib.util.find_spec(f"{name}.{n}") is None]
    assert missing == [], f"{name}'s docstring names modules that do not exist: {missing}"


def test_only_a_missing_extra_skips(monkeypatch):
    def needs(module: str):
        def import_module(name):
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)

        return import_module

    monkeypatch.setattr(importlib, "import_module", needs("boto3"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match=r"needs the \[s3\] extra \(boto3 is not installed\)"):
        _import("fastpersist.example")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # installed, yet its import failed
    with pytest.raises(ModuleNotFoundError):
        _import("fastpersist.example")
    monkeypatch.setattr(importlib, "import_module", needs("nosuchmodule"))  # not an extra: a real failure
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError):
        _import("fastpersist.example")
