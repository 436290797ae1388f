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
