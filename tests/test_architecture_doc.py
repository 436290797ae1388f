"""docs/architecture.md matches the tree: every module listed once, names that exist, the layering rules kept."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gen_architecture  # noqa: E402

DOC = os.path.join(ROOT, "docs", "architecture.md")
PACKAGES = {"format", "io", "cli", "bench", "integrations", "distributed", "dcp"}


def _doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def test_generated_blocks_match_the_tree():
    assert gen_architecture.render(_doc()) == _doc(), "run: python tools/gen_architecture.py"


def test_the_check_command_fails_when_a_module_is_added(tmp_path):
    tree = tmp_path / "repo"
    for name in ("fastpersist", "native", "docs"):
        shutil.copytree(os.path.join(ROOT, name), tree / name, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    script = os.path.join(ROOT, "tools", "gen_architecture.py")
    check = [sys.executable, script, "--check", "--root", str(tree)]
    assert subprocess.run(check, capture_output=True).returncode == 0
    (tree / "fastpersist" / "newmodule.py").write_text('"""A module added by another branch."""\n')
    result = subprocess.run(check, capture_output=True, text=True)
    assert result.returncode == 1 and "differs from the tree" in result.stderr
    assert subprocess.run([sys.executable, script, "--root", str(tree)], capture_output=True).returncode == 0
    assert "| `fastpersist/newmodule.py` | A module added by another branch. |" in (tree / "docs" / "architecture.md").read_text()
    (tree / "fastpersist" / "undocumented.py").write_text("x = 1\n")
    result = subprocess.run(check, capture_output=True, text=True)
    assert result.returncode == 2 and "no module docstring" in result.stderr


def test_every_module_is_listed_exactly_once():
    listed = re.findall(r"^\| `([^`]+)` \|", _doc(), flags=re.MULTILINE)
    modules = [path for path, _ in gen_architecture.python_modules(ROOT) + gen_architecture.native_files(ROOT)]
    assert sorted(listed) == sorted(modules)
    assert len(listed) == len(set(listed))


def _resolves(name: str) -> bool:
    parts = name.split(".")
    module, index = None, 0
    for index in range(len(parts), 0, -1):
        try:
            module = importlib.import_module("fastpersist." + ".".join(parts[:index]))
            break
        except ImportError:
            continue
    if module is None:
        return False
    target = module
    for attribute in parts[index:]:
        if not hasattr(target, attribute):
            return False
        target = getattr(target, attribute)
    return True


def test_names_in_the_prose_exist():
    prose = re.sub(r"<!-- fastpersist:\w+ -->.*?<!-- /fastpersist -->", "", _doc(), flags=re.DOTALL)
    names = set(re.findall(r"`(?:fastpersist\.)?((?:format|io|cli|bench|commit|saving|loading|futures|verification|"
                           r"config|system|tensors|errors|api|integrations|distributed|dcp)(?:\.\w+)+)", prose))  # fmt: skip
    names = {n for n in names if not n.endswith(".py")}  # file names are checked below
    assert names, "the prose names no modules"
    assert sorted(n for n in names if not _resolves(n)) == []
    paths = set(re.findall(r"`((?:fastpersist|native|tools|tests)/[\w/.]+\.(?:py|cpp|hpp))`", prose))
    assert sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p))) == []


@pytest.mark.parametrize(("layer", "forbidden"), [("format", "io"), ("format", "io.engine"), ("io", "_native"),
                                                  ("fastpersist", "_native"), ("cli", "_native")])  # fmt: skip
def test_dependencies_run_one_way(layer, forbidden):
    assert forbidden not in gen_architecture.layer_graph(ROOT).get(layer, set())
