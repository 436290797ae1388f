"""The examples run (on CPU here) and check their own results: train loop in 3 modes, DDP, Lightning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One thread each: the examples' tiny models gain nothing from more, and a busy CI machine loses a lot.
ENV = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run(args, timeout=300):
    result = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("mode", ["sync", "pipelined", "snapshot"])
def test_train_loop(mode, tmp_path):
    out = run(
        [
            sys.executable,
            "examples/train_loop.py",
            "--dir",
            str(tmp_path),
            "--mode",
            mode,
            "--steps",
            "12",
            "--every",
            "4",
            "--device",
            "cpu",
        ]
    )
    assert f"mode={mode}" in out and "weights identical=True" in out


@pytest.mark.parametrize("mode", [None, "pipelined", "snapshot"])
def test_ddp_sharded_with_torchrun(tmp_path, mode):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    extra = ["--async-mode", mode] if mode else []
    command = [torchrun, "--nproc-per-node", "2", "--standalone", "examples/ddp_sharded.py", "--dir", str(tmp_path)]
    out = run(command + extra)
    assert "ranks=2" in out and "identical on all ranks=True" in out
    if mode:
        assert f"saves=in the background ({mode})" in out


def test_lightning_callback(tmp_path):
    pytest.importorskip("lightning")
    out = run(
        [
            sys.executable,
            "examples/lightning_callback.py",
            "--dir",
            str(tmp_path),
            "--epochs",
            "1",
            "--check",
            "--accelerator",
            "cpu",
            "--async-mode",
            "snapshot",
        ]
    )
    assert "resumed at epoch 1" in out


def test_offload_generate(tmp_path):
    pytest.importorskip("transformers")
    out = run([sys.executable, "examples/offload_generate.py", "--dir", str(tmp_path), "--device", "cpu"])
    assert "tokens equal the fully loaded model's: True" in out


def test_offload_generate_tied(tmp_path):
    pytest.importorskip("transformers")
    command = [sys.executable, "examples/offload_generate.py", "--dir", str(tmp_path), "--device", "cpu"]
    out = run([*command, "--tie-word-embeddings", "--layers", "2", "--new-tokens", "8"])
    assert "lm_head tied to embed_tokens again: True" in out
    assert "tokens equal the fully loaded model's: True" in out
