"""The pinned ring: page-locked host buffers that carry bytes between tensors and files, one slot at a time.

Every path that stages bytes through page-locked host memory goes through a
:class:`Ring`: saves (:func:`fastpersist.io.writer.write_plan`: copies into a
buffer, then its write), CUDA loads (:func:`fastpersist.io.reader.stream_to_device`:
a buffer's read, then its copies out) and DeepNVMe's handle for CUDA tensors
(:class:`fastpersist.deepnvme.handle.AioHandle`, both ways). A ring leases one
buffer per I/O handle it is given from the process's pool
(:func:`fastpersist.io.memory.lease_buffers`) and pairs them as slots. Its user
takes the slots in order (:meth:`Ring.slot`) and, before a buffer is used
again, waits for everything its previous use started (:meth:`Slot.wait_idle`):

* its stage: work on a worker thread (checksums, a refill) that may end by
  submitting the slot's I/O;
* its copies: CUDA events recorded after the copies into or out of the buffer,
  queued on side streams (:meth:`Ring.stream`);
* its checksums: CRC-32 tasks that read the buffer;
* its I/O: the read or write submitted from the buffer to the slot's handle.

Leaving the ring's block waits for all of that on every slot, also when an
exception propagates (it drains: everything in flight is waited for, errors
met on the way are dropped for the one being raised, and every side stream is
synchronized, for copies queued but not yet tracked); only then do the buffers
go back to the pool. On a normal exit the first error raises, after the rest
is drained.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Sequence

import torch

from fastpersist.io import memory
from fastpersist.tensors import host_memoryview

__all__ = ["Ring", "Slot", "SharedHandle", "side_stream", "side_streams", "read_events", "on_streams"]


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new copy stream on CUDA ``device``, ordered after the calling thread's current stream there.

    Copies queued on it then see every write the caller queued before (the kernels producing a
    tensor to save, or still reading a tensor a load overwrites).
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def side_streams(plan) -> dict[torch.device, torch.cuda.Stream]:
    """One copy stream per CUDA device of ``plan`` (:func:`side_stream`), made on the calling thread."""
    return {device: side_stream(device) for device in plan.devices() if device.type == "cuda"}


@contextlib.contextmanager
def on_streams(streams):
    """Makes each of ``streams`` (``{device: stream}``, from :func:`side_streams`) current on its device.

    Work queued meanwhile on another thread than the one that made them (the
    save thread) still comes after what that thread had queued.
    """
    with contextlib.ExitStack() as stack:
        for stream in (streams or {}).values():
            stack.enter_context(torch.cuda.stream(stream))
        yield


def read_events(streams) -> list[tuple[torch.device, torch.cuda.Event]]:
    """``[(device, event)]``: an event recorded on each side stream after every copy queued on it so far."""
    events = []
    for device, stream in streams.items():
        event = torch.cuda.Event()
        event.record(stream)
        events.append((device, event))
    return events


class SharedHandle:
    """A slot's handle on a native handle that several slots share: each slot waits for its own request only.

    Holds at most one request: the slot submits one read or write per use and
    waits for it (:meth:`wait`) before the next. Requests are detached, so
    another slot's wait neither waits for them nor raises their errors.
    """

    def __init__(self, handle) -> None:
        self.handle = handle
        self.request = None

    def submit_write(self, address: int, nbytes: int, file, offset: int, keepalive, **options) -> None:
        self.request = self.handle.submit_write(address, nbytes, file, offset, keepalive, detached=True, **options)

    def submit_read(self, address: int, nbytes: int, file, offset: int, keepalive, **options) -> None:
        self.request = self.handle.submit_read(address, nbytes, file, offset, keepalive, detached=True, **options)

    def wait(self) -> None:
        """Until the request is done; raises its error (``OSError``)."""
        request, self.request = self.request, None
        if request is not None:
            self.handle.wait_request(request)


class Slot:
    """One buffer of a :class:`Ring`, its I/O handle, and what is in flight on the buffer.

    The ring's user owns the slot between :meth:`wait_idle` and the hand-off of
    its stage; a stage (one worker thread) may then wait for the slot's copies
    and checksums and submit its I/O, until the owner's :meth:`wait_stage`.

    Attributes:
        index: the slot's place in the ring.
        buffer: ``size`` page-locked bytes (a uint8 CPU tensor); ``address`` is its first byte.
        handle: ``submit_write``/``submit_read(address, nbytes, file, offset, keepalive, **options)``
            and ``wait()``, which returns once every request submitted to it is done and raises the
            first error (a native handle, a :class:`SharedHandle`, an upload's part handle).
        events: CUDA events recorded after copies into or out of the buffer (:meth:`track_copies`).
        checksums: tasks reading the buffer (``wait()``), such as CRC-32s of the checksum pool.
        stage: the future of work on a worker thread for this use of the slot, or None.
    """

    def __init__(self, index: int, buffer: torch.Tensor, handle) -> None:
        self.index = index
        self.buffer = buffer
        self.address = buffer.data_ptr()
        self.handle = handle
        self.events: list[torch.cuda.Event] = []
        self.checksums: list = []
        self.stage: concurrent.futures.Future | None = None
        self._submitted = False  # I/O submitted and not waited for yet

    @functools.cached_property
    def view(self) -> memoryview:
        """The buffer as a writable memoryview (for slice assignment of bytes)."""
        return host_memoryview(self.buffer)

    def track_copies(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Records (and returns) an event on ``stream`` after the copies just queued there into or out of the buffer."""
        event = torch.cuda.Event()
        event.record(stream)
        self.events.append(event)
        return event

    def submit_write(self, nbytes: int, file, offset: int, **options) -> None:
        """Writes the buffer's first ``nbytes`` to ``file`` at ``offset`` through the slot's handle."""
        self._submitted = True  # first: a submit that fails part way is waited for too
        self.handle.submit_write(self.address, nbytes, file, offset, self.buffer, **options)

    def submit_read(self, nbytes: int, file, offset: int, **options) -> None:
        """Reads ``nbytes`` of ``file`` at ``offset`` into the buffer through the slot's handle."""
        self._submitted = True
        self.handle.submit_read(self.address, nbytes, file, offset, self.buffer, **options)

    def busy(self) -> bool:
        """Whether :meth:`wait_stage` would wait."""
        return self.stage is not None and not self.stage.done()

    def wait_stage(self) -> None:
        """Until the slot's stage is done; raises its error."""
        stage, self.stage = self.stage, None
        if stage is not None:
            stage.result()

    def wait_copies(self) -> None:
        """Until the copies tracked by the slot's events are done."""
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def wait_checksums(self) -> None:
        """Until the tasks reading the buffer are done."""
        checksums, self.checksums = self.checksums, []
        for task in checksums:
            task.wait()

    def wait_buffer(self) -> None:
        """Until no copy or checksum uses the buffer: the checksums are waited for also when a copy raises."""
        try:
            self.wait_copies()
        finally:
            self.wait_checksums()

    def wait_io(self) -> None:
        """Until the slot's I/O is done (nothing to wait for when none was submitted); raises its error."""
        if self._submitted:
            self._submitted = False  # a handle's wait() reaps everything before it raises
            self.handle.wait()

    def wait_idle(self) -> None:
        """Until the buffer is free for its next use: the stage, then copies and checksums, then the I/O.

        Raises the first error met; what follows it is then left for :meth:`drain`.
        """
        self.wait_stage()
        self.wait_buffer()
        self.wait_io()

    def drain(self) -> None:
        """:meth:`wait_idle` that never raises an ``Exception``: for when another error is being raised."""
        stage, self.stage = self.stage, None
        if stage is not None:
            concurrent.futures.wait([stage])
        for wait in (self.wait_copies, self.wait_checksums, self.wait_io):
            try:
                wait()
            except Exception:  # noqa: BLE001 - the error already being raised is the one that matters
                pass


class Ring:
    """A lease of page-locked buffers, one per I/O handle, used in order as :class:`Slot` objects.

    Usage::

        with Ring(handles, size, streams=streams) as ring:
            for index, window in enumerate(windows):
                slot = ring.slot(index)
                slot.wait_idle()  # its previous use is over
                ...               # copies (slot.track_copies), slot.submit_write / submit_read

    Args:
        handles: one I/O handle per slot (see :attr:`Slot.handle`); a caller may reuse them
            across rings.
        size: bytes per buffer.
        huge_pages: buffers from 2 MiB up ask for transparent huge pages (the
            ``huge_pages`` setting; see :func:`fastpersist.io.memory.lease_buffers`).
        streams: side CUDA streams by device, made by the caller (:func:`side_streams`); more are
            made on first use (:meth:`stream`).

    Raises:
        MemoryError / OSError: the buffers cannot be allocated (on entering).
        Whatever a slot's stage, copy, checksum or I/O raised, on a normal exit
        (after everything else in flight is done).
    """

    def __init__(self, handles: Sequence, size: int, *, huge_pages: bool = True, streams: dict | None = None):
        self.handles = list(handles)
        self.size = size
        self.huge_pages = huge_pages
        self.streams: dict[torch.device, torch.cuda.Stream] = {} if streams is None else streams
        self.slots: list[Slot] = []
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> Ring:
        buffers = self._exit.enter_context(memory.lease_buffers(len(self.handles), self.size, self.huge_pages))
        self.slots = [Slot(index, buffer, handle) for index, (buffer, handle) in enumerate(zip(buffers, self.handles))]
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if error is None:
                try:
                    self.wait_idle()
                except BaseException:
                    self.drain()
                    raise
            else:
                self.drain()
        finally:
            self.slots = []
            self._exit.close()  # the buffers go back to the pool

    def slot(self, index: int) -> Slot:
        """The slot of the ``index``-th use of the ring (uses go round the slots in order)."""
        return self.slots[index % len(self.slots)]

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The ring's side stream on CUDA ``device``, made on first use (:func:`side_stream`)."""
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = side_stream(device)
        return stream

    def wait_streams(self) -> None:
        """Until every copy queued on the ring's side streams is done: one synchronization per stream, for
        every slot's copies at once (their events are then dropped). The slots' copies must have gone on
        these streams (:meth:`stream`, or the streams the ring was given)."""
        for stream in self.streams.values():
            stream.synchronize()
        for slot in self.slots:
            slot.events.clear()

    def wait_idle(self) -> None:
        """Until every slot is idle (:meth:`Slot.wait_idle`, slot by slot); raises the first error met."""
        for slot in self.slots:
            slot.wait_idle()

    def drain(self) -> None:
        """Until nothing is in flight on any slot, nor on the side streams; never raises an ``Exception``."""
        for slot in self.slots:
            slot.drain()
        for stream in self.streams.values():
            try:
                stream.synchronize()  # copies queued before a failure could track them
            except Exception:  # noqa: BLE001 - as in Slot.drain
                pass
