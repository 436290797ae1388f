"""Runs a DCP test file from PyTorch's suite plainly, or with fastpersist's storage layer swapped in.

    python tests/compat/peers/run_dcp_peer_suite.py /work/peer/pytorch/test_file_system_checkpoint_cpu.py
    python tests/compat/peers/run_dcp_peer_suite.py /work/peer/pytorch/test_file_system_checkpoint_cpu.py --ours

With ``--ours``, ``torch.distributed.checkpoint.FileSystemWriter`` and
``FileSystemReader`` (the names the peer file imports) become thin adapters
over ``FastPersistWriter`` / ``FastPersistReader`` that accept their
arguments (``thread_count`` -> ``files_per_rank``). The peer file is copied
into a temporary directory with one import line prepended that installs the
adapters, so processes the peer's tests spawn get them too. The peer file
itself is never copied into this repository.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

_PATCH = """
import torch.distributed.checkpoint as _dcp
import torch.distributed.checkpoint.filesystem as _filesystem
from fastpersist.dcp import FastPersistReader, FastPersistWriter


class FileSystemWriter(FastPersistWriter):
    def __init__(self, path, single_file_per_rank=True, sync_files=True, thread_count=1,
                 per_thread_copy_ahead=10_000_000, cache_staged_state_dict=False, overwrite=True,
                 _extensions=None, serialization_format=None):
        if _extensions:
            raise NotImplementedError("fastpersist.dcp does not implement DCP's experimental stream transforms")
        super().__init__(path, files_per_rank=thread_count, sync_files=sync_files, overwrite=overwrite)


class FileSystemReader(FastPersistReader):
    def __init__(self, path, _extension_registry=None):
        super().__init__(path, _extension_registry=_extension_registry)


_dcp.FileSystemWriter = FileSystemWriter
_dcp.FileSystemReader = FileSystemReader
_filesystem.FileSystemWriter = FileSystemWriter
_filesystem.FileSystemReader = FileSystemReader
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer_file")
    parser.add_argument("--ours", action="store_true", help="swap in FastPersistWriter/Reader")
    parser.add_argument("-k", default=None, help="unittest -k pattern")
    args = parser.parse_args()
    repository = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with tempfile.TemporaryDirectory(prefix="fastpersist-peer-") as directory:
        target = os.path.join(directory, os.path.basename(args.peer_file))
        with open(args.peer_file) as source, open(target, "w") as copy:
            if args.ours:
                with open(os.path.join(directory, "fastpersist_dcp_peer_patch.py"), "w") as patch:
                    patch.write(_PATCH)
                copy.write("import fastpersist_dcp_peer_patch  # noqa: F401\n")
            shutil.copyfileobj(source, copy)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([directory, repository, os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, target] + (["-k", args.k] if args.k else [])
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    output = result.stdout + result.stderr
    for line in output.splitlines():
        if re.match(r"^(ERROR|FAIL):", line) or re.match(r"^(Ran \d+ tests|OK|FAILED)", line):
            print(line)
    print(f"{'ours' if args.ours else 'plain'}: exit status {result.returncode}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
