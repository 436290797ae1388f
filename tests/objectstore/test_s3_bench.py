"""``python -m fastpersist.bench s3`` runs end to end against its own moto server and writes a renderable document.

Benchmarks are not tests: nothing here looks at speed, only at the document's
structure and that every load was compared with the saved state.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("boto3", reason="the s3 benchmark needs boto3 (pip install fastpersist[test])")
pytest.importorskip("moto.server", reason="the s3 benchmark needs moto[server] (pip install fastpersist[test])")


def test_tiny_run_writes_a_verified_document(tmp_path, monkeypatch):
    from fastpersist.bench import report, s3

    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "s3.json"
    status = s3.main(["--size", "8M", "--repeats", "1", "--part-size", "5M", "--concurrency", "2", "--json", str(out)])
    document = json.loads(out.read_text())

    assert status == 0, document["problems"]
    assert document["benchmark"] == "s3" and report.benchmark_of(document) == "s3"
    commit = document["machine"]["code"]["commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit)  # None outside a git checkout
    assert document["machine"]["hostname"]
    assert document["config"]["bytes"] == 8 << 20
    assert document["config"]["s3_part_size"] == 5 << 20 and document["config"]["s3_concurrency"] == 2
    assert document["config"]["endpoint"].startswith("http://127.0.0.1:")
    for kind in ("save", "load"):
        for method in ("fastpersist", "boto3"):
            entry = document["results"][kind][method]
            assert entry["status"] == "ok", entry
            assert entry["seconds"]["n"] == 1 and entry["gb_per_s"]["median"] > 0
            assert entry["peak_extra_rss_bytes"]["max"] >= entry["peak_extra_rss_bytes"]["median"]
        for method in ("s3fs", "s3torchconnector"):  # other libraries: a failure (e.g. against moto) is reported
            entry = document["results"][kind][method]
            assert entry["status"] in ("ok", "skipped", "failed"), entry
            assert entry["status"] == "ok" or entry["reason"], entry
    assert document["results"]["load"]["fastpersist"]["verified"] is True
    assert document["results"]["load"]["boto3"]["verified"] is True
    assert all(outcome is True for outcome in document["cross_reads"].values()) and len(document["cross_reads"]) == 2
    assert set(document["ratios"]) == {"save: fastpersist / boto3", "load: fastpersist / boto3"}

    markdown = s3.to_markdown(document)
    assert "| save | fastpersist.save(state, 's3://...') |" in markdown and "PROBLEM" not in markdown
    block = "<!-- fastpersist:s3 -->\n<!-- /fastpersist -->"
    rendered = report.render_docs(block, [("tiny.json", document)])
    assert "`docs/results/tiny.json`" in rendered and "boto3 get_object" in rendered


def test_state_has_the_size_asked_for():
    from fastpersist.bench import s3
    from fastpersist.tuning import workloads

    tensors, objects = workloads.flatten_state(s3.make_state(40 << 20))
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == 40 << 20
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16, torch.float32}
    assert objects["step"] == 1000
