"""AioHandle behaves like DeepNVMe's aio_handle where DeepSpeed code depends on it (docs/deepnvme-parity.md).

DeepSpeed's own test files run through tests/compat/peers/run_deepspeed_aio.sh; these
tests pin down each parity point on its own, CPU cases here and CUDA cases on
the GPU machine (``-m gpu``).
"""

from __future__ import annotations

import errno
import inspect
import os
import threading

import pytest
import torch

from fastpersist.deepnvme import AsyncIOBuilder, PinMemoryBuilder, UtilsBuilder
from fastpersist.deepnvme.handle import AioHandle
from fastpersist.io import memory
from fastpersist.tensors import cast_to_byte_tensor, host_memoryview


def _bytes(t: torch.Tensor) -> bytes:
    t = t.cpu().contiguous().view(torch.uint8)
    return bytes(host_memoryview(t)) if t.numel() else b""


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("block_size", [512, 1024, 3584, 8192, 6144, 1 << 20])
@pytest.mark.parametrize("direct", [True, False])
def test_deepspeed_block_sizes_round_trip(disk_dir, block_size, direct):
    h = AioHandle(block_size, 2, False, False, 2, direct=direct)
    assert h.get_block_size() == block_size
    for n in (0, 1, 4095, 4096, 3 * block_size + 17, 70_001):
        source = _payload(n, seed=n)
        path = os.path.join(disk_dir, f"b{n}")
        assert h.sync_pwrite(source, path) == 1
        out = torch.zeros_like(source)
        assert h.sync_pread(out, path) == 1
        assert _bytes(out) == _bytes(source)
        assert os.path.getsize(path) == n


@pytest.mark.parametrize("block_size", [0, 100, 1000, 4097, (1 << 30) + 512])
def test_invalid_block_size_raises(block_size):
    with pytest.raises(ValueError, match="block_size"):
        AioHandle(block_size)


def test_queue_depth_range():
    assert AioHandle(queue_depth=1).get_queue_depth() == 1
    assert AioHandle(queue_depth=32768).get_queue_depth() == 32768
    for bad in (0, 32769):
        with pytest.raises(ValueError, match="queue_depth"):
            AioHandle(queue_depth=bad)


def test_block_size_rounding_is_logged_once(caplog, monkeypatch):
    from fastpersist.deepnvme import handle as handle_module

    monkeypatch.setattr(handle_module, "_logged_block_rounding", False)
    with caplog.at_level("INFO", logger="fastpersist.deepnvme.handle"):
        AioHandle(1024)
        AioHandle(1536)
        AioHandle(4096)
    messages = [r.getMessage() for r in caplog.records if "O_DIRECT alignment" in r.getMessage()]
    assert len(messages) == 1 and "1024" in messages[0]


def test_positional_constructor_and_getters_match_deepspeed():
    h = AsyncIOBuilder().load().aio_handle(1024, 2, True, False, 2)
    assert isinstance(h, AioHandle)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events()) == (
        1024,
        2,
        True,
        False,
    )
    assert h.get_intra_op_parallelism() == 2
    assert h.get_alignment() == 2 * 4096  # DeepNVMe: intra_op_parallelism * O_DIRECT alignment
    d = AsyncIOBuilder().load().aio_handle()
    assert (d.get_block_size(), d.get_queue_depth(), d.get_single_submit(), d.get_overlap_events()) == (
        1 << 20,
        128,
        False,
        False,
    )
    assert d.get_intra_op_parallelism() == 1 and d.get_alignment() == 4096


def test_builders_look_like_deepspeed():
    for builder, name in ((AsyncIOBuilder, "async_io"), (UtilsBuilder, "utils"), (PinMemoryBuilder, "pin_memory")):
        assert builder.NAME == name
        assert builder().is_compatible() is True
        assert builder().is_compatible(verbose=False) is True
    module = AsyncIOBuilder().load(verbose=False)
    assert module.aio_handle is AioHandle


# ----------------------------------------------------------------------------- keyword names


def test_fd_keyword_and_positional_fd(disk_dir):
    h = AioHandle(1024, 2, True, True, 2)
    path = os.path.join(disk_dir, "fd.bin")
    data = _payload(3 * 4096, seed=1)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        assert h.async_pwrite(buffer=data[:4096], fd=fd, file_offset=0) == 0
        assert h.wait() == 1
        assert h.async_pwrite(data[4096:8192], fd, 4096) == 0  # DeepNVMe's positional (buffer, fd, offset)
        assert h.wait() == 1
        assert h.sync_pwrite(data[8192:], fd=fd, file_offset=8192) == 1
        assert h.pwrite(data[:0], fd=fd, file_offset=0, **{"async": False}) == 1
    finally:
        os.close(fd)
    assert _read(path) == _bytes(data)
    out = torch.zeros_like(data)
    rfd = os.open(path, os.O_RDONLY)
    try:
        assert h.sync_pread(out, fd=rfd) == 1
        assert h.pread(out, fd=rfd, validate=True, **{"async": True}) == 0
        assert h.wait() == 1
    finally:
        os.close(rfd)
    assert _bytes(out) == _bytes(data)


def test_filename_or_fd_errors(disk_dir):
    h = AioHandle()
    t = _payload(10)
    with pytest.raises(TypeError, match="either filename or fd"):
        h.async_pwrite(t, os.path.join(disk_dir, "x"), fd=3)
    with pytest.raises(TypeError, match="filename"):
        h.sync_pwrite(t)
    with pytest.raises(TypeError, match="fd must be an int"):
        h.sync_pwrite(t, fd="3")


def test_async_keyword(disk_dir):
    h = AioHandle()
    path = os.path.join(disk_dir, "k.bin")
    data = _payload(10_000, seed=2)
    assert h.pwrite(data, path, False, **{"async": True}) == 0
    assert h.wait() == 1
    assert h.pwrite(data, path, validate=True, async_op=True) == 0
    assert h.wait() == 1
    out = torch.zeros_like(data)
    assert h.pread(out, path, False, **{"async": False}) == 1
    assert h.pread(out, path, False, True, 0) == 0  # positional (validate, async, file_offset)
    assert h.wait() == 1
    assert _bytes(out) == _bytes(data)
    with pytest.raises(TypeError, match="both async_op"):
        h.pwrite(data, path, False, True, **{"async": False})
    with pytest.raises(TypeError, match="unexpected keyword"):
        h.pread(out, path, asynch=True)


def test_signature_names_match_deepspeed():
    # DeepNVMe's pybind11 keyword names (csrc/aio/py_lib/py_ds_aio.cpp).
    expected = {
        "pread": ["buffer", "filename", "validate", "file_offset"],
        "pwrite": ["buffer", "filename", "validate", "file_offset"],
        "sync_pread": ["buffer", "filename", "file_offset"],
        "sync_pwrite": ["buffer", "filename", "file_offset"],
        "async_pread": ["buffer", "filename", "file_offset"],
        "async_pwrite": ["buffer", "filename", "file_offset", "fd"],
        "read": ["buffer", "filename", "validate", "file_offset"],
        "write": ["buffer", "filename", "validate", "file_offset"],
        "free_cpu_locked_tensor": ["tensor"],
        "is_pinned": ["buffer"],
    }
    for method, names in expected.items():
        parameters = inspect.signature(getattr(AioHandle, method)).parameters
        for name in names:
            assert name in parameters, f"{method} lacks keyword {name}"


def test_example_tenosr_alias():
    h = AioHandle()
    a = h.new_cpu_locked_tensor(num_elem=100, example_tenosr=torch.empty(0, dtype=torch.bfloat16))
    b = h.new_cpu_locked_tensor(100, example_tensor=torch.empty(0, dtype=torch.int32))
    c = h.new_cpu_locked_tensor(1024, torch.Tensor())  # the tutorial's call: float32
    assert (a.dtype, b.dtype, c.dtype) == (torch.bfloat16, torch.int32, torch.float32)
    assert a.numel() == b.numel() == 100 and c.shape == torch.Size([1024])
    with pytest.raises(TypeError):
        h.new_cpu_locked_tensor(10, torch.empty(0), example_tenosr=torch.empty(0))
    for t in (a, b, c):
        assert h.free_cpu_locked_tensor(t)


# ----------------------------------------------------------------------------- methods


def test_read_write_return_zero_like_deepspeed(disk_dir):
    h = AioHandle(1024)
    path = os.path.join(disk_dir, "rw.bin")
    data = _payload(12_345, seed=3)
    assert h.write(data, path, True) == 0
    out = torch.zeros_like(data)
    assert h.read(out, path, True) == 0
    assert _bytes(out) == _bytes(data)
    with pytest.raises(FileNotFoundError):
        h.read(out, os.path.join(disk_dir, "missing"), False)


def test_is_pinned_slices_views_and_other_handles():
    a, b = AioHandle(1024, 2), AioHandle(1024, 2)
    t = a.new_cpu_locked_tensor(4 * 1024, torch.empty(0, dtype=torch.float32))
    try:
        assert a.is_pinned(t) and b.is_pinned(t)
        assert a.is_pinned(t.narrow(0, 1024, 1024))
        assert a.is_pinned(t[1:])
        assert a.is_pinned(t.view(64, 64)[:, 3])  # strided view inside the allocation
        assert a.is_pinned(t.view(torch.uint8)[5:77])
        assert not a.is_pinned(t.clone())
        assert not a.is_pinned(torch.empty(4096))
        u = PinMemoryBuilder().load().pin_handle()
        assert u.is_pinned(t.narrow(0, 10, 10))
    finally:
        assert a.free_cpu_locked_tensor(t)
    assert not memory.is_managed_locked_memory(t)  # forgotten after free
    if not torch.cuda.is_available():  # with CUDA the bytes stay registered (pinned) until t is collected
        assert not a.is_pinned(t)


def test_cast_to_byte_tensor_on_a_list():
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16), torch.tensor(5)]
    cast = UtilsBuilder().load().cast_to_byte_tensor
    out = cast(tensors)
    assert isinstance(out, list) and [o.numel() for o in out] == [40, 6, 8]
    assert all(o.dtype == torch.uint8 for o in out)
    out[0][0:4] = torch.tensor([0, 0, 128, 63], dtype=torch.uint8)  # zero-copy: 1.0f
    assert tensors[0][0].item() == 1.0
    assert cast_to_byte_tensor(tuple(tensors))[2].numel() == 8


# ----------------------------------------------------------------------------- truncation


def test_offset_zero_write_does_not_truncate(disk_dir):
    h = AioHandle(1024)
    path = os.path.join(disk_dir, "t.bin")
    big, small = _payload(100_000, seed=4), _payload(1000, seed=5)
    h.sync_pwrite(big, path)
    h.sync_pwrite(small, path, 0)
    assert _read(path) == _bytes(small) + _bytes(big)[1000:]
    h.async_pwrite(small, path, 0)
    h.wait()
    assert os.path.getsize(path) == 100_000
    h.sync_pwrite(small, path, truncate=True)
    assert os.path.getsize(path) == 1000


# ----------------------------------------------------------------------------- threads


def test_blocking_calls_from_threads_report_only_their_own(disk_dir, in_threads):
    h = AioHandle(4096, 2, True, True, 2)
    n = 1 << 20
    sources = [_payload(n, seed=10 + i) for i in range(4)]
    paths = [os.path.join(disk_dir, f"s{i}") for i in range(4)]
    for s, p in zip(sources, paths):
        h.sync_pwrite(s, p)
    # An asynchronous write stays pending for wait(); blocking calls must not count it.
    pending_path = os.path.join(disk_dir, "pending")
    assert h.async_pwrite(_payload(4 << 20, seed=99), pending_path) == 0
    outs = [torch.zeros(n, dtype=torch.uint8) for _ in range(4)]
    results: dict[int, object] = {}
    barrier = threading.Barrier(4)

    def run(i: int) -> None:
        barrier.wait()
        for _ in range(5):
            results[i] = h.sync_pread(outs[i], paths[i])

    assert in_threads(run, 4) == []
    assert results == {0: 1, 1: 1, 2: 1, 3: 1}
    assert h.wait() == 1  # only the asynchronous write
    for o, s in zip(outs, sources):
        assert _bytes(o) == _bytes(s)


def test_error_surfaces_only_in_the_thread_that_caused_it(disk_dir):
    h = AioHandle(4096, 2, False, False, 2)
    good = os.path.join(disk_dir, "good")
    short = os.path.join(disk_dir, "short")
    h.sync_pwrite(_payload(1 << 20, seed=6), good)
    with open(short, "wb") as f:
        f.write(b"x" * 100)
    outcome: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def reader(name: str, path: str) -> None:
        out = torch.zeros(1 << 20, dtype=torch.uint8)
        barrier.wait()
        try:
            outcome[name] = [h.sync_pread(out, path) for _ in range(10)]
        except BaseException as e:  # noqa: BLE001
            outcome[name] = e

    threads = [threading.Thread(target=reader, args=a) for a in (("good", good), ("short", short))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcome["good"] == [1] * 10
    assert isinstance(outcome["short"], EOFError) and isinstance(outcome["short"], OSError)
    assert h.wait() == 0  # nothing asynchronous was submitted, no stray error
    assert h.pending() == 0


def test_async_errors_still_go_to_wait(disk_dir):
    h = AioHandle()
    out = torch.zeros(4096, dtype=torch.uint8)
    short = os.path.join(disk_dir, "short")
    with open(short, "wb") as f:
        f.write(b"x")
    assert h.async_pread(out, short) == 0
    assert h.sync_pwrite(out, os.path.join(disk_dir, "ok")) == 1  # unaffected by the pending failure
    with pytest.raises(EOFError):
        h.wait()
    assert h.wait() == 0


def test_write_error_is_an_oserror_not_minus_one(tmp_path):
    h = AioHandle()
    with pytest.raises(FileNotFoundError) as info:
        h.sync_pwrite(_payload(10), str(tmp_path / "no" / "such" / "dir" / "f"))
    assert info.value.errno == errno.ENOENT


# ----------------------------------------------------------------------------- tutorial snippets


def test_tutorial_cpu_snippets_with_only_the_import_changed(tmp_path):
    # The DeepNVMe tutorial's snippets (shared/reference), CPU tensors, a smaller size.
    size = 16 << 20
    target = str(tmp_path / "test_1GB.pt")
    assert not os.path.isfile(target)
    t = torch.empty(size, dtype=torch.uint8)
    # was: from deepspeed.ops.op_builder import AsyncIOBuilder
    from fastpersist.deepnvme import AsyncIOBuilder as Builder

    h = Builder().load().aio_handle()
    h.sync_pwrite(t, target)
    assert os.path.isfile(target) and os.path.getsize(target) == size
    os.remove(target)
    h = Builder().load().aio_handle()
    h.async_pwrite(t, target)
    assert h.wait() == 1
    assert os.path.getsize(target) == size
    os.remove(target)
    h = Builder().load().aio_handle(intra_op_parallelism=4)
    h.async_pwrite(t, target)
    assert h.wait() == 1
    assert os.path.getsize(target) == size
    h = (
        Builder()
        .load()
        .aio_handle(
            block_size=1048576, queue_depth=32, single_submit=False, overlap_events=True, intra_op_parallelism=8
        )
    )
    assert h.get_intra_op_parallelism() == 8
    x = h.new_cpu_locked_tensor(1024, torch.Tensor())
    assert x.shape == torch.Size([1024]) and x.dtype == torch.float32
    from fastpersist.deepnvme import UtilsBuilder as Utils

    util_ops = Utils().load()
    bf16_tensor = torch.zeros(1024, dtype=torch.bfloat16)
    byte_tensor = util_ops.cast_to_byte_tensor(bf16_tensor)
    bf16_tensor += 1.0
    assert byte_tensor.dtype == torch.uint8 and byte_tensor[:4].tolist() == [128, 63, 128, 63]


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_tutorial_cuda_snippets_with_only_the_import_changed(tmp_path):
    from fastpersist.deepnvme import AsyncIOBuilder as Builder

    target = str(tmp_path / "test_1GB.pt")
    t = torch.empty(1024**3, dtype=torch.uint8).cuda()
    h = Builder().load().aio_handle()
    h.sync_pwrite(t, target)
    assert os.path.getsize(target) == 1073741824
    os.remove(target)
    h.async_pwrite(t, target)
    assert h.wait() == 1
    assert os.path.getsize(target) == 1073741824
    os.remove(target)
    h = Builder().load().aio_handle(intra_op_parallelism=4)
    h.async_pwrite(t, target)
    assert h.wait() == 1
    os.remove(target)
    p = torch.empty(1024**3, dtype=torch.uint8).pin_memory()
    h = Builder().load().aio_handle()
    h.async_pwrite(p, target)
    assert h.wait() == 1
    assert os.path.getsize(target) == 1073741824
    util_ops = UtilsBuilder().load()
    bf16_tensor = torch.zeros(1024, dtype=torch.bfloat16, device="cuda")
    byte_tensor = util_ops.cast_to_byte_tensor(bf16_tensor)
    bf16_tensor += 1.0
    assert byte_tensor.device.type == "cuda" and byte_tensor[:4].tolist() == [128, 63, 128, 63]


@pytest.mark.gpu
def test_cuda_ring_bounds_pinned_memory(disk_dir):
    h = AioHandle(1 << 20, 32, cuda_chunk_bytes=1 << 20, cuda_chunks=4)
    n = 96 << 20
    source = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    path = os.path.join(disk_dir, "ring.bin")
    before = memory.pooled_bytes()
    assert h.sync_pwrite(source, path) == 1
    assert memory.pooled_bytes() - before <= 4 << 20  # the ring, not the tensor
    out = torch.zeros_like(source)
    assert h.sync_pread(out, path) == 1
    assert memory.pooled_bytes() - before <= 4 << 20
    assert torch.equal(out, source)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4097, (3 << 20) + 5])
@pytest.mark.parametrize("file_offset", [0, 4096, 1000])
def test_cuda_ring_sizes_and_offsets(disk_dir, n, file_offset):
    h = AioHandle(1024, 2, True, True, 2, cuda_chunk_bytes=1 << 20, cuda_chunks=2)
    source = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    path = os.path.join(disk_dir, "o.bin")
    with open(path, "wb") as f:
        f.write(b"\xee" * file_offset)
    assert h.sync_pwrite(source, path, file_offset) == 1
    assert _read(path)[file_offset:] == _bytes(source)
    out = torch.zeros_like(source)
    assert h.async_pread(out, path, file_offset) == 0
    assert h.wait() == 1
    assert torch.equal(out, source)


@pytest.mark.gpu
def test_cuda_async_respects_producer_stream(disk_dir):
    h = AioHandle(1 << 20, 8)
    path = os.path.join(disk_dir, "s.bin")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(50_000_000)  # keeps the stream busy; the write must wait for the fill below
        x.fill_(7)
        assert h.async_pwrite(x, path) == 0
    assert h.wait() == 1
    assert set(_read(path)) == {7}


@pytest.mark.gpu
def test_cuda_concurrent_blocking_calls(disk_dir, in_threads):
    h = AioHandle(4096, 2, True, True, 2)
    n = 8 << 20
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for _ in range(3)]
    paths = [os.path.join(disk_dir, f"c{i}") for i in range(3)]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        results[i] = h.sync_pwrite(sources[i], paths[i])
        out = torch.zeros_like(sources[i])
        results[i] = (results[i], h.sync_pread(out, paths[i]), torch.equal(out, sources[i]))

    assert in_threads(run, 3) == []
    assert results == {i: (1, 1, True) for i in range(3)}
    assert h.wait() == 0


def test_repr_of_a_failed_construction_does_not_crash():
    # pytest shows `self = repr(...)` of every frame of a failing test; a handle
    # whose native construction failed used to crash the interpreter there.
    from fastpersist.io import engine

    with pytest.raises(ValueError) as info:
        engine.IoHandle(block_size=100)
    tb = info.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    half_made = tb.tb_frame.f_locals.get("self")
    assert "construction failed" in repr(half_made)


def test_validate_through_a_write_only_direct_fd(disk_dir):
    h = AioHandle()
    path = os.path.join(disk_dir, "v.bin")
    data = h.new_cpu_locked_tensor(8192, torch.uint8)
    data.copy_(_payload(8192, seed=8))
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        assert h.pwrite(data, fd=fd, validate=True) == 1
        assert h.pwrite(data, fd=fd, validate=True, file_offset=8192, **{"async": True}) == 0
        assert h.wait() == 1
    finally:
        os.close(fd)
        h.free_cpu_locked_tensor(data)
    assert _read(path) == _bytes(data) * 2


def test_native_detached_requests_are_not_seen_by_wait(disk_dir):
    from fastpersist.io import engine

    handle = engine.IoHandle(block_size=4096, queue_depth=4, intra_op_parallelism=2)
    good = torch.zeros(1 << 16, dtype=torch.uint8)
    short_path = os.path.join(disk_dir, "short")
    with open(short_path, "wb") as f:
        f.write(b"y" * 10)
    detached = handle.submit_read(good.data_ptr(), good.numel(), short_path, keepalive=good, detached=True)
    attached = handle.submit_write(good.data_ptr(), good.numel(), os.path.join(disk_dir, "w"), keepalive=good)
    assert handle.wait() == 1  # the attached write only; the detached failure is not raised here
    assert attached.done
    with pytest.raises(EOFError):
        handle.wait_request(detached)
    assert detached.done and detached.failed
    ok = handle.submit_write(good.data_ptr(), good.numel(), os.path.join(disk_dir, "w2"), keepalive=good, detached=True)
    assert handle.wait_request(ok) == 1
    assert handle.wait() == 0 and handle.pending() == 0
