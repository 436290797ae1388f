"""Object -> SavePlan: pickles once, with storages replaced by persistent ids.

The pickling rules are torch.save's own (``torch/serialization.py:_save``),
so the ``data.pkl`` we write is what torch.save would write for the same
object: tensors, Parameters, subclasses, sparse, quantized and nested tensors
all reduce themselves through ``__reduce_ex__`` exactly as under torch.save.
Only the storage bytes take another route: instead of being copied, each
storage becomes a zero-copy uint8 view in the plan.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import secrets
import sys
from typing import Any

import torch
from torch.serialization import location_tag, normalize_storage_type

from fastpersist.errors import MixedDtypeViewsError, UnsupportedObjectError
from fastpersist.format.plan import BytesRecord, SavePlan, StorageRecord
from fastpersist.format.zipformat import PAYLOAD_ALIGNMENT, is_packed_storage, layout_archive, storage_alignment_claim
from fastpersist.tensors import storage_byte_view

__all__ = ["plan_save", "archive_name_for"]

DEFAULT_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
_PLAIN_TYPES = frozenset({str, int, float, bool, tuple, list, dict, type(None), bytes, torch.Size, torch.dtype})


def archive_name_for(path: str | os.PathLike[str] | None) -> str:
    """The top-level folder torch puts records in: the file's stem, or ``archive`` for buffers."""
    if path is None:
        return "archive"
    stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
    return stem or "archive"


def plan_save(
    obj: Any,
    archive_name: str,
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    disable_byteorder_record: bool = False,
) -> SavePlan:
    """Pickles ``obj`` and lays out the checkpoint file.

    Args:
        obj: anything torch.save accepts.
        archive_name: the archive's top-level folder (see archive_name_for).
        pickle_module, pickle_protocol, disable_byteorder_record: as torch.save.

    Returns:
        A plan whose storage records view the object's storages (no copies):
        the caller must not modify those tensors until the plan is written.

    Raises:
        UnsupportedObjectError: the object cannot be pickled, or two tensors
            view the same memory with different dtypes, or a storage lives on
            the meta device (it has no data to save).
    """
    storages: dict[str, torch.UntypedStorage] = {}
    id_map: dict[int, str] = {}
    storage_dtypes: dict[int, torch.dtype] = {}

    typed_storage = torch.storage.TypedStorage
    is_storage = torch.is_storage
    plain_types = _PLAIN_TYPES

    def persistent_id(item: Any):
        # Called for every object pickled (19 per tensor): the common types leave at once.
        if type(item) in plain_types or not (isinstance(item, typed_storage) or is_storage(item)):
            return None
        if isinstance(item, typed_storage):
            storage = item._untyped_storage
            storage_dtype = item.dtype
            storage_type = getattr(torch, item._pickle_storage_type())
            storage_numel = item._size()
        else:
            storage = item
            storage_dtype = torch.uint8
            storage_type = normalize_storage_type(type(item))
            storage_numel = storage.nbytes()
        if storage.device.type == "meta":
            raise UnsupportedObjectError(
                "cannot save a tensor on the meta device: it has no data. Materialize it first "
                "(for example with .to_empty(device='cpu') and initialization)"
            )
        if storage.data_ptr() != 0:
            seen = storage_dtypes.setdefault(storage.data_ptr(), storage_dtype)
            if seen != storage_dtype:
                raise MixedDtypeViewsError(
                    "Cannot save multiple tensors or storages that view the same data as different types "
                    f"({seen} and {storage_dtype}); save a copy of one of them instead"
                )
        key = id_map.setdefault(storage._cdata, str(len(id_map)))
        fake_device = getattr(item, "_fake_device", None)
        location = str(fake_device) if fake_device is not None else location_tag(storage)
        storages[key] = storage
        return ("storage", storage_type, key, location, storage_numel)

    buffer = io.BytesIO()
    if pickle_module is pickle:
        # The C pickler's persistent_id attribute is called directly: one Python frame less per object.
        pickler = pickle.Pickler(buffer, protocol=pickle_protocol)
        pickler.persistent_id = persistent_id
    else:

        class _Pickler(pickle_module.Pickler):  # type: ignore[name-defined,misc]
            def persistent_id(self, item):
                return persistent_id(item)

        pickler = _Pickler(buffer, protocol=pickle_protocol)

    try:
        pickler.dump(obj)
    except UnsupportedObjectError:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise UnsupportedObjectError(
            f"cannot serialize the object: {e}. fastpersist.save accepts what torch.save accepts: "
            "tensors, containers and picklable objects (lambdas and local classes are not picklable)"
        ) from e

    prefix = archive_name + "/"
    views = {key: storage_byte_view(storage) for key, storage in storages.items()}
    sizes = [storage.nbytes() for storage in storages.values()]
    metadata = [("data.pkl", buffer.getvalue())]
    # An alignment set in torch's config.save.storage_alignment is honoured for every
    # storage (at least our 4096). With torch's default, small storages are packed at 64 bytes, and a
    # file that mixes packed and page-aligned storages declares no alignment (torch then
    # reads offsets from the local headers).
    alignment, requested = storage_alignment(), _requested_alignment()
    pack = requested in (None, _TORCH_DEFAULT_ALIGNMENT)
    claim = storage_alignment_claim(sizes, alignment) if pack else alignment
    if claim is not None:
        metadata += [(".format_version", b"1"), (".storage_alignment", str(claim).encode())]
    if not disable_byteorder_record:
        metadata.append(("byteorder", sys.byteorder.encode()))
    closing = [("version", b"3\n"), (".data/serialization_id", _serialization_id())]

    layout = layout_archive(
        [(prefix + name, len(data), False) for name, data in metadata]
        + [(f"{prefix}data/{key}", size, not (pack and is_packed_storage(size))) for key, size in zip(views, sizes)]
        + [(prefix + name, len(data), False) for name, data in closing],
        alignment=alignment,
    )
    entries = iter(layout.entries)
    records: list[BytesRecord | StorageRecord] = [BytesRecord(next(entries), data) for _, data in metadata]
    records += [StorageRecord(next(entries), key, view) for key, view in views.items()]
    records += [BytesRecord(next(entries), data) for _, data in closing]
    return SavePlan(layout, tuple(records))


def storage_alignment() -> int:
    """Storage payload alignment: ours (4096), or torch's ``config.save.storage_alignment`` when larger.

    Any alignment torch is asked for is honoured (the least common multiple with
    ours, so O_DIRECT still works).
    """
    requested = _requested_alignment() or PAYLOAD_ALIGNMENT
    return math.lcm(PAYLOAD_ALIGNMENT, requested) if requested > 0 else PAYLOAD_ALIGNMENT


_TORCH_DEFAULT_ALIGNMENT = 64
"""torch's own ``config.save.storage_alignment`` default: asking for it means "no preference"."""


def _requested_alignment() -> int | None:
    """torch's ``config.save.storage_alignment`` (None where this torch has no such setting)."""
    try:
        from torch.utils.serialization import config as torch_config

        return int(torch_config.save.storage_alignment)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


def _serialization_id() -> bytes:
    # torch writes 40 decimal digits that identify this save; any unique value will do.
    return "".join(str(secrets.randbelow(10)) for _ in range(40)).encode()
