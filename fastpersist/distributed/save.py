"""Collective, data-parallel save: one checkpoint of rank 0's object, its bytes written by every rank.

A collective save means ``torch.save`` on the group's rank 0, written by all
ranks: the committed file holds rank 0's object (its pickled metadata,
device tags and values), never a mix of ranks' bytes. Ranks exchange
metadata only (:class:`~fastpersist.distributed.coordinator.Coordinator`,
through the group's store, never a collective of its backend). One save is a
:class:`CollectiveSave`, whose phases are its methods:

* **plan** -- every rank pickles and plans its object and reports its host;
  rank 0 also reports its file layout and metadata records (``data.pkl``,
  ...), creates the pre-sized temporary file (``layout="file"``) and a token.
  The file up to the central directory is split into one aligned range per
  writer (:func:`~fastpersist.distributed.sharding.shard_ranges`); each
  writer writes its range of **rank 0's layout** from its own storages of
  the same key and size, and leaves out the bytes of storages it does not
  have (:func:`~fastpersist.distributed.sharding.split_range`).
* **verify** -- which storages each writer holds byte for byte as rank 0
  does: a 64-bit digest of each (:mod:`~fastpersist.distributed.replicas`).
  Where the bytes differ but the values the tensors see are the same (one
  rank keeps a weight column-major), nothing is reported; where the values
  differ (per-rank state, a drifted replica), ``divergence`` says whether to
  warn on rank 0 (default), refuse on every rank (nothing is committed) or
  say nothing; key paths named in ``per_rank`` are expected to differ and
  never warned about. Rank 0's values are written either way.
* **capture** (asynchronous saves) -- the bytes this rank will write are
  copied into staging (snapshot mode: only this rank's share), or left in
  place for the background write to read (pipelined mode).
* **write** -- each writer writes its share (into rank 0's temporary file,
  its own part, or an object store's part object), computing the CRC-32 of
  each record slice on the way, and fsyncs; it reports the slices.
* **commit** (rank 0) -- combines the slices' CRC-32s
  (:func:`~fastpersist.io.checksum.crc32_combine_all`) and writes what needs
  them: the data descriptors and the trailer (``layout="file"``, then fsync,
  rename over the target, directory fsync) or the manifest (``layout="parts"``,
  atomically, last). Every rank returns only after that succeeded.
* **abort** -- after a failure anywhere: rank 0 removes its temporary file,
  each rank the parts no manifest can reference.

:func:`save` runs the phases in the caller, writing first and verifying
beside the write: every writer writes its whole range from its own memory
while its digests are computed on the compute units, and rank 0 then
rewrites the bytes another writer held differently (``layout="parts"``: as
patches in the manifest, at most :data:`PATCH_LIMIT`) and writes what the
others left out. An asynchronous collective save
(:func:`fastpersist.async_save` with ``group=``) verifies first, in the
caller, so that every rank knows before the state is captured exactly which
bytes it writes: rank 0 writes the others' left-out and differing bytes in
its own write, and no rank reads the state again once the caller has gone
on; the write and commit then run on the background save queue.

Until the commit nothing is visible at the path: bytes a writer wrote from a
differing storage live only in the temporary file (or an unreferenced part)
until rank 0 has replaced them. A failure at any step is raised on every
rank, naming the rank; the previous checkpoint at the path stays. Other
ranks open rank 0's temporary file without creating it, so a rank that
arrives after a failure never recreates it.

The save resolves its target once (:func:`fastpersist.io.targets.resolve`),
whose store says which layouts it holds. Where the parts and the manifest go
is a small store object: files beside the path (``_LocalParts``), or, for an
``s3://bucket/key`` target (always ``layout="parts"``), part objects beside
the key and a manifest object whose ``PutObject`` is the commit
(:class:`fastpersist.distributed.objectstore.ObjectParts`). A
:class:`~fastpersist.io.targets.Sink` target (benchmarks) runs every phase
into ``/dev/null``: no temporary file, no parts, nothing committed.
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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fastpersist import config
from fastpersist.distributed import replicas
from fastpersist.distributed.coordinator import DEFAULT_TIMEOUT, Coordinator
from fastpersist.distributed.manifest import Manifest, PartInfo, part_name
from fastpersist.distributed.objectstore import ObjectParts
from fastpersist.distributed.sharding import DEFAULT_ALIGNMENT, ByteRange, shard_ranges, split_range, writer_ranks
from fastpersist.errors import DistributedCheckpointError, ReplicaDivergenceWarning, caller_location, warn_at_caller
from fastpersist.format.plan import BytesRecord, SavePlan, StorageRecord
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io import commit, engine, queue, targets, workers
from fastpersist.io.checksum import crc32_combine_all
from fastpersist.io.ring import on_streams
from fastpersist.io.writer import idle_work, side_streams, write_plan
from fastpersist.tensors import host_memoryview

__all__ = [
    "DIVERGENCE",
    "LAYOUTS",
    "PATCH_LIMIT",
    "WRITERS",
    "CollectiveSave",
    "Options",
    "SaveStats",
    "is_collective",
    "options",
    "safetensors_refused",
    "save",
    "wants_group",
]

LAYOUTS = ("file", "parts")
WRITERS = ("all", "node")
DIVERGENCE = ("warn", "error", "ignore")
PATCH_LIMIT = 256 << 20
"""``layout="parts"``: most bytes rank 0 may carry in the manifest for other writers' differing storages."""


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What this rank did in a collective save (for benchmarks and logs)."""

    rank: int
    world_size: int
    writers: int
    bytes_written: int
    write_seconds: float
    total_seconds: float
    file_size: int
    steps: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds from the start of the save to the end of each step's exchange (plan, verify, write, commit)."""
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


@dataclasses.dataclass(frozen=True)
class Options:
    """A collective save's choices, checked (made by :func:`options`)."""

    layout: str
    writers: str = "all"
    divergence: str = "warn"
    timeout: float = DEFAULT_TIMEOUT
    alignment: int = DEFAULT_ALIGNMENT
    per_rank: tuple[str, ...] = ()
    """Key paths (``"callbacks"``, ``"loops.fit_loop"``) of per-rank state: differences there are expected."""
    pickle_module: Any = pickle
    pickle_protocol: int = DEFAULT_PROTOCOL
    disable_byteorder_record: bool = False


def options(
    destination: Any,
    *,
    layout: str | None = None,
    writers: str = "all",
    divergence: str = "warn",
    timeout: float | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    per_rank: Iterable[str] = (),
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    disable_byteorder_record: bool = False,
) -> Options:
    """The :class:`Options` of a collective save to ``destination`` (a path, a URL or a target), checked before
    any exchange.

    Raises:
        ValueError: an unknown layout, writers or divergence mode, a timeout
            that is not positive, a layout the target's store does not hold
            (``layout="file"`` for an object store URL; any for a store
            without collective saves), or a malformed URL.
        TypeError: ``per_rank`` is not an iterable of strings; a file object.
    """
    if writers not in WRITERS:
        raise ValueError(f"writers must be one of {WRITERS}, got {writers!r}")
    if divergence not in DIVERGENCE:
        raise ValueError(f"divergence must be one of {DIVERGENCE}, got {divergence!r}")
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if isinstance(per_rank, str) or not all(isinstance(p, str) for p in per_rank):
        raise TypeError(f"per_rank must be an iterable of key paths (str), got {per_rank!r}")
    return Options(
        _layout_for(targets.resolve(destination), layout),
        writers,
        divergence,
        timeout,
        alignment,
        tuple(per_rank),
        pickle_module,
        pickle_protocol,
        disable_byteorder_record,
    )


def safetensors_refused(path: Any) -> ValueError:
    """The error for a collective save of safetensors (it writes a torch-format checkpoint), to raise."""
    return ValueError(
        f"a collective save (group=...) writes a torch-format checkpoint, not safetensors ({path}): save with "
        "format='torch', or save the safetensors file on one rank (if rank == 0: ...)"
    )


def wants_group(group: Any) -> bool:
    """Whether ``group=`` was given at all (``None`` and ``False`` mean a plain save)."""
    return group is not None and group is not False


def is_collective(group: Any) -> bool:
    """Whether ``group`` asks for a collective save: torch.distributed is up and the group has > 1 rank."""
    import torch.distributed as dist

    if not wants_group(group):
        return False
    if not dist.is_available() or not dist.is_initialized():
        if group is True:
            return False  # "the default group" with no torch.distributed: a plain save
        raise RuntimeError("group= was given but torch.distributed is not initialized (init_process_group)")
    return dist.get_world_size(None if group is True else group) > 1


def save(
    obj: object,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    settings: config.Settings | None = None,
    **choices: Any,
) -> SaveStats:
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
            Or a target (:mod:`fastpersist.io.targets`): a
            :class:`~fastpersist.io.targets.Sink` runs the save into
            ``/dev/null`` and commits nothing (benchmarks).
        group: the process group (``None`` or ``True``: the default group).
        settings: resolved fastpersist settings (default: current ones).
        **choices: :func:`options`' keywords: ``layout`` (``"file"`` or
            ``"parts"``; default ``"file"`` for paths, ``"parts"`` for
            ``s3://``), ``writers`` (``"all"`` or one per ``"node"``),
            ``divergence`` (``"warn"``, ``"error"``, ``"ignore"``),
            ``per_rank`` (key paths of per-rank state), ``timeout`` (seconds
            each rank waits for the others at each step), ``alignment``, the
            pickling options.

    Returns:
        What this rank did (:class:`SaveStats`).

    Raises:
        DistributedCheckpointError: on every rank, when any rank failed, did
            not report in time, made another collective call (another path,
            layout or writers: at once), or (``divergence="error"``) holds
            other values than rank 0 (``failures`` names the ranks); also
            (``layout="parts"``) when more than :data:`PATCH_LIMIT` bytes
            differ from rank 0's. With ``s3://``: a rank's upload failed (its
            ``ObjectStoreError``, e.g. ``BucketNotFoundError``, is named in
            the message); its multipart upload was aborted and the part
            objects already stored deleted (a note on the error lists what
            could not be).
        ValueError, TypeError: bad choices (:func:`options`), before any exchange.
    """
    chosen = options(path, **choices)
    operation = CollectiveSave(obj, path, None if group is True else group, chosen, settings or config.settings())
    return operation.run()


class CollectiveSave:
    """One collective save on this rank: its phases (methods, called in order) and what they found.

    :meth:`run` is the synchronous save: :meth:`plan`, :meth:`write` (the
    digests beside it), :meth:`verify`, :meth:`commit`. An asynchronous save
    calls :meth:`plan`, :meth:`verify` and captures the state in the caller
    (using :meth:`share`), then :meth:`write` and :meth:`commit` on the
    background thread. Any phase that raises must be followed by
    :meth:`abort`; :meth:`fail` hands an error raised between phases to the
    other ranks, which wait in the next step.

    Raises (constructor): RuntimeError when torch.distributed is not
    initialized or this process is not in ``group``.
    """

    def __init__(
        self, obj: object, path: Any, group: Any, choices: Options, settings: config.Settings, *, planner=None
    ):
        self.obj = obj
        self.destination = targets.resolve(path)  # where the bytes go (checked in the plan step, on every rank)
        self.discarding = self.destination.discards  # a sink: nothing created, written for real or committed
        self.options = choices
        self.settings = settings
        self.planner: Callable[[object, str], SavePlan] = planner or (
            lambda o, archive: plan_save(
                o, archive, choices.pickle_module, choices.pickle_protocol, choices.disable_byteorder_record
            )
        )
        self.began = time.perf_counter()
        self.caller = caller_location()  # where a divergence warning belongs, also when raised on the save thread
        self.in_background = False  # an asynchronous save's phases after the plan run on the save thread
        self._early: tuple[dict[str, int], Any] | None = None  # digests queued in the caller (start_digests)
        description = f"{choices.layout}, writers={choices.writers}, {os.path.basename(self.destination.path)}"
        self.coordinator = Coordinator(group, choices.timeout, "save", description)
        self.rank = self.coordinator.rank
        self.marks: dict[str, float] = {}
        self.timing: dict[str, float] = {}
        # plan
        self.store: Any = None  # where parts and the manifest go (layout="parts")
        self.target = self.directory = None
        self.temporary: str | None = None  # rank 0's temporary file (layout="file"), until committed
        self.shared_file: str | None = None  # where every writer writes (layout="file")
        self.token = ""
        self.plan: SavePlan | None = None  # rank 0's layout with this rank's storages
        self.present: dict[int, StorageRecord] = {}  # by rank 0's storage ordinal: the ones this rank has
        self.writer_list: list[int] = []
        self.ranges: tuple[ByteRange, ...] = ()
        self.units = 1
        self._hosts: list[str] = []
        self._skeleton: tuple | None = None
        self._own: SavePlan | None = None  # this rank's own plan, until split against rank 0's layout
        # verify (before the write: asynchronous saves)
        self.verified = False
        self.pieces: list[ByteRange] | None = None  # what this rank writes
        self.holes: list[ByteRange] = []  # what it leaves out (rank 0 writes them)
        self.differ: dict[int, list[int]] = {}  # writer -> ordinals it holds with other bytes than rank 0
        self.divergent: list[int] = []  # ordinals whose values differ (not just their layout)
        # write and commit
        self.written: list[dict[str, Any]] = []
        self.written_parts: list[str] = []
        self.outcome: dict[str, Any] = {}
        self.committing = False
        self.manifest_sent = False

    # ------------------------------------------------------------------ the synchronous save

    def run(self) -> SaveStats:
        """The synchronous save: plan, write (digests beside it), verify, commit; returns this rank's stats."""
        try:
            self.plan_phase()
            self.write()
            self.verify()
            self.commit()
        except BaseException as error:
            self.abort(error)
            raise
        return self.stats()

    # ------------------------------------------------------------------ phases

    def plan_phase(self) -> None:
        """:meth:`plan_locally`, then :meth:`exchange_plan`."""
        self.plan_locally()
        self.exchange_plan()

    def plan_locally(self) -> None:
        """Pickles and plans this rank's object (in the caller: the object's structure is taken now).

        Raises:
            DistributedCheckpointError: on every rank, when it failed on one.
        """
        try:
            self._plan_locally()
        except BaseException as error:
            self.fail(error, "plan")  # every rank raises
            raise

    def exchange_plan(self) -> None:
        """Exchanges hosts and rank 0's layout; rank 0 creates its temporary file (``layout="file"``).

        Called in the caller, it first waits for a collective save still
        pending in this process (:func:`fastpersist.io.queue.wait_collective`);
        on the save thread, the saves before it are done already.
        """
        queue.wait_collective()
        reports = self.coordinator.run("plan", self._prepare, last=False)
        self.marks["plan"] = time.perf_counter() - self.began
        self._hosts = [r["host"] for r in reports]
        self._skeleton, self.token = reports[0]["skeleton"], reports[0]["token"]
        self.shared_file = reports[0].get("temporary")

    def _plan_locally(self) -> None:
        destination = self.destination.checked()
        if destination.local:
            self.target, self.directory = destination.path, destination.directory
            if self.options.layout == "parts":
                self.store = _LocalParts(destination.path, destination.directory)
        elif self.discarding:
            self.target = destination.path
        else:  # an object store (the only remote store whose collective_layout accepts a collective save)
            self.store = ObjectParts(destination, self.settings)
            self.target = self.store.target
        self._own = self.planner(self.obj, archive_name_for(self.target))

    def start_digests(self, streams=None) -> None:
        """(After :meth:`plan_locally`, in the caller) Has the digests of every storage of this rank queued on ``streams``.

        An asynchronous save's verify then only collects them: computed on the
        save thread they waited for the GPU, busy with training, for 8-22 ms per
        save, and launched in the caller they took it 10 ms (docs/distributed.md).
        So a thread of their own launches them, beside the saves still being
        written. They read the state as it is when the streams were made; the
        save's reads, queued later on the same streams after these launches,
        and whatever waits for those (the optimizer step), come after them.
        """
        own = self._own.storages

        def launch():
            with on_streams(streams):
                pending = replicas.PendingDigests(own)
                pending.launch_all()
            return pending

        self._early = ({record.key: i for i, record in enumerate(own)}, workers.detached("fastpersist-digests", launch))

    def local_plan(self) -> SavePlan:
        """This rank's plan of its own object (after :meth:`plan_locally`): which devices its tensors are on."""
        return self._own if self._own is not None else self.plan

    def _prepare(self) -> dict[str, Any]:
        own = self._own
        payload: dict[str, Any] = {"host": socket.gethostname()}
        if self.rank == 0:
            self.token = secrets.token_hex(6)
            payload.update(skeleton=_skeleton(own), token=self.token)
            if self.options.layout == "file" and not self.discarding:
                payload["temporary"] = self.temporary = _create_presized(
                    self.target, self.directory, own.size, self.settings
                )
        return payload

    def _split(self) -> None:
        """This rank's plan of rank 0's layout, and its range with the storages it lacks left out."""
        if self.plan is not None:
            return
        layout = self._skeleton[0]
        self.writer_list = writer_ranks(self._hosts, self.options.writers)
        alignment = self.options.alignment
        self.ranges = shard_ranges(layout.central_directory_offset, len(self.writer_list), alignment)
        self.units = max(1, -(-layout.central_directory_offset // alignment))
        if self.rank == 0:
            self.plan, self.present = self._own, dict(enumerate(self._own.storages))
        else:
            self.plan, self.present = _plan_from(self._skeleton, self._own)
        self._own = None
        blocked = [o for o in range(len(self.plan.storages)) if o not in self.present]
        self.pieces, self.holes = self._cut(self.rank, blocked)

    def _cut(self, rank: int, blocked) -> tuple[list[ByteRange], list[ByteRange]]:
        if rank not in self.writer_list:
            return [], []
        mine = self.ranges[self.writer_list.index(rank)]
        return split_range(mine, _payloads(self.plan, blocked), self.options.alignment)

    def _compared(self) -> list[int]:
        """The ordinals this rank digests: its storages, when there is more than one writer and it is one."""
        if len(self.writer_list) < 2 or self.rank not in self.writer_list:
            return []
        return sorted(self.present)

    def verify(self, streams=None) -> None:
        """Which storages every writer holds as rank 0 does, and what to say about those it does not.

        Before the write (an asynchronous save, in the caller) it computes and
        exchanges the digests, and reassigns the bytes a writer holds
        differently to rank 0 (:meth:`share`). After the write (:meth:`run`) it
        compares the digests the write step reported. Either way, storages whose
        bytes differ are compared by value (:func:`~fastpersist.distributed.replicas.value_digests`)
        in one more exchange, and ``divergence`` applies to those whose values differ.

        ``streams`` (before the write, on the save thread): the side streams,
        made in the caller, on which the digests are computed.

        Raises:
            DistributedCheckpointError: on every rank, ``divergence="error"``
                and values differ outside ``per_rank`` (nothing committed).
        """
        if not self.written:  # before the write
            reports = self.coordinator.run("verify", self._digest_before_write, streams, last=False)
            self.verified = True
            digests = [r.get("digests") for r in reports]
        else:
            digests = [r.get("digests") for r in self.written]
        candidates: dict[int, list[int]] = {}  # ordinal -> writers whose values may differ
        if self.writer_list and len(self.writer_list) > 1:
            own = digests[0]
            for w in self.writer_list[1:]:
                self.differ[w], divergent = replicas.mismatches(own, digests[w])
                for ordinal in divergent:
                    candidates.setdefault(ordinal, []).append(w)
        if candidates and self.options.divergence != "ignore":
            self._judge(candidates)
        if self.verified:
            self._reassign(digests)
        self.marks["verify"] = time.perf_counter() - self.began

    def _digest_before_write(self, streams=None) -> dict[str, Any]:
        self._split()
        compared = self._compared()
        if self._early is not None:  # queued in the caller
            (index, launched), self._early = self._early, None
            every = launched.result().result()
            found = [every[index[self.present[o].key]] for o in compared]
        else:  # on the caller's streams (or side streams it made): the digests see what the caller queued
            with on_streams(streams):
                found = replicas.storage_digests([self.present[o] for o in compared]) if compared else []
        return {"digests": dict(zip(compared, found))}

    def _judge(self, candidates: dict[int, list[int]]) -> None:
        """Compares the candidates' values across ranks (one exchange); warns on rank 0 or raises on every rank."""
        ordinals = sorted(candidates)

        def mine() -> dict[str, Any]:
            wanted = ordinals if self.rank == 0 else [o for o in ordinals if self.rank in candidates[o]]
            values = replicas.value_digests(self.obj, {o: self.present[o] for o in wanted if o in self.present})
            names = {}
            if self.rank == 0:
                keys = [self.plan.storages[o].key for o in ordinals]
                found = replicas.storage_names(self.obj, keys, self.plan)
                names = {o: found[self.plan.storages[o].key] for o in ordinals}
            return {"values": values, "names": names}

        reports = self.coordinator.run("values", mine, last=False)
        reference, names = reports[0]["values"], reports[0]["names"]
        where: dict[int, list[int]] = {}
        for ordinal, writers in candidates.items():
            own = reference.get(ordinal)
            for w in writers:
                theirs = reports[w]["values"].get(ordinal)
                if own is None or theirs is None or own != theirs:
                    where.setdefault(ordinal, []).append(w)
        self.divergent = sorted(where)
        reported = [o for o in self.divergent if not _under(names[o], self.options.per_rank)]
        if not reported:
            return
        shown = ", ".join(f"{names[o]} (rank {', '.join(map(str, where[o]))})" for o in reported[:8])
        more = f" and {len(reported) - 8} more" if len(reported) > 8 else ""
        if self.options.divergence == "error":
            raise DistributedCheckpointError(
                f"collective save: {len(reported)} tensor(s) hold other values on some ranks than on rank 0: "
                f"{shown}{more}. Nothing was committed. Synchronize them before saving, pass their key paths as "
                "per_rank= if they are per-rank state, or pass divergence='warn' to save rank 0's values (what "
                "torch.save on rank 0 would write)",
                {r: "values differ from rank 0's" for r in sorted({r for o in reported for r in where[o]})},
            )
        if self.rank == 0:
            warn_at_caller(
                f"collective save: {len(reported)} tensor(s) hold other values on some ranks than on rank 0; rank "
                f"0's values were saved: {shown}{more}. Expected for per-rank state (RNG states, unsynchronized "
                "metrics: name their key paths in per_rank= to say so); for weights it means the replicas drifted "
                "apart. divergence='ignore' silences this, 'error' refuses",
                ReplicaDivergenceWarning,
                self.caller,
            )

    def _reassign(self, digests: list[dict[int, Any] | None]) -> None:
        """Verified before the write: each writer leaves out what it lacks or holds differently; rank 0 writes it."""
        every = set(range(len(self.plan.storages)))
        extra: list[ByteRange] = []
        for w in self.writer_list:
            if w == 0:
                continue
            blocked = (every - set(digests[w] or ())) | set(self.differ.get(w, ()))
            pieces, holes = self._cut(w, sorted(blocked))
            if w == self.rank:
                self.pieces, self.holes = pieces, holes
            extra += holes
        if self.rank == 0:
            self.pieces = sorted(self.pieces + extra, key=lambda r: r.start)

    def share(self) -> tuple[SavePlan, list[ByteRange]]:
        """(After a verify before the write) this rank's plan and the byte ranges of it that it writes."""
        return self.plan, list(self.pieces or [])

    def write(self, plan: SavePlan | None = None, *, streams=None, after_reads=None, before_report=None) -> None:
        """Writes this rank's share and exchanges what was written.

        Args:
            plan: the plan to write from (default: :attr:`plan`; a snapshot of
                its share, for asynchronous saves).
            streams: side CUDA streams made on the thread that queued the
                tensors' producers (default: made here).
            after_reads: called with the side streams' events once every byte
                this rank writes has been read (or its copy queued).
            before_report: called once everything is written, before the
                report (a pipelined save checks here that nothing changed).
        """
        reports = self.coordinator.run("write", self._write, plan, streams, after_reads, before_report, last=False)
        self.written = reports
        self.marks["write"] = time.perf_counter() - self.began

    def _write(self, plan, streams, after_reads, before_report) -> dict[str, Any]:
        # Everything here may fail (on one rank or all): inside the step the others hear of it, which the
        # plan step, exchanged without waiting for every rank to read it (last=False), relies on.
        start = time.perf_counter()
        self._split()
        plan = plan or self.plan
        if not self.pieces and not self.holes:
            if after_reads is not None:
                after_reads([])
            if before_report is not None:
                before_report()
            return {}
        if streams is None:
            streams = side_streams(plan)  # before the digests are queued: the copies must not wait for them
        compared = [] if self.verified else self._compared()
        prepared_at = time.perf_counter()
        pending = replicas.PendingDigests([self.present[o] for o in compared]) if compared else None
        if pending and self.settings.checksum:
            # Queued during a checksummed write they finished 17-19 ms after it (2 x H200, 4.3 GB to the
            # sink, CRC-32s on Python threads or on the native pool alike); queued now in 10-16 ms.
            pending.launch_all()
        launched_at = time.perf_counter()
        with idle_work(pending.launch_next) if pending else contextlib.nullcontext():  # beside the copies
            slices, parts = self._write_pieces(plan, self.pieces, streams, after_reads)
        written_at = time.perf_counter()
        digests = dict(zip(compared, pending.result())) if pending else {}
        if before_report is not None:
            before_report()
        self.timing.update(
            write=written_at - start,
            prepare=prepared_at - start,
            launch=launched_at - prepared_at,
            digest=time.perf_counter() - written_at,
        )
        return {
            "slices": slices,
            "parts": parts,
            "holes": [dataclasses.astuple(h) for h in self.holes],
            "pieces": [dataclasses.astuple(p) for p in self.pieces],
            "digests": digests,
        }

    def _write_pieces(self, plan: SavePlan, pieces, streams, after_reads=None):
        """Writes ``pieces`` (into rank 0's temporary file, this rank's parts, or a sink's /dev/null)."""
        if self.discarding:
            return _write_ranges(plan, self.target, pieces, self.settings, streams, after_reads, sink=True), []
        if self.options.layout == "file":
            return _write_ranges(plan, self.shared_file, pieces, self.settings, streams, after_reads), []
        slices, parts = [], []
        pieces = [p for p in pieces if p.length]
        for number, byte_range in enumerate(pieces):
            name = part_name(self.target, self.token, byte_range.index, self.units)
            last = after_reads if number == len(pieces) - 1 else None
            crcs = self.store.write(plan, name, byte_range, self.settings, streams, last)
            slices += _slice_crcs(plan, crcs, byte_range)
            self.written_parts.append(name)
            parts.append(
                dataclasses.asdict(
                    PartInfo(byte_range.index, name, byte_range.start, byte_range.end, socket.gethostname())
                )
            )
        if not pieces and after_reads is not None:
            after_reads([])
        return slices, parts

    def commit(self) -> None:
        """Rank 0 commits (after repairing what the write left to it); every rank learns the outcome.

        Raises:
            DistributedCheckpointError: on every rank, when rank 0's commit failed.
        """
        self.committing = True  # from here a part may be referenced by a committed manifest
        self.outcome = self.coordinator.run("commit", self._commit)[0]
        self.marks["commit"] = time.perf_counter() - self.began
        if self.rank == 0:
            self.temporary = None
        if self.store is not None and (self.rank == 0 or not self.store.seen_by_every_rank):
            # Unlinking a large part took 25 ms on a disk (docs/distributed.md): an asynchronous save's next
            # save, on the same thread, would wait for it.
            self.store.remove_old(self.token, later=self.in_background)

    def _commit(self) -> dict[str, Any]:
        """Rank 0's commit step: repair (a save verified after its write), CRC-32s, descriptors, trailer or manifest."""
        if self.rank != 0:
            return {}
        plan, written, writers = self.plan, self.written, self.writer_list
        record_of = [i for i, r in enumerate(plan.records) if isinstance(r, StorageRecord)]  # ordinal -> index
        slices = [s for w in writers for s in written[w]["slices"]]
        ranges = [ByteRange(*p) for w in writers for p in written[w]["pieces"]]
        repaired = 0
        rewritten: set[int] = set()
        patches: list[tuple[int, bytes]] = []
        if not self.verified:  # what the writers left out, and what they wrote from differing storages
            holes = [ByteRange(*h) for w in writers for h in written[w]["holes"]]
            redo: list[tuple[int, int, int]] = []  # (record index, start, end) of slices to replace
            for w, ordinals in self.differ.items():
                indices = {record_of[o] for o in ordinals}
                for index, start, _, length in written[w]["slices"]:
                    if index in indices:
                        redo.append((index, start, start + length))
                        rewritten.add(index)
            redone = {(index, start) for index, start, _ in redo}
            slices = [s for s in slices if (s[0], s[1]) not in redone]
            repaired = sum(h.length for h in holes) + sum(end - start for _, start, end in redo)
            ranges += holes
            if not self.discarding:
                if self.options.layout == "file":
                    slices += _rewrite_in_file(plan, self.shared_file, holes, redo, self.settings)
                else:
                    extra, parts_of_holes = self._write_pieces(plan, holes, None)  # rank 0's parts
                    slices += extra
                    written[0]["parts"] = written[0]["parts"] + parts_of_holes
                    redone_patches, redone_slices = _redo_as_patches(plan, redo)
                    patches += redone_patches
                    slices += redone_slices
        else:
            mine = [ByteRange(*h) for w in writers[1:] for h in written[w]["holes"]]
            repaired = sum(h.length for h in mine)
        outcome = {
            "differ": self.differ,
            "divergent": [plan.storages[o].key for o in self.divergent],
            "repaired": repaired,
        }
        if self.discarding:
            return outcome
        crcs = _combined_crcs(plan, slices, self.settings.checksum)
        patches += _descriptor_patches(plan, crcs, sorted(ranges, key=lambda r: r.start), rewritten)
        if self.options.layout == "file":
            _commit_file(plan, crcs, patches, self.temporary, self.target, self.directory, self.settings)
        else:
            parts = tuple(sorted((PartInfo(**p) for w in writers for p in written[w]["parts"]), key=lambda p: p.start))
            manifest = Manifest(
                size=plan.size,
                token=self.token,
                parts=parts,
                patches=tuple(patches),
                trailer_offset=plan.layout.central_directory_offset,
                trailer=plan.trailer(crcs),
                world_size=self.coordinator.size,
            )
            self.manifest_sent = True  # from here the manifest may be stored: its parts must stay
            self.store.commit(manifest.to_bytes(), self.settings)
        return outcome

    def fail(self, error: BaseException, step: str = "write") -> None:
        """Hands ``error``, raised on this rank between phases, to the others (waiting in ``step``).

        An ``Exception`` is posted as this rank's outcome of ``step``, so every
        rank raises at once; a ``KeyboardInterrupt`` or ``SystemExit`` marks
        the call abandoned (the others raise within a second) and is re-raised.

        Raises:
            DistributedCheckpointError: (an ``Exception``) on every rank, chained from ``error``.
        """
        if not isinstance(error, Exception):
            reason = f"was interrupted ({type(error).__name__}) before step {step!r}"
            self.coordinator.abort(reason, {self.rank: "interrupted"}, step)
            raise error
        self.coordinator.exchange(step, error=error)
        raise AssertionError("unreachable") from error  # exchange always raises when given an error

    def abort(self, error: BaseException) -> None:
        """After a failed phase: removes rank 0's temporary file and the parts no manifest can reference.

        A note is added to ``error`` when some parts could not be removed. Never raises.
        """
        if self.temporary:
            commit.discard_temporary(self.temporary)
            self.temporary = None
        if self.store is not None:
            note = self._discard_parts()
            if note:
                error.add_note(note)

    def _discard_parts(self) -> str | None:
        """After a failed ``layout="parts"`` save: removes the parts no manifest can reference.

        Before the commit step each rank removes its own (rank 0 also every part
        of this save's token it sees: the object store's, a shared directory's).
        In the commit step only rank 0 knows whether the manifest may have been
        stored: if not, it removes every writer's parts. Returns a note for the
        error when some may be left.
        """
        if not self.committing:
            return self.store.discard(self.written_parts, token=self.token or None)
        if self.rank == 0 and not self.manifest_sent:
            names = list(self.written_parts)
            names += [part["name"] for report in self.written for part in report.get("parts", ())]
            return self.store.discard(names, token=self.token or None)
        return None

    def stats(self) -> SaveStats:
        """What this rank did (after :meth:`commit`)."""
        report = self.written[self.rank] if self.rank in self.writer_list else {}
        wrote = sum(end - start for _, start, end in report.get("pieces", ()))
        unequal = set(self.differ.get(self.rank, ()))
        storages = self.plan.storages
        if self.rank == 0:
            shared = sum(r.entry.size for r in storages)
        else:
            shared = sum(storages[o].entry.size for o in self.present if o not in unequal) if report else 0
        repaired = self.outcome.get("repaired", 0) if self.rank == 0 else 0
        return SaveStats(
            rank=self.rank,
            world_size=self.coordinator.size,
            writers=len(self.writer_list),
            bytes_written=wrote + (0 if self.verified else repaired),
            write_seconds=self.timing.get("write", 0.0),
            total_seconds=time.perf_counter() - self.began,
            file_size=self.plan.size,
            steps=dict(self.marks),
            digest_seconds=self.timing.get("digest", 0.0),
            prepare_seconds=self.timing.get("prepare", 0.0),
            launch_seconds=self.timing.get("launch", 0.0),
            shared_bytes=shared,
            repaired_bytes=repaired,
            divergent=tuple(self.outcome.get("divergent", ())),
        )


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the key path ``name`` is one of ``prefixes`` or inside one (``a.b``, ``a[0]`` are inside ``a``)."""
    return any(name == p or name.startswith((p + ".", p + "[")) for p in prefixes)


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


def _layout_for(destination: targets.Target, layout: str | None) -> str:
    """The layout a collective save to ``destination`` uses: ``layout``, or its store's default ("file" for
    paths, "parts" for object stores).

    Raises:
        ValueError: an unknown layout; one the store does not hold; a malformed URL.
        TypeError: a file object.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return destination.collective_layout(layout)


class _LocalParts:
    """Where a ``layout="parts"`` save to a path puts its parts (files beside the target) and its manifest.

    Parts may be on each rank's own storage, so each rank removes the
    earlier saves' parts it sees (:attr:`seen_by_every_rank` is False).
    """

    seen_by_every_rank = False

    def __init__(self, target: str, directory: str):
        self.target = target
        self.directory = directory

    def write(self, plan: SavePlan, name: str, byte_range: ByteRange, settings, streams, after_reads=None) -> list[int]:
        path = os.path.join(self.directory, name)
        return _write_part(plan, path, self.directory, byte_range, settings, streams, after_reads)

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

    def remove_old(self, token: str, *, later: bool = False) -> None:
        """Removes the parts of earlier saves of this path; ``later``: listed now, unlinked on a cleanup thread.

        The listing is always made now: once this rank joins the next call,
        another rank may write that call's parts into the same directory.
        """
        stale = _stale_parts(self.target, token)
        if later and stale:
            workers.in_background(_unlink_all, stale)
        else:
            _unlink_all(stale)


def _payloads(plan: SavePlan, ordinals) -> list[tuple[int, int]]:
    storages = plan.storages
    return [(storages[o].entry.data_offset, storages[o].entry.data_end) for o in ordinals if storages[o].entry.size]


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


def _write_ranges(plan: SavePlan, file_path: str, ranges, settings, streams, after_reads=None, sink: bool = False):
    """Writes each range of ``plan`` into rank 0's temporary file (which must exist); fsyncs once.

    ``after_reads`` is called after the last range's reads (each earlier range was written whole before).
    """
    ranges = [r for r in ranges if r.length]
    if not ranges:
        if after_reads is not None:
            after_reads([])
        return []
    file = engine.File(file_path, "w", direct=settings.direct and not sink, truncate=False, create=False)
    slices = []
    try:
        for number, byte_range in enumerate(ranges):
            crcs = write_plan(
                plan,
                file,
                settings,
                streams=streams,
                byte_range=(byte_range.start, byte_range.end),
                destination_offset=0 if sink else None,
                after_reads=after_reads if number == len(ranges) - 1 else None,
            )
            slices += _slice_crcs(plan, crcs, byte_range)
        if settings.fsync and not sink:
            file.fsync()
    finally:
        file.close()
    return slices


def _write_part(plan: SavePlan, final: str, directory: str, byte_range: ByteRange, settings, streams, after_reads=None):
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
                after_reads=after_reads,
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


def _stale_parts(target: str, token: str) -> list[str]:
    """After a committed parts save: the parts of earlier saves of the same path that this rank sees."""
    directory, name = os.path.split(os.path.abspath(target))
    stale = []
    for candidate in glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(name)}.*.part-*-of-*")):
        if os.path.basename(candidate)[len(name) + 1 :].split(".part-")[0] != token:
            stale.append(candidate)
    return stale


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
