"""The storage ceiling: measured independently of any save path, verified, and never beaten silently."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fastpersist.bench import bounds, methods, report
from fastpersist.bench.checkpoint import run_benchmark
from fastpersist.system import CacheDropper


def test_pattern_blocks_are_unique():
    pattern = bounds._stamped_pattern(64 * bounds.BLOCK + 100)
    blocks = pattern[: 64 * bounds.BLOCK].view(64, bounds.BLOCK)
    assert len({bytes(b[:8].numpy()) for b in blocks}) == 64  # a misplaced block cannot compare equal


def test_grid_covers_block_sizes_queue_depths_and_the_load_ring(tmp_path):
    with bounds.CeilingProbe(str(tmp_path), 1 << 20, use_fio=False) as probe:
        writes = probe.candidates("write")
        reads = probe.candidates("read", read_buffers=(64 << 20, 8))
    assert {(c.block_size, c.queue_depth) for c in writes} == {
        (b, q) for b in bounds.GRID_BLOCK_SIZES for q in bounds.GRID_QUEUE_DEPTHS
    }
    assert bounds.Candidate("engine", 64 << 20, 8) in reads and len(reads) == len(writes) + 1
    assert os.listdir(tmp_path) == []


def test_ceiling_is_the_best_verified_full_size_sample(tmp_path):
    result = bounds.measure_ceiling(str(tmp_path), 3 << 20, use_fio=False, grid_bytes=1 << 20, passes=2, seed=3)
    assert result["bytes"] == 3 << 20 and result["fio"]["path"] is None
    assert len(result["grid"]["write"]) == 4 and all(p["bytes"] == 1 << 20 for p in result["grid"]["write"])
    for op in ("write", "read"):
        samples = result[op]["samples"]
        assert samples and all(s["bytes"] == 3 << 20 and s["error"] is None for s in samples)
        assert result[op]["gbps"] == max(s["gbps"] for s in samples)
    assert os.listdir(tmp_path) == []


def test_a_read_that_returns_other_bytes_fails_the_ceiling(tmp_path, monkeypatch):
    with bounds.CeilingProbe(str(tmp_path), 1 << 20, use_fio=False) as probe:
        candidate = probe.candidates("write")[0]
        probe.write(candidate)
        path = probe._path("engine")
        with open(path, "r+b") as f:  # one block stale: what a read of the wrong offset would return
            f.seek(5 * bounds.BLOCK)
            f.write(bytes(probe.source[3 * bounds.BLOCK : 4 * bounds.BLOCK].numpy()))
        with pytest.raises(bounds.CeilingVerificationError, match=f"byte {5 * bounds.BLOCK}"):
            probe.read(candidate)


def test_failed_candidates_never_count(tmp_path, monkeypatch):
    def broken_read(self, candidate, nbytes=None):
        raise bounds.CeilingVerificationError("bytes differ")

    monkeypatch.setattr(bounds.CeilingProbe, "read", broken_read)
    result = bounds.measure_ceiling(str(tmp_path), 1 << 20, use_fio=False, grid_bytes=1 << 20)
    assert result["write"]["gbps"] is None and result["read"]["gbps"] is None
    assert all("bytes differ" in p["error"] for p in result["grid"]["read"])


@pytest.mark.skipif(bounds.system.find_fio() is None, reason="fio is not installed")
def test_fio_candidates_verify_their_reads(tmp_path):
    with bounds.CeilingProbe(str(tmp_path), 4 << 20, use_fio=True) as probe:
        fio = bounds.Candidate("fio", 1 << 20, 8)
        assert probe.write(fio) > 0 and probe.read(fio) > 0
        with open(probe._path("fio"), "r+b") as f:
            f.seek(2 << 20)
            f.write(b"\xff" * 64)
        with pytest.raises(bounds.CeilingVerificationError, match="verify"):
            probe.read(fio)


def test_faster_than_the_ceiling_is_flagged_not_reported_as_a_win():
    document = {
        "baselines": {"save": "torch.save", "load": "torch.load"},
        "ceiling": {
            "fio": {"path": None},
            "write": {
                "gbps": 2.0,
                "best": {"tool": "engine", "block_size": 16 << 20, "queue_depth": 32},
                "samples": [{"gbps": 2.0}],
            },
            "read": {"gbps": None, "best": None, "samples": []},
        },
        "results": [
            {
                "op": "save",
                "method": m,
                "label": m,
                "status": "ok",
                "timed": True,
                "summary": {
                    "gbps": {"median": g, "min": g, "max": g, "n": 1},
                    "seconds": {"median": 1.0},
                    "blocked_seconds": None,
                    "rss_delta_bytes": {"median": 0},
                    "peak_rss_bytes": {"median": 0},
                },
            }
            for m, g in (("torch.save", 1.0), ("fastpersist", 2.5))
        ],
    }
    report.annotate_ceiling(document)
    by_name = {r["method"]: r for r in document["results"]}
    assert by_name["torch.save"]["ceiling_ratio"] == 0.5 and not by_name["torch.save"]["measurement_problem"]
    assert by_name["fastpersist"]["ceiling_ratio"] == 1.25 and by_name["fastpersist"]["measurement_problem"]
    assert report.measurement_problems(document) == ["save fastpersist"]
    rows = {r["method"]: r for r in report.rows(document)}
    assert rows["fastpersist"]["status"].startswith("MEASUREMENT PROBLEM")
    assert rows["ceiling-write"]["gbps"] == "2.00" and "engine 16M QD32" in rows["ceiling-write"]["label"]
    assert rows["ceiling-read"]["status"].startswith("FAILED")


def test_method_order_is_random_per_round_and_seeded(shm_dir):
    saves = [dataclasses.replace(methods.SAVE_METHODS["torch.save"], name=f"m{i}") for i in range(5)]
    state = {"w": torch.arange(4.0)}  # only the order is under test: the smallest state that saves

    def schedule_for(seed):
        schedule = []
        run_benchmark(
            state,
            saves,
            [],
            shm_dir,
            repeats=4,
            warmup=0,
            order_seed=seed,
            schedule=schedule,
            dropper=CacheDropper(enabled=False),
        )
        return [tuple(r["save"]) for r in schedule]

    first = schedule_for(11)
    assert first == schedule_for(11)
    assert len(set(first)) > 1 and all(sorted(order) == [f"m{i}" for i in range(5)] for order in first)
    assert first != schedule_for(12)
