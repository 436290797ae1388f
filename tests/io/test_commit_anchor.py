"""Saves that commit later land in the directory that was there at the call (``io.commit.DirectoryAnchor``).

``async_save`` and ``async_save_file`` hold the target's directory open: a
directory renamed while the save is pending receives the file under its new
name, nothing is created at the old path (even when a new directory took the
name), and a deleted directory fails the save without recreating anything.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import fastpersist
from fastpersist.errors import TargetDirectoryMissingError
from fastpersist.io import commit


def state() -> dict:
    return {"w": torch.arange(100_000, dtype=torch.float32)}


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_async_save_follows_a_renamed_directory(tmp_path, monkeypatch, mode, commit_gate):
    gate = commit_gate
    (tmp_path / "tmp-1").mkdir()
    descriptors = len(os.listdir("/proc/self/fd"))
    future = fastpersist.async_save(state(), tmp_path / "tmp-1" / "a.pt", mode=mode)
    assert gate.reached.wait(60)
    os.rename(tmp_path / "tmp-1", tmp_path / "final-1")
    (tmp_path / "tmp-1").mkdir()
    gate.go.set()
    future.result(60)
    assert len(os.listdir("/proc/self/fd")) == descriptors, "the anchor is closed after the commit"
    assert os.listdir(tmp_path / "tmp-1") == []
    assert torch.equal(fastpersist.load(tmp_path / "final-1" / "a.pt")["w"], state()["w"])
    assert future.path == str(tmp_path / "tmp-1" / "a.pt"), "the future names the path it was given"


def test_async_save_file_into_a_deleted_directory_fails_and_recreates_nothing(tmp_path, monkeypatch, commit_gate):
    gate = commit_gate
    (tmp_path / "gone").mkdir()
    future = fastpersist.api.safetensors.async_save_file(state(), tmp_path / "gone" / "m.safetensors", mode="snapshot")
    assert gate.reached.wait(60)
    shutil.rmtree(tmp_path / "gone")
    gate.go.set()
    with pytest.raises(TargetDirectoryMissingError, match="deleted while this save was pending") as caught:
        future.result(60)
    assert caught.value.filename == str(tmp_path / "gone")
    assert os.listdir(tmp_path) == []


def test_errors_name_the_directory_not_the_descriptor(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    destination = commit.anchored(commit.target(tmp_path / "d" / "a.pt"))
    assert destination.anchor is not None and destination.anchor.reach().startswith("/proc/self/fd/")

    def failing_replace(temporary, target, directory, keep=False):
        raise OSError(5, "Input/output error", target)

    monkeypatch.setattr(commit, "replace_file", failing_replace)
    from fastpersist.format.serializer import plan_save

    with pytest.raises(OSError) as caught:
        commit.commit_plan(plan_save(state(), "a"), destination, fastpersist.config.resolve(), streams=None)
    destination.release()
    assert caught.value.filename == str(tmp_path / "d" / "a.pt")
    assert [n for n in os.listdir(tmp_path / "d") if n != "a.pt"] == [], "the temporary is removed"


def test_special_targets_are_not_anchored(tmp_path):
    assert commit.anchored(commit.target("/dev/null")).anchor is None
