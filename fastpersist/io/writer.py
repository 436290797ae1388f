"""Executes a save plan into a file through a ring of page-aligned, page-locked buffers.

The file is produced as one sequential stream of ``buffer_size`` windows.
For each window, in order:

1. **fill** — static bytes (headers, padding, metadata) are copied in, and
   storage bytes are copied from their tensors: CPU storages by a native copy
   that computes their CRC-32 on the way (the source is read once), GPU
   storages by an asynchronous device-to-host copy on a side CUDA stream;
2. **checksum** — once the copies have landed, the CRC-32 of each large GPU
   storage slice is queued on the CRC pool (:mod:`fastpersist.io.checksum`),
   computed from zero;
3. **finalize** — in file order, each slice's CRC-32 is folded into its
   record's running CRC, and the data descriptors and central directory that
   fall into the window (they need those CRCs) are written in;
4. **submit** — the window goes to the native engine, which writes it with
   O_DIRECT while the next windows are filled (on tmpfs: copied into a
   mapping of the file by the pool's threads, :mod:`fastpersist.io.mapping`).

Fill runs on the calling thread; checksum and finalize each run on a worker
thread of their own, window by window in file order. So filling window
``k+2`` (a memcpy or a DMA), checksumming window ``k+1`` and finalizing
window ``k`` overlap (native calls release the GIL), and the CRC pool never
waits for the finalize of a window before starting on the next one. The
buffers are a :class:`fastpersist.io.ring.Ring`; each slot has its own native
handle, so a slot is reused as soon as *its* write is done. Host memory is
the ring plus metadata, whatever the checkpoint's size.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from fastpersist.config import Settings
from fastpersist.format.plan import BytesRecord, SavePlan, Segment, SegmentKind, StorageRecord
from fastpersist.io import checksum as crc_pool
from fastpersist.io import engine, memory, timeline, workers
from fastpersist.io import mapping as mapped
from fastpersist.io.ring import Ring, SharedHandle, Slot, read_events, side_streams

__all__ = ["write_plan", "side_streams", "read_events", "initial_crcs", "idle_work"]

_idle = threading.local()


@contextlib.contextmanager
def idle_work(step: Callable[[], bool]) -> Iterator[None]:
    """Inside the block, :func:`write_plan` on this thread calls ``step()`` whenever it would otherwise
    wait for a ring buffer (its copies, checksums and write still running), until ``step`` returns
    False (nothing left to do). Work that must run on the writing thread goes there instead of before
    the first copy: the collective save queues its digest kernels this way. Thread-local; blocks nest.
    """
    previous = getattr(_idle, "step", None)
    _idle.step = step
    try:
        yield
    finally:
        _idle.step = previous


def initial_crcs(plan: SavePlan, checksum: bool) -> list[int]:
    """Each record's CRC-32 as far as it is known before writing: in-memory records' CRCs
    (computed here, natively), 0 for storages (whose CRCs the writers accumulate).

    With ``checksum`` off every CRC-32 is 0, unless the plan says its in-memory records keep
    theirs (``plan.keeps_bytes_crcs``: a DCP file's archives, :class:`fastpersist.dcp.layout.FilePlan`);
    its storages' are 0 then.
    """
    if not checksum and not getattr(plan, "keeps_bytes_crcs", False):
        return [0] * len(plan.records)
    return [engine.crc32_of(record.data) if isinstance(record, BytesRecord) else 0 for record in plan.records]


def write_plan(
    plan: SavePlan,
    file,
    settings: Settings,
    *,
    streams=None,
    byte_range=None,
    destination_offset: int | None = None,
    make_handle=None,
    after_reads=None,
) -> list[int]:
    """Writes every byte of ``plan`` into ``file`` (a native File opened for writing).

    Args:
        plan: what to write.
        file: the destination, from ``engine.File(path, "w", ...)``, or
            whatever the handles of ``make_handle`` write to.
        settings: buffer size and count, engine settings, checksum.
        streams: side CUDA streams from :func:`side_streams`, made on the
            thread that queued the tensors' producers (default: made here).
        byte_range: ``(start, end)``: write only these bytes of the plan (one
            rank's share of a data-parallel save). The data descriptors of
            records that start before ``start`` and the trailer are written as
            zeros (they need CRC-32s of bytes outside the range; the
            committing rank writes them).
        destination_offset: file offset of the range's first byte (default:
            ``start``, i.e. where it lies in the whole file).
        make_handle: makes each ring slot's handle (default: a native handle
            from ``settings``). A handle has ``submit_write(address, nbytes,
            file, offset, keepalive)``, called once per window in file order
            from one worker thread, and ``wait()``, which returns once every
            write submitted to it is done and raises the first error as an
            ``OSError`` (an object store's multipart upload is such a handle:
            :mod:`fastpersist.io.targets.s3.upload`).
        after_reads: called once every byte of the plan's storages has been
            read or its copy queued, while the last windows are still being
            written, with ``[(device, event), ...]``: a CUDA event per side
            stream, recorded after its last copy (empty for CPU storages,
            which are copied synchronously). Work ordered after those events
            may change the tensors (pipelined saves release the state here:
            :mod:`fastpersist.api.futures`).

    Inside :func:`idle_work` on the calling thread, its step runs whenever the
    writer would wait for a ring buffer.

    Returns:
        The CRC-32 of every record, in plan order (zeros when checksums are
        off, but for the in-memory records of a plan that keeps them: :func:`initial_crcs`).
        With ``byte_range``: the CRC-32 of each storage record's bytes inside
        the range (0 for the others), for combination across ranks.

    Raises:
        OSError: from the engine (errno and filename set). When it raises,
            nothing is left in flight and the ring is returned to the pool;
            the file's contents are then undefined (the caller discards it).
    """
    segments = plan.segments()
    first, size = (0, plan.size) if byte_range is None else byte_range
    shift = 0 if destination_offset is None else destination_offset - first  # plan offset -> file offset
    partial = byte_range is not None
    # Sized to the checkpoint (or this rank's range): a small save does not pin the full ring.
    count, window_size = memory.ring_shape(size - first, settings.buffer_size, settings.buffer_count)
    crcs = initial_crcs(plan, settings.checksum)
    if partial:  # storage CRCs of the range's slices only (the caller combines them across ranges)
        crcs = [0 if isinstance(record, StorageRecord) else crc for record, crc in zip(plan.records, crcs)]
    if streams is None:
        streams = side_streams(plan)
    mapping = None
    if make_handle is None and getattr(file, "direct", True):
        make_handle = lambda: engine.make_handle(settings)  # noqa: E731
    elif make_handle is None:
        if mapped.wanted(file, settings.tmpfs_mapping):
            mapping = mapped.Mapping.for_writing(file, first + shift, size + shift)
        make_handle = (lambda: mapped.WriteHandle(mapping)) if mapping is not None else _serial(settings)
    with contextlib.ExitStack() as stack:
        if mapping is not None:  # after the ring: nothing copies into it any more; unmapping takes a while
            stack.callback(workers.detached, "fastpersist-unmap", mapping.close)
        ring = stack.enter_context(
            Ring([make_handle() for _ in range(count)], window_size, huge_pages=settings.huge_pages, streams=streams)
        )
        fill_cursor = _Cursor(segments)
        checksum_cursor = _Cursor(segments)
        if partial:  # skip the segments that end before the range
            fill_cursor.first = checksum_cursor.first = bisect.bisect_right([s[1] + s[2] for s in segments], first)
        trailer: list[tuple[int, bytes]] = []  # (offset, bytes) of the trailer being written
        checker = workers.executor(1, "fastpersist-crc")
        finalizer = workers.executor(1, "fastpersist-crc")
        idle = getattr(_idle, "step", None)
        try:
            for index, start in enumerate(range(first, size, window_size)):
                slot = ring.slot(index)
                while idle is not None and slot.busy():
                    if not idle():
                        idle = None
                slot.wait_idle()
                window = (start, min(start + window_size, size))
                _fill(plan, slot, window, fill_cursor, streams, crcs, settings.checksum)
                if index == 0:
                    timeline.mark("first window filled")
                checked = checker.submit(_checksum, plan, slot, window, checksum_cursor, settings.checksum)
                # The slot's stage: its finalize waits for its checksums, then submits its write.
                slot.stage = finalizer.submit(
                    _finalize_and_submit,
                    plan,
                    slot,
                    window,
                    checked,
                    crcs,
                    trailer,
                    settings,
                    file,
                    shift,
                    first if partial else None,
                )
            timeline.mark("reads queued")
            if after_reads is not None:
                after_reads(read_events(streams))
            ring.wait_idle()
            timeline.mark("written")
        finally:
            # Every queued checksum and finalize runs to its end before the ring drains and gives its buffers back.
            checker.shutdown(wait=True)
            finalizer.shutdown(wait=True)
    return crcs


def _serial(settings: Settings) -> Callable[[], SharedHandle]:
    """The ``make_handle`` of a buffered destination (tmpfs, or where O_DIRECT is refused): one writer, in file order.

    Buffered writes into one file serialize on its inode in the kernel, and
    on tmpfs each page written is allocated on the spot: several writers in
    flight were slower than one, and a save went at their speed
    (docs/io-engine.md, docs/performance.md). So the slots of such a save
    share one new native handle with a single lane and one request in flight
    (:class:`~fastpersist.io.ring.SharedHandle`); each slot waits for its own
    (detached) request, so a slot is still reused as soon as its window is
    written.
    """
    shared = engine.make_handle(settings, queue_depth=1, intra_op_parallelism=1)
    return lambda: SharedHandle(shared)


class _Cursor:
    """Walks the sorted segments window by window without rescanning from the start."""

    def __init__(self, segments: Sequence[Segment]):
        self.segments = segments
        self.first = 0

    def overlapping(self, start: int, end: int):
        """(segment, lo, hi) for each segment meeting ``[start, end)``, clipped to it, in file order."""
        # One flat loop: with 100,000 small storages there are 300,000 segments per pass.
        segments = self.segments
        for index in range(self.first, len(segments)):
            segment = segments[index]
            offset = segment[1]
            if offset >= end:
                return
            segment_end = offset + segment[2]
            if segment_end > start:
                if segment_end <= end:
                    yield segment, (offset if offset > start else start), segment_end
                    self.first = index + 1
                else:
                    yield segment, (offset if offset > start else start), end


def _fill(
    plan: SavePlan, slot: Slot, window: tuple[int, int], cursor: _Cursor, streams, crcs: list[int], checksum: bool
) -> None:
    start, end = window
    base = slot.address
    records = plan.records
    view = slot.view
    device_copies: dict = {}  # stream -> [(destination, source)], queued once per window
    host_copies: list = []  # (record, destination, source, length): CPU pieces for the pool, copied together
    for (kind, offset, _, index, data), lo, hi in cursor.overlapping(start, end):
        if kind == _BYTES:
            if lo == offset and hi - lo == len(data):
                view[lo - start : hi - start] = data
            else:
                view[lo - start : hi - start] = data[lo - offset : hi - offset]
        elif kind == _STORAGE:
            record = records[index]
            if record.device.type == "cpu":
                # Pointer arithmetic, not tensor slices: with 100,000 small storages the
                # slicing cost more than the copies.
                destination, source = base + (lo - start), record.data_ptr() + (lo - offset - record.offset)
                if hi - lo >= _POOL_COPY:
                    host_copies.append((index, destination, source, hi - lo))
                elif checksum:
                    # Records are filled in file order, so this running CRC is complete
                    # before finalize (on the worker) writes the record's descriptor.
                    crcs[index] = engine.copy_with_crc32(destination, source, hi - lo, crcs[index])
                else:
                    ctypes.memmove(destination, source, hi - lo)
                continue
            held = offset + record.offset  # file offset of the view's first byte
            source = record.view[lo - held : hi - held]
            destination = slot.buffer[lo - start : hi - start]
            if source.device.type == "cuda":
                device_copies.setdefault(streams[source.device], []).append((destination, source))
            else:
                destination.copy_(source)  # other devices (mps, xpu, ...)
        # DESCRIPTOR and TRAILER bytes need CRCs: written at finalize.
    if host_copies:
        _copy_on_the_pool(host_copies, crcs, checksum)
    for stream, pairs in device_copies.items():
        # One stream context per window, not per storage (entering one costs more than a small copy).
        with torch.cuda.stream(stream):
            for destination, source in pairs:
                destination.copy_(source, non_blocking=True)
        slot.track_copies(stream)


_POOL_COPY = 256 << 10
"""CPU storage pieces of at least this many bytes are copied (and checksummed) on the CRC pool's threads, all of a
window's at once; smaller ones on the filling thread, where a pool task's fixed cost would outweigh the copy."""


def _copy_on_the_pool(pieces: list[tuple[int, int, int, int]], crcs: list[int], checksum: bool) -> None:
    """Copies a window's large CPU pieces ``(record, destination, source, length)`` on the pool's threads side by
    side, in ranges of at most ``PIECE_SIZE`` (each CRC-32 computed in its copy's pass), and waits for them; then
    folds each range's CRC-32 into its record's running CRC, in file order. One piece after another on the filling
    thread, a CPU state with many medium tensors (a training state: a snapshot) was copied at one core's speed."""
    ranges = [(index, piece) for index, *copy in pieces for piece in crc_pool.copy_pieces(*copy)]
    job = crc_pool.submit_copies([piece for _, piece in ranges], checksum)
    job.wait()  # native, GIL released: a Ctrl-C is raised once no task can still write into the buffer
    if checksum:
        for k, (index, (_, _, length)) in enumerate(ranges):
            crcs[index] = engine.crc32_combine(crcs[index], job.crc(k), length)


_BYTES, _STORAGE, _DESCRIPTOR, _TRAILER = (
    SegmentKind.BYTES,
    SegmentKind.STORAGE,
    SegmentKind.DESCRIPTOR,
    SegmentKind.TRAILER,
)


def _checksum(plan: SavePlan, slot: Slot, window: tuple[int, int], cursor: _Cursor, checksum: bool):
    """Checksum stage of a window: waits for its device-to-host copies, then queues the CRC-32 of
    its large device-storage pieces; returns ``(pieces, queued)`` for the finalize stage."""
    slot.wait_copies()
    pieces = list(cursor.overlapping(*window))
    return pieces, (_queue_device_crcs(plan, slot, window[0], pieces) if checksum else {})


def _finalize_and_submit(
    plan,
    slot: Slot,
    window: tuple[int, int],
    checked: concurrent.futures.Future,
    crcs,
    trailer: list[tuple[int, bytes]],
    settings,
    file,
    shift: int = 0,
    range_start: int | None = None,
) -> None:
    start, end = window
    pieces, queued = checked.result()
    try:
        _finalize_pieces(plan, slot, start, pieces, queued, crcs, trailer, settings, range_start)
    except BaseException:
        for pending in queued.values():
            pending.wait()  # no pool task may still read the buffer once it goes back to the ring
        raise
    slot.submit_write(end - start, file, start + shift)


def _finalize_pieces(
    plan,
    slot: Slot,
    start: int,
    pieces,
    queued: dict,
    crcs,
    trailer: list[tuple[int, bytes]],
    settings,
    range_start: int | None,
) -> None:
    for (kind, offset, _, index, _), lo, hi in pieces:
        if range_start is not None and (
            kind == _TRAILER or (kind == _DESCRIPTOR and plan.records[index].entry.data_offset < range_start)
        ):
            slot.view[lo - start : hi - start] = bytes(hi - lo)  # the committing rank writes these
        elif kind == _STORAGE:
            pending = queued.get(index)
            if pending is not None:  # computed from zero: continue the record's running CRC
                crcs[index] = engine.crc32_combine(crcs[index], pending.result(), hi - lo)
            elif settings.checksum and plan.records[index].device.type != "cpu":
                crcs[index] = engine.crc32(slot.address + (lo - start), hi - lo, crcs[index])
        elif kind == _DESCRIPTOR:
            data = plan.records[index].entry.data_descriptor(crcs[index])
            slot.view[lo - start : hi - start] = data[lo - offset : hi - offset]
        elif kind == _TRAILER:
            # The segment's record is -1 for a plan's one trailer; a plan of several archives
            # (a DCP .distcp file: dcp.layout.FilePlan) numbers their trailers there instead.
            # Each is made once: a trailer may span two windows.
            if not trailer or trailer[0][0] != offset:
                trailer[:] = [(offset, plan.trailer(crcs) if index < 0 else plan.trailer(crcs, index))]
            slot.view[lo - start : hi - start] = trailer[0][1][lo - offset : hi - offset]


_INLINE_CRC = 256 << 10
"""Device storage pieces smaller than this are checksummed on the finalizing thread: a pool task's fixed cost
(docs/performance.md) would outweigh their checksum."""


def _queue_device_crcs(plan: SavePlan, slot: Slot, start: int, pieces) -> dict:
    """Queues, all at once, the CRC-32 of every large device-storage piece of the window on the pool.

    One piece after another, the cores sat idle between pieces; queued together, the checksums of a
    GPU save ran much faster (docs/performance.md). A window holds at most one
    piece of each record. Each CRC starts from zero: the checksum stage runs ahead of the
    finalize, which folds it into the record's running CRC in file order.
    """
    base = slot.address
    queued = {}
    try:
        for (kind, _, _, index, _), lo, hi in pieces:
            if kind == _STORAGE and hi - lo >= _INLINE_CRC and plan.records[index].device.type != "cpu":
                queued[index] = crc_pool.submit_crc32(base + (lo - start), hi - lo)
    except BaseException:
        for pending in queued.values():
            pending.wait()  # the finalize never sees these: do not hand the buffer back under them
        raise
    return queued
