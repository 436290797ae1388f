"""Exception types raised by fastpersist.

I/O failures are raised as the built-in ``OSError`` subclasses
(``FileNotFoundError``, ``PermissionError``, ...) with ``errno`` and
``filename`` set, so callers can keep the handlers they wrote for
``torch.save``.  The types below cover what is specific to checkpoints.
Each subclasses the built-in type that ``torch.save`` / ``torch.load`` would
raise in the same situation, so existing ``except`` clauses keep working.

Every exception and warning class of fastpersist is defined here, including
the types the compiled core raises (the binding takes them from this module)
and the internal signals that never leave the module raising them; other
modules import them from here (and re-export the public ones where they were
first published). ``tests/docs/test_architecture_doc.py`` keeps it so.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings

__all__ = [
    "FastPersistError",
    "ConfigError",
    "EngineUnavailableError",
    "UnexpectedEndOfFileError",
    "CudaUnavailableError",
    "GdsUnavailableError",
    "CufileError",
    "CufileUnavailable",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "UnsafeCheckpointPathError",
    "UnsupportedObjectError",
    "TruncatedCheckpointError",
    "MissingEndRecordError",
    "InvalidSafetensorsError",
    "UnsafeFileNameError",
    "DistributedCheckpointError",
    "TensorModifiedError",
    "TargetPermissionError",
    "TargetDirectoryMissingError",
    "TargetIsADirectoryError",
    "MixedDtypeViewsError",
    "NotWritableError",
    "CheckpointIOError",
    "ObjectStoreError",
    "ObjectStoreCredentialsError",
    "BucketNotFoundError",
    "ObjectNotFoundError",
    "ObjectStoreUnavailableError",
    "CheckpointChangedError",
    "OffloadPlanError",
    "UsageError",
    "ReplicaDivergenceWarning",
    "NonAtomicSaveWarning",
    "caller_location",
    "warn_at_caller",
    "torch_compatible",
    "unsupported_object_error",
]


class FastPersistError(Exception):
    """Base class of fastpersist's exceptions.

    Not of all of them: :class:`UnexpectedEndOfFileError`,
    :class:`CufileUnavailable`, :class:`OffloadPlanError`,
    :class:`UsageError`, the warnings and the internal signals keep the bases
    they had before they moved into this module.
    """


class ConfigError(FastPersistError, ValueError):
    """A setting has an invalid name, type or value."""


class EngineUnavailableError(FastPersistError, RuntimeError):
    """An I/O engine that was named explicitly cannot start on this machine."""


class UnexpectedEndOfFileError(OSError, EOFError):
    """A read reached the end of the file before the requested number of bytes.

    Raised by the native core (``fastpersist.io.engine``); ``filename`` is the
    file. Both an ``OSError`` and an ``EOFError``.
    """

    def __str__(self):
        return str(self.args[0]) if self.args else "unexpected end of file"


class CudaUnavailableError(FastPersistError, RuntimeError):
    """A CUDA-only API (``GdsHandle``) was used where torch sees no CUDA device; ``AioHandle`` serves host memory."""


class GdsUnavailableError(EngineUnavailableError):
    """``GdsHandle``'s ``cufile`` path was named explicitly but cuFile cannot start (no libcufile, or its driver
    refused to open); the message says why. ``gds_path="auto"`` falls back to the ``bounce`` path instead."""


class CufileError(FastPersistError, OSError):
    """A cuFile call failed with a cuFile status (not an operating-system error, which raises the usual ``OSError``
    subclass with its ``errno``).

    An ``OSError`` with ``errno`` EIO and ``filename`` set where a file is involved.

    Attributes:
        call: the cuFile function (``"cuFileRead"``, ``"cuFileHandleRegister"``, ...).
        code: the ``CUfileOpError`` value (5001 ... 5050), or None.
        cuda_code: the CUDA driver error that came with ``CU_FILE_CUDA_DRIVER_ERROR``, else 0.
    """

    def __init__(self, *args, call: str = "", code: int | None = None, cuda_code: int = 0):
        super().__init__(*args)
        self.call = call
        self.code = code
        self.cuda_code = cuda_code


class CufileUnavailable(Exception):
    """cuFile cannot be used here; ``str()`` says why (library not found, a symbol missing, the driver refused).

    Raised by ``fastpersist.deepnvme.cufile``; ``GdsHandle`` turns it into
    :class:`GdsUnavailableError` where ``cufile`` was named, and falls back
    to its ``bounce`` path under ``auto``.
    """


class CorruptCheckpointError(FastPersistError, RuntimeError):
    """A checkpoint file is truncated, malformed or not a checkpoint at all.

    Attributes:
        path: the file, when known.
        record: the name of the damaged record, when known.
    """

    def __init__(self, message: str, *, path: str | None = None, record: str | None = None):
        super().__init__(message)
        self.path = path
        self.record = record


class ChecksumMismatchError(CorruptCheckpointError):
    """A record's bytes do not match the checksum stored with them."""


class UnsafeCheckpointPathError(CorruptCheckpointError):
    """A checkpoint's own metadata names a file outside the checkpoint's directory; nothing was opened.

    The file names a checkpoint lists (a sharded safetensors index's
    ``weight_map``) must be plain names of files beside it: an absolute path,
    ``..`` or a name with a directory separator is refused before any of the
    listed files is opened, so a checkpoint from elsewhere cannot make the
    reader open arbitrary files. A :class:`CorruptCheckpointError`.

    Attributes:
        path: the metadata file (the index).
        record: the key whose entry names the file.
    """


class UnsupportedObjectError(FastPersistError, TypeError):
    """The object to save contains something fastpersist cannot serialize."""


class UnpicklableObjectError(UnsupportedObjectError, pickle.PicklingError):
    """The pickler refused an object (torch.save raises ``pickle.PicklingError`` for it)."""


class UnpicklableAttributeError(UnsupportedObjectError, AttributeError):
    """The pickler could not find an object by its name, e.g. a local class (torch.save: ``AttributeError``)."""


def unsupported_object_error(cause: BaseException, message: str) -> UnsupportedObjectError:
    """The :class:`UnsupportedObjectError` for what the pickler raised: also of ``cause``'s type (PicklingError,
    AttributeError or TypeError), so the ``except`` clause written for torch.save catches it."""
    if isinstance(cause, pickle.PicklingError):
        return UnpicklableObjectError(message)
    if isinstance(cause, AttributeError):
        return UnpicklableAttributeError(message)
    return UnsupportedObjectError(message)  # already a TypeError


class TruncatedCheckpointError(CorruptCheckpointError, EOFError):
    """A file that ends too early; still an EOFError, which torch.load raised for it."""


class MissingEndRecordError(CorruptCheckpointError):
    """No zip end record: a truncated archive, or not a zip archive at all."""


class InvalidSafetensorsError(CorruptCheckpointError):
    """A safetensors file whose header is invalid: bad length, JSON, dtype, shape or offsets.

    The message uses the safetensors library's wording ("invalid offset for
    tensor `x`", "incomplete metadata, file not fully covered", ...) and says
    which tensor is at fault (also in ``record``).
    """


class UnsafeFileNameError(CorruptCheckpointError):
    """A checkpoint names one of its own files with something other than a plain file name beside it.

    A sharded checkpoint's manifest names its parts, a DCP checkpoint's
    ``.metadata`` its data files; each must be a file in the checkpoint's
    directory (an object beside the manifest, on S3). A path (``../x``,
    ``/etc/passwd``, ``sub/dir``), ``.``, ``..``, an empty name or one with a
    NUL byte is refused before anything is opened, by every reader of
    sharded checkpoints and by ``fastpersist.verify`` of DCP checkpoints: a
    crafted checkpoint cannot make a load read another file's bytes as its own. A
    :class:`CorruptCheckpointError`, so a ``RuntimeError``, as torch.load raises
    for a file that is not a sound checkpoint.

    Attributes:
        path: the checkpoint (the manifest, or the DCP directory).
        record: the name refused.
    """


class DistributedCheckpointError(FastPersistError, RuntimeError):
    """A collective (data-parallel) save or load failed on one or more ranks.

    Raised on every rank of the group, so that no rank goes on as if the
    checkpoint existed. Nothing was committed: the previous checkpoint at the
    path is intact.

    Attributes:
        failures: group rank -> what went wrong there (an exception's text,
            or that the rank did not report within the timeout).
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class ReplicaDivergenceWarning(UserWarning):
    """A collective save found tensors whose values differ between ranks; rank 0's values were written.

    A collective save writes rank 0's object (what ``torch.save`` on rank 0
    would write). Per-rank state (RNG states, unsynchronized metrics) is
    expected to differ; weights that differ mean the replicas drifted apart.
    Silence it with ``divergence="ignore"``, or make it an error with
    ``divergence="error"`` (docs/distributed.md).
    """


class NonAtomicSaveWarning(UserWarning):
    """A save was written in place (not atomically): the previous file was overwritten as it went."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller_location() -> tuple[str, int, dict] | None:
    """The first frame outside fastpersist, as ``(file name, line, its module's globals)``, or None.

    Taken by an entry point whose warnings may be raised later on the
    background save thread (:func:`warn_at_caller` with ``location=``).
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


def warn_at_caller(
    message: str, category: type[Warning] = UserWarning, location: tuple[str, int, dict] | None = None
) -> None:
    """``warnings.warn`` attributed to the first frame outside fastpersist: the user's line, not ours.

    ``location`` (from :func:`caller_location`, taken in the caller) names
    that line from another thread: on the background save thread every frame
    is ours or the thread's.
    """
    if location is not None:
        filename, line, module_globals = location
        registry = module_globals.setdefault("__warningregistry__", {})
        module = module_globals.get("__name__", "")
        warnings.warn_explicit(message, category, filename, line, module, registry, module_globals)
        return
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class TensorModifiedError(FastPersistError, RuntimeError):
    """A tensor changed while a pipelined ``async_save`` was still reading it; nothing was committed.

    The file would have mixed old and new values (with valid CRCs), so the save
    is failed instead and the previous file at the path stays. Wait for the save
    before modifying the state (``fastpersist.Checkpointer`` does it before each
    optimizer step), or use ``async_save(..., mode="snapshot")``.

    Attributes:
        path: the checkpoint that was not written.
        names: where the modified tensors were found in the object (as many as known).
    """

    def __init__(self, message: str, *, path: str | None = None, names: tuple[str, ...] = ()):
        super().__init__(message)
        self.path = path
        self.names = names


# Where torch raises a different built-in type for the same case, our type subclasses
# both, so ``except RuntimeError`` written for torch.save and ``except PermissionError``
# (the precise type) both catch it:
#
# | case                                             | torch raises    | fastpersist raises (bases)                                |
# |--------------------------------------------------|-----------------|-----------------------------------------------------------|
# | the file exists and may not be written (0444)    | RuntimeError    | TargetPermissionError (PermissionError, RuntimeError)     |
# | the directory to save into is missing            | RuntimeError    | TargetDirectoryMissingError (FileNotFoundError, RuntimeError) |
# | the path to save to is a directory               | RuntimeError    | TargetIsADirectoryError (IsADirectoryError, RuntimeError) |
# | two tensors view one storage with other dtypes   | RuntimeError    | MixedDtypeViewsError (UnsupportedObjectError -> TypeError, RuntimeError) |
# | ``f`` is neither a path nor has ``write``        | AttributeError  | NotWritableError (AttributeError, TypeError)              |
# | I/O error while saving or loading (ENOSPC, EROFS, EIO, EDQUOT, ...) | RuntimeError | CheckpointIOError (OSError, RuntimeError) |
# | damaged / truncated file                         | RuntimeError, EOFError, UnpicklingError | CorruptCheckpointError (RuntimeError), TruncatedCheckpointError (EOFError) |
# | a checkpoint names a file outside itself (../x)  | RuntimeError (as for any damaged file) | UnsafeFileNameError (CorruptCheckpointError -> RuntimeError) |


class TargetPermissionError(FastPersistError, PermissionError, RuntimeError):
    """The caller may not write the target (or create files in its directory); nothing was changed.

    torch.save raises RuntimeError here; this is both a PermissionError and a RuntimeError.
    """


class TargetDirectoryMissingError(FastPersistError, FileNotFoundError, RuntimeError):
    """The directory to save into does not exist (torch.save: RuntimeError "Parent directory ... does not exist")."""


class TargetIsADirectoryError(FastPersistError, IsADirectoryError, RuntimeError):
    """The path to save to is a directory (torch.save: RuntimeError "... Is a directory")."""


class MixedDtypeViewsError(UnsupportedObjectError, RuntimeError):
    """Two tensors or storages view the same memory with different dtypes (torch.save: RuntimeError)."""


class NotWritableError(FastPersistError, AttributeError, TypeError):
    """``f`` is neither a path nor a file object with ``write`` (torch.save: AttributeError)."""


class CheckpointIOError(FastPersistError, OSError, RuntimeError):
    """An I/O error while saving or loading a checkpoint: a full disk (ENOSPC), a read-only filesystem
    (EROFS), a quota (EDQUOT), a failing device (EIO), ...

    An ``OSError`` with ``errno``, ``strerror`` and ``filename`` set, and a
    ``RuntimeError``, which is what torch.save and torch.load raise for the
    same failures: ``except RuntimeError`` and ``except OSError`` both catch it.
    """


class ObjectStoreError(CheckpointIOError):
    """A save to or load from an object store (``s3://bucket/key``) failed: a network error, a refused request.

    A :class:`CheckpointIOError` (``OSError`` and ``RuntimeError``) whose
    ``filename`` is the URL; ``code`` is the store's error code (``"NoSuchBucket"``,
    ``"SlowDown"``, ...) or the botocore exception's name for network errors. A
    failed save has aborted its multipart upload: the previous object at the key
    is intact.
    """

    def __init__(self, *args, code: str | None = None):
        super().__init__(*args)
        self.code = code


class ObjectStoreCredentialsError(ObjectStoreError, PermissionError):
    """The object store refused the credentials (missing, unknown, expired or not permitted)."""


class BucketNotFoundError(ObjectStoreError, FileNotFoundError):
    """The bucket of an ``s3://`` URL does not exist (for this endpoint and region)."""


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """No object at the key of an ``s3://`` URL (torch.load raises ``FileNotFoundError`` for a missing path)."""


class ObjectStoreUnavailableError(FastPersistError, ImportError):
    """An ``s3://`` URL was given but boto3 is not installed (``pip install fastpersist[s3]``)."""


class CheckpointChangedError(CheckpointIOError):
    """A checkpoint file changed on disk while an offloaded model was reading it."""


class OffloadPlanError(ValueError):
    """The model, the checkpoint and the budget do not fit together (the message names what and how)."""


class UsageError(ValueError):
    """Command-line options that cannot run as given here (``fastpersist tune``'s, ds_nvme_tune's); the message
    says why, or what to use instead."""


# ----------------------------------------------------------------------------- internal signals
# Raised and caught inside one module, never seen by a caller (so not in __all__).


class StoreWaitTimedOut(Exception):
    """``distributed.coordinator``: the keys waited for did not all appear in the store before the deadline."""


class CallAbandoned(Exception):
    """``distributed.coordinator``: another rank abandoned the collective call; ``args[0]`` is
    ``(reason, failures)``."""


class CallNotOpened(Exception):
    """``distributed.coordinator``: rank 0 did not open the collective call (it never made it) before the deadline."""


class PartSkippedError(ObjectStoreError):
    """``io.targets.s3.upload``: a part not uploaded because another part had already failed (never the error a save
    raises)."""


class ShortResponseError(Exception):
    """``io.targets.s3.ranges``: a ranged GET's response ended early (retried)."""


_KEPT_ON_LOAD = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def torch_compatible(error: OSError, *, saving: bool, detail: str = "") -> OSError:
    """``error`` as an exception that ``except RuntimeError`` (torch's type for I/O failures) catches too.

    Keeps ``errno``, ``filename`` and notes; ``detail`` is appended to the
    message. A permission error of a save becomes a
    :class:`TargetPermissionError`, a missing directory a
    :class:`TargetDirectoryMissingError`, anything else a
    :class:`CheckpointIOError`. On loads, the errors ``open()`` raises for a
    path (missing, not permitted, a directory) stay as they are: torch.load
    raises those too.

    Returns ``error`` itself when nothing is to change.
    """
    if isinstance(error, RuntimeError) or (not saving and isinstance(error, _KEPT_ON_LOAD)):
        if detail:
            error.add_note(detail)
        return error
    if saving and isinstance(error, PermissionError):
        kind: type[OSError] = TargetPermissionError
    elif saving and isinstance(error, FileNotFoundError):
        kind = TargetDirectoryMissingError
    else:
        kind = CheckpointIOError
    message = error.strerror or str(error)
    if detail:
        message = f"{message}; {detail}"
    converted = kind(error.errno, message, error.filename) if error.errno is not None else kind(message)
    for note in getattr(error, "__notes__", ()):
        converted.add_note(note)
    converted.__traceback__ = error.__traceback__
    return converted


_ALSO_RAISED_AS: dict[tuple[type, type], type] = {}


def also_raised_as(error: BaseException, other: type[BaseException]) -> BaseException:
    """``error`` as an instance of a subclass of both its own type and ``other`` (cached per pair of types).

    For a drop-in of a library whose callers catch the library's own type:
    the safetensors library raises ``SafetensorError`` where fastpersist
    raises ``OSError`` (an I/O error while saving), so under
    ``fastpersist.patch`` both ``except`` clauses must catch it. Keeps the
    message, ``errno``/``filename``, attributes, notes, cause and traceback.
    Returns ``error`` itself when it already is an ``other``.
    """
    if isinstance(error, other):
        return error
    key = (type(error), other)
    kind = _ALSO_RAISED_AS.get(key)
    if kind is None:
        kind = _ALSO_RAISED_AS[key] = type(type(error).__name__, key, {"__module__": type(error).__module__})
    converted = kind.__new__(kind, *error.args)
    BaseException.__init__(converted, *error.args)
    if isinstance(error, OSError):
        OSError.__init__(converted, *error.args)
        converted.filename = error.filename
        if error.filename2 is not None:
            converted.filename2 = error.filename2
    converted.__dict__.update(error.__dict__)  # notes and fastpersist's attributes (path, record, ...)
    converted.__cause__, converted.__context__ = error.__cause__, error.__context__
    converted.__traceback__ = error.__traceback__
    return converted
