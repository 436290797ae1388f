"""The pinned ring (``io.ring``): slots taken in order, each reused only once its last use is over, and a ring
that drains (nothing in flight) before its buffers go back to the pool, whatever raised.

Driven on CPU with handles that record what happens and when; the native engine's own fault hook covers the
real handles. The users' paths (saves, CUDA loads, DCP files, DeepNVMe's CUDA tensors) have their own tests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import threading
import time

import pytest
import torch

from fastpersist import config
from fastpersist.io import engine, memory, ring

SIZE = 1 << 20


class _Requests:
    """A slot handle whose requests finish only when released (or after ``delay`` seconds); it logs each event
    ``(what, slot, offset)`` and can fail the wait of a given request."""

    def __init__(self, slot: int, log: list, *, delay: float = 0.0, fail: int | None = None):
        self.slot, self.log, self.delay, self.fail = slot, log, delay, fail
        self.pending: list[tuple[int, int]] = []  # (request number, offset)
        self.done = 0
        self.submitted = 0

    def _submit(self, kind: str, address: int, nbytes: int, file, offset: int, keepalive, **options) -> None:
        assert keepalive.data_ptr() == address  # the buffer stays referenced while the request runs
        self.submitted += 1
        self.pending.append((self.submitted, offset))
        self.log.append((kind, self.slot, offset))

    def submit_write(self, *args, **options) -> None:
        self._submit("write", *args, **options)

    def submit_read(self, *args, **options) -> None:
        self._submit("read", *args, **options)

    def wait(self) -> None:
        time.sleep(self.delay)
        pending, self.pending = self.pending, []
        for _, offset in pending:
            self.done += 1
            self.log.append(("done", self.slot, offset))
        if any(number == self.fail for number, _ in pending):
            raise OSError(errno.EIO, f"injected failure of slot {self.slot}")


class _Task:
    """A checksum task that reads the buffer for ``delay`` seconds."""

    def __init__(self, log: list, name: str, delay: float = 0.05):
        self.log, self.name, self.delay = log, name, delay
        self.finished = False

    def wait(self) -> None:
        if not self.finished:
            time.sleep(self.delay)
            self.finished = True
            self.log.append(("checksum", self.name))


@contextlib.contextmanager
def _watched_pool(monkeypatch, log: list):
    """Logs ``("lease", n)`` and ``("returned", n)`` around every lease of the pool; yields the leases' buffers."""
    real = memory.lease_buffers
    leased: list[torch.Tensor] = []

    @contextlib.contextmanager
    def lease(count, size, huge_pages=True):
        with real(count, size, huge_pages) as buffers:
            log.append(("lease", count))
            leased.extend(buffers)
            yield buffers
            log.append(("returned", count))

    monkeypatch.setattr(memory, "lease_buffers", lease)
    yield leased


def _after(log: list, first, then) -> bool:
    return log.index(then) > log.index(first)


def test_slots_are_used_in_order_and_each_waits_for_its_last_io_before_reuse(monkeypatch):
    log: list = []
    handles = [_Requests(slot, log) for slot in range(3)]
    with _watched_pool(monkeypatch, log) as leased, ring.Ring(handles, SIZE) as staging:
        assert [slot.index for slot in staging.slots] == [0, 1, 2]
        assert [slot.buffer.data_ptr() for slot in staging.slots] == [b.data_ptr() for b in leased]
        assert all(slot.address % memory.PAGE_SIZE == 0 and slot.buffer.numel() == SIZE for slot in staging.slots)
        for use in range(8):
            slot = staging.slot(use)
            assert slot is staging.slots[use % 3]
            slot.wait_idle()
            slot.view[:4] = use.to_bytes(4, "little")  # the buffer is ours until the write below
            slot.submit_write(SIZE, None, use * SIZE)
    writes = [(event[1], event[2]) for event in log if event[0] == "write"]
    assert writes == [(use % 3, use * SIZE) for use in range(8)]
    for use in range(3, 8):  # a slot's write is done before the slot's next use is submitted
        assert _after(log, ("done", use % 3, (use - 3) * SIZE), ("write", use % 3, use * SIZE))
    assert all(handle.done == handle.submitted for handle in handles)
    assert log[-1] == ("returned", 3)  # after every write is done


def test_a_slot_waits_for_its_stage_then_its_copies_and_checksums_then_its_io(monkeypatch):
    log: list = []
    handles = [_Requests(0, log)]
    stages = concurrent.futures.ThreadPoolExecutor(1)
    with _watched_pool(monkeypatch, log), ring.Ring(handles, SIZE) as staging:
        slot = staging.slot(0)

        def stage() -> None:
            time.sleep(0.05)
            log.append(("stage", 0))
            slot.submit_write(SIZE, None, 0)

        slot.stage = stages.submit(stage)
        slot.checksums = [_Task(log, "a"), _Task(log, "b")]
        assert slot.busy()
        slot.wait_idle()
        assert not slot.busy() and slot.stage is None and slot.checksums == []
        assert log[1:] == [("stage", 0), ("write", 0, 0), ("checksum", "a"), ("checksum", "b"), ("done", 0, 0)]
        assert handles[0].done == 1
        slot.wait_idle()  # nothing left: the handle is not waited for again
        assert log[-1] == ("done", 0, 0)
    stages.shutdown()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_in_the_block_drains_every_slot_before_the_buffers_go_back(monkeypatch, error):
    """Writes in flight on every slot, checksums reading one buffer and a stage still running when the user's
    code raises: the error propagates (a KeyboardInterrupt too), once all of them are done."""
    log: list = []
    handles = [_Requests(slot, log, delay=0.02) for slot in range(3)]
    stages = concurrent.futures.ThreadPoolExecutor(1)
    with _watched_pool(monkeypatch, log), pytest.raises(error), ring.Ring(handles, SIZE) as staging:
        for use in range(3):
            staging.slot(use).submit_write(SIZE, None, use * SIZE)
        staging.slots[1].checksums = [_Task(log, "slow", delay=0.1)]
        staging.slots[2].stage = stages.submit(lambda: time.sleep(0.3) or log.append(("stage", 2)))
        raise error("in the user's code")
    returned = log.index(("returned", 3))
    assert all(handle.done == handle.submitted == 1 for handle in handles)
    assert all(log.index(event) < returned for event in [("checksum", "slow"), ("stage", 2)])
    assert all(log.index(("done", slot, slot * SIZE)) < returned for slot in range(3))
    stages.shutdown()


def test_the_first_io_error_raises_once_the_other_slots_are_done(monkeypatch):
    """A failed write of slot 1, reported when the ring is left normally: the ring waits for slots 0 and 2 (whose
    writes are still in flight) before raising it, and their errors would not replace it."""
    log: list = []
    handles = [_Requests(0, log, delay=0.02), _Requests(1, log, fail=1), _Requests(2, log, delay=0.05, fail=1)]
    with _watched_pool(monkeypatch, log), pytest.raises(OSError, match="slot 1") as raised:
        with ring.Ring(handles, SIZE) as staging:
            for use in range(3):
                staging.slot(use).submit_write(SIZE, None, use * SIZE)
    assert raised.value.errno == errno.EIO
    assert all(handle.done == handle.submitted == 1 for handle in handles)
    assert log.index(("done", 2, 2 * SIZE)) < log.index(("returned", 3))


def test_a_failed_stage_raises_from_the_slot_and_the_ring_still_drains(monkeypatch):
    log: list = []
    handles = [_Requests(slot, log, delay=0.02) for slot in range(2)]
    stages = concurrent.futures.ThreadPoolExecutor(1)

    def failing_stage() -> None:
        raise ValueError("the stage failed")

    with _watched_pool(monkeypatch, log), pytest.raises(ValueError, match="stage failed"):
        with ring.Ring(handles, SIZE) as staging:
            staging.slot(1).submit_write(SIZE, None, SIZE)  # in flight on the other slot
            staging.slot(0).stage = stages.submit(failing_stage)
            staging.slot(2).wait_idle()  # the ring's third use: slot 0 again
            pytest.fail("a slot whose stage failed is not reused")
    assert handles[1].done == 1 and log.index(("done", 1, SIZE)) < log.index(("returned", 2))
    stages.shutdown()


def test_a_handle_that_fails_to_submit_is_still_waited_for(monkeypatch):
    """A submit that raises part way may have started requests: the slot waits for its handle all the same."""
    log: list = []

    class HalfSubmitted(_Requests):
        def submit_write(self, *args, **options) -> None:
            super().submit_write(*args, **options)
            raise OSError(errno.ENOSPC, "no space after the first block")

    handles = [HalfSubmitted(0, log)]
    with _watched_pool(monkeypatch, log), pytest.raises(OSError, match="no space"):
        with ring.Ring(handles, SIZE) as staging:
            staging.slot(0).submit_write(SIZE, None, 0)
    assert handles[0].done == 1 and log.index(("done", 0, 0)) < log.index(("returned", 1))


def test_the_pool_gets_the_buffers_back_and_a_ring_reuses_them(monkeypatch):
    log: list = []
    handles = [_Requests(slot, log) for slot in range(2)]
    with ring.Ring(handles, SIZE) as first:
        addresses = {slot.address for slot in first.slots}
    with ring.Ring(handles, SIZE) as again:
        assert {slot.address for slot in again.slots} == addresses
        with ring.Ring(handles, SIZE) as nested:  # a ring in use lends its buffers to no one else
            assert not addresses & {slot.address for slot in nested.slots}


def _file(tmp_path, name: str):
    path = tmp_path / name
    file = engine.File(str(path), "w", direct=True, truncate=True)
    return path, file


@pytest.mark.parametrize("shared", [False, True], ids=["handle-per-slot", "shared-handle"])
def test_real_handles_write_every_window_in_order(tmp_path, shared):
    """Native handles, one per slot or one shared by the slots' detached requests: 9 windows of odd
    content through 3 slots land where they belong."""
    settings = config.settings()
    windows = [torch.randint(0, 256, (SIZE,), dtype=torch.uint8) for _ in range(9)]
    windows[-1] = windows[-1][: SIZE - 4097]  # a short last window
    if shared:
        native = engine.make_handle(settings)
        handles = [ring.SharedHandle(native) for _ in range(3)]
    else:
        handles = [engine.make_handle(settings) for _ in range(3)]
    path, file = _file(tmp_path, "w.bin")
    try:
        with ring.Ring(handles, SIZE) as staging:
            for use, window in enumerate(windows):
                slot = staging.slot(use)
                slot.wait_idle()
                slot.buffer[: window.numel()].copy_(window)
                slot.submit_write(window.numel(), file, use * SIZE)
    finally:
        file.close()
    assert path.read_bytes() == b"".join(w.numpy().tobytes() for w in windows)


@pytest.mark.parametrize("shared", [False, True], ids=["handle-per-slot", "shared-handle"])
def test_a_failing_native_write_leaves_nothing_in_flight(tmp_path, shared):
    settings = config.settings()
    with engine.inject_fault(nth=3, op="write"):  # the third write of each handle
        natives = [engine.make_handle(settings) for _ in range(1 if shared else 3)]
    handles = [ring.SharedHandle(natives[0]) for _ in range(3)] if shared else natives
    _, file = _file(tmp_path, "f.bin")
    try:
        with pytest.raises(OSError) as raised, ring.Ring(handles, SIZE) as staging:
            for use in range(12):
                slot = staging.slot(use)
                slot.wait_idle()
                slot.buffer.fill_(use)
                slot.submit_write(SIZE, file, use * SIZE)
    finally:
        file.close()
    assert raised.value.errno == errno.EIO and raised.value.filename
    assert all(native.pending() == 0 for native in natives)


def test_shared_handle_slots_wait_only_for_their_own_request(tmp_path):
    """A slot's wait neither waits for nor raises the error of another slot's request on the shared handle."""
    native = engine.make_handle(config.settings())
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 4096)
    good = tmp_path / "good.bin"
    good.write_bytes(b"y" * SIZE)
    readable = [engine.File(str(p), "r", direct=False) for p in (short, good)]
    try:
        with ring.Ring([ring.SharedHandle(native) for _ in range(2)], SIZE) as staging:
            failing, fine = staging.slots
            failing.submit_read(SIZE, readable[0], 0)  # past the end of the file: fails
            fine.submit_read(SIZE, readable[1], 0)
            fine.wait_io()
            assert bytes(fine.view[:4]) == b"yyyy"
            with pytest.raises(EOFError):
                failing.wait_io()
    finally:
        for file in readable:
            file.close()
    assert native.pending() == 0


def test_two_threads_run_rings_of_their_own_at_once(tmp_path):
    settings = config.settings()
    errors: list = []

    def one(name: str) -> None:
        try:
            path, file = _file(tmp_path, name)
            try:
                with ring.Ring([engine.make_handle(settings) for _ in range(2)], SIZE) as staging:
                    for use in range(6):
                        slot = staging.slot(use)
                        slot.wait_idle()
                        slot.buffer.fill_(use + 1)
                        slot.submit_write(SIZE, file, use * SIZE)
            finally:
                file.close()
            data = path.read_bytes()
            assert all(data[use * SIZE : (use + 1) * SIZE] == bytes([use + 1]) * SIZE for use in range(6))
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(error)

    threads = [threading.Thread(target=one, args=(f"t{i}.bin",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


@pytest.mark.gpu
def test_copies_queued_but_not_tracked_are_waited_for_when_the_ring_drains():
    """A device-to-host copy queued on the ring's side stream, then an error before its event was recorded:
    the ring synchronizes the stream before the buffer goes back."""
    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device=device)
    handles = [ring.SharedHandle(engine.make_handle(config.settings()))]
    with pytest.raises(RuntimeError, match="after the copy"), ring.Ring(handles, 64 << 20) as staging:
        stream = staging.stream(device)
        assert staging.stream(device) is stream  # made once
        with torch.cuda.stream(stream):
            staging.slot(0).buffer.copy_(source, non_blocking=True)
        raise RuntimeError("after the copy, before its event")
    assert stream.query()


@pytest.mark.gpu
def test_a_slot_waits_for_its_tracked_copies_and_the_ring_for_its_streams():
    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device=device)
    handles = [ring.SharedHandle(engine.make_handle(config.settings()))]
    with ring.Ring(handles, SIZE) as staging:
        slot = staging.slot(0)
        stream = staging.stream(device)
        with torch.cuda.stream(stream):
            slot.buffer.copy_(source, non_blocking=True)
        event = slot.track_copies(stream)
        slot.wait_idle()
        assert event.query() and slot.events == []
        assert torch.equal(slot.buffer, source.cpu())
        with torch.cuda.stream(stream):
            slot.buffer.copy_(source.flip(0), non_blocking=True)
        slot.track_copies(stream)
        staging.wait_streams()  # one synchronization of the stream stands for every slot's events
        assert slot.events == [] and stream.query()
        assert torch.equal(slot.buffer, source.flip(0).cpu())
