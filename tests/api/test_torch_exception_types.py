"""Every failure torch.save / torch.load report as RuntimeError is caught by ``except RuntimeError`` with ours too.

Scripts written for torch wrap saves in ``except RuntimeError``; fastpersist's
exceptions keep the precise built-in type (``OSError`` with ``errno``,
``PermissionError``, ...) and are ``RuntimeError`` as well
(docs/compatibility.md, "Exceptions").
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import fastpersist
from fastpersist.errors import CheckpointIOError, TargetIsADirectoryError
from fastpersist.io import engine


def state(megabytes: int = 2) -> dict:
    return {"w": torch.arange(megabytes << 18, dtype=torch.float32)}


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_write_errors_are_runtime_errors_with_their_errno(tmp_path, code):
    path = tmp_path / "ckpt.pt"
    with engine.inject_fault(nth=1, errno=code, op="write"), pytest.raises(RuntimeError) as caught:
        fastpersist.save(state(), path)
    error = caught.value
    assert isinstance(error, OSError) and isinstance(error, CheckpointIOError) and error.errno == code
    assert error.filename and not os.path.exists(path) and os.listdir(tmp_path) == []


def test_async_save_error_is_a_runtime_error(tmp_path):
    with engine.inject_fault(nth=1, errno=errno.ENOSPC, op="write"):
        future = fastpersist.async_save(state(), tmp_path / "ckpt.pt")
        with pytest.raises(RuntimeError) as caught:
            future.result()
    assert caught.value.errno == errno.ENOSPC


def test_safetensors_write_error_is_a_runtime_error(tmp_path):
    with engine.inject_fault(nth=1, errno=errno.EIO, op="write"), pytest.raises(RuntimeError) as caught:
        fastpersist.save_file({"w": torch.ones(1 << 20)}, tmp_path / "m.safetensors")
    assert caught.value.errno == errno.EIO


def test_full_disk_while_replacing_says_why_and_what_to_do(tmp_path):
    """The atomic replace needs room for both files: the message gives the sizes and the ways out."""
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state(4), path)
    before = path.read_bytes()
    with engine.inject_fault(nth=1, errno=errno.ENOSPC, op="write"), pytest.raises(RuntimeError) as caught:
        fastpersist.save(state(4), path)
    message = str(caught.value)
    assert caught.value.errno == errno.ENOSPC
    assert "room for both" in message and "atomic=False" in message and "MB free now" in message
    assert f"{os.path.getsize(path) / 1e6:,.1f} MB" in message  # the old file's size
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_full_disk_for_a_new_file_gives_the_size_needed(tmp_path):
    with engine.inject_fault(nth=1, errno=errno.ENOSPC, op="write"), pytest.raises(RuntimeError) as caught:
        fastpersist.save(state(4), tmp_path / "new.pt")
    assert "the checkpoint needs" in str(caught.value) and "room for both" not in str(caught.value)


def test_saving_over_a_directory_is_a_runtime_error(tmp_path):
    with pytest.raises(RuntimeError) as caught:
        fastpersist.save(state(), tmp_path)
    assert isinstance(caught.value, IsADirectoryError) and isinstance(caught.value, TargetIsADirectoryError)
    with pytest.raises(RuntimeError):
        torch.save(state(), tmp_path)  # torch's own type for it


def test_read_errors_are_runtime_errors_and_open_errors_stay(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state(4), path)
    with engine.inject_fault(nth=1, errno=errno.EIO, op="read"), pytest.raises(RuntimeError) as caught:
        fastpersist.load(path)
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.EIO
    with pytest.raises(FileNotFoundError) as missing:  # what torch.load's open() raises
        fastpersist.load(tmp_path / "missing.pt")
    assert not isinstance(missing.value, RuntimeError)
    with pytest.raises(IsADirectoryError):
        fastpersist.load(tmp_path)


@pytest.mark.root
def test_real_full_and_read_only_filesystems(small_tmpfs, readonly_tmpfs):
    with pytest.raises(RuntimeError) as full:
        fastpersist.save(state(8), os.path.join(small_tmpfs, "big.pt"))
    assert full.value.errno == errno.ENOSPC and os.listdir(small_tmpfs) == []
    with pytest.raises(RuntimeError) as read_only:
        fastpersist.save(state(), os.path.join(readonly_tmpfs, "ckpt.pt"))
    assert read_only.value.errno == errno.EROFS and isinstance(read_only.value, OSError)


_MODULE_LAMBDA = lambda: 0  # noqa: E731 - the pickler raises PicklingError for it (AttributeError for a local one)


def test_unpicklable_objects_are_the_pickler_s_exception_type_too(tmp_path):
    """For each object torch.save refuses, ours raises an exception of torch's type (and UnsupportedObjectError)."""
    import io
    import threading

    from fastpersist.errors import UnsupportedObjectError

    for name, obj in {"module lambda": _MODULE_LAMBDA, "local lambda": lambda: 1, "lock": threading.Lock()}.items():
        with pytest.raises(Exception) as torch_error:
            torch.save({"x": obj}, io.BytesIO())
        with pytest.raises(type(torch_error.value)) as ours:
            fastpersist.save({"x": obj}, tmp_path / "a.pt")
        assert isinstance(ours.value, UnsupportedObjectError), name
    assert os.listdir(tmp_path) == []
