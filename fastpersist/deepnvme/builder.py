"""DeepSpeed op-builder look-alikes, so DeepNVMe scripts run on fastpersist with only the import changed.

::

    # from deepspeed.ops.op_builder import AsyncIOBuilder, GDSBuilder, UtilsBuilder
    from fastpersist.deepnvme import AsyncIOBuilder, GDSBuilder, UtilsBuilder

    h = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=32)
    g = GDSBuilder().load().gds_handle(block_size=1 << 20, queue_depth=32)  # CUDA tensors
    h.sync_pwrite(tensor, "/nvme/x.pt")
    byte_view = UtilsBuilder().load().cast_to_byte_tensor(tensor)

``load()`` compiles nothing: the native core ships with fastpersist. The
handles are :class:`fastpersist.AioHandle` and :class:`fastpersist.GdsHandle`;
their deliberate differences from DeepNVMe are listed in docs/deepnvme-parity.md.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from fastpersist.deepnvme.gds import GdsHandle
from fastpersist.deepnvme.handle import AioHandle, is_pinned
from fastpersist.io import memory
from fastpersist.tensors import cast_to_byte_tensor

__all__ = [
    "AioHandle",
    "AsyncIOBuilder",
    "GDSBuilder",
    "GdsHandle",
    "PinHandle",
    "PinMemoryBuilder",
    "UtilsBuilder",
]


class _Builder:
    """What DeepSpeed's ``OpBuilder`` offers callers that only load an op."""

    NAME = ""
    BUILD_VAR = ""

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return f"fastpersist.deepnvme.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Always True: fastpersist's engine falls back to a thread pool where io_uring is unavailable."""
        return True

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        return self._module()

    def jit_load(self, verbose: bool = True) -> types.SimpleNamespace:
        return self._module()

    def _module(self) -> types.SimpleNamespace:
        raise NotImplementedError


def _aio_transfer(
    write: bool,
    buffer: torch.Tensor,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    handle = AioHandle(block_size, queue_depth, single_submit, overlap_events)
    if write:
        handle.pwrite(buffer, filename, validate, False)
    else:
        handle.pread(buffer, filename, validate, False)
    return 0


def aio_read(
    buffer: torch.Tensor,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """DeepNVMe's one-shot ``aio_read``: reads ``filename`` into ``buffer``; 0 on success, raises on error."""
    return _aio_transfer(
        False,
        buffer,
        filename,
        block_size,
        queue_depth,
        single_submit,
        overlap_events,
        validate,
    )


def aio_write(
    buffer: torch.Tensor,
    filename: str,
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """DeepNVMe's one-shot ``aio_write``: writes ``buffer`` to ``filename``; 0 on success, raises on error."""
    return _aio_transfer(
        True,
        buffer,
        filename,
        block_size,
        queue_depth,
        single_submit,
        overlap_events,
        validate,
    )


def deepspeed_memcpy(dest: torch.Tensor, src: torch.Tensor) -> int:
    """DeepNVMe's ``deepspeed_memcpy``: copies ``src`` into ``dest`` (same number of bytes); returns 0."""
    dest_bytes, src_bytes = cast_to_byte_tensor(dest), cast_to_byte_tensor(src)
    if dest_bytes.numel() != src_bytes.numel():
        raise ValueError(f"deepspeed_memcpy: dest has {dest_bytes.numel()} bytes, src {src_bytes.numel()}")
    dest_bytes.copy_(src_bytes)
    return 0


class AsyncIOBuilder(_Builder):
    """``AsyncIOBuilder().load().aio_handle(...)`` gives a :class:`fastpersist.AioHandle`."""

    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"

    def _module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            aio_handle=AioHandle,
            aio_read=aio_read,
            aio_write=aio_write,
            deepspeed_memcpy=deepspeed_memcpy,
        )


class GDSBuilder(_Builder):
    """``GDSBuilder().load().gds_handle(...)`` gives a :class:`fastpersist.GdsHandle` (CUDA tensors).

    ``is_compatible()`` is True where torch sees a CUDA device: the handle then
    works with or without cuFile (its ``bounce`` path needs no cuFile).
    Loading never loads cuFile; making a handle may (``gds_path`` setting).
    """

    NAME = "gds"
    BUILD_VAR = "DS_BUILD_GDS"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether torch sees a CUDA device (``GdsHandle`` raises ``CudaUnavailableError`` without one)."""
        try:
            return bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001 - a broken CUDA install means "not compatible"
            return False

    def _module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(gds_handle=GdsHandle)


class UtilsBuilder(_Builder):
    """``UtilsBuilder().load().cast_to_byte_tensor(t_or_list)``: zero-copy uint8 views."""

    NAME = "utils"
    BUILD_VAR = "DS_BUILD_UTILS"

    def _module(self) -> types.SimpleNamespace:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        return types.SimpleNamespace(
            cast_to_byte_tensor=cast_to_byte_tensor,
            flatten=_flatten_dense_tensors,
            unflatten=_unflatten_dense_tensors,
        )


class PinHandle:
    """DeepSpeed's ``pin_handle``: locked CPU tensors from the process-wide registry that AioHandle shares."""

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any = None) -> torch.Tensor:
        dtype = example_tensor.dtype if isinstance(example_tensor, torch.Tensor) else (example_tensor or torch.uint8)
        return memory.new_cpu_locked_tensor(num_elem, dtype)

    def free_cpu_locked_tensor(self, locked_tensor: torch.Tensor) -> bool:
        return memory.free_cpu_locked_tensor(locked_tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        return is_pinned(buffer)


class PinMemoryBuilder(_Builder):
    """``PinMemoryBuilder().load().pin_handle()`` gives a :class:`PinHandle`."""

    NAME = "pin_memory"
    BUILD_VAR = "DS_BUILD_PIN_MEMORY"

    def _module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(pin_handle=PinHandle)
