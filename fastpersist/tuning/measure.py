"""Measuring tools of the tuner, shared with the benchmarks: statistics, durability, the machine, checks.

What a measurement needs besides a clock: durability (:func:`fsync_paths`),
a description of the machine and the code (:func:`machine_info`,
:func:`code_version`), a byte-for-byte check of what was loaded
(:func:`verify_state`) and pages made resident (:func:`touch_pages`). What the
operating system reports (filesystems, the page cache) comes from
:mod:`fastpersist.system`. The benchmarks (:mod:`fastpersist.bench`) build on
these; nothing here imports them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
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

import torch

from fastpersist import system
from fastpersist.io.commit import fsync_directory
from fastpersist.tuning.workloads import flatten_state

__all__ = [
    "summarize",
    "fsync_paths",
    "remove_path",
    "machine_info",
    "code_version",
    "sigterm_as_interrupt",
    "touch_pages",
    "verify_state",
    "write_json",
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
        "free_page_reporting": system.free_page_reporting(),
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
    except Exception:  # noqa: BLE001 - not installed as a distribution: ask the module
        mod = sys.modules.get(module)
        return getattr(mod, "__version__", None) if mod else None


# --------------------------------------------------------------------- interruption


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


# --------------------------------------------------------------------- checks


def touch_pages(loaded: Any) -> None:
    """Reads one byte of every page of every storage, so lazily mapped data is resident."""
    from fastpersist.tensors import storage_byte_view

    tensors = (
        loaded
        if isinstance(loaded, dict) and all(isinstance(v, torch.Tensor) for v in loaded.values())
        else flatten_state(loaded)[0]
    )
    seen: set[int] = set()
    for t in tensors.values():
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        int(storage_byte_view(storage)[::4096].sum())


_memcmp = None


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous uint8 tensors hold the same bytes.

    On the CPU through libc's ``memcmp`` (7 GB/s on the development VM, where ``torch.equal`` compared
    614 MB at 1.3 GB/s and the checkpoint benchmark's checks took 33 s of its three minutes);
    elsewhere, or without libc, ``torch.equal``.
    """
    global _memcmp
    if a.numel() != b.numel():
        return False
    if a.device.type != "cpu" or b.device.type != "cpu" or a.numel() == 0:
        return torch.equal(a, b)
    if _memcmp is None:
        try:
            import ctypes

            function = ctypes.CDLL(None).memcmp
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            _memcmp = function
        except (OSError, AttributeError, TypeError):  # no C library to load (not a POSIX system)
            _memcmp = False
    if _memcmp is False:
        return torch.equal(a, b)
    return _memcmp(a.data_ptr(), b.data_ptr(), a.numel()) == 0


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def verify_state(
    expected: tuple[dict[str, torch.Tensor], dict[str, Any]],
    actual: tuple[dict[str, torch.Tensor], dict[str, Any] | None],
    device: torch.device | None = None,
) -> str | None:
    """Compares a loaded state with the original, byte for byte.

    Args:
        expected: ``flatten_state(original)``.
        actual: the loaded state, flattened the same way; its second element
            is None when the format does not carry non-tensor leaves.
        device: the device loads were asked for; a tensor that lived there
            originally must come back there.

    Returns:
        None when every tensor has the same names, dtype, shape and bytes (and
        the other leaves compare equal), else a description of the first
        difference.
    """
    want_tensors, want_objects = expected
    got_tensors, got_objects = actual
    missing = sorted(set(want_tensors) - set(got_tensors))
    extra = sorted(set(got_tensors) - set(want_tensors))
    if missing or extra:
        return f"tensor names differ: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
    for key, want in want_tensors.items():
        got = got_tensors[key]
        if not isinstance(got, torch.Tensor):
            return f"{key}: expected a tensor, got {type(got).__name__}"
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return f"{key}: expected {want.dtype} {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"
        if device is not None and want.device.type == device.type and got.device.type != device.type:
            return f"{key}: loaded to {got.device}, expected {device}"
        a = _bytes_of(want)
        b = _bytes_of(got)
        if b.device != a.device:
            b = b.to(a.device)
        if not _same_bytes(a, b):
            index = int((a != b).nonzero()[0]) if a.numel() else 0
            return f"{key}: bytes differ (first at byte {index} of {a.numel()})"
    if got_objects is not None:
        for key, want in want_objects.items():
            if key not in got_objects:
                return f"{key}: missing from the loaded state"
            if got_objects[key] != want:
                return f"{key}: expected {want!r}, got {got_objects[key]!r}"
    return None


def write_json(document: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Writes ``document`` (atomically: temp file, then rename)."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
