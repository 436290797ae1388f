"""Host memory for I/O: page-aligned, page-locked tensors and a per-process pool.

Direct I/O needs aligned memory, and fast device copies need page-locked
(pinned) memory. On this project's machines allocating and locking memory is
slow (page faults dominate), so staging buffers are allocated once per process
and size and reused (:func:`lease_buffers`).

All memory comes from :class:`fastpersist.io.engine.AlignedBuffer` (anonymous
``mmap``), viewed as a tensor with ``torch.frombuffer`` -- no copy, and the
tensor keeps the mapping alive. This works on CPU-only torch builds where
``pin_memory()`` raises. Once this process uses CUDA, locked buffers are also
registered with ``cudaHostRegister`` so device copies run at pinned speed; they
are unregistered just before the memory is unmapped. A process that never
touches CUDA never initializes it here: registering would create a CUDA
context, some 250 MB of host memory and a fraction of a second, for a save of
CPU tensors. Pooled buffers made before CUDA was first used are registered
when they are next leased.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator

import torch

from fastpersist import system
from fastpersist.io import engine
from fastpersist.tensors import cast_to_byte_tensor

__all__ = [
    "new_cpu_locked_tensor",
    "free_cpu_locked_tensor",
    "aligned_empty",
    "destination_buffer",
    "destination_empty",
    "destination_huge_pages",
    "lease_buffers",
    "reserve_ring",
    "release_pooled_buffers",
    "ring_shape",
    "is_locked_tensor",
    "is_managed_locked_memory",
    "cast_to_byte_tensor",
    "PAGE_SIZE",
]

PAGE_SIZE = 4096
_HUGE_PAGE = 2 << 20

_warned_unlocked = False
_warn_lock = threading.Lock()
_free_page_reporting: bool | None = None  # system.free_page_reporting(), read once per process


class _Allocations:
    """The live allocations made by :func:`new_cpu_locked_tensor`, by base address.

    Lets :func:`free_cpu_locked_tensor`, :func:`is_locked_tensor` and
    :func:`is_managed_locked_memory` recognise them. An entry goes when the
    tensor is freed or, at the latest, just before its memory is unmapped
    (:class:`_Release`), so a later mapping at the same address is never taken
    for ours. The lock is reentrant: a garbage collection that unmaps a buffer
    can run inside any block that holds it.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.locked: dict[int, bool] = {}  # base -> whether mlock succeeded
        self.sizes: dict[int, int] = {}  # base -> nbytes

    def add(self, base: int, nbytes: int, locked: bool) -> None:
        with self.lock:
            self.locked[base] = locked
            self.sizes[base] = nbytes

    def forget(self, base: int) -> bool:
        with self.lock:
            self.sizes.pop(base, None)
            return self.locked.pop(base, None) is not None

    def is_locked(self, base: int) -> bool:
        with self.lock:
            return self.locked.get(base, False)

    def covers(self, start: int, end: int) -> bool:
        with self.lock:
            allocations = list(self.sizes.items())  # a release hook may change sizes mid-loop
        return any(base <= start and end <= base + nbytes for base, nbytes in allocations)


_allocations = _Allocations()


def _warn_unlocked(reason: str) -> None:
    global _warned_unlocked
    with _warn_lock:
        if _warned_unlocked:
            return
        _warned_unlocked = True
    warnings.warn(
        f"fastpersist could not lock host memory ({reason}). Buffers stay usable but may be paged out, "
        "and device copies will not run at pinned speed.",
        RuntimeWarning,
        stacklevel=3,
    )


class _Release:
    """What a locked buffer undoes just before its memory is unmapped (its release hook).

    It leaves the registry, so that a later mapping at the same address is not
    taken for ours, and leaves CUDA's registration if it has one. A tensor
    dropped without :func:`free_cpu_locked_tensor` is forgotten this way too.
    """

    __slots__ = ("ptr", "nbytes", "unregister", "allocations")

    def __init__(self, buffer: engine.AlignedBuffer) -> None:
        self.ptr = buffer.ptr
        self.nbytes = buffer.nbytes
        self.unregister = None  # cudart.cudaHostUnregister once CUDA registered the memory
        self.allocations = _allocations  # held: module globals are gone when the last buffers go at exit

    def __call__(self) -> None:
        if self.unregister is not None:
            self.unregister(self.ptr)
        self.allocations.forget(self.ptr)


def _cuda_register(release: _Release) -> bool:
    """Registers the buffer of ``release`` with CUDA (pinned for DMA); the hook unregisters it before unmap.

    Only once CUDA is initialized in this process (see the module docstring);
    returns whether the buffer is registered now.
    """
    if release.nbytes == 0 or not torch.cuda.is_initialized():
        return False
    cudart = torch.cuda.cudart()
    result = cudart.cudaHostRegister(release.ptr, release.nbytes, 0)
    if int(getattr(result, "value", result)) != 0:
        warnings.warn(
            f"cudaHostRegister of {release.nbytes} bytes failed ({result}); device copies will use pageable memory",
            RuntimeWarning,
            stacklevel=3,
        )
        return True  # do not try again: the warning said it once
    release.unregister = cudart.cudaHostUnregister
    return True


def _tensor_over(buffer: engine.AlignedBuffer, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    element = torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=nbytes // element)


def new_cpu_locked_tensor(numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A CPU tensor of ``numel`` elements on page-aligned, page-locked memory (contents undefined).

    Mirrors DeepNVMe's ``new_cpu_locked_tensor``. From 2 MiB up, the memory is
    2 MiB aligned and advised for transparent huge pages (see
    :func:`_new_locked`). If ``mlock`` fails (RLIMIT_MEMLOCK),
    the memory stays usable but unlocked and one ``RuntimeWarning`` is issued per
    process. Once the process uses CUDA, the memory is also registered for pinned
    copies (a tensor made before CUDA's first use is not: device copies from it
    still work, at pageable speed). The memory is released when the last
    reference to the tensor goes.

    Raises:
        MemoryError / OSError: the mapping cannot be created.
        ValueError: negative ``numel``.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    nbytes = int(numel) * torch.empty(0, dtype=dtype).element_size()
    tensor, _, _ = _new_locked(nbytes, dtype)
    return tensor


def _new_locked(
    nbytes: int, dtype: torch.dtype = torch.uint8, huge_pages: bool = True
) -> tuple[torch.Tensor, _Release, bool]:
    """:func:`new_cpu_locked_tensor` of ``nbytes``: the tensor, its buffer's release hook, and whether CUDA registered it.

    With ``huge_pages`` (from 2 MiB up, best effort) the memory is physically
    contiguous in 2 MiB pieces, so a direct request from it needs few
    scatter-gather segments. Where the device accepts few segments in flight,
    that decides throughput: on a virtio disk O_DIRECT writes from 4 KiB pages
    kept few requests in flight, from huge pages many more, and ran faster
    (docs/performance.md, docs/benchmarks.md). Locking the memory then takes
    longer the first time, which pooled buffers pay once per process.
    """
    buffer = engine.AlignedBuffer(nbytes, lock=True, huge_pages=huge_pages and nbytes >= _HUGE_PAGE)
    if nbytes and not buffer.locked:
        _warn_unlocked(buffer.lock_error)
    release = _Release(buffer)
    buffer.set_release_hook(release)
    registered = _cuda_register(release)
    tensor = _tensor_over(buffer, nbytes, dtype)
    if nbytes:
        _allocations.add(tensor.data_ptr(), nbytes, buffer.locked)
    return tensor, release, registered


def free_cpu_locked_tensor(tensor: torch.Tensor) -> bool:
    """Forgets a tensor made by :func:`new_cpu_locked_tensor`.

    The memory itself is unmapped when the last reference to the tensor (or a
    view of it) is gone; this cannot free memory that is still referenced.
    Returns True if ``tensor`` was one of ours.
    """
    return _allocations.forget(tensor.data_ptr())


def is_locked_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` was made by :func:`new_cpu_locked_tensor` and its memory is locked."""
    return _allocations.is_locked(tensor.data_ptr())


def is_managed_locked_memory(tensor: torch.Tensor) -> bool:
    """Whether every byte of CPU ``tensor`` lies inside one allocation made by :func:`new_cpu_locked_tensor`.

    Recognises the tensor itself and any slice or view of it (DeepNVMe's
    pinned-tensor manager matches address ranges the same way). Allocations
    whose ``mlock`` failed count too: they are page-aligned and managed, only
    not locked (see :func:`is_locked_tensor`).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        end = start
    else:
        # Highest byte the view can touch (torch strides are never negative).
        span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
        end = start + (span + 1) * tensor.element_size()
    return _allocations.covers(start, end)


def aligned_empty(nbytes: int, huge_pages: bool = True, lock: bool = False) -> torch.Tensor:
    """An uninitialised 1-D uint8 CPU tensor of ``nbytes`` on page-aligned memory.

    For sizes of 2 MiB and more with ``huge_pages``, the memory is 2 MiB aligned
    and advised for transparent huge pages (far fewer page faults when it is
    first written). For memory that is kept and reused (staging areas, offload
    slots); a load's fresh destination comes from :func:`destination_buffer`.

    Args:
        nbytes: size in bytes (0 allowed).
        huge_pages: ask for transparent huge pages (best effort).
        lock: mlock the memory (falls back to unlocked with one warning).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    buffer = engine.AlignedBuffer(int(nbytes), lock=lock, huge_pages=huge_pages and nbytes >= _HUGE_PAGE)
    if lock and nbytes and not buffer.locked:
        _warn_unlocked(buffer.lock_error)
    return _tensor_over(buffer, int(nbytes), torch.uint8)


def destination_huge_pages(requested: bool) -> bool:
    """Whether fresh memory that a load reads into, and that becomes its tensors, goes on transparent huge pages.

    ``requested`` (the ``huge_pages`` setting), except on a virtual machine that hands freed memory back
    to its host (:func:`fastpersist.system.free_page_reporting`). There a load's fresh huge pages are
    mostly made of memory the host has taken back, and the guest's zeroing of each one waits for the host
    to supply it again: on the development VM a fresh process faulted 614 MB of huge pages in at 0.15
    GB/s and of 4 KiB pages at 0.9 GB/s, and ``fastpersist.load`` of 614 MB ran at 0.15 GB/s into huge
    pages and 0.95 GB/s into 4 KiB pages (docs/checkpoint-benchmark.md). Pooled staging memory is
    faulted in once and reused, so it keeps huge pages there.
    """
    global _free_page_reporting
    if not requested:
        return False
    if _free_page_reporting is None:
        _free_page_reporting = system.free_page_reporting()
    return not _free_page_reporting


def destination_buffer(nbytes: int, huge_pages: bool) -> engine.AlignedBuffer:
    """Fresh page-aligned memory for a load to read ``nbytes`` into: what becomes the loaded tensors.

    On transparent huge pages (2 MiB aligned, for sizes of 2 MiB and more) where
    :func:`destination_huge_pages` says so for ``huge_pages`` (the setting); unlocked.
    """
    huge = destination_huge_pages(huge_pages) and nbytes >= _HUGE_PAGE
    return engine.AlignedBuffer(int(nbytes), lock=False, huge_pages=huge)


def destination_empty(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """:func:`destination_buffer` of ``nbytes`` as an uninitialised 1-D uint8 CPU tensor."""
    return _tensor_over(destination_buffer(nbytes, huge_pages), int(nbytes), torch.uint8)


class _BufferPool:
    """Locked buffers by size (and whether they ask for huge pages), allocated on first use
    and reused for the life of the process.

    Each buffer is kept with its AlignedBuffer and whether CUDA has registered
    it, so that one made before the process first used CUDA is registered on
    its first lease after that.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}  # (size, huge_pages) -> idle buffers
        self._allocated: dict[tuple[int, bool], int] = {}
        self._unregistered: dict[int, _Release] = {}  # data_ptr -> release hook, of buffers CUDA has not registered

    def acquire(self, count: int, size: int, huge_pages: bool = True) -> list[torch.Tensor]:
        key = (size, huge_pages)
        with self._lock:
            free = self._free.setdefault(key, [])
            taken = [free.pop() for _ in range(min(count, len(free)))]
            missing = count - len(taken)
            self._allocated[key] = self._allocated.get(key, 0) + missing
        try:
            # Allocation, locking and registering are slow; do them outside the lock.
            if self._unregistered and torch.cuda.is_initialized():
                self._register(taken)
            for _ in range(missing):
                tensor, release, registered = _new_locked(size, huge_pages=huge_pages)
                taken.append(tensor)
                if not registered and size:
                    with self._lock:
                        self._unregistered[tensor.data_ptr()] = release
        except BaseException:
            with self._lock:
                self._allocated[key] -= count - len(taken)
            self.release(taken, size, huge_pages)
            raise
        return taken

    def _register(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            with self._lock:
                release = self._unregistered.pop(tensor.data_ptr(), None)
            if release is not None and not _cuda_register(release):
                with self._lock:
                    self._unregistered[tensor.data_ptr()] = release

    def release(self, tensors: list[torch.Tensor], size: int, huge_pages: bool = True) -> None:
        with self._lock:
            self._free.setdefault((size, huge_pages), []).extend(tensors)

    def clear(self) -> int:
        with self._lock:
            freed = sum(key[0] * len(tensors) for key, tensors in self._free.items())
            for key, tensors in self._free.items():
                self._allocated[key] -= len(tensors)
                for t in tensors:
                    self._unregistered.pop(t.data_ptr(), None)
                    free_cpu_locked_tensor(t)
            self._free.clear()
        return freed

    def allocated_bytes(self) -> int:
        with self._lock:
            return sum(key[0] * n for key, n in self._allocated.items())


_pool = _BufferPool()


def _reset_after_fork() -> None:
    """A forked child starts with an empty pool and fresh locks (a lock held by another
    parent thread at fork time would never be released in the child). The parent's
    buffers stay mapped in the child but are not reused: the child's copy is not locked."""
    global _pool, _warn_lock
    _pool = _BufferPool()
    _warn_lock = threading.Lock()
    _allocations.lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_after_fork)


@contextlib.contextmanager
def lease_buffers(count: int, size: int, huge_pages: bool = True) -> Iterator[list[torch.Tensor]]:
    """Lends ``count`` locked, page-aligned uint8 CPU tensors of ``size`` bytes.

    With ``huge_pages`` (the ``huge_pages`` setting), buffers of 2 MiB and more
    ask for transparent huge pages: direct I/O from them needs far fewer
    scatter-gather segments (see :func:`_new_locked`). Buffers come from a per-process pool and go back to it when the block
    exits, so repeated saves and loads do not pay for allocating and locking
    again. Concurrent leases (other threads, nested blocks) get distinct
    buffers. Thread-safe. Contents are undefined.

    Do not keep references to the buffers after the block: another lease may
    reuse them.
    """
    if count < 0 or size < 0:
        raise ValueError(f"count and size must be >= 0, got count={count}, size={size}")
    buffers = _pool.acquire(int(count), int(size), bool(huge_pages))
    try:
        yield list(buffers)
    finally:
        _pool.release(buffers, int(size), bool(huge_pages))


def reserve_ring(total_bytes: int, buffer_size: int, buffer_count: int, huge_pages: bool = True) -> int:
    """Allocates and locks now the ring that moving ``total_bytes`` will lease (:func:`ring_shape`); returns its bytes.

    The buffers go to the pool, so the next save or load of that size takes them without waiting
    for allocation, locking and CUDA registration (docs/async.md says how long those take).
    """
    count, size = ring_shape(total_bytes, buffer_size, buffer_count)
    with lease_buffers(count, size, huge_pages):
        pass
    return count * size


def release_pooled_buffers() -> int:
    """Frees the pool's idle buffers (those not leased now); returns the bytes released."""
    return _pool.clear()


def pooled_bytes() -> int:
    """Bytes currently allocated by the pool (idle and leased)."""
    return _pool.allocated_bytes()


_MIN_RING_BUFFER = 1 << 20


def ring_shape(total_bytes: int, buffer_size: int, buffer_count: int) -> tuple[int, int]:
    """``(count, size)`` of the staging ring for moving ``total_bytes``, at most ``buffer_count`` x ``buffer_size``.

    The ring is sized to the checkpoint: a 3 MB save leases one 4 MiB buffer,
    not four 64 MiB ones (pinning 256 MiB for a tiny file was the old
    behaviour). Sizes below ``buffer_size`` are powers of two (at least 1 MiB),
    so the process-wide pool holds a handful of size classes, not one per
    checkpoint size; large checkpoints get the full ring, whatever their size
    (host memory does not grow with the checkpoint). Free idle buffers with
    :func:`release_pooled_buffers` (``fastpersist.release_buffers()``).
    """
    if total_bytes <= 0 or buffer_size <= 0 or buffer_count <= 0:
        return (min(1, max(buffer_count, 0)), max(min(buffer_size, _MIN_RING_BUFFER), 0))
    size = buffer_size
    if total_bytes < buffer_size:
        size = _MIN_RING_BUFFER
        while size < total_bytes:
            size *= 2
        size = min(size, buffer_size)
    count = min(buffer_count, -(-total_bytes // size))
    return (count, size)
