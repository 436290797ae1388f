"""Engine selection over the native core; the only importer of ``fastpersist._native``.

Re-exports the native types:

* :class:`File` -- a file with a buffered and (where the filesystem allows it)
  an O_DIRECT descriptor, its direct-I/O ``alignment`` and ``fallback_reason``.
* :class:`IoHandle` -- asynchronous reads/writes split into ``block_size``
  chunks over ``intra_op_parallelism`` lanes, each with ``queue_depth`` in
  flight. ``submit_write``/``submit_read`` return at once; ``wait()`` returns
  the number of completed requests and raises the first error (an ``OSError``
  subclass with ``errno`` and ``filename``) after everything in flight is done.
* :class:`AlignedBuffer` -- page-aligned (optionally locked) host memory with
  the buffer protocol (``torch.frombuffer``).

Engine choice is a tri-state: ``auto`` uses io_uring when it starts and
otherwise the thread pool, logging once (logger ``fastpersist``) why; a named
engine that cannot start raises :class:`~fastpersist.errors.EngineUnavailableError`.
"""

from __future__ import annotations

import contextlib
import errno as errno_module
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from fastpersist import _native, config
from fastpersist.errors import ConfigError, EngineUnavailableError, UnexpectedEndOfFileError

__all__ = [
    "File",
    "IoHandle",
    "AlignedBuffer",
    "Request",
    "UnexpectedEndOfFileError",
    "ENGINE_NAMES",
    "engines_compiled",
    "engine_status",
    "resolve_engine",
    "make_handle",
    "inject_fault",
    "fault_injected",
    "probe_directory",
    "memlock_limit",
    "crc32",
    "crc32_of",
    "copy_with_crc32",
    "crc32_accelerated",
    "crc32_method",
    "crc32_methods",
    "crc32_with",
    "crc32_combine",
    "copy_many",
    "CrcPool",
    "CrcJob",
    "hash64",
    "hash64_many",
    "errno_advice",
]

File = _native.File
AlignedBuffer = _native.AlignedBuffer
Request = _native.Request

errno_advice = _native.errno_advice
"""``errno_advice(errno)``: what to do about it, as the native errors' messages end (``""`` for most errnos)."""
crc32 = _native.crc32
"""``crc32(address, length, crc=0)``: zlib's CRC-32 of memory, at memory speed (GIL released)."""
crc32_of = _native.crc32_of
"""``crc32_of(data, crc=0)``: the CRC-32 of a contiguous buffer (bytes, memoryview, ...); the one CRC
entry point for bytes already in Python objects (``crc32`` takes an address)."""
copy_with_crc32 = _native.copy_with_crc32
"""``copy_with_crc32(destination, source, length, crc=0)``: memcpy that returns the CRC-32 of the bytes."""
copy_many = _native.copy_many
"""``copy_many(destinations, sources, lengths, checksum)``: many small copies in one call, without the GIL
(a destination of 0 only checksums); returns each range's CRC-32 with ``checksum``, else ``[]``."""
CrcPool = _native.CrcPool
"""``CrcPool(threads)``: native threads computing CRC-32s of memory ranges without the GIL; ``submit(addresses,
lengths)`` returns a ``CrcJob`` (``done()``, ``wait()``, ``crc(index)``) at once. Owned by
:mod:`fastpersist.io.checksum`."""
CrcJob = _native.CrcJob
crc32_accelerated = _native.crc32_accelerated
crc32_method = _native.crc32_method
"""``crc32_method()``: the CRC-32 method in use, the fastest this CPU has: ``"vpclmul"`` (256-bit carry-less
multiplication, 128 bytes a step), ``"pclmul"`` (128-bit, 64 bytes a step) or ``"table"`` (slice-by-8)."""
crc32_methods = _native.crc32_methods
"""``crc32_methods()``: every CRC-32 method this CPU can run, slowest first."""
crc32_with = _native.crc32_with
"""``crc32_with(method, address, length, crc=0, copy_to=0)``: ``crc32`` by the named method (with ``copy_to``,
also the copy of ``copy_with_crc32``); for tests and benchmarks comparing methods on one machine."""
crc32_combine = _native.crc32_combine
"""``crc32_combine(crc_first, crc_second, length_second)``: CRC-32 of two ranges back to back (zlib's)."""
hash64 = _native.hash64
"""``hash64(address, length, seed=0)``: XXH64 of memory (64 bits; GIL released from 64 KiB)."""
hash64_many = _native.hash64_many
"""``hash64_many(addresses, lengths, seed=0)``: XXH64 of each range, one call without the GIL."""

ENGINE_NAMES = ("io_uring", "threads")
"""Engines fastpersist knows, best first."""

_log = logging.getLogger("fastpersist")
_fallback_logged = False
_fallback_lock = threading.Lock()


def engines_compiled() -> list[str]:
    """Engines built into the native module, best first (e.g. ``['io_uring', 'threads']``)."""
    return list(_native.engines_compiled())


@functools.cache
def _probe(name: str) -> tuple[bool, str]:
    if name not in engines_compiled():
        return False, f"{name}: not compiled into this build of fastpersist"
    ok, reason = _native.probe_engine(name)
    return bool(ok), str(reason)


def engine_status() -> dict[str, dict[str, Any]]:
    """For every known engine: ``{"compiled": bool, "usable": bool, "reason": str}``.

    ``reason`` says why an engine is not usable ("" when it is). Probing is
    done once per process.
    """
    compiled = engines_compiled()
    status = {}
    for name in ENGINE_NAMES:
        ok, reason = _probe(name)
        status[name] = {"compiled": name in compiled, "usable": ok, "reason": reason}
    return status


def resolve_engine(name: str = "auto") -> str:
    """The engine that ``name`` selects on this machine.

    Args:
        name: ``"auto"``, ``"io_uring"`` or ``"threads"``.

    Returns:
        ``"io_uring"`` or ``"threads"``. For ``auto``, falls back to
        ``threads`` when io_uring cannot start and logs why once per process.

    Raises:
        EngineUnavailableError: ``name`` names an engine that cannot start here.
        ConfigError: ``name`` is not an engine name.
    """
    global _fallback_logged
    if name == "auto":
        ok, reason = _probe("io_uring")
        if ok:
            return "io_uring"
        with _fallback_lock:
            if not _fallback_logged:
                _fallback_logged = True
                _log.warning("fastpersist: io_uring is not usable (%s); using the threads engine", reason)
        return "threads"
    if name not in ENGINE_NAMES:
        raise ConfigError(f"unknown I/O engine {name!r}; choose 'auto', {', '.join(repr(n) for n in ENGINE_NAMES)}")
    ok, reason = _probe(name)
    if not ok:
        raise EngineUnavailableError(
            f"I/O engine {name!r} cannot start on this machine: {reason}. "
            "Use engine='auto' (falls back to the threads engine) or engine='threads'."
        )
    return name


# ----------------------------------------------------------------------------- fault injection

_fault_lock = threading.Lock()
_fault_stack: list[dict[str, Any]] = []


@contextlib.contextmanager
def inject_fault(
    nth: int = 1,
    errno: int = errno_module.EIO,
    op: str = "write",
    short: bool = False,
    count: int = 1,
) -> Iterator[dict[str, Any]]:
    """Makes every :class:`IoHandle` created inside the block faulty (for tests).

    The ``nth`` chunk submission of each such handle that matches ``op``
    (counted across its lanes, 1-based) completes with ``-errno`` without
    reaching the disk, or, with ``short=True``, is submitted with half its
    length so the engine must resubmit the rest (the result must still be
    byte exact). ``count`` consecutive submissions are affected (0: all from
    ``nth`` on). Handles created outside the block are unaffected; nested
    blocks use the innermost spec. Process wide (any thread). Saves to tmpfs
    write through handles inside the block, not through a mapping of the file
    (:mod:`fastpersist.io.mapping`), so that the faults reach them.

    Args:
        nth: 1-based index of the first faulty submission.
        errno: the error to complete with (ignored when ``short``).
        op: ``"write"``, ``"read"`` or ``"any"``.
        short: shorten instead of failing.
        count: how many consecutive submissions to break.

    Yields:
        The fault spec dict passed to the native handle.
    """
    if op not in ("write", "read", "any"):
        raise ValueError(f"op must be 'write', 'read' or 'any', got {op!r}")
    if nth < 1:
        raise ValueError("nth is 1-based and must be >= 1")
    spec = {"nth": int(nth), "errno": int(errno), "op": op, "short": bool(short), "count": int(count)}
    with _fault_lock:
        _fault_stack.append(spec)
    try:
        yield spec
    finally:
        with _fault_lock:
            _fault_stack.remove(spec)


def fault_injected() -> bool:
    """Whether an :func:`inject_fault` block is active (in any thread)."""
    return _active_fault() is not None


def _active_fault() -> dict[str, Any] | None:
    with _fault_lock:
        return dict(_fault_stack[-1]) if _fault_stack else None


def _reset_after_fork() -> None:
    # Locks another parent thread may have held at fork time; rings and handles are made
    # per call, so the child makes its own.
    global _fallback_lock, _fault_lock
    _fallback_lock = threading.Lock()
    _fault_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


# ----------------------------------------------------------------------------- handle


class IoHandle(_native.IoHandle):
    """Asynchronous I/O handle (see the module docstring and docs/io-engine.md).

    Every argument left out (None) takes its value from the settings in force
    (:func:`fastpersist.config.settings`), the one source of I/O defaults.

    Args:
        block_size: bytes per chunk (multiple of 512; direct chunks are rounded to the file alignment).
        queue_depth: chunks each lane keeps in flight.
        single_submit: one submission system call per chunk (io_uring).
        overlap_events: reap while submitting (sliding window) instead of batch by batch.
        intra_op_parallelism: lanes (threads with their own engine instance).
        engine: ``auto``, ``io_uring`` or ``threads``.
        direct: use O_DIRECT for the aligned middle of requests where the file allows it.
        fault: test-only fault spec (see :func:`inject_fault`); defaults to the
            innermost active ``inject_fault`` block.

    Raises:
        EngineUnavailableError: a named engine cannot start.
        ValueError: invalid sizes.
    """

    def __init__(
        self,
        block_size: int | None = None,
        queue_depth: int | None = None,
        single_submit: bool | None = None,
        overlap_events: bool | None = None,
        intra_op_parallelism: int | None = None,
        engine: str | None = None,
        direct: bool | None = None,
        fault: dict[str, Any] | None = None,
    ) -> None:
        # One source of defaults: what is not given comes from the settings in force (fastpersist.config).
        current = config.settings()
        block_size = current.block_size if block_size is None else block_size
        queue_depth = current.queue_depth if queue_depth is None else queue_depth
        single_submit = current.single_submit if single_submit is None else single_submit
        overlap_events = current.overlap_events if overlap_events is None else overlap_events
        intra_op_parallelism = current.intra_op_parallelism if intra_op_parallelism is None else intra_op_parallelism
        engine = current.engine if engine is None else engine
        direct = current.direct if direct is None else direct
        resolve_engine(engine)  # raises for a named engine that cannot start; logs auto's fallback once
        if fault is None:
            fault = _active_fault()
        super().__init__(  # the core raises fastpersist.errors.EngineUnavailableError itself
            block_size=block_size,
            queue_depth=queue_depth,
            single_submit=single_submit,
            overlap_events=overlap_events,
            intra_op_parallelism=intra_op_parallelism,
            engine=engine,
            direct=direct,
            fault=fault,
        )
        self._constructed = True

    def __repr__(self) -> str:
        # A failed __init__ leaves no native object behind; pytest and debuggers
        # call repr() on it while showing the traceback (the native repr would crash).
        if not self.__dict__.get("_constructed", False):
            return "<fastpersist IoHandle (construction failed)>"
        return super().__repr__()


def make_handle(settings: Any = None, **overrides: Any) -> IoHandle:
    """An :class:`IoHandle` configured from :class:`fastpersist.config.Settings`.

    Args:
        settings: a Settings snapshot; ``None`` means ``fastpersist.config.settings()``.
        **overrides: handle arguments that win over ``settings`` (e.g. ``direct=False``).
    """
    if settings is None:
        settings = config.settings()
    arguments = dict(
        block_size=settings.block_size,
        queue_depth=settings.queue_depth,
        single_submit=settings.single_submit,
        overlap_events=settings.overlap_events,
        intra_op_parallelism=settings.intra_op_parallelism,
        engine=settings.engine,
        direct=settings.direct,
    )
    arguments.update(overrides)
    return IoHandle(**arguments)


def probe_directory(path: Any) -> dict[str, Any]:
    """Direct-I/O support of a directory: ``dict(direct, reason, alignment, memory_alignment, fs_type)``.

    Creates and deletes a small probe file. Raises ``OSError`` subclasses when
    the directory is missing or not writable.
    """
    return _native.probe_directory(path)


def memlock_limit() -> tuple[int | None, int | None]:
    """RLIMIT_MEMLOCK as ``(soft, hard)`` bytes; ``None`` means unlimited."""
    return _native.memlock_limit()
