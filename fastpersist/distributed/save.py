"""Collective, data-parallel save: one checkpoint of rank 0's object, its bytes written by every rank.

A collective save means ``torch.save`` on the group's rank 0, written by all
ranks: the committed file holds rank 0's object (its pickled metadata,
device tags and values), never a mix of ranks' bytes. Ranks exchange
metadata only (:class:`~fastpersist.distributed.coordinator.Coordinator`),
in three steps:

1. ``plan``: every rank pickles and plans its object and reports its host;
   rank 0 also reports its file layout and metadata records (``data.pkl``,
   ...), creates the pre-sized temporary file (``layout="file"``) and a token.
2. ``write``: the file up to the central directory is split into one
   aligned range per writer (:func:`~fastpersist.distributed.sharding.shard_ranges`).
   Each writer writes its range of **rank 0's layout** from its own storages
   of the same key and size (the bytes of storages it does not have are left
   out, :func:`~fastpersist.distributed.sharding.split_range`), computing the
   CRC-32 of each record slice on the way, and fsyncs. Beside the write it
   computes a 64-bit digest of each of its storages
   (:mod:`~fastpersist.distributed.replicas`; on a GPU it runs on the
   compute units while the copy engines move the bytes). It reports slices,
   digests and the sub-ranges it left out.
3. ``commit`` (rank 0): compares every writer's digests with its own. Where
   a writer's storage differs from rank 0's (per-rank state, a drifted
   replica), rank 0 rewrites those bytes of the temporary file from its own
   copy (``layout="parts"``: records them in the manifest as patches), and
   writes what the others left out. ``divergence`` says whether to warn
   (default), raise (nothing is committed), or say nothing. Then it combines
   the slices' CRC-32s (:func:`~fastpersist.io.checksum.crc32_combine_all`)
   and writes what needs them: the data descriptors and the trailer
   (``layout="file"``, then fsync, rename over the target, directory fsync)
   or the manifest (``layout="parts"``, atomically, last). Every rank
   returns only after that succeeded.

Until the commit nothing is visible at the path: the bytes a writer wrote
from a differing storage live only in the temporary file (or an unreferenced
part) until rank 0 has replaced them. A failure at any step is raised on
every rank, naming the rank; rank 0 then removes the temporary file, and the
previous checkpoint at the path stays. Other ranks open rank 0's temporary
file without creating it, so a rank that arrives after a failure never
recreates it.

Where the parts and the manifest go is a small store object: files beside
the path (``_LocalParts``), or, for an ``s3://bucket/key`` target (always
``layout="parts"``), part objects beside the key and a manifest object whose
``PutObject`` is the commit (:class:`fastpersist.distributed.objectstore.ObjectParts`).
A failed ``layout="parts"`` save removes its parts: each rank its own before
the commit step; rank 0 every part of the save's token it can see, and in
the commit step every writer's as long as the manifest was not sent.
"""

from __future__ import annotations

import contextlib
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

from fastpersist import config
from fastpersist.distributed import replicas
from fastpersist.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator
from fastpersist.distributed.manifest import Manifest, PartInfo, part_name
from fastpersist.distributed.objectstore import ObjectParts
from fastpersist.distributed.sharding import DEFAULT_ALIGNMENT, ByteRange, shard_ranges, split_range, writer_ranks
from fastpersist.errors import DistributedCheckpointError, ReplicaDivergenceWarning
from fastpersist.format.plan import BytesRecord, SavePlan, StorageRecord
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io import commit, engine, objectstore
from fastpersist.io.checksum import crc32_combine_all
from fastpersist.io.writer import idle_work, side_streams, write_plan
from fastpersist.tensors import host_memoryview

__all__ = ["DIVERGENCE", "LAYOUTS", "PATCH_LIMIT", "WRITERS", "SaveStats", "is_collective", "last_stats", "save"]

LAYOUTS = ("file", "parts")
WRITERS = ("all", "node")
DIVERGENCE = ("warn", "error", "ignore")
PATCH_LIMIT = 256 << 20
"""``layout="parts"``: most bytes rank 0 may carry in the manifest for other writers' differing storages."""


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
    digest_seconds: float = 0.0
    """Seconds the identity check added to this rank's write step (its digests' wait after the write)."""
    prepare_seconds: float = 0.0
    """Part of ``write_seconds``: this rank's plan of rank 0's layout and its pieces, before any byte moved."""
    launch_seconds: float = 0.0
    """Part of ``write_seconds``: queuing the digests (kernel launches, host tasks) before the write began."""
    shared_bytes: int = 0
    """Storage bytes this rank wrote from its own memory that rank 0 found identical (rank 0: all it wrote)."""
    repaired_bytes: int = 0
    """Rank 0: bytes it wrote for the others (left out, or differing from its own)."""
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


def _plan_from(skeleton: tuple, own: SavePlan) -> tuple[SavePlan, dict[int, StorageRecord]]:
    """Rank 0's plan, with this rank's storages of the same key and size.

    Returns the plan and, by rank 0's storage ordinal, the records this rank
    has. The others get an empty stand-in: their bytes are left out of this
    rank's ranges (:func:`split_range`).
    """
    layout, metadata, keys = skeleton
    records: list[Any] = [None] * len(layout.entries)
    for i, data in metadata:
        records[i] = BytesRecord(layout.entries[i], data)
    mine = {r.key: r for r in own.storages}
    present = {}
    for ordinal, (i, key) in enumerate(keys):
        entry, candidate = layout.entries[i], mine.get(key)
        if candidate is not None and candidate.entry.size == entry.size:
            records[i] = present[ordinal] = candidate.placed(entry)
        else:
            records[i] = StorageRecord(entry, key, view=_NOTHING)
    return SavePlan(layout, tuple(records)), present


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
    """Every record's CRC-32 from the slices (which tile each record), as one writer would have computed it."""
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


def _descriptor_patches(plan: SavePlan, crcs: list[int], ranges, rewritten: set[int]) -> list[tuple[int, bytes]]:
    """Data descriptors to write at commit: those of records that started in an earlier range (their
    writer left zeros) and those of records whose bytes rank 0 rewrote (``rewritten``: the writer's
    descriptor holds its own CRC-32)."""
    patches = []
    for index, (record, crc) in enumerate(zip(plan.records, crcs)):
        entry = record.entry
        if not entry.descriptor_size:
            continue
        lo, hi = entry.descriptor_offset, entry.descriptor_offset + entry.descriptor_size
        # A writer zeroes the descriptor bytes it holds when the record started before its range
        # (io.writer); a descriptor may straddle two ranges.
        if index in rewritten or any(
            r.length and r.start < hi and lo < r.end and entry.data_offset < r.start for r in ranges
        ):
            patches.append((entry.descriptor_offset, entry.data_descriptor(crc)))
    return patches


def _storage_bytes(record: StorageRecord, lo: int, hi: int, chunk: int = 64 << 20):
    """``(file offset, bytes)`` pieces of a storage record's payload ``[lo, hi)`` (file offsets), copied to the host.

    Always owned ``bytes``, from every device: the pieces outlive the loop
    (manifest patches), and one code path for every device is the one the CPU
    tests check.
    """
    offset = record.entry.data_offset
    view = record.view
    for start in range(lo, hi, chunk):
        end = min(start + chunk, hi)
        yield start, bytes(host_memoryview(view[start - offset : end - offset].cpu()))


def save(
    obj: object,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    layout: str | None = None,
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
            Or ``s3://bucket/key``: a manifest object at the key and part
            objects beside it (:mod:`fastpersist.distributed.objectstore`).
        group: the process group (``None``: the default group).
        layout: ``"file"`` or ``"parts"``; ``None``: ``"file"`` for paths,
            ``"parts"`` for ``s3://`` URLs (the only layout there).
        writers: ``"all"`` ranks write, or one per ``"node"`` (host name).
        divergence: what to do when a writer's storage has rank 0's key and
            size but other bytes: ``"warn"`` (write rank 0's values and issue a
            :class:`~fastpersist.errors.ReplicaDivergenceWarning` on rank 0
            naming the tensors), ``"error"`` (raise on every rank, nothing
            committed) or ``"ignore"``.
        timeout: seconds each rank waits for the others at each step.
        alignment: range boundaries are multiples of this (power of two).
        settings: resolved fastpersist settings (default: current ones).
        _sink: benchmarks only: every writer writes its ranges into
            ``/dev/null`` and nothing is committed (the pipeline without storage).

    Raises:
        DistributedCheckpointError: on every rank, when any rank failed, did
            not report in time, or (``divergence="error"``) holds other values
            than rank 0 (``failures`` names the ranks); also (``layout="parts"``)
            when more than :data:`PATCH_LIMIT` bytes differ from rank 0's.
            With ``s3://``: a rank's upload failed (its ``ObjectStoreError``,
            e.g. ``BucketNotFoundError``, is named in the message); its
            multipart upload was aborted and the part objects already stored
            deleted (a note on the error lists what could not be).
        ValueError: an unknown layout, writers or divergence mode, ``layout="file"``
            for an ``s3://`` URL, or a malformed URL (before any exchange).
    """
    layout = _layout_for(path, layout)
    if writers not in WRITERS:
        raise ValueError(f"writers must be one of {WRITERS}, got {writers!r}")
    if divergence not in DIVERGENCE:
        raise ValueError(f"divergence must be one of {DIVERGENCE}, got {divergence!r}")
    settings = settings or config.settings()
    began = time.perf_counter()
    coordinator = Coordinator(group, timeout, "save", f"{layout} {os.path.basename(os.fspath(path))}")
    rank = coordinator.rank
    state: dict[str, Any] = {}

    def prepare() -> dict[str, Any]:
        if objectstore.is_object_url(path):
            state["parts"] = ObjectParts(path, settings)
            state["target"] = state["parts"].target
        else:
            destination = commit.target(path)
            state.update(target=destination.path, directory=destination.directory)
            if layout == "parts":
                state["parts"] = _LocalParts(destination.path, destination.directory)
        plan = state["plan"] = plan_save(
            obj, archive_name_for(state["target"]), pickle_module, pickle_protocol, disable_byteorder_record
        )
        payload: dict[str, Any] = {"host": socket.gethostname()}
        if rank == 0:
            payload.update(skeleton=_skeleton(plan), token=state.setdefault("token", secrets.token_hex(6)))
            if layout == "file" and not _sink:
                payload["temporary"] = state["temporary"] = _create_presized(
                    state["target"], state["directory"], plan.size, settings
                )
        return payload

    try:
        reports = coordinator.run("plan", prepare, last=False)
        marks = {"plan": time.perf_counter() - began}
        skeleton, token = reports[0]["skeleton"], reports[0]["token"]
        timing: dict[str, float] = {}

        def write() -> dict[str, Any]:
            # Everything here may fail (on one rank or all): inside the step the others hear of it, which the
            # plan step, exchanged without waiting for every rank to read it (last=False), relies on.
            writer_list = state["writer_list"] = writer_ranks([r["host"] for r in reports], writers)
            ranges = shard_ranges(skeleton[0].central_directory_offset, len(writer_list), alignment)
            state["units"] = max(1, -(-skeleton[0].central_directory_offset // alignment))
            mine = ranges[writer_list.index(rank)] if rank in writer_list else None
            if mine is None:
                return {}
            start = time.perf_counter()
            if rank == 0:
                plan = state["plan"]
                present = dict(enumerate(plan.storages))
            else:
                plan, present = _plan_from(skeleton, state["plan"])
            state["write_plan"] = plan
            missing = [o for o in range(len(plan.storages)) if o not in present]
            pieces, holes = split_range(mine, _payloads(plan, missing), alignment)
            streams = side_streams(plan)  # before the digests are queued: the copies must not wait for them
            compared = sorted(present) if len(writer_list) > 1 else []
            prepared_at = time.perf_counter()
            pending = replicas.PendingDigests([present[o] for o in compared]) if compared else None
            if pending and settings.checksum:
                # Queued during a checksummed write they finished 17-19 ms after it (2 x H200, 4.3 GB to the
                # sink, CRC-32s on Python threads or on the native pool alike); queued now in 10-16 ms.
                pending.launch_all()
            launched_at = time.perf_counter()
            with idle_work(pending.launch_next) if pending else contextlib.nullcontext():  # beside the copies
                slices, parts = _write_pieces(plan, pieces, streams, state, layout, token, reports, settings, _sink)
            written_at = time.perf_counter()
            digests = dict(zip(compared, pending.result())) if pending else {}
            timing.update(
                write=written_at - start,
                prepare=prepared_at - start,
                launch=launched_at - prepared_at,
                digest=time.perf_counter() - written_at,
            )
            return {
                "slices": slices,
                "parts": parts,
                "holes": [dataclasses.astuple(h) for h in holes],
                "pieces": [dataclasses.astuple(p) for p in pieces],
                "digests": digests,
            }

        written = state["written"] = coordinator.run("write", write, last=False)
        marks["write"] = time.perf_counter() - began

        def finish() -> dict[str, Any]:
            if rank != 0:
                return {}
            return _commit(
                obj, state, written, state["writer_list"], layout, divergence, token, coordinator.size, settings, _sink
            )

        state["committing"] = True  # from here a part may be referenced by a committed manifest
        outcome = coordinator.run("commit", finish)[0]
        marks["commit"] = time.perf_counter() - began
        if rank == 0:
            state.pop("temporary", None)
    except BaseException as error:
        temporary = state.get("temporary")
        if temporary:
            commit.discard_temporary(temporary)
        if "parts" in state and not _sink:
            note = _discard_parts(state, rank)
            if note:
                error.add_note(note)
        raise
    store = state.get("parts")
    if store is not None and not _sink and (rank == 0 or not store.seen_by_every_rank):
        store.remove_old(token)
    writer_list = state["writer_list"]
    report = written[rank] if rank in writer_list else {}
    wrote = sum(end - start for _, start, end in report.get("pieces", ()))
    unequal = set(outcome.get("differ", {}).get(rank, ()))
    plan = state.get("write_plan", state["plan"])
    storages = plan.storages
    shared = (
        sum(r.entry.size for r in storages)
        if rank == 0
        else sum(storages[o].entry.size for o in report.get("digests", {}) if o not in unequal)
    )
    _last["stats"] = SaveStats(
        rank=rank,
        world_size=coordinator.size,
        writers=len(writer_list),
        bytes_written=wrote + (outcome.get("repaired", 0) if rank == 0 else 0),
        write_seconds=timing.get("write", 0.0),
        total_seconds=time.perf_counter() - began,
        file_size=plan.size,
        steps=marks,
        digest_seconds=timing.get("digest", 0.0),
        prepare_seconds=timing.get("prepare", 0.0),
        launch_seconds=timing.get("launch", 0.0),
        shared_bytes=shared,
        repaired_bytes=outcome.get("repaired", 0) if rank == 0 else 0,
        divergent=tuple(outcome.get("divergent", ())),
    )


def _layout_for(path, layout: str | None) -> str:
    """The layout a collective save to ``path`` uses: ``layout``, or by default "file" (paths), "parts" (URLs).

    Raises:
        ValueError: an unknown layout, ``"file"`` for an ``s3://`` URL, a malformed URL.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not objectstore.is_object_url(path):
        return layout or "file"
    if layout == "file":
        raise ValueError(
            f"a collective save to an object store cannot use layout='file' ({path}): ranks cannot write one object "
            "in place. Leave layout at its default (for s3:// URLs: layout='parts', each writer uploads its share "
            "as a part object and rank 0 commits a manifest object at the key; fastpersist.load reads it), or save "
            "to a shared filesystem with layout='file'"
        )
    objectstore.target(path)  # a malformed URL fails here, on every rank, before any exchange
    return "parts"


def _discard_parts(state: dict[str, Any], rank: int) -> str | None:
    """After a failed ``layout="parts"`` save: removes the parts no manifest can reference.

    Before the commit step each rank removes its own (rank 0 also every part
    of this save's token it sees: the object store's, a shared directory's).
    In the commit step only rank 0 knows whether the manifest may have been
    stored: if not, it removes every writer's parts. Returns a note for the
    error when some may be left.
    """
    store = state["parts"]
    if "committing" not in state:
        return store.discard(state.get("written_parts", ()), token=state.get("token"))
    if rank == 0 and "manifest_sent" not in state:
        names = list(state.get("written_parts", ()))
        names += [part["name"] for report in state.get("written", ()) for part in report.get("parts", ())]
        return store.discard(names, token=state.get("token"))
    return None


class _LocalParts:
    """Where a ``layout="parts"`` save to a path puts its parts (files beside the target) and its manifest.

    Parts may be on each rank's own storage, so each rank removes the
    earlier saves' parts it sees (:attr:`seen_by_every_rank` is False).
    """

    seen_by_every_rank = False

    def __init__(self, target: str, directory: str):
        self.target = target
        self.directory = directory

    def write(self, plan: SavePlan, name: str, byte_range: ByteRange, settings, streams) -> list[int]:
        return _write_part(plan, os.path.join(self.directory, name), self.directory, byte_range, settings, streams)

    def commit(self, manifest: bytes, settings) -> None:
        _write_atomically(self.target, self.directory, manifest, settings)

    def discard(self, names, token: str | None = None) -> str | None:
        paths = {os.path.join(self.directory, name) for name in names}
        if token:
            stem = glob.escape(os.path.basename(self.target))
            paths.update(glob.glob(os.path.join(glob.escape(self.directory), f"{stem}.{token}.part-*-of-*")))
        left = []
        for path in sorted(paths):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # another rank's part, on storage this rank does not see
            except OSError as error:
                left.append(f"{path} ({error.strerror})")
        if not left:
            return None
        return f"parts of the failed save could not be removed: {', '.join(left)}; no checkpoint uses them: delete them"

    def remove_old(self, token: str) -> None:
        _remove_old_parts(self.target, token)


def _payloads(plan: SavePlan, ordinals) -> list[tuple[int, int]]:
    storages = plan.storages
    return [(storages[o].entry.data_offset, storages[o].entry.data_end) for o in ordinals if storages[o].entry.size]


def _write_pieces(plan, pieces, streams, state, layout, token, reports, settings, sink):
    """Writes this writer's pieces (into rank 0's temporary file, its own parts, or /dev/null)."""
    if sink:
        return _write_ranges(plan, "/dev/null", pieces, settings, streams, sink=True), []
    if layout == "file":
        return _write_ranges(plan, reports[0]["temporary"], pieces, settings, streams), []
    return _write_parts(plan, pieces, state, token, settings, streams)


def _write_parts(plan: SavePlan, ranges, state, token, settings, streams):
    """``layout="parts"``: each range becomes a part (a file beside the target, or an object beside the key)."""
    slices, parts = [], []
    for byte_range in ranges:
        if not byte_range.length:
            continue
        name = part_name(state["target"], token, byte_range.index, state["units"])
        crcs = state["parts"].write(plan, name, byte_range, settings, streams)
        slices += _slice_crcs(plan, crcs, byte_range)
        state.setdefault("written_parts", []).append(name)
        parts.append(
            dataclasses.asdict(PartInfo(byte_range.index, name, byte_range.start, byte_range.end, socket.gethostname()))
        )
    return slices, parts


def _commit(obj, state, written, writer_list, layout, divergence, token, world_size, settings, sink) -> dict:
    """Rank 0's commit step: compare, repair, CRC-32s, descriptors and trailer or manifest, commit."""
    plan = state["plan"]
    storages = plan.storages
    record_of = [i for i, r in enumerate(plan.records) if isinstance(r, StorageRecord)]  # ordinal -> record index
    own = written[0]["digests"]
    slices = [s for w in writer_list for s in written[w]["slices"]]
    pieces = [ByteRange(*p) for w in writer_list for p in written[w]["pieces"]]
    differ: dict[int, list[int]] = {}
    divergent: dict[int, list[int]] = {}
    for w in writer_list[1:]:
        differ[w], divergent[w] = replicas.mismatches(own, written[w]["digests"])
    keys = [r.key for r in storages]
    bad = sorted({o for ordinals in divergent.values() for o in ordinals})
    if bad:
        _report_divergence(obj, plan, bad, keys, divergent, divergence)
    # What rank 0 writes for the others: the bytes they left out, and those they wrote from differing storages.
    holes = [ByteRange(*h) for w in writer_list for h in written[w]["holes"]]
    redo: list[tuple[int, int, int]] = []  # (record index, start, end) of slices to replace
    rewritten: set[int] = set()
    for w, ordinals in differ.items():
        indices = {record_of[o] for o in ordinals}
        for index, start, _, length in written[w]["slices"]:
            if index in indices:
                redo.append((index, start, start + length))
                rewritten.add(index)
    redone = {(index, start) for index, start, _ in redo}
    slices = [s for s in slices if (s[0], s[1]) not in redone]
    repaired = sum(h.length for h in holes) + sum(end - start for _, start, end in redo)
    patches: list[tuple[int, bytes]] = []
    if not sink:
        if layout == "file":
            slices += _rewrite_in_file(plan, state["temporary"], holes, redo, settings)
        else:
            extra, parts_of_holes = _write_parts(plan, holes, state, token, settings, None)  # rank 0's parts
            slices += extra
            written[0]["parts"] = written[0]["parts"] + parts_of_holes
            redone_patches, redone_slices = _redo_as_patches(plan, redo)
            patches += redone_patches
            slices += redone_slices
    if sink:
        return {"differ": differ, "divergent": [keys[o] for o in bad], "repaired": repaired}
    crcs = _combined_crcs(plan, slices, settings.checksum)
    patches += _descriptor_patches(plan, crcs, sorted(pieces + holes, key=lambda r: r.start), rewritten)
    if layout == "file":
        _commit_file(plan, crcs, patches, state["temporary"], state["target"], state["directory"], settings)
    else:
        parts = tuple(sorted((PartInfo(**p) for w in writer_list for p in written[w]["parts"]), key=lambda p: p.start))
        manifest = Manifest(
            size=plan.size,
            token=token,
            parts=parts,
            patches=tuple(patches),
            trailer_offset=plan.layout.central_directory_offset,
            trailer=plan.trailer(crcs),
            world_size=world_size,
        )
        state["manifest_sent"] = True  # from here the manifest may be stored: its parts must stay
        state["parts"].commit(manifest.to_json(), settings)
    return {"differ": differ, "divergent": [keys[o] for o in bad], "repaired": repaired}


def _rewrite_in_file(plan: SavePlan, temporary: str, holes, redo, settings) -> list[tuple[int, int, int, int]]:
    """``layout="file"``: rank 0 writes the left-out ranges and the differing slices into the temporary file."""
    slices = []
    if holes:
        slices += _write_ranges(plan, temporary, holes, settings, None)
    if redo:
        descriptor = os.open(temporary, os.O_WRONLY)
        try:
            for index, lo, hi in redo:
                crc = 0
                for offset, data in _storage_bytes(plan.records[index], lo, hi):
                    _pwrite_all(descriptor, data, offset)
                    crc = engine.crc32_of(data, crc)
                slices.append((index, lo, crc, hi - lo))
        finally:
            os.close(descriptor)
    return slices


def _redo_as_patches(plan: SavePlan, redo) -> tuple[list[tuple[int, bytes]], list[tuple[int, int, int, int]]]:
    """``layout="parts"``: rank 0 cannot write into another writer's part; its bytes go into the manifest."""
    total = sum(hi - lo for _, lo, hi in redo)
    if total > PATCH_LIMIT:
        raise DistributedCheckpointError(
            f"collective save: {total / 2**20:.0f} MiB of the other ranks' tensors differ from rank 0's, and with "
            f"layout='parts' rank 0 can carry at most {PATCH_LIMIT / 2**20:.0f} MiB of them in the manifest (it "
            "cannot write into another rank's part). Synchronize the state first, or save with layout='file'. "
            "Nothing was committed",
            {0: "too many differing bytes for layout='parts'"},
        )
    patches, slices = [], []
    for index, lo, hi in redo:
        crc = 0
        for offset, data in _storage_bytes(plan.records[index], lo, hi):
            patches.append((offset, data))
            crc = engine.crc32_of(data, crc)
        slices.append((index, lo, crc, hi - lo))
    return patches, slices


def _report_divergence(
    obj: Any, plan: SavePlan, divergent: list[int], keys: list[str], where: dict[int, list[int]], policy: str
) -> None:
    """Rank 0: warns, or raises (every rank then raises), about storages whose values differ between ranks."""
    if policy == "ignore":
        return
    wanted = [keys[o] for o in divergent]
    names = replicas.storage_names(obj, wanted, plan)
    ranks = {keys[o]: [w for w, ordinals in where.items() if o in ordinals] for o in divergent}
    shown = ", ".join(f"{names[k]} (rank {', '.join(map(str, ranks[k]))})" for k in wanted[:8])
    more = f" and {len(wanted) - 8} more" if len(wanted) > 8 else ""
    if policy == "error":
        raise DistributedCheckpointError(
            f"collective save: {len(wanted)} tensor(s) hold other values on some ranks than on rank 0: "
            f"{shown}{more}. Nothing was committed. Synchronize them before saving, or pass divergence='warn' "
            "to save rank 0's values (what torch.save on rank 0 would write)",
            {r: "values differ from rank 0's" for r in sorted({r for rs in ranks.values() for r in rs})},
        )
    warnings.warn(
        f"collective save: {len(wanted)} tensor(s) hold other values on some ranks than on rank 0; rank 0's "
        f"values were saved: {shown}{more}. Expected for per-rank state (RNG states, unsynchronized metrics); "
        "for weights it means the replicas drifted apart. divergence='ignore' silences this, 'error' refuses",
        ReplicaDivergenceWarning,
        stacklevel=5,
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


def _write_ranges(plan: SavePlan, file_path: str, ranges, settings, streams, sink: bool = False):
    """Writes each range of ``plan`` into rank 0's temporary file (which must exist); fsyncs once."""
    ranges = [r for r in ranges if r.length]
    if not ranges:
        return []
    file = engine.File(file_path, "w", direct=settings.direct and not sink, truncate=False, create=False)
    slices = []
    try:
        for byte_range in ranges:
            crcs = write_plan(
                plan,
                file,
                settings,
                streams=streams,
                byte_range=(byte_range.start, byte_range.end),
                destination_offset=0 if sink else None,
            )
            slices += _slice_crcs(plan, crcs, byte_range)
        if settings.fsync and not sink:
            file.fsync()
    finally:
        file.close()
    return slices


def _write_part(plan: SavePlan, final: str, directory: str, byte_range: ByteRange, settings, streams):
    temporary = _temporary_name(final, directory)
    file = engine.File(temporary, "w", direct=settings.direct, truncate=True)
    try:
        try:
            if file.direct and byte_range.length:
                file.allocate(0, byte_range.length)
            crcs = write_plan(
                plan,
                file,
                settings,
                streams=streams,
                byte_range=(byte_range.start, byte_range.end),
                destination_offset=0,
            )
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
    return crcs


def _commit_file(
    plan: SavePlan, crcs: list[int], patches, temporary: str, target: str, directory: str, settings
) -> None:
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
