"""zlib's CRC-32 computed with torch operations (``fastpersist.io.device_crc``).

The operations run eagerly on CPU tensors here; on a GPU (marked tests) the
same operations are captured as CUDA graphs and replayed, and a verified CUDA
load checksums its records' whole segments that way.
"""

from __future__ import annotations

import os
import threading
import time
import zlib

import pytest
import torch

import fastpersist
from fastpersist.io import device_crc
from fastpersist.io.device_crc import DeviceCrc

BLOCK = device_crc.CHUNK * device_crc.GROUP  # the smallest length raw_crc takes


def _random(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("blocks", [1, 2, 255, 256, 257])
def test_raw_crc_gives_zlibs_crc32(blocks):
    """One block (one level), front padding of a level (2, 255, 257 values), a whole group (256)."""
    data = _random(blocks * BLOCK, blocks)
    raw = device_crc.raw_crc(data).item()
    assert device_crc.crc32_of_raw(raw, data.numel()) == zlib.crc32(data.numpy().tobytes())


def test_raw_crc_of_zeros_is_zero_and_of_one_changed_bit_is_not():
    zeros = torch.zeros(BLOCK, dtype=torch.uint8)
    assert device_crc.raw_crc(zeros).item() == 0
    zeros[BLOCK - 1] = 0x80
    assert device_crc.raw_crc(zeros).item() != 0


@pytest.mark.parametrize(
    "data",
    [
        torch.zeros(BLOCK + 1, dtype=torch.uint8),
        torch.zeros(0, dtype=torch.uint8),
        torch.zeros(BLOCK // 4, dtype=torch.int32),
    ],
    ids=["ragged", "empty", "int32"],
)
def test_raw_crc_refuses_what_it_cannot_take(data):
    with pytest.raises(ValueError, match="multiple of"):
        device_crc.raw_crc(data)


def test_split_takes_whole_segments_largest_first_and_leaves_the_tail():
    big, small = device_crc.SEGMENTS
    assert DeviceCrc.split(2 * big + 3 * small + 5) == ([big, big, small, small, small], 5)
    assert DeviceCrc.split(small - 1) == ([], small - 1)
    assert DeviceCrc.split(0) == ([], 0)
    assert DeviceCrc.count(big + small) == 2


def test_a_checker_gives_each_segments_crc32_in_queue_order(monkeypatch):
    monkeypatch.setattr(device_crc, "SEGMENTS", (4 * BLOCK, BLOCK))
    first, second = _random(6 * BLOCK, 1), _random(BLOCK, 2)
    checker = DeviceCrc(torch.device("cpu"), 4)
    parts = checker.queue(first, [4 * BLOCK, BLOCK], None) + checker.queue(second, [BLOCK], None)
    checker.close()
    pieces = [first[: 4 * BLOCK], first[4 * BLOCK : 5 * BLOCK], second]
    assert [part.result() for part in parts] == [zlib.crc32(p.numpy().tobytes()) for p in pieces]


@pytest.mark.gpu
def test_graphs_on_the_gpu_give_zlibs_crc32():
    """Segments of both sizes, replayed from one checker, at offsets that are not segment-aligned."""
    big, small = device_crc.SEGMENTS
    host = _random(big + 3 * small + 4096, 3)
    data = host.cuda()
    checker = DeviceCrc(torch.device("cuda"), 8)
    sizes = [big, small, small]
    parts = checker.queue(data[4096:], sizes, _event_now())
    parts += checker.queue(data[:small], [small], _event_now())
    checker.close()
    expected, offset = [], 4096
    for size in sizes:
        expected.append(zlib.crc32(host[offset : offset + size].numpy().tobytes()))
        offset += size
    expected.append(zlib.crc32(host[:small].numpy().tobytes()))
    assert [part.result() for part in parts] == expected


def _event_now() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


@pytest.fixture
def queued(monkeypatch) -> list[int]:
    """The sizes of the segments checksummed on the device, in queue order, by every load of the test."""
    sizes: list[int] = []
    real_queue = DeviceCrc.queue
    monkeypatch.setattr(DeviceCrc, "queue", lambda self, *a: sizes.extend(a[1]) or real_queue(self, *a))
    return sizes


# Two ring buffers: a 40 MiB record is read in 16 MiB windows (a load smaller than 16 windows spreads over the
# ring in smaller ones, and pieces below the smallest segment are all checksummed on the CPU).
_TWO_WINDOWS = {"read_buffer_count": 2}


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [True, False])
def test_a_verified_cuda_load_finds_a_changed_byte_in_any_part_of_a_record(tmp_path, queued, on_device):
    """A 40 MiB record: a flipped byte in its first and second windows (segments the device checksums) and in
    its last bytes (a tail the CPU checksums) is found, with the device's checksums and without; the untouched
    file loads equal."""
    tensor = _random((40 << 20) + 3000, 4)
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"t": tensor}, path)
    loaded = fastpersist.load(path, map_location="cuda", device_checksum=on_device, **_TWO_WINDOWS)
    assert torch.equal(loaded["t"].cpu(), tensor)
    assert bool(queued) == on_device and set(queued) <= set(device_crc.SEGMENTS)
    offset = _data_offset(path, tensor)
    for where in (10, (20 << 20) + 10, tensor.numel() - 1):
        with open(path, "r+b") as f:
            f.seek(offset + where)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(fastpersist.ChecksumMismatchError, match="data/0"):
            fastpersist.load(path, map_location="cuda", device_checksum=on_device, **_TWO_WINDOWS)
        with open(path, "r+b") as f:
            f.seek(offset + where)
            f.write(byte)


def _data_offset(path, tensor: torch.Tensor) -> int:
    """Where the tensor's bytes start in the file (found by content: the first 64 bytes are random)."""
    blob = open(path, "rb").read()
    offset = blob.find(tensor[:64].numpy().tobytes())
    assert offset > 0
    return offset


def test_a_forked_child_forgets_the_parents_graphs_without_destroying_them():
    cache = device_crc._Cache()
    parent_graphs = object()
    cache.idle[torch.device("cuda", 0)] = [parent_graphs]
    cache.forget_after_fork()
    assert cache.idle == {} and cache.release() == 0
    assert cache.forked == [{torch.device("cuda", 0): [parent_graphs]}]  # kept, never destroyed


@pytest.mark.gpu
def test_loads_reuse_their_graphs_and_release_buffers_frees_them(tmp_path, monkeypatch):
    made = []
    real = device_crc._Graphs.__init__
    monkeypatch.setattr(device_crc._Graphs, "__init__", lambda self, device: made.append(device) or real(self, device))
    fastpersist.release_buffers()
    tensor = _random((40 << 20) + 5, 5)
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"t": tensor}, path)

    def load():
        return fastpersist.load(path, map_location="cuda", device_checksum=True, **_TWO_WINDOWS)["t"].cpu()

    for _ in range(2):
        assert torch.equal(load(), tensor)
    assert len(made) == 1
    assert fastpersist.release_buffers() >= max(device_crc.SEGMENTS)
    assert torch.equal(load(), tensor)
    assert len(made) == 2


def test_segments_longer_than_a_block_run_the_table_step_block_by_block(monkeypatch):
    """The table step's temporaries cover one block at a time: blocks that divide the segment and one that leaves
    a shorter last block give zlib's CRC-32 all the same."""
    data = _random(3 * BLOCK, 6)
    expected = zlib.crc32(data.numpy().tobytes())
    for block in (BLOCK, 2 * BLOCK, 40 * device_crc.CHUNK):
        monkeypatch.setattr(device_crc, "BLOCK", block)
        assert device_crc.crc32_of_raw(device_crc.raw_crc(data).item(), data.numel()) == expected


@pytest.mark.parametrize(
    "given, expected",
    [(True, "always"), (False, "never"), ("true", "always"), ("0", "never"), ("auto", "auto"), (" never ", "never")],
)
def test_the_setting_takes_its_modes_and_the_old_booleans(given, expected):
    assert fastpersist.config.resolve({"device_checksum": given}).device_checksum == expected


def test_the_setting_defaults_to_auto_and_refuses_other_values(monkeypatch):
    assert fastpersist.config.Settings().device_checksum == "auto"
    with pytest.raises(fastpersist.ConfigError, match="device_checksum must be one of"):
        fastpersist.config.resolve({"device_checksum": "sometimes"})


class _FakeGraphs:
    """Stands in for a captured set: records the thread that made it, fails if told to."""

    made: list = []
    fail = False

    def __init__(self, device):
        if _FakeGraphs.fail:
            raise torch.cuda.OutOfMemoryError("no room for the graphs")
        self.device, self.nbytes = device, 1
        _FakeGraphs.made.append(threading.current_thread().name)


class _FakeWarmUp:
    """Stands in for the warm-up: records its thread, waits for ``go`` first, fails if told to."""

    def __init__(self):
        self.threads, self.go, self.fail = [], threading.Event(), False

    def __call__(self, device):
        self.go.wait(10)
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise torch.cuda.OutOfMemoryError("no room to warm up")


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(device_crc, "_Graphs", _FakeGraphs)
    monkeypatch.setattr(_FakeGraphs, "made", [])
    monkeypatch.setattr(_FakeGraphs, "fail", False)
    warm_up = _FakeWarmUp()
    monkeypatch.setattr(device_crc, "_warm_up", warm_up)
    return warm_up


def _wait_until(condition) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the background warm-up did not finish"
        time.sleep(0.01)


def test_auto_warms_up_in_the_background_captures_in_the_next_large_load_and_later_loads_take_the_set(fake_graphs):
    """No capture runs on a thread of its own: while a stream captures, another thread's torch.cuda.synchronize()
    fails, so a capture beside the caller's code could break it. The warm-up (eager) runs in the background."""
    cache, device = device_crc._Cache(), torch.device("cuda", 0)
    assert cache.ready(device, start=False) is None and not cache.background  # a small load starts nothing
    assert cache.ready(device, start=True) is None  # a large one starts the warm-up and does not wait
    assert cache.ready(device, start=True) is None and cache.background == {device}  # one warm-up at a time
    assert _FakeGraphs.made == []
    fake_graphs.go.set()
    _wait_until(lambda: not cache.background)
    assert fake_graphs.threads == ["fastpersist-crc-warm-up_0"] and cache.warm == {device}
    assert cache.ready(device, start=False) is None and _FakeGraphs.made == []  # a small load captures nothing
    graphs = cache.ready(device, start=True)  # the next large load captures, on its own thread
    assert isinstance(graphs, _FakeGraphs) and _FakeGraphs.made == [threading.current_thread().name]
    assert cache.ready(device, start=False) is None  # leased: not idle
    cache.give_back(graphs)
    assert cache.ready(device, start=True) is graphs and len(_FakeGraphs.made) == 1
    assert fake_graphs.threads == ["fastpersist-crc-warm-up_0"]  # warmed up once


def test_a_failed_warm_up_is_not_retried_until_release(fake_graphs, caplog):
    cache, device = device_crc._Cache(), torch.device("cuda", 0)
    fake_graphs.fail = True
    fake_graphs.go.set()
    assert cache.ready(device, start=True) is None
    _wait_until(lambda: not cache.background)
    assert cache.failed == {device} and not cache.warm and "warming up failed" in caplog.text
    assert cache.ready(device, start=True) is None and not cache.background  # not tried again
    fake_graphs.fail = False
    assert cache.release() == 0
    assert cache.ready(device, start=True) is None
    _wait_until(lambda: not cache.background)
    assert cache.warm == {device} and isinstance(cache.ready(device, start=True), _FakeGraphs)


def test_a_failed_capture_leaves_that_load_on_the_cpu_and_is_not_retried_until_release(fake_graphs, caplog):
    cache, device = device_crc._Cache(), torch.device("cuda", 0)
    fake_graphs.go.set()
    assert cache.ready(device, start=True) is None
    _wait_until(lambda: not cache.background)
    _FakeGraphs.fail = True
    assert cache.ready(device, start=True) is None  # logged, not raised
    assert cache.failed == {device} and "capturing failed" in caplog.text
    _FakeGraphs.fail = False
    assert cache.ready(device, start=True) is None and _FakeGraphs.made == []  # not tried again
    cache.release()
    assert isinstance(cache.ready(device, start=True), _FakeGraphs)  # still warm: captured at once
    assert fake_graphs.threads == ["fastpersist-crc-warm-up_0"]


def test_always_captures_in_the_load_and_raises_what_capturing_raised(fake_graphs):
    cache, device = device_crc._Cache(), torch.device("cuda", 0)
    _FakeGraphs.fail = True
    with pytest.raises(torch.cuda.OutOfMemoryError):
        cache.lease(device)
    _FakeGraphs.fail = False
    graphs = cache.lease(device)
    assert _FakeGraphs.made == [threading.current_thread().name] and cache.warm == {device}
    assert fake_graphs.threads == []  # the capture warms up on its own
    cache.give_back(graphs)
    assert cache.ready(device, start=False) is graphs


def test_no_background_warm_up_starts_once_the_interpreter_shuts_down(fake_graphs, monkeypatch):
    """Where no thread may start, the warm-up would run on the caller's thread: auto starts none."""
    monkeypatch.setattr(device_crc.workers, "threads_allowed", lambda: False)
    cache = device_crc._Cache()
    assert cache.ready(torch.device("cuda", 0), start=True) is None and not cache.background
    assert _FakeGraphs.made == [] and fake_graphs.threads == []


@pytest.mark.gpu
def test_auto_loads_checksum_on_the_cpu_until_the_set_is_captured_then_on_the_device(tmp_path, monkeypatch, queued):
    """The first large verified load neither waits for a warm-up nor checksums on the device; the loads after the
    background warm-up do (the first of them captures the set); all load equal, and a changed byte is still found."""
    monkeypatch.setattr(device_crc, "AUTO_BYTES", 32 << 20)
    monkeypatch.setattr(device_crc, "_cache", device_crc._Cache())  # a device that earlier tests warmed up is cold
    tensor = _random((40 << 20) + 3000, 7)
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"t": tensor}, path)
    assert torch.equal(fastpersist.load(path, map_location="cuda", **_TWO_WINDOWS)["t"].cpu(), tensor)
    assert not queued
    _wait_until(lambda: not device_crc._cache.background)
    assert torch.equal(fastpersist.load(path, map_location="cuda", **_TWO_WINDOWS)["t"].cpu(), tensor)
    assert queued and set(queued) <= set(device_crc.SEGMENTS)
    with open(path, "r+b") as f:
        f.seek(_data_offset(path, tensor) + 100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(fastpersist.ChecksumMismatchError, match="data/0"):
        fastpersist.load(path, map_location="cuda", **_TWO_WINDOWS)
    fastpersist.release_buffers()


@pytest.mark.gpu
def test_the_caller_may_synchronize_the_device_right_after_a_large_verified_load(tmp_path, monkeypatch):
    """Regression: auto captured its graphs on a thread of its own after the first large verified load, and the
    caller's next torch.cuda.synchronize() failed ("operation not permitted when stream is capturing")."""
    monkeypatch.setattr(device_crc, "AUTO_BYTES", 32 << 20)
    monkeypatch.setattr(device_crc, "_cache", device_crc._Cache())
    tensor = _random((40 << 20) + 3000, 7)
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"t": tensor}, path)
    for _ in range(3):
        loaded = fastpersist.load(path, map_location="cuda", **_TWO_WINDOWS)["t"]
        synchronized = 0
        while device_crc._cache.background or synchronized < 100:  # all through the warm-up, if one runs
            torch.cuda.synchronize()
            synchronized += 1
        assert torch.equal(loaded.cpu(), tensor)
    assert device_crc._cache.idle  # the second load captured a set, inside itself
    fastpersist.release_buffers()
