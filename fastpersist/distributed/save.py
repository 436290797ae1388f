"""Collective, data-parallel save: one checkpoint of rank 0's object, its bytes written by every rank.

A collective save means ``torch.save`` on the group's rank 0, written by all
ranks: the file holds rank 0's object (its pickled metadata, device tags and
values), and another rank writes a byte of it only from a storage it holds
byte for byte as rank 0 does (:mod:`~fastpersist.distributed.replicas`), so
the file is never a mix of ranks' bytes. Ranks exchange metadata only
(:class:`~fastpersist.distributed.coordinator.Coordinator`), in four steps:

1. ``plan``: every rank pickles and plans its object and reports its host;
   rank 0 also reports its file layout, metadata records and storage digests,
   and creates the pre-sized temporary file (``layout="file"``) and a token.
2. ``match``: every other writer compares its storages with rank 0's (same
   key, size and 64-bit digest) and reports which it holds. Storages of the
   same key and size whose bytes differ are *divergent*: rank 0's values are
   written, and ``divergence`` says whether to warn (default), raise, or
   not mention it.
3. ``write``: the file is dealt out in aligned ranges
   (:func:`~fastpersist.distributed.sharding.assign_ranges`), a writer never
   getting bytes of a storage it does not hold; each writer writes its ranges
   from rank 0's layout and its own identical storages, fsyncs, and reports
   the CRC-32 of each record slice it wrote.
4. ``commit``: rank 0 combines the slices' CRC-32s
   (:func:`~fastpersist.io.checksum.crc32_combine_all`, native) and writes what needs
   them: the data descriptors and the trailer (``layout="file"``, then fsync,
   rename over the target, directory fsync) or the manifest (``layout="parts"``,
   atomically, last). Every rank returns only after that succeeded.

A failure at any step is raised on every rank, naming the rank; rank 0 then
removes the temporary file, and the previous checkpoint at the path stays.
Other ranks open rank 0's temporary file without creating it, so a rank that
arrives after a failure never recreates it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pickle
import secrets
import socket
import time
import warnings
from typing import Any

import torch

from fastpersist import commit, config
from fastpersist.distributed import replicas
from fastpersist.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator
from fastpersist.distributed.manifest import Manifest, PartInfo, part_name
from fastpersist.distributed.sharding import DEFAULT_ALIGNMENT, ByteRange, assign_ranges, writer_ranks
from fastpersist.errors import DistributedCheckpointError, ReplicaDivergenceWarning
from fastpersist.format.plan import BytesRecord, SavePlan, StorageRecord
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io import engine
from fastpersist.io.checksum import crc32_combine_all
from fastpersist.io.writer import write_plan

__all__ = ["DIVERGENCE", "LAYOUTS", "WRITERS", "SaveStats", "is_collective", "last_stats", "save"]

LAYOUTS = ("file", "parts")
WRITERS = ("all", "node")
DIVERGENCE = ("warn", "error", "ignore")


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
    """Seconds from the start of the save to the end of each step's exchange (plan, match, write, commit)."""
    digest_seconds: float = 0.0
    """Seconds this rank spent computing its storages' digests (the identity check)."""
    shared_bytes: int = 0
    """Storage bytes this rank holds identically to rank 0 (rank 0: all of its storages' bytes)."""
    divergent: tuple[str, ...] = ()
    """Storage keys whose values differ between a writer and rank 0 (rank 0's values were written)."""


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


def _skeleton(plan: SavePlan) -> tuple:
    """What another rank needs to write rank 0's file: the layout, metadata records' bytes, storage keys."""
    metadata = tuple((i, r.data) for i, r in enumerate(plan.records) if isinstance(r, BytesRecord))
    keys = tuple((i, r.key) for i, r in enumerate(plan.records) if isinstance(r, StorageRecord))
    return plan.layout, metadata, keys


_NOTHING = torch.empty(0, dtype=torch.uint8)


def _plan_from(skeleton: tuple, own: SavePlan, held: set[int]) -> SavePlan:
    """Rank 0's plan with this rank's identical storages (``held``: rank 0's storage ordinals).

    The storages this rank does not hold get an empty stand-in: no range of
    this rank's covers their bytes (:func:`assign_ranges` saw to it).
    """
    layout, metadata, keys = skeleton
    records: list[Any] = [None] * len(layout.entries)
    for i, data in metadata:
        records[i] = BytesRecord(layout.entries[i], data)
    mine = {r.key: r for r in own.storages}
    for ordinal, (i, key) in enumerate(keys):
        entry = layout.entries[i]
        records[i] = mine[key].placed(entry) if ordinal in held else StorageRecord(entry, key, view=_NOTHING)
    return SavePlan(layout, tuple(records))


def _blocked(skeleton: tuple, held: set[int] | None) -> list[tuple[int, int]]:
    """Byte intervals of rank 0's storages a writer does not hold (None: it holds all)."""
    if held is None:
        return []
    layout, _, keys = skeleton
    return [(layout.entries[i].data_offset, layout.entries[i].data_end) for ordinal, (i, _) in enumerate(keys)
            if ordinal not in held and layout.entries[i].size]  # fmt: skip


def _slice_crcs(plan: SavePlan, crcs: list[int], byte_range: ByteRange) -> list[tuple[int, int, int, int]]:
    """``(record index, first byte, CRC-32, length)`` of each storage record's bytes inside the range."""
    result = []
    for index, record in enumerate(plan.records):
        if not isinstance(record, StorageRecord) or not record.entry.size:
            continue
        lo = max(record.entry.data_offset, byte_range.start)
        hi = min(record.entry.data_end, byte_range.end)
        if lo < hi:
            result.append((index, lo, crcs[index], hi - lo))
    return result


def _combined_crcs(plan: SavePlan, slices: list[tuple[int, int, int, int]], checksum: bool) -> list[int]:
    """Every record's CRC-32 from the writers' slices (in file order), as one writer would have computed it."""
    if not checksum:
        return [0] * len(plan.records)
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    for index, start, crc, length in slices:
        pieces.setdefault(index, []).append((start, crc, length))
    crcs = []
    for index, record in enumerate(plan.records):
        if isinstance(record, BytesRecord):
            crcs.append(engine.crc32_of(record.data))
            continue
        mine = sorted(pieces.get(index, []))
        if sum(length for _, _, length in mine) != record.entry.size:
            raise AssertionError(f"the writers' slices of {record.entry.name!r} do not cover it")
        crcs.append(crc32_combine_all([(crc, length) for _, crc, length in mine]))
    return crcs


def _descriptor_patches(plan: SavePlan, crcs: list[int], ranges) -> list[tuple[int, bytes]]:
    """Data descriptors no writer could write: their record starts in an earlier range."""
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
    divergence: str = "warn",
    timeout: float = DEFAULT_TIMEOUT,
    alignment: int = DEFAULT_ALIGNMENT,
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    disable_byteorder_record: bool = False,
    settings: config.Settings | None = None,
    _sink: bool = False,
) -> None:
    """Collective save of rank 0's object, written by every rank; see the module docstring and docs/distributed.md.

    Args:
        obj: this rank's object. The file holds rank 0's; the other ranks'
            storages that equal rank 0's byte for byte are written from their
            own memory, the rest by rank 0.
        path: the checkpoint path (the same file on every rank for
            ``layout="file"``). ``layout="parts"``: a manifest at ``path``
            (rank 0) and the parts each writer wrote beside its own ``path``.
        group: the process group (``None``: the default group).
        layout: ``"file"`` or ``"parts"``.
        writers: ``"all"`` ranks write, or one per ``"node"`` (host name).
        divergence: what to do when a writer's storage has rank 0's key and
            size but other bytes: ``"warn"`` (write rank 0's values and issue a
            :class:`~fastpersist.errors.ReplicaDivergenceWarning` on rank 0
            naming the tensors), ``"error"`` (raise on every rank, nothing
            written) or ``"ignore"``.
        timeout: seconds each rank waits for the others at each step.
        alignment: range boundaries are multiples of this (power of two).
        settings: resolved fastpersist settings (default: current ones).
        _sink: benchmarks only: every writer writes its ranges into
            ``/dev/null`` and nothing is committed (the pipeline without storage).

    Raises:
        DistributedCheckpointError: on every rank, when any rank failed, did
            not report in time, or (``divergence="error"``) holds other values
            than rank 0 (``failures`` names the ranks).
        ValueError: an unknown layout, writers or divergence mode (before any exchange).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if writers not in WRITERS:
        raise ValueError(f"writers must be one of {WRITERS}, got {writers!r}")
    if divergence not in DIVERGENCE:
        raise ValueError(f"divergence must be one of {DIVERGENCE}, got {divergence!r}")
    settings = settings or config.settings()
    began = time.perf_counter()
    coordinator = Coordinator(group, timeout, "save", f"{layout} {os.path.basename(os.fspath(path))}")
    rank = coordinator.rank
    state: dict[str, Any] = {"digest_seconds": 0.0}

    def digests(plan: SavePlan) -> list:
        start = time.perf_counter()
        result = replicas.storage_digests(plan.storages)
        state["digest_seconds"] += time.perf_counter() - start
        return result

    def prepare() -> dict[str, Any]:
        target = commit.resolve_target(os.fspath(path))
        directory = commit.check_target(target)
        plan = plan_save(obj, archive_name_for(target), pickle_module, pickle_protocol, disable_byteorder_record)
        state.update(target=target, directory=directory, plan=plan)
        payload: dict[str, Any] = {"host": socket.gethostname()}
        if rank == 0:
            payload.update(skeleton=_skeleton(plan), digests=digests(plan), token=secrets.token_hex(6))
            if layout == "file" and not _sink:
                payload["temporary"] = state["temporary"] = _create_presized(target, directory, plan.size, settings)
        elif writers == "all":
            state["digests"] = digests(plan)  # every rank writes: digest now, alongside rank 0
        return payload

    try:
        reports = coordinator.run("plan", prepare)
        marks = {"plan": time.perf_counter() - began}
        skeleton = reports[0]["skeleton"]
        writer_list = writer_ranks([r["host"] for r in reports], writers)
        reference_keys = [key for _, key in skeleton[2]]

        def match() -> dict[str, Any]:
            if rank == 0 or rank not in writer_list:
                return {}
            own = state["plan"]
            mine = state.get("digests") or digests(own)
            held, divergent = replicas.compare(reports[0]["digests"], reference_keys, own.storages, mine)
            return {"held": held, "divergent": divergent}

        matched = coordinator.run("match", match)
        marks["match"] = time.perf_counter() - began
        divergent = sorted({i for m in matched for i in m.get("divergent", ())})
        if divergent:
            _report_divergence(obj, state["plan"], divergent, reference_keys, matched, divergence, rank)
        held = {w: set(matched[w]["held"]) for w in writer_list if w != 0}
        layout_0 = skeleton[0]
        token = reports[0]["token"]
        timing: dict[str, float] = {}

        def write() -> dict[str, Any]:
            # Everything here may fail on one rank only: inside the step, the others hear of it at once.
            start = time.perf_counter()
            blocked = [_blocked(skeleton, held.get(w)) for w in writer_list]
            assigned = assign_ranges(layout_0.central_directory_offset, len(writer_list), blocked, alignment)
            state["ranges"] = sorted((r for ranges in assigned for r in ranges), key=lambda r: r.start)
            mine = state["mine"] = assigned[writer_list.index(rank)] if rank in writer_list else ()
            plan = state["write_plan"] = (state["plan"] if rank == 0 else
                                          _plan_from(skeleton, state["plan"], held.get(rank, set())))  # fmt: skip
            slices, parts = [], []
            if _sink:
                slices = _write_ranges(plan, "/dev/null", mine, settings, sink=True)
            elif layout == "file" and mine:
                # Rank 0 fsyncs its ranges here too: left to its commit fsync, the flush of its ranges would
                # start only after the others' (measured: slower), not alongside them.
                slices = _write_ranges(plan, reports[0]["temporary"], mine, settings)
            elif layout == "parts":
                for byte_range in mine:
                    name = part_name(state["target"], token, byte_range.index, len(state["ranges"]))
                    final = os.path.join(state["directory"], name)
                    slices += _write_part(plan, final, state["directory"], byte_range, settings)
                    state.setdefault("written_parts", []).append(final)
                    parts.append(dataclasses.asdict(PartInfo(byte_range.index, name, byte_range.start, byte_range.end,
                                                             socket.gethostname())))  # fmt: skip
            timing["write"] = time.perf_counter() - start
            return {"slices": slices, "parts": parts}

        written = coordinator.run("write", write)
        marks["write"] = time.perf_counter() - began
        plan, mine, all_ranges = state["write_plan"], state["mine"], state["ranges"]

        def finish() -> None:
            if rank != 0 or _sink:
                return
            crcs = _combined_crcs(plan, [s for w in written for s in w["slices"]], settings.checksum)
            patches = _descriptor_patches(plan, crcs, all_ranges)
            if layout == "file":
                _commit_file(plan, crcs, patches, state["temporary"], state["target"], state["directory"], settings)
                state.pop("temporary")
            else:
                parts = tuple(sorted((PartInfo(**p) for w in written for p in w["parts"]), key=lambda p: p.index))
                manifest = Manifest(
                    size=plan.size, token=token, parts=parts, patches=tuple(patches),
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
        if layout == "parts" and "committing" not in state:
            # Not referenced by any manifest. (Once rank 0 may have committed, parts stay; a later
            # save's clean-up removes those that no manifest references.)
            for part in state.get("written_parts", ()):
                try:
                    os.unlink(part)
                except OSError:
                    pass
        raise
    if layout == "parts" and not _sink:
        _remove_old_parts(state["target"], token)
    own_bytes = sum(r.entry.size for r in state["plan"].storages)
    shared = own_bytes if rank == 0 else sum(layout_0.entries[skeleton[2][o][0]].size for o in held.get(rank, ()))
    _last["stats"] = SaveStats(
        rank=rank, world_size=coordinator.size, writers=len(writer_list),
        bytes_written=sum(r.length for r in mine), write_seconds=timing.get("write", 0.0),
        total_seconds=time.perf_counter() - began, file_size=plan.size, steps=marks,
        digest_seconds=state["digest_seconds"], shared_bytes=shared,
        divergent=tuple(reference_keys[i] for i in divergent),
    )  # fmt: skip


def _report_divergence(obj: Any, plan: SavePlan, divergent: list[int], keys: list[str], matched: list[dict],
                       policy: str, rank: int) -> None:  # fmt: skip
    """Warns (rank 0) or raises (every rank) about storages whose values differ between ranks."""
    if policy == "ignore" or (policy == "warn" and rank != 0):
        return
    wanted = [keys[i] for i in divergent]
    names = replicas.storage_names(obj, wanted, plan)
    where = {keys[i]: [r for r, m in enumerate(matched) if i in m.get("divergent", ())] for i in divergent}
    shown = ", ".join(f"{names[k]} (rank {', '.join(map(str, where[k]))})" for k in wanted[:8])
    more = f" and {len(wanted) - 8} more" if len(wanted) > 8 else ""
    if policy == "error":
        ranks = sorted({r for rs in where.values() for r in rs})
        raise DistributedCheckpointError(
            f"collective save: {len(wanted)} tensor(s) hold other values on some ranks than on rank 0: "
            f"{shown}{more}. Nothing was written. Synchronize them before saving, or pass divergence='warn' "
            "to save rank 0's values (what torch.save on rank 0 would write)",
            {r: "values differ from rank 0's" for r in ranks},
        )
    warnings.warn(
        f"collective save: {len(wanted)} tensor(s) hold other values on some ranks than on rank 0; rank 0's "
        f"values were saved: {shown}{more}. Expected for per-rank state (RNG states, unsynchronized metrics); "
        "for weights it means the replicas drifted apart. divergence='ignore' silences this, 'error' refuses",
        ReplicaDivergenceWarning,
        stacklevel=4,
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


def _write_ranges(plan: SavePlan, file_path: str, ranges, settings, sink: bool = False):
    """Writes each range of ``plan`` into rank 0's temporary file (which must exist); fsyncs once."""
    if not ranges:
        return []
    file = engine.File(file_path, "w", direct=settings.direct and not sink, truncate=False, create=False)
    slices = []
    try:
        for byte_range in ranges:
            crcs = write_plan(plan, file, settings, byte_range=(byte_range.start, byte_range.end),
                              destination_offset=0 if sink else None)  # fmt: skip
            slices += _slice_crcs(plan, crcs, byte_range)
        if settings.fsync and not sink:
            file.fsync()
    finally:
        file.close()
    return slices


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
