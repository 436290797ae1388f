"""The torch zip container: layout of a file to write, and parsing of a file to read.

A torch checkpoint is a zip archive of stored (uncompressed) records. This
module writes it the way torch's own writer does (local headers with the
data-descriptor flag and an ``FB`` padding extra field, a data descriptor
after each payload, a central directory, zip64 end records), except that
payloads start at 4 KiB-aligned offsets so they can go through O_DIRECT.

The layout is computed before a single byte is written: every header and
payload offset is known up front, and only the CRC-32 values (in the data
descriptors and the central directory) are filled in once the payloads have
streamed past. That is what lets one sequential pass write the file, and any
contiguous byte range be written by a process of its own.

Parsing is defensive: every size and offset read from a file is checked
against the file's size before it is used, so a truncated or hostile file
raises :class:`CorruptCheckpointError` instead of allocating or seeking
wildly.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Callable, Iterable, Sequence

from fastpersist.errors import CorruptCheckpointError

__all__ = [
    "PAYLOAD_ALIGNMENT",
    "ZipEntry",
    "ZipLayout",
    "layout_archive",
    "ZipRecordInfo",
    "read_directory",
]

PAYLOAD_ALIGNMENT = 4096
"""Storage payloads start at multiples of this many bytes (O_DIRECT's unit here)."""

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_DESCRIPTOR32 = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_EOCD64_LOCATOR = struct.Struct("<IIQI")

_SIG_LOCAL = 0x04034B50
_SIG_CENTRAL = 0x02014B50
_SIG_DESCRIPTOR = 0x08074B50
_SIG_EOCD = 0x06054B50
_SIG_EOCD64 = 0x06064B50
_SIG_EOCD64_LOCATOR = 0x07064B50

_FLAGS = 0x0808  # bit 3: sizes and CRC follow in a data descriptor; bit 11: UTF-8 names
_VERSION = 45  # zip64
_PAD_TAG = 0x4246  # "FB", the padding extra field torch's writer uses
_ZIP64_TAG = 0x0001
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_METADATA_ALIGNMENT = 64
_DOS_TIME_DATE = (0, 0)  # what torch's writer stores (1980-00-00 00:00)


@dataclasses.dataclass(frozen=True)
class ZipEntry:
    """One record of the archive, placed.

    Attributes:
        name: full name inside the archive (``<archive>/data/0``).
        header_offset: where its local header starts.
        data_offset: where its payload starts.
        size: payload bytes.
        aligned: whether the payload start was aligned to PAYLOAD_ALIGNMENT.
    """

    name: str
    header_offset: int
    data_offset: int
    size: int
    aligned: bool

    @property
    def data_end(self) -> int:
        return self.data_offset + self.size

    @property
    def zip64(self) -> bool:
        return self.size >= _U32_MAX or self.header_offset >= _U32_MAX

    @property
    def descriptor_offset(self) -> int:
        return self.data_end

    @property
    def descriptor_size(self) -> int:
        # Like miniz (torch's writer, whose offsets torch's reader may recompute),
        # an empty record gets no data descriptor.
        if self.size == 0:
            return 0
        return _DESCRIPTOR64.size if self.zip64 else _DESCRIPTOR32.size

    def local_header(self) -> bytes:
        """The local header plus its extra fields (CRC and sizes are in the descriptor)."""
        name = self.name.encode("utf-8")
        zip64 = _local_zip64_extra(self.size, self.header_offset)
        pad = self.data_offset - self.header_offset - _LOCAL.size - len(name) - len(zip64) - 4
        extra = zip64 + struct.pack("<HH", _PAD_TAG, pad) + b"Z" * pad
        size32 = _U32_MAX if self.size >= _U32_MAX else 0
        header = _LOCAL.pack(
            _SIG_LOCAL, _VERSION if self.zip64 else 20, _FLAGS, 0, *_DOS_TIME_DATE, 0, size32, size32,
            len(name), len(extra),
        )  # fmt: skip
        return header + name + extra

    def data_descriptor(self, crc: int) -> bytes:
        if self.zip64:
            return _DESCRIPTOR64.pack(_SIG_DESCRIPTOR, crc, self.size, self.size)
        return _DESCRIPTOR32.pack(_SIG_DESCRIPTOR, crc, self.size, self.size)

    def central_header(self, crc: int) -> bytes:
        name = self.name.encode("utf-8")
        zip64_fields = []
        size32 = self.size
        offset32 = self.header_offset
        if self.size >= _U32_MAX:
            zip64_fields += [self.size, self.size]
            size32 = _U32_MAX
        if self.header_offset >= _U32_MAX:
            zip64_fields.append(self.header_offset)
            offset32 = _U32_MAX
        extra = b""
        if zip64_fields:
            extra = struct.pack(f"<HH{len(zip64_fields)}Q", _ZIP64_TAG, 8 * len(zip64_fields), *zip64_fields)
        version = _VERSION if zip64_fields else 20
        header = _CENTRAL.pack(
            _SIG_CENTRAL, version, version, _FLAGS, 0, *_DOS_TIME_DATE, crc, size32, size32,
            len(name), len(extra), 0, 0, 0, 0, offset32,
        )  # fmt: skip
        return header + name + extra


@dataclasses.dataclass(frozen=True)
class ZipLayout:
    """Where every byte of an archive goes. Pure data: nothing here does I/O.

    Attributes:
        entries: the records in file order.
        central_directory_offset: where the central directory starts.
        size: the total file size.
    """

    entries: tuple[ZipEntry, ...]
    central_directory_offset: int
    size: int

    def trailer(self, crcs: Sequence[int]) -> bytes:
        """Central directory and end records, given every entry's CRC-32 (in entry order)."""
        if len(crcs) != len(self.entries):
            raise ValueError(f"need {len(self.entries)} CRC values, got {len(crcs)}")
        directory = b"".join(e.central_header(c) for e, c in zip(self.entries, crcs))
        start = self.central_directory_offset
        count = len(self.entries)
        eocd64_offset = start + len(directory)
        eocd64 = _EOCD64.pack(
            _SIG_EOCD64, _EOCD64.size - 12, _VERSION, _VERSION, 0, 0, count, count, len(directory), start
        )
        locator = _EOCD64_LOCATOR.pack(_SIG_EOCD64_LOCATOR, 0, eocd64_offset, 1)
        eocd = _EOCD.pack(
            _SIG_EOCD, 0, 0, min(count, _U16_MAX), min(count, _U16_MAX),
            min(len(directory), _U32_MAX), min(start, _U32_MAX), 0,
        )  # fmt: skip
        return directory + eocd64 + locator + eocd

    def trailer_size(self) -> int:
        return self.size - self.central_directory_offset


def _local_zip64_extra(size: int, header_offset: int) -> bytes:
    """The zip64 extra field miniz puts in a local header (empty when not needed)."""
    fields = ([size, size] if size >= _U32_MAX else []) + ([header_offset] if header_offset >= _U32_MAX else [])
    if not fields:
        return b""
    return struct.pack(f"<HH{len(fields)}Q", _ZIP64_TAG, 8 * len(fields), *fields)


def _central_size(entry: ZipEntry) -> int:
    fields = (2 if entry.size >= _U32_MAX else 0) + (1 if entry.header_offset >= _U32_MAX else 0)
    return _CENTRAL.size + len(entry.name.encode("utf-8")) + (4 + 8 * fields if fields else 0)


def layout_archive(records: Iterable[tuple[str, int, bool]]) -> ZipLayout:
    """Places records one after another, padding each payload as torch's writer does.

    Args:
        records: ``(name, size, align)`` in file order; ``align`` puts the
            payload at a multiple of PAYLOAD_ALIGNMENT (storages, so they can
            go through O_DIRECT), otherwise at a multiple of 64 (small
            metadata records, like torch).

    Returns:
        The layout, with the central directory after the last record.
    """
    entries = []
    offset = 0
    for name, size, align in records:
        encoded = name.encode("utf-8")
        if len(encoded) > _U16_MAX:
            raise ValueError(f"record name too long for a zip archive: {name[:80]!r}...")
        if size < 0:
            raise ValueError(f"record {name!r} has a negative size")
        # 4: the padding field's own header. The formula is miniz's getPadding,
        # which torch's reader replays when it computes offsets itself.
        earliest = offset + _LOCAL.size + len(encoded) + len(_local_zip64_extra(size, offset)) + 4
        alignment = PAYLOAD_ALIGNMENT if align else _METADATA_ALIGNMENT
        data_offset = -(-earliest // alignment) * alignment
        entry = ZipEntry(name, offset, data_offset, size, align)
        entries.append(entry)
        offset = entry.data_end + entry.descriptor_size
    trailer = sum(_central_size(e) for e in entries) + _EOCD64.size + _EOCD64_LOCATOR.size + _EOCD.size
    return ZipLayout(tuple(entries), offset, offset + trailer)


# ---------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class ZipRecordInfo:
    """A record found in an existing archive.

    Attributes:
        name: full name inside the archive.
        header_offset: local header position.
        data_offset: payload position (read from the local header).
        size: payload bytes.
        crc: the CRC-32 stored in the central directory (0 may mean "not computed").
    """

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int


ReadAt = Callable[[int, int], bytes]
"""``read_at(offset, length) -> bytes``: reads exactly ``length`` bytes or fewer at EOF."""


def _corrupt(path: str | None, message: str, record: str | None = None) -> CorruptCheckpointError:
    where = f"{path}: " if path else ""
    return CorruptCheckpointError(
        f"{where}{message}; the file is truncated, damaged or not a torch checkpoint", path=path, record=record
    )


def read_directory(read_at: ReadAt, file_size: int, path: str | None = None) -> list[ZipRecordInfo]:
    """Parses the central directory of a (possibly hostile) zip archive.

    Raises:
        CorruptCheckpointError: no end record, sizes or offsets outside the
            file, compressed records, or any other inconsistency.
    """
    if file_size < _EOCD.size:
        raise _corrupt(path, f"file is {file_size} bytes, too small for a zip archive")
    tail_length = min(file_size, _EOCD.size + _U16_MAX)
    tail = read_at(file_size - tail_length, tail_length)
    position = tail.rfind(struct.pack("<I", _SIG_EOCD))
    while position >= 0 and position + _EOCD.size > len(tail):
        position = tail.rfind(struct.pack("<I", _SIG_EOCD), 0, position)
    if position < 0:
        raise _corrupt(path, "no zip end-of-central-directory record")
    eocd_offset = file_size - tail_length + position
    _, disk, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, position)
    if disk != 0:
        raise _corrupt(path, "multi-disk zip archives are not supported")
    if count == _U16_MAX or cd_size == _U32_MAX or cd_offset == _U32_MAX:
        locator_offset = eocd_offset - _EOCD64_LOCATOR.size
        if locator_offset < 0:
            raise _corrupt(path, "zip64 archive without its end-record locator")
        signature, _, eocd64_offset, _ = _EOCD64_LOCATOR.unpack(read_at(locator_offset, _EOCD64_LOCATOR.size))
        if signature != _SIG_EOCD64_LOCATOR or eocd64_offset + _EOCD64.size > locator_offset:
            raise _corrupt(path, "bad zip64 end-record locator")
        fields = _EOCD64.unpack(read_at(eocd64_offset, _EOCD64.size))
        if fields[0] != _SIG_EOCD64:
            raise _corrupt(path, "bad zip64 end record")
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
        directory_end = eocd64_offset
    else:
        directory_end = eocd_offset
    if cd_offset + cd_size > directory_end or cd_size < count * _CENTRAL.size:
        raise _corrupt(path, f"central directory ({count} records, {cd_size} bytes at {cd_offset}) does not fit")
    directory = read_at(cd_offset, cd_size)
    if len(directory) != cd_size:
        raise _corrupt(path, "central directory is cut short")
    records = []
    position = 0
    for _ in range(count):
        if position + _CENTRAL.size > cd_size:
            raise _corrupt(path, "central directory ends inside a record")
        fields = _CENTRAL.unpack_from(directory, position)
        (signature, _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len, comment_len, _, _, _,
         header_offset) = fields  # fmt: skip
        if signature != _SIG_CENTRAL:
            raise _corrupt(path, "bad central directory record signature")
        end = position + _CENTRAL.size + name_len + extra_len + comment_len
        if end > cd_size:
            raise _corrupt(path, "central directory record runs past the directory")
        raw_name = directory[position + _CENTRAL.size : position + _CENTRAL.size + name_len]
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
        extra = directory[position + _CENTRAL.size + name_len : position + _CENTRAL.size + name_len + extra_len]
        usize, csize, header_offset = _apply_zip64_extra(extra, usize, csize, header_offset, path, name)
        if method != 0 or csize != usize:
            raise _corrupt(path, f"record {name!r} is compressed (method {method}); torch checkpoints store records")
        if flags & 0x1:
            raise _corrupt(path, f"record {name!r} is encrypted")
        records.append((name, header_offset, usize, crc))
        position = end
    return [_locate(read_at, file_size, cd_offset, path, *r) for r in records]


def _apply_zip64_extra(extra: bytes, usize: int, csize: int, offset: int, path, name) -> tuple[int, int, int]:
    position = 0
    while position + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4 : position + 4 + length]
        if len(body) != length:
            raise _corrupt(path, f"record {name!r} has a truncated extra field", name)
        if tag == _ZIP64_TAG:
            values = list(struct.unpack_from(f"<{length // 8}Q", body))
            try:
                if usize == _U32_MAX:
                    usize = values.pop(0)
                if csize == _U32_MAX:
                    csize = values.pop(0)
                if offset == _U32_MAX:
                    offset = values.pop(0)
            except IndexError:
                raise _corrupt(path, f"record {name!r} has a short zip64 extra field", name) from None
        position += 4 + length
    return usize, csize, offset


def _locate(read_at: ReadAt, file_size: int, cd_offset: int, path, name, header_offset, size, crc) -> ZipRecordInfo:
    if header_offset + _LOCAL.size > cd_offset:
        raise _corrupt(path, f"record {name!r} has its header outside the file", name)
    header = read_at(header_offset, _LOCAL.size)
    if len(header) != _LOCAL.size:
        raise _corrupt(path, f"record {name!r} header is cut short", name)
    fields = _LOCAL.unpack(header)
    if fields[0] != _SIG_LOCAL:
        raise _corrupt(path, f"record {name!r} has a bad local header signature", name)
    data_offset = header_offset + _LOCAL.size + fields[9] + fields[10]
    if data_offset + size > cd_offset:
        raise _corrupt(path, f"record {name!r} ({size} bytes at {data_offset}) runs past the data area", name)
    return ZipRecordInfo(name, header_offset, data_offset, size, crc)
