"""Commit of a checkpoint file with torch.save's filesystem semantics, made atomic and durable.

How a save to a path lands (see docs/compatibility.md):

* a **regular file** (new or existing) is written to a temporary sibling in the
  directory the kernel resolves for the path, fsynced, renamed over the
  target, and the directory is fsynced. The replaced file's mode, owner and
  group (where permitted) and extended attributes (ACLs included) are carried
  over; a new file gets ``0666 & ~umask`` (and the directory's default ACL),
  as ``open()`` gives it. A file the caller may not write is refused
  (:class:`~fastpersist.errors.TargetPermissionError`) and nothing changes.
* a **special file** (character or block device, FIFO, socket, ``/dev/stdout``
  and other ``/dev`` or ``/proc`` paths) is written in place, as torch.save
  writes it, with no rename and no fsync where fsync is invalid.
* a writable regular file in a directory the caller cannot write is written
  in place, with a one-time warning that the save was not atomic; so is every
  regular file when the ``atomic`` setting is off (``atomic=False``), which
  keeps hard links and the inode.

Temporary names are ``.<name>.fastpersist-<pid>-<start>-<namespace>-<random>.tmp``
(the name is hashed when that would exceed the filesystem's name limit). The
namespace tags the host, boot and PID namespace; the start time (clock ticks
after boot) tells the writer apart from a later process with the same PID. A
save removes the temporaries that processes of its own namespace left when
they died (at any age: a dead process writes nothing more), never one whose
writer may be alive: another process's, another host's or container's, this
process's own. The directory is listed when that is cheap (at most 1% of the
time since the last listing, :data:`CLEANUP_SCAN_SHARE`); in between, the
writers of the temporaries seen at the last listing are checked again, so a
writer that died since is noticed at the next save. Names of the older form
``<pid>-<namespace>-<random>`` are still recognised, by PID alone.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import hashlib
import os
import secrets
import socket
import stat
import threading
import time
import warnings
from typing import Any

from fastpersist import config, system
from fastpersist.errors import (
    CheckpointIOError,
    NonAtomicSaveWarning,
    TargetDirectoryMissingError,
    TargetIsADirectoryError,
    TargetPermissionError,
    torch_compatible,
)
from fastpersist.io import engine, spares, timeline, workers
from fastpersist.io.stream import write_plan_to_stream
from fastpersist.io.writer import write_plan

__all__ = [
    "Target",
    "DirectoryAnchor",
    "target",
    "anchored",
    "releasing",
    "resolve_target",
    "check_target",
    "target_kind",
    "temporary_name",
    "temporary_path_pattern",
    "remove_stale_temporaries",
    "copy_metadata",
    "discard_temporary",
    "replace_file",
    "live_temporaries",
    "commit_plan",
    "fsync_directory",
    "fsync_file_object",
    "NonAtomicSaveWarning",
]

_TEMP_MARK = ".fastpersist-"
_TEMP_SUFFIX = ".tmp"
CLEANUP_SCAN_SHARE = 0.01
"""The share of the time the automatic cleanup may spend listing one directory.

A save lists its directory again only once the time since the last listing is
at least the last listing's cost divided by this share: every save in a
directory of a few thousand entries, seldom in one of 100,000 (what a
listing costs: docs/reliability.md).
"""
_WATCHED_MAX = 64  # temporaries of live writers whose writers are checked again between listings


# ----------------------------------------------------------------------------- process state


@dataclasses.dataclass
class _Listing:
    """The automatic cleanup's last listing of one directory."""

    finished: float  # time.monotonic() when it ended
    cost: float  # seconds it took (listing and checking the writers, not removing files)
    watched: dict[str, tuple[int, int | None]]  # temporaries of live writers -> (pid, start time)


_lock = threading.Lock()
_live: set[str] = set()  # temporaries this process is writing now
_listings: dict[str, _Listing] = {}  # directory -> its last cleanup listing
_warned_in_place = False


def live_temporaries() -> set[str]:
    """The temporary files this process is writing right now (for diagnostics and tests)."""
    with _lock:
        return set(_live)


def _namespace() -> str:
    """8 hex digits naming this host, boot and PID namespace: PIDs are comparable only within one."""
    parts = [socket.gethostname()]
    for source in ("/proc/self/ns/pid",):
        try:
            parts.append(str(os.stat(source).st_ino))
        except OSError:
            pass
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


_NAMESPACE = _namespace()
_STARTED = system.process_start_time(os.getpid())  # None where /proc does not say


def _reset_after_fork() -> None:
    # The child writes none of the parent's temporaries; the parent still owns them (and frees
    # the files it set aside: workers' background thread does not exist in the child). The child is a
    # new process: its own start time, and its own PID namespace after an unshare(CLONE_NEWPID).
    global _lock, _live, _listings, _NAMESPACE, _STARTED
    _lock = threading.Lock()
    _live = set()
    _listings = {}
    _NAMESPACE = _namespace()
    _STARTED = system.process_start_time(os.getpid())


os.register_at_fork(after_in_child=_reset_after_fork)


# ----------------------------------------------------------------------------- durability helpers


def fsync_file_object(f: Any) -> None:
    """fsync ``f``'s descriptor when it is a regular file or block device (pipes, sockets, ttys: nothing)."""
    try:
        descriptor = f.fileno()
    except (AttributeError, OSError, ValueError):
        return  # BytesIO and friends: nothing to make durable
    try:
        mode = os.fstat(descriptor).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode) or stat.S_ISBLK(mode):
        os.fsync(descriptor)


def fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ----------------------------------------------------------------------------- targets


def _is_magic(path: str) -> bool:
    """Paths whose meaning is not a directory entry (``/dev/stdout``, ``/proc/self/fd/1``): never renamed over."""
    absolute = os.path.abspath(path)
    return absolute.startswith(("/proc/", "/dev/fd/")) or absolute in (
        "/dev/stdout",
        "/dev/stderr",
        "/dev/stdin",
    )


def target_kind(path: str, *, magic: bool = True) -> str:
    """``"regular"`` (absent or a regular file), ``"special"`` (written in place) or ``"directory"``.

    ``magic=False`` for a path through an anchored directory (``/proc/self/fd/N/name``), which
    names an ordinary directory entry although it starts with ``/proc/``.
    """
    magic = magic and _is_magic(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "special" if magic and os.path.lexists(path) else "regular"
    except OSError:
        return "regular"  # check_target / open() report it
    if stat.S_ISDIR(mode):
        return "directory"
    if not stat.S_ISREG(mode) or magic:
        return "special"
    return "regular"


def resolve_target(path: str) -> str:
    """The path a save to ``path`` must write.

    A regular file (or a new one) is resolved as the kernel resolves it
    (symbolic links anywhere in the path, ``..`` after a symlinked directory),
    so the temporary lives in the directory that really holds the file and the
    rename replaces the file a symlink points to, not the link. Special files
    (devices, FIFOs, ``/dev/stdout``) are kept as given: they are opened in place.
    """
    path = os.fspath(path)
    if target_kind(path) != "regular":
        return path
    return os.path.realpath(path)


class DirectoryAnchor:
    """The directory an asynchronous save was asked into, held open until the save commits.

    A save that commits later than it was called (``async_save``, and every
    save of ``fastpersist.patch(mode="snapshot")``) must land in the directory
    that was there at the call, whatever happens to its path meanwhile:
    libraries rename checkpoint directories (a temporary name, then the final
    one) and delete old ones (Hugging Face Trainer's ``save_total_limit``). The
    commit therefore reaches the directory through its open descriptor
    (``/proc/self/fd/N``): a renamed directory receives the file under its new
    name; nothing is ever created at the old path, even when a new directory
    took that name; a deleted directory fails the save with
    :class:`~fastpersist.errors.TargetDirectoryMissingError` (nothing is
    written, nothing is recreated). Where ``/proc/self/fd`` is missing, the
    commit checks instead that the path still names the same directory
    (device and inode) and fails the same way when it does not.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.fd: int | None = None  # set before the open, which may raise: __del__ then closes nothing
        self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        info = os.fstat(self.fd)
        self.identity = (info.st_dev, info.st_ino)
        via = f"/proc/self/fd/{self.fd}"
        try:
            follows = os.path.samestat(os.stat(via), info)
        except OSError:
            follows = False
        self.via: str | None = via if follows else None

    def reach(self) -> str:
        """A path to the anchored directory now (``/proc/self/fd/N``, or its path where nothing moved it).

        Raises:
            TargetDirectoryMissingError: the directory was deleted, or (without /proc) moved or replaced.
        """
        if self.fd is None:
            raise ValueError("this anchor is released")
        if os.fstat(self.fd).st_nlink == 0:
            raise TargetDirectoryMissingError(
                errno.ENOENT,
                "the directory was deleted while this save was pending, so nothing was written (it is not "
                "recreated). Code that deletes a checkpoint directory right after saving into it must wait "
                "for the save first (fastpersist.wait_all())",
                self.directory,
            )
        if self.via is not None:
            return self.via
        try:
            info = os.stat(self.directory)
            same = (info.st_dev, info.st_ino) == self.identity
        except OSError:
            same = False
        if not same:
            raise TargetDirectoryMissingError(
                errno.ENOENT,
                "the directory was renamed or replaced while this save was pending; without /proc/self/fd the "
                "save cannot follow it, so nothing was written",
                self.directory,
            )
        return self.directory

    def original_name(self, name: str | None) -> str | None:
        """``name`` with the ``/proc/self/fd/N`` prefix replaced by the directory's path at the call (for errors)."""
        if name and self.via is not None and name.startswith(self.via):
            return self.directory + name[len(self.via) :]
        return name

    def release(self) -> None:
        """Closes the descriptor (idempotent)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        # A save abandoned before it was queued (an allocation error, Ctrl-C) drops its anchor unreleased.
        try:
            self.release()
        except OSError:
            pass


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a save to a path writes: made by :func:`target`, the one place every save resolves and checks it.

    Attributes:
        path: the file to write, resolved as the kernel resolves it
            (:func:`resolve_target`).
        directory: its directory (checked: it exists and may be written).
        given: the path as the caller gave it (torch names the archive's
            top-level folder after its stem).
        anchor: for a save that commits later (:func:`anchored`), the
            directory held open (:class:`DirectoryAnchor`); None otherwise.
    """

    path: str
    directory: str
    given: str
    anchor: DirectoryAnchor | None = None

    def release(self) -> None:
        """Closes the anchor, if any (idempotent): call once the save committed or was abandoned."""
        if self.anchor is not None:
            self.anchor.release()


def target(path: str | os.PathLike[str]) -> Target:
    """Resolves and checks the target of a save (:func:`resolve_target`, then :func:`check_target`).

    Raises:
        as :func:`check_target`.
    """
    given = os.fspath(path)
    resolved = resolve_target(given)
    return Target(resolved, check_target(resolved), given)


def anchored(destination: Target) -> Target:
    """``destination`` with its directory held open (:class:`DirectoryAnchor`), for a save that commits later.

    Only a regular target gets an anchor (special files are written in place
    by their path). Call :meth:`Target.release` once the save is done.

    Raises:
        FileNotFoundError, NotADirectoryError: the directory is gone already.
    """
    if destination.anchor is not None or target_kind(destination.path) != "regular":
        return destination
    return dataclasses.replace(destination, anchor=DirectoryAnchor(destination.directory))


def releasing(work, destination):
    """``work`` followed, whatever happens, by the release of ``destination``'s anchor (a no-op without one)."""
    release = getattr(destination, "release", None)
    if release is None:
        return work

    def run() -> None:
        try:
            work()
        finally:
            release()

    return run


def check_target(path: str) -> str:
    """The target's directory; raises the error torch.save's open() would, with advice.

    Raises:
        TargetIsADirectoryError: (IsADirectoryError and RuntimeError) ``path`` is a directory.
        TargetDirectoryMissingError: (FileNotFoundError and RuntimeError) its directory is missing.
        TargetPermissionError: (PermissionError and RuntimeError) the file exists and may not be
            written, or it does not exist and its directory may not be written.
        CheckpointIOError: (OSError and RuntimeError) errno EROFS on a read-only filesystem.
    """
    directory = os.path.dirname(os.path.abspath(path))
    kind = target_kind(path)
    if kind == "directory":
        raise TargetIsADirectoryError(
            errno.EISDIR,
            "cannot save a checkpoint over a directory; pass a file path",
            path,
        )
    if kind == "special":
        if not os.access(path, os.W_OK):
            raise TargetPermissionError(errno.EACCES, "no permission to write this file", path)
        return directory
    if not os.path.isdir(directory):
        raise TargetDirectoryMissingError(
            errno.ENOENT,
            "the directory to save into does not exist; create it first (os.makedirs)",
            directory,
        )
    exists = os.path.exists(path)
    if os.statvfs(directory).f_flag & os.ST_RDONLY:  # root gets here too: access() checks the mount
        raise CheckpointIOError(
            errno.EROFS,
            "the filesystem is mounted read-only; save to another filesystem",
            directory,
        )
    if exists and not os.access(path, os.W_OK):
        raise TargetPermissionError(
            errno.EACCES,
            "no permission to write this file (torch.save refuses it too); nothing was changed",
            path,
        )
    if not exists and not os.access(directory, os.W_OK | os.X_OK):
        raise TargetPermissionError(errno.EACCES, "no permission to create files in this directory", directory)
    return directory


# ----------------------------------------------------------------------------- temporaries


def _name_max(directory: str) -> int:
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return 255


def temporary_name(
    name: str, directory: str = ".", pid: int | None = None, token: str | None = None, started: int | None = None
) -> str:
    """The temporary file name for a save of ``name`` (a base name) into ``directory``.

    ``.<name>.fastpersist-<pid>-<started>-<namespace>-<token>.tmp``; when that would
    not fit the filesystem's name limit, ``<name>`` is replaced by a hash of it.
    ``pid`` and ``started`` default to this process's PID and start time
    (:func:`fastpersist.system.process_start_time`). Without a start time (another
    ``pid`` given alone, or no /proc) the name has the older form
    ``<pid>-<namespace>-<token>``, whose writer is judged by its PID alone.
    """
    if pid is None:
        pid, started = os.getpid(), _STARTED
    token = secrets.token_hex(4) if token is None else token
    owner = f"{pid}" if started is None else f"{pid}-{started}"
    tail = f"{_TEMP_MARK}{owner}-{_NAMESPACE}-{token}{_TEMP_SUFFIX}"
    candidate = f".{name}{tail}"
    if len(os.fsencode(candidate)) <= _name_max(directory):
        return candidate
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:32]
    return f".{digest}{tail}"


def temporary_path_pattern(path: str) -> str:
    """The glob that matches the temporary files saves into ``path``'s directory may leave after a crash."""
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.join(glob.escape(directory), f".*{_TEMP_MARK}*{_TEMP_SUFFIX}")


def _parse_temporary(basename: str) -> tuple[int, int | None, str] | None:
    """(pid, start time or None, namespace) of a temporary name, None if it is not one."""
    if not basename.startswith(".") or not basename.endswith(_TEMP_SUFFIX) or _TEMP_MARK not in basename:
        return None
    fields = basename[: -len(_TEMP_SUFFIX)].rsplit(_TEMP_MARK, 1)[1].split("-")
    try:
        if len(fields) == 4:
            return int(fields[0]), int(fields[1]), fields[2]
        if len(fields) == 3:  # written before names carried the start time
            return int(fields[0]), None, fields[1]
    except ValueError:
        pass
    return None


def _writer_gone(pid: int, started: int | None) -> bool:
    """Whether the process that named a temporary of this namespace is provably gone.

    Only then may its temporary go: any doubt (a /proc that does not show the
    process, as under ``hidepid``) keeps the file.
    """
    if pid == os.getpid():
        if _STARTED is None:
            return False  # this process writes names without a start time too: it may be ours
        # Ours now are named with our start time (and may be in flight unregistered, as the
        # collective save's are); another start time, or none, is an earlier holder of our PID.
        return started != _STARTED
    # Names of the older form carry no start time: the PID is all there is to go by.
    return not system.process_alive(pid, started)


def _unlink_stale(candidate: str, min_age: float, now: float) -> bool:
    try:
        if min_age > 0 and now - os.lstat(candidate).st_mtime < min_age:
            return False
        os.unlink(candidate)
    except OSError:
        return False  # gone already, or not ours to delete (sticky directory): never block a save
    return True


def remove_stale_temporaries(path: str, min_age: float = 0.0) -> list[str]:
    """Removes temporaries that killed saves left in ``path``'s directory; returns the removed paths.

    Only temporaries of this host, boot and PID namespace whose writer is
    provably gone (its PID is free or a zombie's, or held by a process that
    started at another time), never one of this process. ``min_age`` (seconds) spares
    younger ones too; by default age does not matter, since a dead writer
    writes nothing more. Lists the directory every time it is called (saves
    call it through a throttle, see the module docstring); never raises:
    files it may not delete (sticky directories) and a directory it cannot
    list are skipped.
    """
    directory = os.path.dirname(os.path.abspath(path))
    began = time.perf_counter()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    with _lock:
        live = set(_live)
    doomed, watched = [], {}
    for name in names:
        if _TEMP_MARK not in name:
            continue
        parsed = _parse_temporary(name)
        candidate = os.path.join(directory, name)
        if parsed is None or candidate in live:
            continue
        pid, started, namespace = parsed
        if namespace != _NAMESPACE:
            continue  # another host, boot or container: its PIDs mean nothing here
        if _writer_gone(pid, started):
            doomed.append(candidate)
        elif pid != os.getpid() and len(watched) < _WATCHED_MAX:
            watched[candidate] = (pid, started)
    cost = time.perf_counter() - began
    now = time.time()
    removed = [candidate for candidate in doomed if _unlink_stale(candidate, min_age, now)]
    with _lock:
        if len(_listings) >= 4096:
            _listings.clear()
        _listings[directory] = _Listing(time.monotonic(), cost, watched)
    return removed


def _maybe_remove_stale(directory: str) -> None:
    """The automatic cleanup before a save: a listing when it is cheap, else a check of the watched writers.

    A listing's cost grows with the directory (docs/reliability.md), so it
    runs when the time since the last one is at least its cost divided by
    CLEANUP_SCAN_SHARE. In between, the writers of the temporaries the last
    listing saw alive are checked again (a signal 0 and a read of /proc each),
    and the temporaries of those that died since are removed.
    """
    now = time.monotonic()
    with _lock:
        listing = _listings.get(directory)
        due = listing is None or now - listing.finished >= listing.cost / CLEANUP_SCAN_SHARE
        watched = [] if due else list(listing.watched.items())
    if due:
        remove_stale_temporaries(os.path.join(directory, "x"))
        return
    for candidate, (pid, started) in watched:
        if _writer_gone(pid, started):
            _unlink_stale(candidate, 0.0, 0.0)
            with _lock:
                listing.watched.pop(candidate, None)


# ----------------------------------------------------------------------------- commit


def commit_plan(
    plan, destination: Target, settings: config.Settings, streams, *, before_commit=None, after_reads=None
) -> None:
    """Writes ``plan`` to ``destination`` (from :func:`target`) with the semantics in the module docstring.

    ``before_commit``, if given, is called once every byte is written: before the rename of
    an atomic save, whose failure it then aborts (the temporary file is removed, ``path`` is
    untouched); after the write of an in-place save (special targets, ``atomic=False``),
    where it can only report. ``after_reads``: as :func:`~fastpersist.io.writer.write_plan`'s
    (called once the plan's tensors have been read; for special targets, after the write).

    Raises:
        CheckpointIOError: (an ``OSError`` with ``errno`` and a ``RuntimeError``, as
            torch.save raises) a full disk, a read-only filesystem, an I/O error. A full
            disk while replacing a file says how much room the atomic replace needed.
        TargetPermissionError, TargetDirectoryMissingError: as :func:`check_target`.
    """
    path, directory = destination.path, destination.directory
    anchor = destination.anchor
    try:
        if anchor is not None:  # the directory held open at the call, wherever it is now
            _maybe_remove_stale(directory)
            reached = anchor.reach()
            path = os.path.join(reached, os.path.basename(path))
            _commit_plan(plan, path, reached, settings, streams, before_commit, after_reads, through_anchor=True)
        else:
            _commit_plan(plan, path, directory, settings, streams, before_commit, after_reads)
    except OSError as error:
        if anchor is not None:
            error.filename = anchor.original_name(error.filename)
            path, directory = destination.path, destination.directory
        raise torch_compatible(error, saving=True, detail=_explain(error, plan, path, directory, settings)) from None


def _explain(error: OSError, plan, path: str, directory: str, settings: config.Settings) -> str:
    """What a full disk means for this save, with the sizes (empty for other errors)."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return ""
    try:
        stat = os.statvfs(directory)
        free = f"{stat.f_bavail * stat.f_frsize / 1e6:,.1f} MB free now"
    except OSError:
        free = "free space unknown"
    new = f"{plan.size / 1e6:,.1f} MB"
    replacing = getattr(settings, "atomic", True) and target_kind(path) == "regular" and os.path.exists(path)
    if not replacing:
        return f"the checkpoint needs {new} ({free})"
    old = f"{os.path.getsize(path) / 1e6:,.1f} MB"
    return (
        f"replacing {path!r} ({old}) atomically writes the new checkpoint ({new}) completely beside it and "
        f"removes the old one only after the rename, so the filesystem needs room for both ({free}); the old "
        "file is intact. Free space, save to another filesystem, or pass atomic=False to overwrite it in "
        "place as torch.save does (the old checkpoint is then lost if that save fails)"
    )


def _commit_plan(
    plan,
    path: str,
    directory: str,
    settings: config.Settings,
    streams,
    before_commit,
    after_reads,
    through_anchor=False,
) -> None:
    kind = target_kind(path, magic=not through_anchor)
    if kind == "special":
        _write_special(plan, path, settings)
        if after_reads is not None:
            after_reads([])
        if before_commit is not None:
            before_commit()
        return
    atomic = getattr(settings, "atomic", True)
    if atomic and os.path.exists(path) and not os.access(directory, os.W_OK | os.X_OK):
        _warn_in_place(path, directory)
        atomic = False
    if not atomic:
        _write_in_place(plan, path, directory, settings, streams, after_reads)
        if before_commit is not None:
            before_commit()
        return
    if not through_anchor:  # an anchored save cleans its directory by its path (commit_plan)
        _maybe_remove_stale(directory)
    spare = spares.take(directory, os.path.basename(path))  # the file the last save here replaced (io.spares)
    if spare is None:
        temporary = os.path.join(directory, temporary_name(os.path.basename(path), directory))
    else:
        temporary, descriptor = os.path.join(directory, spare[0]), spare[1]
    with _lock:
        _live.add(temporary)
    try:
        if spare is None:
            # O_EXCL: never write into someone else's file. Mode 0666 lets the kernel apply the
            # umask (and the directory's default ACL), exactly as open() does for a new file.
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            file = engine.File(temporary, "w", direct=settings.direct, truncate=False, create=False)
            try:
                if file.direct:
                    # Reserving the blocks first makes O_DIRECT writes cheaper here and fails a full
                    # disk before any byte is written. On tmpfs (buffered) it would only zero-fill
                    # every page before the copy overwrites it. A spare's blocks are there already.
                    file.allocate(0, plan.size)
                timeline.mark("opened")
                write_plan(plan, file, settings, streams=streams, after_reads=after_reads)
                if spare is not None:
                    file.truncate(plan.size)  # a spare larger than this checkpoint
                if settings.fsync:
                    file.fsync()
                    timeline.mark("fsynced")
            finally:
                file.close()
            _copy_metadata(path, descriptor, reused=spare is not None)
        finally:
            os.close(descriptor)
        if before_commit is not None:
            before_commit()
        replace_file(temporary, path, directory, keep=settings.reuse_replaced == "always")
        timeline.mark("renamed")
    except BaseException as e:
        discard_temporary(temporary)  # never masks the error being raised
        if isinstance(e, OSError) and e.filename == temporary:
            e.add_note(f"while saving {path!r}: the previous file there is untouched and the temporary file is removed")
        raise
    finally:
        with _lock:
            _live.discard(temporary)
    if settings.fsync:
        fsync_directory(directory)
    timeline.mark("committed")


def _warn_in_place(path: str, directory: str) -> None:
    global _warned_in_place
    with _lock:
        if _warned_in_place:
            return
        _warned_in_place = True
    warnings.warn(
        f"fastpersist: cannot create files in {directory!r}, so {path!r} was overwritten in place, as torch.save "
        "does: the save was not atomic (an interruption would leave a damaged file). Make the directory "
        "writable for atomic saves. This warning is shown once.",
        NonAtomicSaveWarning,
        stacklevel=4,
    )


def _write_in_place(plan, path: str, directory: str, settings: config.Settings, streams, after_reads=None) -> None:
    """torch.save's way: open (create 0666 & ~umask, or truncate) and write the file itself."""
    created = not os.path.exists(path)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        file = engine.File(path, "w", direct=settings.direct, truncate=False, create=False)
        try:
            write_plan(plan, file, settings, streams=streams, after_reads=after_reads)
            if settings.fsync:
                file.fsync()
        finally:
            file.close()
    finally:
        os.close(descriptor)
    if settings.fsync and created:
        fsync_directory(directory)


def _write_special(plan, path: str, settings: config.Settings) -> None:
    """Devices, FIFOs, ``/dev/stdout``: one sequential stream, as torch.save writes them."""
    with open(path, "wb", buffering=0) as stream:
        write_plan_to_stream(plan, stream, checksum=settings.checksum, chunk_size=settings.buffer_size)
        if settings.fsync:
            fsync_file_object(stream)  # block devices only


DEFER_REMOVAL_BYTES = 64 << 20
"""A replaced file at least this large is freed by a helper thread after the rename (see replace_file)."""


def replace_file(temporary: str, target: str, directory: str, keep: bool = False) -> None:
    """``os.replace(temporary, target)``, freeing a large replaced file off the caller's path.

    Renaming over a file frees its blocks inside the rename when that was its
    last link, which takes long on a filesystem that discards freed blocks
    (measured in docs/reliability.md). So a replaced regular file of at least
    DEFER_REMOVAL_BYTES with one link first gets a second, temporary name
    (a hard link, named and tracked like our temporaries, so a crash leaves
    nothing that the stale-temporary cleanup would not remove); the rename
    then only moves a name, and a helper thread unlinks the old file. Where
    hard links are not possible, the rename frees the file as before. Pending
    removals finish at interpreter exit. With ``keep`` the set-aside file is
    kept for the next save of ``target`` instead (:mod:`fastpersist.io.spares`).
    """
    aside = _set_aside(target, directory)
    try:
        os.replace(temporary, target)
    except BaseException:
        if aside is not None:
            _remove_aside(aside)
        raise
    if aside is not None:
        if keep and spares.keep(directory, os.path.basename(aside), os.path.basename(target)):
            with _lock:
                _live.discard(aside)  # a spare now: io.spares frees it, or a save writes it
            return
        workers.in_background(_remove_aside, aside)


def _set_aside(target: str, directory: str) -> str | None:
    try:
        info = os.lstat(target)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_size < DEFER_REMOVAL_BYTES:
        return None
    aside = os.path.join(directory, temporary_name(os.path.basename(target), directory))
    with _lock:
        _live.add(aside)
    try:
        os.link(target, aside, follow_symlinks=False)
    except OSError:  # no hard links here (FAT, some FUSE), or the target just vanished
        with _lock:
            _live.discard(aside)
        return None
    return aside


def _remove_aside(aside: str) -> None:
    try:
        os.unlink(aside)
    except OSError:
        pass  # a crash-leftover cleaner got there first: nothing else can hold this name
    finally:
        with _lock:
            _live.discard(aside)


def discard_temporary(temporary: str) -> None:
    """Removes a temporary file on an error path; never raises (the error being handled wins)."""
    try:
        os.unlink(temporary)
    except OSError:
        pass


def copy_metadata(existing: str, temporary: str) -> None:
    """Gives ``temporary`` the owner, group, xattrs and mode of ``existing`` (nothing if it does not exist)."""
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CLOEXEC)
    try:
        _copy_metadata(existing, descriptor)
    finally:
        os.close(descriptor)


def _copy_metadata(existing: str, descriptor: int, reused: bool = False) -> None:
    """Gives the temporary what an in-place write would have kept: owner, group, xattrs/ACLs, mode.

    ``reused``: the temporary is a spare (an earlier file of this path), whose xattrs that ``existing`` lacks go.
    """
    try:
        st = os.stat(existing)
    except FileNotFoundError:
        return  # a new file: open() already applied the umask and default ACL (a spare needs the target)
    if reused:
        try:
            extra = set(os.listxattr(descriptor)) - set(os.listxattr(existing))
        except OSError:
            extra = set()
        for name in extra:
            try:
                os.removexattr(descriptor, name)
            except OSError:
                pass
    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.fchown(descriptor, st.st_uid, st.st_gid)
        except OSError:
            try:
                os.fchown(descriptor, -1, st.st_gid)  # a member of the group may keep the group
            except OSError:
                pass
    try:
        names = os.listxattr(existing)
    except OSError:
        names = []
    for name in names:
        try:
            os.setxattr(descriptor, name, os.getxattr(existing, name))
        except OSError:
            pass  # security.* for non-root, filesystems without xattrs: keep what can be kept
    os.fchmod(descriptor, stat.S_IMODE(st.st_mode))
