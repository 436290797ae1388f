"""The save plan: what to write where. Pure data; writers execute it.

A plan is a :class:`~fastpersist.format.zipformat.ZipLayout` plus, for every
entry, where its bytes come from: small metadata records carry their bytes
(and CRC-32), storage records carry the storage (seen as a zero-copy uint8
view on its device). Everything else in the file (local headers, padding, data
descriptors, the central directory) follows from the layout.

:meth:`SavePlan.segments` flattens a plan into contiguous, non-overlapping
pieces that cover the whole file, so an executor can fill any byte range of
the file on its own (a ring buffer, or one rank's share of a data-parallel
save) without knowing anything about zip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from fastpersist.format.zipformat import ZipEntry, ZipLayout
from fastpersist.tensors import storage_byte_view

__all__ = ["BytesRecord", "StorageRecord", "SavePlan", "SegmentKind", "Segment"]

_NOTHING = torch.empty(0, dtype=torch.uint8)


@dataclasses.dataclass(frozen=True)
class BytesRecord:
    """A small record whose bytes are in memory (``data.pkl``, ``byteorder``, ...)."""

    entry: ZipEntry
    data: bytes


class StorageRecord:
    """A tensor storage: ``view`` is a 1-D uint8 tensor over all of its bytes, on its device.

    ``StorageRecord(entry, key, storage)`` makes the view on first use only:
    writers of CPU storages need just their address (:meth:`data_ptr`), and a
    view per storage was a fifth of the time to plan a checkpoint of many
    small tensors. ``StorageRecord(entry, key, view=view)`` takes a ready view
    (a staging copy, for example). Treat records as immutable.

    A ready view may hold only part of the payload (a collective save's
    snapshot of one rank's share): ``offset`` is the payload byte its first
    byte is, and it holds :attr:`nbytes` bytes from there. Writers read only
    the bytes of their range, which must lie inside.
    """

    __slots__ = ("entry", "key", "offset", "_storage", "_view")

    def __init__(
        self,
        entry: ZipEntry,
        key: str,
        storage: torch.UntypedStorage | None = None,
        *,
        view: torch.Tensor | None = None,
        offset: int = 0,
    ):
        if (storage is None) == (view is None):
            raise TypeError("a StorageRecord needs either a storage or a view")
        if offset and view is None:
            raise TypeError("only a ready view may start inside the payload (offset=)")
        self.entry = entry
        self.key = key
        self.offset = offset
        self._storage = storage
        self._view = view

    @property
    def view(self) -> torch.Tensor:
        view = self._view
        if view is None:
            # Threads racing here make equal views of one storage; either may stay.
            view = self._view = storage_byte_view(self._storage)
        return view

    @property
    def nbytes(self) -> int:
        """Bytes of the payload the record holds (all of it, unless a ready view holds a part)."""
        return self.entry.size if self._view is None else self._view.numel()

    def cropped(self, start: int, end: int) -> StorageRecord:
        """The same record holding only the payload's bytes ``[start, end)`` (offsets in the payload)."""
        return StorageRecord(
            self.entry, self.key, view=self.view[start - self.offset : end - self.offset], offset=start
        )

    @property
    def device(self) -> torch.device:
        return self._storage.device if self._view is None else self._view.device

    def placed(self, entry: ZipEntry) -> StorageRecord:
        """The same storage (or view) as the record of another layout's ``entry``."""
        if self._view is not None:  # a ready view (also once made from the storage): keep using it
            return StorageRecord(entry, self.key, view=self._view, offset=self.offset)
        return StorageRecord(entry, self.key, self._storage)

    def data_ptr(self) -> int:
        """The address of the first byte (``view.data_ptr()``), without making the view."""
        return self._storage.data_ptr() if self._view is None else self._view.data_ptr()

    def __repr__(self) -> str:
        return f"StorageRecord({self.entry.name!r}, key={self.key!r}, device={self.device})"


Record = BytesRecord | StorageRecord


class SegmentKind:
    """What a segment's bytes are. Plain ints, so a segment row holds no object the garbage collector tracks."""

    BYTES = 0  # static bytes known now: headers, padding, metadata payloads
    STORAGE = 1  # a slice of a storage view
    DESCRIPTOR = 2  # a data descriptor: needs the record's CRC-32
    TRAILER = 3  # central directory + end records: needs every CRC-32


Segment = tuple  # (kind, offset, length, record, data)
"""``length`` bytes of the file at ``offset``: a plain tuple ``(kind, offset, length, record, data)``.

``kind`` is a :class:`SegmentKind` value; ``record`` indexes
:attr:`SavePlan.records` (STORAGE, DESCRIPTOR; -1 otherwise, but a plan of
several archives, ``dcp.layout.FilePlan``, numbers its TRAILER segments and
makes each with ``trailer(crcs, number)``); ``data`` holds
the bytes of a BYTES segment (``b""`` otherwise). Plain tuples of ints and
bytes, not named ones: the collector stops tracking those, and a plan of
100,000 small tensors has 300,000 segments (as named tuples their full
collections were a third of such a save).
"""


@dataclasses.dataclass(frozen=True, eq=False)
class SavePlan:
    """Everything needed to write one checkpoint file.

    Attributes:
        layout: placement of every zip entry.
        records: one per ``layout.entries`` item, same order.
    """

    layout: ZipLayout
    records: tuple[Record, ...]

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def storages(self) -> tuple[StorageRecord, ...]:
        return tuple(r for r in self.records if isinstance(r, StorageRecord))

    def devices(self) -> set[torch.device]:
        return {r.device for r in self.storages}

    def trailer(self, crcs: Sequence[int]) -> bytes:
        return self.layout.trailer(crcs)

    def with_views(self, views: Mapping[int, torch.Tensor]) -> SavePlan:
        """The same plan, each storage record ``r`` reading from ``views[id(r)]`` (a snapshot's copies)."""
        records = tuple(
            StorageRecord(r.entry, r.key, view=views[id(r)], offset=r.offset) if isinstance(r, StorageRecord) else r
            for r in self.records
        )
        return SavePlan(self.layout, records)

    def cropped(self, ranges: Sequence[tuple[int, int]]) -> SavePlan:
        """The same plan, its storage records holding only their bytes inside ``ranges`` (file offsets).

        What one rank of a collective save writes is a few ranges of the file:
        a snapshot of this plan copies those bytes only. Each storage keeps
        the span from its first to its last byte inside the ranges (one view,
        :meth:`StorageRecord.cropped`); one with none holds nothing. Executing
        the plan outside ``ranges`` is then an error.
        """
        spans = sorted((start, end) for start, end in ranges if end > start)
        records = []
        for record in self.records:
            if not isinstance(record, StorageRecord) or not record.entry.size:
                records.append(record)
                continue
            lo, hi = record.entry.data_offset, record.entry.data_offset + record.entry.size
            inside = [(max(start, lo), min(end, hi)) for start, end in spans if start < hi and end > lo]
            if inside:
                records.append(record.cropped(inside[0][0] - lo, max(end for _, end in inside) - lo))
            else:
                records.append(StorageRecord(record.entry, record.key, view=_NOTHING))
        return SavePlan(self.layout, tuple(records))

    def segments(self) -> list[Segment]:
        """Contiguous pieces covering ``[0, size)`` in file order."""
        # One pass with few attribute lookups: 100,000 small storages make 300,000 segments.
        pieces: list[Segment] = []
        append = pieces.append
        bytes_kind, storage_kind, descriptor_kind = SegmentKind.BYTES, SegmentKind.STORAGE, SegmentKind.DESCRIPTOR
        position = 0
        for index, record in enumerate(self.records):
            entry = record.entry
            header_offset, data_offset, size = entry.header_offset, entry.data_offset, entry.size
            if header_offset != position:
                raise AssertionError(f"layout gap before {entry.name!r}")
            append((bytes_kind, header_offset, data_offset - header_offset, -1, entry.local_header()))
            if isinstance(record, BytesRecord):
                append((bytes_kind, data_offset, size, -1, record.data))
            elif size:
                append((storage_kind, data_offset, size, index, b""))
            position = data_offset + size
            descriptor_size = entry.descriptor_size
            if descriptor_size:
                # Filled from the executor's CRC table, like the central directory, so the two
                # always agree (both 0 when checksums are off).
                append((descriptor_kind, position, descriptor_size, index, b""))
                position += descriptor_size
        trailer_size = self.layout.trailer_size()
        pieces.append((SegmentKind.TRAILER, position, trailer_size, -1, b""))
        if position + trailer_size != self.size:
            raise AssertionError("layout does not end at the file size")
        return pieces
