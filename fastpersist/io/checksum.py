"""CRC-32 work spread over the cores: one process-wide pool, pieces combined natively.

A verified load of fast storage is limited by CRC-32 when one thread does
it, to a fraction of the unverified speed (docs/performance.md). Here every large range is cut into pieces of ``piece_size``
bytes, each piece is checksummed (or copied and checksummed) by a native call
that releases the GIL on one of the pool's threads, and the pieces' CRCs are
folded back in order with ``crc32_combine`` -- the result is the CRC-32 of
the whole range, as zlib computes it.

Submission never blocks and tasks never wait on other tasks, so callers can
queue the CRC of a window right after its read completes and keep reading
and copying while the pool works (:class:`PendingCrc`).

CRC-32s of memory ranges (:func:`submit_crc32`, :func:`submit_crc32_many`)
and copies, with or without their CRC-32 in the same pass (:func:`submit_copies`),
run on a native pool (``engine.CrcPool``) whose threads never take the
interpreter lock: with Python threads each task took it to start and to
finish, and a loading thread queued behind them for it (docs/performance.md).
Other work (:func:`executor`'s users) runs on a pool of Python threads. Both
pools are created on first use, sized to the CPUs this process may run on
(``FASTPERSIST_CRC_THREADS`` overrides), reused by every save and load,
recreated after ``fork`` (threads do not survive it) and stopped at
interpreter exit (later work runs on the calling thread).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import os
import threading

from fastpersist.io import engine, workers

__all__ = [
    "executor",
    "crc32_combine_all",
    "PendingCrc",
    "submit_crc32",
    "submit_crc32_many",
    "submit_copy",
    "submit_copy_with_crc32",
    "submit_copies",
    "copy_pieces",
    "crc32",
    "copy_with_crc32",
    "copy",
    "part_value",
    "threads",
    "PIECE_SIZE",
    "shutdown",
]

PIECE_SIZE = 4 << 20
"""Bytes per task: large enough that a task's fixed overhead is small against its CRC-32 (docs/performance.md)."""

_forked_pools: list = []  # native pools of the parent, kept from their destructor in a forked child


class _PerProcess:
    """A pool of this process: made on first use, and again in a forked child (the parent's threads are
    not there; ``forget`` hands the parent's object back)."""

    def __init__(self, make, stop):
        self._make, self._stop = make, stop
        self._lock = threading.Lock()
        self._pool = None
        self._pid = 0

    def get(self):
        pool = self._pool
        if pool is not None and self._pid == os.getpid():
            return pool
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool, self._pid = self._make(), os.getpid()
            return self._pool

    def forget(self):
        """In a forked child: the parent's lock may have been held, and its pool has no threads here."""
        self._lock = threading.Lock()
        pool, self._pool = self._pool, None
        return pool

    def stop(self) -> None:
        """Stops this process's pool (waiting for its queued work); the next ``get`` makes a new one."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            self._stop(pool)


def threads() -> int:
    """Threads in the pool: ``FASTPERSIST_CRC_THREADS``, else the CPUs this process may use (at most 32)."""
    configured = os.environ.get("FASTPERSIST_CRC_THREADS")
    if configured:
        try:
            return max(1, int(configured))
        except ValueError:
            pass
    try:
        available = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        available = os.cpu_count() or 1
    return max(1, min(32, available))


# During interpreter shutdown (atexit saves) new pools run tasks on the caller's thread.
_python_pool = _PerProcess(lambda: workers.executor(threads(), "fastpersist-crc"), lambda p: p.shutdown(wait=True))
_native_pool = _PerProcess(
    lambda: engine.CrcPool(threads() if workers.threads_allowed() else 0), lambda p: p.shutdown()
)


def executor() -> concurrent.futures.Executor:
    """The process-wide pool (made on first use, again after ``fork``), for other native work on every core."""
    return _python_pool.get()


def _crc_pool():
    """The process-wide native CRC-32 pool (made on first use, again after ``fork``); one without threads,
    which computes on the caller's thread, once the interpreter is shutting down."""
    return _native_pool.get()


def _forget_after_fork() -> None:
    _python_pool.forget()
    parent = _native_pool.forget()
    if parent is not None:
        _forked_pools.append(parent)  # never destroyed here: it would join the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_native_pool.stop)  # its threads are joined at exit; later CRC-32s run on the caller's thread


def shutdown() -> None:
    """Stops the pools' threads (a later call starts new pools). Waits for queued work."""
    _python_pool.stop()
    _native_pool.stop()


class PendingCrc:
    """The CRC-32 of a range whose pieces are being checksummed on the pools.

    :meth:`result` waits for every piece and returns the CRC-32 of the
    range continued from the ``crc`` given at submission (raises what a task
    raised). :meth:`done` tells without waiting. Each piece is ``(part, length)``
    with ``part`` as :func:`part_value` takes it.
    """

    __slots__ = ("_crc", "_pieces", "_value")

    def __init__(self, crc: int, pieces: list[tuple[object, int]]):
        self._crc = crc
        self._pieces = pieces
        self._value: int | None = None

    def _waitables(self) -> list:
        found = []
        for piece, _ in self._pieces:
            if isinstance(piece, tuple):
                piece = piece[0]
            if isinstance(piece, (concurrent.futures.Future, engine.CrcJob)):
                found.append(piece)
        return found

    def done(self) -> bool:
        return self._value is not None or all(w.done() for w in self._waitables())

    def result(self) -> int:
        if self._value is None:
            self._value = crc32_combine_all(self._pieces, self._crc)
            self._pieces = []
        return self._value

    def wait(self) -> None:
        """Waits for every piece without combining (before reusing the memory); never raises."""
        futures = []
        for waitable in self._waitables():
            if isinstance(waitable, engine.CrcJob):
                waitable.wait()
            else:
                futures.append(waitable)
        concurrent.futures.wait(futures)


def part_value(part) -> int:
    """The CRC-32 a queued part stands for, waiting for it: an int; a ``(CrcJob, index)`` pair, for one range
    of a submission of several; anything with ``result()`` (a Future, a :class:`PendingCrc`, a device part)."""
    if isinstance(part, tuple):
        job, index = part
        return job.crc(index)
    result = getattr(part, "result", None)
    return part if result is None else result()  # an int of any kind (a rank's gathered CRC) has no result()


def _split(length: int, piece_size: int) -> list[tuple[int, int]]:
    return [(offset, min(piece_size, length - offset)) for offset in range(0, length, piece_size)]


def copy_pieces(destination: int, source: int, length: int, piece_size: int = PIECE_SIZE) -> list[tuple[int, int, int]]:
    """The ``(destination, source, length)`` pieces of at most ``piece_size`` bytes of one copy, in order: what
    :func:`submit_copies` takes, a task each."""
    return [(destination + offset, source + offset, n) for offset, n in _split(length, piece_size)]


def submit_crc32(address: int, length: int, crc: int = 0, *, piece_size: int = PIECE_SIZE) -> PendingCrc:
    """Queues the CRC-32 of ``length`` bytes at ``address`` (kept alive by the caller until :meth:`result`),
    in pieces of ``piece_size`` on the native pool."""
    if length <= 0:
        return PendingCrc(crc, [])
    pieces = _split(length, piece_size)
    job = _crc_pool().submit([address + o for o, _ in pieces], [n for _, n in pieces])
    return PendingCrc(crc, [((job, index), n) for index, (_, n) in enumerate(pieces)])


def submit_copy(destination: int, source: int, length: int, *, piece_size: int = PIECE_SIZE, populate: bool = False):
    """Queues a copy of ``length`` bytes (non-overlapping) on the native pool, in pieces of ``piece_size`` spread
    over its threads; returns an ``engine.CrcJob`` to ``wait()`` for (both sides stay alive until then), whose
    values are 0. With ``populate`` the destination is a file mapping: each task first fills its pages' table
    entries in one call (``madvise``) instead of a fault per page, and a piece whose pages cannot be had is not
    copied; its value is then the errno."""
    return submit_copies(copy_pieces(destination, source, length, piece_size), populate=populate)


def submit_copies(pieces: list[tuple[int, int, int]], checksum: bool = False, *, populate: bool = False):
    """Queues a copy of each ``(destination, source, length)`` (non-overlapping) on the native pool, a task each;
    with ``checksum`` each task computes its bytes' CRC-32 in the copy's pass (``job.crc(i)``; else 0; for
    ``populate`` see :func:`submit_copy`). Returns an ``engine.CrcJob`` to ``wait()`` for; both sides stay alive
    until then."""
    destinations, sources, lengths = (list(side) for side in zip(*pieces)) if pieces else ([], [], [])
    return _crc_pool().submit_copies(destinations, sources, lengths, populate, checksum)


def submit_crc32_many(ranges: list[tuple[int, int]]):
    """Queues the CRC-32 of each small ``(address, length)`` range on the native pool; returns an
    ``engine.CrcJob`` (``crc(i)`` is range ``i``'s)."""
    return _crc_pool().submit([address for address, _ in ranges], [n for _, n in ranges])


def submit_copy_with_crc32(
    destination: int, source: int, length: int, crc: int = 0, *, piece_size: int = PIECE_SIZE
) -> PendingCrc:
    """Queues a copy of ``length`` bytes (non-overlapping) and its CRC-32, pieces on several cores."""
    if length <= 0:
        return PendingCrc(crc, [])
    pieces = copy_pieces(destination, source, length, piece_size)
    job = submit_copies(pieces, checksum=True)
    return PendingCrc(crc, [((job, index), n) for index, (_, _, n) in enumerate(pieces)])


def crc32(address: int, length: int, crc: int = 0, *, piece_size: int = PIECE_SIZE) -> int:
    """CRC-32 of ``length`` bytes at ``address``, continued from ``crc``, using every core for large ranges.

    Small ranges are checksummed on the calling thread (no task overhead).
    """
    if length <= piece_size:
        return engine.crc32(address, length, crc)
    return submit_crc32(address, length, crc, piece_size=piece_size).result()


def copy_with_crc32(destination: int, source: int, length: int, crc: int = 0, *, piece_size: int = PIECE_SIZE) -> int:
    """``engine.copy_with_crc32`` spread over the pool for large ranges (the source is read once)."""
    if length <= piece_size:
        return engine.copy_with_crc32(destination, source, length, crc)
    return submit_copy_with_crc32(destination, source, length, crc, piece_size=piece_size).result()


def copy(destination: int, source: int, length: int, *, piece_size: int = PIECE_SIZE) -> None:
    """memcpy (non-overlapping), spread over the pool for large ranges; no checksum."""
    if length <= piece_size:
        ctypes.memmove(destination, source, length)  # ctypes releases the GIL
        return
    submit_copies(copy_pieces(destination, source, length, piece_size)).wait()


def crc32_combine_all(pieces, crc: int = 0) -> int:
    """CRC-32 of consecutive ranges given in order as ``(part, length)``, continued from ``crc``: ``part`` is
    the range's CRC-32 or anything :func:`part_value` takes (then waited for). E.g. the slices of one record
    written by several ranks, or the pieces a load queued."""
    for part, length in pieces:
        crc = engine.crc32_combine(crc, part_value(part), length)
    return crc
