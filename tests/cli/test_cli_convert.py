"""``fastpersist convert``: torch checkpoints <-> safetensors files."""

from __future__ import annotations

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

import fastpersist
from fastpersist.cli import main


def _lightning_like() -> dict:
    weight = torch.randn(8, 8)
    return {
        "epoch": 2,
        "state_dict": {
            "enc.weight": weight,
            "dec.weight": weight,
            "enc.bias": torch.zeros(8),
            "t": torch.randn(4, 6).t(),
        },
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(8, 8)}}, "param_groups": [{"lr": 0.1}]}],
    }


def test_torch_to_safetensors_state_dict_with_tied_and_strided_tensors(tmp_path, capsys):
    checkpoint = _lightning_like()
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    assert (
        main(
            [
                "convert",
                str(tmp_path / "ckpt.pt"),
                str(tmp_path / "model.safetensors"),
                "--key",
                "state_dict",
                "--metadata",
                "format=pt",
            ]
        )
        == 0
    )
    loaded = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert set(loaded) == {"dec.weight", "enc.bias", "t"}  # the tied weight once
    assert torch.equal(loaded["dec.weight"], checkpoint["state_dict"]["enc.weight"])
    assert torch.equal(loaded["t"], checkpoint["state_dict"]["t"])
    with safetensors_torch.safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"enc.weight": "dec.weight", "format": "pt"}
    assert "3 tensors" in capsys.readouterr().out


def test_non_tensor_values_are_refused_dropped_or_kept(tmp_path, capsys):
    checkpoint = _lightning_like()
    source = tmp_path / "ckpt.pt"
    fastpersist.save(checkpoint, source)
    out = tmp_path / "all.safetensors"
    assert main(["convert", str(source), str(out)]) == 2
    error = capsys.readouterr().err
    assert "epoch" in error and "optimizer_states.0.param_groups.0.lr" in error and "--drop-non-tensors" in error
    assert not out.exists()
    assert main(["convert", str(source), str(out), "--drop-non-tensors"]) == 0
    assert "optimizer_states.0.state.0.exp_avg" in safetensors_torch.load_file(out)
    assert main(["convert", str(source), str(tmp_path / "kept.safetensors"), "--keep-structure"]) == 0
    kept = fastpersist.load(tmp_path / "kept.safetensors")
    assert kept["epoch"] == 2 and kept["optimizer_states"][0]["param_groups"] == [{"lr": 0.1}]
    assert kept["state_dict"]["enc.weight"] is kept["state_dict"]["dec.weight"]


def test_safetensors_to_torch(tmp_path, capsys):
    tensors = {"a": torch.randn(3, 3), "b": torch.arange(4)}
    safetensors_torch.save_file(tensors, tmp_path / "in.safetensors", metadata={"note": "x"})
    assert main(["convert", str(tmp_path / "in.safetensors"), str(tmp_path / "out.pt")]) == 0
    loaded = torch.load(tmp_path / "out.pt")
    assert set(loaded) == {"a", "b"} and torch.equal(loaded["a"], tensors["a"])
    assert "not stored" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "missing.pt"), str(tmp_path / "x.safetensors")]) == 2
    with pytest.raises(SystemExit, match="no entry 'model'"):
        main(["convert", str(tmp_path / "out.pt"), str(tmp_path / "x.safetensors"), "--key", "model"])


def test_unreadable_inputs_and_missing_output_directory_are_one_line_errors(tmp_path, capsys):
    torch.save({"w": torch.ones(3)}, tmp_path / "good.pt")
    (tmp_path / "garbage.pt").write_bytes(b"garbage" * 10)
    whole = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "garbage.pt"), str(tmp_path / "o.safetensors")]) == 1
    error = capsys.readouterr().err
    assert "not a checkpoint: neither a zip archive" in error and "Traceback" not in error
    assert main(["convert", str(tmp_path / "cut.pt"), str(tmp_path / "o.safetensors")]) == 1
    assert "cannot be read (CorruptCheckpointError" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "good.pt"), str(tmp_path / "missing" / "o.safetensors")]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_drop_non_tensors_applies_to_torch_outputs(tmp_path, capsys):
    checkpoint = _lightning_like()
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    assert main(["convert", str(tmp_path / "ckpt.pt"), str(tmp_path / "tensors.pt"), "--drop-non-tensors"]) == 0
    assert "dropped 2 non-tensor values: epoch, optimizer_states.0.param_groups.0.lr" in capsys.readouterr().out
    out = torch.load(tmp_path / "tensors.pt")
    assert "epoch" not in out and out["optimizer_states"][0]["param_groups"] == [{}]
    assert torch.equal(out["state_dict"]["t"], checkpoint["state_dict"]["t"])
