"""Object -> SavePlan: pickles once, with storages replaced by persistent ids.

The pickling rules are torch.save's own (``torch/serialization.py:_save``),
so the ``data.pkl`` we write is what torch.save would write for the same
object: tensors, Parameters, subclasses, sparse, quantized and nested tensors
all reduce themselves through ``__reduce_ex__`` exactly as under torch.save.
Only the storage bytes take another route: instead of being copied, each
storage becomes a record of the plan that refers to it (no copy).

Plain tensors (exactly ``torch.Tensor``, strided, on the CPU or a CUDA device,
with no Python attributes, hooks or names) are reduced by a shortcut that
returns what ``Tensor.__reduce_ex__`` returns for them, minus its Python
overhead (half the pickling time of a checkpoint of many small tensors). The
shortcut is checked once per process against torch's own reduction, byte for
byte on sample tensors, and stays off if anything differs.
"""

from __future__ import annotations

import copyreg
import io
import logging
import math
import os
import pickle
import secrets
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.serialization import location_tag, normalize_storage_type

from fastpersist.errors import MixedDtypeViewsError, UnsupportedObjectError, unsupported_object_error
from fastpersist.format.plan import BytesRecord, SavePlan, StorageRecord
from fastpersist.format.zipformat import PAYLOAD_ALIGNMENT, is_packed_storage, layout_archive, storage_alignment_claim
from fastpersist.tensors import torch_serialization_config

__all__ = ["plan_save", "archive_name_for"]

DEFAULT_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
_PLAIN_TYPES = frozenset({str, int, float, bool, tuple, list, dict, type(None), bytes, torch.Size, torch.dtype})
_log = logging.getLogger("fastpersist")


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
    tensors: list | None = None,
) -> SavePlan:
    """Pickles ``obj`` and lays out the checkpoint file.

    Args:
        obj: anything torch.save accepts.
        archive_name: the archive's top-level folder (see archive_name_for).
        pickle_module, pickle_protocol, disable_byteorder_record: as torch.save.
        tensors: a list that receives ``(tensor, version counter)`` of every
            plain ``torch.Tensor`` and ``nn.Parameter`` pickled through the
            shortcut (for detecting changes during an asynchronous save).
            Tensors of other types, and
            every tensor when the shortcut does not apply, are not recorded:
            compare the storages covered with the plan's.

    Returns:
        A plan whose storage records refer to the object's storages (no copies):
        the caller must not modify those tensors until the plan is written.

    Raises:
        UnsupportedObjectError: the object cannot be pickled, or two tensors
            view the same memory with different dtypes, or a storage lives on
            the meta device (it has no data to save).
    """
    shortcut = pickle_module is pickle or getattr(pickle_module, "wraps", None) is pickle
    table = _plain_tensor_dispatch_table(pickle_protocol) if shortcut else None
    if table is not None and tensors is not None:
        # A Parameter pickles its .data, a tensor with a version counter of its own: record the Parameter.
        table = {
            **table,
            torch.Tensor: _recording(table[torch.Tensor], tensors),
            torch.nn.Parameter: _recording(lambda parameter: parameter.__reduce_ex__(pickle_protocol), tensors),
        }
    pickled, storages = _pickle_with_storages(obj, pickle_module, pickle_protocol, table)

    prefix = archive_name + "/"
    sizes = [storage.nbytes() for storage in storages.values()]
    metadata = [("data.pkl", pickled)]
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
        + [(f"{prefix}data/{key}", size, not (pack and is_packed_storage(size))) for key, size in zip(storages, sizes)]
        + [(prefix + name, len(data), False) for name, data in closing],
        alignment=alignment,
    )
    entries = iter(layout.entries)
    records: list[BytesRecord | StorageRecord] = [BytesRecord(next(entries), data) for _, data in metadata]
    records += [StorageRecord(next(entries), key, storage) for key, storage in storages.items()]
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
        return int(torch_serialization_config.save.storage_alignment)
    except (AttributeError, TypeError, ValueError):
        return None


def _serialization_id() -> bytes:
    # torch writes 40 decimal digits that identify this save; any unique value will do.
    return "".join(str(secrets.randbelow(10)) for _ in range(40)).encode()


def _pickle_with_storages(
    obj: Any, pickle_module: Any, protocol: int, dispatch_table: dict | None
) -> tuple[bytes, dict[str, torch.UntypedStorage]]:
    """``obj`` pickled as torch.save pickles it, and its storages by key.

    Every storage becomes a persistent id ``("storage", StorageType, key,
    location, numel)``, exactly torch.save's. ``dispatch_table`` (from
    :func:`_plain_tensor_dispatch_table`) is used by the pickler when given.

    Raises:
        UnsupportedObjectError: the object cannot be pickled, two tensors view
            the same memory with different dtypes, or a storage is on the meta device.
    """
    storages: dict[str, torch.UntypedStorage] = {}
    id_map: dict[int, str] = {}
    storage_dtypes: dict[int, torch.dtype] = {}

    typed_storage = torch.storage.TypedStorage
    is_storage = torch.is_storage
    # Types whose objects are never storages: the common ones leave persistent_id at once.
    # A plain tensor pickles classes (OrderedDict, FloatStorage), a function, the tensor itself
    # and its empty hooks besides containers and numbers: five of its 19 calls.
    plain_types = _PLAIN_TYPES | {
        type,
        types.FunctionType,
        types.BuiltinFunctionType,
        torch.Tensor,
        _NoHooks,
        type(torch.FloatStorage),
    }
    stand_in = _TypedStorageStandIn
    storage_types = _v2_storage_types()

    def storage_id(
        item: Any,
        storage: torch.UntypedStorage,
        storage_dtype: torch.dtype,
        storage_type: Any,
        storage_numel: int,
        location: str | None = None,
    ):
        if location is None:
            if storage.device.type == "meta":
                raise UnsupportedObjectError(
                    "cannot save a tensor on the meta device: it has no data. Materialize it first "
                    "(for example with .to_empty(device='cpu') and initialization)"
                )
            fake_device = getattr(item, "_fake_device", None)
            location = str(fake_device) if fake_device is not None else location_tag(storage)
        pointer = storage.data_ptr()
        if pointer != 0:
            seen = storage_dtypes.setdefault(pointer, storage_dtype)
            if seen != storage_dtype:
                raise MixedDtypeViewsError(
                    "Cannot save multiple tensors or storages that view the same data as different types "
                    f"({seen} and {storage_dtype}); save a copy of one of them instead"
                )
        key = id_map.setdefault(storage._cdata, str(len(id_map)))
        storages[key] = storage
        return ("storage", storage_type, key, location, storage_numel)

    # torch's location_tag asks each registered tagger in turn; when its CPU tagger comes
    # first (always, unless a package registered one before it) a CPU storage is "cpu".
    registry = getattr(torch.serialization, "_package_registry", None) or [(None, None, None)]
    cpu_first = registry[0][1] is getattr(torch.serialization, "_cpu_tag", ())

    def persistent_id(item: Any):
        # Called for every object pickled (19 per tensor): the common types leave at once.
        kind = type(item)
        if kind in plain_types:
            return None
        if kind is stand_in:  # a plain tensor's storage, from the shortcut: what its TypedStorage gives
            storage, dtype = item.storage, item.dtype
            return storage_id(
                None,
                storage,
                dtype,
                storage_types[dtype],
                storage.nbytes() // dtype.itemsize,
                "cpu" if item.cpu and cpu_first else None,
            )
        if isinstance(item, typed_storage):
            return storage_id(
                item, item._untyped_storage, item.dtype, getattr(torch, item._pickle_storage_type()), item._size()
            )
        if is_storage(item):
            return storage_id(item, item, torch.uint8, normalize_storage_type(type(item)), item.nbytes())
        return None

    return _dump(obj, persistent_id, pickle_module, protocol, dispatch_table), storages


def _dump(
    obj: Any, persistent_id: Callable[[Any], Any], pickle_module: Any, protocol: int, dispatch_table: dict | None
) -> bytes:
    """``obj`` pickled by ``pickle_module`` with ``persistent_id`` (and ``dispatch_table``, when given).

    Raises:
        UnsupportedObjectError: the pickler refused the object (also of the
            type it raised: PicklingError, TypeError or AttributeError).
    """
    buffer = io.BytesIO()
    if pickle_module is pickle:
        # The C pickler's persistent_id attribute is called directly: one Python frame less per object.
        pickler = pickle.Pickler(buffer, protocol=protocol)
        pickler.persistent_id = persistent_id
    else:

        class _Pickler(pickle_module.Pickler):  # type: ignore[name-defined,misc]
            def persistent_id(self, item):
                return persistent_id(item)

        pickler = _Pickler(buffer, protocol=protocol)
    if dispatch_table is not None and getattr(pickler, "dispatch_table", None) is None:
        pickler.dispatch_table = dispatch_table
    try:
        pickler.dump(obj)
    except UnsupportedObjectError:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise unsupported_object_error(
            e,
            f"cannot serialize the object: {e}. fastpersist.save accepts what torch.save accepts: "
            "tensors, containers and picklable objects (lambdas and local classes are not picklable)",
        ) from e
    return buffer.getvalue()


# ---------------------------------------------------------------------------- plain tensor shortcut


class _TypedStorageStandIn:
    """Stands where torch's reduction of a tensor puts a new TypedStorage (costly to build; docs/performance.md).

    Only our ``persistent_id`` ever sees it, and it answers exactly what it
    answers for that TypedStorage, so the pickle is the same.
    """

    __slots__ = ("storage", "dtype", "cpu")

    def __init__(self, storage: torch.UntypedStorage, dtype: torch.dtype, cpu: bool):
        self.storage = storage
        self.dtype = dtype
        self.cpu = cpu  # the tensor is on the CPU (so is its storage)


class _NoHooks:
    """Stands where torch's reduction of a tensor puts an empty ``OrderedDict`` (its backward hooks).

    Pickles to the same bytes as a fresh ``OrderedDict()`` without the trip through
    ``copyreg._slotnames`` that reducing an OrderedDict makes every time.
    """

    __slots__ = ()


def _reduce_no_hooks(_: _NoHooks) -> tuple:
    return (OrderedDict, (), None, None, iter(()))


def _v2_storage_types() -> dict[torch.dtype, Any]:
    """dtype -> the legacy storage class torch's persistent id names for a TypedStorage of that dtype."""
    return {dtype: getattr(torch, name) for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


def _plain_tensor_reducer(protocol: int) -> Callable[[torch.Tensor], tuple]:
    """``reduce(tensor)`` for a dispatch table: ``tensor.__reduce_ex__(protocol)``, made cheap for plain tensors.

    For a tensor that takes torch's fast path (exactly ``torch.Tensor``, no
    Python state) and the ordinary branch of ``Tensor._reduce_ex_internal``
    (strided, not quantized, nested or named, on the CPU or CUDA, no backward
    hooks to warn about), it returns the same rebuild function and arguments,
    with stand-ins for the TypedStorage and the empty hooks dict that pickle
    to the same bytes. Anything else goes to ``__reduce_ex__``.
    """
    v3_dtypes = frozenset(torch.storage._new_dtypes())
    v2_dtypes = frozenset(torch.storage._dtype_to_storage_type_map())
    rebuild_v2, rebuild_v3 = torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3
    tensor_metadata = torch._C._get_tensor_metadata
    strided = torch.strided
    stand_in = _TypedStorageStandIn
    # torch before 2.13 refuses to save named tensors: leave them to it.
    has_names = getattr(torch.Tensor, "has_names", None) or (lambda tensor: False)

    def reduce(tensor: torch.Tensor) -> tuple:
        if (
            (tensor.is_cpu or tensor.is_cuda)
            and tensor.layout is strided
            and not tensor.is_quantized
            and not tensor.is_nested
            and not tensor.__getstate__()
            and not tensor._backward_hooks
            and not has_names(tensor)
        ):
            dtype = tensor.dtype
            metadata = tensor_metadata(tensor)
            if dtype in v2_dtypes:
                storage = stand_in(tensor.untyped_storage(), dtype, tensor.is_cpu)
                args = (
                    storage,
                    tensor.storage_offset(),
                    tuple(tensor.size()),
                    tensor.stride(),
                    tensor.requires_grad,
                    _NoHooks(),
                )
                return (rebuild_v2, args + (metadata,)) if metadata else (rebuild_v2, args)
            if dtype in v3_dtypes:
                args = (
                    tensor.untyped_storage(),
                    tensor.storage_offset(),
                    tuple(tensor.size()),
                    tensor.stride(),
                    tensor.requires_grad,
                    _NoHooks(),
                    dtype,
                )
                return (rebuild_v3, args + (metadata,)) if metadata else (rebuild_v3, args)
        return tensor.__reduce_ex__(protocol)

    return reduce


def _recording(reduce: Callable[[torch.Tensor], tuple], tensors: list) -> Callable[[torch.Tensor], tuple]:
    """``reduce`` that first appends ``(tensor, version)`` to ``tensors`` (inference tensors have no version)."""

    def recording(tensor: torch.Tensor) -> tuple:
        try:
            tensors.append((tensor, tensor._version))
        except RuntimeError:
            pass
        return reduce(tensor)

    return recording


_shortcut_lock = threading.Lock()
_shortcut_checked: dict[int, bool] = {}  # protocol -> whether the shortcut pickles as torch does


def _reset_after_fork() -> None:
    """A forked child gets a fresh lock: one held by another parent thread at fork time (its first
    save's one-time check) would never be released in the child."""
    global _shortcut_lock
    _shortcut_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _plain_tensor_dispatch_table(protocol: int) -> dict | None:
    """A pickler dispatch table with the plain tensor shortcut, or None where it must not be used.

    None inside ``torch.serialization.skip_data()`` and under a torch function
    mode (torch's reduction behaves differently there), and when the shortcut
    failed its one-time check against torch's own reduction.
    """
    from torch.serialization import _serialization_tls

    if getattr(_serialization_tls, "skip_data", False) or torch.overrides._get_current_function_mode_stack():
        return None
    with _shortcut_lock:
        usable = _shortcut_checked.get(protocol)
        if usable is None:
            usable = _shortcut_checked[protocol] = _shortcut_pickles_as_torch(protocol)
    return _dispatch_table(protocol) if usable else None


def _dispatch_table(protocol: int) -> dict:
    table = dict(copyreg.dispatch_table)  # a pickler's own table replaces copyreg's: keep its entries
    table[torch.Tensor] = _plain_tensor_reducer(protocol)
    table[_NoHooks] = _reduce_no_hooks
    return table


def _shortcut_samples() -> list:
    """Tensors of every kind the shortcut takes or hands on, as they occur in checkpoints."""
    base = torch.arange(24, dtype=torch.float32)
    samples: list[Any] = [
        base,
        base[3:15].view(3, 4).t(),
        torch.zeros(()),
        torch.empty(0, dtype=torch.int64),
        torch.ones(2, 3, dtype=torch.float64, requires_grad=True),
        torch.ones(3, dtype=torch.bfloat16),
        torch.ones(3, dtype=torch.float16),
        torch.zeros(4, dtype=torch.bool),
        torch.arange(5, dtype=torch.int8),
        torch.arange(5, dtype=torch.uint8),
        torch.ones(2, dtype=torch.complex64).conj(),
        torch.ones(2, dtype=torch.complex64).conj().imag,
        torch.ones(3)._neg_view(),
        torch.nn.Parameter(torch.ones(2)),
        OrderedDict(a=torch.ones(1)),
    ]
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            samples.append(torch.zeros(3, dtype=dtype))
    return samples


def _shortcut_pickles_as_torch(protocol: int) -> bool:
    """Whether pickling sample tensors with the shortcut gives exactly the bytes torch's reduction gives."""
    try:
        samples = _shortcut_samples()
        fast, fast_storages = _pickle_with_storages(samples, pickle, protocol, _dispatch_table(protocol))
        torchs, torch_storages = _pickle_with_storages(samples, pickle, protocol, None)
        same = fast == torchs and [(k, s._cdata) for k, s in fast_storages.items()] == [
            (k, s._cdata) for k, s in torch_storages.items()
        ]
    except Exception as e:  # noqa: BLE001 - any failure means: do as torch does
        _log.debug("fastpersist: plain tensor pickling shortcut off (%s: %s)", type(e).__name__, e)
        return False
    if not same:
        _log.debug("fastpersist: plain tensor pickling shortcut off: it pickles differently from torch")
    return same
