"""The CUDA load path (``reader._stream_windows`` on an ``io.ring.Ring``) streaming windows into storages, on CPU.

The ring serves CUDA targets; its scheduling (which slot reads which window, refills on a helper
thread, errors, nothing left in flight) does not depend on the device, so these tests run it with CPU
destinations, which it copies into at once. The CUDA copies themselves are covered by the GPU tests
(tests/api/test_save_load.py, tests/io/test_parallel_crc.py).
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import fastpersist
from fastpersist import config
from fastpersist.errors import ChecksumMismatchError
from fastpersist.format.zipformat import read_directory
from fastpersist.io import engine, reader
from fastpersist.tensors import storage_byte_view

# 1 MiB windows, two slots: six 1.2 MB records make seven windows, so each slot is refilled twice or more.
SETTINGS = config.resolve({"read_buffer_size": "1M", "block_size": "1M", "read_buffer_count": 2})


class _Handle:
    """A native handle that records what it is asked to read, from which thread, and can fail."""

    def __init__(self, slot: int, log: list, fail_submit: int | None = None, fail_wait: int | None = None):
        self.real = engine.make_handle(SETTINGS, direct=False)
        self.slot, self.log = slot, log
        self.submits = 0
        self.waits = 0
        self.fail_submit, self.fail_wait = fail_submit, fail_wait

    def submit_read(self, ptr, nbytes, target, file_offset, keepalive):
        self.submits += 1
        if self.submits == self.fail_submit:
            raise OSError(errno.EIO, "injected submit failure")
        self.log.append((self.slot, file_offset, threading.current_thread().name))
        return self.real.submit_read(ptr, nbytes, target, file_offset, keepalive)

    def wait(self):
        self.waits += 1
        done = self.real.wait()
        if self.waits == self.fail_wait:
            raise OSError(errno.EIO, "injected read failure")
        return done

    def pending(self):
        return self.real.pending()


def _checkpoint(tmp_path, count: int = 6):
    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(300_000, generator=generator) for i in range(count)}
    path = str(tmp_path / "ring.pt")
    fastpersist.save(state, path)
    with open(path, "rb") as handle:
        fd = handle.fileno()
        records = read_directory(lambda offset, n: os.pread(fd, n, offset), os.fstat(fd).st_size)
    return path, state, [record for record in records if "/data/" in record.name]


def _load(path, records, handles, *, verify=True, settings=SETTINGS):
    """Reads every record through the ring of ``handles`` into fresh CPU storages; returns them."""
    file = engine.File(path, "r", direct=False)
    provider = reader.FileStorageProvider(file, records, settings, verify=verify, path=path)
    provider._ring_handles = handles
    items = [(record, torch.UntypedStorage(record.size)) for record in records]
    try:
        provider._read_device(items)
    finally:
        provider.close()
        file.close()
    return items


def _refill_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fastpersist-refill")]


def test_every_window_lands_and_each_slot_is_refilled_in_order_off_the_calling_thread(tmp_path):
    path, state, records = _checkpoint(tmp_path)
    log: list = []
    handles = [_Handle(slot, log) for slot in range(2)]
    items = _load(path, records, handles)

    by_name = {record.name.rsplit("/", 1)[-1]: storage for record, storage in items}
    for index, tensor in enumerate(state.values()):  # saved in order: key i is record "i"
        assert torch.equal(storage_byte_view(by_name[str(index)]), storage_byte_view(tensor.untyped_storage()))

    in_order = sorted(((r, storage_byte_view(s)) for r, s in items), key=lambda item: item[0].data_offset)
    windows = reader._windows(in_order, 1 << 20, None)
    assert len(windows) >= 6  # several refills per slot
    offsets = [offset for _, offset, _ in log]
    assert sorted(offsets) == [w.start for w in windows]  # each window read once
    for slot in range(2):  # slot s reads windows s, s + 2, s + 4, ...
        assert [o for s, o, _ in log if s == slot] == [w.start for w in windows[slot::2]]
    caller = threading.current_thread().name
    assert [name for _, _, name in log[:2]] == [caller, caller]  # the first fill
    assert all(name.startswith("fastpersist-refill") for _, _, name in log[2:])  # refills
    assert not _refill_threads()


def test_a_corrupted_byte_in_a_later_window_is_found(tmp_path):
    path, _, records = _checkpoint(tmp_path)
    last = max(records, key=lambda record: record.data_offset)
    with open(path, "r+b") as handle:
        handle.seek(last.data_offset + last.size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError, match=last.name.rsplit("/", 1)[-1]):
        _load(path, records, [_Handle(slot, []) for slot in range(2)])
    _load(path, records, [_Handle(slot, []) for slot in range(2)], verify=False)  # unverified: no check


@pytest.mark.parametrize("failure", ["refill", "read"])
def test_a_failure_mid_ring_raises_once_everything_in_flight_is_done(tmp_path, failure):
    """A refill that cannot submit, or a read that fails: the load raises that error, no slot is
    refilled after it, no read is left in flight and the helper thread is gone."""
    path, _, records = _checkpoint(tmp_path)
    log: list = []
    if failure == "refill":  # slot 1's third read (window 5) cannot be submitted
        handles = [_Handle(0, log), _Handle(1, log, fail_submit=3)]
    else:  # slot 0's second read (window 2) fails
        handles = [_Handle(0, log, fail_wait=2), _Handle(1, log)]
    with pytest.raises(OSError, match="injected"):
        _load(path, records, handles)
    assert all(handle.pending() == 0 for handle in handles)
    assert not _refill_threads()
    windows_read = len(log)
    assert windows_read < 7  # stopped before the end
    # Every window the ring read was a window of this load, each once.
    assert len({offset for _, offset, _ in log}) == windows_read


def test_stream_to_device_reads_payloads_of_several_files_and_returns_their_crcs(tmp_path):
    """The ring's entry point for DCP: payloads at any offset of several files, interleaved, some empty."""
    import zlib

    generator = torch.Generator().manual_seed(1)
    blobs, files = [], []
    for name in ("a.bin", "b.bin"):
        blob = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, generator=generator)
        (tmp_path / name).write_bytes(blob.numpy().tobytes())
        blobs.append(blob)
        files.append(engine.File(str(tmp_path / name), "r", direct=False))
    spans = [(1, 4097, 3 << 20), (0, 123, 1_500_000), (1, 0, 0), (0, 2 << 20, 2 << 20), (1, (3 << 20) + 4097, 5)]
    payloads = [(files[f], offset, n, torch.empty(n, dtype=torch.uint8)) for f, offset, n in spans]
    try:
        crcs = reader.stream_to_device(payloads, SETTINGS, verify=True)
        unverified = reader.stream_to_device(payloads, SETTINGS, verify=False)
    finally:
        for file in files:
            file.close()
    for (f, offset, n), (_, _, _, destination), crc in zip(spans, payloads, crcs):
        expected = blobs[f][offset : offset + n]
        assert torch.equal(destination, expected)
        assert crc == zlib.crc32(expected.numpy().tobytes())
    assert unverified == [0] * len(spans)
    assert not _refill_threads()


def test_checksums_of_a_window_whose_copies_fail_are_waited_for(tmp_path, monkeypatch):
    """The buffer goes back to the pool only once nothing reads it: the CRC-32s queued for a window
    whose copies raise are waited for before the error leaves the ring."""
    import time

    class SlowCrc:
        finished = False

        def wait(self):
            time.sleep(0.2)
            self.finished = True

    queued: list = []
    monkeypatch.setattr(reader, "_queue_crcs", lambda *args: queued.append(SlowCrc()) or [queued[-1]])
    real_copies = reader._queue_copies

    def failing_copies(window, slot, ring):
        if len(queued) == 3:
            raise RuntimeError("injected copy failure")
        return real_copies(window, slot, ring)

    monkeypatch.setattr(reader, "_queue_copies", failing_copies)
    path, _, records = _checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        _load(path, records, [_Handle(slot, []) for slot in range(2)])
    assert len(queued) == 3 and all(crc.finished for crc in queued)
    assert not _refill_threads()


def _on_device(monkeypatch, segments=(256 << 10, 64 << 10)):
    """The device's checksums, for the CPU destinations these tests use, with segments small enough that
    the 1.2 MB records' pieces hold some of each and a tail."""
    from fastpersist.io import device_crc

    monkeypatch.setattr(reader, "_CHECKSUM_ON_DEVICE", ("cpu",))
    monkeypatch.setattr(device_crc, "SEGMENTS", segments)


def _load_on_device(path, records, handles):
    return _load(path, records, handles, settings=config.resolve({**SETTINGS.as_dict(), "device_checksum": True}))


def test_device_checksums_take_the_whole_segments_and_the_cpu_the_tails(tmp_path, monkeypatch):
    from fastpersist.io.device_crc import DeviceCrc

    _on_device(monkeypatch)
    queued = []
    real_queue = DeviceCrc.queue
    monkeypatch.setattr(DeviceCrc, "queue", lambda self, *a: queued.append(a[1]) or real_queue(self, *a))
    path, state, records = _checkpoint(tmp_path)
    items = _load_on_device(path, records, [_Handle(slot, []) for slot in range(2)])
    by_name = {record.name.rsplit("/", 1)[-1]: storage for record, storage in items}
    for index, tensor in enumerate(state.values()):
        assert torch.equal(storage_byte_view(by_name[str(index)]), storage_byte_view(tensor.untyped_storage()))
    assert {size for sizes in queued for size in sizes} == {256 << 10, 64 << 10}
    assert sum(map(sum, queued)) < sum(record.size for record in records)  # the tails went to the CPU


@pytest.mark.parametrize("part", ["segment", "tail"])
def test_the_device_checksums_find_a_changed_byte_in_a_segment_or_a_tail(tmp_path, monkeypatch, part):
    from fastpersist.io.device_crc import DeviceCrc

    _on_device(monkeypatch)
    path, _, records = _checkpoint(tmp_path)
    last = max(records, key=lambda record: record.data_offset)
    in_order = sorted(records, key=lambda record: record.data_offset)
    windows = reader._windows([(r, torch.empty(r.size, dtype=torch.uint8)) for r in in_order], 1 << 20, None)
    pieces = [p for w in windows for p in w.pieces if p[0] is last and all(DeviceCrc.split(p[4]))]
    _, _, record_offset, _, length = pieces[0]  # a piece with segments and a tail
    _, tail = DeviceCrc.split(length)
    where = record_offset + (10 if part == "segment" else length - tail + 10)
    with open(path, "r+b") as handle:
        handle.seek(last.data_offset + where)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatchError, match=last.name.rsplit("/", 1)[-1]):
        _load_on_device(path, records, [_Handle(slot, []) for slot in range(2)])


def test_a_device_without_room_for_its_checker_is_checksummed_on_the_cpu(tmp_path, monkeypatch, caplog):
    from fastpersist.io.device_crc import DeviceCrc

    _on_device(monkeypatch)

    def no_room(self, device, segments):
        raise torch.cuda.OutOfMemoryError("injected: no room for the graphs")

    monkeypatch.setattr(DeviceCrc, "__init__", no_room)
    monkeypatch.setattr(DeviceCrc, "queue", lambda *a: pytest.fail("nothing may be queued on the device"))
    path, _, records = _checkpoint(tmp_path)
    last = max(records, key=lambda record: record.data_offset)
    _load_on_device(path, records, [_Handle(slot, []) for slot in range(2)])
    assert "stay on the CPU" in caplog.text and "injected" in caplog.text
    with open(path, "r+b") as handle:
        handle.seek(last.data_offset + 10)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatchError):
        _load_on_device(path, records, [_Handle(slot, []) for slot in range(2)])


@pytest.mark.parametrize("device_checksums", [False, True], ids=["host-crc", "device-crc"])
def test_two_threads_stream_through_rings_of_their_own_at_once(tmp_path, monkeypatch, device_checksums):
    """Each load leases its own buffers and handles, and makes its own device checkers: two threads reading at
    once both get their bytes."""
    import concurrent.futures as futures

    load = _load_on_device if device_checksums else _load
    if device_checksums:
        _on_device(monkeypatch)
    path, state, records = _checkpoint(tmp_path)
    expected = [storage_byte_view(t.untyped_storage()) for t in state.values()]

    def one_load(_):
        items = load(path, records, [_Handle(slot, []) for slot in range(2)])
        by_name = {record.name.rsplit("/", 1)[-1]: storage for record, storage in items}
        return all(torch.equal(storage_byte_view(by_name[str(i)]), e) for i, e in enumerate(expected))

    with futures.ThreadPoolExecutor(2) as pool:
        assert all(pool.map(one_load, range(6)))
    assert not _refill_threads()


@pytest.mark.parametrize("device_checksums", [False, True], ids=["host-crc", "device-crc"])
def test_ctrl_c_in_the_ring_leaves_nothing_in_flight(tmp_path, monkeypatch, device_checksums):
    """A KeyboardInterrupt while the ring runs raises once every read and refill is done and every device
    checker closed (on CUDA: its stream waited for and its graphs given back)."""
    from fastpersist.io.device_crc import DeviceCrc

    load = _load_on_device if device_checksums else _load
    if device_checksums:
        _on_device(monkeypatch)
    made, closed = [], []
    real_init, real_close = DeviceCrc.__init__, DeviceCrc.close
    monkeypatch.setattr(DeviceCrc, "__init__", lambda self, *a: made.append(self) or real_init(self, *a))
    monkeypatch.setattr(DeviceCrc, "close", lambda self: closed.append(self) or real_close(self))
    real_copies = reader._queue_copies
    calls = []

    def interrupted_copies(window, slot, ring):
        calls.append(window)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_copies(window, slot, ring)

    monkeypatch.setattr(reader, "_queue_copies", interrupted_copies)
    path, _, records = _checkpoint(tmp_path)
    handles = [_Handle(slot, []) for slot in range(2)]
    with pytest.raises(KeyboardInterrupt):
        load(path, records, handles)
    assert closed == made and bool(made) == device_checksums
    assert all(handle.pending() == 0 for handle in handles)
    assert not _refill_threads()
