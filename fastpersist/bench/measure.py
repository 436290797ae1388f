"""The benchmarks' own measuring tools: peak host memory and the ranks of a launched run.

Resident and peak memory come from /proc (:func:`current_rss`,
:func:`peak_rss`, :class:`PeakMemory`); :class:`DistributedEnv` reads a
launcher's rank variables. The tools the tuner shares with the benchmarks
(statistics, durability, the machine's description, checks) live in
:mod:`fastpersist.tuning.measure` and are re-exported here for the
benchmarks' modules.
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


# --------------------------------------------------------------------- resident memory


def _kib_field(text: str | None) -> int | None:
    return int(text.split()[0]) * 1024 if text else None


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
    return _kib_field(status_field("VmHWM"))


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where not allowed.

    Lets :func:`peak_rss` catch peaks shorter than any sampling interval.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
            rss = current_rss()
            if rss > peak:
                peak = rss
            self.peak = peak

    def __enter__(self) -> PeakMemory:
        self.baseline = current_rss()
        self.peak = self.baseline
        self._hwm = reset_peak_rss()
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
            hwm = peak_rss()
            if hwm is not None:
                self.peak = max(self.peak, hwm)
                self.source = "sampled+VmHWM"

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


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
