"""Every command is one module of fastpersist/cli/, registered by one line."""

from __future__ import annotations

import os

import pytest

from fastpersist import cli
from fastpersist.cli import main


def test_every_command_is_a_cli_module():
    commands = {name: entry for name, entry in cli.COMMANDS.items() if isinstance(entry, str)}
    assert {"info", "verify", "tune", "bench"} <= set(commands)
    for name, module in commands.items():
        assert module == f"fastpersist.cli.{name}"
        assert os.path.exists(os.path.join(os.path.dirname(cli.__file__), f"{name}.py"))


def test_bench_runs_a_benchmark_with_its_own_options(capsys):
    assert cli.main(["bench", "checkpoint", "--list-models"]) == 0
    assert "llama-3-8b" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "bench",
                "report",
                "--check-docs",
                "--root",
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            ]
        )
        == 0
    )


def _bench_helps(capsys) -> dict[str, str]:
    """What ``fastpersist bench --help`` and ``python -m fastpersist.bench --help`` print."""
    from fastpersist.bench.__main__ import main as bench_main

    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--help"])
    assert exit_.value.code == 0
    helps = {"fastpersist bench --help": capsys.readouterr().out}
    assert bench_main(["--help"]) == 0
    helps["python -m fastpersist.bench --help"] = capsys.readouterr().out
    return helps


def test_both_bench_helps_list_every_registered_benchmark_with_its_description(capsys, monkeypatch):
    from fastpersist import bench

    assert len(bench.SUBCOMMANDS) >= 13
    for where, text in _bench_helps(capsys).items():
        lines = text.splitlines()
        for name, (_, description) in bench.SUBCOMMANDS.items():
            assert any(line.split() == [name, *description.split()] for line in lines), (where, name)
    # The helps read the one registry: a benchmark registered later is listed too.
    monkeypatch.setitem(bench.SUBCOMMANDS, "made_up", ("fastpersist.bench.made_up", "a benchmark added by a test"))
    for where, text in _bench_helps(capsys).items():
        assert "  made_up" in text and "a benchmark added by a test" in text, where


def test_tune_has_its_options(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["tune", "--quick", "--dir", "/tmp", "--optimize", "save"])
    assert (args.quick, args.optimize) == (True, "save")


def test_merge_of_an_ordinary_checkpoint_says_there_is_nothing_to_merge(tmp_path, capsys):
    import torch

    torch.save({"w": torch.ones(3)}, tmp_path / "ckpt.pt")
    assert main(["merge", str(tmp_path / "ckpt.pt"), str(tmp_path / "out.pt")]) == 2
    error = capsys.readouterr().err
    assert "already a single checkpoint" in error and "damaged" not in error
    assert not (tmp_path / "out.pt").exists()


def test_tune_and_bench_with_a_size_too_small_suggest_a_smaller_model(tmp_path, capsys):
    assert main(["tune", "--dir", str(tmp_path), "--size", "1M"]) == 2
    assert "pick a smaller --model (toy: from" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "checkpoint", "--size", "1M", "--dir", str(tmp_path)])
    assert exit_.value.code == 2 and "pick a smaller --model (toy" in capsys.readouterr().err


def test_gpu_acceptance_script_says_it_needs_a_gpu(tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    # python3 must be this interpreter (the script calls python3): a shim directory first on PATH.
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").symlink_to(sys.executable)
    env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        ["bash", os.path.join(root, "examples", "gpu_acceptance.sh"), str(tmp_path / "out"), "tests"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr + done.stdout


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_of_a_dcp_checkpoint_directory(tmp_path, capsys):
    """`fastpersist verify DIR` checks a DCP checkpoint's items (their CRC-32s are in its .metadata and archives)."""
    import json
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from fastpersist.dcp import FastPersistWriter

    state = {"weight": torch.randn(300, 7), "step": 3}
    dcp.save(state, storage_writer=FastPersistWriter(str(tmp_path / "ckpt")), no_dist=True)
    assert main(["verify", str(tmp_path / "ckpt")]) == 0
    assert capsys.readouterr().out.startswith(f"OK       {tmp_path / 'ckpt'}: 2 items, ")
    assert main(["verify", "--json", str(tmp_path / "ckpt")]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["status"] == "ok" and entry["records"] == 2 and entry["checksummed"]
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        info = next(i for index, i in pickle.load(f).storage_data.items() if index.fqn == "weight")
    with open(tmp_path / "ckpt" / info.relative_path, "r+b") as f:
        f.seek(info.fastpersist["offset"] + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    assert main(["verify", str(tmp_path / "ckpt")]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert main(["verify", "--json", str(tmp_path / "ckpt")]) == 1
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["kind"] == "checksum" and entry["record"] == "weight"
    (tmp_path / "plain").mkdir()
    assert main(["verify", str(tmp_path / "plain")]) == 2
    error = capsys.readouterr().err
    assert "IsADirectoryError" in error and "without a DCP checkpoint's .metadata" in error
