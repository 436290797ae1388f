"""Shapes users hit: 1,000+ parameters with optimizer state and Python scalars, mixed CPU/GPU,
one tensor above 4 GiB (zip64), and the shapes benchmark (with its sink) end to end."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastpersist
from fastpersist.bench import shapes
from fastpersist.format.zipformat import read_directory


def _same(a, b) -> bool:
    return shapes._same(a, b)


def test_llm_like_state_with_optimizer_scalars(tmp_path):
    state = shapes.build_shape("mixed", 1_100, None, 8 << 20, "cpu")
    assert len(state["model"]) >= 1_000
    assert isinstance(state["optimizer"]["state"][0]["step"], int)
    path = tmp_path / "train.pt"
    fastpersist.save(state, path)
    for weights_only in (True, False):
        assert _same(state, fastpersist.load(path, weights_only=weights_only))
    assert _same(state, torch.load(path, weights_only=True))
    fastpersist.verify(path)


@pytest.mark.gpu
def test_mixed_cpu_gpu_state(tmp_path):
    state = shapes.build_shape("mixed", 220, None, 8 << 20, "cuda")
    devices = {t.device.type for t in shapes._tensors_of(state)}
    assert devices == {"cpu", "cuda"}
    path = tmp_path / "mixed.pt"
    fastpersist.save(state, path)
    loaded = fastpersist.load(path)
    assert {t.device.type for t in shapes._tensors_of(loaded)} == {"cpu", "cuda"}
    assert _same(state, loaded)
    assert _same(state, torch.load(path, weights_only=True))


@pytest.mark.slow
def test_single_tensor_above_4_gib(tmp_path):
    """A 4.5 GiB tensor backed by a sparse file (no 4.5 GiB of RAM needed to build it)."""
    nbytes = (4 << 30) + (512 << 20)
    backing = tmp_path / "backing.bin"
    with open(backing, "wb") as f:
        f.truncate(nbytes)
    huge = torch.from_file(str(backing), shared=False, size=nbytes, dtype=torch.uint8)
    huge[:7] = torch.arange(7, dtype=torch.uint8)
    huge[-5:] = 9
    path = tmp_path / "huge.pt"
    fastpersist.save({"huge": huge}, path)
    with open(path, "rb") as f:
        data_fd = f.fileno()
        records = read_directory(lambda o, n: os.pread(data_fd, n, o), os.fstat(data_fd).st_size)
    record = next(r for r in records if r.name.endswith("/data/0"))
    assert record.size == nbytes and record.data_offset % 4096 == 0
    assert fastpersist.verify(path).checksummed
    for loaded in (fastpersist.load(path, mmap=True)["huge"], torch.load(path, mmap=True)["huge"]):
        assert loaded.numel() == nbytes
        assert loaded[:7].tolist() == list(range(7)) and loaded[-5:].tolist() == [9] * 5
        assert int(loaded[1 << 32 : (1 << 32) + 4096].sum()) == 0


@pytest.mark.parametrize("shape", ["many-small", "many-medium", "huge", "mixed"])
def test_shape_builders(shape):
    state = shapes.build_shape(shape, 40, "16-256" if shape == "many-small" else None, 1 << 20, "cpu")
    tensors = shapes._tensors_of(state)
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    if shape == "many-small":
        assert {t.numel() * t.element_size() for t in tensors} == {16, 32, 64, 128, 256}
    zeros = shapes.build_shape(shape, 40, None, 1 << 20, "cpu", zeros=True)
    assert all(int(t.count_nonzero()) == 0 for t in shapes._tensors_of(zeros))


def test_shapes_benchmark_with_sink_writes_labelled_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = shapes.main(
        [
            "--shape",
            "many-small",
            "--tensors",
            "300",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--sink",
            "--dir",
            str(tmp_path / "made" / "here"),  # made if missing
            "--json",
            str(out),
            "--no-drop-caches",
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    kinds = {r["method"]: r["kind"] for r in doc["results"]}
    assert kinds["fastpersist-sink"] == "sink" and kinds["fastpersist"] == "storage"
    assert kinds["fastpersist-sink-load verified"] == "sink"
    assert {"torch.save", "torch.load wo=True", "torch.load wo=False", "fastpersist verified wo=False"} <= set(kinds)
    assert all(r["median_s"] > 0 for r in doc["results"])
    assert "sink" in capsys.readouterr().out
    # Every figure next to its bound, measured in the same rounds.
    bound_of = {r["method"]: r.get("bound") for r in doc["results"] if r["kind"] != "ceiling"}
    assert bound_of["fastpersist"] == bound_of["torch.save"] == "ceiling: write"
    assert bound_of["fastpersist verified wo=True"] == "ceiling: read"
    assert bound_of["fastpersist-sink"] == "ceiling: copy to host + CRC-32"
    assert bound_of["fastpersist-sink-load verified"] == "ceiling: copy to device + CRC-32"
    assert bound_of["fastpersist-sink-load unverified"] == "ceiling: copy to device"
    assert all(r["of_bound"] > 0 for r in doc["results"] if r["kind"] != "ceiling")
    assert "| of bound |" in shapes.markdown(doc)
    # Where each of our loads' time goes on its calling thread: the parts add up to the whole (one round).
    ours = [r for r in doc["results"] if r["op"] == "load" and r["method"].startswith("fastpersist")]
    assert ours and all(set(r["caller_waits_s"]) == {"read", "slot", "crc", "copy", "other"} for r in ours)
    assert all(sum(r["caller_waits_s"].values()) == pytest.approx(r["median_s"]) for r in ours)
    assert all(r["caller_waits_s"]["read"] > 0 for r in ours if "sink" not in r["method"])
    assert not any("caller_waits_s" in r for r in doc["results"] if r["method"].startswith(("torch", "ceiling")))
    assert "| load | read | slot | crc | copy | other |" in shapes.markdown(doc)


def test_checkpoint_benchmark_forwards_shape(tmp_path):
    from fastpersist.bench import checkpoint

    out = tmp_path / "r.json"
    assert (
        checkpoint.main(
            [
                "--shape",
                "many-small",
                "--tensors",
                "50",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--no-loads",
                "--dir",
                str(tmp_path),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["shape"] == "many-small"
