"""``data.pkl`` -> object, with torch.load's rules, and storages from a provider.

torch.load's semantics (``torch/serialization.py:_load``) are kept: the
weights-only unpickler by default, ``map_location`` as a string, device, dict
or callable, storages shared between views, byte order records, sparse
tensor validation after loading. What differs is where storage bytes come
from: a :class:`StorageProvider` hands out storages already on their target
device, so no CPU copy is made for CUDA targets, and (in the weights-only
mode, whose rebuild functions never read tensor data) all bytes can be read
in one parallel batch after unpickling instead of one record at a time.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch.serialization import StorageType, _get_restore_location

from fastpersist.errors import CorruptCheckpointError, FastPersistError
from fastpersist.format.zipformat import ZipRecordInfo

__all__ = ["StorageProvider", "target_device", "deserialize", "archive_prefix"]


class StorageProvider(Protocol):
    """Where storage bytes come from (implemented by the I/O layer)."""

    def storage(self, record: ZipRecordInfo, device: torch.device) -> torch.UntypedStorage:
        """An untyped storage of ``record.size`` bytes on ``device`` (cpu or cuda).

        Its bytes may be filled later, at :meth:`flush`.
        """

    def flush(self) -> None:
        """Fills every storage handed out so far. Raises what the reads raise."""


def archive_prefix(names: list[str], path: str | None) -> str:
    """The archive's top-level folder, found from its ``data.pkl`` record."""
    for name in names:
        if name.endswith("/data.pkl") and name.count("/") == 1:
            return name[: -len("data.pkl")]
    raise CorruptCheckpointError(
        f"{path or 'the file'} is a zip archive but not a torch checkpoint (no <archive>/data.pkl record)", path=path
    )


def target_device(map_location: Any, location: str) -> torch.device | None:
    """The device a storage saved at ``location`` must end up on, when it is cpu or a usable CUDA device.

    Returns None when torch's own ``restore_location`` must decide (callables,
    other device types, unavailable devices: torch raises its usual errors).
    """
    if map_location is None:
        name = location
    elif isinstance(map_location, (str, torch.device)):
        name = str(map_location)
    elif isinstance(map_location, Mapping):
        name = map_location.get(location, location)
    else:
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        return None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device() if device.index is None else device.index
        if 0 <= index < torch.cuda.device_count():
            return torch.device("cuda", index)
    return None


_UNKNOWN = object()


def _is_meta(map_location: Any) -> bool:
    return (isinstance(map_location, str) and map_location == "meta") or (
        isinstance(map_location, torch.device) and map_location.type == "meta"
    )


def deserialize(
    pickle_bytes: bytes,
    records: Mapping[str, ZipRecordInfo],
    prefix: str,
    provider: StorageProvider,
    *,
    map_location: Any = None,
    pickle_module: Any = None,
    weights_only: bool = True,
    byteorder: bytes | None = b"little",
    path: str | None = None,
    release_records: bool = False,
    **pickle_load_args: Any,
) -> Any:
    """Rebuilds the saved object.

    Args:
        pickle_bytes: the ``data.pkl`` record.
        records: every record of the archive by full name.
        prefix: the archive's top-level folder with its trailing slash.
        provider: supplies storages (see StorageProvider).
        map_location, pickle_module, weights_only, pickle_load_args: as torch.load.
        byteorder: the file's ``byteorder`` record (None: native order).
        release_records: remove each storage's record from ``records`` (a
            dict) once its storage is loaded, so that the directory shrinks
            as the state grows.

    Raises:
        pickle.UnpicklingError: weights_only refused something (torch's
            message), or a persistent id is malformed.
        CorruptCheckpointError: the pickle names a storage the archive lacks,
            sizes disagree, or (weights_only) ``data.pkl`` is malformed in a
            way that made one of torch's rebuild functions fail.
        OSError, ChecksumMismatchError: reading a storage failed.
    """
    restore_location = _get_restore_location(map_location)
    meta = _is_meta(map_location)
    swap = byteorder is not None and byteorder.decode() != sys.byteorder
    # Rebuild functions the weights-only unpickler allows never read tensor data,
    # so their storages can be filled in one batch afterwards. Arbitrary pickles may
    # read data while unpickling (custom __setstate__), and byte swapping needs the
    # data, so those are filled storage by storage, as torch.load does.
    # Globals the user allowed (add_safe_globals / safe_globals) may run their own code, e.g. a
    # tensor subclass's __setstate__ reading values: they too get tensors with their data.
    # torch allows some of its own classes that way (nested and distributed tensors, device mesh
    # layouts) as soon as they are imported; their rebuilds read no data, like its other ones.
    eager = not weights_only or swap or _user_safe_globals()
    loaded: dict[str, torch.storage.TypedStorage] = {}
    devices: dict[str, Any] = {}  # location -> target_device(map_location, location)
    from_storage: set[int] = set()  # ids of exceptions raised while loading a storage

    def load_storage(dtype: torch.dtype, nbytes: int, key: str, location: str) -> torch.storage.TypedStorage:
        name = f"{prefix}data/{key}"
        record = records.get(name)
        if record is None:
            raise CorruptCheckpointError(
                f"{path or 'checkpoint'}: the pickle refers to missing record {name!r}", path=path, record=name
            )
        if record.size != nbytes:
            raise CorruptCheckpointError(
                f"{path or 'checkpoint'}: record {name!r} holds {record.size} bytes but the pickle expects {nbytes}",
                path=path,
                record=name,
            )
        if meta:
            wrap = torch.UntypedStorage(nbytes, device="meta")
        else:
            device = devices.get(location, _UNKNOWN)
            if device is _UNKNOWN:  # one lookup per location, not per storage (100,000 small tensors)
                device = devices[location] = target_device(map_location, location)
            storage = provider.storage(record, device or torch.device("cpu"))
            if eager or device is None:
                provider.flush()
            if swap:
                storage.byteswap(dtype)
            wrap = storage if device is not None else _restore(restore_location, storage, location, name, path)
        typed = torch.storage.TypedStorage(wrap_storage=wrap, dtype=dtype, _internal=True)
        if typed._data_ptr() != 0:
            loaded[key] = typed  # asked for again, it comes from here
            if release_records:
                del records[name]
        return typed

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        # A damaged or hostile data.pkl can put anything in a persistent id: check
        # its shape before using it, so that it fails as a pickle error.
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise pickle.UnpicklingError(f"unexpected persistent id {saved_id!r} in a torch checkpoint")
        typename, storage_type, key, location, numel = saved_id
        typename = _text(typename)
        if typename != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id type {typename!r}, expected 'storage'")
        location = _text(location)
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        elif isinstance(getattr(storage_type, "dtype", None), torch.dtype):
            dtype = storage_type.dtype
        else:
            raise pickle.UnpicklingError(f"persistent id names {storage_type!r}, not a storage type")
        if not isinstance(key, str) or not isinstance(location, str):
            raise pickle.UnpicklingError(f"bad storage key {key!r} or location {location!r} in a persistent id")
        if key in loaded:
            return loaded[key]
        if not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError(f"bad element count {numel!r} for storage {key!r}")
        try:
            return load_storage(dtype, numel * torch._utils._element_size(dtype), key, location)
        except BaseException as e:
            from_storage.add(id(e))  # I/O, checksum and device errors: raised as they are
            raise

    unpickler = _unpickler(pickle_bytes, weights_only, pickle_module, pickle_load_args)
    unpickler.persistent_load = persistent_load
    result = _unpickle(unpickler, provider, map_location, weights_only, from_storage, prefix, path)
    _validate_sparse_tensors(weights_only, prefix, path)
    return result


def _unpickler(pickle_bytes: bytes, weights_only: bool, pickle_module: Any, pickle_load_args: dict[str, Any]):
    """The unpickler torch.load would use for ``data.pkl``: the weights-only one, or ``pickle_module``'s."""
    stream = io.BytesIO(pickle_bytes)
    if weights_only:
        from torch import _weights_only_unpickler

        return _weights_only_unpickler.Unpickler(stream, **pickle_load_args)
    return _unpickler_class(pickle_module or pickle)(stream, **pickle_load_args)


def _unpickle(
    unpickler: Any,
    provider: StorageProvider,
    map_location: Any,
    weights_only: bool,
    from_storage: set[int],
    prefix: str,
    path: str | None,
) -> Any:
    """Runs ``unpickler`` with ``map_location`` published to torch, then fills every storage (``provider.flush``).

    Raises:
        CorruptCheckpointError: the weights-only unpickler failed in a way that
            means ``data.pkl`` is damaged. Errors of storages (ids in
            ``from_storage``), of arbitrary pickles and of ``map_location``
            are raised as they are.
    """
    from torch.serialization import _serialization_tls

    _serialization_tls.map_location = map_location
    try:
        try:
            result = unpickler.load()
        except (pickle.UnpicklingError, FastPersistError, OSError, MemoryError):
            raise
        except Exception as e:
            if not weights_only or id(e) in from_storage:
                raise  # arbitrary pickles may raise anything; so may map_location
            # The weights-only unpickler calls only torch's own rebuild functions, so
            # anything else it raises (IndexError, KeyError, a rebuild's RuntimeError...)
            # means data.pkl is damaged: say so instead of leaking the symptom.
            raise CorruptCheckpointError(
                f"{path or 'checkpoint'}: {prefix}data.pkl is malformed ({type(e).__name__}: {e}); the file is "
                "damaged: check it with `fastpersist verify` and restore it from a good copy",
                path=path,
                record=prefix + "data.pkl",
            ) from e
        provider.flush()
    except BaseException:
        # torch queues sparse tensors for validation while unpickling; a failed load
        # must not leave them to be validated (and fail) in the next, unrelated load.
        torch._utils._sparse_tensors_to_validate.clear()
        raise
    finally:
        _serialization_tls.map_location = None
    return result


def _validate_sparse_tensors(weights_only: bool, prefix: str, path: str | None) -> None:
    """torch's check of the sparse tensors just loaded; a failure of the weights-only mode means a damaged file.

    Raises:
        CorruptCheckpointError: ``weights_only`` and an invalid sparse tensor.
        RuntimeError: an invalid sparse tensor of an arbitrary pickle (torch's error).
    """
    try:
        torch._utils._validate_loaded_sparse_tensors()
    except RuntimeError as e:
        if not weights_only:
            raise
        raise CorruptCheckpointError(
            f"{path or 'checkpoint'}: a sparse tensor in the file is invalid ({e}); the file is damaged",
            path=path,
            record=prefix + "data.pkl",
        ) from e


def _user_safe_globals() -> bool:
    """Whether the weights-only unpickler allows globals besides torch's own (see deserialize)."""
    for entry in torch.serialization.get_safe_globals():
        allowed = entry[0] if isinstance(entry, tuple) else entry
        module = getattr(allowed, "__module__", None) or ""
        if module != "torch" and not module.startswith("torch."):
            return True
    return False


def _restore(restore_location, storage, location: str, name: str, path: str | None):
    """torch's restore_location, with a clear error for a location that names no device at all."""
    try:
        return restore_location(storage, location)
    except RuntimeError as e:
        try:
            torch.device(location)
        except (RuntimeError, ValueError):
            # Not even a device string (and no registered package claims it): the
            # pickle is damaged. A real but unavailable device keeps torch's error.
            raise CorruptCheckpointError(
                f"{path or 'checkpoint'}: storage {name!r} has location {location!r}, which is not a device; "
                f"the file is damaged ({e})",
                path=path,
                record=name,
            ) from e
        raise


def _text(value: Any) -> Any:
    """Persistent-id fields may be bytes in old files; decode them without failing."""
    if isinstance(value, bytes):
        return value.decode("ascii", errors="replace")
    return value


def _unpickler_class(pickle_module: Any) -> type:
    module_mapping = {"torch.tensor": "torch._tensor"}  # as torch.load, for old checkpoints

    class _Unpickler(pickle_module.Unpickler):  # type: ignore[name-defined,misc]
        def find_class(self, module_name, name):
            if type(name) is str and "Storage" in name:
                try:
                    return StorageType(name)
                except KeyError:
                    pass
            return super().find_class(module_mapping.get(module_name, module_name), name)

    return _Unpickler
