"""CRC-32 work spread over the cores: one process-wide pool, pieces combined natively.

A verified load of fast storage is limited by CRC-32 when one thread does
it (~5.8 GB/s from /dev/shm to CUDA on the H100 machine, against ~20 GB/s
unverified). Here every large range is cut into pieces of ``piece_size``
bytes, each piece is checksummed (or copied and checksummed) by a native call
that releases the GIL on one of the pool's threads, and the pieces' CRCs are
folded back in order with ``crc32_combine`` -- the result is the CRC-32 of
the whole range, as zlib computes it.

Submission never blocks and tasks never wait on other tasks, so callers can
queue the CRC of a window right after its read completes and keep reading
and copying while the pool works (:class:`PendingCrc`).

The pool is created on first use, sized to the CPUs this process may run on
(``FASTPERSIST_CRC_THREADS`` overrides), reused by every save and load, and
recreated after ``fork`` (threads do not survive it).
"""

from __future__ import annotations

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
    "submit_copy_with_crc32",
    "crc32",
    "copy_with_crc32",
    "copy",
    "threads",
    "PIECE_SIZE",
    "shutdown",
]

PIECE_SIZE = 4 << 20
"""Bytes per task: large enough that task overhead (~20 us) is < 1% at 14 GB/s a core."""

_lock = threading.Lock()
_pool: concurrent.futures.Executor | None = None
_pool_pid = 0


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


def executor() -> concurrent.futures.Executor:
    """The process-wide pool (made on first use, again after ``fork``), for other native work on every core."""
    global _pool, _pool_pid
    pid = os.getpid()
    pool = _pool
    if pool is not None and _pool_pid == pid:
        return pool
    with _lock:
        if _pool is None or _pool_pid != pid:
            # After fork the parent's threads are gone: start a new pool (the old object is dropped).
            # During interpreter shutdown (atexit saves) the tasks run on the caller's thread.
            _pool = workers.executor(threads(), "fastpersist-crc")
            _pool_pid = pid
        return _pool


def _forget_after_fork() -> None:
    # The parent's threads do not exist in the child, and its lock may have been held.
    global _pool, _lock
    _lock = threading.Lock()
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def shutdown() -> None:
    """Stops the pool's threads (a later call starts a new pool). Waits for queued work."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None and _pool_pid == os.getpid():
        pool.shutdown(wait=True)


class PendingCrc:
    """The CRC-32 of a range whose pieces are being checksummed on the pool.

    :meth:`result` waits for every piece and returns the CRC-32 of the
    range continued from the ``crc`` given at submission (raises what a task
    raised). :meth:`done` tells without waiting.
    """

    __slots__ = ("_crc", "_pieces", "_value")

    def __init__(self, crc: int, pieces: list[tuple[concurrent.futures.Future | int, int]]):
        self._crc = crc
        self._pieces = pieces
        self._value: int | None = None

    def _futures(self) -> list[concurrent.futures.Future]:
        futures = []
        for piece, _ in self._pieces:
            if isinstance(piece, tuple):
                piece = piece[0]
            if isinstance(piece, concurrent.futures.Future):
                futures.append(piece)
        return futures

    def done(self) -> bool:
        return self._value is not None or all(f.done() for f in self._futures())

    def result(self) -> int:
        if self._value is None:
            crc = self._crc
            for piece, length in self._pieces:
                if isinstance(piece, tuple):  # (future of a batch, index in its results)
                    value = piece[0].result()[piece[1]]
                elif isinstance(piece, concurrent.futures.Future):
                    value = piece.result()
                else:
                    value = piece
                crc = engine.crc32_combine(crc, value, length)
            self._value = crc
            self._pieces = []
        return self._value

    def wait(self) -> None:
        """Waits for every piece without combining (before reusing the memory); never raises."""
        concurrent.futures.wait(self._futures())


def _split(length: int, piece_size: int) -> list[tuple[int, int]]:
    return [(offset, min(piece_size, length - offset)) for offset in range(0, length, piece_size)]


def submit_crc32(address: int, length: int, crc: int = 0, *, piece_size: int = PIECE_SIZE) -> PendingCrc:
    """Queues the CRC-32 of ``length`` bytes at ``address`` (kept alive by the caller until :meth:`result`)."""
    if length <= 0:
        return PendingCrc(crc, [])
    if length <= piece_size:
        return PendingCrc(crc, [(executor().submit(engine.crc32, address, length), length)])
    pool = executor()
    return PendingCrc(crc, [(pool.submit(engine.crc32, address + o, n), n) for o, n in _split(length, piece_size)])


def submit_crc32_many(ranges: list[tuple[int, int]]) -> concurrent.futures.Future:
    """Queues one task computing the CRC-32 of each small ``(address, length)`` range; a list in order.

    The task is one ``engine.copy_many`` call, which runs without the GIL.
    """
    addresses = [address for address, _ in ranges]
    return executor().submit(engine.copy_many, [0] * len(addresses), addresses, [n for _, n in ranges], True)


def submit_copy_with_crc32(
    destination: int, source: int, length: int, crc: int = 0, *, piece_size: int = PIECE_SIZE
) -> PendingCrc:
    """Queues a copy of ``length`` bytes (non-overlapping) and its CRC-32, pieces on several cores."""
    if length <= 0:
        return PendingCrc(crc, [])
    pool = executor()
    return PendingCrc(
        crc,
        [
            (pool.submit(engine.copy_with_crc32, destination + o, source + o, n), n)
            for o, n in _split(length, piece_size)
        ],
    )


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
    pool = executor()
    futures = [pool.submit(ctypes.memmove, destination + o, source + o, n) for o, n in _split(length, piece_size)]
    for future in futures:
        future.result()


def crc32_combine_all(pieces) -> int:
    """CRC-32 of the concatenation of pieces given in order as ``(crc32(piece), len(piece))``
    (e.g. the slices of one record written by several ranks)."""
    crc = 0
    for piece_crc, length in pieces:
        crc = engine.crc32_combine(crc, piece_crc, length)
    return crc
