"""Zero-copy byte views of tensors and storages (pure PyTorch), and torch's serialization settings.

Both the serializer (``format``) and the I/O layer (``io``) need to see a
tensor's memory as bytes without copying it; this module is the one place
that knows how. It also imports ``torch.utils.serialization.config`` once, at
import time: an import inside a save or load would hold that module's import
lock, which a child forked meanwhile by another thread would never see
released.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import torch

try:
    from torch.utils.serialization import config as torch_serialization_config
except ImportError:  # a torch without these settings (set_crc32_options and the like)
    torch_serialization_config = None

__all__ = ["cast_to_byte_tensor", "storage_byte_view", "host_memoryview", "named_tensors", "torch_serialization_config"]


def storage_byte_view(storage: torch.UntypedStorage | torch.TypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over every byte of ``storage``, on its device, sharing its memory.

    The view keeps the storage alive. Works for every device and dtype
    (including the meta device, where it has no data).
    """
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    if not isinstance(storage, torch.UntypedStorage):
        raise TypeError(f"expected a torch storage, got {type(storage).__name__}")
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    view.set_(storage, 0, (storage.nbytes(),), (1,))
    return view


def cast_to_byte_tensor(tensor: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """A zero-copy 1-D uint8 view of the bytes of a contiguous tensor.

    Mirrors DeepNVMe's ``cast_to_byte_tensor``. The result shares memory with
    ``tensor`` (writes through it change ``tensor``) and keeps it alive. Given a
    list (or tuple) of tensors, returns the list of their byte views, as
    DeepNVMe's overload does.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.
        ValueError: ``tensor`` is not contiguous (its bytes are not one range);
            use ``storage_byte_view(tensor.untyped_storage())`` for the whole
            storage, or ``tensor.contiguous()`` for a copy.
    """
    if isinstance(tensor, (list, tuple)):
        return [cast_to_byte_tensor(t) for t in tensor]
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"cast_to_byte_tensor expects a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(
            "cast_to_byte_tensor needs a contiguous tensor (its bytes must form one range); "
            "call .contiguous() first, or use storage_byte_view() for the whole storage"
        )
    nbytes = tensor.numel() * tensor.element_size()
    start = tensor.storage_offset() * tensor.element_size()
    return storage_byte_view(tensor.untyped_storage())[start : start + nbytes]


def host_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over the bytes of a contiguous CPU tensor (no numpy needed).

    The memoryview (and every slice of it) keeps ``tensor`` alive, so a view of
    a temporary (``host_memoryview(t.cpu())``) is safe: the ctypes array it
    exports holds the tensor.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("host_memoryview needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array.tensor = tensor  # from_address does not own the memory: the exporter keeps its owner
    return memoryview(array).cast("B")


def named_tensors(obj: Any, limit: int = 100_000) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key path, tensor)`` for each tensor in ``obj``, depth first, each object once.

    Walks dicts, lists, tuples and objects' ``__dict__`` (at most ``limit``
    items), and names each tensor by its path: ``optimizer.state.0.exp_avg``,
    ``weights[2]``; the object itself is ``(the object)``. The one walker of
    every message that names tensors (divergent replicas, tensors modified
    during a save) and of the collective save's value comparison.
    """
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", obj)]
    visited = 0
    while stack and visited < limit:
        path, item = stack.pop()
        visited += 1
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            yield path or "(the object)", item
            continue
        try:
            if isinstance(item, dict):
                children = [(f"{path}.{k}" if path else str(k), v) for k, v in item.items()]
            elif isinstance(item, (list, tuple)):
                children = [(f"{path}[{i}]", v) for i, v in enumerate(item)]
            elif hasattr(item, "__dict__") and not isinstance(item, type):
                children = [(f"{path}.{k}" if path else k, v) for k, v in vars(item).items()]
            else:
                continue
        except Exception:  # noqa: BLE001 - a name is a courtesy; an odd object must not fail the caller
            continue
        stack.extend(reversed(children))
