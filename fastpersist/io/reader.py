"""Reads storage records from a checkpoint file into tensor memory.

CPU targets: each storage's bytes are read with O_DIRECT straight into
page-aligned memory that *becomes* the storage (no second copy). The
destination is placed so that its address and the record's file offset agree
modulo the page size, which lets the engine read the aligned middle directly
even for torch.save's 64-byte-aligned files. A record's read starts when the
unpickler asks for its storage, and the records that follow it in the file
are read ahead into their own future storages (up to the CUDA ring's bytes),
so a load that waits for each storage (``weights_only=False``, a callable
``map_location``) keeps the storage busy as a batch load does. Small records (below 1 MiB)
that sit next to each other in the file share one read into a slab (the next
slab is read ahead); each is copied out, and checksummed in the same pass, into
its own allocation as soon as it is asked for, as torch.load makes it. A slab,
which also holds the records' zip headers, is freed once every record in it is
out.

CUDA targets: file windows stream through a ring of page-locked buffers
(:class:`fastpersist.io.ring.Ring`, one native handle per buffer, reads
issued ahead), and each window is copied
host-to-device on a side stream into storages allocated on the device. The
calling thread only waits for reads and queues copies; a helper thread
refills each buffer once its copies and checksums are done. Host memory stays
at the ring's size. DCP's reader streams its CUDA items through the same ring
(:func:`stream_to_device`).

Both paths can verify each record's CRC-32 against the central directory on
the bytes they read.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

import torch

from fastpersist.config import Settings
from fastpersist.format.zipformat import ZipRecordInfo, check_record_crc
from fastpersist.io import checksum, engine, memory, timeline, workers
from fastpersist.io.device_crc import DeviceCrc
from fastpersist.io.ring import Ring, Slot
from fastpersist.tensors import storage_byte_view

__all__ = ["FileStorageProvider", "MemoryStorageProvider", "MmapStorageProvider", "stream_to_device"]

_PAGE = 4096
_SMALL_RECORD = 1 << 20  # records below this share allocations and reads
_SLAB_LIMIT = 4 << 20
_MAX_GAP = 64 << 10  # bytes of headers we accept reading to merge two small records
_BATCH_BYTES = 1 << 20  # small record pieces are checksummed in tasks of about this many bytes
_INLINE_BYTES = 256 << 10  # a last batch smaller than this is checksummed on the calling thread
_MIN_WINDOW = 1 << 20  # CUDA ring windows are not cut smaller than this
_RING_CRC_PIECE = 16 << 20  # bytes per CRC-32 task in the CUDA ring
_CHECKSUM_ON_DEVICE = ("cuda",)  # destination device types whose pieces the device checksums (tests add "cpu")
_log = logging.getLogger("fastpersist")


def _align_down(value: int) -> int:
    return value - value % _PAGE


@dataclasses.dataclass
class _Read:
    """A large record being read in place into the CPU storage that will hold it."""

    record: ZipRecordInfo
    storage: torch.UntypedStorage
    requests: list  # (detached native request, [(record, address, record_offset, length)]), in file order


@dataclasses.dataclass
class _Slab:
    """One read covering several small records' file range, into a buffer that lives until
    every record in it has been copied out."""

    file_start: int  # page-aligned
    file_end: int
    index: int  # in file order
    records: int = 0  # small records planned in it
    copied: int = 0  # of those, copied out so far
    buffer: object = None  # engine.AlignedBuffer while needed
    address: int = 0  # of buffer; 0 without one
    request: object = None  # the native read filling buffer, until waited for


class FileStorageProvider:
    """Implements format.deserializer.StorageProvider over an open native File.

    Call order: ``storage(...)`` any number of times, then ``flush()``; repeat.
    Small records are filled (and verified) before ``storage`` returns; the
    others at ``flush``, into zeroed memory until then. After a large CPU
    record, the next large records in file order are read ahead (at most
    ``read_buffer_size * read_buffer_count`` bytes not yet asked for), each into
    the storage it becomes when asked for. One native handle (and,
    for CUDA targets, one ring of handles) serves
    every flush of a load: ``load(weights_only=False)`` flushes after each
    storage, and creating a handle per storage made it many times slower
    than torch.load on many small tensors (docs/performance.md). CRC-32 work goes to the shared pool of
    :mod:`fastpersist.io.checksum`, overlapped with the reads. Call
    :meth:`close` when done (``load`` does).
    """

    def __init__(self, file, records: Sequence[tuple], settings: Settings, *, verify: bool, path: str):
        self._file = file
        self._settings = settings
        self._verify = verify
        self._path = path
        self._cpu: list[_Read] = []  # asked for, not yet flushed
        self._device: list[tuple[ZipRecordInfo, torch.UntypedStorage]] = []
        self._slab_of: dict[str, _Slab] = {}
        self._slabs: list[_Slab] = []  # in file order
        self._large: list[ZipRecordInfo] = []  # records read in place, in file order
        self._position: dict[str, int] = {}  # name -> index in _large
        self._next = 0  # in _large: the next record to read ahead
        self._ahead: dict[str, _Read] = {}  # read ahead, not yet asked for
        self._ahead_bytes = 0
        self._ahead_limit = settings.read_buffer_size * settings.read_buffer_count
        self._handle = None
        self._ring_handles: list = []
        self._plan(records)

    def close(self) -> None:
        """Drops the handles, slabs and reads ahead, once no read is in flight into them."""
        requests = [request for read in [*self._ahead.values(), *self._cpu] for request, _ in read.requests]
        requests += [slab.request for slab in self._slabs if slab.request is not None]
        for request in requests:
            try:
                self._handle.wait_request(request)
            except OSError:
                pass  # nobody needs these bytes any more
        self._ahead.clear()
        self._cpu.clear()
        for slab in self._slabs:
            slab.request, slab.buffer, slab.address = None, None, 0
        self._handle = None
        self._ring_handles = []

    # -- StorageProvider ------------------------------------------------------

    def storage(self, record: ZipRecordInfo, device: torch.device) -> torch.UntypedStorage:
        # Popped: the table shrinks as the state grows; a record asked for again is read on its own.
        slab = self._slab_of.pop(record.name, None)
        if slab is not None:
            return self._small_storage(record, slab, device)
        if device.type == "cuda":
            read = self._take_ahead(record)
            if read is not None:  # read ahead after a CPU record: its bytes are (nearly) in memory already
                # Records bound for CUDA follow CPU ones in this file: the ring, not pageable memory,
                # is their fast way; stop reading ahead (what is in flight still comes from memory).
                self._ahead_limit = 0
                self._finish_reads([read])
                return read.storage.to(device=device)
            storage = torch.empty(record.size, dtype=torch.uint8, device=device).untyped_storage()
            self._device.append((record, storage))
            return storage
        if record.size == 0:
            return torch.UntypedStorage(0)
        read = self._take_ahead(record) or self._start_read(record)
        self._read_ahead(record)
        self._cpu.append(read)
        return read.storage

    def flush(self) -> None:
        if self._cpu:
            cpu, self._cpu = self._cpu, []
            self._finish_reads(cpu)
        if self._device:
            device, self._device = self._device, []
            self._read_device(device)

    # -- small records ----------------------------------------------------------

    def _small_storage(self, record: ZipRecordInfo, slab: _Slab, device: torch.device) -> torch.UntypedStorage:
        """``record``'s own storage, filled from its slab now (read if needed) and checked.

        Filled before it is returned: a rebuild function may read a tensor's values while
        unpickling (nested tensors do), and torch.load's storages always hold their bytes.
        """
        if slab.address == 0 or slab.request is not None:
            self._slab_ready(slab)
        storage = torch.UntypedStorage(record.size)
        crc = engine.copy_with_crc32(
            storage.data_ptr(), slab.address + (record.data_offset - slab.file_start), record.size
        )
        slab.copied += 1
        if slab.copied == slab.records:  # every record is out
            slab.buffer, slab.address = None, 0
        if crc != record.crc and self._verify:
            self._check(record, crc)  # raises, unless the archive stores no CRC
        if device.type == "cuda":
            return (
                torch.empty(record.size, dtype=torch.uint8, device=device)
                .copy_(storage_byte_view(storage))
                .untyped_storage()
            )
        return storage

    def _slab_ready(self, slab: _Slab) -> None:
        """Waits for ``slab``'s bytes, reading it first if needed (and the next slab ahead)."""
        if slab.address == 0:
            self._submit_slab(slab)
            following = slab.index + 1
            if following < len(self._slabs) and self._slabs[following].address == 0:
                self._submit_slab(self._slabs[following])
        if slab.request is not None:
            request, slab.request = slab.request, None
            try:
                with timeline.waiting("read"):
                    self._handle.wait_request(request)
            except BaseException:
                slab.buffer, slab.address = None, 0
                raise

    def _submit_slab(self, slab: _Slab) -> None:
        slab.buffer = engine.AlignedBuffer(slab.file_end - slab.file_start, lock=False, huge_pages=False)
        slab.address = slab.buffer.ptr
        # Detached: the flushes' wait() neither waits for a read ahead nor raises its error.
        slab.request = self._io().submit_read(
            slab.buffer.ptr, slab.file_end - slab.file_start, self._file, slab.file_start, slab.buffer, detached=True
        )

    # -- CPU ------------------------------------------------------------------

    def _plan(self, records: Sequence[tuple]) -> None:
        """Groups small records into slabs and lists the large ones in file order; ``records`` are
        ZipRecordInfo or plain rows of the same fields (``RecordTable.rows()``), read by index."""
        slab = None
        for row in sorted(records, key=lambda r: r[2]):
            name, _, data_offset, size, _ = row
            if size == 0 or "/data/" not in name:
                continue
            if size >= _SMALL_RECORD:
                self._position[name] = len(self._large)
                self._large.append(ZipRecordInfo(*row))
                continue
            if (
                slab is None
                or data_offset - slab.file_end > _MAX_GAP
                or data_offset + size - slab.file_start > _SLAB_LIMIT
            ):
                slab = _Slab(_align_down(data_offset), data_offset, len(self._slabs))
                self._slabs.append(slab)
            slab.file_end = data_offset + size
            slab.records += 1
            self._slab_of[name] = slab

    def _cpu_destination(self, record: ZipRecordInfo) -> torch.UntypedStorage:
        # Same address modulo the page as the file offset: the middle reads directly.
        delta = record.data_offset % _PAGE
        buffer = memory.destination_buffer(delta + record.size, self._settings.huge_pages)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=record.size, offset=delta).untyped_storage()

    def _io(self):
        if self._handle is None:
            self._handle = engine.make_handle(self._settings)
        return self._handle

    def _start_read(self, record: ZipRecordInfo) -> _Read:
        """Allocates ``record``'s storage and starts reading into it, in pieces (checksumming a
        large record then starts before all of it is in). Piece boundaries keep address == offset
        (mod page)."""
        storage = self._cpu_destination(record)
        handle, address = self._io(), storage.data_ptr()
        piece_size = max(self._settings.buffer_size, _PAGE)
        requests = []
        for offset in range(0, record.size, piece_size):
            length = min(piece_size, record.size - offset)
            # Detached: only the flush that needs these bytes waits for them and sees their error.
            request = handle.submit_read(
                address + offset, length, self._file, record.data_offset + offset, storage, detached=True
            )
            requests.append((request, [(record, address + offset, offset, length)]))
        return _Read(record, storage, requests)

    def _read_ahead(self, record: ZipRecordInfo) -> None:
        """Starts reading the large records after ``record`` in the file, up to the read-ahead limit."""
        position = self._position.get(record.name)
        if position is not None:
            self._next = max(self._next, position + 1)
        while self._next < len(self._large) and self._ahead_bytes < self._ahead_limit:
            following = self._large[self._next]
            self._next += 1
            self._ahead[following.name] = self._start_read(following)
            self._ahead_bytes += following.size

    def _take_ahead(self, record: ZipRecordInfo) -> _Read | None:
        """``record``'s read ahead, now asked for (it leaves the read-ahead's count), or None."""
        read = self._ahead.pop(record.name, None)
        if read is not None:
            self._ahead_bytes -= record.size
        return read

    def _finish_reads(self, reads: list[_Read]) -> None:
        """Waits for ``reads``; with verify, CRCs run on the pool as each piece lands, and are checked in order."""
        handle = self._io()
        pending: dict[str, list] = {}
        queued: list = []
        error = None
        try:
            for read in reads:
                for request, pieces in read.requests:
                    try:
                        with timeline.waiting("read"):
                            handle.wait_request(request)
                    except OSError as e:  # raised once all are in, so that every request is accounted for
                        error = error or e
                        continue
                    if self._verify and error is None:
                        queued += _queue_crcs(pieces, pending)
        finally:
            with timeline.waiting("crc"):
                _wait_all(queued)
        if error is not None:
            raise error
        if self._verify:
            for read in reads:  # raises ChecksumMismatchError, in file order
                self._check(read.record, checksum.crc32_combine_all(pending.pop(read.record.name, [])))

    # -- CUDA -----------------------------------------------------------------

    def _read_device(self, items: list[tuple[ZipRecordInfo, torch.UntypedStorage]]) -> None:
        payloads = [
            (self._file, record.data_offset, record.size, storage_byte_view(storage)) for record, storage in items
        ]
        crcs = stream_to_device(payloads, self._settings, verify=self._verify, handles=self._ring_handles)
        if self._verify:
            for (record, _), crc in zip(items, crcs):
                self._check(record, crc)

    def _check(self, record: ZipRecordInfo, crc: int) -> None:
        check_record_crc(record, crc, self._path)


def _queue_crcs(pieces, pending: dict[str, list], piece_size: int = checksum.PIECE_SIZE) -> list:
    """Queues the CRC-32 of record pieces ``(record, address, record_offset, length)`` on the pool.

    Many small pieces share one task (a task per 64-byte tensor would cost more
    than its CRC); large pieces are split over the pool's threads. Appends
    ``(part, length)`` to ``pending[record.name]`` in the given order (file
    order per record), where ``part`` is an int, a PendingCrc or a (batch
    job, index) pair (see :func:`checksum.part_value`). Returns what was queued, which
    the caller waits for before reusing the memory.
    """
    queued = []
    batch: list[tuple[list, int, int, int]] = []  # (record's parts, index in them, address, length)
    batch_bytes = 0
    for record, address, _, length in pieces:
        parts = pending.get(record.name)
        if parts is None:
            parts = pending[record.name] = []
        if length >= _BATCH_BYTES:
            part = checksum.submit_crc32(address, length, piece_size=piece_size)
            queued.append(part)
            parts.append((part, length))
            continue
        batch.append((parts, len(parts), address, length))
        parts.append((0, length))  # replaced from the batch below
        batch_bytes += length
        if batch_bytes >= _BATCH_BYTES:
            queued.append(_queue_batch(batch))
            batch, batch_bytes = [], 0
    if batch:
        if batch_bytes < _INLINE_BYTES:
            crc32 = engine.crc32
            for parts, index, address, length in batch:  # cheaper here than a task
                parts[index] = (crc32(address, length), length)
        else:
            queued.append(_queue_batch(batch))
    return queued


def _queue_batch(batch: list[tuple[list, int, int, int]]) -> checksum.PendingCrc:
    job = checksum.submit_crc32_many([(address, length) for _, _, address, length in batch])
    for position, (parts, index, _, length) in enumerate(batch):
        parts[index] = ((job, position), length)
    return checksum.PendingCrc(0, [(job, 0)])


def _wait_all(queued: list) -> None:
    for part in queued:
        part.wait()


class MemoryStorageProvider:
    """Storages that are slices of one storage holding the whole checkpoint file's bytes.

    CPU storages are views of ``whole`` (no copy; each keeps all of it alive,
    as an mmap load's storages keep the mapping); CUDA targets are copied
    from it. With ``verify``, each record's CRC-32 is checked as it is asked for.
    Used for checkpoints downloaded into memory (object stores).
    """

    def __init__(self, whole: torch.UntypedStorage, *, verify: bool, path: str):
        self._mapping = whole
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


class MmapStorageProvider(MemoryStorageProvider):
    """Storages that map the file (``load(..., mmap=True)``), as torch.load's mmap mode does.

    CPU storages are slices of one mapping of the whole file; pages are read
    on first touch. CUDA targets are copied from the mapping.
    """

    def __init__(self, path: str, size: int, *, verify: bool):
        from torch.serialization import MAP_SHARED, get_default_mmap_options

        shared = get_default_mmap_options() == MAP_SHARED
        super().__init__(torch.UntypedStorage.from_file(path, shared, size), verify=verify, path=path)


def _window_size(total: int, settings: Settings) -> int:
    """Bytes per ring window for moving ``total`` bytes: ``read_buffer_size``, or less, so that a flush
    smaller than the ring still spreads over all of it.

    Each ring buffer has its own handle. A load that waits for each storage (``weights_only=False``)
    flushes one record at a time, and a 36 MB record in one window was read by one handle while
    the other seven idled, at a fraction of a batch load's speed; cut over the ring, it loads
    almost as fast (docs/performance.md). Windows stay at least 1 MiB and page multiples.
    """
    share = -(-total // settings.read_buffer_count)
    share = -(-share // _PAGE) * _PAGE
    return max(min(settings.read_buffer_size, share), min(settings.read_buffer_size, _MIN_WINDOW))


@dataclasses.dataclass
class _Window:
    start: int  # page-aligned file offset
    end: int
    file: object  # the native File read
    pieces: list = dataclasses.field(default_factory=list)  # (record, dest uint8 view, record_off, buf_off, len)


def _windows(items, window_size: int, file) -> list[_Window]:
    """Cuts the file ranges of ``items`` (``(record, destination uint8 tensor)``, in file order) into reads of
    ``file`` of at most ``window_size`` bytes."""
    windows: list[_Window] = []
    current = None
    for record, destination in items:
        position, stop = record.data_offset, record.data_offset + record.size
        while position < stop:
            if current is None or position >= current.start + window_size or position - current.end > _MAX_GAP:
                current = _Window(_align_down(position), position, file)
                windows.append(current)
            take = min(stop, current.start + window_size) - position
            current.pieces.append((record, destination, position - record.data_offset, position - current.start, take))
            position += take
            current.end = position
    return windows


def stream_to_device(
    payloads: list[tuple], settings: Settings, *, verify: bool, handles: list | None = None
) -> list[int]:
    """Reads payloads ``(file, offset, nbytes, destination)`` into device memory through one ring of
    page-locked buffers; returns each payload's CRC-32 (0 without ``verify``).

    ``file`` is a native File opened for reading, ``destination`` a uint8 tensor of ``nbytes`` on a CUDA
    device. Payloads of one file are read in file order, in windows of at most ``read_buffer_size``
    (smaller when all of them fit the ring, so that they still spread over it: :func:`_window_size`), which
    start on a page (O_DIRECT reads into the aligned buffers). ``handles``: native handles to reuse, one
    per buffer; the list is extended with the handles made here. The one ring of CUDA loads, used by
    ``load`` (:class:`FileStorageProvider`) and by DCP's reader.
    """
    records = [ZipRecordInfo(str(index), 0, offset, nbytes, 0) for index, (_, offset, nbytes, _) in enumerate(payloads)]
    size = _window_size(sum(nbytes for _, _, nbytes, _ in payloads), settings)
    by_file: dict[int, list] = {}
    for record, (file, _, _, destination) in zip(records, payloads):
        by_file.setdefault(id(file), [file, []])[1].append((record, destination))
    windows = []
    for file, items in by_file.values():
        windows += _windows(sorted(items, key=lambda item: item[0].data_offset), size, file)
    if not windows:
        return [0] * len(payloads)
    pending: dict[str, list] = {}
    count = min(settings.read_buffer_count, len(windows))
    handles = [] if handles is None else handles
    while len(handles) < count:
        handles.append(engine.make_handle(settings))
    # Windows are at most read_buffer_size; lease buffers no larger than the largest one needs.
    _, buffer_size = memory.ring_shape(max(w.end - w.start for w in windows), settings.read_buffer_size, 1)
    checkers = _device_checkers(windows, settings.device_checksum) if verify else {}
    try:
        with Ring(handles[:count], buffer_size, huge_pages=settings.huge_pages) as ring:
            _stream_windows(windows, ring, pending if verify else None, checkers)
    finally:
        with timeline.waiting("crc"):
            for checker in checkers.values():
                checker.close()
    if not verify:
        return [0] * len(payloads)
    return [checksum.crc32_combine_all(pending.get(record.name, [])) for record in records]


def _stream_windows(windows: list[_Window], ring: Ring, pending: dict[str, list] | None, checkers: dict) -> None:
    """Moves every window's bytes from its file into its destinations through ``ring``; with ``pending``, queues
    each piece's CRC-32 into it: the whole segments of pieces in CUDA memory on the device of a checker of
    ``checkers`` after their copy (:mod:`fastpersist.io.device_crc`), the rest on the CPU pool from the buffer.

    Stages of a window: read into its slot (the handle's threads), then host-to-device copies on a
    side stream per device (queued by this thread) beside CRC-32s on the pool, then the slot's
    refill with the window ``len(ring.slots)`` later. Refills run on a helper thread, in window order,
    each once its window's copies and checksums are done (the slot's stage); this thread only waits
    for the next window's read. So the copy engine always has the next window queued, and no read
    waits for the copies and checksums of other slots: on one thread, waiting for each slot in turn,
    a load from a discarding source reached half the host-to-device copy bound (docs/benchmarks.md).

    Returns once every read, copy and checksum of the ring is done. The first error raises: a read's, a
    refill's or a copy's; the ring then drains (nothing in flight when the buffers go back to the pool).
    """
    count = len(ring.slots)
    stopping = threading.Event()  # no refill submits once set
    refills = workers.executor(1, "fastpersist-refill") if len(windows) > count else None

    def refill(slot: Slot, window: _Window) -> None:
        slot.wait_buffer()  # its copies and checksums are done (and the checksums also when a copy failed)
        if not stopping.is_set():
            slot.submit_read(window.end - window.start, window.file, window.start)

    try:
        for slot, window in zip(ring.slots, windows):
            slot.submit_read(window.end - window.start, window.file, window.start)
        for index, window in enumerate(windows):
            slot = ring.slot(index)
            if slot.stage is not None:
                with timeline.waiting("slot"):
                    slot.wait_stage()  # the slot's read of this window was submitted (or raises why not)
            with timeline.waiting("read"):
                slot.wait_io()
            if pending is not None:
                # On the slot at once: waited for before the buffer is reused, also if the copies raise.
                slot.checksums, device_work = _queue_window_crcs(window, slot.address, checkers, pending)
            events = _queue_copies(window, slot, ring)
            if pending is not None and device_work:
                _queue_device_crcs(device_work, events)
            following = index + count
            if following < len(windows):
                slot.stage = refills.submit(refill, slot, windows[following])
    finally:
        stopping.set()
        if refills is not None:
            refills.shutdown(wait=True)
    with timeline.waiting("crc"):
        for slot in ring.slots:
            slot.wait_checksums()
    with timeline.waiting("copy"):
        ring.wait_streams()


def _device_checkers(windows: list[_Window], mode: str) -> dict[torch.device, DeviceCrc]:
    """A :class:`DeviceCrc` per device that holds whole segments of the windows' pieces, as the
    ``device_checksum`` setting ``mode`` says: ``always`` captures a graph set where none is ready, ``auto`` takes
    only a ready one (:meth:`DeviceCrc.if_ready`), ``never`` none. A device left out (no set ready, its memory
    full, capture failed) has its pieces checksummed on the CPU."""
    if mode == "never":
        return {}
    segments: dict[torch.device, list[int]] = {}
    for window in windows:
        for _, destination, _, _, length in window.pieces:
            if destination.device.type in _CHECKSUM_ON_DEVICE:
                sizes = DeviceCrc.split(length)[0]
                counted = segments.setdefault(destination.device, [0, 0])
                counted[0], counted[1] = counted[0] + len(sizes), counted[1] + sum(sizes)
    checkers = {}
    for device, (count, nbytes) in segments.items():
        if not count:
            continue
        try:
            checker = DeviceCrc(device, count) if mode == "always" else DeviceCrc.if_ready(device, count, nbytes)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
            _log.warning("checksums of %s stay on the CPU for this load: %s", device, error)
        else:
            if checker is not None:
                checkers[device] = checker
    return checkers


def _queue_window_crcs(window: _Window, address: int, checkers: dict, pending: dict) -> tuple[list, list]:
    """Queues the CRC-32s of ``window``'s pieces (in the buffer at ``address``) that the CPU computes: all of a
    piece, or the tail after the whole segments that its device's checker takes (:func:`_queue_device_crcs`,
    once the copies are queued). Parts go to ``pending`` in file order: a record has one piece per window,
    whose segments hold places before its tail. Returns what the CPU queued, which must finish before the
    buffer is reused, and the device work ``(checker, destination, sizes, parts, index)``."""
    host, on_device = [], []
    for record, destination, record_offset, offset, length in window.pieces:
        checker = checkers.get(destination.device)
        sizes, tail = DeviceCrc.split(length) if checker is not None else ([], length)
        if sizes:
            parts = pending.setdefault(record.name, [])
            on_device.append(
                (checker, destination[record_offset : record_offset + length - tail], sizes, parts, len(parts))
            )
            parts.extend((0, size) for size in sizes)  # places for the device's parts
        if tail:
            host.append((record, address + offset + length - tail, record_offset + length - tail, tail))
    return _queue_crcs(host, pending, _RING_CRC_PIECE), on_device


def _queue_device_crcs(on_device: list, events: dict) -> None:
    """Queues the segments :func:`_queue_window_crcs` left to the devices, each after its device's copies
    (``events``), into the places it kept."""
    for checker, destination, sizes, parts, index in on_device:
        queued = checker.queue(destination, sizes, events.get(destination.device))
        parts[index : index + len(sizes)] = zip(queued, sizes)


def _queue_copies(window: _Window, slot: Slot, ring: Ring) -> dict:
    """Queues the copies of ``window``'s pieces out of ``slot``'s buffer into their destinations; returns
    an event per CUDA device used, recorded after them (and tracked by the slot), by device.

    CUDA destinations copy on the ring's side stream of their device (made on first use, after the
    device's current stream: nothing queued before the load can land after it), one stream context per
    window. CPU destinations copy now (the ring's tests run without a GPU).
    """
    buffer = slot.buffer
    copies: dict = {}  # stream (None: copy now) -> pairs
    for _record, destination, record_offset, buffer_offset, length in window.pieces:
        stream = ring.stream(destination.device) if destination.device.type == "cuda" else None
        pair = (destination[record_offset : record_offset + length], buffer[buffer_offset : buffer_offset + length])
        copies.setdefault(stream, []).append(pair)
    events = {}
    for stream, pairs in copies.items():
        if stream is None:
            for target, source in pairs:
                target.copy_(source)
            continue
        with torch.cuda.stream(stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
        events[stream.device] = slot.track_copies(stream)
    return events
