"""``save`` and ``load``: drop-in replacements for ``torch.save`` and ``torch.load``."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import glob
import os
import pickle
import secrets
import threading
import warnings
import zlib
from typing import Any, BinaryIO, Callable

import torch

from fastpersist import config
from fastpersist.errors import CorruptCheckpointError, FastPersistError
from fastpersist.format.deserializer import archive_prefix, deserialize
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.format.zipformat import (
    MissingEndRecordError,
    ZipRecordInfo,
    check_record_crc,
    check_structure,
    read_directory,
)
from fastpersist.io import engine
from fastpersist.io.reader import FileStorageProvider, MmapStorageProvider
from fastpersist.io.stream import write_plan_to_stream
from fastpersist.io.writer import side_streams, write_plan

__all__ = ["save", "load", "async_save", "SaveFuture", "verify", "VerifyReport"]

_SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(config.Settings))
_TEMP_MARK = ".fastpersist-"


def _split_settings(function: str, kwargs: dict[str, Any], allow_other: bool) -> tuple[dict, dict]:
    settings = {k: v for k, v in kwargs.items() if k in _SETTING_NAMES}
    other = {k: v for k, v in kwargs.items() if k not in _SETTING_NAMES}
    if other and not allow_other:
        name = next(iter(other))
        raise TypeError(
            f"{function}() got an unexpected keyword argument {name!r}; "
            f"fastpersist settings are: {', '.join(sorted(_SETTING_NAMES))}"
        )
    return settings, other


# ------------------------------------------------------------------------------ save


def save(
    obj: object,
    f: str | os.PathLike[str] | BinaryIO,
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
    **settings: Any,
) -> None:
    """Saves ``obj`` like ``torch.save``, as fast as the storage allows.

    The file is a standard torch zip checkpoint that ``torch.load`` reads,
    with storage payloads at 4 KiB-aligned offsets and CRC-32 checksums.

    Saving to a path is atomic: the bytes go to a temporary file beside the
    target, which is fsynced and renamed over the target, and the directory is
    fsynced; the old file stays intact until the new one is complete. When
    ``save`` returns the checkpoint is durable (unless ``fsync=False``).

    Do not modify the tensors in ``obj`` until ``save`` returns.

    Args:
        obj: what to save (anything ``torch.save`` accepts).
        f: a path, or a writable binary file object (slower path: the bytes
            are streamed through its ``write`` method).
        pickle_module, pickle_protocol, _use_new_zipfile_serialization,
            _disable_byteorder_record: as ``torch.save``.
        **settings: per-call overrides of any ``fastpersist.config`` setting
            (``buffer_size``, ``engine``, ``fsync``, ``checksum``, ...).

    Raises:
        UnsupportedObjectError: ``obj`` cannot be pickled (nothing is written).
        IsADirectoryError, FileNotFoundError, PermissionError: the target
            path is a directory, its directory is missing, or not writable
            (``OSError`` with ``errno.EROFS`` on a read-only filesystem).
        OSError: an I/O error (ENOSPC, EIO, ...), with ``errno`` and
            ``filename`` set; the previous file at the target is untouched and
            no temporary file is left behind.
        TypeError: an unknown keyword argument.
        ConfigError: an invalid setting value.
    """
    overrides, _ = _split_settings("save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if not _use_new_zipfile_serialization:
        # The legacy (pre-1.6) format has no aligned records; torch writes it.
        torch.save(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization=False)
        return
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        directory = _check_target(_resolve_target(path))
        plan = plan_save(obj, archive_name_for(path), pickle_module, pickle_protocol, _disable_byteorder_record)
        path = _resolve_target(path)
        _write_to_path(plan, path, directory, resolved, streams=None)
    else:
        plan = plan_save(obj, archive_name_for(None), pickle_module, pickle_protocol, _disable_byteorder_record)
        write_plan_to_stream(plan, f, checksum=resolved.checksum, chunk_size=resolved.buffer_size)
        if callable(getattr(f, "flush", None)):
            f.flush()
        if resolved.fsync:
            _fsync_file_object(f)


def _fsync_file_object(f: Any) -> None:
    try:
        descriptor = f.fileno()
    except (AttributeError, OSError, ValueError):
        return  # BytesIO and friends: nothing to make durable
    os.fsync(descriptor)


def _resolve_target(path: str) -> str:
    """The file a save to ``path`` must replace.

    torch.save writes through a symbolic link into the file it points to; the
    atomic rename must do the same instead of replacing the link itself.
    """
    return os.path.realpath(path) if os.path.islink(path) else path


def _check_target(path: str) -> str:
    """The target's directory; raises the error torch.save's open() would, with advice."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "cannot save a checkpoint over a directory; pass a file path", path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            errno.ENOENT, "the directory to save into does not exist; create it first (os.makedirs)", directory
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:  # root gets here too: access() checks the mount
            raise OSError(errno.EROFS, "the filesystem is mounted read-only; save to another filesystem", directory)
        raise PermissionError(errno.EACCES, "no permission to create files in this directory", directory)
    return directory


def temporary_path_pattern(path: str) -> str:
    """The glob that matches the temporary files a save to ``path`` may leave after a crash."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(glob.escape(directory), f".{glob.escape(name)}{_TEMP_MARK}*.tmp")


def _remove_stale_temporaries(path: str) -> None:
    """Removes temporaries of earlier saves to ``path`` whose process is gone (killed mid-save)."""
    for candidate in glob.glob(temporary_path_pattern(path)):
        try:
            pid = int(os.path.basename(candidate)[len(os.path.basename(path)) + 1 + len(_TEMP_MARK) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and _process_alive(pid):
            continue  # another process may be saving to the same path right now
        try:
            os.unlink(candidate)
        except FileNotFoundError:
            pass


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` can still be writing: a zombie (killed, not yet reaped) cannot."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _write_to_path(plan, path: str, directory: str, settings: config.Settings, streams) -> None:
    """Writes ``plan`` to a temporary file beside ``path``, makes it durable, renames it over ``path``."""
    _remove_stale_temporaries(path)
    name = os.path.basename(path)
    temporary = os.path.join(directory, f".{name}{_TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}.tmp")
    file = engine.File(temporary, "w", direct=settings.direct, truncate=True)
    try:
        try:
            if file.direct:
                # Reserving the blocks first makes O_DIRECT writes cheaper here and fails a full
                # disk before any byte is written. On tmpfs (buffered) it would only zero-fill
                # every page before the copy overwrites it.
                file.allocate(0, plan.size)
            write_plan(plan, file, settings, streams=streams)
            if settings.fsync:
                file.fsync()
        finally:
            file.close()
        _copy_mode(path, temporary)
        os.replace(temporary, path)
    except BaseException as e:
        try:
            os.unlink(temporary)
        except OSError:
            pass  # never mask the error being raised
        if isinstance(e, OSError) and e.filename == temporary:
            e.add_note(f"while saving {path!r}: the previous file there is untouched and the temporary file is removed")
        raise
    if settings.fsync:
        _fsync_directory(directory)


def _copy_mode(existing: str, temporary: str) -> None:
    """Keeps the permission bits of a file being replaced, as writing it in place would."""
    try:
        mode = os.stat(existing).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(temporary, mode)


def _fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ------------------------------------------------------------------------------ async save


class SaveFuture:
    """The pending result of :func:`async_save`."""

    def __init__(self, future: concurrent.futures.Future, path: str):
        self._future = future
        self.path = path

    def result(self, timeout: float | None = None) -> None:
        """Blocks until the checkpoint is durable at ``path``; raises the save's error.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            OSError, UnsupportedObjectError, ...: whatever the save raised.
        """
        return self._future.result(timeout)

    wait = result

    def done(self) -> bool:
        """True once the save finished (successfully or not)."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveFuture {self.path!r} {state}>"


_executor_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _background() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            # One worker: background saves run one after another, so host memory stays
            # one ring, and a later save of the same path lands after an earlier one.
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fastpersist-save")
        return _executor


def async_save(
    obj: object,
    f: str | os.PathLike[str],
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    **settings: Any,
) -> SaveFuture:
    """Starts saving ``obj`` to the path ``f`` in the background and returns at once.

    The object is pickled before this returns (so pickling errors raise
    here); the tensor bytes are written by a background thread, through the
    same pinned ring as :func:`save`, with no extra copy of the checkpoint in
    host memory. Background saves run one at a time, in call order.

    The tensors in ``obj`` must not be modified until the returned future is
    done: for training, call ``future.result()`` before the next optimizer
    step (the forward and backward passes may run meanwhile).

    Raises:
        UnsupportedObjectError, IsADirectoryError, FileNotFoundError,
        PermissionError, TypeError, ConfigError: at once, as :func:`save`.
    """
    overrides, _ = _split_settings("async_save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"async_save needs a file path, got {type(f).__name__}; use save() for file objects")
    path = os.fspath(f)
    directory = _check_target(_resolve_target(path))
    plan = plan_save(obj, archive_name_for(path), pickle_module, pickle_protocol)
    path = _resolve_target(path)
    # The copies must come after the work queued so far on the caller's streams,
    # which the background thread cannot see: order them here.
    streams = side_streams(plan)
    future = _background().submit(_write_to_path, plan, path, directory, resolved, streams)
    return SaveFuture(future, path)


# ------------------------------------------------------------------------------ verify


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
    check only: ``report.checksummed`` is False then.

    Raises:
        CorruptCheckpointError: truncated, malformed, or not a zip checkpoint
            (``record`` names the damaged record when there is one).
        ChecksumMismatchError: a record's bytes do not match its CRC-32
            (the exception's ``record`` names it).
        OSError: the file cannot be read (IsADirectoryError, FileNotFoundError, ...).
    """
    path = os.fspath(path)
    with open(path, "rb") as handle:
        descriptor = handle.fileno()
        size = os.fstat(descriptor).st_size

        def read_at(offset: int, length: int) -> bytes:
            return os.pread(descriptor, length, offset)

        records = check_structure(read_at, size, path)
        archive_prefix([r.name for r in records], path)
        checksummed = _has_checksums(records)
        total = 0
        buffer = engine.AlignedBuffer(max(min(chunk_size, max((r.size for r in records), default=0)), 1),
                                      lock=False, huge_pages=False)  # fmt: skip
        for record in sorted(records, key=lambda r: r.data_offset):
            crc = _crc_of_range(descriptor, record, buffer, path)
            total += record.size
            if checksummed and crc != record.crc:
                check_record_crc(record, crc, path)
    return VerifyReport(path, len(records), total, checksummed)


def _has_checksums(records) -> bool:
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


# ------------------------------------------------------------------------------ load


def _resolve_weights_only(weights_only: bool | None, pickle_module: Any) -> bool:
    """torch.load's rules: default True, the TORCH_FORCE_*WEIGHTS_ONLY_LOAD variables."""
    from torch.serialization import _default_to_weights_only

    explicit = weights_only is not None
    if weights_only is None:
        weights_only = _default_to_weights_only(pickle_module)
    truthy = ("1", "y", "yes", "true")
    force = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in truthy
    force_not = os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in truthy
    if force and force_not:
        raise RuntimeError(
            "Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` should be set, but both were set."
        )
    if force:
        return True
    if force_not and not explicit:
        return False
    if weights_only and pickle_module is not None:
        raise RuntimeError(
            "Can not safely load weights when explicit pickle_module is specified (as torch.load says)"
        )
    return bool(weights_only)


def load(
    f: str | os.PathLike[str] | BinaryIO,
    map_location: Any = None,
    pickle_module: Any = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    verify: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Loads a checkpoint like ``torch.load``, reading storages in parallel with O_DIRECT.

    Reads any torch.save zip file (any alignment) as well as fastpersist's.
    CPU tensors land in page-aligned memory that becomes their storage; CUDA
    targets are streamed through page-locked buffers straight to the device.

    Args:
        f: a path, or a readable binary file object (handled by torch.load).
        map_location: as torch.load (str, torch.device, dict or callable).
        pickle_module: as torch.load (only with ``weights_only=False``).
        weights_only: as torch.load (default True: torch's safe unpickler).
        mmap: as torch.load: map the file instead of reading it.
        verify: check every record's CRC-32 before returning. Default: the
            ``verify`` setting (on) for paths loaded without mmap; files
            written without checksums are then loaded unverified, silently
            (with a warning when ``verify=True`` is passed explicitly).
        **kwargs: ``fastpersist.config`` setting overrides; anything else is
            passed to the unpickler, as torch.load's ``pickle_load_args``.

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: as open().
        CorruptCheckpointError: truncated, damaged or non-checkpoint file.
        ChecksumMismatchError: (verify) a record's bytes do not match its CRC-32.
        pickle.UnpicklingError: weights_only refused an object (torch's message).
    """
    overrides, pickle_load_args = _split_settings("load", kwargs, allow_other=True)
    resolved = config.resolve(overrides)
    # The default (the ``verify`` setting) applies to paths read in full; file objects
    # and mmap loads are verified only when asked, since that means reading them twice.
    explicit = verify is not None
    if verify is None:
        verify = resolved.verify and not mmap
    weights_only = _resolve_weights_only(weights_only, pickle_module)
    if mmap is None:
        from torch.utils.serialization import config as torch_config

        mmap = torch_config.load.mmap
    if pickle_load_args and weights_only:
        warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=2)
        pickle_load_args = {}
    torch_kwargs = dict(weights_only=weights_only, mmap=mmap, **pickle_load_args)
    if pickle_module is not None:
        torch_kwargs["pickle_module"] = pickle_module
    if not isinstance(f, (str, os.PathLike)):
        if verify and explicit:
            _verify_file_object(f)
        return torch.load(f, map_location, **torch_kwargs)
    path = os.fspath(f)
    if torch._guards.detect_fake_mode(None) is not None:
        return torch.load(path, map_location, **torch_kwargs)
    return _load_from_path(path, map_location, pickle_module, weights_only, mmap, verify, resolved, torch_kwargs,
                           pickle_load_args, warn_unverifiable=explicit)  # fmt: skip


def _open_records(file, path: str, verify: bool) -> tuple[dict[str, ZipRecordInfo], Callable[[int, int], bytes]]:
    size = file.size()

    def read_at(offset: int, length: int) -> bytes:
        return os.pread(file.fd, length, offset)

    # Verifying also checks the bytes no CRC covers (headers, descriptors, end records).
    parse = check_structure if verify else read_directory
    return {r.name: r for r in parse(read_at, size, path)}, read_at


class TruncatedCheckpointError(CorruptCheckpointError, EOFError):
    """A file that ends too early; still an EOFError, which torch.load raised for it."""


_LEGACY_MAGIC = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"  # pickled 0x1950a86a20f9469cfc6c, torch's legacy mark


def _is_legacy_torch_file(head: bytes) -> bool:
    """A pre-1.6 torch file: a pickle that starts with torch's magic number, or the older tar format."""
    return (head[:1] == b"\x80" and head[2:14] == _LEGACY_MAGIC) or head[257:262] == b"ustar"


def _load_with_torch(path: str, map_location, torch_kwargs: dict) -> Any:
    """torch.load for files that are not zip archives (legacy format), with clearer errors for damaged ones."""
    with open(path, "rb") as handle:
        head = handle.read(512)
    if not head:
        raise TruncatedCheckpointError(
            f"{path} is empty (0 bytes): it is not a checkpoint. An interrupted copy or a save by a tool "
            "without atomic commit leaves such files; restore it from a good copy", path=path,
        )  # fmt: skip
    legacy = _is_legacy_torch_file(head)
    if not legacy:
        _raise_if_damaged_zip(path)
    try:
        return torch.load(path, map_location, **torch_kwargs)
    except (pickle.UnpicklingError, OSError, FastPersistError, MemoryError):
        raise
    except Exception as e:
        # A real legacy file may fail for reasons of its own (map_location, user
        # classes): those errors stay torch's. A file that is not one lets torch's
        # legacy reader surface garbage as IndexError, KeyError, "Invalid magic
        # number"...; say what it means instead. EOFError always means truncation.
        if legacy and not isinstance(e, EOFError):
            raise
        kind = TruncatedCheckpointError if isinstance(e, EOFError) else CorruptCheckpointError
        what = "a truncated legacy torch file" if legacy else "neither a zip checkpoint nor a legacy torch file"
        raise kind(
            f"{path} is {what} ({type(e).__name__}: {e}); the file is damaged or not a checkpoint: "
            "restore it from a good copy", path=path,
        ) from e  # fmt: skip


def _raise_if_damaged_zip(path: str) -> None:
    """A zip archive whose first bytes are damaged is not a legacy file: say so rather than unpickle it."""
    with open(path, "rb") as handle:
        descriptor = handle.fileno()
        try:
            records = read_directory(lambda o, n: os.pread(descriptor, n, o), os.fstat(descriptor).st_size, path)
        except MissingEndRecordError:
            if os.pread(descriptor, 2, 0) == b"PK":
                raise  # a zip archive damaged at both ends (truncated, and a first header hit)
            return  # not a zip archive: torch.load may know it
    first = min(records, key=lambda r: r.header_offset).name if records else None
    raise CorruptCheckpointError(
        f"{path}: a zip archive whose first bytes are damaged (it does not start with a zip header); "
        "restore it from a good copy", path=path, record=first,
    )  # fmt: skip


def _record_bytes(read_at, record: ZipRecordInfo, path: str, verify: bool) -> bytes:
    data = read_at(record.data_offset, record.size)
    if len(data) != record.size:
        raise CorruptCheckpointError(f"{path}: record {record.name!r} is cut short", path=path, record=record.name)
    if verify:
        _check_crc(path, record, data)
    return data


def _check_crc(path: str, record: ZipRecordInfo, data) -> None:
    crc = zlib.crc32(data)
    if crc != record.crc:
        check_record_crc(record, crc, path)


def _is_zip(path: str) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == b"PK\x03\x04"


def _load_from_path(path, map_location, pickle_module, weights_only, mmap, verify, settings, torch_kwargs,
                    pickle_load_args, warn_unverifiable=True):  # fmt: skip
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "expected a checkpoint file, got a directory", path)
    if not _is_zip(path):  # legacy (pre-1.6) or foreign format: torch.load knows them all
        return _load_with_torch(path, map_location, torch_kwargs)
    file = engine.File(path, "r", direct=settings.direct and not mmap)
    try:
        records, read_at = _open_records(file, path, verify)
        names = list(records)
        prefix = archive_prefix(names, path)
        if prefix + "constants.pkl" in records:  # a TorchScript archive
            return torch.load(path, map_location, **torch_kwargs)
        if verify and not _has_checksums(records.values()):
            if warn_unverifiable:
                warnings.warn(f"{path} was written without CRC-32 checksums; it cannot be verified", stacklevel=3)
            verify = False
        if verify:  # the small records nothing else reads (version, serialization id, ...)
            for name, record in records.items():
                if not name.startswith(prefix + "data/") and name != prefix + "data.pkl":
                    _record_bytes(read_at, record, path, verify)
        pickle_bytes = _record_bytes(read_at, records[prefix + "data.pkl"], path, verify)
        byteorder = b"little"
        if prefix + "byteorder" in records:
            byteorder = _record_bytes(read_at, records[prefix + "byteorder"], path, verify)
            if byteorder not in (b"little", b"big"):
                raise CorruptCheckpointError(f"{path}: unknown byte order record {byteorder!r}", path=path)
        storages = [r for name, r in records.items() if name.startswith(prefix + "data/")]
        if mmap:
            provider = MmapStorageProvider(path, file.size(), verify=verify)
        else:
            provider = FileStorageProvider(file, storages, settings, verify=verify, path=path)
        try:
            return deserialize(
                pickle_bytes, records, prefix, provider, map_location=map_location, pickle_module=pickle_module,
                weights_only=weights_only, byteorder=byteorder, path=path, **pickle_load_args,
            )  # fmt: skip
        except pickle.UnpicklingError as e:
            if not weights_only:
                raise
            from torch.serialization import UNSAFE_MESSAGE

            raise pickle.UnpicklingError(
                f"Weights only load failed. {UNSAFE_MESSAGE}\nWeightsUnpickler error: {e}"
            ) from None
    finally:
        file.close()


def _verify_file_object(f: BinaryIO) -> None:
    start = f.tell()
    f.seek(0, os.SEEK_END)
    size = f.tell() - start

    def read_at(offset: int, length: int) -> bytes:
        f.seek(start + offset)
        return f.read(length)

    try:
        records = check_structure(read_at, size, None)
        if not _has_checksums(records):
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
                crc = zlib.crc32(piece, crc)
            if crc != record.crc:
                check_record_crc(record, crc, "<file object>")
    finally:
        f.seek(start)
