"""Measuring tools shared by the checkpoint benchmark and the tuner.

What a measurement needs besides a clock: durability (:func:`fsync_paths`),
a cold page cache before reads (:class:`CacheDropper`), peak host memory
(:class:`PeakMemory`), and a description of the machine
(:func:`machine_info`). None of this imports fastpersist's I/O stack, so the
baselines can be measured on a machine where fastpersist does not build.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = [
    "summarize",
    "fsync_paths",
    "files_under",
    "remove_path",
    "CacheDropper",
    "PeakMemory",
    "current_rss",
    "release_memory",
    "machine_info",
    "filesystem_of",
    "DistributedEnv",
    "distributed_env",
    "timer",
    "sigterm_as_interrupt",
]


# --------------------------------------------------------------------- statistics


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """``{"median", "min", "max", "n"}`` of ``values``, or None when empty."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# --------------------------------------------------------------------- durability


def files_under(path: str) -> list[str]:
    """``path`` itself when it is a file, else every regular file below it (sorted)."""
    if os.path.isfile(path):
        return [path]
    found: list[str] = []
    for root, _dirs, names in os.walk(path):
        found.extend(os.path.join(root, n) for n in sorted(names))
    return sorted(found)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_paths(path: str) -> None:
    """Makes ``path`` (a file or a directory tree) and its directory entry durable.

    fsync works on the inode, so a fresh descriptor flushes whatever any
    earlier descriptor wrote. Every benchmarked method pays for this call, so
    a method that already synced pays only a few no-op syscalls.

    Raises:
        OSError: from ``open``/``fsync``.
    """
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if os.path.isdir(path):
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                _fsync_dir(os.path.join(root, d))
        _fsync_dir(path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)) or ".")


def remove_path(path: str) -> None:
    """Removes a file or directory tree; missing paths are fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# --------------------------------------------------------------------- page cache


class CacheDropper:
    """Empties the page cache of the files about to be read.

    ``mode`` is decided once, at construction:

    * ``drop_caches``: ``sync`` then ``echo 3 > /proc/sys/vm/drop_caches``
      (root, and /proc/sys writable) -- the whole cache, as after a reboot;
    * ``fadvise``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file after
      fsync -- drops those files' clean pages; works for any user;
    * ``none``: neither works (not Linux); reads may hit the cache;
    * ``disabled``: the caller asked for warm reads.
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
        """Drops the cache of ``paths`` (files or directories); returns the mode actually used."""
        if self.mode == "drop_caches":
            if self._try_drop_caches():
                return "drop_caches"
            self.mode = "fadvise"  # lost the permission mid-run (unusual); degrade, and say so per sample
        if self.mode == "fadvise":
            for path in paths:
                for file in files_under(path):
                    fd = os.open(file, os.O_RDONLY)
                    try:
                        os.fsync(fd)  # DONTNEED skips dirty pages
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
            return "fadvise"
        return self.mode


# --------------------------------------------------------------------- memory

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> int:
    """Resident set size of this process in bytes (psutil if present, else /proc)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # pragma: no cover - neither /proc nor psutil
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0), which
    # catches peaks shorter than the sampling interval.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_libc = None


def release_memory(collect: bool = True) -> None:
    """Collects garbage (unless ``collect`` is False) and returns freed heap to the OS.

    Called between measurements so each starts from a comparable resident set.
    """
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


class PeakMemory:
    """Peak resident memory over a block, sampled by a background thread.

    Samples RSS every ``interval`` seconds (5 ms by default); where Linux lets
    us reset the kernel's own high-water mark (``/proc/self/clear_refs``), the
    kernel's VmHWM is used too, so short spikes between samples are not missed.

    Attributes (after the block): ``baseline`` (RSS just before), ``peak``,
    ``delta`` (peak - baseline), ``source`` (``sampled`` or ``sampled+VmHWM``).
    """

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self.source = "sampled"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm = False

    def _run(self) -> None:
        peak = self.peak
        while not self._stop.wait(self.interval):
            rss = current_rss()
            if rss > peak:
                peak = rss
            self.peak = peak

    def __enter__(self) -> "PeakMemory":
        self.baseline = current_rss()
        self.peak = self.baseline
        self._hwm = _reset_hwm()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="fastpersist-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, current_rss())
        if self._hwm:
            hwm = _read_hwm()
            if hwm is not None:
                self.peak = max(self.peak, hwm)
                self.source = "sampled+VmHWM"

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


# --------------------------------------------------------------------- machine


def filesystem_of(path: str) -> dict[str, Any]:
    """Mount point, filesystem type, device and free space of the filesystem holding ``path``."""
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


def _read_first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return None


def machine_info(directory: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """What a result needs to be interpreted later: host, CPU, memory, versions, device, filesystem."""
    import torch

    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": None,
        "ram_bytes": None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "device": device,
        "device_name": "cpu",
        "transparent_hugepage": _read_first_line("/sys/kernel/mm/transparent_hugepage/enabled"),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "euid": os.geteuid() if hasattr(os, "geteuid") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        info["device_name"] = torch.cuda.get_device_name(index)
        info["cuda_device_count"] = torch.cuda.device_count()
    for module in ("safetensors", "fastpersist", "psutil", "numpy"):
        info[f"{module}_version"] = _version_of(module)
    if directory is not None:
        info["filesystem"] = filesystem_of(directory)
    return info


def _version_of(module: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(module)
    except Exception:
        mod = sys.modules.get(module)
        return getattr(mod, "__version__", None) if mod else None


# --------------------------------------------------------------------- ranks


class DistributedEnv:
    """Rank and world size from the launcher's environment (torchrun sets them).

    Without a launcher: rank 0 of 1. ``barrier()`` uses torch.distributed only
    when a process group is initialized, so single-process runs need none.
    """

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover
            return
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def distributed_env() -> DistributedEnv:
    return DistributedEnv()


@contextlib.contextmanager
def timer() -> Iterator[Callable[[], float]]:
    """``with timer() as elapsed: ...; elapsed()`` -- seconds since entry (frozen at exit)."""
    start = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - start
    end.append(time.perf_counter())


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turns SIGTERM into KeyboardInterrupt inside the block, so cleanup code runs for both.

    Only in the main thread (signal handlers can be set nowhere else); a no-op elsewhere.
    """
    if os.name != "posix" or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
