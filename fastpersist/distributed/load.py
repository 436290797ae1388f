"""Loading a checkpoint saved as parts (``layout="parts"``), alone or collectively.

* All parts visible (one machine, shared filesystem, or copied together):
  :func:`read_parts` rebuilds the ordinary file's bytes in memory from the
  parts and the manifest and checks its structure and every record's CRC-32.
* Each rank sees only its own part (node-local storage): :func:`read_collective`,
  called by every rank of a group. Ranks exchange which parts (and whether
  the manifest) they see; each part is read by the lowest rank that sees it
  and travels to every rank by ``torch.distributed.broadcast``. The group's
  size need not be the saving world size.

Both return the bytes; ``fastpersist.load`` unpickles them. Part objects of
an ``s3://`` checkpoint are fetched by :mod:`fastpersist.distributed.objectstore`
into the same :func:`assemble_into`. Memory: the
whole file's bytes are held once in host memory while the objects are built
(plus the objects themselves). ``fastpersist merge`` turns
parts into one ordinary file, which loads without that copy.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from fastpersist.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator
from fastpersist.distributed.manifest import Manifest, PartInfo, is_manifest, read_manifest
from fastpersist.errors import DistributedCheckpointError, TruncatedCheckpointError
from fastpersist.io import engine
from fastpersist.io.records import verify_records
from fastpersist.tensors import host_memoryview

__all__ = [
    "PartsSource",
    "assemble",
    "assemble_into",
    "check_part_size",
    "read_parts",
    "read_collective",
    "check_bytes",
]

_PART = re.compile(r"^(?P<name>.+)\.(?P<token>[0-9a-f]+)\.part-(?P<index>\d+)-of-(?P<count>\d+)$")


class PartsSource:
    """Random access to the bytes of the ordinary file a manifest stands for, read from its parts.

    Args:
        manifest: the manifest.
        directory: where the parts are (default: beside the manifest).
        extra: explicit part paths, by part index (they win over ``directory``).
    """

    def __init__(self, manifest: Manifest, directory: str, extra: dict[int, str] | None = None):
        self.manifest = manifest
        self._descriptors: dict[int, int] = {}
        self.paths = {}
        for part in manifest.parts:
            path = (extra or {}).get(part.index) or os.path.join(directory, part.name)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise FileNotFoundError(
                    2,
                    f"part {part.index} of the sharded checkpoint is missing (written on host "
                    f"{part.host or '?'}); copy it beside the manifest, or load collectively (group=) on ranks "
                    "that see it",
                    path,
                ) from None
            check_part_size(part, size, path)
            self.paths[part.index] = path

    @property
    def size(self) -> int:
        return self.manifest.size

    def close(self) -> None:
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()

    def __enter__(self) -> PartsSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _descriptor(self, index: int) -> int:
        if index not in self._descriptors:
            self._descriptors[index] = os.open(self.paths[index], os.O_RDONLY)
        return self._descriptors[index]

    def read_at(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        out = bytearray()
        for part in self.manifest.parts:
            lo, hi = max(offset, part.start), min(end, part.end)
            if lo < hi:
                out += os.pread(self._descriptor(part.index), hi - lo, lo - part.start)
        lo, hi = max(offset, self.manifest.trailer_offset), end
        if lo < hi:
            t = self.manifest.trailer_offset
            out += self.manifest.trailer[lo - t : hi - t]
        _apply_patches(out, offset, self.manifest)
        return bytes(out)


def _apply_patches(buffer, offset: int, manifest: Manifest) -> None:
    end = offset + len(buffer)
    for position, data in manifest.patches:
        lo, hi = max(position, offset), min(position + len(data), end)
        if lo < hi:
            buffer[lo - offset : hi - offset] = data[lo - position : hi - position]


def check_part_size(part: PartInfo, size: int, where: str) -> None:
    """Raises TruncatedCheckpointError when the part found at ``where`` (a path or URL) has another size than listed."""
    if size != part.length:
        raise TruncatedCheckpointError(
            f"{where}: part {part.index} has {size} bytes, the manifest says {part.length}; restore it",
            path=where,
        )


def assemble_into(
    destination: memoryview, manifest: Manifest, read_parts: Callable[[list[tuple[PartInfo, memoryview]]], None]
) -> None:
    """Rebuilds the ordinary file a manifest stands for in ``destination`` (``manifest.size`` writable bytes).

    ``read_parts`` gets each part with the slice of ``destination`` it
    fills (``[part.start, part.end)``) and must fill them all, in any order
    (local files one by one; object stores with concurrent ranged GETs).
    Then the manifest's patches and trailer are written in. The caller
    verifies the result (:func:`check_bytes`, or the loader's own checks).
    """
    if len(destination) != manifest.size:
        raise AssertionError(f"{len(destination)} bytes to rebuild a checkpoint of {manifest.size}")
    read_parts([(part, destination[part.start : part.end]) for part in manifest.parts])
    finish(destination, manifest)


def assemble(manifest: Manifest, directory: str, extra: dict[int, str] | None = None) -> torch.Tensor:
    """The whole ordinary file's bytes (uint8 CPU tensor), read from all parts."""
    source = PartsSource(manifest, directory, extra)
    buffer = torch.empty(manifest.size, dtype=torch.uint8)

    def read_parts(pieces: list[tuple[PartInfo, memoryview]]) -> None:
        for part, view in pieces:
            _read_file_into(source.paths[part.index], view)

    assemble_into(host_memoryview(buffer), manifest, read_parts)
    return buffer


def _read_file_into(path: str, view: memoryview) -> None:
    with open(path, "rb") as handle:
        position = 0
        while position < len(view):
            count = handle.readinto(view[position:])
            if not count:
                raise TruncatedCheckpointError(f"{path}: part ends early", path=path)
            position += count


def finish(buffer: torch.Tensor | memoryview, manifest: Manifest) -> None:
    """Writes the manifest's patches (data descriptors) and trailer into the assembled bytes."""
    data = buffer if isinstance(buffer, memoryview) else host_memoryview(buffer)
    for position, patch in manifest.patches:
        data[position : position + len(patch)] = memoryview(patch).cast("B")
    t = manifest.trailer_offset
    data[t : manifest.size] = memoryview(manifest.trailer).cast("B")


def check_bytes(buffer: torch.Tensor, path: str) -> None:
    """Structure and every record's CRC-32 of an assembled file (what ``fastpersist.verify`` checks)."""
    view = host_memoryview(buffer)

    def read_at(offset: int, length: int) -> bytes:
        return bytes(view[offset : offset + length])

    def crc_of(record) -> int:
        return engine.crc32_of(view[record.data_offset : record.data_offset + record.size])

    verify_records(read_at, len(view), path, crc_of=crc_of)


def read_parts(path: str, verify: bool = True) -> torch.Tensor:
    """The ordinary file's bytes of a sharded checkpoint whose parts are all visible beside its manifest.

    Raises:
        UnsafeFileNameError: the manifest names a part that is not a plain
            file name beside it (``../x``, ``/etc/passwd``, ...); nothing was opened.
        FileNotFoundError: a part is missing (its index and host named).
        TruncatedCheckpointError: a part is shorter than the manifest says.
        CorruptCheckpointError, ChecksumMismatchError: (``verify``) damaged bytes.
    """
    manifest = read_manifest(path)
    buffer = assemble(manifest, os.path.dirname(os.path.abspath(path)))
    if verify:
        check_bytes(buffer, path)
    return buffer


def _local_parts(path: str) -> dict[str, dict[int, str]]:
    """token -> {part index: path} for the part files this rank sees beside ``path``."""
    directory, name = os.path.split(os.path.abspath(path))
    found: dict[str, dict[int, str]] = {}
    for candidate in glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(name)}.*.part-*-of-*")):
        match = _PART.match(os.path.basename(candidate))
        if match and match["name"] == name:
            found.setdefault(match["token"], {})[int(match["index"])] = candidate
    return found


def read_collective(
    path: str, group: Any, verify: bool = True, timeout: float = DEFAULT_TIMEOUT
) -> torch.Tensor | None:
    """Collective read: every rank of ``group`` calls it; parts may be visible on some ranks only.

    Returns the ordinary file's bytes, verified, on every rank; or ``None``
    when every rank sees an ordinary checkpoint at ``path`` (the caller loads
    it as a plain file).

    Raises:
        DistributedCheckpointError: on every rank, when no rank sees the
            manifest or some part, or a rank fails or times out.
    """
    import torch.distributed as dist

    coordinator = Coordinator(group, timeout, "load", os.path.basename(os.fspath(path)))

    def survey() -> dict[str, Any]:
        manifest = None
        ordinary = False
        if os.path.isfile(path):
            if is_manifest(path):
                with open(path, "rb") as handle:
                    manifest = handle.read()
            else:
                ordinary = True
        return {"manifest": manifest, "ordinary": ordinary, "parts": _local_parts(path)}

    views = coordinator.run("survey", survey)
    holders = [r for r, v in enumerate(views) if v["manifest"] is not None]
    if not holders:
        if all(v["ordinary"] for v in views):
            return None
        raise DistributedCheckpointError(
            f"collective load of {path}: no rank sees a checkpoint or sharded-checkpoint manifest there",
            {r: "no manifest" for r in range(coordinator.size)},
        )
    manifest = Manifest.from_bytes(views[holders[0]]["manifest"], path)
    sources = {}
    for part in manifest.parts:
        seen = [r for r, v in enumerate(views) if part.index in v["parts"].get(manifest.token, {})]
        if not seen:
            raise DistributedCheckpointError(
                f"collective load of {path}: part {part.index} ({part.name}, written on host {part.host or '?'}) "
                "is visible on no rank; the checkpoint cannot be rebuilt",
                {},
            )
        sources[part.index] = seen[0]
    mine = views[coordinator.rank]["parts"].get(manifest.token, {})

    buffer = torch.empty(manifest.size, dtype=torch.uint8)

    def read_mine() -> None:
        view = host_memoryview(buffer)
        for part in manifest.parts:
            if sources[part.index] == coordinator.rank:
                check_part_size(part, os.stat(mine[part.index]).st_size, mine[part.index])
                _read_file_into(mine[part.index], view[part.start : part.end])

    coordinator.run("read", read_mine)
    backend = dist.get_backend(coordinator.group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    for part in manifest.parts:
        if not part.length:
            continue
        piece = buffer[part.start : part.end]
        carrier = piece if device.type == "cpu" else piece.to(device)
        dist.broadcast(carrier, src=coordinator.global_rank(sources[part.index]), group=coordinator.group)
        if carrier is not piece:
            piece.copy_(carrier)
    finish(buffer, manifest)

    def check() -> None:
        if verify:
            check_bytes(buffer, path)

    coordinator.run("verify", check)
    return buffer
