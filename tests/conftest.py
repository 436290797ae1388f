"""Shared fixtures and hardware markers, for the tests grouped by layer (format/, io/, api/, distributed/, ...).

Markers (see pyproject.toml): ``gpu`` needs a CUDA device, ``multigpu`` two or
more, ``root`` needs root (mounting a small tmpfs, dropping caches), ``slow``
runs minutes. Each is skipped, never passed, where the machine lacks it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

# The helper scripts and modules the tests start in subprocesses or import (one folder for all of them).
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_workers")
if WORKERS not in sys.path:
    sys.path.insert(0, WORKERS)

try:
    import torch
except ImportError:  # the package cannot work without torch; let imports fail loudly in tests
    torch = None


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch is not None and torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    cuda = _cuda_count()
    reasons = {
        "gpu": None if cuda >= 1 else "needs a CUDA device",
        "multigpu": None if cuda >= 2 else "needs two or more CUDA devices",
        "root": None if os.geteuid() == 0 else "needs root",
        "slow": None if os.environ.get("FASTPERSIST_SLOW_TESTS") == "1" else "slow: set FASTPERSIST_SLOW_TESTS=1",
    }
    for item in items:
        for marker, reason in reasons.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def saves_checked():
    """After the test: waits for pending async saves; fails if one failed and nobody checked its error (then marks
    them checked, so the whole pytest run does not fail at exit)."""
    yield
    from fastpersist.api import futures
    from fastpersist.io import queue

    for future in futures.pending_saves():
        future._finished.wait(120)
    left = [f for f in queue._unchecked if not f._checked]
    for f in left:
        f.exception()
    assert not left, f"a test left failed saves unchecked: {left}"


def run_in_threads(target, count: int, timeout: float | None = None) -> list[BaseException]:
    """Runs ``target(i)`` for i in range(count) on threads started together, joins them (each for at most
    ``timeout``) and returns what any of them raised, for the test to assert on."""
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return errors


@pytest.fixture
def in_threads():
    """:func:`run_in_threads`, for tests that call an entry point from several threads at once."""
    return run_in_threads


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on the disk the repository lives on (ext4 here: O_DIRECT works)."""
    return tmp_path


@pytest.fixture
def shm_dir():
    """A directory on tmpfs (/dev/shm), where O_DIRECT is refused: the fallback path."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = tempfile.mkdtemp(prefix="fastpersist-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["disk", "shm"])
def any_dir(request, tmp_path):
    """Both a disk directory (O_DIRECT) and a tmpfs one (buffered fallback)."""
    if request.param == "disk":
        yield tmp_path
        return
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = tempfile.mkdtemp(prefix="fastpersist-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _damage_record(path, suffix: str, offset: int = 0, mask: int = 0x40) -> None:
    """Flips ``mask`` in one payload byte of the checkpoint record whose name ends with ``suffix``:
    ``offset`` bytes into the payload (negative: from its end)."""
    from fastpersist.format.zipformat import read_directory

    with open(path, "r+b") as handle:
        descriptor = handle.fileno()
        records = read_directory(lambda at, length: os.pread(descriptor, length, at), os.fstat(descriptor).st_size)
        victim = next(record for record in records if record.name.endswith(suffix))
        at = victim.data_offset + (offset if offset >= 0 else victim.size + offset)
        byte = os.pread(descriptor, 1, at)
        os.pwrite(descriptor, bytes([byte[0] ^ mask]), at)


@pytest.fixture
def damage_record():
    """``damage_record(path, suffix, offset=0, mask=0x40)``: corrupts one byte of a checkpoint's record."""
    return _damage_record


@contextlib.contextmanager
def mounted_tmpfs(options: str, prefix: str):
    """A tmpfs mounted with ``options`` on a fresh directory; skips without root or mount(8)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a tmpfs of its own")
    path = tempfile.mkdtemp(prefix=prefix)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True)
    if result.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs():
    """A 4 MiB tmpfs mount, to provoke ENOSPC. Needs root and mount(8)."""
    with mounted_tmpfs("size=4m", "fastpersist-enospc-") as path:
        yield path


@pytest.fixture
def readonly_tmpfs():
    """A read-only tmpfs mount (EROFS on any write). Needs root and mount(8)."""
    with mounted_tmpfs("ro,size=1m", "fastpersist-ro-") as path:
        yield path


class _CommitGate:
    """Holds every anchored commit (an asynchronous save's, ``io.commit.DirectoryAnchor.reach``) until opened."""

    def __init__(self, monkeypatch):
        from fastpersist.io import commit

        self.reached = threading.Event()
        self.go = threading.Event()
        reach = commit.DirectoryAnchor.reach

        def held(anchor):
            self.reached.set()
            assert self.go.wait(60), "the test never let the save commit"
            return reach(anchor)

        monkeypatch.setattr(commit.DirectoryAnchor, "reach", held)


@pytest.fixture
def commit_gate(monkeypatch):
    """A gate that asynchronous saves wait at before they commit: ``.reached`` is set there, ``.go`` lets them on."""
    return _CommitGate(monkeypatch)
