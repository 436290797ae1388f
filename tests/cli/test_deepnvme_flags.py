"""DeepSpeed command lines with the program name replaced: ds_io -> ``fastpersist bench io``, ds_nvme_tune -> ``fastpersist tune``."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from fastpersist import cli
from fastpersist.bench import io as bench_io
from fastpersist.tuning import deepnvme
from fastpersist.tuning import tuner as tune

_M = 1 << 20


# ----------------------------------------------------------------------------- ds_io -> bench io


def _io(*argv: str) -> argparse.Namespace:
    return bench_io.apply_ds_io(bench_io.build_parser().parse_args(list(argv)))


def test_ds_io_flags_map_onto_the_engine_settings(tmp_path):
    args = _io(
        "--folder",
        str(tmp_path),
        "--io_size",
        "400M",
        "--block_size",
        "8K",
        "--queue_depth",
        "64",
        "--single_submit",
        "--sequential_requests",
        "--io_parallel",
        "4",
        "--loops",
        "5",
        "--warmup_loops",
        "2",
        "--handle",
        "--engine",
        "aio_handle",
        "--use_accelerator_pin_memory",
        "--validate",
        "--multi_process",
        "1",
    )
    assert args.ds_io and args.dir == str(tmp_path)
    assert args.size == 400 * _M and args.block_size == 8 << 10 and args.queue_depth == 64
    assert args.single_submit and args.no_overlap_events  # overlap_events = not --sequential_requests
    assert args.threads == 4 and args.repeats == 5 and args.warmup_loops == 2
    assert args.engine == "auto" and args.validate and args.device == "cpu"
    assert args.mode == "write"  # ds_io writes unless --read
    assert _io("--folder", str(tmp_path), "--io_size", "1G", "--read").mode == "read"
    assert _io("--folder", str(tmp_path), "--io_size", "1G", "--engine", "aio_basic").engine == "auto"


def test_ds_io_defaults_and_our_own_flags_are_unchanged(tmp_path):
    ds = _io("--folder", str(tmp_path), "--io_size", "1G")
    assert ds.block_size == _M and ds.queue_depth == 32 and ds.threads == 1 and ds.repeats == 3
    assert not ds.single_submit and not ds.no_overlap_events
    ours = _io("--dir", str(tmp_path), "--size", "2G", "--block-size", "4M", "--queue-depth", "8", "--threads", "2")
    assert not ours.ds_io and ours.mode == "both" and ours.size == 2 << 30 and ours.block_size == 4 * _M
    assert ours.queue_depth == 8 and ours.threads == 2 and ours.engine == "auto"
    plain = _io()
    assert plain.dir == "." and plain.size == 1 << 30 and plain.block_size == 16 * _M and plain.mode == "both"


def test_ds_io_folder_to_device_mapping(tmp_path):
    args = _io("--folder_to_device_mapping", f"{tmp_path}:0", "--io_size", "8M")
    assert args.ds_io and args.dir == str(tmp_path) and args.device == "cpu"
    with pytest.raises(bench_io.UsageError, match="one command per folder"):
        _io("--folder_to_device_mapping", f"{tmp_path}:0", f"{tmp_path}:1", "--io_size", "8M")
    with pytest.raises(bench_io.UsageError, match="FOLDER:DEVICE"):
        _io("--folder_to_device_mapping", str(tmp_path), "--io_size", "8M")
    with pytest.raises(bench_io.UsageError, match="cannot be specified together"):
        _io("--folder", str(tmp_path), "--folder_to_device_mapping", f"{tmp_path}:0", "--io_size", "8M")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--use_gds"], "add --gpu"),
        (["--gds_path", "cufile"], "--use_gds only"),
        (["--engine", "torch_io"], "fastpersist.bench checkpoint"),
        (["--engine", "torch_fastio"], "not provided"),
        (["--torch_legacy_save"], "torch_fastio"),
        (["--fast_io_size", "64M"], "torch_fastio"),
        (["--slow_bounce_buffer"], "not supported"),
        (["--multi_process", "2"], "only 1 process"),
        (["--read", "--mode", "write"], "contradicts"),
        (["--validate", "--no-verify"], "contradicts"),
    ],
)
def test_ds_io_unsupported_flags_are_clear_errors(tmp_path, extra, message):
    with pytest.raises(bench_io.UsageError, match=message):
        _io("--folder", str(tmp_path), "--io_size", "8M", *extra)


def test_ds_io_use_gds_needs_gpu_as_ds_io_does(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_io.main(["--folder", str(tmp_path), "--io_size", "8M", "--use_gds"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--use_gds moves a CUDA tensor: add --gpu" in err


def test_ds_io_use_gds_parses_with_the_gds_path(tmp_path):
    args = bench_io.build_parser().parse_args(
        ["--folder", str(tmp_path), "--io_size", "8M", "--gpu", "--use_gds", "--gds_path", "bounce"]
    )
    assert args.use_gds and args.gpu and args.gds_path == "bounce"
    assert bench_io.build_parser().parse_args(["--use_gds"]).gds_path is None  # the gds_path setting decides
    with pytest.raises(SystemExit):
        bench_io.build_parser().parse_args(["--use_gds", "--gds_path", "direct"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_ds_io_use_gds_without_cuda_is_the_gpu_error(tmp_path):
    with pytest.raises(bench_io.UsageError, match="--gpu needs a CUDA device"):
        _io("--folder", str(tmp_path), "--io_size", "8M", "--gpu", "--use_gds")


@pytest.mark.gpu
def test_ds_io_use_gds_runs_gds_handle(tmp_path, capsys):
    argv = ["--folder", str(tmp_path), "--io_size", "4M", "--gpu", "--use_gds", "--loops", "1", "--validate"]
    assert bench_io.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["handle"] == "gds_handle" and doc["settings"]["gds_path"] in ("cufile", "bounce")
    assert doc["gbps_median"]["engine_write"] > 0
    assert bench_io.main([*argv, "--read", "--gds_path", "bounce"]) == 0
    out = capsys.readouterr().out
    assert "GdsHandle path bounce" in out and "E2E Read Speed = " in out
    assert list(tmp_path.iterdir()) == []


def test_ds_io_sizes_take_ds_io_syntax():
    parser = bench_io.build_parser()
    for text, value in (("400M", 400 * _M), ("1G", 1 << 30), ("8K", 8 << 10), ("4096", 4096)):
        assert parser.parse_args(["--io_size", text, "--block_size", text]).io_size == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--io_size", "4X"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_ds_io_gpu_without_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(bench_io.UsageError, match="--gpu needs a CUDA device"):
        _io("--folder", str(tmp_path), "--io_size", "8M", "--gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ds_io_gpu_maps_the_device_of_the_folder_mapping(tmp_path):
    assert _io("--folder_to_device_mapping", f"{tmp_path}:0", "--io_size", "8M", "--gpu").device == "cuda:0"


def test_ds_io_summary_uses_ds_io_wording():
    doc = {"settings": {"size": 1 << 30}, "seconds_median": {"engine_write": 0.5, "engine_read": None}}
    assert bench_io.ds_io_summary(doc) == ["E2E Write Latency = 0.5 sec", "E2E Write Speed = 2.0 GB/sec"]


def test_ds_io_command_line_runs_write_then_read(tmp_path, capsys):
    common = ["--folder", str(tmp_path), "--io_size", "1M", "--block_size", "256K", "--queue_depth", "4"]
    assert cli.main(["bench", "io", *common, "--io_parallel", "2", "--loops", "1", "--validate", "--handle"]) == 0
    out = capsys.readouterr().out
    assert "E2E Write Latency = " in out and "E2E Write Speed = " in out and "E2E Read" not in out
    assert "fastpersist io bench" in out  # our own table too
    argv = [*common, "--read", "--loops", "1", "--warmup_loops", "1", "--sequential_requests", "--single_submit"]
    assert bench_io.main(argv) == 0
    out = capsys.readouterr().out
    assert "E2E Read Speed = " in out and "E2E Write" not in out
    assert list(tmp_path.iterdir()) == []  # nothing left behind


# ----------------------------------------------------------------------------- ds_nvme_tune -> tune


def _tune(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_ds_nvme_tune_flags_map_onto_the_tuner(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(
        json.dumps(
            {
                "block_size": ["128K", "1M"],
                "queue_depth": [8, 16],
                "sequential_requests": [True],
                "single_submit": [False, True],
                "io_parallel": [1, 2],
            }
        )
    )
    args = deepnvme.apply(
        _tune(
            "--nvme_dir",
            str(tmp_path),
            "--sweep_config",
            str(sweep),
            "--io_size",
            "8M",
            "--loops",
            "2",
            "--no_read",
            "--flush_page_cache",
            "--log_dir",
            str(tmp_path / "logs"),
            "--verbose",
        )
    )
    assert args.dir == str(tmp_path) and args.size == "8M" and args.repeats == 2 and args.optimize == "save"
    assert args.knob_values == {
        "block_size": (128 << 10, _M),
        "queue_depth": (8, 16),
        "overlap_events": (False,),
        "single_submit": (False, True),
        "intra_op_parallelism": (1, 2),
    }
    assert args.json == str(tmp_path / "logs" / "fastpersist-tune.json") and (tmp_path / "logs").is_dir()
    assert not args.no_drop_caches  # the page cache is dropped anyway
    assert deepnvme.apply(_tune("--nvme_dir", str(tmp_path), "--no_write")).optimize == "load"


def test_ds_nvme_tune_defaults_follow_ds_nvme_tune(tmp_path):
    args = deepnvme.apply(_tune("--nvme_dir", str(tmp_path)))
    assert args.size == "400M" and args.repeats == 1 and args.optimize == "both" and args.device == "cpu"
    assert args.knob_values == deepnvme.sweep_knobs(deepnvme.DEFAULT_SWEEP_CONFIG)
    assert args.knob_values["overlap_events"] == (False, True)  # sequential_requests [True, False]
    ours = deepnvme.apply(_tune("--dir", str(tmp_path), "--size", "1G", "--repeats", "3", "--optimize", "load"))
    assert ours.dir == str(tmp_path) and ours.size == "1G" and ours.repeats == 3 and ours.knob_values is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--no_read", "--no_write"], "nothing to measure"),
        (["--no_read", "--optimize", "load"], "contradict"),
        (["--loops", "2", "--repeats", "3"], "same thing"),
    ],
)
def test_ds_nvme_tune_unsupported_flags_are_clear_errors(tmp_path, extra, message):
    with pytest.raises(deepnvme.UsageError, match=message):
        deepnvme.apply(_tune("--nvme_dir", str(tmp_path), *extra))


def test_ds_nvme_tune_bad_inputs(tmp_path):
    with pytest.raises(deepnvme.UsageError, match="once per directory"):
        deepnvme.apply(_tune("--nvme_dir", str(tmp_path), str(tmp_path)))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"thread_count": [1]}))
    with pytest.raises(deepnvme.UsageError, match="unknown key 'thread_count'"):
        deepnvme.apply(_tune("--nvme_dir", str(tmp_path), "--sweep_config", str(bad)))
    bad.write_text(json.dumps({"single_submit": ["yes"]}))
    with pytest.raises(deepnvme.UsageError, match="true/false"):
        deepnvme.apply(_tune("--nvme_dir", str(tmp_path), "--sweep_config", str(bad)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_ds_nvme_tune_gds_without_cuda_is_a_clear_error_from_the_command(tmp_path, capsys):
    assert cli.main(["tune", "--nvme_dir", str(tmp_path), "--gds"]) == 2
    err = capsys.readouterr().err
    assert "--gds tunes GdsHandle" in err and "needs a CUDA device" in err and "drop --gds" in err


@pytest.mark.gpu
def test_ds_nvme_tune_gds_sweeps_the_handle_settings(tmp_path):
    args = deepnvme.apply(_tune("--nvme_dir", str(tmp_path), "--gds"))
    assert args.gpu and args.device == "cuda"
    assert args.knob_values == deepnvme.sweep_knobs(deepnvme.DEFAULT_SWEEP_CONFIG)
    subset = deepnvme.apply(_tune("--dir", str(tmp_path), "--gds", "--settings", "block_size,queue_depth"))
    assert set(subset.knob_values) == {"block_size", "queue_depth"}
    with pytest.raises(deepnvme.UsageError, match="handle's settings"):
        deepnvme.apply(_tune("--dir", str(tmp_path), "--gds", "--settings", "buffer_size"))


@pytest.mark.gpu
def test_ds_nvme_tune_gds_command_line_runs(tmp_path, capsys):
    work = tmp_path / "nvme"
    work.mkdir()
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["1M"], "queue_depth": [8], "io_parallel": [1, 2]}))
    argv = ["tune", "--nvme_dir", str(work), "--gds", "--io_size", "8M", "--loops", "1", "--sweep_config", str(sweep)]
    assert cli.main([*argv, "--model", "toy", "--out", str(tmp_path / "cfg.json")]) == 0
    out = capsys.readouterr().out
    assert "Best performance (GB/sec): read = " in out and "GdsHandle data path: " in out
    assert list(work.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_ds_nvme_tune_gpu_without_cuda_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["tune", "--nvme_dir", str(tmp_path), "--gpu"]) == 2
    assert "--gpu needs a CUDA device" in capsys.readouterr().err


def test_aio_config_is_deepspeed_json():
    recommended = {"block_size": _M, "queue_depth": 32, "intra_op_parallelism": 8, "overlap_events": True}
    aio = deepnvme.aio_config(recommended)["aio"]
    assert aio == {
        "single_submit": "false",
        "overlap_events": "true",
        "intra_op_parallelism": 8,
        "queue_depth": 32,
        "block_size": _M,
    }
    text = deepnvme.format_aio(recommended, 3.69, 3.18)
    assert text.startswith("Best performance (GB/sec): read =  3.69, write =  3.18\n")
    assert json.loads(text.split("\n", 1)[1]) == {"aio": aio}


def test_ds_nvme_tune_command_line_runs(tmp_path, capsys):
    work = tmp_path / "nvme"
    work.mkdir()
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["1M", "2M"], "queue_depth": [8], "io_parallel": [1]}))
    argv = [
        "tune",
        "--nvme_dir",
        str(work),
        "--io_size",
        "4M",
        "--loops",
        "1",
        "--sweep_config",
        str(sweep),
        "--log_dir",
        str(tmp_path / "logs"),
        "--model",
        "toy",
        "--out",
        str(tmp_path / "cfg.json"),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    block = out[out.index("Best performance (GB/sec)") :].split("\n", 1)[1]
    aio = json.loads(block[: block.index("\n}\n") + 2])["aio"]
    assert aio["block_size"] in (_M, 2 * _M) and aio["queue_depth"] in (8, 16)
    assert "Best performance (GB/sec): read = " in out and "wrote " in out
    assert json.loads((tmp_path / "logs" / "aio_config.json").read_text())["aio"] == aio
    assert (tmp_path / "logs" / "fastpersist-tune.json").exists() and (tmp_path / "cfg.json").exists()
    assert list(work.iterdir()) == []
