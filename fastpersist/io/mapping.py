"""Saves to tmpfs through a mapping of the file, filled by the CRC pool's threads instead of ``write`` calls.

A ``write`` into a tmpfs file allocates, zero-fills and fills its pages under
the file's inode lock, one writer at a time, so a save to /dev/shm went at one
thread's copy speed. Here the save's range is allocated (``fallocate``) at its
first write, while the next windows are being read (a pipelined save's step
waits for those reads, not for the allocation), so a full filesystem fails
with ``ENOSPC`` before any byte is copied, never as a ``SIGBUS`` inside a
copy; then the ring's windows are copied into a shared mapping of it in
pieces, side by side, each task first filling its pages' table entries in
one call (``MADV_POPULATE_WRITE``, Linux 5.14) rather than taking a fault per
page. The file is the save's own temporary (``O_EXCL``):
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
    if when == "never" or (when == "auto" and checksum.threads() < MIN_THREADS) or engine.fault_injected():
        return False  # under inject_fault the save writes through handles, which the faults reach
    try:
        return getattr(file, "filesystem", None) in _FILESYSTEMS
    except OSError:  # fstatfs failed: read and write as usual, which report the error if there is one
        return False


class Mapping:
    """Bytes ``[start, end)`` of a regular file to be written through a mapping: allocated and mapped by the first
    :meth:`address` (the save's first write), so that the save's first reads do not wait for the allocation;
    ``address(offset)`` is then the address of the file's byte ``offset``. One thread (the writer's finalize
    stage) asks for addresses; :meth:`close` once it no longer does."""

    def __init__(self, descriptor: int, file, start: int, end: int):
        self.path = file.path
        self._file = file
        self._descriptor = descriptor  # read and write: a shared mapping to write needs both
        self._start, self._end = start, end
        self._map: mmap.mmap | None = None
        self._base = 0

    @classmethod
    def for_writing(cls, file, start: int, end: int) -> Mapping | None:
        """``file``'s range ``[start, end)`` to write through a mapping; None where the file is not a regular file
        that can be opened to read and write (the caller then writes)."""
        if end <= start:
            return None
        try:
            descriptor = os.open(file.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if _same_regular_file(descriptor, file):
                return cls(descriptor, file, start, end)
        except OSError:
            pass
        os.close(descriptor)
        return None

    def address(self, offset: int) -> int:
        """The address of the file's byte ``offset``. The first call allocates every page of the range (a full
        filesystem raises ``OSError`` ``ENOSPC`` here, before any copy, which would raise SIGBUS; ``fallocate``
        only ever extends the file: ranks of a collective save share it) and maps it."""
        if self._map is None:
            if self._descriptor < 0:
                raise OSError(errno.EBADF, f"the mapping of '{self.path}' failed before or is closed", self.path)
            try:
                if not self._file.allocate(self._start, self._end - self._start):
                    raise OSError(errno.EOPNOTSUPP, f"cannot allocate '{self.path}' to map it", self.path)
                low = self._start - self._start % mmap.ALLOCATIONGRANULARITY
                self._map = mmap.mmap(self._descriptor, self._end - low, offset=low, access=mmap.ACCESS_WRITE)
                view = ctypes.c_char.from_buffer(self._map)
                self._base = ctypes.addressof(view) - low
                del view  # no export left: close() can unmap
            finally:
                os.close(self._descriptor)  # the mapping holds its own reference to the file
                self._descriptor = -1
        return self._base + offset

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        elif self._descriptor >= 0:
            os.close(self._descriptor)
            self._descriptor = -1


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
        destination = self._mapping.address(offset)
        copy = checksum.submit_copy(destination, address, nbytes, piece_size=_PIECE, populate=_can_populate())
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
