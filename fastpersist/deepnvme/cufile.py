"""NVIDIA cuFile (GPUDirect Storage) through ``ctypes``: loaded lazily, optional, every failure an exception.

Nothing here runs on ``import fastpersist``: :func:`open_driver` loads
``libcufile.so`` and opens its driver the first time a
:class:`~fastpersist.deepnvme.gds.GdsHandle` asks for the ``cufile`` path,
once per process and library path.

Why ``ctypes`` on ``libcufile.so`` rather than ``torch.cuda.gds`` or
``cuda.bindings.cufile``:

* ``torch.cuda.gds.GdsFile`` moves whole storages only
  (``load_storage(storage, offset)`` reads ``storage.nbytes()`` bytes): no
  transfer of part of a buffer, so no ``narrow`` views, no splitting one
  operation over several threads, no offset inside a registered buffer (what
  DeepNVMe's ``gds_handle`` does for views of a pinned tensor). It always opens
  with ``O_DIRECT`` (refused by tmpfs), cannot take a caller's descriptor, and
  reports failures as a ``RuntimeError`` string without the cuFile code.
* ``cuda.bindings.cufile`` has the whole API but its module layout has changed
  between cuda-bindings releases, and it is one more package to pin.
* The C API needed is small and stable (``cufile.h`` of cuFile 1.x): seven
  functions, one 24-byte descriptor struct, and a status struct of two ints
  returned by value. ``ctypes`` releases the GIL around each call, so several
  threads read and write at once. The wheel that ships ``libcufile.so.0``
  (``nvidia-cufile``) also ships the header this module was checked against.

Error model (``cufile.h``): calls that return ``CUfileError_t`` fail with
``err != 0`` (a ``CUfileOpError`` from 5001; ``CU_FILE_CUDA_DRIVER_ERROR``
carries a CUDA driver code in ``cu_err``); ``cuFileRead``/``cuFileWrite``
return the byte count, ``-1`` with ``errno`` for an operating-system error, or
``-CUfileOpError``. Operating-system errors raise the usual ``OSError``
subclass (``errno``, ``filename``); cuFile statuses raise
:class:`~fastpersist.errors.CufileError`. Short transfers are continued until
the request is complete or the file ends.

Compatibility mode: without the nvidia-fs kernel module cuFile still opens
(``allow_compat_mode``, on by default) and moves data through its own host
buffers with POSIX I/O. That is still the ``cufile`` path;
:attr:`Driver.compat_mode` says which one runs. A file opened without
``O_DIRECT`` also works, but only ``O_DIRECT`` can be true GPUDirect.

cuFile writes a ``cufile.log`` in the current directory unless its
configuration (``CUFILE_ENV_PATH_JSON``, ``/etc/cufile.json``) says otherwise;
fastpersist leaves that configuration to the user.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as errno_module
import glob
import os
import sys
import threading
from typing import Any

from fastpersist.errors import CufileError, CufileUnavailable

__all__ = [
    "Driver",
    "CufileUnavailable",
    "open_driver",
    "library_candidates",
    "find_library_file",
    "nvidia_fs_loaded",
    "status_name",
]

#: cuFile's status base: every CUfileOpError but success is above it (cufile.h ``CUFILEOP_BASE_ERR``).
CUFILEOP_BASE_ERR = 5000
CU_FILE_CUDA_DRIVER_ERROR = 5011
CU_FILE_MEMORY_ALREADY_REGISTERED = 5023
CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
#: How long ``cuFileDriverOpen`` may take before the ``cufile`` path is given up (it can spin without a CUDA driver).
DRIVER_OPEN_TIMEOUT_SECONDS = 60.0

_STATUS_NAMES = {
    5001: "CU_FILE_DRIVER_NOT_INITIALIZED (nvidia-fs driver is not loaded and compatibility mode is off)",
    5002: "CU_FILE_DRIVER_INVALID_PROPS",
    5003: "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
    5004: "CU_FILE_DRIVER_VERSION_MISMATCH (nvidia-fs driver version mismatch)",
    5005: "CU_FILE_DRIVER_VERSION_READ_ERROR",
    5006: "CU_FILE_DRIVER_CLOSING",
    5007: "CU_FILE_PLATFORM_NOT_SUPPORTED",
    5008: "CU_FILE_IO_NOT_SUPPORTED (GPUDirect Storage not supported on this file)",
    5009: "CU_FILE_DEVICE_NOT_SUPPORTED (GPUDirect Storage not supported on this GPU)",
    5010: "CU_FILE_NVFS_DRIVER_ERROR",
    5011: "CU_FILE_CUDA_DRIVER_ERROR",
    5012: "CU_FILE_CUDA_POINTER_INVALID",
    5013: "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
    5014: "CU_FILE_CUDA_POINTER_RANGE_ERROR",
    5015: "CU_FILE_CUDA_CONTEXT_MISMATCH",
    5016: "CU_FILE_INVALID_MAPPING_SIZE",
    5017: "CU_FILE_INVALID_MAPPING_RANGE",
    5018: "CU_FILE_INVALID_FILE_TYPE",
    5019: "CU_FILE_INVALID_FILE_OPEN_FLAG",
    5020: "CU_FILE_DIO_NOT_SET (the file is not open with O_DIRECT)",
    5022: "CU_FILE_INVALID_VALUE",
    5023: "CU_FILE_MEMORY_ALREADY_REGISTERED",
    5024: "CU_FILE_MEMORY_NOT_REGISTERED",
    5025: "CU_FILE_PERMISSION_DENIED",
    5026: "CU_FILE_DRIVER_ALREADY_OPEN",
    5027: "CU_FILE_HANDLE_NOT_REGISTERED",
    5028: "CU_FILE_HANDLE_ALREADY_REGISTERED",
    5029: "CU_FILE_DEVICE_NOT_FOUND",
    5030: "CU_FILE_INTERNAL_ERROR",
    5031: "CU_FILE_GETNEWFD_FAILED",
    5033: "CU_FILE_NVFS_SETUP_ERROR",
    5034: "CU_FILE_IO_DISABLED (GPUDirect Storage disabled by configuration for this file)",
    5036: "CU_FILE_GPU_MEMORY_PINNING_FAILED",
    5043: "CU_FILE_NOMEM_ERROR",
    5044: "CU_FILE_IO_ERROR",
    5045: "CU_FILE_INTERNAL_BUF_REGISTER_ERROR",
    5047: "CU_FILE_INVALID_CONTEXT_ERROR",
    5048: "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR",
}


def status_name(code: int) -> str:
    """cufile.h's name for a ``CUfileOpError`` value (sign ignored), e.g. ``CU_FILE_IO_NOT_SUPPORTED (...)``."""
    code = abs(int(code))
    return _STATUS_NAMES.get(code, f"cuFile status {code}")


class _Status(ctypes.Structure):
    """``CUfileError_t``: ``{CUfileOpError err; CUresult cu_err;}``, two 4-byte enums, returned by value."""

    _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]


class _DescriptorHandle(ctypes.Union):
    _fields_ = [("fd", ctypes.c_int), ("handle", ctypes.c_void_p)]


class _Descriptor(ctypes.Structure):
    """``CUfileDescr_t``: ``{enum type; union {int fd; void *handle;} handle; const CUfileFSOps_t *fs_ops;}``."""

    _fields_ = [("type", ctypes.c_int), ("handle", _DescriptorHandle), ("fs_ops", ctypes.c_void_p)]


def nvidia_fs_loaded() -> bool:
    """Whether the nvidia-fs kernel module is loaded (without it cuFile can only run in compatibility mode)."""
    return os.path.exists("/proc/driver/nvidia-fs") or os.path.isdir("/sys/module/nvidia_fs")


def _wheel_directories() -> list[str]:
    # The nvidia-cufile wheels: nvidia/cu13/lib (CUDA 13), nvidia/cufile/lib (cu12 era), and any other nvidia/*/lib.
    found = []
    for entry in sys.path:
        if not entry or not os.path.isdir(os.path.join(entry, "nvidia")):
            continue
        for pattern in ("nvidia/cu13/lib", "nvidia/cufile/lib", "nvidia/cu12/lib", "nvidia/*/lib"):
            for directory in sorted(glob.glob(os.path.join(entry, pattern))):
                if directory not in found:
                    found.append(directory)
    return found


def library_candidates(explicit: str = "") -> list[str]:
    """What :func:`open_driver` tries to ``dlopen``, in order.

    ``explicit`` (the ``cufile_library`` setting) is the only candidate when
    given. Otherwise: the sonames (``libcufile.so.0`` finds a copy torch has
    already loaded, or one on the library path), then the ``nvidia-cufile``
    wheel's files on ``sys.path``, then ``$CUDA_HOME`` / ``/usr/local/cuda``.
    """
    if explicit:
        return [explicit]
    names = ["libcufile.so.0", "libcufile.so"]
    for directory in _wheel_directories():
        names += sorted(glob.glob(os.path.join(directory, "libcufile.so*")))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            names += [os.path.join(home, "lib64", "libcufile.so.0"), os.path.join(home, "lib", "libcufile.so.0")]
    return [n for n in names if "libcufile_rdma" not in n]


def find_library_file(explicit: str = "") -> str | None:
    """The first ``libcufile`` file that exists (without loading it), or None. For reports such as ``info``."""
    if explicit:
        return explicit if os.path.exists(explicit) else None
    for name in library_candidates():
        if os.path.isabs(name) and os.path.exists(name):
            return name
    found = ctypes.util.find_library("cufile")
    return found or None


def _bind(library: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
    try:
        function = getattr(library, name)
    except AttributeError:
        raise CufileUnavailable(f"{library._name} has no {name}(): not a cuFile library, or too old") from None
    function.restype = restype
    function.argtypes = argtypes
    return function


class Driver:
    """An opened cuFile driver: the calls GdsHandle makes, each raising on failure.

    Thread-safe: cuFile's calls may come from several threads at once (each
    thread must have the buffer's CUDA context current: the caller's job).
    Made by :func:`open_driver`, never directly.
    """

    def __init__(self, library: ctypes.CDLL, path: str):
        self.path = path
        self._library = library
        self._handle_register = _bind(
            library, "cuFileHandleRegister", _Status, [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Descriptor)]
        )
        self._handle_deregister = _bind(library, "cuFileHandleDeregister", None, [ctypes.c_void_p])
        self._buf_register = _bind(
            library, "cuFileBufRegister", _Status, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        )
        self._buf_deregister = _bind(library, "cuFileBufDeregister", _Status, [ctypes.c_void_p])
        io_args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64]
        self._read = _bind(library, "cuFileRead", ctypes.c_ssize_t, io_args)
        self._write = _bind(library, "cuFileWrite", ctypes.c_ssize_t, io_args)
        self._driver_open = _bind(library, "cuFileDriverOpen", _Status, [])
        self.version: int | None = None
        try:
            get_version = _bind(library, "cuFileGetVersion", _Status, [ctypes.POINTER(ctypes.c_int)])
            value = ctypes.c_int(0)
            if get_version(ctypes.byref(value)).err == 0:
                self.version = value.value
        except CufileUnavailable:
            pass  # older libraries: the version is only for reports
        self.compat_mode = not nvidia_fs_loaded()
        """True when cuFile can only run in compatibility mode (no nvidia-fs): its own host buffers, POSIX I/O."""

    def _open(self) -> None:
        status = self._driver_open()
        if status.err != 0:
            detail = status_name(status.err)
            if status.err == CU_FILE_CUDA_DRIVER_ERROR:
                detail += f", CUDA driver error {status.cu_err}"
            raise CufileUnavailable(f"cuFileDriverOpen failed: {detail}")

    # -------------------------------------------------------------- registration
    def register_handle(self, fd: int, filename: str | None = None) -> int:
        """``cuFileHandleRegister`` of an open descriptor; returns the cuFile handle.

        Raises:
            CufileError: cuFile refused the descriptor (e.g. ``CU_FILE_IO_NOT_SUPPORTED``).
        """
        descriptor = _Descriptor()
        descriptor.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD
        descriptor.handle.fd = fd
        handle = ctypes.c_void_p(None)
        status = self._handle_register(ctypes.byref(handle), ctypes.byref(descriptor))
        if status.err != 0:
            raise self._error("cuFileHandleRegister", status.err, status.cu_err, filename)
        return int(handle.value or 0)

    def deregister_handle(self, handle: int) -> None:
        """``cuFileHandleDeregister`` (cannot fail)."""
        self._handle_deregister(ctypes.c_void_p(handle))

    def register_buffer(self, address: int, length: int) -> None:
        """``cuFileBufRegister(address, length, 0)``; an already registered buffer is not an error.

        Raises:
            CufileError: cuFile refused (e.g. BAR1 space exhausted).
        """
        status = self._buf_register(ctypes.c_void_p(address), length, 0)
        if status.err not in (0, CU_FILE_MEMORY_ALREADY_REGISTERED):
            raise self._error("cuFileBufRegister", status.err, status.cu_err, None)

    def deregister_buffer(self, address: int) -> None:
        """``cuFileBufDeregister``.

        Raises:
            CufileError: cuFile refused (the address was not registered).
        """
        status = self._buf_deregister(ctypes.c_void_p(address))
        if status.err != 0:
            raise self._error("cuFileBufDeregister", status.err, status.cu_err, None)

    # -------------------------------------------------------------- data
    def read(self, handle: int, base: int, size: int, file_offset: int, buffer_offset: int, filename: str) -> int:
        """Reads up to ``size`` bytes at ``file_offset`` into ``base + buffer_offset``; returns the bytes read.

        Continues after short reads; returns fewer than ``size`` only at end of file.

        Raises:
            OSError: an operating-system error (errno set, ``filename`` named).
            CufileError: a cuFile status.
        """
        return self._transfer(self._read, "cuFileRead", handle, base, size, file_offset, buffer_offset, filename)

    def write(self, handle: int, base: int, size: int, file_offset: int, buffer_offset: int, filename: str) -> int:
        """Writes ``size`` bytes from ``base + buffer_offset`` at ``file_offset``; returns ``size``.

        Raises:
            OSError: an operating-system error (``ENOSPC``, ``EIO``, ...; errno and ``filename`` set).
            CufileError: a cuFile status, or a write that made no progress.
        """
        return self._transfer(self._write, "cuFileWrite", handle, base, size, file_offset, buffer_offset, filename)

    def _transfer(
        self,
        function: Any,
        call: str,
        handle: int,
        base: int,
        size: int,
        file_offset: int,
        buffer_offset: int,
        filename: str,
    ) -> int:
        done = 0
        while done < size:
            ctypes.set_errno(0)
            result = function(
                ctypes.c_void_p(handle),
                ctypes.c_void_p(base),
                size - done,
                file_offset + done,
                buffer_offset + done,
            )
            if result < 0:
                if result == -1:
                    code = ctypes.get_errno() or errno_module.EIO
                    raise OSError(
                        code,
                        f"{call} of {size - done} bytes at offset {file_offset + done} failed: {os.strerror(code)}",
                        filename,
                    )
                raise self._error(call, -result, 0, filename, f" at offset {file_offset + done}")
            if result == 0:
                if call == "cuFileRead":
                    break  # end of file
                raise self._error(call, None, 0, filename, f": no progress at offset {file_offset + done}")
            done += result
        return done

    def _error(self, call: str, code: int | None, cuda_code: int, filename: str | None, where: str = "") -> CufileError:
        detail = status_name(code) if code else "cuFile made no progress"
        if cuda_code:
            detail += f", CUDA driver error {cuda_code}"
        mode = "compatibility mode" if self.compat_mode else "GPUDirect mode"
        message = f"{call} failed{where}: {detail} (cuFile {self.path}, {mode})"
        return CufileError(errno_module.EIO, message, filename, call=call, code=code, cuda_code=cuda_code)


_lock = threading.Lock()
_drivers: dict[str, Driver | CufileUnavailable] = {}


def _load(candidates: list[str]) -> tuple[ctypes.CDLL, str]:
    tried = []
    for name in candidates:
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL, use_errno=True), name
        except OSError as e:
            tried.append(f"{name}: {e}")
    shown = "; ".join(tried[:4]) + (f"; and {len(tried) - 4} more" if len(tried) > 4 else "")
    raise CufileUnavailable(
        f"libcufile could not be loaded ({shown}). Install the nvidia-cufile wheel or set FASTPERSIST_CUFILE_LIBRARY"
    )


def _open_with_timeout(driver: Driver, timeout: float) -> None:
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            driver._open()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(e)

    thread = threading.Thread(target=run, name="fastpersist-cufile-open", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise CufileUnavailable(f"cuFileDriverOpen did not return within {timeout:g} s (is a CUDA driver installed?)")
    if outcome[0] is not None:
        raise outcome[0]


def open_driver(library: str = "", *, timeout: float = DRIVER_OPEN_TIMEOUT_SECONDS) -> Driver:
    """Loads libcufile (``library``, or the first of :func:`library_candidates`) and opens its driver, once.

    The outcome, a :class:`Driver` or the reason it failed, is cached per
    ``library`` value for the life of the process: the driver is never closed
    (cuFile closes it at exit). Call only where torch sees a CUDA device: on a
    machine without a CUDA driver ``cuFileDriverOpen`` may never return, which
    ``timeout`` guards against (the stuck thread is left behind).

    Raises:
        CufileUnavailable: the library is missing or not cuFile, or
            ``cuFileDriverOpen`` failed or timed out; the message says which.
    """
    with _lock:
        cached = _drivers.get(library)
        if cached is None:
            try:
                handle, path = _load(library_candidates(library))
                driver = Driver(handle, getattr(handle, "_name", path))
                _open_with_timeout(driver, timeout)
                cached = driver
            except CufileUnavailable as e:
                cached = e
            except Exception as e:  # noqa: BLE001 - ctypes or the library failing in any way: not usable
                cached = CufileUnavailable(f"cuFile could not start: {type(e).__name__}: {e}")
            _drivers[library] = cached
    if isinstance(cached, CufileUnavailable):
        raise CufileUnavailable(str(cached))
    return cached


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _drivers.clear()  # cuFile's driver state does not survive fork (nor does CUDA's)


os.register_at_fork(after_in_child=_forget_after_fork)
