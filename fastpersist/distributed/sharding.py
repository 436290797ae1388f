"""How a data-parallel save splits one checkpoint's bytes across ranks. Pure functions, no I/O.

The split is a function of the plan's byte length and the number of writers
only, so every rank computes the same answer without talking to the others.
Ranges are contiguous, disjoint, cover ``[0, length)`` in rank order, start at
multiples of ``alignment`` (so concurrent O_DIRECT writers never share a
block) and differ in size by at most one ``alignment`` unit.

What is split is the file up to the central directory
(``plan.layout.central_directory_offset``): headers, payloads and data
descriptors. The trailer (central directory and end records) needs every
record's CRC-32 and is written by the committing rank once all ranks are
done (see :mod:`fastpersist.distributed.save`).

A writer that lacks some of rank 0's storages leaves their bytes out of its
range (:func:`split_range`, aligned so that no two writers share a block);
rank 0 writes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["DEFAULT_ALIGNMENT", "ByteRange", "plan_ranges", "shard_ranges", "split_range", "writer_ranks"]

DEFAULT_ALIGNMENT = 1 << 20
"""1 MiB: a multiple of every O_DIRECT alignment and of the engine's default block size."""


@dataclasses.dataclass(frozen=True)
class ByteRange:
    """``[start, end)`` of the checkpoint file, written by writer number ``index``."""

    index: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def shard_ranges(length: int, writers: int, alignment: int = DEFAULT_ALIGNMENT) -> tuple[ByteRange, ...]:
    """Splits ``[0, length)`` into ``writers`` contiguous, aligned, balanced ranges.

    The whole ``alignment`` units of ``length`` are dealt out evenly (the
    first ranges get one more when they do not divide), and the partial unit
    at the end goes to the last range, so every range but the last starts and
    ends on an alignment boundary and range sizes differ by at most
    ``alignment``. When ``length`` is small some ranges are
    empty (``start == end``): those writers write nothing.

    Args:
        length: bytes to split (>= 0).
        writers: number of writers (>= 1).
        alignment: boundary granularity, a power of two (>= 1).

    Returns:
        ``writers`` ranges in index order.

    Raises:
        ValueError: a negative length, fewer than one writer, or an alignment
            that is not a positive power of two.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if writers < 1:
        raise ValueError(f"need at least one writer, got {writers}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a positive power of two, got {alignment}")
    # Whole alignment units are dealt out as evenly as possible (the first ranges get
    # one more); the partial unit at the end of the file goes to the last range.
    each, extra = divmod(length // alignment, writers)
    boundaries = [0]
    for k in range(writers - 1):
        boundaries.append(boundaries[-1] + (each + (k < extra)) * alignment)
    boundaries.append(length)
    return tuple(ByteRange(k, boundaries[k], boundaries[k + 1]) for k in range(writers))


def plan_ranges(plan, writers: int, alignment: int = DEFAULT_ALIGNMENT) -> tuple[ByteRange, ...]:
    """:func:`shard_ranges` of a :class:`~fastpersist.format.plan.SavePlan`'s bytes before its trailer."""
    return shard_ranges(plan.layout.central_directory_offset, writers, alignment)


def split_range(
    byte_range: ByteRange, blocked: Iterable[tuple[int, int]], alignment: int = DEFAULT_ALIGNMENT
) -> tuple[list[ByteRange], list[ByteRange]]:
    """Cuts the intervals a writer may not write out of its range.

    Args:
        byte_range: the writer's range.
        blocked: byte intervals ``(start, end)`` it may not write (the payloads
            of storages it does not have); each is widened to whole
            ``alignment`` units, so that the bytes left out never share an
            O_DIRECT block with bytes written.
        alignment: as :func:`shard_ranges`.

    Returns:
        ``(pieces, holes)``: the sub-ranges it writes and the sub-ranges left
        out (for rank 0 to write), each in file order, together tiling
        ``byte_range``. Every ``index`` is the sub-range's first alignment
        unit (``start // alignment``), unique in the file.
    """
    start, end = byte_range.start, byte_range.end
    cuts = []
    for lo, hi in sorted(blocked):
        lo, hi = max(lo // alignment * alignment, start), min(-(-hi // alignment) * alignment, end)
        if lo >= hi:
            continue
        if cuts and lo <= cuts[-1][1]:
            cuts[-1][1] = max(cuts[-1][1], hi)
        else:
            cuts.append([lo, hi])
    pieces, holes, position = [], [], start
    for lo, hi in cuts:
        if position < lo:
            pieces.append(ByteRange(position // alignment, position, lo))
        holes.append(ByteRange(lo // alignment, lo, hi))
        position = hi
    if position < end or (not pieces and not holes):
        pieces.append(ByteRange(position // alignment, position, end))
    return pieces, holes


def writer_ranks(hosts: list[str], mode: str) -> list[int]:
    """The group ranks that write, in writer order.

    Args:
        hosts: the host name of every rank of the group, in rank order.
        mode: ``"all"`` (every rank writes) or ``"node"`` (the lowest rank of
            each host writes; the others stay idle, for ranks sharing one disk).

    Raises:
        ValueError: an unknown mode.
    """
    if mode == "all":
        return list(range(len(hosts)))
    if mode == "node":
        first: dict[str, int] = {}
        for rank, host in enumerate(hosts):
            first.setdefault(host, rank)
        return sorted(first.values())
    raise ValueError(f"writers must be 'all' or 'node', got {mode!r}")
