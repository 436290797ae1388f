"""What the operating system says about this process and machine, read in one place (from /proc and /sys).

Linux's /proc is the one source (no psutil): the memory still available,
effective capabilities, transparent huge pages, the filesystem holding a
path, whether a process is alive and when it started. Also the one way to
empty the page cache before a cold read (:class:`CacheDropper`) and to find
fio. Every reader returns ``None`` (or a documented fallback) where the file
does not exist, so callers work on other systems too. Imports nothing from
fastpersist.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import sys
from collections.abc import Iterable
from typing import Any

__all__ = [
    "status_field",
    "CacheDropper",
    "FIO_INSTALL_HINT",
    "available_memory",
    "cpu_model",
    "effective_capability",
    "files_under",
    "filesystem_of",
    "find_fio",
    "free_page_reporting",
    "process_alive",
    "process_start_time",
    "release_memory",
    "transparent_huge_pages",
]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

FIO_INSTALL_HINT = (
    "fio is not installed; install it for an independent storage ceiling "
    "(Debian/Ubuntu: apt-get install fio; RHEL/Fedora: dnf install fio; conda: conda install -c conda-forge fio)"
)


# --------------------------------------------------------------------- /proc readers


def status_field(name: str) -> str | None:
    """The value of ``name:`` in /proc/self/status (e.g. ``VmHWM``, ``CapEff``), or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (what can be allocated without swapping), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def effective_capability(bit: int) -> bool | None:
    """Whether this process holds capability ``bit`` (e.g. 14, CAP_IPC_LOCK), or None when unknown."""
    value = status_field("CapEff")
    return None if value is None else bool(int(value, 16) >> bit & 1)


def transparent_huge_pages() -> str | None:
    """The selected mode of /sys/kernel/mm/transparent_hugepage/enabled (``always``, ``madvise``, ``never``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()


_BALLOON_DEVICES = "/sys/bus/virtio/drivers/virtio_balloon"
_BALLOON_F_REPORTING = 5
"""VIRTIO_BALLOON_F_REPORTING: the guest reports free pages, and the host takes their memory back."""


def free_page_reporting(balloon_devices: str = _BALLOON_DEVICES) -> bool:
    """Whether this virtual machine hands the memory it frees back to its host (virtio-balloon free page reporting).

    Such a guest reports free blocks of 2 MiB and more to the host a few seconds after they are freed,
    and the host drops their backing. A 2 MiB transparent huge page later made from such a block is
    slow to fault in (on the development VM: 0.15 GB/s, against 0.9 GB/s for 4 KiB pages, which come
    from smaller free blocks that are never reported; docs/checkpoint-benchmark.md). Read from the
    negotiated feature bits in ``balloon_devices/*/features``; False where there is no such device
    (bare metal, other hypervisors' balloons).
    """
    try:
        names = sorted(os.listdir(balloon_devices))
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(balloon_devices, name, "features"), encoding="ascii") as f:
                bits = f.read().strip()
        except OSError:
            continue  # not a device (bind, unbind, uevent, module)
        if len(bits) > _BALLOON_F_REPORTING and bits[_BALLOON_F_REPORTING] == "1":
            return True
    return False


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def process_alive(pid: int, started: int | None = None) -> bool:
    """Whether process ``pid`` can still be running code: a zombie (exited, not yet reaped) cannot.

    With ``started`` (its :func:`process_start_time`), whether that very process
    can: a later process given the same PID does not count. True where
    /proc does not say (another user's process under ``hidepid``).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's: /proc may still say whether it is a zombie, and when it started
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return fields[0] != b"Z" and (started is None or int(fields[19]) == started)
    except (OSError, IndexError, ValueError):
        return True


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (/proc/<pid>/stat field 22), or None.

    A PID names one process only while it lives; the PID and this start time
    name it for the whole boot (see :func:`process_alive`). None where the
    process is gone or /proc does not show it.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def filesystem_of(path: str) -> dict[str, Any]:
    """Mount point, filesystem type, device, mount options and free space of the filesystem holding ``path``."""
    path = os.path.realpath(path)
    info: dict[str, Any] = {"path": path}
    best = ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 4:
                    continue
                device, mount, fstype, options = fields[:4]
                mount = mount.replace("\\040", " ")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best = mount
                    info.update(mount_point=mount, type=fstype, device=device, options=options)
    except OSError:
        pass
    try:
        usage = shutil.disk_usage(path)
        info.update(total_bytes=usage.total, free_bytes=usage.free)
    except OSError:
        pass
    return info


_libc = None


def release_memory(collect: bool = True) -> None:
    """Collects garbage (unless ``collect`` is False) and returns freed heap to the OS (glibc malloc_trim)."""
    global _libc
    if collect:
        gc.collect()
    if sys.platform.startswith("linux"):
        try:
            if _libc is None:
                _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim(0)
        except (OSError, AttributeError):
            pass


def find_fio() -> str | None:
    """The path of the fio executable, or None (then show :data:`FIO_INSTALL_HINT`)."""
    return shutil.which("fio")


# --------------------------------------------------------------------- page cache


def files_under(path: str) -> list[str]:
    """``path`` itself when it is a file, else every regular file below it (sorted)."""
    if os.path.isfile(path):
        return [path]
    found: list[str] = []
    for root, _dirs, names in os.walk(path):
        found.extend(os.path.join(root, n) for n in sorted(names))
    return sorted(found)


class CacheDropper:
    """Empties the page cache of files about to be read: the one cache-drop helper.

    ``mode`` is decided once, at construction:

    * ``drop_caches``: ``sync`` then ``echo 3 > /proc/sys/vm/drop_caches``
      (root, and /proc/sys writable) -- the whole cache, as after a reboot;
    * ``fadvise``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file after
      fsync -- drops those files' clean pages; works for any user;
    * ``none``: neither works (not Linux); reads may hit the cache;
    * ``disabled``: the caller asked for warm reads.

    ``detail`` says the same in a sentence, for reports.
    """

    def __init__(self, enabled: bool = True):
        self.detail = ""
        if not enabled:
            self.mode = "disabled"
            self.detail = "page cache not dropped (--no-drop-caches): loads may be served from memory"
            return
        if self._try_drop_caches():
            self.mode = "drop_caches"
            self.detail = "page cache dropped before every load (sync; echo 3 > /proc/sys/vm/drop_caches)"
        elif hasattr(os, "posix_fadvise"):
            self.mode = "fadvise"
            self.detail = (
                "could not write /proc/sys/vm/drop_caches (needs root); dropped each file's pages "
                "with posix_fadvise(DONTNEED) before every load"
            )
        else:
            self.mode = "none"
            self.detail = "could not drop the page cache on this system: loads may be served from memory"

    @staticmethod
    def _try_drop_caches() -> bool:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return True
        except OSError:
            return False

    def drop(self, paths: Iterable[str]) -> str:
        """Drops the cache of ``paths`` (files or directories); returns the mode actually used.

        Raises:
            OSError: opening or fsyncing one of the files (fadvise mode).
        """
        if self.mode == "drop_caches":
            if self._try_drop_caches():
                return "drop_caches"
            self.mode = "fadvise"  # lost the permission mid-run (unusual); degrade, and say so per sample
        if self.mode == "fadvise":
            for path in paths:
                for file in files_under(path):
                    descriptor = os.open(file, os.O_RDONLY)
                    try:
                        os.fsync(descriptor)  # DONTNEED skips dirty pages
                        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(descriptor)
            return "fadvise"
        return self.mode
