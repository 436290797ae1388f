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

When some writers may not write some bytes (they do not hold those storages
as rank 0 does), :func:`assign_ranges` deals the file out around them: each
writer then gets a few ranges instead of one, still aligned and balanced.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Sequence

__all__ = ["DEFAULT_ALIGNMENT", "ByteRange", "assign_ranges", "plan_ranges", "shard_ranges", "writer_ranks"]

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


def assign_ranges(length: int, writers: int, blocked: Sequence[Iterable[tuple[int, int]]],
                  alignment: int = DEFAULT_ALIGNMENT) -> tuple[tuple[ByteRange, ...], ...]:  # fmt: skip
    """Splits ``[0, length)`` among ``writers``, none getting a byte it may not write.

    Args:
        length: bytes to split (>= 0).
        writers: number of writers (>= 1). Writer 0 may write every byte.
        blocked: for each writer, byte intervals ``(start, end)`` it may not
            write (writer 0's must be empty). Each is widened to whole
            ``alignment`` units, so that no two writers share a unit.
        alignment: as :func:`shard_ranges`.

    Returns:
        For each writer, its ranges in file order; every range's ``index`` is
        its position among all ranges in file order. With nothing blocked,
        exactly :func:`shard_ranges` (one range each). Otherwise units are
        dealt so that each writer gets about ``length / writers`` bytes: units
        some writers may not write go to the eligible writer with the most
        quota left, then the rest, in file order, to each writer in turn.

    Raises:
        ValueError: as :func:`shard_ranges`; writer 0 blocked; ``blocked``
            not of length ``writers``.
    """
    blocked = [list(b) for b in blocked]
    if len(blocked) != writers:
        raise ValueError(f"blocked must list {writers} writers' intervals, got {len(blocked)}")
    if blocked and blocked[0]:
        raise ValueError("writer 0 may write every byte: its blocked intervals must be empty")
    plain = shard_ranges(length, writers, alignment)
    units = -(-length // alignment)
    spans = [_merge((start // alignment, -(-end // alignment)) for start, end in b if end > start) for b in blocked]
    if not any(spans):
        return tuple((r,) for r in plain)
    quota = [units // writers + (w < units % writers) for w in range(writers)]
    cuts = sorted({0, units, *(p for span in spans for interval in span for p in interval)})
    pieces = []  # (first unit, end unit, eligible writers or None for all)
    for first, end in zip(cuts, cuts[1:]):
        eligible = [w for w in range(writers) if not _inside(spans[w], first)]
        pieces.append((first, end, None if len(eligible) == writers else eligible))
    owners: list[tuple[int, int, int]] = []
    for first, end, eligible in pieces:  # restricted units first, to whoever has the most quota left
        if eligible is None:
            continue
        while first < end:
            writer = max(eligible, key=lambda w: (quota[w], -w))
            take = end - first if quota[writer] <= 0 else min(end - first, quota[writer])
            owners.append((first, first + take, writer))
            quota[writer] -= take
            first += take
    writer = 0
    for first, end, eligible in pieces:  # then the rest, in file order, each writer in turn
        if eligible is not None:
            continue
        while first < end:
            while writer < writers - 1 and quota[writer] <= 0:
                writer += 1
            take = end - first if writer == writers - 1 else min(end - first, quota[writer])
            owners.append((first, first + take, writer))
            quota[writer] -= take
            first += take
    owners.sort()
    merged: list[list[int]] = []
    for first, end, owner in owners:
        if merged and merged[-1][2] == owner and merged[-1][1] == first:
            merged[-1][1] = end
        else:
            merged.append([first, end, owner])
    result: list[list[ByteRange]] = [[] for _ in range(writers)]
    for index, (first, end, owner) in enumerate(merged):
        result[owner].append(ByteRange(index, first * alignment, min(end * alignment, length)))
    return tuple(tuple(r) for r in result)


def _merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


def _inside(intervals: list[tuple[int, int]], unit: int) -> bool:
    position = bisect.bisect_right(intervals, (unit, float("inf"))) - 1
    return position >= 0 and intervals[position][0] <= unit < intervals[position][1]


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
