"""The front door's choice of file format: ``torch`` (torch.save zip) or ``safetensors``.

``fastpersist.save(obj, path)`` writes safetensors when ``format="safetensors"``
is passed or the path ends in ``.safetensors`` (``format="torch"`` forces a
torch checkpoint); ``fastpersist.load(path)`` recognises a safetensors file by
its first bytes (an 8-byte little-endian header length, then ``{``), whatever
its name. ``async_save`` follows the same rule.

What is written:

* a dict of ``str -> tensor`` (a state dict) whose tensors do not share memory
  becomes a plain safetensors file: every tool reads it;
* anything else (nested dicts, lists, tuples, numbers, strings, None, the same
  tensor under two names, integer keys -- a Lightning or optimizer checkpoint)
  is flattened: tensors are stored under dotted names (``optimizer.state.0.exp_avg``)
  and the structure goes, as JSON, into the header's ``__metadata__`` under
  ``fastpersist.structure``. Any safetensors reader gets the flat tensors;
  ``fastpersist.load`` rebuilds the original object. Other objects (user
  classes, ``torch.dtype``...) are refused with :class:`UnsupportedObjectError`:
  use the torch format for those.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any

import torch

from fastpersist.errors import CorruptCheckpointError, UnsupportedObjectError
from fastpersist.format.safetensors import looks_like_safetensors
from fastpersist.io import targets

__all__ = [
    "FORMATS",
    "STRUCTURE_KEY",
    "async_save_safetensors",
    "flatten",
    "is_safetensors_file",
    "load_safetensors",
    "save_safetensors",
    "unflatten",
    "wants_safetensors",
]

FORMATS = ("torch", "safetensors")
STRUCTURE_KEY = "fastpersist.structure"
_EXTENSIONS = (".safetensors",)


def wants_safetensors(f: Any, format: str | None) -> bool:  # noqa: A002 (torch-style keyword)
    """Whether a save to ``f`` with ``format`` writes safetensors (explicit choice, else the extension)."""
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}")
        return format == "safetensors"
    return isinstance(f, (str, os.PathLike)) and os.fspath(f).lower().endswith(_EXTENSIONS)


def is_safetensors_file(path: str) -> bool:
    """Whether the file at ``path`` starts like a safetensors file."""
    with open(path, "rb") as handle:
        return looks_like_safetensors(handle.read(9))


def is_torch_zip_file(path: str) -> bool:
    """Whether the file at ``path`` starts like a zip archive (every torch.save file since torch 1.6)."""
    with open(path, "rb") as handle:
        return handle.read(4) == b"PK\x03\x04"


# ----------------------------------------------------------------------------- flattening


def _plain_state_dict(obj: Any) -> bool:
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        return False
    from fastpersist.api.safetensors import find_shared_tensors

    return all(len(group) < 2 for group in find_shared_tensors(obj))


def _tensor_identity(tensor: torch.Tensor) -> tuple:
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        pointer = id(tensor)
    return (tensor.device, pointer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def flatten(obj: Any) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """``(tensors, metadata)`` to store ``obj`` in a safetensors file.

    A plain state dict is returned as is (``metadata`` None). Otherwise
    tensors get dotted names and the structure is encoded in ``metadata``;
    the same tensor (same memory, shape and strides) reached twice is stored
    once.

    Raises:
        UnsupportedObjectError: a value that is neither a tensor nor JSON-like, naming where it is.
    """
    if _plain_state_dict(obj):
        return dict(obj), None
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}

    def name_for(path: list[str]) -> str:
        base = ".".join(path) or "tensor"
        name, suffix = base, 1
        while name in tensors or name == "__metadata__":
            name, suffix = f"{base}#{suffix}", suffix + 1
        return name

    def encode(value: Any, path: list[str]) -> Any:
        if isinstance(value, torch.Tensor):
            identity = _tensor_identity(value)
            if identity in seen:
                return {"tensor": seen[identity]}
            name = name_for(path)
            tensors[name] = value
            seen[identity] = name
            return {"tensor": name}
        if value is None or isinstance(value, (bool, str)):
            return {"value": value}
        if isinstance(value, int):
            return {"value": int(value)}
        if isinstance(value, float):
            return {"float": repr(value)} if not math.isfinite(value) else {"value": value}
        if isinstance(value, dict):
            kind = "odict" if isinstance(value, collections.OrderedDict) else "dict"
            items = []
            for key, item in value.items():
                if not (key is None or isinstance(key, (str, int, float, bool))):
                    raise _refuse(path + [repr(key)], key, "a dict key")
                items.append([encode(key, path + ["<key>"]), encode(item, path + [str(key)])])
            return {kind: items}
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple, torch.Size):
            kind = "list" if type(value) is list else "tuple"
            return {kind: [encode(item, path + [str(i)]) for i, item in enumerate(value)]}
        raise _refuse(path, value, "a value")

    structure = encode(obj, [])
    return tensors, {STRUCTURE_KEY: json.dumps(structure, separators=(",", ":"))}


def _refuse(path: list[str], value: Any, what: str) -> UnsupportedObjectError:
    where = "".join(f"[{p!r}]" for p in path) or "the object"
    return UnsupportedObjectError(
        f"cannot save {where} ({what} of type {type(value).__name__}) in a safetensors file: it holds only tensors "
        "and JSON-like values (None, bool, int, float, str, lists, tuples, dicts). Save with format='torch' "
        "(or a path not ending in .safetensors), or convert that value first"
    )


def unflatten(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, path: str = "") -> Any:
    """The object :func:`flatten` stored, or ``tensors`` when the file is a plain state dict."""
    if not metadata or STRUCTURE_KEY not in metadata:
        return tensors
    try:
        structure = json.loads(metadata[STRUCTURE_KEY])
        return _decode(structure, tensors)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CorruptCheckpointError(
            f"{path}: the {STRUCTURE_KEY} metadata is damaged ({type(e).__name__}: {e}); "
            "load the tensors alone with fastpersist.load_file",
            path=path,
        ) from None


def _decode(node: dict, tensors: dict[str, torch.Tensor]) -> Any:
    ((kind, payload),) = node.items()
    if kind == "tensor":
        return tensors[payload]
    if kind == "value":
        return payload
    if kind == "float":
        return float(payload)
    if kind == "list":
        return [_decode(item, tensors) for item in payload]
    if kind == "tuple":
        return tuple(_decode(item, tensors) for item in payload)
    if kind in ("dict", "odict"):
        result = collections.OrderedDict() if kind == "odict" else {}
        for key, value in payload:
            result[_decode(key, tensors)] = _decode(value, tensors)
        return result
    raise ValueError(f"unknown node {kind!r}")


# ----------------------------------------------------------------------------- save / load


def save_safetensors(obj: Any, destination: targets.Target, settings: dict[str, Any]) -> None:
    """``fastpersist.save(obj, f, format="safetensors")``: a path or a URL goes through save_file; a file object
    gets the bytes."""
    from fastpersist.api import safetensors

    tensors, metadata = flatten(obj)
    if not isinstance(destination, targets.FileObject):
        safetensors.save_file(tensors, destination, metadata=metadata, **settings)
        return
    if settings:
        raise TypeError(f"settings {sorted(settings)} apply to saves to a path, not to a file object")
    stream = destination.checked().stream
    stream.write(safetensors.save(tensors, metadata=metadata))
    if callable(getattr(stream, "flush", None)):
        stream.flush()


def async_save_safetensors(obj: Any, destination: targets.Target, settings: dict[str, Any]):
    """``fastpersist.async_save(obj, path, format="safetensors")`` (``path`` may be a URL)."""
    from fastpersist.api import safetensors

    if isinstance(destination, targets.FileObject):
        raise TypeError(
            f"async_save needs a file path, got {type(destination.stream).__name__}; use save() for file objects"
        )
    tensors, metadata = flatten(obj)
    return safetensors.async_save_file(tensors, destination, metadata=metadata, **settings)


def _map(tensors: dict[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    """Applies a dict or callable ``map_location`` to tensors loaded on the CPU (their saved location is "cpu")."""
    if isinstance(map_location, dict):
        target = map_location.get("cpu", "cpu")
        return {name: tensor.to(target) for name, tensor in tensors.items()}
    result = {}
    for name, tensor in tensors.items():
        storage = map_location(tensor.untyped_storage(), "cpu")
        if storage is None:
            result[name] = tensor
        else:
            storage = storage._untyped_storage if isinstance(storage, torch.TypedStorage) else storage
            result[name] = torch.empty(0, dtype=tensor.dtype, device=storage.device).set_(
                storage, tensor.storage_offset(), tensor.shape, tensor.stride()
            )
    return result


def load_safetensors(path: str, map_location: Any, settings: dict[str, Any]) -> Any:
    """``fastpersist.load`` of a safetensors file: tensors on ``map_location``'s device, the saved object rebuilt."""
    from fastpersist.api import safetensors

    device: Any = "cpu"
    if isinstance(map_location, (str, int, torch.device)):
        device = map_location
    with safetensors.safe_open(path, framework="pt", device=device, **settings) as f:
        tensors = f.get_tensors()
        metadata = f.metadata()
    if map_location is not None and not isinstance(map_location, (str, int, torch.device)):
        tensors = _map(tensors, map_location)
    return unflatten(tensors, metadata, path)


def load_safetensors_buffer(buffer: Any, size: int, map_location: Any, path: str) -> Any:
    """``fastpersist.load`` of a downloaded safetensors object: CPU tensors are views of ``buffer`` (no copy)."""
    from fastpersist.api import safetensors

    tensors, metadata = safetensors.tensors_in_buffer(buffer, size, path)
    if isinstance(map_location, (str, int, torch.device)):
        tensors = {name: tensor.to(map_location) for name, tensor in tensors.items()}
    elif map_location is not None:
        tensors = _map(tensors, map_location)
    return unflatten(tensors, metadata, path)


def load_safetensors_bytes(data: bytes, map_location: Any) -> Any:
    """``fastpersist.load`` of a file object holding a safetensors file."""
    from fastpersist.api import safetensors

    tensors = safetensors.load(data)
    if isinstance(map_location, (str, int, torch.device)):
        tensors = {name: tensor.to(map_location) for name, tensor in tensors.items()}
    elif map_location is not None:
        tensors = _map(tensors, map_location)
    from fastpersist.format.safetensors import parse_header

    header = parse_header(data, len(data))
    return unflatten(tensors, header.metadata)
