"""Saves to tmpfs through a mapping of the file, filled by the CRC pool's threads instead of ``write`` calls.

A ``write`` into a tmpfs file allocates, zero-fills and fills its pages under
the file's inode lock, one writer at a time, so a save to /dev/shm went at one
thread's copy speed. Here the save's range is allocated first (``fallocate``),
so a full filesystem fails with ``ENOSPC`` before any byte is copied, never as
a ``SIGBUS`` inside a copy; then the ring's windows are copied into a shared
mapping of it in pieces, side by side, each task first filling its pages'
table entries in one call (``MADV_POPULATE_WRITE``, Linux 5.14) rather than
taking a fault per page. The file is the save's own temporary (``O_EXCL``):
nothing truncates it under the mapping. It is unmapped on a thread of its own
once the ring has drained (the commit does not wait for the unmapping). The
``tmpfs_mapping`` setting decides; measured in docs/performance.md (which
also has why loads do not read through a mapping, and why the copies do not
allocate the pages themselves).

The ring's slots take :class:`WriteHandle` as their handle (``submit_write``
and ``wait``), so the writer drives it like a native handle.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import stat

from fastpersist.io import checksum, engine

__all__ = ["MIN_THREADS", "Mapping", "WriteHandle", "wanted"]

MIN_THREADS = 4
"""Pool threads from which ``tmpfs_mapping="auto"`` maps: on fewer cores a save's zero-filling ``fallocate`` costs
more than the parallel copies gain (docs/performance.md)."""
_FILESYSTEMS = frozenset({"tmpfs"})
_PIECE = 4 << 20  # bytes per copy task
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def wanted(file, when: str) -> bool:
    """Whether ``file`` (a native File) goes through a mapping under the ``tmpfs_mapping`` setting ``when``."""
    if when == "never" or (when == "auto" and checksum.threads() < MIN_THREADS):
        return False
    try:
        return getattr(file, "filesystem", None) in _FILESYSTEMS
    except OSError:  # fstatfs failed: read and write as usual, which report the error if there is one
        return False


class Mapping:
    """Bytes ``[start, end)`` of a regular file, mapped to write; :attr:`base` + a file offset is that byte's
    address."""

    def __init__(self, descriptor: int, start: int, end: int, path: str):
        self.path = path
        self._offset = start - start % mmap.ALLOCATIONGRANULARITY
        self._map = mmap.mmap(descriptor, end - self._offset, offset=self._offset, access=mmap.ACCESS_WRITE)
        view = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(view) - self._offset
        del view  # no export left: close() can unmap

    @classmethod
    def for_writing(cls, file, start: int, end: int) -> Mapping | None:
        """``file``'s range ``[start, end)`` allocated and mapped for writing; None where the file is not a
        regular file or cannot be mapped (the caller then writes). Raises ``OSError`` (``ENOSPC``, ``EDQUOT``)
        when the filesystem has no room for the range."""
        if end <= start:
            return None
        try:  # a shared mapping to write needs a descriptor that reads too
            descriptor = os.open(file.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not _same_regular_file(descriptor, file):
                return None
            # Every page of the range now: a full filesystem fails here, before any copy (which would raise
            # SIGBUS). fallocate only ever extends the file: ranks of a collective save share it.
            if not file.allocate(start, end - start):
                return None
            return cls(descriptor, start, end, file.path)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            return None
        finally:
            os.close(descriptor)  # the mapping keeps its own reference to the file

    def close(self) -> None:
        self._map.close()


@functools.cache
def _can_populate() -> bool:
    """Whether ``MADV_POPULATE_WRITE`` exists here (Linux 5.14): the copy tasks then fill their pages' table
    entries in one call each instead of a page fault per page."""
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(_MADV_POPULATE_WRITE)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _same_regular_file(descriptor: int, file) -> bool:
    info = os.fstat(descriptor)
    return stat.S_ISREG(info.st_mode) and os.path.samestat(info, os.fstat(file.fd))


class WriteHandle:
    """A ring slot's handle on a :class:`Mapping` of the save's file: a write is a copy queued on the pool."""

    def __init__(self, mapping: Mapping) -> None:
        self._mapping = mapping
        self._copies: list = []

    def submit_write(self, address: int, nbytes: int, file, offset: int, keepalive, **options) -> None:
        destination = self._mapping.base + offset
        populate = checksum.POPULATE_DESTINATION if _can_populate() else 0
        copy = checksum.submit_copy(destination, address, nbytes, piece_size=_PIECE, populate=populate)
        self._copies.append(copy)

    def wait(self) -> None:
        """Until every copy submitted is done; raises ``OSError`` when a range could not be copied (its pages'
        table entries could not be filled: not expected once the range is allocated, but reported, not copied)."""
        copies, self._copies = self._copies, []
        failed = 0
        for copy in copies:
            copy.wait()
            failed = failed or next((copy.crc(i) for i in range(len(copy)) if copy.crc(i)), 0)
        if failed:
            code = errno.ENOSPC if failed == errno.EFAULT else failed  # EFAULT: a page it could not have
            advice = engine.errno_advice(code)
            message = f"copy into the mapping of '{self._mapping.path}' failed: {os.strerror(code)}"
            raise OSError(code, message + (f"; {advice}" if advice else ""), self._mapping.path)
