"""Reading a zip checkpoint's records and checking them: structure, then every record's CRC-32.

One check serves every verifier (:func:`verify_records`): ``fastpersist.verify``
of a file, of a file object, of a sharded checkpoint's parts, and of the bytes
a collective load assembled. It reads through a ``read_at(offset, length)``
callable (or a caller's faster ``crc_of(record)``), so it does not care where
the bytes are. Loads read single records with :func:`record_bytes` and the zip
directory's small pieces through :class:`HeaderCache`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable

from fastpersist.errors import CorruptCheckpointError
from fastpersist.format.zipformat import ZipRecordInfo, check_record_crc, check_structure
from fastpersist.io import engine

__all__ = ["VerifyReport", "HeaderCache", "has_checksums", "record_bytes", "check_crc", "verify_records"]

ReadAt = Callable[[int, int], bytes]


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What ``fastpersist.verify`` checked.

    Attributes:
        path: the checkpoint (or the manifest of a sharded one).
        records: records (zip entries, or safetensors tensors) checked.
        bytes: payload bytes read and checksummed.
        checksummed: False when the file carries no CRC-32s (only its
            structure could be checked).
    """

    path: str
    records: int
    bytes: int
    checksummed: bool


def has_checksums(records: Iterable[ZipRecordInfo]) -> bool:
    """False for files written without CRC-32s (every non-empty record's CRC is 0)."""
    return any(r.crc != 0 for r in records if r.size)


def check_crc(path: str | None, record: ZipRecordInfo, data) -> None:
    """Raises ChecksumMismatchError, naming the record, unless ``data`` has the record's CRC-32."""
    crc = engine.crc32_of(data)
    if crc != record.crc:
        check_record_crc(record, crc, path)


def record_bytes(read_at: ReadAt, record: ZipRecordInfo, path: str | None, verify: bool) -> bytes:
    """A record's payload (checked against its CRC-32 when ``verify``).

    Raises:
        CorruptCheckpointError: the file ends inside the record.
        ChecksumMismatchError: (``verify``) the bytes do not match the CRC-32.
    """
    data = read_at(record.data_offset, record.size)
    if len(data) != record.size:
        raise CorruptCheckpointError(f"{path}: record {record.name!r} is cut short", path=path, record=record.name)
    if verify:
        check_crc(path, record, data)
    return data


def _crc_by_reading(read_at: ReadAt, path: str | None, chunk_size: int) -> Callable[[ZipRecordInfo], int]:
    def crc_of(record: ZipRecordInfo) -> int:
        crc = 0
        for position in range(0, record.size, chunk_size):
            piece = read_at(record.data_offset + position, min(chunk_size, record.size - position))
            if not piece:
                raise CorruptCheckpointError(
                    f"{path or '<file object>'}: record {record.name!r} is cut short", path=path, record=record.name
                )
            crc = engine.crc32_of(piece, crc)
        return crc

    return crc_of


def verify_records(
    read_at: ReadAt,
    size: int,
    path: str | None,
    *,
    crc_of: Callable[[ZipRecordInfo], int] | None = None,
    chunk_size: int = 16 << 20,
) -> tuple[list[ZipRecordInfo], int, bool]:
    """Checks a zip checkpoint of ``size`` bytes: its structure, then every record's CRC-32.

    The structure check covers every byte no CRC-32 covers (local headers,
    padding, data descriptors, central directory, end records, no gaps and
    nothing after the end); then each record's payload is checksummed, in
    file order, and compared with the central directory's CRC-32. A file
    without CRC-32s (``checksum=False``, torch's ``compute_crc32=False``) gets
    the structure check only (its payloads are not read).

    Args:
        read_at: reads ``length`` bytes at ``offset`` (fewer only at the end).
        size: the file's size.
        path: for messages.
        crc_of: the CRC-32 of a record's payload (default: read through
            ``read_at`` in ``chunk_size`` pieces); lets a caller use a faster
            reader.

    Returns:
        ``(records, payload bytes, checksummed)``.

    Raises:
        CorruptCheckpointError: truncated, malformed, or not a zip checkpoint.
        ChecksumMismatchError: a record's bytes do not match its CRC-32
            (``record`` names it).
    """
    records = check_structure(read_at, size, path)
    checksummed = has_checksums(records)
    total = sum(record.size for record in records)
    if not checksummed:
        return records, total, False  # nothing to compare the payloads with
    crc_of = crc_of or _crc_by_reading(read_at, path, chunk_size)
    for record in sorted(records, key=lambda r: r.data_offset):
        crc = crc_of(record)
        if crc != record.crc:
            check_record_crc(record, crc, path)
    return records, total, True


class HeaderCache:
    """``read_at`` for the zip parser that serves small reads from one cached 64 KiB window.

    Checking the structure reads every local header and data descriptor: with
    packed records they sit next to each other, and one pread per header was
    60,000 system calls for a file of 20,000 small tensors. The window stays
    small so that the headers of large records do not drag megabytes of
    payload through the page cache.
    """

    _WINDOW = 64 << 10

    def __init__(self, fd: int, size: int):
        self._fd = fd
        self._size = size
        self._start = 0
        self._data = b""

    def __call__(self, offset: int, length: int) -> bytes:
        if length > self._WINDOW // 4:
            return os.pread(self._fd, length, offset)
        if not (self._start <= offset and offset + length <= self._start + len(self._data)):
            self._start = offset
            self._data = os.pread(self._fd, min(self._WINDOW, max(length, self._size - offset)), offset)
        position = offset - self._start
        return self._data[position : position + length]
