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
from fastpersist.io import engine
from fastpersist.io.writer import write_plan

_MiB = 1 << 20


def _entries():
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
    entries = [(MetadataIndex("bytes"), b"hello"), (MetadataIndex("empty-bytes"), b"")]
    entries += [(MetadataIndex(f"t{i}"), t) for i, t in enumerate(tensors)]
    return entries, tensors


@pytest.mark.parametrize("window", [_MiB, 4096 * 3, 64 * _MiB], ids=["1MiB", "12KiB", "one-window"])
def test_sequential_pass_equals_local_writer(tmp_path, window):
    """Small windows make trailers and descriptors span two windows."""
    entries, tensors = _entries()
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
    for item, tensor in zip(archives, tensors):
        archive = streamed[item.base : item.base + item.length]
        assert zipfile.ZipFile(io.BytesIO(archive)).testzip() is None
        assert torch.equal(torch.load(io.BytesIO(archive)), tensor)


def test_a_file_of_archives_has_no_single_trailer():
    entries, _ = _entries()
    plan = layout.FilePlan.of(layout.place_items("__0_0.distcp", entries))
    with pytest.raises(ValueError, match="one trailer per archive"):
        plan.trailer([0] * len(plan.records))
