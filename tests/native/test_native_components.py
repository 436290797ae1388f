"""The C++ core without Python: each component's own test (native/tests/*_test.cpp) and the end-to-end smoke test.

Every source of native/src is compiled once (no Python headers, no torch), each
test file is linked with those objects and run with a scratch directory; it
prints ``<name>: ok`` and exits 0, or prints the first failed check. Skipped
without a C++ compiler or without the native sources (an installed package).
"""

from __future__ import annotations

import concurrent.futures
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


def _flags() -> list[str]:
    have_uring = "1" if os.path.exists("/usr/include/linux/io_uring.h") else "0"
    include, src = os.path.join(ROOT, "native", "include"), os.path.join(ROOT, "native", "src")
    return ["-std=c++17", "-O0", "-pthread", f"-DFASTPERSIST_HAVE_IO_URING={have_uring}", "-I", include, "-I", src]


@pytest.fixture(scope="module")
def core_objects(compiler, tmp_path_factory):
    """native/src compiled once for every test here (each test used to compile all of it again)."""
    sources = sorted(glob.glob(os.path.join(ROOT, "native", "src", "*.cpp")))
    if not sources:
        pytest.skip("native sources not present (installed package)")
    out = tmp_path_factory.mktemp("native-core")
    objects = [str(out / (os.path.basename(source)[:-4] + ".o")) for source in sources]

    def build(pair):
        source, target = pair
        return subprocess.run(
            [compiler, *_flags(), "-c", source, "-o", target], capture_output=True, text=True, timeout=600
        )

    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        for result in pool.map(build, zip(sources, objects)):
            assert result.returncode == 0, result.stderr[-3000:]
    return objects


def test_every_component_has_its_test():
    components = {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(ROOT, "native", "src", "*.cpp"))}
    tested = {os.path.basename(p)[: -len("_test.cpp")] for p in TESTS if p.endswith("_test.cpp")}
    # engine.cpp, engine_*.cpp and handle.cpp are exercised end to end by core_smoke.cpp.
    smoke = {c for c in components if c.startswith("engine") or c == "handle"}
    assert components - smoke <= tested | {"error"}, f"components without a test: {sorted(components - smoke - tested)}"
    assert "error" in tested or any(p.endswith("file_test.cpp") for p in TESTS)  # errors are tested with files


@pytest.mark.parametrize("source", TESTS, ids=[os.path.basename(p)[:-4] for p in TESTS])
def test_native_component(source, compiler, core_objects, tmp_path):
    binary = str(tmp_path / "test")
    build = subprocess.run(
        [compiler, *_flags(), source, *core_objects, "-o", binary], capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([binary, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ": ok" in run.stdout
