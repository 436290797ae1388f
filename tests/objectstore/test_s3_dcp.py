"""torch.distributed.checkpoint to and from s3://bucket/prefix through FastPersistWriter / FastPersistReader,
against moto's S3 server: the objects are the local writer's files, .metadata is the commit, failures leave
no .metadata and no upload in progress.

Single-process tests use ``no_dist=True``; one 2-rank gloo world (tests/_workers/_dcp_s3_worker.py) saves,
loads, async-saves and fails a save on rank 1.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dcp"))
from test_dcp import _assert_equal, _blank, _describe, _load, _save

from fastpersist import config
from fastpersist.dcp import FastPersistReader, FastPersistWriter
from fastpersist.dcp import objectstore as dcp_objectstore
from fastpersist.errors import BucketNotFoundError, ObjectNotFoundError, ObjectStoreError
from fastpersist.io.targets.s3 import connection, upload

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_workers", "_dcp_s3_worker.py")
_MiB = 1 << 20
_PARTS = {"s3_part_size": "5M", "s3_concurrency": 2}


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "weight": torch.randn(257, 33),
        "half": torch.randn(64, 64).to(torch.bfloat16),
        "ints": torch.arange(4097, dtype=torch.int64),
        "transposed": torch.randn(17, 9).t(),
        "view": torch.randn(1000)[3:500],
        "empty": torch.empty(0, 4),
        "flag": torch.tensor(True),
        "big": torch.randn(3 * _MiB),  # 12 MiB: three parts of 5 MiB
        "step": 123,
        "nested": {"list": [1, "two", 3.0], "t": torch.ones(3)},
    }


def _small_state() -> dict:
    return {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 3), "step": 1}


def _keys(s3, prefix: str) -> list[str]:
    listing = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix + "/")
    return sorted(entry["Key"][len(prefix) + 1 :] for entry in listing.get("Contents", []))


def _download(s3, prefix: str, directory) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in _keys(s3, prefix):
        (directory / name).write_bytes(s3.get(f"{prefix}/{name}"))


def _upload(s3, directory, prefix: str) -> None:
    for path in sorted(directory.iterdir()):
        s3.put(f"{prefix}/{path.name}", path.read_bytes())


@pytest.mark.parametrize("files_per_rank", [1, 3])
def test_round_trip(s3, files_per_rank):
    state = _state()
    _save(state, s3.url("run/step-1"), files_per_rank=files_per_rank, **_PARTS)
    names = [f"__0_{i}.distcp" for i in range(files_per_rank)]
    assert _keys(s3, "run/step-1") == sorted([".metadata", *names])
    _load(s3.url("run/step-1"), state, **_PARTS)
    assert s3.uploads_in_progress() == []


def test_objects_are_the_local_writers_files_and_filesystem_reader_loads_them(s3, tmp_path, monkeypatch):
    """Same state, same process: each object has the bytes of the local writer's file; a downloaded copy of
    the prefix is a directory FileSystemReader (and ours) loads.

    Placement follows the tensors' addresses, so the state holds no non-contiguous tensor (each save would
    place a fresh contiguous copy), and each archive's random serialization id is fixed."""
    from fastpersist.format import serializer

    monkeypatch.setattr(serializer, "_serialization_id", lambda: b"1234567890" * 4)
    state = _state()
    state["transposed"] = state["transposed"].contiguous()
    _save(state, tmp_path / "local")
    _save(state, s3.url("run/step-1"), **_PARTS)
    local_names = sorted(os.listdir(tmp_path / "local"))
    assert _keys(s3, "run/step-1") == local_names
    for name in local_names:
        if name.endswith(".distcp"):
            assert s3.get(f"run/step-1/{name}") == (tmp_path / "local" / name).read_bytes(), name
    ours = pickle.loads(s3.get("run/step-1/.metadata"))
    with open(tmp_path / "local" / ".metadata", "rb") as f:
        theirs = pickle.load(f)
    assert ours.storage_data.keys() == theirs.storage_data.keys()
    for index, info in ours.storage_data.items():
        other = theirs.storage_data[index]
        assert (info.relative_path, info.offset, info.length) == (other.relative_path, other.offset, other.length)
        assert info.fastpersist == other.fastpersist
    assert ours.storage_meta.checkpoint_id == s3.url("run/step-1")
    _download(s3, "run/step-1", tmp_path / "downloaded")
    _load(tmp_path / "downloaded", state, FileSystemReader)
    _load(tmp_path / "downloaded", state)


@pytest.mark.parametrize("thread_count", [1, 2])
def test_reads_filesystem_writer_checkpoints_uploaded_under_a_prefix(s3, tmp_path, thread_count):
    state = _state()
    _save(state, tmp_path / "theirs", FileSystemWriter, thread_count=thread_count)
    _upload(s3, tmp_path / "theirs", "theirs")
    _load(s3.url("theirs"), state, **_PARTS)


def test_loads_into_other_dtypes_and_layouts(s3):
    """Destinations that cannot take the bytes in place get a fetched, verified copy."""
    state = {"a": torch.randn(8, 16), "b": torch.randn(300, 5)}
    _save(state, s3.url("ckpt"))
    out = {"a": torch.zeros(16, 8).t(), "b": torch.zeros(300, 5, dtype=torch.float64)}
    dcp.load(out, storage_reader=FastPersistReader(s3.url("ckpt")), no_dist=True)
    assert torch.equal(out["a"], state["a"])
    assert torch.equal(out["b"], state["b"].double())


def test_adjacent_items_share_a_get(s3, recording_client):
    """Fifty small tensors of one object: one ranged GET for all of them (and one for .metadata)."""
    state = {f"t{i}": torch.full((100,), float(i)) for i in range(50)}
    _save(state, s3.url("many"))
    recording_client.clear()
    _load(s3.url("many"), state)
    gets = sum(client.calls.get("get_object", 0) for client in recording_client)
    assert gets == 2


def test_checkpoint_id_and_validate_checkpoint_id(s3, tmp_path):
    assert FastPersistWriter.validate_checkpoint_id(s3.url("ckpt"))
    assert FastPersistReader.validate_checkpoint_id(s3.url("ckpt"))
    assert not FastPersistWriter.validate_checkpoint_id("gs://bucket/ckpt")
    state = _small_state()
    writer = FastPersistWriter(str(tmp_path / "unused"))
    reader = FastPersistReader(str(tmp_path / "unused"))
    for step in range(2):
        dcp.save(state, checkpoint_id=s3.url(f"run/step-{step}"), storage_writer=writer, no_dist=True)
        assert writer.checkpoint_id == s3.url(f"run/step-{step}")
        out = _blank(state)
        dcp.load(out, checkpoint_id=s3.url(f"run/step-{step}"), storage_reader=reader, no_dist=True)
        _assert_equal(out, state)
    assert not (tmp_path / "unused").exists()
    with pytest.raises(ValueError, match="pass the URL as a string"):
        FastPersistWriter(__import__("pathlib").Path(s3.url("ckpt")))


def test_async_save(s3):
    state = _state()
    response = dcp.async_save(state, storage_writer=FastPersistWriter(s3.url("async"), **_PARTS), no_dist=True)
    getattr(response, "upload_completion", response).result()
    _load(s3.url("async"), state)


def test_stale_metadata_is_deleted_before_any_upload(s3, monkeypatch):
    _save(_small_state(), s3.url("ckpt"))
    real = upload.commit_plan
    seen_metadata = []

    def watching(plan, destination, *args, **kwargs):
        seen_metadata.append(".metadata" in _keys(s3, "ckpt"))
        return real(plan, destination, *args, **kwargs)

    monkeypatch.setattr(upload, "commit_plan", watching)
    new = {"a": torch.arange(10, dtype=torch.float32) + 1, "b": torch.zeros(3, 3), "step": 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _save(new, s3.url("ckpt"))
    assert seen_metadata == [False]
    assert any("existing checkpoint" in str(w.message) for w in caught)
    _load(s3.url("ckpt"), new)


def test_overwrite_false_refuses_and_keeps_the_checkpoint(s3):
    state = _small_state()
    _save(state, s3.url("ckpt"))
    with pytest.raises(BaseException) as caught:
        _save(_small_state(), s3.url("ckpt"), overwrite=False)
    assert "FileExistsError" in _describe(caught.value) and "overwrite=False" in _describe(caught.value)
    _load(s3.url("ckpt"), state)


def _failing_uploads(monkeypatch, method: str, nth: int, error: BaseException) -> None:
    real = connection.make_client

    def failing(concurrency):
        client = real(concurrency)
        client.fail[method] = (nth, error)
        return client

    monkeypatch.setattr(connection, "make_client", failing)


def _network_error():
    from botocore.exceptions import ConnectionClosedError

    return ConnectionClosedError(endpoint_url="http://127.0.0.1:1/injected")


def test_a_fault_mid_upload_leaves_no_metadata_and_no_upload(s3, recording_client, monkeypatch):
    state = _state()
    _save(state, s3.url("ckpt"), **_PARTS)
    _failing_uploads(monkeypatch, "upload_part", 2, _network_error())
    with pytest.raises(BaseException) as caught:
        _save(state, s3.url("ckpt"), **_PARTS)
    described = _describe(caught.value)
    assert "CheckpointException" in described and "ObjectStoreError" in described, described
    assert "uploading part 2 of s3://" in described and "ckpt/__0_0.distcp" in described, described
    assert ".metadata" not in _keys(s3, "ckpt")
    assert s3.uploads_in_progress() == []
    assert recording_client[-1].calls["abort_multipart_upload"] == 1
    with pytest.raises(BaseException) as caught:
        _load(s3.url("ckpt"), state)
    assert "holds no committed checkpoint" in _describe(caught.value)


def test_a_failed_commit_leaves_no_metadata(s3, recording_client, monkeypatch):
    """Every file is up, the PutObject of .metadata fails: still no checkpoint, and the error says why."""
    state = _small_state()
    _save(state, s3.url("ckpt"))
    real = connection.make_client

    def refuse_metadata(**arguments):
        if arguments["Key"].endswith(".metadata"):
            raise _network_error()

    def failing(concurrency):
        client = real(concurrency)
        client.before["put_object"] = refuse_metadata  # (the data file, of one part, is a PutObject too)
        return client

    monkeypatch.setattr(connection, "make_client", failing)
    with pytest.raises(BaseException) as caught:
        _save(state, s3.url("ckpt"))
    assert "uploading s3://" in _describe(caught.value) and "ckpt/.metadata" in _describe(caught.value)
    assert _keys(s3, "ckpt") == ["__0_0.distcp"]


def test_commit_checks_every_rank_object(s3):
    prefix = dcp_objectstore.prefix_of(s3.url("ckpt"))
    s3.put("ckpt/__0_0.distcp", b"x" * 10)
    client = connection.make_client(2)
    settings = config.settings()
    dcp_objectstore.check_committed(prefix, {"__0_0.distcp": 10}, settings, client=client)
    with pytest.raises(ObjectStoreError, match="holds 10 bytes where its rank uploaded 11"):
        dcp_objectstore.check_committed(prefix, {"__0_0.distcp": 11}, settings, client=client)
    with pytest.raises(ObjectNotFoundError):
        dcp_objectstore.check_committed(prefix, {"__0_0.distcp": 10, "__1_0.distcp": 5}, settings, client=client)


def test_corruption_is_detected(s3):
    state = _state()
    _save(state, s3.url("ckpt"))
    metadata = pickle.loads(s3.get("ckpt/.metadata"))
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == "big")
    data = bytearray(s3.get(f"ckpt/{info.relative_path}"))
    data[info.fastpersist["offset"] + 12345] ^= 0x40
    s3.put(f"ckpt/{info.relative_path}", bytes(data))
    with pytest.raises(BaseException) as caught:
        _load(s3.url("ckpt"), state)
    assert "ChecksumMismatchError" in _describe(caught.value) and "'big'" in _describe(caught.value)


def test_missing_bucket_and_missing_prefix(s3):
    state = _small_state()
    missing_bucket = f"s3://{s3.bucket}-missing/ckpt"
    # (DCP 2.13 re-raises a failed read_metadata as an AssertionError carrying the message)
    for action in (lambda: _load(missing_bucket, state), lambda: _save(state, missing_bucket)):
        with pytest.raises(BaseException) as caught:
            action()
        assert f"bucket '{s3.bucket}-missing' does not exist" in _describe(caught.value)
    with pytest.raises(BaseException) as caught:
        _load(s3.url("nothing/here"), state)
    assert "nothing/here holds no committed checkpoint (no .metadata object)" in _describe(caught.value)
    reader = FastPersistReader(s3.url("nothing/here"))
    with pytest.raises(ObjectNotFoundError, match="holds no committed checkpoint") as caught:
        reader.read_metadata()
    assert isinstance(caught.value, FileNotFoundError) and caught.value.filename == s3.url("nothing/here/.metadata")
    with pytest.raises(BucketNotFoundError, match="Create it"):
        FastPersistReader(missing_bucket).read_metadata()


def test_a_missing_data_object(s3):
    state = _small_state()
    _save(state, s3.url("ckpt"))
    s3.client.delete_object(Bucket=s3.bucket, Key="ckpt/__0_0.distcp")
    with pytest.raises(BaseException) as caught:
        _load(s3.url("ckpt"), state)
    assert "ObjectNotFoundError" in _describe(caught.value) and "__0_0.distcp" in _describe(caught.value)


# ----------------------------------------------------------------------------- 2 ranks (gloo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world: int, url: str, root, timeout: int = 300) -> list[dict]:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    repository = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([repository] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    processes = [
        subprocess.Popen(
            [sys.executable, WORKER, url, str(root)],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    reports = []
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank} failed:\n{output}"
        with open(os.path.join(root, f"s3.{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


def test_two_ranks(s3, tmp_path):
    """2 gloo ranks: save, load, async_save to S3; a downloaded copy loads with FileSystemReader; a fault in
    rank 1's upload fails the save on both ranks and leaves no .metadata and no upload in progress."""
    import _dcp_s3_worker as worker  # (tests/_workers is on sys.path: tests/conftest.py)

    reports = _run_world(2, s3.url("run"), tmp_path)
    for key in ("save", "load", "async_save", "failing_ran"):
        for rank, report in enumerate(reports):
            assert report[key] == "ok", f"rank {rank}: {key}: {report[key]}"
    for rank, report in enumerate(reports):
        failure = report["failure"]
        assert failure["raised"] and failure["type"] == "CheckpointException", (rank, failure)
        assert failure["ranks"] == [1], (rank, failure)
        assert "uploading part 2 of " in failure["inner"][0] and "__1_0.distcp" in failure["inner"][0], failure
    assert _keys(s3, "run/step-1") == ["__0_0.distcp", "__1_0.distcp"]  # the failed save's: no .metadata
    assert s3.uploads_in_progress() == []
    assert _keys(s3, "run/async") == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    _download(s3, "run/async", tmp_path / "async")
    full = worker.full_state()
    expected = {**full, "step": 42}
    _load(tmp_path / "async", expected, FileSystemReader)
