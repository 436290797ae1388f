"""The benchmarks' own measuring tools: peak host memory (:class:`PeakMemory`) and the ranks of a launched
run (:class:`DistributedEnv`). Those of :mod:`fastpersist.tuning.measure` are re-exported."""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any

from fastpersist.system import PAGE_SIZE, status_field
from fastpersist.tuning.measure import (
    code_version,
    fsync_paths,
    machine_info,
    remove_path,
    sigterm_as_interrupt,
    summarize,
    touch_pages,
    verify_state,
)

__all__ = [
    "current_rss",
    "peak_rss",
    "reset_peak_rss",
    "scratch_dir",
    "PeakMemory",
    "DistributedEnv",
    "summarize",
    "fsync_paths",
    "remove_path",
    "machine_info",
    "code_version",
    "sigterm_as_interrupt",
    "touch_pages",
    "verify_state",
]


def scratch_dir(parent: str | None, prefix: str) -> str:
    """A new temporary directory in ``parent`` (made if missing; None: the system's)."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def current_rss() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss() -> int | None:
    """The kernel's high-water mark of this process's resident memory (VmHWM), in bytes, or None."""
    text = status_field("VmHWM")
    return int(text.split()[0]) * 1024 if text else None


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak resident memory over a block (``baseline`` before it, ``peak``, ``delta``): RSS sampled every
    ``interval`` seconds, and the kernel's high-water mark where it can be reset (``source``: ``sampled+VmHWM``),
    so that spikes between samples are not missed."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.baseline = self.peak = 0
        self.source = "sampled"
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, current_rss())

    def __enter__(self) -> PeakMemory:
        self.baseline = self.peak = current_rss()
        self._hwm = reset_peak_rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="fastpersist-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        rss, hwm = current_rss(), peak_rss() if self._hwm else None
        self.peak = max(self.peak, rss, hwm or 0)
        if hwm is not None:
            self.source = "sampled+VmHWM"

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


class DistributedEnv:
    """Rank and world size from the launcher's environment (torchrun's; without one: rank 0 of 1)."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """torch.distributed's barrier where a process group is initialized."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
