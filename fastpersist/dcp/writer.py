"""``FastPersistWriter``: a ``torch.distributed.checkpoint`` StorageWriter over fastpersist's engine.

Usage::

    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistWriter

    dcp.save(state_dict, storage_writer=FastPersistWriter("/ckpt/step-100"))
    dcp.async_save(state_dict, storage_writer=FastPersistWriter("/ckpt/step-100")).result()

The directory it writes is the one DCP's ``FileSystemWriter`` would write
(``.metadata`` plus ``__{rank}_{n}.distcp`` files of torch.save archives and
raw bytes), so ``FileSystemReader`` loads it; see :mod:`fastpersist.dcp.layout`.

How each rank writes its file (``write_data``): its items are laid out
(:func:`~fastpersist.dcp.layout.place_items`), and the file, as a
:class:`~fastpersist.dcp.layout.FilePlan`, is written in one sequential pass
by the writer of ``fastpersist.save`` (:func:`fastpersist.io.writer.write_plan`):
tensors are copied into a ring of page-locked buffers (CPU tensors with their
CRC-32 computed in the same pass, GPU tensors by device-to-host copies on a
side CUDA stream, checksummed on the CRC-32 pool) while earlier buffers are
written with O_DIRECT; each archive's descriptors and central directory go in
once its payload's CRC-32 is known. The file and the directory are fsynced
before ``write_data`` returns.

Commit (``finish``, coordinator only, which DCP calls only once every rank's
``write_data`` succeeded -- a failure on any rank fails the save on every
rank): the ``.metadata`` goes to a temporary file that is fsynced and renamed
into place, then the directory is fsynced. An existing ``.metadata`` in the
directory is removed (durably) before any rank writes, so a save that dies
half way never leaves a ``.metadata`` pointing at half-written files.

Under a URL (``s3://bucket/prefix``, ``memory://dir``, any fsspec
filesystem's; :mod:`fastpersist.io.targets`), the same files become objects
(or files) under the prefix, byte for byte: each rank writes each of its
files through the target's commit, executing a
:class:`~fastpersist.dcp.layout.FilePlan` (for S3 one multipart upload fed by
the ring writer: ``s3_concurrency`` parts of ``s3_part_size`` in flight, host
memory bounded by the ring, the upload aborted on any failure). The
coordinator deletes a stale ``.metadata`` before any rank writes, and
``finish`` checks that every rank's files are there with their sizes before it
stores ``.metadata`` (for S3 one PutObject), the commit. A checkpoint under a
prefix holds exactly the files of a local directory, under the same names, so
a copied prefix loads with DCP's ``FileSystemReader`` and an uploaded
directory from a URL.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import uuid
import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import (
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from fastpersist import config
from fastpersist.dcp.layout import (
    BytesItem,
    FileLayout,
    FilePlan,
    file_name,
    place_items,
)
from fastpersist.format.dcp import EXTENSION_ATTRIBUTE, EXTENSION_VERSION, METADATA_FILE
from fastpersist.io import engine, targets
from fastpersist.io.commit import fsync_directory
from fastpersist.io.writer import write_plan

__all__ = ["METADATA_FILE", "FastPersistWriter", "validate_checkpoint_path"]

CURRENT_DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION


def validate_checkpoint_path(checkpoint_id: str | os.PathLike) -> bool:
    """Whether fastpersist's writer and reader take ``checkpoint_id``: a URL whose store can be reached (its
    package installed), or, as ``FileSystem.validate_checkpoint_id`` accepts, a local path with a writable
    ancestor."""
    try:
        target = targets.resolve(checkpoint_id)
    except (ValueError, ImportError):
        return False  # a scheme no store knows, a store whose package is missing, a URL made a path object
    if target.remote:
        return True
    if isinstance(checkpoint_id, Path):
        return True
    if "://" in str(checkpoint_id):
        return False
    return any(p.exists() and os.access(str(p), os.W_OK) for p in Path(checkpoint_id).parents)


class FastPersistWriter(StorageWriter):
    """DCP StorageWriter that writes FileSystemWriter-compatible checkpoints with fastpersist's engine.

    Args:
        path: the checkpoint directory (created if missing), or a URL (a
            string: ``s3://bucket/prefix``, ``memory://dir``...) under which
            the files become objects. ``dcp.save(..., checkpoint_id=...)`` replaces it.
        files_per_rank: ``.distcp`` files each rank writes (items are spread
            by size, like FileSystemWriter's ``thread_count``). One file is
            usually fastest: the engine parallelises within it.
        sync_files: fsync every file and the directory (durable checkpoint).
            With False a crash may leave a checkpoint that fails its checksums.
            (No effect under a URL: the store's commit is what it is.)
        overwrite: allow saving into a directory that holds a checkpoint
            (its ``.metadata`` is removed first); False raises instead.
        **settings: ``fastpersist.config`` overrides (``buffer_size``,
            ``buffer_count``, ``engine``, ``direct``, ``block_size``,
            ``queue_depth``, ``intra_op_parallelism``, ``checksum``; under a
            URL: ``buffer_size``, ``buffer_count``, for ``s3://`` also
            ``s3_part_size``, ``s3_concurrency``).

    Raises:
        TypeError: an unknown keyword argument.
        ConfigError: an invalid setting value.
        ValueError: a URL without a bucket, or made a ``pathlib`` path; a scheme no store knows.
        ObjectStoreUnavailableError: the package of the URL's store is missing.

    Raises from ``dcp.save`` (DCP wraps a rank's error in a ``CheckpointException``
    raised on every rank; no ``.metadata`` is left behind):
        FileExistsError: ``overwrite=False`` and the target holds a checkpoint.
        OSError: a local write failed (``errno`` and ``filename`` set).
        BucketNotFoundError, ObjectStoreCredentialsError, ObjectStoreError:
            a request under a URL failed (the rank's upload in progress is
            aborted), or a rank's object is missing or was overwritten
            before the commit; ObjectStoreUnavailableError: boto3 is missing.

    Call order (DCP's): ``reset`` -> ``set_up_storage_writer`` ->
    ``prepare_local_plan`` -> (coordinator) ``prepare_global_plan`` ->
    ``write_data`` -> (coordinator) ``finish``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        files_per_rank: int = 1,
        sync_files: bool = True,
        overwrite: bool = True,
        **settings: Any,
    ) -> None:
        super().__init__()
        overrides, _ = config.split_overrides("FastPersistWriter", settings, allow_other=False)
        self.settings = config.resolve(overrides)
        if files_per_rank < 1:
            raise ValueError(f"files_per_rank must be >= 1, got {files_per_rank}")
        self._locate(path)
        self.files_per_rank = int(files_per_rank)
        self.sync_files = bool(sync_files)
        self.overwrite = bool(overwrite)
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = True

    # -- StorageWriter ---------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self._locate(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.target.local:  # (under a URL, the coordinator's retraction checks overwrite)
            self.target.make_directory()
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            if self._metadata_path(0 if not self.use_collectives else None).exists() and not self.overwrite:
                raise FileExistsError(
                    f"{self.path} already holds a checkpoint and overwrite=False; save to a new directory "
                    "or pass FastPersistWriter(..., overwrite=True)"
                )
        if self.rank is not None and not self.use_collectives:
            self._retract_metadata(self.rank)
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: from here until finish() the
        # directory holds no .metadata, so a save that dies half way leaves no checkpoint
        # that points at half-written files.
        self._retract_metadata()
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_")) if plan.storage_data is None else plan
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: _StoragePrefix = plan.storage_data
        buckets = _split_by_size_and_type(self.files_per_rank, list(plan.items))
        store = self.target.connected(self.settings) if not self.target.local and plan.items else None
        results: list[WriteResult] = []
        for number, bucket in enumerate(b for b in buckets if b):
            entries = []
            # Bytes items first, as FileSystemWriter does; tensors in plan order.
            for item in sorted(bucket, key=lambda i: i.type != WriteItemType.BYTE_IO):
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    data = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
                entries.append((item.index, data))
            layout = place_items(file_name(prefix.prefix, number), entries)
            del entries
            results += self._write_file(layout, store)
        if self.sync_files and results and self.target.local:
            fsync_directory(str(self.path))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for result_list in results:
            storage_md.update({result.index: result.storage_data for result in result_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        per_rank = not self.use_collectives and self.rank is not None
        if not self.target.local:
            store = self.target.connected(self.settings)
            store.check_sizes(_file_sizes(results), self.settings)
            store.child(self._metadata_name(self.rank if per_rank else None)).put_bytes(
                pickle.dumps(metadata), self.settings
            )
            return
        target = self._metadata_path(self.rank if per_rank else None)
        temporary = target.with_name(target.name + ".tmp")
        with open(temporary, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        os.replace(temporary, target)
        if self.sync_files:
            fsync_directory(str(self.path))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return validate_checkpoint_path(checkpoint_id)

    # -- internals -------------------------------------------------------------

    def _locate(self, path: str | os.PathLike) -> None:
        self.target = targets.resolve(path).as_directory()  # where the files go (fastpersist.io.targets)
        self.path = Path(path) if self.target.local else self.target.path

    def _metadata_name(self, rank: int | None = None) -> str:
        return METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"

    def _metadata_path(self, rank: int | None = None) -> Path:
        return self.path / self._metadata_name(rank)

    def _retract_metadata(self, rank: int | None = None) -> None:
        name = self._metadata_name(rank)
        stored = None
        if self.target.local:
            if not self._metadata_path(rank).exists():
                return
        else:
            stored = self.target.connected(self.settings).child(name)
            if not stored.exists():
                return
        if not self.overwrite:
            raise FileExistsError(f"{self.path} already holds a checkpoint and overwrite=False")
        warnings.warn(
            f"Detected an existing checkpoint in {self.path}, overwriting it",
            stacklevel=3,
        )
        if stored is not None:
            stored.remove()
            return
        self._metadata_path(rank).unlink()
        if self.sync_files:
            fsync_directory(str(self.path))

    def _write_file(self, layout: FileLayout, store=None) -> list[WriteResult]:
        if store is None:
            crcs = write_layout(layout, str(self.path / layout.name), self.settings, fsync=self.sync_files)
        else:
            plan = FilePlan.of(layout)
            crcs = plan.payload_crcs(store.child(layout.name).commit_plan(plan, self.settings, None))
        results = []
        for position, item in enumerate(layout.items):
            info = _StorageInfo(layout.name, item.base, item.length)
            if isinstance(item, BytesItem):
                extension = {
                    "version": EXTENSION_VERSION,
                    "kind": "bytes",
                    "offset": item.base,
                    "nbytes": item.length,
                    "crc32": item.crc,
                }
            else:
                extension = {
                    "version": EXTENSION_VERSION,
                    "kind": "tensor",
                    "offset": item.payload_offset,
                    "nbytes": item.nbytes,
                    "crc32": crcs[position] if self.settings.checksum else None,
                    "dtype": str(item.tensor.dtype).removeprefix("torch."),
                    "shape": tuple(item.tensor.shape),
                }
            setattr(info, EXTENSION_ATTRIBUTE, extension)
            results.append(WriteResult(index=item.index, size_in_bytes=item.length, storage_data=info))
        return results


def _file_sizes(results: list[list[WriteResult]]) -> dict[str, int]:
    """Each written file's size, by name: where its last item ends (a layout ends there)."""
    sizes: dict[str, int] = {}
    for result_list in results:
        for result in result_list:
            info = result.storage_data
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return sizes


def write_layout(layout: FileLayout, path: str, settings: config.Settings, *, fsync: bool = True) -> dict[int, int]:
    """Writes every byte of ``layout`` to ``path`` (replacing it); returns payload CRC-32s by item position.

    The file is written in one sequential pass by the ring writer
    (:func:`fastpersist.io.writer.write_plan` executing it as a
    :class:`~fastpersist.dcp.layout.FilePlan`), as an upload to ``s3://`` is:
    the same bytes either way.

    On error nothing is left in flight, the partial file is removed and the
    error (``OSError`` with ``errno`` and ``filename``) propagates.
    """
    plan = FilePlan.of(layout)
    file = engine.File(path, "w", direct=settings.direct, truncate=True)
    try:
        try:
            if file.direct and layout.size:
                file.allocate(0, layout.size)  # cheaper O_DIRECT writes; a full disk fails here
            crcs = write_plan(plan, file, settings)
            if fsync:
                file.fsync()
        finally:
            file.close()
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return plan.payload_crcs(crcs)
