"""``save``: the drop-in replacement for ``torch.save``."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable
from typing import Any, BinaryIO

import torch

from fastpersist import config
from fastpersist.api import dispatch
from fastpersist.distributed import save as distributed_save
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io import targets, timeline
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
            are streamed through its ``write`` method), or a URL: ``s3://bucket/key``
            (an S3 or S3-compatible object store), ``memory://``, ``gs://``...
            (any fsspec filesystem); docs/object-storage.md.
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
            ObjectStoreUnavailableError (an ImportError) means boto3 (for other
            URLs: fsspec, or the package it names for the scheme) is missing.
            Other URLs fail as the store fails, the previous file intact
            (docs/object-storage.md).
            With ``group``, a collective save to ``s3://``: a failed rank's
            upload error is raised on every rank as DistributedCheckpointError.
    """
    destination = targets.resolve(f)  # the one decision of where the bytes go (fastpersist.io.targets)
    if destination.remote and "local_copy" in settings:
        raise TypeError(
            "save() has no local_copy: a two-tier save is fastpersist.async_save(obj, url, local_copy=path) (call "
            "result() on its future to wait for the upload)"
        )
    if dispatch.wants_safetensors(f, settings.pop("format", None)):
        # A store refuses any group=, a path only one of several ranks (without a process group it is a plain save).
        if distributed_save.is_collective(group) or (destination.remote and distributed_save.wants_group(group)):
            raise distributed_save.safetensors_refused(destination.path)
        dispatch.save_safetensors(obj, destination, settings)  # format="safetensors" or a .safetensors path
        return
    if destination.remote and not _use_new_zipfile_serialization:
        raise ValueError(
            f"the legacy format (_use_new_zipfile_serialization=False) cannot be saved to {destination.path}"
        )
    overrides, _ = config.split_overrides("save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if resolved.checksum and not _torch_compute_crc32():
        resolved = resolved.replace(checksum=False)  # torch.serialization.set_crc32_options(False)
    if distributed_save.is_collective(group):
        distributed_save.save(
            obj,
            destination,
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
    if not destination.remote and torch_writes_it(_use_new_zipfile_serialization):
        _TORCH_SAVE(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record)
        return
    timeline.mark("call")
    destination = destination.checked()
    plan = plan_save(
        obj, archive_name_for(destination.given), pickle_module, pickle_protocol, _disable_byteorder_record
    )
    timeline.mark("pickled")
    destination.commit_plan(plan, resolved, streams=None)


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
