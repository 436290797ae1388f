"""The manifest of a checkpoint saved as per-rank parts (``layout="parts"``).

The manifest is a small file at the checkpoint's path, written last and
atomically by rank 0 once every part is durable. It describes how to rebuild
the ordinary torch zip file: the parts hold the file's bytes up to the
central directory, in order; the manifest holds what needs every rank's
CRC-32s (each record's data descriptor and the trailer: central directory
and end records), so the parts themselves never need rewriting.

Its content is a JSON document. The file is that document stored (not
compressed) as the one record of a zip archive whose record name is a
sentence, :data:`RECORD`: ``torch.load`` of the path then fails with
``RuntimeError: ... file in archive is not in a subdirectory: this file is
the manifest of a fastpersist sharded checkpoint ...`` (torch's reader
requires every record inside a folder and names the first one that is not),
with ``weights_only`` True or False and with ``mmap=True``, instead of
unpickling JSON ("Unsupported operand 123"). Manifests written before that
are the bare JSON document; :meth:`Manifest.from_bytes` reads both.

Parts are named ``<path>.<token>.part-<k>-of-<n>`` (``token`` is unique per
save, so a failed save never touches the previous checkpoint's parts). A
part's name in the manifest must be a plain file name (it is looked up
beside the manifest): the parser refuses anything else before a part is
opened (:func:`fastpersist.format.names.check_file_name`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
import zipfile
from typing import Any

from fastpersist.errors import CorruptCheckpointError
from fastpersist.format.names import check_file_name

__all__ = [
    "FORMAT",
    "HEAD_SIZE",
    "RECORD",
    "Manifest",
    "PartInfo",
    "is_manifest",
    "looks_like_manifest",
    "read_manifest",
    "part_name",
]

FORMAT = "fastpersist-sharded"
VERSION = 1
RECORD = (
    "this file is the manifest of a fastpersist sharded checkpoint (layout='parts'), not a torch.save file: "
    "load it with fastpersist.load(path), or merge its parts into one file with: fastpersist merge PATH OUT"
)
"""The name of the one record of a manifest file, whose content is the JSON document. torch.load quotes it.

No ``/`` in it: that is what makes torch's reader stop at it and say so."""
HEAD_SIZE = 256
"""Bytes at the start of a file or object that :func:`looks_like_manifest` needs (the zip header and
:data:`RECORD`, or the start of a bare JSON document)."""
_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_HEADER = 30  # the local header's fixed part; the name follows it
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the same bytes for the same manifest


def part_name(path: str, token: str, index: int, count: int) -> str:
    """The file name of part ``index`` (0-based) of ``count`` for a save to ``path``."""
    return f"{os.path.basename(path)}.{token}.part-{index}-of-{count}"


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """One part: file ``name`` (beside the manifest) holds bytes ``[start, end)`` of the checkpoint."""

    index: int
    name: str
    start: int
    end: int
    host: str = ""

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a sharded checkpoint is made of.

    Attributes:
        size: the size of the ordinary checkpoint file it stands for.
        token: this save's unique token (in every part's name).
        parts: the parts, in file order; they cover ``[0, patches_end)``.
        patches: ``(offset, bytes)`` written over the parts (data descriptors).
        trailer_offset: where the trailer (central directory, end records) starts.
        trailer: its bytes; ``trailer_offset + len(trailer) == size``.
        world_size: ranks that saved it.
    """

    size: int
    token: str
    parts: tuple[PartInfo, ...]
    patches: tuple[tuple[int, bytes], ...]
    trailer_offset: int
    trailer: bytes
    world_size: int

    def to_bytes(self) -> bytes:
        """The manifest file's bytes: the JSON document as the one record of a zip archive (see the module)."""
        buffer = io.BytesIO()
        record = zipfile.ZipInfo(RECORD, _ZIP_TIME)
        record.external_attr = 0o644 << 16
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr(record, self.document())
        return buffer.getvalue()

    def document(self) -> bytes:
        """The JSON document (what a manifest file was before the zip wrapper, and what its record holds)."""
        document = {
            "format": FORMAT,
            "version": VERSION,
            "size": self.size,
            "token": self.token,
            "world_size": self.world_size,
            "parts": [dataclasses.asdict(p) for p in self.parts],
            "patches": [[offset, data.hex()] for offset, data in self.patches],
            "trailer_offset": self.trailer_offset,
            "trailer": self.trailer.hex(),
        }
        return json.dumps(document, indent=1).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, path: str | None = None) -> Manifest:
        """Parses a manifest file: the zip-wrapped form, or the bare JSON document of older saves.

        Raises:
            CorruptCheckpointError: not a manifest, damaged, or the parts do not tile the file.
            UnsafeFileNameError: a part's name is not a plain file name (nothing was opened).
        """
        try:
            document = json.loads(_unwrap(data))
            if document.get("format") != FORMAT:
                raise ValueError("not a fastpersist sharded-checkpoint manifest")
            if document.get("version") != VERSION:
                raise ValueError(f"manifest version {document.get('version')} is not supported (expected {VERSION})")
            manifest = cls(
                size=int(document["size"]),
                token=str(document["token"]),
                parts=tuple(PartInfo(**p) for p in document["parts"]),
                patches=tuple((int(o), bytes.fromhex(h)) for o, h in document["patches"]),
                trailer_offset=int(document["trailer_offset"]),
                trailer=bytes.fromhex(document["trailer"]),
                world_size=int(document["world_size"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{path}: damaged sharded-checkpoint manifest ({e})", path=path) from e
        manifest.check(path)
        return manifest

    def check(self, path: str | None = None) -> None:
        """Raises CorruptCheckpointError when the pieces do not tile the file, UnsafeFileNameError when a part's
        name is not a plain file name beside the manifest."""
        position = 0
        for part in self.parts:
            check_file_name(part.name, checkpoint=path, what=f"part {part.index} of the sharded checkpoint")
            if part.start != position or part.end < part.start:
                raise CorruptCheckpointError(f"{path}: manifest parts do not tile the file at {position}", path=path)
            position = part.end
        if position != self.trailer_offset or self.trailer_offset + len(self.trailer) != self.size:
            raise CorruptCheckpointError(
                f"{path}: manifest parts and trailer do not add up to {self.size} bytes", path=path
            )
        for offset, data in self.patches:
            if offset < 0 or offset + len(data) > self.trailer_offset:
                raise CorruptCheckpointError(f"{path}: manifest patch at {offset} is out of range", path=path)


def _unwrap(data: bytes) -> bytes:
    """The JSON document of a manifest file (the zip-wrapped form's record, or the older bare document)."""
    if data[:4] != _ZIP_MAGIC:
        return data
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            if names != [RECORD] or archive.getinfo(RECORD).compress_type != zipfile.ZIP_STORED:
                raise ValueError("a zip archive other than a manifest's one stored record")
            return archive.read(RECORD)  # checks the record's CRC-32
    except (zipfile.BadZipFile, EOFError) as e:
        raise ValueError(str(e)) from None


def is_manifest(path: str) -> bool:
    """Whether ``path`` is a sharded-checkpoint manifest (cheap: looks at the first bytes)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(HEAD_SIZE)
    except OSError:
        return False
    return looks_like_manifest(head)


def looks_like_manifest(head: bytes) -> bool:
    """Whether a file or object that starts with ``head`` (its first :data:`HEAD_SIZE` bytes or more) is a manifest.

    Either form: a zip archive whose first record is named :data:`RECORD`, or
    a JSON document naming the format in its first bytes (older saves).
    """
    if head[:4] == _ZIP_MAGIC:
        name = RECORD.encode()
        return (
            len(head) >= _ZIP_HEADER + len(name)
            and struct.unpack_from("<H", head, 26)[0] == len(name)
            and head[_ZIP_HEADER : _ZIP_HEADER + len(name)] == name
        )
    return head.lstrip()[:1] == b"{" and FORMAT.encode() in head[:HEAD_SIZE]


def read_manifest(path: str) -> Manifest:
    """The manifest at ``path`` (either form); raises as :meth:`Manifest.from_bytes`, or OSError from ``open``."""
    with open(path, "rb") as handle:
        return Manifest.from_bytes(handle.read(), path)


def as_dict(manifest: Manifest) -> dict[str, Any]:
    return json.loads(manifest.document())
