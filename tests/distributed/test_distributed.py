"""Collective (data-parallel) save and load with real processes and the gloo backend.

Each test spawns 2 or 4 ranks (tests/_workers/_distributed_worker.py) that run a list
of steps and report per step; the test then checks the files from outside.
Tensors are small and timeouts short so the whole module runs in well under
a minute on a 2-core machine.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from _distributed_worker import make_state, same

import fastpersist
import fastpersist.cli

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    world: int, directory, steps: list, deadline: float = 120, backend: str = "gloo", tag_cuda: bool = False
) -> list[list[dict]]:
    """Runs ``steps`` on ``world`` ranks; returns each rank's per-step results. Fails on a hang.

    ``tag_cuda``: each rank pickles its CPU storages as ``cuda:<rank>`` (what one GPU per rank gives).
    """
    import _distributed_worker

    context = mp.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=_distributed_worker.run, args=(r, world, port, str(directory), steps, backend, tag_cuda))
        for r in range(world)
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join(deadline)
    hung = [r for r, p in enumerate(processes) if p.is_alive()]
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"rank(s) {hung} still running after {deadline} s: a collective call hung"
    results = []
    for r in range(world):
        name = os.path.join(directory, f"result-{r}.json")
        if not os.path.exists(name):
            results.append(None)  # the rank died (os._exit) before reporting
            continue
        with open(name) as handle:
            results.append(json.load(handle))
        os.unlink(name)
    return results


def ok(results, step: int) -> list[dict]:
    for rank, per_rank in enumerate(results):
        assert "ok" in per_rank[step], f"rank {rank} step {step}: {per_rank[step]}"
    return [per_rank[step]["ok"] for per_rank in results]


def temporaries(directory) -> list[str]:
    return glob.glob(os.path.join(directory, "**", ".*.tmp"), recursive=True)


@pytest.mark.parametrize("world", [2, 4])
def test_both_layouts_and_reload_at_any_world_size(world, tmp_path):
    steps = [
        {"op": "save", "layout": "file", "name": "file.pt"},
        {"op": "save", "layout": "parts", "name": "parts.pt"},
        {"op": "load", "name": "parts.pt"},  # collective, every part visible
        {"op": "save", "layout": "file", "writers": "node", "name": "node.pt"},
    ]
    results = spawn(world, tmp_path, steps)
    expected = make_state()
    saved = ok(results, 0)
    size = saved[0]["size"]
    assert sum(r["bytes"] for r in saved) < size  # the trailer is rank 0's, after the ranges
    assert all(abs(r["bytes"] - size / world) < (1 << 20) + size / world * 0.01 or size < world << 20 for r in saved)
    # The shared-file result is an ordinary checkpoint: plain torch.load, fastpersist.verify.
    assert same(torch.load(tmp_path / "file.pt"), expected)
    assert fastpersist.verify(tmp_path / "file.pt").checksummed
    # Parts: a manifest at the path, one part per rank; loads in one process (world size 1).
    ok(results, 1)
    from fastpersist.distributed.manifest import read_manifest

    parts = read_manifest(tmp_path / "parts.pt").parts
    assert len(glob.glob(str(tmp_path / "parts.pt.*.part-*-of-*"))) == len(parts) == min(world, -(-size >> 20))
    assert same(fastpersist.load(tmp_path / "parts.pt"), expected)
    assert fastpersist.verify(tmp_path / "parts.pt").records == fastpersist.verify(tmp_path / "file.pt").records
    assert all(r["same"] for r in ok(results, 2))
    # One writer per node: this machine is one node, so rank 0 wrote it all.
    node = ok(results, 3)
    assert node[0]["writers"] == 1 and node[0]["bytes"] > 0 and all(r["bytes"] == 0 for r in node[1:])
    assert same(torch.load(tmp_path / "node.pt"), expected)
    assert temporaries(tmp_path) == []


def test_intermediate_steps_skip_the_read_marks(tmp_path):
    """A step followed by another (last=False) goes on without every rank's read mark; the last step and a
    failed one wait for them, so the store's host cannot leave before the others have read."""
    results = spawn(2, tmp_path, [{"op": "exchange"}])
    for outcome in ok(results, 0):
        assert outcome == {"marks": {"first": False, "last": True, "failing": True}, "failed": [1]}


def test_single_rank_group_is_the_plain_save(tmp_path):
    results = spawn(1, tmp_path, [{"op": "save", "layout": "parts"}])
    assert ok(results, 0) == [{"plain": True}]  # no collective-save statistics: the plain save ran
    assert same(torch.load(tmp_path / "ckpt.pt"), make_state())  # an ordinary file, no manifest, no parts
    assert glob.glob(str(tmp_path / "ckpt.pt.*")) == []


def test_node_local_parts_loaded_by_fewer_ranks(tmp_path):
    """Saved by 4 ranks into 4 'node-local' directories; loaded by 2 ranks that each see only some parts."""
    dirs = [str(tmp_path / f"node{r}") for r in range(4)]
    for d in dirs:
        os.makedirs(d)
    ok(spawn(4, tmp_path, [{"op": "save", "layout": "parts", "dirs": dirs}]), 0)
    assert os.listdir(dirs[1]) and not os.path.exists(os.path.join(dirs[1], "ckpt.pt"))  # manifest: rank 0 only
    # Two ranks: rank 0 keeps node0 (manifest, part 0) and gets part 1; rank 1 gets parts 2 and 3.
    for r, target in ((1, 0), (2, 1), (3, 1)):
        for name in os.listdir(dirs[r]):
            shutil.move(os.path.join(dirs[r], name), os.path.join(dirs[target], name))
    results = spawn(2, tmp_path, [{"op": "load", "dirs": dirs[:2]}])
    assert all(r["same"] for r in ok(results, 0))
    # Plain load needs every part beside the manifest, and says which is missing.
    with pytest.raises(FileNotFoundError, match="part 2 of the sharded checkpoint is missing"):
        fastpersist.load(os.path.join(dirs[0], "ckpt.pt"))
    # The merge CLI turns the parts into one ordinary checkpoint (parts gathered in one place first).
    for name in os.listdir(dirs[1]):
        shutil.move(os.path.join(dirs[1], name), os.path.join(dirs[0], name))
    merged = tmp_path / "merged.pt"
    done = subprocess.run(
        [sys.executable, "-m", "fastpersist", "merge", os.path.join(dirs[0], "ckpt.pt"), str(merged)],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(fastpersist.__file__)),
    )
    assert done.returncode == 0, done.stderr
    assert same(torch.load(merged), make_state())
    verify = subprocess.run(
        [sys.executable, "-m", "fastpersist", "verify", os.path.join(dirs[0], "ckpt.pt")],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(fastpersist.__file__)),
    )
    assert verify.returncode == 0 and verify.stdout.startswith("OK"), verify.stdout + verify.stderr
    # A part kept elsewhere is named with --part; a damaged part is caught by verify, load and merge.
    from fastpersist.distributed.manifest import read_manifest

    part = os.path.join(dirs[0], read_manifest(os.path.join(dirs[0], "ckpt.pt")).parts[-1].name)  # the last part
    elsewhere = shutil.move(part, tmp_path / os.path.basename(part))
    assert (
        fastpersist.cli.main(
            ["merge", os.path.join(dirs[0], "ckpt.pt"), str(tmp_path / "again.pt"), "--part", str(elsewhere)]
        )
        == 0
    )
    assert same(torch.load(tmp_path / "again.pt"), make_state())
    shutil.move(elsewhere, part)
    with open(part, "r+b") as handle:
        handle.seek(os.path.getsize(part) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    verify = subprocess.run(
        [sys.executable, "-m", "fastpersist", "verify", os.path.join(dirs[0], "ckpt.pt")],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(fastpersist.__file__)),
    )
    assert verify.returncode == 1 and verify.stdout.startswith("CORRUPT"), verify.stdout + verify.stderr
    with pytest.raises(fastpersist.ChecksumMismatchError):
        fastpersist.load(os.path.join(dirs[0], "ckpt.pt"))
    assert fastpersist.cli.main(["merge", os.path.join(dirs[0], "ckpt.pt"), str(tmp_path / "bad.pt")]) == 1
    assert not os.path.exists(tmp_path / "bad.pt") and temporaries(tmp_path) == []


@pytest.mark.parametrize("layout", ["file", "parts"])
def test_failing_rank_raises_everywhere_and_keeps_previous(layout, tmp_path):
    steps = [
        {"op": "save", "layout": layout, "seed": 1},  # the previous checkpoint
        {"op": "save", "layout": layout, "seed": 2, "bad": 1, "fault": "exception"},
        {"op": "save", "layout": layout, "seed": 3, "bad": 1, "fault": "enospc"},
    ]
    results = spawn(2, tmp_path, steps)
    ok(results, 0)
    for step, kind in ((1, "cannot serialize the object"), (2, "No space left on device")):
        for rank in range(2):
            outcome = results[rank][step]
            assert outcome.get("error") == "DistributedCheckpointError", outcome
            assert list(outcome["failures"]) == ["1"], outcome  # names the failing rank, on every rank
            assert kind in outcome["message"] or kind in outcome["failures"]["1"]
    assert same(fastpersist.load(tmp_path / "ckpt.pt"), make_state(1))  # the previous checkpoint stays
    assert temporaries(tmp_path) == []
    if layout == "parts":
        assert len(glob.glob(str(tmp_path / "ckpt.pt.*.part-*"))) == 2  # failed saves' parts removed


def test_killed_rank_is_detected_by_timeout(tmp_path):
    steps = [{"op": "save", "seed": 1}, {"op": "save", "seed": 2, "bad": 2, "fault": "kill", "timeout": 5}]
    port_results = spawn(3, tmp_path, steps, deadline=90)
    ok(port_results[:2], 0)
    for rank in (0, 1):
        outcome = port_results[rank][1]
        assert outcome.get("error") == "DistributedCheckpointError", outcome
        assert "2" in outcome["failures"] and "did not report" in outcome["message"]
    assert port_results[2] is None  # rank 2 died in step 1 (os._exit in its write)
    assert same(fastpersist.load(tmp_path / "ckpt.pt"), make_state(1))
    assert temporaries(tmp_path) == []


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["file", "parts"])
def test_save_from_cuda_tensors(layout, tmp_path):
    """Each rank writes its slice from its own GPU copy (ranks share the GPUs when there are fewer)."""
    results = spawn(2, tmp_path, [{"op": "save", "layout": layout, "device": "cuda"}, {"op": "load", "device": "cuda"}])
    ok(results, 0)
    assert all(r["same"] for r in ok(results, 1))
    assert same(fastpersist.load(tmp_path / "ckpt.pt", map_location="cpu"), make_state())
    if layout == "file":
        assert same(torch.load(tmp_path / "ckpt.pt", map_location="cpu"), make_state())


@pytest.mark.multigpu
def test_nccl_group_one_rank_per_gpu(tmp_path):
    """NCCL: saves use only the store; the collective load's parts travel by NCCL broadcast of CUDA tensors."""
    world = min(torch.cuda.device_count(), 4)
    dirs = [str(tmp_path / f"node{r}") for r in range(world)]
    for d in dirs:
        os.makedirs(d)
    steps = [
        {"op": "save", "layout": "file", "device": "cuda", "name": "file.pt"},
        {"op": "save", "layout": "parts", "device": "cuda", "dirs": dirs},
        {"op": "load", "device": "cuda", "dirs": dirs},
    ]
    results = spawn(world, tmp_path, steps, backend="nccl")
    ok(results, 0)
    ok(results, 1)
    assert all(r["same"] for r in ok(results, 2))  # every rank saw only its own part
    assert same(torch.load(tmp_path / "file.pt", map_location="cpu"), make_state())


def test_ranks_benchmark_refuses_a_missing_directory(tmp_path, capsys):
    from fastpersist.bench import ranks

    with pytest.raises(SystemExit) as exited:
        ranks.main(["--ranks", "1", "--size", "1M", "--dir", f"{tmp_path},{tmp_path / 'missing'}"])
    assert exited.value.code == 2 and f"{tmp_path / 'missing'}: no such directory" in capsys.readouterr().err


def test_ranks_benchmark_runs_and_verifies(tmp_path):
    from fastpersist.bench import ranks

    out = tmp_path / "ranks.json"
    code = ranks.main(
        [
            "--ranks",
            "2",
            "--size",
            "3M",
            "--repeat",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "ranks.md"),
        ]
    )
    assert code == 0
    document = json.loads(out.read_text())
    assert [r["ranks"] for r in document["results"]] == [1, 2]  # the single writer is always measured
    two = document["results"][1]
    assert two["verified"] and len(two["per_rank"]) == 2
    assert sum(p["bytes"] for p in two["per_rank"]) <= two["file_bytes"]
    assert "| 2 |" in (tmp_path / "ranks.md").read_text()


def test_ranks_benchmark_sink_reports_the_hosts_bound(tmp_path):
    """With --sink every N gets the bound its ranks' shared host allows, measured with all ranks at once."""
    from fastpersist.bench import ranks

    out = tmp_path / "ranks.json"
    code = ranks.main(["--ranks", "2", "--size", "3M", "--repeat", "2", "--sink", "--json", str(out)])
    assert code == 0
    document = json.loads(out.read_text())
    one, two = document["results"]
    assert one["bound_speedup"] == 1.0
    for result in (one, two):
        assert result["bound_seconds"]["median"] > 0 and result["of_bound"] > 0
    assert "| bound end-to-end (s) |" in ranks.to_markdown(document)
