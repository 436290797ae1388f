"""``AioHandle``: DeepNVMe's ``aio_handle`` tensor API over the fastpersist engine.

A drop-in for code written against ``deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle``::

    from fastpersist.io.handle import AioHandle
    h = AioHandle(block_size=1 << 20, queue_depth=32)
    h.async_pwrite(tensor, "/nvme/x.bin")   # returns at once
    h.wait()                                # 1 completed op; raises the first error
    h.sync_pread(out, "/nvme/x.bin")

Differences from DeepNVMe (see docs/io-engine.md): a file written from offset 0
through a path is truncated to the written size (pass ``truncate=False`` to keep
bytes beyond it); short transfers are resubmitted and every completion is
checked; errors are ``OSError`` subclasses with ``errno`` and ``filename``.

Tensors: any contiguous CPU tensor is written/read in place (as bytes). CUDA
tensors go through a pinned bounce buffer from :mod:`fastpersist.io.memory`:
device-to-host copy then write; read then host-to-device copy in ``wait()``
(or before a synchronous call returns).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch

from fastpersist.io import engine as engine_module
from fastpersist.io import memory
from fastpersist.tensors import cast_to_byte_tensor, host_memoryview

__all__ = ["AioHandle"]

PathOrFd = Union[str, "os.PathLike[str]", int]

_BOUNCE_GRANULE = 1 << 20


@dataclass
class _Completion:
    """Work to finish in wait(): host-to-device copies, validation, returning bounce buffers."""

    actions: list[Callable[[], None]] = field(default_factory=list)


def _bounce_size(nbytes: int) -> int:
    # Round so that the pool sees few distinct sizes (it keeps one set per size).
    if nbytes <= 64 * _BOUNCE_GRANULE:
        return max(_BOUNCE_GRANULE, -(-nbytes // _BOUNCE_GRANULE) * _BOUNCE_GRANULE)
    granule = 64 * _BOUNCE_GRANULE
    return -(-nbytes // granule) * granule


class AioHandle:
    """Asynchronous tensor reads and writes (DeepNVMe ``aio_handle`` parity).

    Args:
        block_size: bytes per I/O request submitted to the engine.
        queue_depth: requests each lane keeps in flight.
        single_submit: one submission system call per request.
        overlap_events: reap completions while submitting.
        intra_op_parallelism: lanes (threads) splitting each operation.
        engine: ``auto``, ``io_uring`` or ``threads`` (keyword only).
        direct: use O_DIRECT where the filesystem allows it (keyword only).

    Raises:
        EngineUnavailableError: a named engine cannot start.

    Call order: any number of ``async_*`` calls, then ``wait()`` before touching
    the tensors again (reads) or reusing them (writes). Tensors are referenced
    by the handle until their I/O completes.
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
    ) -> None:
        self._handle = engine_module.IoHandle(
            block_size=block_size,
            queue_depth=queue_depth,
            single_submit=single_submit,
            overlap_events=overlap_events,
            intra_op_parallelism=intra_op_parallelism,
            engine=engine,
            direct=direct,
        )
        self._lock = threading.Lock()
        self._completion = _Completion()

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

    def get_engine(self) -> str:
        """The engine in use (``io_uring`` or ``threads``)."""
        return self._handle.engine

    def get_direct(self) -> bool:
        return self._handle.direct

    # ------------------------------------------------------------------ memory
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any = torch.uint8) -> torch.Tensor:
        """A page-locked CPU tensor of ``num_elem`` elements with the dtype of ``example_tensor``.

        ``example_tensor`` may be a tensor (DeepNVMe's signature) or a dtype.
        """
        dtype = example_tensor.dtype if isinstance(example_tensor, torch.Tensor) else example_tensor
        return memory.new_cpu_locked_tensor(num_elem, dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return memory.free_cpu_locked_tensor(tensor)

    # ------------------------------------------------------------------ writes
    def sync_pwrite(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0, **kwargs: Any) -> int:
        """Writes ``buffer`` and waits; returns the number of completed operations."""
        return self.pwrite(buffer, filename, False, False, file_offset, **kwargs)

    def async_pwrite(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0, **kwargs: Any) -> int:
        """Starts writing ``buffer``; returns 0 at once. Call :meth:`wait`."""
        return self.pwrite(buffer, filename, False, True, file_offset, **kwargs)

    def pwrite(
        self,
        buffer: torch.Tensor,
        filename: PathOrFd,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
        *,
        truncate: bool | None = None,
    ) -> int:
        """Writes the bytes of ``buffer`` to ``filename`` (a path or an open fd) at ``file_offset``.

        Args:
            buffer: a contiguous CPU or CUDA tensor.
            filename: path (created if missing) or a file descriptor open for writing.
            validate: read the bytes back after the write and compare (raises ``IOError`` on mismatch).
            async_op: return at once (0); :meth:`wait` completes it.
            file_offset: where the first byte goes.
            truncate: for a path written from offset 0 the file is truncated to
                the written size unless ``truncate=False``; a nonzero offset
                never truncates; descriptors are never truncated unless ``truncate=True``.

        Returns:
            0 when ``async_op``, else the number of operations :meth:`wait` completed.

        Raises:
            OSError subclasses (FileNotFoundError, PermissionError, ...) for open
            errors at once, and for I/O errors from :meth:`wait`.
        """
        data = cast_to_byte_tensor(buffer)
        nbytes = data.numel()
        is_path = not isinstance(filename, int)
        if truncate is None:
            truncate = is_path and file_offset == 0
        target = os.fspath(filename) if is_path else filename
        if data.device.type == "cpu":
            self._handle.submit_write(data.data_ptr(), nbytes, target, file_offset, keepalive=data, truncate=truncate)
        elif data.device.type == "cuda":
            bounce, give_back = self._lease_bounce(nbytes)
            try:
                bounce[:nbytes].copy_(data, non_blocking=False)
                self._handle.submit_write(
                    bounce.data_ptr(), nbytes, target, file_offset, keepalive=bounce, truncate=truncate
                )
            except BaseException:
                give_back()
                raise
            self._after_wait(give_back)
        else:
            raise ValueError(f"AioHandle supports CPU and CUDA tensors, got a tensor on {data.device}")
        if validate:
            self._after_wait(lambda: self._validate(data, target, file_offset))
        return 0 if async_op else self.wait()

    # ------------------------------------------------------------------ reads
    def sync_pread(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """Reads into ``buffer`` and waits; returns the number of completed operations."""
        return self.pread(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """Starts reading into ``buffer``; returns 0 at once. Call :meth:`wait`."""
        return self.pread(buffer, filename, False, True, file_offset)

    def pread(
        self,
        buffer: torch.Tensor,
        filename: PathOrFd,
        validate: bool = False,
        async_op: bool = False,
        file_offset: int = 0,
    ) -> int:
        """Fills ``buffer`` (all of its bytes) from ``filename`` at ``file_offset``.

        Raises:
            FileNotFoundError etc. at once; ``UnexpectedEndOfFileError``
            (an ``OSError`` and ``EOFError``) from :meth:`wait` when the file
            ends before ``buffer`` is full (the message names file, offset and size).
        """
        data = cast_to_byte_tensor(buffer)
        nbytes = data.numel()
        target = filename if isinstance(filename, int) else os.fspath(filename)
        if data.device.type == "cpu":
            self._handle.submit_read(data.data_ptr(), nbytes, target, file_offset, keepalive=data)
        elif data.device.type == "cuda":
            bounce, give_back = self._lease_bounce(nbytes)
            try:
                self._handle.submit_read(bounce.data_ptr(), nbytes, target, file_offset, keepalive=bounce)
            except BaseException:
                give_back()
                raise

            def copy_in() -> None:
                try:
                    data.copy_(bounce[:nbytes], non_blocking=False)
                finally:
                    give_back()

            # Runs in wait(): copies only after the read completed successfully;
            # on error the bounce buffer is just returned.
            self._after_wait(copy_in, on_error=give_back)
        else:
            raise ValueError(f"AioHandle supports CPU and CUDA tensors, got a tensor on {data.device}")
        if validate:
            self._after_wait(lambda: self._validate(data, target, file_offset))
        return 0 if async_op else self.wait()

    # ------------------------------------------------------------------ completion
    def wait(self) -> int:
        """Blocks until every submitted operation is done; returns how many completed.

        Raises the first I/O error (after everything in flight finished); the
        handle is usable afterwards.
        """
        with self._lock:
            completion, self._completion = self._completion, _Completion()
        try:
            completed = self._handle.wait()
        except BaseException:
            for action in completion.actions:
                on_error = getattr(action, "on_error", None)
                if on_error is not None:
                    on_error()
            raise
        for action in completion.actions:
            action()
        return completed

    def pending(self) -> int:
        """Operations submitted and not yet completed."""
        return self._handle.pending()

    def _after_wait(self, action: Callable[[], None], on_error: Callable[[], None] | None = None) -> None:
        wrapped = _Action(action, on_error)
        with self._lock:
            self._completion.actions.append(wrapped)

    def _lease_bounce(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        size = _bounce_size(nbytes)
        lease = memory.lease_buffers(1, size)
        (bounce,) = lease.__enter__()
        returned = False

        def give_back() -> None:
            nonlocal returned
            if not returned:
                returned = True
                lease.__exit__(None, None, None)

        return bounce, give_back

    def _validate(self, data: torch.Tensor, target: PathOrFd, file_offset: int) -> None:
        expected = data.cpu() if data.device.type != "cpu" else data
        nbytes = expected.numel()
        if isinstance(target, int):
            got = os.pread(target, nbytes, file_offset)
        else:
            with open(target, "rb") as f:
                f.seek(file_offset)
                got = f.read(nbytes)
        if got != bytes(host_memoryview(expected)):
            name = target if not isinstance(target, int) else f"<fd {target}>"
            raise IOError(f"validation failed: the {nbytes} bytes at offset {file_offset} of {name} differ from the tensor")

    def __repr__(self) -> str:
        return (
            f"AioHandle(block_size={self.get_block_size()}, queue_depth={self.get_queue_depth()}, "
            f"single_submit={self.get_single_submit()}, overlap_events={self.get_overlap_events()}, "
            f"intra_op_parallelism={self.get_intra_op_parallelism()}, engine={self.get_engine()!r}, "
            f"direct={self.get_direct()})"
        )


class _Action:
    """A completion action with an optional cleanup to run instead when wait() fails."""

    def __init__(self, action: Callable[[], None], on_error: Callable[[], None] | None) -> None:
        self._action = action
        self.on_error = on_error

    def __call__(self) -> None:
        self._action()
