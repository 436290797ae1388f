"""The C++ core without Python: each component's own test (native/tests/*_test.cpp) and the end-to-end smoke test.

Each test file is compiled with every source of native/src (no Python headers,
no torch) and run with a scratch directory; it prints ``<name>: ok`` and exits
0, or prints the first failed check. Skipped without a C++ compiler or without
the native sources (an installed package).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = sorted(glob.glob(os.path.join(ROOT, "native", "tests", "*.cpp")))


@pytest.fixture(scope="module")
def compiler():
    found = shutil.which("g++") or shutil.which("c++")
    if found is None:
        pytest.skip("no C++ compiler")
    return found


def test_every_component_has_its_test():
    components = {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(ROOT, "native", "src", "*.cpp"))}
    tested = {os.path.basename(p)[: -len("_test.cpp")] for p in TESTS if p.endswith("_test.cpp")}
    # engine.cpp, engine_*.cpp and handle.cpp are exercised end to end by core_smoke.cpp.
    smoke = {c for c in components if c.startswith("engine") or c == "handle"}
    assert components - smoke <= tested | {"error"}, f"components without a test: {sorted(components - smoke - tested)}"
    assert "error" in tested or any(p.endswith("file_test.cpp") for p in TESTS)  # errors are tested with files


@pytest.mark.parametrize("source", TESTS, ids=[os.path.basename(p)[:-4] for p in TESTS])
def test_native_component(source, compiler, tmp_path):
    sources = sorted(glob.glob(os.path.join(ROOT, "native", "src", "*.cpp")))
    if not sources:
        pytest.skip("native sources not present (installed package)")
    binary = str(tmp_path / "test")
    have_uring = "1" if os.path.exists("/usr/include/linux/io_uring.h") else "0"
    build = subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O0",
            "-pthread",
            f"-DFASTPERSIST_HAVE_IO_URING={have_uring}",
            "-I",
            os.path.join(ROOT, "native", "include"),
            "-I",
            os.path.join(ROOT, "native", "src"),
            *sources,
            source,
            "-o",
            binary,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([binary, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ": ok" in run.stdout
