"""``verify``: check a whole checkpoint's structure and CRC-32s without unpickling it."""

from __future__ import annotations

import os
import warnings
from typing import BinaryIO

from fastpersist.errors import CorruptCheckpointError
from fastpersist.format.deserializer import archive_prefix
from fastpersist.format.safetensors import header_length, looks_like_safetensors, parse_header
from fastpersist.format.zipformat import ZipRecordInfo, check_alignment_claim
from fastpersist.io import engine
from fastpersist.io.records import VerifyReport, verify_records

__all__ = ["verify", "VerifyReport", "verify_file_object"]


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
        buffer = engine.AlignedBuffer(max(min(chunk_size, size), 1), lock=False, huge_pages=False)
        records, total, checksummed = verify_records(
            read_at, size, path, crc_of=lambda record: _crc_of_range(descriptor, record, buffer, path)
        )
        archive_prefix([r.name for r in records], path)
        # After the CRCs, so that damaged bytes are reported as such first. A wrong claim
        # leaves every byte intact (archives rewritten by other zip tools have one), but
        # torch.load with calculate_storage_offsets would read wrong bytes: a warning.
        try:
            check_alignment_claim(records, read_at, path)
        except CorruptCheckpointError as e:
            warnings.warn(
                str(e).replace("; the file is truncated, damaged or not a torch checkpoint", "")
                + "; plain torch.load and fastpersist.load read it correctly",
                RuntimeWarning,
                stacklevel=2,
            )
    return VerifyReport(path, len(records), total, checksummed)


def _crc_of_range(descriptor: int, record: ZipRecordInfo, buffer, path: str | None) -> int:
    """CRC-32 of a record's payload, read through one reused buffer (no fresh pages per chunk)."""
    crc = 0
    view = memoryview(buffer)
    position, end = record.data_offset, record.data_offset + record.size
    while position < end:
        count = os.preadv(descriptor, [view[: min(len(view), end - position)]], position)
        if count <= 0:
            raise CorruptCheckpointError(f"{path}: record {record.name!r} is cut short", path=path, record=record.name)
        crc = engine.crc32(buffer.ptr, count, crc)  # the native CRC-32: zlib's, about twice as fast
        position += count
    return crc


def verify_file_object(f: BinaryIO) -> None:
    """Structure and every CRC-32 of the checkpoint in a seekable file object (its position is kept)."""
    start = f.tell()
    f.seek(0, os.SEEK_END)
    size = f.tell() - start

    def read_at(offset: int, length: int) -> bytes:
        f.seek(start + offset)
        return f.read(length)

    try:
        _, _, checksummed = verify_records(read_at, size, None)
        if not checksummed:
            warnings.warn(
                "the file object holds a checkpoint without CRC-32 checksums; it cannot be verified", stacklevel=4
            )
    finally:
        f.seek(start)
