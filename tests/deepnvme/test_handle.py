"""AioHandle: DeepNVMe aio_handle parity over the engine (CPU and CUDA tensors)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from fastpersist.deepnvme.handle import AioHandle
from fastpersist.io import engine
from fastpersist.tensors import host_memoryview

DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.complex64,
]


def _random(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=generator
    )
    if dtype == torch.bool:
        return raw.bool()
    return raw.view(dtype)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(host_memoryview(t.contiguous().view(torch.uint8))) if t.numel() else b""


def test_getters():
    h = AioHandle(
        block_size=2 << 20,
        queue_depth=7,
        single_submit=True,
        overlap_events=True,
        intra_op_parallelism=2,
        engine="threads",
        direct=False,
    )
    assert h.get_block_size() == 2 << 20
    assert h.get_queue_depth() == 7
    assert h.get_single_submit() is True
    assert h.get_overlap_events() is True
    assert h.get_intra_op_parallelism() == 2 == h.get_thread_count()
    assert h.get_engine() == "threads"
    assert h.get_direct() is False
    d = AioHandle()
    assert (d.get_block_size(), d.get_queue_depth(), d.get_single_submit(), d.get_overlap_events()) == (
        1 << 20,
        128,
        False,
        False,
    )
    assert d.get_engine() == engine.resolve_engine("auto") and d.get_direct() is True
    assert "AioHandle(" in repr(d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sync_round_trip_every_dtype(any_dir, dtype):
    h = AioHandle(block_size=64 << 10)
    for numel in (0, 1, 1000, 70001):
        source = _random(numel, dtype, seed=numel)
        path = os.path.join(any_dir, f"t{numel}")
        assert h.sync_pwrite(source, path) == 1
        assert os.path.getsize(path) == source.numel() * source.element_size()
        out = torch.empty_like(source)
        assert h.sync_pread(out, path) == 1
        assert _bytes(out) == _bytes(source)


def test_async_many_then_wait(any_dir):
    h = AioHandle(block_size=64 << 10, queue_depth=8, intra_op_parallelism=2)
    sources = [_random(50_000 + i, torch.float32, seed=i) for i in range(6)]
    for i, s in enumerate(sources):
        assert h.async_pwrite(s, os.path.join(any_dir, f"a{i}")) == 0
    assert h.wait() == 6
    outs = [torch.empty_like(s) for s in sources]
    for i, o in enumerate(outs):
        assert h.async_pread(o, os.path.join(any_dir, f"a{i}")) == 0
    assert h.wait() == 6 and h.pending() == 0
    for o, s in zip(outs, sources):
        assert _bytes(o) == _bytes(s)


def test_pwrite_pread_generic_with_offsets_and_validate(disk_dir):
    h = AioHandle(block_size=64 << 10)
    path = os.path.join(disk_dir, "g")
    first, second = _random(30_000, torch.float64, 1), _random(12_345, torch.uint8, 2)
    h.pwrite(first, path, validate=True)
    offset = first.numel() * 8 + 17
    h.pwrite(second, path, validate=True, async_op=True, file_offset=offset)
    assert h.wait() == 1
    assert os.path.getsize(path) == offset + second.numel()
    out = torch.empty_like(second)
    h.pread(out, path, validate=True, async_op=False, file_offset=offset)
    assert _bytes(out) == _bytes(second)


def test_truncation_rules(disk_dir):
    h = AioHandle()
    path = os.path.join(disk_dir, "trunc")
    big, small = _random(100_000, torch.uint8, 1), _random(1000, torch.uint8, 2)
    h.sync_pwrite(big, path)
    h.sync_pwrite(small, path)  # like DeepNVMe: a write at offset 0 keeps what lies beyond
    assert os.path.getsize(path) == 100_000
    assert open(path, "rb").read() == _bytes(small) + _bytes(big)[1000:]
    h.sync_pwrite(small, path, truncate=True)  # explicit: the file ends where the write ends
    assert os.path.getsize(path) == 1000
    h.sync_pwrite(big, path)
    h.sync_pwrite(small, path, file_offset=4096)  # nonzero offset, no truncate: size unchanged
    assert os.path.getsize(path) == 100_000


def test_fd_target(disk_dir):
    h = AioHandle(block_size=64 << 10)
    path = os.path.join(disk_dir, "fd")
    source = _random(200_000, torch.int32, 3)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        h.sync_pwrite(source, fd, file_offset=8192)
        out = torch.empty_like(source)
        h.sync_pread(out, fd, file_offset=8192)
        assert _bytes(out) == _bytes(source)
    finally:
        os.close(fd)


def test_views_and_non_contiguous(disk_dir):
    h = AioHandle()
    base = _random(10_000, torch.float32, 4)
    view = base[123:4567]
    path = os.path.join(disk_dir, "v")
    h.sync_pwrite(view, path)
    out = torch.zeros(10_000, dtype=torch.float32)
    h.sync_pread(out[200 : 200 + view.numel()], path)
    assert _bytes(out[200 : 200 + view.numel()]) == _bytes(view)
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(base.view(100, 100).t(), path)


def test_read_past_eof_is_a_clear_error(disk_dir):
    h = AioHandle()
    path = os.path.join(disk_dir, "small")
    h.sync_pwrite(_random(100, torch.uint8), path)
    out = torch.empty(1000, dtype=torch.uint8)
    with pytest.raises(EOFError) as info:
        h.sync_pread(out, path)
    assert isinstance(info.value, OSError)
    message = str(info.value)
    assert path in message and "offset" in message and "1000" in message
    assert h.pending() == 0


def test_errors_and_reuse(tmp_path):
    h = AioHandle()
    t = _random(10, torch.uint8)
    with pytest.raises(FileNotFoundError) as info:
        h.sync_pwrite(t, str(tmp_path / "missing" / "x"))
    assert info.value.filename == str(tmp_path / "missing" / "x")
    with pytest.raises(FileNotFoundError):
        h.sync_pread(t, str(tmp_path / "nothing"))
    h.sync_pwrite(t, str(tmp_path / "ok"))  # still usable
    with engine.inject_fault(nth=1, errno=errno.EIO):
        faulty = AioHandle()
    with pytest.raises(OSError) as info:
        faulty.sync_pwrite(t, str(tmp_path / "eio"))
    assert info.value.errno == errno.EIO and faulty.pending() == 0
    faulty.sync_pwrite(t, str(tmp_path / "eio"))


def test_locked_tensor_helpers():
    h = AioHandle()
    t = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float16))
    assert t.dtype == torch.float16 and t.numel() == 1000 and t.data_ptr() % 4096 == 0
    assert h.free_cpu_locked_tensor(t) is True
    u = h.new_cpu_locked_tensor(10, torch.int64)
    assert u.dtype == torch.int64


def test_named_engine_unavailable(monkeypatch):
    from fastpersist.errors import EngineUnavailableError

    monkeypatch.setattr(
        engine, "_probe", lambda name: (False, "disabled for the test") if name == "io_uring" else (True, "")
    )
    with pytest.raises(EngineUnavailableError):
        AioHandle(engine="io_uring")


# ----------------------------------------------------------------------------- the CUDA ring, on CPU


class _FakeEvent:
    """Stands for torch.cuda.Event: CPU copies are done when queued, so recording and waiting only log."""

    log: list = []

    def __init__(self) -> None:
        self.number = None

    def record(self, stream) -> None:
        self.number = sum(1 for event in self.log if event[0] == "record")
        self.log.append(("record", self.number))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.number))


class _FakeStream:
    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        _FakeEvent.log.append(("stream synchronize", None))


class _LoggedHandle:
    """The handle's native handle, logging each request's submission and wait by file offset."""

    def __init__(self, native, log: list) -> None:
        self.native, self.log = native, log
        self.offsets: dict[int, int] = {}

    def submit_write(self, ptr, nbytes, target, offset, keepalive, **options):
        self.log.append(("write", offset))
        request = self.native.submit_write(ptr, nbytes, target, offset, keepalive, **options)
        self.offsets[id(request)] = offset
        return request

    def submit_read(self, ptr, nbytes, target, offset, keepalive, **options):
        self.log.append(("read", offset))
        request = self.native.submit_read(ptr, nbytes, target, offset, keepalive, **options)
        self.offsets[id(request)] = offset
        return request

    def wait_request(self, request):
        self.log.append(("done", self.offsets[id(request)]))
        return self.native.wait_request(request)

    def __getattr__(self, name):
        return getattr(self.native, name)


@pytest.fixture
def cpu_ring(monkeypatch):
    """An AioHandle whose CUDA ring (``_ring_write`` / ``_ring_read``) runs on CPU tensors: the copies are plain
    CPU copies, events and the side stream stand-ins that log. Yields ``make(**kwargs) -> (handle, log)``."""
    import contextlib

    log: list = []
    monkeypatch.setattr(_FakeEvent, "log", log)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(AioHandle, "_side_stream", lambda self, device: _FakeStream())

    def make(**kwargs):
        handle = AioHandle(cuda_chunk_bytes=64 << 10, cuda_chunks=3, **kwargs)
        handle._handle = _LoggedHandle(handle._handle, log)
        return handle

    return make, log


@pytest.mark.parametrize(("nbytes", "file_offset"), [(1, 0), ((64 << 10) * 7 + 5, 0), ((64 << 10) * 7 + 5, 4097)])
def test_the_cuda_ring_round_trips_and_keeps_its_order(disk_dir, cpu_ring, nbytes, file_offset):
    """Chunk by chunk through 3 slots: a chunk's copy is waited for before its write, a slot's last write before
    its next copy; reads run 3 ahead, each slot refilled once its chunk was copied out."""
    make, log = cpu_ring
    handle = make()
    source = _random(nbytes, torch.uint8, seed=nbytes)
    path = os.path.join(disk_dir, "ring.bin")
    file = engine.File(path, "w", direct=True, truncate=True)
    try:
        handle._ring_write(source, file, file_offset, True, None)
    finally:
        file.close()
    with open(path, "rb") as f:
        f.seek(file_offset)
        assert f.read() == _bytes(source)
    chunks = [offset for offset in range(0, nbytes, 64 << 10)]
    expected = []
    for k, offset in enumerate(chunks):
        if k >= 3:
            expected.append(("done", file_offset + chunks[k - 3]))
        expected += [("record", k), ("synchronize", k), ("write", file_offset + offset)]
    expected.append(("stream synchronize", None))
    last = sorted(range(len(chunks))[-3:], key=lambda k: k % 3)  # leaving the ring waits slot by slot
    expected += [("done", file_offset + chunks[k]) for k in last]
    assert log == expected

    log.clear()
    out = torch.zeros(nbytes, dtype=torch.uint8)
    file = engine.File(path, "r", direct=True)
    try:
        handle._ring_read(out, file, file_offset, None)
    finally:
        file.close()
    assert torch.equal(out, source)
    expected = [("read", file_offset + offset) for offset in chunks[:3]]
    for k, offset in enumerate(chunks):
        expected += [("done", file_offset + offset), ("record", k)]
        if k + 3 < len(chunks):
            expected += [("synchronize", k), ("read", file_offset + chunks[k + 3])]
    expected.append(("stream synchronize", None))  # the last copies: `out` is complete on return
    assert log == expected


def test_a_failing_ring_write_waits_for_every_request_and_returns_its_chunks(disk_dir, cpu_ring):
    from fastpersist.io import memory

    make, log = cpu_ring
    with engine.inject_fault(nth=4, op="write", count=0):  # the 4th write fails, and every one after it
        handle = make()
    source = _random((64 << 10) * 9, torch.uint8)
    path = os.path.join(disk_dir, "fail.bin")
    before = None
    for _ in range(3):
        log.clear()
        file = engine.File(path, "w", direct=True, truncate=True)
        try:
            with pytest.raises(OSError) as raised:
                handle._ring_write(source, file, 0, False, None)
        finally:
            file.close()
        assert raised.value.errno == errno.EIO
        submitted = [offset for kind, offset in log if kind == "write"]
        assert sorted(offset for kind, offset in log if kind == "done") == sorted(submitted)  # each waited for
        assert submitted == [k * (64 << 10) for k in range(len(submitted))]
        before = memory.pooled_bytes() if before is None else before
        assert memory.pooled_bytes() == before  # the same chunks, back in the pool each time


def test_a_ring_read_past_the_end_raises_once_every_read_is_done(disk_dir, cpu_ring):
    make, log = cpu_ring
    handle = make()
    path = os.path.join(disk_dir, "short.bin")
    with open(path, "wb") as f:
        f.write(b"x" * ((64 << 10) * 4 + 10))
    out = torch.zeros((64 << 10) * 8, dtype=torch.uint8)
    file = engine.File(path, "r", direct=True)
    try:
        with pytest.raises(EOFError):
            handle._ring_read(out, file, 0, None)
    finally:
        file.close()
    submitted = [offset for kind, offset in log if kind == "read"]
    assert sorted(offset for kind, offset in log if kind == "done") == sorted(submitted)
    assert bytes(host_memoryview(out[: (64 << 10) * 4])) == b"x" * ((64 << 10) * 4)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("numel", [0, 1, 4097, 3_000_001])
def test_cuda_round_trip(any_dir, numel):
    h = AioHandle(block_size=1 << 20)
    source = _random(numel, torch.bfloat16, seed=numel).cuda()
    path = os.path.join(any_dir, "cuda.bin")
    h.sync_pwrite(source, path)
    assert os.path.getsize(path) == numel * 2
    out = torch.zeros_like(source)
    h.sync_pread(out, path)
    assert _bytes(out.cpu()) == _bytes(source.cpu())


@pytest.mark.gpu
def test_cuda_async_and_validate(disk_dir):
    h = AioHandle(block_size=1 << 20, queue_depth=8)
    sources = [torch.randn(1_000_000 + i, device="cuda") for i in range(3)]
    for i, s in enumerate(sources):
        h.pwrite(s, os.path.join(disk_dir, f"c{i}"), validate=True, async_op=True)
    assert h.wait() == 3
    outs = [torch.empty_like(s) for s in sources]
    for i, o in enumerate(outs):
        h.async_pread(o, os.path.join(disk_dir, f"c{i}"))
    h.wait()
    for o, s in zip(outs, sources):
        assert torch.equal(o, s)


@pytest.mark.gpu
def test_cuda_read_error_returns_bounce_buffer(disk_dir):
    from fastpersist.io import memory

    h = AioHandle()
    out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    path = os.path.join(disk_dir, "short")
    with open(path, "wb") as f:
        f.write(b"x" * 10)
    before = memory.pooled_bytes()
    for _ in range(3):
        with pytest.raises(EOFError):
            h.sync_pread(out, path)
    assert memory.pooled_bytes() - before <= 1 << 20  # the same bounce buffer is reused, not leaked
