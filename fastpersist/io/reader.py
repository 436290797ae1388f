"""Reads storage records from a checkpoint file into tensor memory.

CPU targets: each storage's bytes are read with O_DIRECT straight into
page-aligned memory that *becomes* the storage (no second copy). The
destination is placed so that its address and the record's file offset agree
modulo the page size, which lets the engine read the aligned middle directly
even for torch.save's 64-byte-aligned files. Small records that sit next to
each other in the file share one allocation and one read.

CUDA targets: file windows stream through a ring of page-locked buffers
(one native handle per buffer, reads issued ahead), and each window is copied
host-to-device on a side stream into storages allocated on the device. Host
memory stays at the ring's size.

Both paths can verify each record's CRC-32 against the central directory on
the bytes they read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Sequence

import torch

from fastpersist.config import Settings
from fastpersist.format.zipformat import ZipRecordInfo, check_record_crc
from fastpersist.io import engine, memory, workers
from fastpersist.tensors import storage_byte_view

__all__ = ["FileStorageProvider", "MmapStorageProvider"]

_PAGE = 4096
_SMALL_RECORD = 1 << 20  # records below this share allocations and reads
_SLAB_LIMIT = 64 << 20
_MAX_GAP = 64 << 10  # bytes of headers we accept reading to merge two small records
_VERIFY_THREADS = 2  # CRC-32 runs at ~14 GB/s a thread: two keep up with any disk here
_POLL_SECONDS = 0.0002


def _align_down(value: int) -> int:
    return value - value % _PAGE


@dataclasses.dataclass
class _Slab:
    """One allocation and one read covering several small records' file range."""

    file_start: int  # page-aligned
    file_end: int
    buffer: object = None  # engine.AlignedBuffer, allocated on first use
    loaded: bool = False


class FileStorageProvider:
    """Implements format.deserializer.StorageProvider over an open native File.

    Call order: ``storage(...)`` any number of times, then ``flush()``; repeat.
    """

    def __init__(self, file, records: Sequence[ZipRecordInfo], settings: Settings, *, verify: bool, path: str):
        self._file = file
        self._settings = settings
        self._verify = verify
        self._path = path
        self._cpu: list[tuple[ZipRecordInfo, torch.UntypedStorage]] = []
        self._device: list[tuple[ZipRecordInfo, torch.UntypedStorage]] = []
        self._slab_of: dict[str, _Slab] = {}
        self._plan_slabs(records)

    # -- StorageProvider ------------------------------------------------------

    def storage(self, record: ZipRecordInfo, device: torch.device) -> torch.UntypedStorage:
        if device.type == "cuda":
            storage = torch.empty(record.size, dtype=torch.uint8, device=device).untyped_storage()
            self._device.append((record, storage))
            return storage
        storage = self._cpu_destination(record)
        self._cpu.append((record, storage))
        return storage

    def flush(self) -> None:
        if self._cpu:
            cpu, self._cpu = self._cpu, []
            self._read_cpu(cpu)
        if self._device:
            device, self._device = self._device, []
            self._read_device(device)

    # -- CPU ------------------------------------------------------------------

    def _plan_slabs(self, records: Sequence[ZipRecordInfo]) -> None:
        slab = None
        for record in sorted(records, key=lambda r: r.data_offset):
            if record.size == 0 or record.size >= _SMALL_RECORD or "/data/" not in record.name:
                continue
            if (
                slab is None
                or record.data_offset - slab.file_end > _MAX_GAP
                or record.data_offset + record.size - slab.file_start > _SLAB_LIMIT
            ):
                slab = _Slab(_align_down(record.data_offset), record.data_offset)
            slab.file_end = record.data_offset + record.size
            self._slab_of[record.name] = slab

    def _cpu_destination(self, record: ZipRecordInfo) -> torch.UntypedStorage:
        if record.size == 0:
            return torch.UntypedStorage(0)
        slab = self._slab_of.get(record.name)
        if slab is not None:
            if slab.buffer is None:
                slab.buffer = engine.AlignedBuffer(slab.file_end - slab.file_start, lock=False, huge_pages=False)
            offset = record.data_offset - slab.file_start
            return torch.frombuffer(slab.buffer, dtype=torch.uint8, count=record.size, offset=offset).untyped_storage()
        # Same address modulo the page as the file offset: the middle reads directly.
        delta = record.data_offset % _PAGE
        buffer = engine.AlignedBuffer(delta + record.size, lock=False, huge_pages=self._settings.huge_pages)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=record.size, offset=delta).untyped_storage()

    def _read_cpu(self, items: list[tuple[ZipRecordInfo, torch.UntypedStorage]]) -> None:
        handle = engine.make_handle(self._settings)
        slabs: list[_Slab] = []
        reads: list = []  # (native Request, the records whose bytes it brings), in submission order
        checks: list[concurrent.futures.Future] = []
        pool = workers.executor(_VERIFY_THREADS, "fastpersist-verify") if self._verify else None
        try:
            for record, storage in items:
                if record.size == 0:
                    continue
                slab = self._slab_of.get(record.name)
                if slab is None:
                    request = handle.submit_read(storage.data_ptr(), record.size, self._file, record.data_offset, storage)
                    reads.append((request, [(record, storage)]))
                elif slab.loaded:
                    reads.append((None, [(record, storage)]))
                elif all(slab is not other for other in slabs):
                    slabs.append(slab)
                    length = slab.file_end - slab.file_start
                    pointer = storage.data_ptr() - (record.data_offset - slab.file_start)
                    request = handle.submit_read(pointer, length, self._file, slab.file_start, slab.buffer)
                    reads.append((request, [(record, storage)]))
                else:
                    next(covered for request, covered in reversed(reads) if request is not None and
                         self._slab_of.get(covered[0][0].name) is slab).append((record, storage))  # fmt: skip
            if pool is not None:
                # Requests complete roughly in submission (file) order: checksum each
                # record as soon as its bytes are in, while later reads are in flight.
                for request, covered in reads:
                    while request is not None and not request.done:
                        time.sleep(_POLL_SECONDS)
                    if request is not None and request.failed:
                        break  # wait() below raises the read error
                    checks += [pool.submit(self._check_storage, record, storage) for record, storage in covered]
        finally:
            try:
                handle.wait()  # raises the first read error once nothing is in flight
            finally:
                if pool is not None:
                    pool.shutdown(wait=True)
        for slab in slabs:
            slab.loaded = True
        for check in checks:
            check.result()  # raises ChecksumMismatchError, in file order

    def _check_storage(self, record: ZipRecordInfo, storage: torch.UntypedStorage) -> None:
        self._check(record, engine.crc32(storage.data_ptr(), record.size))

    # -- CUDA -----------------------------------------------------------------

    def _read_device(self, items: list[tuple[ZipRecordInfo, torch.UntypedStorage]]) -> None:
        windows = _windows(sorted(items, key=lambda item: item[0].data_offset), self._settings.buffer_size)
        if not windows:
            return
        streams: dict[torch.device, torch.cuda.Stream] = {}
        crcs = {record.name: 0 for record, _ in items}
        count = min(self._settings.read_buffer_count, len(windows))
        # One worker checksums windows in file order (running CRCs stay consistent) while
        # this thread queues the host-to-device copies; a slot is refilled only once both
        # its copies and its checksum are done.
        checker = workers.executor(1, "fastpersist-verify") if self._verify else None
        with memory.lease_buffers(count, self._settings.buffer_size) as buffers:
            handles = [engine.make_handle(self._settings) for _ in buffers]
            events: list[list[torch.cuda.Event]] = [[] for _ in buffers]
            checked: list[concurrent.futures.Future | None] = [None] * count
            try:
                for index in range(count):
                    self._submit_window(handles[index], buffers[index], windows[index])
                for index, window in enumerate(windows):
                    slot = index % count
                    handles[slot].wait()
                    if checker is not None:
                        checked[slot] = checker.submit(_window_crcs, window, buffers[slot].data_ptr(), crcs)
                    for record, destination, record_offset, buffer_offset, length in window.pieces:
                        stream = streams.get(destination.device)
                        if stream is None:
                            stream = streams[destination.device] = torch.cuda.Stream(destination.device)
                            stream.wait_stream(torch.cuda.current_stream(destination.device))
                        with torch.cuda.stream(stream):
                            destination[record_offset : record_offset + length].copy_(
                                buffers[slot][buffer_offset : buffer_offset + length], non_blocking=True
                            )
                        event = torch.cuda.Event()
                        event.record(stream)
                        events[slot].append(event)
                    following = index + count
                    if following < len(windows):
                        for event in events[slot]:
                            event.synchronize()  # the slot's copies are done
                        events[slot].clear()
                        if checked[slot] is not None:
                            checked[slot].result()  # and so is its checksum: refill it
                        self._submit_window(handles[slot], buffers[slot], windows[following])
            finally:
                for handle in handles:
                    try:
                        handle.wait()
                    except OSError:
                        pass
                if checker is not None:
                    checker.shutdown(wait=True)
                for stream in streams.values():
                    stream.synchronize()
        if self._verify:
            for record, _ in items:
                self._check(record, crcs[record.name])

    def _submit_window(self, handle, buffer: torch.Tensor, window: "_Window") -> None:
        handle.submit_read(buffer.data_ptr(), window.end - window.start, self._file, window.start, buffer)

    def _check(self, record: ZipRecordInfo, crc: int) -> None:
        check_record_crc(record, crc, self._path)


class MmapStorageProvider:
    """Storages that map the file (``load(..., mmap=True)``), as torch.load's mmap mode does.

    CPU storages are slices of one mapping of the whole file; pages are read
    on first touch. CUDA targets are copied from the mapping.
    """

    def __init__(self, path: str, size: int, *, verify: bool):
        from torch.serialization import MAP_SHARED, get_default_mmap_options

        shared = get_default_mmap_options() == MAP_SHARED
        self._mapping = torch.UntypedStorage.from_file(path, shared, size)
        self._verify = verify
        self._path = path

    def storage(self, record: ZipRecordInfo, device: torch.device) -> torch.UntypedStorage:
        mapped = self._mapping[record.data_offset : record.data_offset + record.size]
        if self._verify:
            check_record_crc(record, engine.crc32(mapped.data_ptr(), record.size) if record.size else 0, self._path)
        if device.type == "cpu":
            return mapped
        return mapped.to(device=device)

    def flush(self) -> None:
        pass


def _window_crcs(window: "_Window", address: int, crcs: dict[str, int]) -> None:
    """Folds the bytes of every record piece in a read window into the records' running CRC-32s."""
    for record, _, _, buffer_offset, length in window.pieces:
        crcs[record.name] = engine.crc32(address + buffer_offset, length, crcs[record.name])


@dataclasses.dataclass
class _Window:
    start: int  # page-aligned file offset
    end: int
    pieces: list = dataclasses.field(default_factory=list)  # (record, dest uint8 view, record_off, buf_off, len)


def _windows(items, window_size: int) -> list[_Window]:
    """Cuts the records' file ranges into reads of at most ``window_size`` bytes."""
    windows: list[_Window] = []
    current = None
    for record, storage in items:
        destination = storage_byte_view(storage)
        position, stop = record.data_offset, record.data_offset + record.size
        while position < stop:
            if current is None or position >= current.start + window_size or position - current.end > _MAX_GAP:
                current = _Window(_align_down(position), position)
                windows.append(current)
            take = min(stop, current.start + window_size) - position
            current.pieces.append((record, destination, position - record.data_offset, position - current.start, take))
            position += take
            current.end = position
    return windows
