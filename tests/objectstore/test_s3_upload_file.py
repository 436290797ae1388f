"""io.targets.s3.files.upload_file against moto's S3 server: a local file as an object, byte for byte, in bounded
memory; any failure aborts the multipart upload and leaves the previous object intact."""

from __future__ import annotations

import os

import pytest

import fastpersist
from fastpersist.errors import BucketNotFoundError, CheckpointIOError, ObjectStoreError
from fastpersist.io.targets.s3 import connection, files

_MiB = 1 << 20
_PART = 5 * _MiB


def _settings(**changes):
    return fastpersist.config.settings().replace(s3_part_size=_PART, **changes)


def _network_error():
    from botocore.exceptions import ConnectionClosedError

    return ConnectionClosedError(endpoint_url="http://127.0.0.1:1/injected")


def _file(path, size: int, seed: int = 0) -> bytes:
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    data = bytes(b ^ seed for b in data)
    path.write_bytes(data)
    return data


@pytest.mark.parametrize(
    ("size", "parts"),
    [(0, 0), (1, 0), (4097, 0), (_PART, 0), (_PART + 1, 2), (2 * _PART + 12_345, 3)],
    ids=["empty", "1", "4097", "one-part", "one-part+1", "three-parts-odd-tail"],
)
def test_object_is_the_file_byte_for_byte(s3, recording_client, tmp_path, size, parts):
    data = _file(tmp_path / "ckpt.pt", size)
    files.upload_file(tmp_path / "ckpt.pt", s3.url("up/ckpt.pt"), _settings(s3_concurrency=2))
    assert s3.get("up/ckpt.pt") == data
    calls = recording_client[-1].calls
    if parts:
        assert calls["upload_part"] == parts and calls["complete_multipart_upload"] == 1
        assert "put_object" not in calls
    else:
        assert calls["put_object"] == 1 and "create_multipart_upload" not in calls
    assert s3.uploads_in_progress() == []


def test_host_memory_is_at_most_concurrency_parts(s3, recording_client, tmp_path, monkeypatch):
    made = []

    class Counted(files._Buffers):
        def __init__(self, size):
            super().__init__(size)
            made.append(self)

    monkeypatch.setattr(files, "_Buffers", Counted)
    data = _file(tmp_path / "big.pt", 6 * _PART + 7)  # 7 parts through 3 buffers
    files.upload_file(str(tmp_path / "big.pt"), s3.url("big.pt"), _settings(s3_concurrency=3))
    assert s3.get("big.pt") == data
    assert recording_client[-1].calls["upload_part"] == 7
    assert [buffers.made <= 3 for buffers in made] == [True]
    assert recording_client[-1].in_flight_peak <= 3


def test_an_open_file_is_uploaded_even_after_its_name_was_replaced(s3, tmp_path):
    first = _file(tmp_path / "ckpt.pt", _PART + 100, seed=1)
    with open(tmp_path / "ckpt.pt", "rb") as opened:
        _file(tmp_path / "next.pt", 3000, seed=2)
        os.replace(tmp_path / "next.pt", tmp_path / "ckpt.pt")  # what a later atomic save does
        files.upload_file(opened, connection.target(s3.url("ckpt.pt")), _settings())
        assert not opened.closed  # the caller's file stays open
    assert s3.get("ckpt.pt") == first


@pytest.mark.parametrize("failure", ["network", "interrupt"])
def test_failure_mid_upload_aborts_and_keeps_the_previous_object(s3, recording_client, tmp_path, monkeypatch, failure):
    s3.put("ckpt.pt", b"previous")
    _file(tmp_path / "ckpt.pt", 3 * _PART + 1)
    real = connection.make_client

    def failing(concurrency):
        client = real(concurrency)
        client.fail["upload_part"] = (2, _network_error() if failure == "network" else KeyboardInterrupt())
        return client

    monkeypatch.setattr(connection, "make_client", failing)
    expected = ObjectStoreError if failure == "network" else KeyboardInterrupt
    with pytest.raises(expected) as caught:
        files.upload_file(tmp_path / "ckpt.pt", s3.url("ckpt.pt"), _settings(s3_concurrency=1))
    if failure == "network":
        assert caught.value.code == "ConnectionClosedError" and "uploading part 2" in str(caught.value)
    client = recording_client[-1]
    assert client.calls["abort_multipart_upload"] == 1 and "complete_multipart_upload" not in client.calls
    assert client.calls["upload_part"] == 2  # the parts after the failure were skipped
    assert s3.get("ckpt.pt") == b"previous" and s3.uploads_in_progress() == []


def test_failed_single_put_keeps_the_previous_object(s3, recording_client, tmp_path, monkeypatch):
    s3.put("ckpt.pt", b"previous")
    _file(tmp_path / "ckpt.pt", 1000)
    real = connection.make_client

    def failing(concurrency):
        client = real(concurrency)
        client.fail["put_object"] = (1, _network_error())
        return client

    monkeypatch.setattr(connection, "make_client", failing)
    with pytest.raises(ObjectStoreError, match="uploading"):
        files.upload_file(tmp_path / "ckpt.pt", s3.url("ckpt.pt"), _settings())
    assert s3.get("ckpt.pt") == b"previous"


@pytest.mark.parametrize("change", ["append", "truncate"])
def test_a_file_changed_during_the_upload_is_not_committed(s3, recording_client, tmp_path, monkeypatch, change):
    s3.put("ckpt.pt", b"previous")
    path = tmp_path / "ckpt.pt"
    _file(path, 3 * _PART)
    real = connection.make_client

    def changing(concurrency):
        client = real(concurrency)

        def rewrite(**_):
            if change == "append":
                with open(path, "ab") as f:
                    f.write(b"more")
            else:
                os.truncate(path, _PART + 10)

        client.before["upload_part"] = rewrite
        return client

    monkeypatch.setattr(connection, "make_client", changing)
    message = "modified while it was being uploaded" if change == "append" else "truncated or rewritten in place"
    with pytest.raises(CheckpointIOError, match=message) as caught:
        files.upload_file(path, s3.url("ckpt.pt"), _settings(s3_concurrency=1))
    assert caught.value.filename == str(path)
    assert recording_client[-1].calls["abort_multipart_upload"] == 1
    assert s3.get("ckpt.pt") == b"previous" and s3.uploads_in_progress() == []


def test_local_and_store_errors_are_clear(s3, recording_client, tmp_path):
    with pytest.raises(FileNotFoundError):
        files.upload_file(tmp_path / "absent.pt", s3.url("x.pt"), _settings())
    with pytest.raises(IsADirectoryError):
        files.upload_file(tmp_path, s3.url("x.pt"), _settings())
    assert recording_client == []  # nothing was asked of the store
    _file(tmp_path / "ckpt.pt", 10)
    with pytest.raises(ValueError, match="s3://bucket/path"):
        files.upload_file(tmp_path / "ckpt.pt", "s3://bucket/", _settings())
    with pytest.raises(BucketNotFoundError):
        files.upload_file(tmp_path / "ckpt.pt", f"s3://{s3.bucket}-missing/x.pt", _settings())
    with open("/dev/null", "rb") as device, pytest.raises(ValueError, match="regular file"):
        files.upload_file(device, s3.url("x.pt"), _settings())
