"""``verify`` of a sharded checkpoint (a manifest and its parts): the same checks as for one file.

The parts are read through :class:`~fastpersist.distributed.load.PartsSource`
as the ordinary file they stand for: the structure check covers every
header, padding, data descriptor and end record; then every record's CRC-32
is recomputed (records that span parts included) and compared with the
central directory's.
"""

from __future__ import annotations

import os

from fastpersist.distributed.load import PartsSource
from fastpersist.distributed.manifest import read_manifest
from fastpersist.io.records import VerifyReport, verify_records

__all__ = ["verify_sharded"]


def verify_sharded(path: str, chunk_size: int = 16 << 20) -> VerifyReport:
    """Checks a sharded checkpoint: its parts as the ordinary file they stand for (structure, every CRC-32)."""
    manifest = read_manifest(path)
    with PartsSource(manifest, os.path.dirname(os.path.abspath(path))) as source:
        records, total, checksummed = verify_records(source.read_at, source.size, path, chunk_size=chunk_size)
    return VerifyReport(path, len(records), total, checksummed)
