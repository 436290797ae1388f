"""The bounds the benchmarks print: each moves the bytes it claims to, and leaves the state alone."""

from __future__ import annotations

import os

import pytest
import torch

from fastpersist.bench import bounds


def _states(device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    sizes = (3 << 20, (1 << 20) + 17, 4096)  # windows of 1 MiB: several per tensor, a short last one
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator).to(device) for n in sizes]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_copy_ceiling_moves_the_bytes_and_leaves_the_state_alone(device):
    tensors = _states(device)
    before = [t.clone() for t in tensors]
    ceiling = bounds.CopyCeiling(tensors, window=1 << 20, slots=8)
    for crc in (False, True):
        assert ceiling.to_host(crc) > 0
        # 6 windows in all, the last the 4 KiB tensor: slot 5 holds it.
        assert torch.equal(ceiling.ring[5][:4096], tensors[2].cpu())
        assert torch.equal(ceiling.ring[0], tensors[0][: 1 << 20].cpu())
        assert ceiling.to_device(crc) > 0
    for a, b in zip(tensors, before):
        assert torch.equal(a, b)


def test_read_ceiling_reads_a_file_of_any_length(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom((9 << 20) + 123))
    assert bounds.read_ceiling(str(path)) > 0
    assert bounds.read_ceiling(str(path), 16, 1 << 20, size=5 << 20, direct=False) > 0  # the stages' pread rows
    with pytest.raises(OSError, match="expected"):
        bounds.read_ceiling(
            str(path), 2, 1 << 20, size=12 << 20, direct=False
        )  # past the end: never a silent short read


def test_write_ceiling_writes_fresh_files_and_cleans_up(tmp_path):
    result = bounds.write_ceiling(str(tmp_path), 3 << 20, repeats=1)
    assert result["best_s"] == min(result["seconds"].values()) > 0
    assert {"pwrite-1", "pwrite-8"} <= result["seconds"].keys()
    assert list(tmp_path.iterdir()) == []


def test_fio_write_allocates_inside_its_clock(tmp_path, monkeypatch):
    """fio's clock starts after it lays out a file unless --fallocate=none: a save's does not."""
    seen = {}

    def fake_run(command, **_):
        seen["command"] = command

        class Done:
            returncode = 0
            stdout = '{"jobs": [{"job_runtime": 10}]}'
            stderr = ""

        return Done()

    monkeypatch.setattr(bounds.subprocess, "run", fake_run)
    seconds = bounds.fio_write_seconds(str(tmp_path / "c.bin"), 8 << 20)
    assert "--fallocate=none" in seen["command"] and "--end_fsync=1" in seen["command"]
    assert seconds == pytest.approx(0.010 * (8 << 20) / (16 << 20))
