"""Every figure table in README.md and docs/ is generated from a JSON result in docs/results/."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from fastpersist.bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIGURE = re.compile(r"\d+\.\d+\s*(GB/s|x\b|GiB/s|MB/s)|\d+\.\d+ \(\d")


def _outside_generated_blocks(text: str) -> str:
    return re.sub(r"<!-- fastpersist:\w+ -->.*?<!-- /fastpersist -->", "", text, flags=re.DOTALL)


def test_docs_match_their_json():
    assert report.update_docs(ROOT, check=True) == [], "run: python -m fastpersist.bench report --update-docs"


def test_every_result_records_code_settings_and_machine():
    for name, document in report.load_results(os.path.join(ROOT, "docs", "results")):
        code = document["machine"]["code"]
        assert re.fullmatch(r"[0-9a-f]{40}", code["commit"]), name
        assert document["machine"]["hostname"], name
        kind = report.benchmark_of(document)
        if kind == "dcp":
            assert document["config"]["ranks"] and document["results"]["ceiling_write"], name
        elif kind is None:  # the checkpoint benchmark
            assert document["settings"]["model"], name
            assert document["order"]["seed"] is not None and "ceiling" in document, name  # None with --no-ceiling
        else:  # the other benchmarks: their parameters and results
            assert kind in report.RENDERERS, name
            assert document.get("config") or document.get("settings"), name
            assert document.get("results") or document.get("save"), name


def test_no_table_outside_the_generated_blocks_holds_a_figure():
    for path in report.doc_files(ROOT):
        with open(path, encoding="utf-8") as f:
            text = _outside_generated_blocks(f.read())
        typed = [line for line in text.splitlines() if line.startswith("|") and FIGURE.search(line)]
        assert typed == [], f"{path}: figures typed into a table; generate them from docs/results/"


def test_readme_and_benchmarks_have_their_blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "<!-- fastpersist:summary -->" in f.read()
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        assert "<!-- fastpersist:results -->" in f.read()


@pytest.fixture()
def repo(tmp_path):
    """A copy of the docs with one synthetic result."""
    (tmp_path / "docs" / "results").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    shutil.copy(os.path.join(ROOT, "docs", "benchmarks.md"), tmp_path / "docs" / "benchmarks.md")
    g = {"median": 2.5, "min": 2.0, "max": 3.0, "n": 3}
    summary = {
        "gbps": g,
        "seconds": {"median": 1.0},
        "blocked_seconds": None,
        "rss_delta_bytes": {"median": 0},
        "peak_rss_bytes": {"median": 0},
    }
    document = {
        "schema": "fastpersist.bench.checkpoint/1",
        "machine": {
            "hostname": "box",
            "cpu_count": 2,
            "ram_bytes": 1 << 30,
            "torch": "2.13",
            "date": "today",
            "filesystem": {"type": "ext4"},
            "code": {"fastpersist": "0.1.0", "commit": "a" * 40},
        },
        "settings": {
            "model": "toy",
            "layers": 2,
            "model_layers": 2,
            "dtype": "bf16",
            "device": "cpu",
            "repeats": 3,
            "warmup": 1,
            "dir": "/x",
        },
        "state": {"bytes": 10**9, "tensors": 3},
        "order": {"seed": 0, "rounds": []},
        "ceiling": {
            "write": {
                "gbps": 2.0,
                "best": {"tool": "engine", "block_size": 1 << 24, "queue_depth": 8},
                "samples": [{"gbps": 2.0}],
            },
            "read": {"gbps": None, "best": None, "samples": []},
        },
        "baselines": {"save": "torch.save", "load": "torch.load"},
        "results": [
            {"op": "save", "method": "torch.save", "label": "torch.save + fsync", "status": "ok", "summary": summary},
            {"op": "save", "method": "fastpersist", "label": "fastpersist.save", "status": "ok", "summary": summary},
        ],
    }
    (tmp_path / "docs" / "results" / "r.json").write_text(json.dumps(document))
    return tmp_path, document


def test_update_fills_the_blocks_and_check_sees_an_edit(repo):
    root, _ = repo
    assert report.update_docs(str(root)) == [str(root / "README.md"), str(root / "docs" / "benchmarks.md")]
    assert report.update_docs(str(root), check=True) == []
    readme = (root / "README.md").read_text()
    assert "| [r.json](docs/results/r.json) |" in readme and "2.50 (1.00x) MEASUREMENT PROBLEM" in readme
    benchmarks = (root / "docs" / "benchmarks.md").read_text()
    assert "### r.json" in benchmarks and "at commit aaaaaaaaaaaa" in benchmarks
    (root / "docs" / "benchmarks.md").write_text(benchmarks.replace("2.50", "9.99", 1))
    assert report.update_docs(str(root), check=True) == [str(root / "docs" / "benchmarks.md")]
    assert report.main(["--check-docs", "--root", str(root)]) == 1
    assert report.main(["--update-docs", "--root", str(root)]) == 0
    assert report.main(["--check-docs", "--root", str(root)]) == 0


def test_a_result_without_a_code_version_is_refused(repo):
    root, document = repo
    del document["machine"]["code"]
    (root / "docs" / "results" / "r.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="re-measure it"):
        report.update_docs(str(root))
    assert report.main(["--update-docs", "--root", str(root)]) == 2
