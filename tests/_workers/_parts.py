"""Sharded checkpoints (a manifest and its parts) made in one process, for tests that craft or damage manifests.

A collective ``layout="parts"`` save needs several ranks; what a load reads is
only the manifest and the part files, so here an ordinary checkpoint's bytes
are cut into two parts and a trailer, and the manifest describes them.
"""

from __future__ import annotations

import io

import torch

import fastpersist
from fastpersist.distributed.manifest import Manifest, PartInfo, part_name

TOKEN = "0123abcd"


def make_state() -> dict:
    return {"weights": torch.arange(5000, dtype=torch.float32), "step": 7}


def split(data: bytes, base: str, names: dict[int, str] | None = None) -> tuple[Manifest, list[bytes]]:
    """The manifest and the two parts' bytes of the checkpoint ``data`` saved to a file named ``base``.

    ``names`` replaces part names by index (crafted manifests).
    """
    trailer_offset = len(data) - 100
    cut = trailer_offset // 2
    ranges = [(0, cut), (cut, trailer_offset)]
    parts = tuple(
        PartInfo(index, (names or {}).get(index, part_name(base, TOKEN, index, 2)), start, end, "here")
        for index, (start, end) in enumerate(ranges)
    )
    manifest = Manifest(
        size=len(data),
        token=TOKEN,
        parts=parts,
        patches=(),
        trailer_offset=trailer_offset,
        trailer=data[trailer_offset:],
        world_size=2,
    )
    return manifest, [data[start:end] for start, end in ranges]


def checkpoint_bytes(state: dict | None = None) -> bytes:
    buffer = io.BytesIO()
    fastpersist.save(make_state() if state is None else state, buffer)
    return buffer.getvalue()


def write_parts(directory, base: str = "ckpt.pt", *, names=None, bare_json: bool = False) -> tuple[str, list[bytes]]:
    """Writes a sharded checkpoint of :func:`make_state` into ``directory``; returns the manifest's path and the
    parts' bytes. Parts renamed by ``names`` are not written (the test decides what is at those names).

    ``bare_json``: the manifest as saves wrote it before the zip wrapper (the JSON document alone).
    """
    manifest, pieces = split(checkpoint_bytes(), base, names)
    for part, piece in zip(manifest.parts, pieces):
        if part.index not in (names or {}):
            (directory / part.name).write_bytes(piece)
    path = directory / base
    path.write_bytes(manifest.document() if bare_json else manifest.to_bytes())
    return str(path), pieces
