"""dcp.layout.FilePlan: a .distcp file written in one pass by the ring writer (write_plan, as the local writer
and an upload do) has exactly the bytes and CRC-32s of the plain sequential writer (io.stream), whatever the
windows and the engine, with checksums on or off."""

from __future__ import annotations

import io
import zipfile
import zlib

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from fastpersist import config
from fastpersist.dcp import layout, writer
from fastpersist.format.plan import SegmentKind
from fastpersist.io.stream import write_plan_to_stream

_MiB = 1 << 20


def _at_residue(tensor: torch.Tensor, residue: int) -> torch.Tensor:
    """A copy of ``tensor`` whose memory starts ``residue`` bytes into a page (the layout follows that)."""
    nbytes = tensor.numel() * tensor.element_size()
    buffer = torch.empty(nbytes + 8192, dtype=torch.uint8)
    start = (residue - buffer.data_ptr()) % 4096
    copy = buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy


def _entries(first_residue: int | None = None):
    torch.manual_seed(0)
    tensors = [
        torch.randint(0, 255, (1,), dtype=torch.uint8),
        torch.randint(0, 255, (4095,), dtype=torch.uint8),
        torch.randint(0, 255, (4097,), dtype=torch.uint8),
        torch.randn(300000),
        torch.randn(_MiB // 4 + 3),
        torch.empty(0),
        torch.randn(64, 64).to(torch.bfloat16),
        torch.randn(1000)[3:500],
    ]
    if first_residue is not None:
        tensors[0] = _at_residue(tensors[0], first_residue)
    entries = [(MetadataIndex("bytes"), b"hello"), (MetadataIndex("empty-bytes"), b"")]
    entries += [(MetadataIndex(f"t{i}"), t) for i, t in enumerate(tensors)]
    return entries, tensors


def _entries_with_a_trailer_across_a_page():
    """Entries whose first archive's central directory crosses a page boundary, so 4 KiB windows cut it."""
    for residue in range(0, 4096, 8):
        entries, tensors = _entries(residue)
        plan = layout.FilePlan.of(layout.place_items("__0_0.distcp", entries))
        _, offset, length, _, _ = next(s for s in plan.segments() if s[0] == SegmentKind.TRAILER)
        if offset // 4096 != (offset + length - 1) // 4096:
            return entries, tensors
    raise AssertionError("no placement of the first tensor puts its trailer across a page")


def _archive_crcs(raw: bytes, item) -> dict[str, int]:
    archive = zipfile.ZipFile(io.BytesIO(raw[item.base : item.base + item.length]))
    return {info.filename.rsplit("/", 1)[-1]: info.CRC for info in archive.infolist()}


@pytest.mark.parametrize("window", [4096, _MiB, 64 * _MiB], ids=["4KiB-splits-a-trailer", "1MiB", "one-window"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_ring_pass_equals_the_sequential_writer(tmp_path, window, direct):
    entries, tensors = _entries_with_a_trailer_across_a_page() if window == 4096 else _entries()
    placed = layout.place_items("__0_0.distcp", entries)
    plan = layout.FilePlan.of(placed)
    expected = io.BytesIO()
    write_plan_to_stream(plan, expected)
    settings = config.settings().replace(buffer_size=window, block_size=window, buffer_count=2, direct=direct)
    crcs = writer.write_layout(placed, str(tmp_path / "ring"), settings)
    written = (tmp_path / "ring").read_bytes()
    assert len(written) == plan.size == placed.size
    assert written == expected.getvalue()
    archives = [(position, item) for position, item in enumerate(placed.items) if isinstance(item, layout.TensorItem)]
    assert len(archives) == len(tensors)
    for (position, item), tensor in zip(archives, tensors):
        payload = written[item.payload_offset : item.payload_offset + item.nbytes]
        assert crcs[position] == zlib.crc32(payload)
        archive = written[item.base : item.base + item.length]
        assert zipfile.ZipFile(io.BytesIO(archive)).testzip() is None
        assert torch.equal(torch.load(io.BytesIO(archive)), tensor)


def test_without_checksums_only_the_payloads_crcs_are_zero(tmp_path):
    """checksum=False spares the payloads' CRC-32s only: each archive's pickle and small records keep theirs,
    locally and in an upload alike (both are this ring pass)."""
    entries, _ = _entries()
    placed = layout.place_items("__0_0.distcp", entries)
    crcs = writer.write_layout(placed, str(tmp_path / "f"), config.settings().replace(checksum=False))
    written = (tmp_path / "f").read_bytes()
    for position, item in enumerate(placed.items):
        if not isinstance(item, layout.TensorItem):
            continue
        assert crcs[position] == 0
        stored = _archive_crcs(written, item)
        assert stored.pop("0") == 0  # the payload, data/0
        archive = zipfile.ZipFile(io.BytesIO(written[item.base : item.base + item.length]))
        for info in archive.infolist():
            if not info.filename.endswith("/0"):
                assert stored[info.filename.rsplit("/", 1)[-1]] == zlib.crc32(archive.read(info)) != 0


def test_a_file_of_archives_has_no_single_trailer():
    entries, _ = _entries()
    plan = layout.FilePlan.of(layout.place_items("__0_0.distcp", entries))
    with pytest.raises(ValueError, match="one trailer per archive"):
        plan.trailer([0] * len(plan.records))
