"""Collective, data-parallel save: every rank writes a disjoint slice of one checkpoint.

Called by every rank of a process group with the same (replicated) object.
Each rank pickles and plans the checkpoint itself (the plan is cheap: zero-copy
views), takes its byte range from :func:`~fastpersist.distributed.sharding.plan_ranges`
and writes only that range, from its own tensors. Ranks exchange metadata only
(:class:`~fastpersist.distributed.coordinator.Coordinator`), in three steps:

1. ``plan``: every rank reports its plan's fingerprint and host; rank 0
   creates the pre-sized temporary file (``layout="file"``) and a token.
   Plans that differ (ranks holding different objects) fail here.
2. ``write``: every writer writes its range, fsyncs, and reports the CRC-32 of
   each record slice it wrote.
3. ``commit``: rank 0 combines the slices' CRC-32s
   (:func:`~fastpersist.io.checksum.crc32_combine_all`, native) and writes what needs
   them: the data descriptors and the trailer (``layout="file"``, then fsync,
   rename over the target, directory fsync) or the manifest (``layout="parts"``,
   atomically, last). Every rank returns only after that succeeded.

A failure at any step is raised on every rank, naming the rank; rank 0 then
removes the temporary file, and the previous checkpoint at the path stays.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pickle
import secrets
import socket
import time
from typing import Any

from fastpersist import commit, config
from fastpersist.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator
from fastpersist.distributed.manifest import Manifest, PartInfo, part_name
from fastpersist.distributed.sharding import DEFAULT_ALIGNMENT, ByteRange, plan_ranges, writer_ranks
from fastpersist.errors import DistributedCheckpointError
from fastpersist.format.plan import BytesRecord, SavePlan, StorageRecord
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io import engine
from fastpersist.io.checksum import crc32_combine_all
from fastpersist.io.writer import write_plan

__all__ = ["LAYOUTS", "WRITERS", "SaveStats", "is_collective", "last_stats", "save"]

LAYOUTS = ("file", "parts")
WRITERS = ("all", "node")


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What this rank did in its last collective save (for benchmarks and logs)."""

    rank: int
    world_size: int
    writers: int
    bytes_written: int
    write_seconds: float
    total_seconds: float
    file_size: int
    steps: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds from the start of the save to the end of each step's exchange (plan, write, commit)."""


_last: dict[str, SaveStats] = {}


def last_stats() -> SaveStats | None:
    """This process's statistics for its most recent collective save, or None."""
    return _last.get("stats")


def is_collective(group: Any) -> bool:
    """Whether ``group`` asks for a collective save: torch.distributed is up and the group has > 1 rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if group is True:
            return False  # "the default group" with no torch.distributed: a plain save
        raise RuntimeError("group= was given but torch.distributed is not initialized (init_process_group)")
    return dist.get_world_size(None if group is True else group) > 1


def _fingerprint(plan: SavePlan) -> str:
    """Identical on every rank that holds the same object: names, sizes, offsets, metadata bytes."""
    digest = engine.crc32_of(repr((plan.size, plan.layout.central_directory_offset)).encode())
    for record in plan.records:
        entry = record.entry
        digest = engine.crc32_of(repr((entry.name, entry.header_offset, entry.size)).encode(), digest)
        if isinstance(record, BytesRecord) and not entry.name.endswith("/.data/serialization_id"):
            digest = engine.crc32_of(record.data, digest)
    return f"{digest:08x}-{plan.size}"


def _with_serialization_id(plan: SavePlan, serialization_id: bytes) -> SavePlan:
    """The plan with rank 0's serialization id, so the file does not depend on which rank wrote what."""
    records = tuple(
        BytesRecord(r.entry, serialization_id)
        if isinstance(r, BytesRecord) and r.entry.name.endswith("/.data/serialization_id") and len(r.data) ==
        len(serialization_id) else r
        for r in plan.records
    )  # fmt: skip
    return SavePlan(plan.layout, records)


def _serialization_id(plan: SavePlan) -> bytes:
    for record in plan.records:
        if isinstance(record, BytesRecord) and record.entry.name.endswith("/.data/serialization_id"):
            return record.data
    return b""


def _slice_crcs(plan: SavePlan, crcs: list[int], byte_range: ByteRange) -> dict[int, tuple[int, int]]:
    """record index -> (CRC-32 of its payload bytes inside the range, their length), storage records only."""
    result = {}
    for index, record in enumerate(plan.records):
        if not isinstance(record, StorageRecord) or not record.entry.size:
            continue
        lo = max(record.entry.data_offset, byte_range.start)
        hi = min(record.entry.data_end, byte_range.end)
        if lo < hi:
            result[index] = (crcs[index], hi - lo)
    return result


def _combined_crcs(plan: SavePlan, slices: list[dict[int, tuple[int, int]]], checksum: bool) -> list[int]:
    """Every record's CRC-32 from the writers' slices (in file order), as one writer would have computed it."""
    if not checksum:
        return [0] * len(plan.records)
    crcs = []
    for index, record in enumerate(plan.records):
        if isinstance(record, BytesRecord):
            crcs.append(engine.crc32_of(record.data))
            continue
        pieces = [s[index] for s in slices if index in s]
        if sum(length for _, length in pieces) != record.entry.size:
            raise AssertionError(f"the writers' slices of {record.entry.name!r} do not cover it")
        crcs.append(crc32_combine_all(pieces))
    return crcs


def _descriptor_patches(plan: SavePlan, crcs: list[int], ranges) -> list[tuple[int, bytes]]:
    """Data descriptors no writer could write: their record starts in an earlier writer's range."""
    patches = []
    for record, crc in zip(plan.records, crcs):
        entry = record.entry
        if not entry.descriptor_size:
            continue
        lo, hi = entry.descriptor_offset, entry.descriptor_offset + entry.descriptor_size
        # A writer zeroes the descriptor bytes it holds when the record started before its range
        # (io.writer); a descriptor may straddle two ranges.
        if any(r.length and r.start < hi and lo < r.end and entry.data_offset < r.start for r in ranges):
            patches.append((entry.descriptor_offset, entry.data_descriptor(crc)))
    return patches


def save(
    obj: object,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    layout: str = "file",
    writers: str = "all",
    timeout: float = DEFAULT_TIMEOUT,
    alignment: int = DEFAULT_ALIGNMENT,
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    disable_byteorder_record: bool = False,
    settings: config.Settings | None = None,
) -> None:
    """Collective save of a replicated object; see the module docstring and docs/distributed.md.

    Args:
        obj: the same object on every rank (DDP-replicated state).
        path: the checkpoint path (the same on every rank). ``layout="file"``:
            one ordinary checkpoint file on a filesystem every rank sees.
            ``layout="parts"``: a manifest at ``path`` (rank 0) and one part
            per writer beside it (each writer's own filesystem).
        group: the process group (``None``: the default group).
        layout: ``"file"`` or ``"parts"``.
        writers: ``"all"`` ranks write, or one per ``"node"`` (host name).
        timeout: seconds each rank waits for the others at each step.
        alignment: range boundaries are multiples of this (power of two).
        settings: resolved fastpersist settings (default: current ones).

    Raises:
        DistributedCheckpointError: on every rank, when any rank failed or did
            not report in time (``failures`` names the ranks).
        ValueError: an unknown layout or writers mode (before any exchange).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if writers not in WRITERS:
        raise ValueError(f"writers must be one of {WRITERS}, got {writers!r}")
    settings = settings or config.settings()
    began = time.perf_counter()
    coordinator = Coordinator(group, timeout, "save")
    rank = coordinator.rank
    state: dict[str, Any] = {}

    def prepare() -> dict[str, Any]:
        target = commit.resolve_target(os.fspath(path))
        directory = commit.check_target(target)
        plan = plan_save(obj, archive_name_for(target), pickle_module, pickle_protocol, disable_byteorder_record)
        state.update(target=target, directory=directory, plan=plan)
        payload = {"fingerprint": _fingerprint(plan), "host": socket.gethostname()}
        if rank == 0:
            payload["serialization_id"] = _serialization_id(plan)
            payload["token"] = secrets.token_hex(6)
            if layout == "file":
                payload["temporary"] = state["temporary"] = _create_presized(target, directory, plan.size, settings)
        return payload

    try:
        reports = coordinator.run("plan", prepare)
        marks = {"plan": time.perf_counter() - began}
        _check_same_plan(reports)
        plan = _with_serialization_id(state["plan"], reports[0]["serialization_id"])
        writer_list = writer_ranks([r["host"] for r in reports], writers)
        ranges = plan_ranges(plan, len(writer_list), alignment)
        mine = ranges[writer_list.index(rank)] if rank in writer_list else None
        token = reports[0]["token"]
        timing: dict[str, float] = {}

        def write() -> dict[str, Any]:
            start = time.perf_counter()
            if mine is None:
                return {"slices": {}, "part": None}
            if layout == "file":
                # Rank 0 fsyncs its range here too: left to its commit fsync, the flush of its range would
                # start only after the others' (measured: slower), not alongside them.
                slices = _write_range(plan, reports[0]["temporary"], mine, settings)
                part = None
            else:
                name = part_name(state["target"], token, mine.index, len(ranges))
                final = os.path.join(state["directory"], name)
                slices = _write_part(plan, final, state["directory"], mine, settings)
                state["written_part"] = final
                part = PartInfo(mine.index, name, mine.start, mine.end, socket.gethostname())
            timing["write"] = time.perf_counter() - start
            return {"slices": slices, "part": part and dataclasses.asdict(part)}

        written = coordinator.run("write", write)
        marks["write"] = time.perf_counter() - began

        def finish() -> None:
            if rank != 0:
                return
            crcs = _combined_crcs(plan, [w["slices"] for w in written], settings.checksum)
            if layout == "file":
                _commit_file(plan, crcs, _descriptor_patches(plan, crcs, ranges), state["temporary"], state["target"],
                             state["directory"], settings)  # fmt: skip
                state.pop("temporary")
            else:
                parts = tuple(PartInfo(**w["part"]) for w in sorted((w for w in written if w["part"]),
                                                                    key=lambda w: w["part"]["index"]))  # fmt: skip
                manifest = Manifest(
                    size=plan.size, token=token, parts=parts, patches=tuple(_descriptor_patches(plan, crcs, ranges)),
                    trailer_offset=plan.layout.central_directory_offset, trailer=plan.trailer(crcs),
                    world_size=coordinator.size,
                )  # fmt: skip
                _write_atomically(state["target"], state["directory"], manifest.to_json(), settings)

        state["committing"] = True  # from here a part may be referenced by a committed manifest
        coordinator.run("commit", finish)
        marks["commit"] = time.perf_counter() - began
    except BaseException:
        temporary = state.get("temporary")
        if temporary:
            commit.discard_temporary(temporary)
        if layout == "parts" and "written_part" in state and "committing" not in state:
            # Not referenced by any manifest. (Once rank 0 may have committed, parts stay; a later
            # save's clean-up removes those that no manifest references.)
            try:
                os.unlink(state["written_part"])
            except OSError:
                pass
        raise
    if layout == "parts":
        _remove_old_parts(state["target"], token)
    _last["stats"] = SaveStats(
        rank=rank, world_size=coordinator.size, writers=len(writer_list),
        bytes_written=mine.length if mine else 0, write_seconds=timing.get("write", 0.0),
        total_seconds=time.perf_counter() - began, file_size=plan.size, steps=marks,
    )  # fmt: skip


def _check_same_plan(reports: list[dict[str, Any]]) -> None:
    fingerprints = {r["fingerprint"] for r in reports}
    if len(fingerprints) != 1:
        odd = [rank for rank, r in enumerate(reports) if r["fingerprint"] != reports[0]["fingerprint"]]
        raise DistributedCheckpointError(
            f"collective save: rank(s) {odd} hold a different object than rank 0 (different tensors, shapes or "
            "pickled metadata). A data-parallel save needs the same replicated state on every rank; save "
            "sharded (FSDP/DTensor) state with torch.distributed.checkpoint. Nothing was written",
            {r: "different object than rank 0" for r in odd},
        )


def _temporary_name(target: str, directory: str) -> str:
    # A live process's temporary is never judged stale, so no registration is needed.
    return os.path.join(directory, commit.temporary_name(os.path.basename(target), directory))


def _create_presized(target: str, directory: str, size: int, settings: config.Settings) -> str:
    """Rank 0's temporary file, at its final size (blocks reserved: a full disk fails here, before any write)."""
    commit.remove_stale_temporaries(target)
    temporary = _temporary_name(target, directory)
    file = engine.File(temporary, "w", direct=settings.direct, truncate=True)
    try:
        if file.direct:
            file.allocate(0, size)
        file.truncate(size)
    except BaseException:
        file.close()
        commit.discard_temporary(temporary)
        raise
    file.close()
    return temporary


def _write_range(plan: SavePlan, file_path: str, byte_range: ByteRange, settings, fsync: bool = True):
    file = engine.File(file_path, "w", direct=settings.direct, truncate=False)
    try:
        crcs = write_plan(plan, file, settings, byte_range=(byte_range.start, byte_range.end))
        if settings.fsync and fsync:
            file.fsync()
    finally:
        file.close()
    return _slice_crcs(plan, crcs, byte_range)


def _write_part(plan: SavePlan, final: str, directory: str, byte_range: ByteRange, settings):
    temporary = _temporary_name(final, directory)
    file = engine.File(temporary, "w", direct=settings.direct, truncate=True)
    try:
        try:
            if file.direct and byte_range.length:
                file.allocate(0, byte_range.length)
            crcs = write_plan(plan, file, settings, byte_range=(byte_range.start, byte_range.end),
                              destination_offset=0)  # fmt: skip
            if settings.fsync:
                file.fsync()
        finally:
            file.close()
        commit.replace_file(temporary, final, directory)
    except BaseException:
        commit.discard_temporary(temporary)
        raise
    if settings.fsync:
        commit.fsync_directory(directory)
    return _slice_crcs(plan, crcs, byte_range)


def _commit_file(plan: SavePlan, crcs: list[int], patches, temporary: str, target: str, directory: str,
                 settings) -> None:  # fmt: skip
    """Rank 0, after every range is durable: descriptors and trailer, fsync, rename, directory fsync."""
    descriptor = os.open(temporary, os.O_WRONLY)
    try:
        for offset, data in patches:
            _pwrite_all(descriptor, data, offset)
        _pwrite_all(descriptor, plan.trailer(crcs), plan.layout.central_directory_offset)
        if settings.fsync:
            os.fsync(descriptor)
    finally:
        os.close(descriptor)
    commit.copy_metadata(target, temporary)
    commit.replace_file(temporary, target, directory)
    if settings.fsync:
        commit.fsync_directory(directory)


def _pwrite_all(descriptor: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        count = os.pwrite(descriptor, view, offset)
        view, offset = view[count:], offset + count


def _write_atomically(target: str, directory: str, data: bytes, settings) -> None:
    temporary = _temporary_name(target, directory)
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _pwrite_all(descriptor, data, 0)
            if settings.fsync:
                os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, target)
    except BaseException:
        commit.discard_temporary(temporary)
        raise
    if settings.fsync:
        commit.fsync_directory(directory)


def _remove_old_parts(target: str, token: str) -> None:
    """After a committed parts save: this rank's view of earlier saves' parts of the same path is garbage."""
    directory, name = os.path.split(os.path.abspath(target))
    for candidate in glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(name)}.*.part-*-of-*")):
        middle = os.path.basename(candidate)[len(name) + 1 :].split(".part-")[0]
        if middle != token:
            try:
                os.unlink(candidate)
            except OSError:
                pass
