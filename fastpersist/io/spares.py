"""Replaced checkpoint files kept for the next save of the same path (the ``reuse_replaced`` setting).

A save that replaces a file frees the old file's blocks, and the next save
allocates new ones. On a filesystem that discards freed blocks (ext4 mounted
with ``discard``, as cloud machines' disks often are) freeing a checkpoint
costs the disk about as much time as writing it, so a checkpoint every few
steps ran at half the disk's speed (docs/performance.md). A kept file, a
*spare*, is overwritten in place by the next save of its path instead: no
block is allocated, freed or discarded.

* A spare is the replaced file itself under a temporary name of this process
  (the hard link :func:`fastpersist.io.commit.replace_file` makes before its
  rename), so a crash leaves nothing the stale-temporary cleanup would not
  remove, and no other process's cleanup touches it while this one lives.
* :func:`take` hands it only to the next save of the same path, and only
  while that path still names the file this process wrote there (nothing else
  replaced it), the spare has no other link, and no descriptor or mapping
  anywhere has it open: a write lease can be placed only then
  (``F_SETLEASE``). A reader that still holds the previous checkpoint keeps it
  intact; that save then writes a fresh file and the spare is freed.
* A spare no save took is freed :data:`SPARE_SECONDS` after it was kept (by a
  thread of its own that ends with the last spare), at interpreter exit, and
  by :func:`release` (``fastpersist.release_buffers()``). A forked child
  forgets its parent's spares without freeing them.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import stat
import threading
import time

from fastpersist.io import workers

__all__ = ["SPARE_SECONDS", "keep", "take", "release", "kept"]

SPARE_SECONDS = 30.0
"""How long a spare waits for the next save of its path before it is freed."""


@dataclasses.dataclass(frozen=True)
class _Spare:
    directory: int  # an O_PATH descriptor of the directory: names below are resolved there, whatever path reached it
    name: str  # the spare's temporary name
    identity: tuple[int, int]  # (st_dev, st_ino) of the spare
    target: tuple[int, int]  # what the target name held after the rename: the file this process wrote
    size: int
    deadline: float  # time.monotonic()


_lock = threading.Lock()
_wake = threading.Condition(_lock)
_spares: dict[tuple[int, int, str], _Spare] = {}  # (directory's st_dev, st_ino, target name) -> its spare
_reaping = False  # a reaper thread runs (it ends when no spare is left)
_closing = False  # interpreter exit began: no new spare


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def keep(directory: str, spare: str, target: str) -> bool:
    """Keeps the file named ``spare`` in ``directory`` (the one just replaced at the name ``target`` there) for
    the next save of ``target``. False where it cannot be kept (interpreter exit, no thread may start, a name
    gone): the caller frees it. A spare kept earlier for ``target`` is freed.
    """
    global _reaping
    try:
        handle = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        kept_file = os.stat(spare, dir_fd=handle, follow_symlinks=False)
        written = os.stat(target, dir_fd=handle, follow_symlinks=False)
        key = (*_identity(os.fstat(handle)), target)
    except OSError:
        os.close(handle)
        return False
    deadline = time.monotonic() + SPARE_SECONDS
    entry = _Spare(handle, spare, _identity(kept_file), _identity(written), kept_file.st_size, deadline)
    with _lock:
        if _closing or not workers.threads_allowed():
            os.close(handle)
            return False
        previous = _spares.pop(key, None)
        _spares[key] = entry
        start, _reaping = not _reaping, True
        _wake.notify_all()
    if previous is not None:
        workers.in_background(_free, previous)  # freeing takes disk time where freed blocks are discarded
    if start:
        try:
            workers.detached("fastpersist-spares", _reap)
        except RuntimeError:  # no thread can start: the caller frees it now; the save itself succeeded
            with _lock:
                _reaping = False
                _spares.pop(key, None)
            os.close(handle)
            return False
    return True


def take(directory: str, target: str) -> tuple[str, int] | None:
    """The name of ``target``'s spare in ``directory`` and a read-write descriptor of it, for a save to write
    into; None if there is none or it may not be overwritten (then it is freed). The caller closes the
    descriptor."""
    try:
        key = (*_identity(os.stat(directory)), target)
    except OSError:
        return None
    with _lock:
        spare = _spares.pop(key, None)
    if spare is None:
        return None
    descriptor = -1
    try:
        # replaced by someone else: the spare may be what they renamed away
        usable = _identity(os.stat(target, dir_fd=spare.directory, follow_symlinks=False)) == spare.target
        if usable:
            descriptor = os.open(spare.name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=spare.directory)
            info = os.fstat(descriptor)
            usable = stat.S_ISREG(info.st_mode) and _identity(info) == spare.identity and info.st_nlink == 1
        if usable:
            # Placed only if no other descriptor or mapping has the file open (this process's included);
            # dropped at once, so no lease-break signal can ever come.
            fcntl.fcntl(descriptor, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            fcntl.fcntl(descriptor, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        usable = False
    if not usable:
        if descriptor >= 0:
            os.close(descriptor)
        workers.in_background(_free, spare)
        return None
    os.close(spare.directory)
    return spare.name, descriptor


def kept() -> dict[str, str]:
    """Target path -> its spare's path (for diagnostics and tests)."""
    with _lock:
        entries = list(_spares.items())
    found = {}
    for (_, _, target), spare in entries:
        try:
            directory = os.readlink(f"/proc/self/fd/{spare.directory}")
        except OSError:
            continue
        found[os.path.join(directory, target)] = os.path.join(directory, spare.name)
    return found


def release() -> int:
    """Frees every spare now; returns their bytes."""
    with _lock:
        doomed = list(_spares.values())
        _spares.clear()
        _wake.notify_all()
    for spare in doomed:
        _free(spare)
    return sum(spare.size for spare in doomed)


def _free(spare: _Spare) -> None:
    try:
        os.unlink(spare.name, dir_fd=spare.directory)
    except OSError:
        pass  # gone already: only this process's cleanup could have removed it
    finally:
        os.close(spare.directory)


def _reap() -> None:
    """Frees each spare at its deadline; ends when none is left."""
    global _reaping
    while True:
        with _lock:
            while True:
                if not _spares:
                    _reaping = False
                    return
                now = time.monotonic()
                due = [target for target, spare in _spares.items() if _closing or spare.deadline <= now]
                if due:
                    doomed = [_spares.pop(target) for target in due]
                    break
                _wake.wait(min(spare.deadline for spare in _spares.values()) - now)
        for spare in doomed:
            _free(spare)


def _close_at_exit() -> None:
    global _closing
    with _lock:
        _closing = True
        _wake.notify_all()
    release()


def _forget_after_fork() -> None:
    global _lock, _wake, _spares, _reaping, _closing
    for spare in _spares.values():
        os.close(spare.directory)  # the child's copy of the descriptor; the file stays the parent's
    _lock = threading.Lock()
    _wake = threading.Condition(_lock)
    _spares, _reaping, _closing = {}, False, False  # the parent's: its own to free, never the child's


os.register_at_fork(after_in_child=_forget_after_fork)
# threading's exit hooks run before the interpreter joins threads (the reaper among them) and before atexit.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_close_at_exit)
