"""``AioHandle``: DeepNVMe's ``aio_handle`` tensor API over the fastpersist engine.

A drop-in for code written against ``deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle``
(``fastpersist.deepnvme.AsyncIOBuilder`` builds it the same way)::

    from fastpersist.deepnvme.handle import AioHandle
    h = AioHandle(block_size=1 << 20, queue_depth=32)
    h.async_pwrite(tensor, "/nvme/x.bin")   # returns 0 at once
    h.wait()                                # 1 completed op; raises the first error
    h.sync_pread(out, "/nvme/x.bin")        # 1

Deliberate differences from DeepNVMe are listed in docs/deepnvme-parity.md.
The main ones: errors raise ``OSError`` subclasses (with ``errno`` and
``filename``) or ``ValueError``/``TypeError`` where DeepNVMe returns -1, prints
or aborts; a blocking call returns only its own count (1), whatever other
threads have in flight on the handle; writes never truncate unless
``truncate=True``.

Tensors: contiguous CPU tensors (locked, torch-pinned or plain) are written and
read in place. CUDA tensors are copied through a small ring of pinned host
chunks (default 4 x 8 MiB, from :mod:`fastpersist.io.memory`) on a side
stream, overlapping the device copies with the file I/O; a tensor of any size
pins at most the ring.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Union

import torch

from fastpersist.io import engine as engine_module
from fastpersist.io import memory
from fastpersist.io.ring import Ring, SharedHandle
from fastpersist.tensors import cast_to_byte_tensor, host_memoryview

__all__ = ["AioHandle", "DeepNVMeCalls", "is_pinned", "check_file_bytes"]

PathOrFd = Union[str, "os.PathLike[str]", int]

_logger = logging.getLogger("fastpersist.deepnvme.handle")

#: DeepNVMe's O_DIRECT alignment unit; get_alignment() is this times intra_op_parallelism.
O_DIRECT_ALIGNMENT = 4096
_DEFAULT_RING_CHUNK = 8 << 20
_DEFAULT_RING_SLOTS = 4
_MIN_RING_CHUNK = 64 << 10

_logged_block_rounding = False
_log_lock = threading.Lock()


def _log_block_rounding_once(block_size: int) -> None:
    global _logged_block_rounding
    with _log_lock:
        if _logged_block_rounding:
            return
        _logged_block_rounding = True
    _logger.info(
        "AioHandle block_size=%d is not a multiple of the 4096-byte O_DIRECT alignment: direct chunks are "
        "rounded to the file's alignment and unaligned heads/tails go through the page cache (logged once)",
        block_size,
    )


def _async_flag(async_op: bool | None, kwargs: dict[str, Any], method: str) -> bool:
    """Resolves DeepNVMe's ``async`` keyword (a Python keyword, so it comes through ``**kwargs``)."""
    unknown = sorted(set(kwargs) - {"async"})
    if unknown:
        raise TypeError(f"{method}() got unexpected keyword argument(s): {', '.join(unknown)}")
    if "async" in kwargs:
        if async_op is not None and bool(async_op) != bool(kwargs["async"]):
            raise TypeError(f"{method}() got both async_op={async_op} and async={kwargs['async']}; pass one")
        return bool(kwargs["async"])
    return bool(async_op)


def _resolve_target(filename: Any, fd: int | None, method: str) -> PathOrFd:
    if fd is not None:
        if filename is not None:
            raise TypeError(f"{method}() takes either filename or fd, not both")
        if not isinstance(fd, int) or isinstance(fd, bool):
            raise TypeError(f"{method}(): fd must be an int file descriptor, got {type(fd).__name__}")
        return fd
    if filename is None:
        raise TypeError(f"{method}() needs filename (a path) or fd (an open file descriptor)")
    if isinstance(filename, bool):
        raise TypeError(f"{method}(): filename must be a path or an int file descriptor, got a bool")
    return filename if isinstance(filename, int) else os.fspath(filename)


def is_pinned(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is directly usable for DMA: torch-pinned, or inside a locked allocation.

    Slices and views of tensors made by ``new_cpu_locked_tensor`` count as
    pinned; the registry is process-wide, so every handle agrees.
    """
    if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
        return False
    if memory.is_managed_locked_memory(buffer):
        return True
    try:
        return bool(buffer.is_pinned())
    except RuntimeError:  # CPU-only torch builds may raise instead of answering
        return False


def check_file_bytes(data: torch.Tensor, target: PathOrFd, file_offset: int) -> None:
    """DeepNVMe's ``validate``: the file's bytes at ``file_offset`` equal ``data``'s (a contiguous uint8 view).

    Reads through a fresh read-only description, so a caller's descriptor that
    is write-only or O_DIRECT works too.

    Raises:
        OSError: the bytes differ (the message names file, offset and size), or the file cannot be read.
    """
    expected = data.cpu() if data.device.type != "cpu" else data
    nbytes = expected.numel()
    name = target if isinstance(target, int) else os.fspath(target)
    with open(f"/proc/self/fd/{target}" if isinstance(target, int) else name, "rb") as f:
        f.seek(file_offset)
        got = f.read(nbytes)
    if got != bytes(host_memoryview(expected)):
        shown = f"<fd {target}>" if isinstance(target, int) else name
        raise OSError(
            f"validation failed: the {nbytes} bytes at offset {file_offset} of {shown} differ from the tensor"
        )


def _ring_chunk(nbytes: int, limit: int) -> int:
    # Few distinct sizes so the buffer pool reuses them: powers of two from 64 KiB to the limit.
    size = _MIN_RING_CHUNK
    while size < nbytes and size < limit:
        size *= 2
    return min(size, limit)


class DeepNVMeCalls:
    """DeepNVMe's read and write calls, one shape for both handles (``AioHandle``, ``GdsHandle``).

    Subclasses provide ``_transfer(write, buffer, target, validate, async_op,
    file_offset, truncate)``, which moves the bytes (or queues them when
    ``async_op``) and returns 0 when asynchronous, else 1, and ``wait()``.
    """

    def _transfer(
        self,
        write: bool,
        buffer: torch.Tensor,
        target: PathOrFd,
        validate: bool,
        async_op: bool,
        file_offset: int,
        truncate: bool,
    ) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ writes
    def sync_pwrite(
        self,
        buffer: torch.Tensor,
        filename: Any = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        truncate: bool = False,
    ) -> int:
        """Writes ``buffer`` and waits; returns 1 (this call's operation)."""
        return self.pwrite(buffer, filename, False, False, file_offset, fd=fd, truncate=truncate)

    def async_pwrite(
        self,
        buffer: torch.Tensor,
        filename: Any = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        truncate: bool = False,
    ) -> int:
        """Starts writing ``buffer`` to a path or a descriptor (``fd=`` or positional int); returns 0. Call :meth:`wait`."""
        return self.pwrite(buffer, filename, False, True, file_offset, fd=fd, truncate=truncate)

    def pwrite(
        self,
        buffer: torch.Tensor,
        filename: Any = None,
        validate: bool = False,
        async_op: bool | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        truncate: bool = False,
        **kwargs: Any,
    ) -> int:
        """Writes the bytes of ``buffer`` to ``filename`` (a path or an open fd) at ``file_offset``.

        Args:
            buffer: a contiguous CPU or CUDA tensor.
            filename: path (created if missing) or a file descriptor open for writing.
            validate: read the bytes back after the write and compare (raises ``IOError`` on mismatch).
            async_op: return at once (0); :meth:`wait` completes it. DeepNVMe's
                keyword ``async`` is accepted too (``pwrite(..., **{"async": True})``).
            file_offset: where the first byte goes.
            fd: an open descriptor instead of ``filename`` (DeepNVMe's keyword).
            truncate: after the write, set the file size to ``file_offset + nbytes``.
                Off by default: like DeepNVMe, a write never shortens the file.

        Returns:
            0 when asynchronous, else 1 (this call's operation only).

        Raises:
            TypeError: ``buffer`` is not a tensor on the CPU or (where the
                handle takes them) a CUDA device.
            ValueError: ``buffer`` is not contiguous; ``file_offset`` < 0.
            OSError subclasses (FileNotFoundError, PermissionError, ...) for open
            errors at once, and for I/O errors from :meth:`wait` (or from this
            call when blocking); ``GdsHandle`` made with ``path="cufile"``:
            ``CufileError`` for cuFile statuses.
        """
        async_op = _async_flag(async_op, kwargs, "pwrite")
        target = _resolve_target(filename, fd, "pwrite")
        return self._transfer(True, buffer, target, validate, async_op, file_offset, truncate)

    def write(
        self,
        buffer: torch.Tensor,
        filename: Any = None,
        validate: bool = False,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        truncate: bool = False,
    ) -> int:
        """Blocking write (DeepNVMe's non-parallel ``write``); returns 0 like DeepNVMe, raises on error."""
        target = _resolve_target(filename, fd, "write")
        self._transfer(True, buffer, target, validate, False, file_offset, truncate)
        return 0

    # ------------------------------------------------------------------ reads
    def sync_pread(
        self,
        buffer: torch.Tensor,
        filename: Any = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Reads into ``buffer`` and waits; returns 1 (this call's operation)."""
        return self.pread(buffer, filename, False, False, file_offset, fd=fd)

    def async_pread(
        self,
        buffer: torch.Tensor,
        filename: Any = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Starts reading into ``buffer``; returns 0 at once. Call :meth:`wait`."""
        return self.pread(buffer, filename, False, True, file_offset, fd=fd)

    def pread(
        self,
        buffer: torch.Tensor,
        filename: Any = None,
        validate: bool = False,
        async_op: bool | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        **kwargs: Any,
    ) -> int:
        """Fills ``buffer`` (all of its bytes) from ``filename`` at ``file_offset``.

        ``async`` (through ``**kwargs``) and ``fd=`` work as in :meth:`pwrite`.

        Raises:
            FileNotFoundError etc. at once; ``UnexpectedEndOfFileError``
            (an ``OSError`` and ``EOFError``) when the file ends before
            ``buffer`` is full (the message names file, offset and size).
        """
        async_op = _async_flag(async_op, kwargs, "pread")
        target = _resolve_target(filename, fd, "pread")
        return self._transfer(False, buffer, target, validate, async_op, file_offset, False)

    def read(
        self,
        buffer: torch.Tensor,
        filename: Any = None,
        validate: bool = False,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Blocking read (DeepNVMe's non-parallel ``read``); returns 0 like DeepNVMe, raises on error."""
        target = _resolve_target(filename, fd, "read")
        self._transfer(False, buffer, target, validate, False, file_offset, False)
        return 0


class AioHandle(DeepNVMeCalls):
    """Asynchronous tensor reads and writes (DeepNVMe ``aio_handle`` parity).

    The defaults of the first five arguments are DeepNVMe's own
    (``aio_handle()``'s): scripts written for it get the same handle. They are
    the API's contract, not fastpersist's I/O defaults (those are
    :class:`fastpersist.config.Settings`, which saves and loads use).

    Args:
        block_size: bytes per I/O request; any multiple of 512 up to 1 GiB (as
            DeepNVMe). Direct (O_DIRECT) chunks are rounded to the file's
            alignment, logged once.
        queue_depth: requests each lane keeps in flight, 1..32768 (lanes allocate
            at most 4096 slots each).
        single_submit: one submission system call per request.
        overlap_events: reap completions while submitting.
        intra_op_parallelism: lanes (threads) splitting each operation.
        engine: ``auto``, ``io_uring`` or ``threads`` (keyword only).
        direct: use O_DIRECT where the filesystem allows it (keyword only).
        cuda_chunk_bytes: size of each pinned ring chunk for CUDA tensors.
        cuda_chunks: number of ring chunks (copies and file I/O overlap across them).

    Raises:
        ValueError: invalid sizes (DeepNVMe would abort or misbehave).
        EngineUnavailableError: a named engine cannot start.

    Call order: any number of ``async_*`` calls, then ``wait()`` before touching
    the tensors again (reads) or reusing them (writes). Tensors are referenced
    by the handle until their I/O completes. Blocking calls (``sync_*``,
    ``pread``/``pwrite`` without ``async``, ``read``, ``write``) may run from
    several threads at once on one handle; each waits for and reports only its
    own operation.
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        *,
        engine: str = "auto",
        direct: bool = True,
        cuda_chunk_bytes: int = _DEFAULT_RING_CHUNK,
        cuda_chunks: int = _DEFAULT_RING_SLOTS,
    ) -> None:
        if cuda_chunk_bytes < 4096 or cuda_chunk_bytes % 4096:
            raise ValueError(f"cuda_chunk_bytes must be a positive multiple of 4096, got {cuda_chunk_bytes}")
        if cuda_chunks < 1:
            raise ValueError(f"cuda_chunks must be >= 1, got {cuda_chunks}")
        try:
            self._handle = engine_module.IoHandle(
                block_size=block_size,
                queue_depth=queue_depth,
                single_submit=single_submit,
                overlap_events=overlap_events,
                intra_op_parallelism=intra_op_parallelism,
                engine=engine,
                direct=direct,
            )
        except (TypeError, OverflowError) as e:
            raise ValueError(f"invalid AioHandle settings: {e}") from None
        if direct and block_size % O_DIRECT_ALIGNMENT:
            _log_block_rounding_once(block_size)
        self._ring_chunk = cuda_chunk_bytes
        self._ring_slots = cuda_chunks
        self._lock = threading.Lock()
        self._actions: list[Callable[[], None]] = []
        self._futures: list[concurrent.futures.Future] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_pid = 0
        self._streams: dict[int, Any] = {}

    # ------------------------------------------------------------------ getters
    def get_block_size(self) -> int:
        return self._handle.block_size

    def get_queue_depth(self) -> int:
        return self._handle.queue_depth

    def get_single_submit(self) -> bool:
        return self._handle.single_submit

    def get_overlap_events(self) -> bool:
        return self._handle.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._handle.intra_op_parallelism

    def get_thread_count(self) -> int:
        """Alias of :meth:`get_intra_op_parallelism` (older DeepNVMe name)."""
        return self._handle.intra_op_parallelism

    def get_alignment(self) -> int:
        """Bytes that buffer sizes and file offsets should be multiples of for fully direct I/O.

        DeepNVMe's value: ``intra_op_parallelism * 4096`` (``FastFileWriter``
        sizes its buffers with it). fastpersist itself accepts any size and
        offset: unaligned heads and tails go through the page cache.
        """
        return self._handle.intra_op_parallelism * O_DIRECT_ALIGNMENT

    def get_engine(self) -> str:
        """The engine in use (``io_uring`` or ``threads``)."""
        return self._handle.engine

    def get_direct(self) -> bool:
        return self._handle.direct

    # ------------------------------------------------------------------ memory
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any = None, **kwargs: Any) -> torch.Tensor:
        """A page-locked CPU tensor of ``num_elem`` elements with the dtype of ``example_tensor``.

        ``example_tensor`` may be a tensor (DeepNVMe's signature) or a dtype;
        DeepNVMe's misspelled keyword ``example_tenosr`` is accepted too.
        """
        if "example_tenosr" in kwargs:
            if example_tensor is not None:
                raise TypeError("new_cpu_locked_tensor() got both example_tensor and example_tenosr")
            example_tensor = kwargs.pop("example_tenosr")
        if kwargs:
            raise TypeError(f"new_cpu_locked_tensor() got unexpected keyword argument(s): {', '.join(sorted(kwargs))}")
        if example_tensor is None:
            dtype = torch.uint8
        elif isinstance(example_tensor, torch.Tensor):
            dtype = example_tensor.dtype
        elif isinstance(example_tensor, torch.dtype):
            dtype = example_tensor
        else:
            raise TypeError(f"example_tensor must be a tensor or a torch.dtype, got {type(example_tensor).__name__}")
        return memory.new_cpu_locked_tensor(num_elem, dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Forgets a tensor made by :meth:`new_cpu_locked_tensor`; True if it was one."""
        return memory.free_cpu_locked_tensor(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is directly usable for DMA: torch-pinned, or inside a locked allocation.

        Slices and views of tensors made by :meth:`new_cpu_locked_tensor` (by any
        handle: the registry is process-wide) count as pinned.
        """
        return is_pinned(buffer)

    # ------------------------------------------------------------------ completion
    def wait(self) -> int:
        """Blocks until every asynchronous operation of the handle is done; returns how many completed.

        Blocking calls running in other threads are not counted or waited for.
        Raises the first error (after everything in flight finished); the
        handle is usable afterwards. With nothing in flight it returns 0.
        """
        with self._lock:
            actions, self._actions = self._actions, []
            futures, self._futures = self._futures, []
        error: BaseException | None = None
        completed = 0
        try:
            completed = self._handle.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised below after the CUDA jobs finished
            error = e
        for future in futures:
            try:
                future.result()
                completed += 1
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is None:
            for action in actions:
                try:
                    action()
                except BaseException as e:  # noqa: BLE001
                    error = error or e
        if error is not None:
            raise error
        return completed

    def pending(self) -> int:
        """Asynchronous operations submitted and not yet completed."""
        with self._lock:
            cuda_jobs = sum(1 for f in self._futures if not f.done())
        return self._handle.pending() + cuda_jobs

    # ------------------------------------------------------------------ internals
    def _transfer(
        self,
        write: bool,
        buffer: torch.Tensor,
        target: PathOrFd,
        validate: bool,
        async_op: bool,
        file_offset: int,
        truncate: bool,
    ) -> int:
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if file_offset < 0:
            raise ValueError(f"file_offset must be >= 0, got {file_offset}")
        data = cast_to_byte_tensor(buffer)
        device = data.device.type
        if device == "cpu":
            return self._cpu_transfer(write, data, target, validate, async_op, file_offset, truncate)
        if device == "cuda":
            return self._cuda_transfer(write, data, target, validate, async_op, file_offset, truncate)
        raise ValueError(f"AioHandle supports CPU and CUDA tensors, got a tensor on {data.device}")

    def _submit(
        self,
        write: bool,
        ptr: int,
        nbytes: int,
        target: Any,
        offset: int,
        keepalive: Any,
        truncate: bool,
        detached: bool,
    ) -> Any:
        if write:
            return self._handle.submit_write(
                ptr,
                nbytes,
                target,
                offset,
                keepalive=keepalive,
                truncate=truncate,
                detached=detached,
            )
        return self._handle.submit_read(ptr, nbytes, target, offset, keepalive=keepalive, detached=detached)

    def _cpu_transfer(
        self,
        write: bool,
        data: torch.Tensor,
        target: PathOrFd,
        validate: bool,
        async_op: bool,
        file_offset: int,
        truncate: bool,
    ) -> int:
        nbytes = data.numel()
        if async_op:
            # Submit and register the completion work together, so that a wait()
            # in another thread never sees the request without its validation.
            with self._lock:
                self._submit(
                    write,
                    data.data_ptr(),
                    nbytes,
                    target,
                    file_offset,
                    data,
                    truncate,
                    False,
                )
                if validate:
                    self._actions.append(lambda: self._validate(data, target, file_offset))
            return 0
        request = self._submit(write, data.data_ptr(), nbytes, target, file_offset, data, truncate, True)
        self._handle.wait_request(request)
        if validate:
            self._validate(data, target, file_offset)
        return 1

    def _cuda_transfer(
        self,
        write: bool,
        data: torch.Tensor,
        target: PathOrFd,
        validate: bool,
        async_op: bool,
        file_offset: int,
        truncate: bool,
    ) -> int:
        # Open a path once, here, so open errors raise at the call (as for CPU tensors).
        if isinstance(target, int):
            file, close = target, None
        else:
            file = engine_module.File(target, "w" if write else "r", direct=self._handle.direct)
            close = file.close
        # Everything the caller queued on its current stream so far (the kernels
        # producing `data`, or still reading it) comes before our copies, even
        # when the job runs later in the worker thread.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(data.device))

        def job() -> None:
            try:
                if write:
                    self._ring_write(data, file, file_offset, truncate, ready)
                else:
                    self._ring_read(data, file, file_offset, ready)
            finally:
                if close is not None:
                    close()
            if validate:
                self._validate(data, target, file_offset)

        if not async_op:
            job()
            return 1
        with self._lock:
            self._futures.append(self._worker().submit(job))
        return 0

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        # Called with self._lock held. A fork leaves the parent's worker thread behind: start a new one.
        if self._executor is None or self._executor_pid != os.getpid():
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastpersist-aio")
            self._executor_pid = os.getpid()
        return self._executor

    def _side_stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def _ring_geometry(self, nbytes: int) -> tuple[int, int, list[tuple[int, int]]]:
        chunk = _ring_chunk(nbytes, self._ring_chunk)
        pieces = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
        return chunk, min(self._ring_slots, len(pieces)), pieces

    def _ring_write(
        self,
        data: torch.Tensor,
        file: Any,
        file_offset: int,
        truncate: bool,
        ready: Any,
    ) -> None:
        nbytes = data.numel()
        if nbytes == 0:
            request = self._submit(True, 0, 0, file, file_offset, None, truncate, True)
            self._handle.wait_request(request)
            return
        stream = self._side_stream(data.device)
        chunk, slots, pieces = self._ring_geometry(nbytes)
        # The caller's kernels that produce `data` run on its current stream.
        stream.wait_event(ready)
        with self._ring(slots, chunk, data.device, stream) as staging:
            for k, (off, length) in enumerate(pieces):
                slot = staging.slot(k)
                slot.wait_io()  # its previous chunk is written: refill it
                with torch.cuda.stream(stream):
                    slot.buffer[:length].copy_(data[off : off + length], non_blocking=True)
                slot.track_copies(stream)
                slot.wait_copies()
                last = off + length == nbytes
                slot.submit_write(length, file, file_offset + off, truncate=truncate and last)
            staging.wait_streams()

    def _ring_read(self, data: torch.Tensor, file: Any, file_offset: int, ready: Any) -> None:
        nbytes = data.numel()
        if nbytes == 0:
            return
        stream = self._side_stream(data.device)
        chunk, slots, pieces = self._ring_geometry(nbytes)
        # Do not overwrite `data` while the caller's queued kernels may still read it.
        stream.wait_event(ready)
        with self._ring(slots, chunk, data.device, stream) as staging:
            for slot, (off, length) in zip(staging.slots, pieces):
                slot.submit_read(length, file, file_offset + off)
            for k, (off, length) in enumerate(pieces):
                slot = staging.slot(k)
                slot.wait_io()
                with torch.cuda.stream(stream):
                    data[off : off + length].copy_(slot.buffer[:length], non_blocking=True)
                slot.track_copies(stream)
                following = k + slots
                if following < len(pieces):
                    slot.wait_copies()  # the chunk left the ring slot; refill it
                    next_off, next_length = pieces[following]
                    slot.submit_read(next_length, file, file_offset + next_off)
            staging.wait_streams()  # `data` is complete for every stream when we return

    def _ring(self, slots: int, chunk: int, device: torch.device, stream: Any) -> Ring:
        """A ring of ``slots`` pinned chunks whose requests go to this handle, detached: one blocking call
        waits for its own requests only, whatever other threads have in flight on the handle."""
        return Ring([SharedHandle(self._handle) for _ in range(slots)], chunk, streams={device: stream})

    def _validate(self, data: torch.Tensor, target: PathOrFd, file_offset: int) -> None:
        check_file_bytes(data, target, file_offset)

    def __repr__(self) -> str:
        return (
            f"AioHandle(block_size={self.get_block_size()}, queue_depth={self.get_queue_depth()}, "
            f"single_submit={self.get_single_submit()}, overlap_events={self.get_overlap_events()}, "
            f"intra_op_parallelism={self.get_intra_op_parallelism()}, engine={self.get_engine()!r}, "
            f"direct={self.get_direct()})"
        )
