"""A writable file object as a target (``BytesIO``, a socket, an open file): the bytes are streamed in order.

What ``fastpersist.save(obj, f)`` does for a file object: the plan is written
sequentially through ``f.write`` (:func:`fastpersist.io.stream.write_plan_to_stream`,
device storages copied to the host a slice at a time), then ``f`` is flushed
and, where it is a regular file or a block device, fsynced. There is no
commit to make: the stream is the caller's.
"""

from __future__ import annotations

from typing import Any

from fastpersist.config import Settings
from fastpersist.errors import NotWritableError
from fastpersist.io.commit import fsync_file_object
from fastpersist.io.stream import write_plan_to_stream
from fastpersist.io.targets.base import Target

__all__ = ["FileObject"]


class FileObject(Target):
    """The caller's file object ``stream``; saves only (loads of file objects are torch.load's)."""

    scheme = "stream"

    def __init__(self, stream: Any):
        self.stream = stream

    @property
    def path(self) -> str:
        return str(getattr(self.stream, "name", f"<{type(self.stream).__name__}>"))

    @property
    def given(self) -> None:
        return None  # torch names the archive of a buffer "archive"

    def checked(self) -> FileObject:
        """This target, once the object is known to be writable.

        Raises:
            NotWritableError: (AttributeError, TypeError, as torch.save raises) the object has no ``write``.
        """
        if not callable(getattr(self.stream, "write", None)):
            raise NotWritableError(
                f"expected 'f' to be a string, path, or a file-like object with a 'write' attribute, "
                f"got {type(self.stream).__name__}"
            )
        return self

    def anchored(self) -> Target:
        raise TypeError(
            f"a save that commits later (async_save) needs a file path or a URL, got {type(self.stream).__name__}; "
            "use save() for file objects"
        )

    def collective_layout(self, layout: str | None) -> str:
        raise TypeError("a collective save (group=...) needs a path, not a file object")

    def commit_plan(self, plan, settings: Settings, streams=None, *, before_commit=None, after_reads=None) -> None:
        """Streams the plan into the object, flushes it, fsyncs it where that means something (``fsync``).

        ``after_reads`` and ``before_commit`` are called once every byte is written.

        Raises:
            NotWritableError: no ``write``. OSError: the stream's own.
        """
        stream = self.checked().stream
        write_plan_to_stream(plan, stream, checksum=settings.checksum, chunk_size=settings.buffer_size)
        if callable(getattr(stream, "flush", None)):
            stream.flush()
        if settings.fsync:
            fsync_file_object(stream)
        if after_reads is not None:
            after_reads([])
        if before_commit is not None:
            before_commit()
