"""``python -m fastpersist.bench gds``: GdsHandle's paths against AioHandle + copy and the raw O_DIRECT ceiling."""

from __future__ import annotations

import json

import pytest
import torch

from fastpersist.bench import SUBCOMMANDS
from fastpersist.bench import gds as bench_gds


def test_registered_as_a_subcommand():
    assert SUBCOMMANDS["gds"][0] == "fastpersist.bench.gds"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_without_cuda_it_says_a_device_is_needed(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench_gds.main(["--dir", str(tmp_path), "--size", "1M"])


def test_markdown_shows_every_method_and_unavailable_ones():
    doc = {
        "settings": {"size": 1 << 30, "repeats": 3, "block_size": 1 << 20, "queue_depth": 32, "threads": 4},
        "results": {
            "ceiling": {"write_gbps": 2.0, "read_gbps": 2.5, "path": "engine io_uring, O_DIRECT, host memory"},
            "gds_bounce": {"write_gbps": 1.8, "read_gbps": 2.25, "path": "bounce: asked for"},
            "gds_cufile": {"error": "GdsHandle path 'cufile' cannot start: no libcufile", "path": None},
        },
        "ratios": {"ceiling": {}, "gds_bounce": {"write_vs_ceiling": 0.9, "read_vs_ceiling": 0.9}},
    }
    text = bench_gds.to_markdown(doc)
    assert "| gds_bounce | 1.80 | 2.25 | 0.90 | 0.90 | - | - | bounce: asked for |" in text
    assert "| gds_cufile | - | - | - | - | - | - | unavailable: GdsHandle path 'cufile' cannot start" in text


@pytest.mark.gpu
def test_runs_every_method_and_verifies(tmp_path, capsys):
    out = tmp_path / "gds.json"
    assert bench_gds.main(["--dir", str(tmp_path), "--size", "8M", "--repeats", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "gds" and set(doc["results"]) == set(bench_gds.METHODS)
    for name, entry in doc["results"].items():
        if entry["error"] is None:
            assert entry["verified"] and entry["write_gbps"] > 0 and entry["read_gbps"] > 0, name
            assert len(entry["write_samples"]) == 2
    assert doc["results"]["gds_bounce"]["error"] is None
    assert "write_vs_ceiling" in doc["ratios"]["gds_bounce"] and "read_vs_aio_copy" in doc["ratios"]["gds_bounce"]
    assert "| ceiling |" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["gds.json"]
    assert bench_gds.main(["--dir", str(tmp_path), "--size", "4M", "--repeats", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["size"] == 4 << 20
