"""``async_save`` and the future it returns: saves that overlap training.

The saves run on the background save queue (:mod:`fastpersist.io.queue`: one
thread, call order, errors never lost). Two modes (setting
``async_mode``, or ``mode=`` per call; costs in docs/async.md):

* ``pipelined`` -- the object is pickled before ``async_save`` returns, and
  the background thread streams the tensor bytes straight from the live
  tensors through the pinned ring. No extra memory, but the tensors must not
  change until the save is done. A change is detected (tensor version
  counters are compared after the last byte is read): the save then fails
  with :class:`~fastpersist.errors.TensorModifiedError` and nothing is
  committed. :class:`fastpersist.Checkpointer` makes the wait automatic
  before each ``optimizer.step()``.
* ``snapshot`` -- the storages are first copied into a reusable staging area
  (pinned host memory the size of the checkpoint; device-to-host copies are
  queued on a side stream and the caller's stream waits for them), then
  ``async_save`` returns; the state may change at once. For a
  :class:`fastpersist.Checkpointer` with GPU state and an idle save queue
  (or no staging area free), the save thread queues the copies and the
  optimizer step's hook waits until they are queued.

At most ``async_max_pending`` saves are in flight: a new one first waits for
the oldest. Under a Checkpointer's hooks a pipelined save does not wait: it
is queued at once, and the hook before the next optimizer step waits until
it has read the state (so at most the save being written and the one
waiting to read are in flight, and neither holds a staging area).

Errors are never lost: ``result()``/``wait()`` re-raise them; a
failed save whose error nobody checked is reported by a ``RuntimeWarning`` at
the next ``async_save``, and at interpreter exit (after pending saves have
finished) on stderr, with exit status 1. Saves still pending at exit are
completed before the interpreter shuts down. After ``fork()`` the child gets
a fresh worker (the parent's pending saves finish in the parent).

A third way, for object stores: the **two-tier save**,
``async_save(obj, "s3://bucket/key", local_copy=path)``. The checkpoint is
first saved to the local ``path`` by the ordinary synchronous local save
(atomic, fsync, O_DIRECT) -- at disk speed, before ``async_save`` returns, so
the state may change at once -- and the local file is then uploaded by the
same background queue (the target's ``upload_file``; for S3
:func:`fastpersist.io.targets.s3.files.upload_file`): one
queued job per save, whose future raises the upload's errors, completes at
interpreter exit and behaves after ``fork()`` as every other. The local file
is kept: it is the fast tier a restart may load.
"""

from __future__ import annotations

import inspect
import os
import pickle
import threading
import types
from collections.abc import Iterable
from typing import Any

from fastpersist import config
from fastpersist.api import dispatch, saving
from fastpersist.distributed import save as distributed_save
from fastpersist.errors import TensorModifiedError
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io import device_crc, memory, spares, staging, targets, timeline
from fastpersist.io.commit import releasing, target_kind
from fastpersist.io.queue import (
    SaveFuture,
    has_slot,
    pending_saves,
    queue_idle,
    report_unchecked_as_warnings,
    run_in_order,
    submit,
    wait_all,
    wait_for_slot,
)
from fastpersist.io.writer import side_streams
from fastpersist.tensors import named_tensors

__all__ = [
    "async_save",
    "prepare",
    "SaveFuture",
    "wait_all",
    "release_buffers",
    "pending_saves",
    "run_in_order",
]


def release_buffers() -> int:
    """Frees the memory kept for reuse: idle ring buffers and idle snapshot areas (pinned host memory), and
    the idle CUDA graphs of verified loads' device checksums (their device memory goes back to torch's
    caching allocator); and the replaced files kept for the next save of their path (``reuse_replaced``).

    Memory in use by a pending save is kept (call :func:`wait_all` first to
    free everything). The next save or load allocates again. Returns the bytes freed.
    """
    return memory.release_pooled_buffers() + staging.release_idle_areas() + device_crc.release() + spares.release()


class _RecordingPickler:
    """Makes a pickle module whose Pickler also records every tensor it pickles (and its version)."""

    def __init__(self, pickle_module: Any):
        import torch

        recorded = self.recorded = []
        tensor_type = torch.Tensor

        class Pickler(pickle_module.Pickler):  # type: ignore[misc,name-defined]
            def reducer_override(self, obj):
                if isinstance(obj, tensor_type):
                    try:
                        recorded.append((obj, obj._version))
                    except RuntimeError:
                        pass  # inference tensors have no version counter
                parent = getattr(super(), "reducer_override", None)
                return parent(obj) if parent is not None else NotImplemented

        # ``wraps``: plan_save's plain tensor shortcut applies as it does to the wrapped module.
        self.module = types.SimpleNamespace(Pickler=Pickler, wraps=pickle_module)


def _plan_recording(obj: object, archive: str, pickle_module: Any, protocol: int, recorded: list | None):
    """``plan_save``, filling ``recorded`` (when not None) with ``(tensor, version)`` of every tensor pickled.

    The serializer records the plain tensors of its shortcut at no cost; when some storage of the
    plan is not covered by them (tensor subclasses, a custom pickle module, bare storages), the
    object is pickled again through a pickler that records every tensor.
    """
    if recorded is None:
        return plan_save(obj, archive, pickle_module, protocol)
    plan = plan_save(obj, archive, pickle_module, protocol, tensors=recorded)
    covered = {(t.device, t.untyped_storage().data_ptr()) for t, _ in recorded}
    if all(r.entry.size == 0 or (r.device, r.data_ptr()) in covered for r in plan.storages):
        return plan
    recorder = _RecordingPickler(pickle_module)
    plan = plan_save(obj, archive, recorder.module, protocol)
    recorded[:] = recorder.recorded
    return plan


def _modification(path: str, recorded: list, obj: object = None) -> TensorModifiedError | None:
    """The error to fail a save with when a recorded tensor changed since it was pickled, else None.

    The tensors are named by their key paths in ``obj`` (``optimizer.state.0.exp_avg``), as the divergence
    warning names them; a tensor not found there by its dtype, shape and device.
    """
    modified = [tensor for tensor, version in recorded if tensor._version != version]
    if not modified:
        return None
    paths: dict[int, str] = {}
    if obj is not None:
        wanted = {id(t) for t in modified}
        for name, tensor in named_tensors(obj):
            if id(tensor) in wanted and id(tensor) not in paths:
                paths[id(tensor)] = name
    changed = []
    for tensor in modified:
        described = f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)} on {tensor.device}"
        changed.append(f"{paths[id(tensor)]} ({described})" if id(tensor) in paths else described)
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        return TensorModifiedError(
            f"{len(changed)} tensor(s) changed while the async_save to {path!r} was still reading them "
            f"({shown}); the checkpoint would mix old and new values, so nothing was written and the "
            "previous file is untouched. Wait for the future (or use fastpersist.Checkpointer, which waits "
            "before optimizer.step()) before modifying the state, or pass mode='snapshot'.",
            path=path,
            names=tuple(changed),
        )
    return None


class _Release:
    """The moment a save's tensors may change again, and whether they changed before it.

    A pipelined save reads the live tensors on the background thread; a
    snapshot taken for a :class:`~fastpersist.Checkpointer` copies them on a
    side stream that the caller's stream does not wait for. In both cases the
    tensors are free once their last read is queued: the writer reports it
    (:meth:`reads_queued`, with a CUDA event per side stream) and the
    Checkpointer's hooks, before the optimizer step, call :meth:`release`,
    which makes the calling thread's streams wait for those events. The
    verdict -- did a recorded tensor change before that point, when a copy
    may not have read it yet? -- is taken once: by the first :meth:`release`,
    or at commit (:meth:`decide_at_commit`) when nobody released. A changed
    tensor fails the save with ``TensorModifiedError``; nothing is committed.
    """

    def __init__(self, path: str, recorded: list, obj: object = None):
        self._path = path
        self._recorded = recorded
        self._obj = obj  # to name a modified tensor by its key path (dropped with the tensors)
        self._lock = threading.Lock()
        self._queued = threading.Event()
        self._events: list = []
        self._decided = False
        self._error: TensorModifiedError | None = None

    def reads_queued(self, events: list) -> None:
        """(writer) Every read is queued; ``events``: ``[(device, event)]`` after the last copies."""
        self._events = list(events)
        timeline.mark("reads released")
        self._queued.set()

    def abandon(self) -> None:
        """(writer) The save ended: nothing reads the tensors any more, nothing is left to decide."""
        with self._lock:
            self._decided = True
            self._recorded = []  # the future outlives the save: it must not keep the state alive
            self._obj = None
        self._queued.set()

    def release(self) -> None:
        """(caller, before changing the tensors) Waits until the reads are queued; orders this thread's streams
        after them; decides whether the tensors changed before now."""
        with timeline.waiting("release"):
            self._queued.wait()
        with self._lock:
            if self._decided:
                return
            import torch

            for device, event in self._events:
                torch.cuda.current_stream(device).wait_event(event)
            self._error = _modification(self._path, self._recorded, self._obj)
            self._decided = True

    def decide_at_commit(self) -> None:
        """(writer, every byte written) Raises TensorModifiedError if the tensors changed before the release
        (or, when nobody released, before now)."""
        with self._lock:
            if not self._decided:
                self._error = _modification(self._path, self._recorded, self._obj)
                self._decided = True
            error = self._error
        if error is not None:
            raise error


def async_save(
    obj: object,
    f: str | os.PathLike[str],
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    *,
    mode: str | None = None,
    local_copy: str | os.PathLike[str] | None = None,
    group: Any = None,
    layout: str | None = None,
    writers: str = "all",
    divergence: str = "warn",
    per_rank: Iterable[str] = (),
    timeout: float | None = None,
    **settings: Any,
) -> SaveFuture:
    """Starts saving ``obj`` to the path ``f`` in the background and returns a future.

    The object is pickled before this returns (pickling errors raise here).
    With ``mode="pipelined"`` (the default, setting ``async_mode``) the
    tensors are read by the background thread: do not modify them until the
    future is done (``fastpersist.Checkpointer`` waits before each optimizer
    step). A modification is detected and fails the save with
    ``TensorModifiedError``; nothing is committed. With ``mode="snapshot"``
    the tensors are copied to pinned host memory first and may be modified as
    soon as this returns.

    The commit is atomic as with :func:`fastpersist.save`: until the future
    finishes successfully the previous file at ``f`` is intact.

    **Collective save** (``group=`` a process group of several ranks, called
    by every rank): the asynchronous form of ``fastpersist.save(obj, f,
    group=...)``, with the same file (rank 0's object, never a mix), options
    (``layout``, ``writers``, ``divergence``, ``per_rank``, ``timeout``) and
    guarantees. The ranks agree on the layout and compare their storages
    (two metadata exchanges through the group's store), and each rank
    captures the bytes it will write (in snapshot mode it copies only its
    own share into staging; in pipelined mode its share is read from the
    live tensors). A bare snapshot does all that before it returns, so the
    state may change at once. A pipelined save, or any save under a
    Checkpointer's hooks, only pickles here: the exchanges, the capture and
    the digests' comparison run on the save thread after the saves before
    it (the digests are queued at once, beside them), and the hooks hold the
    state until it is read or copied. Each rank then writes its share in the
    background; rank 0 commits once every share is durable, and every rank's
    future ends with that commit or with the same
    ``DistributedCheckpointError``. Mismatched calls and
    ``divergence="error"`` refusals raise here for a bare snapshot, and at
    ``result()`` otherwise, on every rank; divergence warnings name the
    caller's line either way. A collective save or load made while one is
    pending first waits for it (docs/distributed.md).

    **Two-tier save** (``f`` a URL, ``s3://`` or any fsspec store's, and ``local_copy`` a local path):
    the checkpoint is saved to ``local_copy`` first, synchronously, by the
    ordinary local save (``fastpersist.save``: atomic, fsync, O_DIRECT), in
    the format the URL asks for (``format=`` or a ``.safetensors`` key); then
    this returns, the state may change at once (``mode`` does not apply), and
    the background queue uploads the local file to ``f``
    (:meth:`fastpersist.io.targets.base.Target.upload_file`). The future (mode
    ``"upload"``, ``local_copy`` set) finishes when the object is committed
    and raises the upload's errors; the object then holds exactly the local
    file's bytes. The local file is kept. The upload reads the file this save
    wrote even if a later save replaces it meanwhile. ``async_max_pending``
    bounds the uploads in flight: a new save first waits for the oldest.

    Args:
        obj, f, pickle_module, pickle_protocol: as :func:`fastpersist.save`
            (``f`` must be a path or a URL: ``s3://bucket/key``, ``memory://``...).
        mode: ``"pipelined"`` or ``"snapshot"`` (default: setting ``async_mode``).
        local_copy: (URL targets only) the local file of a two-tier save.
        group, layout, writers, divergence, per_rank, timeout: a collective
            save, as :func:`fastpersist.save` takes them.
        **settings: per-call overrides of ``fastpersist.config`` settings.

    Raises:
        UnsupportedObjectError, IsADirectoryError, FileNotFoundError,
        PermissionError, TypeError, ConfigError: at once, as :func:`save`.
        MemoryError: (snapshot) the staging area cannot be allocated.
        ValueError: (a URL) at once: a malformed URL; ``local_copy`` with
            a target that is not a URL, a ``local_copy`` that is a
            URL or a special file, or ``atomic=False``.
        OSError: (``local_copy``) at once: what the local save raises; nothing
            is uploaded then and the previous object is intact.
        ObjectStoreError and its subclasses: (a URL) at ``result()``, as
            :func:`fastpersist.save` raises them; ObjectStoreUnavailableError
            (boto3 missing) at ``result()`` too. A failed upload of a two-tier
            save leaves the previous object intact and the local file in place.
        DistributedCheckpointError: (``group=``) on every rank, here or at
            ``result()``, as :func:`fastpersist.save` raises it.
    """
    return _start(
        obj,
        f,
        pickle_module,
        pickle_protocol,
        mode,
        local_copy,
        group,
        settings,
        released_by_hooks=False,
        collective=dict(layout=layout, writers=writers, divergence=divergence, per_rank=per_rank, timeout=timeout),
    )


def hooked_async_save(obj: object, f: str | os.PathLike[str], *, mode: str | None, **options: Any) -> SaveFuture:
    """``async_save`` for :class:`fastpersist.Checkpointer`, whose optimizer-step hooks release the state.

    The snapshot copies may then overlap the caller's next forward pass: the
    hook (:meth:`~fastpersist.io.queue.SaveFuture.release_reads`) orders the
    step after them, and a change before the release is detected. ``options``
    are ``async_save``'s keywords, with its defaults (bound against its signature).
    """
    bound = inspect.signature(async_save).bind(obj, f, mode=mode, **options)
    bound.apply_defaults()
    given = bound.arguments
    return _start(
        obj,
        f,
        given["pickle_module"],
        given["pickle_protocol"],
        mode,
        given["local_copy"],
        given["group"],
        given["settings"],
        released_by_hooks=True,
        collective={name: given[name] for name in ("layout", "writers", "divergence", "per_rank", "timeout")},
    )


def _start(
    obj: object,
    f: Any,
    pickle_module: Any,
    pickle_protocol: int,
    mode: str | None,
    local_copy: Any,
    group: Any,
    settings: dict[str, Any],
    *,
    released_by_hooks: bool,
    collective: dict[str, Any],
) -> SaveFuture:
    """Where an ``async_save`` goes: a collective save, a two-tier upload, a safetensors file or a local save."""
    destination = targets.resolve(f)  # the one decision of where the bytes go (fastpersist.io.targets)
    if distributed_save.is_collective(group):
        if local_copy is not None:
            raise ValueError("local_copy= (a two-tier save) cannot be combined with group= (a collective save)")
        chosen = distributed_save.options(
            destination, pickle_module=pickle_module, pickle_protocol=pickle_protocol, **collective
        )
        return _collective_async_save(obj, f, destination, group, chosen, mode, settings, released_by_hooks)
    if local_copy is not None:
        return _save_through_local_copy(obj, f, destination, local_copy, pickle_module, pickle_protocol, settings)
    if dispatch.wants_safetensors(f, settings.pop("format", None)):
        return dispatch.async_save_safetensors(obj, destination, settings)
    return _local_async_save(obj, f, destination, pickle_module, pickle_protocol, mode, settings, released_by_hooks)


def _local_async_save(
    obj: object,
    f: Any,
    destination: targets.Target,
    pickle_module: Any,
    pickle_protocol: int,
    mode: str | None,
    settings: dict[str, Any],
    released_by_hooks: bool,
) -> SaveFuture:
    """``async_save`` to a local path: pickled here, the copies (snapshot) or reads (pipelined) and the commit on
    the save thread."""
    resolved = _begin(f, mode, settings)
    destination = destination.checked()
    path = destination.path
    pipelined = resolved.async_mode == "pipelined"
    # Versions are recorded when someone must decide whether the tensors changed during the reads.
    recorded: list | None = [] if pipelined or released_by_hooks else None
    plan = _plan_recording(obj, archive_name_for(destination.given), pickle_module, pickle_protocol, recorded)
    timeline.mark("pickled")
    # A local commit lands in the directory that is there now, even if it is renamed or deleted meanwhile
    # (an error path below closes the anchor when the target is dropped).
    destination = destination.anchored()
    future = SaveFuture(path, resolved.async_mode)
    idle = queue_idle()
    on_save_thread = _state_on_save_thread(plan, pipelined, released_by_hooks, idle, resolved.async_max_pending)
    if not on_save_thread:
        wait_for_slot(resolved.async_max_pending)  # at most async_max_pending staging areas (or uploads) exist
    timeline.mark("slot")
    if not pipelined:
        if on_save_thread:
            # The save thread queues the device-to-host copies itself, on side streams ordered here. With the
            # queue idle the staging area is leased here (an allocation error is the caller's, as for every
            # snapshot); behind a pending save, by the save thread once that save has given its area back.
            snapshot = None
            streams = side_streams(plan)
            leased = staging.lease(plan) if idle else None
            release = _Release(path, recorded, obj)
        else:
            leased = streams = None
            snapshot = staging.snapshot_plan(plan, caller_waits=not released_by_hooks)
            release = _Release(path, recorded, obj) if released_by_hooks and snapshot.events else None
            if release is not None:
                release.reads_queued(snapshot.events)

        def work() -> None:
            nonlocal plan, snapshot, leased, streams
            taken = snapshot
            try:
                if taken is None:
                    taken = staging.snapshot_plan(plan, caller_waits=False, leased=leased, streams=streams)
                    release.reads_queued(taken.events)
                taken.wait_copies()
                destination.commit_plan(
                    taken.plan,
                    resolved,
                    streams={},
                    before_commit=None if release is None else release.decide_at_commit,
                )
            finally:
                if taken is not None:
                    taken.release()
                elif leased is not None:
                    leased.release()
                if release is not None:
                    release.abandon()
                # The future outlives the save, and a failure's traceback holds this frame's function:
                # its closure must not keep the state (a model's GPU memory) alive.
                plan = snapshot = taken = leased = streams = None

    else:
        # The copies must come after the work queued so far on the caller's streams,
        # which the background thread cannot see: order them here.
        streams = side_streams(plan)
        release = _Release(path, recorded, obj)

        def work() -> None:
            nonlocal plan, streams
            try:
                destination.commit_plan(
                    plan,
                    resolved,
                    streams,
                    before_commit=release.decide_at_commit,
                    after_reads=release.reads_queued,
                )
            finally:
                release.abandon()
                plan = streams = None  # as above: nothing the future keeps may hold the state

    submit(future.set_work(releasing(work, destination), release))
    timeline.mark("queued")
    return future


def _state_on_save_thread(plan, pipelined: bool, released_by_hooks: bool, idle: bool, max_pending: int) -> bool:
    """Whether a local ``async_save`` leaves the reads or copies to the save thread, when it gets to the save.

    Only for a Checkpointer, whose hooks order the optimizer step after them:
    the hook before the next step then waits (beside the forward pass) rather
    than the call. Always for pipelined reads; for snapshot copies when the
    queue is idle (they start at once) or when the call would wait for a
    staging area anyway. A snapshot behind a pending save with a staging area
    free is copied in the call, so the step does not wait for that write. CPU
    storages are always copied in the call: nothing orders their changes.
    """
    if not released_by_hooks:
        return False
    if pipelined:
        return True
    devices = plan.devices()
    cuda_only = bool(devices) and all(d.type == "cuda" for d in devices)
    return cuda_only and (idle or not has_slot(max_pending))


def _begin(f: Any, mode: str | None, settings: dict[str, Any]) -> config.Settings:
    """The settings of an ``async_save`` to the path ``f`` (``mode`` among them); reports unchecked failures.

    Raises:
        TypeError: ``f`` is not a path, or an unknown keyword. ConfigError: an invalid setting.
    """
    if mode is not None:
        settings["async_mode"] = mode
    overrides, _ = config.split_overrides("async_save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"async_save needs a file path, got {type(f).__name__}; use save() for file objects")
    report_unchecked_as_warnings()
    timeline.mark("call")
    return resolved


def _collective_async_save(
    obj: object,
    f: Any,
    destination: targets.Target,
    group: Any,
    chosen: Any,
    mode: str | None,
    settings: dict[str, Any],
    released_by_hooks: bool,
) -> SaveFuture:
    """``async_save`` with ``group=``: pickled here; the rest here or on the save thread.

    See :mod:`fastpersist.distributed.save` for the phases. A pipelined save,
    or any save a Checkpointer's hooks release, exchanges its plan, verifies
    and reads or copies the state on the save thread, after the saves before
    it: the caller only pickles, and the next optimizer step waits (in the
    hook) until the state is read. A bare snapshot does all that here, so the
    state may change as soon as the call returns. Either way the exchanges go
    through the group's store: no collective of the group's backend runs on
    the save thread.
    """
    if dispatch.wants_safetensors(f, settings.pop("format", None)):
        raise distributed_save.safetensors_refused(f)
    resolved = _begin(f, mode, settings)
    pipelined = resolved.async_mode == "pipelined"
    recorded: list | None = [] if pipelined or released_by_hooks else None
    module, protocol = chosen.pickle_module, chosen.pickle_protocol
    operation = distributed_save.CollectiveSave(
        obj,
        destination,
        None if group is True else group,
        chosen,
        resolved,
        planner=lambda o, archive: _plan_recording(o, archive, module, protocol, recorded),
    )
    try:
        operation.plan_locally()
    except BaseException as error:
        operation.abort(error)
        raise
    timeline.mark("pickled")
    path = os.fspath(f)
    future = SaveFuture(path, resolved.async_mode)
    future.collective = True
    operation.in_background = True
    release = None
    if pipelined or released_by_hooks:
        try:
            # Ordered here after the work queued so far on the caller's streams, which the save thread cannot see.
            streams = side_streams(operation.local_plan())
            operation.start_digests(streams)
            release = _Release(path, recorded, obj)
            if not released_by_hooks:
                wait_for_slot(resolved.async_max_pending)  # the hooks bound a Checkpointer's saves instead
        except BaseException as error:
            operation.abort(error)
            operation.fail(error, "plan")  # the others wait in the plan step (on their save threads): they raise too
            raise
        work = _collective_work(operation, future, release, streams, pipelined)
    else:
        work = _collective_work(operation, future, None, None, False, _capture_here(operation, resolved))
    future.set_work(work, release)
    submit(future)
    timeline.mark("queued")
    return future


def _capture_here(operation, resolved: config.Settings):
    """A bare collective snapshot's plan exchange, verify and copies, in the caller; returns the copies."""
    try:
        operation.exchange_plan()
        wait_for_slot(resolved.async_max_pending)  # at most async_max_pending staging areas exist
        timeline.mark("slot")
        operation.verify()  # before the capture: each rank then knows exactly which bytes it writes
    except BaseException as error:
        operation.abort(error)
        raise
    timeline.mark("verified")
    try:
        plan, pieces = operation.share()
        return staging.snapshot_plan(plan.cropped([(p.start, p.end) for p in pieces]), caller_waits=True)
    except BaseException as error:
        operation.abort(error)
        operation.fail(error)  # the others wait in the write step: they raise too (and so does this)
        raise


def _collective_work(operation, future: SaveFuture, release, streams, pipelined: bool, taken=None):
    """The save thread's part of a collective ``async_save``: what the caller left, then write and commit."""

    def work() -> None:
        nonlocal operation, taken, streams, release
        try:
            if operation.pieces is None:  # plan, verify and capture here
                operation.exchange_plan()
                operation.verify(streams)
                plan, pieces = operation.share()
                if not pipelined:
                    taken = staging.snapshot_plan(
                        plan.cropped([(p.start, p.end) for p in pieces]), caller_waits=False, streams=streams
                    )
                    release.reads_queued(taken.events)
            if taken is not None:
                taken.wait_copies()
            timeline.mark("opened")
            operation.write(
                None if taken is None else taken.plan,
                streams=streams,
                after_reads=release.reads_queued if pipelined else None,
                before_report=None if release is None else release.decide_at_commit,
            )
            operation.commit()
            timeline.mark("committed")
            future.stats = operation.stats()
        except BaseException as error:
            operation.abort(error)
            raise
        finally:
            if taken is not None:
                taken.release()
            if release is not None:
                release.abandon()
            # The future outlives the save: nothing it keeps may hold the state (as in async_save).
            operation = taken = streams = release = None

    return work


def prepare(obj: object, *, mode: str | None = None, **settings: Any) -> int:
    """Allocates and pins now the host memory an ``async_save(obj, ...)`` will use; returns its bytes.

    The first save of a process otherwise allocates it on the spot: the ring of
    page-locked buffers (up to ``buffer_size * buffer_count``) and, in snapshot
    mode, the staging area the size of the checkpoint -- about
    0.5 s per GiB to lock and register with CUDA on the lent GPU machines. The
    memory goes to the pools that saves reuse (``release_buffers()`` frees it).
    ``obj`` is pickled to size it and not kept.

    Raises:
        MemoryError / OSError: the memory cannot be allocated.
        UnsupportedObjectError, ConfigError: as :func:`async_save`.
    """
    if mode is not None:
        settings["async_mode"] = mode
    overrides, _ = config.split_overrides("async_save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    plan = plan_save(obj, "prepare")
    # A snapshot is written through the ring as well.
    staged = staging.reserve(plan) if resolved.async_mode == "snapshot" else 0
    return staged + memory.reserve_ring(plan.size, resolved.buffer_size, resolved.buffer_count, resolved.huge_pages)


def _save_through_local_copy(
    obj: object,
    url: Any,
    destination: targets.Target,
    local_copy: Any,
    pickle_module: Any,
    pickle_protocol: int,
    settings: dict[str, Any],
) -> SaveFuture:
    """The two-tier save of :func:`async_save`: the local save here and now, the upload as one queued job."""
    if not destination.remote:
        raise ValueError(
            f"local_copy= is for saves to an object store (a URL target), got {url!r}; "
            "to save to a local file, pass that path as the target"
        )
    if not isinstance(local_copy, (str, os.PathLike)):
        raise TypeError(f"local_copy must be a local path, got {type(local_copy).__name__}")
    if targets.is_url(local_copy):
        raise ValueError(f"local_copy must be a local path (the fast tier), got the URL {local_copy!r}")
    destination = destination.checked()
    local = os.fspath(local_copy)
    settings = dict(settings)
    chosen = "safetensors" if dispatch.wants_safetensors(url, settings.pop("format", None)) else "torch"
    overrides, _ = config.split_overrides("async_save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if not resolved.atomic:
        raise ValueError(
            "local_copy needs atomic local saves (atomic=True): the upload reads the file while a later save "
            "may replace it, which only a rename (not an overwrite in place) leaves harmless"
        )
    if target_kind(local) == "special":
        raise ValueError(f"local_copy must be a regular file (it is uploaded afterwards), got {local!r}")
    report_unchecked_as_warnings()
    wait_for_slot(resolved.async_max_pending)  # bounds the uploads in flight (and the old files they hold open)
    saving.save(obj, local, pickle_module, pickle_protocol, format=chosen, **settings)
    source = open(local, "rb", buffering=0)  # the file this save wrote, whatever replaces its name later
    try:
        future = SaveFuture(destination.path, "upload")
        future.local_copy = local

        def work() -> None:
            try:
                destination.upload_file(source, resolved)
            finally:
                source.close()

        future.set_work(work)
    except BaseException:
        source.close()
        raise
    return submit(future)
