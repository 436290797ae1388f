"""The aio_handle benchmark runs and writes its JSON document (speed is measured, never asserted)."""

import json

from fastpersist.bench import SUBCOMMANDS
from fastpersist.bench.aio_handle import main


def test_aio_handle_benchmark_writes_json(tmp_path):
    assert "aio_handle" in SUBCOMMANDS
    out = tmp_path / "r.json"
    assert main(["--dir", str(tmp_path / "d"), "--size", "1MiB", "--repeat", "1", "--no-cuda", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["size_bytes"] == 1 << 20
    assert set(doc["results"]["cpu_locked"]) == {"write_GBps", "read_GBps"}
    assert not any(p.name.startswith("fastpersist-bench") for p in (tmp_path / "d").iterdir())
