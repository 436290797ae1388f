"""Every fastpersist setting, in one place.

Each setting has a typed default, an environment variable that overrides the
default when the module is first imported, a getter, a process-wide setter
that returns a restorer, and a context manager for the calling thread::

    import fastpersist
    fastpersist.config.get("buffer_size")            # 67108864
    restore = fastpersist.config.set(engine="threads")   # the whole process, from now on
    restore()                                        # back to what it was
    with fastpersist.config.override(direct=False):  # this thread only, inside the block
        fastpersist.save(state, "ckpt.pt")
    fastpersist.save(state, "ckpt.pt", buffer_count=2)   # only this call

Precedence, highest first: keyword arguments of a call, :func:`override`
blocks of the calling thread (innermost first), :func:`set`, the JSON file
named by ``FASTPERSIST_CONFIG`` (what ``fastpersist tune`` writes), the
individual environment variables, the defaults below.

Sizes accept integers or strings with a binary suffix (``"8M"``, ``"64MiB"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fractions
import json
import os
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from fastpersist.errors import ConfigError

__all__ = [
    "Settings",
    "parse_size",
    "size_argument",
    "ENGINES",
    "GDS_PATHS",
    "get",
    "set",
    "override",
    "Restorer",
    "settings",
    "resolve",
    "reset",
    "load_file",
    "read_file",
    "save_file",
    "environment_variable",
    "describe",
    "split_overrides",
]

ENGINES = ("auto", "io_uring", "threads")
ASYNC_MODES = ("pipelined", "snapshot")
GDS_PATHS = ("auto", "cufile", "bounce")
TMPFS_MAPPING = ("auto", "always", "never")
DEVICE_CHECKSUM = ("auto", "always", "never")
REUSE_REPLACED = ("auto", "always", "never")
CONFIG_FILE_VERSION = 1
_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Settings:
    """An immutable snapshot of every setting. See docs/configuration.md."""

    engine: str = "auto"
    """I/O engine: ``auto`` (io_uring if it starts, else threads; the reason for a fallback is logged once on the
    ``fastpersist`` logger), ``io_uring`` or ``threads`` (naming one that cannot start raises
    ``EngineUnavailableError``)."""
    direct: bool = True
    """Use O_DIRECT where the filesystem supports it. Where it refuses (tmpfs, overlayfs, some network filesystems)
    fastpersist uses buffered I/O + fsync and says why in ``fastpersist info``."""
    block_size: int = 8 * _MiB
    """Bytes per I/O request submitted to the engine. A multiple of 4096."""
    queue_depth: int = 16
    """Requests each lane keeps in flight."""
    intra_op_parallelism: int = 1
    """Lanes (threads, each with its own io_uring ring) that split one request."""
    single_submit: bool = False
    """Submit each request with its own system call instead of in batches (io_uring)."""
    overlap_events: bool = True
    """Reap completions while submitting (a sliding window) instead of batch by batch."""
    buffer_size: int = 64 * _MiB
    """Bytes in each page-locked staging buffer of the save ring, and in each piece a CPU load reads in place. A
    multiple of 4096, and a multiple or divisor of ``block_size``."""
    buffer_count: int = 8
    """Buffers in the save ring (2 to 64). Host memory for staging a save is at most ``buffer_size * buffer_count``
    (512 MiB by default: about 448 MiB in flight, as fio keeps at QD 32 x 16 MiB), allocated on first use and
    reused; a checkpoint smaller than that leases only what it needs (``memory.ring_shape``), and
    ``fastpersist.release_buffers()`` frees idle buffers."""
    read_buffer_size: int = 16 * _MiB
    """Bytes in each page-locked buffer of the ring of CUDA loads. A multiple of 4096. Many small buffers keep the
    storage busier than a few large ones: a buffer idles from its read's end until its copy and checksum are done, so
    16 x 16 MiB loads faster than 8 x 64 MiB, with half the memory (measured in docs/performance.md)."""
    read_buffer_count: int = 16
    """Buffers in the ring of CUDA loads (2 to 64): a buffer is refilled only after its host-to-device copy and
    checksum, so loads need more reads in flight than saves; a storage loaded on its own (``weights_only=False``) is cut
    over all of them. Host memory: ``read_buffer_size * read_buffer_count`` (256 MiB by default). CPU loads read
    straight into the tensors and use no ring; those that wait for each storage (``weights_only=False``, a callable
    ``map_location``) read up to ``read_buffer_size * read_buffer_count`` bytes of the next tensors ahead."""
    fsync: bool = True
    """``save`` returns only once the file and its directory entry are durable."""
    checksum: bool = True
    """Write the CRC-32 of every record (verified by ``zipfile``, ``fastpersist verify``, ``load(verify=True)``)."""
    verify: bool = True
    """``load`` of a path checks every record's CRC-32, overlapped with the reads (see reliability.md). File objects
    and ``mmap=True`` loads are verified only with ``load(..., verify=True)``."""
    device_checksum: str = "auto"
    """Verified loads to CUDA checksum each record's whole 16 MiB and 4 MiB segments on the GPU after their copy
    (torch operations replayed as CUDA graphs on a stream of their own), and only the rest on the CPU, whose pass
    otherwise competes with the reads and copies for the host's memory bandwidth. A process's first graphs take time
    to make, almost all of it warming the device up, and keep part of each device's memory until
    ``fastpersist.release_buffers()``. ``auto`` never makes a load wait for the warm-up: a verified load of at least
    1 GiB to a device with no graphs ready warms it up on a thread of its own (no capture there) and checksums on the
    CPU; the next such load captures the graphs inside itself (milliseconds) and later loads reuse them. While it
    captures, a ``torch.cuda.synchronize()`` on another thread of the process would fail; no capture runs outside a
    load. ``always`` makes them in the first load that needs them, ``never`` checksums on the CPU only and captures
    nothing (``true``/``false`` mean ``always``/``never``). Where the graphs cannot be made (the device's memory is
    full), the CPU checksums. The gain and both costs are measured in docs/performance.md."""
    tmpfs_mapping: str = "auto"
    """Saves to tmpfs (/dev/shm) allocate the file's range first, then copy each window into a mapping of the file on
    the CRC pool's threads side by side, instead of ``write`` calls, which fill a tmpfs file one thread at a time
    under its inode lock. A full filesystem still raises ``ENOSPC`` (from the allocation, before any copy).
    ``auto`` maps where the pool has at least four threads (on fewer cores the zero-filling of the allocation
    costs more than the parallel copies gain), ``always`` and ``never`` as they say. Measured in
    docs/performance.md."""
    reuse_replaced: str = "auto"
    """A save that replaces a file of at least 64 MiB keeps the replaced file, under a temporary name, for the next
    save of the same path, which overwrites its blocks in place instead of allocating new ones while the old ones
    are freed: on a disk that discards freed blocks (ext4 mounted with ``discard``, common on cloud machines)
    freeing costs about as much disk time as writing. A kept file is used only while nothing else has it open or
    linked, and freed 30 s after it was kept, at exit or by ``fastpersist.release_buffers()``; until then the
    directory holds one more hidden file of the checkpoint's size. ``auto`` keeps them for the saves of a
    ``Checkpointer`` (checkpoints every few steps, Lightning's asynchronous plugin among them), ``always`` for
    every save, ``never`` for none. Measured in docs/performance.md."""
    huge_pages: bool = True
    """Ask for transparent huge pages (best effort) for large load destinations (fewer page faults) and for the pooled
    staging rings of saves and loads. Direct requests from huge pages need few scatter-gather segments, which
    decides write speed on disks that accept few segments in flight; the first save of a process then takes longer
    to lock its ring, which later saves reuse (measured in
    [performance.md](performance.md#staging-memory-on-huge-pages)). On a virtual machine that hands freed memory back
    to its host (virtio-balloon free page reporting, shown by ``fastpersist info``) load destinations stay on 4 KiB
    pages whatever this says: fresh huge pages there are mostly memory the host took back, and fault in several
    times slower (see [checkpoint-benchmark.md](checkpoint-benchmark.md#equal-conditions-for-every-load))."""
    async_mode: str = "pipelined"
    """``async_save``: ``pipelined`` writes straight from the live tensors (no extra memory; the state must not change
    until the save is done), ``snapshot`` copies the state into a reusable pinned staging area first (host memory =
    checkpoint size). See [async.md](async.md)."""
    async_max_pending: int = 1
    """``async_save``: saves in flight at most (1 to 64); a new save first waits for the oldest to finish. In snapshot
    mode each pending save holds one staging area."""
    atomic: bool = True
    """Save regular files to a temporary file beside them, fsynced and renamed over the target: the previous file
    stays intact until the new one is complete. Off: written in place as torch.save does (the inode and hard links
    stay; an interrupted save leaves a truncated file). See [compatibility.md](compatibility.md)."""
    s3_part_size: int = 64 * _MiB
    """Object stores (``s3://``): bytes per multipart-upload part and per ranged GET of a load. 5 MiB (the S3
    minimum) to 5 GiB, a multiple of 4096; raised automatically where a checkpoint would need more than 10,000
    parts. See [object-storage.md](object-storage.md)."""
    s3_concurrency: int = 8
    """Object stores (``s3://``): parts uploaded, or ranges downloaded, at once (1 to 64). A save's host memory is
    at most ``max(2, s3_concurrency) * s3_part_size`` (the upload of a local file, as in a two-tier save:
    ``s3_concurrency * s3_part_size``); a load holds the whole object in host memory."""

    gds_path: str = "auto"
    """``GdsHandle``'s data path between CUDA tensors and files: ``auto`` (``cufile`` when libcufile loads and its
    driver opens, else ``bounce``; the reason is logged once on the ``fastpersist`` logger), ``cufile`` (NVIDIA cuFile;
    raises ``GdsUnavailableError`` where it cannot start; compatibility mode without nvidia-fs counts), ``bounce``
    (pinned host chunks and the I/O engine, no cuFile). See [deepnvme-parity.md](deepnvme-parity.md)."""
    cufile_library: str = ""
    """Path of ``libcufile.so`` for ``GdsHandle``'s ``cufile`` path. Empty: the one already loaded or on the library
    path, else the ``nvidia-cufile`` wheel's. cuFile is loaded only when a ``GdsHandle`` is made, never on import."""

    def __post_init__(self) -> None:
        _validate(self)

    def replace(self, **changes: Any) -> Settings:
        """Returns a copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **_coerce_all(changes))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def environment_variable(name: str) -> str:
    """The environment variable that sets ``name`` (``FASTPERSIST_<NAME>``)."""
    _check_name(name)
    return "FASTPERSIST_" + name.upper()


def describe() -> list[tuple[str, str, Any, str]]:
    """(name, environment variable, default, description) for every setting, the description on one line."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(Settings))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(after.value.value.split())
    return [(n, environment_variable(n), getattr(_DEFAULTS, n), docs.get(n, "")) for n in _FIELDS]


def split_overrides(function: str, kwargs: Mapping[str, Any], allow_other: bool) -> tuple[dict, dict]:
    """Splits a call's keyword arguments into setting overrides and the rest.

    Raises:
        TypeError: ``allow_other`` is False and a keyword is not a setting name
            (the message lists the settings), as Python does for unknown keywords.
    """
    overrides = {k: v for k, v in kwargs.items() if k in _FIELDS}
    other = {k: v for k, v in kwargs.items() if k not in _FIELDS}
    if other and not allow_other:
        name = next(iter(other))
        raise TypeError(
            f"{function}() got an unexpected keyword argument {name!r}; "
            f"fastpersist settings are: {', '.join(sorted(_FIELDS))}"
        )
    return overrides, other


def _check_name(name: str) -> None:
    if name not in _FIELDS:
        raise ConfigError(f"unknown fastpersist setting {name!r}; known settings: {', '.join(_FIELDS)}")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_WERE_SWITCHES = {"device_checksum"}  # booleans once: true/false still mean always/never


def parse_size(text: str | int) -> int:
    """Bytes from a size: the one size syntax of every setting, command and benchmark.

    An integer is a byte count. A string is a number (fractions allowed) with
    an optional unit ``K``, ``M``, ``G`` or ``T``, which may be followed by
    ``B`` or ``iB`` and is case-insensitive. Every unit is binary: ``"2G"``,
    ``"2GB"`` and ``"2GiB"`` all mean ``2 * 2**30`` bytes; ``"1.5M"`` is
    1572864. The result must be a whole number of bytes (``"1.5"`` is refused).

    Raises:
        ValueError: ``text`` is not a size (a negative integer, a bool, an
            unknown unit). The message shows the accepted forms.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"not a size: {text!r} (examples: 4096, 8M, 512MiB, 1.5G)")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 8M, 512MiB, 1.5G; units are binary)")
    power = " kmgt".index((match.group(2) or " ").lower())
    value = fractions.Fraction(match.group(1)) * (1 << (10 * power))
    if value.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def size_argument(text: str) -> int:
    """:func:`parse_size` as an ``argparse`` ``type=``: a bad size becomes a usage error naming the forms."""
    import argparse

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _coerce(name: str, value: Any) -> Any:
    _check_name(name)
    kind = _FIELDS[name].type
    if kind in ("bool", bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"setting {name!r} takes a boolean (true/false), got {value!r}")
    if kind in ("int", int):
        if isinstance(value, bool):
            raise ConfigError(f"setting {name!r} takes an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return parse_size(value)
            except ValueError:
                pass
        raise ConfigError(f"setting {name!r} takes an integer or a size like '8M', got {value!r}")
    if kind in ("str", str):
        if name in _WERE_SWITCHES and (isinstance(value, bool) or str(value).strip().lower() in _TRUE | _FALSE):
            return "always" if value is True or str(value).strip().lower() in _TRUE else "never"
        if isinstance(value, str):
            return value.strip()
        raise ConfigError(f"setting {name!r} takes a string, got {value!r}")
    raise AssertionError(f"unhandled setting type {kind!r}")


def _coerce_all(values: Mapping[str, Any]) -> dict[str, Any]:
    return {name: _coerce(name, value) for name, value in values.items()}


def _validate(s: Settings) -> None:
    if s.engine not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {s.engine!r}")
    for name in ("block_size", "buffer_size", "read_buffer_size"):
        value = getattr(s, name)
        if value < 4096 or value % 4096:
            raise ConfigError(f"{name} must be a positive multiple of 4096 bytes, got {value}")
    if s.buffer_size % s.block_size and s.block_size % s.buffer_size:
        raise ConfigError(
            f"buffer_size ({s.buffer_size}) must be a multiple of block_size ({s.block_size}) or divide it"
        )
    if not 1 <= s.queue_depth <= 4096:
        raise ConfigError(f"queue_depth must be between 1 and 4096, got {s.queue_depth}")
    if not 1 <= s.intra_op_parallelism <= 256:
        raise ConfigError(f"intra_op_parallelism must be between 1 and 256, got {s.intra_op_parallelism}")
    if s.gds_path not in GDS_PATHS:
        raise ConfigError(f"gds_path must be one of {GDS_PATHS}, got {s.gds_path!r}")
    if s.tmpfs_mapping not in TMPFS_MAPPING:
        raise ConfigError(f"tmpfs_mapping must be one of {TMPFS_MAPPING}, got {s.tmpfs_mapping!r}")
    if s.reuse_replaced not in REUSE_REPLACED:
        raise ConfigError(f"reuse_replaced must be one of {REUSE_REPLACED}, got {s.reuse_replaced!r}")
    if s.device_checksum not in DEVICE_CHECKSUM:
        raise ConfigError(
            f"device_checksum must be one of {DEVICE_CHECKSUM} (or true/false), got {s.device_checksum!r}"
        )
    if s.async_mode not in ASYNC_MODES:
        raise ConfigError(f"async_mode must be one of {ASYNC_MODES}, got {s.async_mode!r}")
    if not 1 <= s.async_max_pending <= 64:
        raise ConfigError(f"async_max_pending must be between 1 and 64, got {s.async_max_pending}")
    if s.s3_part_size < 5 * _MiB or s.s3_part_size > 5 << 30 or s.s3_part_size % 4096:
        raise ConfigError(
            f"s3_part_size must be a multiple of 4096 bytes between 5 MiB and 5 GiB (S3's limits), got {s.s3_part_size}"
        )
    if not 1 <= s.s3_concurrency <= 64:
        raise ConfigError(f"s3_concurrency must be between 1 and 64, got {s.s3_concurrency}")
    for name in ("buffer_count", "read_buffer_count"):
        if not 2 <= getattr(s, name) <= 64:
            raise ConfigError(f"{name} must be between 2 and 64, got {getattr(s, name)}")


_DEFAULTS = Settings()


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read fastpersist configuration file {path!r}: {e}") from e
    except ValueError as e:
        raise ConfigError(f"fastpersist configuration file {path!r} is not valid JSON: {e}") from e
    if not isinstance(document, dict) or not isinstance(document.get("settings"), dict):
        raise ConfigError(
            f"fastpersist configuration file {path!r} must be a JSON object with a 'settings' object "
            "(as written by 'fastpersist tune')"
        )
    version = document.get("fastpersist_config_version", CONFIG_FILE_VERSION)
    if version != CONFIG_FILE_VERSION:
        raise ConfigError(f"{path!r} has configuration version {version}; this fastpersist reads {CONFIG_FILE_VERSION}")
    return _coerce_all(document["settings"])


def _from_environment() -> Settings:
    values: dict[str, Any] = {}
    for name in _FIELDS:
        raw = os.environ.get(environment_variable(name))
        if raw is not None and raw.strip() != "":
            values[name] = _coerce(name, raw)
    path = os.environ.get("FASTPERSIST_CONFIG")
    if path:
        values.update(_read_file(path))
    return _DEFAULTS.replace(**values)


_lock = threading.Lock()
_current = _from_environment()  # process-wide: set(), reset(), load_file()
_local = threading.local()  # per thread: the changes of the override() blocks it is inside


def _reset_after_fork() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _thread_changes() -> list[dict[str, Any]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def settings() -> Settings:
    """The settings in force now in this thread (a frozen snapshot)."""
    stack = getattr(_local, "stack", None)
    if not stack:
        return _current
    merged: dict[str, Any] = {}
    for changes in stack:
        merged.update(changes)
    return _current.replace(**merged)


def get(name: str) -> Any:
    """The current value of setting ``name``. Raises ConfigError for unknown names."""
    _check_name(name)
    return getattr(settings(), name)


def resolve(overrides: Mapping[str, Any] | None = None) -> Settings:
    """The current settings with per-call ``overrides`` applied (None values are ignored)."""
    current = settings()
    if not overrides:
        return current
    return current.replace(**{k: v for k, v in overrides.items() if v is not None})


class Restorer(contextlib.AbstractContextManager):
    """What :func:`set` returns: call it (or leave its ``with`` block) to put back the previous values.

    Only the fields :func:`set` changed are restored, and only where nobody
    changed them since. As a context manager, ``with config.set(...)`` keeps
    the change process-wide for the block (other threads see it too); use
    :func:`override` for a change of the calling thread only.
    """

    def __init__(self, previous: Settings, changes: dict[str, Any]):
        self._previous = previous
        self._changes = changes
        self._done = False

    def __call__(self) -> None:
        global _current
        with _lock:
            if self._done:
                return
            self._done = True
            undo = {
                name: getattr(self._previous, name)
                for name, value in self._changes.items()
                if getattr(_current, name) == value
            }
            if undo:
                _current = _current.replace(**undo)

    restore = __call__

    def __exit__(self, *exc: Any) -> None:
        self()


def set(**changes: Any) -> Restorer:  # noqa: A001 - mirrors kvikio.defaults.set
    """Changes settings for the whole process, from now on; returns a :class:`Restorer`.

    ``restore = config.set(engine="threads")`` ... ``restore()`` (or ``with
    config.set(...):``) puts the previous values back. For a change that
    other threads must not see, use :func:`override`.

    Raises:
        ConfigError: unknown name or invalid value; nothing is changed then.
    """
    global _current
    coerced = _coerce_all(changes)
    with _lock:
        previous = _current
        _current = _current.replace(**coerced)  # validates the combination; raises before anything changes
    return Restorer(previous, coerced)


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """Changes settings for the calling thread only, inside the ``with`` block; yields them.

    Other threads never see the change, not even for an instant; blocks nest
    (the innermost wins). The process-wide settings (:func:`set`) stay as
    they are.

    Raises:
        ConfigError: unknown name or invalid value (on entering the block).
    """
    coerced = _coerce_all(changes)
    settings().replace(**coerced)  # validates the combination; raises before anything changes
    stack = _thread_changes()
    stack.append(coerced)
    try:
        yield settings()
    finally:
        for index in range(len(stack) - 1, -1, -1):
            if stack[index] is coerced:
                del stack[index]
                break


def reset() -> None:
    """Back to the defaults plus the environment, as at import time."""
    global _current
    fresh = _from_environment()
    with _lock:
        _current = fresh


def load_file(path: str | os.PathLike[str]) -> Restorer:
    """Applies a configuration file written by ``fastpersist tune`` (or by hand) to the whole process.

    Returns the :class:`Restorer` of :func:`set`. ``with
    config.override(**config.read_file(path)):`` applies one to this thread only.
    """
    return set(**read_file(path))


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings in a configuration file (checked), without applying them."""
    return _read_file(os.fspath(path))


def save_file(path: str | os.PathLike[str], values: Mapping[str, Any], **metadata: Any) -> None:
    """Writes ``values`` as a configuration file that :func:`load_file` reads."""
    checked = _DEFAULTS.replace(**values)
    document = {
        "fastpersist_config_version": CONFIG_FILE_VERSION,
        "settings": {name: getattr(checked, name) for name in values},
        **metadata,
    }
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
