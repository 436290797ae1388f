"""Failures of s3:// saves and loads against moto's S3 server: each is a clear error, and a failed save
aborts its multipart upload and leaves the previous object intact."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import fastpersist
from fastpersist.errors import (
    BucketNotFoundError,
    CheckpointIOError,
    ChecksumMismatchError,
    ObjectNotFoundError,
    ObjectStoreCredentialsError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
    TruncatedCheckpointError,
)
from fastpersist.format.serializer import plan_save
from fastpersist.io.targets.s3 import connection, upload

_MiB = 1 << 20
_PREVIOUS = {"version": torch.tensor([1]), "weights": torch.arange(1000)}
_NEXT = {"version": torch.tensor([2]), "weights": torch.randn(16 * _MiB // 4)}  # 4 parts of 5 MiB


def _network_error():
    from botocore.exceptions import ConnectionClosedError

    return ConnectionClosedError(endpoint_url="http://127.0.0.1:1/injected")


def _assert_previous_intact(s3, key: str) -> None:
    assert fastpersist.load(s3.url(key))["version"].item() == 1
    assert s3.uploads_in_progress() == []


def test_network_error_in_a_part_aborts_and_keeps_the_previous_object(s3, recording_client):
    fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))
    recording_client.clear()
    with pytest.raises(ObjectStoreError, match="uploading part 2 .*Check AWS_ENDPOINT_URL") as caught:
        original = connection.make_client

        def failing(concurrency):
            client = original(concurrency)
            client.fail["upload_part"] = (2, _network_error())
            return client

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(connection, "make_client", failing)
            fastpersist.save(_NEXT, s3.url("ckpt.pt"), s3_part_size="5M", s3_concurrency=1)
    assert isinstance(caught.value, CheckpointIOError) and isinstance(caught.value, RuntimeError)
    assert caught.value.filename == s3.url("ckpt.pt")
    assert caught.value.code == "ConnectionClosedError"
    client = recording_client[0]
    assert client.calls["abort_multipart_upload"] == 1
    assert "complete_multipart_upload" not in client.calls
    assert client.calls["upload_part"] == 2  # the parts after the failed one were skipped, not sent
    _assert_previous_intact(s3, "ckpt.pt")


def test_keyboard_interrupt_aborts_and_keeps_the_previous_object(s3, recording_client, monkeypatch):
    fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))
    real = connection.make_client

    def interrupted(concurrency):
        client = real(concurrency)
        client.fail["upload_part"] = (3, KeyboardInterrupt())
        return client

    monkeypatch.setattr(connection, "make_client", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fastpersist.save(_NEXT, s3.url("ckpt.pt"), s3_part_size="5M", s3_concurrency=2)
    assert recording_client[-1].calls["abort_multipart_upload"] == 1
    _assert_previous_intact(s3, "ckpt.pt")


def test_failed_completion_aborts(s3, recording_client, monkeypatch):
    from botocore.exceptions import ClientError

    fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))
    real = connection.make_client
    refusal = ClientError({"Error": {"Code": "InternalError", "Message": "injected"}}, "CompleteMultipartUpload")

    def refusing(concurrency):
        client = real(concurrency)
        client.fail["complete_multipart_upload"] = (1, refusal)
        return client

    monkeypatch.setattr(connection, "make_client", refusing)
    with pytest.raises(ObjectStoreError, match="completing the upload .*InternalError") as caught:
        fastpersist.save(_NEXT, s3.url("ckpt.pt"), s3_part_size="5M")
    assert caught.value.code == "InternalError"
    assert recording_client[-1].calls["abort_multipart_upload"] == 1
    _assert_previous_intact(s3, "ckpt.pt")


def test_a_failed_abort_is_reported_with_the_command_that_cleans_up(s3, recording_client, monkeypatch):
    real = connection.make_client

    def failing_twice(concurrency):
        client = real(concurrency)
        client.fail["upload_part"] = (1, _network_error())
        client.fail["abort_multipart_upload"] = (1, _network_error())
        return client

    monkeypatch.setattr(connection, "make_client", failing_twice)
    with pytest.raises(ObjectStoreError) as caught:
        fastpersist.save(_NEXT, s3.url("ckpt.pt"), s3_part_size="5M")
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "AbortMultipartUpload failed as well" in notes and "aws s3api abort-multipart-upload" in notes
    [upload] = s3.uploads_in_progress()  # left behind, as the note says
    assert upload["Key"] == "ckpt.pt" and upload["UploadId"] in notes
    s3.client.abort_multipart_upload(Bucket=s3.bucket, Key="ckpt.pt", UploadId=upload["UploadId"])


def test_an_object_of_one_part_goes_up_in_one_put(s3, recording_client):
    """Below one part, one PutObject (the commit) instead of create + upload part + complete."""
    fastpersist.save(_NEXT, s3.url("ckpt.pt"))
    calls = recording_client[-1].calls
    assert calls.get("put_object") == 1 and "create_multipart_upload" not in calls and "upload_part" not in calls
    assert torch.equal(fastpersist.load(s3.url("ckpt.pt"))["weights"], _NEXT["weights"])


def test_a_failed_single_put_keeps_the_previous_object(s3, recording_client, monkeypatch):
    fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))
    real = connection.make_client

    def failing(concurrency):
        client = real(concurrency)
        client.fail["put_object"] = (1, _network_error())
        return client

    monkeypatch.setattr(connection, "make_client", failing)
    with pytest.raises(ObjectStoreError, match="uploading"):
        fastpersist.save(_NEXT, s3.url("ckpt.pt"))
    _assert_previous_intact(s3, "ckpt.pt")


@pytest.mark.parametrize("part_size", [None, "5M"], ids=["one-put", "multipart"])
def test_failed_before_commit_check_aborts(s3, part_size):
    fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))

    def refuse():
        raise fastpersist.TensorModifiedError("changed", path=s3.url("ckpt.pt"), names=("w",))

    plan = plan_save(_NEXT, "ckpt")
    settings = fastpersist.config.settings()
    if part_size:
        settings = settings.replace(s3_part_size=5 << 20)
    with pytest.raises(fastpersist.TensorModifiedError):
        upload.commit_plan(plan, connection.target(s3.url("ckpt.pt")), settings, None, before_commit=refuse)
    _assert_previous_intact(s3, "ckpt.pt")


def test_async_save_errors_surface_at_result(s3):
    future = fastpersist.async_save(_PREVIOUS, f"s3://{s3.bucket}-missing/ckpt.pt")
    with pytest.raises(BucketNotFoundError):
        future.result()


def test_wrong_credentials(s3, monkeypatch):
    import moto.settings

    fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))
    with pytest.MonkeyPatch.context() as checking:
        checking.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks keys in this block
        with pytest.raises(ObjectStoreCredentialsError, match="AWS_ACCESS_KEY_ID") as caught:
            fastpersist.save(_NEXT, s3.url("ckpt.pt"))
        assert isinstance(caught.value, PermissionError) and caught.value.code == "InvalidAccessKeyId"
        with pytest.raises(ObjectStoreCredentialsError, match="credentials were not accepted"):
            fastpersist.load(s3.url("ckpt.pt"))
    assert fastpersist.load(s3.url("ckpt.pt"))["version"].item() == 1


def test_missing_credentials(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ObjectStoreCredentialsError, match="NoCredentialsError: Unable to locate credentials") as caught:
        fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))
    assert caught.value.code == "NoCredentialsError"


def test_missing_bucket(s3):
    url = f"s3://{s3.bucket}-missing/ckpt.pt"
    with pytest.raises(BucketNotFoundError, match="does not exist.*AWS_ENDPOINT_URL") as caught:
        fastpersist.save(_PREVIOUS, url)
    assert isinstance(caught.value, FileNotFoundError) and caught.value.filename == url
    with pytest.raises(BucketNotFoundError, match="Create it"):
        fastpersist.load(url)


def test_missing_key(s3):
    with pytest.raises(ObjectNotFoundError, match="no object at this key") as caught:
        fastpersist.load(s3.url("absent/ckpt.pt"))
    assert isinstance(caught.value, FileNotFoundError) and caught.value.filename == s3.url("absent/ckpt.pt")


def test_unreachable_endpoint(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(ObjectStoreError, match="EndpointConnectionError.*Check AWS_ENDPOINT_URL"):
        fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))
    with pytest.raises(ObjectStoreError, match="EndpointConnectionError"):
        fastpersist.load(s3.url("ckpt.pt"))


def test_object_replaced_during_a_load_fails_the_load(s3, recording_client, monkeypatch):
    fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"))
    real = connection.make_client

    def replacing(concurrency):
        client = real(concurrency)
        client.before["get_object"] = lambda **_: s3.put("ckpt.pt", b"another object")
        return client

    monkeypatch.setattr(connection, "make_client", replacing)
    with pytest.raises(ObjectStoreError, match="replaced while it was being read"):
        fastpersist.load(s3.url("ckpt.pt"))


def test_a_response_that_breaks_off_is_fetched_again(s3, recording_client, monkeypatch):
    fastpersist.save(_NEXT, s3.url("ckpt.pt"))
    real = connection.make_client

    class BrokenBody:
        """The first 1000 bytes of a response, then the end: a connection that dropped."""

        def __init__(self, body):
            self._body = body

        def iter_chunks(self, size):
            yield next(self._body.iter_chunks(1000))

        def close(self):
            self._body.close()

    def breaking(concurrency):
        client = real(concurrency)
        client.after["get_object"] = lambda count, response: (
            {**response, "Body": BrokenBody(response["Body"])} if count == 1 else response
        )
        return client

    monkeypatch.setattr(connection, "make_client", breaking)
    loaded = fastpersist.load(s3.url("ckpt.pt"), s3_concurrency=1)
    assert torch.equal(loaded["weights"], _NEXT["weights"])
    assert recording_client[-1].calls["get_object"] == 2


def test_damaged_object_fails_verification(s3):
    buffer = io.BytesIO()
    fastpersist.save({"w": torch.zeros(4096)}, buffer)
    data = bytearray(buffer.getvalue())
    payload = data.index(bytes(4096 * 4))  # the tensor's bytes (all zero)
    data[payload + 100] ^= 0xFF
    s3.put("damaged.pt", bytes(data))
    with pytest.raises(ChecksumMismatchError):
        fastpersist.load(s3.url("damaged.pt"))
    assert fastpersist.load(s3.url("damaged.pt"), verify=False)["w"].count_nonzero() == 1


def test_empty_object_is_not_a_checkpoint(s3):
    s3.put("empty.pt", b"")
    with pytest.raises(TruncatedCheckpointError, match="empty"):
        fastpersist.load(s3.url("empty.pt"))


def test_what_object_stores_do_not_support_yet_is_refused(s3):
    fastpersist.save(_PREVIOUS, s3.url("plain.pt"), group=True)  # no process group: the plain save, as for paths
    assert fastpersist.load(s3.url("plain.pt"))["version"].item() == 1
    with pytest.raises(ValueError, match="legacy"):
        fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"), _use_new_zipfile_serialization=False)
    for url in ("s3://", "s3://bucket", "s3://bucket/", "s3://bucket/folder/"):
        with pytest.raises(ValueError, match="s3://bucket/path/to/ckpt.pt"):
            fastpersist.save(_PREVIOUS, url)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fastpersist.save(_PREVIOUS, s3.url("ckpt.pt"), no_such_setting=1)
    assert s3.uploads_in_progress() == []


def test_without_boto3_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 now raises ImportError
    with pytest.raises(ObjectStoreUnavailableError, match=r"pip install fastpersist\[s3\]") as caught:
        fastpersist.save(_PREVIOUS, "s3://bucket/ckpt.pt")
    assert isinstance(caught.value, ImportError)
    with pytest.raises(ImportError, match=r"fastpersist\[s3\]"):
        fastpersist.load("s3://bucket/ckpt.pt")
