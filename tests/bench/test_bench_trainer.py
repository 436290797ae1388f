"""The Trainer benchmark runs end to end on a toy Llama and its report renders (no speed asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastpersist.bench import trainer

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def test_trainer_benchmark_json_table_and_chart(tmp_path):
    out, svg = tmp_path / "trainer.json", tmp_path / "trainer.svg"
    command = [sys.executable, "-m", "fastpersist.bench", "trainer", "--device", "cpu", "--dir", str(tmp_path / "c")]
    command += ["--methods", "unpatched+fsync,patched-async", "--checkpoints", "2", "--json", str(out)]
    run = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["schema"] == trainer.SCHEMA and document["benchmark"] == "trainer"
    (entry,) = document["results"]
    assert entry["checkpoint_bytes"] > 0 and entry["write_ceiling"]["best_s"] > 0
    fsynced, background = entry["methods"]["unpatched+fsync"], entry["methods"]["patched-async"]
    for result in (fsynced, background):
        (sample,) = result["samples"]
        assert sample["verified"]["ok"], sample["verified"]
        assert [c["step"] for c in sample["checkpoints"]] == [2, 4]
        assert all(c["durable_s"] >= c["blocked_s"] > 0 for c in sample["checkpoints"])
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(sample["files"])
    # The patched run's files went through fastpersist (and none to the originals); the unpatched one's did not.
    assert background["samples"][0]["patch_stats"]["fastpersist"]["save_file"] == 2
    assert background["samples"][0]["patch_stats"]["fastpersist"]["torch.save"] >= 2 * 3
    assert background["samples"][0]["patch_stats"]["original"] == {}
    assert fsynced["samples"][0]["patch_stats"] == {}
    assert not os.listdir(tmp_path / "c")  # each run removes its output directory
    assert "| patched-async |" in run.stdout and "unpatched + fsync" in run.stdout

    report = subprocess.run(
        [sys.executable, "-m", "fastpersist.bench", "trainer", "--report", str(out), "--svg", str(svg)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "| unpatched+fsync |" in report.stdout
    assert svg.read_text().startswith("<svg") and "patched-async" in svg.read_text()


def test_fsync_tree_skips_saves_in_flight(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "a" / "sub").mkdir()
    (tmp_path / "a" / "sub" / "state.json").write_text("{}")
    (tmp_path / "a" / ".optimizer.pt.fastpersist-1-2-ns-abc.tmp").write_bytes(b"partial")
    assert trainer.fsync_tree(str(tmp_path / "a")) == 2


def test_targets_are_the_issue_ratios():
    results = {
        "unpatched": {"blocked_s": 3.0},
        "unpatched+fsync": {"durable_s": 5.0},
        "patched": {"durable_s": 2.0},
        "patched-async": {"blocked_s": 0.25},
    }
    got = trainer._targets(results, {"best_s": 1.9}, 4_000_000_000)
    assert got["patched_gbps"] == pytest.approx(2.0)
    assert got["patched_of_ceiling"] == pytest.approx(0.95)
    assert got["patched_vs_unpatched_fsync"] == pytest.approx(2.5)
    assert got["async_blocked_of_unpatched"] == pytest.approx(0.25 / 3.0)
    assert trainer._targets({"patched": {"error": "x"}}, None, 1)["patched_of_ceiling"] is None
