"""Runs PyTorch's test/test_serialization.py plain and with torch.save/torch.load swapped for fastpersist's.

Usage:
    python tests/compat/peers/run_torch_serialization.py PATH/TO/test_serialization.py [--json OUT.json] [-k EXPR]

PyTorch's file is not part of this repository: take it from the PyTorch
release matching the installed torch. Each run is a separate pytest process;
the report lists the tests that pass plain but fail swapped. Every such test
must be one that asserts torch's exact byte offsets (see
docs/compatibility.md, "PyTorch's own test suite"); the exit status is 1 when
another one fails.
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


def run(test_file: str, swapped: bool, extra: list[str]) -> dict[str, str]:
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
                f.write(CONFTEST.format(here=HERE))
            command += ["-p", "fastpersist_swap"]
        subprocess.run(command + extra, env=env, cwd=os.path.dirname(os.path.abspath(test_file)))
        outcomes = {}
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            tags = {child.tag for child in case}
            outcomes[name] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file")
    parser.add_argument("--json", help="write the comparison here")
    parser.add_argument("-k", help="pytest -k expression")
    args = parser.parse_args(argv)
    extra = ["-k", args.k] if args.k else []
    plain = run(args.test_file, False, extra)
    swapped = run(args.test_file, True, extra)
    regressions = sorted(n for n, o in plain.items() if o == "passed" and swapped.get(n) != "passed")
    unexpected = [n for n in regressions if n.rsplit("::", 1)[1].split("_cpu")[0] not in EXPECTED_DIFFERENCES]
    result = {
        "plain_passed": sum(o == "passed" for o in plain.values()),
        "swapped_passed": sum(o == "passed" for o in swapped.values()),
        "total": len(plain),
        "pass_plain_fail_swapped": regressions,
        "unexpected": unexpected,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
