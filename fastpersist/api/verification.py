"""``verify``: check a whole checkpoint's structure and CRC-32s without unpickling it.

A checkpoint is a file (torch zip or safetensors), the manifest of a sharded
one (``layout="parts"``), or a DCP checkpoint directory. Every zip archive
among them goes through the one verifier, :func:`fastpersist.io.records.verify_records`.
"""

from __future__ import annotations

import errno
import os
import warnings
from typing import Any, BinaryIO

from fastpersist.errors import ChecksumMismatchError, CorruptCheckpointError, TruncatedCheckpointError
from fastpersist.format.dcp import extension_of, is_metadata_name, read_metadata
from fastpersist.format.deserializer import archive_prefix
from fastpersist.format.names import check_file_name
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

    ``path`` may also be the manifest of a sharded checkpoint
    (``layout="parts"``): its parts are checked as the file they stand for.
    Or a DCP checkpoint directory (``.metadata`` and ``.distcp`` files): see
    :func:`_verify_dcp_directory`; ``report.records`` counts its items.

    Raises:
        CorruptCheckpointError: truncated, malformed, or not a zip checkpoint
            (``record`` names the damaged record when there is one);
            (``UnsafeFileNameError``) a manifest or ``.metadata`` names a file
            that is not a plain name in the checkpoint's directory.
        ChecksumMismatchError: a record's bytes do not match its CRC-32
            (the exception's ``record`` names it; for a DCP item, its name).
        IsADirectoryError: a directory that holds no DCP checkpoint (no ``.metadata``).
        OSError: the file cannot be read (FileNotFoundError, PermissionError, ...).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return _verify_dcp_directory(path, chunk_size)
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


def _verify_dcp_directory(directory: str, chunk_size: int) -> VerifyReport:
    """A DCP checkpoint directory: every item listed by its ``.metadata`` (or ``__{rank}.metadata`` files).

    The metadata is unpickled without running code from it
    (:func:`fastpersist.format.dcp.read_metadata`); each item's data file must
    be a plain name in the directory. An item that is a zip archive (every
    tensor item, and the ``BYTE_IO`` items of DCP's default planner, from
    ``FastPersistWriter`` and ``FileSystemWriter`` alike) is checked by
    :func:`~fastpersist.io.records.verify_records` over its byte range:
    structure and every record's CRC-32; where ``FastPersistWriter``'s
    extension is there, the archive's payload must also be where it says,
    with its CRC-32. Other items are checked against the extension's CRC-32.
    Items with nothing to check them by (raw bytes of another writer, items
    written through DCP's stream transforms, ``checksum=False``) make
    ``checksummed`` False.
    """
    names = sorted(name for name in os.listdir(directory) if is_metadata_name(name))
    if not names:
        raise IsADirectoryError(
            errno.EISDIR,
            "a directory without a DCP checkpoint's .metadata (a DCP save that did not finish leaves none); verify "
            "checks checkpoint files, sharded-checkpoint manifests and DCP checkpoint directories",
            directory,
        )
    items = total = 0
    checksummed = True
    for name in names:
        where = os.path.join(directory, name)
        with open(where, "rb") as handle:
            metadata = read_metadata(handle.read(), where)
        by_file: dict[str, list[tuple[str, Any]]] = {}
        for index, info in metadata.storage_data.items():
            item = str(getattr(index, "fqn", index))
            file = check_file_name(
                getattr(info, "relative_path", None), checkpoint=directory, what=f"the data file of item {item!r}"
            )
            by_file.setdefault(file, []).append((item, info))
        for file, entries in sorted(by_file.items()):
            with open(os.path.join(directory, file), "rb") as handle:
                for item, info in entries:
                    try:
                        count, checked = _verify_dcp_item(handle.fileno(), handle.name, item, info, chunk_size)
                    except (TypeError, KeyError, ValueError) as e:  # fields of other types than a save writes
                        raise CorruptCheckpointError(
                            f"{where}: the entry of item {item!r} is malformed ({type(e).__name__}: {e})",
                            path=where,
                            record=item,
                        ) from None
                    items, total, checksummed = items + 1, total + count, checksummed and checked
    return VerifyReport(directory, items, total, checksummed)


def _verify_dcp_item(descriptor: int, path: str, item: str, info: Any, chunk_size: int) -> tuple[int, bool]:
    """Checks one DCP item of the data file ``path``; returns (payload bytes checksummed, whether checksummed)."""
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
        raise CorruptCheckpointError(f"{path}: item {item!r} has no valid byte range in the metadata", path=path)
    where = f"{path}: item {item!r} (bytes {offset}-{offset + length})"
    size = os.fstat(descriptor).st_size
    if offset + length > size:
        raise TruncatedCheckpointError(
            f"{where} ends past the file's {size} bytes: the file is truncated; restore it from a good copy",
            path=path,
            record=item,
        )
    if getattr(info, "transform_descriptors", None):
        return 0, False  # compressed or otherwise transformed by DCP: its own reader decodes it, nothing to check here
    extension = extension_of(info)

    def read_at(position: int, count: int) -> bytes:
        return os.pread(descriptor, max(0, min(count, length - position)), offset + position)

    if read_at(0, 4) == b"PK\x03\x04":
        try:
            records, count, _ = verify_records(read_at, length, where, chunk_size=chunk_size)
        except CorruptCheckpointError as e:  # the same error, naming the item rather than its archive's record
            raise type(e)(str(e), path=path, record=item) from None
        if extension is not None and extension["kind"] == "tensor":
            payload = next((r for r in records if offset + r.data_offset == extension["offset"]), None)
            crc = extension["crc32"]
            if payload is None or payload.size != extension["nbytes"] or (crc is not None and crc != payload.crc):
                raise CorruptCheckpointError(
                    f"{where}: the tensor's archive does not hold the payload the checkpoint's metadata describes "
                    f"(offset {extension['offset']}, {extension['nbytes']} bytes, CRC-32 {crc}); the metadata or "
                    "the file is damaged: restore the checkpoint from a good copy",
                    path=path,
                    record=item,
                )
        return count, all(r.crc for r in records if r.size)  # a CRC of 0: not computed (checksum=False)
    if extension is None or extension["crc32"] is None:
        return 0, False  # raw bytes that no CRC-32 covers
    start, count = extension["offset"] - offset, extension["nbytes"]
    crc = 0
    for position in range(start, start + count, chunk_size):
        crc = engine.crc32_of(read_at(position, min(chunk_size, start + count - position)), crc)
    if crc != extension["crc32"]:
        raise ChecksumMismatchError(
            f"{where} is corrupt: its CRC-32 is {crc:#010x}, the checkpoint's metadata says "
            f"{extension['crc32']:#010x}. Restore the checkpoint from a good copy",
            path=path,
            record=item,
        )
    return count, True


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
