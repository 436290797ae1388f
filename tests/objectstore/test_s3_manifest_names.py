"""A collective save's manifest object under s3://: both file forms load, and part names stay under its prefix.

The manifest and part objects are put here directly (tests/_workers/_parts.py
cuts an ordinary checkpoint in two parts), so no ranks are spawned; the
collective save that writes them is tested in test_s3_collective.py.
"""

from __future__ import annotations

import pytest
import torch
from _parts import TOKEN, checkpoint_bytes, make_state, split

import fastpersist
from fastpersist.distributed.manifest import part_name
from fastpersist.distributed.objectstore import remove_checkpoint
from fastpersist.errors import UnsafeFileNameError


def put_checkpoint(s3, key: str, *, names=None, bare_json: bool = False) -> list[bytes]:
    """A manifest object at ``key`` and its part objects beside it (those renamed by ``names`` are not put)."""
    manifest, pieces = split(checkpoint_bytes(), key.rpartition("/")[2], names)
    folder = key.rpartition("/")[0]
    for part, piece in zip(manifest.parts, pieces):
        if part.index not in (names or {}):
            s3.put(f"{folder}/{part.name}", piece)
    s3.put(key, manifest.document() if bare_json else manifest.to_bytes())
    return pieces


def keys(s3) -> list[str]:
    return sorted(item["Key"] for item in s3.client.list_objects_v2(Bucket=s3.bucket).get("Contents", ()))


@pytest.mark.parametrize("bare_json", [False, True])
def test_both_manifest_forms_load(s3, bare_json):
    put_checkpoint(s3, "run/ckpt.pt", bare_json=bare_json)
    loaded = fastpersist.load(s3.url("run/ckpt.pt"))
    assert torch.equal(loaded["weights"], make_state()["weights"]) and loaded["step"] == 7


@pytest.mark.parametrize("name", ["sub/x", "../x", "/x", "x\0y", "..", ""])
def test_part_names_that_leave_the_prefix_are_refused_and_nothing_is_removed(s3, name):
    pieces = put_checkpoint(s3, "run/ckpt.pt", names={1: name})
    # The objects the name could reach hold exactly the part's bytes: following the name would load.
    for key in ("run/sub/x", "run/../x", "run//x", "x", "run/x"):
        s3.put(key, pieces[1])
    before = keys(s3)
    with pytest.raises(UnsafeFileNameError, match="not a plain file name beside the checkpoint") as e:
        fastpersist.load(s3.url("run/ckpt.pt"), verify=False)
    assert e.value.record == name and e.value.path == s3.url("run/ckpt.pt")
    with pytest.raises(UnsafeFileNameError):  # the removal reads the manifest first: nothing is deleted
        remove_checkpoint(s3.url("run/ckpt.pt"))
    assert keys(s3) == before
    assert f"run/{part_name('ckpt.pt', TOKEN, 0, 2)}" in before
