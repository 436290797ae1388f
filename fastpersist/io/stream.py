"""Executes a save plan into any writable file object (BytesIO, sockets, open files).

The slow but universal path, used when the target has no file descriptor the
engine can write to. Host memory stays bounded: device storages are copied
to the host one ``chunk_size`` slice at a time.
"""

from __future__ import annotations

from typing import BinaryIO

from fastpersist.format.plan import SavePlan, SegmentKind
from fastpersist.io import engine
from fastpersist.io.writer import initial_crcs
from fastpersist.tensors import host_memoryview

__all__ = ["write_plan_to_stream"]


def write_plan_to_stream(plan: SavePlan, stream: BinaryIO, *, checksum: bool = True, chunk_size: int = 64 << 20) -> int:
    """Writes the whole file described by ``plan`` to ``stream`` sequentially.

    Returns:
        The number of bytes written.

    Raises:
        OSError: from the stream.
        NotWritableError: (AttributeError, TypeError) ``stream`` has no ``write`` method.
    """
    if not callable(getattr(stream, "write", None)):
        from fastpersist.errors import NotWritableError

        raise NotWritableError(f"expected a path or a writable binary file object, got {type(stream).__name__}")
    crcs = initial_crcs(plan, checksum)
    written = 0
    for kind, _, length, record, data in plan.segments():
        if kind == SegmentKind.DESCRIPTOR:
            data = plan.records[record].entry.data_descriptor(crcs[record])
        elif kind == SegmentKind.TRAILER:  # numbered in a plan of several archives (format.plan.Segment)
            data = plan.trailer(crcs) if record < 0 else plan.trailer(crcs, record)
        elif kind == SegmentKind.STORAGE:
            view = plan.records[record].view
            crc = 0
            for start in range(0, length, chunk_size):
                piece = view[start : start + chunk_size]
                host = piece if piece.device.type == "cpu" else piece.to("cpu")
                block = host_memoryview(host)
                if checksum:
                    crc = engine.crc32_of(block, crc)
                _write_all(stream, block)
            crcs[record] = crc
            written += length
            continue
        _write_all(stream, data)
        written += len(data)
    return written


def _write_all(stream: BinaryIO, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        count = stream.write(view)
        if count is None:  # raw non-blocking streams; buffered ones write everything
            count = len(view)
        view = view[count:]
