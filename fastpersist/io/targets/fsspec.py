"""A file in any fsspec filesystem as a target (``memory://``, ``file://``; ``gs://``, ``az://`` and the others
where the package fsspec names for them is installed; ``pip install fastpersist[fsspec]``).

A new store in one file: the filesystem object (``fsspec.core.url_to_fs``)
does the requests, this class maps a checkpoint's operations onto it.

* **save**: the ring writer (:func:`fastpersist.io.writer.write_plan`) fills
  and finalizes the file's windows in order; this target's handle writes each
  one into a file opened for writing on a temporary path beside the target
  (``.<name>.fastpersist-<random>.tmp``), on the writer's finalizing thread.
  Once every byte is written and ``before_commit`` passed, the temporary is
  moved over the target (``fs.mv``): the commit. On any failure the temporary
  is removed and the previous file is intact. What the move guarantees is the
  filesystem's: a rename on ``file://`` (atomic, but fsspec does not fsync:
  pass a plain path for durable local saves), a copy and a delete on object
  stores (the object appears whole, atomically), a copy in ``memory://``.
  Temporaries of a process that died mid-save are not removed automatically.
* **load**: the file's size (``fs.size``), then ranged reads
  (``fs.cat_file(path, start, end)``) into page-aligned memory, at most
  ``buffer_size`` bytes a request. Reads are not pinned to a version (S3's
  ETag pinning has no fsspec equivalent): replace files by a move, as saves do.
* collective saves (``group=``) are refused: they need part files beside the
  target on every rank's view of the store, which local paths and S3 give.

Errors: a missing file is :class:`~fastpersist.errors.ObjectNotFoundError`
(a ``FileNotFoundError``); the filesystem's other ``OSError`` become
:class:`~fastpersist.errors.CheckpointIOError` (also a ``RuntimeError``, as torch
raises) with the URL as ``filename``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import secrets
import shutil
from typing import Any

from fastpersist.config import Settings
from fastpersist.errors import (
    CheckpointIOError,
    ObjectNotFoundError,
    ObjectStoreUnavailableError,
    TruncatedCheckpointError,
    torch_compatible,
)
from fastpersist.io import engine
from fastpersist.io.targets.base import Target
from fastpersist.io.writer import write_plan

__all__ = ["FsspecFile", "check_scheme", "known_scheme"]


def _fsspec(scheme: str):
    try:
        import fsspec
    except ImportError as e:
        raise ObjectStoreUnavailableError(
            f"{scheme}:// paths need fsspec, which is not installed ({e}); install it with: pip install "
            "fastpersist[fsspec] (and the package fsspec names for the scheme: gcsfs for gs://, adlfs for az://)"
        ) from e
    return fsspec


def known_scheme(scheme: str) -> bool:
    """Whether fsspec (when installed) has a filesystem for ``scheme``, its package installed or not."""
    try:
        import fsspec
    except ImportError:
        return False
    return scheme in fsspec.available_protocols()


def check_scheme(scheme: str, url: str) -> None:
    """Checks, without a request, that a filesystem for ``scheme`` can be made.

    Raises:
        ObjectStoreUnavailableError: (an ``ImportError``) fsspec, or the package it names for the scheme, is missing.
        ValueError: fsspec knows no filesystem for the scheme.
    """
    fsspec = _fsspec(scheme)
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise ValueError(
            f"no store is known for {scheme}:// URLs ({url!r}): pass a local path, an s3:// URL or a URL of a "
            "filesystem fsspec knows (fsspec.available_protocols())"
        ) from None
    except ImportError as e:
        raise ObjectStoreUnavailableError(f"{scheme}:// paths need a package that is not installed: {e}") from e


class FsspecFile(Target):
    """The file at ``url`` in the fsspec filesystem of its scheme (see the module docstring)."""

    remote = True

    def __init__(self, url: str, filesystem: Any = None, fs_path: str | None = None):
        self._url = url
        self.scheme = url.partition("://")[0]
        self._fs = filesystem
        self._fs_path = fs_path

    @classmethod
    def parse(cls, url: str) -> FsspecFile:
        """A target for ``url``, checked as :func:`check_scheme` checks it; the filesystem is made on first use."""
        check_scheme(url.partition("://")[0], url)
        return cls(url)

    @property
    def path(self) -> str:
        return self._url

    @property
    def given(self) -> str:
        return self._url  # its stem names the archive's top folder, as a local file's name does

    @property
    def fs(self):
        """The filesystem object (made on first use: some make clients, or ask for credentials)."""
        if self._fs is None:
            self._fs, self._fs_path = _fsspec(self.scheme).core.url_to_fs(self._url)
        return self._fs

    @property
    def fs_path(self) -> str:
        """The path inside the filesystem (``url`` without its scheme, as the filesystem spells it)."""
        if self._fs_path is None:
            self.fs  # noqa: B018 - makes both
        return self._fs_path

    def _failure(self, error: OSError, *, saving: bool) -> OSError:
        """``error`` as this module raises it: a missing file as ObjectNotFoundError, the URL as filename."""
        if isinstance(error, FileNotFoundError) and not isinstance(error, ObjectNotFoundError) and not saving:
            return ObjectNotFoundError(
                errno.ENOENT, f"no such file in the {self.scheme}:// filesystem ({error})", self._url
            )
        if not isinstance(error, RuntimeError):
            error.filename = self._url
        return torch_compatible(error, saving=saving)

    # ------------------------------------------------------------------ saves

    def _temporary(self) -> str:
        directory, name = posixpath.split(self.fs_path)
        return posixpath.join(directory, f".{name}.fastpersist-{secrets.token_hex(8)}.tmp")

    def _commit(self, write, before_commit=None):
        """``write(stream)`` into a temporary file, ``before_commit()``, then the move over the target.

        On any failure the temporary file is removed (a failure to remove it is
        a note on the error raised) and the target is untouched.
        """
        fs, temporary = self.fs, self._temporary()
        try:
            stream = fs.open(temporary, "wb")
            try:
                result = write(stream)
            finally:
                stream.close()
            if before_commit is not None:
                before_commit()
            fs.mv(temporary, self.fs_path)
        except BaseException as error:
            try:
                if fs.exists(temporary):
                    fs.rm_file(temporary)
            except Exception as cleanup:  # noqa: BLE001 - the save's own error is the one to raise
                error.add_note(
                    f"the temporary file {temporary} could not be removed ({type(cleanup).__name__}: {cleanup}); "
                    "no checkpoint uses it: delete it"
                )
            if isinstance(error, OSError):
                raise self._failure(error, saving=True) from None
            raise
        return result

    def commit_plan(self, plan, settings: Settings, streams=None, *, before_commit=None, after_reads=None) -> list[int]:
        """The ring writer's windows into the temporary file, then the move (see the module docstring)."""
        writes = _StreamWrites()

        def write(stream) -> list[int]:
            writes.stream = stream
            return write_plan(
                plan, stream, settings, streams=streams, make_handle=lambda: writes, after_reads=after_reads
            )

        return self._commit(write, before_commit)

    def put_bytes(self, data, settings: Settings) -> None:
        self._commit(lambda stream: _write_all(stream, memoryview(data).cast("B")))

    def upload_file(self, source: Any, settings: Settings) -> None:
        """Copies ``source`` (a path, or a binary file object read from its position) into the store."""
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as opened:
                self._commit(lambda stream: shutil.copyfileobj(opened, stream, settings.buffer_size))
            return
        self._commit(lambda stream: shutil.copyfileobj(source, stream, settings.buffer_size))

    # ------------------------------------------------------------------ loads

    def size(self) -> int:
        """The file's size in bytes.

        Raises:
            ObjectNotFoundError: (``FileNotFoundError``) no file there.
        """
        try:
            return int(self.fs.size(self.fs_path))
        except OSError as error:
            raise self._failure(error, saving=False) from None

    def read_into(self, offset: int, destination, settings: Settings) -> None:
        """Fills ``destination`` (a writable buffer) with the file's bytes from ``offset`` on.

        Raises:
            TruncatedCheckpointError: the file ends before the range does.
            ObjectNotFoundError: no file there.
        """
        view = memoryview(destination).cast("B")
        step = max(1, settings.buffer_size)
        for start in range(0, len(view), step):
            end = min(start + step, len(view))
            try:
                data = self.fs.cat_file(self.fs_path, offset + start, offset + end)
            except OSError as error:
                raise self._failure(error, saving=False) from None
            if len(data) != end - start:
                raise TruncatedCheckpointError(
                    f"{self._url} ends before byte {offset + end} (a read of bytes {offset + start}-{offset + end - 1} "
                    f"got {len(data)}): it is not the file the checkpoint describes (truncated or replaced)",
                    path=self._url,
                )
            view[start:end] = data

    def download(self, settings: Settings) -> tuple[Any, int]:
        size = self.size()
        buffer = engine.AlignedBuffer(max(size, 1), lock=False)
        self.read_into(0, memoryview(buffer).cast("B")[:size], settings)
        return buffer, size

    def open_reader(self, settings: Settings) -> _Reader:
        return _Reader(self, settings)

    def read_ranges(self, reads, settings: Settings) -> None:
        for where, offset, destination in reads:
            where.read_into(offset, destination, settings)

    def exists(self) -> bool:
        return bool(self.fs.isfile(self.fs_path))

    def remove(self) -> None:
        try:
            self.fs.rm_file(self.fs_path)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise self._failure(error, saving=True) from None

    # ------------------------------------------------------------------ directories (DCP)

    def as_directory(self) -> FsspecFile:
        return FsspecFile(self._url.rstrip("/"), self.fs, self.fs_path.rstrip("/"))

    def make_directory(self) -> None:
        try:
            self.fs.makedirs(self.fs_path, exist_ok=True)
        except OSError as error:
            raise self._failure(error, saving=True) from None

    def child(self, name: str) -> FsspecFile:
        return FsspecFile(f"{self._url.rstrip('/')}/{name}", self.fs, f"{self.fs_path.rstrip('/')}/{name}")

    def check_sizes(self, sizes: dict[str, int], settings: Settings) -> None:
        for name in sorted(sizes):
            where = self.child(name)
            size = where.size()
            if size != sizes[name]:
                raise CheckpointIOError(
                    errno.EIO,
                    f"holds {size} bytes where its rank wrote {sizes[name]}: another save wrote to {self._url} at "
                    "the same time. The checkpoint was not committed; save it again",
                    where.path,
                )


class _Reader:
    """A file kept open for ranged reads (``fs.cat_file`` per range; the size read once, at open)."""

    def __init__(self, target: FsspecFile, settings: Settings):
        self.target = target
        self.settings = settings
        self.size = target.size()

    def read(self, start: int, end: int):
        if start < 0 or end > self.size:
            raise ValueError(f"bytes {start}-{end - 1} are outside {self.target.path} ({self.size} bytes)")
        buffer = engine.AlignedBuffer(max(end - start, 1), lock=False)
        self.target.read_into(start, memoryview(buffer).cast("B")[: end - start], self.settings)
        return buffer

    def close(self) -> None:
        pass  # cat_file holds nothing open


class _StreamWrites:
    """The handle of every ring slot of a save (``write_plan``'s ``make_handle``): the writer submits the
    windows in file order from its finalizing thread, and each is written into the stream there and then."""

    def __init__(self):
        self.stream: Any = None
        self.written = 0

    def submit_write(self, address: int, nbytes: int, file, offset: int, keepalive) -> None:
        if offset != self.written:
            raise AssertionError(f"windows must come in order: expected offset {self.written}, got {offset}")
        _write_all(self.stream, memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B"))
        self.written += nbytes

    def wait(self) -> int:
        return 0  # written at submission: the slot may be refilled


def _write_all(stream, view: memoryview) -> None:
    while view:
        count = stream.write(view)
        view = view[len(view) if count is None else count :]
