"""The manifest of a ``layout="parts"`` checkpoint: the part names it may hold.

The sharded checkpoints here are made in one process (tests/_workers/_parts.py):
an ordinary checkpoint's bytes cut into two parts and a trailer. What the
ranks of a real collective save write is tested in test_distributed.py.
"""

from __future__ import annotations

import os

import pytest
from _parts import checkpoint_bytes, split, write_parts

import fastpersist
from fastpersist.cli import main
from fastpersist.cli.merge import merge
from fastpersist.errors import UnsafeFileNameError


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
def test_part_names_that_leave_the_directory_are_refused_before_anything_is_opened(tmp_path, kind):
    (tmp_path / "control").mkdir()
    assert fastpersist.load(write_parts(tmp_path / "control")[0], verify=False)["step"] == 7  # named as saved: loads
    checkpoint = tmp_path / "run"
    (checkpoint / "sub").mkdir(parents=True)
    _, pieces = split(checkpoint_bytes(), "ckpt.pt")
    name = NAMES[kind](_outside(tmp_path, pieces[1]))
    (checkpoint / "sub" / "x").write_bytes(pieces[1])
    path, _ = write_parts(checkpoint, names={1: name})
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
