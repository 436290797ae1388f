"""The tree is formatted and linted by ruff (its settings live in pyproject.toml; the version is pinned in [test])."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ruff() -> list[str]:
    """The ruff command: the module of this interpreter, else one on PATH; skip where neither is installed."""
    try:
        import ruff  # noqa: F401 (only asks whether it is installed)
    except ImportError:
        found = shutil.which("ruff")
        if found is None:
            pytest.skip("ruff is not installed (pip install -e '.[test]')")
        return [found]
    return [sys.executable, "-m", "ruff"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_lint_is_clean():
    result = _run("check", "--no-cache", ".")
    assert result.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix .`):\n{result.stdout}"


def test_formatting_is_clean():
    result = _run("format", "--check", "--no-cache", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}"


def test_no_formatter_escapes():
    """One formatter for everything: no line opts out of it."""
    marker = "fmt: " + "skip"
    offenders = []
    for folder in ("fastpersist", "tests", "examples", "tools"):
        for directory, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    with open(path, encoding="utf-8") as f:
                        offenders += [f"{path}:{n}" for n, line in enumerate(f, 1) if marker in line]
    assert offenders == []
