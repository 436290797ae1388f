"""S3 uploads of local files: a file's parts read with concurrent ``pread`` calls and sent as a multipart upload.

:func:`upload_file` is the background half of a two-tier save
(``async_save(..., local_copy=path)``; the design:
:mod:`fastpersist.io.targets.s3`): the same multipart upload as a save's
(:class:`~fastpersist.io.targets.s3.upload.MultipartUpload`), committed and
aborted the same way, whose parts are read from the file into at most
``s3_concurrency`` page-aligned buffers of ``s3_part_size`` bytes (one
``PutObject`` for a file of at most one part,
:func:`~fastpersist.io.targets.s3.keys.put_bytes`). A file written to during
its upload fails it before the commit.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from typing import Any

from fastpersist.config import Settings
from fastpersist.errors import CheckpointIOError
from fastpersist.io import engine
from fastpersist.io.targets.s3 import connection
from fastpersist.io.targets.s3.connection import ObjectURL, part_size_for, target
from fastpersist.io.targets.s3.keys import put_bytes
from fastpersist.io.targets.s3.upload import MultipartUpload, abort_and_raise

__all__ = ["upload_file"]


class _FileSource:
    """A local file opened for an upload: its descriptor, its size and identity at open, preads of its ranges."""

    def __init__(self, source: Any):
        if isinstance(source, (str, os.PathLike)):
            self.path = os.fspath(source)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            self._owned = True
        else:
            self.fd = source.fileno()
            self.path = str(getattr(source, "name", f"<file descriptor {self.fd}>"))
            self._owned = False
        try:
            status = os.fstat(self.fd)
            if stat.S_ISDIR(status.st_mode):
                raise IsADirectoryError(errno.EISDIR, "upload_file needs a regular file, got a directory", self.path)
            if not stat.S_ISREG(status.st_mode):
                raise ValueError(f"upload_file needs a regular file (its size is known), got {self.path!r}")
        except BaseException:
            self.close()
            raise
        self.size = status.st_size
        self._identity = (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fills ``view`` with the file's bytes from ``offset`` on (preads release the GIL; any thread may call)."""
        position = 0
        while position < len(view):
            try:
                count = os.preadv(self.fd, [view[position:]], offset + position)
            except OSError as error:
                raise CheckpointIOError(
                    error.errno, f"reading it for its upload failed: {error.strerror}", self.path
                ) from error
            if count == 0:
                raise CheckpointIOError(
                    errno.EIO,
                    f"the file ended at byte {offset + position}, before the {self.size} bytes it had when its "
                    "upload started: it was truncated or rewritten in place during the upload",
                    self.path,
                )
            position += count

    def check_unchanged(self) -> None:
        """Raises CheckpointIOError when the file was written to since it was opened (before the commit)."""
        status = os.fstat(self.fd)
        if (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns) != self._identity:
            raise CheckpointIOError(
                errno.EIO,
                "the file was modified while it was being uploaded, so the object would mix two versions; nothing "
                "was committed. Replace files atomically (fastpersist's saves do) or upload again",
                self.path,
            )

    def close(self) -> None:
        if self._owned and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


class _Buffers:
    """Page-aligned buffers of one size, made on first need and reused: never more than are in use at once."""

    def __init__(self, size: int):
        self.size = size
        self.made = 0
        self._free: list = []
        self._lock = threading.Lock()

    def acquire(self):
        with self._lock:
            if self._free:
                return self._free.pop()
            self.made += 1
        return engine.AlignedBuffer(self.size, lock=False)

    def release(self, buffer) -> None:
        with self._lock:
            self._free.append(buffer)


def upload_file(source: Any, destination: str | ObjectURL, settings: Settings, *, client=None) -> None:
    """Uploads a local file to ``destination``: a multipart upload committed by its completion, or one
    ``PutObject`` for a file of at most one part.

    Parts of ``s3_part_size`` bytes (raised where the file would need more
    than 10,000) are read with concurrent ``pread`` calls into page-aligned
    buffers and sent by ``s3_concurrency`` threads: host memory is at most
    ``s3_concurrency * s3_part_size``, whatever the file's size. The file's
    identity, size and modification time are compared before the commit: a
    file written to during the upload fails it (fastpersist's saves replace
    files by rename, which leaves an open file as it was). On any failure,
    interrupts included, what is in flight is drained, the parts are
    discarded (``AbortMultipartUpload``) and the previous object at the key is
    intact. Blocks until done; may run on any thread.

    Args:
        source: a path, or a binary file object opened for reading (read
            through its ``fileno()``, left open): the bytes of the file it had
            open are uploaded even if its name has been replaced since.
        destination: ``s3://bucket/key`` or an :class:`ObjectURL`.
        settings: ``s3_part_size`` and ``s3_concurrency`` are used.
        client: a boto3 S3 client (default: one from
            :func:`~fastpersist.io.targets.s3.connection.make_client`).

    Raises:
        ValueError: a malformed URL; ``source`` is not a regular file.
        FileNotFoundError, PermissionError, IsADirectoryError: opening ``source``.
        CheckpointIOError: reading the file failed, or it changed during the
            upload (the upload is aborted).
        ObjectStoreUnavailableError: boto3 is missing.
        ObjectStoreCredentialsError, BucketNotFoundError, ObjectStoreError:
            the store refused a request or the network failed; the upload is
            aborted (a note says so where the abort failed as well).
        KeyboardInterrupt: after the parts in flight finished and the upload was aborted.
    """
    url = target(destination) if isinstance(destination, str) else destination
    file = _FileSource(source)
    try:
        if client is None:
            client = connection.make_client(settings.s3_concurrency)
        part_size = part_size_for(file.size, settings.s3_part_size)
        if file.size <= part_size:
            _put_file(file, url, client)
        else:
            _upload_file_parts(file, url, client, part_size, settings.s3_concurrency)
    finally:
        file.close()


def _put_file(file: _FileSource, url: ObjectURL, client) -> None:
    """A file of at most one part: read whole, then :func:`put_bytes` (the commit; a failure sends nothing)."""
    buffer = engine.AlignedBuffer(max(file.size, 1), lock=False)
    view = memoryview(buffer).cast("B")[: file.size]
    file.read_into(view, 0)
    file.check_unchanged()
    put_bytes(url, view, client=client)


def _upload_file_parts(file: _FileSource, url: ObjectURL, client, part_size: int, concurrency: int) -> None:
    parts = range(0, file.size, part_size)
    upload = MultipartUpload(client, url, min(concurrency, len(parts)))
    buffers = _Buffers(part_size)
    try:
        upload.begin()
        futures = [upload.submit_file_part(file, start, min(part_size, file.size - start), buffers) for start in parts]
        for future in futures:  # interruptible; parts after a failure are skipped, not sent
            future.result()
        file.check_unchanged()
        upload.complete()
    except BaseException as error:  # noqa: BLE001 - re-raised by _abort_and_raise after the abort
        upload.fail(error)  # parts not started yet are skipped
        upload.close()  # drained: nothing in flight when the abort runs
        abort_and_raise(upload, error)
    finally:
        upload.close()
