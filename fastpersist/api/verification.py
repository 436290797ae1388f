"""``verify``: check a whole checkpoint's structure and CRC-32s without unpickling it."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import BinaryIO

from fastpersist.errors import CorruptCheckpointError
from fastpersist.format.deserializer import archive_prefix
from fastpersist.format.safetensors import header_length, looks_like_safetensors, parse_header
from fastpersist.format.zipformat import ZipRecordInfo, check_alignment_claim, check_record_crc, check_structure
from fastpersist.io import engine

__all__ = ["verify", "VerifyReport", "has_checksums", "verify_file_object"]


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked."""

    path: str
    records: int
    bytes: int
    checksummed: bool


def verify(path: str | os.PathLike[str], *, chunk_size: int = 16 << 20) -> VerifyReport:
    """Checks a whole checkpoint without unpickling it: structure, then every record's CRC-32.

    The structure check covers every byte that no CRC-32 covers (local
    headers, padding, data descriptors, central directory, end records, no
    gaps and nothing after the end); then every record is read and its CRC-32
    compared with the central directory's. Files written without checksums
    (``checksum=False``, torch's ``compute_crc32=False``) get the structure
    check only: ``report.checksummed`` is False then. So do safetensors files
    (which have no checksums): their header, offsets and size are checked.

    Raises:
        CorruptCheckpointError: truncated, malformed, or not a zip checkpoint
            (``record`` names the damaged record when there is one).
        ChecksumMismatchError: a record's bytes do not match its CRC-32
            (the exception's ``record`` names it).
        OSError: the file cannot be read (IsADirectoryError, FileNotFoundError, ...).

    ``path`` may also be the manifest of a sharded checkpoint
    (``layout="parts"``): its parts are checked as the file they stand for.
    """
    path = os.fspath(path)
    from fastpersist.distributed.manifest import is_manifest

    if os.path.isfile(path) and is_manifest(path):  # a sharded checkpoint (layout="parts"): check its parts
        from fastpersist.distributed.verify import verify_sharded

        return verify_sharded(path, chunk_size=chunk_size)
    with open(path, "rb") as handle:
        descriptor = handle.fileno()
        size = os.fstat(descriptor).st_size

        def read_at(offset: int, length: int) -> bytes:
            return os.pread(descriptor, length, offset)

        if looks_like_safetensors(read_at(0, 9)):
            # No checksums in the format: its header, offsets and size are what can be checked.
            header = parse_header(read_at(0, 8 + header_length(read_at(0, 8), size, path)), size, path)
            return VerifyReport(path, len(header.tensors), size - header.data_offset, checksummed=False)
        records = check_structure(read_at, size, path)
        archive_prefix([r.name for r in records], path)
        checksummed = has_checksums(records)
        total = 0
        buffer = engine.AlignedBuffer(max(min(chunk_size, max((r.size for r in records), default=0)), 1),
                                      lock=False, huge_pages=False)  # fmt: skip
        for record in sorted(records, key=lambda r: r.data_offset):
            crc = _crc_of_range(descriptor, record, buffer, path)
            total += record.size
            if checksummed and crc != record.crc:
                check_record_crc(record, crc, path)
        # After the CRCs, so that damaged bytes are reported as such first. A wrong claim
        # leaves every byte intact (archives rewritten by other zip tools have one), but
        # torch.load with calculate_storage_offsets would read wrong bytes: a warning.
        try:
            check_alignment_claim(records, read_at, path)
        except CorruptCheckpointError as e:
            warnings.warn(str(e).replace("; the file is truncated, damaged or not a torch checkpoint", "")
                          + "; plain torch.load and fastpersist.load read it correctly", RuntimeWarning,
                          stacklevel=2)  # fmt: skip
    return VerifyReport(path, len(records), total, checksummed)


def has_checksums(records) -> bool:
    """False for files written without CRC-32s (every non-empty record's CRC is 0)."""
    return any(r.crc != 0 for r in records if r.size)


def _crc_of_range(descriptor: int, record: ZipRecordInfo, buffer, path: str | None) -> int:
    """CRC-32 of a record's payload, read through one reused buffer (no fresh pages per chunk)."""
    crc = 0
    view = memoryview(buffer)
    position, end = record.data_offset, record.data_offset + record.size
    while position < end:
        count = os.preadv(descriptor, [view[: min(len(view), end - position)]], position)
        if count <= 0:
            raise CorruptCheckpointError(f"{path}: record {record.name!r} is cut short", path=path,
                                         record=record.name)  # fmt: skip
        crc = engine.crc32(buffer.ptr, count, crc)  # the native CRC-32: zlib's, about twice as fast
        position += count
    return crc


def verify_file_object(f: BinaryIO) -> None:
    start = f.tell()
    f.seek(0, os.SEEK_END)
    size = f.tell() - start

    def read_at(offset: int, length: int) -> bytes:
        f.seek(start + offset)
        return f.read(length)

    try:
        records = check_structure(read_at, size, None)
        if not has_checksums(records):
            warnings.warn("the file object holds a checkpoint without CRC-32 checksums; it cannot be verified",
                          stacklevel=4)  # fmt: skip
            return
        for record in records:
            crc = 0
            for position in range(0, record.size, 16 << 20):
                piece = read_at(record.data_offset + position, min(16 << 20, record.size - position))
                if not piece:
                    raise CorruptCheckpointError(f"<file object>: record {record.name!r} is cut short",
                                                 record=record.name)  # fmt: skip
                crc = engine.crc32_of(piece, crc)
            if crc != record.crc:
                check_record_crc(record, crc, "<file object>")
    finally:
        f.seek(start)

