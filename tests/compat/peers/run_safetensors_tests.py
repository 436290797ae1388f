"""Runs the safetensors library's own Python tests against fastpersist's safetensors functions.

Usage::

    python tests/compat/peers/run_safetensors_tests.py PATH [--json OUT.json] [--mode all|both|plain|ours|ours-align8]

``PATH`` is a checkout's ``bindings/python/tests`` directory (or a copy of
its test files; the peer code is never copied into this repository). Each
torch-relevant test file is run twice, in fresh interpreters: once as is
(``plain``: the library), once with ``safetensors.torch.save_file``,
``load_file``, ``save``, ``load``, ``save_model``, ``load_model`` and
``safe_open`` (for ``framework="pt"``; numpy/flax/... files stay the
library's) replaced by fastpersist's (``ours``), and once more with
``save_file(..., alignment=8)`` (``ours-align8``: the library's exact bytes,
no 4 KiB header padding). The report lists the counts
per file and every test whose outcome differs. docs/safetensors.md explains
the expected differences.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# The files that exercise safetensors.torch; the others test numpy/flax/tf/mlx/paddle
# bindings or the library's GIL handling of its own numpy serializer.
DEFAULT_FILES = [
    "test_pt_comparison.py",
    "test_pt_model.py",
    "test_simple.py",
    "test_pread_backend.py",
    "test_multithreaded.py",
]

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _patch(alignment: int | None = None) -> None:
    """Swaps the library's torch entry points for fastpersist's (before the tests import them).

    ``alignment=8`` makes ``save_file`` write the library's exact bytes (no 4 KiB header padding).
    """
    sys.path.insert(0, _REPOSITORY)
    import safetensors
    import safetensors.torch as library

    from fastpersist.api import safetensors as ours

    library_safe_open = safetensors.safe_open

    def safe_open(filename, framework="pt", device="cpu", **kwargs):
        if framework in ("pt", "torch", "pytorch"):
            return ours.safe_open(filename, framework=framework, device=device, **kwargs)
        return library_safe_open(filename, framework=framework, device=device, **kwargs)

    for name in ("save_file", "load_file", "save", "load", "save_model", "load_model"):
        setattr(library, name, getattr(ours, name))
    if alignment is not None:
        import functools

        library.save_file = functools.partial(ours.save_file, alignment=alignment)
        ours.save_file = library.save_file  # save_model calls it too
    library.safe_open = safe_open
    safetensors.safe_open = safe_open


class _Outcomes:
    """A pytest plugin recording each test's outcome."""

    def __init__(self) -> None:
        self.results: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome = report.outcome
            if report.when == "setup" and outcome == "failed":
                outcome = "error"
            self.results[report.nodeid.split("::", 1)[-1]] = outcome


def _child(mode: str, test_file: str, result_file: str) -> int:
    if mode == "ours":
        _patch()
    elif mode == "ours-align8":
        _patch(alignment=8)
    import pytest

    test_file, home = os.path.abspath(test_file), os.getcwd()
    with tempfile.TemporaryDirectory(prefix="safetensors-peer-") as work:  # removed with what the tests wrote
        os.makedirs(os.path.join(work, "tests", "data"))
        os.chdir(work)  # the tests write ./tests/data/*.safetensors
        try:
            ini = os.path.join(work, "pytest.ini")
            with open(ini, "w") as f:
                f.write("[pytest]\n")
            plugin = _Outcomes()
            args = ["-q", "-p", "no:cacheprovider", "-c", ini, "--rootdir", work, test_file]
            code = pytest.main(args, plugins=[plugin])
        finally:
            os.chdir(home)
    with open(result_file, "w") as f:
        json.dump({"exit_code": int(code), "results": plugin.results}, f)
    return 0


def _run(mode: str, test_file: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        result_file = out.name
    try:
        completed = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", mode, test_file, result_file],
            capture_output=True,
            text=True,
            timeout=900,
        )
        try:
            with open(result_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"exit_code": completed.returncode, "results": {}, "error": completed.stderr[-4000:]}
    finally:
        os.unlink(result_file)


def _counts(results: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in results.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(*argv[1:4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="the safetensors repository's bindings/python/tests directory")
    parser.add_argument("--files", nargs="*", default=DEFAULT_FILES, help="test files to run (default: the torch ones)")
    parser.add_argument(
        "--mode",
        choices=("both", "all", "plain", "ours", "ours-align8"),
        default="all",
        help="both: plain and ours; all: also ours with alignment=8 (the library's exact bytes)",
    )
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    modes = {"both": ["plain", "ours"], "all": ["plain", "ours", "ours-align8"]}.get(args.mode, [args.mode])
    report: dict = {"path": os.path.abspath(args.path), "files": {}}
    totals = {mode: {} for mode in modes}
    for name in args.files:
        test_file = os.path.join(os.path.abspath(args.path), name)
        if not os.path.exists(test_file):
            print(f"{name}: missing, skipped")
            continue
        entry = {}
        for mode in modes:
            entry[mode] = _run(mode, test_file)
            for outcome, count in _counts(entry[mode]["results"]).items():
                totals[mode][outcome] = totals[mode].get(outcome, 0) + count
        line = "  ".join(f"{mode}: {_counts(entry[mode]['results'])}" for mode in modes)
        print(f"{name}: {line}")
        if "plain" in modes and len(modes) > 1:
            results = {mode: entry[mode]["results"] for mode in modes}
            tests = sorted(set().union(*results.values()))
            entry["differences"] = {
                test: {mode: results[mode].get(test) for mode in modes}
                for test in tests
                if len({results[mode].get(test) for mode in modes}) > 1
            }
            for test, outcome in entry["differences"].items():
                print(f"    {test}: " + ", ".join(f"{mode} {outcome[mode]}" for mode in modes))
        for mode in modes:
            if entry[mode].get("error"):
                print(f"    {mode} did not run: {entry[mode]['error']}")
        report["files"][name] = entry
    report["totals"] = totals
    print("totals: " + "  ".join(f"{mode}: {totals[mode]}" for mode in modes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
