"""``load``: the drop-in replacement for ``torch.load``."""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import pickle
import warnings
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from fastpersist import config
from fastpersist.api import archive, dispatch
from fastpersist.api.verification import verify_file_object
from fastpersist.distributed import load as distributed_load
from fastpersist.distributed import save as distributed_save
from fastpersist.distributed.manifest import HEAD_SIZE, is_manifest, looks_like_manifest
from fastpersist.errors import CorruptCheckpointError, FastPersistError, TruncatedCheckpointError, torch_compatible
from fastpersist.format.deserializer import archive_prefix
from fastpersist.format.safetensors import looks_like_safetensors
from fastpersist.format.zipformat import MissingEndRecordError, RecordTable, read_directory, read_rows
from fastpersist.io import engine, targets
from fastpersist.io.reader import FileStorageProvider, MemoryStorageProvider, MmapStorageProvider
from fastpersist.io.records import HeaderCache
from fastpersist.tensors import host_memoryview, torch_serialization_config

__all__ = ["load"]

_TORCH_LOAD = torch.serialization.load  # torch's own, even where torch.load is patched to ours


def _resolve_weights_only(weights_only: bool | None, pickle_module: Any) -> bool:
    """torch.load's rules: default True, the TORCH_FORCE_*WEIGHTS_ONLY_LOAD variables, with its warning."""
    from torch.serialization import _default_to_weights_only

    not_set = weights_only is None
    if not_set:
        weights_only = _default_to_weights_only(pickle_module)
    truthy = ("1", "y", "yes", "true")
    force = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in truthy
    force_not = os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in truthy
    if force and force_not:
        raise RuntimeError(
            "Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` "
            "should be set, but both were set."
        )
    if force:
        weights_only = True
    elif force_not and not_set:  # only overrides a call site that did not pass weights_only
        warnings.warn(
            "Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected, since the"
            "`weights_only` argument was not explicitly passed to `torch.load`, forcing weights_only=False.",
            UserWarning,
            stacklevel=3,
        )
        weights_only = False
    if weights_only and pickle_module is not None:
        raise RuntimeError("Can not safely load weights when explicit pickle_module is specified")
    return bool(weights_only)


def load(
    f: str | os.PathLike[str] | BinaryIO,
    map_location: Any = None,
    pickle_module: Any = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    verify: bool | None = None,
    group: Any = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """Loads a checkpoint like ``torch.load``, reading storages in parallel with O_DIRECT.

    Reads any torch.save zip file (any alignment) as well as fastpersist's,
    and safetensors files (recognised by their first bytes; see
    :mod:`fastpersist.api.dispatch`).
    CPU tensors land in page-aligned memory that becomes their storage; CUDA
    targets are streamed through page-locked buffers straight to the device.

    Args:
        f: a path, or a readable binary file object (handled by torch.load),
            or a URL: ``s3://bucket/key`` (an S3 or S3-compatible object store),
            ``memory://``, ``gs://``... (any fsspec filesystem), downloaded
            whole into memory (docs/object-storage.md).
        map_location: as torch.load (str, torch.device, dict or callable).
        pickle_module: as torch.load (only with ``weights_only=False``).
        weights_only: as torch.load (default True: torch's safe unpickler).
        mmap: as torch.load: map the file instead of reading it.
        verify: check every record's CRC-32 before returning. Default: the
            ``verify`` setting (on) for paths loaded without mmap; files
            written without checksums are then loaded unverified, silently
            (with a warning when ``verify=True`` is passed explicitly).
        group: a ``torch.distributed`` process group (or ``True``: the
            default one): a collective load of a sharded checkpoint
            (``layout="parts"``) when each rank sees only some parts; they
            travel between ranks through torch.distributed. A sharded
            checkpoint whose parts are all visible loads without a group.
            For URLs every rank sees the whole store, so each
            reads the object (and a collective save's part objects) itself:
            ``group`` changes nothing there.
        timeout: (with ``group``) seconds to wait for the other ranks.
        **kwargs: ``fastpersist.config`` setting overrides; anything else is
            passed to the unpickler, as torch.load's ``pickle_load_args``.

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: as open().
        CheckpointIOError: (an ``OSError`` and a ``RuntimeError``, as torch.load raises)
            an I/O error while reading (EIO, ...), ``errno`` and ``filename`` set.
        CorruptCheckpointError: truncated, damaged or non-checkpoint file.
        ChecksumMismatchError: (verify) a record's bytes do not match its CRC-32.
        pickle.UnpicklingError: weights_only refused an object (torch's message).
        ObjectNotFoundError, BucketNotFoundError, ObjectStoreCredentialsError,
            ObjectStoreError, ObjectStoreUnavailableError: (a URL) see
            :func:`_load_from_store`.
    """
    overrides, pickle_load_args = config.split_overrides("load", kwargs, allow_other=True)
    resolved = config.resolve(overrides)
    # The default (the ``verify`` setting) applies to paths read in full; file objects
    # and mmap loads are verified only when asked, since that means reading them twice.
    explicit = verify is not None
    weights_only = _resolve_weights_only(weights_only, pickle_module)
    if mmap is None:
        mmap = getattr(getattr(torch_serialization_config, "load", None), "mmap", False)
    if verify is None:
        verify = resolved.verify and not mmap
    torch_kwargs = dict(weights_only=weights_only, mmap=mmap, **pickle_load_args)
    if pickle_module is not None:
        torch_kwargs["pickle_module"] = pickle_module
    if not isinstance(f, (str, os.PathLike)):
        if _is_safetensors_stream(f):
            return dispatch.load_safetensors_bytes(f.read(), map_location)
        if verify and explicit:
            verify_file_object(f)
        return _TORCH_LOAD(f, map_location, **torch_kwargs)
    source = targets.resolve(f)  # the one decision of where the bytes come from (fastpersist.io.targets)
    request = archive.LoadRequest(
        map_location, pickle_module, weights_only, mmap, verify, resolved, torch_kwargs, pickle_load_args, explicit
    )
    if source.remote:  # a store: ranged reads into memory (docs/object-storage.md)
        return _load_from_store(source, request)
    path = os.fspath(f)
    sharded = _load_sharded(
        path,
        group,
        timeout,
        verify,
        dict(map_location=map_location, pickle_module=pickle_module, weights_only=weights_only, **pickle_load_args),
    )
    if sharded is not _NOT_SHARDED:
        return sharded
    if torch._guards.detect_fake_mode(None) is not None:
        # Fake tensors: torch's own path.
        return _TORCH_LOAD(path, map_location, **torch_kwargs)
    if weights_only and pickle_load_args:
        # torch warns, and still hands them (``encoding=``) to the weights-only unpickler.
        warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=2)
    # torch.load's default encoding
    request = dataclasses.replace(request, pickle_load_args={"encoding": "utf-8", **pickle_load_args})
    try:
        return _load_from_path(path, request)
    except OSError as error:  # EIO and the like: torch.load raises RuntimeError for them (open()'s errors stay)
        raise torch_compatible(error, saving=False) from None


_NOT_SHARDED = object()


def _load_sharded(path: str, group: Any, timeout: float | None, verify: bool, load_kwargs: dict) -> Any:
    """A sharded checkpoint (manifest + parts), or a collective load; else _NOT_SHARDED."""
    if distributed_save.is_collective(group):
        data = distributed_load.read_collective(
            path,
            None if group is True else group,
            verify=verify,
            timeout=distributed_save.DEFAULT_TIMEOUT if timeout is None else timeout,
        )
        return _NOT_SHARDED if data is None else load(io.BytesIO(host_memoryview(data)), **load_kwargs)
    if os.path.isfile(path) and is_manifest(path):
        data = distributed_load.read_parts(path, verify=verify)
        return load(io.BytesIO(host_memoryview(data)), **load_kwargs)
    return _NOT_SHARDED


def _load_from_store(source: targets.Target, request: archive.LoadRequest) -> Any:
    """``fastpersist.load(url, ...)``: the file or object of a store, with the arguments as ``load`` resolved them.

    It is downloaded whole into one page-aligned buffer (host memory: its
    size, :meth:`~fastpersist.io.targets.base.Target.download`), parsed and
    verified as a local file is; CPU storages are views of that buffer (as an
    mmap load's are of the mapping), CUDA storages copies. Safetensors files
    and legacy torch files are recognised by their first bytes, as for paths
    (a safetensors file's CPU tensors are views of the buffer as well); so is
    the manifest of a collective save, whose part objects are then fetched
    into one buffer and verified the same way
    (:func:`fastpersist.distributed.objectstore.read_parts`). ``group=`` needs
    no exchange here: every rank reads the store itself.

    Raises:
        ObjectNotFoundError, BucketNotFoundError: (``FileNotFoundError``); also a
            missing part object of a collective save's checkpoint.
        TruncatedCheckpointError: empty; a part object has another size than its manifest says.
        ObjectStoreCredentialsError: (``PermissionError``) the credentials were refused.
        ObjectStoreError: a network error; the object was replaced during the load.
        ObjectStoreUnavailableError: boto3 (or fsspec) is missing.
        ValueError: a collective save's manifest in a store that holds no part objects.
        CorruptCheckpointError, ChecksumMismatchError: as for a local file.
        pickle.UnpicklingError: weights_only refused an object.
    """
    source = source.checked()
    path, settings, verify = source.path, request.settings, request.verify
    buffer, size = source.download(settings)
    view = memoryview(buffer).cast("B")[:size]
    if size == 0:
        raise TruncatedCheckpointError(f"{path} is empty (0 bytes): it is not a checkpoint", path=path)
    if looks_like_manifest(bytes(view[:HEAD_SIZE])):  # a collective save's manifest: the checkpoint is in its parts
        if "parts" not in source.layouts:
            raise ValueError(f"{path} is the manifest of a collective save, whose parts this store does not hold")
        from fastpersist.distributed import objectstore as parts  # torch.distributed only where needed

        buffer, size = parts.read_parts(source, bytes(view), settings)
        view = memoryview(buffer).cast("B")[:size]
    head = bytes(view[:16])
    if looks_like_safetensors(head):
        return dispatch.load_safetensors_buffer(buffer, size, request.map_location, path)
    if head[:4] != b"PK\x03\x04":  # legacy (pre-1.6) or foreign format: torch.load knows them
        return _TORCH_LOAD(io.BytesIO(view), request.map_location, **request.torch_kwargs)

    def read_at(offset: int, length: int) -> bytes:
        return bytes(view[offset : offset + length])

    records = RecordTable(read_rows(read_at, size, path, check=verify))
    prefix = archive_prefix(list(records), path)
    if prefix + "constants.pkl" in records:  # a TorchScript archive
        return _TORCH_LOAD(io.BytesIO(view), request.map_location, **request.torch_kwargs)
    pickle_bytes, order, verify = archive.metadata(read_at, records, prefix, path, verify, request.warn_unverifiable)
    whole = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
    provider = MemoryStorageProvider(whole, verify=verify, path=path)
    request = dataclasses.replace(request, pickle_load_args={"encoding": "utf-8", **request.pickle_load_args})
    return archive.rebuild(pickle_bytes, records, prefix, provider, request, byteorder=order, path=path)


def _open_records(file, path: str, verify: bool) -> tuple[RecordTable, Callable[[int, int], bytes]]:
    size = file.size()

    read_at = HeaderCache(file.fd, size)
    # Verifying also checks the bytes no CRC covers (headers, descriptors, end records).
    # Rows, not named tuples: the garbage collector stops tracking them (see read_rows).
    return RecordTable(read_rows(read_at, size, path, check=verify)), read_at


_LEGACY_MAGIC = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"  # pickled 0x1950a86a20f9469cfc6c, torch's legacy mark


def _is_legacy_torch_file(head: bytes) -> bool:
    """A pre-1.6 torch file: a pickle that starts with torch's magic number, or the older tar format."""
    return (head[:1] == b"\x80" and head[2:14] == _LEGACY_MAGIC) or head[257:262] == b"ustar"


def _load_with_torch(path: str, map_location, torch_kwargs: dict) -> Any:
    """torch.load for files that are not zip archives (legacy format), with clearer errors for damaged ones."""
    with open(path, "rb") as handle:
        head = handle.read(512)
    if not head:
        raise TruncatedCheckpointError(
            f"{path} is empty (0 bytes): it is not a checkpoint. An interrupted copy or a save by a tool "
            "without atomic commit leaves such files; restore it from a good copy",
            path=path,
        )
    legacy = _is_legacy_torch_file(head)
    if not legacy:
        _raise_if_damaged_zip(path)
    try:
        return _TORCH_LOAD(path, map_location, **torch_kwargs)
    except (pickle.UnpicklingError, OSError, FastPersistError, MemoryError):
        raise
    except Exception as e:
        # A real legacy file may fail for reasons of its own (map_location, user
        # classes): those errors stay torch's. A file that is not one lets torch's
        # legacy reader surface garbage as IndexError, KeyError, "Invalid magic
        # number"...; say what it means instead. EOFError always means truncation.
        if legacy and not isinstance(e, EOFError):
            raise
        kind = TruncatedCheckpointError if isinstance(e, EOFError) else CorruptCheckpointError
        what = "a truncated legacy torch file" if legacy else "neither a zip checkpoint nor a legacy torch file"
        raise kind(
            f"{path} is {what} ({type(e).__name__}: {e}); the file is damaged or not a checkpoint: "
            "restore it from a good copy",
            path=path,
        ) from e


def _raise_if_damaged_zip(path: str) -> None:
    """A zip archive whose first bytes are damaged is not a legacy file: say so rather than unpickle it."""
    with open(path, "rb") as handle:
        descriptor = handle.fileno()
        try:
            records = read_directory(lambda o, n: os.pread(descriptor, n, o), os.fstat(descriptor).st_size, path)
        except MissingEndRecordError:
            if os.pread(descriptor, 2, 0) == b"PK":
                raise  # a zip archive damaged at both ends (truncated, and a first header hit)
            return  # not a zip archive: torch.load may know it
    first = min(records, key=lambda r: r.header_offset).name if records else None
    raise CorruptCheckpointError(
        f"{path}: a zip archive whose first bytes are damaged (it does not start with a zip header); "
        "restore it from a good copy",
        path=path,
        record=first,
    )


def _is_safetensors_stream(f) -> bool:
    """A seekable file object positioned at a safetensors file (its position is kept)."""
    try:
        if not f.seekable():
            return False
        position = f.tell()
        head = f.read(9)
        f.seek(position)
    except (AttributeError, OSError, ValueError):
        return False
    return isinstance(head, bytes) and dispatch.looks_like_safetensors(head)


def _load_from_path(path: str, request: archive.LoadRequest) -> Any:
    """``fastpersist.load`` of a local file, as ``request`` asks."""
    map_location, settings, verify = request.map_location, request.settings, request.verify
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "expected a checkpoint file, got a directory", path)
    if dispatch.is_safetensors_file(path):
        return dispatch.load_safetensors(path, map_location, settings.as_dict())
    if not dispatch.is_torch_zip_file(path):  # legacy (pre-1.6) or foreign format: torch.load knows them all
        return _load_with_torch(path, map_location, request.torch_kwargs)
    file = engine.File(path, "r", direct=settings.direct and not request.mmap)
    try:
        records, read_at = _open_records(file, path, verify)
        prefix = archive_prefix(list(records), path)
        if prefix + "constants.pkl" in records:  # a TorchScript archive
            return _TORCH_LOAD(path, map_location, **request.torch_kwargs)
        pickle_bytes, order, verify = archive.metadata(
            read_at, records, prefix, path, verify, request.warn_unverifiable
        )
        if request.mmap:
            provider = MmapStorageProvider(path, file.size(), verify=verify)
        else:
            storages = [row for row in records.rows() if row[0].startswith(prefix + "data/")]
            provider = FileStorageProvider(file, storages, settings, verify=verify, path=path)
            del storages
        try:
            return archive.rebuild(pickle_bytes, records, prefix, provider, request, byteorder=order, path=path)
        finally:
            if isinstance(provider, FileStorageProvider):
                provider.close()
    finally:
        file.close()
