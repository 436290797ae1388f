"""Reusable host staging areas for snapshot-mode ``async_save``.

A snapshot save copies every storage of the checkpoint into one host area
(pinned when CUDA is available, so device-to-host copies run at DMA speed),
then lets the caller go on while the background thread writes the area out.

Memory rules (also in docs/async.md):

* an area holds one checkpoint: its size is the sum of the checkpoint's
  storages, each rounded up to 4 KiB;
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

__all__ = ["StagingArea", "Snapshot", "snapshot_plan", "release_idle_areas", "staged_bytes"]

_ALIGNMENT = 4096


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class StagingArea:
    """One host buffer that holds the storages of one checkpoint."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        if torch.cuda.is_available():
            self.buffer = memory.new_cpu_locked_tensor(capacity)
        else:
            # Without a GPU there is no DMA to speed up: page-aligned memory, not locked.
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
            fitting = [area for area in self.idle if area.capacity >= nbytes]
            if fitting:
                area = min(fitting, key=lambda a: a.capacity)
                self.idle.remove(area)
                self.busy.add(id(area))
                return area
            # Grow: the largest idle area is replaced by a bigger one.
            replaced = max(self.idle, key=lambda a: a.capacity) if self.idle else None
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

    def wait_copies(self) -> None:
        """Blocks until every device-to-host copy has landed in the area."""
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def release(self) -> None:
        """Gives the area back for reuse (call once the plan is written or abandoned)."""
        if self.area is not None:
            area, self.area = self.area, None
            _pool.release(area)


def snapshot_plan(plan: SavePlan) -> Snapshot:
    """Copies the storages of ``plan`` into a staging area; returns the plan over the copies.

    CPU storages are copied before this returns. CUDA storages are copied
    asynchronously on a side stream that is ordered after the caller's
    current stream, and the caller's current stream is made to wait for the
    copies, so kernels queued later (an optimizer step) cannot change the
    bytes before they are copied; the caller's thread is not blocked.
    :meth:`Snapshot.wait_copies` waits for them (the background writer does).

    Raises:
        MemoryError / OSError: the staging area cannot be allocated.
    """
    storages = plan.storages
    offsets = []
    total = 0
    for record in storages:
        offsets.append(total)
        total += _round_up(record.view.numel(), _ALIGNMENT)
    if not storages:
        return Snapshot(plan, None, [])
    area = _pool.acquire(total)
    try:
        events = []
        side_streams: dict = {}
        copies: dict[int, torch.Tensor] = {}
        for record, offset in zip(storages, offsets):
            source = record.view
            destination = area.buffer[offset : offset + source.numel()]
            if source.device.type == "cuda":
                stream = side_streams.get(source.device)
                if stream is None:
                    stream = side_streams[source.device] = torch.cuda.Stream(source.device)
                    stream.wait_stream(torch.cuda.current_stream(source.device))
                with torch.cuda.stream(stream):
                    destination.copy_(source, non_blocking=True)
                # The caller may drop the tensor at once: its memory must not be reused before the copy ran.
                source.record_stream(stream)
            else:
                destination.copy_(source)
            copies[id(record)] = destination
        for device, stream in side_streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
    except BaseException:
        _pool.release(area)
        raise
    records = tuple(
        StorageRecord(record.entry, record.key, view=copies[id(record)])
        if isinstance(record, StorageRecord)
        else record
        for record in plan.records
    )
    return Snapshot(SavePlan(plan.layout, records), area, events)


def release_idle_areas() -> int:
    """Frees the staging areas that no pending save uses; returns the bytes freed."""
    return _pool.clear()


def staged_bytes() -> int:
    """Bytes held by staging areas now (idle and in use)."""
    with _pool.lock:
        return _pool.allocated
