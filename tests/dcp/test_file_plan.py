"""dcp.layout.FilePlan: a .distcp file written in one sequential pass by write_plan (as an upload does) has
exactly the bytes and CRC-32s the local writer's out-of-order writes give."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from fastpersist import config
from fastpersist.dcp import layout, writer
from fastpersist.format.plan import SegmentKind
from fastpersist.io import engine
from fastpersist.io.writer import write_plan

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


@pytest.mark.parametrize("window", [4096, _MiB, 64 * _MiB], ids=["4KiB-splits-a-trailer", "1MiB", "one-window"])
def test_sequential_pass_equals_local_writer(tmp_path, window):
    entries, tensors = _entries_with_a_trailer_across_a_page() if window == 4096 else _entries()
    placed = layout.place_items("__0_0.distcp", entries)
    settings = config.settings()
    expected_crcs = writer.write_layout(placed, str(tmp_path / "local"), settings)
    plan = layout.FilePlan.of(placed)
    file = engine.File(str(tmp_path / "stream"), "w", direct=False, truncate=True)
    try:
        crcs = write_plan(plan, file, settings.replace(buffer_size=window, block_size=window, buffer_count=2))
    finally:
        file.close()
    local = (tmp_path / "local").read_bytes()
    streamed = (tmp_path / "stream").read_bytes()
    assert len(streamed) == plan.size == placed.size
    assert streamed == local
    assert plan.payload_crcs(crcs) == expected_crcs
    archives = [item for item in placed.items if isinstance(item, layout.TensorItem)]
    assert len(archives) == len(tensors)
    for item, tensor in zip(archives, tensors):
        archive = streamed[item.base : item.base + item.length]
        assert zipfile.ZipFile(io.BytesIO(archive)).testzip() is None
        assert torch.equal(torch.load(io.BytesIO(archive)), tensor)


def test_a_file_of_archives_has_no_single_trailer():
    entries, _ = _entries()
    plan = layout.FilePlan.of(layout.place_items("__0_0.distcp", entries))
    with pytest.raises(ValueError, match="one trailer per archive"):
        plan.trailer([0] * len(plan.records))
