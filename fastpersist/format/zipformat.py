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
against the file's size before it is used, records may neither overlap nor
share a name, and each local header must agree with its central directory
entry, so a truncated or hostile file raises :class:`CorruptCheckpointError`
instead of allocating, seeking wildly or reading one byte range as two
records. :func:`check_structure` goes further for ``fastpersist verify``: it
checks every byte that no CRC-32 covers (headers, padding, data descriptors,
end records) and that records tile the file without gaps.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from fastpersist.errors import ChecksumMismatchError, CorruptCheckpointError, MissingEndRecordError

__all__ = [
    "PAYLOAD_ALIGNMENT",
    "PACKED_RECORD_LIMIT",
    "PACKED_ALIGNMENT",
    "storage_alignment_claim",
    "is_packed_storage",
    "check_alignment_claim",
    "ZipEntry",
    "ZipLayout",
    "layout_archive",
    "ZipRecordInfo",
    "read_directory",
    "read_rows",
    "RecordTable",
    "check_structure",
    "MissingEndRecordError",
]

PAYLOAD_ALIGNMENT = 4096
"""Storage payloads start at multiples of this many bytes (O_DIRECT's unit here)."""

PACKED_RECORD_LIMIT = 64 << 10
"""Storage records smaller than this are packed: their payloads start at multiples of
PACKED_ALIGNMENT instead of PAYLOAD_ALIGNMENT. Padding a 64-byte tensor to 4 KiB made files
of many small tensors 12x larger than torch.save's, while O_DIRECT buys nothing for them
(readers fetch many small records with one read anyway)."""

PACKED_ALIGNMENT = 64
"""Alignment of packed storage payloads and of metadata records (torch.save's own)."""

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
# Extra fields that zip writers put in local headers: zip64, NTFS times, torch's
# padding, Info-ZIP times and Unix ids, Unicode comment and path, the JAR marker,
# Android's alignment. Anything else in a local header is taken for damage.
_KNOWN_EXTRA_TAGS = frozenset(
    {0x0001, 0x000A, _PAD_TAG, 0x5455, 0x5855, 0x7855, 0x7875, 0x6375, 0x7075, 0xCAFE, 0xD935}
)
_ZIP64_TAG = 0x0001
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_METADATA_ALIGNMENT = PACKED_ALIGNMENT
_DOS_TIME_DATE = (0, 0)  # what torch's writer stores (1980-00-00 00:00)


class ZipEntry(NamedTuple):
    """One record of the archive, placed.

    A named tuple: cheaper to build and read than a dataclass. (The garbage
    collector still tracks named tuples -- it stops tracking only exact tuples
    of untracked values -- so the per-piece tables built from entries, like
    ``SavePlan.segments()``, use plain tuples.)

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
        return _descriptor_size(self.size, self.header_offset)

    def local_header(self) -> bytes:
        """The local header plus its extra fields (CRC and sizes are in the descriptor)."""
        name = self.name.encode("utf-8")
        if self.size < _U32_MAX and self.header_offset < _U32_MAX:  # no zip64 field: cached pieces
            extra_length = self.data_offset - self.header_offset - _LOCAL.size - len(name)
            return _local_header32(len(name), extra_length) + name + _padding_field(extra_length - 4)
        zip64 = _local_zip64_extra(self.size, self.header_offset)
        pad = self.data_offset - self.header_offset - _LOCAL.size - len(name) - len(zip64) - 4
        extra = zip64 + struct.pack("<HH", _PAD_TAG, pad) + b"Z" * pad
        size32 = _U32_MAX if self.size >= _U32_MAX else 0
        header = _LOCAL.pack(
            _SIG_LOCAL,
            _VERSION if self.zip64 else 20,
            _FLAGS,
            0,
            *_DOS_TIME_DATE,
            0,
            size32,
            size32,
            len(name),
            len(extra),
        )
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
            _SIG_CENTRAL,
            version,
            version,
            _FLAGS,
            0,
            *_DOS_TIME_DATE,
            crc,
            size32,
            size32,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            offset32,
        )
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
            _SIG_EOCD,
            0,
            0,
            min(count, _U16_MAX),
            min(count, _U16_MAX),
            min(len(directory), _U32_MAX),
            min(start, _U32_MAX),
            0,
        )
        return directory + eocd64 + locator + eocd

    def trailer_size(self) -> int:
        return self.size - self.central_directory_offset


def _descriptor_size(size: int, header_offset: int) -> int:
    # Like miniz (torch's writer, whose offsets torch's reader may recompute),
    # an empty record gets no data descriptor.
    if size == 0:
        return 0
    return _DESCRIPTOR64.size if size >= _U32_MAX or header_offset >= _U32_MAX else _DESCRIPTOR32.size


@functools.lru_cache(maxsize=4096)
def _local_header32(name_length: int, extra_length: int) -> bytes:
    """The fixed part of a local header of a record below 4 GiB starting below 4 GiB (no zip64 field)."""
    return _LOCAL.pack(_SIG_LOCAL, 20, _FLAGS, 0, *_DOS_TIME_DATE, 0, 0, 0, name_length, extra_length)


@functools.lru_cache(maxsize=8192)
def _padding_field(pad: int) -> bytes:
    """torch's ``FB`` extra field holding ``pad`` bytes of padding."""
    return struct.pack("<HH", _PAD_TAG, pad) + b"Z" * pad


def _local_zip64_extra(size: int, header_offset: int) -> bytes:
    """The zip64 extra field miniz puts in a local header (empty when not needed)."""
    fields = ([size, size] if size >= _U32_MAX else []) + ([header_offset] if header_offset >= _U32_MAX else [])
    if not fields:
        return b""
    return struct.pack(f"<HH{len(fields)}Q", _ZIP64_TAG, 8 * len(fields), *fields)


def _central_size(entry: ZipEntry) -> int:
    fields = (2 if entry.size >= _U32_MAX else 0) + (1 if entry.header_offset >= _U32_MAX else 0)
    return _CENTRAL.size + len(entry.name.encode("utf-8")) + (4 + 8 * fields if fields else 0)


def layout_archive(records: Iterable[tuple[str, int, bool]], alignment: int = PAYLOAD_ALIGNMENT) -> ZipLayout:
    """Places records one after another, padding each payload as torch's writer does.

    Args:
        records: ``(name, size, align)`` in file order; ``align`` puts the
            payload at a multiple of PAYLOAD_ALIGNMENT (storages, so they can
            go through O_DIRECT), otherwise at a multiple of 64 (small
            metadata records, like torch).
        alignment: the storage payload alignment, a multiple of PAYLOAD_ALIGNMENT.

    Returns:
        The layout, with the central directory after the last record.
    """
    if alignment <= 0 or alignment % PAYLOAD_ALIGNMENT:
        raise ValueError(f"storage alignment must be a multiple of {PAYLOAD_ALIGNMENT}, got {alignment}")
    storage_alignment = alignment
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
        step = storage_alignment if align else _METADATA_ALIGNMENT
        data_offset = _padded_data_offset(offset, len(encoded), size, step)
        entries.append(ZipEntry(name, offset, data_offset, size, align))
        offset = data_offset + size + _descriptor_size(size, offset)
    trailer = sum(_central_size(e) for e in entries) + _EOCD64.size + _EOCD64_LOCATOR.size + _EOCD.size
    return ZipLayout(tuple(entries), offset, offset + trailer)


def _padded_data_offset(header_offset: int, name_length: int, size: int, alignment: int) -> int:
    """Where miniz (torch's writer) puts a payload: after the header, the name, zip64 and padding fields."""
    # 4: the padding field's own header. The formula is miniz's getPadding,
    # which torch's reader replays when it computes offsets itself.
    earliest = header_offset + _LOCAL.size + name_length + 4
    if size >= _U32_MAX or header_offset >= _U32_MAX:
        earliest += len(_local_zip64_extra(size, header_offset))
    return -(-earliest // alignment) * alignment


def is_packed_storage(size: int) -> bool:
    """Whether a storage record of ``size`` bytes is packed (PACKED_ALIGNMENT) rather than page-aligned."""
    return size < PACKED_RECORD_LIMIT


def storage_alignment_claim(sizes: Iterable[int], alignment: int = PAYLOAD_ALIGNMENT) -> int | None:
    """The ``.storage_alignment`` a file with storages of these sizes may declare, or None.

    torch's reader, with ``calculate_storage_offsets`` on (or under
    ``TORCH_SERIALIZATION_DEBUG``), recomputes every storage offset from one
    alignment when ``.format_version`` is present. That holds when every
    storage is page-aligned (PAYLOAD_ALIGNMENT) or every one is packed
    (PACKED_ALIGNMENT); a file that mixes them must not claim an alignment, so
    the writer then leaves ``.format_version`` and ``.storage_alignment`` out
    and torch reads each offset from its local header (as for pre-2.5 files).
    """
    packed = {is_packed_storage(size) for size in sizes}
    if packed == {True}:
        return PACKED_ALIGNMENT
    if len(packed) > 1:
        return None
    return alignment


# ---------------------------------------------------------------------------- reading


class ZipRecordInfo(NamedTuple):
    """A record found in an existing archive (a named tuple: see ZipEntry).

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


def _corrupt(path: str | None, message: str, record: str | None = None, kind=CorruptCheckpointError):
    where = f"{path}: " if path else ""
    return kind(f"{where}{message}; the file is truncated, damaged or not a torch checkpoint", path=path, record=record)


_CentralEntry = tuple[str, bytes, int, int, int, int, int, int, int, int]
"""The fields of one central directory entry that a reader or a verifier looks at: ``(name, raw_name,
version_needed, flags, method, time, date, crc, size, header_offset)``. A plain tuple of plain values,
which the garbage collector stops tracking; as objects, the entries of 100,000 small records
brought on an extra full collection per load (docs/performance.md)."""


@dataclasses.dataclass(frozen=True)
class _Directory:
    """The central directory and where the end records are."""

    entries: list[_CentralEntry]
    cd_offset: int
    cd_size: int
    eocd_offset: int
    comment_length: int


def read_directory(read_at: ReadAt, file_size: int, path: str | None = None) -> list[ZipRecordInfo]:
    """Parses the central directory of a (possibly hostile) zip archive.

    Every record's payload lies inside the file, before the central
    directory, and no two records overlap or share a name, so a caller may
    allocate ``record.size`` bytes and read them without further checks.

    Raises:
        MissingEndRecordError: no end record (a truncated file, or not a zip
            archive); a CorruptCheckpointError.
        CorruptCheckpointError: sizes or offsets outside the file,
            overlapping or duplicate records, compressed records, a local
            header that disagrees with the directory, or any other
            inconsistency.
    """
    return [_record(row) for row in read_rows(read_at, file_size, path, check=False)]


def read_rows(read_at: ReadAt, file_size: int, path: str | None = None, *, check: bool) -> list[tuple]:
    """:func:`read_directory` (``check=False``) or :func:`check_structure` (``check=True``), each
    record as a plain ``(name, header_offset, data_offset, size, crc)`` tuple.

    The garbage collector stops tracking plain tuples of strings and ints, not
    named tuples: 20,000 ZipRecordInfo objects alive through a load set off a
    second full collection of the whole process (torch.load sets off one).
    :class:`RecordTable` keeps rows and hands out ZipRecordInfo on demand.
    """
    if check:
        return _checked_rows(read_at, file_size, path)
    directory = _read_central_directory(read_at, file_size, path)
    rows = [_locate(read_at, directory.cd_offset, path, e) for e in directory.entries]
    _check_disjoint(rows, path)
    return rows


def _record(row: tuple) -> ZipRecordInfo:
    """The ZipRecordInfo of a row (without the keyword handling of its constructor)."""
    return tuple.__new__(ZipRecordInfo, row)


class RecordTable(Mapping):
    """An archive's records by name, kept as plain tuples (see :func:`read_rows`).

    Looking a name up returns a ZipRecordInfo made on the spot. Deleting a name
    lets its row go (a load drops each storage's row once the storage is in).
    """

    __slots__ = ("_rows",)

    def __init__(self, rows: Iterable[tuple]):
        self._rows: dict[str, tuple] = {row[0]: row for row in rows}

    def __getitem__(self, name: str) -> ZipRecordInfo:
        return _record(self._rows[name])

    def get(self, name: str, default: Any = None) -> Any:
        row = self._rows.get(name)
        return default if row is None else _record(row)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __delitem__(self, name: str) -> None:
        del self._rows[name]

    def rows(self) -> list[tuple]:
        """Every row, ``(name, header_offset, data_offset, size, crc)``; index access works on records too."""
        return list(self._rows.values())


def check_structure(read_at: ReadAt, file_size: int, path: str | None = None) -> list[ZipRecordInfo]:
    """:func:`read_directory`, plus a check of every byte that no CRC-32 covers.

    Checks that each local header repeats its directory entry (name, flags,
    method, version, time, CRC and sizes where present), that extra fields
    are well formed (torch's ``FB`` padding holds only ``Z`` bytes), that
    each data descriptor repeats the record's CRC-32 and size, and that the
    records, the central directory and the end records follow one another
    with no gap and nothing after the end. Together with the records'
    CRC-32s this covers every byte of the file except informational fields
    that no reader uses (version made by, file attributes, disk numbers,
    comments). It reads only headers, so it is cheap.

    Raises:
        CorruptCheckpointError: with ``record`` naming the damaged record
            when the damage is inside one (for a truncated file: the record
            the file ends in or after, when one can be found).
    """
    return [_record(row) for row in read_rows(read_at, file_size, path, check=True)]


def _checked_rows(read_at: ReadAt, file_size: int, path: str | None) -> list[tuple]:
    try:
        directory = _read_central_directory(read_at, file_size, path)
    except MissingEndRecordError:
        last = _last_local_header(read_at, file_size) if file_size >= _EOCD.size else None
        if last is None:
            raise
        raise _corrupt(
            path,
            f"the file ends at byte {file_size} without its zip end records: it was cut short "
            f"inside or after record {last!r}",
            last,
        ) from None
    rows = [_locate(read_at, directory.cd_offset, path, e) for e in directory.entries]
    _check_disjoint(rows, path)
    expected = 0
    order = sorted(range(len(rows)), key=lambda i: rows[i][1])
    for index in order:
        entry, record = directory.entries[index], _record(rows[index])
        if record.header_offset != expected:
            raise _corrupt(
                path,
                f"{record.header_offset - expected:+d} unexplained bytes before record "
                f"{record.name!r} at offset {expected}",
                record.name,
            )
        expected, crc = _check_framing(read_at, entry, record, directory.cd_offset, path)
        if crc != record.crc:  # the central directory's CRC is 0, the local record holds one: verify that
            rows[index] = rows[index][:4] + (crc,)
    if expected != directory.cd_offset:
        raise _corrupt(path, f"{directory.cd_offset - expected} unexplained bytes before the central directory")
    _check_end_records(read_at, file_size, directory, path)
    return rows


def _read_central_directory(read_at: ReadAt, file_size: int, path: str | None) -> _Directory:
    if file_size < _EOCD.size:
        raise _corrupt(path, f"file is {file_size} bytes, too small for a zip archive", kind=MissingEndRecordError)
    tail_length = min(file_size, _EOCD.size + _U16_MAX)
    tail = read_at(file_size - tail_length, tail_length)
    if len(tail) != tail_length:
        raise _corrupt(path, "the file shrank while being read")
    position = tail.rfind(struct.pack("<I", _SIG_EOCD))
    while position >= 0 and position + _EOCD.size > len(tail):
        position = tail.rfind(struct.pack("<I", _SIG_EOCD), 0, position)
    if position < 0:
        raise _corrupt(path, "no zip end-of-central-directory record", kind=MissingEndRecordError)
    eocd_offset = file_size - tail_length + position
    _, disk, _, _, count, cd_size, cd_offset, comment_length = _EOCD.unpack_from(tail, position)
    if disk != 0:
        raise _corrupt(path, "multi-disk zip archives are not supported")
    if count == _U16_MAX or cd_size == _U32_MAX or cd_offset == _U32_MAX:
        locator_offset = eocd_offset - _EOCD64_LOCATOR.size
        if locator_offset < 0:
            raise _corrupt(path, "zip64 archive without its end-record locator")
        locator = read_at(locator_offset, _EOCD64_LOCATOR.size)
        if len(locator) != _EOCD64_LOCATOR.size:
            raise _corrupt(path, "zip64 end-record locator is cut short")
        signature, _, eocd64_offset, _ = _EOCD64_LOCATOR.unpack(locator)
        if signature != _SIG_EOCD64_LOCATOR or eocd64_offset + _EOCD64.size > locator_offset:
            raise _corrupt(path, "bad zip64 end-record locator")
        record = read_at(eocd64_offset, _EOCD64.size)
        if len(record) != _EOCD64.size:
            raise _corrupt(path, "zip64 end record is cut short")
        fields = _EOCD64.unpack(record)
        if fields[0] != _SIG_EOCD64:
            raise _corrupt(path, "bad zip64 end record")
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
        directory_end = eocd64_offset
    else:
        directory_end = eocd_offset
    # Bounds first, so that a hostile count or size never turns into an allocation.
    if cd_offset + cd_size > directory_end or cd_size < count * _CENTRAL.size:
        raise _corrupt(path, f"central directory ({count} records, {cd_size} bytes at {cd_offset}) does not fit")
    directory = read_at(cd_offset, cd_size)
    if len(directory) != cd_size:
        raise _corrupt(path, "central directory is cut short")
    entries = []
    names = set()
    position = 0
    for _ in range(count):
        if position + _CENTRAL.size > cd_size:
            raise _corrupt(path, "central directory ends inside a record")
        fields = _CENTRAL.unpack_from(directory, position)
        (
            signature,
            _,
            version_needed,
            flags,
            method,
            time,
            date,
            crc,
            csize,
            usize,
            name_len,
            extra_len,
            comment_len,
            _,
            _,
            _,
            header_offset,
        ) = fields
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
            raise _corrupt(
                path, f"record {name!r} is compressed (method {method}); torch checkpoints store records", name
            )
        if flags & 0x1:
            raise _corrupt(path, f"record {name!r} is encrypted", name)
        # Two entries with one name would let a damaged directory swap data for a
        # record silently (the last one would win in a dict by name).
        if name in names:
            raise _corrupt(path, f"record {name!r} appears twice in the central directory", name)
        names.add(name)
        entries.append((name, raw_name, version_needed, flags, method, time, date, crc, usize, header_offset))
        position = end
    return _Directory(entries, cd_offset, cd_size, eocd_offset, comment_length)


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


def _locate(read_at: ReadAt, cd_offset: int, path, entry: _CentralEntry) -> tuple:
    """The record's row, ``(name, header_offset, data_offset, size, crc)``, once its local header agrees."""
    name, raw_name, _, _, _, _, _, crc, size, header_offset = entry
    header_length = _LOCAL.size + len(raw_name)
    if header_offset + header_length > cd_offset:
        raise _corrupt(path, f"record {name!r} has its header outside the data area", name)
    header = read_at(header_offset, header_length)
    if len(header) != header_length:
        raise _corrupt(path, f"record {name!r} header is cut short", name)
    fields = _LOCAL.unpack_from(header)
    if fields[0] != _SIG_LOCAL:
        raise _corrupt(path, f"record {name!r} has a bad local header signature", name)
    # The payload offset comes from the local header, so the local header must be
    # this record's: a damaged offset could otherwise point at another record.
    if fields[9] != len(raw_name) or header[_LOCAL.size :] != raw_name:
        local = header[_LOCAL.size : _LOCAL.size + fields[9]]
        raise _corrupt(path, f"record {name!r} has a local header named {local!r}", name)
    if fields[3] != 0:
        raise _corrupt(path, f"record {name!r} is compressed (method {fields[3]}) in its local header", name)
    data_offset = header_offset + _LOCAL.size + fields[9] + fields[10]
    if data_offset + size > cd_offset:
        raise _corrupt(path, f"record {name!r} ({size} bytes at {data_offset}) runs past the data area", name)
    return (name, header_offset, data_offset, size, crc)


def _check_disjoint(rows: list[tuple], path) -> None:
    """Rejects records whose byte ranges overlap (a damaged offset, or a zip bomb)."""
    ordered = sorted(rows, key=lambda r: (r[1], r[2] + r[3]))
    for before, after in zip(ordered, ordered[1:]):
        if before[2] + before[3] > after[1]:
            raise _corrupt(path, f"records {before[0]!r} and {after[0]!r} overlap", after[0])


def _check_framing(
    read_at: ReadAt, entry: _CentralEntry, record: ZipRecordInfo, cd_offset: int, path
) -> tuple[int, int]:
    """Checks a record's local header, extra fields and data descriptor.

    Returns where the record ends and the CRC-32 to verify it against: the
    central directory's, or, where that is 0 ("not computed", or zeroed), the
    one the local header or data descriptor holds.
    """
    # Few temporary objects per record: a verified load of 100,000 small tensors runs this for each.
    _, raw_name, central_version, central_flags, central_method, central_time, central_date, central_crc, size, _ = (
        entry
    )
    header = read_at(record.header_offset, record.data_offset - record.header_offset)
    # A record framed exactly as fastpersist's writer frames it (below 4 GiB, a checksum in the
    # directory) is checked by comparing its header and descriptor with the bytes the writer
    # would have written: what _check_framing_fields would accept, at a third of its cost.
    # Anything else, damage included, takes those field-by-field checks, which say what is wrong.
    if (
        central_version == 20
        and central_flags == _FLAGS
        and central_method == 0
        and central_crc
        and (central_time, central_date) == _DOS_TIME_DATE
        and 0 < size < _U32_MAX
        and record.header_offset < _U32_MAX
    ):
        extra_length = len(header) - _LOCAL.size - len(raw_name)
        end = record.data_offset + size
        if (
            extra_length >= 4
            and header == _local_header32(len(raw_name), extra_length) + raw_name + _padding_field(extra_length - 4)
            and read_at(end, _DESCRIPTOR32.size) == _DESCRIPTOR32.pack(_SIG_DESCRIPTOR, central_crc, size, size)
        ):
            return end + _DESCRIPTOR32.size, central_crc
    return _check_framing_fields(read_at, entry, record, header, cd_offset, path)


def _check_framing_fields(
    read_at: ReadAt, entry: _CentralEntry, record: ZipRecordInfo, header: bytes, cd_offset: int, path
) -> tuple[int, int]:
    """:func:`_check_framing` field by field (``header``: the local header read), for records framed otherwise
    than fastpersist's writer frames them (torch's, other writers', damaged ones): each check says what is wrong.

    Returns what :func:`_check_framing` returns.
    """
    name = record.name
    _, _, central_version, central_flags, central_method, central_time, central_date, central_crc, size, _ = entry
    if len(header) != record.data_offset - record.header_offset:
        raise _corrupt(path, f"record {name!r} header is cut short", name)
    (_, version_needed, flags, method, time, date, crc, csize, usize, name_len, extra_len) = _LOCAL.unpack_from(header)
    # Writers that need zip64 only for the offset (past 4 GiB) mark just the central
    # entry as version 4.5; the local header keeps 1.0 or 2.0.
    version_ok = version_needed == central_version or (central_version == 45 and version_needed in (10, 20))
    if (
        not version_ok
        or flags != central_flags
        or method != central_method
        or time != central_time
        or date != central_date
    ):
        raise _corrupt(
            path,
            f"record {name!r}: its local header disagrees with the central directory (version, flags, method or time)",
            name,
        )
    extra = header[_LOCAL.size + name_len :]
    zip64_values: list[int] | None = None
    position = 0
    while position < len(extra):
        if position + 4 > len(extra):
            raise _corrupt(path, f"record {name!r} has a truncated extra field in its local header", name)
        tag, length = _EXTRA_HEADER.unpack_from(extra, position)
        body = extra[position + 4 : position + 4 + length]
        if len(body) != length:
            raise _corrupt(path, f"record {name!r} has a truncated extra field in its local header", name)
        if tag not in _KNOWN_EXTRA_TAGS:  # a damaged tag would hide its field from these checks
            raise _corrupt(path, f"record {name!r} has an unknown extra field {tag:#06x} in its local header", name)
        if tag == _PAD_TAG and body.strip(b"Z"):
            raise _corrupt(path, f"record {name!r} has damaged padding in its local header", name)
        if tag == _ZIP64_TAG:
            zip64_values = list(struct.unpack_from(f"<{length // 8}Q", body))
        position += 4 + length
    size_u, size_c = usize, csize
    if usize == _U32_MAX or csize == _U32_MAX:  # zip64: the real sizes are in the extra field, in this order
        values = zip64_values or []
        if usize == _U32_MAX:
            size_u = values.pop(0) if values else -1
        if csize == _U32_MAX:
            size_c = values.pop(0) if values else -1
    streamed = flags & 0x8
    # With a data descriptor (bit 3) writers leave CRC and sizes 0 here (torch), or fill them in anyway.
    crc_ok = crc == central_crc or (streamed and crc == 0) or central_crc == 0
    sizes_ok = (size_u == size and size_c == size) or (streamed and size_u == 0 and size_c == 0)
    if not (crc_ok and sizes_ok):
        raise _corrupt(
            path, f"record {name!r}: its local header's CRC-32 or size disagrees with the central directory", name
        )
    effective = central_crc or crc
    end = record.data_offset + record.size
    if not streamed:
        return end, effective
    # The descriptor's sizes take 8 bytes when the local header has a zip64 field. Its
    # signature is optional in the zip specification; torch and fastpersist write it.
    has_zip64 = usize == _U32_MAX or csize == _U32_MAX or zip64_values is not None
    available = read_at(end, min(_DESCRIPTOR64.size, max(cd_offset - end, 0)))
    has_signature = available[:4] == _DESCRIPTOR_SIGNATURE
    if record.size == 0 and not has_signature:
        return end, effective  # torch's writer gives empty records no descriptor
    found = None
    for layout in (_DESCRIPTOR64, _DESCRIPTOR32) if has_zip64 else (_DESCRIPTOR32, _DESCRIPTOR64):
        if not has_signature:
            layout = _UNSIGNED_DESCRIPTORS[layout.format]
        if len(available) >= layout.size:
            values = layout.unpack_from(available)  # ([signature,] crc, compressed size, size)
            # A central CRC of 0 means "not computed": fastpersist's writer with checksum=False
            # still puts the real CRC-32 of metadata records in their descriptors.
            descriptor_crc = values[-3]
            if values[-2] == record.size == values[-1] and (descriptor_crc == central_crc or central_crc == 0):
                return end + layout.size, effective or descriptor_crc
            found = found or values[1 if has_signature else 0 :]
    if found is None:
        raise _corrupt(path, f"record {name!r} has its data descriptor cut short", name)
    raise _corrupt(
        path,
        f"record {name!r}: its data descriptor disagrees with the central directory "
        f"(CRC-32 {found[0]:#010x}, size {found[2]})",
        name,
    )


_EXTRA_HEADER = struct.Struct("<HH")
_DESCRIPTOR_SIGNATURE = struct.pack("<I", _SIG_DESCRIPTOR)
_UNSIGNED_DESCRIPTORS = {  # the same, without the (optional) signature
    layout.format: struct.Struct("<" + layout.format[2:]) for layout in (_DESCRIPTOR32, _DESCRIPTOR64)
}


def _check_end_records(read_at: ReadAt, file_size: int, directory: _Directory, path) -> None:
    """The zip64 end record and locator (when present) and the end record follow the directory exactly."""
    expected = directory.cd_offset + directory.cd_size
    eocd = read_at(directory.eocd_offset, _EOCD.size)
    fields = _EOCD.unpack(eocd)
    count = len(directory.entries)
    locator_offset = directory.eocd_offset - _EOCD64_LOCATOR.size
    locator = read_at(locator_offset, _EOCD64_LOCATOR.size) if locator_offset >= expected else b""
    if len(locator) == _EOCD64_LOCATOR.size and locator[:4] == struct.pack("<I", _SIG_EOCD64_LOCATOR):
        eocd64_offset = _EOCD64_LOCATOR.unpack(locator)[2]
        record = read_at(eocd64_offset, _EOCD64.size) if eocd64_offset == expected else b""
        if len(record) != _EOCD64.size:
            raise _corrupt(path, "the zip64 end record is not right after the central directory")
        z = _EOCD64.unpack(record)
        if z[0] != _SIG_EOCD64 or eocd64_offset + 12 + z[1] != locator_offset:
            raise _corrupt(path, "bad zip64 end record")
        if (z[6], z[7], z[8], z[9]) != (count, count, directory.cd_size, directory.cd_offset):
            raise _corrupt(path, "the zip64 end record disagrees with the central directory")
        expected = locator_offset + _EOCD64_LOCATOR.size
        zip64 = True
    else:
        zip64 = False
    if directory.eocd_offset != expected:
        raise _corrupt(path, f"{directory.eocd_offset - expected} unexplained bytes before the end record")
    classic = (fields[3], fields[4], fields[5], fields[6])
    wanted = (count, count, directory.cd_size, directory.cd_offset)
    limits = (_U16_MAX, _U16_MAX, _U32_MAX, _U32_MAX)
    for value, true, limit in zip(classic, wanted, limits):
        # Values too large for the classic field are saturated; with a zip64 end
        # record present, some writers saturate them anyway.
        if value != min(true, limit) and not (zip64 and value == limit):
            raise _corrupt(path, "the end record disagrees with the central directory")
    if directory.eocd_offset + _EOCD.size + directory.comment_length > file_size:
        raise _corrupt(path, "the end record's comment runs past the end of the file")
    # Bytes after the end record (and its comment) are not part of the archive: torch.load
    # ignores them (appended data, a padded copy), and so do we.


def _last_local_header(read_at: ReadAt, file_size: int, window: int = 16 << 20) -> str | None:
    """The name in the last plausible local header of a file that lost its end (a truncated file)."""
    signature = struct.pack("<I", _SIG_LOCAL)
    end = file_size
    while end > 0:
        start = max(0, end - window)
        chunk = read_at(start, end - start + _LOCAL.size + 1024)
        position = chunk.rfind(signature, 0, end - start)
        while position >= 0:
            if position + _LOCAL.size <= len(chunk):
                fields = _LOCAL.unpack_from(chunk, position)
                raw = chunk[position + _LOCAL.size : position + _LOCAL.size + fields[9]]
                if fields[3] == 0 and 0 < fields[9] == len(raw) and b"/" in raw:
                    try:
                        return raw.decode("utf-8")
                    except UnicodeDecodeError:
                        pass
            position = chunk.rfind(signature, 0, position)
        end = start
    return None


def check_record_crc(record: ZipRecordInfo, crc: int, path: str | None) -> None:
    """Raises ChecksumMismatchError, naming the record, unless ``crc`` is the CRC-32 the archive stores for it."""
    # A stored CRC of 0 for a non-empty record means "not computed": torch.save under
    # skip_data() or with set_crc32_options(False) writes 0 (its data may even be holes).
    if crc != record.crc and not (record.crc == 0 and record.size):
        raise ChecksumMismatchError(
            f"{path or 'checkpoint'}: record {record.name!r} is corrupt: its CRC-32 is {crc:#010x}, "
            f"the archive says {record.crc:#010x}. Restore the checkpoint from a good copy",
            path=path,
            record=record.name,
        )


def check_alignment_claim(records: Sequence[ZipRecordInfo], read_at: ReadAt, path: str | None = None) -> int | None:
    """Checks that torch can recompute every storage offset from the alignment the file declares.

    When ``.format_version`` is present, torch's reader may skip the local
    headers and derive each storage's offset from the previous one and
    ``.storage_alignment`` (default 64): storages must then follow one another
    in key order, each padded as miniz pads to that alignment. A file that
    declares an alignment its records do not have reads back as garbage under
    ``calculate_storage_offsets``; this finds that without torch.

    Args:
        records: the archive's records (from :func:`check_structure`).
        read_at: reads the small ``.format_version`` / ``.storage_alignment`` records.

    Returns:
        The declared alignment, or None when the file declares none.

    Raises:
        CorruptCheckpointError: naming the first storage record whose offset
            disagrees with the declared alignment.
    """
    by_name = {r.name: r for r in records}
    prefix = next(
        (r.name[: -len("data.pkl")] for r in records if r.name.endswith("/data.pkl") and r.name.count("/") == 1), None
    )
    if prefix is None or prefix + ".format_version" not in by_name:
        return None
    version_record = by_name[prefix + ".format_version"]
    if read_at(version_record.data_offset, version_record.size) < b"1":
        return None
    alignment = 64
    if prefix + ".storage_alignment" in by_name:
        record = by_name[prefix + ".storage_alignment"]
        text = read_at(record.data_offset, min(record.size, 32))
        if not text.isdigit() or int(text) <= 0:
            raise _corrupt(path, f"bad .storage_alignment record {text[:32]!r}", record.name)
        alignment = int(text)
    storage_prefix = prefix + "data/"
    storages = sorted(
        (r for r in records if r.name.startswith(storage_prefix) and r.name[len(storage_prefix) :].isdigit()),
        key=lambda r: int(r.name[len(storage_prefix) :]),
    )
    cursor = None
    for record in storages:
        header = record.header_offset if cursor is None else cursor
        expected = _padded_data_offset(header, len(record.name.encode("utf-8")), record.size, alignment)
        if record.header_offset != header or record.data_offset != expected:
            raise _corrupt(
                path,
                f"record {record.name!r} is not where the declared storage alignment ({alignment}) puts it "
                "(torch.load with calculate_storage_offsets would read wrong bytes)",
                record.name,
            )
        cursor = record.data_offset + record.size
        if record.size:
            zip64 = record.size >= _U32_MAX or record.header_offset >= _U32_MAX
            cursor += _DESCRIPTOR64.size if zip64 else _DESCRIPTOR32.size
    return alignment
