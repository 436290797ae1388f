"""Exception types raised by fastpersist.

I/O failures are raised as the built-in ``OSError`` subclasses
(``FileNotFoundError``, ``PermissionError``, ...) with ``errno`` and
``filename`` set, so callers can keep the handlers they wrote for
``torch.save``.  The types below cover what is specific to checkpoints.
Each subclasses the built-in type that ``torch.save`` / ``torch.load`` would
raise in the same situation, so existing ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "FastPersistError",
    "ConfigError",
    "EngineUnavailableError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "UnsupportedObjectError",
    "TruncatedCheckpointError",
    "InvalidSafetensorsError",
    "DistributedCheckpointError",
    "TensorModifiedError",
    "TargetPermissionError",
    "TargetDirectoryMissingError",
    "MixedDtypeViewsError",
    "NotWritableError",
    "ReplicaDivergenceWarning",
]


class FastPersistError(Exception):
    """Base class of every exception defined by fastpersist."""


class ConfigError(FastPersistError, ValueError):
    """A setting has an invalid name, type or value."""


class EngineUnavailableError(FastPersistError, RuntimeError):
    """An I/O engine that was named explicitly cannot start on this machine."""


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


class UnsupportedObjectError(FastPersistError, TypeError):
    """The object to save contains something fastpersist cannot serialize."""


class TruncatedCheckpointError(CorruptCheckpointError, EOFError):
    """A file that ends too early; still an EOFError, which torch.load raised for it."""


class InvalidSafetensorsError(CorruptCheckpointError):
    """A safetensors file whose header is invalid: bad length, JSON, dtype, shape or offsets.

    The message uses the safetensors library's wording ("invalid offset for
    tensor `x`", "incomplete metadata, file not fully covered", ...) and says
    which tensor is at fault (also in ``record``).
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
# | two tensors view one storage with other dtypes   | RuntimeError    | MixedDtypeViewsError (UnsupportedObjectError -> TypeError, RuntimeError) |
# | ``f`` is neither a path nor has ``write``        | AttributeError  | NotWritableError (AttributeError, TypeError)              |
# | damaged / truncated file                         | RuntimeError, EOFError, UnpicklingError | CorruptCheckpointError (RuntimeError), TruncatedCheckpointError (EOFError) |


class TargetPermissionError(FastPersistError, PermissionError, RuntimeError):
    """The caller may not write the target (or create files in its directory); nothing was changed.

    torch.save raises RuntimeError here; this is both a PermissionError and a RuntimeError.
    """


class TargetDirectoryMissingError(FastPersistError, FileNotFoundError, RuntimeError):
    """The directory to save into does not exist (torch.save: RuntimeError "Parent directory ... does not exist")."""


class MixedDtypeViewsError(UnsupportedObjectError, RuntimeError):
    """Two tensors or storages view the same memory with different dtypes (torch.save: RuntimeError)."""


class NotWritableError(FastPersistError, AttributeError, TypeError):
    """``f`` is neither a path nor a file object with ``write`` (torch.save: AttributeError)."""
