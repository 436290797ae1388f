"""The checkpoint benchmark: model catalogue, runner, verification, reports.

Behaviour only; no timing is asserted (speed is the benchmark's job).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zipfile

import pytest
import torch

from fastpersist import config, system
from fastpersist.bench import checkpoint, measure, methods, report
from fastpersist.tuning import workloads

_WARM = system.CacheDropper(enabled=False)  # tests that need no cold reads skip the (slow) cache drop
BASELINE_METHODS = "torch.save,torch.save-fast,safetensors,dcp,torch.load,torch.load-mmap,safetensors.load,dcp.load"


# ----------------------------------------------------------------------------- catalogue


@pytest.mark.parametrize(
    "name, parameters",
    [
        ("gpt2", 124_439_808),
        ("gpt2-xl", 1_557_611_200),
        ("llama-3.2-1b", 1_235_814_400),
        ("phi-3-mini", 3_821_079_552),
        ("llama-3-8b", 8_030_261_248),
        ("tinyllama-1.1b", 1_100_048_384),
    ],
)
def test_full_models_have_their_published_parameter_counts(name, parameters):
    spec = workloads.get_model(name)
    assert workloads.parameter_count(spec, spec.num_layers) == parameters
    assert spec.published_parameters == parameters


def test_gpt2_small_shapes_are_exact_and_the_tied_head_is_stored_once():
    spec = workloads.get_model("gpt2")
    shapes = dict(workloads.parameter_shapes(spec))
    assert shapes["transformer.wte.weight"] == (50257, 768)
    assert shapes["transformer.wpe.weight"] == (1024, 768)
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (768, 2304)  # Conv1D: (in, out)
    assert shapes["transformer.h.11.mlp.c_proj.weight"] == (3072, 768)
    assert shapes["transformer.ln_f.bias"] == (768,)
    assert "lm_head.weight" not in shapes  # tied to wte: one storage, saved once
    assert len(shapes) == 2 + 12 * 12 + 2
    # 124,439,808 counts wte once; an untied head would add 38,597,376
    assert sum(math.prod(s) for s in shapes.values()) == 124_439_808


def test_llama_and_phi3_shapes_are_exact():
    llama1b = dict(workloads.parameter_shapes(workloads.get_model("llama-3.2-1b")))
    assert llama1b["model.embed_tokens.weight"] == (128256, 2048)
    assert llama1b["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)  # 8 kv heads x 64
    assert llama1b["model.layers.15.mlp.down_proj.weight"] == (2048, 8192)
    assert "lm_head.weight" not in llama1b  # tie_word_embeddings=true

    llama8b = dict(workloads.parameter_shapes(workloads.get_model("llama-3-8b")))
    assert llama8b["model.layers.31.self_attn.v_proj.weight"] == (1024, 4096)
    assert llama8b["model.layers.0.mlp.gate_proj.weight"] == (14336, 4096)
    assert llama8b["lm_head.weight"] == (128256, 4096)

    phi3 = dict(workloads.parameter_shapes(workloads.get_model("phi-3-mini")))
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"] == (9216, 3072)
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"] == (16384, 3072)
    assert phi3["lm_head.weight"] == (32064, 3072)


def test_default_model_is_a_truncated_tinyllama_of_about_600_mb():
    spec = workloads.get_model(workloads.DEFAULT_MODEL)
    size = workloads.state_bytes(spec, torch.bfloat16)
    assert 0.5e9 < size < 1.0e9
    full = dict(workloads.parameter_shapes(workloads.get_model("tinyllama-1.1b")))
    for name, shape in workloads.parameter_shapes(spec):
        assert full[name] == shape


def test_layers_and_size_select_a_prefix_of_the_blocks():
    spec = workloads.get_model("llama-3-8b")
    two = workloads.parameter_shapes(spec, 2)
    assert [n for n, _ in two if ".layers." in n][-1].startswith("model.layers.1.")
    layers = workloads.layers_for_size(spec, config.parse_size("2.5G"), torch.bfloat16)
    assert (
        workloads.state_bytes(spec, torch.bfloat16, layers)
        <= 2.5 * 2**30
        < workloads.state_bytes(spec, torch.bfloat16, layers + 1)
    )
    with pytest.raises(ValueError, match="embeddings alone"):
        workloads.layers_for_size(spec, config.parse_size("1G"), torch.bfloat16)
    with pytest.raises(ValueError):
        workloads.parameter_shapes(spec, 33)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(KeyError, match="llama-3-8b"):
        workloads.get_model("nonexistent")
    assert workloads.get_model("GPT2-small").name == "gpt2"


def test_synthetic_state_is_random_deterministic_and_owns_its_storage():
    a = workloads.build_state("toy", seed=1)
    b = workloads.build_state("toy", seed=1)
    c = workloads.build_state("toy", seed=2)
    assert list(a) == [n for n, _ in workloads.parameter_shapes(workloads.get_model("toy"))]
    pointers = set()
    for name, t in a.items():
        assert t.dtype == torch.bfloat16 and t.is_contiguous()
        assert torch.equal(t, b[name])
        assert t.count_nonzero() > 0.9 * t.numel()
        pointers.add(t.untyped_storage().data_ptr())
    assert len(pointers) == len(a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_training_state_has_adam_moments_master_weights_step_and_rng():
    state = workloads.build_state("toy", training_state=True, dtype="bf16")
    n = len(state["model"])
    assert len(state["optimizer"]["state"]) == n
    first = state["optimizer"]["state"][0]
    assert first["exp_avg"].dtype == torch.float32 and first["exp_avg_sq"].min() >= 0
    assert state["optimizer"]["param_groups"][0]["params"] == list(range(n))
    assert all(t.dtype == torch.float32 for t in state["master_weights"].values())
    assert state["step"] == 1000
    assert state["rng_state"].dtype == torch.uint8
    tensors, _ = workloads.flatten_state(state)
    spec = workloads.get_model("toy")
    assert sum(
        t.numel() * t.element_size() for k, t in tensors.items() if k != "rng_state" and not k.endswith(".step")
    ) == (workloads.state_bytes(spec, torch.bfloat16, training_state=True))


# ----------------------------------------------------------------------------- verification


def test_verify_state_reports_the_first_difference():
    state = workloads.build_state("toy")
    expected = workloads.flatten_state(state)
    assert measure.verify_state(expected, workloads.flatten_state({k: v.clone() for k, v in state.items()})) is None

    changed = {k: v.clone() for k, v in state.items()}
    changed["transformer.h.1.mlp.c_fc.bias"].view(torch.uint8)[7] ^= 1
    assert "c_fc.bias: bytes differ" in measure.verify_state(expected, workloads.flatten_state(changed))

    retyped = dict(state, **{"transformer.ln_f.bias": state["transformer.ln_f.bias"].float()})
    assert "ln_f.bias" in measure.verify_state(expected, workloads.flatten_state(retyped))

    missing = dict(state)
    del missing["transformer.wpe.weight"]
    assert "missing" in measure.verify_state(expected, workloads.flatten_state(missing))


def _corrupting_save(state, path, ctx):
    """torch.save, then one flipped byte in the middle of a tensor payload (torch.load does not check CRCs)."""
    torch.save(state, path)
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        offset = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return {}


def _corrupting_load(path, state, ctx):
    loaded = methods.torch_load(path, state, ctx)
    next(iter(loaded.values())).view(torch.uint8)[0] ^= 1
    return loaded


TORCH_SAVE, TORCH_LOAD = checkpoint.SAVE_METHODS["torch.save"], checkpoint.LOAD_METHODS["torch.load"]
_CORRUPTING_SAVE = dataclasses.replace(
    TORCH_SAVE, name="corrupting-torch.save", label="torch.save with a flipped byte", save=_corrupting_save
)
_CORRUPTING_LOAD = dataclasses.replace(
    TORCH_LOAD, name="corrupting-torch.load", label="torch.load that damages a tensor", load=_corrupting_load
)


def test_a_corrupted_file_or_load_is_reported_failed_not_timed(tmp_path):
    state = workloads.build_state("toy")
    reads_corrupted = dataclasses.replace(TORCH_LOAD, name="reads-corrupted", source="corrupting-torch.save")
    results = checkpoint.run_benchmark(
        state,
        [TORCH_SAVE, _CORRUPTING_SAVE],
        [TORCH_LOAD, _CORRUPTING_LOAD, reads_corrupted],
        str(tmp_path),
        repeats=2,
        warmup=0,
    )
    by_name = {r.name: r for r in results}
    assert by_name["torch.save"].status == "ok" and len(by_name["torch.save"].samples) == 2
    bad = by_name["corrupting-torch.save"]
    assert bad.status == "FAILED" and "bytes differ" in bad.reason and bad.samples == []
    assert by_name["torch.load"].status == "ok"
    assert by_name["corrupting-torch.load"].status == "FAILED"
    assert by_name["reads-corrupted"].status == "skipped"  # never timed on a file that failed verification
    assert os.listdir(tmp_path) == []

    document = {
        "schema": checkpoint.SCHEMA,
        "machine": measure.machine_info(str(tmp_path)),
        "settings": {
            "model": "toy",
            "layers": 2,
            "model_layers": 2,
            "dtype": "bf16",
            "device": "cpu",
            "repeats": 2,
            "warmup": 0,
            "dir": str(tmp_path),
        },
        "state": {"bytes": 1, "tensors": len(state)},
        "baselines": checkpoint.BASELINES,
        "results": [r.as_dict(1) for r in results],
    }
    text = report.format_table(document)
    assert "FAILED: verification failed" in text
    markdown = report.to_markdown(document)
    row = next(line for line in markdown.splitlines() if "flipped byte" in line)
    assert "| - |" in row and "FAILED" in row


def test_a_method_that_raises_is_failed_and_its_loads_skipped(tmp_path):
    def broken(state, path, ctx):
        raise OSError(28, "No space left on device")

    results = checkpoint.run_benchmark(
        workloads.build_state("toy"),
        [dataclasses.replace(TORCH_SAVE, name="broken", save=broken)],
        [dataclasses.replace(TORCH_LOAD, name="reads-broken", source="broken")],
        str(tmp_path),
        repeats=1,
        warmup=0,
    )
    assert results[0].status == "FAILED" and "No space left" in results[0].reason
    assert results[1].status == "skipped" and "broken" in results[1].reason


# ----------------------------------------------------------------------------- end to end


def test_tiny_end_to_end_run_with_baselines_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "result.json"
    work = tmp_path / "work"
    work.mkdir()
    rc = checkpoint.main(
        [
            "--model",
            "toy",
            "--methods",
            BASELINE_METHODS,
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--dir",
            str(work),
            "--json",
            str(out),
            "--png",
            str(tmp_path / "chart.png"),
            "--no-progress",
            "--ceiling-grid-size",
            "1M",
            "--order-seed",
            "5",
            "--settle",
            "0.2",
            "--load-repeats",
            "2",
            "--memory-settle",
            "0.05",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert os.listdir(work) == []  # the temporary directory was removed
    document = report.load_result(out)
    assert document["schema"] == checkpoint.SCHEMA
    for key in ("hostname", "cpu_count", "ram_bytes", "torch", "device_name", "filesystem", "date"):
        assert key in document["machine"]
    assert document["settings"]["cache"] in ("drop_caches", "fadvise", "none")
    assert len(document["machine"]["code"]["commit"]) == 40  # which code produced the figures
    assert document["order"]["seed"] == 5 and len(document["order"]["rounds"]) == 3
    assert [len(r["load"]) for r in document["order"]["rounds"]] == [4, 8, 8]  # warm-up: one load each
    assert document["order"]["settle_seconds"] == 0.2
    assert sorted(document["order"]["rounds"][0]["save"]) == sorted(BASELINE_METHODS.split(",")[:4])
    for op in ("write", "read"):
        part = document["ceiling"][op]
        assert part["gbps"] > 0 and part["best"]["error"] is None
        assert part["gbps"] == max(s["gbps"] for s in part["samples"] if s["gbps"])
    for r in document["results"]:
        assert r["ceiling_ratio"] > 0 and r["measurement_problem"] == (r["ceiling_ratio"] > 1.0)
    assert "write ceiling" in printed and "read ceiling" in printed
    ops = {(r["op"], r["method"]): r for r in document["results"]}
    assert set(ops) == {("save", n) for n in ("torch.save", "torch.save-fast", "safetensors", "dcp")} | {
        ("load", n) for n in ("torch.load", "torch.load-mmap", "safetensors.load", "dcp.load")
    }
    assert document["settings"]["load_repeats"] == 2
    assert document["order"]["memory_settle_seconds"] == 0.05
    assert isinstance(document["machine"]["free_page_reporting"], bool)
    for r in ops.values():
        assert r["status"] == "ok", r
        timed = 2 * (2 if r["op"] == "load" else 1)  # 2 rounds; each load method twice a round
        assert len(r["samples"]) == 1 + timed and sum(1 for s in r["samples"] if s["warmup"]) == 1
        assert sorted(s["round"] for s in r["samples"] if not s["warmup"]) == sorted([1, 2] * (timed // 2))
        assert r["summary"]["gbps"]["n"] == timed
        assert r["summary"]["gbps"]["min"] <= r["summary"]["gbps"]["median"] <= r["summary"]["gbps"]["max"]
        assert r["summary"]["peak_rss_bytes"]["median"] > 0
    for r in ops.values():
        if r["op"] == "load":
            assert all(s["cache"] == document["settings"]["cache"] for s in r["samples"])
            assert all(s["file_age_seconds"] >= 0.2 for s in r["samples"])  # every loaded file settled first
            # every timed load paused after its cache drop; warm-up loads (not reported) did not
            assert {s["memory_settle_seconds"] for s in r["samples"]} == {0.0, 0.05}
            assert all(s["memory_settle_seconds"] == (0.0 if s["warmup"] else 0.05) for s in r["samples"])
    assert "torch.save + fsync" in printed and "verified" in printed
    assert "median of 2 rounds after 1 warm-up (loads: 2 per round, 4 in all)" in printed
    assert "equal conditions: before every load, memory released and the page cache dropped, then a 0.05 s pause" in (
        printed
    )

    markdown = report.to_markdown([document, document])
    assert markdown.count("| op | method | GB/s |") == 2
    assert "| save | torch.save + fsync |" in markdown
    assert "1.00x" in markdown  # the baseline row

    capsys.readouterr()
    assert checkpoint.main(["--markdown", str(out)]) == 0
    assert capsys.readouterr().out.strip() == report.to_markdown(document).strip()


def test_training_state_round_trips_through_every_baseline(tmp_path):
    state = workloads.build_state("toy", training_state=True)
    saves = [checkpoint.SAVE_METHODS[n] for n in ("torch.save", "safetensors", "dcp")]
    loads = [checkpoint.LOAD_METHODS[n] for n in ("torch.load", "torch.load-mmap", "safetensors.load", "dcp.load")]
    results = checkpoint.run_benchmark(state, saves, loads, str(tmp_path), repeats=1, warmup=0, dropper=_WARM)
    assert [(r.name, r.status, r.reason) for r in results if r.status != "ok"] == []


def test_every_timed_load_and_each_rounds_saves_follow_a_release_a_drop_and_the_memory_pause(tmp_path, monkeypatch):
    events = []

    class Dropper:
        mode = detail = "recorded"

        def drop(self, paths):
            events.append("drop")
            return "recorded"

    monkeypatch.setattr(system, "release_memory", lambda collect=True: events.append("release"))
    monkeypatch.setattr(checkpoint.time, "sleep", lambda seconds: events.append(("sleep", seconds)))
    real_timed = checkpoint._timed
    monkeypatch.setattr(checkpoint, "_timed", lambda result, op, *a: events.append(op) or real_timed(result, op, *a))
    results = checkpoint.run_benchmark(
        workloads.build_state("toy"),
        [TORCH_SAVE],
        [TORCH_LOAD, checkpoint.LOAD_METHODS["torch.load-mmap"]],
        str(tmp_path),
        repeats=1,
        warmup=1,
        dropper=Dropper(),
        settle_seconds=5.0,
        memory_settle_seconds=2.0,
    )
    assert all(r.status == "ok" for r in results)
    timed = events[events.index("load") + 1 :]
    timed = timed[next(i for i, e in enumerate(timed) if e == "release" and timed[i + 1] == ("sleep", 2.0)) :]
    # the timed round: the pause before its saves (each save releasing memory first), the settle less the
    # first load's pause, then per load release -> drop -> pause -> load (no release between pause and load)
    assert timed[:4] == ["release", ("sleep", 2.0), "release", "save"]
    assert ("sleep", 3.0) in timed
    loads = [i for i, e in enumerate(timed) if e == "load"]
    assert len(loads) == 2
    for i in loads:
        assert timed[i - 3 : i] == ["release", "drop", ("sleep", 2.0)]
    warmup = events[: events.index("load") + 1]
    assert ("sleep", 5.0) in warmup and ("sleep", 2.0) not in warmup  # warm-up: full settle, no memory pause
    for result in results:
        if result.op == "load":
            assert [s["memory_settle_seconds"] for s in result.samples] == [0.0, 2.0]
            assert all(s["cache"] == "recorded" for s in result.samples)


def test_memory_settle_defaults_to_a_pause_only_where_freed_memory_goes_back_to_the_host(tmp_path, monkeypatch):
    seen = []
    real = checkpoint.run_benchmark

    def recording(*args, **kwargs):
        seen.append(kwargs["memory_settle_seconds"])
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "run_benchmark", recording)
    monkeypatch.setattr(checkpoint.time, "sleep", lambda seconds: None)  # the pauses themselves are not tested here
    arguments = ["--model", "toy", "--methods", "torch.save,torch.load", "--repeats", "1", "--warmup", "0"]
    arguments += ["--dir", str(tmp_path), "--no-progress", "--no-ceiling", "--no-drop-caches", "--settle", "0"]
    for reporting, expected in ((True, 2.5), (False, 0.0)):
        monkeypatch.setattr(system, "free_page_reporting", lambda reporting=reporting: reporting)
        assert checkpoint.main(arguments) == 0
        assert seen[-1] == expected
    assert checkpoint.main(arguments + ["--memory-settle", "0.5"]) == 0
    assert seen[-1] == 0.5
    assert checkpoint.BENCHMARK.parser().parse_args([]).load_repeats == 1


def test_a_load_without_its_save_runs_that_save_untimed(tmp_path):
    results = checkpoint.run_benchmark(
        workloads.build_state("toy"), [], [TORCH_LOAD], str(tmp_path), repeats=1, warmup=0
    )
    helper, load = results
    assert helper.name == "torch.save" and not helper.timed and helper.status == "ok"
    assert load.status == "ok" and len(load.samples) == 1


def test_bad_arguments_are_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        checkpoint.main(["--model", "nonexistent", "--dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        checkpoint.main(["--methods", "torch.save,nope", "--dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        checkpoint.main(["--load-repeats", "0", "--dir", str(tmp_path)])
    assert "--load-repeats must be at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="load_repeats"):
        checkpoint.run_benchmark({}, [], [], str(tmp_path), load_repeats=0)
    with pytest.raises(SystemExit):
        checkpoint.main(["--memory-settle", "-1", "--dir", str(tmp_path)])
    assert "--memory-settle must be at least 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="memory_settle_seconds"):
        checkpoint.run_benchmark({}, [], [], str(tmp_path), memory_settle_seconds=-1)
    assert checkpoint.main(["--list-models"]) == 0
    assert "llama-3-8b" in capsys.readouterr().out


def test_markdown_rejects_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a result"):
        report.load_result(path)


def test_png_is_written_or_skipped_with_a_note(tmp_path):
    document_path = tmp_path / "r.json"
    checkpoint.main(
        [
            "--model",
            "toy",
            "--methods",
            "torch.save,torch.load",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--dir",
            str(tmp_path),
            "--json",
            str(document_path),
            "--no-progress",
            "--no-drop-caches",
            "--no-ceiling",
            "--settle",
            "0",
            "--memory-settle",
            "0",
        ]
    )
    note = report.save_png(report.load_result(document_path), tmp_path / "c.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert note.startswith("skipped: matplotlib")
    else:
        assert (tmp_path / "c.png").stat().st_size > 0


def test_peak_memory_sees_an_allocation():
    with measure.PeakMemory() as memory:
        block = torch.ones(64 << 20, dtype=torch.uint8)
        del block
    assert memory.delta >= 48 << 20


# ----------------------------------------------------------------------------- fastpersist methods


def test_fastpersist_methods_run_and_verify(tmp_path):
    state = workloads.build_state("toy")
    saves = [checkpoint.SAVE_METHODS[n] for n in ("torch.save", "fastpersist", "fastpersist-async")]
    loads = [checkpoint.LOAD_METHODS[n] for n in ("fastpersist.load", "fastpersist.load-torchfile")]
    results = checkpoint.run_benchmark(state, saves, loads, str(tmp_path), repeats=1, warmup=0)
    assert [(r.name, r.status, r.reason) for r in results if r.status != "ok"] == []
    async_result = next(r for r in results if r.name == "fastpersist-async")
    assert async_result.samples[0]["blocked_seconds"] <= async_result.samples[0]["seconds"]
    assert os.listdir(tmp_path) == []


def test_fastpersist_training_state_round_trips(tmp_path):
    state = workloads.build_state("toy", training_state=True)
    saves = [checkpoint.SAVE_METHODS[n] for n in ("fastpersist", "fastpersist-async")]
    loads = [checkpoint.LOAD_METHODS["fastpersist.load"]]
    results = checkpoint.run_benchmark(state, saves, loads, str(tmp_path), repeats=1, warmup=0)
    assert [(r.name, r.status, r.reason) for r in results if r.status != "ok"] == []


@pytest.mark.gpu
def test_cuda_state_round_trips_through_every_method(tmp_path):
    state = workloads.build_state("toy", device="cuda")
    ctx = checkpoint.BenchContext(device=torch.device("cuda", 0))
    saves = [m for m in checkpoint.SAVE_METHODS.values() if m.default]
    loads = [m for m in checkpoint.LOAD_METHODS.values() if m.default]
    results = checkpoint.run_benchmark(state, saves, loads, str(tmp_path), ctx=ctx, repeats=1, warmup=0)
    assert [(r.name, r.status, r.reason) for r in results if r.status == "FAILED"] == []


def test_keyboard_interrupt_removes_the_temporary_directory(tmp_path, monkeypatch, capsys):
    def interrupting(state, path, ctx):
        torch.save(state, path)  # leaves a file behind in the work directory
        raise KeyboardInterrupt

    method = dataclasses.replace(TORCH_SAVE, name="interrupting", save=interrupting)
    monkeypatch.setitem(checkpoint.SAVE_METHODS, "interrupting", method)
    rc = checkpoint.main(
        [
            "--model",
            "toy",
            "--methods",
            "torch.save,interrupting",
            "--dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "never.json"),
            "--no-progress",
            "--no-ceiling",
        ]
    )
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_optional_raw_write_ceiling_round_trips(tmp_path):
    results = checkpoint.run_benchmark(
        workloads.build_state("toy"),
        [checkpoint.SAVE_METHODS["os.write"]],
        [],
        str(tmp_path),
        repeats=1,
        warmup=0,
        dropper=_WARM,
    )
    assert results[0].status == "ok" and results[0].file_bytes == workloads.state_bytes(
        workloads.get_model("toy"), torch.bfloat16
    )
