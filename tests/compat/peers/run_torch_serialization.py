"""Runs PyTorch's test/test_serialization.py plain, with torch.save/torch.load swapped for fastpersist's, and
under fastpersist.patch().

Usage:
    python tests/compat/peers/run_torch_serialization.py PATH/TO/test_serialization.py [--json OUT.json] [-k EXPR]
        [--patched]

PyTorch's file is not part of this repository: take it from the PyTorch
release matching the installed torch. Each run is a separate pytest process;
the report lists the tests that pass plain but fail swapped (and, with
``--patched``, those that pass plain but fail under ``fastpersist.patch()``,
the drop-in for code you do not own, docs/patch.md). Every such test must be
one that asserts torch's exact byte offsets (see docs/compatibility.md,
"PyTorch's own test suite"); the exit status is 1 when another one fails, 2 when none passed even plain
(the file did not load: PyTorch's test helpers need ``expecttest``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

# Tests that assert torch's exact byte layout, which fastpersist's 4 KiB-aligned
# payloads change on purpose: name -> reason. Each entry must also be listed in
# docs/compatibility.md. Empty until a run against PyTorch's file shows one.
EXPECTED_DIFFERENCES: dict[str, str] = {
    "test_storage_alignment": (
        "asserts torch's exact byte offsets (20480, 24576) under storage_alignment=4096: torch pads every "
        "record, metadata included, to 4096; fastpersist pads storages to 4096 (4096, 8192) and metadata to 64"
    ),
}

CONFTEST = """
import sys
sys.path.insert(0, {here!r})
import torch_shim
torch_shim.install()
"""

PATCHED = """
import fastpersist
fastpersist.patch()
"""


def run(test_file: str, swapped: bool | str, extra: list[str]) -> dict[str, str]:
    """One pytest run: plain (``False``), swapped (``True``) or under ``fastpersist.patch()`` (``"patched"``)."""
    with tempfile.TemporaryDirectory() as work:
        report = os.path.join(work, "report.xml")
        plugin_dir = os.path.join(work, "plugin")
        os.makedirs(plugin_dir)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([ROOT, plugin_dir, os.environ.get("PYTHONPATH", "")]),
        )
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            test_file,
            f"--junitxml={report}",
        ]
        if swapped:
            with open(os.path.join(plugin_dir, "fastpersist_swap.py"), "w") as f:
                f.write(PATCHED if swapped == "patched" else CONFTEST.format(here=HERE))
            command += ["-p", "fastpersist_swap"]
        subprocess.run(command + extra, env=env, cwd=os.path.dirname(os.path.abspath(test_file)))
        outcomes = {}
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            tags = {child.tag for child in case}
            outcomes[name] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        return outcomes


def _regressions(plain: dict[str, str], other: dict[str, str]) -> list[str]:
    return sorted(n for n, o in plain.items() if o == "passed" and other.get(n) != "passed")


def _unexpected(regressions: list[str]) -> list[str]:
    return [n for n in regressions if n.rsplit("::", 1)[1].split("_cpu")[0] not in EXPECTED_DIFFERENCES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file")
    parser.add_argument("--json", help="write the comparison here")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--patched", action="store_true", help="also run it under fastpersist.patch()")
    args = parser.parse_args(argv)
    extra = ["-k", args.k] if args.k else []
    plain = run(args.test_file, False, extra)
    swapped = run(args.test_file, True, extra)
    regressions = _regressions(plain, swapped)
    result = {
        "plain_passed": sum(o == "passed" for o in plain.values()),
        "swapped_passed": sum(o == "passed" for o in swapped.values()),
        "total": len(plain),
        "pass_plain_fail_swapped": regressions,
        "unexpected": _unexpected(regressions),
    }
    if args.patched:
        patched = run(args.test_file, "patched", extra)
        regressions = _regressions(plain, patched)
        result.update(
            patched_passed=sum(o == "passed" for o in patched.values()),
            counts={
                name: {kind: sum(o == kind for o in outcomes.values()) for kind in ("passed", "failed", "skipped")}
                for name, outcomes in (("plain", plain), ("swapped", swapped), ("patched", patched))
            },
            pass_plain_fail_patched=regressions,
        )
        result["unexpected"] = sorted(set(result["unexpected"]) | set(_unexpected(regressions)))
    unexpected = result["unexpected"]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not result["plain_passed"]:
        # Nothing passed as shipped: the file did not load (a missing test dependency such as expecttest, or
        # a file from another torch release), so nothing was compared.
        print("error: no test passed plain; see pytest's output above", file=sys.stderr)
        return 2
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
