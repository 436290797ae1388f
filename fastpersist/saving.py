"""``save``: the drop-in replacement for ``torch.save``."""

from __future__ import annotations

import os
import pickle
from typing import Any, BinaryIO

import torch

from fastpersist import config, formats
from fastpersist.commit import check_target, commit_plan, fsync_file_object, resolve_target
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io.stream import write_plan_to_stream

__all__ = ["save"]


def save(
    obj: object,
    f: str | os.PathLike[str] | BinaryIO,
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
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
            are streamed through its ``write`` method).
        pickle_module, pickle_protocol, _use_new_zipfile_serialization,
            _disable_byteorder_record: as ``torch.save``.
        **settings: per-call overrides of any ``fastpersist.config`` setting
            (``buffer_size``, ``engine``, ``fsync``, ``checksum``, ...), and
            ``format="torch"|"safetensors"`` (default: safetensors for paths
            ending in ``.safetensors``; see :mod:`fastpersist.formats`).

    Raises:
        UnsupportedObjectError: ``obj`` cannot be pickled (nothing is written).
        IsADirectoryError, FileNotFoundError, PermissionError: the target
            path is a directory, its directory is missing, or not writable
            (``OSError`` with ``errno.EROFS`` on a read-only filesystem).
        OSError: an I/O error (ENOSPC, EIO, ...), with ``errno`` and
            ``filename`` set; the previous file at the target is untouched and
            no temporary file is left behind.
        TypeError: an unknown keyword argument.
        ConfigError: an invalid setting value.
    """
    if formats.wants_safetensors(f, settings.pop("format", None)):
        formats.save_safetensors(obj, f, settings)  # format="safetensors" or a .safetensors path
        return
    overrides, _ = config.split_overrides("save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if not _use_new_zipfile_serialization:
        # The legacy (pre-1.6) format has no aligned records; torch writes it.
        torch.save(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization=False)
        return
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        directory = check_target(resolve_target(path))
        plan = plan_save(obj, archive_name_for(path), pickle_module, pickle_protocol, _disable_byteorder_record)
        path = resolve_target(path)
        commit_plan(plan, path, directory, resolved, streams=None)
    else:
        plan = plan_save(obj, archive_name_for(None), pickle_module, pickle_protocol, _disable_byteorder_record)
        write_plan_to_stream(plan, f, checksum=resolved.checksum, chunk_size=resolved.buffer_size)
        if callable(getattr(f, "flush", None)):
            f.flush()
        if resolved.fsync:
            fsync_file_object(f)

