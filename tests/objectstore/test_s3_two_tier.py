"""Two-tier saves, async_save(obj, "s3://...", local_copy=path), against moto's S3 server: the local file is a
plain local save, the object its bytes; upload errors surface at result(); the previous object survives any
failure; pending uploads complete at interpreter exit, Ctrl-C included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import fastpersist
from fastpersist.api import futures
from fastpersist.errors import BucketNotFoundError, ObjectStoreError
from fastpersist.io import commit, queue
from fastpersist.io.targets.s3 import connection

_MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_error_left_unchecked(saves_checked):
    """Every test here ends with no async save failed and unchecked (tests/conftest.py)."""


@pytest.fixture
def fixed_serialization_id(monkeypatch):
    from fastpersist.format import serializer

    # torch writes a random serialization id per save: fix it so that two saves can be compared.
    monkeypatch.setattr(serializer, "_serialization_id", lambda: b"1234567890" * 4)


def _state(version: int = 1, size: int = 1000) -> dict:
    generator = torch.Generator().manual_seed(version)
    return {"version": torch.tensor([version]), "w": torch.randn(size, generator=generator), "step": version}


def _network_error():
    from botocore.exceptions import ConnectionClosedError

    return ConnectionClosedError(endpoint_url="http://127.0.0.1:1/injected")


class Gate:
    """Holds the background queue busy until opened, so that uploads stay pending."""

    def __init__(self):
        self.event = threading.Event()
        self.future = queue.run_in_order(self.event.wait, "<gate>")

    def open(self):
        self.event.set()
        self.future.result(timeout=60)


@pytest.mark.parametrize("part_size", [None, "5M"], ids=["one-put", "multipart"])
def test_local_file_is_a_plain_save_and_the_object_its_bytes(
    s3, recording_client, tmp_path, fixed_serialization_id, part_size
):
    state = _state(size=3 * _MiB if part_size else 1000)  # 12 MiB: 3 parts of 5 MiB
    settings = {"s3_part_size": part_size} if part_size else {}
    (tmp_path / "plain").mkdir()
    fastpersist.save(state, tmp_path / "plain" / "ckpt.pt")
    local = tmp_path / "ckpt.pt"
    future = fastpersist.async_save(state, s3.url("run/ckpt.pt"), local_copy=local, **settings)
    assert local.read_bytes() == (tmp_path / "plain" / "ckpt.pt").read_bytes()  # written before the return
    assert future.mode == "upload" and future.local_copy == str(local) and future.path == s3.url("run/ckpt.pt")
    future.result()
    assert future.done() and future.exception() is None
    assert s3.get("run/ckpt.pt") == local.read_bytes()
    assert fastpersist.load(s3.url("run/ckpt.pt"))["version"].item() == 1
    calls = recording_client[0].calls  # the upload's client (the load made the next one)
    if part_size:
        assert calls["upload_part"] == 3 and calls["complete_multipart_upload"] == 1
    else:
        assert calls["put_object"] == 1
    assert s3.uploads_in_progress() == [] and local.exists()  # the local tier is kept


def test_the_url_decides_the_format(s3, tmp_path):
    state = {"model": {"w": torch.randn(5)}, "step": 2}
    future = fastpersist.async_save(state, s3.url("model.safetensors"), local_copy=tmp_path / "model.bin")
    future.result()
    local = (tmp_path / "model.bin").read_bytes()
    assert s3.get("model.safetensors") == local and local[8:9] == b"{"
    fastpersist.save(state, tmp_path / "plain.safetensors")
    assert local == (tmp_path / "plain.safetensors").read_bytes()
    loaded = fastpersist.load(s3.url("model.safetensors"))
    assert loaded["step"] == 2 and torch.equal(loaded["model"]["w"], state["model"]["w"])
    future = fastpersist.async_save(state, s3.url("ckpt.bin"), local_copy=tmp_path / "ckpt.safetensors", format="torch")
    future.result()
    assert s3.get("ckpt.bin")[:4] == b"PK\x03\x04" == (tmp_path / "ckpt.safetensors").read_bytes()[:4]


def test_upload_errors_surface_at_result_and_the_local_file_stays(s3, tmp_path):
    future = fastpersist.async_save(_state(), f"s3://{s3.bucket}-missing/ckpt.pt", local_copy=tmp_path / "ckpt.pt")
    with pytest.raises(BucketNotFoundError, match="does not exist"):
        future.result()
    assert isinstance(future.exception(), BucketNotFoundError)
    assert fastpersist.load(tmp_path / "ckpt.pt")["version"].item() == 1


def test_a_failed_upload_keeps_the_previous_object(s3, recording_client, tmp_path, monkeypatch):
    fastpersist.save(_state(1), s3.url("ckpt.pt"))
    real = connection.make_client

    def failing(concurrency):
        client = real(concurrency)
        client.fail["upload_part"] = (2, _network_error())
        return client

    monkeypatch.setattr(connection, "make_client", failing)
    future = fastpersist.async_save(
        _state(2, size=4 * _MiB), s3.url("ckpt.pt"), local_copy=tmp_path / "ckpt.pt", s3_part_size="5M"
    )
    with pytest.raises(ObjectStoreError, match=r"uploading part \d of") as caught:
        future.result()
    assert caught.value.code == "ConnectionClosedError"
    assert recording_client[-1].calls["abort_multipart_upload"] == 1
    monkeypatch.setattr(connection, "make_client", real)
    assert fastpersist.load(s3.url("ckpt.pt"))["version"].item() == 1
    assert s3.uploads_in_progress() == []
    assert fastpersist.load(tmp_path / "ckpt.pt")["version"].item() == 2  # the fast tier has the new one


def test_a_pending_upload_sends_the_file_of_its_own_save(s3, tmp_path):
    """A later save to the same local path replaces the file (a rename) while the first upload waits."""
    gate = Gate()
    try:
        first = fastpersist.async_save(_state(1), s3.url("a.pt"), local_copy=tmp_path / "ckpt.pt", async_max_pending=3)
        first_bytes = (tmp_path / "ckpt.pt").read_bytes()
        second = fastpersist.async_save(_state(2), s3.url("b.pt"), local_copy=tmp_path / "ckpt.pt", async_max_pending=3)
        assert not first.done() and not second.done()
    finally:
        gate.open()
    first.result()
    second.result()
    assert s3.get("a.pt") == first_bytes
    assert s3.get("b.pt") == (tmp_path / "ckpt.pt").read_bytes() != first_bytes


def test_uploads_in_flight_are_bounded_by_async_max_pending(s3, tmp_path):
    first = fastpersist.async_save(_state(1), s3.url("a.pt"), local_copy=tmp_path / "a.pt")
    second = fastpersist.async_save(_state(2), s3.url("b.pt"), local_copy=tmp_path / "b.pt")
    assert first.done()  # async_max_pending=1: the second save waited for the first upload
    second.result()


def test_the_checkpointer_does_not_wait_for_uploads(s3, tmp_path):
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = fastpersist.Checkpointer(optimizer)
    gate = Gate()
    try:
        future = checkpointer.save(
            model.state_dict(), s3.url("ckpt.pt"), local_copy=tmp_path / "ckpt.pt", async_max_pending=2
        )
        assert future._release is None  # the state is on local disk already: nothing for the step to wait for
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        assert not future.done()
    finally:
        gate.open()
    checkpointer.close()
    assert s3.get("ckpt.pt") == (tmp_path / "ckpt.pt").read_bytes()


def test_refusals_are_clear_and_come_before_any_write(s3, tmp_path):
    state = _state()
    local = tmp_path / "ckpt.pt"
    with pytest.raises(ValueError, match="local_copy= is for saves to an object store"):
        fastpersist.async_save(state, tmp_path / "target.pt", local_copy=local)
    with pytest.raises(ValueError, match="must be a local path"):
        fastpersist.async_save(state, s3.url("ckpt.pt"), local_copy=s3.url("copy.pt"))
    with pytest.raises(TypeError, match="must be a local path"):
        fastpersist.async_save(state, s3.url("ckpt.pt"), local_copy=3)
    with pytest.raises(ValueError, match="atomic"):
        fastpersist.async_save(state, s3.url("ckpt.pt"), local_copy=local, atomic=False)
    with pytest.raises(ValueError, match="regular file"):
        fastpersist.async_save(state, s3.url("ckpt.pt"), local_copy="/dev/null")
    with pytest.raises(ValueError, match="s3://bucket/path"):
        fastpersist.async_save(state, "s3://bucket/", local_copy=local)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fastpersist.async_save(state, s3.url("ckpt.pt"), local_copy=local, no_such_setting=1)
    with pytest.raises(TypeError, match=r"async_save\(obj, url, local_copy=path\)"):
        fastpersist.save(state, s3.url("ckpt.pt"), local_copy=local)
    assert not local.exists() and os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):  # the local save's own errors raise at once; nothing is queued
        fastpersist.async_save(state, s3.url("ckpt.pt"), local_copy=tmp_path / "missing" / "ckpt.pt")
    assert futures.pending_saves() == []
    assert s3.client.list_objects_v2(Bucket=s3.bucket).get("KeyCount") == 0


def test_an_interrupt_during_the_local_write_changes_nothing(s3, tmp_path):
    fastpersist.save(_state(1), s3.url("ckpt.pt"))
    fastpersist.save(_state(1), tmp_path / "ckpt.pt")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(commit, "write_plan", interrupted)  # Ctrl-C while the local file is written
        with pytest.raises(KeyboardInterrupt):
            fastpersist.async_save(_state(2), s3.url("ckpt.pt"), local_copy=tmp_path / "ckpt.pt")
    assert futures.pending_saves() == []
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left
    assert fastpersist.load(tmp_path / "ckpt.pt")["version"].item() == 1
    assert fastpersist.load(s3.url("ckpt.pt"))["version"].item() == 1


def _child_environment(s3) -> dict:
    keep = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k in keep}
    environment["AWS_EC2_METADATA_DISABLED"] = "true"
    environment["PYTHONPATH"] = REPO
    return environment


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time, torch, fastpersist
    from fastpersist.io.targets.s3 import connection
    url, local, go, wait_forever = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    # Ctrl-C raises KeyboardInterrupt even in a process started with SIGINT ignored (a background job of a
    # shell without job control), where Python would not install its handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real = connection.make_client

    def held(concurrency):  # the upload waits until the parent says go: it is surely pending until then
        client = real(concurrency)

        def wait_for_go(**_):
            deadline = time.monotonic() + 60
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.01)

        client.meta.events.register("before-call.s3.PutObject", wait_for_go)
        return client

    connection.make_client = held
    fastpersist.async_save({"w": torch.arange(100_000, dtype=torch.float32)}, url, local_copy=local)
    print("saved", flush=True)
    if wait_forever:
        time.sleep(120)  # training goes on, until Ctrl-C
    """
)


def test_a_pending_upload_completes_at_interpreter_exit(s3, tmp_path):
    (tmp_path / "go").touch()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, s3.url("exit.pt"), str(tmp_path / "exit.pt"), str(tmp_path / "go"), "0"],
        env=_child_environment(s3),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert s3.get("exit.pt") == (tmp_path / "exit.pt").read_bytes()
    failed = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            f"s3://{s3.bucket}-missing/x.pt",
            str(tmp_path / "x.pt"),
            str(tmp_path / "go"),
            "0",
        ],
        env=_child_environment(s3),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode == 1  # as for every async save whose error nobody checked
    assert "never checked" in failed.stderr and "BucketNotFoundError" in failed.stderr
    assert f"local copy {str(tmp_path / 'x.pt')!r} was written" in failed.stderr
    assert (tmp_path / "x.pt").exists()


def test_ctrl_c_while_an_upload_is_pending_still_completes_it(s3, tmp_path):
    go = tmp_path / "go"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, s3.url("interrupted.pt"), str(tmp_path / "ckpt.pt"), str(go), "1"],
        env=_child_environment(s3),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "saved"
        child.send_signal(signal.SIGINT)  # the main thread gets KeyboardInterrupt; the upload is held pending
        go.touch()
        _, stderr = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
    assert "KeyboardInterrupt" in stderr
    # Python ends on an uncaught KeyboardInterrupt by SIGINT, unless code run since cleared CPython's flag
    # for it (any exec() of a string does, on any thread: the upload's boto3 code may): then with status 1.
    assert child.returncode in (-signal.SIGINT, 1), stderr
    assert s3.get("interrupted.pt") == (tmp_path / "ckpt.pt").read_bytes()
    assert s3.uploads_in_progress() == []
