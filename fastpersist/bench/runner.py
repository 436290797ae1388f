"""Runs benchmark methods round by round, times them, and verifies every result byte for byte.

:func:`run_benchmark` is the whole job: it knows the method interfaces of
:mod:`fastpersist.bench.methods.base`, never a particular method.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from fastpersist import system
from fastpersist.bench import measure
from fastpersist.bench.methods import SAVE_METHODS, BenchContext, LoadMethod, SaveMethod
from fastpersist.tuning import workloads

__all__ = ["MethodResult", "run_benchmark"]


@dataclasses.dataclass
class MethodResult:
    """Everything measured for one method. ``status``: ok, FAILED (verification or error) or skipped."""

    op: str
    name: str
    label: str
    status: str = "ok"
    reason: str | None = None
    timed: bool = True
    file_bytes: int | None = None
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def fail(self, reason: str) -> None:
        self.status = "FAILED"
        self.reason = reason

    def as_dict(self, state_bytes: int) -> dict[str, Any]:
        timed = [s for s in self.samples if not s.get("warmup")]
        ok = self.status == "ok"
        return {
            "op": self.op,
            "method": self.name,
            "label": self.label,
            "status": self.status,
            "reason": self.reason,
            "timed": self.timed,
            "bytes": state_bytes,
            "file_bytes": self.file_bytes,
            "samples": self.samples,
            "summary": {
                "gbps": measure.summarize([s["gbps"] for s in timed]) if ok else None,
                "seconds": measure.summarize([s["seconds"] for s in timed]) if ok else None,
                "blocked_seconds": measure.summarize([s.get("blocked_seconds") for s in timed]) if ok else None,
                "peak_rss_bytes": measure.summarize([s["peak_rss_bytes"] for s in timed]) if ok else None,
                "rss_delta_bytes": measure.summarize([s["rss_delta_bytes"] for s in timed]) if ok else None,
            },
        }


def _shuffled(items: Sequence[Any], rng: random.Random) -> list[Any]:
    order = list(items)
    rng.shuffle(order)
    return order


def _path_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in system.files_under(path))


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 300 else text[:297] + "..."


def run_benchmark(
    state: Any,
    save_methods: Sequence[SaveMethod],
    load_methods: Sequence[LoadMethod],
    directory: str,
    *,
    ctx: BenchContext | None = None,
    repeats: int = 3,
    warmup: int = 1,
    dropper: system.CacheDropper | None = None,
    progress: Callable[[str], None] | None = None,
    state_bytes: int | None = None,
    order_seed: int = 0,
    schedule: list[dict[str, Any]] | None = None,
    settle_seconds: float = 0.0,
    load_repeats: int = 1,
    memory_settle_seconds: float = 0.0,
) -> list[MethodResult]:
    """Runs every method ``warmup + repeats`` times, interleaved, and verifies each result.

    Every round runs the saves in a fresh random order, then the loads (each
    after dropping the page cache) in a fresh random order, then deletes the
    round's files: no method always follows another, so a disk that drifts
    over the run hurts all methods alike. The orders come from
    ``random.Random(order_seed)`` (the same on every rank) and are appended to
    ``schedule`` (``{"round", "warmup", "save", "load"}`` per round) when given. A save is timed
    from the call to the end of :func:`measure.fsync_paths` of what it wrote;
    a load from the call until the state is complete on the device. Each saved
    file is read back and each loaded state compared with the original
    (untimed); the first difference or exception marks the method FAILED and
    stops running it (and the loads that read its files).

    Load methods whose ``source`` is not among ``save_methods`` get that save
    run untimed each round to produce their input.

    Between a round's saves and its loads everything is synced and then
    ``settle_seconds`` pass (the first load's memory pause, below, counts
    towards them): some (virtual) disks read a file slowly for a while after
    it was written, which would penalise the load of whichever file was saved
    last. Each load's sample records its file's age (``file_age_seconds``:
    from the end of its save to the start of the load).

    ``load_repeats``: cold loads of each load method per timed round, all of
    the round's loads in one random order (warm-up rounds load once).

    ``memory_settle_seconds``: before each timed load, memory is released
    (garbage collected, heap trimmed), the page cache dropped, and then this
    many seconds pass. A virtual machine that reports free memory to its
    host (:func:`fastpersist.system.free_page_reporting`) hands freed 2 MiB
    blocks back about two seconds after they are freed; until then a load
    that takes such blocks (huge pages, the page cache's large folios) finds
    them backed and fast, afterwards it waits for the host to supply them
    again. Without the pause a load's speed depends on what the method before
    it freed (the page cache of the file it read, its state); with it every
    load starts on memory the host has taken back, as a freshly started
    process does. Each load sample records the pause
    (``memory_settle_seconds``); warm-up loads, which are not reported, do
    not pause.

    Returns:
        One :class:`MethodResult` per method: the saves in the given order,
        then the untimed helper saves, then the loads.
    """
    ctx = ctx or BenchContext()
    dropper = dropper or system.CacheDropper()
    progress = progress or (lambda _text: None)
    if state_bytes is None:
        state_bytes = workloads.state_nbytes(state)
    expected = workloads.flatten_state(state)

    results: dict[tuple[str, str], MethodResult] = {}
    saves = list(save_methods)
    for m in saves:
        results[("save", m.name)] = MethodResult("save", m.name, m.label)
    for m in load_methods:
        if ("save", m.source) not in results:
            if m.source not in SAVE_METHODS:
                raise KeyError(f"load method {m.name!r} reads files of unknown save method {m.source!r}")
            helper = SAVE_METHODS[m.source]
            saves.append(helper)
            results[("save", helper.name)] = MethodResult("save", helper.name, helper.label, timed=False)
    for m in load_methods:
        results[("load", m.name)] = MethodResult("load", m.name, m.label)
    for m in list(saves) + list(load_methods):
        op = "save" if isinstance(m, SaveMethod) else "load"
        reason = m.unavailable(ctx)
        if reason:
            results[(op, m.name)].status = "skipped"
            results[(op, m.name)].reason = reason

    if load_repeats < 1:
        raise ValueError(f"load_repeats must be at least 1, got {load_repeats}")
    if memory_settle_seconds < 0:
        raise ValueError(f"memory_settle_seconds must be at least 0, got {memory_settle_seconds}")
    rounds = warmup + repeats
    rng = random.Random(order_seed)
    for round_index in range(rounds):
        is_warmup = round_index < warmup
        save_order = _shuffled(saves, rng)
        load_order = _shuffled(list(load_methods) * (1 if is_warmup else load_repeats), rng)
        if schedule is not None:
            schedule.append(
                {
                    "round": round_index,
                    "warmup": is_warmup,
                    "save": [m.name for m in save_order],
                    "load": [m.name for m in load_order],
                }
            )
        written: dict[str, str] = {}  # save method -> its verified output, for the loads
        written_at: dict[str, float] = {}  # save method -> when its save ended (perf_counter)
        created: dict[str, str] = {}  # everything to delete at the end of the round
        try:
            if not is_warmup and memory_settle_seconds:
                # The last round's files were deleted: their page cache is free memory the host still backs.
                system.release_memory()
                time.sleep(memory_settle_seconds)
            for method in save_order:
                result = results[("save", method.name)]
                if result.status != "ok":
                    continue
                progress(f"round {round_index + 1}/{rounds}: save {method.name}")
                path = method.target(directory, ctx)
                measure.remove_path(path)
                created[method.name] = path
                sample = _measure_save(method, state, path, ctx, result)
                if sample is None:
                    continue
                result.file_bytes = _path_bytes(path)
                try:
                    loaded = method.read_back(path, state, ctx)
                    problem = measure.verify_state(expected, method.flat(loaded), ctx.device)
                    del loaded
                except Exception as e:  # noqa: BLE001 - a failed read-back marks the method FAILED
                    problem = f"reading the file back failed: {_short_error(e)}"
                if problem:
                    result.fail(f"verification failed: {problem}")
                    continue
                written[method.name] = path
                written_at[method.name] = sample.pop("ended")
                sample.update(round=round_index, warmup=is_warmup, gbps=state_bytes / sample["seconds"] / 1e9)
                result.samples.append(sample)
            pause = 0.0 if is_warmup else memory_settle_seconds
            if load_order and written:
                os.sync()
                time.sleep(max(0.0, settle_seconds - pause))  # the first load's pause completes the settle
            for method in load_order:
                result = results[("load", method.name)]
                if result.status != "ok":
                    continue
                source = results[("save", method.source)]
                if method.source not in written:
                    result.status = "skipped"
                    result.reason = (
                        f"its input ({method.source}) was not written: {source.status} {source.reason or ''}".strip()
                    )
                    continue
                progress(f"round {round_index + 1}/{rounds}: load {method.name}")
                path = written[method.source]
                system.release_memory()  # before the drop and the pause: what is freed now settles too
                cache = dropper.drop([path])
                time.sleep(pause)
                ctx.dist.barrier()
                age = time.perf_counter() - written_at[method.source]
                sample, loaded = _measure_load(method, state, path, ctx, result)
                if sample is None:
                    continue
                sample["file_age_seconds"] = age
                sample["memory_settle_seconds"] = pause
                try:
                    problem = measure.verify_state(expected, method.flat(loaded), ctx.device)
                except Exception as e:  # noqa: BLE001 - a failed comparison marks the method FAILED
                    problem = f"comparing the loaded state failed: {_short_error(e)}"
                del loaded
                if problem:
                    result.fail(f"verification failed: {problem}")
                    continue
                sample.update(
                    round=round_index, warmup=is_warmup, cache=cache, gbps=state_bytes / sample["seconds"] / 1e9
                )
                result.samples.append(sample)
        finally:
            by_name = {m.name: m for m in saves}
            for name, path in created.items():
                by_name[name].cleanup(path)
            if created:
                os.sync()
    return list(results.values())


def _record_failure(result: MethodResult, op: str, error: BaseException) -> None:
    result.fail(f"{op} raised {_short_error(error)}")
    if os.environ.get("FASTPERSIST_BENCH_TRACEBACK"):
        traceback.print_exc()


def _measure_save(
    method: SaveMethod, state: Any, path: str, ctx: BenchContext, result: MethodResult
) -> dict[str, Any] | None:
    system.release_memory()
    ctx.synchronize()
    ctx.dist.barrier()
    try:
        with measure.PeakMemory() as memory:
            start = time.perf_counter()
            extra = method.save(state, path, ctx) or {}
            ctx.synchronize()
            measure.fsync_paths(path)
            ended = time.perf_counter()
            seconds = ended - start
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a method's failure is recorded, the run goes on
        _record_failure(result, "save", e)
        return None
    return {
        "ended": ended,
        "seconds": seconds,
        "blocked_seconds": extra.get("blocked_seconds"),
        "peak_rss_bytes": memory.peak,
        "baseline_rss_bytes": memory.baseline,
        "rss_delta_bytes": memory.delta,
        "memory_source": memory.source,
    }


def _measure_load(
    method: LoadMethod, state: Any, path: str, ctx: BenchContext, result: MethodResult
) -> tuple[dict[str, Any] | None, Any]:
    # The caller released memory before dropping the cache and pausing (run_benchmark).
    ctx.synchronize()
    try:
        with measure.PeakMemory() as memory:
            start = time.perf_counter()
            loaded = method.load(path, state, ctx)
            if ctx.device.type == "cpu":
                measure.touch_pages(method.flat(loaded)[0])
            ctx.synchronize()
            seconds = time.perf_counter() - start
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a method's failure is recorded, the run goes on
        _record_failure(result, "load", e)
        return None, None
    sample = {
        "seconds": seconds,
        "peak_rss_bytes": memory.peak,
        "baseline_rss_bytes": memory.baseline,
        "rss_delta_bytes": memory.delta,
        "memory_source": memory.source,
    }
    return sample, loaded
