"""Runs an offloaded model: resident weights loaded once, the others streamed into slots around each forward.

Each streamed unit's module gets its ``forward`` wrapped (``try``/``finally``:
a forward that raises or is interrupted still releases its slot). Before it,
the wrapper binds the unit's tensors to views of a slot, loading it first if
no prefetch did, and asks for the next units in execution order (learnt on
the first pass, model order until then) to be loaded into free slots. After
it, the meta placeholders go back and the slot is reusable once the device's
current stream has passed the module's work.

One loader thread per model fills slots: O_DIRECT reads of each tensor's
page-aligned file range into the slot's pinned host staging (or the host
tier's copy, kept after the first read within ``max_host_memory``), then one
host-to-device copy on a side stream, after the slot's previous user's work
(a CUDA event). With ``device="cpu"`` the slots are page-aligned host memory
and the reads land in them directly.

The model's own forward takes a lock: passes from several threads run one
after the other (the slots are shared). The loader thread is a daemon that
:meth:`Offloaded.close` (or interpreter exit) stops and joins; after
``fork`` the child starts its own on first use.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import functools
import os
import queue
import threading
import time
import weakref
from typing import Any

import torch

from fastpersist.errors import CheckpointChangedError
from fastpersist.io import engine, memory
from fastpersist.offload.plan import Unit

__all__ = ["CheckpointChangedError", "OffloadStats", "Offloaded"]


@dataclasses.dataclass
class OffloadStats:
    """Counters of one offloaded model (``Offloaded.stats()``)."""

    units_loaded: int = 0
    bytes_read: int = 0
    host_tier_hits: int = 0
    read_seconds: float = 0.0
    """Loader time spent in reads (disk to host)."""
    stall_seconds: float = 0.0
    """Time forwards waited for a unit that was not loaded yet."""


@dataclasses.dataclass
class _Slot:
    index: int
    target: torch.Tensor
    """Where the unit's layout lives for the forward (device memory, or host memory for device="cpu")."""
    staging: torch.Tensor | None
    """Pinned host memory the reads land in before the copy (CUDA only)."""
    unit: Unit | None = None
    state: str = "free"  # free | loading | ready | active
    active: int = 0
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None
    loaded: Any = None  # CUDA event: the copy into target is done
    released: Any = None  # CUDA event: the last forward using target is done
    staged: Any = None  # CUDA event: the copy out of staging is done


_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for offloaded in list(_live):
        offloaded.close()


_abandoned: list = []
"""A forked child's inherited native handles: never destroyed there (their destructor would join the
parent's I/O threads, which do not exist in the child)."""


def _after_fork_in_child() -> None:
    for offloaded in list(_live):
        offloaded._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Offloaded:
    """The state of one dispatched model (``model.fastpersist_offload``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        resident: list[Unit],
        streamed: list[Unit],
        slots: int,
        slot_bytes: int,
        kept: list[tuple[torch.nn.Module, str, bool]],
        host_tier_bytes: int,
        settings,
    ):
        self.model = model
        self.device = device
        self.resident = resident
        self.streamed = streamed
        self.settings = settings
        self._stats = OffloadStats()
        self._files: dict[str, Any] = {}
        self._stamps: dict[str, tuple[int, int, int]] = {}
        self._pid = 0
        self._handle = None
        self._thread: threading.Thread | None = None
        self._requests: queue.Queue = queue.Queue()
        self._lock = threading.RLock()
        self._wrapped: list[tuple[torch.nn.Module, Any]] = []  # (module, its own instance forward or None)
        self._originals: dict[tuple[int, str], torch.Tensor] = {}
        self._order = list(streamed)
        self._seen: list[Unit] = []
        self._learnt = False
        self._host_tier: dict[str, torch.Tensor] = {}
        self._host_tier_left = host_tier_bytes
        self._closed = False
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._slots = [self._new_slot(i, slot_bytes) for i in range(slots)]
        self._open_files(resident + streamed)
        for module, name, is_parameter in kept:
            table = module._parameters if is_parameter else module._buffers
            table[name] = table[name].to(device)
        self._keep_buffers: list[torch.Tensor] = []
        for unit in resident:
            self._load_resident(unit)
        for unit in streamed:
            for b in unit.bindings:
                table = b.module._parameters if b.is_parameter else b.module._buffers
                # Placeholders on the meta device: a model built on the CPU frees its values here, and a
                # streamed weight read outside its module's forward fails loudly instead of being stale.
                table[b.name] = _placeholder(table[b.name], b.is_parameter)
                self._originals[(id(b.module), b.name)] = table[b.name]
            self._wrap(unit.module, functools.partial(self._activate, unit), functools.partial(self._deactivate, unit))
        self._wrap(model, self._enter, self._leave)
        _live.add(self)

    # -- public ---------------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        """A copy of the counters so far."""
        return dataclasses.replace(self._stats)

    def describe(self) -> dict[str, Any]:
        """What was placed where: resident and streamed units with their bytes, slots and the host tier."""
        return {
            "device": str(self.device),
            "resident": [(u.name, u.tensor_bytes) for u in self.resident],
            "streamed": [(u.name, u.tensor_bytes) for u in self.streamed],
            "slots": len(self._slots),
            "slot_bytes": self._slots[0].target.numel() if self._slots else 0,
            "host_tier_bytes": sum(t.numel() for t in self._host_tier.values()),
        }

    def close(self) -> None:
        """Stops the loader thread, restores the wrapped forwards, frees the slots and files. Unusable after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread, self._thread = self._thread, None
            if thread is not None and self._pid == os.getpid():
                self._requests.put(None)
                thread.join()
            if self._side is not None:
                self._side.synchronize()  # no copy into or out of a slot may outlive its memory
            for module, previous in reversed(self._wrapped):
                if previous is None:
                    del module.forward
                else:
                    module.forward = previous
            self._wrapped.clear()
            self._guard = self.model.register_forward_pre_hook(_refuse_closed)
            self._slots.clear()
            self._host_tier.clear()
            for file in self._files.values():
                file.close()
            self._files.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def forget(self) -> None:
        """Removes the closed model's guard (a new ``dispatch`` of the same model calls this)."""
        guard = getattr(self, "_guard", None)
        if guard is not None:
            guard.remove()
            self._guard = None

    # -- loading ----------------------------------------------------------------------------------

    def _new_slot(self, index: int, nbytes: int) -> _Slot:
        if self.device.type == "cuda":
            return _Slot(
                index, torch.empty(nbytes, dtype=torch.uint8, device=self.device), memory.new_cpu_locked_tensor(nbytes)
            )
        return _Slot(index, memory.aligned_empty(nbytes), None)

    def _open_files(self, units: list[Unit]) -> None:
        for unit in units:
            for b in unit.bindings:
                path = b.source.path
                if path not in self._files:
                    file = engine.File(path, "r", direct=True)
                    self._files[path] = file
                    st = os.fstat(file.fileno())
                    self._stamps[path] = (st.st_size, st.st_mtime_ns, st.st_ino)

    def _check_unchanged(self, unit: Unit) -> None:
        for path in {b.source.path for b in unit.bindings}:
            st = os.fstat(self._files[path].fileno())
            if (st.st_size, st.st_mtime_ns, st.st_ino) != self._stamps[path]:
                raise CheckpointChangedError(
                    errno.ESTALE,
                    f"{path} changed on disk while the offloaded model was using it (size or modification time "
                    "differ): dispatch the model again",
                    path,
                )

    def _forked(self) -> None:
        """In a forked child: the parent's loader thread, its requests and held locks do not exist here."""
        self._lock = threading.RLock()
        if self._handle is not None:
            _abandoned.append(self._handle)
        self._thread, self._pid, self._handle = None, 0, None
        for slot in self._slots:
            if slot.state == "loading" or not slot.ready.is_set() and slot.unit is not None:
                slot.unit, slot.state, slot.error = None, "free", None
            slot.ready = threading.Event()
            if slot.unit is not None:
                slot.ready.set()

    def _io(self):
        pid = os.getpid()
        if self._pid != pid:  # first use, or a forked child: its own handle and loader thread
            if self._handle is not None:
                _abandoned.append(self._handle)
            self._pid = pid
            self._handle = engine.make_handle(self.settings)
            self._requests = queue.Queue()
            self._thread = threading.Thread(target=self._loader, name="fastpersist-offload", daemon=True)
            self._thread.start()
        return self._handle

    def _read(self, unit: Unit, buffer: torch.Tensor) -> None:
        """Reads every tensor of ``unit`` into its region of ``buffer`` (page-aligned host memory)."""
        self._check_unchanged(unit)
        handle = self._handle
        start = time.perf_counter()
        base = buffer.data_ptr()
        for b in unit.reads:
            offset, length = b.read_span
            handle.submit_read(base + b.region, length, self._files[b.source.path], offset, buffer, allow_short=True)
        handle.wait()
        self._stats.read_seconds += time.perf_counter() - start
        self._stats.bytes_read += unit.tensor_bytes
        self._stats.units_loaded += 1

    def _fill(self, slot: _Slot, unit: Unit) -> None:
        """Makes ``slot.target`` hold ``unit``'s layout (runs on the loader thread)."""
        if self.device.type != "cuda":
            self._read(unit, slot.target)
            return
        source = self._host_tier.get(unit.name)
        if source is not None:
            self._stats.host_tier_hits += 1
        elif self._host_tier_left >= unit.nbytes:
            source = memory.new_cpu_locked_tensor(unit.nbytes)
            self._read(unit, source)
            self._host_tier[unit.name] = source
            self._host_tier_left -= unit.nbytes
        else:
            if slot.staged is not None:
                slot.staged.synchronize()  # the previous copy out of the staging buffer is done
            source = slot.staging
            self._read(unit, source)
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self._side):
            if slot.released is not None:
                self._side.wait_event(slot.released)
            _copy_to_device(unit, source, slot.target, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)
        slot.loaded = done
        if source is slot.staging:
            slot.staged = done

    def _loader(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            slot, unit = item
            try:
                self._fill(slot, unit)
            except BaseException as e:  # noqa: BLE001 - handed to the forward that waits for this unit
                slot.error = e
            finally:
                slot.ready.set()

    def _load_resident(self, unit: Unit) -> None:
        self._io()
        if self.device.type == "cuda":
            host = memory.new_cpu_locked_tensor(unit.nbytes)
            self._read(unit, host)
            target = torch.empty(unit.nbytes, dtype=torch.uint8, device=self.device)
            _copy_to_device(unit, host, target, non_blocking=False)  # the pinned host buffer is freed next
        else:
            target = memory.destination_empty(unit.nbytes, self.settings.huge_pages)
            self._read(unit, target)
        self._keep_buffers.append(target)
        _bind(unit, target)

    # -- forward wrappers -----------------------------------------------------------------------

    def _wrap(self, module: torch.nn.Module, before, after) -> None:
        """Runs ``before()`` ahead of ``module``'s forward and ``after()`` once it ends, however it ends.

        A wrapper, not forward hooks: torch runs ``always_call`` hooks after an
        ``Exception`` only, and a Ctrl-C inside a forward must release the
        slot and the lock too. ``functools.wraps`` keeps the signature that
        frameworks inspect (transformers' ``generate``).
        """
        previous = module.__dict__.get("forward")
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            before()
            try:
                return inner(*args, **kwargs)
            finally:
                after()

        module.forward = forward
        self._wrapped.append((module, previous))

    def _enter(self) -> None:
        if self._closed:
            raise RuntimeError("this offloaded model was closed (Offloaded.close()); dispatch it again")
        self._lock.acquire()

    def _leave(self) -> None:
        try:
            if not self._learnt and self._seen:
                self._learnt = True
                order = list(dict.fromkeys(self._seen))  # first calls, in execution order
                self._order = order + [u for u in self.streamed if u not in order]
        finally:
            self._lock.release()

    def _slot_of(self, unit: Unit) -> _Slot | None:
        return next((s for s in self._slots if s.unit is unit), None)

    def _request(self, slot: _Slot, unit: Unit) -> None:
        slot.unit, slot.state, slot.error = unit, "loading", None
        slot.ready.clear()
        self._requests.put((slot, unit))

    def _free_slot(self, keep: set[int]) -> _Slot | None:
        """A slot that may take another unit: empty, or holding a loaded unit not needed soon."""
        for slot in self._slots:
            if slot.unit is None:
                return slot
        for slot in self._slots:
            if slot.state in ("ready", "loading") and id(slot.unit) not in keep:
                slot.ready.wait()
                slot.unit, slot.state = None, "free"
                return slot
        return None

    def _activate(self, unit: Unit) -> None:
        self._io()
        if not self._learnt:
            self._seen.append(unit)
        slot = self._slot_of(unit)
        if slot is None:
            slot = self._free_slot(keep=set())
            if slot is None:
                raise RuntimeError(
                    f"offloaded module {unit.name} was called while every slot is in use by modules still running "
                    "(nested streamed modules): dispatch with more slots (slots=...)"
                )
            self._request(slot, unit)
        if not slot.ready.is_set():
            start = time.perf_counter()
            slot.ready.wait()
            self._stats.stall_seconds += time.perf_counter() - start
        if slot.error is not None:
            error, slot.error = slot.error, None
            slot.unit, slot.state = None, "free"
            raise error
        if slot.active == 0:
            if slot.loaded is not None:
                torch.cuda.current_stream(self.device).wait_event(slot.loaded)
            _bind(unit, slot.target)
        slot.active += 1
        slot.state = "active"
        try:
            self._prefetch(unit)
        except BaseException:
            self._deactivate(unit)  # the forward will not run: its wrapper's after() will not either
            raise

    def _deactivate(self, unit: Unit) -> None:
        slot = self._slot_of(unit)
        if slot is None or slot.active == 0:
            return  # its activation failed before binding
        slot.active -= 1
        if slot.active:
            return
        for b in unit.bindings:
            table = b.module._parameters if b.is_parameter else b.module._buffers
            table[b.name] = self._originals[(id(b.module), b.name)]
        if self.device.type == "cuda":
            released = torch.cuda.Event()
            released.record(torch.cuda.current_stream(self.device))
            slot.released = released
        slot.state = "ready"
        self._prefetch(unit)

    def _prefetch(self, current: Unit) -> None:
        order = self._order
        if len(self._slots) < 2 or current not in order:
            return
        position = order.index(current)
        ahead = [order[(position + k) % len(order)] for k in range(1, len(self._slots))]
        keep = {id(current)} | {id(u) for u in ahead}
        for unit in ahead:
            if self._slot_of(unit) is not None:
                continue
            slot = self._free_slot(keep)
            if slot is None:
                return
            self._request(slot, unit)


def _placeholder(tensor: torch.Tensor, is_parameter: bool) -> torch.Tensor:
    if tensor.is_meta:
        return tensor
    empty = torch.empty_like(tensor, device="meta")
    return torch.nn.Parameter(empty, requires_grad=False) if is_parameter else empty


def _refuse_closed(module, args) -> None:
    raise RuntimeError("this offloaded model was closed (fastpersist_offload.close()); dispatch it again")


def _copy_to_device(unit: Unit, host: torch.Tensor, device: torch.Tensor, *, non_blocking: bool) -> None:
    """Copies ``unit``'s tensors from their host layout into their device layout (each at its region's start)."""
    for host_offset, device_offset, length in unit.device_copies():
        target = device[device_offset : device_offset + length]
        target.copy_(host[host_offset : host_offset + length], non_blocking=non_blocking)


def _bind(unit: Unit, buffer: torch.Tensor) -> None:
    """Points every tensor of ``unit`` at its bytes in ``buffer``; tied names get the same object.

    In host memory a tensor's bytes sit at its file offset within the page
    (``data_offset``); on a CUDA device at its region's start.
    """
    made: dict[tuple[int, bool], torch.Tensor] = {}
    for b in unit.bindings:
        tensor = made.get((b.region, b.is_parameter))
        if tensor is None:
            start = b.region if buffer.is_cuda else b.data_offset
            tensor = buffer[start : start + b.source.nbytes].view(b.source.dtype).view(b.source.shape)
            if b.is_parameter:
                tensor = torch.nn.Parameter(tensor, requires_grad=False)
            made[(b.region, b.is_parameter)] = tensor
        (b.module._parameters if b.is_parameter else b.module._buffers)[b.name] = tensor
