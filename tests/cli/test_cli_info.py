"""``fastpersist info``: what the machine offers, as text and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastpersist import cli


def test_info_json_in_process(tmp_path, capsys):
    assert cli.main(["info", "--json", "--dir", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) >= {"versions", "engines", "directory", "memory", "cuda"}
    assert set(info["versions"]) == {"fastpersist", "torch", "python", "kernel"}
    assert "threads" in info["engines"]["compiled"]
    for _name, status in info["engines"]["status"].items():
        assert set(status) == {"compiled", "usable", "reason"}
        assert status["usable"] or status["reason"]
    assert info["engines"]["auto_selects"] in ("io_uring", "threads")
    d = info["directory"]
    assert d["path"] == str(tmp_path) and isinstance(d["direct"], bool) and d["alignment"] >= 4096 and d["fs_type"]
    assert "memlock_soft_bytes" in info["memory"]
    from fastpersist.io import checksum, engine

    assert info["checksums"] == {"crc32_method": engine.crc32_method(), "crc32_threads": checksum.threads()}
    import torch

    assert info["cuda"]["available"] is torch.cuda.is_available()


def test_info_says_where_fio_is_or_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.main(["info", "--dir", str(tmp_path)]) == 0
    assert "fio               not installed: install it" in capsys.readouterr().out
    fio = tmp_path / "fio"
    fio.write_text("#!/bin/sh\n")
    fio.chmod(0o755)
    assert cli.main(["info", "--json", "--dir", str(tmp_path)]) == 0
    tools = json.loads(capsys.readouterr().out)["tools"]
    assert tools == {"fio": str(fio), "fio_note": None}


def test_info_text_via_module(shm_dir):
    result = subprocess.run(
        [sys.executable, "-m", "fastpersist", "info", "--dir", shm_dir], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for word in ("fastpersist", "torch", "I/O engines", "threads", "tmpfs", "O_DIRECT", "memlock", "CUDA"):
        assert word in out
    assert "no (" in out  # tmpfs: says why not direct


def test_info_missing_directory_is_reported(tmp_path, capsys):
    assert cli.main(["info", "--json", "--dir", str(tmp_path / "nope")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "FileNotFoundError" in info["directory"]["error"]


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "info" in capsys.readouterr().out


def test_lazy_module_commands_are_listed(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "info" in out
    cli.register_command("ghost", "fastpersist.no_such_module")
    try:
        cli.build_parser()  # a module that cannot be imported is left out, not fatal
    finally:
        del cli.COMMANDS["ghost"]


def test_commands_are_registrable(capsys):
    calls = []
    cli.COMMANDS["hello"] = (lambda p: p.add_argument("--name", default="x"), lambda a: calls.append(a.name) or 0)
    try:
        assert cli.main(["hello", "--name", "y"]) == 0
        assert calls == ["y"]
    finally:
        del cli.COMMANDS["hello"]
    with pytest.raises(SystemExit):
        cli.main(["hello"])
