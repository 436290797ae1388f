"""Every entry point with fsspec URLs (``memory://`` and ``file://``): the same bytes as a local save, the
commit by a move, failures that leave the previous file and no temporary behind, clear refusals.

Skipped where fsspec is missing (``pip install fastpersist[fsspec]``).
"""

from __future__ import annotations

import errno
import io
import os
import pathlib
import sys
import uuid
import warnings

import pytest
import torch

fsspec = pytest.importorskip("fsspec", reason="the fsspec store tests need fsspec (pip install fastpersist[test])")
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

import fastpersist
from fastpersist.api.safetensors import async_save_file
from fastpersist.distributed import save as distributed_save
from fastpersist.errors import (
    CheckpointIOError,
    InvalidSafetensorsError,
    ObjectNotFoundError,
    ObjectStoreUnavailableError,
)
from fastpersist.io import targets

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dcp"))
from test_dcp import _describe, _load, _save

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group says so

_MiB = 1 << 20


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "weight": torch.randn(257, 33),
        "half": torch.randn(64, 64).to(torch.bfloat16),
        "ints": torch.arange(4097, dtype=torch.int64),
        "view": torch.randn(1000)[3:500],
        "empty": torch.empty(0, 4),
        "big": torch.randn(3 * _MiB // 4),  # 3 MiB: several windows of the ring below
        "step": 7,
    }


_SMALL_RING = {"buffer_size": "1M", "buffer_count": 2}


def _same(actual, expected) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


@pytest.fixture
def memory():
    """A fresh folder of fsspec's (process-wide) memory filesystem: its URL; removed afterwards."""
    root = f"memory://fastpersist-{uuid.uuid4().hex}"
    yield root
    filesystem = fsspec.filesystem("memory")
    if filesystem.exists(root):
        filesystem.rm(root, recursive=True)


@pytest.fixture(params=["memory", "file"])
def store(request, memory, tmp_path):
    """A folder URL of each filesystem under test, and how to list the names in it."""
    if request.param == "memory":
        filesystem, root = fsspec.filesystem("memory"), memory
    else:
        filesystem, root = fsspec.filesystem("file"), f"file://{tmp_path}/store"
        os.makedirs(tmp_path / "store")
    return root, lambda: sorted(os.path.basename(p) for p in filesystem.ls(root, detail=False))


def _bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def test_the_resolver_picks_one_target_per_store(tmp_path):
    assert isinstance(targets.resolve(str(tmp_path / "x.pt")), targets.LocalFile)
    assert isinstance(targets.resolve(tmp_path / "x.pt"), targets.LocalFile)
    assert isinstance(targets.resolve("s3://bucket/x.pt"), targets.S3Object)  # no request, boto3 or not
    memory = targets.resolve("memory://a/x.pt")
    assert memory.remote and not memory.local and memory.path == "memory://a/x.pt"
    assert isinstance(targets.resolve(io.BytesIO()), targets.FileObject)
    assert targets.resolve(memory) is memory
    assert targets.is_url("file:///tmp/x") and not targets.is_url("/tmp/x") and not targets.is_url(io.BytesIO())


@pytest.mark.parametrize("collapsed", ["memory://bucket/ckpt.pt", "s3://bucket/ckpt.pt"])
def test_a_url_made_into_a_path_object_is_refused(collapsed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"pass the URL as a string, '{collapsed}'"):
        fastpersist.save({"a": torch.ones(2)}, pathlib.Path(collapsed))
    assert os.listdir(tmp_path) == []


def test_unknown_schemes_and_missing_packages_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="no store is known for nosuchscheme://"):
        fastpersist.save({"a": torch.ones(2)}, "nosuchscheme://x/ckpt.pt")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ObjectStoreUnavailableError, match="gcsfs"):
            fastpersist.load("gs://bucket/ckpt.pt")
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now raises ImportError
    with pytest.raises(ObjectStoreUnavailableError, match=r"pip install fastpersist\[fsspec\]") as caught:
        fastpersist.load("memory://x/ckpt.pt")
    assert isinstance(caught.value, ImportError)


def test_save_writes_a_checkpoint_and_load_reads_it(store, tmp_path):
    root, names = store
    state = _state()
    fastpersist.save(state, f"{root}/ckpt.pt", **_SMALL_RING)
    assert names() == ["ckpt.pt"]  # no temporary left
    (tmp_path / "copy.pt").write_bytes(_bytes(f"{root}/ckpt.pt"))
    report = fastpersist.verify(tmp_path / "copy.pt")  # every record's CRC-32, the layout of a local save
    assert report.checksummed and report.records > len(state)
    _same(fastpersist.load(f"{root}/ckpt.pt"), state)
    _same(torch.load(io.BytesIO(_bytes(f"{root}/ckpt.pt"))), state)
    fastpersist.save({"step": 8}, f"{root}/ckpt.pt")  # replaces it
    assert fastpersist.load(f"{root}/ckpt.pt") == {"step": 8}


def test_async_save_commits_at_result(store):
    root, names = store
    state = _state()
    fastpersist.async_save(state, f"{root}/pipelined.pt", **_SMALL_RING).result()
    fastpersist.async_save(state, f"{root}/snapshot.pt", mode="snapshot", **_SMALL_RING).result()
    _same(fastpersist.load(f"{root}/pipelined.pt"), state)
    _same(fastpersist.load(f"{root}/snapshot.pt"), state)
    assert names() == ["pipelined.pt", "snapshot.pt"]


def test_two_tier_save_uploads_the_local_copy(store, tmp_path):
    root, _ = store
    state = _state()
    future = fastpersist.async_save(state, f"{root}/ckpt.pt", local_copy=tmp_path / "local.pt")
    future.result()
    assert _bytes(f"{root}/ckpt.pt") == (tmp_path / "local.pt").read_bytes()


def test_safetensors_functions(store):
    root, _ = store
    tensors = {"w": torch.randn(300, 7), "b": torch.arange(11, dtype=torch.int32), "none": torch.empty(0)}
    fastpersist.save_file(tensors, f"{root}/model.safetensors", metadata={"k": "v"})
    _same(fastpersist.load_file(f"{root}/model.safetensors"), tensors)
    with fastpersist.safe_open(f"{root}/model.safetensors", framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        assert torch.equal(f.get_slice("w")[10:20], tensors["w"][10:20])
    async_save_file(tensors, f"{root}/async.safetensors").result()
    _same(fastpersist.load_file(f"{root}/async.safetensors"), tensors)
    nested = {"model": tensors, "step": 3}
    fastpersist.save(nested, f"{root}/nested.safetensors")
    loaded = fastpersist.load(f"{root}/nested.safetensors")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], tensors["w"])


def test_dcp_save_and_load(store):
    root, names = store
    state = _state()
    _save(state, f"{root}/dcp", **_SMALL_RING)
    _load(f"{root}/dcp", state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overwriting an existing checkpoint"
        _save({**state, "step": 8}, f"{root}/dcp")
    _load(f"{root}/dcp", {**state, "step": 8})
    listed = fsspec.filesystem(root.partition("://")[0]).ls(f"{root}/dcp", detail=False)
    assert sorted(os.path.basename(p) for p in listed) == [".metadata", "__0_0.distcp"]


def test_missing_files_are_file_not_found(memory):
    for load in (
        lambda: fastpersist.load(f"{memory}/absent.pt"),
        lambda: fastpersist.load_file(f"{memory}/absent.safetensors"),
    ):
        with pytest.raises(ObjectNotFoundError) as caught:
            load()
        assert isinstance(caught.value, FileNotFoundError) and caught.value.filename.startswith(memory)
    with pytest.raises(BaseException) as caught:
        _load(f"{memory}/no-dcp", {"a": torch.ones(2)})
    assert "no-dcp holds no committed checkpoint (no .metadata object)" in _describe(caught.value)


def test_a_truncated_file_is_refused(memory):
    fastpersist.save_file({"w": torch.ones(100)}, f"{memory}/full.safetensors", alignment=8)
    data = _bytes(f"{memory}/full.safetensors")
    fsspec.filesystem("memory").pipe_file(f"{memory}/cut.safetensors", data[:-4])
    with pytest.raises(InvalidSafetensorsError):
        fastpersist.load_file(f"{memory}/cut.safetensors")


class _FailingFile(MemoryFile):
    """A memory file whose writes fail with EIO once ``budget`` bytes went in."""

    def __init__(self, fs, path, budget: int):
        super().__init__(fs, path)
        self.budget = budget

    def write(self, data) -> int:
        if self.tell() + len(memoryview(data)) > self.budget:
            raise OSError(errno.EIO, "injected write error")
        return super().write(data)


class _FaultyMemory(MemoryFileSystem):
    """fsspec's memory filesystem (a store of its own) whose files opened for writing fail after ``budget`` bytes."""

    protocol = "fastpersist-faulty"
    store: dict = {}
    pseudo_dirs = [""]
    budget: int | None = None

    def _open(self, path, mode="rb", **kwargs):
        if "w" not in mode or self.budget is None:
            return super()._open(path, mode, **kwargs)
        opened = _FailingFile(self, self._strip_protocol(path), self.budget)
        opened.commit()
        return opened


@pytest.fixture
def faulty():
    fsspec.register_implementation(_FaultyMemory.protocol, _FaultyMemory, clobber=True)
    _FaultyMemory.budget = None
    yield f"{_FaultyMemory.protocol}://ckpts"
    _FaultyMemory.store.clear()


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(faulty):
    previous = {"version": torch.tensor([1])}
    fastpersist.save(previous, f"{faulty}/ckpt.pt")
    _FaultyMemory.budget = 5000
    with pytest.raises(CheckpointIOError, match="injected write error") as caught:
        fastpersist.save(_state(), f"{faulty}/ckpt.pt", **_SMALL_RING)
    assert isinstance(caught.value, RuntimeError) and caught.value.filename == f"{faulty}/ckpt.pt"
    with pytest.raises(CheckpointIOError):
        fastpersist.async_save(_state(), f"{faulty}/ckpt.pt").result()
    _FaultyMemory.budget = None
    assert [key.rpartition("/")[2] for key in _FaultyMemory.store] == ["ckpt.pt"]  # no temporary left
    _same(fastpersist.load(f"{faulty}/ckpt.pt"), previous)


def test_collective_saves_and_file_objects_are_refused_where_they_cannot_go(memory):
    with pytest.raises(ValueError, match="collective save"):
        distributed_save.options(f"{memory}/ckpt.pt")
    with pytest.raises(TypeError, match="needs a path, not a file object"):
        distributed_save.options(io.BytesIO())
    with pytest.raises(TypeError, match="async_save needs a file path"):
        fastpersist.async_save({"a": torch.ones(2)}, io.BytesIO())


def test_a_sink_writes_everything_and_keeps_nothing():
    from fastpersist.format.serializer import plan_save

    plan = plan_save(_state(), "sink")
    reported = []
    crcs = targets.Sink().commit_plan(
        plan, fastpersist.config.settings(), before_commit=lambda: reported.append("commit")
    )
    assert len(crcs) == len(plan.records) and any(crcs) and reported == ["commit"]
