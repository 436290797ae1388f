"""``FastPersistReader``: a ``torch.distributed.checkpoint`` StorageReader over fastpersist's engine.

Usage::

    dcp.load(state_dict, storage_reader=FastPersistReader("/ckpt/step-100"))

Reads checkpoints written by :class:`~fastpersist.dcp.FastPersistWriter` and
by DCP's own ``FileSystemWriter``.

For items written by fastpersist (their ``_StorageInfo`` carries the
``fastpersist`` extension: payload offset, length, CRC-32, dtype, shape):

* a read that covers a whole saved chunk into a contiguous CPU tensor of the
  same dtype is read *in place*: the engine reads the payload straight into
  the destination tensor DCP provides (O_DIRECT for the page-aligned middle
  when the tensor's address and the payload's offset agree within a page,
  which the writer arranges for tensors from torch's allocator), all reads in
  flight at once, each checksummed as soon as it lands;
* the same into a CUDA tensor streams through a ring of page-locked buffers
  with host-to-device copies on a side stream;
* anything else (resharding reads of part of a chunk, dtype or layout
  changes) reads the whole payload once into page-aligned memory, verifies
  it, and copies the requested slices.

Items without the extension (FileSystemWriter's) are read with the engine,
their archive's zip CRC-32s are verified (when the writer computed them) and
they are unpickled with ``torch.load(weights_only=True)``, as DCP's reader does.

Under a URL (``s3://bucket/prefix``, ``memory://dir``...; :mod:`fastpersist.io.targets`)
the same files are objects: ``read_metadata`` fetches ``.metadata``, and each
rank's items are read with ranged reads through the target
(:meth:`~fastpersist.io.targets.base.Target.read_ranges`; for S3
``io.targets.s3.ranges.read_ranges``: ``s3_concurrency`` GETs of at most
``s3_part_size``, reads of one object that touch or lie within 64 KiB
sharing one, every GET conditional on the ETag the object had when first
asked for). Whole chunks land straight in the tensors DCP provides (CPU) and
are verified there; everything else lands in host buffers, at most
``s3_concurrency * s3_part_size`` bytes of them at a time, and is verified,
parsed and copied as above. Objects of ``FileSystemWriter`` checkpoints
uploaded under a prefix are read the same way.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import pickle
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fastpersist import config
from fastpersist.dcp.layout import PAGE
from fastpersist.dcp.writer import validate_checkpoint_path
from fastpersist.errors import ChecksumMismatchError, CorruptCheckpointError, ObjectNotFoundError
from fastpersist.format.dcp import METADATA_FILE, extension_of
from fastpersist.format.deserializer import archive_prefix, deserialize
from fastpersist.format.zipformat import read_directory
from fastpersist.io import engine, memory, targets
from fastpersist.io.reader import stream_to_device
from fastpersist.tensors import cast_to_byte_tensor, host_memoryview

__all__ = ["FastPersistReader"]

_VERIFY_THREADS = 2
_POLL_SECONDS = 0.0002


class FastPersistReader(StorageReader):
    """DCP StorageReader with parallel, in-place, verified reads.

    Args:
        path: the checkpoint directory, or the URL (a string:
            ``s3://bucket/prefix``, ``memory://dir``...) of one.
            ``dcp.load(..., checkpoint_id=...)`` replaces it.
        verify: check every item's CRC-32 (fastpersist's extension, or the
            zip CRC-32s of FileSystemWriter archives). Default: the
            ``verify`` setting (on).
        **settings: ``fastpersist.config`` overrides (``engine``, ``direct``,
            ``block_size``, ``queue_depth``, ``intra_op_parallelism``,
            ``read_buffer_size``, ``read_buffer_count``, ``huge_pages``; for
            ``s3://``: ``s3_part_size``, ``s3_concurrency``).

    Raises:
        ValueError: a URL without a bucket, or made a ``pathlib`` path; a scheme no store knows.
        ObjectStoreUnavailableError: the package of the URL's store is missing.

    Raises (from ``dcp.load``, wrapped by DCP in a ``CheckpointException`` on every rank):
        ChecksumMismatchError: an item's bytes do not match their CRC-32.
        CorruptCheckpointError: an item's archive is damaged;
            (``TruncatedCheckpointError``) an object is shorter than its items.
        FileNotFoundError: no ``.metadata`` (not a committed checkpoint) or a
            missing data file; under a prefix ``ObjectNotFoundError``, or
            ``BucketNotFoundError`` where the bucket does not exist.
        ObjectStoreCredentialsError, ObjectStoreError: an ``s3://`` request
            was refused or the network failed; an object was replaced while
            it was read (``code="PreconditionFailed"``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        verify: bool | None = None,
        _extension_registry: Any = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        self.extension_registry = _extension_registry  # DCP's (experimental) stream transforms
        overrides, _ = config.split_overrides("FastPersistReader", settings, allow_other=False)
        self.settings = config.resolve(overrides)
        self.verify = self.settings.verify if verify is None else bool(verify)
        self._locate(path)
        self.storage_data: dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True

    # -- StorageReader ---------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self._locate(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        if not self.target.local:
            metadata = self._fetch_metadata(name)
        else:
            metadata = self._open_metadata(self.path / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _open_metadata(self, path: Path) -> Metadata:
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                e.errno,
                f"{self.path} holds no committed checkpoint (no {path.name}): the save did not finish, "
                "or this is not a checkpoint directory",
                str(path),
            ) from None

    def _fetch_metadata(self, name: str) -> Metadata:
        stored = self.target.connected(self.settings).child(name)
        try:
            buffer, size = stored.download(self.settings)
        except ObjectNotFoundError as e:
            raise ObjectNotFoundError(
                e.errno,
                f"{self.target.path} holds no committed checkpoint (no {name} object): the save did not finish, "
                f"or this is not a checkpoint prefix (list {self.target.path}/ to see what it holds)",
                e.filename,
                code=e.code,
            ) from None
        return pickle.loads(memoryview(buffer).cast("B")[:size])

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.path}/{METADATA_FILE} has no storage data", path=str(self.path))
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        (_PlanReader if self.target.local else _StorePlanReader)(self, planner).run(plan.items)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return validate_checkpoint_path(checkpoint_id)

    def _locate(self, path: str | os.PathLike) -> None:
        self.target = targets.resolve(path).as_directory()  # where the files are (fastpersist.io.targets)
        self.path = Path(path) if self.target.local else self.target.path


def _whole_chunk(request: ReadItem, shape: tuple) -> bool:
    return all(o == 0 for o in request.storage_offsets) and tuple(request.lengths) == tuple(shape)


class _PlanReader:
    """Carries out one rank's LoadPlan."""

    def __init__(self, reader: FastPersistReader, planner: LoadPlanner):
        self.reader = reader
        self.planner = planner
        self.settings = reader.settings
        self.verify = reader.verify
        self.files: dict[str, Any] = {}

    def run(self, items: list[ReadItem]) -> None:
        try:
            self._carry_out(*self._classify(items))
        finally:
            for file in self.files.values():
                file.close()

    def _classify(self, items: list[ReadItem]) -> tuple[list, ...]:
        """The rank's reads by path: (in place, to a device, staged, FileSystemWriter's, bytes, transformed)."""
        groups: dict[Any, list[ReadItem]] = {}
        for item in items:
            groups.setdefault(item.storage_index, []).append(item)
        in_place, to_device, staged, foreign, raw, transformed = [], [], [], [], [], []
        for index, requests in groups.items():
            info = self.reader.storage_data[index]
            if getattr(info, "transform_descriptors", None):
                transformed.append((requests, info))
                continue
            extension = extension_of(info)
            if requests[0].type == LoadItemType.BYTE_IO:
                raw += [(request, info, extension) for request in requests]
            elif extension is None:
                foreign.append((requests, info))
            elif len(requests) == 1 and _whole_chunk(requests[0], extension["shape"]):
                request = requests[0]
                destination = self.planner.resolve_tensor(request).detach()
                if destination.dtype != _dtype(extension) or not destination.is_contiguous():
                    staged.append((requests, info, extension))
                elif destination.device.type == "cpu":
                    in_place.append((request, destination, info, extension))
                elif destination.device.type == "cuda":
                    to_device.append((request, destination, info, extension))
                else:
                    staged.append((requests, info, extension))
            else:
                staged.append((requests, info, extension))
        return in_place, to_device, staged, foreign, raw, transformed

    def _carry_out(self, in_place, to_device, staged, foreign, raw, transformed) -> None:
        self._read_in_place(in_place)
        self._read_to_device(to_device)
        for entry in staged:
            self._read_staged(*entry)
        for entry in foreign:
            self._read_foreign(*entry)
        for entry in raw:
            self._read_bytes(*entry)
        for entry in transformed:
            self._read_transformed(*entry)

    # -- helpers ---------------------------------------------------------------

    def _file(self, relative_path: str):
        file = self.files.get(relative_path)
        if file is None:
            file = self.files[relative_path] = engine.File(
                str(self.reader.path / relative_path), "r", direct=self.settings.direct
            )
        return file

    def _where(self, info) -> str:
        return str(self.reader.path / info.relative_path)

    def _check(self, crc: int, extension: dict, info, request: ReadItem) -> None:
        if extension["crc32"] is None:
            return  # written with checksum=False
        if crc != extension["crc32"]:
            raise ChecksumMismatchError(
                f"{self._where(info)}: item {request.storage_index.fqn!r} (offset {info.offset}) is corrupt: "
                f"its CRC-32 is {crc:#010x}, the checkpoint's metadata says {extension['crc32']:#010x}. "
                "Restore the checkpoint from a good copy",
                path=self._where(info),
                record=request.storage_index.fqn,
            )

    def _aligned_like(self, offset: int, nbytes: int, element_size: int = 1) -> torch.Tensor:
        """uint8 CPU memory whose address agrees with file ``offset`` within a page (direct reads)."""
        residue = offset % PAGE
        if residue % element_size:
            residue = 0
        buffer = memory.destination_buffer(residue + nbytes, self.settings.huge_pages)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=residue)

    def _read_exact(self, info, offset: int, nbytes: int, element_size: int = 1) -> torch.Tensor:
        destination = self._aligned_like(offset, nbytes, element_size)
        if nbytes:
            handle = engine.make_handle(self.settings)
            handle.submit_read(
                destination.data_ptr(),
                nbytes,
                self._file(info.relative_path),
                offset,
                destination,
            )
            handle.wait()
        return destination

    # -- paths -----------------------------------------------------------------

    def _read_in_place(self, entries: list) -> None:
        if not entries:
            return
        handle = engine.make_handle(self.settings)
        requests = []
        checks = []
        pool = concurrent.futures.ThreadPoolExecutor(_VERIFY_THREADS) if self.verify else None
        try:
            for request, destination, info, extension in entries:
                nbytes = extension["nbytes"]
                if nbytes:
                    native = handle.submit_read(
                        destination.data_ptr(), nbytes, self._file(info.relative_path), extension["offset"], destination
                    )
                    requests.append((native, request, destination, info, extension))
            if pool is not None:
                # Checksum each tensor as soon as its bytes are in, while later reads are in flight.
                for native, request, destination, info, extension in requests:
                    while not native.done:
                        time.sleep(_POLL_SECONDS)
                    if native.failed:
                        break  # wait() below raises the read error
                    checks.append(
                        (
                            pool.submit(engine.crc32, destination.data_ptr(), extension["nbytes"], 0),
                            request,
                            info,
                            extension,
                        )
                    )
        finally:
            try:
                handle.wait()
            finally:
                if pool is not None:
                    pool.shutdown(wait=True)
        for future, request, info, extension in checks:
            self._check(future.result(), extension, info, request)
        for request, destination, _, _ in entries:
            self.planner.commit_tensor(request, destination)

    def _read_to_device(self, entries: list) -> None:
        pieces = [
            (
                self._file(info.relative_path),
                extension["offset"],
                extension["nbytes"],
                cast_to_byte_tensor(destination),
            )
            for _, destination, info, extension in entries
        ]
        crcs = stream_to_device(pieces, self.settings, verify=self.verify)
        for (request, destination, info, extension), crc in zip(entries, crcs):
            if self.verify:
                self._check(crc, extension, info, request)
            self.planner.commit_tensor(request, destination)

    def _read_staged(self, requests: list[ReadItem], info, extension: dict) -> None:
        dtype = _dtype(extension)
        element_size = torch.empty(0, dtype=dtype).element_size()
        data = self._read_exact(info, extension["offset"], extension["nbytes"], element_size)
        if self.verify:
            crc = engine.crc32(data.data_ptr(), extension["nbytes"]) if extension["nbytes"] else 0
            self._check(crc, extension, info, requests[0])
        stored = data.view(dtype).reshape(extension["shape"])
        for request in requests:
            self._copy_into(
                request,
                narrow_tensor_by_index(stored, request.storage_offsets, request.lengths),
            )

    def _read_foreign(self, requests: list[ReadItem], info) -> None:
        """A FileSystemWriter item: a torch.save archive, unpickled over the bytes read (no second copy)."""
        data = self._read_exact(info, info.offset, info.length)
        where = self._where(info)
        base = data.data_ptr()

        def read_at(offset: int, length: int) -> bytes:
            return bytes(host_memoryview(data)[offset : offset + length])

        records = {r.name: r for r in read_directory(read_at, info.length, where)}
        if self.verify and any(r.crc for r in records.values() if r.size):
            for record in records.values():  # (no CRC-32s at all: torch's compute_crc32=False)
                crc = engine.crc32(base + record.data_offset, record.size) if record.size else 0
                if crc != record.crc:
                    raise ChecksumMismatchError(
                        f"{where}: item {requests[0].storage_index.fqn!r} (offset {info.offset}) is corrupt: "
                        f"record {record.name!r} has CRC-32 {crc:#010x}, its archive says {record.crc:#010x}. "
                        "Restore the checkpoint from a good copy",
                        path=where,
                        record=requests[0].storage_index.fqn,
                    )
        prefix = archive_prefix(list(records), where)
        pickle_record = records[prefix + "data.pkl"]
        byteorder = records.get(prefix + "byteorder")
        stored = deserialize(
            read_at(pickle_record.data_offset, pickle_record.size),
            records,
            prefix,
            _SliceProvider(data),
            map_location="cpu",
            weights_only=True,
            byteorder=read_at(byteorder.data_offset, byteorder.size) if byteorder else None,
            path=where,
        )
        if not isinstance(stored, torch.Tensor):
            raise CorruptCheckpointError(
                f"{where}: item {requests[0].storage_index.fqn!r} holds a {type(stored).__name__}, not a tensor",
                path=where,
            )
        for request in requests:
            self._copy_into(
                request,
                narrow_tensor_by_index(stored, request.storage_offsets, request.lengths),
            )

    def _copy_into(self, request: ReadItem, source: torch.Tensor) -> None:
        destination = self.planner.resolve_tensor(request).detach()
        if destination.size() != source.size():
            raise CorruptCheckpointError(
                f"{self.reader.path}: item {request.storage_index.fqn!r}: the checkpoint holds shape "
                f"{tuple(source.size())} where {tuple(destination.size())} is expected",
                path=str(self.reader.path),
            )
        destination.copy_(source)
        self.planner.commit_tensor(request, destination)

    def _read_bytes(self, request: ReadItem, info, extension: dict | None) -> None:
        data = self._read_exact(info, info.offset, info.length)
        raw = bytes(host_memoryview(data))
        if self.verify and extension is not None:
            self._check(engine.crc32_of(raw), extension, info, request)
        self.planner.load_bytes(request, io.BytesIO(raw))

    def _read_transformed(self, requests: list[ReadItem], info) -> None:
        """A FileSystemWriter item written through stream transforms (compression...): DCP's own decoding."""
        from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

        data = self._read_exact(info, info.offset, info.length)
        transforms = _StorageReaderTransforms(self.reader.extension_registry)
        stream = transforms.transform_load_stream(
            requests[0],
            info.transform_descriptors,
            io.BytesIO(bytes(host_memoryview(data))),
        )
        decoded = stream.read(-1)
        if requests[0].type == LoadItemType.BYTE_IO:
            for request in requests:
                self.planner.load_bytes(request, io.BytesIO(decoded))
            return
        stored = torch.load(io.BytesIO(decoded), map_location="cpu", weights_only=True)
        for request in requests:
            self._copy_into(
                request,
                narrow_tensor_by_index(stored, request.storage_offsets, request.lengths),
            )


class _StorePlanReader(_PlanReader):
    """Carries out one rank's LoadPlan from the files under a URL: ranged reads of the target, not file reads.

    The paths are the file reader's; only where the bytes come from differs.
    Whole chunks into contiguous CPU tensors are fetched straight into them
    (:meth:`_read_in_place`); every other read is fetched first, in batches
    of at most ``s3_concurrency * s3_part_size`` bytes, into page-aligned
    host buffers that :meth:`_read_exact` then hands to the file reader's
    code (CUDA destinations take the staged path: fetched, verified, copied).
    One connection serves the whole load (:meth:`~fastpersist.io.targets.base.Target.connected`):
    for S3, each object is asked for its ETag once, and every GET is conditional on it.
    """

    def __init__(self, reader: FastPersistReader, planner: LoadPlanner):
        super().__init__(reader, planner)
        self.store = reader.target.connected(self.settings)
        self.fetched: dict[tuple[str, int, int], torch.Tensor] = {}

    def _where(self, info) -> str:
        return self.store.child(info.relative_path).path

    def _fetch(self, reads: list) -> None:
        """``(relative path, offset, destination memoryview)`` reads, all at once."""
        files = [(self.store.child(name), offset, destination) for name, offset, destination in reads]
        self.store.read_ranges(files, self.settings)

    def _carry_out(self, in_place, to_device, staged, foreign, raw, transformed) -> None:
        self._read_in_place(in_place)
        jobs = []  # (function, its arguments, (info, offset, nbytes, element size) it reads)
        for request, _, info, extension in to_device:
            staged.append(([request], info, extension))
        for entry in staged:
            _, info, extension = entry
            element_size = torch.empty(0, dtype=_dtype(extension)).element_size()
            jobs.append((self._read_staged, entry, (info, extension["offset"], extension["nbytes"], element_size)))
        for entry in foreign:
            jobs.append((self._read_foreign, entry, (entry[1], entry[1].offset, entry[1].length, 1)))
        for entry in raw:
            jobs.append((self._read_bytes, entry, (entry[1], entry[1].offset, entry[1].length, 1)))
        for entry in transformed:
            jobs.append((self._read_transformed, entry, (entry[1], entry[1].offset, entry[1].length, 1)))
        budget = self.settings.s3_concurrency * self.settings.s3_part_size
        batch: list = []
        held = 0
        for job in jobs:
            nbytes = job[2][2]
            if batch and held + nbytes > budget:
                self._run_batch(batch)
                batch, held = [], 0
            batch.append(job)
            held += nbytes
        if batch:
            self._run_batch(batch)

    def _run_batch(self, jobs: list) -> None:
        reads = []
        for _, _, (info, offset, nbytes, element_size) in jobs:
            key = (info.relative_path, offset, nbytes)
            if key not in self.fetched:
                data = self.fetched[key] = self._aligned_like(offset, nbytes, element_size)
                if nbytes:
                    reads.append((info.relative_path, offset, host_memoryview(data)))
        try:
            self._fetch(reads)
            for function, entry, _ in jobs:
                function(*entry)
        finally:
            self.fetched.clear()

    def _read_exact(self, info, offset: int, nbytes: int, element_size: int = 1) -> torch.Tensor:
        return self.fetched[(info.relative_path, offset, nbytes)]

    def _read_in_place(self, entries: list) -> None:
        if not entries:
            return
        reads = []
        for request, destination, info, extension in entries:
            view = host_memoryview(destination)
            if len(view) != extension["nbytes"]:
                raise CorruptCheckpointError(
                    f"{self._where(info)}: item {request.storage_index.fqn!r} holds {extension['nbytes']} bytes, "
                    f"its shape and dtype say {len(view)}",
                    path=self._where(info),
                    record=request.storage_index.fqn,
                )
            reads.append((info.relative_path, extension["offset"], view))
        self._fetch(reads)
        if self.verify:
            with concurrent.futures.ThreadPoolExecutor(_VERIFY_THREADS) as pool:
                crcs = list(
                    pool.map(
                        lambda entry: (
                            engine.crc32(entry[1].data_ptr(), entry[3]["nbytes"], 0) if entry[3]["nbytes"] else 0
                        ),
                        entries,
                    )
                )
            for (request, _, info, extension), crc in zip(entries, crcs):
                self._check(crc, extension, info, request)
        for request, destination, _, _ in entries:
            self.planner.commit_tensor(request, destination)


class _SliceProvider:
    """Storages that are slices of one buffer holding a whole archive (format.deserializer's provider)."""

    def __init__(self, data: torch.Tensor):
        self._data = data

    def storage(self, record, device: torch.device) -> torch.UntypedStorage:
        offset = self._data.storage_offset() + record.data_offset  # the slice keeps the buffer alive
        return self._data.untyped_storage()[offset : offset + record.size]

    def flush(self) -> None:
        pass


def _dtype(extension: dict) -> torch.dtype:
    dtype = getattr(torch, extension["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {extension['dtype']!r} in checkpoint metadata")
    return dtype
