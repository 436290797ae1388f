"""The save plan: what to write where. Pure data; writers execute it.

A plan is a :class:`~fastpersist.format.zipformat.ZipLayout` plus, for every
entry, where its bytes come from: small metadata records carry their bytes
(and CRC-32), storage records carry a zero-copy uint8 view of the storage on
its device. Everything else in the file (local headers, padding, data
descriptors, the central directory) follows from the layout.

:meth:`SavePlan.segments` flattens a plan into contiguous, non-overlapping
pieces that cover the whole file, so an executor can fill any byte range of
the file on its own (a ring buffer, or one rank's share of a data-parallel
save) without knowing anything about zip.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterator, NamedTuple, Sequence

import torch

from fastpersist.format.zipformat import ZipEntry, ZipLayout

__all__ = ["BytesRecord", "StorageRecord", "SavePlan", "SegmentKind", "Segment"]


@dataclasses.dataclass(frozen=True)
class BytesRecord:
    """A small record whose bytes are in memory (``data.pkl``, ``byteorder``, ...)."""

    entry: ZipEntry
    data: bytes


@dataclasses.dataclass(frozen=True, eq=False)
class StorageRecord:
    """A tensor storage: ``view`` is a 1-D uint8 tensor over all of its bytes, on its device."""

    entry: ZipEntry
    key: str
    view: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.view.device


Record = BytesRecord | StorageRecord


class SegmentKind(enum.Enum):
    BYTES = "bytes"  # static bytes known now: headers, padding, metadata payloads
    STORAGE = "storage"  # a slice of a storage view
    DESCRIPTOR = "descriptor"  # a data descriptor: needs the record's CRC-32
    TRAILER = "trailer"  # central directory + end records: needs every CRC-32


class Segment(NamedTuple):
    """``length`` bytes of the file at ``offset``.

    ``record`` indexes :attr:`SavePlan.records` (STORAGE, DESCRIPTOR);
    ``data`` holds the bytes of a BYTES segment. An immutable tuple (cheaper
    to build than a frozen dataclass: a plan of 100,000 small tensors has
    300,000 segments).
    """

    kind: SegmentKind
    offset: int
    length: int
    record: int = -1
    data: bytes = b""

    @property
    def end(self) -> int:
        return self.offset + self.length


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

    def segments(self) -> list[Segment]:
        """Contiguous pieces covering ``[0, size)`` in file order."""
        pieces: list[Segment] = []
        position = 0
        for index, record in enumerate(self.records):
            entry = record.entry
            if entry.header_offset != position:
                raise AssertionError(f"layout gap before {entry.name!r}")
            pieces.append(Segment(SegmentKind.BYTES, entry.header_offset, entry.data_offset - entry.header_offset,
                                  data=entry.local_header()))  # fmt: skip
            if isinstance(record, BytesRecord):
                pieces.append(Segment(SegmentKind.BYTES, entry.data_offset, entry.size, data=record.data))
            elif entry.size:
                pieces.append(Segment(SegmentKind.STORAGE, entry.data_offset, entry.size, record=index))
            if entry.descriptor_size:
                # Filled from the executor's CRC table, like the central directory, so the two
                # always agree (both 0 when checksums are off).
                pieces.append(Segment(SegmentKind.DESCRIPTOR, entry.descriptor_offset, entry.descriptor_size,
                                      record=index))  # fmt: skip
            position = entry.descriptor_offset + entry.descriptor_size
        pieces.append(Segment(SegmentKind.TRAILER, position, self.layout.trailer_size()))
        if position + self.layout.trailer_size() != self.size:
            raise AssertionError("layout does not end at the file size")
        return pieces

    @staticmethod
    def overlapping(segments: Sequence[Segment], start: int, end: int, first: int = 0) -> Iterator[tuple[int, Segment]]:
        """(index, segment) for segments meeting ``[start, end)``, scanning from index ``first``."""
        for index in range(first, len(segments)):
            segment = segments[index]
            if segment.offset >= end:
                return
            if segment.end > start:
                yield index, segment
