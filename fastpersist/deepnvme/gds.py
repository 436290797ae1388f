"""``GdsHandle``: DeepNVMe's ``gds_handle`` on CUDA tensors, through cuFile or through pinned host chunks.

A drop-in for ``deepspeed.ops.op_builder.GDSBuilder().load().gds_handle(...)``
(``fastpersist.deepnvme.GDSBuilder`` builds it the same way)::

    from fastpersist import GdsHandle
    h = GdsHandle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=4)
    t = h.new_pinned_device_tensor(1 << 30, torch.empty(0, dtype=torch.uint8))
    h.async_pwrite(t, "/nvme/x.bin")      # 0 at once
    h.wait()                               # 1
    h.path                                 # "cufile" or "bounce"

Two data paths, chosen when the handle is made (``path=`` or the
``gds_path`` setting, ``FASTPERSIST_GDS_PATH``):

1. ``cufile``: NVIDIA cuFile (:mod:`fastpersist.deepnvme.cufile`, loaded on
   first use). Each operation opens the file (``O_DIRECT`` where the
   filesystem allows it, as GPUDirect needs), registers the descriptor, and
   splits the bytes into ``intra_op_parallelism`` contiguous parts, each one
   ``cuFileRead``/``cuFileWrite`` on a worker thread with the tensor's device
   current. A view inside a tensor given to :meth:`pin_device_tensor` is passed
   as (registered base, offset), as cuFile requires. Without the nvidia-fs
   module cuFile runs in compatibility mode: still this path.
2. ``bounce``: no cuFile. Device bytes go through a ring of pinned host chunks
   on a side stream, overlapping the device copies with the engine's file I/O
   (:class:`~fastpersist.deepnvme.handle.AioHandle`'s CUDA path).

``auto`` (the default) takes ``cufile`` when libcufile loads and its driver
opens, else ``bounce``, and logs why once (logger ``fastpersist``). If a cuFile
call then fails with a cuFile status, an ``auto`` handle redoes that operation
on the bounce path and stays there (logged once); a handle made with
``path="cufile"`` raises :class:`~fastpersist.errors.CufileError` instead.
Operating-system errors (``ENOSPC``, ``ENOENT``, ...) raise their ``OSError``
on either path.

CPU tensors are read and written as by ``AioHandle``, as DeepNVMe's
``gds_handle`` hands them to its aio base (DeepSpeed's own ``test_gds.py``
writes CPU tensors through a ``gds_handle``). The GDS-only calls
(``pin_device_tensor``, ``unpin_device_tensor``) require CUDA tensors.

Call order: any number of ``async_*`` calls, then :meth:`GdsHandle.wait`
before touching the tensors again. Work queued on the caller's current stream
before a call (the kernels producing or still reading the tensor) completes
before the transfer touches the tensor; data read is complete for every
stream when a blocking call or ``wait()`` returns.
"""

from __future__ import annotations

import concurrent.futures
import errno as errno_module
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

from fastpersist import config
from fastpersist.deepnvme import cufile
from fastpersist.deepnvme.handle import O_DIRECT_ALIGNMENT, AioHandle, DeepNVMeCalls, check_file_bytes
from fastpersist.errors import ConfigError, CudaUnavailableError, CufileError, GdsUnavailableError
from fastpersist.io import engine as engine_module
from fastpersist.tensors import cast_to_byte_tensor

__all__ = ["GdsHandle", "choose_path", "require_cuda_tensor", "PATHS", "pinned_device_regions"]

PATHS = config.GDS_PATHS
"""``auto``, ``cufile``, ``bounce``."""

_log = logging.getLogger("fastpersist")
_logged: set[str] = set()
_log_lock = threading.Lock()


def _log_once(key: str, level: int, message: str, *args: Any) -> None:
    with _log_lock:
        if key in _logged:
            return
        _logged.add(key)
    _log.log(level, message, *args)


def choose_path(requested: str, open_cufile: Callable[[], Any]) -> tuple[str, Any, str]:
    """Which data path a handle takes: ``(path, driver or None, reason)``.

    Args:
        requested: ``"auto"``, ``"cufile"`` or ``"bounce"``.
        open_cufile: returns an opened cuFile driver or raises
            :class:`fastpersist.deepnvme.cufile.CufileUnavailable` (normally
            :func:`fastpersist.deepnvme.cufile.open_driver`; tests pass fakes).

    Returns:
        ``("cufile", driver, why)`` or ``("bounce", None, why)``; ``why`` is one
        sentence (for logs and ``fastpersist info``).

    Raises:
        GdsUnavailableError: ``requested`` is ``"cufile"`` and cuFile cannot start.
        ConfigError: ``requested`` is not a path name.
    """
    if requested not in PATHS:
        raise ConfigError(f"GdsHandle path must be one of {PATHS}, got {requested!r}")
    if requested == "bounce":
        return "bounce", None, "the bounce path was asked for (gds_path=bounce)"
    try:
        driver = open_cufile()
    except cufile.CufileUnavailable as e:
        if requested == "cufile":
            raise GdsUnavailableError(
                f"GdsHandle path 'cufile' cannot start: {e}. Use path='auto' (falls back to the bounce path) "
                "or path='bounce'."
            ) from None
        return "bounce", None, f"cuFile is not usable ({e}); using the bounce path (pinned host chunks)"
    mode = "compatibility mode, no nvidia-fs" if getattr(driver, "compat_mode", False) else "GPUDirect"
    return "cufile", driver, f"cuFile {getattr(driver, 'path', '')} opened ({mode})"


# ----------------------------------------------------------------------------- pinned device tensors

_regions_lock = threading.Lock()
_regions: dict[tuple[int, int], tuple[int, bool]] = {}  # (device, start) -> (length, registered with cuFile)


def pinned_device_regions() -> list[tuple[int, int, int, bool]]:
    """``(device, start, length, registered_with_cufile)`` of every pinned device tensor (process-wide)."""
    with _regions_lock:
        return [(d, s, n, r) for (d, s), (n, r) in sorted(_regions.items())]


def _find_region(device: int, address: int, nbytes: int) -> tuple[int, bool] | None:
    """The pinned region holding ``[address, address + nbytes)``: ``(start, registered)``, or None."""
    with _regions_lock:
        for (d, start), (length, registered) in _regions.items():
            if d == device and start <= address and address + nbytes <= start + length:
                return start, registered
    return None


_fd_lock = threading.Lock()
_fd_handles: dict[tuple[int, int], list[int]] = {}  # (id(driver), fd) -> [cuFile handle, users]


def _acquire_fd_handle(driver: Any, fd: int, name: str) -> int:
    key = (id(driver), fd)
    with _fd_lock:
        entry = _fd_handles.get(key)
        if entry is None:
            entry = _fd_handles[key] = [driver.register_handle(fd, name), 0]
        entry[1] += 1
        return entry[0]


def _release_fd_handle(driver: Any, fd: int) -> None:
    key = (id(driver), fd)
    with _fd_lock:
        entry = _fd_handles.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _fd_handles[key]
            driver.deregister_handle(entry[0])


def require_cuda_tensor(tensor: Any, method: str) -> torch.Tensor:
    """``tensor``'s bytes as a contiguous uint8 view, for GDS-only calls that need device memory.

    Raises:
        TypeError: ``tensor`` is not a tensor, or not on a CUDA device (the message names the requirement and what
            to use for host memory).
        ValueError: ``tensor`` is not contiguous.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"GdsHandle.{method}() needs a CUDA tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise TypeError(
            f"GdsHandle.{method}() needs a CUDA tensor (GPUDirect Storage pins device memory); got a tensor on "
            f"{tensor.device}. For host memory use new_cpu_locked_tensor(), or fastpersist.AioHandle."
        )
    return cast_to_byte_tensor(tensor)


def _device_index(tensor: torch.Tensor) -> int:
    return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()


def _bind_device(index: int) -> None:
    # cuFile needs the buffer's context current on the calling thread. set_device makes device `index` current for
    # the runtime; a cheap runtime call that needs a context (a stream query) makes its primary context current.
    torch.cuda.set_device(index)
    torch.cuda.current_stream(index).query()


def _parts(nbytes: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous (offset, length) parts of ``nbytes``, each but the last a multiple of 4096."""
    if nbytes == 0:
        return []
    size = -(-nbytes // max(count, 1))
    size = -(-size // O_DIRECT_ALIGNMENT) * O_DIRECT_ALIGNMENT
    return [(off, min(size, nbytes - off)) for off in range(0, nbytes, size)]


def _end_of_file(name: str, file_offset: int, nbytes: int, available: int) -> OSError:
    error = engine_module.UnexpectedEndOfFileError(
        f"unexpected end of file {name!r} at offset {file_offset + available}: the request wanted {nbytes} bytes "
        f"but only {available} could be read; the file is truncated or the offset/size is wrong"
    )
    error.filename = name
    return error


def _open_for_cufile(path: str, write: bool, direct: bool) -> int:
    # Writes open read-write: cuFile may read back around an unaligned write (read-modify-write) in GPUDirect mode.
    flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
    flags |= getattr(os, "O_CLOEXEC", 0)
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        try:
            return os.open(path, flags | o_direct, 0o666)
        except OSError as e:
            if e.errno != errno_module.EINVAL:  # EINVAL: the filesystem refuses O_DIRECT (tmpfs, overlayfs)
                raise
    return os.open(path, flags, 0o666)


def probe_registration(driver: Any, directory: str) -> str | None:
    """Whether cuFile registers a file in ``directory``: ``None`` if it does, else why not.

    An open driver is not enough: cuFile looks up the filesystem's volume
    attributes when a file is registered, and fails there even in compatibility
    mode where it cannot (seen on a virtio disk in a container without udev
    data: ``CU_FILE_HANDLE_NOT_REGISTERED``). ``GdsHandle(path="auto")`` then
    moves such operations to the bounce path; this says so beforehand.

    Raises:
        OSError: the probe file cannot be created in ``directory``.
    """
    descriptor, name = tempfile.mkstemp(prefix=".fastpersist-cufile-probe-", dir=directory)
    os.close(descriptor)
    try:
        fd = _open_for_cufile(name, write=True, direct=True)
        try:
            handle = driver.register_handle(fd, name)
        except OSError as error:
            return str(error)
        else:
            driver.deregister_handle(handle)
            return None
        finally:
            os.close(fd)
    finally:
        os.unlink(name)


class GdsHandle(DeepNVMeCalls):
    """DeepNVMe's ``gds_handle``: tensor reads and writes with CUDA tensors moved by cuFile or a pinned bounce ring.

    The first five arguments and their defaults are DeepNVMe's ``gds_handle()``'s.

    Args:
        block_size: bytes per engine request on the bounce path and for CPU tensors (as ``AioHandle``).
        queue_depth: engine requests in flight per lane (bounce path, CPU tensors).
        single_submit: as ``AioHandle``.
        overlap_events: as ``AioHandle``.
        intra_op_parallelism: threads splitting each operation (cuFile calls on the
            ``cufile`` path, engine lanes otherwise).
        path: ``"auto"``, ``"cufile"`` or ``"bounce"`` (keyword only); None takes
            the ``gds_path`` setting (env ``FASTPERSIST_GDS_PATH``).
        engine, direct, cuda_chunk_bytes, cuda_chunks: the engine and pinned-ring
            settings of the bounce path and CPU tensors (keyword only; as ``AioHandle``).

    Raises:
        CudaUnavailableError: torch sees no CUDA device (use ``AioHandle`` for host memory).
        GdsUnavailableError: ``path="cufile"`` and cuFile cannot start here.
        ConfigError: ``path`` is not a path name.
        ValueError: invalid sizes (as ``AioHandle``).
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        *,
        path: str | None = None,
        engine: str = "auto",
        direct: bool = True,
        cuda_chunk_bytes: int = 8 << 20,
        cuda_chunks: int = 4,
    ) -> None:
        if not torch.cuda.is_available():
            raise CudaUnavailableError(
                "GdsHandle needs a CUDA device, and torch sees none here (torch.cuda.is_available() is False). "
                "For tensors in host memory use fastpersist.AioHandle (DeepNVMe's aio_handle), which takes the "
                "same arguments."
            )
        if isinstance(intra_op_parallelism, bool) or not isinstance(intra_op_parallelism, int):
            raise ValueError(f"intra_op_parallelism must be an int, got {intra_op_parallelism!r}")
        if intra_op_parallelism < 1:
            raise ValueError(f"intra_op_parallelism must be >= 1, got {intra_op_parallelism}")
        settings = config.settings()
        requested = settings.gds_path if path is None else path
        self._aio = AioHandle(
            block_size,
            queue_depth,
            single_submit,
            overlap_events,
            intra_op_parallelism,
            engine=engine,
            direct=direct,
            cuda_chunk_bytes=cuda_chunk_bytes,
            cuda_chunks=cuda_chunks,
        )
        library = settings.cufile_library
        self._requested = requested
        self._path, self._driver, self._reason = choose_path(requested, lambda: cufile.open_driver(library))
        if requested == "auto" and self._path == "bounce":
            _log_once("auto-bounce", logging.WARNING, "fastpersist: GdsHandle: %s", self._reason)
        self._parallelism = intra_op_parallelism
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future] = []
        self._op_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._part_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_pid = 0

    # ------------------------------------------------------------------ getters
    @property
    def path(self) -> str:
        """The data path CUDA tensors take now: ``"cufile"`` or ``"bounce"``."""
        return self._path

    @property
    def path_reason(self) -> str:
        """Why :attr:`path` is what it is (one sentence)."""
        return self._reason

    def get_path(self) -> str:
        """:attr:`path` as a getter, like DeepNVMe's other ``get_*``."""
        return self._path

    def get_requested_path(self) -> str:
        """What the handle was asked for: ``auto``, ``cufile`` or ``bounce``."""
        return self._requested

    def get_cufile_compat_mode(self) -> bool | None:
        """On the ``cufile`` path, whether cuFile runs in compatibility mode (no nvidia-fs); else None."""
        return None if self._driver is None or self._path != "cufile" else bool(self._driver.compat_mode)

    def get_block_size(self) -> int:
        return self._aio.get_block_size()

    def get_queue_depth(self) -> int:
        return self._aio.get_queue_depth()

    def get_single_submit(self) -> bool:
        return self._aio.get_single_submit()

    def get_overlap_events(self) -> bool:
        return self._aio.get_overlap_events()

    def get_intra_op_parallelism(self) -> int:
        return self._parallelism

    def get_thread_count(self) -> int:
        """Alias of :meth:`get_intra_op_parallelism`."""
        return self._parallelism

    def get_alignment(self) -> int:
        """4096, DeepNVMe's ``gds_handle`` value (its aio base always has one lane). Any size and offset work."""
        return O_DIRECT_ALIGNMENT

    def get_engine(self) -> str:
        """The I/O engine of the bounce path and CPU tensors."""
        return self._aio.get_engine()

    def get_direct(self) -> bool:
        return self._aio.get_direct()

    # ------------------------------------------------------------------ pinned tensors
    def new_pinned_device_tensor(self, num_elem: int, example_tensor: Any = None, **kwargs: Any) -> torch.Tensor:
        """A CUDA tensor of ``num_elem`` elements, pinned as by :meth:`pin_device_tensor`.

        The dtype is ``example_tensor``'s (a tensor or a ``torch.dtype``;
        DeepNVMe's misspelled keyword ``example_tenosr`` works too); the device
        is ``example_tensor``'s when it is a CUDA tensor, else the current CUDA
        device. Give it back with :meth:`free_pinned_device_tensor`.

        Raises:
            TypeError: ``example_tensor`` is neither a tensor nor a dtype; unknown keywords.
            CufileError: on the ``cufile`` path of a handle made with ``path="cufile"``, registration failed.
        """
        if "example_tenosr" in kwargs:
            if example_tensor is not None:
                raise TypeError("new_pinned_device_tensor() got both example_tensor and example_tenosr")
            example_tensor = kwargs.pop("example_tenosr")
        if kwargs:
            raise TypeError(
                f"new_pinned_device_tensor() got unexpected keyword argument(s): {', '.join(sorted(kwargs))}"
            )
        if example_tensor is None:
            dtype, device = torch.uint8, None
        elif isinstance(example_tensor, torch.Tensor):
            dtype = example_tensor.dtype
            device = example_tensor.device if example_tensor.device.type == "cuda" else None
        elif isinstance(example_tensor, torch.dtype):
            dtype, device = example_tensor, None
        else:
            raise TypeError(f"example_tensor must be a tensor or a torch.dtype, got {type(example_tensor).__name__}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        tensor = torch.empty(int(num_elem), dtype=dtype, device=device)
        self.pin_device_tensor(tensor)
        return tensor

    def free_pinned_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Unpins a tensor from :meth:`new_pinned_device_tensor` (its memory goes when the last reference does); True."""
        self.unpin_device_tensor(tensor)
        return True

    def pin_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Pins a contiguous CUDA tensor for GDS: ``cuFileBufRegister`` on the ``cufile`` path; returns True.

        Pinning is process-wide (every handle sees it) and optional: unpinned
        tensors work on both paths (cuFile then stages through its own
        buffers). Views inside a pinned tensor use its registration. On the
        bounce path only the bookkeeping is done. If cuFile refuses the
        registration, an ``auto`` handle logs it once and carries on unregistered.

        Raises:
            TypeError: ``tensor`` is not a CUDA tensor (host memory: ``new_cpu_locked_tensor``).
            ValueError: ``tensor`` is not contiguous.
            CufileError: registration failed on a handle made with ``path="cufile"``.
        """
        data = require_cuda_tensor(tensor, "pin_device_tensor")
        index, start, length = _device_index(data), data.data_ptr(), data.numel()
        registered = False
        if self._path == "cufile" and length:
            try:
                self._on_device(index, lambda: self._driver.register_buffer(start, length))
                registered = True
            except CufileError as e:
                if self._requested == "cufile":
                    raise
                _log_once("register", logging.WARNING, "fastpersist: GdsHandle: %s; tensors stay unregistered", e)
        with _regions_lock:
            _regions[(index, start)] = (length, registered)
        return True

    def unpin_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Undoes :meth:`pin_device_tensor`; True if ``tensor`` was pinned (DeepNVMe returns True always).

        Raises:
            TypeError: ``tensor`` is not a CUDA tensor.
            CufileError: ``cuFileBufDeregister`` failed on a handle made with ``path="cufile"``.
        """
        data = require_cuda_tensor(tensor, "unpin_device_tensor")
        index, start = _device_index(data), data.data_ptr()
        with _regions_lock:
            entry = _regions.pop((index, start), None)
        if entry is None:
            return False
        if entry[1] and self._driver is not None:
            try:
                self._on_device(index, lambda: self._driver.deregister_buffer(start))
            except CufileError as e:
                if self._requested == "cufile":
                    raise
                _log_once("deregister", logging.WARNING, "fastpersist: GdsHandle: %s", e)
        return True

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any = None, **kwargs: Any) -> torch.Tensor:
        """A page-locked CPU tensor (as ``AioHandle.new_cpu_locked_tensor``)."""
        return self._aio.new_cpu_locked_tensor(num_elem, example_tensor, **kwargs)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Forgets a tensor from :meth:`new_cpu_locked_tensor`; False for anything else, CUDA tensors included.

        DeepSpeed's ds_io calls this on its CUDA buffer when a ``--use_gds`` run ends.
        """
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return False
        return self._aio.free_cpu_locked_tensor(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """CPU tensors: as ``AioHandle.is_pinned``. CUDA tensors: inside a tensor given to :meth:`pin_device_tensor`."""
        if isinstance(buffer, torch.Tensor) and buffer.device.type == "cuda":
            nbytes = buffer.numel() * buffer.element_size()
            return _find_region(_device_index(buffer), buffer.data_ptr(), nbytes) is not None
        return self._aio.is_pinned(buffer)

    # ------------------------------------------------------------------ completion
    def wait(self) -> int:
        """Waits for every asynchronous operation of the handle; returns how many completed.

        Raises the first error once everything in flight has finished; the
        handle stays usable. With nothing in flight it returns 0.
        """
        with self._lock:
            futures, self._futures = self._futures, []
        error: BaseException | None = None
        completed = 0
        try:
            completed = self._aio.wait()
        except BaseException as e:  # noqa: BLE001 - raised after the cuFile jobs finished too
            error = e
        for future in futures:
            try:
                future.result()
                completed += 1
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error
        return completed

    def pending(self) -> int:
        """Asynchronous operations submitted and not yet completed."""
        with self._lock:
            mine = sum(1 for f in self._futures if not f.done())
        return self._aio.pending() + mine

    # ------------------------------------------------------------------ internals
    def _on_device(self, index: int, action: Callable[[], Any]) -> Any:
        """Runs ``action`` on a worker thread bound to device ``index`` (the caller's current device is untouched)."""
        return self._parts_pool().submit(lambda: (_bind_device(index), action())[1]).result()

    def _pools_for_this_process(self) -> None:
        # Called with self._lock held. A fork leaves the parent's worker threads behind: start new ones.
        if self._executor_pid != os.getpid():
            self._op_executor = self._part_executor = None
            self._executor_pid = os.getpid()

    def _parts_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            self._pools_for_this_process()
            if self._part_executor is None:
                self._part_executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._parallelism, thread_name_prefix="fastpersist-gds"
                )
            return self._part_executor

    def _op_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        # Called with self._lock held.
        self._pools_for_this_process()
        if self._op_executor is None:
            self._op_executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="fastpersist-gds-op"
            )
        return self._op_executor

    def _transfer(
        self,
        write: bool,
        buffer: Any,
        target: Any,
        validate: bool,
        async_op: bool,
        file_offset: int,
        truncate: bool,
    ) -> int:
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if buffer.device.type == "cpu" or self._path == "bounce":
            # Host tensors go to the aio base as in DeepNVMe; on the bounce path so do CUDA tensors (pinned ring).
            return self._aio_transfer(write, buffer, target, validate, async_op, file_offset, truncate)
        if buffer.device.type != "cuda":
            raise TypeError(f"GdsHandle moves CUDA (and CPU) tensors; got a tensor on {buffer.device}")
        if file_offset < 0:
            raise ValueError(f"file_offset must be >= 0, got {file_offset}")
        data = cast_to_byte_tensor(buffer)
        if isinstance(target, int):
            fd, close = target, False
            name = f"<fd {target}>"
        else:
            # O_DIRECT (what GPUDirect needs) only for whole 4 KiB blocks: cuFile's compatibility mode does plain
            # pread/pwrite on the descriptor, which the kernel refuses for unaligned O_DIRECT requests.
            aligned = file_offset % O_DIRECT_ALIGNMENT == 0 and data.numel() % O_DIRECT_ALIGNMENT == 0
            direct = aligned and data.data_ptr() % O_DIRECT_ALIGNMENT == 0 and self._aio.get_direct()
            fd, close, name = _open_for_cufile(target, write, direct), True, target  # open errors raise at the call
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(data.device))

        def job() -> None:
            try:
                try:
                    self._cufile_job(write, data, fd, name, file_offset, truncate, ready)
                except CufileError as e:
                    if self._requested == "cufile":
                        raise
                    self._fall_back(e)
                    self._aio_transfer(write, data, target, False, False, file_offset, truncate)
                except OSError as e:
                    if e.errno != errno_module.EINVAL:
                        raise
                    # An O_DIRECT descriptor with an unaligned request: the engine handles those (buffered head/tail).
                    if self._requested == "cufile":
                        e.add_note(
                            "cuFile refused the request on this descriptor (unaligned O_DIRECT?); path='auto' "
                            "sends such requests through the bounce path"
                        )
                        raise
                    _log_once(
                        "einval",
                        logging.INFO,
                        "fastpersist: GdsHandle: cuFile refused a request with EINVAL "
                        "(%s); such requests go through the bounce path",
                        e,
                    )
                    self._aio_transfer(write, data, target, False, False, file_offset, truncate)
            finally:
                if close:
                    os.close(fd)
            if validate:
                check_file_bytes(data, target, file_offset)

        if not async_op:
            job()
            return 1
        with self._lock:
            self._futures.append(self._op_pool().submit(job))
        return 0

    def _aio_transfer(self, write, buffer, target, validate, async_op, file_offset, truncate) -> int:
        if write:
            return self._aio.pwrite(buffer, target, validate, async_op, file_offset, truncate=truncate)
        return self._aio.pread(buffer, target, validate, async_op, file_offset)

    def _fall_back(self, error: CufileError) -> None:
        with self._lock:
            self._path = "bounce"
            self._reason = f"a cuFile call failed ({error}); moved to the bounce path"
        _log_once("cufile-failed", logging.WARNING, "fastpersist: GdsHandle: %s", self._reason)

    def _cufile_job(
        self,
        write: bool,
        data: torch.Tensor,
        fd: int,
        name: str,
        file_offset: int,
        truncate: bool,
        ready: Any,
    ) -> None:
        driver = self._driver
        nbytes = data.numel()
        if not write and nbytes:
            # Checked before any I/O: a short read would continue at an unaligned offset, which an O_DIRECT
            # descriptor refuses (EINVAL) in compatibility mode.
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and file_offset + nbytes > info.st_size:
                raise _end_of_file(name, file_offset, nbytes, max(info.st_size - file_offset, 0))
        if nbytes:
            index = _device_index(data)
            address = data.data_ptr()
            region = _find_region(index, address, nbytes)
            base, delta = (region[0], address - region[0]) if region and region[1] else (address, 0)
            ready.synchronize()  # the caller's queued kernels that produce or read `data` are done
            handle = _acquire_fd_handle(driver, fd, name)
            try:
                pool = self._parts_pool()

                def part(offset: int, length: int) -> int:
                    _bind_device(index)
                    if write:
                        return driver.write(handle, base, length, file_offset + offset, delta + offset, name)
                    return driver.read(handle, base, length, file_offset + offset, delta + offset, name)

                futures = [
                    (off, length, pool.submit(part, off, length)) for off, length in _parts(nbytes, self._parallelism)
                ]
                error: BaseException | None = None
                short: tuple[int, int, int] | None = None
                for off, length, future in futures:  # every part finishes before anything is raised
                    try:
                        done = future.result()
                        if done < length and short is None:
                            short = (off, length, done)
                    except BaseException as e:  # noqa: BLE001
                        error = error or e
            finally:
                _release_fd_handle(driver, fd)
            if error is not None:
                raise error
            if short is not None:
                off, length, done = short
                raise _end_of_file(name, file_offset, nbytes, off + done)
        if write and truncate:
            os.ftruncate(fd, file_offset + nbytes)

    def __repr__(self) -> str:
        return (
            f"GdsHandle(block_size={self.get_block_size()}, queue_depth={self.get_queue_depth()}, "
            f"single_submit={self.get_single_submit()}, overlap_events={self.get_overlap_events()}, "
            f"intra_op_parallelism={self.get_intra_op_parallelism()}, path={self.path!r})"
        )
