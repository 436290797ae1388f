"""``save``: the drop-in replacement for ``torch.save``."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable
from typing import Any, BinaryIO

import torch

from fastpersist import config
from fastpersist.api import dispatch, objectstore
from fastpersist.distributed import save as distributed_save
from fastpersist.errors import NotWritableError
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io import timeline
from fastpersist.io.commit import commit_plan, fsync_file_object, target
from fastpersist.io.stream import write_plan_to_stream
from fastpersist.tensors import torch_serialization_config

__all__ = ["save", "torch_writes_it"]

_TORCH_SAVE = torch.serialization.save  # torch's own, even where torch.save is patched to ours


def save(
    obj: object,
    f: str | os.PathLike[str] | BinaryIO,
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
    *,
    group: Any = None,
    layout: str | None = None,
    writers: str = "all",
    divergence: str = "warn",
    per_rank: Iterable[str] = (),
    timeout: float | None = None,
    **settings: Any,
) -> None:
    """Saves ``obj`` like ``torch.save``, as fast as the storage allows.

    The file is a standard torch zip checkpoint that ``torch.load`` reads,
    with storage payloads at 4 KiB-aligned offsets and CRC-32 checksums.

    Saving to a path is atomic: the bytes go to a temporary file beside the
    target, which is fsynced and renamed over the target, and the directory is
    fsynced; the old file stays intact until the new one is complete. When
    ``save`` returns the checkpoint is durable (unless ``fsync=False``).

    Do not modify the tensors in ``obj`` until ``save`` returns.

    Args:
        obj: what to save (anything ``torch.save`` accepts).
        f: a path, or a writable binary file object (slower path: the bytes
            are streamed through its ``write`` method), or ``s3://bucket/key``
            (an S3 or S3-compatible object store; docs/object-storage.md).
        pickle_module, pickle_protocol, _use_new_zipfile_serialization,
            _disable_byteorder_record: as ``torch.save``.
        group: a ``torch.distributed`` process group (or ``True`` for the
            default one): a collective, data-parallel save that every rank
            calls; the file holds rank 0's object (what ``torch.save`` on
            rank 0 writes), and every rank writes the slices of it that it
            holds byte for byte (see :mod:`fastpersist.distributed`,
            docs/distributed.md). Without a group, or with a group of one
            rank, it is the ordinary single-process save. ``f`` must then be
            a path.
        layout: (with ``group``) ``"file"``: one ordinary checkpoint on a
            shared filesystem; ``"parts"``: one part per writer on its own
            storage, plus a manifest at ``f``. Default: ``"file"`` for paths,
            ``"parts"`` for ``s3://`` URLs (part objects and a manifest
            object; ``"file"`` is refused there with ``ValueError``).
            Collective saves write torch-format checkpoints: with safetensors
            (``format="safetensors"`` or a ``.safetensors`` path) and a group
            of more than one rank, ``ValueError``.
        writers: (with ``group``) ``"all"`` ranks write, or one per ``"node"``.
        divergence: (with ``group``) when a rank's tensor has other values
            than rank 0's (same key and size): ``"warn"`` writes rank 0's and
            warns (:class:`~fastpersist.errors.ReplicaDivergenceWarning`),
            ``"error"`` raises on every rank, ``"ignore"`` writes rank 0's.
            Tensors whose bytes differ but whose values are the same (another
            memory layout) are not divergent.
        per_rank: (with ``group``) key paths of per-rank state (``"rng"``,
            ``"callbacks"``, ``"loops.fit_loop"``): their values are expected
            to differ between ranks, are saved as rank 0's and never warned
            about or refused.
        timeout: (with ``group``) seconds a rank waits for the others at each
            step before raising (default 600).
        **settings: per-call overrides of any ``fastpersist.config`` setting
            (``buffer_size``, ``engine``, ``fsync``, ``checksum``, ...), and
            ``format="torch"|"safetensors"`` (default: safetensors for paths
            ending in ``.safetensors``; see :mod:`fastpersist.api.dispatch`).

    Raises:
        UnsupportedObjectError: ``obj`` cannot be pickled (nothing is written).
        IsADirectoryError: the target path is a directory.
        TargetDirectoryMissingError: (FileNotFoundError, RuntimeError) its
            directory is missing.
        TargetPermissionError: (PermissionError, RuntimeError) the file may
            not be written (e.g. mode 0444), or a new one not created; nothing
            changes. ``OSError`` with ``errno.EROFS`` on a read-only filesystem.
        MixedDtypeViewsError: (RuntimeError, TypeError) two tensors view one
            storage with different dtypes.
        NotWritableError: (AttributeError, TypeError) ``f`` is neither a path
            nor has a ``write`` method.
        OSError: an I/O error (ENOSPC, EIO, ...), with ``errno`` and
            ``filename`` set; the previous file at the target is untouched and
            no temporary file is left behind.
        TypeError: an unknown keyword argument.
        ConfigError: an invalid setting value.
        ObjectStoreError: (``s3://``, a CheckpointIOError) the upload failed;
            it was aborted and the previous object is intact. Its subclasses
            ObjectStoreCredentialsError and BucketNotFoundError name the cause;
            ObjectStoreUnavailableError (an ImportError) means boto3 is missing.
            With ``group``, a collective save to ``s3://``: a failed rank's
            upload error is raised on every rank as DistributedCheckpointError.
    """
    if objectstore.is_object_url(f):  # s3://bucket/key: a multipart upload (docs/object-storage.md)
        objectstore.save(
            obj,
            f,
            pickle_module,
            pickle_protocol,
            _use_new_zipfile_serialization,
            _disable_byteorder_record,
            group=group,
            torch_crc32=_torch_compute_crc32(),
            settings=settings,
            collective=dict(layout=layout, writers=writers, divergence=divergence, per_rank=per_rank, timeout=timeout),
        )
        return
    if dispatch.wants_safetensors(f, settings.pop("format", None)):
        if distributed_save.is_collective(group):
            raise distributed_save.safetensors_refused(f)
        dispatch.save_safetensors(obj, f, settings)  # format="safetensors" or a .safetensors path
        return
    overrides, _ = config.split_overrides("save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if resolved.checksum and not _torch_compute_crc32():
        resolved = resolved.replace(checksum=False)  # torch.serialization.set_crc32_options(False)
    if distributed_save.is_collective(group):
        if not isinstance(f, (str, os.PathLike)):
            raise TypeError("a collective save (group=...) needs a path, not a file object")
        distributed_save.save(
            obj,
            f,
            group=group,
            layout=layout,
            writers=writers,
            divergence=divergence,
            per_rank=per_rank,
            timeout=timeout,
            pickle_module=pickle_module,
            pickle_protocol=pickle_protocol,
            disable_byteorder_record=_disable_byteorder_record,
            settings=resolved,
        )
        return
    if torch_writes_it(_use_new_zipfile_serialization):
        _TORCH_SAVE(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record)
        return
    if isinstance(f, (str, os.PathLike)):
        timeline.mark("call")
        destination = target(f)
        plan = plan_save(
            obj, archive_name_for(destination.given), pickle_module, pickle_protocol, _disable_byteorder_record
        )
        timeline.mark("pickled")
        commit_plan(plan, destination, resolved, streams=None)
    else:
        if not callable(getattr(f, "write", None)):
            raise NotWritableError(
                f"expected 'f' to be a string, path, or a file-like object with a 'write' attribute, "
                f"got {type(f).__name__}"
            )
        plan = plan_save(obj, archive_name_for(None), pickle_module, pickle_protocol, _disable_byteorder_record)
        write_plan_to_stream(plan, f, checksum=resolved.checksum, chunk_size=resolved.buffer_size)
        if callable(getattr(f, "flush", None)):
            f.flush()
        if resolved.fsync:
            fsync_file_object(f)


def torch_writes_it(use_new_zipfile_serialization: bool = True) -> bool:
    """Whether a save is left to ``torch.save`` itself: the legacy (pre-1.6) format, which has no aligned
    records, or a save inside ``torch.serialization.skip_data()``, whose files are headers around holes
    (torch's fake-tensor workflow)."""
    return not use_new_zipfile_serialization or _torch_skip_data()


def _torch_skip_data() -> bool:
    """Inside ``torch.serialization.skip_data()``."""
    from torch.serialization import _serialization_tls

    return bool(getattr(_serialization_tls, "skip_data", False))


def _torch_compute_crc32() -> bool:
    """torch's ``config.save.compute_crc32`` (``torch.serialization.set_crc32_options``)."""
    try:
        return bool(torch_serialization_config.save.compute_crc32)
    except AttributeError:
        return True
