"""Where each DCP write item goes in a rank's ``.distcp`` file. Pure data: no I/O here.

A ``.distcp`` file of DCP's ``FileSystemWriter`` is a concatenation of items,
each addressed by ``(relative_path, offset, length)`` in the checkpoint's
``.metadata``: a ``BYTE_IO`` item is its raw bytes; a tensor item is a
complete ``torch.save`` archive of the tensor (one storage of exactly the
tensor's bytes), which DCP's reader opens with ``torch.load`` on a view of
that byte range. We write the same thing, so either reader loads either
writer's files, and place it so the engine can use O_DIRECT:

* a tensor archive's payload starts at an address congruent, modulo the page
  size, to the source memory it comes from (a CPU destination tensor
  allocated the same way -- torch's allocator gives large tensors the same
  offset within a page -- is then read straight into with O_DIRECT); the
  payloads of other devices' tensors start on a page;
* the payload's position *inside* its archive is page-aligned, as
  fastpersist's own ``save`` does (``format.zipformat.PAYLOAD_ALIGNMENT``), so
  the archive is also a valid standalone torch checkpoint;
* everything that is not a payload (local headers, pickles, descriptors,
  central directories, raw bytes items and the zero gaps between items) is
  "static" bytes; descriptors and central directories are made once the
  payloads' CRC-32s are known.

fastpersist adds, per item, a ``fastpersist`` attribute to DCP's own
``_StorageInfo`` (plain built-in types: DCP's reader, and an environment
without fastpersist, unpickle and ignore it): the payload's absolute offset,
length, CRC-32, dtype and shape. The reader uses it to read tensors in place
and verify them; for files without it (written by ``FileSystemWriter``) it
parses the archives instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from fastpersist.format.dcp import EXTENSION_ATTRIBUTE, EXTENSION_VERSION  # described there, for readers without DCP
from fastpersist.format.plan import SavePlan, Segment, SegmentKind
from fastpersist.format.serializer import plan_save
from fastpersist.io import engine

__all__ = [
    "DEFAULT_SUFFIX",
    "EXTENSION_ATTRIBUTE",
    "EXTENSION_VERSION",
    "PAGE",
    "BytesItem",
    "FileLayout",
    "FilePlan",
    "TensorItem",
    "file_name",
    "place_items",
    "tensor_with_exact_storage",
]

PAGE = 4096
DEFAULT_SUFFIX = ".distcp"


def file_name(prefix: str, index: int) -> str:
    """``__{rank}_{n}.distcp``, as FileSystemWriter names its files (``prefix`` is ``__{rank}_``)."""
    return f"{prefix}{index}{DEFAULT_SUFFIX}"


def tensor_with_exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor whose storage holds exactly its bytes (what DCP's writer torch.saves).

    Shares memory with ``tensor`` when it is contiguous (a view of a bigger
    storage gets a storage that aliases just its bytes); copies otherwise.
    """
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.storage_offset() == 0 and storage.nbytes() == nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    exact = storage[start : start + nbytes]
    if exact.data_ptr() != tensor.data_ptr() or exact.nbytes() != nbytes:  # pragma: no cover - defensive
        return tensor.clone()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(exact, 0, tensor.shape, tensor.stride())


@dataclasses.dataclass(frozen=True, eq=False)
class TensorItem:
    """A tensor write item, placed: its archive plan (offsets relative to the archive) and base offset."""

    index: object  # the DCP MetadataIndex
    plan: SavePlan
    base: int
    tensor: torch.Tensor  # with exact storage; the archive's one storage

    @property
    def storage_record(self) -> int:
        for i, record in enumerate(self.plan.records):
            if hasattr(record, "view"):
                return i
        raise AssertionError("a tensor archive has one storage")  # pragma: no cover

    @property
    def payload_offset(self) -> int:
        return self.base + self.plan.records[self.storage_record].entry.data_offset

    @property
    def nbytes(self) -> int:
        return self.plan.records[self.storage_record].entry.size

    @property
    def length(self) -> int:
        return self.plan.size


@dataclasses.dataclass(frozen=True, eq=False)
class BytesItem:
    """A BYTE_IO write item: its raw bytes at ``base``."""

    index: object
    data: bytes
    base: int

    @property
    def length(self) -> int:
        return len(self.data)

    @property
    def crc(self) -> int:
        return engine.crc32_of(self.data)


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """One ``.distcp`` file: its items in file order and its size."""

    name: str
    items: tuple[TensorItem | BytesItem, ...]
    size: int


@dataclasses.dataclass(frozen=True, eq=False)
class FilePlan:
    """One ``.distcp`` file as a plan for :func:`fastpersist.io.writer.write_plan`: its bytes in one pass, in order.

    The local writer (:func:`fastpersist.dcp.writer.write_layout`) and an
    upload (as a stream of parts) both write the file this way, through
    ``write_plan``'s ring. The gaps are zeros, a bytes item is its bytes, and a
    tensor item is its archive's segments moved to the item's base.
    ``records`` are every archive's records, archive after archive, so the
    CRC-32 table ``write_plan`` keeps covers all of them; the file has one
    trailer per archive, which its TRAILER segments number (see
    :data:`fastpersist.format.plan.Segment`). With checksums off, the
    archives' small in-memory records (their pickles) keep their CRC-32s and
    only the payloads' are 0 (:attr:`keeps_bytes_crcs`). Make it with :meth:`of`.

    Attributes:
        layout: the file.
        records: the archives' records, in file order.
        firsts: by archive number, the index in ``records`` of its first record.
        positions: by archive number, its item's position in ``layout.items``.
    """

    layout: FileLayout
    records: tuple
    firsts: tuple[int, ...]
    positions: tuple[int, ...]

    keeps_bytes_crcs = True
    """Read by :func:`fastpersist.io.writer.initial_crcs` (a class attribute, not a field)."""

    @classmethod
    def of(cls, layout: FileLayout) -> FilePlan:
        records: list = []
        firsts, positions = [], []
        for position, item in enumerate(layout.items):
            if isinstance(item, TensorItem):
                firsts.append(len(records))
                positions.append(position)
                records += item.plan.records
        return cls(layout, tuple(records), tuple(firsts), tuple(positions))

    @property
    def size(self) -> int:
        return self.layout.size

    def devices(self) -> set[torch.device]:
        return {self.layout.items[position].tensor.device for position in self.positions}

    def segments(self) -> list[Segment]:
        """Contiguous pieces covering ``[0, size)`` in file order."""
        pieces: list[Segment] = []
        end = 0
        archive = 0
        for item in self.layout.items:
            if item.base > end:
                pieces.append((SegmentKind.BYTES, end, item.base - end, -1, bytes(item.base - end)))
            if isinstance(item, BytesItem):
                if item.length:
                    pieces.append((SegmentKind.BYTES, item.base, item.length, -1, item.data))
            else:
                first = self.firsts[archive]
                for kind, offset, length, record, data in item.plan.segments():
                    if kind == SegmentKind.TRAILER:
                        record = archive
                    elif record >= 0:
                        record += first
                    pieces.append((kind, item.base + offset, length, record, data))
                archive += 1
            end = item.base + item.length
        if end != self.size:  # pragma: no cover - place_items ends the file at its last item
            raise AssertionError("the layout does not end at the file size")
        return pieces

    def trailer(self, crcs, archive: int = -1) -> bytes:
        """The trailer of archive number ``archive`` (its central directory), given every record's CRC-32.

        Raises:
            ValueError: no archive number (a file of several archives has no one trailer).
        """
        if archive < 0:
            raise ValueError("a .distcp file has one trailer per archive: name the archive")
        item = self.layout.items[self.positions[archive]]
        first = self.firsts[archive]
        return item.plan.trailer(crcs[first : first + len(item.plan.records)])

    def payload_crcs(self, crcs) -> dict[int, int]:
        """Each tensor item's payload CRC-32 by position in ``layout.items`` (what the local writer returns)."""
        return {
            position: crcs[first + self.layout.items[position].storage_record]
            for first, position in zip(self.firsts, self.positions)
        }


def _residue(tensor: torch.Tensor) -> int:
    """Where in a page the payload should start: the source's own offset for CPU memory, 0 otherwise."""
    if tensor.device.type == "cpu" and tensor.numel():
        return tensor.data_ptr() % PAGE
    return 0


def place_items(name: str, entries: Sequence[tuple[object, torch.Tensor | bytes]]) -> FileLayout:
    """Lays out one file.

    Args:
        name: the file name (``__0_0.distcp``).
        entries: ``(MetadataIndex, data)`` in file order; ``data`` is a tensor
            (saved as a torch.save archive of it, see
            :func:`tensor_with_exact_storage`) or the bytes of a BYTE_IO item.

    Returns:
        The layout; tensors are held (not copied) until it is written.
    """
    cursor = 0
    items: list[TensorItem | BytesItem] = []
    for index, data in entries:
        if isinstance(data, (bytes, bytearray, memoryview)):
            item = BytesItem(index, bytes(data), cursor)
            cursor += item.length
        else:
            tensor = tensor_with_exact_storage(data)
            plan = plan_save(tensor, "archive")
            payload = next(r for r in plan.records if hasattr(r, "view")).entry.data_offset
            # payload (page-aligned inside the archive) lands at the wanted residue in the file
            base = cursor + (_residue(tensor) - (cursor + payload)) % PAGE
            item = TensorItem(index, plan, base, tensor)
            cursor = base + item.length
        items.append(item)
    return FileLayout(name, tuple(items), cursor)
