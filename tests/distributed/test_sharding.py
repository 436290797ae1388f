"""The rank split of a data-parallel save (a pure function) and the CRC-32 combination it relies on."""

from __future__ import annotations

import itertools
import os
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpersist.distributed.sharding import ByteRange, shard_ranges, writer_ranks
from fastpersist.io.checksum import crc32_combine_all
from fastpersist.io.engine import crc32_combine


def check(length: int, writers: int, alignment: int) -> tuple[ByteRange, ...]:
    ranges = shard_ranges(length, writers, alignment)
    assert len(ranges) == writers
    assert [r.index for r in ranges] == list(range(writers))
    assert ranges[0].start == 0 and ranges[-1].end == length
    for before, after in itertools.pairwise(ranges):
        assert before.end == after.start  # contiguous, disjoint, in order
    for r in ranges:
        assert r.start <= r.end
        assert r.start % alignment == 0  # every start aligned
        if r.index < writers - 1:
            assert r.end % alignment == 0  # only the file's end may be unaligned
    sizes = [r.length for r in ranges]
    assert max(sizes) - min(sizes) <= alignment  # balanced to one alignment unit
    return ranges


@given(st.integers(0, 1 << 40), st.integers(1, 64), st.sampled_from([1, 512, 4096, 1 << 20]))
@settings(max_examples=300, deadline=None)
def test_ranges_cover_aligned_and_balanced(length, writers, alignment):
    check(length, writers, alignment)


@pytest.mark.parametrize(
    "length,writers,alignment,expected",
    [
        (0, 3, 4096, [(0, 0), (0, 0), (0, 0)]),
        (100, 2, 4096, [(0, 0), (0, 100)]),  # less than one unit: the last writer takes it
        (8192, 2, 4096, [(0, 4096), (4096, 8192)]),
        (3 * 4096 + 5, 3, 4096, [(0, 4096), (4096, 8192), (8192, 3 * 4096 + 5)]),
        (10 << 20, 4, 1 << 20, [(0, 3 << 20), (3 << 20, 6 << 20), (6 << 20, 8 << 20), (8 << 20, 10 << 20)]),
        (1000, 1, 4096, [(0, 1000)]),
    ],
)
def test_known_splits(length, writers, alignment, expected):
    assert [(r.start, r.end) for r in check(length, writers, alignment)] == expected


def test_same_answer_every_time():
    assert shard_ranges(123456789, 7, 4096) == shard_ranges(123456789, 7, 4096)


@pytest.mark.parametrize("length,writers,alignment", [(-1, 2, 4096), (10, 0, 4096), (10, 2, 3000), (10, 2, 0)])
def test_invalid_arguments(length, writers, alignment):
    with pytest.raises(ValueError):
        shard_ranges(length, writers, alignment)


def test_writer_ranks():
    hosts = ["a", "a", "b", "b", "a"]
    assert writer_ranks(hosts, "all") == [0, 1, 2, 3, 4]
    assert writer_ranks(hosts, "node") == [0, 2]
    with pytest.raises(ValueError, match="'all' or 'node'"):
        writer_ranks(hosts, "socket")


@given(st.binary(max_size=3000), st.binary(max_size=3000))
@settings(max_examples=200, deadline=None)
def test_crc32_combine_matches_zlib(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_combine_large_lengths_and_many_pieces():
    data = os.urandom(5 << 20)
    cuts = [0, 1, 4095, 1 << 20, (3 << 20) + 7, 5 << 20]
    pieces = [(zlib.crc32(data[a:b]), b - a) for a, b in itertools.pairwise(cuts)]
    assert crc32_combine_all(pieces) == zlib.crc32(data)
    with pytest.raises((ValueError, TypeError)):
        crc32_combine(0, 0, -1)


def test_descriptor_patches_cover_exactly_what_writers_cannot_write():
    """Records spanning a boundary (and descriptors straddling one) are patched; others are the writers'."""
    import torch

    from fastpersist.distributed.save import _descriptor_patches
    from fastpersist.distributed.sharding import plan_ranges
    from fastpersist.format.serializer import plan_save

    plan = plan_save({f"t{i}": torch.zeros(3000 + 517 * i, dtype=torch.uint8) for i in range(40)}, "a")
    crcs = [0] * len(plan.records)
    for writers in (1, 2, 3, 7):
        ranges = plan_ranges(plan, writers, alignment=4096)
        patched = {offset for offset, _ in _descriptor_patches(plan, crcs, ranges, set())}
        for record in plan.records:
            entry = record.entry
            if not entry.descriptor_size:
                continue
            lo, hi = entry.descriptor_offset, entry.descriptor_offset + entry.descriptor_size
            holders = [r for r in ranges if r.length and r.start < hi and lo < r.end]
            writable = all(entry.data_offset >= r.start for r in holders)
            assert (lo in patched) == (not writable)
        assert len(patched) <= 2 * (writers - 1)


def test_descriptor_patches_include_records_rank_zero_rewrote():
    import torch

    from fastpersist.distributed.save import _descriptor_patches
    from fastpersist.format.serializer import plan_save

    plan = plan_save({f"t{i}": torch.zeros(3000 + 517 * i, dtype=torch.uint8) for i in range(4)}, "a")
    index = next(i for i, r in enumerate(plan.records) if r.entry.descriptor_size)
    whole = [ByteRange(0, 0, plan.layout.central_directory_offset)]
    assert _descriptor_patches(plan, [0] * len(plan.records), whole, set()) == []
    patches = _descriptor_patches(plan, [7] * len(plan.records), whole, {index})
    assert patches == [(plan.records[index].entry.descriptor_offset, plan.records[index].entry.data_descriptor(7))]


@pytest.mark.parametrize(
    "blocked, pieces, holes",
    [
        ([], [(4, 9.5)], []),
        ([(5.01, 5.02)], [(4, 5), (6, 9.5)], [(5, 6)]),
        ([(5.01, 5.02), (5.5, 7.2), (100, 101)], [(4, 5), (8, 9.5)], [(5, 8)]),
        ([(0, 4.5)], [(5, 9.5)], [(4, 5)]),
        ([(9.2, 9.3)], [(4, 9)], [(9, 9.5)]),
        ([(0, 100)], [], [(4, 9.5)]),
    ],
)
def test_split_range_leaves_out_whole_units(blocked, pieces, holes):
    """Blocked intervals widen to whole units inside the range; pieces and holes tile it; index = first unit."""
    from fastpersist.distributed.sharding import split_range

    unit = 1 << 20
    at = lambda x: int(x * unit)  # noqa: E731
    mine = ByteRange(1, at(4), at(9.5))
    got_pieces, got_holes = split_range(mine, [(at(a), at(b)) for a, b in blocked], unit)
    assert [(r.start, r.end) for r in got_pieces] == [(at(a), at(b)) for a, b in pieces]
    assert [(r.start, r.end) for r in got_holes] == [(at(a), at(b)) for a, b in holes]
    tiles = sorted(got_pieces + got_holes, key=lambda r: r.start)
    assert tiles[0].start == mine.start and tiles[-1].end == mine.end
    assert all(a.end == b.start for a, b in zip(tiles, tiles[1:]))
    assert all(r.index == r.start // unit for r in tiles)
