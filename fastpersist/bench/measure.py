"""The benchmarks' own measuring tools: peak host memory (:class:`PeakMemory`) and the ranks of a launched
run (:class:`DistributedEnv`). The tools the tuner shares with the benchmarks (statistics, durability, the
machine's description, checks) live in :mod:`fastpersist.tuning.measure`, re-exported here.
"""

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
    """A new temporary directory for a benchmark's files, in ``parent`` (made if missing; None: the system's)."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def current_rss() -> int:
    """Resident set size of this process in bytes (/proc/self/statm; the peak from getrusage elsewhere)."""
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
    """Resets VmHWM to the current RSS (Linux >= 4.0), so that :func:`peak_rss` catches peaks shorter than
    any sampling interval; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak resident memory over a block: RSS sampled every ``interval`` seconds by a thread, and the kernel's
    own high-water mark where it can be reset (short spikes between samples are not missed).

    After the block: ``baseline`` (RSS just before), ``peak``, ``delta`` (peak - baseline) and ``source``
    (``sampled`` or ``sampled+VmHWM``).
    """

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.baseline = self.peak = 0
        self.source = "sampled"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm = False

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
        self.peak = max(self.peak, current_rss())
        hwm = peak_rss() if self._hwm else None
        if hwm is not None:
            self.peak = max(self.peak, hwm)
            self.source = "sampled+VmHWM"

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


class DistributedEnv:
    """Rank and world size from the launcher's environment (torchrun sets them; without one: rank 0 of 1).
    :meth:`barrier` uses torch.distributed only when a process group is initialized."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
