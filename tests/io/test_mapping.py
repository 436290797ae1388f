"""Saves to tmpfs through a mapping of the file, copied by the CRC pool's threads (the ``tmpfs_mapping`` setting)."""

import errno
import mmap
import os
import shutil
import tempfile
import time
import zipfile

import numpy
import pytest
import torch

import fastpersist
from fastpersist.io import checksum, engine, mapping

SHM = "/dev/shm"


def _tmpfs_dir():
    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm")
    directory = tempfile.mkdtemp(prefix="fastpersist-mapped-", dir=SHM)
    probe = engine.File(os.path.join(directory, "probe"), "w")
    try:
        if probe.filesystem != "tmpfs":
            pytest.skip(f"/dev/shm is {probe.filesystem}, not tmpfs")
    finally:
        probe.close()
        os.unlink(os.path.join(directory, "probe"))
    return directory


@pytest.fixture
def tmpfs_dir():
    directory = _tmpfs_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def mappings(monkeypatch):
    """The result of every ``Mapping.for_writing`` call, in order: the saves that mapped their file."""
    made = []
    for_writing = mapping.Mapping.for_writing

    def spy(*args, **kwargs):
        made.append(for_writing(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(mapping.Mapping, "for_writing", spy)
    return made


def _state():
    # Several ring windows (2 MiB buffers), a storage across window ends, and small records between them.
    return {
        "large": torch.randn(1_500_000),
        "small": torch.arange(7, dtype=torch.int16),
        "odd": torch.randn(333_333).to(torch.bfloat16),
        "tail": torch.ones(3),
    }


def test_the_mapped_file_holds_the_written_ones_records(tmpfs_dir, mappings):
    state = _state()
    # The archive's records are named after the file: the same name in two directories.
    os.mkdir(os.path.join(tmpfs_dir, "mapped"))
    os.mkdir(os.path.join(tmpfs_dir, "written"))
    mapped, written = os.path.join(tmpfs_dir, "mapped", "ckpt.pt"), os.path.join(tmpfs_dir, "written", "ckpt.pt")
    fastpersist.save(state, mapped, tmpfs_mapping="always", buffer_size=2 << 20, buffer_count=3)
    assert len(mappings) == 1 and mappings[0] is not None
    fastpersist.save(state, written, tmpfs_mapping="never", buffer_size=2 << 20, buffer_count=3)
    assert len(mappings) == 1
    assert os.path.getsize(mapped) == os.path.getsize(written)
    with zipfile.ZipFile(mapped) as a, zipfile.ZipFile(written) as b:
        assert a.namelist() == b.namelist()
        for name in a.namelist():  # every record checked against its CRC-32; equal but the per-save id
            if not name.endswith("serialization_id"):
                assert a.read(name) == b.read(name), name
    loaded = torch.load(mapped)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    again = fastpersist.load(mapped, verify=True)
    assert all(torch.equal(again[name], tensor) for name, tensor in state.items())
    assert os.listdir(os.path.dirname(mapped)) == ["ckpt.pt"]


def test_asynchronous_saves_replace_a_mapped_checkpoint(tmpfs_dir, mappings):
    path = os.path.join(tmpfs_dir, "ckpt.pt")
    descriptors = len(os.listdir("/proc/self/fd"))
    for step in range(3):
        state = {"weights": torch.full((600_000,), float(step)), "step": torch.tensor(step)}
        fastpersist.async_save(state, path, tmpfs_mapping="always", buffer_size=1 << 20).result(timeout=60)
        loaded = fastpersist.load(path, verify=True)
        assert torch.equal(loaded["weights"], state["weights"]) and int(loaded["step"]) == step
    assert len(mappings) == 3 and all(m is not None for m in mappings)
    deadline = time.monotonic() + 10  # each mapping (and the descriptor it holds) is closed on a thread of its own
    while len(os.listdir("/proc/self/fd")) > descriptors:
        assert time.monotonic() < deadline, "a mapping's descriptor leaked"
        time.sleep(0.01)
    assert os.listdir(tmpfs_dir) == ["ckpt.pt"]


def test_auto_maps_only_with_enough_pool_threads(tmpfs_dir, mappings, monkeypatch):
    path = os.path.join(tmpfs_dir, "ckpt.pt")
    state = {"w": torch.randn(100_000)}
    monkeypatch.setattr(checksum, "threads", lambda: mapping.MIN_THREADS - 1)
    fastpersist.save(state, path, tmpfs_mapping="auto")
    monkeypatch.setattr(checksum, "threads", lambda: mapping.MIN_THREADS)
    fastpersist.save(state, path, tmpfs_mapping="auto")
    assert len(mappings) == 1 and mappings[0] is not None
    assert torch.equal(fastpersist.load(path)["w"], state["w"])


def test_files_off_tmpfs_are_not_mapped(tmp_path, mappings):
    path = tmp_path / "ckpt.pt"
    probe = engine.File(str(tmp_path / "probe"), "w")
    filesystem = probe.filesystem
    probe.close()
    if filesystem == "tmpfs":
        pytest.skip("the temporary directory is on tmpfs")
    state = {"w": torch.randn(10_000)}
    fastpersist.save(state, path, tmpfs_mapping="always", direct=False)
    assert mappings == []
    assert torch.equal(fastpersist.load(path)["w"], state["w"])


def test_the_setting_is_validated():
    with pytest.raises(fastpersist.ConfigError, match="tmpfs_mapping"):
        fastpersist.save({"w": torch.ones(1)}, os.devnull, tmpfs_mapping="sometimes")


def test_without_populate_the_copies_fault_their_pages_in(tmpfs_dir, mappings, monkeypatch):
    """Kernels before 5.14 have no MADV_POPULATE_WRITE: the copies take a fault per page of the allocated range."""
    monkeypatch.setattr(mapping, "_can_populate", lambda: False)
    path = os.path.join(tmpfs_dir, "ckpt.pt")
    state = _state()
    fastpersist.save(state, path, tmpfs_mapping="always", buffer_size=1 << 20)
    assert len(mappings) == 1 and mappings[0] is not None
    loaded = fastpersist.load(path, verify=True)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


def test_a_copy_whose_pages_cannot_be_filled_is_reported_not_copied(tmp_path):
    """The native task reports a failed page-table fill (a read-only destination here) instead of copying into
    it: the value the handle raises as an OSError naming the file."""
    source = torch.full((1 << 16,), 7, dtype=torch.uint8)
    path = tmp_path / "ro.bin"
    path.write_bytes(bytes(1 << 16))
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 1 << 16, access=mmap.ACCESS_READ)
    try:
        address = numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
        job = checksum.submit_copy(address, source.data_ptr(), 1 << 16, populate=True)
        job.wait()
        assert job.crc(0) != 0 and path.read_bytes() == bytes(1 << 16)
    finally:
        del address
        view.close()


def test_saves_from_several_threads_and_a_forked_child_map_their_own_files(tmpfs_dir, mappings, in_threads):
    """Each save maps its own file: threads saving at once, then a child forked while the pool runs (its pool
    has no threads: the copies run on the saving thread)."""
    states = [{"w": torch.full((400_000,), float(i)), "i": torch.tensor(i)} for i in range(4)]
    paths = [os.path.join(tmpfs_dir, f"ckpt{i}.pt") for i in range(4)]
    errors = in_threads(lambda i: fastpersist.save(states[i], paths[i], tmpfs_mapping="always", buffer_size=1 << 20), 4)
    assert not errors and len(mappings) == 4
    for state, path in zip(states, paths):
        assert torch.equal(fastpersist.load(path, verify=True)["w"], state["w"])
    child = os.fork()
    if child == 0:
        code = 1
        try:
            fastpersist.save(states[0], os.path.join(tmpfs_dir, "child.pt"), tmpfs_mapping="always")
            loaded = fastpersist.load(os.path.join(tmpfs_dir, "child.pt"), verify=True)
            # numpy's comparison: torch's would use the parent's intra-op threads, which a forked child has not
            code = 0 if numpy.array_equal(loaded["w"].numpy(), states[0]["w"].numpy()) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_injected_write_faults_reach_a_save_to_tmpfs(tmpfs_dir, mappings):
    """inject_fault breaks the engine's handles: under it a save to tmpfs writes through them, not a mapping."""
    path = os.path.join(tmpfs_dir, "ckpt.pt")
    with engine.inject_fault(nth=1, errno=errno.EIO, op="write"), pytest.raises(OSError) as caught:
        fastpersist.save(_state(), path, tmpfs_mapping="always")
    assert caught.value.errno == errno.EIO and mappings == [] and os.listdir(tmpfs_dir) == []
