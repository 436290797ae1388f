"""Asynchronous collective saves: ``fastpersist.async_save(obj, path, group=...)`` on every rank (gloo, CPU).

Each rank writes its share of rank 0's checkpoint on the background save
thread; rank 0 commits once every share is durable; every rank's future ends
with that commit or with the same error. The same semantics as the
synchronous collective save (tests in test_distributed.py and
test_distributed_replicas.py): rank 0's object, never a mix; divergence
policies; both layouts; failures leave the previous checkpoint and no
temporary behind. NCCL with one GPU per rank runs in ``test_nccl_*`` (multigpu).
"""

from __future__ import annotations

import glob
import os
import time
import zipfile

import pytest
import torch
from _distributed_worker import make_big, make_state, same
from test_distributed import ok, spawn, temporaries

import fastpersist

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def records(path) -> dict[str, tuple[int, bytes]]:
    """Every record's header offset and bytes but the random serialization id: what two saves of one state share."""
    with zipfile.ZipFile(path) as archive:
        return {
            i.filename: (i.header_offset, archive.read(i))
            for i in archive.infolist()
            if not i.filename.endswith("serialization_id")
        }


def parts(directory, name) -> list[str]:
    return glob.glob(os.path.join(directory, f"{name}.*.part-*"))


@pytest.mark.parametrize("layout", ["file", "parts"])
def test_round_trip_in_both_modes_is_the_synchronous_file(layout, tmp_path):
    """Both modes write what the synchronous collective save writes (byte for byte for one file), every rank its
    share; per-rank state (and a rank holding fewer storages) saved as rank 0's; one writer per node; a
    collective load after them."""
    (tmp_path / "sync").mkdir()  # the synchronous saves of the same names (a file's archive is named after it)
    steps = [
        {"op": "save", "layout": layout, "name": "sync/snapshot.pt", "big": True},
        {"op": "save", "layout": layout, "name": "sync/pipelined.pt", "big": True},
        {"op": "save", "layout": layout, "name": "snapshot.pt", "async": "snapshot", "big": True},
        {"op": "save", "layout": layout, "name": "pipelined.pt", "async": "pipelined", "big": True},
        {"op": "save", "layout": layout, "name": "ranks.pt", "async": "snapshot", "variant": "per_rank"},
        {"op": "save", "layout": layout, "name": "ranks2.pt", "async": "pipelined", "variant": "per_rank"},
        {"op": "save", "layout": layout, "name": "node.pt", "async": "snapshot", "writers": "node"},
        {"op": "load", "name": "ranks2.pt", "variant": "per_rank"},
    ]
    results = spawn(2, tmp_path, steps, tag_cuda=True)
    expected = {**make_state(), "big": make_big(0)}
    for step, name in ((2, "snapshot.pt"), (3, "pipelined.pt")):
        saved = ok(results, step)
        assert saved[1]["bytes"] > 4 << 20 and saved[1]["shared"] > 16 << 20  # rank 1 wrote its share
        assert same(fastpersist.load(tmp_path / name, map_location="cpu"), expected)
        assert fastpersist.verify(tmp_path / name).checksummed
        if layout == "file":
            assert records(tmp_path / name) == records(tmp_path / "sync" / name)
            assert same(torch.load(tmp_path / name, map_location="cpu"), expected)
    for step, name in ((4, "ranks.pt"), (5, "ranks2.pt")):
        saved = ok(results, step)
        assert sorted(saved[0]["divergent"]) == sorted(saved[1]["divergent"]) and len(saved[0]["divergent"]) == 2
        assert len(saved[0]["warnings"]) == 1 and "sampler" in saved[0]["warnings"][0]
        assert "colmajor" not in saved[0]["warnings"][0] and saved[0]["warned_at"] == ["_distributed_worker.py"]
        assert same(fastpersist.load(tmp_path / name, map_location="cpu"), make_state(0, 0, "per_rank"))
    node = ok(results, 6)
    assert node[0]["writers"] == 1 and node[1]["bytes"] == 0
    assert same(fastpersist.load(tmp_path / "node.pt", map_location="cpu"), make_state())
    assert all(r["same"] for r in ok(results, 7))
    assert temporaries(tmp_path) == []


def test_divergence_policies(tmp_path):
    """A drifted weight: 'warn' writes rank 0's values and warns at the caller's line on rank 0; 'error' raises at
    the call on every rank, before anything is captured; 'ignore' is silent."""
    steps = [
        {"op": "save", "variant": "drift", "name": "warn.pt", "async": "pipelined"},
        {"op": "save", "variant": "drift", "name": "error.pt", "divergence": "error", "async": "snapshot"},
        {"op": "save", "variant": "drift", "name": "ignore.pt", "divergence": "ignore", "async": "snapshot"},
    ]
    results = spawn(2, tmp_path, steps)
    warned = ok(results, 0)
    assert "weights[2]" in warned[0]["warnings"][0] and "rank 1" in warned[0]["warnings"][0]
    assert warned[0]["warned_at"] == ["_distributed_worker.py"] and warned[1]["warnings"] == []
    assert same(torch.load(tmp_path / "warn.pt"), make_state(0, 0, "drift"))
    for rank in range(2):
        outcome = results[rank][1]
        assert outcome.get("error") == "DistributedCheckpointError", outcome
        assert "weights[2]" in outcome["message"] and "Nothing was committed" in outcome["message"]
    assert not os.path.exists(tmp_path / "error.pt")
    ignored = ok(results, 2)
    assert ignored[0]["warnings"] == [] and same(torch.load(tmp_path / "ignore.pt"), make_state(0, 0, "drift"))
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("layout", ["file", "parts"])
def test_a_failing_rank_fails_every_future_and_keeps_the_previous_checkpoint(layout, tmp_path):
    """An unpicklable object (at the call), a full disk on one rank (in the background) and a tensor modified
    before a pipelined save read it: every rank raises, naming the rank; the previous checkpoint and nothing
    else stays; the next save works."""
    steps = [
        {"op": "save", "layout": layout, "seed": 1, "async": "snapshot"},  # the previous checkpoint
        {"op": "save", "layout": layout, "seed": 2, "bad": 1, "fault": "exception", "async": "pipelined"},
        {"op": "save", "layout": layout, "seed": 3, "bad": 1, "fault": "enospc", "async": "snapshot"},
        {"op": "save", "layout": layout, "seed": 4, "bad": 1, "fault": "enospc", "async": "pipelined"},
        {"op": "save", "layout": layout, "seed": 5, "bad": 0, "fault": "modify", "async": "pipelined"},
        {"op": "save", "layout": layout, "seed": 6, "bad": 1, "fault": "modify", "async": "pipelined"},
        {"op": "save", "layout": layout, "seed": 7, "async": "pipelined", "name": "next.pt"},
    ]
    results = spawn(2, tmp_path, steps)
    ok(results, 0)
    kinds = {
        1: (1, "cannot serialize the object"),
        2: (1, "No space left on device"),
        3: (1, "No space left on device"),
        4: (0, "TensorModifiedError"),
        5: (1, "TensorModifiedError"),
    }
    for step, (bad, kind) in kinds.items():
        for rank in range(2):
            outcome = results[rank][step]
            assert outcome.get("error") == "DistributedCheckpointError", (step, outcome)
            assert list(outcome["failures"]) == [str(bad)], (step, outcome)  # names the failing rank, everywhere
            assert kind in outcome["message"] or kind in outcome["failures"][str(bad)], (step, outcome)
    assert "weights[0]" in results[0][4]["message"]  # the modified tensor, by its key path
    assert same(fastpersist.load(tmp_path / "ckpt.pt"), make_state(1))  # the previous checkpoint stays
    ok(results, 6)
    assert same(fastpersist.load(tmp_path / "next.pt"), make_state(7))
    assert temporaries(tmp_path) == []
    if layout == "parts":
        assert len(parts(tmp_path, "ckpt.pt")) == 2  # the failed saves' parts were removed


def test_replaced_parts_are_removed_off_the_save_thread(tmp_path):
    """Saves of one path with layout="parts": each commit lists the earlier saves' parts and a cleanup thread
    unlinks them (the next save does not wait for it); once the ranks have exited only the last save's parts are
    left, and it loads."""
    steps = [
        {"op": "save", "layout": "parts", "seed": seed, "async": mode, "big": True}
        for seed, mode in ((1, "pipelined"), (2, "snapshot"), (3, "pipelined"))
    ]
    results = spawn(2, tmp_path, steps)
    for step in range(3):
        ok(results, step)
    left = parts(tmp_path, "ckpt.pt")
    assert len(left) == 2 and len({os.path.basename(p).split(".part-")[0] for p in left}) == 1, left
    assert same(fastpersist.load(tmp_path / "ckpt.pt"), {**make_state(3), "big": make_big(3)})
    assert temporaries(tmp_path) == []


def test_a_rank_killed_during_the_background_write_fails_the_others_within_the_timeout(tmp_path):
    steps = [
        {"op": "save", "seed": 1, "async": "snapshot"},
        {"op": "save", "seed": 2, "bad": 2, "fault": "kill", "timeout": 5, "async": "pipelined"},
    ]
    began = time.monotonic()
    results = spawn(3, tmp_path, steps, deadline=90)
    assert time.monotonic() - began < 60
    ok(results[:2], 0)
    for rank in (0, 1):
        outcome = results[rank][1]
        assert outcome.get("error") == "DistributedCheckpointError", outcome
        assert "2" in outcome["failures"] and "did not report" in outcome["message"]
        assert outcome["seconds"] < 20
    assert results[2] is None  # rank 2 died in its background write (os._exit)
    assert same(fastpersist.load(tmp_path / "ckpt.pt"), make_state(1))
    assert temporaries(tmp_path) == []


def test_an_interrupted_background_write_releases_the_other_ranks_at_once(tmp_path):
    """Ctrl-C (KeyboardInterrupt) in one rank's background write: that future raises it, the others raise within
    seconds (not at their 60 s timeout), nothing is committed."""
    steps = [
        {"op": "save", "seed": 1, "async": "snapshot"},
        {"op": "save", "seed": 2, "bad": 1, "fault": "interrupt", "timeout": 60, "async": "pipelined"},
    ]
    results = spawn(2, tmp_path, steps, deadline=90)
    ok(results, 0)
    assert results[1][1]["error"] == "KeyboardInterrupt"
    outcome = results[0][1]
    assert outcome.get("error") == "DistributedCheckpointError" and "interrupted" in outcome["message"], outcome
    assert outcome["seconds"] < 20
    assert same(fastpersist.load(tmp_path / "ckpt.pt"), make_state(1)) and temporaries(tmp_path) == []


def test_twenty_saves_in_a_row_with_sync_collective_calls_between(tmp_path):
    """Twenty asynchronous saves of changing values, not waited for one by one (the next waits for the previous
    slot), with synchronous collective saves and loads between them (each first lets the pending ones finish):
    every file holds its own values."""
    steps = [{"op": "burst", "count": 20, "every": 5}]
    results = spawn(2, tmp_path, steps, deadline=180)
    done = ok(results, 0)
    assert done[0]["loads"] == done[1]["loads"] == [True] * 4
    for i in range(20):
        assert same(fastpersist.load(tmp_path / f"burst-{i}.pt"), make_state(100 + i)), i
    for i in range(4):
        assert same(fastpersist.load(tmp_path / f"sync-{i}.pt"), make_state(200 + i)), i
    assert temporaries(tmp_path) == []


def test_exit_with_a_collective_save_pending_completes_it(tmp_path):
    """Every rank returns from its script with a save pending: the interpreter's exit completes the save."""
    steps = [{"op": "save", "seed": 3, "async": "pipelined", "pending": True, "name": "exit.pt"}]
    results = spawn(2, tmp_path, steps, deadline=90)
    assert ok(results, 0) == [{"plain": True}, {"plain": True}]  # the steps returned before the save ended
    assert same(fastpersist.load(tmp_path / "exit.pt"), make_state(3))
    assert temporaries(tmp_path) == []


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["file", "parts"])
def test_nccl_async_collective_saves(layout, tmp_path):
    """NCCL, each rank's state on its own GPU: both modes, per-rank state and a column-major replica, a drifted
    weight refused, a modified tensor, a rank's full disk; every file rank 0's object (device tags cuda:0)."""
    steps = [
        {"op": "save", "layout": layout, "variant": "per_rank", "device": "cuda", "async": "snapshot"},
        {"op": "save", "layout": layout, "variant": "per_rank", "device": "cuda", "async": "pipelined", "name": "p.pt"},
        {"op": "load", "variant": "per_rank", "map_location": "own", "name": "p.pt"},
        {
            "op": "save",
            "layout": layout,
            "variant": "drift",
            "device": "cuda",
            "name": "drift.pt",
            "divergence": "error",
            "async": "pipelined",
        },
        {
            "op": "save",
            "layout": layout,
            "device": "cuda",
            "seed": 5,
            "bad": 1,
            "fault": "modify",
            "async": "pipelined",
        },
        {"op": "save", "layout": layout, "device": "cuda", "seed": 6, "bad": 1, "fault": "enospc", "async": "snapshot"},
        {"op": "burst", "count": 6, "every": 3, "device": "cuda", "layout": layout},
        {"op": "save", "layout": layout, "device": "cuda", "async": "pipelined", "big": True, "name": "big.pt"},
    ]
    results = spawn(2, tmp_path, steps, backend="nccl", deadline=240)
    expected = make_state(0, 0, "per_rank")
    for step, name in ((0, "ckpt.pt"), (1, "p.pt")):
        saved = ok(results, step)
        assert len(saved[0]["divergent"]) == 2 and saved[0]["warned_at"] == ["_distributed_worker.py"], saved
        assert same(fastpersist.load(tmp_path / name, map_location="cpu"), expected)
        if layout == "file":
            from test_distributed_replicas import pickled

            data = pickled(tmp_path / name)
            assert b"cuda:0" in data and b"cuda:1" not in data
    loads = ok(results, 2)
    assert all(r["same"] for r in loads) and [r["devices"] for r in loads] == [["cuda:0"], ["cuda:1"]]
    for step in (3, 4, 5):
        for rank in range(2):
            assert results[rank][step].get("error") == "DistributedCheckpointError", results[rank][step]
    assert "weights[2]" in results[0][3]["message"] and "TensorModifiedError" in results[0][4]["message"]
    assert same(fastpersist.load(tmp_path / "ckpt.pt", map_location="cpu"), expected)
    assert ok(results, 6)[0]["loads"] == [True] * 2
    for i in range(6):
        assert same(fastpersist.load(tmp_path / f"burst-{i}.pt", map_location="cpu"), make_state(100 + i)), i
    big = ok(results, 7)
    assert big[1]["bytes"] > 4 << 20 and big[1]["shared"] > 16 << 20  # rank 1 wrote its share from its GPU
    assert same(fastpersist.load(tmp_path / "big.pt", map_location="cpu"), {**make_state(), "big": make_big(0)})
    assert temporaries(tmp_path) == []
