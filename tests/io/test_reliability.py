"""Bad input gets a clear error and loses nothing; damaged files are detected and named.

Covers issue 4 except crashes (test_crash.py), engine faults
(test_fault_injection.py) and fuzzing (test_fuzz_loader.py): unusual tensor
kinds, unsupported objects, awkward targets (directory, missing parent,
read-only filesystem, full filesystem, tmpfs, file objects, a longer file
being replaced, symbolic links), stale temporary files, and verification:
every byte whose damage matters is caught by ``fastpersist.verify`` and by
``load(verify=True)``, naming the record, and truncations are caught at
every boundary.
"""

from __future__ import annotations

import errno
import glob
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile

import pytest
import torch

import fastpersist
from fastpersist import cli, system
from fastpersist.distributed.save import _temporary_name as _collective_temporary_name
from fastpersist.errors import ChecksumMismatchError, CorruptCheckpointError, UnsupportedObjectError
from fastpersist.format.zipformat import check_structure, read_directory
from fastpersist.io import commit

# ----------------------------------------------------------------------------- helpers


def same(a, b) -> bool:
    """Deep equality, tensors by type, dtype, layout, shape and values (NaN-free inputs)."""
    if isinstance(a, torch.Tensor):
        if type(a) is not type(b) or a.dtype != b.dtype or a.layout != b.layout or a.is_nested != b.is_nested:
            return False
        if a.is_nested:
            return len(a.unbind()) == len(b.unbind()) and all(same(x, y) for x, y in zip(a.unbind(), b.unbind()))
        if a.shape != b.shape:
            return False
        if a.is_quantized:
            return (
                a.qscheme() == b.qscheme()
                and torch.equal(a.int_repr(), b.int_repr())
                and torch.equal(a.dequantize(), b.dequantize())
            )
        if a.layout != torch.strided:
            return torch.equal(a.to_dense(), b.to_dense())
        return torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def temporaries(directory) -> list[str]:
    return sorted(glob.glob(os.path.join(str(directory), ".*.fastpersist-*.tmp")))


def small_checkpoint(path, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    obj = {
        "weight": torch.randn(40, 30, generator=generator),
        "bias": torch.randn(7, generator=generator),
        "empty": torch.empty(0),
        "step": seed,
    }
    fastpersist.save(obj, path)
    return obj


class MyTensor(torch.Tensor):
    """A tensor subclass at module level (picklable; refused by weights_only, as torch does)."""


# ----------------------------------------------------------------------------- tensor kinds


def _special_tensors() -> dict:
    torch.manual_seed(0)
    dense = torch.randn(6, 4)
    dense[dense.abs() < 0.7] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta", "nested tensors are a prototype"
        return {
            "coo": dense.to_sparse(),
            "coo_uncoalesced": torch.sparse_coo_tensor(
                torch.tensor([[0, 0, 1], [1, 1, 2]]), torch.tensor([1.0, 2, 3]), (2, 3)
            ),
            "csr": dense.to_sparse_csr(),
            "csc": dense.to_sparse_csc(),
            "bsr": dense.to_sparse_bsr((2, 2)),
            "nested": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
            "nested_jagged": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(5, 3)], layout=torch.jagged),
            "qint8": torch.quantize_per_tensor(torch.randn(10), 0.1, 3, torch.qint8),
            "quint8_per_channel": torch.quantize_per_channel(
                torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 2]), 0, torch.quint8
            ),
            "parameter": torch.nn.Parameter(torch.randn(3)),
            "subclass": torch.randn(5).as_subclass(MyTensor),
            "complex_view": torch.randn(4, dtype=torch.complex64)[1:],
        }


SPECIAL = _special_tensors()


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_special_tensors_round_trip(kind, tmp_path):
    """Sparse, nested, quantized and subclass tensors: as torch.save does, both ways."""
    obj = {"x": SPECIAL[kind], "also": torch.arange(3)}
    ours, theirs = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    fastpersist.save(obj, ours)
    torch.save(obj, theirs)
    torch_refuses = kind == "subclass"  # weights_only refuses unknown subclasses in torch.load too
    for weights_only in (True, False):
        if weights_only and torch_refuses:
            for path in (ours, theirs):
                with pytest.raises(pickle.UnpicklingError):
                    torch.load(path, weights_only=True)
                with pytest.raises(pickle.UnpicklingError):
                    fastpersist.load(path, weights_only=True)
            continue
        for loader in (torch.load, fastpersist.load):
            for path in (ours, theirs):
                assert same(obj, loader(path, weights_only=weights_only)), (loader, path, weights_only)
    assert same(obj, fastpersist.load(ours, weights_only=not torch_refuses, verify=True, mmap=True))
    assert fastpersist.verify(ours).checksummed


# ----------------------------------------------------------------------------- bad input to save


@pytest.mark.parametrize(
    "bad",
    [lambda: 1, (i for i in range(3)), __import__("threading").Lock()],
    ids=["lambda", "generator", "lock"],
)
def test_unsupported_object_leaves_old_checkpoint_and_no_file(bad, tmp_path):
    path = tmp_path / "ckpt.pt"
    old = small_checkpoint(path)
    before = path.read_bytes()
    with pytest.raises(UnsupportedObjectError, match="cannot serialize") as info:
        fastpersist.save({"w": torch.ones(3), "bad": bad}, path)
    assert isinstance(info.value, TypeError)  # what torch.save raises, so old handlers still work
    assert path.read_bytes() == before and same(old, fastpersist.load(path))
    assert temporaries(tmp_path) == []
    with pytest.raises(UnsupportedObjectError):
        fastpersist.async_save({"bad": bad}, tmp_path / "async.pt")  # raised at once, not in the future
    assert not (tmp_path / "async.pt").exists()


def test_target_is_a_directory(tmp_path):
    (tmp_path / "ckpt.pt").mkdir()
    with pytest.raises(IsADirectoryError, match="pass a file path") as info:
        fastpersist.save({"a": torch.ones(1)}, tmp_path / "ckpt.pt")
    assert info.value.errno == errno.EISDIR
    with pytest.raises(IsADirectoryError):
        fastpersist.load(tmp_path / "ckpt.pt")
    assert temporaries(tmp_path) == [] and os.listdir(tmp_path / "ckpt.pt") == []


def test_parent_directory_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="create it first") as info:
        fastpersist.save({"a": torch.ones(1)}, tmp_path / "missing" / "ckpt.pt")
    assert info.value.errno == errno.ENOENT and info.value.filename == str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        fastpersist.async_save({"a": torch.ones(1)}, tmp_path / "missing" / "ckpt.pt")
    assert os.listdir(tmp_path) == []


def test_read_only_filesystem(readonly_tmpfs):
    target = os.path.join(readonly_tmpfs, "ckpt.pt")
    with pytest.raises(OSError, match="read-only") as info:
        fastpersist.save({"a": torch.ones(1)}, target)
    assert info.value.errno == errno.EROFS  # what torch.save's open() raises there
    with pytest.raises(OSError, match="read-only"):
        fastpersist.async_save({"a": torch.ones(1)}, target)
    assert os.listdir(readonly_tmpfs) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_directory_without_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match="no permission"):
        fastpersist.save({"a": torch.ones(1)}, locked / "ckpt.pt")


@pytest.mark.root
@pytest.mark.parametrize(
    "settings",
    [{"direct": True}, {"direct": False, "tmpfs_mapping": "never"}, {"tmpfs_mapping": "always"}],
    ids=["direct", "written", "mapped"],
)
def test_disk_full_keeps_old_checkpoint_and_leaves_no_temporary(small_tmpfs, settings):
    path = os.path.join(small_tmpfs, "ckpt.pt")
    old = small_checkpoint(path)
    before = open(path, "rb").read()
    with pytest.raises(OSError) as info:
        fastpersist.save({"big": torch.randn(2_000_000)}, path, **settings)  # 8 MB into 4 MiB
    assert info.value.errno == errno.ENOSPC
    assert "filesystem is full" in str(info.value)
    assert any("previous file there is untouched" in note for note in getattr(info.value, "__notes__", []))
    assert open(path, "rb").read() == before and same(old, fastpersist.load(path, verify=True))
    assert os.listdir(small_tmpfs) == ["ckpt.pt"]
    future = fastpersist.async_save({"big": torch.randn(2_000_000)}, path, **settings)
    with pytest.raises(OSError) as info:
        future.result(timeout=60)
    assert info.value.errno == errno.ENOSPC and open(path, "rb").read() == before
    assert os.listdir(small_tmpfs) == ["ckpt.pt"]
    # The space comes back: nothing holds the removed temporaries open. The kernel may release the pages a
    # moment after the last close (likely: io_uring's workers drop their file references asynchronously; on the
    # 2-core CI machine under load that took longer than the next save): wait for it, a few seconds at most.
    deadline = time.monotonic() + 10
    while free_bytes(small_tmpfs) < 3 << 20:
        assert time.monotonic() < deadline, f"{free_bytes(small_tmpfs)} bytes free: a temporary is still held"
        time.sleep(0.01)
    new = {"fits": torch.randn(100_000)}
    fastpersist.save(new, path)
    assert same(new, fastpersist.load(path, verify=True)) and same(new, torch.load(path))


def free_bytes(directory) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def test_filesystem_without_direct_io(shm_dir):
    """tmpfs refuses O_DIRECT: the engine falls back to buffered I/O, transparently."""
    from fastpersist.io import engine

    probe = engine.probe_directory(shm_dir)
    assert not probe["direct"]  # otherwise this test tests nothing
    path = os.path.join(shm_dir, "ckpt.pt")
    obj = {"a": torch.randn(300_000), "b": torch.randn(5)}
    fastpersist.save(obj, path, direct=True)
    assert same(obj, fastpersist.load(path, verify=True, direct=True)) and same(obj, torch.load(path))


class NoFileno(io.RawIOBase):
    """A writable stream without a file descriptor (a socket-like sink)."""

    def __init__(self):
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, chunk):
        self.data += chunk
        return len(chunk)

    def fileno(self):
        raise io.UnsupportedOperation("fileno")


def test_file_objects_without_fileno(tmp_path):
    obj = {"a": torch.randn(1000), "n": 3}
    buffer = io.BytesIO()
    fastpersist.save(obj, buffer)  # fsync is on by default: must not fail for lack of a descriptor
    assert same(obj, torch.load(io.BytesIO(buffer.getvalue())))
    assert same(obj, fastpersist.load(io.BytesIO(buffer.getvalue()), verify=True))
    sink = NoFileno()
    fastpersist.save(obj, sink)
    assert bytes(sink.data)[:4] == b"PK\x03\x04" and same(obj, torch.load(io.BytesIO(bytes(sink.data))))
    damaged = bytearray(buffer.getvalue())
    damaged[read_directory(lambda o, n: bytes(damaged[o : o + n]), len(damaged))[-3].data_offset + 5] ^= 1
    with pytest.raises(ChecksumMismatchError, match="archive/data/"):
        fastpersist.load(io.BytesIO(bytes(damaged)), verify=True)
    with pytest.raises(TypeError, match="file-like object with a 'write' attribute"):
        fastpersist.save(obj, object())
    with pytest.raises(AttributeError):  # what torch.save raises there
        fastpersist.save(obj, object())


def test_replacing_a_longer_file_leaves_no_stale_bytes(any_dir):
    path = os.path.join(any_dir, "ckpt.pt")
    with open(path, "wb") as handle:
        handle.write(b"\xff" * (3 << 20))
    obj = {"a": torch.randn(1000)}
    fastpersist.save(obj, path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        end = max(i.header_offset for i in archive.infolist())
    from fastpersist.format.serializer import plan_save

    assert os.path.getsize(path) == plan_save(obj, "ckpt").size > end  # exactly the new file's size
    assert fastpersist.verify(path).records == 7  # nothing after the end records
    assert same(obj, fastpersist.load(path, verify=True))


def test_permissions_of_replaced_file_are_kept(tmp_path):
    path = tmp_path / "ckpt.pt"
    small_checkpoint(path)
    os.chmod(path, 0o640)
    small_checkpoint(path, seed=1)
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_saving_through_a_symbolic_link_replaces_its_target(tmp_path):
    """Like torch.save, which opens the link: the link stays, the file it points to changes."""
    real = tmp_path / "step-100.pt"
    link = tmp_path / "latest.pt"
    small_checkpoint(real)
    link.symlink_to(real.name)
    new = small_checkpoint(link, seed=5)
    assert link.is_symlink() and os.readlink(link) == real.name
    assert same(new, fastpersist.load(real)) and same(new, torch.load(link))
    assert temporaries(tmp_path) == []


def test_interrupted_save_removes_its_temporary(tmp_path, monkeypatch):
    """Ctrl-C (or any exception) in the middle of writing: the old file stays, the temporary goes."""
    path = tmp_path / "ckpt.pt"
    old = small_checkpoint(path)

    def interrupted(plan, file, settings, streams=None, **_):
        file.allocate(0, plan.size)
        raise KeyboardInterrupt

    monkeypatch.setattr(commit, "write_plan", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fastpersist.save({"new": torch.ones(10)}, path)
    assert temporaries(tmp_path) == [] and same(old, fastpersist.load(path, verify=True))


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    path = tmp_path / "ckpt.pt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / commit.temporary_name("ckpt.pt", str(tmp_path), pid=dead.pid)
    alive = tmp_path / commit.temporary_name("ckpt.pt", str(tmp_path), pid=os.getppid())  # maybe saving now
    other = tmp_path / commit.temporary_name("other.pt", str(tmp_path), pid=dead.pid)  # another checkpoint's
    for leftover in (stale, alive, other):
        leftover.write_bytes(b"partial")  # just written: age does not matter once the writer is gone
    obj = small_checkpoint(path)
    assert not stale.exists() and alive.exists() and not other.exists()
    # Readers never see temporaries: the checkpoint is the committed file.
    assert same(obj, fastpersist.load(path, verify=True))


def test_temporaries_of_killed_but_unreaped_savers_are_removed(tmp_path):
    """A saver killed by SIGKILL stays a zombie until its parent reaps it; it writes nothing more."""
    path = tmp_path / "ckpt.pt"
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        zombie.kill()
        deadline = time.monotonic() + 10
        while open(f"/proc/{zombie.pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0] != b"Z":
            assert time.monotonic() < deadline, "the child did not become a zombie"
            time.sleep(0.01)
        stale = tmp_path / commit.temporary_name("ckpt.pt", str(tmp_path), pid=zombie.pid)
        stale.write_bytes(b"partial")
        small_checkpoint(path)
        assert not stale.exists()
    finally:
        zombie.wait()


def test_stale_temporaries_are_told_apart_by_pid_and_start_time(tmp_path):
    """A PID names a process only while it lives: the start time in the name tells a later holder apart."""
    path = tmp_path / "ckpt.pt"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = system.process_start_time(sleeper.pid)
        own = system.process_start_time(os.getpid())
        assert started is not None and own is not None
        kept = {
            # another process's save in progress
            "live": commit.temporary_name("ckpt.pt", str(tmp_path), pid=sleeper.pid, started=started),
            # an older fastpersist's name of a live PID: the PID is all there is to go by
            "old-form live": commit.temporary_name("ckpt.pt", str(tmp_path), pid=sleeper.pid),
            # this process's own, unregistered (the collective save's temporaries are not)
            "own": os.path.basename(_collective_temporary_name(str(path), str(tmp_path))),
        }
        removed = {
            # the PID was reused: the process that wrote it started at another time
            "reused": commit.temporary_name("ckpt.pt", str(tmp_path), pid=sleeper.pid, started=started + 1),
            # an earlier holder of this process's PID, in the new and the old form
            "own reused": commit.temporary_name("ckpt.pt", str(tmp_path), pid=os.getpid(), started=own - 1),
            "own old form": commit.temporary_name("ckpt.pt", str(tmp_path), pid=os.getpid()),
            # a collective save's part, as a killed rank leaves it
            "part": commit.temporary_name("ckpt.pt.ab12.part-1-of-2", str(tmp_path), pid=os.getpid(), started=0),
        }
        for name in [*kept.values(), *removed.values()]:
            (tmp_path / name).write_bytes(b"partial")
            os.utime(tmp_path / name, (time.time() - 3600, time.time() - 3600))  # age decides nothing
        small_checkpoint(path)
        left = set(os.listdir(tmp_path)) - {"ckpt.pt"}
        assert left == set(kept.values()), {k: v in left for k, v in {**kept, **removed}.items()}
    finally:
        sleeper.kill()
        sleeper.wait()


# ----------------------------------------------------------------------------- damaged files


def test_empty_and_garbage_files(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="is empty") as info:
        fastpersist.load(empty)
    assert isinstance(info.value, EOFError)  # torch.load raised EOFError here: old handlers still work
    with pytest.raises(CorruptCheckpointError, match="too small"):
        fastpersist.verify(empty)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(bytes(range(256)) * 20)
    with pytest.raises((CorruptCheckpointError, pickle.UnpicklingError)):
        fastpersist.load(garbage)
    with pytest.raises(CorruptCheckpointError, match="no zip end"):
        fastpersist.verify(garbage)
    zip_magic = tmp_path / "zip_magic.pt"
    zip_magic.write_bytes(b"PK\x03\x04" + bytes(5000))
    with pytest.raises(CorruptCheckpointError, match="no zip end"):
        fastpersist.load(zip_magic)


def test_a_zip_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "hello")
    with pytest.raises(CorruptCheckpointError, match="not a torch checkpoint"):
        fastpersist.load(path)
    with pytest.raises(CorruptCheckpointError, match="not a torch checkpoint"):
        fastpersist.verify(path)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x/data.pkl", pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(CorruptCheckpointError, match="compressed"):
        fastpersist.load(path)


def test_legacy_files_load_and_damaged_ones_say_so(tmp_path):
    path = tmp_path / "legacy.pt"
    obj = {"a": torch.randn(100)}
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    assert same(obj, fastpersist.load(path))
    data = path.read_bytes()
    for length in (len(data) // 2, 20, 3):
        path.write_bytes(data[:length])
        with pytest.raises((RuntimeError, EOFError), match="corrupt|truncated|damaged"):  # torch's or ours
            fastpersist.load(path)


def _archive_map(path) -> dict:
    """Byte ranges of every structure of an archive: name -> list of (start, end, label)."""
    data = open(path, "rb").read()
    records = read_directory(lambda o, n: data[o : o + n], len(data))
    regions = []
    for r in records:
        regions.append((r.header_offset, r.data_offset, r.name, "header"))
        regions.append((r.data_offset, r.data_offset + r.size, r.name, "payload"))
        if r.size:
            regions.append((r.data_offset + r.size, r.data_offset + r.size + 16, r.name, "descriptor"))
    return data, records, regions


# Fields that no reader uses and no check can cover (there is no checksum over the
# directory): version made by, disk start, internal and external attributes in
# each central entry; versions and disk numbers in the zip64 end record; disk
# numbers in the locator; the "disk with the directory" in the end record.
_CENTRAL_UNCHECKED = [(4, 2), (34, 2), (36, 2), (38, 4)]
_EOCD64_UNCHECKED = [(12, 2), (14, 2), (16, 4), (20, 4)]
_LOCATOR_UNCHECKED = [(4, 4), (16, 4)]
_EOCD_UNCHECKED = [(6, 2)]


def _unchecked_offsets(data: bytes) -> set[int]:
    offsets = set()
    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", data, eocd + 12)
    position = cd_offset
    while position < cd_offset + cd_size:
        offsets |= {position + s + i for s, n in _CENTRAL_UNCHECKED for i in range(n)}
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, position + 28)
        position += 46 + name_len + extra_len + comment_len
    eocd64 = cd_offset + cd_size
    offsets |= {eocd64 + s + i for s, n in _EOCD64_UNCHECKED for i in range(n)}
    locator = eocd - 20
    offsets |= {locator + s + i for s, n in _LOCATOR_UNCHECKED for i in range(n)}
    offsets |= {eocd + s + i for s, n in _EOCD_UNCHECKED for i in range(n)}
    return offsets


def _record_at(records, offset: int) -> str | None:
    for r in records:
        end = r.data_offset + r.size + (16 if r.size else 0)
        if r.header_offset <= offset < end:
            return r.name
    return None


def test_verify_catches_every_flipped_byte_and_names_the_record(tmp_path):
    """Every byte of a checkpoint, flipped one at a time: verify catches each one that matters."""
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"w": torch.randn(30), "b": torch.arange(5), "e": torch.empty(0)}, path)
    good = path.read_bytes()
    records = read_directory(lambda o, n: good[o : o + n], len(good))
    unchecked = _unchecked_offsets(good)
    missed, misnamed = [], []
    damaged = "/dev/shm" if os.path.isdir("/dev/shm") else tmp_path  # many small writes
    damaged = os.path.join(tempfile.mkdtemp(dir=damaged), "damaged.pt")
    for offset in range(len(good)):
        data = bytearray(good)
        data[offset] ^= 0x10
        with open(damaged, "wb") as handle:
            handle.write(data)
        try:
            fastpersist.verify(damaged)
        except CorruptCheckpointError as e:
            payload = [r.name for r in records if r.data_offset <= offset < r.data_offset + r.size]
            if payload and not (isinstance(e, ChecksumMismatchError) and e.record == payload[0]):
                misnamed.append((offset, payload[0], str(e)))
            elif _record_at(records, offset) is not None and e.record is None:
                misnamed.append((offset, _record_at(records, offset), str(e)))
        else:
            if offset not in unchecked:
                missed.append(offset)
    shutil.rmtree(os.path.dirname(damaged))
    assert missed == [], f"flips at these offsets went unnoticed: {missed[:20]}"
    assert misnamed == [], misnamed[:5]
    assert len(unchecked) < 120  # informational fields only


def test_load_with_verify_catches_flipped_bytes_and_names_the_record(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"w": torch.randn(3000), "b": torch.arange(5)}, path)
    good = path.read_bytes()
    records = read_directory(lambda o, n: good[o : o + n], len(good))
    damaged = tmp_path / "damaged.pt"
    for record in records:
        for offset in sorted(
            {record.data_offset, record.data_offset + record.size // 2, record.data_offset + record.size - 1}
        ):
            if record.size == 0:
                continue
            data = bytearray(good)
            data[offset] ^= 0x01
            damaged.write_bytes(data)
            with pytest.raises(ChecksumMismatchError) as info:
                fastpersist.load(damaged, verify=True)
            assert info.value.record == record.name and record.name in str(info.value)
            assert "Restore the checkpoint" in str(info.value)
            with pytest.raises(ChecksumMismatchError):
                fastpersist.load(damaged, verify=True, mmap=True)
        # the header: its name, its padding
        for offset in (record.header_offset + 30, record.data_offset - 1):
            data = bytearray(good)
            data[offset] ^= 0x01
            damaged.write_bytes(data)
            with pytest.raises(CorruptCheckpointError) as info:
                fastpersist.load(damaged, verify=True)
            assert info.value.record == record.name


def test_files_without_checksums(tmp_path):
    path = tmp_path / "ckpt.pt"
    obj = {"a": torch.randn(10)}
    fastpersist.save(obj, path, checksum=False)
    report = fastpersist.verify(path)
    assert not report.checksummed and report.records == 7
    with pytest.warns(UserWarning, match="without CRC-32"):
        assert same(obj, fastpersist.load(path, verify=True))


def _boundaries(path) -> list[int]:
    data, records, regions = _archive_map(path)
    points = {0, 1, 4, 29, 30, len(data) - 1, len(data) - 22, len(data) - 21, len(data) - 42, len(data) - 98}
    for start, end, _, _ in regions:
        points |= {start - 1, start, start + 1, end - 1, end, end + 1}
    eocd = data.rfind(b"PK\x05\x06")
    cd_offset = struct.unpack_from("<I", data, eocd + 16)[0]
    points |= {cd_offset - 1, cd_offset, cd_offset + 1, cd_offset + 46}
    return sorted(p for p in points if 0 <= p < len(data))


def test_truncation_at_every_boundary(tmp_path):
    path = tmp_path / "ckpt.pt"
    obj = {"w": torch.randn(2000), "b": torch.arange(5), "e": torch.empty(0)}
    fastpersist.save(obj, path)
    good = path.read_bytes()
    records = read_directory(lambda o, n: good[o : o + n], len(good))
    cut = tmp_path / "cut.pt"
    for length in _boundaries(path):
        cut.write_bytes(good[:length])
        with pytest.raises((CorruptCheckpointError, pickle.UnpicklingError)):
            fastpersist.load(cut)
        with pytest.raises(CorruptCheckpointError) as info:
            fastpersist.verify(cut)
        if length > 30:  # the first local header is complete: the message names a record
            assert info.value.record in {r.name for r in records}, (length, str(info.value))
            assert "cut short" in str(info.value) or "truncated" in str(info.value)


def test_appended_bytes_are_tolerated_like_torch(tmp_path):
    """torch.load ignores bytes after the zip end record; so do load and verify (docs/compatibility.md)."""
    path = tmp_path / "ckpt.pt"
    obj = small_checkpoint(path)
    with open(path, "ab") as handle:
        handle.write(b"\0" * 100)
    fastpersist.verify(path)
    assert same(obj, fastpersist.load(path, verify=True)) and same(obj, torch.load(path))


def central_entries(data: bytes) -> dict[str, int]:
    """Record name -> offset of its central directory entry."""
    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", data, eocd + 12)
    entries, position = {}, cd_offset
    while position < cd_offset + cd_size:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, position + 28)
        entries[bytes(data[position + 46 : position + 46 + name_len]).decode()] = position
        position += 46 + name_len + extra_len + comment_len
    return entries


def test_record_sizes_past_the_end_are_rejected_before_allocating(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"w": torch.randn(1000)}, path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<II", data, central_entries(data)["ckpt/data/0"] + 20, 0xFFFFFFF0, 0xFFFFFFF0)  # 4 GiB
    path.write_bytes(data)
    lengths = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: lengths.append(n) or real_pread(fd, n, off))
    for check in (fastpersist.load, fastpersist.verify, lambda p: fastpersist.load(p, verify=True)):
        with pytest.raises(CorruptCheckpointError, match="runs past the data area") as info:
            check(path)
        assert info.value.record == "ckpt/data/0"
    assert max(lengths) <= len(data)  # os.pread allocates what it is asked for: never more than the file


def test_structure_of_a_sparse_zip64_archive(tmp_path):
    """A record over 4 GiB and one past 4 GiB, laid out by fastpersist's writer, in a sparse file.

    check_structure and read_directory follow the zip64 fields (local and
    central extras, 24-byte descriptors, zip64 end record) without reading
    the payloads, and name the record whose zip64 field is damaged.
    """
    from fastpersist.format.zipformat import layout_archive

    big = (4 << 30) + 123
    layout = layout_archive(
        [("z/data.pkl", 10, False), ("z/data/0", big, True), ("z/data/1", 4096, True), ("z/version", 2, False)]
    )
    crcs = [0x1234, 0x5678, 0x9ABC, 0xDEF0]  # not checked here: no payload is read
    path = tmp_path / "zip64.pt"
    with open(path, "wb") as handle:
        for entry, crc in zip(layout.entries, crcs):
            handle.seek(entry.header_offset)
            handle.write(entry.local_header())
            if entry.descriptor_size:
                handle.seek(entry.descriptor_offset)
                handle.write(entry.data_descriptor(crc))
        handle.seek(layout.central_directory_offset)
        handle.write(layout.trailer(crcs))
    assert os.path.getsize(path) == layout.size and layout.entries[2].header_offset > 0xFFFFFFFF
    with open(path, "rb") as handle:
        read_at = lambda offset, length: os.pread(handle.fileno(), length, offset)  # noqa: E731
        records = check_structure(read_at, layout.size, str(path))
        assert [(r.name, r.size, r.data_offset) for r in records] == [
            (e.name, e.size, e.data_offset) for e in layout.entries
        ]
        assert read_directory(read_at, layout.size) == records
    data = bytearray(open(path, "rb").read(layout.entries[1].data_offset))  # the head: data/0's local header
    zip64_field = data.rfind(struct.pack("<Q", big))  # in data/0's local zip64 extra
    with open(path, "r+b") as handle:  # damaged in place: a copy would write 4 GiB
        handle.seek(zip64_field)
        handle.write(struct.pack("<Q", big + 1))
    with open(path, "rb") as handle:
        with pytest.raises(CorruptCheckpointError) as info:
            check_structure(lambda o, n: os.pread(handle.fileno(), n, o), layout.size, str(path))
    assert info.value.record == "z/data/0"


def test_weights_only_refuses_a_malicious_pickle(tmp_path):
    """A valid archive (CRCs and all) whose data.pkl would run a shell command."""

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("evil/data.pkl", pickle.dumps(Exploit(), protocol=2))
        archive.writestr("evil/version", "3\n")
    assert fastpersist.verify(path).checksummed  # structurally fine
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        fastpersist.load(path)
    with pytest.raises(pickle.UnpicklingError):
        fastpersist.load(path, verify=True)
    assert not (tmp_path / "pwned").exists()


def test_malformed_persistent_ids_are_pickle_errors(tmp_path):
    path = tmp_path / "bad.pt"

    class Id:
        def __init__(self, saved_id):
            self.saved_id = saved_id

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.saved_id if isinstance(obj, Id) else None

    cases = [
        ("storage",),
        ("storage", torch.FloatStorage, ["key"], "cpu", 4),
        ("disk", torch.FloatStorage, "0", "cpu", 1),
        ("storage", torch.FloatStorage, "0", "cpu", -1),
        ("storage", torch.FloatStorage, "9", "cpu", 1),
    ]
    for saved_id in cases:
        buffer = io.BytesIO()
        Pickler(buffer, protocol=2).dump([Id(saved_id)])
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("bad/data.pkl", buffer.getvalue())
            archive.writestr("bad/data/0", bytes(16))
        with pytest.raises((pickle.UnpicklingError, CorruptCheckpointError)):
            fastpersist.load(path)


def test_failed_load_does_not_poison_the_next_one(tmp_path):
    """torch queues sparse tensors for validation; a failed load must not leave them queued."""
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    fastpersist.save({"s": torch.randn(3, 3).to_sparse()}, good)
    invalid = torch.sparse_coo_tensor(torch.tensor([[0], [7]]), torch.tensor([1.0]), (2, 2), check_invariants=False)
    fastpersist.save({"s": invalid, "later": torch.ones(1)}, tmp_path / "full.pt")
    with zipfile.ZipFile(tmp_path / "full.pt") as source, zipfile.ZipFile(bad, "w") as target:
        for info in source.infolist():
            if info.filename != "full/data/2":  # "later"'s storage: missing, after "s" was rebuilt
                target.writestr(info.filename, source.read(info))
    with torch.sparse.check_sparse_tensor_invariants():
        with pytest.raises(CorruptCheckpointError, match="missing record"):
            fastpersist.load(bad)
        assert fastpersist.load(good)["s"].layout == torch.sparse_coo
        with pytest.raises(CorruptCheckpointError, match="sparse tensor in the file is invalid"):
            fastpersist.load(tmp_path / "full.pt")


# ----------------------------------------------------------------------------- the verify command


def test_verify_command_exit_codes(tmp_path, capsys):
    from fastpersist.cli import verify as verify_cli

    good, bad, missing = tmp_path / "good.pt", tmp_path / "bad.pt", tmp_path / "missing.pt"
    small_checkpoint(good)
    data = bytearray(good.read_bytes())
    record = [r for r in read_directory(lambda o, n: bytes(data[o : o + n]), len(data)) if r.name.endswith("data/0")][0]
    data[record.data_offset + 17] ^= 0x80
    bad.write_bytes(data)  # a copy of good.pt: its records are named good/...

    def run(*arguments):
        code = verify_cli.main([str(a) for a in arguments])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = run(good)
    assert code == 0 and "OK" in out and "CRC-32" in out
    code, out, _ = run(good, bad)
    assert code == 1 and "CORRUPT" in out and "bad.pt" in out and "'good/data/0'" in out
    code, _, err = run(missing)
    assert code == 2 and "No such file" in err
    with pytest.raises(SystemExit) as info:
        run()
    assert info.value.code == 2 and "usage" in capsys.readouterr().err
    code, out, _ = run("--json", good, bad, missing)
    assert code == 2
    report = json.loads(out)
    assert [r["status"] for r in report] == ["ok", "corrupt", "error"]
    assert report[1]["record"] == "good/data/0" and report[1]["kind"] == "checksum"
    unchecked = tmp_path / "unchecked.pt"
    fastpersist.save({"a": torch.ones(2)}, unchecked, checksum=False)
    assert run(unchecked)[0] == 0 and run("--require-checksums", unchecked)[0] == 1
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert run(legacy)[0] == 2
    # As a program: the exit status reaches the shell.
    result = subprocess.run(
        [sys.executable, "-m", "fastpersist.cli.verify", str(good), str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "CORRUPT" in result.stdout and "OK" in result.stdout


def test_verify_subcommand_of_the_main_command(tmp_path):
    assert "verify" in cli.COMMANDS
    good = tmp_path / "good.pt"
    small_checkpoint(good)
    result = subprocess.run(
        [sys.executable, "-m", "fastpersist", "verify", str(good)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "OK" in result.stdout
    good.write_bytes(good.read_bytes()[:-10])
    assert cli.main(["verify", str(good)]) == 1
