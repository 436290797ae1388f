"""The stage-by-stage ring benchmark: every stage moves the source's bytes, and its CRC-32s are the source's."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from fastpersist.bench import report, stages

SMALL = ["--size", "8M", "--window", "1M", "--slots", "4", "--rounds", "1", "--no-cuda"]


def test_stages_of_a_fresh_file(tmp_path, capsys):
    out = tmp_path / "stages.json"
    assert stages.main(SMALL + ["--dir", str(tmp_path), "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    rows = {r["stage"]: r for r in document["results"]}
    assert list(rows) == ["read", "read + CRC-32", "pread x 8", "pread x 16"]
    assert rows["read + CRC-32"]["crc_checked"] is True and rows["read"]["crc_checked"] is None
    assert all(r["gbps"] > 0 and len(r["seconds"]) == 1 for r in rows.values())
    assert document["config"]["bytes"] == 8 << 20 and document["machine"]["code"]
    assert list(tmp_path.iterdir()) == [out]  # the fresh source is removed
    assert "| read + CRC-32 |" in capsys.readouterr().out
    assert report.benchmark_of(document) == "stages" and "| pread x 16 |" in stages.to_markdown(document)


def test_stages_of_the_sink():
    document = stages.BENCHMARK.measure(stages.BENCHMARK.parser().parse_args(SMALL + ["--sink"]))
    assert document["config"]["source"] == "sink (/dev/zero)"
    assert next(r for r in document["results"] if r["stage"] == "read + CRC-32")["crc_checked"] is True


def test_a_wrong_crc_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(stages, "_source_crc", lambda *a: 12345)
    with pytest.raises(RuntimeError, match="differs from the source"):
        stages.main(SMALL + ["--dir", str(tmp_path)])


@pytest.mark.parametrize(
    "where, message",
    [
        (["--source", "{short}"], "fewer than --size"),
        (["--source", "{missing}"], "no such file"),
        (["--dir", "{missing}"], "no such directory"),
        (["--size", "4K"], "smaller than one window"),
    ],
)
def test_a_command_line_that_cannot_run_is_a_usage_error(tmp_path, capsys, where, message):
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 4096)
    argv = [a.format(short=short, missing=tmp_path / "missing") for a in where]
    with pytest.raises(SystemExit) as exited:
        stages.main(SMALL + argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["read + copy", "read + copy + CRC-32", "read + copy + device CRC-32"])
def test_a_copy_stage_is_the_loads_ring(tmp_path, stage):
    """The copy stages run the load's own ring (here into host memory: no GPU needed), bytes and CRC-32 intact."""
    from fastpersist import config
    from fastpersist.io import engine

    data = os.urandom(6 << 20)
    path = tmp_path / "source.bin"
    path.write_bytes(data)
    settings = config.settings()
    target = torch.zeros(len(data), dtype=torch.uint8)
    handles = [engine.make_handle(settings) for _ in range(4)]
    seconds, crc = stages._stage(str(path), len(data), 1 << 20, settings, handles, target, stage)
    assert seconds > 0 and bytes(target.numpy()) == data
    assert crc == (zlib.crc32(data) if "CRC-32" in stage else None)


def test_the_source_crc_reads_on_after_a_short_read(tmp_path):
    """/dev/zero may fill less than asked into memory not touched yet: a short read is no end (a pipe gives them)."""
    import threading

    from fastpersist.io import memory

    data = os.urandom(3 << 20)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb", buffering=0) as out:
            for start in range(0, len(data), 100_000):
                out.write(data[start : start + 100_000])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert stages._source_crc(str(fifo), len(data), memory.aligned_empty(1 << 20)) == zlib.crc32(data)
    finally:
        writer.join()
    short = tmp_path / "short.bin"
    short.write_bytes(data[:4096])
    with pytest.raises(OSError, match="ends at 4096 bytes"):
        stages._source_crc(str(short), 8192, memory.aligned_empty(1 << 20))


def test_a_read_that_fails_leaves_nothing_in_flight(tmp_path):
    """A failed read raises out of the stage after every other read of the ring is done, its file closed last."""
    from fastpersist import config
    from fastpersist.io import engine

    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(3 << 20))  # 8 windows asked, 3 there: the reads past the end come back short
    settings = config.settings()
    handles = [engine.make_handle(settings) for _ in range(4)]
    with pytest.raises(OSError):
        stages._stage(str(path), 8 << 20, 1 << 20, settings, handles, None, "read + CRC-32")
    for handle in handles:  # every request was reaped: the handles take new work
        handle.wait()
