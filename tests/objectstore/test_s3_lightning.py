"""Lightning's CheckpointIO plugins with s3:// paths: fastpersist's object-store saves, loads and removals.

Lightning calls ``save_checkpoint``, ``load_checkpoint`` and
``remove_checkpoint`` with the paths ModelCheckpoint builds; with an
``s3://`` dirpath these are object URLs, and the plugins must not need
fsspec's s3fs for them.
"""

from __future__ import annotations

import pytest
import torch

from fastpersist.errors import ObjectNotFoundError


def _plugins():
    pytest.importorskip("lightning")
    from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO, FastPersistCheckpointIO

    return [FastPersistCheckpointIO, AsyncFastPersistCheckpointIO]


def _checkpoint() -> dict:
    return {
        "state_dict": {"layer.weight": torch.randn(8, 4), "layer.bias": torch.zeros(8)},
        "epoch": 3,
        "global_step": 12,
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(8, 4)}}, "param_groups": [{"lr": 1e-3}]}],
    }


@pytest.mark.parametrize("index", [0, 1], ids=["sync", "async"])
def test_save_load_and_remove_on_s3(index, s3):
    plugin = _plugins()[index]()
    url = s3.url("lightning/checkpoints/epoch=3-step=12.ckpt")
    checkpoint = _checkpoint()
    plugin.save_checkpoint(checkpoint, url)
    loaded = plugin.load_checkpoint(url)
    assert loaded["epoch"] == 3 and loaded["global_step"] == 12
    assert torch.equal(loaded["state_dict"]["layer.weight"], checkpoint["state_dict"]["layer.weight"])
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["exp_avg"], torch.ones(8, 4))
    plugin.remove_checkpoint(url)
    with pytest.raises(ObjectNotFoundError):
        plugin.load_checkpoint(url)
    plugin.remove_checkpoint(url)  # already gone: nothing happens, as for a local path
    plugin.teardown()


def test_storage_options_reach_the_object_store_save(s3, recording_client):
    plugin = _plugins()[0]()
    url = s3.url("lightning/last.ckpt")
    plugin.save_checkpoint({"w": torch.randn(3 << 20)}, url, storage_options={"s3_part_size": "5M"})
    parts = sum(client.calls.get("upload_part", 0) for client in recording_client)
    assert parts == 3  # 12 MiB of payload in 5 MiB parts
    assert plugin.load_checkpoint(url)["w"].shape == (3 << 20,)
