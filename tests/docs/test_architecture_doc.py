"""docs/architecture.md matches the tree: every module listed once, names that exist, the layering rules kept."""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gen_architecture

DOC = os.path.join(ROOT, "docs", "architecture.md")
PACKAGES = {"format", "io", "cli", "bench", "integrations", "distributed", "dcp", "api", "deepnvme", "tuning"}


@functools.cache
def _module_graph() -> dict[str, set[str]]:
    """The tree's import graph, parsed once for every test below that reads it (each parse takes seconds)."""
    return gen_architecture.module_graph(ROOT)


@functools.cache
def _layer_graph() -> dict[str, set[str]]:
    return gen_architecture.layer_graph(ROOT)


def _doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def test_generated_blocks_match_the_tree():
    assert gen_architecture.render(_doc()) == _doc(), "run: python tools/gen_architecture.py"
    with open(os.path.join(ROOT, gen_architecture.SETTINGS_DOC), encoding="utf-8") as f:
        settings_page = f.read()
    assert gen_architecture.render(settings_page, ROOT, gen_architecture.SETTINGS_DOC) == settings_page


def test_the_settings_table_lists_every_setting_once():
    from fastpersist import config

    rows = gen_architecture.settings_rows(ROOT)
    assert [name for name, _, _ in rows] == [name for name, *_ in config.describe()]
    assert dict((name, text) for name, _, text in rows)["atomic"].startswith("Save regular files")


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
    assert (
        "| `fastpersist/newmodule.py` | A module added by another branch. |"
        in (tree / "docs" / "architecture.md").read_text()
    )
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
    names = set(
        re.findall(
            r"`(?:fastpersist\.)?((?:format|io|cli|bench|api|deepnvme|tuning|display|"
            r"config|system|tensors|errors|integrations|distributed|dcp)(?:\.\w+)+)",
            prose,
        )
    )
    names = {n for n in names if not n.endswith(".py")}  # file names are checked below
    assert names, "the prose names no modules"
    assert sorted(n for n in names if not _resolves(n)) == []
    paths = set(re.findall(r"`((?:fastpersist|native|tools|tests)/[\w/.]+\.(?:py|cpp|hpp))`", prose))
    assert sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p))) == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("format", "io"),
        ("format", "io.engine"),
        ("io", "_native"),
        ("base", "_native"),
        ("cli", "_native"),
        ("api", "bench"),
        ("io", "api"),
        ("distributed", "api"),
    ],
)
def test_dependencies_run_one_way(layer, forbidden):
    assert forbidden not in _layer_graph().get(layer, set())


def test_every_layer_imports_only_layers_below_it():
    rank = {name: index for index, name in enumerate(gen_architecture.LAYER_ORDER)}
    graph = _layer_graph()
    assert set(graph) <= set(rank), f"layers missing from LAYER_ORDER: {sorted(set(graph) - set(rank))}"
    upward = {layer: sorted(t for t in targets if rank[t] <= rank[layer]) for layer, targets in graph.items()}
    assert {layer: t for layer, t in upward.items() if t} == {}


def test_no_import_cycles_between_modules():
    """Function-level imports included: a cycle hidden inside a function is still a cycle."""
    assert gen_architecture.import_cycles(ROOT) == []


def test_the_benchmarks_are_a_leaf():
    """The product never imports fastpersist.bench; only the `fastpersist bench` command dispatches to it."""
    importers = {
        module
        for module, targets in _module_graph().items()
        if not module.startswith("fastpersist.bench") and any(t.startswith("fastpersist.bench") for t in targets)
    }
    assert importers == {"fastpersist.cli.bench"}


def test_the_cycle_finder_finds_a_hidden_cycle(tmp_path):
    tree = tmp_path / "repo"
    (tree / "fastpersist" / "sub").mkdir(parents=True)
    (tree / "fastpersist" / "__init__.py").write_text('"""The package."""\n')
    (tree / "fastpersist" / "sub" / "__init__.py").write_text('"""Sub."""\n')
    (tree / "fastpersist" / "sub" / "a.py").write_text('"""A."""\nfrom fastpersist.sub import b\n')
    (tree / "fastpersist" / "sub" / "b.py").write_text('"""B."""\ndef f():\n    from fastpersist.sub import a\n')
    assert gen_architecture.import_cycles(str(tree)) == [["fastpersist.sub.a", "fastpersist.sub.b"]]


def _exception_names() -> set[str]:
    """Names that denote an exception type wherever they appear as a base: the built-in ones, those of
    fastpersist.errors, and any name ending in Error, Exception or Warning (``pickle.PicklingError``...)."""
    from fastpersist import errors

    names = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    return names | {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)}


def exception_classes(source: str, names: set[str]) -> list[str]:
    """``name:line`` of every class ``source`` defines, nested ones included, with a base that is an exception type."""

    def base_name(base: ast.expr) -> str:
        return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")

    return [
        f"{node.name}:{node.lineno}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
        and any(
            name in names or name.endswith(("Error", "Exception", "Warning")) for name in map(base_name, node.bases)
        )
    ]


def test_every_exception_class_is_defined_in_errors_py():
    """One place for the exception and warning types: the product's other modules import them from
    fastpersist.errors (the benchmarks, a leaf outside the product, aside)."""
    names = _exception_names()
    found = {}
    for path, _ in gen_architecture.python_modules(ROOT):
        if path == os.path.join("fastpersist", "errors.py") or path.startswith(os.path.join("fastpersist", "bench")):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            classes = exception_classes(f.read(), names)
        if classes:
            found[path] = classes
    assert found == {}, "define these in fastpersist/errors.py and import them from there"


def test_the_compiled_core_raises_the_types_of_errors_py():
    """The binding takes its exception types from fastpersist.errors instead of defining its own."""
    from fastpersist import _native, errors

    raised = {n: v for n, v in vars(_native).items() if isinstance(v, type) and issubclass(v, BaseException)}
    assert set(raised) == {"EngineUnavailableError", "UnexpectedEndOfFileError"}
    assert {n: v.__module__ for n, v in raised.items()} == dict.fromkeys(raised, "fastpersist.errors")
    assert all(getattr(errors, n) is v for n, v in raised.items())


def test_the_exception_finder_finds_every_kind_of_base():
    source = (
        "import pickle\n"
        "class A(OSError): pass\n"
        "class B(pickle.PicklingError): pass\n"
        "class C(CorruptCheckpointError): pass\n"
        "class D(errors.FastPersistError): pass\n"
        "class E(object): pass\n"
        "def f():\n"
        "    class G(KeyboardInterrupt): pass\n"
        "class H(MyWarning, dict): pass\n"
    )
    assert exception_classes(source, _exception_names()) == ["A:2", "B:3", "C:4", "D:5", "H:9", "G:8"]


RING_LEASE_ALLOWED = {
    "fastpersist/io/ring.py",  # the one pinned ring
    "fastpersist/io/memory.py",  # defines lease_buffers (reserve_ring warms the pool with it)
}


def _lease_callers(root: str) -> set[str]:
    """Modules under ``root``/fastpersist that name ``lease_buffers`` (a call, an import, an attribute)."""
    import ast

    callers = set()
    for directory, _, files in os.walk(os.path.join(root, "fastpersist")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                named = (
                    (isinstance(node, ast.Attribute) and node.attr == "lease_buffers")
                    or (isinstance(node, ast.Name) and node.id == "lease_buffers")
                    or (isinstance(node, ast.ImportFrom) and any(a.name == "lease_buffers" for a in node.names))
                    or (isinstance(node, ast.FunctionDef) and node.name == "lease_buffers")
                )
                if named:
                    callers.add(os.path.relpath(path, root))
                    break
    return callers


def test_only_the_ring_leases_pinned_buffers():
    """Every staging ring is ``io.ring.Ring``: no other product module leases buffers from the pool."""
    callers = _lease_callers(ROOT)
    assert "fastpersist/io/ring.py" in callers
    assert sorted(callers - RING_LEASE_ALLOWED) == []


def test_the_lease_finder_finds_a_lease_however_it_is_named(tmp_path):
    package = tmp_path / "fastpersist"
    package.mkdir()
    (package / "a.py").write_text(
        "from fastpersist.io import memory\nwith memory.lease_buffers(2, 8) as b:\n    pass\n"
    )
    (package / "b.py").write_text("from fastpersist.io.memory import lease_buffers\n")
    (package / "c.py").write_text("lease = getattr(object, 'other_name')\n")
    assert _lease_callers(str(tmp_path)) == {"fastpersist/a.py", "fastpersist/b.py"}


_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "memory://")
"""URL schemes product code may name only where targets are resolved or implemented (``file://`` is left
out: the Lightning plugins strip it to keep their local fast path)."""
_STORES = (
    "fastpersist/io/targets/",  # resolve() and one file (or package: s3/, with its requests) per store
    "fastpersist/distributed/objectstore.py",  # collective saves as S3 part objects
    "fastpersist/bench/",  # a leaf: the benchmarks name the stores they measure
)


def _scheme_uses(path: str) -> list[str]:
    """Where ``path`` names a URL scheme in code (string literals that are not docstrings) or calls the old
    scheme test ``is_object_url``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}  # docstrings
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found += [f"line {node.lineno}: {scheme}" for scheme in _SCHEMES if scheme in node.value]
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name == "is_object_url":
            found.append(f"line {node.lineno}: is_object_url")
    return found


def test_only_the_targets_decide_where_bytes_go():
    """A new store is one file under io/targets/: no entry point tests for a scheme itself (it calls
    io.targets.resolve and uses the target's methods)."""
    offenders = {}
    for path, _ in gen_architecture.python_modules(ROOT):
        if not path.startswith(_STORES):
            uses = _scheme_uses(os.path.join(ROOT, path))
            if uses:
                offenders[path] = uses
    assert offenders == {}


def test_the_scheme_check_sees_code_and_skips_docstrings(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Saves to ``s3://bucket/key``."""\n'
        "def f(url):\n"
        '    """Takes memory:// too."""\n'
        '    return url.startswith("s3://") or objectstore.is_object_url(url) or f"gs://{url}"\n'
    )
    assert sorted(_scheme_uses(str(module))) == ["line 4: gs://", "line 4: is_object_url", "line 4: s3://"]
