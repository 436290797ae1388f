"""The safetensors benchmark runs end to end and checks what it measures (speed itself is not asserted)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("safetensors.torch")
pytest.importorskip("numpy")

from fastpersist.bench import SUBCOMMANDS
from fastpersist.bench.safetensors_bench import main


def test_small_run_reports_every_method_and_no_problem(tmp_path):
    assert "safetensors" in SUBCOMMANDS
    out = tmp_path / "result.json"
    assert (
        main(["--size", "4M", "--model", "toy", "--repeats", "1", "--dir", str(tmp_path / "files"), "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert result["problems"] == []
    assert set(result["save"]) == {"ceiling", "fastpersist", "safetensors", "fastpersist-torch"}
    assert set(result["load"]) == {"ceiling", "fastpersist", "fastpersist-own", "safetensors"}
    assert "save: fastpersist / safetensors" in result["ratios"]
    assert result["config"]["bytes"] > 0
