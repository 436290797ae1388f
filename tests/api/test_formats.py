"""The front door's format choice: save/load/async_save of safetensors files, and whole checkpoints in them."""

from __future__ import annotations

import collections
import io
import math
import os

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

import fastpersist
from fastpersist.api import dispatch
from fastpersist.errors import CorruptCheckpointError, UnsupportedObjectError


def _checkpoint() -> dict:
    weight = torch.randn(4, 4)
    return {
        "epoch": 3,
        "global_step": 2**40,
        "name": "run-ünï",
        "flags": (True, False, None),
        "inf": float("inf"),
        "nan": float("nan"),
        "state_dict": collections.OrderedDict(
            [("enc.weight", weight), ("dec.weight", weight), ("bias", torch.zeros(4))]
        ),
        "optimizer": {
            "state": {0: {"exp_avg": torch.ones(4), "step": torch.tensor(7.0)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "empty": [],
        "a.b": torch.arange(3),
        "a": {"b": torch.arange(4)},  # the same dotted name as the key above
    }


def test_extension_selects_safetensors_and_load_sniffs_the_bytes(tmp_path):
    state = {"a": torch.randn(3, 3), "b": torch.arange(5)}
    fastpersist.save(state, tmp_path / "m.safetensors")
    plain = safetensors_torch.load_file(tmp_path / "m.safetensors")  # a plain file, no structure metadata
    assert set(plain) == {"a", "b"}
    fastpersist.save(state, tmp_path / "m.weights", format="safetensors")
    fastpersist.save(state, tmp_path / "m.pt")
    assert (tmp_path / "m.pt").read_bytes()[:2] == b"PK"
    fastpersist.save(state, tmp_path / "zip.safetensors", format="torch")
    assert (tmp_path / "zip.safetensors").read_bytes()[:2] == b"PK"
    for name in ("m.safetensors", "m.weights", "m.pt", "zip.safetensors"):
        loaded = fastpersist.load(tmp_path / name)
        assert set(loaded) == {"a", "b"} and torch.equal(loaded["a"], state["a"]), name
    with pytest.raises(ValueError, match="unknown format"):
        fastpersist.save(state, tmp_path / "x", format="npz")


def test_whole_checkpoints_round_trip_and_stay_readable_by_the_library(tmp_path):
    checkpoint = _checkpoint()
    path = tmp_path / "ckpt.safetensors"
    fastpersist.save(checkpoint, path)
    loaded = fastpersist.load(path)
    assert set(loaded) == set(checkpoint)
    assert loaded["epoch"] == 3 and loaded["global_step"] == 2**40 and loaded["name"] == "run-ünï"
    assert loaded["flags"] == (True, False, None)
    assert loaded["inf"] == math.inf and math.isnan(loaded["nan"])
    assert isinstance(loaded["state_dict"], collections.OrderedDict)
    assert list(loaded["state_dict"]) == ["enc.weight", "dec.weight", "bias"]
    assert loaded["state_dict"]["enc.weight"] is loaded["state_dict"]["dec.weight"]  # tied weights stay tied
    assert torch.equal(loaded["state_dict"]["enc.weight"], checkpoint["state_dict"]["enc.weight"])
    assert list(loaded["optimizer"]["state"]) == [0]  # integer keys stay integers
    assert loaded["optimizer"]["param_groups"] == checkpoint["optimizer"]["param_groups"]
    assert torch.equal(loaded["a.b"], torch.arange(3)) and torch.equal(loaded["a"]["b"], torch.arange(4))
    assert loaded["empty"] == []
    flat = safetensors_torch.load_file(path)
    assert "optimizer.state.0.exp_avg" in flat and "state_dict.enc.weight" in flat
    assert len(flat) == 6  # the tied weight once


def test_refuses_objects_a_safetensors_file_cannot_hold(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(UnsupportedObjectError, match=r"\['config'\]\['dtype'\].*format='torch'"):
        fastpersist.save({"config": {"dtype": torch.float16}, "w": torch.ones(1)}, path)
    with pytest.raises(RuntimeError, match="share memory"):
        base = torch.ones(4)
        fastpersist.save({"x": base, "y": base[1:]}, path)
    assert not path.exists()


def test_file_objects_and_async_save(tmp_path):
    buffer = io.BytesIO()
    fastpersist.save({"a": torch.ones(2)}, buffer, format="safetensors")
    assert safetensors_torch.load(buffer.getvalue())["a"].tolist() == [1.0, 1.0]
    buffer.seek(0)
    assert fastpersist.load(buffer)["a"].tolist() == [1.0, 1.0]
    future = fastpersist.async_save(_checkpoint(), tmp_path / "a.safetensors")
    future.result()
    assert fastpersist.load(tmp_path / "a.safetensors")["epoch"] == 3


def test_map_location_forms(tmp_path):
    path = tmp_path / "m.safetensors"
    fastpersist.save({"a": torch.ones(2)}, path)
    assert fastpersist.load(path, map_location="cpu")["a"].device.type == "cpu"
    assert fastpersist.load(path, map_location={"cuda:0": "cpu"})["a"].device.type == "cpu"
    seen = []
    loaded = fastpersist.load(path, map_location=lambda storage, location: seen.append(location))
    assert seen == ["cpu"] and loaded["a"].tolist() == [1.0, 1.0]


def test_damaged_structure_metadata_is_reported(tmp_path):
    path = tmp_path / "d.safetensors"
    fastpersist.api.safetensors.save_file({"t": torch.ones(1)}, path, metadata={dispatch.STRUCTURE_KEY: "{broken"})
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        fastpersist.load(path)


def test_a_lightning_checkpoint_io_inherits_the_format(tmp_path):
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.plugins.io import CheckpointIO

    class SafetensorsIO(CheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fastpersist.save(checkpoint, path, format="safetensors")

        def load_checkpoint(self, path, map_location=None, weights_only=None):
            return fastpersist.load(path, map_location=map_location)

        def remove_checkpoint(self, path):
            os.remove(path)

    class Model(lightning.LightningModule):
        def __init__(self, lr: float = 0.1):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, index):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(8, 4))
            return torch.utils.data.DataLoader(data, batch_size=4)

    options = dict(
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[SafetensorsIO()],
    )
    trainer = lightning.Trainer(max_epochs=1, **options)
    trainer.fit(Model())
    path = trainer.checkpoint_callback.best_model_path
    assert "optimizer_states.0.state.0.exp_avg" in safetensors_torch.load_file(path)
    resumed = lightning.Trainer(max_epochs=2, **options)
    model = Model()
    resumed.fit(model, ckpt_path=path)
    assert resumed.current_epoch == 2 and resumed.global_step == 4


def test_a_collective_safetensors_save_is_refused_not_made_by_every_rank(tmp_path, monkeypatch):
    """group= with safetensors used to be ignored: every rank wrote the file. A group of one rank is a plain save."""
    from fastpersist.distributed import save as distributed_save

    state = {"w": torch.ones(3)}
    monkeypatch.setattr(distributed_save, "is_collective", lambda group: True)
    with pytest.raises(ValueError, match="format='torch'"):
        fastpersist.save(state, tmp_path / "m.safetensors", group=True)
    with pytest.raises(ValueError, match="collective save"):
        fastpersist.save(state, tmp_path / "m.bin", group=True, format="safetensors")
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(distributed_save, "is_collective", lambda group: False)
    fastpersist.save(state, tmp_path / "m.safetensors", group=True)
    assert torch.equal(fastpersist.load_file(tmp_path / "m.safetensors")["w"], state["w"])
