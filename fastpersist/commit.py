"""Atomic, durable commit of a checkpoint file: temporary sibling, fsync, rename, directory fsync.

Also the target checks that give torch.save's errors with advice, and the
removal of temporaries that a killed save left behind.
"""

from __future__ import annotations

import errno
import glob
import os
import secrets
from typing import Any

from fastpersist import config, system
from fastpersist.io import engine
from fastpersist.io.writer import write_plan

__all__ = [
    "resolve_target",
    "check_target",
    "temporary_path_pattern",
    "remove_stale_temporaries",
    "commit_plan",
    "fsync_directory",
    "fsync_file_object",
]

_TEMP_MARK = ".fastpersist-"


def fsync_file_object(f: Any) -> None:
    try:
        descriptor = f.fileno()
    except (AttributeError, OSError, ValueError):
        return  # BytesIO and friends: nothing to make durable
    os.fsync(descriptor)


def resolve_target(path: str) -> str:
    """The file a save to ``path`` must replace.

    torch.save writes through a symbolic link into the file it points to; the
    atomic rename must do the same instead of replacing the link itself.
    """
    return os.path.realpath(path) if os.path.islink(path) else path


def check_target(path: str) -> str:
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


def remove_stale_temporaries(path: str) -> None:
    """Removes temporaries of earlier saves to ``path`` whose process is gone (killed mid-save)."""
    for candidate in glob.glob(temporary_path_pattern(path)):
        try:
            pid = int(os.path.basename(candidate)[len(os.path.basename(path)) + 1 + len(_TEMP_MARK) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and system.process_alive(pid):
            continue  # another process may be saving to the same path right now
        try:
            os.unlink(candidate)
        except FileNotFoundError:
            pass


def commit_plan(plan, path: str, directory: str, settings: config.Settings, streams) -> None:
    """Writes ``plan`` to a temporary file beside ``path``, makes it durable, renames it over ``path``."""
    remove_stale_temporaries(path)
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
        fsync_directory(directory)


def _copy_mode(existing: str, temporary: str) -> None:
    """Keeps the permission bits of a file being replaced, as writing it in place would."""
    try:
        mode = os.stat(existing).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(temporary, mode)


def fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

