"""``python -m fastpersist.bench checkpoint``: save and load a real-shaped checkpoint every way.

One run compares, on the same bytes, ``torch.save`` (default and fast
settings), ``safetensors``, ``torch.distributed.checkpoint`` and fastpersist
(sync and async), then the matching loads. Every number is a time to durable
(fsync of the files and their directory) or a cold load (page cache dropped
first); every saved file and every loaded state is compared byte for byte with
the original before its method is reported. See docs/checkpoint-benchmark.md.

This module is the command line only; the jobs live in their own modules:

* the methods in :mod:`fastpersist.bench.methods` (add one with :func:`register`);
* the rounds, timing and verification in :mod:`fastpersist.bench.runner`;
* tables, charts and Markdown in :mod:`fastpersist.bench.report`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from fastpersist import config, display, system
from fastpersist.bench import measure, report
from fastpersist.bench.harness import Benchmark, UsageError, option
from fastpersist.bench.methods import LOAD_METHODS, SAVE_METHODS, BenchContext, LoadMethod, SaveMethod, register
from fastpersist.bench.runner import MethodResult, run_benchmark
from fastpersist.tuning import workloads

__all__ = [
    "BENCHMARK",
    "BenchContext",
    "SaveMethod",
    "LoadMethod",
    "MethodResult",
    "SAVE_METHODS",
    "LOAD_METHODS",
    "register",
    "run_benchmark",
    "main",
    "SCHEMA",
]

SCHEMA = "fastpersist.bench.checkpoint/1"
_SETTLE_DEFAULT = 5.0
"""Seconds between a round's saves and its loads (see ``--settle``)."""
_LOAD_REPEATS_DEFAULT = 1
"""Cold loads of each method per timed round (see ``--load-repeats``)."""
_MEMORY_SETTLE_DEFAULT = 2.5
"""Seconds before each timed load where the guest hands freed memory back to its host (see ``--memory-settle``)."""
BASELINES = {"save": "torch.save", "load": "torch.load"}


def _default_dcp_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _options(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    what = parser.add_argument_group("what to save")
    what.add_argument("--model", default=workloads.DEFAULT_MODEL, help="model whose shapes to use (see --list-models)")
    what.add_argument("--layers", type=int, default=None, help="keep only the first N transformer blocks")
    option(
        what,
        "size",
        type=str,
        default=None,
        help="keep as many blocks as fit in this size (e.g. 2G, 512MiB); overrides --layers",
    )
    what.add_argument("--dtype", choices=sorted(workloads.DTYPES), default="bf16", help="parameter dtype")
    option(what, "device")
    what.add_argument(
        "--training-state",
        action="store_true",
        help="save a full training checkpoint: + Adam moments (fp32), fp32 master weights, step, RNG state",
    )
    what.add_argument("--seed", type=int, default=0, help="random seed of the synthetic data")

    how = parser.add_argument_group("how to measure")
    how.add_argument(
        "--methods",
        default=None,
        help="comma-separated save and load methods to run (default: every default method; see --list-methods)",
    )
    how.add_argument("--skip", default="", help="comma-separated methods to leave out")
    option(how, "repeats")
    how.add_argument(
        "--load-repeats",
        type=int,
        default=_LOAD_REPEATS_DEFAULT,
        help="cold loads of each load method per timed round, each after its own cache drop and memory pause",
    )
    how.add_argument("--warmup", type=int, default=1, help="untimed rounds first (still verified)")
    option(
        how,
        "dir",
        help="directory on the filesystem to test; a temporary subdirectory is made there and removed "
        "afterwards (default: the current directory)",
    )
    option(how, "no_drop_caches")
    how.add_argument(
        "--settle",
        type=float,
        default=None,
        help="seconds to wait (after a sync) between a round's saves and its loads, so that every loaded file "
        "has settled: some virtual disks read a file slowly right after it was written (default: "
        f"{_SETTLE_DEFAULT:g} s, 0 on tmpfs)",
    )
    how.add_argument(
        "--memory-settle",
        type=float,
        default=None,
        help="seconds to wait before each timed load, after the page cache is dropped, so that the memory freed "
        "before it is handed back to the host and every load starts on memory in the same state (default: "
        f"{_MEMORY_SETTLE_DEFAULT:g} s on a virtual machine with free page reporting, else 0)",
    )
    how.add_argument(
        "--order-seed", type=int, default=0, help="seed of the random method order of every round (recorded)"
    )
    how.add_argument(
        "--no-ceiling",
        action="store_true",
        help="do not measure the storage ceiling (best of fio and an engine grid; see docs/checkpoint-benchmark.md)",
    )
    how.add_argument("--no-fio", action="store_true", help="leave fio out of the ceiling even when it is installed")
    how.add_argument(
        "--ceiling-grid-size",
        default="256M",
        help="file size of each grid point of the ceiling search (the finalists use the state's size)",
    )
    how.add_argument("--dcp-threads", type=int, default=_default_dcp_threads(), help="DCP FileSystemWriter threads")
    how.add_argument(
        "--fp-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a fastpersist setting for the fastpersist methods (repeatable), e.g. block_size=16M",
    )
    how.add_argument(
        "--config", default=None, help="a fastpersist configuration file (as written by 'fastpersist tune')"
    )

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
            flag = "default" if m.default else "optional"
            state = f"unavailable: {reason}" if reason else "available"
            print(f"{op}  {name:<28} {flag:<8} {m.label}{extra}; {state}")


def _select_methods(args: argparse.Namespace) -> tuple[list[SaveMethod], list[LoadMethod]]:
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.methods:
        wanted = [s.strip() for s in args.methods.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in SAVE_METHODS and w not in LOAD_METHODS]
        if unknown:
            raise UsageError(
                f"unknown method(s) {', '.join(unknown)}; known: {', '.join(list(SAVE_METHODS) + list(LOAD_METHODS))}"
            )
    else:
        wanted = [n for n, m in SAVE_METHODS.items() if m.default] + [n for n, m in LOAD_METHODS.items() if m.default]
    unknown = skip - set(SAVE_METHODS) - set(LOAD_METHODS)
    if unknown:
        raise UsageError(f"unknown method(s) in --skip: {', '.join(sorted(unknown))}")
    saves = [SAVE_METHODS[n] for n in wanted if n in SAVE_METHODS and n not in skip]
    loads = [LOAD_METHODS[n] for n in wanted if n in LOAD_METHODS and n not in skip]
    return saves, loads


def _parse_fp_settings(items: Sequence[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--fp-setting takes NAME=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        values[key.strip()] = value.strip()
    if values:
        config.settings().replace(**values)  # validates names and values (raises ConfigError)
    return values


def _measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Entry point of a run: the process group under torchrun, then :func:`_main`.

    Raises:
        UsageError: bad arguments or an unusable directory (exit 2); SystemExit: 130 when interrupted, and on
        ranks other than 0 their status (they print nothing).
    """
    if args.list_models:
        _print_models()
        return None
    dist = measure.DistributedEnv()
    process_group = _init_process_group(dist)
    try:
        return _main(args, dist)
    finally:
        if process_group:
            import torch.distributed

            torch.distributed.destroy_process_group()


def _init_process_group(dist: measure.DistributedEnv) -> bool:
    """Under torchrun (WORLD_SIZE > 1), a gloo group for the barriers between timed operations."""
    if dist.world_size <= 1:
        return False
    import torch.distributed

    if not torch.distributed.is_available() or torch.distributed.is_initialized():
        return False
    torch.distributed.init_process_group("gloo")
    return True


def _main(args: argparse.Namespace, dist: measure.DistributedEnv) -> dict[str, Any] | None:
    say = print if dist.is_main else (lambda *a, **k: None)
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

    try:
        overrides = _parse_fp_settings(args.fp_setting)
    except UsageError:
        raise
    except Exception as e:  # ConfigError, ValueError...: reported as a usage error
        raise UsageError(str(e)) from e
    if args.config:
        try:
            config.load_file(args.config)
        except Exception as e:  # any unreadable file is a usage error here
            raise UsageError(f"--config: {e}") from e
    ctx = BenchContext(device=device, dist=dist, dcp_threads=args.dcp_threads, fastpersist_overrides=overrides)
    if args.list_methods:
        _print_methods(ctx)
        return None
    saves, loads = _select_methods(args)
    if not saves and not loads:
        raise UsageError("no methods left to run")

    try:
        spec = workloads.get_model(args.model)
        dtype = workloads.DTYPES[args.dtype]
        layers = args.layers
        if args.size:
            layers = workloads.layers_for_size(spec, config.parse_size(args.size), dtype, args.training_state)
        if layers is None:
            layers = spec.default_layers if spec.default_layers is not None else spec.num_layers
        expected_bytes = workloads.state_bytes(spec, dtype, layers, args.training_state)
    except (KeyError, ValueError) as e:
        raise UsageError(str(e.args[0] if isinstance(e, KeyError) else e)) from e

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

    settle = args.settle if args.settle is not None else (0.0 if fs.get("type") == "tmpfs" else _SETTLE_DEFAULT)
    memory_settle = args.memory_settle
    if memory_settle is None:
        memory_settle = _MEMORY_SETTLE_DEFAULT if system.free_page_reporting() else 0.0
    code = measure.code_version()  # now: the code that runs, whatever is edited meanwhile
    dropper = system.CacheDropper(enabled=not args.no_drop_caches)
    work = None
    interrupted = False
    document: dict[str, Any] | None = None
    failed = False
    with measure.sigterm_as_interrupt():
        try:
            work = tempfile.mkdtemp(prefix=".fastpersist-bench-", dir=parent)
            say(
                f"building {spec.name} ({layers} of {spec.num_layers} blocks, {args.dtype}"
                f"{', training state' if args.training_state else ''}) on {device} ...",
                file=sys.stderr,
            )
            build_start = time.perf_counter()
            state = workloads.build_state(
                spec, dtype=dtype, device=device, layers=layers, training_state=args.training_state, seed=args.seed
            )
            tensors, _objects = workloads.flatten_state(state)
            state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            build_seconds = time.perf_counter() - build_start
            loads_per_method = args.repeats * args.load_repeats + args.warmup
            ops = (args.repeats + args.warmup) * len(saves) + loads_per_method * len(loads)
            progress = display.Progress(ops, enabled=dist.is_main and not args.no_progress)
            started = time.perf_counter()
            schedule: list[dict[str, Any]] = []
            try:
                ceiling = None if args.no_ceiling else _measure_ceiling(args, work, state_bytes, ctx, progress)
                results = run_benchmark(
                    state,
                    saves,
                    loads,
                    work,
                    ctx=ctx,
                    repeats=args.repeats,
                    warmup=args.warmup,
                    dropper=dropper,
                    progress=progress,
                    state_bytes=state_bytes,
                    order_seed=args.order_seed,
                    schedule=schedule,
                    settle_seconds=settle,
                    load_repeats=args.load_repeats,
                    memory_settle_seconds=memory_settle,
                )
            finally:
                progress.close()
            elapsed = time.perf_counter() - started
            document = _document(
                args, spec, layers, state_bytes, len(tensors), results, parent, dropper, ctx, elapsed, build_seconds
            )
            document["machine"]["code"] = code
            document["order"] = {
                "seed": args.order_seed,
                "rounds": schedule,
                "settle_seconds": settle,
                "memory_settle_seconds": memory_settle,
            }
            document["ceiling"] = ceiling
            report.annotate_ceiling(document)
            failed = any(r.status == "FAILED" for r in results)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if work is not None:
                measure.remove_path(work)

    if interrupted:
        print("\ninterrupted; temporary files removed, nothing reported", file=sys.stderr)
        raise SystemExit(130)
    assert document is not None
    if not dist.is_main:
        raise SystemExit(1 if failed else 0)
    return document


def _text(document: dict[str, Any]) -> str:
    """The terminal's report (:func:`report.format_table`), and a warning when a method beat the ceiling."""
    problems = report.measurement_problems(document)
    if not problems:
        return report.format_table(document)
    return report.format_table(document) + (
        f"\n\nMEASUREMENT PROBLEM: {', '.join(problems)} exceeded the storage ceiling measured in this run; "
        "the ceiling or the method's timing is wrong, so these ratios are not results."
    )


def _measure_ceiling(
    args: argparse.Namespace, work: str, state_bytes: int, ctx: BenchContext, progress: Any
) -> dict[str, Any] | None:
    """The storage ceiling on rank 0 (the others wait), or None when it cannot be measured here."""
    from fastpersist.bench.methods import ceilings

    ceiling = None
    if ctx.dist.is_main:
        try:
            grid_bytes = config.parse_size(args.ceiling_grid_size)
            settings = config.resolve(ctx.fastpersist_overrides)
            available = system.available_memory()
            nbytes = state_bytes if available is None else min(state_bytes, available // 4)
            ceiling = ceilings.measure_ceiling(
                work,
                nbytes,
                engine_name=settings.engine,
                use_fio=not args.no_fio,
                read_buffers=(settings.read_buffer_size, settings.read_buffer_count),
                grid_bytes=grid_bytes,
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


def _document(
    args: argparse.Namespace,
    spec: workloads.ModelSpec,
    layers: int,
    state_bytes: int,
    tensor_count: int,
    results: list[MethodResult],
    parent: str,
    dropper: system.CacheDropper,
    ctx: BenchContext,
    elapsed: float,
    build_seconds: float,
) -> dict[str, Any]:
    fastpersist_settings = config.resolve(ctx.fastpersist_overrides).as_dict()
    return {
        "schema": SCHEMA,
        "machine": measure.machine_info(parent, str(ctx.device)),
        "settings": {
            "model": spec.name,
            "model_description": spec.description,
            "layers": layers,
            "model_layers": spec.num_layers,
            "dtype": args.dtype,
            "device": str(ctx.device),
            "training_state": args.training_state,
            "repeats": args.repeats,
            "load_repeats": args.load_repeats,
            "warmup": args.warmup,
            "dir": parent,
            "seed": args.seed,
            "order_seed": args.order_seed,
            "dcp_threads": args.dcp_threads,
            "cache": dropper.mode,
            "cache_detail": dropper.detail,
            "rank": ctx.dist.rank,
            "world_size": ctx.dist.world_size,
            "fastpersist_overrides": ctx.fastpersist_overrides,
            "fastpersist_config_file": args.config or os.environ.get("FASTPERSIST_CONFIG"),
            "fastpersist_settings": fastpersist_settings,
            "argv": sys.argv[1:],
        },
        "state": {
            "bytes": state_bytes,
            "tensors": tensor_count,
            "parameters": workloads.parameter_count(spec, layers),
            "build_seconds": build_seconds,
        },
        "elapsed_seconds": elapsed,
        "baselines": BASELINES,
        "results": [r.as_dict(state_bytes) for r in results],
    }


BENCHMARK = Benchmark(
    "checkpoint",
    _options,
    _measure,
    report.to_markdown,
    description=(
        "Save and load a synthetic checkpoint with the exact tensor shapes of a real model, "
        "with torch.save, safetensors, torch DCP and fastpersist, and compare them: time to "
        "durable (fsync), cold loads (page cache dropped), peak host memory; every result "
        "verified byte for byte."
    ),
    schema=report.SCHEMA_PREFIX,
    show=_text,
    render=lambda documents: report.to_markdown([document for _, document in documents]),
    png=report.save_png,
    report="--markdown",
    status=lambda document: 1 if any(r["status"] == "FAILED" for r in document["results"]) else 0,
    redirect=("--shape", "shapes"),  # --shape many-small|many-medium|huge|mixed, --sink (issue 15)
)
main = BENCHMARK.main
