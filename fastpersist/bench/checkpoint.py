"""``python -m fastpersist.bench checkpoint``: save and load a real-shaped checkpoint every way.

Every save is timed to durable (fsync of the files and their directory), every load cold (page cache dropped
first), and every file and loaded state is compared byte for byte with the original before its method is
reported. See docs/checkpoint-benchmark.md; the methods are in :mod:`fastpersist.bench.methods`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastpersist import config, display, system
from fastpersist.bench import measure, report
from fastpersist.bench.harness import Benchmark, Rounds, UsageError, option
from fastpersist.bench.methods import LOAD_METHODS, SAVE_METHODS, BenchContext, LoadMethod, SaveMethod
from fastpersist.tuning import workloads

SCHEMA = "fastpersist.bench.checkpoint/1"
_SETTLE_DEFAULT = 5.0
_MEMORY_SETTLE_DEFAULT = 2.5
BASELINES = {"save": "torch.save", "load": "torch.load"}


def _options(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    what = parser.add_argument_group("what to save")
    what.add_argument("--model", default=workloads.DEFAULT_MODEL, help="model whose shapes to use (see --list-models)")
    what.add_argument("--layers", type=int, default=None, help="keep only the first N transformer blocks")
    option(what, "size", type=str, default=None, help="keep as many blocks as fit in this size; overrides --layers")
    what.add_argument("--dtype", choices=sorted(workloads.DTYPES), default="bf16", help="parameter dtype")
    option(what, "device")
    what.add_argument("--training-state", action="store_true", help="+ Adam moments, fp32 master weights, step, RNG")
    what.add_argument("--seed", type=int, default=0, help="random seed of the synthetic data")

    how = parser.add_argument_group("how to measure")
    how.add_argument("--methods", default=None, help="comma-separated methods (default: the default ones)")
    how.add_argument("--skip", default="", help="comma-separated methods to leave out")
    option(how, "repeats")
    how.add_argument("--load-repeats", type=int, default=1, help="cold loads of each load method per timed round")
    how.add_argument("--warmup", type=int, default=1, help="untimed rounds first (still verified)")
    option(how, "dir", help="a temporary subdirectory is made there (default: the current directory)")
    option(how, "no_drop_caches")
    settle = f"seconds between a round's saves and its loads (default: {_SETTLE_DEFAULT:g} s, 0 on tmpfs)"
    how.add_argument("--settle", type=float, default=None, help=settle)
    settle = "seconds before each timed load, for freed memory to go back to the host (default: "
    settle += f"{_MEMORY_SETTLE_DEFAULT:g} s on a virtual machine with free page reporting, else 0)"
    how.add_argument("--memory-settle", type=float, default=None, help=settle)
    how.add_argument("--order-seed", type=int, default=0, help="seed of every round's random method order")
    how.add_argument("--no-ceiling", action="store_true", help="do not measure the storage ceiling")
    how.add_argument("--no-fio", action="store_true", help="leave fio out of the ceiling")
    how.add_argument("--ceiling-grid-size", default="256M", help="file size of each point of the ceiling's grid")
    threads = max(1, min(8, os.cpu_count() or 1))
    how.add_argument("--dcp-threads", type=int, default=threads, help="DCP FileSystemWriter threads")
    setting = "a fastpersist setting (repeatable)"
    how.add_argument("--fp-setting", action="append", default=[], metavar="NAME=VALUE", help=setting)
    how.add_argument("--config", default=None, help="a fastpersist configuration file ('fastpersist tune')")

    out = parser.add_argument_group("output")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    out.add_argument("--list-models", action="store_true", help="list the model catalogue and exit")
    out.add_argument("--list-methods", action="store_true", help="list the methods and exit")


def _print_models() -> None:
    rows = []
    for name, spec in workloads.CATALOGUE.items():
        layers = spec.default_layers if spec.default_layers is not None else spec.num_layers
        params = workloads.parameter_count(spec, layers)
        size = workloads.format_bytes(params * 2)
        rows.append((name, f"{layers}/{spec.num_layers}", f"{params / 1e6:,.1f} M", size, spec.description))
    print(display.format_table(("model", "layers", "params", "bf16", "description"), rows, "<>>><", rule=False))


def _print_methods(ctx: BenchContext) -> None:
    for op, registry in (("save", SAVE_METHODS), ("load", LOAD_METHODS)):
        for name, m in registry.items():
            reason = m.unavailable(ctx)
            extra = f" (reads {m.source}'s files)" if op == "load" else ""
            state = f"unavailable: {reason}" if reason else "available"
            print(f"{op}  {name:<28} {'default' if m.default else 'optional':<8} {m.label}{extra}; {state}")


def _select_methods(args: argparse.Namespace) -> tuple[list[SaveMethod], list[LoadMethod]]:
    known = list(SAVE_METHODS) + list(LOAD_METHODS)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.methods:
        wanted = [s.strip() for s in args.methods.split(",") if s.strip()]
        if unknown := [w for w in wanted if w not in known]:
            raise UsageError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(known)}")
    else:
        wanted = [n for n, m in [*SAVE_METHODS.items(), *LOAD_METHODS.items()] if m.default]
    if skip - set(known):
        raise UsageError(f"unknown method(s) in --skip: {', '.join(sorted(skip - set(known)))}")
    saves = [SAVE_METHODS[n] for n in wanted if n in SAVE_METHODS and n not in skip]
    return saves, [LOAD_METHODS[n] for n in wanted if n in LOAD_METHODS and n not in skip]


def _fastpersist_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``--fp-setting`` items, validated, and ``--config`` loaded; a bad one is a usage error."""
    values: dict[str, Any] = {}
    for item in args.fp_setting:
        key, equals, value = item.partition("=")
        if not equals:
            raise UsageError(f"--fp-setting takes NAME=VALUE, got {item!r}")
        values[key.strip()] = value.strip()
    try:
        if values:
            config.settings().replace(**values)  # validates names and values (raises ConfigError)
    except Exception as e:  # ConfigError, ValueError...: reported as a usage error
        raise UsageError(str(e)) from e
    if args.config:
        try:
            config.load_file(args.config)
        except Exception as e:  # any unreadable file is a usage error here
            raise UsageError(f"--config: {e}") from e
    return values


def _measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """A run: under torchrun (WORLD_SIZE > 1) in a gloo group for the barriers between timed operations.
    SystemExit: 130 when interrupted; on ranks other than 0 their status (they print nothing)."""
    if args.list_models:
        _print_models()
        return None
    dist = measure.DistributedEnv()
    group = dist.world_size > 1 and torch.distributed.is_available() and not torch.distributed.is_initialized()
    if group:
        torch.distributed.init_process_group("gloo")
    try:
        return _main(args, dist)
    finally:
        if group:
            torch.distributed.destroy_process_group()


def _device(args: argparse.Namespace, dist: measure.DistributedEnv) -> torch.device:
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise UsageError(f"--device: {e}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available to this torch build")
        if device.index is None:
            device = torch.device("cuda", dist.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise UsageError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.repeats < 1 or args.load_repeats < 1 or args.warmup < 0:
        raise UsageError("--repeats and --load-repeats must be at least 1 and --warmup at least 0")
    if args.memory_settle is not None and args.memory_settle < 0:
        raise UsageError("--memory-settle must be at least 0")
    return device


def _layers(args: argparse.Namespace) -> tuple[workloads.ModelSpec, int, int]:
    """The model, its blocks kept (``--layers``, ``--size``) and the state's bytes."""
    try:
        spec = workloads.get_model(args.model)
        dtype = workloads.DTYPES[args.dtype]
        layers = args.layers
        if args.size:
            layers = workloads.layers_for_size(spec, config.parse_size(args.size), dtype, args.training_state)
        if layers is None:
            layers = spec.default_layers if spec.default_layers is not None else spec.num_layers
        return spec, layers, workloads.state_bytes(spec, dtype, layers, args.training_state)
    except (KeyError, ValueError) as e:
        raise UsageError(str(e.args[0] if isinstance(e, KeyError) else e)) from e


def _main(args: argparse.Namespace, dist: measure.DistributedEnv) -> dict[str, Any] | None:
    device = _device(args, dist)
    overrides = _fastpersist_settings(args)
    ctx = BenchContext(device=device, dist=dist, dcp_threads=args.dcp_threads, fastpersist_overrides=overrides)
    if args.list_methods:
        _print_methods(ctx)
        return None
    saves, loads = _select_methods(args)
    if not saves and not loads:
        raise UsageError("no methods left to run")
    spec, layers, expected_bytes = _layers(args)
    parent = os.path.abspath(args.dir or os.getcwd())
    if not os.path.isdir(parent):
        raise UsageError(f"--dir {parent} is not a directory")
    fs = system.filesystem_of(parent)
    outputs = len(saves) + sum(1 for m in loads if m.source not in {s.name for s in saves})
    need = int(expected_bytes * 1.05) * max(outputs, 1) * dist.world_size
    if fs.get("free_bytes") is not None and fs["free_bytes"] < need:
        raise UsageError(
            f"{parent} has {workloads.format_bytes(fs['free_bytes'])} free; this run keeps one copy per "
            f"save method at a time, about {workloads.format_bytes(need)}. Use --dir elsewhere, fewer --methods, "
            "or a smaller --size."
        )
    available = system.available_memory()
    if available is not None and device.type == "cpu" and expected_bytes * 3 > available and dist.is_main:
        print(
            f"warning: the state ({workloads.format_bytes(expected_bytes)}) plus a loaded copy and a verification "
            f"copy may not fit in the {workloads.format_bytes(available)} of memory available",
            file=sys.stderr,
        )
    if args.settle is None:  # the defaults resolved for this directory and machine
        args.settle = 0.0 if fs.get("type") == "tmpfs" else _SETTLE_DEFAULT
    if args.memory_settle is None:
        args.memory_settle = _MEMORY_SETTLE_DEFAULT if system.free_page_reporting() else 0.0
    code = measure.code_version()  # now: the code that runs, whatever is edited meanwhile
    try:
        with (
            measure.sigterm_as_interrupt(),
            tempfile.TemporaryDirectory(prefix=".fastpersist-bench-", dir=parent, ignore_cleanup_errors=True) as work,
        ):
            document = _run(args, ctx, spec, layers, saves, loads, parent, work)
    except KeyboardInterrupt:
        print("\ninterrupted; temporary files removed, nothing reported", file=sys.stderr)
        raise SystemExit(130) from None
    document["machine"]["code"] = code
    if not dist.is_main:
        raise SystemExit(_status(document))
    return document


def _run(
    args: argparse.Namespace,
    ctx: BenchContext,
    spec: workloads.ModelSpec,
    layers: int,
    saves: list[SaveMethod],
    loads: list[LoadMethod],
    parent: str,
    work: str,
) -> dict[str, Any]:
    """One measured run in ``work``: the state built, the ceiling, the rounds and the document."""
    if ctx.dist.is_main:
        what = f"{layers} of {spec.num_layers} blocks, {args.dtype}{', training state' if args.training_state else ''}"
        print(f"building {spec.name} ({what}) on {ctx.device} ...", file=sys.stderr)
    build = time.perf_counter()
    state = workloads.build_state(
        spec, dtype=args.dtype, device=ctx.device, layers=layers, training_state=args.training_state, seed=args.seed
    )
    tensors, _objects = workloads.flatten_state(state)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    build = time.perf_counter() - build
    ops = (args.repeats + args.warmup) * len(saves) + (args.repeats * args.load_repeats + args.warmup) * len(loads)
    progress = display.Progress(ops, enabled=ctx.dist.is_main and not args.no_progress)
    dropper = system.CacheDropper(enabled=not args.no_drop_caches)
    started = time.perf_counter()
    schedule: list[dict[str, Any]] = []
    pauses = {"settle_seconds": args.settle, "memory_settle_seconds": args.memory_settle}
    with contextlib.closing(progress):
        ceiling = None if args.no_ceiling else _measure_ceiling(args, work, state_bytes, ctx, progress)
        options = {k: getattr(args, k) for k in ("repeats", "warmup", "order_seed", "load_repeats")}
        options.update(pauses, dropper=dropper, progress=progress, state_bytes=state_bytes, schedule=schedule)
        results = run_benchmark(state, saves, loads, work, ctx=ctx, **options)
    elapsed = time.perf_counter() - started
    overrides, config_file = ctx.fastpersist_overrides, args.config or os.environ.get("FASTPERSIST_CONFIG")
    settings = {"model": spec.name, "model_description": spec.description, "layers": layers}
    settings.update(model_layers=spec.num_layers, dtype=args.dtype, device=str(ctx.device))
    settings.update({k: getattr(args, k) for k in ("training_state", "repeats", "load_repeats", "warmup")}, dir=parent)
    settings.update({k: getattr(args, k) for k in ("seed", "order_seed", "dcp_threads")}, cache=dropper.mode)
    settings.update(cache_detail=dropper.detail, rank=ctx.dist.rank, world_size=ctx.dist.world_size)
    settings.update(fastpersist_overrides=overrides, fastpersist_config_file=config_file)
    settings.update(fastpersist_settings=config.resolve(overrides).as_dict(), argv=sys.argv[1:])
    parameters = workloads.parameter_count(spec, layers)
    document = {
        "schema": SCHEMA,
        "machine": measure.machine_info(parent, str(ctx.device)),
        "settings": settings,
        "state": {"bytes": state_bytes, "tensors": len(tensors), "parameters": parameters, "build_seconds": build},
        "elapsed_seconds": elapsed,
        "baselines": BASELINES,
        "results": [r.as_dict(state_bytes) for r in results],
        "order": {"seed": args.order_seed, "rounds": schedule, **pauses},
        "ceiling": ceiling,
    }
    report.annotate_ceiling(document)
    return document


def _measure_ceiling(
    args: argparse.Namespace, work: str, state_bytes: int, ctx: BenchContext, progress: Any
) -> dict[str, Any] | None:
    """The storage ceiling on rank 0 (the others wait), or None when it cannot be measured here."""
    from fastpersist.bench import bounds

    ceiling = None
    if ctx.dist.is_main:
        try:
            settings = config.resolve(ctx.fastpersist_overrides)
            available = system.available_memory()
            ceiling = bounds.measure_ceiling(
                work,
                state_bytes if available is None else min(state_bytes, available // 4),
                engine_name=settings.engine,
                use_fio=not args.no_fio,
                read_buffers=(settings.read_buffer_size, settings.read_buffer_count),
                grid_bytes=config.parse_size(args.ceiling_grid_size),
                passes=2,
                seed=args.order_seed,
                progress=progress,
            )
            if ceiling["fio"]["note"]:
                print(f"note: {ceiling['fio']['note']}", file=sys.stderr)
        except (ImportError, OSError, RuntimeError, ValueError) as e:
            ceiling = {"error": f"{type(e).__name__}: {e}"}
            print(f"warning: the storage ceiling could not be measured: {ceiling['error']}", file=sys.stderr)
    ctx.dist.barrier()
    return ceiling


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

    def fail(self, reason: str, status: str = "FAILED") -> None:
        self.status, self.reason = status, reason

    def as_dict(self, state_bytes: int) -> dict[str, Any]:
        timed = [s for s in self.samples if not s.get("warmup")]
        keys = ("gbps", "seconds", "blocked_seconds", "peak_rss_bytes", "rss_delta_bytes")
        out = {"op": self.op, "method": self.name, "label": self.label, "status": self.status, "reason": self.reason}
        out.update(timed=self.timed, bytes=state_bytes, file_bytes=self.file_bytes, samples=self.samples)
        out["summary"] = {
            k: measure.summarize([s.get(k) for s in timed]) if self.status == "ok" else None for k in keys
        }
        return out


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 300 else text[:297] + "..."


def _timed(
    result: MethodResult, op: str, call: Callable[..., Any], *args: Any
) -> tuple[Any, float, dict[str, Any]] | None:
    """``call(*args)``'s value, when it ended and its sample; None (``result`` FAILED) when it raised."""
    try:
        with measure.PeakMemory() as memory:
            start = time.perf_counter()
            value = call(*args)
            ended = time.perf_counter()
    except Exception as e:  # noqa: BLE001 - a method's failure is recorded, the run goes on
        result.fail(f"{op} raised {_short_error(e)}")
        if os.environ.get("FASTPERSIST_BENCH_TRACEBACK"):
            traceback.print_exc()
        return None
    sample = {"seconds": ended - start, "peak_rss_bytes": memory.peak, "baseline_rss_bytes": memory.baseline}
    return value, ended, {**sample, "rss_delta_bytes": memory.delta, "memory_source": memory.source}


def _save(method: SaveMethod, state: Any, path: str, ctx: BenchContext) -> dict[str, Any]:
    extra = method.save(state, path, ctx) or {}
    ctx.synchronize()
    measure.fsync_paths(path)
    return extra


def _load(method: LoadMethod, state: Any, path: str, ctx: BenchContext) -> Any:
    loaded = method.load(path, state, ctx)
    if ctx.device.type == "cpu":
        measure.touch_pages(method.flat(loaded)[0])
    ctx.synchronize()
    return loaded


@dataclasses.dataclass
class _Runner:
    """One timed, verified save or load of :func:`run_benchmark`; a failure marks its result FAILED."""

    state: Any
    expected: Any  # the state flattened, to compare every file and loaded state with
    ctx: BenchContext
    dropper: Any
    state_bytes: int

    def verified(self, result: MethodResult, method: Any, what: str, read: Callable[..., Any], *args: Any) -> bool:
        """Whether ``read(*args)`` gives the original bytes; if not (a failure to read included) ``result`` fails."""
        try:
            problem = measure.verify_state(self.expected, method.flat(read(*args)), self.ctx.device)
        except Exception as e:  # noqa: BLE001 - a failed read-back or comparison marks the method FAILED
            problem = f"{what} failed: {_short_error(e)}"
        if problem:
            result.fail(f"verification failed: {problem}")
        return not problem

    def save(self, method: SaveMethod, result: MethodResult, path: str, tag: dict[str, Any]) -> float | None:
        """Saves into a fresh ``path``; when the save ended (None: it failed)."""
        measure.remove_path(path)
        system.release_memory()
        self.ctx.synchronize()
        self.ctx.dist.barrier()
        timed = _timed(result, "save", _save, method, self.state, path, self.ctx)
        if timed is None:
            return None
        extra, ended, sample = timed
        result.file_bytes = sum(os.path.getsize(f) for f in system.files_under(path))
        if not self.verified(result, method, "reading the file back", method.read_back, path, self.state, self.ctx):
            return None
        sample = {"seconds": sample.pop("seconds"), "blocked_seconds": extra.get("blocked_seconds"), **sample}
        result.samples.append({**sample, **tag, "gbps": self.state_bytes / sample["seconds"] / 1e9})
        return ended

    def load(self, method: LoadMethod, result: MethodResult, path: str, saved: float, pause: float, tag: dict) -> None:
        """Loads ``path`` (saved at ``saved``) cold, after a ``pause`` for freed memory to settle."""
        system.release_memory()  # before the drop and the pause: what is freed now settles too
        cache = self.dropper.drop([path])
        time.sleep(pause)
        self.ctx.dist.barrier()
        age = time.perf_counter() - saved
        self.ctx.synchronize()
        timed = _timed(result, "load", _load, method, self.state, path, self.ctx)
        if timed is None or not self.verified(result, method, "comparing the loaded state", lambda: timed[0]):
            return
        sample = {**timed[2], "file_age_seconds": age, "memory_settle_seconds": pause, **tag, "cache": cache}
        result.samples.append({**sample, "gbps": self.state_bytes / sample["seconds"] / 1e9})


def _method_results(
    save_methods: Sequence[SaveMethod], load_methods: Sequence[LoadMethod], ctx: BenchContext
) -> tuple[list[SaveMethod], dict[tuple[str, str], MethodResult]]:
    """The saves to run (those given, then the untimed saves of loads' sources) and every method's result."""
    saves = list(save_methods)
    results = {("save", m.name): MethodResult("save", m.name, m.label) for m in saves}
    for m in load_methods:
        if ("save", m.source) not in results:
            if m.source not in SAVE_METHODS:
                raise KeyError(f"load method {m.name!r} reads files of unknown save method {m.source!r}")
            saves.append(SAVE_METHODS[m.source])
            results[("save", m.source)] = MethodResult("save", m.source, SAVE_METHODS[m.source].label, timed=False)
    results.update({("load", m.name): MethodResult("load", m.name, m.label) for m in load_methods})
    for m in saves + list(load_methods):
        if reason := m.unavailable(ctx):
            results[("save" if isinstance(m, SaveMethod) else "load", m.name)].fail(reason, "skipped")
    return saves, results


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

    Each round runs the saves, then the loads (``load_repeats`` times each in a timed round), each phase in a
    fresh seeded order (recorded in ``schedule``), then deletes its files. A difference or exception marks a
    method FAILED (its loads skipped); a load whose ``source`` is not among ``save_methods`` has that save run
    untimed. ``settle_seconds`` pass between a round's saves and its loads (virtual disks read fresh files
    slowly for a while); before each timed load, and a timed round's saves, memory is released, the cache
    dropped and ``memory_settle_seconds`` pass (a VM with free page reporting returns freed memory to its host
    about 2 s later; a load into memory still backed is faster than in a fresh process). Returns a
    :class:`MethodResult` per method: the saves as given, the untimed helper saves, the loads.
    """
    ctx = ctx or BenchContext()
    progress = progress or (lambda _text: None)
    state_bytes = workloads.state_nbytes(state) if state_bytes is None else state_bytes
    runner = _Runner(state, workloads.flatten_state(state), ctx, dropper or system.CacheDropper(), state_bytes)
    saves, results = _method_results(save_methods, load_methods, ctx)
    if load_repeats < 1:
        raise ValueError(f"load_repeats must be at least 1, got {load_repeats}")
    if memory_settle_seconds < 0:
        raise ValueError(f"memory_settle_seconds must be at least 0, got {memory_settle_seconds}")
    rounds = Rounds(repeats, warmup, order="shuffle", seed=order_seed)
    for index in range(warmup + repeats):
        tag = {"round": index, "warmup": index < warmup}
        save_order = rounds.ordered(saves, index)
        load_order = rounds.ordered(list(load_methods) * (1 if tag["warmup"] else load_repeats), index)
        if schedule is not None:
            schedule.append({**tag, "save": [m.name for m in save_order], "load": [m.name for m in load_order]})
        where = f"round {index + 1}/{warmup + repeats}"
        written: dict[str, tuple[str, float]] = {}  # save method -> its verified output, when its save ended
        created: dict[str, str] = {}  # everything to delete at the end of the round
        try:
            pause = 0.0 if tag["warmup"] else memory_settle_seconds
            if pause:  # the last round's files were deleted: their page cache is free memory the host still backs
                system.release_memory()
                time.sleep(pause)
            for method in save_order:
                if (result := results[("save", method.name)]).status == "ok":
                    progress(f"{where}: save {method.name}")
                    path = created[method.name] = method.target(directory, ctx)
                    if (ended := runner.save(method, result, path, tag)) is not None:
                        written[method.name] = (path, ended)
            if load_order and written:
                os.sync()
                time.sleep(max(0.0, settle_seconds - pause))  # the first load's pause completes the settle
            for method in load_order:
                if (result := results[("load", method.name)]).status != "ok":
                    continue
                if method.source not in written:
                    source = results[("save", method.source)]
                    reason = f"its input ({method.source}) was not written: {source.status} {source.reason or ''}"
                    result.fail(reason.strip(), "skipped")
                    continue
                progress(f"{where}: load {method.name}")
                runner.load(method, result, *written[method.source], pause, tag)
        finally:
            by_name = {m.name: m for m in saves}
            for name, path in created.items():
                by_name[name].cleanup(path)
            if created:
                os.sync()
    return list(results.values())


def _text(document: dict[str, Any]) -> str:
    """The terminal's report, and a warning when a method beat the ceiling."""
    text = report.format_table(document)
    if problems := report.measurement_problems(document):
        text += (
            f"\n\nMEASUREMENT PROBLEM: {', '.join(problems)} exceeded the storage ceiling measured in this run; "
            "the ceiling or the method's timing is wrong, so these ratios are not results."
        )
    return text


def _status(document: dict[str, Any]) -> int:
    return 1 if any(r["status"] == "FAILED" for r in document["results"]) else 0


BENCHMARK = Benchmark(
    "checkpoint",
    _options,
    _measure,
    report.to_markdown,
    description=(
        "Save and load a synthetic checkpoint with the exact tensor shapes of a real model, with torch.save, "
        "safetensors, torch DCP and fastpersist, and compare them: time to durable (fsync), cold loads (page "
        "cache dropped), peak host memory; every result verified byte for byte."
    ),
    schema=report.SCHEMA_PREFIX,
    show=_text,
    render=lambda documents: report.to_markdown([document for _, document in documents]),
    png=report.save_png,
    report="--markdown",
    status=_status,
    redirect=("--shape", "shapes"),  # --shape many-small|many-medium|huge|mixed, --sink (issue 15)
)
main = BENCHMARK.main
