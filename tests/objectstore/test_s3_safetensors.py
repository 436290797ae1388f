"""safetensors files as objects (s3://bucket/key) against moto's S3 server: saves byte-identical to local
files, through the multipart machinery of torch-format saves; loads and lazy reads with ranged GETs."""

from __future__ import annotations

import pytest
import torch

import fastpersist
from fastpersist.api import safetensors as fs
from fastpersist.errors import InvalidSafetensorsError, ObjectNotFoundError, ObjectStoreError
from fastpersist.io.targets.s3 import connection, ranges

_MiB = 1 << 20


def _network_error():
    from botocore.exceptions import ConnectionClosedError

    return ConnectionClosedError(endpoint_url="http://127.0.0.1:1/injected")


def _dtypes() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(33, 7, generator=generator),
        "f16": torch.randn(5, generator=generator).half(),
        "bf16": torch.randn(9, generator=generator).bfloat16(),
        "f64": torch.randn(3, dtype=torch.float64, generator=generator),
        "i64": torch.arange(-5, 6),
        "i32": torch.arange(7, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(4, dtype=torch.complex64, generator=generator),
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
    }
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            tensors[name] = torch.arange(6).to(dtype)
    return tensors


def _multipart() -> dict[str, torch.Tensor]:
    """About 13 MiB of odd-sized tensors: three parts of 5 MiB, tensors crossing part boundaries."""
    generator = torch.Generator().manual_seed(1)
    return {
        "big": torch.randn(2 * _MiB + 13, generator=generator),
        "odd": torch.randint(0, 255, (4 * _MiB + 4097,), dtype=torch.uint8, generator=generator),
        "half": torch.randn(_MiB + 1, generator=generator).half(),
        "tail": torch.arange(3, dtype=torch.int64),
    }


def _assert_tensors_equal(loaded: dict, expected: dict) -> None:
    """Same names, dtypes, shapes and bytes (bytes: float8 has no torch.equal)."""
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize(
    ("make", "alignment", "part_size"),
    [
        (_dtypes, 4096, None),
        (_dtypes, 8, None),
        (_multipart, 4096, "5M"),
        (_multipart, 8, "5M"),
        (lambda: {}, 4096, None),
    ],
    ids=["dtypes", "dtypes-align8", "multipart", "multipart-align8", "no-tensors"],
)
def test_object_is_byte_identical_to_the_local_file(s3, recording_client, tmp_path, make, alignment, part_size):
    from safetensors.torch import load as library_load

    tensors = make()
    settings = {"s3_part_size": part_size, "s3_concurrency": 2} if part_size else {}
    local = tmp_path / "model.safetensors"
    fastpersist.save_file(tensors, local, metadata={"format": "pt"}, alignment=alignment)
    fastpersist.save_file(
        tensors, s3.url("m/model.safetensors"), metadata={"format": "pt"}, alignment=alignment, **settings
    )
    downloaded = s3.get("m/model.safetensors")
    assert downloaded == local.read_bytes()
    _assert_tensors_equal(library_load(downloaded), tensors)
    calls = recording_client[-1].calls
    if part_size:  # the torch format's multipart machinery: 3 parts, completed
        assert calls["upload_part"] == -(-len(downloaded) // (5 * _MiB)) == 3
        assert calls["complete_multipart_upload"] == 1
    else:
        assert calls["put_object"] == 1 and "create_multipart_upload" not in calls
    assert s3.uploads_in_progress() == []


def test_load_file_and_safe_open_of_urls(s3, recording_client):
    tensors = {**_multipart(), **_dtypes()}
    fastpersist.save_file(tensors, s3.url("model.safetensors"), metadata={"k": "v"}, s3_part_size="5M")
    recording_client.clear()
    loaded = fastpersist.load_file(s3.url("model.safetensors"), s3_part_size="5M", s3_concurrency=3)
    _assert_tensors_equal(loaded, tensors)
    reader = recording_client[-1]
    stored = s3.get("model.safetensors")
    data = len(stored) - 8 - int.from_bytes(stored[:8], "little")
    assert reader.calls["head_object"] == 1
    # One GET for the header (the first 64 KiB), then the data section in ranges of 5 MiB.
    assert reader.calls["get_object"] == 1 + -(-data // (5 * _MiB)) == 4
    loaded["big"][0] = 42.0  # CPU tensors are writable views of the fetched buffer
    assert loaded["big"][0] == 42.0

    ranges = []
    with fastpersist.safe_open(s3.url("model.safetensors"), framework="pt") as f:
        client = recording_client[-1]
        client.before["get_object"] = lambda **arguments: ranges.append(arguments["Range"])
        assert f.keys() == sorted(tensors) and f.metadata() == {"k": "v"}
        assert torch.equal(f.get_tensor("tail"), tensors["tail"])
        assert torch.equal(f.get_slice("big")[10:20], tensors["big"][10:20])
        assert f.get_slice("f32").get_shape() == [33, 7]
        with pytest.raises(KeyError):
            f.get_tensor("absent")
    # Only the ranges asked for were fetched: 24 bytes of "tail", 40 bytes of "big".
    sizes = [int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1 for r in ranges]
    assert sizes == [24, 40]


def test_load_file_reads_the_librarys_objects_and_load_model(s3, tmp_path):
    from safetensors.torch import save as library_save

    tensors = _dtypes()
    s3.put("library.safetensors", library_save(tensors))
    _assert_tensors_equal(fastpersist.load_file(s3.url("library.safetensors")), tensors)
    _assert_tensors_equal(fastpersist.load(s3.url("library.safetensors")), tensors)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied: stored once
    fs.save_model(model, s3.url("model.safetensors"))
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    other[1].weight = other[0].weight
    missing, unexpected = fs.load_model(other, s3.url("model.safetensors"))
    assert not missing and not unexpected
    assert torch.equal(other[0].weight, model[0].weight) and torch.equal(other[1].bias, model[1].bias)


def test_front_door_saves_safetensors_objects(s3, tmp_path):
    state = {"model": {"w": torch.randn(5), "b": torch.zeros(2)}, "step": 3, "lr": [0.1]}
    fastpersist.save(state, tmp_path / "ckpt.safetensors")
    fastpersist.save(state, s3.url("ckpt.safetensors"))
    assert s3.get("ckpt.safetensors") == (tmp_path / "ckpt.safetensors").read_bytes()
    fastpersist.save(state, s3.url("ckpt.bin"), format="safetensors")
    assert s3.get("ckpt.bin") == (tmp_path / "ckpt.safetensors").read_bytes()
    for key in ("ckpt.safetensors", "ckpt.bin"):
        loaded = fastpersist.load(s3.url(key))
        assert loaded["step"] == 3 and loaded["lr"] == [0.1] and torch.equal(loaded["model"]["w"], state["model"]["w"])
    mapped = fastpersist.load(s3.url("ckpt.bin"), map_location=lambda storage, location: storage)
    assert torch.equal(mapped["model"]["b"], state["model"]["b"])
    assert fastpersist.load(s3.url("ckpt.bin"), map_location="meta")["model"]["w"].device.type == "meta"
    fastpersist.save(state, s3.url("forced.safetensors"), format="torch")  # format= wins over the key
    assert s3.get("forced.safetensors")[:4] == b"PK\x03\x04"


def test_async_saves_of_safetensors_objects(s3, tmp_path):
    tensors = _dtypes()
    fastpersist.save_file(tensors, tmp_path / "model.safetensors")
    future = fs.async_save_file(tensors, s3.url("async.safetensors"))
    future.result()
    assert s3.get("async.safetensors") == (tmp_path / "model.safetensors").read_bytes()
    state = {"w": torch.randn(7), "nested": {"step": 1}}
    fastpersist.save(state, tmp_path / "front.safetensors")
    fastpersist.async_save(state, s3.url("front.safetensors")).result()
    assert s3.get("front.safetensors") == (tmp_path / "front.safetensors").read_bytes()
    with pytest.raises(ObjectStoreError):
        fs.async_save_file(tensors, f"s3://{s3.bucket}-missing/x.safetensors").result()


def test_objects_that_are_not_safetensors_are_refused_clearly(s3):
    s3.put("empty.safetensors", b"")
    with pytest.raises(InvalidSafetensorsError, match="shorter than 8 bytes") as caught:
        fastpersist.load_file(s3.url("empty.safetensors"))
    assert s3.url("empty.safetensors") in str(caught.value)
    fastpersist.save({"w": torch.ones(2)}, s3.url("torch.pt"))
    with pytest.raises(InvalidSafetensorsError):
        fastpersist.load_file(s3.url("torch.pt"))
    truncated = fs.save({"w": torch.ones(100)})[:-4]
    s3.put("truncated.safetensors", truncated)
    with pytest.raises(InvalidSafetensorsError, match="truncated|not fully covered"):
        fastpersist.safe_open(s3.url("truncated.safetensors"))
    with pytest.raises(ObjectNotFoundError):
        fastpersist.load_file(s3.url("absent.safetensors"))
    with pytest.raises(ValueError, match="s3://bucket/path"):
        fastpersist.load_file("s3://bucket/")


def test_an_object_replaced_while_open_fails_the_read(s3):
    fastpersist.save_file({"w": torch.ones(10)}, s3.url("model.safetensors"))
    with fastpersist.safe_open(s3.url("model.safetensors"), framework="pt") as f:
        fastpersist.save_file({"w": torch.zeros(10)}, s3.url("model.safetensors"))
        with pytest.raises(ObjectStoreError, match="replaced while it was being read"):
            f.get_tensor("w")


def test_safe_open_reads_through_read_ranges_pinned_to_the_etag_of_its_head(s3, monkeypatch):
    # One ranged-read mechanism: ObjectReader is a HEAD plus read_ranges calls given that HEAD's ETag.
    fastpersist.save_file({"a": torch.arange(5), "b": torch.ones(3)}, s3.url("model.safetensors"))
    real, calls = ranges.read_ranges, []

    def recording(reads, settings, **options):
        calls.append((list(reads), dict(options["seen"])))
        return real(reads, settings, **options)

    monkeypatch.setattr(ranges, "read_ranges", recording)
    with fastpersist.safe_open(s3.url("model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("b"), torch.ones(3))
    url = connection.target(s3.url("model.safetensors"))
    assert len(calls) == 2  # the header, then "b"
    for reads, seen in calls:
        assert [read[0] for read in reads] == [url]
        assert seen[url][1] == s3.client.head_object(Bucket=s3.bucket, Key="model.safetensors")["ETag"]


_PREVIOUS = {"version": torch.tensor([1])}
_NEXT = {"version": torch.tensor([2]), "weights": torch.randn(16 * _MiB // 4)}  # 4 parts of 5 MiB


def _assert_previous_intact(s3, key: str) -> None:
    assert fastpersist.load_file(s3.url(key))["version"].item() == 1
    assert s3.uploads_in_progress() == []


@pytest.mark.parametrize("failure", ["network", "interrupt"])
def test_failure_mid_upload_keeps_the_previous_object(s3, recording_client, monkeypatch, failure):
    fastpersist.save_file(_PREVIOUS, s3.url("model.safetensors"))
    real = connection.make_client

    def failing(concurrency):
        client = real(concurrency)
        client.fail["upload_part"] = (2, _network_error() if failure == "network" else KeyboardInterrupt())
        return client

    monkeypatch.setattr(connection, "make_client", failing)
    expected = ObjectStoreError if failure == "network" else KeyboardInterrupt
    with pytest.raises(expected):
        fastpersist.save_file(_NEXT, s3.url("model.safetensors"), s3_part_size="5M", s3_concurrency=1)
    client = recording_client[-1]
    assert client.calls["abort_multipart_upload"] == 1 and "complete_multipart_upload" not in client.calls
    monkeypatch.setattr(connection, "make_client", real)
    _assert_previous_intact(s3, "model.safetensors")


def test_failed_single_put_keeps_the_previous_object(s3, recording_client, monkeypatch):
    fastpersist.save_file(_PREVIOUS, s3.url("model.safetensors"))
    real = connection.make_client

    def failing(concurrency):
        client = real(concurrency)
        client.fail["put_object"] = (1, _network_error())
        return client

    monkeypatch.setattr(connection, "make_client", failing)
    with pytest.raises(ObjectStoreError, match="uploading"):
        fastpersist.save({"version": torch.tensor([2])}, s3.url("model.safetensors"))
    monkeypatch.setattr(connection, "make_client", real)
    _assert_previous_intact(s3, "model.safetensors")


def test_what_stays_unsupported_is_refused_clearly(s3):
    with pytest.raises(ValueError, match="collective"):
        fastpersist.save(_PREVIOUS, s3.url("model.safetensors"), group=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fastpersist.save_file(_PREVIOUS, s3.url("model.safetensors"), no_such_setting=1)
    with pytest.raises(ValueError, match="unknown format"):
        fastpersist.save(_PREVIOUS, s3.url("model.safetensors"), format="npz")
    assert s3.uploads_in_progress() == []


def test_threads_and_a_forked_child_save_safetensors_objects(s3, in_threads):
    """save_file to s3:// from several threads at once, and from a child after os.fork(): each object is whole."""
    import os
    import threading

    tensors = [{"w": torch.randn(1 << 18), "i": torch.tensor([index])} for index in range(3)]
    start = threading.Barrier(len(tensors))

    def save(index):
        start.wait()
        fastpersist.save_file(tensors[index], s3.url(f"thread-{index}.safetensors"))

    assert in_threads(save, len(tensors)) == []
    for index, expected in enumerate(tensors):
        loaded = fastpersist.load_file(s3.url(f"thread-{index}.safetensors"))
        assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["i"], expected["i"])
    pid = os.fork()
    if pid == 0:  # the child: its own client, the parent's buffer pool left alone
        code = 1
        try:
            fastpersist.save_file(tensors[0], s3.url("child.safetensors"))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(fastpersist.load_file(s3.url("child.safetensors"))["w"], tensors[0]["w"])
    assert s3.uploads_in_progress() == []
