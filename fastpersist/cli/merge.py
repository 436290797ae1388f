"""``fastpersist merge MANIFEST OUT``: turns a sharded checkpoint (manifest + parts) into one ordinary file.

``MANIFEST`` is the path a ``layout="parts"`` save was given (the manifest
written there by rank 0); its parts are looked up beside it, or given with
``--part FILE`` (repeatable; the part index is read from the file name). The
output is an ordinary torch zip checkpoint that ``torch.load`` reads, written
atomically (temporary file, fsync, verified: structure and every CRC-32, then
rename and directory fsync): a damaged set leaves nothing at ``OUT``.

Exit status: 0 merged and verified, 1 the parts are damaged or do not match
the manifest, 2 a usage error or an unreadable/missing file.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

__all__ = ["HELP", "add_arguments", "run", "main", "merge"]

HELP = "merge a sharded checkpoint's parts (layout='parts') into one ordinary checkpoint file"

_INDEX = re.compile(r"\.part-(\d+)-of-\d+$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="MANIFEST", help="the sharded checkpoint's path (its manifest)")
    parser.add_argument("output", metavar="OUT", help="the ordinary checkpoint file to write")
    parser.add_argument(
        "--part",
        action="append",
        default=[],
        metavar="FILE",
        help="a part file that is not beside the manifest (repeatable)",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the CRC-32 check of the merged file")


def merge(manifest_path: str, output: str, parts: list[str] = (), verify: bool = True, chunk_size: int = 16 << 20):
    """Writes the ordinary checkpoint a sharded one stands for; returns the VerifyReport (or None)."""
    from fastpersist.distributed.load import PartsSource
    from fastpersist.distributed.manifest import read_manifest
    from fastpersist.distributed.save import _temporary_name
    from fastpersist.io import commit

    manifest = read_manifest(manifest_path)
    extra = {}
    for part in parts:
        match = _INDEX.search(part)
        if not match:
            raise ValueError(f"{part}: not a part file name (expected ...part-K-of-N)")
        extra[int(match.group(1))] = part
    destination = commit.target(output)
    target, directory = destination.path, destination.directory
    with PartsSource(manifest, os.path.dirname(os.path.abspath(manifest_path)), extra) as source:
        temporary = _temporary_name(target, directory)
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                for position in range(0, source.size, chunk_size):
                    data = memoryview(source.read_at(position, min(chunk_size, source.size - position)))
                    while data:
                        count = os.pwrite(descriptor, data, position)
                        data, position = data[count:], position + count
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            report = None
            if verify:  # before the rename: a damaged set never replaces anything at OUT
                from fastpersist.api.verification import verify as verify_file

                report = verify_file(temporary)
            commit.copy_metadata(target, temporary)
            commit.replace_file(temporary, target, directory)
        except BaseException:
            commit.discard_temporary(temporary)
            raise
    commit.fsync_directory(directory)
    return report


def run(args: argparse.Namespace) -> int:
    from fastpersist.distributed.manifest import is_manifest
    from fastpersist.errors import CorruptCheckpointError

    if os.path.isfile(args.manifest) and not is_manifest(args.manifest):
        from fastpersist.api.dispatch import is_safetensors_file, is_torch_zip_file

        if is_torch_zip_file(args.manifest) or is_safetensors_file(args.manifest):
            print(
                f"ERROR    {args.manifest} is already a single checkpoint, not the manifest of a sharded one "
                "(layout='parts'): there is nothing to merge; load or copy it as it is",
                file=sys.stderr,
            )
            return 2
    try:
        report = merge(args.manifest, args.output, args.part, verify=not args.no_verify)
    except CorruptCheckpointError as e:
        print(f"CORRUPT  {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"ERROR    {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    what = f"{report.records} records, {report.bytes} bytes, verified" if report else "not verified"
    print(f"OK       {args.output}: merged from {args.manifest} ({what})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastpersist merge", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
