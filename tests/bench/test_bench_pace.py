"""The pace benchmark's rounds, ratios and table (the training part and fio replaced: they have their own tests)."""

from __future__ import annotations

import argparse
import json

import pytest

from fastpersist import system
from fastpersist.bench import bounds, pace


def test_pace_measures_every_target_and_reports_it(tmp_path, monkeypatch, capsys):
    fio_calls = []
    monkeypatch.setattr(system, "find_fio", lambda: "/usr/bin/fio")
    monkeypatch.setattr(bounds, "fio_write_seconds", lambda path, nbytes: fio_calls.append(nbytes) or 0.05)
    monkeypatch.setattr(
        pace,
        "_training",
        lambda directory, iterations, scratch: {
            "of_bound": {"fastpersist-pipelined": 1.02, "fastpersist-snapshot": 1.2}
        },
    )
    args = argparse.Namespace(
        disk=str(tmp_path / "disk"), shm=str(tmp_path / "shm"), size=4 << 20, rounds=3, iterations=2
    )
    document = pace.BENCHMARK.measure(args)
    results = document["results"]
    assert set(results) == set(pace.TARGETS)
    assert results["training-disk-pipelined"] == {**results["training-disk-pipelined"], "ratio": 1.02, "met": True}
    assert results["training-shm-snapshot"]["met"] is False
    assert fio_calls == [4 << 20] * 3
    for name in ("disk-save", "verified-load"):
        rounds = document["parts"][name]["rounds"]
        assert len(rounds) == 3 and all(r["ratio"] > 0 for r in rounds)
        assert results[name]["ratio"] == pytest.approx(sorted(r["ratio"] for r in rounds)[1])
    assert not list((tmp_path / "disk").iterdir()) and not list((tmp_path / "shm").iterdir())  # nothing left

    path = tmp_path / "pace.json"
    path.write_text(json.dumps(document))
    assert pace.main(["--report", str(path)]) == 0
    table = capsys.readouterr().out
    assert "| every-iteration snapshot to shm, x the bound | 1.200 | <= 1.1 | NO |" in table
    assert "disk-save per round:" in table


def test_pace_without_fio_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(system, "find_fio", lambda: None)
    args = argparse.Namespace(disk=str(tmp_path), shm=str(tmp_path), size=1 << 20, rounds=1, iterations=1)
    with pytest.raises(SystemExit, match="fio"):
        pace.BENCHMARK.measure(args)
