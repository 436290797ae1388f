"""The training benchmark runs end to end on a tiny model and its report renders (no speed asserted)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.mark.parametrize("methods", ["fastpersist-pipelined,torch.save"])  # snapshot: tests/api, GPU runs
def test_training_benchmark_json_table_and_chart(methods, tmp_path):
    out = tmp_path / "training.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastpersist.bench",
            "training",
            "--device",
            "cpu",
            "--dir",
            str(tmp_path / "ckpt"),
            "--d-model",
            "32",
            "--heads",
            "2",
            "--layers",
            "1",
            "--vocab",
            "64",
            "--batch",
            "2",
            "--seq",
            "8",
            "--iterations",
            "2",
            "--warmup",
            "1",
            "--methods",
            methods,
            "--json",
            str(out),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["schema"] == "fastpersist-training-bench/1"
    methods_run = [r["method"] for r in document["results"]]
    assert methods_run == ["none", *methods.split(",")]
    for result in document["results"]:
        assert "error" not in result, result
        assert result["per_iteration_s"] > 0 and len(result["samples"]) == 1
        if result["method"] != "none":
            assert result["checkpoint_bytes"] > 0 and result["overhead_pct"] is not None
            # Each timed save's phases were recorded (2 iterations, a checkpoint after each), the write's included.
            saves = result["samples"][0]["saves"]
            assert len(saves) == 2 and all(save["save"] > 0 for save in saves)
            assert result["steady_of_possible"] > 0
            if result["method"].startswith("fastpersist"):
                assert {"pickle", "write", "rename"} <= result["phases"].keys()
    ceiling = document["write_ceiling"]
    assert ceiling["best_s"] > 0 and {"pwrite-1", "pwrite-8"} <= ceiling["seconds"].keys()
    # The bound: checkpoints written one after another (as many as the run writes, at least 3), each freeing the
    # one before: the row's time per file is at least its writes'.
    row = ceiling["in_a_row_s"]
    assert len(row) >= 3 and ceiling["sustained_s"] >= statistics.mean(row) * 0.999
    assert document["possible_per_iteration_s"] >= min(ceiling["sustained_s"], ceiling["best_s"])
    assert document["possible_alone_per_iteration_s"] >= ceiling["best_s"]
    assert os.listdir(tmp_path / "ckpt") == [], "the benchmark removes its checkpoints"
    svg = tmp_path / "chart.svg"
    report = subprocess.run(
        [sys.executable, "-m", "fastpersist.bench", "training", "--report", str(out), "--svg", str(svg)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert report.returncode == 0, report.stderr
    assert "| fastpersist-pipelined |" in report.stdout and svg.read_text().startswith("<svg")
    assert "Possible (the bound)" in report.stdout and "Where a save's time goes" in report.stdout
