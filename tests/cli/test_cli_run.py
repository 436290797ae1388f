"""The launcher: ``python -m fastpersist.run``, ``fastpersist run --``, under torchrun and accelerate launch.

The program runs unchanged, as ``python`` would run it (argv, ``__main__``,
``sys.path[0]``, exit status), with ``fastpersist.patch()`` applied before
its first import: safetensors' ``save_file`` imported by name is fastpersist's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

pytest.importorskip("safetensors")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(REPO, "tests", "_workers", "_patched_program.py")


def launch(command: list[str], cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def page_aligned(path) -> bool:
    with zipfile.ZipFile(path) as archive:
        large = [i.filename for i in archive.infolist() if "/data/" in i.filename and i.file_size >= 64 << 10]
    reader = torch._C.PyTorchFileReader(str(path))
    return bool(large) and all(reader.get_record_offset(n.split("/", 1)[1]) % 4096 == 0 for n in large)


def seen(directory, rank: int = 0) -> dict:
    with open(os.path.join(directory, f"rank{rank}.json")) as f:
        return json.load(f)


def test_python_m_fastpersist_run_runs_the_script_as_python_would(tmp_path):
    result = launch(
        [sys.executable, "-m", "fastpersist.run", "--alignment", "4096", PROGRAM, str(tmp_path), "3"], tmp_path
    )
    assert result.returncode == 3, result.stderr
    report = seen(tmp_path)
    assert report["argv"] == [PROGRAM, str(tmp_path), "3"] and report["name"] == "__main__"
    assert report["path0"] == os.path.dirname(PROGRAM)
    assert report["stats"]["fastpersist"] == {"torch.save": 1, "torch.load": 1, "save_file": 1}
    assert page_aligned(tmp_path / "rank0.pt")
    header = int.from_bytes((tmp_path / "rank0.safetensors").read_bytes()[:8], "little")
    assert (8 + header) % 4096 == 0, "--alignment reached the patch"


@pytest.mark.parametrize("interpreter", ["this", "other"])
def test_fastpersist_run_with_a_named_interpreter(tmp_path, interpreter):
    """``fastpersist run -- python x.py``: this interpreter runs it here; another one is exec'd with the launcher."""
    if interpreter == "this":
        named = sys.executable
    else:
        named = str(tmp_path / "python3")  # another file (as pyenv's shims are): exec'd with -m fastpersist.run
        with open(named, "w") as f:
            f.write(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        os.chmod(named, 0o755)
    out = tmp_path / "out"
    out.mkdir()
    result = launch(
        [sys.executable, "-m", "fastpersist", "run", "--mode", "snapshot", "--", named, PROGRAM, str(out)], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert seen(out)["stats"]["fastpersist"]["torch.save"] == 1
    assert page_aligned(out / "rank0.pt")


def test_a_module_runs_as_python_m_runs_it(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import sys, torch\n"
        "from torch import save\n"
        "save({'w': torch.ones(128, 256)}, sys.argv[1])\n"
        "print(__name__, sys.argv[1:], sys.path[0])\n"
    )
    result = launch([sys.executable, "-m", "fastpersist.run", "-m", "pkg.train", str(tmp_path / "a.pt")], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["__main__", f"['{tmp_path / 'a.pt'}']", str(tmp_path)]
    assert page_aligned(tmp_path / "a.pt")


def test_an_uncaught_exception_fails_the_run(tmp_path):
    (tmp_path / "bad.py").write_text("raise ValueError('boom')\n")
    result = launch([sys.executable, "-m", "fastpersist.run", str(tmp_path / "bad.py")], tmp_path)
    assert result.returncode == 1 and "ValueError: boom" in result.stderr
    usage = launch([sys.executable, "-m", "fastpersist.run"], tmp_path)
    assert usage.returncode == 2 and "name a Python script" in usage.stderr


@pytest.mark.parametrize("form", ["module", "no-python"])
def test_under_torchrun_every_rank_is_patched(tmp_path, form):
    if shutil.which("torchrun") is None and form == "no-python":
        pytest.skip("no torchrun on PATH")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if form == "module":
        command = [*torchrun, "-m", "fastpersist.run", PROGRAM, str(tmp_path)]
    else:
        command = [*torchrun, "--no-python", "fastpersist", "run", "--", sys.executable, PROGRAM, str(tmp_path)]
    result = launch(command, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert seen(tmp_path, rank)["stats"]["fastpersist"]["save_file"] == 1
        assert page_aligned(tmp_path / f"rank{rank}.pt")
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt")["w"], torch.full((128, 256), float(rank)))


def test_under_accelerate_launch(tmp_path):
    pytest.importorskip("accelerate")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    result = launch([*command, "-m", "fastpersist.run", PROGRAM, str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert seen(tmp_path)["stats"]["fastpersist"]["torch.save"] == 1
    assert page_aligned(tmp_path / "rank0.pt")
