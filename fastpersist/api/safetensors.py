"""safetensors files through fastpersist's pipeline: ``save_file``, ``load_file``, ``safe_open``.

Drop-in for ``safetensors.torch`` (same signatures, same checks and error
types for what it refuses), with:

* **save**: the tensors' bytes go from their own memory (zero-copy byte
  views, CPU or GPU) through the pinned ring to the native engine with
  O_DIRECT -- no copy of the state in host memory (safetensors builds the
  whole file in memory first) -- into a temporary file that is fsynced and
  renamed over the target (atomic and durable, like ``fastpersist.save``).
  The header is padded with spaces so the data starts 4 KiB-aligned
  (``alignment=8`` gives the library's exact bytes).
* **load**: one parallel O_DIRECT read per tensor (small neighbours share one)
  straight into page-aligned memory that becomes the tensors' storage, or,
  for CUDA, windows streamed through pinned buffers to the device.
* **lazy access**: :class:`safe_open` reads a tensor (or the rows of a slice)
  only when asked.

Files are byte-compatible both ways with the safetensors library.

Every function that takes a file name also takes a URL: ``s3://bucket/key``,
or a file of any fsspec filesystem (``memory://``, ``gs://``...; docs/object-storage.md).
A save commits through the target (:meth:`fastpersist.io.targets.base.Target.commit_plan`:
for S3, the writer's ring becomes the parts of a multipart upload); a load or a
``safe_open`` reads the header and then the tensors' byte ranges through the
target's reader (:meth:`~fastpersist.io.targets.base.Target.open_reader`: for
S3, one HEAD, then ranged GETs pinned to its ETag).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fastpersist import config, errors
from fastpersist.errors import InvalidSafetensorsError
from fastpersist.format import safetensors as layout
from fastpersist.format.zipformat import ZipRecordInfo
from fastpersist.io import engine, staging, targets
from fastpersist.io.commit import releasing
from fastpersist.io.queue import SaveFuture, report_unchecked_as_warnings, run_in_order, submit, wait_for_slot
from fastpersist.io.reader import FileStorageProvider
from fastpersist.io.writer import side_streams
from fastpersist.tensors import cast_to_byte_tensor, host_memoryview

__all__ = [
    "async_save_file",
    "load",
    "load_file",
    "load_model",
    "safe_open",
    "save",
    "save_file",
    "save_model",
]


# ----------------------------------------------------------------------------- checks (as safetensors.torch)


def _storage_key(tensor: torch.Tensor):
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return 0, 0


def _end_pointer(tensor: torch.Tensor) -> int:
    if tensor.nelement():
        return tensor.view(-1)[-1].data_ptr() + tensor.element_size()
    return tensor.data_ptr()


def find_shared_tensors(tensors: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """Groups of names whose tensors overlap in memory (the safetensors library's rule).

    Tensors of one storage that do not overlap (disjoint slices) are separate
    groups: saving them is allowed.
    """
    by_storage: dict[tuple, set[str]] = {}
    for name, tensor in tensors.items():
        pointer, nbytes = _storage_key(tensor)
        if tensor.device.type != "meta" and pointer != 0 and nbytes != 0:
            by_storage.setdefault((tensor.device, pointer, nbytes), set()).add(name)
    groups: list[set[str]] = []
    for names in sorted(by_storage.values(), key=sorted):
        if len(names) < 2:
            groups.append(names)
            continue
        areas = sorted((tensors[n].data_ptr(), _end_pointer(tensors[n]), n) for n in names)
        _, last_stop, first = areas[0]
        groups.append({first})
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                groups.append({name})
            else:
                groups[-1].add(name)
            last_stop = stop
    return groups


def check_tensors(tensors: Any) -> None:
    """The checks of ``safetensors.torch.save_file``, in its order and with its messages.

    Raises:
        ValueError, TypeError, RuntimeError, UnsupportedObjectError: as :func:`save_file`.
    """
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received {type(tensor)}")
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
        if tensor.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise ValueError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not support."
            " You can make it a dense tensor before saving with `.to_dense()` but be aware this might"
            " make a much larger file than needed."
        )
    failing = [names for names in find_shared_tensors(tensors) if len(names) > 1]
    if failing:
        raise RuntimeError(
            f"Some tensors share memory, this will lead to duplicate memory on disk and potential differences "
            f"when loading them again: {failing}. A potential way to correctly save your model is to use "
            "`save_model` (fastpersist.api.safetensors.save_model), or .clone() the tensors. More information at "
            "https://huggingface.co/docs/safetensors/torch_shared_tensors"
        )
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(
                f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. It either means you"
                " are trying to save tensors which are reference of each other in which case it's recommended to save"
                " only the full tensors, and reslice at load time, or simply call `.contiguous()` on your tensor to"
                " pack it before saving."
            )
        if tensor.device.type == "meta":
            raise RuntimeError(f"Cannot copy out of meta tensor; no data! (tensor `{name}` is on the meta device)")
        layout.dtype_name(tensor.dtype)  # raises UnsupportedObjectError for complex128 & co.


def _byte_views(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (tensor, cast_to_byte_tensor(tensor)) for name, tensor in tensors.items()}


def _settings(function: str, settings: Mapping[str, Any]) -> config.Settings:
    overrides, _ = config.split_overrides(function, settings, allow_other=False)
    # The format has no checksums: computing them would only cost time.
    return config.resolve(overrides).replace(checksum=False)


# ----------------------------------------------------------------------------- save


def save_file(
    tensors: dict[str, torch.Tensor],
    filename: str | os.PathLike[str],
    metadata: dict[str, str] | None = None,
    *,
    alignment: int = layout.DEFAULT_ALIGNMENT,
    **settings: Any,
) -> None:
    """Saves a dict of tensors to ``filename`` in safetensors format, durably and atomically.

    Same signature and checks as ``safetensors.torch.save_file``. The tensors
    may live on any device (CUDA ones are copied through pinned buffers); do
    not modify them until this returns.

    ``filename`` may be ``s3://bucket/key``: the object gets exactly the bytes
    of the local file, uploaded as a multipart upload whose parts are the
    writer's ring buffers (host memory at most ``max(2, s3_concurrency) *
    s3_part_size``) and committed by its completion (one ``PutObject`` for an
    object of at most one part); see docs/object-storage.md.

    Args:
        tensors: name -> contiguous, dense tensor; no two may share memory.
        filename: the file to write (replaced atomically), or an ``s3://`` URL.
        metadata: optional ``str -> str`` map stored in the header.
        alignment: the data section starts at a multiple of this (4096: the
            payload is O_DIRECT-aligned; 8: the safetensors library's bytes).
        **settings: ``fastpersist.config`` overrides (``engine``, ``fsync``,
            ``s3_part_size``, ``s3_concurrency``, ...).

    Raises:
        ValueError: not a dict of tensors, a sparse or non-contiguous tensor;
            a malformed ``s3://`` URL.
        RuntimeError: tensors that share memory; a meta tensor.
        TypeError: metadata not ``str -> str``; an unknown keyword.
        UnsupportedObjectError: a dtype the format lacks (complex128, ...).
        OSError: from the target checks or the I/O (the previous file stays intact).
        ObjectStoreUnavailableError, ObjectStoreCredentialsError,
            BucketNotFoundError, ObjectStoreError: (``s3://``) as
            ``fastpersist.save`` raises them; the upload was aborted and the
            previous object is intact.
    """
    check_tensors(tensors)
    resolved = _settings("save_file", settings)
    plan = layout.plan_save_file(_byte_views(tensors), metadata, alignment)
    destination = targets.resolve(filename).checked()
    destination.commit_plan(plan, resolved, streams=None)


def async_save_file(
    tensors: dict[str, torch.Tensor],
    filename: str | os.PathLike[str],
    metadata: dict[str, str] | None = None,
    *,
    alignment: int = layout.DEFAULT_ALIGNMENT,
    mode: str | None = None,
    **settings: Any,
):
    """Like :func:`save_file`, in the background; returns a :class:`fastpersist.SaveFuture`.

    Checks run (and raise) before this returns; the bytes are written by the
    background thread of :func:`fastpersist.async_save`, in call order with
    other background saves. ``mode`` (default: setting ``async_mode``):
    ``"pipelined"`` writes from the tensors themselves -- do not modify them
    until the future is done; ``"snapshot"`` first copies them into a staging
    area (host memory, reused; at most ``async_max_pending`` in flight), after
    which they may change at once. ``filename`` may be ``s3://bucket/key``
    (uploaded as by :func:`save_file`). A local file lands in the directory
    that was there at the call, even if that directory is renamed meanwhile;
    if it is deleted, the save fails (:class:`fastpersist.io.commit.DirectoryAnchor`).

    Raises:
        At once: what :func:`save_file` raises before writing (the checks, a
        malformed URL, an unknown keyword, an invalid ``mode``), MemoryError
        (snapshot: the staging area). At the future's ``result()``: what it
        raises while writing or uploading.
    """
    check_tensors(tensors)
    if mode is not None:
        settings = {**settings, "async_mode": mode}
    resolved = _settings("async_save_file", settings)
    plan = layout.plan_save_file(_byte_views(tensors), metadata, alignment)
    destination = targets.resolve(filename).anchored()
    if resolved.async_mode == "snapshot":
        return _snapshot_save(plan, destination, resolved)
    streams = side_streams(plan)  # ordered after the caller's queued work, on the caller's thread
    work = releasing(lambda: destination.commit_plan(plan, resolved, streams), destination)
    return run_in_order(work, destination.path)


def _snapshot_save(plan, destination: targets.Target, resolved: config.Settings):
    """Copies the plan's tensors into a staging area now; the save thread writes the copies."""
    report_unchecked_as_warnings()
    wait_for_slot(resolved.async_max_pending)  # at most async_max_pending staging areas exist
    taken = staging.snapshot_plan(plan)  # the caller's streams wait for the device-to-host copies

    def work() -> None:
        nonlocal taken
        try:
            taken.wait_copies()
            destination.commit_plan(taken.plan, resolved, streams={})
        finally:
            taken.release()
            taken = None  # the future outlives the save: it must not hold the staging area

    future = SaveFuture(destination.path, "snapshot")
    future.set_work(releasing(work, destination))
    return submit(future)


def save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file of ``tensors`` (exactly the safetensors library's ``save``)."""
    check_tensors(tensors)
    plan = layout.plan_save_file(_byte_views(tensors), metadata, alignment=8)
    parts = [plan.header]
    for record in plan.records:
        view = record.view if record.device.type == "cpu" else record.view.cpu()
        parts.append(bytes(host_memoryview(view)))
    return b"".join(parts)


# ----------------------------------------------------------------------------- load


def _device(device: Any) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r}: {e}") from None
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return target


def _tensor_over(storage: torch.UntypedStorage, entry: layout.TensorEntry, shape=None) -> torch.Tensor:
    dtype = layout.torch_dtype(entry.dtype)
    shape = entry.torch_shape if shape is None else shape
    tensor = torch.empty(0, dtype=dtype, device=storage.device)
    if storage.nbytes() == 0:
        return torch.empty(shape, dtype=dtype, device=storage.device)
    return tensor.set_(storage, 0, shape)


class _Reader:
    """An open safetensors file: its parsed header and a native file to read ranges from."""

    def __init__(self, filename: str | os.PathLike[str], settings: config.Settings):
        self.path = os.fspath(filename)
        if os.path.isdir(self.path):
            raise IsADirectoryError(errno.EISDIR, "expected a safetensors file, got a directory", self.path)
        self.settings = settings
        self.file = engine.File(self.path, "r", direct=settings.direct)
        try:
            size = self.file.size()
            length = layout.header_length(os.pread(self.file.fd, 8, 0), size, self.path)
            self.header = layout.parse_header(os.pread(self.file.fd, 8 + length, 0), size, self.path)
        except BaseException:
            self.file.close()
            raise

    def close(self) -> None:
        self.file.close()

    def entry(self, name: str) -> layout.TensorEntry:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise KeyError(f"File does not contain tensor {name}") from None

    def read(self, pieces: Iterable[tuple[str, int, int]], device: torch.device) -> list[torch.UntypedStorage]:
        """Reads ``(name, start, end)`` absolute file ranges in parallel; one storage each, on ``device``."""
        pieces = list(pieces)
        target = device if device.type in ("cpu", "cuda") else torch.device("cpu")
        records = [
            ZipRecordInfo(f"safetensors/data/{i}", start, start, end - start, 0)
            for i, (_, start, end) in enumerate(pieces)
        ]
        provider = FileStorageProvider(self.file, records, self.settings, verify=False, path=self.path)
        storages = [provider.storage(record, target) for record in records]
        provider.flush()
        if target != device:
            storages = [s.to(device=device) if s.nbytes() else torch.UntypedStorage(0, device=device) for s in storages]
        return storages

    def tensors(self, names: Iterable[str], device: torch.device) -> dict[str, torch.Tensor]:
        entries = [self.entry(name) for name in names]
        for entry in entries:
            layout.torch_dtype(entry.dtype)  # refuse before reading anything
        storages = self.read(((e.name, e.start, e.end) for e in entries), device)
        return {entry.name: _tensor_over(storage, entry) for entry, storage in zip(entries, storages)}


class _StoreReader(_Reader):
    """An open safetensors file of a store (a URL): its header, and ranged reads of the tensors' bytes.

    Through the target's :meth:`~fastpersist.io.targets.base.Target.open_reader`:
    for S3 the object's size and ETag are read once (``HeadObject``) and every
    later GET is conditional on that ETag, so an object replaced while it is
    open fails the read (``ObjectStoreError``) instead of mixing two versions.
    """

    _FIRST_READ = 64 << 10  # one request reads the header of almost every file (ours are padded to 4 KiB)

    def __init__(self, source: targets.Target, settings: config.Settings):
        self.path = url = source.path
        self.settings = settings
        self.object = source.open_reader(settings)
        try:
            size = self.object.size
            first = self._bytes(0, min(size, self._FIRST_READ))
            length = layout.header_length(first[:8], size, url)
            if 8 + length > len(first):
                first += self._bytes(len(first), 8 + length)
            self.header = layout.parse_header(first, size, url)
        except BaseException:
            self.close()
            raise

    def _bytes(self, start: int, end: int) -> bytes:
        return bytes(memoryview(self.object.read(start, end)).cast("B")[: end - start])

    def close(self) -> None:
        self.object.close()  # its connections

    def read(self, pieces: Iterable[tuple[str, int, int]], device: torch.device) -> list[torch.UntypedStorage]:
        """``(name, start, end)`` object ranges, fetched as one span with concurrent ranged GETs.

        CPU storages are views of the span's page-aligned buffer (which lives
        as long as any of them); other devices get copies.
        """
        pieces = list(pieces)
        if not pieces:
            return []
        low = min(start for _, start, _ in pieces)
        high = max(end for _, _, end in pieces)
        span = self.object.read(low, high)
        storages = []
        for _, start, end in pieces:
            if end == start:
                storage = torch.UntypedStorage(0)
            else:
                view = torch.frombuffer(span, dtype=torch.uint8, count=end - start, offset=start - low)
                storage = view.untyped_storage()
            if device.type != "cpu":
                storage = storage.to(device=device) if storage.nbytes() else torch.UntypedStorage(0, device=device)
            storages.append(storage)
        return storages


def load_file(
    filename: str | os.PathLike[str],
    device: str | int | torch.device = "cpu",
    *,
    backend: str | None = None,
    **settings: Any,
) -> dict[str, torch.Tensor]:
    """Loads a safetensors file into a dict of tensors on ``device``, reading in parallel with O_DIRECT.

    Same signature as ``safetensors.torch.load_file``; reads files written by
    the safetensors library and by :func:`save_file` alike. CPU tensors get
    page-aligned memory of their own (never a mapping of the file); CUDA
    tensors are filled through pinned buffers.

    ``filename`` may be ``s3://bucket/key``: the header is fetched, validated
    as a file's is, then the data section with ``s3_concurrency`` concurrent
    ranged GETs of ``s3_part_size`` bytes (each conditional on the ETag seen
    first) into one page-aligned buffer; CPU tensors are views of it (host
    memory: the data section's size, freed when the last tensor is), other
    devices get copies.

    Args:
        filename: the file, or an ``s3://`` URL.
        device: where the tensors go (``"cpu"``, ``"cuda:1"``, ``1``, ``torch.device``).
        backend: accepted for compatibility (``"mmap"``, ``"pread"``); fastpersist always
            reads with its engine.
        **settings: ``fastpersist.config`` overrides (``engine``, ``direct``, ``buffer_size``, ...).

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: as open().
        InvalidSafetensorsError: an invalid header (length, JSON, dtype, shape, offsets, file size).
        ValueError: an invalid device or backend; a malformed ``s3://`` URL.
        ObjectNotFoundError, BucketNotFoundError: (``FileNotFoundError``) no such object or bucket.
        ObjectStoreCredentialsError: (``PermissionError``) the credentials were refused.
        ObjectStoreError: a network error; the object was replaced during the load.
        ObjectStoreUnavailableError: boto3 is missing.
    """
    with safe_open(filename, framework="pt", device=device, backend=backend, **settings) as f:
        return f.get_tensors()


def load(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors (on the CPU) from the bytes of a safetensors file, as ``safetensors.torch.load``."""
    data = bytes(data)
    header = layout.parse_header(data, len(data))
    result = {}
    for name, entry in header.tensors.items():
        dtype = layout.torch_dtype(entry.dtype)
        if entry.size == 0:
            result[name] = torch.empty(entry.torch_shape, dtype=dtype)
        else:
            buffer = bytearray(data[entry.start : entry.end])  # writable: tensors own their memory
            result[name] = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(entry.torch_shape)
    return result


def tensors_in_buffer(buffer: Any, size: int, path: str | None = None) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors, metadata)`` of the safetensors file held in the first ``size`` bytes of ``buffer``, without a copy.

    Each CPU tensor is a view of ``buffer`` with a storage of its own (which
    keeps ``buffer`` alive). For the download of an object, which is already
    a private page-aligned buffer.

    Raises:
        InvalidSafetensorsError: an invalid header.
    """
    view = memoryview(buffer).cast("B")[:size]
    length = layout.header_length(bytes(view[:8]), size, path)
    header = layout.parse_header(bytes(view[: 8 + length]), size, path)
    tensors = {}
    for name, entry in header.tensors.items():
        dtype = layout.torch_dtype(entry.dtype)
        if entry.size == 0:
            tensors[name] = torch.empty(entry.torch_shape, dtype=dtype)
        else:
            bytes_view = torch.frombuffer(buffer, dtype=torch.uint8, count=entry.size, offset=entry.start)
            tensors[name] = _tensor_over(bytes_view.untyped_storage(), entry)
    return tensors, header.metadata


_BACKENDS = (None, "mmap", "pread")


class safe_open:
    """Lazy access to a safetensors file, like ``safetensors.safe_open``.

    ::

        with fastpersist.api.safetensors.safe_open("model.safetensors", framework="pt", device="cuda") as f:
            weight = f.get_tensor("lm_head.weight")          # reads only that tensor
            rows = f.get_slice("embed.weight")[1000:2000]     # reads only those rows

    Only ``framework="pt"`` is supported. The header is read and validated on
    open; each ``get_*`` reads just the byte ranges it needs, in parallel with
    O_DIRECT. Usable with or without ``with`` (then call :meth:`close`).

    ``filename`` may be ``s3://bucket/key``: the open reads the object's size
    and ETag and its header (ranged GETs); each ``get_*`` then fetches only its
    byte range, with concurrent ranged GETs conditional on that ETag, so an
    object replaced while open fails the read instead of mixing versions.

    Raises (on open):
        FileNotFoundError, PermissionError, IsADirectoryError, InvalidSafetensorsError,
        ValueError (framework, device or backend; a malformed URL).
        ObjectNotFoundError, BucketNotFoundError, ObjectStoreCredentialsError,
        ObjectStoreError, ObjectStoreUnavailableError: (``s3://``) as :func:`load_file`;
        the ``get_*`` methods raise ObjectStoreError for a network error or a replaced object.
    """

    def __init__(
        self, filename, framework: str = "pt", device: Any = "cpu", *, backend: str | None = None, **settings: Any
    ):
        if framework not in ("pt", "torch", "pytorch"):
            raise ValueError(f"fastpersist.api.safetensors.safe_open supports framework='pt' only, got {framework!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected 'mmap' or 'pread' (both read with fastpersist)")
        self._device = _device(device)
        resolved = _settings("safe_open", settings)
        source = targets.resolve(filename)
        self._reader: _Reader | None = _StoreReader(source, resolved) if source.remote else _Reader(filename, resolved)

    def __enter__(self) -> safe_open:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the file (idempotent)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def _open(self) -> _Reader:
        if self._reader is None:
            raise _closed()
        return self._reader

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._open().header.tensors)

    def offset_keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._open().header.tensors)

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` map, or None when the file has none."""
        metadata = self._open().header.metadata
        return dict(metadata) if metadata is not None else None

    def get_tensor(self, name: str) -> torch.Tensor:
        """Reads tensor ``name`` (only its bytes). Raises KeyError when the file lacks it."""
        return self._open().tensors([name], self._device)[name]

    def get_tensors(self) -> dict[str, torch.Tensor]:
        """Reads every tensor, in parallel; the dict is in file order."""
        reader = self._open()
        return reader.tensors(list(reader.header.tensors), self._device)

    def get_slice(self, name: str) -> SafetensorsSlice:
        """A lazy slice of tensor ``name``: ``get_shape()``, ``get_dtype()``, and indexing that reads only the rows needed."""
        return SafetensorsSlice(self._open(), self._open().entry(name), self._device)


def as_library_error(error: BaseException) -> BaseException:
    """``error``, and where the safetensors library is installed also its ``SafetensorError`` (what the library
    raises where fastpersist raises ``error``), so that code written for either catches it."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return error
    return errors.also_raised_as(error, SafetensorError)


def _closed() -> BaseException:
    """Using a closed ``safe_open`` (a ValueError; the library raises its ``SafetensorError``)."""
    return as_library_error(ValueError("this safe_open is closed; open the file again"))


class SafetensorsSlice:
    """What :meth:`safe_open.get_slice` returns (``PySafeSlice`` in safetensors)."""

    def __init__(self, reader: _Reader, entry: layout.TensorEntry, device: torch.device):
        self._reader = reader
        self._entry = entry
        self._device = device

    def get_shape(self) -> list[int]:
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        return self._entry.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        entry = self._entry
        shape = entry.torch_shape
        index = index if isinstance(index, tuple) else (index,)
        rows = shape[0] if shape else 0
        first = index[0] if index else None
        lo, hi, rest = 0, rows, index
        if rows and isinstance(first, int) and not isinstance(first, bool):
            row = first + rows if first < 0 else first
            if not 0 <= row < rows:
                raise IndexError(f"index {first} is out of bounds for dimension 0 with size {rows}")
            lo, hi, rest = row, row + 1, (0, *index[1:])
        elif rows and isinstance(first, slice):
            start, stop, step = first.indices(rows)
            if step > 0:
                lo, hi = start, max(start, stop)
                rest = (slice(0, hi - lo, step), *index[1:])
        if not shape:
            return self._reader.tensors([entry.name], self._device)[entry.name][index]
        row_bytes = entry.size // rows if rows else 0
        (storage,) = self._reader.read(
            [(entry.name, entry.start + lo * row_bytes, entry.start + hi * row_bytes)], self._device
        )
        part = _tensor_over(storage, entry, (hi - lo, *shape[1:]))
        return part[rest]


# ----------------------------------------------------------------------------- models (shared weights)


def _remove_duplicate_names(
    state_dict: Mapping[str, torch.Tensor], *, preferred_names=None, discard_names=None
) -> dict[str, list[str]]:
    """For each group of tensors sharing memory, the name kept -> the names dropped (safetensors' rule)."""
    preferred_names = set(preferred_names or [])
    discard_names = set(discard_names or [])
    removed: dict[str, list[str]] = {}
    for shared in find_shared_tensors(state_dict):
        complete = {n for n in shared if _is_complete(state_dict[n])}
        if not complete:
            raise RuntimeError(
                "Error while trying to find names to remove to save state dict, but found no suitable name to keep"
                f" for saving amongst: {shared}. None is covering the entire storage. Refusing to save/load the model"
                " since you could be storing much more memory than needed. Please refer to"
                " https://huggingface.co/docs/safetensors/torch_shared_tensors for more information."
            )
        keep = sorted(complete)[0]
        preferred = complete.difference(discard_names)
        if preferred:
            keep = sorted(preferred)[0]
        if preferred_names and preferred_names.intersection(complete):
            keep = sorted(preferred_names.intersection(complete))[0]
        for name in sorted(shared):
            if name != keep:
                removed.setdefault(keep, []).append(name)
    return removed


def _is_complete(tensor: torch.Tensor) -> bool:
    pointer, nbytes = _storage_key(tensor)
    return tensor.data_ptr() == pointer and tensor.nelement() * tensor.element_size() == nbytes


def save_model(
    model: torch.nn.Module,
    filename: str | os.PathLike[str],
    metadata: dict[str, str] | None = None,
    force_contiguous: bool = True,
    **settings: Any,
) -> None:
    """``safetensors.torch.save_model``: drops the duplicate names of shared (tied) weights, then :func:`save_file`."""
    state_dict = model.state_dict()
    removed = _remove_duplicate_names(state_dict)
    metadata = dict(metadata or {})
    for kept, names in removed.items():
        for name in names:
            if name not in metadata:
                metadata[name] = kept  # lets load_model tie them again
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    try:
        save_file(state_dict, filename, metadata=metadata, **settings)
    except ValueError as e:
        raise ValueError(
            f"{e}\nOr use save_model(..., force_contiguous=True); read the docs for the trade-offs."
        ) from None


def load_model(
    model: torch.nn.Module, filename: str | os.PathLike[str], strict: bool = True, device: Any = "cpu", **settings: Any
) -> tuple[set[str], list[str]]:
    """``safetensors.torch.load_model``: loads into ``model``, re-tying shared weights; returns (missing, unexpected)."""
    state_dict = load_file(filename, device=device, **settings)
    model_state = model.state_dict()
    to_removes = _remove_duplicate_names(model_state, preferred_names=list(state_dict))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing, unexpected = set(missing), list(unexpected)
    for names in to_removes.values():
        for name in names:
            if name in missing:
                missing.remove(name)  # tied to a tensor that was loaded
            else:
                unexpected.append(name)  # the file has it, but the model ties it to another
    if strict and (missing or unexpected):
        missing_text = ", ".join(f'"{k}"' for k in sorted(missing))
        unexpected_text = ", ".join(f'"{k}"' for k in sorted(unexpected))
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += f"\n    Missing key(s) in state_dict: {missing_text}"
        if unexpected:
            error += f"\n    Unexpected key(s) in state_dict: {unexpected_text}"
        raise RuntimeError(error)
    return missing, unexpected


__all__ += ["InvalidSafetensorsError", "SafetensorsSlice", "check_tensors", "find_shared_tensors"]
