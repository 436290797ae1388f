"""Engine faults during save and load: errors propagate, nothing leaks, nothing is lost.

Faults come from the native engine's own fault hook (``engine.inject_fault``),
so the real submission, completion and cleanup code runs: the N-th chunk
submission of every handle created inside the block fails with EIO or ENOSPC,
or is shortened (the engine must resubmit the rest). After each failure we
check what issue 4 asks for: an ``OSError`` with ``errno`` and ``filename``,
the previous checkpoint intact, no temporary file, no descriptor, thread or
pool lease left behind, and nothing still in flight (the target does not
change afterwards).
"""

from __future__ import annotations

import errno
import gc
import glob
import os
import threading
import time
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.format.serializer import plan_save
from fastpersist.io import engine, memory

ENGINES = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not engine.engine_status()[name]["usable"], reason=engine.engine_status()[name]["reason"]
        ),
    )
    for name in engine.ENGINE_NAMES
]
# Small windows and blocks: a ~2.4 MB checkpoint becomes ~40 submissions, so a fault
# can land on the first, a middle and the last chunk, with others in flight.
SMALL = dict(buffer_size="256K", block_size="64K", buffer_count=3, queue_depth=4)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def temporaries(directory) -> list[str]:
    return glob.glob(os.path.join(str(directory), ".*.fastpersist-*.tmp"))


def states():
    generator = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(1000, generator=generator), "step": 1}
    new = {"w": torch.randn(600_000, generator=generator), "b": torch.randn(3, generator=generator), "step": 2}
    return old, new


def equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def worker_threads() -> int:
    """Threads, less the process-wide ones that live for the process by design: async_save's background
    worker and the CRC-32 pool (made at first use: running this file alone, inside a test's block)."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith(("fastpersist-save", "fastpersist-crc")))


class Leaks:
    """Descriptors, threads and pooled buffers before, compared after."""

    def __enter__(self):
        gc.collect()
        self.descriptors = open_descriptors()
        self.threads = worker_threads()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        gc.collect()
        assert open_descriptors() == self.descriptors, "a file descriptor (file or io_uring ring) leaked"
        assert worker_threads() <= self.threads, "a worker thread was left running"
        memory.release_pooled_buffers()  # frees every idle pooled buffer...
        assert memory.pooled_bytes() == 0, "a pooled buffer lease was not returned"  # ...so none is leased
        return False


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("directory", ["disk", "shm"])
def test_write_fault_during_save(engine_name, error, where, directory, tmp_path, shm_dir):
    directory = tmp_path if directory == "disk" else shm_dir
    path = os.path.join(directory, "ckpt.pt")
    old, new = states()
    fastpersist.save(old, path, **SMALL)
    before = open(path, "rb").read()
    stat = os.stat(path)
    chunks = -(-plan_save(new, "ckpt").size // (64 << 10))  # to aim at the last chunk
    # Each ring slot has its own handle, so the n-th submission counts per handle.
    nth = {"first": 1, "middle": max(1, chunks // 3 // 2), "last": max(1, chunks // 3)}[where]
    with Leaks():
        with pytest.raises(OSError) as info:
            with engine.inject_fault(nth=nth, errno=error, op="write"):
                fastpersist.save(new, path, engine=engine_name, **SMALL)
        assert info.value.errno == error
        assert info.value.filename and ".fastpersist-" in info.value.filename
        assert os.strerror(error) in str(info.value)
        assert any(path in note for note in getattr(info.value, "__notes__", []))
        del info
    assert temporaries(directory) == []
    time.sleep(0.05)  # anything still in flight would land now
    assert open(path, "rb").read() == before and os.stat(path).st_mtime_ns == stat.st_mtime_ns
    assert equal(old, fastpersist.load(path, verify=True)) and equal(old, torch.load(path))


@pytest.mark.parametrize("engine_name", ENGINES)
def test_every_submission_failing(engine_name, tmp_path):
    path = tmp_path / "ckpt.pt"
    old, new = states()
    fastpersist.save(old, path, **SMALL)
    with Leaks():
        with pytest.raises(OSError) as info:
            with engine.inject_fault(nth=1, errno=errno.EIO, op="write", count=0):
                fastpersist.save(new, path, engine=engine_name, **SMALL)
        assert info.value.errno == errno.EIO
        del info
    assert temporaries(tmp_path) == [] and equal(old, fastpersist.load(path, verify=True))


@pytest.mark.parametrize("engine_name", ENGINES)
def test_write_fault_during_async_save(engine_name, tmp_path):
    path = tmp_path / "ckpt.pt"
    old, new = states()
    fastpersist.save(old, path, **SMALL)
    with Leaks():
        with engine.inject_fault(nth=2, errno=errno.ENOSPC, op="write"):
            future = fastpersist.async_save(new, path, engine=engine_name, **SMALL)
            with pytest.raises(OSError) as info:
                future.result(timeout=60)
        assert info.value.errno == errno.ENOSPC and future.done()
        del info, future
    assert temporaries(tmp_path) == [] and equal(old, fastpersist.load(path, verify=True))
    fastpersist.async_save(new, path, engine=engine_name, **SMALL).result(timeout=60)  # the next one works
    assert equal(new, fastpersist.load(path, verify=True))


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("count", [1, 5, 0], ids=["one", "five", "all"])
@pytest.mark.parametrize("directory", ["disk", "shm"])
def test_short_writes_still_produce_a_correct_file(engine_name, count, directory, tmp_path, shm_dir):
    directory = tmp_path if directory == "disk" else shm_dir
    path = os.path.join(directory, "ckpt.pt")
    os.mkdir(os.path.join(directory, "reference"))
    reference = os.path.join(directory, "reference", "ckpt.pt")  # same name: same archive folder, same size
    _, new = states()
    fastpersist.save(new, reference, engine=engine_name, **SMALL)
    with Leaks():
        with engine.inject_fault(nth=2, short=True, count=count, op="write"):
            fastpersist.save(new, path, engine=engine_name, **SMALL)
    assert os.path.getsize(path) == os.path.getsize(reference)
    with zipfile.ZipFile(path) as ours, zipfile.ZipFile(reference) as theirs:
        for info in theirs.infolist():
            if not info.filename.endswith("serialization_id"):  # random per save
                assert ours.read(info.filename) == theirs.read(info), info.filename  # CRC-checked reads
    assert fastpersist.verify(path).checksummed
    assert equal(new, fastpersist.load(path, verify=True)) and equal(new, torch.load(path))
    assert temporaries(directory) == []


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
@pytest.mark.parametrize("nth", [1, 2, 7])
@pytest.mark.parametrize("mode", ["cpu", "verify"])
def test_read_fault_during_load(engine_name, error, nth, mode, tmp_path):
    path = tmp_path / "ckpt.pt"
    _, new = states()
    new["small"] = [torch.randn(n) for n in (1, 100, 5000)]  # small records share a slab read
    fastpersist.save(new, path, **SMALL)
    before = path.read_bytes()
    with Leaks():
        with pytest.raises(OSError) as info:
            with engine.inject_fault(nth=nth, errno=error, op="read"):
                fastpersist.load(path, engine=engine_name, verify=(mode == "verify"), **SMALL)
        assert info.value.errno == error and info.value.filename == str(path)
        del info
    assert path.read_bytes() == before  # a failed load never writes
    assert torch.equal(fastpersist.load(path, verify=True)["w"], new["w"])


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("count", [1, 0], ids=["one", "all"])
def test_short_reads_still_load_correctly(engine_name, count, tmp_path):
    path = tmp_path / "ckpt.pt"
    _, new = states()
    fastpersist.save(new, path, **SMALL)
    with Leaks():
        with engine.inject_fault(nth=1, short=True, count=count, op="read"):
            loaded = fastpersist.load(path, engine=engine_name, verify=True, **SMALL)
    assert equal(new, loaded)


def test_faults_do_not_outlive_their_block(tmp_path):
    """A handle made after the block is healthy, and the next save and load work."""
    path = tmp_path / "ckpt.pt"
    _, new = states()
    with pytest.raises(OSError):
        with engine.inject_fault(nth=1, errno=errno.EIO, op="any"):
            fastpersist.save(new, path, **SMALL)
    assert not path.exists()
    fastpersist.save(new, path, **SMALL)
    assert equal(new, fastpersist.load(path, verify=True, **SMALL))
