"""Collective (data-parallel) saves to ``s3://`` with real gloo ranks against moto's S3 server.

Each test spawns 2 ranks (tests/_workers/_distributed_worker.py, through
tests/distributed/test_distributed.py's ``spawn``) that save to and load
from the test's bucket; the test then looks at the bucket directly: the
manifest object at the key, one part object per writer, no multipart upload
left in progress, no stray part objects after a failure.
"""

from __future__ import annotations

import io
import os
import re
import sys
import zipfile

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from _distributed_worker import make_big, make_state, same
from test_distributed import ok, spawn

import fastpersist
from fastpersist.distributed.manifest import Manifest
from fastpersist.distributed.objectstore import remove_checkpoint
from fastpersist.errors import ObjectNotFoundError, TruncatedCheckpointError
from fastpersist.format import serializer

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

_PREVIOUS = {"version": torch.tensor([1]), "weights": torch.arange(1000)}


def keys(s3) -> list[str]:
    return sorted(item["Key"] for item in s3.client.list_objects_v2(Bucket=s3.bucket).get("Contents", ()))


def manifest_of(s3, key: str) -> Manifest:
    return Manifest.from_bytes(s3.get(key))


def rebuilt(s3, key: str) -> bytes:
    """The ordinary file a manifest object stands for, put together here from the objects (not by fastpersist)."""
    manifest = manifest_of(s3, key)
    folder = key.rpartition("/")[0]
    data = bytearray()
    for part in manifest.parts:
        data += s3.get(f"{folder}/{part.name}" if folder else part.name)
    for offset, patch in manifest.patches:
        data[offset : offset + len(patch)] = patch
    return bytes(data + manifest.trailer)


def expected_state(seed: int = 0, variant: str | None = None, big: bool = False) -> dict:
    state = make_state(seed, 0, variant)
    if big:
        state["big"] = make_big(seed)
    return state


def failed_everywhere(results, step: int) -> list[dict]:
    for rank, per_rank in enumerate(results):
        assert per_rank[step].get("error") == "DistributedCheckpointError", f"rank {rank}: {per_rank[step]}"
    return [per_rank[step] for per_rank in results]


def test_identical_replicas_upload_their_shares_and_load_back(s3, tmp_path, monkeypatch):
    """Two writers, one part object each; the checkpoint is the bytes of a local single-process save."""
    fastpersist.save(_PREVIOUS, s3.url("run/ckpt.pt"))  # a plain object at the key: replaced at the commit
    save = {"op": "save", "url": s3.url("run/ckpt.pt"), "big": True, "s3_part_size": "5M"}
    steps = [
        save,
        {"op": "load", "url": s3.url("run/ckpt.pt"), "big": True},  # group= on a URL: every rank reads the store
        {**save, "layout": "file"},  # refused before any exchange
        {**save, "seed": 1},  # the same key again: the first save's parts are removed after the commit
    ]
    results = spawn(2, tmp_path, steps)
    saved = ok(results, 0)
    assert all(r["bytes"] > 0 for r in saved) and saved[0]["writers"] == 2 and saved[0]["divergent"] == []
    assert all(r["same"] for r in ok(results, 1))
    for per_rank in results:
        assert per_rank[2]["error"] == "ValueError" and "layout='parts'" in per_rank[2]["message"]
    ok(results, 3)

    manifest = manifest_of(s3, "run/ckpt.pt")
    assert manifest.world_size == 2 and len(manifest.parts) == 2
    assert all(patch.startswith(b"PK\x07\x08") for _, patch in manifest.patches)  # data descriptors only
    assert keys(s3) == sorted(["run/ckpt.pt"] + [f"run/{p.name}" for p in manifest.parts])  # no earlier parts
    assert all(p.name.startswith(f"ckpt.pt.{manifest.token}.part-") for p in manifest.parts)
    assert s3.uploads_in_progress() == []
    assert same(fastpersist.load(s3.url("run/ckpt.pt")), expected_state(1, big=True))
    # Byte for byte what one process writes (given the same random serialization id, which torch writes too).
    data = rebuilt(s3, "run/ckpt.pt")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        identity = archive.read("ckpt/.data/serialization_id")
    monkeypatch.setattr(serializer, "_serialization_id", lambda: identity)
    fastpersist.save(expected_state(1, big=True), tmp_path / "ckpt.pt")
    assert data == (tmp_path / "ckpt.pt").read_bytes()
    # A damaged, shortened or missing part object fails the load, saying so.
    part = f"run/{manifest.parts[1].name}"
    good = s3.get(part)
    s3.put(part, good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 0xFF]) + good[len(good) // 2 + 1 :])
    with pytest.raises(fastpersist.ChecksumMismatchError):
        fastpersist.load(s3.url("run/ckpt.pt"))
    s3.put(part, good[:-1])
    index = manifest.parts[1].index  # the part's first alignment unit
    with pytest.raises(TruncatedCheckpointError, match=f"part {index} has"):
        fastpersist.load(s3.url("run/ckpt.pt"))
    s3.client.delete_object(Bucket=s3.bucket, Key=part)
    with pytest.raises(ObjectNotFoundError, match=f"part {index} of the sharded checkpoint .* is missing"):
        fastpersist.load(s3.url("run/ckpt.pt"))
    # Removing the checkpoint (as Lightning's remove_checkpoint does) removes its part objects too.
    remove_checkpoint(s3.url("run/ckpt.pt"))
    assert keys(s3) == []


def test_divergent_replicas_warn_or_refuse(s3, tmp_path):
    """A drifted weight: "warn" commits rank 0's values (patches in the manifest), "error" commits nothing."""
    url = s3.url("ckpt.pt")
    steps = [
        {"op": "save", "url": url, "variant": "drift"},
        {"op": "save", "url": url, "variant": "drift", "divergence": "error", "seed": 1},
    ]
    results = spawn(2, tmp_path, steps)
    warned = ok(results, 0)
    assert len(warned[0]["warnings"]) == 1 and "rank 1" in warned[0]["warnings"][0]
    assert "weights[2]" in warned[0]["warnings"][0] and warned[1]["warnings"] == []
    assert same(fastpersist.load(url), make_state(0, 0, "drift"))  # rank 0's values, never rank 1's
    committed = keys(s3)
    refused = failed_everywhere(results, 1)
    for outcome in refused:
        assert "weights[2]" in outcome["message"] and "Nothing was committed" in outcome["message"]
        assert list(outcome["failures"]) == ["1"]
    # The refused save's parts were deleted by rank 0; the committed checkpoint is untouched.
    assert keys(s3) == committed and s3.uploads_in_progress() == []
    assert same(fastpersist.load(url), make_state(0, 0, "drift"))


def test_a_rank_failing_mid_upload_fails_every_rank_and_leaves_nothing(s3, tmp_path):
    """Rank 1's second UploadPart breaks: both ranks raise naming it; the previous object is all there is."""
    url = s3.url("ckpt.pt")
    fastpersist.save(_PREVIOUS, url)
    save = {"op": "save", "url": url, "big": True, "s3_part_size": "5M"}
    results = spawn(2, tmp_path, [{**save, "s3_faults": {"1": {"upload_part": 2}}}])
    for outcome in failed_everywhere(results, 0):
        assert list(outcome["failures"]) == ["1"], outcome
        assert "rank 1" in outcome["message"] and "uploading part 2" in outcome["message"]
    # Rank 1's multipart upload was aborted, rank 0's finished part object deleted.
    assert keys(s3) == ["ckpt.pt"] and s3.uploads_in_progress() == []
    assert same(fastpersist.load(url), _PREVIOUS)

    steps = [
        # Again, and rank 0 cannot delete its part object: its error says what is left.
        {**save, "s3_faults": {"1": {"upload_part": 2}, "0": {"delete_objects": 1}}},
        save,  # the next committed save to the key removes it
    ]
    results = spawn(2, tmp_path, steps)
    rank0, rank1 = failed_everywhere(results, 0)
    assert "could not all be removed" in rank0["traceback"] and "rank 1" in rank0["message"]
    left = re.findall(rf"s3://{s3.bucket}/(ckpt\.pt\.[0-9a-f]+\.part-0-of-\d+)", rank0["traceback"])
    assert left and "could not all be removed" not in rank1["traceback"]
    ok(results, 1)
    manifest = manifest_of(s3, "ckpt.pt")
    assert keys(s3) == sorted(["ckpt.pt"] + [p.name for p in manifest.parts]) and left[0] not in keys(s3)
    assert s3.uploads_in_progress() == []
    assert same(fastpersist.load(url), expected_state(big=True))


def test_a_missing_bucket_fails_every_rank_clearly(s3, tmp_path):
    url = f"s3://{s3.bucket}-missing/ckpt.pt"
    results = spawn(2, tmp_path, [{"op": "save", "url": url}, {"op": "load", "url": url}])
    for outcome in failed_everywhere(results, 0):
        assert sorted(outcome["failures"]) == ["0", "1"]
        assert all("BucketNotFoundError" in text and "does not exist" in text for text in outcome["failures"].values())
    for per_rank in results:
        assert per_rank[1]["error"] == "BucketNotFoundError" and "does not exist" in per_rank[1]["message"]


@pytest.mark.multigpu
def test_nccl_ranks_upload_their_gpu_shares(s3, tmp_path):
    """One rank per GPU over NCCL: each rank's state on its own device, each writer uploading its share."""
    world = min(torch.cuda.device_count(), 4)
    save = {"op": "save", "url": s3.url("gpu/ckpt.pt"), "big": True, "s3_part_size": "5M", "device": "cuda"}
    steps = [save, {"op": "load", "url": s3.url("gpu/ckpt.pt"), "big": True}]
    results = spawn(world, tmp_path, steps, backend="nccl")
    saved = ok(results, 0)
    assert saved[0]["writers"] == world and saved[0]["divergent"] == []
    assert all(r["same"] for r in ok(results, 1))
    manifest = manifest_of(s3, "gpu/ckpt.pt")
    assert manifest.world_size == world and len(manifest.parts) == world
    assert s3.uploads_in_progress() == []
    assert same(fastpersist.load(s3.url("gpu/ckpt.pt"), map_location="cpu"), expected_state(big=True))


@pytest.mark.parametrize("mode", ["snapshot", "pipelined"])
def test_asynchronous_collective_saves_upload_in_the_background(s3, tmp_path, mode):
    """async_save(url, group=...): each rank uploads its share on the save thread; a drifted weight is rank 0's
    (its bytes in rank 0's parts, not in manifest patches); a failed upload on one rank fails both futures and
    leaves no part object or upload behind."""
    url = s3.url("async/ckpt.pt")
    steps = [
        {"op": "save", "url": url, "big": True, "s3_part_size": "5M", "async": mode},
        {"op": "save", "url": url, "variant": "drift", "seed": 1, "async": mode},
        {
            "op": "save",
            "url": url,
            "seed": 2,
            "async": mode,
            "s3_faults": {"1": {"upload_part": 1}},
            "big": True,
            "s3_part_size": "5M",
        },
    ]
    results = spawn(2, tmp_path, steps)
    saved = ok(results, 0)
    assert all(r["bytes"] > 0 for r in saved) and saved[0]["writers"] == 2
    drifted = ok(results, 1)
    assert "weights[2]" in drifted[0]["warnings"][0]
    manifest = manifest_of(s3, "async/ckpt.pt")
    assert all(patch.startswith(b"PK\x07\x08") for _, patch in manifest.patches)  # data descriptors only
    committed = keys(s3)
    failed_everywhere(results, 2)
    assert keys(s3) == committed and s3.uploads_in_progress() == []
    assert same(fastpersist.load(url), make_state(1, 0, "drift"))
