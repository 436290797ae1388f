"""The native core through fastpersist.io.engine: File, IoHandle, engines, errors, faults.

Every round trip compares bytes. Sizes are chosen around a small block size so
that "several blocks + odd tail" stays fast.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import subprocess
import tempfile
import threading
import time

import pytest
import torch

from fastpersist.errors import ConfigError, EngineUnavailableError
from fastpersist.io import engine
from fastpersist.io.memory import aligned_empty
from fastpersist.tensors import host_memoryview

BLOCK = 64 << 10
SIZES = [0, 1, 511, 4095, 4096, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 777]
OFFSETS = [0, 4096, 12345]
SHIFTS = [0, 1, 512]  # bytes past a page boundary for the memory address

USABLE = [name for name, s in engine.engine_status().items() if s["usable"]]


@pytest.fixture(params=list(engine.ENGINE_NAMES))
def engine_name(request):
    status = engine.engine_status()[request.param]
    if not status["usable"]:
        pytest.skip(f"engine {request.param} not usable here: {status['reason']}")
    return request.param


def _random_aligned(nbytes: int, shift: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, view): ``view`` holds ``nbytes`` random bytes starting ``shift`` bytes past a page."""
    owner = aligned_empty(nbytes + shift + 4096, huge_pages=False)
    view = owner[shift : shift + nbytes]
    generator = torch.Generator().manual_seed(seed)
    view.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
    return owner, view


def _file_bytes(path, offset: int = 0) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_round_trip_every_size(any_dir, engine_name, offset, shift):
    handle = engine.IoHandle(block_size=BLOCK, queue_depth=4, engine=engine_name)
    for size in SIZES:
        path = os.path.join(any_dir, f"rt-{size}")
        _, source = _random_aligned(size, shift, seed=size)
        handle.submit_write(source.data_ptr(), size, path, offset, keepalive=source, truncate=True)
        assert handle.wait() == 1
        assert os.path.getsize(path) == offset + size
        assert _file_bytes(path, offset) == bytes(host_memoryview(source)), f"size {size}"

        _, destination = _random_aligned(size, shift, seed=size + 1)
        request = handle.submit_read(destination.data_ptr(), size, path, offset, keepalive=destination)
        assert handle.wait() == 1
        assert request.done and request.bytes_transferred == size
        assert torch.equal(destination, source), f"size {size}"


def test_direct_path_used_on_disk_and_not_on_tmpfs(disk_dir, shm_dir, engine_name):
    size = 4 * BLOCK
    _, source = _random_aligned(size)
    on_disk = engine.IoHandle(block_size=BLOCK, engine=engine_name)
    on_disk.submit_write(source.data_ptr(), size, os.path.join(disk_dir, "d"), 0, keepalive=source)
    on_disk.wait()
    assert on_disk.stats()["bytes_direct"] == size
    assert on_disk.stats()["bytes_buffered"] == 0

    on_shm = engine.IoHandle(block_size=BLOCK, engine=engine_name)
    on_shm.submit_write(source.data_ptr(), size, os.path.join(shm_dir, "d"), 0, keepalive=source)
    on_shm.wait()
    assert on_shm.stats() == {"bytes_direct": 0, "bytes_buffered": size, "requests": 1}
    with engine.File(os.path.join(shm_dir, "d"), "r") as f:
        assert not f.direct and f.direct_fd == -1
        assert "tmpfs" in f.fallback_reason


def test_unaligned_memory_goes_buffered_but_stays_exact(disk_dir):
    size = 4 * BLOCK
    _, source = _random_aligned(size, shift=1)
    handle = engine.IoHandle(block_size=BLOCK)
    path = os.path.join(disk_dir, "u")
    handle.submit_write(source.data_ptr(), size, path, 0, keepalive=source)
    handle.wait()
    assert handle.stats()["bytes_direct"] == 0
    assert _file_bytes(path) == bytes(host_memoryview(source))


def test_direct_disabled_by_handle(disk_dir):
    size = 2 * BLOCK
    _, source = _random_aligned(size)
    handle = engine.IoHandle(block_size=BLOCK, direct=False)
    handle.submit_write(source.data_ptr(), size, os.path.join(disk_dir, "n"), 0, keepalive=source)
    handle.wait()
    assert handle.stats()["bytes_direct"] == 0 and not handle.direct


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("single_submit", [True, False])
def test_many_requests_outstanding(any_dir, engine_name, lanes, overlap, single_submit):
    handle = engine.IoHandle(
        block_size=BLOCK,
        queue_depth=3,
        intra_op_parallelism=lanes,
        overlap_events=overlap,
        single_submit=single_submit,
        engine=engine_name,
    )
    sources = [_random_aligned(2 * BLOCK + 100 * i, shift=(i % 2) * 8, seed=i)[1] for i in range(8)]
    shared = os.path.join(any_dir, "shared")
    offsets, position = [], 0
    for source in sources:
        offsets.append(position)
        position += source.numel()
    requests = []
    for i, source in enumerate(sources):  # 8 into separate files, 8 into one file at increasing offsets
        requests.append(
            handle.submit_write(source.data_ptr(), source.numel(), os.path.join(any_dir, f"m{i}"), 0, keepalive=source)
        )
    with engine.File(shared, "w") as f:
        for source, offset in zip(sources, offsets):
            requests.append(handle.submit_write(source.data_ptr(), source.numel(), f, offset, keepalive=source))
        assert handle.wait() == 16
    assert handle.pending() == 0 and all(r.done for r in requests)
    whole = _file_bytes(shared)
    for i, (source, offset) in enumerate(zip(sources, offsets)):
        assert _file_bytes(os.path.join(any_dir, f"m{i}")) == bytes(host_memoryview(source))
        assert whole[offset : offset + source.numel()] == bytes(host_memoryview(source))
    destinations = [torch.zeros_like(s) for s in sources]
    with engine.File(shared, "r") as f:
        for destination, offset in zip(destinations, offsets):
            handle.submit_read(destination.data_ptr(), destination.numel(), f, offset, keepalive=destination)
        assert handle.wait() == len(sources)
    for destination, source in zip(destinations, sources):
        assert torch.equal(destination, source)


def test_fd_targets(disk_dir, engine_name):
    size = 3 * BLOCK + 5
    _, source = _random_aligned(size)
    path = os.path.join(disk_dir, "fd")
    handle = engine.IoHandle(block_size=BLOCK, engine=engine_name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        handle.submit_write(source.data_ptr(), size, fd, 4096, keepalive=source)
        handle.wait()
        assert handle.stats()["bytes_direct"] > 0  # reopened /proc/self/fd/N with O_DIRECT
        destination = torch.zeros(size, dtype=torch.uint8)
        handle.submit_read(destination.data_ptr(), size, fd, 4096, keepalive=destination)
        handle.wait()
        assert torch.equal(destination, source)
        os.fstat(fd)  # still open: the handle never closes a caller's descriptor
    finally:
        os.close(fd)
    # A descriptor the caller opened with O_DIRECT: unaligned pieces still work.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        destination = torch.zeros(size - 3, dtype=torch.uint8)
        handle.submit_read(destination.data_ptr(), size - 3, fd, 4099, keepalive=destination)
        handle.wait()
        assert torch.equal(destination, source[3:])
    finally:
        os.close(fd)


def test_keepalive_is_held_until_completion_and_released_by_wait(disk_dir):
    import weakref

    size = 32 * BLOCK
    handle = engine.IoHandle(block_size=BLOCK, queue_depth=1, direct=False)
    _, source = _random_aligned(size)
    expected = bytes(host_memoryview(source))
    alive = weakref.ref(source)
    handle.submit_write(source.data_ptr(), size, os.path.join(disk_dir, "k"), 0, keepalive=source)
    del source
    gc.collect()
    if handle.pending():
        assert alive() is not None  # only the handle references it now
    handle.wait()
    gc.collect()
    assert alive() is None  # released once the request completed
    assert _file_bytes(os.path.join(disk_dir, "k")) == expected


def test_truncate_flag_and_overwrite(disk_dir):
    path = os.path.join(disk_dir, "t")
    handle = engine.IoHandle(block_size=BLOCK)
    _, big = _random_aligned(5 * BLOCK)
    _, small = _random_aligned(BLOCK + 3, seed=3)
    handle.submit_write(big.data_ptr(), big.numel(), path, 0, keepalive=big)
    handle.wait()
    handle.submit_write(small.data_ptr(), small.numel(), path, 0, keepalive=small)  # no truncate: tail stays
    handle.wait()
    assert os.path.getsize(path) == big.numel()
    assert _file_bytes(path)[: small.numel()] == bytes(host_memoryview(small))
    handle.submit_write(small.data_ptr(), small.numel(), path, 0, keepalive=small, truncate=True)
    handle.wait()
    assert _file_bytes(path) == bytes(host_memoryview(small))
    handle.submit_write(small.data_ptr(), 0, path, 0, truncate=True)  # empty write truncates to 0
    handle.wait()
    assert os.path.getsize(path) == 0


# ----------------------------------------------------------------------------- File


def test_file_attributes_and_methods(disk_dir):
    path = os.path.join(disk_dir, "f")
    with engine.File(path, "w") as f:
        assert f.path == path and f.fd >= 0 and f.mode == "w"
        assert f.direct and f.direct_fd >= 0 and f.fallback_reason == ""
        assert f.alignment >= 4096 and f.alignment % 4096 == 0
        assert f.memory_alignment >= 1
        assert f.allocate(0, 1 << 20) in (True, False)
        f.truncate(12345)
        assert f.size() == 12345
        f.fsync()
    assert f.closed and f.fd == -1
    f.close()  # idempotent
    with engine.File(path, "r", direct=False) as f:
        assert not f.direct and f.fallback_reason == ""
        assert f.size() == 12345
    with pytest.raises(FileNotFoundError):
        engine.File(os.path.join(disk_dir, "missing"), "r")
    with engine.File(path, "rw", truncate=True) as f:
        assert f.size() == 0


def test_file_mode_mismatch_raises_ebadf(disk_dir):
    path = os.path.join(disk_dir, "m")
    open(path, "wb").close()
    handle = engine.IoHandle()
    buf = torch.zeros(10, dtype=torch.uint8)
    with engine.File(path, "r") as f, pytest.raises(OSError) as info:
        handle.submit_write(buf.data_ptr(), 10, f, 0)
    assert info.value.errno == errno.EBADF
    with engine.File(path, "w") as f, pytest.raises(OSError) as info:
        handle.submit_read(buf.data_ptr(), 10, f, 0)
    assert info.value.errno == errno.EBADF
    closed = engine.File(path, "w")
    closed.close()
    with pytest.raises(OSError) as info:
        handle.submit_write(buf.data_ptr(), 10, closed, 0)
    assert info.value.errno == errno.EBADF
    assert handle.pending() == 0


def test_probe_directory_and_limits(disk_dir, shm_dir):
    disk = engine.probe_directory(disk_dir)
    assert set(disk) >= {"direct", "reason", "alignment", "fs_type"}
    assert disk["alignment"] >= 4096
    shm = engine.probe_directory(shm_dir)
    assert shm["direct"] is False and shm["reason"] and shm["fs_type"] == "tmpfs"
    assert os.listdir(shm_dir) == [] and os.listdir(disk_dir) == []  # probe file removed
    with pytest.raises(FileNotFoundError):
        engine.probe_directory(os.path.join(disk_dir, "nope"))
    import resource

    def as_reported(value):
        return None if value == resource.RLIM_INFINITY else value

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert engine.memlock_limit() == (as_reported(soft), as_reported(hard))
    assert "threads" in engine.engines_compiled()


# ----------------------------------------------------------------------------- engine selection


def test_engine_selection():
    status = engine.engine_status()
    assert status["threads"]["usable"] is True
    assert engine.resolve_engine("threads") == "threads"
    expected = "io_uring" if status["io_uring"]["usable"] else "threads"
    assert engine.resolve_engine("auto") == expected
    assert engine.IoHandle().engine == expected
    with pytest.raises(ConfigError):
        engine.resolve_engine("libaio-2000")


def test_named_unavailable_engine_raises_and_auto_falls_back(monkeypatch, caplog):
    def fake_probe(name):
        return (False, "io_uring_setup: not permitted (test)") if name == "io_uring" else (True, "")

    monkeypatch.setattr(engine, "_probe", fake_probe)
    monkeypatch.setattr(engine, "_fallback_logged", False)
    with pytest.raises(EngineUnavailableError, match="not permitted"):
        engine.IoHandle(engine="io_uring")
    with pytest.raises(EngineUnavailableError):
        engine.resolve_engine("io_uring")
    with caplog.at_level(logging.INFO, logger="fastpersist"):
        assert engine.resolve_engine("auto") == "threads"
        assert engine.resolve_engine("auto") == "threads"
    messages = [r.getMessage() for r in caplog.records if "io_uring" in r.getMessage()]
    assert len(messages) == 1 and "not permitted" in messages[0]


def test_native_unknown_engine_raises():
    from fastpersist import _native

    with pytest.raises(_native.EngineUnavailableError):
        _native.IoHandle(engine="bogus")


def test_invalid_settings_raise_value_error():
    with pytest.raises(ValueError):
        engine.IoHandle(block_size=1000)
    with pytest.raises(ValueError):
        engine.IoHandle(queue_depth=0)
    with pytest.raises(ValueError):
        engine.IoHandle(intra_op_parallelism=0)


def test_make_handle_from_settings():
    from fastpersist import config

    settings = config.settings().replace(block_size="128K", queue_depth=5, intra_op_parallelism=2, engine="threads")
    handle = engine.make_handle(settings)
    assert (handle.block_size, handle.queue_depth, handle.intra_op_parallelism, handle.engine) == (
        128 << 10,
        5,
        2,
        "threads",
    )
    assert engine.make_handle(settings, direct=False).direct is False


# ----------------------------------------------------------------------------- errors


def test_missing_directory_raises_file_not_found(tmp_path):
    handle = engine.IoHandle()
    path = str(tmp_path / "no" / "such" / "dir" / "x.bin")
    with pytest.raises(FileNotFoundError) as info:
        handle.submit_write(0, 0, path)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == path
    assert "directory" in str(info.value)  # says what to do
    with pytest.raises(FileNotFoundError):
        handle.submit_read(0, 0, path)
    assert handle.pending() == 0


def test_bad_fd_raises_ebadf():
    read_end, write_end = os.pipe()
    os.close(read_end)
    os.close(write_end)
    handle = engine.IoHandle()
    buf = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(OSError) as info:
        handle.submit_write(buf.data_ptr(), 16, write_end, 0)
    assert info.value.errno == errno.EBADF
    assert handle.pending() == 0


def test_write_only_fd_read_fails_at_wait(disk_dir, engine_name):
    path = os.path.join(disk_dir, "wo")
    with open(path, "wb") as f:
        f.write(b"x" * 8192)
    fd = os.open(path, os.O_WRONLY)
    try:
        handle = engine.IoHandle(engine=engine_name)
        buf = torch.zeros(8192, dtype=torch.uint8)
        with pytest.raises(OSError) as info:
            handle.submit_read(buf.data_ptr(), 8192, fd, 0)
            handle.wait()
        assert info.value.errno == errno.EBADF
        assert handle.pending() == 0
    finally:
        os.close(fd)


@pytest.mark.root
def test_read_only_filesystem_raises_erofs(engine_name):
    mountpoint = tempfile.mkdtemp(prefix="fastpersist-ro-")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", mountpoint], capture_output=True, text=True
    )
    if result.returncode != 0:
        os.rmdir(mountpoint)
        pytest.skip(f"cannot mount a read-only tmpfs: {result.stderr.strip()}")
    try:
        handle = engine.IoHandle(engine=engine_name)
        path = os.path.join(mountpoint, "x.bin")
        with pytest.raises(OSError) as info:
            handle.submit_write(0, 0, path)
        assert info.value.errno == errno.EROFS
        assert info.value.filename == path
        assert "read-only" in str(info.value)
    finally:
        subprocess.run(["umount", "-l", mountpoint], capture_output=True)
        os.rmdir(mountpoint)


@pytest.mark.root
def test_immutable_file_raises_permission_error(disk_dir):
    path = os.path.join(disk_dir, "immutable")
    open(path, "wb").close()
    if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
        pytest.skip("chattr +i not supported here")
    try:
        handle = engine.IoHandle()
        with pytest.raises(PermissionError) as info:
            handle.submit_write(0, 0, path)
        assert info.value.errno == errno.EPERM and info.value.filename == path
    finally:
        subprocess.run(["chattr", "-i", path], capture_output=True)


def test_enospc(small_tmpfs, engine_name):
    size = 8 << 20  # twice the filesystem
    _, source = _random_aligned(size)
    handle = engine.IoHandle(block_size=1 << 20, queue_depth=4, engine=engine_name)
    path = os.path.join(small_tmpfs, "full.bin")
    handle.submit_write(source.data_ptr(), size, path, 0, keepalive=source)
    with pytest.raises(OSError) as info:
        handle.wait()
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == path
    assert "free space" in str(info.value)
    assert handle.pending() == 0
    os.unlink(path)
    handle.submit_write(source.data_ptr(), 1 << 20, path, 0, keepalive=source)  # reusable afterwards
    assert handle.wait() == 1


def test_read_past_end_of_file(disk_dir, engine_name):
    path = os.path.join(disk_dir, "short")
    payload = os.urandom(10000)
    with open(path, "wb") as f:
        f.write(payload)
    handle = engine.IoHandle(block_size=BLOCK, engine=engine_name)
    owner, destination = _random_aligned(3 * BLOCK)
    handle.submit_read(destination.data_ptr(), destination.numel(), path, 0, keepalive=destination)
    with pytest.raises(engine.UnexpectedEndOfFileError) as info:
        handle.wait()
    error = info.value
    assert isinstance(error, EOFError) and isinstance(error, OSError)
    assert error.filename == path
    assert "unexpected end of file" in str(error) and "10000" in str(error)
    assert handle.pending() == 0
    request = handle.submit_read(
        destination.data_ptr(), destination.numel(), path, 0, keepalive=destination, allow_short=True
    )
    handle.wait()
    assert request.bytes_transferred == 10000
    assert bytes(host_memoryview(destination[:10000])) == payload
    with pytest.raises(EOFError):  # entirely past the end
        handle.submit_read(destination.data_ptr(), 10, path, 20000)
        handle.wait()


# ----------------------------------------------------------------------------- fault injection


@pytest.mark.parametrize("lanes", [1, 3])
def test_injected_eio_raises_and_handle_is_reusable(disk_dir, engine_name, lanes):
    size = 6 * BLOCK + 123
    _, source = _random_aligned(size)
    path = os.path.join(disk_dir, "eio")
    with engine.inject_fault(nth=3, errno=errno.EIO, op="write"):
        handle = engine.IoHandle(block_size=BLOCK, queue_depth=2, intra_op_parallelism=lanes, engine=engine_name)
    assert handle.faulty
    handle.submit_write(source.data_ptr(), size, path, 0, keepalive=source)
    with pytest.raises(OSError) as info:
        handle.wait()
    assert info.value.errno == errno.EIO and info.value.filename == path
    assert handle.pending() == 0
    handle.submit_write(source.data_ptr(), size, path, 0, keepalive=source)  # the fault fired once
    assert handle.wait() == 1
    assert _file_bytes(path) == bytes(host_memoryview(source))
    assert not engine.IoHandle().faulty  # outside the block: healthy


def test_first_error_wins_and_everything_is_reaped(disk_dir, engine_name):
    size = 8 * BLOCK
    _, source = _random_aligned(size)
    with engine.inject_fault(nth=2, errno=errno.ENOSPC, count=0):  # every write from the 2nd on fails
        handle = engine.IoHandle(block_size=BLOCK, queue_depth=4, engine=engine_name)
    requests = [
        handle.submit_write(source.data_ptr(), size, os.path.join(disk_dir, f"e{i}"), 0, keepalive=source)
        for i in range(4)
    ]
    with pytest.raises(OSError) as info:
        handle.wait()
    assert info.value.errno == errno.ENOSPC
    assert handle.pending() == 0 and all(r.done for r in requests)
    assert sum(r.failed for r in requests) >= 3


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("shift", [0, 8])
def test_injected_short_transfer_is_recovered(any_dir, engine_name, op, shift):
    size = 5 * BLOCK + 4321
    _, source = _random_aligned(size, shift)
    path = os.path.join(any_dir, "short")
    with engine.inject_fault(nth=1, op=op, short=True, count=3):
        handle = engine.IoHandle(block_size=BLOCK, queue_depth=2, engine=engine_name)
    handle.submit_write(source.data_ptr(), size, path, 4096, keepalive=source, truncate=True)
    handle.wait()
    assert _file_bytes(path, 4096) == bytes(host_memoryview(source))
    _, destination = _random_aligned(size, shift, seed=9)
    handle.submit_read(destination.data_ptr(), size, path, 4096, keepalive=destination)
    handle.wait()
    assert torch.equal(destination, source)


def test_read_fault_does_not_touch_writes(disk_dir):
    size = 2 * BLOCK
    _, source = _random_aligned(size)
    path = os.path.join(disk_dir, "r")
    with engine.inject_fault(nth=1, errno=errno.EIO, op="read"):
        handle = engine.IoHandle(block_size=BLOCK)
    handle.submit_write(source.data_ptr(), size, path, 0, keepalive=source)
    handle.wait()
    destination = torch.zeros(size, dtype=torch.uint8)
    handle.submit_read(destination.data_ptr(), size, path, 0, keepalive=destination)
    with pytest.raises(OSError) as info:
        handle.wait()
    assert info.value.errno == errno.EIO
    assert info.value.operation == "read"


def test_inject_fault_validates_arguments():
    with pytest.raises(ValueError):
        with engine.inject_fault(op="sideways"):
            pass
    with pytest.raises(ValueError):
        with engine.inject_fault(nth=0):
            pass


# ----------------------------------------------------------------------------- the GIL


def _count_iterations(stop: threading.Event) -> int:
    count = 0
    while not stop.is_set():
        count += 1
    return count


def test_blocking_calls_release_the_gil(disk_dir):
    """A Python thread keeps running while another thread waits in I/O.

    If wait()/fsync held the GIL, the counting thread would stall for the whole
    I/O. Compares the counting rate during the I/O with the rate alone
    (generous margin: the machine has 2 cores and the I/O uses CPU too).
    """
    size = 256 << 20
    source = aligned_empty(size, huge_pages=True)
    source.fill_(7)
    handle = engine.IoHandle(block_size=4 << 20, queue_depth=8, direct=False)  # buffered + fsync: long enough
    path = os.path.join(disk_dir, "gil.bin")

    stop = threading.Event()
    start = time.perf_counter()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    alone = _count_iterations(stop) / (time.perf_counter() - start)

    io_seconds = []

    def do_io() -> None:
        t0 = time.perf_counter()
        for _ in range(3):
            with engine.File(path, "w", direct=False, truncate=True) as f:
                handle.submit_write(source.data_ptr(), size, f, 0, keepalive=source)
                handle.wait()
                f.fsync()
        io_seconds.append(time.perf_counter() - t0)
        stop.set()

    stop.clear()
    worker = threading.Thread(target=do_io)
    start = time.perf_counter()
    worker.start()
    counted = _count_iterations(stop)
    elapsed = time.perf_counter() - start
    worker.join()
    during = counted / elapsed
    assert io_seconds and io_seconds[0] > 0.05, "I/O too short to tell"
    assert during > 0.2 * alone, f"counting thread ran at {during:.0f}/s during I/O vs {alone:.0f}/s alone"
