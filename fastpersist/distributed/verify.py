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
from fastpersist.format.zipformat import check_record_crc, check_structure
from fastpersist.io import engine

__all__ = ["verify_sharded"]


def verify_sharded(path: str, chunk_size: int = 16 << 20):
    """Checks a sharded checkpoint; returns a :class:`fastpersist.api.verification.VerifyReport`."""
    from fastpersist.api.verification import VerifyReport, has_checksums

    manifest = read_manifest(path)
    with PartsSource(manifest, os.path.dirname(os.path.abspath(path))) as source:
        records = check_structure(source.read_at, source.size, path)
        checksummed = has_checksums(records)
        total = 0
        for record in sorted(records, key=lambda r: r.data_offset):
            crc = 0
            for position in range(0, record.size, chunk_size):
                piece = source.read_at(record.data_offset + position, min(chunk_size, record.size - position))
                crc = engine.crc32_of(piece, crc)
            total += record.size
            if checksummed and crc != record.crc:
                check_record_crc(record, crc, path)
    return VerifyReport(path, len(records), total, checksummed)
