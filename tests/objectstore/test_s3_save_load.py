"""Saves to and loads from s3://bucket/key against moto's S3 server: round trips, bytes, parts, ranges, threads."""

from __future__ import annotations

import io
import os
import pathlib
import threading

import pytest
import torch

import fastpersist
from fastpersist.io import memory
from fastpersist.io.targets.s3 import connection

_MiB = 1 << 20


def _state() -> dict:
    base = torch.arange(64, dtype=torch.float32)
    return {
        "float32": torch.randn(33, 7),
        "float16": torch.randn(5).half(),
        "bfloat16": torch.randn(9).bfloat16(),
        "float64": torch.randn(3, dtype=torch.float64),
        "int64": torch.arange(-5, 6),
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "uint8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "complex64": torch.randn(4, dtype=torch.complex64),
        "empty": torch.empty(0),
        "shared_whole": base,
        "shared_view": base[10:20],
        "objects": {"step": 7, "name": "run", "lr": [0.1, 0.01], "none": None, "tuple": (1, "a")},
    }


def _assert_state_equal(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[name].dtype == value.dtype, name
            assert torch.equal(loaded[name], value), name
        else:
            assert loaded[name] == value


def test_round_trip_of_dtypes_shared_storages_and_objects(s3):
    state = _state()
    fastpersist.save(state, s3.url("run/ckpt.pt"))
    loaded = fastpersist.load(s3.url("run/ckpt.pt"), map_location="cpu")
    _assert_state_equal(loaded, state)
    # The two views still share one storage, at the same offset.
    assert loaded["shared_view"].untyped_storage().data_ptr() == loaded["shared_whole"].untyped_storage().data_ptr()
    assert loaded["shared_view"].storage_offset() == 10
    loaded["shared_whole"][10] = -1.0
    assert loaded["shared_view"][0] == -1.0


def test_object_is_byte_identical_to_a_local_save_and_torch_loads_it(s3, tmp_path, monkeypatch):
    from fastpersist.format import serializer

    # torch writes a random serialization id per save: fix it so that two saves can be compared.
    monkeypatch.setattr(serializer, "_serialization_id", lambda: b"1234567890" * 4)
    state = _state()
    local = tmp_path / "ckpt.pt"
    fastpersist.save(state, local)
    fastpersist.save(state, s3.url("some/prefix/ckpt.pt"))
    downloaded = s3.get("some/prefix/ckpt.pt")
    assert downloaded == local.read_bytes()
    _assert_state_equal(torch.load(io.BytesIO(downloaded)), state)


def test_multipart_upload_of_several_parts_and_ranged_gets(s3, recording_client):
    state = {"big": torch.randn(13 * _MiB // 4), "small": torch.arange(3)}  # 13 MiB: 3 parts of 5 MiB
    fastpersist.save(state, s3.url("multi.pt"), s3_part_size="5M", s3_concurrency=2)
    saver = recording_client[0]
    assert saver.calls["create_multipart_upload"] == 1
    assert saver.calls["upload_part"] == 3
    assert saver.calls["complete_multipart_upload"] == 1
    assert "abort_multipart_upload" not in saver.calls
    assert saver.in_flight_peak <= 2
    head = s3.client.head_object(Bucket=s3.bucket, Key="multi.pt")
    assert head["ETag"].strip('"').endswith("-3")  # S3's mark of a 3-part object
    assert s3.uploads_in_progress() == []

    loaded = fastpersist.load(s3.url("multi.pt"), s3_part_size="5M", s3_concurrency=3)
    _assert_state_equal(loaded, state)
    assert recording_client[1].calls["get_object"] == 3  # ranges of 5, 5 and 3+ MiB
    assert torch.equal(torch.load(io.BytesIO(s3.get("multi.pt")))["big"], state["big"])


def test_save_leases_at_most_concurrency_parts_of_host_memory(s3, recording_client, monkeypatch):
    leases = []
    real = memory.lease_buffers

    def lease(count, size, huge_pages=True):
        leases.append((count, size))
        return real(count, size, huge_pages)

    monkeypatch.setattr(memory, "lease_buffers", lease)
    state = {"big": torch.randn(31 * _MiB // 4)}  # 7 parts of 5 MiB, through a ring of 3
    fastpersist.save(state, s3.url("bounded.pt"), s3_part_size="5M", s3_concurrency=3)
    assert leases == [(3, 5 * _MiB)]
    assert recording_client[0].calls["upload_part"] == 7
    assert recording_client[0].in_flight_peak <= 3
    assert torch.equal(fastpersist.load(s3.url("bounded.pt"))["big"], state["big"])


def test_settings_apply_from_the_config_mechanism(s3, recording_client):
    state = {"big": torch.randn(11 * _MiB // 4)}
    with fastpersist.config.override(s3_part_size="5M", s3_concurrency=1):
        fastpersist.save(state, s3.url("configured.pt"))
        assert torch.equal(fastpersist.load(s3.url("configured.pt"))["big"], state["big"])
    assert recording_client[0].calls["upload_part"] == 3
    assert recording_client[0].in_flight_peak == 1
    assert recording_client[1].calls["get_object"] == 3


def test_part_size_grows_where_the_checkpoint_needs_more_than_10000_parts():
    assert connection.part_size_for(100 * _MiB, 64 * _MiB) == 64 * _MiB
    assert connection.part_size_for(10_000 * 64 * _MiB, 64 * _MiB) == 64 * _MiB
    grown = connection.part_size_for(10_000 * 64 * _MiB + 1, 64 * _MiB)
    assert grown == 65 * _MiB and grown % _MiB == 0
    assert -(-(10_000 * 64 * _MiB + 1) // grown) <= connection.MAX_PARTS


def test_settings_refuse_part_sizes_s3_refuses():
    with pytest.raises(fastpersist.ConfigError, match="5 MiB"):
        fastpersist.config.settings().replace(s3_part_size="4M")
    with pytest.raises(fastpersist.ConfigError, match="s3_concurrency"):
        fastpersist.config.settings().replace(s3_concurrency=0)


_COLLAPSED_CALLS = {
    "save": lambda path: fastpersist.save({"w": torch.ones(3)}, path),
    "load": lambda path: fastpersist.load(path),
    "async_save": lambda path: fastpersist.async_save({"w": torch.ones(3)}, path).result(),
    "save_file": lambda path: fastpersist.save_file({"w": torch.ones(3)}, path),
    "load_file": lambda path: fastpersist.load_file(path),
}


@pytest.mark.parametrize("call", list(_COLLAPSED_CALLS))
def test_a_url_made_into_a_path_object_is_refused_with_advice(call, tmp_path, monkeypatch):
    """pathlib.Path("s3://bucket/key") is s3:/bucket/key: a ValueError says to pass a str, not to make a folder."""
    monkeypatch.chdir(tmp_path)
    path = pathlib.Path("s3://bucket/ckpt.pt")
    assert str(path) == "s3:/bucket/ckpt.pt"
    with pytest.raises(ValueError, match="pass the URL as a string, 's3://bucket/ckpt.pt'") as info:
        _COLLAPSED_CALLS[call](path)
    assert not isinstance(info.value, OSError), "not the missing-directory error, which advises os.makedirs"
    assert os.listdir(tmp_path) == []


def test_async_save_commits_at_result(s3):
    state = _state()
    future = fastpersist.async_save(state, s3.url("async.pt"))
    future.result()
    _assert_state_equal(fastpersist.load(s3.url("async.pt")), state)
    snapshot = fastpersist.async_save(state, s3.url("async-snapshot.pt"), mode="snapshot")
    snapshot.result()
    _assert_state_equal(fastpersist.load(s3.url("async-snapshot.pt")), state)


def test_threads_save_different_keys_at_once(s3, in_threads):
    states = [{"rank": index, "weights": torch.randn(3 * _MiB // 4 + index)} for index in range(4)]
    start = threading.Barrier(len(states))

    def save(index):
        start.wait()
        fastpersist.save(states[index], s3.url(f"thread-{index}.pt"))

    assert in_threads(save, len(states)) == []
    for index, state in enumerate(states):
        loaded = fastpersist.load(s3.url(f"thread-{index}.pt"))
        assert loaded["rank"] == index and torch.equal(loaded["weights"], state["weights"])
    assert s3.uploads_in_progress() == []


def test_overwrite_replaces_the_object(s3):
    fastpersist.save({"v": torch.tensor([1])}, s3.url("ckpt.pt"))
    fastpersist.save({"v": torch.tensor([2])}, s3.url("ckpt.pt"))
    assert fastpersist.load(s3.url("ckpt.pt"))["v"].item() == 2


def test_load_reads_torch_save_legacy_and_safetensors_objects(s3):
    state = {"w": torch.randn(17), "b": torch.arange(4)}
    for key, kwargs in (("torch.pt", {}), ("legacy.pt", {"_use_new_zipfile_serialization": False})):
        buffer = io.BytesIO()
        torch.save(state, buffer, **kwargs)
        s3.put(key, buffer.getvalue())
        _assert_state_equal(fastpersist.load(s3.url(key)), state)
    buffer = io.BytesIO()
    fastpersist.save(state, buffer, format="safetensors")
    s3.put("model.safetensors", buffer.getvalue())
    _assert_state_equal(fastpersist.load(s3.url("model.safetensors")), state)


def test_load_honours_weights_only_and_map_location(s3):
    import fractions
    import pickle

    fastpersist.save({"w": torch.ones(2)}, s3.url("plain.pt"))
    loaded = fastpersist.load(s3.url("plain.pt"), map_location=lambda storage, location: storage)
    assert torch.equal(loaded["w"], torch.ones(2))
    assert fastpersist.load(s3.url("plain.pt"), map_location="meta")["w"].device.type == "meta"
    fastpersist.save({"custom": fractions.Fraction(1, 3)}, s3.url("custom.pt"))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        fastpersist.load(s3.url("custom.pt"))
    assert fastpersist.load(s3.url("custom.pt"), weights_only=False)["custom"] == fractions.Fraction(1, 3)


def test_the_former_module_name_gives_the_same_functions():
    """``fastpersist.io.objectstore`` (documented: its ``upload_file`` for use on its own) re-exports the S3
    requests from their modules under ``io.targets.s3``: the same objects, not copies."""
    from fastpersist.io import objectstore
    from fastpersist.io.targets.s3 import files, keys, ranges, upload

    defined = {**vars(connection), **vars(files), **vars(keys), **vars(ranges), **vars(upload)}
    assert {name: getattr(objectstore, name) is defined[name] for name in objectstore.__all__} == dict.fromkeys(
        objectstore.__all__, True
    )
