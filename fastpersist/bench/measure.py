"""Measuring tools shared by the benchmarks and the tuner.

What a measurement needs besides a clock: durability (:func:`fsync_paths`),
peak host memory (:class:`PeakMemory`), and a description of the machine and
the code (:func:`machine_info`, :func:`code_version`). What the operating
system reports (RSS, filesystems, the page cache) comes from
:mod:`fastpersist.system`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from fastpersist import system
from fastpersist.io.commit import fsync_directory

__all__ = [
    "summarize",
    "fsync_paths",
    "remove_path",
    "PeakMemory",
    "machine_info",
    "code_version",
    "DistributedEnv",
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


def fsync_paths(path: str) -> None:
    """Makes ``path`` (a file or a directory tree) and its directory entry durable.

    fsync works on the inode, so a fresh descriptor flushes whatever any
    earlier descriptor wrote. Every benchmarked method pays for this call, so
    a method that already synced pays only a few no-op syscalls.

    Raises:
        OSError: from ``open``/``fsync``.
    """
    for file in system.files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if os.path.isdir(path):
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                fsync_directory(os.path.join(root, d))
        fsync_directory(path)
    fsync_directory(os.path.dirname(os.path.abspath(path)) or ".")


def remove_path(path: str) -> None:
    """Removes a file or directory tree; missing paths are fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# --------------------------------------------------------------------- memory

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
            rss = system.current_rss()
            if rss > peak:
                peak = rss
            self.peak = peak

    def __enter__(self) -> "PeakMemory":
        self.baseline = system.current_rss()
        self.peak = self.baseline
        self._hwm = system.reset_peak_rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="fastpersist-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, system.current_rss())
        if self._hwm:
            hwm = system.peak_rss()
            if hwm is not None:
                self.peak = max(self.peak, hwm)
                self.source = "sampled+VmHWM"

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


# --------------------------------------------------------------------- machine


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
        "cpu_model": system.cpu_model(),
        "ram_bytes": None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "device": device,
        "device_name": "cpu",
        "transparent_hugepage": system.transparent_huge_pages(),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "euid": os.geteuid() if hasattr(os, "geteuid") else None,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        info["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        info["device_name"] = torch.cuda.get_device_name(index)
        info["cuda_device_count"] = torch.cuda.device_count()
    for module in ("safetensors", "fastpersist", "numpy"):
        info[f"{module}_version"] = _version_of(module)
    if directory is not None:
        info["filesystem"] = system.filesystem_of(directory)
    info["code"] = code_version()
    return info


def code_version() -> dict[str, Any]:
    """Which code produced a result: fastpersist's version and, from a git checkout, the commit.

    ``commit`` is the full hash of HEAD (None outside a checkout), ``dirty``
    whether the code (the package, the native sources, setup.py) differs from
    it (None when unknown); edits to docs do not count.
    """
    import fastpersist

    root = os.path.dirname(os.path.dirname(os.path.abspath(fastpersist.__file__)))
    info: dict[str, Any] = {"fastpersist": fastpersist.__version__, "commit": None, "dirty": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit:
        info["commit"] = commit
        status = git("status", "--porcelain", "--untracked-files=no", "--", "fastpersist", "native", "setup.py")
        info["dirty"] = None if status is None else bool(status)
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
