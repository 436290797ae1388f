"""The manifest of a ``layout="parts"`` checkpoint: its file form, the older form, and the part names it may hold.

The sharded checkpoints here are made in one process (tests/_workers/_parts.py):
an ordinary checkpoint's bytes cut into two parts and a trailer. What the
ranks of a real collective save write is tested in test_distributed.py.
"""

from __future__ import annotations

import os
import zipfile

import pytest
import torch
from _parts import checkpoint_bytes, make_state, split, write_parts

import fastpersist
from fastpersist.cli import main
from fastpersist.cli.merge import merge
from fastpersist.distributed.manifest import HEAD_SIZE, RECORD, Manifest, is_manifest, looks_like_manifest
from fastpersist.errors import CorruptCheckpointError, UnsafeFileNameError


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize("options", [{}, {"weights_only": False}, {"mmap": True}])
def test_torch_load_of_a_manifest_says_to_use_fastpersist_load(tmp_path, options):
    path, _ = write_parts(tmp_path)
    with pytest.raises(RuntimeError, match=r"not in a subdirectory: this file is the manifest of a fastpersist") as e:
        torch.load(path, **options)
    assert "load it with fastpersist.load(path)" in str(e.value) and "fastpersist merge" in str(e.value)
    assert same(fastpersist.load(path), make_state())


def test_a_manifest_is_one_stored_zip_record_holding_the_json_document(tmp_path):
    path, _ = write_parts(tmp_path)
    with zipfile.ZipFile(path) as archive:  # any zip tool reads it: unzip -p PATH
        (info,) = archive.infolist()
        assert info.filename == RECORD and info.compress_type == zipfile.ZIP_STORED
        document = archive.read(RECORD)
    assert Manifest.from_bytes(document, path) == Manifest.from_bytes(open(path, "rb").read(), path)
    assert 30 + len(RECORD) <= HEAD_SIZE  # looks_like_manifest sees the whole name in the head callers read
    assert is_manifest(path) and looks_like_manifest(open(path, "rb").read(HEAD_SIZE))
    assert not looks_like_manifest(open(path, "rb").read(100))  # too short a head to tell: not one
    ordinary = tmp_path / "ordinary.pt"
    fastpersist.save(make_state(), ordinary)
    assert not is_manifest(str(ordinary))


def test_manifests_written_before_the_zip_wrapper_still_load_verify_and_merge(tmp_path):
    path, _ = write_parts(tmp_path, bare_json=True)
    assert open(path, "rb").read(1) == b"{" and is_manifest(path)
    assert same(fastpersist.load(path), make_state())
    assert fastpersist.verify(path).checksummed
    assert merge(path, str(tmp_path / "merged.pt")).checksummed
    assert same(torch.load(tmp_path / "merged.pt"), make_state())
    assert main(["verify", path]) == 0


def test_a_damaged_manifest_record_is_refused(tmp_path):
    path, _ = write_parts(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[data.index(b'"token"') + 2] ^= 0x01  # a byte of the JSON document: the record's CRC-32 no longer matches
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="damaged sharded-checkpoint manifest"):
        fastpersist.load(path)


def _outside(tmp_path, piece: bytes) -> str:
    """A file outside the checkpoint's directory holding exactly the bytes of the part it is named for: a load
    that followed the name would read it and succeed."""
    os.makedirs(tmp_path / "elsewhere", exist_ok=True)
    target = tmp_path / "elsewhere" / "x"
    target.write_bytes(piece)
    return str(target)


NAMES = {
    "parent": lambda outside: "../elsewhere/x",
    "absolute": lambda outside: outside,
    "etc-passwd": lambda outside: "/etc/passwd",
    "subdirectory": lambda outside: "sub/x",
    "nul": lambda outside: "x\0y",
    "dot-dot": lambda outside: "..",
    "empty": lambda outside: "",
}


@pytest.mark.parametrize("kind", sorted(NAMES))
@pytest.mark.parametrize("bare_json", [False, True])
def test_part_names_that_leave_the_directory_are_refused_before_anything_is_opened(tmp_path, kind, bare_json):
    (tmp_path / "control").mkdir()
    assert fastpersist.load(write_parts(tmp_path / "control")[0], verify=False)["step"] == 7  # named as saved: loads
    checkpoint = tmp_path / "run"
    (checkpoint / "sub").mkdir(parents=True)
    _, pieces = split(checkpoint_bytes(), "ckpt.pt")
    name = NAMES[kind](_outside(tmp_path, pieces[1]))
    (checkpoint / "sub" / "x").write_bytes(pieces[1])
    path, _ = write_parts(checkpoint, names={1: name}, bare_json=bare_json)
    for verify in (False, True):
        with pytest.raises(UnsafeFileNameError, match="not a plain file name beside the checkpoint") as e:
            fastpersist.load(path, verify=verify)
        assert e.value.record == name and e.value.path == path and "part 1" in str(e.value)
    with pytest.raises(UnsafeFileNameError):
        fastpersist.verify(path)
    with pytest.raises(UnsafeFileNameError):
        merge(path, str(tmp_path / "merged.pt"))
    assert main(["verify", path]) == 1  # corrupt
    assert main(["merge", path, str(tmp_path / "merged.pt")]) == 1
    assert not os.path.exists(tmp_path / "merged.pt")
    assert isinstance(e.value, RuntimeError)  # what torch.load raises for a file that is not a sound checkpoint
