"""The target: where one checkpoint's bytes go and come from, whatever the store.

Modelled on DCP's ``FileSystemBase`` (``torch/distributed/checkpoint/filesystem.py``)
and zarr's ``Store`` (``zarr/abc/store.py``): one abstract class, one file per
store, capabilities as class attributes. :func:`fastpersist.io.targets.resolve`
makes one from what the caller passed (a path, a URL, a file object) once per
call; the entry points then use its methods and never ask which store it is.

A target names one file or object; :meth:`Target.child` names a file under it
when it is a directory or a prefix (a DCP checkpoint). Saves go through
:meth:`Target.commit_plan`: the plan is executed by the store's writer (the
pinned ring of :func:`fastpersist.io.writer.write_plan` with the store's handle,
or a stream) and committed, or aborted on any failure, so that nothing
half-written is ever visible at the target. Loads of a remote target read
byte ranges (:meth:`Target.download`, :meth:`Target.open_reader`,
:meth:`Target.read_ranges`); a local file keeps the engine's own reader.

The operations a store does not have raise ``ValueError`` naming the target
and what to pass instead.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Protocol

from fastpersist.config import Settings

__all__ = ["RangeReader", "Target"]


class RangeReader(Protocol):
    """One object or file kept open for reads of chosen byte ranges (:meth:`Target.open_reader`).

    ``size`` is read once, at open; a store that can pin a version (S3's ETag)
    serves every read from the version seen then.
    """

    size: int

    def read(self, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` in a new page-aligned buffer (an ``engine.AlignedBuffer``).

        Raises:
            ValueError: the range reaches past the end.
            OSError: the store's error (``ObjectStoreError`` and its subclasses for remote stores).
        """

    def close(self) -> None:
        """Releases what the reader holds (connections); idempotent."""


class Target(abc.ABC):
    """Where one checkpoint's bytes go and come from (see the module docstring).

    Attributes (class-level capabilities; the entry points test these, never the class):
        scheme: the store's name in messages (``"file"``, ``"s3"``, ``"memory"``...).
        local: the bytes are a local file the native engine opens by path (its
            reader, O_DIRECT, atomic rename and fsync apply).
        remote: the bytes are in a store reached through an API (S3, fsspec):
            loads download ranges; a two-tier save (``local_copy=``) uploads to it.
        discards: the bytes are thrown away and nothing is committed (benchmarks).
        layouts: the collective-save layouts the store holds, the default first
            (empty: collective saves are refused).
        path: the target as errors, futures and logs name it (the resolved path,
            the URL).
        given: the name as the caller gave it (torch names the archive's
            top-level folder after its stem); None for file objects.
    """

    scheme: ClassVar[str] = ""
    local: ClassVar[bool] = False
    remote: ClassVar[bool] = False
    discards: ClassVar[bool] = False
    layouts: ClassVar[tuple[str, ...]] = ()

    @property
    @abc.abstractmethod
    def path(self) -> str:
        """The target as messages name it."""

    @property
    def given(self) -> str | None:
        return self.path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def _unsupported(self, what: str, instead: str) -> ValueError:
        """The error for an operation this store does not offer (raise it)."""
        return ValueError(f"{what} is not possible for {self.path} ({self.scheme} target): {instead}")

    # ------------------------------------------------------------------ saves

    def checked(self) -> Target:
        """This target, checked for a save (a local path resolved and its directory checked; a URL parsed).

        Raises:
            what the store's checks raise (``TargetDirectoryMissingError``,
            ``ValueError`` for a malformed URL, ...), before any byte is written.
        """
        return self

    def anchored(self) -> Target:
        """This target for a save that commits later (``async_save``): checked, and held where the store
        needs it (a local directory stays open). Call :meth:`release` once the save is done."""
        return self.checked()

    def release(self) -> None:
        """Releases what :meth:`anchored` holds (idempotent)."""
        return None  # a store that holds nothing for a pending save

    @abc.abstractmethod
    def commit_plan(self, plan, settings: Settings, streams=None, *, before_commit=None, after_reads=None):
        """Writes every byte of ``plan`` and commits it; on any failure nothing is committed.

        ``before_commit``, if given, is called once every byte is written and
        before the commit, whose failure it aborts (where the store writes in
        place, it can only report). ``after_reads``: as
        :func:`~fastpersist.io.writer.write_plan`'s.

        Returns:
            The CRC-32 of every record where the store's writer computes them
            (the ring writer does), else None.

        Raises:
            OSError and its subclasses: the store's error; the previous file or
            object at the target is intact.
        """

    def collective_layout(self, layout: str | None) -> str:
        """The layout a collective save (``group=``) to this target uses: ``layout``, or the store's default.

        Raises:
            ValueError: the store holds no collective saves, or not in ``layout``.
        """
        if not self.layouts:
            raise self._unsupported(
                "a collective save (group=...)", "save to a local path or an object store URL, or save on one rank"
            )
        if layout is None:
            return self.layouts[0]
        if layout not in self.layouts:
            raise self._unsupported(f"layout={layout!r}", f"use layout={self.layouts[0]!r}")
        return layout

    def put_bytes(self, data, settings: Settings) -> None:
        """Stores ``data`` (a small bytes-like object: a manifest, DCP's ``.metadata``) atomically: the commit."""
        raise self._unsupported("storing bytes", "pass a URL")

    def upload_file(self, source: Any, settings: Settings) -> None:
        """Uploads the local file ``source`` (a path or a binary file object) as this object, atomically.

        The background half of a two-tier save (``async_save(..., local_copy=path)``).
        """
        raise self._unsupported("an upload", "pass a URL")

    # ------------------------------------------------------------------ loads (remote targets)

    def download(self, settings: Settings) -> tuple[Any, int]:
        """The whole file or object in one page-aligned buffer: ``(buffer, size)`` (at least one byte allocated).

        Raises:
            FileNotFoundError (``ObjectNotFoundError``): nothing at the target. The store's errors otherwise.
        """
        raise self._unsupported("a download", "load the path itself")

    def open_reader(self, settings: Settings) -> RangeReader:
        """The file or object kept open for reads of chosen ranges (``safe_open`` reads only what it needs)."""
        raise self._unsupported("a ranged reader", "open the path itself")

    def read_ranges(self, reads, settings: Settings) -> None:
        """Fills each ``(target, offset, destination)`` of ``reads`` with that target's bytes from ``offset``
        on; the targets are this one's children (one store, one connection).

        Raises:
            TruncatedCheckpointError: a read ends past its file's end.
            FileNotFoundError (``ObjectNotFoundError``) and the store's errors.
        """
        raise self._unsupported("ranged reads", "open the path itself")

    def exists(self) -> bool:
        """Whether a file or object is at the target."""
        raise self._unsupported("a lookup", "test the path itself")

    def remove(self) -> None:
        """Removes the file or object at the target (nothing happens if there is none)."""
        raise self._unsupported("a removal", "remove the path itself")

    # ------------------------------------------------------------------ directories and prefixes (DCP)

    def as_directory(self) -> Target:
        """This target naming a directory or a prefix under which a checkpoint's files are (a DCP checkpoint).

        Raises:
            ValueError: it cannot name one (a URL without a bucket).
        """
        return self

    def make_directory(self) -> None:
        """Creates this directory where the store has directories (``file://``); object stores have none."""
        return None

    def child(self, name: str) -> Target:
        """The file ``name`` under this directory or prefix."""
        raise self._unsupported("a file under it", "pass a directory")

    def connected(self, settings: Settings) -> Target:
        """This target, and the children made from it, sharing one connection to the store (and, where the
        store versions objects, reads pinned to the version first seen): one save or load's worth."""
        return self

    def check_sizes(self, sizes: dict[str, int], settings: Settings) -> None:
        """Checks that each child of ``sizes`` (name -> bytes) is there with that size: before a commit
        record (DCP's ``.metadata``) is stored, every rank's files must be.

        Raises:
            FileNotFoundError (``ObjectNotFoundError``): a file is missing.
            CheckpointIOError (``ObjectStoreError``): a file has another size.
        """
        raise self._unsupported("a check of the files before the commit", "pass a URL")
