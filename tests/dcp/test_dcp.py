"""fastpersist.dcp: DCP StorageWriter / StorageReader, compatible with FileSystemWriter / FileSystemReader.

Single-process tests use ``no_dist=True``; multi-process tests run gloo
worlds of 2 and 4 ranks as subprocesses (tests/_workers/_dcp_worker.py), once per
module, and check what every rank reported.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import socket
import subprocess
import sys
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import fastpersist
from fastpersist.dcp import FastPersistReader, FastPersistWriter
from fastpersist.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    TruncatedCheckpointError,
    UnsafeFileNameError,
)
from fastpersist.format.zipformat import read_directory
from fastpersist.io import engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_workers", "_dcp_worker.py")


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "weight": torch.randn(257, 33),
        "half": torch.randn(64, 64).to(torch.bfloat16),
        "ints": torch.arange(4097, dtype=torch.int64),
        "transposed": torch.randn(17, 9).t(),
        "view": torch.randn(1000)[3:500],
        "empty": torch.empty(0, 4),
        "flag": torch.tensor(True),
        "big": torch.randn(1 << 20),
        "step": 123,
        "nested": {"list": [1, "two", 3.0], "t": torch.ones(3)},
    }


def _blank(state):
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, list):
        return [None] * len(state)
    return None


def _assert_equal(actual, expected, where=""):
    if isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for k in expected:
            _assert_equal(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, where


def _describe(error: BaseException) -> str:
    """The message of ``error`` and, for DCP's CheckpointException, of every rank's failure."""
    parts = [f"{type(error).__name__}: {error}"]
    for failure in getattr(error, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"{type(inner).__name__}: {inner}")
    return "\n".join(parts)


def _save(state, path, writer=FastPersistWriter, **kwargs):
    dcp.save(state, storage_writer=writer(str(path), **kwargs), no_dist=True)


def _load(path, expected, reader=FastPersistReader, **kwargs):
    out = _blank(expected)
    dcp.load(out, storage_reader=reader(str(path), **kwargs), no_dist=True)
    _assert_equal(out, expected)
    return out


@pytest.mark.parametrize("writer", [FastPersistWriter, FileSystemWriter])
@pytest.mark.parametrize("reader", [FastPersistReader, FileSystemReader])
def test_round_trip_both_ways(tmp_path, writer, reader):
    """Ours reads theirs, theirs reads ours (and each its own)."""
    state = _state()
    _save(state, tmp_path, writer)
    _load(tmp_path, state, reader)


def test_layout_is_filesystem_writers(tmp_path):
    state = _state()
    _save(state, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp"]
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    assert metadata.version == "1.0.0"
    size = os.path.getsize(tmp_path / "__0_0.distcp")
    for index, info in metadata.storage_data.items():
        assert type(info).__name__ == "_StorageInfo" and info.relative_path == "__0_0.distcp"
        assert 0 <= info.offset and info.offset + info.length <= size
        extension = info.fastpersist
        assert extension["crc32"] >= 0
        if extension["kind"] == "tensor" and extension["nbytes"] >= (1 << 20):
            # The payload sits where the source tensor sat within its page: a load reads it in place.
            assert extension["offset"] % 4096 == state[index.fqn].data_ptr() % 4096


def test_files_per_rank(tmp_path):
    state = _state()
    _save(state, tmp_path, files_per_rank=3)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp")) == [f"__0_{i}.distcp" for i in range(3)]
    _load(tmp_path, state, FileSystemReader)
    _load(tmp_path, state)


def test_buffered_fallback_on_tmpfs(shm_dir):
    state = _state()
    _save(state, shm_dir)
    _load(shm_dir, state)
    _load(shm_dir, state, FileSystemReader)


@pytest.mark.parametrize(
    "settings",
    [
        {"engine": "threads"},
        {"direct": False},
        {"buffer_size": 1 << 20},
        {"checksum": False},
        {"block_size": 1 << 20, "queue_depth": 2, "intra_op_parallelism": 2},
    ],
)
def test_engine_settings(tmp_path, settings):
    state = _state()
    _save(state, tmp_path, **settings)
    _load(tmp_path, state, **settings)
    _load(tmp_path, state, FileSystemReader)


def test_checkpoint_id_and_reuse(tmp_path):
    state = _state()
    writer = FastPersistWriter(str(tmp_path / "unused"))
    for step in range(2):
        dcp.save(
            state,
            checkpoint_id=str(tmp_path / f"step{step}"),
            storage_writer=writer,
            no_dist=True,
        )
    reader = FastPersistReader(str(tmp_path / "unused"))
    for step in range(2):
        out = _blank(state)
        dcp.load(
            out,
            checkpoint_id=str(tmp_path / f"step{step}"),
            storage_reader=reader,
            no_dist=True,
        )
        _assert_equal(out, state)


def test_overwrite(tmp_path):
    old = _state()
    _save(old, tmp_path)
    new = {k: (v + 1 if isinstance(v, torch.Tensor) and v.dtype != torch.bool else v) for k, v in old.items()}
    _save(new, tmp_path)
    _load(tmp_path, new)
    with pytest.raises(BaseException) as caught:
        _save(new, tmp_path, overwrite=False)
    assert "FileExistsError" in _describe(caught.value) and "overwrite=False" in _describe(caught.value)


def test_failed_save_leaves_no_checkpoint(tmp_path):
    """A write error surfaces, the old .metadata is gone (no checkpoint pointing at torn files)."""
    state = _state()
    _save(state, tmp_path)
    with engine.inject_fault(nth=2, op="write"), pytest.raises(BaseException) as info:
        _save(state, tmp_path)
    assert "Input/output error" in _describe(info.value)
    assert not (tmp_path / ".metadata").exists()
    assert not (tmp_path / ".metadata.tmp").exists()
    with pytest.raises(BaseException) as caught:
        _load(tmp_path, state)
    assert "no committed checkpoint" in _describe(caught.value)


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _info(path, fqn):
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


@pytest.mark.parametrize("fqn", ["big", "weight", "ints", "step"])
def test_corruption_is_detected(tmp_path, fqn):
    state = _state()
    _save(state, tmp_path)
    info = _info(tmp_path, fqn)
    _flip_byte(
        tmp_path / info.relative_path,
        info.fastpersist["offset"] + info.fastpersist["nbytes"] // 2,
    )
    with pytest.raises(BaseException) as caught:
        _load(tmp_path, state)
    assert "ChecksumMismatchError" in _describe(caught.value)
    assert repr(fqn) in _describe(caught.value)
    # verify=False loads the damaged bytes (the user asked for it)
    out = _blank(state)
    dcp.load(out, storage_reader=FastPersistReader(str(tmp_path), verify=False), no_dist=True)


def test_corruption_in_filesystem_writer_checkpoint_is_detected(tmp_path):
    state = _state()
    _save(state, tmp_path, FileSystemWriter)
    info = _info(tmp_path, "big")
    _flip_byte(tmp_path / info.relative_path, info.offset + info.length // 2)
    with pytest.raises(BaseException) as caught:
        _load(tmp_path, state)
    assert "ChecksumMismatchError" in _describe(caught.value) and "'big'" in _describe(caught.value)


def _rewrite_metadata(path, change) -> None:
    """Unpickles ``.metadata``, lets ``change(metadata)`` alter it, pickles it back (a damaged or crafted one)."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    change(metadata)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("writer", [FastPersistWriter, FileSystemWriter])
def test_verify_checks_every_item_of_a_dcp_directory(tmp_path, writer):
    """fastpersist.verify(dir): each item (tensor archives, BYTE_IO archives) through the one zip verifier."""
    state = _state()
    _save(state, tmp_path, writer, **({"files_per_rank": 3} if writer is FastPersistWriter else {}))
    with open(tmp_path / ".metadata", "rb") as f:
        items = len(pickle.load(f).storage_data)
    report = fastpersist.verify(tmp_path)
    assert report.checksummed and report.records == items and report.bytes >= state["big"].nbytes
    assert report.path == str(tmp_path)


@pytest.mark.parametrize("writer", [FastPersistWriter, FileSystemWriter])
@pytest.mark.parametrize("fqn", ["big", "weight", "step"])
def test_verify_of_a_dcp_directory_names_the_damaged_item(tmp_path, writer, fqn):
    _save(_state(), tmp_path, writer)
    info = _info(tmp_path, fqn)
    data = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    records = read_directory(lambda offset, length: data[offset : offset + length], len(data), fqn)
    largest = max(records, key=lambda r: r.size)  # the tensor's storage; data.pkl of a BYTE_IO item
    _flip_byte(tmp_path / info.relative_path, info.offset + largest.data_offset + largest.size // 2)
    with pytest.raises(ChecksumMismatchError) as caught:
        fastpersist.verify(tmp_path)
    assert caught.value.record == fqn and caught.value.path == str(tmp_path / info.relative_path)
    assert f"item {fqn!r}" in str(caught.value)


def test_verify_of_a_dcp_directory_finds_truncation_and_a_metadata_that_disagrees(tmp_path):
    _save(_state(), tmp_path)
    big = _info(tmp_path, "big")

    def wrong_crc(metadata):
        info = next(info for index, info in metadata.storage_data.items() if index.fqn == "big")
        info.fastpersist["crc32"] ^= 1

    _rewrite_metadata(tmp_path, wrong_crc)
    with pytest.raises(CorruptCheckpointError, match="does not hold the payload the checkpoint's metadata describes"):
        fastpersist.verify(tmp_path)
    _save(_state(), tmp_path)
    os.truncate(tmp_path / big.relative_path, os.path.getsize(tmp_path / big.relative_path) - 1)
    with pytest.raises(TruncatedCheckpointError, match="the file is truncated") as caught:
        fastpersist.verify(tmp_path)
    assert caught.value.record is not None


def test_verify_of_a_dcp_directory_without_checksums_or_with_per_rank_metadata(tmp_path):
    _save(_state(), tmp_path / "unchecked", checksum=False)
    assert not fastpersist.verify(tmp_path / "unchecked").checksummed  # structure only: payload CRC-32s are 0
    dcp.save(_state(), storage_writer=FastPersistWriter(str(tmp_path / "ranks")), no_dist=True, use_collectives=False)
    assert not (tmp_path / "ranks" / ".metadata").exists()
    assert fastpersist.verify(tmp_path / "ranks").checksummed  # __0.metadata


def test_verify_refuses_a_dcp_item_file_outside_the_directory(tmp_path):
    _save(_state(), tmp_path / "ckpt")
    (tmp_path / "elsewhere.distcp").write_bytes((tmp_path / "ckpt" / "__0_0.distcp").read_bytes())

    def outside(metadata):
        for index, info in list(metadata.storage_data.items()):
            metadata.storage_data[index] = dataclasses.replace(info, relative_path="../elsewhere.distcp")

    _rewrite_metadata(tmp_path / "ckpt", outside)
    with pytest.raises(UnsafeFileNameError, match="not a plain file name") as caught:
        fastpersist.verify(tmp_path / "ckpt")
    assert caught.value.record == "../elsewhere.distcp"


class _Marker:
    """Unpickling it would create a file: a .metadata carrying one must be refused without running it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_verify_does_not_run_code_from_a_dcp_metadata(tmp_path):
    _save(_state(), tmp_path)
    marker = tmp_path / "ran"
    _rewrite_metadata(tmp_path, lambda metadata: setattr(metadata, "planner_data", _Marker(str(marker))))
    with pytest.raises(CorruptCheckpointError, match="io.open is not part of a DCP checkpoint's metadata"):
        fastpersist.verify(tmp_path)
    assert not marker.exists()


def test_metadata_reader_takes_enum_members_by_getattr_and_nothing_else():
    """Python 3.11.0-3.11.4 pickle enum members as ``getattr(cls, name)``: the reader takes those (for DCP's own
    enums), and refuses getattr on anything else."""
    import enum
    import pathlib
    import pickle

    from fastpersist.format import dcp as dcp_format

    members = [m for m in vars(torch.distributed.checkpoint.metadata).values() if isinstance(m, type)]
    kind = next(m for m in members if issubclass(m, enum.Enum) and len(m))
    member = next(iter(kind))

    class ByGetattr:
        def __reduce__(self):
            return getattr, (kind, member.name)

    class Escape:  # a class the reader lets through, then an attribute of it that is no enum member
        def __reduce__(self):
            return getattr, (pathlib.PosixPath, "unlink")

    assert dcp_format._MetadataUnpickler(io.BytesIO(pickle.dumps(ByGetattr(), protocol=2))).load() is member
    with pytest.raises(pickle.UnpicklingError, match="is not part of a DCP checkpoint's metadata"):
        dcp_format._MetadataUnpickler(io.BytesIO(pickle.dumps(Escape(), protocol=2))).load()


def test_verify_of_a_directory_without_a_dcp_checkpoint_says_what_it_checks(tmp_path):
    with pytest.raises(IsADirectoryError, match="without a DCP checkpoint's .metadata.*DCP checkpoint directories"):
        fastpersist.verify(tmp_path)


def test_verify_of_dcp_stream_transforms_is_structure_only(tmp_path):
    """Items written through DCP's stream transforms (compression...) are not archives on disk: nothing to check."""
    checkpoint_utils = pytest.importorskip("torch.testing._internal.distributed.checkpoint_utils")
    _save(_state(), tmp_path, FileSystemWriter, _extensions=[checkpoint_utils.Rot13Example()])
    assert not fastpersist.verify(tmp_path).checksummed


def test_load_into_other_dtype_and_layout(tmp_path):
    """Destinations that cannot take the bytes in place get a verified copy."""
    state = {"a": torch.randn(8, 16), "b": torch.randn(300, 5)}
    _save(state, tmp_path)
    out = {"a": torch.zeros(16, 8).t(), "b": torch.zeros(300, 5, dtype=torch.float64)}
    dcp.load(out, storage_reader=FastPersistReader(str(tmp_path)), no_dist=True)
    assert torch.equal(out["a"], state["a"])
    assert torch.equal(out["b"], state["b"].double())


def test_async_save_single_process(tmp_path):
    state = _state()
    future = dcp.async_save(state, storage_writer=FastPersistWriter(str(tmp_path)), no_dist=True)
    getattr(future, "upload_completion", future).result()
    _load(tmp_path, state)


def test_metadata_is_readable_without_fastpersist(tmp_path):
    """The extension uses only built-in types: unpickling the metadata needs no fastpersist module."""
    _save(_state(), tmp_path)
    code = (
        "import pickle, sys; sys.modules['fastpersist'] = None\n"
        f"m = pickle.load(open({str(tmp_path / '.metadata')!r}, 'rb'))\n"
        "print(len(m.storage_data))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0


# ----------------------------------------------------------------------------- multi-process (gloo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world: int, phase: str, root, timeout: int = 240, device: str = "cpu") -> list[dict]:
    port = _free_port()
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        DCP_TEST_DEVICE=device,
    )
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    processes = [
        subprocess.Popen(
            [sys.executable, WORKER, phase, str(root)],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    reports = []
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank} of {phase} failed:\n{output}"
        with open(os.path.join(root, f"{phase}.{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Runs the gloo worlds once: 2 ranks save, 4 ranks save/load/cross-read/fail/async, 2 ranks load."""
    root = tmp_path_factory.mktemp("dcp-worlds")
    return {
        "save2": _run_world(2, "save2", root),
        "world4": _run_world(4, "world4", root),
        "load2": _run_world(2, "load2", root),
        "root": root,
    }


def _check_all(reports, key):
    for rank, report in enumerate(reports):
        assert report[key] == "ok", f"rank {rank}: {key}: {report[key]}"


def test_two_ranks_save_sharded_and_replicated(worlds):
    _check_all(worlds["save2"], "save_fastpersist")
    _check_all(worlds["save2"], "load_fastpersist")
    _check_all(worlds["save2"], "load_filesystem_reader")
    assert sorted(n for n in os.listdir(worlds["root"] / "fp2") if n.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


def test_four_ranks_round_trip_and_cross_reading(worlds):
    for key in (
        "save_fastpersist",
        "save_filesystem_writer",
        "load_fastpersist",
        "filesystem_reader_reads_ours",
        "fastpersist_reads_filesystem_writer",
    ):
        _check_all(worlds["world4"], key)


def test_resharding_two_to_four(worlds):
    _check_all(worlds["world4"], "reshard_2_to_4")


def test_resharding_four_to_two(worlds):
    _check_all(worlds["load2"], "reshard_4_to_2")
    _check_all(worlds["load2"], "reshard_4_to_2_filesystem_writer")


def test_async_save_four_ranks(worlds):
    _check_all(worlds["world4"], "async_save")


def test_failing_rank_fails_every_rank(worlds):
    for rank, report in enumerate(worlds["world4"]):
        failure = report["failing_rank"]
        assert failure["raised"], f"rank {rank} did not raise"
        assert "CheckpointException" in failure["type"], failure
        assert "dict_keys([2])" in failure["message"], failure  # rank 2's failure, on every rank
    assert not (worlds["root"] / "fail4" / ".metadata").exists()


# ----------------------------------------------------------------------------- CUDA


def _cuda_state() -> dict:
    torch.manual_seed(1)
    return {
        "w": torch.randn(1024, 1024, device="cuda").to(torch.bfloat16),  # 2 MiB: several 1 MiB windows
        "odd": torch.randn(12345, device="cuda"),  # not a whole number of pages
        "view": torch.randn(4096, device="cuda")[7:3000],
        "transposed": torch.randn(33, 65, device="cuda").t(),
        "cpu": torch.randn(300, 300),
        "empty": torch.empty(0, device="cuda"),
        "step": 3,
    }


def _to(state, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "settings",
    [{}, {"buffer_size": 1 << 20, "buffer_count": 2, "read_buffer_size": 1 << 20, "read_buffer_count": 2}],
)
def test_cuda_round_trip(tmp_path, settings):
    """GPU shards through the pinned ring; loads into CUDA and CPU tensors, and by FileSystemReader."""
    state = _cuda_state()
    _save(state, tmp_path, **settings)
    _load(tmp_path, state, **settings)  # into CUDA tensors (the ring), verified
    _load(tmp_path, _to(state, "cpu"), **settings)  # into CPU tensors, in place
    _load(tmp_path, _to(state, "cpu"), FileSystemReader)


@pytest.mark.gpu
def test_cuda_reads_filesystem_writer_and_corruption(tmp_path):
    state = _cuda_state()
    _save(state, tmp_path / "theirs", FileSystemWriter)
    _load(tmp_path / "theirs", state)
    _save(state, tmp_path / "ours")
    info = _info(tmp_path / "ours", "w")
    _flip_byte(tmp_path / "ours" / info.relative_path, info.fastpersist["offset"] + 12345)
    with pytest.raises(BaseException) as caught:
        _load(tmp_path / "ours", state)
    assert "ChecksumMismatchError" in _describe(caught.value)


@pytest.mark.gpu
def test_cuda_async_save(tmp_path):
    state = _cuda_state()
    future = dcp.async_save(state, storage_writer=FastPersistWriter(str(tmp_path)), no_dist=True)
    getattr(future, "upload_completion", future).result()
    _load(tmp_path, state)


@pytest.mark.multigpu
def test_nccl_two_gpus_dtensor(tmp_path):
    """DTensor shards on two GPUs (NCCL): save, load both ways, async_save."""
    reports = _run_world(2, "nccl", tmp_path, device="cuda")
    for key in (
        "save_fastpersist",
        "load_fastpersist",
        "load_filesystem_reader",
        "async_save",
    ):
        _check_all(reports, key)


FSDP2_SCENARIOS = (
    "fsdp2_save_fastpersist",
    "fsdp2_save_filesystem_writer",
    "fsdp2_load_fastpersist",
    "fsdp2_filesystem_reader_reads_ours",
    "fsdp2_fastpersist_reads_filesystem_writer",
)


def test_fsdp2_gloo_two_ranks(tmp_path):
    """FSDP2 model + optimizer state on CPU (gloo): saved and resumed both ways with FileSystemWriter/Reader."""
    reports = _run_world(2, "fsdp2", tmp_path)
    for key in FSDP2_SCENARIOS:
        _check_all(reports, key)


@pytest.mark.multigpu
def test_fsdp2_nccl_two_gpus(tmp_path):
    """FSDP2 on two GPUs (NCCL), one rank per GPU: the same scenarios as on gloo."""
    reports = _run_world(2, "fsdp2", tmp_path, device="cuda")
    for key in FSDP2_SCENARIOS:
        _check_all(reports, key)


def test_without_collectives_per_rank_metadata(tmp_path):
    """use_collectives=False: each rank commits its own __{rank}.metadata, as FileSystemWriter does."""
    state = _state()
    dcp.save(
        state,
        storage_writer=FastPersistWriter(str(tmp_path)),
        no_dist=True,
        use_collectives=False,
    )
    assert (tmp_path / "__0.metadata").exists() and not (tmp_path / ".metadata").exists()
    ours = FastPersistReader(str(tmp_path)).read_metadata(rank=0)
    theirs = FileSystemReader(str(tmp_path)).read_metadata(rank=0)
    assert ours.storage_data.keys() == theirs.storage_data.keys()
    assert {index.fqn for index in ours.storage_data} >= {"weight", "big", "step"}


def test_validate_checkpoint_id(tmp_path):
    assert FastPersistWriter.validate_checkpoint_id(str(tmp_path / "new"))
    assert FastPersistReader.validate_checkpoint_id(tmp_path)
    assert FastPersistWriter.validate_checkpoint_id("s3://bucket/ckpt")  # a prefix: tests/objectstore/test_s3_dcp.py
    assert not FastPersistWriter.validate_checkpoint_id("gs://bucket/ckpt")


def test_ring_writer_windows(tmp_path):
    """A file cut into many small ring windows (each archive across several; GPU tensors take the same path,
    through side-stream copies): every archive is valid and loads, the bytes item is in place."""
    import io
    import zipfile

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from fastpersist import config
    from fastpersist.dcp import layout, writer

    tensors = [torch.randn(n) for n in (1, 1000, 300000, (1 << 20) + 3, 0)]
    entries = [(MetadataIndex(f"t{i}"), t) for i, t in enumerate(tensors)]
    placed = layout.place_items("x.distcp", [*entries, (MetadataIndex("b"), b"hello")])
    settings = config.settings().replace(buffer_size=1 << 20, buffer_count=2)
    path = str(tmp_path / "x.distcp")
    crcs = writer.write_layout(placed, path, settings)
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) == placed.size
    items = [(i, it) for i, it in enumerate(placed.items) if isinstance(it, layout.TensorItem)]
    for i, item in items:
        archive = raw[item.base : item.base + item.length]
        assert zipfile.ZipFile(io.BytesIO(archive)).testzip() is None  # every zip CRC-32 right
        assert torch.equal(torch.load(io.BytesIO(archive)), tensors[i])
        payload = raw[item.payload_offset : item.payload_offset + item.nbytes]
        assert crcs[i] == zlib.crc32(payload)
    assert raw[placed.items[-1].base :][:5] == b"hello"


def test_a_failed_file_write_leaves_nothing_in_flight_and_no_file(tmp_path):
    """A write failing in the ring: the error surfaces once the ring drained, the partial file is gone and the
    ring's buffers are back in the pool (the next save of the same shape takes them)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from fastpersist import config
    from fastpersist.dcp import layout, writer
    from fastpersist.io import memory

    placed = layout.place_items("x.distcp", [(MetadataIndex(f"t{i}"), torch.randn(300_000)) for i in range(4)])
    settings = config.settings().replace(buffer_size=1 << 20, buffer_count=2)
    path = tmp_path / "x.distcp"
    with engine.inject_fault(nth=3, op="write"), pytest.raises(OSError, match="Input/output error"):
        writer.write_layout(placed, str(path), settings)
    assert not path.exists()
    pooled = memory.pooled_bytes()
    writer.write_layout(placed, str(path), settings)
    assert memory.pooled_bytes() == pooled  # no buffer was kept from the pool by the failed write


def test_reads_filesystem_writer_stream_transforms(tmp_path):
    """FileSystemWriter items written through DCP's (experimental) stream transforms are decoded as DCP does."""
    checkpoint_utils = pytest.importorskip("torch.testing._internal.distributed.checkpoint_utils")
    state = _state()
    _save(state, tmp_path, FileSystemWriter, _extensions=[checkpoint_utils.Rot13Example()])
    _load(
        tmp_path,
        state,
        _extension_registry=checkpoint_utils.get_test_extension_registry(),
    )
