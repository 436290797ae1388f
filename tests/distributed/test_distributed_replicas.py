"""A collective save writes rank 0's object: ranks that are not quite replicas, devices, unmatched calls.

Gloo ranks with CPU tensors, made to look like real data-parallel ranks:
each rank's storages pickled as ``cuda:<rank>`` (a location tagger, as one
GPU per rank gives), per-rank tensors (a sampler permutation, an RNG-like
tensor), per-rank Python values, the same values held differently, a
drifted replica. The file must be exactly what ``torch.save`` on rank 0
would write, never a mix. The same cases run with NCCL and one GPU per rank
in ``test_nccl_*`` (multigpu).
"""

from __future__ import annotations

import glob
import os
import time
import zipfile

import pytest
import torch
from _distributed_worker import make_state, same
from test_distributed import ok, spawn, temporaries

import fastpersist

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def pickled(path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def load_cpu(path):
    return torch.load(path, map_location="cpu")


@pytest.mark.parametrize("layout", ["file", "parts"])
def test_device_tags_and_per_rank_state_are_rank_zeros(layout, tmp_path):
    """Pickles differ in device tags and per-rank values: the file is rank 0's object, bytes shared where equal."""
    steps = [{"op": "save", "layout": layout, "variant": "per_rank"}, {"op": "load", "variant": "per_rank"}]
    results = spawn(2, tmp_path, steps, tag_cuda=True)
    saved = ok(results, 0)
    expected = make_state(0, 0, "per_rank")
    loaded = fastpersist.load(tmp_path / "ckpt.pt", map_location="cpu")
    assert same(loaded, expected)  # rank 0's sampler, rng, position, layout; never rank 1's
    assert loaded["position"] == 100 and torch.equal(loaded["sampler"], expected["sampler"])
    assert not torch.equal(loaded["sampler"], make_state(0, 1, "per_rank")["sampler"])
    assert not loaded["flagged"].requires_grad  # rank 0's flag
    if layout == "file":
        assert same(load_cpu(tmp_path / "ckpt.pt"), expected)
        data = pickled(tmp_path / "ckpt.pt")
        assert b"cuda:0" in data and b"cuda:1" not in data  # rank 0's device tags
    assert fastpersist.verify(tmp_path / "ckpt.pt").checksummed
    # Both ranks wrote: rank 1 shares everything but its per-rank tensors and the differently held ones.
    assert saved[1]["bytes"] > 0 and 0 < saved[1]["shared"] < saved[0]["shared"]
    assert sorted(saved[0]["divergent"]) == sorted(saved[1]["divergent"]) and len(saved[0]["divergent"]) == 2
    assert len(saved[0]["warnings"]) == 1 and "sampler" in saved[0]["warnings"][0] and "rng" in saved[0]["warnings"][0]
    assert "colmajor" not in saved[0]["warnings"][0]  # another memory layout of the same values: not divergence
    assert saved[0]["warned_at"] == ["_distributed_worker.py"]  # the caller's line, not fastpersist's
    assert saved[1]["warnings"] == []  # warned once, on rank 0
    assert all(r["same"] for r in ok(results, 1))  # the collective load gives rank 0's object on every rank
    assert temporaries(tmp_path) == []


def test_drifted_replica_policies(tmp_path):
    """A drifted weight: warn (default) writes rank 0's; 'error' refuses, naming it; 'ignore' is silent."""
    steps = [
        {"op": "save", "variant": "drift", "name": "warn.pt"},
        {"op": "save", "variant": "drift", "name": "error.pt", "divergence": "error"},
        {"op": "save", "variant": "drift", "name": "ignore.pt", "divergence": "ignore"},
    ]
    results = spawn(2, tmp_path, steps, tag_cuda=True)
    warned = ok(results, 0)
    assert "weights[2]" in warned[0]["warnings"][0] and "rank 1" in warned[0]["warnings"][0]
    assert same(load_cpu(tmp_path / "warn.pt"), make_state(0, 0, "drift"))
    for rank in range(2):
        outcome = results[rank][1]
        assert outcome.get("error") == "DistributedCheckpointError", outcome
        assert "weights[2]" in outcome["message"] and "Nothing was committed" in outcome["message"]
        assert list(outcome["failures"]) == ["1"]
    assert not os.path.exists(tmp_path / "error.pt")
    ignored = ok(results, 2)
    assert ignored[0]["warnings"] == [] and same(load_cpu(tmp_path / "ignore.pt"), make_state(0, 0, "drift"))
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("layout", ["file", "parts"])
def test_layout_only_differences_and_per_rank_state_are_not_divergence(layout, tmp_path):
    """A column-major replica is not divergence, even with divergence='error'; per_rank= key paths are expected to
    differ: no warning, no refusal; the file is rank 0's object either way."""
    steps = [
        {"op": "save", "layout": layout, "variant": "per_rank", "divergence": "error", "per_rank": ["sampler", "rng"]},
        {"op": "save", "layout": layout, "variant": "per_rank", "per_rank": ["sampler"], "name": "warned.pt"},
    ]
    results = spawn(2, tmp_path, steps, tag_cuda=True)
    saved = ok(results, 0)
    assert saved[0]["warnings"] == [] and saved[1]["warnings"] == []
    assert sorted(saved[0]["divergent"]) == sorted(saved[1]["divergent"]) and len(saved[0]["divergent"]) == 2
    expected = make_state(0, 0, "per_rank")
    assert same(fastpersist.load(tmp_path / "ckpt.pt", map_location="cpu"), expected)
    assert fastpersist.load(tmp_path / "ckpt.pt", map_location="cpu")["colmajor"].is_contiguous()  # rank 0's layout
    warned = ok(results, 1)
    assert len(warned[0]["warnings"]) == 1 and "rng" in warned[0]["warnings"][0]
    assert "sampler" not in warned[0]["warnings"][0] and "colmajor" not in warned[0]["warnings"][0]
    assert same(fastpersist.load(tmp_path / "warned.pt", map_location="cpu"), expected)
    assert temporaries(tmp_path) == []


def test_wholly_different_rank_gives_rank_zeros_file(tmp_path):
    """A rank whose values all differ from rank 0's: rank 0 rewrites what it wrote; the file is rank 0's object."""
    results = spawn(2, tmp_path, [{"op": "save", "seed": "rank", "divergence": "ignore"}])
    saved = ok(results, 0)
    assert saved[1]["shared"] == 12345 * 8  # only "ints" (seed-independent) is the same on both ranks
    assert saved[0]["repaired"] > 0 and saved[0]["bytes"] > saved[1]["bytes"]
    assert same(load_cpu(tmp_path / "ckpt.pt"), make_state(0))
    assert same(load_cpu(tmp_path / "ckpt.pt"), make_state(0))


def test_writers_node_with_per_rank_state(tmp_path):
    results = spawn(2, tmp_path, [{"op": "save", "variant": "per_rank", "writers": "node"}], tag_cuda=True)
    saved = ok(results, 0)
    assert saved[1]["bytes"] == 0  # one machine: rank 0 is the only writer, nothing to compare
    assert same(load_cpu(tmp_path / "ckpt.pt"), make_state(0, 0, "per_rank"))


def test_mismatched_calls_fail_at_once_on_every_rank_then_saves_work(tmp_path):
    """Per-rank paths, layouts or writers, and a save on one rank only: every rank that made the mismatched
    call raises within seconds with the default 600 s timeout, naming both calls; the next matched save works."""
    steps = [
        {"op": "save", "name": "r{rank}.pt", "timeout": None},  # per-rank paths
        {"op": "save", "name": "layout.pt", "layout": ["file", "parts"], "timeout": None},
        {"op": "save", "name": "writers.pt", "writers": ["all", "node"], "timeout": None},
        {"op": "save", "name": "good.pt"},
        {"op": "save", "only": 0, "name": "stray.pt", "timeout": None},  # inside `if rank == 0:`
        {"op": "save", "only": 1, "name": "other.pt", "timeout": None},  # ... and rank 1's next save
        {"op": "save", "name": "again.pt", "seed": 1},
        {"op": "load", "name": "again.pt", "seed": 1},
    ]
    results = spawn(2, tmp_path, steps, deadline=90)
    for step, (mine, theirs) in {0: ("r1.pt", "r0.pt"), 1: ("parts", "file"), 2: ("node", "all")}.items():
        for rank in range(2):
            outcome = results[rank][step]
            assert outcome.get("error") == "DistributedCheckpointError", outcome
            assert outcome["seconds"] < 5, outcome  # not after the 600 s timeout
            assert mine in outcome["message"] and theirs in outcome["message"], outcome
            assert "same path, layout and writers" in outcome["message"]
            assert "save save" not in outcome["message"]
    ok(results, 3)
    assert same(load_cpu(tmp_path / "good.pt"), make_state(0))
    stray, other = results[0][4], results[1][5]
    for outcome in (stray, other):
        assert outcome.get("error") == "DistributedCheckpointError" and outcome["seconds"] < 5, outcome
        assert "stray.pt" in outcome["message"] and "other.pt" in outcome["message"], outcome
    assert results[1][4]["ok"] == {"skipped": True} and results[0][5]["ok"] == {"skipped": True}
    ok(results, 6)
    assert all(r["same"] for r in ok(results, 7))
    assert same(load_cpu(tmp_path / "again.pt"), make_state(1))
    for name in ("r0.pt", "r1.pt", "layout.pt", "writers.pt", "stray.pt", "other.pt"):
        assert not os.path.exists(tmp_path / name)
    assert temporaries(tmp_path) == [] and glob.glob(str(tmp_path / "*.part-*")) == []


def test_a_call_on_one_rank_alone_fails_after_its_timeout(tmp_path):
    """Rank 0 saves alone and nobody else calls: it raises after its timeout, saying which ranks did not report."""
    results = spawn(2, tmp_path, [{"op": "save", "only": 0, "timeout": 3, "name": "stray.pt"}], deadline=60)
    stray = results[0][0]
    assert stray.get("error") == "DistributedCheckpointError" and "did not report" in stray["message"], stray
    assert not os.path.exists(tmp_path / "stray.pt") and temporaries(tmp_path) == []


def test_interrupted_rank_releases_the_others_at_once(tmp_path):
    """Ctrl-C on one rank: the others raise within seconds (not after their timeout); nothing committed."""
    steps = [{"op": "save", "seed": 1}, {"op": "save", "seed": 2, "bad": 1, "fault": "interrupt", "timeout": 60}]
    began = time.monotonic()
    results = spawn(2, tmp_path, steps, deadline=90)
    assert time.monotonic() - began < 45
    assert results[1][1]["error"] == "KeyboardInterrupt"
    outcome = results[0][1]
    assert outcome.get("error") == "DistributedCheckpointError" and "interrupted" in outcome["message"], outcome
    assert same(load_cpu(tmp_path / "ckpt.pt"), make_state(1)) and temporaries(tmp_path) == []


def test_lightning_default_map_location_reads_a_cuda1_checkpoint(tmp_path):
    """Lightning's CheckpointIO loads to the CPU by default; ours must too (a rank-1 file names cuda:1)."""
    pytest.importorskip("lightning")
    from _distributed_worker import tag_as_cuda

    from fastpersist.integrations.lightning import FastPersistCheckpointIO

    registry = list(torch.serialization._package_registry)
    try:
        tag_as_cuda(1)
        fastpersist.save({"w": torch.arange(6.0), "score": torch.tensor(0.5)}, tmp_path / "rank1.ckpt")
    finally:
        torch.serialization._package_registry[:] = registry
    assert b"cuda:1" in pickled(tmp_path / "rank1.ckpt")
    loaded = FastPersistCheckpointIO().load_checkpoint(tmp_path / "rank1.ckpt")
    assert loaded["w"].device.type == "cpu" and torch.equal(loaded["w"], torch.arange(6.0))


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["file", "parts"])
def test_nccl_one_gpu_per_rank(layout, tmp_path):
    """NCCL, each rank's state on its own GPU: rank 0's object (device tags cuda:0), per-rank tensors, drift,
    one writer per node, the collective load onto each rank's own device, per-rank paths then good saves."""
    steps = [
        {"op": "save", "layout": layout, "variant": "per_rank", "device": "cuda"},
        {"op": "load", "variant": "per_rank", "map_location": "own"},
        {
            "op": "save",
            "layout": layout,
            "variant": "drift",
            "device": "cuda",
            "name": "drift.pt",
            "divergence": "error",
        },
        {"op": "save", "layout": layout, "device": "cuda", "writers": "node", "name": "node.pt"},
        {"op": "save", "layout": layout, "device": "cuda", "name": "r{rank}.pt", "timeout": None},
        {"op": "save", "layout": layout, "device": "cuda", "seed": 1, "name": "after.pt"},
        {"op": "load", "seed": 1, "name": "after.pt", "map_location": "own"},
    ]
    results = spawn(2, tmp_path, steps, backend="nccl", deadline=240)
    saved = ok(results, 0)
    assert saved[1]["bytes"] > 0 and saved[1]["shared"] > 0  # rank 1 wrote its identical storages
    assert same(fastpersist.load(tmp_path / "ckpt.pt", map_location="cpu"), make_state(0, 0, "per_rank"))
    if layout == "file":
        data = pickled(tmp_path / "ckpt.pt")
        assert b"cuda:0" in data and b"cuda:1" not in data
        assert same(load_cpu(tmp_path / "ckpt.pt"), make_state(0, 0, "per_rank"))
    loads = ok(results, 1)
    assert all(r["same"] for r in loads) and [r["devices"] for r in loads] == [["cuda:0"], ["cuda:1"]]
    for rank in range(2):
        assert (
            results[rank][2].get("error") == "DistributedCheckpointError"
            and "weights[2]" in results[rank][2]["message"]
        )
    assert ok(results, 3)[1]["bytes"] == 0  # one machine: rank 0 writes it all
    for rank in range(2):  # per-rank paths: both ranks refuse at once
        outcome = results[rank][4]
        assert outcome.get("error") == "DistributedCheckpointError" and outcome["seconds"] < 5, outcome
    ok(results, 5)
    assert all(r["same"] for r in ok(results, 6))
    assert temporaries(tmp_path) == []


def test_rank_zeros_bytes_for_a_repair_are_copies():
    """The bytes rank 0 writes over another rank's are its own, copied to the host piece by piece.

    (On a GPU each piece comes from a temporary host tensor: a view that did not keep it alive wrote
    freed memory into the file with a matching CRC-32, seen on the two-GPU machine.)
    """
    from fastpersist.distributed.save import _storage_bytes
    from fastpersist.format.serializer import plan_save

    tensor = torch.arange(10_000, dtype=torch.int32)
    plan = plan_save({"t": tensor}, "x")
    record = plan.storages[0]
    start = record.entry.data_offset
    pieces = list(_storage_bytes(record, start + 4, start + 40_000 - 8, chunk=4096))
    assert all(isinstance(data, bytes) for _, data in pieces)
    assert [offset for offset, _ in pieces] == list(range(start + 4, start + 40_000 - 8, 4096))
    assert b"".join(data for _, data in pieces) == bytes(tensor.numpy().tobytes()[4:-8])
