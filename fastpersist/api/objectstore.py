"""``save`` and ``load`` of ``s3://bucket/key``: checkpoints in S3 and S3-compatible object stores.

``fastpersist.save``, ``fastpersist.load`` and ``fastpersist.async_save`` hand
``s3://`` URLs here (``async_save`` commits through
:func:`fastpersist.io.objectstore.commit_plan` directly; safetensors saves go
through :mod:`fastpersist.api.safetensors`, whose functions take URLs too). The
object holds exactly the bytes a save to a local file of the key's name holds,
so ``torch.load`` (or ``safetensors.torch.load``) reads a downloaded copy. How
the bytes travel (a multipart upload fed by the writer's ring, committed by
its completion; concurrent ranged GETs) is :mod:`fastpersist.io.objectstore`;
collective saves (``group=``: part objects and a manifest object) and their
loads are :mod:`fastpersist.distributed.objectstore`; usage, settings and
limits are in docs/object-storage.md.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from fastpersist import config
from fastpersist.api import archive, dispatch
from fastpersist.distributed.manifest import HEAD_SIZE, looks_like_manifest
from fastpersist.errors import TruncatedCheckpointError
from fastpersist.format.deserializer import archive_prefix
from fastpersist.format.safetensors import looks_like_safetensors
from fastpersist.format.serializer import archive_name_for, plan_save
from fastpersist.format.zipformat import RecordTable, read_rows
from fastpersist.io import objectstore
from fastpersist.io.reader import MemoryStorageProvider

__all__ = ["is_object_url", "save", "load"]

is_object_url = objectstore.is_object_url

_TORCH_LOAD = torch.serialization.load  # torch's own, even where torch.load is patched to ours


def save(
    obj: object,
    url: str,
    pickle_module: Any,
    pickle_protocol: int,
    use_new_zipfile_serialization: bool,
    disable_byteorder_record: bool,
    *,
    group: Any,
    torch_crc32: bool,
    settings: dict[str, Any],
    collective: dict[str, Any] | None = None,
) -> None:
    """``fastpersist.save(obj, "s3://bucket/key", ...)``: the arguments as :func:`fastpersist.save` takes them.

    ``torch_crc32`` is torch's ``compute_crc32`` option (off: no checksums, as
    for local saves); ``settings`` the call's keyword arguments; ``collective``
    the ``layout``, ``writers``, ``divergence`` and ``timeout`` of a
    collective save (``group=``, every rank calls it): each writer uploads its
    share as a part object and rank 0 commits a manifest object at the key
    (:mod:`fastpersist.distributed.objectstore`).

    Safetensors (``format="safetensors"`` or a ``.safetensors`` key) go
    through :func:`fastpersist.api.safetensors.save_file`, as for paths.

    Raises:
        ValueError: what object stores do not support yet: safetensors with
            ``group=`` (a collective save of safetensors), the legacy format,
            ``layout="file"`` for a collective save; or a malformed URL.
        DistributedCheckpointError: (``group=``) on every rank, when any rank
            failed (its upload error named), or as :func:`fastpersist.distributed.save.save`.
        TypeError, ConfigError: an unknown keyword (``local_copy`` included:
            an ``async_save`` option), an invalid setting.
        UnsupportedObjectError: ``obj`` cannot be pickled (nothing is sent).
        ObjectStoreUnavailableError, ObjectStoreCredentialsError,
            BucketNotFoundError, ObjectStoreError: as
            :func:`fastpersist.io.objectstore.commit_plan` (the previous
            object is intact).
    """
    settings = dict(settings)
    if "local_copy" in settings:
        raise TypeError(
            "save() has no local_copy: a two-tier save is fastpersist.async_save(obj, url, local_copy=path) (call "
            "result() on its future to wait for the upload)"
        )
    from fastpersist.distributed import save as distributed_save

    if dispatch.wants_safetensors(url, settings.pop("format", None)):
        if distributed_save.wants_group(group):
            raise ValueError(
                f"collective saves (group=...) of safetensors to an object store are not supported yet ({url}); "
                "save with format='torch' for a collective save, or without group= from one rank"
            )
        dispatch.save_safetensors(obj, url, settings)
        return
    if not use_new_zipfile_serialization:
        raise ValueError(f"the legacy format (_use_new_zipfile_serialization=False) cannot be saved to {url}")
    overrides, _ = config.split_overrides("save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if resolved.checksum and not torch_crc32:
        resolved = resolved.replace(checksum=False)
    destination = objectstore.target(url)
    if distributed_save.is_collective(group):
        distributed_save.save(
            obj,
            url,
            group=group,
            pickle_module=pickle_module,
            pickle_protocol=pickle_protocol,
            disable_byteorder_record=disable_byteorder_record,
            settings=resolved,
            **(collective or {}),
        )
        return
    plan = plan_save(obj, archive_name_for(destination.given), pickle_module, pickle_protocol, disable_byteorder_record)
    objectstore.commit_plan(plan, destination, resolved, streams=None)


def load(
    url: str,
    map_location: Any,
    pickle_module: Any,
    weights_only: bool,
    verify: bool,
    settings: config.Settings,
    torch_kwargs: dict[str, Any],
    pickle_load_args: dict[str, Any],
    *,
    warn_unverifiable: bool,
) -> Any:
    """``fastpersist.load("s3://bucket/key", ...)``, with the arguments as ``fastpersist.load`` resolved them.

    The object is downloaded whole into one page-aligned buffer (host memory:
    the object's size), parsed and verified as a local file is; CPU storages
    are views of that buffer (as an mmap load's are of the mapping), CUDA
    storages copies. Safetensors objects and legacy torch files are
    recognised by their first bytes, as for paths (a safetensors object's CPU
    tensors are views of the buffer as well); so is the manifest of a
    collective save, whose part objects are then fetched into one buffer and
    verified the same way (:func:`fastpersist.distributed.objectstore.read_parts`).
    ``group=`` of ``fastpersist.load`` needs no exchange here: every rank
    reads the store itself.

    Raises:
        ObjectNotFoundError, BucketNotFoundError: (``FileNotFoundError``); also a
            missing part object of a collective save's checkpoint.
        TruncatedCheckpointError: a part object has another size than its manifest says.
        ObjectStoreCredentialsError: (``PermissionError``) the credentials were refused.
        ObjectStoreError: a network error; the object was replaced during the load.
        ObjectStoreUnavailableError: boto3 is missing.
        CorruptCheckpointError, ChecksumMismatchError: as for a local file.
        pickle.UnpicklingError: weights_only refused an object.
    """
    source = objectstore.target(url)
    path = source.path
    buffer, size = objectstore.download(source, settings)
    view = memoryview(buffer).cast("B")[:size]
    if size == 0:
        raise TruncatedCheckpointError(f"{path} is empty (0 bytes): it is not a checkpoint", path=path)
    if looks_like_manifest(bytes(view[:HEAD_SIZE])):  # a collective save's manifest: the checkpoint is in its parts
        from fastpersist.distributed import objectstore as parts  # torch.distributed only where needed

        buffer, size = parts.read_parts(source, bytes(view), settings)
        view = memoryview(buffer).cast("B")[:size]
    head = bytes(view[:16])
    if looks_like_safetensors(head):
        return dispatch.load_safetensors_buffer(buffer, size, map_location, path)
    if head[:4] != b"PK\x03\x04":  # legacy (pre-1.6) or foreign format: torch.load knows them
        return _TORCH_LOAD(io.BytesIO(view), map_location, **torch_kwargs)

    def read_at(offset: int, length: int) -> bytes:
        return bytes(view[offset : offset + length])

    records = RecordTable(read_rows(read_at, size, path, check=verify))
    prefix = archive_prefix(list(records), path)
    if prefix + "constants.pkl" in records:  # a TorchScript archive
        return _TORCH_LOAD(io.BytesIO(view), map_location, **torch_kwargs)
    pickle_bytes, order, verify = archive.metadata(read_at, records, prefix, path, verify, warn_unverifiable)
    whole = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
    provider = MemoryStorageProvider(whole, verify=verify, path=path)
    return archive.rebuild(
        pickle_bytes,
        records,
        prefix,
        provider,
        map_location=map_location,
        pickle_module=pickle_module,
        weights_only=weights_only,
        byteorder=order,
        path=path,
        pickle_load_args={"encoding": "utf-8", **pickle_load_args},
    )
