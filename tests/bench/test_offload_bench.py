"""``python -m fastpersist.bench offload``: its arguments and its table (the run itself needs a GPU)."""

from __future__ import annotations

import os

from fastpersist.bench import offload


def _document():
    row = {
        "batch": 32,
        "new_tokens": 3,
        "ttft_seconds": 2.0,
        "decode_tokens_per_second": 9.0,
        "peak_gpu_bytes": 12e9,
        "peak_host_rss_bytes": 4.5e9,
        "host_rss_baseline_bytes": 4.0e9,
        "rss_before_dispatch_bytes": 3.0e9,
        "staging_bytes": 1.0e9,
        "bound_tokens_per_second": 10.0,
        "of_bound": 0.9,
        "same_tokens_as_full_gpu": True,
        "prefill_logits_max_abs_diff": 0.0,
    }
    return {
        "machine": {"device_name": "GPU-X"},
        "config": {
            "model_bytes": 40e9,
            "layers": 90,
            "gpu_budget": 10e9,
            "prompt": 512,
            "new_tokens": 32,
            "accelerate_new_tokens": 2,
            "disk_new_tokens": 3,
            "accelerate_reads": "page cache of its files dropped before every step (fadvise)",
        },
        "ceilings": {"disk_read_GBps": 2.0, "host_to_device_GBps": 50.0},
        "results": {"fastpersist-disk": [row]},
    }


def test_table_shows_tokens_bound_and_host_memory_added_over_the_process_before_dispatch():
    table = offload.to_markdown(_document())
    assert "accelerate: page cache of its files dropped before every step (fadvise)" in table
    line = next(line for line in table.splitlines() if line.startswith("| fastpersist-disk"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells == [
        "fastpersist-disk",
        "32",
        "3",
        "9.00",
        "10.00",
        "0.90x",
        "2.00",
        "12.00",
        "4.50",
        "+1.50",
        "1.00",
        "yes",
        "0",
    ]


def test_table_of_an_older_document_without_the_new_fields():
    document = _document()
    row = document["results"]["fastpersist-disk"][0]
    for key in ("new_tokens", "rss_before_dispatch_bytes", "host_rss_baseline_bytes", "staging_bytes"):
        del row[key]
    del document["config"]["accelerate_reads"]
    line = next(line for line in offload.to_markdown(document).splitlines() if line.startswith("| fastpersist-disk"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[2] == "3" and cells[9] == "" and cells[10] == ""


def test_disk_tokens_default_to_new_tokens(tmp_path):
    args = offload.BENCHMARK.parser().parse_args(["--dir", str(tmp_path), "--new-tokens", "7"])
    assert args.disk_tokens is None and args.new_tokens == 7
    args = offload.BENCHMARK.parser().parse_args(["--dir", str(tmp_path), "--disk-tokens", "3"])
    assert args.disk_tokens == 3


def test_cold_reads_names_tmpfs_folders_it_cannot_drop(tmp_path):
    (tmp_path / "w.dat").write_bytes(b"x" * 4096)
    cold = offload._ColdReads([str(tmp_path), str(tmp_path / "missing")])
    assert cold.roots == [str(tmp_path)]
    cold()  # drops what it can; never raises for existing files
    if os.path.isdir("/dev/shm"):
        shm = offload._ColdReads(["/dev/shm"])
        assert "tmpfs" in shm.detail


def test_chart_has_a_bar_per_row_and_a_bound_tick_per_tier(tmp_path):
    import json

    document = _document()
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(document))
    svg_path = tmp_path / "offload.svg"
    assert offload.main(["--report", str(path), "--svg", str(svg_path)]) == 0
    svg = svg_path.read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 2  # the background and one bar
    assert "fastpersist-disk, batch 32" in svg and 'stroke="#c33"' in svg
