"""``fastpersist tune``: the sweep logic, its output file, cleanup and interruption.

The sweep logic is tested through a fake backend that implements the real
``Backend`` interface with torch.save/torch.load (and faults on request), so
it runs without the native engine; one test sweeps the real fastpersist.
"""

from __future__ import annotations

import argparse
import json
import os
import types

import pytest
import torch

from fastpersist import config, system
from fastpersist.errors import EngineUnavailableError
from fastpersist.tuning import tuner as tune
from fastpersist.tuning import workloads


class TorchBackend(tune.Backend):
    """Saves with torch.save whatever the settings; faults injected per setting value."""

    name = "torch"

    def __init__(self, *, unavailable_engine=None, corrupt_when=None, interrupt_after=None, slow_when=None):
        self.unavailable_engine = unavailable_engine
        self.corrupt_when = corrupt_when or {}
        self.interrupt_after = interrupt_after
        self.slow_when = slow_when or {}
        self.saves = 0

    def defaults(self):
        return config.settings().as_dict()

    def validate(self, values):
        config.settings().replace(**values)

    def save(self, state, path, settings):
        self.saves += 1
        if self.interrupt_after is not None and self.saves > self.interrupt_after:
            raise KeyboardInterrupt
        if settings.get("engine") == self.unavailable_engine:
            raise EngineUnavailableError(f"engine {self.unavailable_engine} cannot start here")
        if any(settings.get(k) == v for k, v in self.slow_when.items()):
            import time

            time.sleep(0.05)
        torch.save(state, path)

    def load(self, path, settings, device):
        loaded = torch.load(path, map_location=device, weights_only=True)
        if any(settings.get(k) == v for k, v in self.corrupt_when.items()):
            next(iter(loaded.values())).view(torch.uint8)[0] ^= 1
        return loaded


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    work = tmp_path / "dir"
    work.mkdir(exist_ok=True)
    return parser.parse_args(
        [
            "--dir",
            str(work),
            "--out",
            str(tmp_path / "fastpersist-config.json"),
            "--quick",
            "--model",
            "toy",
            "--repeats",
            "1",
            "--no-drop-caches",
            *extra,
        ]
    )


def test_tiny_sweep_writes_a_valid_configuration_and_leaves_no_files(tmp_path, capsys):
    args = _args(tmp_path)
    assert tune.run(args, backend=TorchBackend()) == 0
    out = capsys.readouterr().out
    assert "export FASTPERSIST_CONFIG=" in out and "fastpersist.config.load_file(" in out
    assert os.listdir(tmp_path / "dir") == []

    path = tmp_path / "fastpersist-config.json"
    document = json.loads(path.read_text())
    assert set(document["settings"]) == {k.name for k in tune.QUICK_KNOBS}
    assert document["measured"]["sweep"] and document["measured"]["default"]["save_gbps"] > 0
    assert document["machine"]["hostname"]
    before = config.settings()
    with config.load_file(path):
        now = config.settings()
        for name, value in document["settings"].items():
            assert getattr(now, name) == value
    assert config.settings() == before


def test_the_file_works_through_the_environment_variable(tmp_path):
    assert tune.run(_args(tmp_path, "--settings", "block_size"), backend=TorchBackend()) == 0
    import subprocess
    import sys

    env = dict(os.environ, FASTPERSIST_CONFIG=str(tmp_path / "fastpersist-config.json"))
    code = "import fastpersist.config as c; print(c.get('block_size'))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = json.loads((tmp_path / "fastpersist-config.json").read_text())["settings"]["block_size"]
    assert int(result.stdout) == expected


def test_values_that_fail_or_corrupt_are_never_chosen(tmp_path):
    state = workloads.build_state("toy")
    backend = TorchBackend(
        unavailable_engine="io_uring", corrupt_when={"queue_depth": 32}, slow_when={"queue_depth": 16}
    )
    knobs = [k for k in tune.QUICK_KNOBS if k.name in ("engine", "queue_depth")]
    result = tune.sweep(
        backend, state, str(tmp_path), knobs=knobs, repeats=1, dropper=system.CacheDropper(enabled=False)
    )
    stages = {knob.name: (points, chosen) for knob, points, chosen in result.stages}
    engine_points, _ = stages["engine"]
    assert "cannot start" in next(p for p in engine_points if p.value == "io_uring").error
    qd_points, qd_chosen = stages["queue_depth"]
    assert "differ" in next(p for p in qd_points if p.value == 32).error
    assert qd_chosen != 32 and result.recommended["queue_depth"] != 32
    assert result.recommended["engine"] != "io_uring"
    assert os.listdir(tmp_path) == []
    assert "failed" in tune.format_sweep(result)


def test_a_clear_winner_is_adopted_and_noise_is_not(tmp_path, monkeypatch):
    # the sweep reads a clock the backend advances: a busy machine cannot change what it measures
    now = [0.0]
    monkeypatch.setattr(tune, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class BlockSizeMatters(TorchBackend):
        def save(self, state, path, settings):
            now[0] += 0.1 if settings["block_size"] == 2 << 20 else 0.3
            torch.save(state, path)

        def load(self, path, settings, device):
            now[0] += 0.05
            return super().load(path, settings, device)

    knobs = [k for k in tune.QUICK_KNOBS if k.name in ("block_size", "buffer_count")]
    result = tune.sweep(
        BlockSizeMatters(),
        workloads.build_state("toy"),
        str(tmp_path),
        knobs=knobs,
        repeats=2,
        threshold=0.5,
        dropper=system.CacheDropper(enabled=False),
    )
    assert result.recommended["block_size"] == 2 << 20
    # buffer_count makes no difference here: the default stays (0.5 threshold >> noise)
    assert result.recommended["buffer_count"] == config.settings().buffer_count
    assert result.improvement() > 1.5


def test_keyboard_interrupt_writes_nothing_and_removes_its_files(tmp_path, capsys):
    args = _args(tmp_path)
    assert tune.run(args, backend=TorchBackend(interrupt_after=3)) == 130
    assert "interrupted" in capsys.readouterr().err
    assert os.listdir(tmp_path / "dir") == []
    assert not (tmp_path / "fastpersist-config.json").exists()


def test_refuses_to_start_without_a_backend_or_directory(tmp_path, capsys):
    class Missing(TorchBackend):
        def unavailable(self):
            return "fastpersist.save is not importable (no native module)"

    assert tune.run(_args(tmp_path), backend=Missing()) == 2
    assert "not importable" in capsys.readouterr().err
    args = _args(tmp_path)
    args.dir = str(tmp_path / "missing")
    assert tune.run(args, backend=TorchBackend()) == 2
    args = _args(tmp_path, "--settings", "nonsense")
    assert tune.run(args, backend=TorchBackend()) == 2


def test_real_fastpersist_tiny_sweep(tmp_path):
    args = _args(tmp_path, "--settings", "engine,block_size,buffer_count")
    assert tune.run(args) == 0
    with config.load_file(tmp_path / "fastpersist-config.json"):
        assert config.get("engine") in config.ENGINES
    assert os.listdir(tmp_path / "dir") == []


@pytest.mark.slow
def test_real_fastpersist_quick_tune(tmp_path):
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    work = tmp_path / "dir"
    work.mkdir()
    args = parser.parse_args(["--dir", str(work), "--out", str(tmp_path / "c.json"), "--quick"])
    assert tune.run(args) == 0
    with config.load_file(tmp_path / "c.json"):
        pass
    assert os.listdir(work) == []
