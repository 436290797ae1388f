"""Reusable host staging areas for snapshot-mode ``async_save``.

A snapshot save copies every storage of the checkpoint into one host area
(pinned when CUDA is available, so device-to-host copies run at DMA speed),
then lets the caller go on while the background thread writes the area out.

Memory rules (also in docs/async.md):

* an area holds one checkpoint: its size is the sum of the checkpoint's
  storages, each rounded up to 4 KiB, except the GPU storages smaller than
  64 KiB, which are packed back to back (gathered on the GPU, one copy);
* areas are kept after a save and reused by the next one, so a training loop
  that saves the same state every N steps allocates (and pins) once;
* an area **grows** when a checkpoint does not fit: the idle area is freed and
  a larger one (the new size plus 1/8, so slowly growing states do not
  reallocate each time) is allocated; it never shrinks on its own;
* there are as many areas as snapshot saves in flight at once, at most
  ``async_max_pending``;
* :func:`release_idle_areas` (``fastpersist.release_buffers()``) frees every
  area not in use by a pending save.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from fastpersist.format.plan import SavePlan, StorageRecord
from fastpersist.io import memory

__all__ = [
    "StagingArea",
    "Snapshot",
    "Lease",
    "lease",
    "snapshot_plan",
    "reserve",
    "release_idle_areas",
    "staged_bytes",
]

_ALIGNMENT = 4096


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class StagingArea:
    """One host buffer that holds the storages of one checkpoint."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        # Pinned (locked and registered with CUDA) once the process uses CUDA. Before that
        # there is no DMA to speed up, and registering would create a CUDA context (~250 MB
        # of host memory) for a snapshot of CPU tensors: page-aligned memory, not locked.
        self.pinned = torch.cuda.is_initialized()
        if self.pinned:
            self.buffer = memory.new_cpu_locked_tensor(capacity)
        else:
            self.buffer = memory.aligned_empty(capacity, huge_pages=True)

    def free(self) -> None:
        memory.free_cpu_locked_tensor(self.buffer)
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.capacity = 0


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[StagingArea] = []
        self.busy: set[int] = set()
        self.allocated = 0

    def acquire(self, nbytes: int) -> StagingArea:
        with self.lock:
            # An area made before CUDA's first use is not pinned: it is not taken once CUDA is up.
            pinned = torch.cuda.is_initialized()
            fitting = [area for area in self.idle if area.capacity >= nbytes and (area.pinned or not pinned)]
            if fitting:
                area = min(fitting, key=lambda a: a.capacity)
                self.idle.remove(area)
                self.busy.add(id(area))
                return area
            # Grow: the largest idle area (an unpinned one first, when CUDA is up) is replaced by a bigger one.
            replaced = max(self.idle, key=lambda a: (pinned and not a.pinned, a.capacity)) if self.idle else None
            if replaced is not None:
                self.idle.remove(replaced)
                self.allocated -= replaced.capacity
        if replaced is not None:
            replaced.free()
        capacity = _round_up(max(nbytes + nbytes // 8, _ALIGNMENT), 2 << 20)
        area = StagingArea(capacity)
        with self.lock:
            self.allocated += capacity
            self.busy.add(id(area))
        return area

    def release(self, area: StagingArea) -> None:
        with self.lock:
            self.busy.discard(id(area))
            self.idle.append(area)

    def clear(self) -> int:
        with self.lock:
            idle, self.idle = self.idle, []
            freed = sum(area.capacity for area in idle)
            self.allocated -= freed
        for area in idle:
            area.free()
        return freed


_pool = _Pool()
_forked_leftovers: list[_Pool] = []


def _reset_in_child() -> None:
    global _pool
    # The parent's areas may be registered with CUDA, which a forked child cannot touch:
    # keep them referenced (never unregistered here) and start a fresh pool.
    _forked_leftovers.append(_pool)
    _pool = _Pool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


@dataclasses.dataclass
class Snapshot:
    """A plan whose storages are copies in a staging area, and what the copies still wait for."""

    plan: SavePlan
    area: StagingArea | None
    events: list
    """``[(device, event)]``: each GPU's copies are done when its event is."""

    def wait_copies(self) -> None:
        """Blocks until every device-to-host copy has landed in the area."""
        for _, event in self.events:
            event.synchronize()
        self.events.clear()

    def release(self) -> None:
        """Gives the area back for reuse (call once the plan is written or abandoned)."""
        if self.area is not None:
            area, self.area = self.area, None
            _pool.release(area)


@dataclasses.dataclass
class Lease:
    """A staging area taken for one plan, and where each of its storages goes in it (see :func:`lease`)."""

    area: StagingArea | None
    offsets: dict[int, int]
    small: dict[torch.device, list[StorageRecord]]
    regions: dict[torch.device, int]

    def release(self) -> None:
        """Gives the area back unused (a snapshot that was never taken)."""
        if self.area is not None:
            area, self.area = self.area, None
            _pool.release(area)


def lease(plan: SavePlan) -> Lease | None:
    """Takes a staging area that fits the storages of ``plan`` (None when it has none).

    The area is the expensive part of a snapshot to fail on (allocation,
    pinning): a caller that hands the copies to another thread leases on its
    own thread, so the error reaches it, then passes the lease to
    :func:`snapshot_plan`.

    Raises:
        MemoryError / OSError: the staging area cannot be allocated.
    """
    if not plan.storages:
        return None
    offsets, small, regions, total = _layout(plan.storages)
    return Lease(_pool.acquire(total), offsets, small, regions)


def snapshot_plan(
    plan: SavePlan,
    caller_waits: bool = True,
    *,
    leased: Lease | None = None,
    streams: dict[torch.device, torch.cuda.Stream] | None = None,
) -> Snapshot:
    """Copies the storages of ``plan`` into a staging area; returns the plan over the copies.

    CPU storages are copied before this returns. CUDA storages are copied
    asynchronously on a side stream that is ordered after the caller's
    current stream, and the caller's current stream is made to wait for the
    copies, so kernels queued later (an optimizer step) cannot change the
    bytes before they are copied; the caller's thread is not blocked.
    :meth:`Snapshot.wait_copies` waits for them (the background writer does).

    With ``caller_waits=False`` the caller's stream does not wait: the copies
    overlap the kernels queued next (a forward pass), and whoever may change
    the tensors must first make its stream wait for ``Snapshot.events``
    (``fastpersist.Checkpointer`` does, before the optimizer step).

    Another thread may take the snapshot for the caller: it passes the
    caller's :func:`lease` as ``leased`` and, as ``streams``, side streams the
    caller made and ordered after its own work
    (:func:`fastpersist.io.writer.side_streams`); the copies then go on those
    streams, and nobody's stream is made to wait (``caller_waits`` must be False).
    The lease is consumed: it is released here on failure, by the snapshot otherwise.

    Raises:
        MemoryError / OSError: the staging area cannot be allocated.
        ValueError: ``streams`` with ``caller_waits``.
    """
    if streams is not None and caller_waits:
        raise ValueError("a snapshot on the caller's own side streams cannot make the caller's stream wait")
    storages = plan.storages
    if not storages:
        return Snapshot(plan, None, [])
    if leased is None:
        leased = lease(plan)
    offsets, small, regions, area = leased.offsets, leased.small, leased.regions, leased.area
    events: list = []
    try:
        copies = {id(r): area.buffer[offsets[id(r)] : offsets[id(r)] + r.view.numel()] for r in storages}
        large: dict[torch.device, list[StorageRecord]] = {}
        for record in storages:
            if record.device.type != "cuda":
                copies[id(record)].copy_(record.view)
            elif record.view.numel() >= _GATHER_BELOW:
                large.setdefault(record.device, []).append(record)
        for device in {*large, *small}:
            region = area.buffer[regions[device] :] if device in regions else None
            stream = streams[device] if streams is not None else None
            event = _copy_from_device(
                device, large.get(device, []), small.get(device, []), copies, region, caller_waits, stream
            )
            events.append((device, event))
    except BaseException:
        for _, event in events:
            event.synchronize()  # nothing may still copy into the area once it is reused
        leased.release()
        raise
    leased.area = None  # the snapshot owns it now
    return Snapshot(plan.with_views(copies), area, events)


def _layout(storages) -> tuple[dict[int, int], dict[torch.device, list[StorageRecord]], dict[torch.device, int], int]:
    """Where each storage goes in the area: ``(offsets by id(record), small records by device, each device's
    region of small ones, total bytes)``.

    Page-aligned, except the small storages of each GPU, which are packed back to back so that one
    gather and one copy move them all (a copy per storage costs the caller's thread time, and a
    training state has many small ones; docs/performance.md). Sizes come from the records' entries:
    making each storage's byte view here would cost the caller time per storage, when the copies may be
    queued on another thread.
    """
    offsets: dict[int, int] = {}
    small: dict[torch.device, list[StorageRecord]] = {}
    total = 0
    for record in storages:
        if record.device.type == "cuda" and record.nbytes < _GATHER_BELOW:
            small.setdefault(record.device, []).append(record)
        else:
            offsets[id(record)] = total
            total += _round_up(record.nbytes, _ALIGNMENT)
    regions: dict[torch.device, int] = {}
    for device, records in small.items():
        regions[device] = total
        for record in records:
            offsets[id(record)] = total
            total += record.nbytes
        total = _round_up(total, _ALIGNMENT)
    return offsets, small, regions, total


def reserve(plan: SavePlan) -> int:
    """Makes sure an idle staging area fits a snapshot of ``plan`` (allocated and pinned now, not at the save).

    Returns the bytes of the area that will take it (0 for a plan without storages).
    """
    if not plan.storages:
        return 0
    area = _pool.acquire(_layout(plan.storages)[3])
    _pool.release(area)
    return area.capacity


_GATHER_BELOW = 64 << 10
"""GPU storages smaller than this are gathered into one device buffer and copied to the host at once."""


def _copy_from_device(
    device: torch.device,
    large: list[StorageRecord],
    small: list[StorageRecord],
    copies: dict[int, torch.Tensor],
    region: torch.Tensor | None,
    caller_waits: bool = True,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event:
    """Queues the device-to-host copies of one GPU's storages on a side stream; returns its event.

    The side stream starts after the work queued so far on the caller's current stream, and (with
    ``caller_waits``) the caller's stream waits for the copies, so later kernels cannot change the bytes first.
    A ``stream`` given is already ordered after the caller's work (made on the caller's thread) and is used as is.
    """
    if stream is None:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            for record in large:
                copies[id(record)].copy_(record.view, non_blocking=True)
            if small:
                gathered = torch.cat([record.view for record in small])  # on the side stream: freed safely
                region[: gathered.numel()].copy_(gathered, non_blocking=True)
            # The caller may drop the tensors at once: their memory must not be reused before the copies ran.
            for record in (*large, *small):
                record.view.record_stream(stream)
    except BaseException:
        stream.synchronize()  # nothing may still copy into the area once it is reused
        raise
    if caller_waits:
        torch.cuda.current_stream(device).wait_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    return event


def release_idle_areas() -> int:
    """Frees the staging areas that no pending save uses; returns the bytes freed."""
    return _pool.clear()


def staged_bytes() -> int:
    """Bytes held by staging areas now (idle and in use)."""
    with _pool.lock:
        return _pool.allocated
