"""Runs Lightning's own checkpoint tests twice: as shipped, and with its CheckpointIO swapped for fastpersist's.

    python tests/compat/peers/run_lightning_checkpoint_io_tests.py /work/peer/lightning/tests [--json out.json]

PATH is the ``tests`` directory of a Lightning source checkout matching the
installed Lightning (2.6.x). The swap (``_lightning_swap.py``) replaces the
save/load/remove methods of Lightning's default ``TorchCheckpointIO`` with
those of ``FastPersistCheckpointIO``, so every Trainer in those tests writes
and reads its checkpoints through fastpersist. Prints passed/failed/skipped
counts for both runs and the tests whose outcome differs.
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
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
FILES = [
    "tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests_pytorch/checkpointing/test_torch_saving.py",
    "tests_pytorch/plugins/test_checkpoint_io_plugin.py",
    "tests_pytorch/plugins/test_async_checkpoint.py",
]


def outcomes(junit: str) -> dict[str, str]:
    result = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                state = "failed"
            elif child.tag == "skipped":
                state = "skipped"
        result[name] = state
    return result


def run(tests: str, files: list[str], swap: bool, extra: list[str]) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as scratch:
        junit = os.path.join(scratch, "junit.xml")
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, REPO, HERE]), "PYTHONWARNINGS": "ignore"}
        if swap:
            argv += ["-p", "_lightning_swap"]
        subprocess.run(argv + files, cwd=tests, env=env)
        return outcomes(junit)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", help="Lightning's tests/ directory")
    parser.add_argument("--json", help="write the counts and differences here")
    parser.add_argument("-k", default=None, help="pytest -k expression (both runs)")
    args = parser.parse_args()
    files = [f for f in FILES if os.path.exists(os.path.join(args.tests, f))]
    extra = ["-k", args.k] if args.k else []
    plain = run(args.tests, files, swap=False, extra=extra)
    ours = run(args.tests, files, swap=True, extra=extra)

    def count(result):
        return {state: sum(1 for s in result.values() if s == state) for state in ("passed", "failed", "skipped")}

    differ = {
        name: (plain.get(name), ours.get(name))
        for name in sorted(set(plain) | set(ours))
        if plain.get(name) != ours.get(name)
    }
    document = {"files": files, "plain": count(plain), "fastpersist": count(ours), "differences": differ}
    print(f"plain:       {document['plain']}")
    print(f"fastpersist: {document['fastpersist']}")
    for name, (a, b) in differ.items():
        print(f"  {name}: plain {a}, fastpersist {b}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    regressions = [n for n, (a, b) in differ.items() if a == "passed" and b != "passed"]
    return 1 if regressions else 0


if __name__ == "__main__":
    raise SystemExit(main())
