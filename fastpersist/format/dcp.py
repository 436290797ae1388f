"""A ``torch.distributed.checkpoint`` (DCP) checkpoint directory as data: its ``.metadata`` and fastpersist's extension.

A DCP checkpoint is a directory: ``.metadata`` (a pickled DCP ``Metadata``;
``__{rank}.metadata`` per rank when saved without collectives) and data files
(``__{rank}_{n}.distcp``). The metadata maps each item to a
``_StorageInfo(relative_path, offset, length)`` in a data file. A tensor
item, and a ``BYTE_IO`` item of DCP's default planner, is a complete
``torch.save`` archive of the value, with zip CRC-32s; ``FastPersistWriter``
adds to each ``_StorageInfo`` an attribute :data:`EXTENSION_ATTRIBUTE`, a
dict of built-in values (``version``, ``kind``, the payload's ``offset`` and
``nbytes``, its ``crc32``; ``dtype`` and ``shape`` of tensors).

:func:`read_metadata` unpickles ``.metadata`` for ``fastpersist.verify``
without running code from it: only DCP's metadata classes, torch dtypes,
``torch.Size``, layouts and paths are let through (DCP's own readers and
``FastPersistReader`` use ``pickle.load``, as torch does).
"""

from __future__ import annotations

import enum
import io
import pickle
import re
from typing import Any

import torch

from fastpersist.errors import CorruptCheckpointError

__all__ = [
    "EXTENSION_ATTRIBUTE",
    "EXTENSION_VERSION",
    "METADATA_FILE",
    "extension_of",
    "is_metadata_name",
    "read_metadata",
]

METADATA_FILE = ".metadata"
EXTENSION_ATTRIBUTE = "fastpersist"
"""Name of the attribute fastpersist adds to DCP's ``_StorageInfo`` (a dict of built-in values)."""
EXTENSION_VERSION = 1

_RANK_METADATA = re.compile(r"__\d+\.metadata")
_DCP_METADATA = "torch.distributed.checkpoint.metadata"  # its classes (dataclasses and enums) only
_OTHER_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (TensorProperties)
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


def is_metadata_name(name: str) -> bool:
    """Whether a file in a directory is a DCP metadata file (``.metadata``, or ``__{rank}.metadata``)."""
    return name == METADATA_FILE or _RANK_METADATA.fullmatch(name) is not None


def extension_of(info: Any) -> dict | None:
    """fastpersist's extension of an item's ``_StorageInfo``, or None (written by another writer, or another version)."""
    extension = getattr(info, EXTENSION_ATTRIBUTE, None)
    if isinstance(extension, dict) and extension.get("version") == EXTENSION_VERSION:
        return extension
    return None


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` for an enum member only: how some Pythons (3.11.0-3.11.4) pickle enum members."""
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and cls.__module__ == _DCP_METADATA
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not part of a DCP checkpoint's metadata")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in ("builtins", "__builtin__") and name == "getattr":
            return _enum_member
        if module == _DCP_METADATA or (module, name) in _OTHER_GLOBALS:
            found = super().find_class(module, name)
            if module != _DCP_METADATA or isinstance(found, type):
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def read_metadata(data: bytes, path: str) -> Any:
    """The DCP ``Metadata`` pickled in ``data`` (a ``.metadata`` file's bytes), unpickled without running its code.

    Raises:
        CorruptCheckpointError: not a pickle, not a DCP ``Metadata``, or one that
            refers to anything but DCP's metadata classes, torch dtypes,
            ``torch.Size``, layouts and paths (the message names it).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises means the same here
        raise CorruptCheckpointError(
            f"{path}: not a DCP checkpoint's metadata, or a damaged one ({type(e).__name__}: {e}); verify reads "
            "it without running code from it. Restore it from a good copy",
            path=path,
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(
            f"{path}: holds a {type(metadata).__name__}, not a DCP checkpoint's metadata with storage data", path=path
        )
    return metadata
