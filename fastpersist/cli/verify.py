"""``fastpersist verify PATH...``: checks checkpoints without loading them.

Each file's structure is checked (every header, padding, data descriptor and
end record; no gaps; nothing after the end) and every record's CRC-32 is
recomputed, without unpickling anything (see :func:`fastpersist.verify`).

A ``PATH`` may also be the manifest of a sharded checkpoint (its parts are
checked) or a DCP checkpoint directory (every item its ``.metadata`` lists).

Exit status: 0 when every file is intact, 1 when a file is corrupt (the
damaged record is named), 2 for a usage error or a file that cannot be read
or checked (missing, a directory without a DCP checkpoint, a legacy pre-1.6
torch file). With several files the highest status wins.

Registered as a subcommand of ``fastpersist`` (``fastpersist/cli/__init__.py``); also
runs on its own as ``python -m fastpersist.cli.verify PATH...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["HELP", "add_arguments", "run", "main", "EXIT_OK", "EXIT_CORRUPT", "EXIT_ERROR"]

HELP = "check checkpoints' structure and CRC-32s without loading them (exit 0 intact, 1 corrupt, 2 error)"
EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_ERROR = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="checkpoint files, sharded checkpoints' manifests or DCP checkpoint directories to check",
    )
    parser.add_argument(
        "--require-checksums",
        action="store_true",
        help="count a file written without CRC-32s (checksum=False) as corrupt instead of checking its structure only",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document (a list, one entry per file)")


def _check(path: str, require_checksums: bool) -> tuple[int, dict]:
    from fastpersist.api import loading, verification
    from fastpersist.errors import ChecksumMismatchError, CorruptCheckpointError

    result: dict = {"path": path}
    try:
        if not os.path.isdir(path):  # a DCP checkpoint directory is checked as such
            with open(path, "rb") as handle:
                head = handle.read(512)
            if head[:4] != b"PK\x03\x04" and loading._is_legacy_torch_file(head):
                result.update(status="error", error="a legacy (pre-1.6) torch file: it has no checksums to verify")
                return EXIT_ERROR, result
        report = verification.verify(path)
    except (ChecksumMismatchError, CorruptCheckpointError) as e:
        kind = "checksum" if isinstance(e, ChecksumMismatchError) else "structure"
        result.update(status="corrupt", kind=kind, record=e.record, error=str(e))
        return EXIT_CORRUPT, result
    except OSError as e:
        result.update(status="error", error=f"{type(e).__name__}: {e}")
        return EXIT_ERROR, result
    result.update(status="ok", records=report.records, bytes=report.bytes, checksummed=report.checksummed)
    if require_checksums and not report.checksummed:
        result.update(
            status="corrupt",
            kind="no-checksums",
            record=None,
            error="written without CRC-32 checksums; its data cannot be verified",
        )
        return EXIT_CORRUPT, result
    return EXIT_OK, result


def _print(result: dict) -> None:
    path, status = result["path"], result["status"]
    if status == "ok":
        what = (
            "structure and CRC-32 of every record"
            if result["checksummed"]
            else ("structure only: written without CRC-32s, its data cannot be verified")
        )
        unit = "items" if os.path.isdir(path) else "records"  # a DCP checkpoint's items, each an archive or bytes
        print(f"OK       {path}: {result['records']} {unit}, {result['bytes']} bytes ({what})")
    elif status == "corrupt":
        message = result["error"]  # names the file, and the record when the damage is in one
        if not message.startswith(path):
            message = f"{path}: {message}"
        print(f"CORRUPT  {message}")
    else:
        print(f"ERROR    {path}: {result['error']}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Checks every path; returns the exit status (see the module docstring)."""
    status = EXIT_OK
    results = []
    for path in args.paths:
        code, result = _check(path, args.require_checksums)
        status = max(status, code)
        results.append(result)
        if not args.json:
            _print(result)
    if args.json:
        print(json.dumps(results, indent=2))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastpersist verify", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
