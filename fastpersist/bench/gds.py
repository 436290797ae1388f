"""GdsHandle throughput: ``python -m fastpersist.bench gds --dir D [--size 1G] [--json [PATH]]`` (needs a CUDA device).

A CUDA tensor written to a fresh preallocated file (to fsync) and read back cold, each method in rotating rounds,
every byte verified outside the clock: ``ceiling`` (O_DIRECT of locked host memory), ``aio_copy`` (AioHandle + a
torch copy: DeepNVMe without GDS), ``gds_bounce``, ``gds_cufile`` (GdsHandle's paths); see docs/deepnvme-parity.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import shutil
from typing import Any

import torch

from fastpersist import system
from fastpersist.bench import bounds, measure
from fastpersist.bench.harness import Benchmark, Rounds, UsageError, figure, markdown_table, option, size, timed
from fastpersist.io import engine, memory

__all__ = ["BENCHMARK", "METHODS", "main", "to_markdown"]

METHODS = ("ceiling", "aio_copy", "gds_bounce", "gds_cufile")
_BASES = ("ceiling", "aio_copy")


def _options(p: argparse.ArgumentParser) -> None:
    option(p, "dir", default=".", help="directory for the test file (a temporary subdirectory, removed)")
    option(p, "size", default=1 << 30, help="tensor bytes (default 1G)")
    option(p, "repeats", help="rounds; medians are reported (default 3)")
    p.add_argument("--block-size", type=size, default=1 << 20, help="handle block_size (default 1M)")
    p.add_argument("--queue-depth", type=int, default=32, help="handle queue_depth (default 32)")
    p.add_argument("--threads", type=int, default=4, help="handle intra_op_parallelism (default 4)")
    option(p, "device", default="cuda", help="CUDA device (default cuda)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")


def _methods(args: argparse.Namespace, source: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    """name -> (path taken, write(path), read(path), (tensor read into, its bytes)), or why one cannot start."""
    from fastpersist.deepnvme.gds import GdsHandle
    from fastpersist.deepnvme.handle import AioHandle
    from fastpersist.errors import GdsUnavailableError

    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := sorted(set(wanted) - set(METHODS)):
        raise UsageError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    n = args.size
    destination = torch.empty(n, dtype=torch.uint8, device=source.device)
    host = memory.aligned_empty(n, lock=True)  # the host side of ceiling and aio_copy (pinned for CUDA)
    knobs = (args.block_size, args.queue_depth, False, True, args.threads)
    methods: dict[str, Any] = {}
    if "ceiling" in wanted:
        io = engine.IoHandle(args.block_size, args.queue_depth, intra_op_parallelism=args.threads, direct=True)
        write = functools.partial(bounds.engine_write, buffer=expected, nbytes=n, handle=io)
        read = functools.partial(bounds.engine_read, buffer=host, nbytes=n, handle=io)
        methods["ceiling"] = (f"engine {io.engine}, O_DIRECT, host memory", write, read, (host, expected))
    if "aio_copy" in wanted:
        aio = AioHandle(*knobs)
        methods["aio_copy"] = (  # the copies: device -> pinned host (synchronous) and back
            "AioHandle on a pinned host tensor + torch copy",
            lambda path: (host.copy_(source), aio.sync_pwrite(host, path), bounds.fsync_file(path)),
            lambda path: (aio.sync_pread(host, path), destination.copy_(host)),
            (destination, source),
        )
    for name in [m for m in ("gds_bounce", "gds_cufile") if m in wanted]:
        try:
            h = GdsHandle(*knobs, path=name.removeprefix("gds_"))
        except GdsUnavailableError as e:
            methods[name] = str(e)
            continue
        methods[name] = (
            f"{h.path}: {h.path_reason}",
            lambda path, h=h: (h.sync_pwrite(source, path), bounds.fsync_file(path)),
            lambda path, h=h: h.sync_pread(destination, path),
            (destination, source),
        )
    return methods


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("the gds benchmark needs a CUDA device (GdsHandle moves CUDA tensors)")
    if args.size <= 0 or args.size % 4096:
        raise UsageError("--size must be a positive multiple of 4096 (the ceiling uses O_DIRECT)")
    device = torch.device(args.device)
    torch.cuda.init()  # before locking host memory: it is then registered with CUDA (pinned)
    expected = memory.aligned_empty(args.size, lock=True)
    expected.view(torch.int64).random_(generator=torch.Generator().manual_seed(0))  # size is a multiple of 4096
    source = expected.to(device)
    torch.cuda.synchronize(device)
    methods = _methods(args, source, expected)
    dropper = system.CacheDropper()
    work = measure.scratch_dir(args.dir, ".fastpersist-bench-gds-")

    def run(name: str, _round: int) -> dict[str, Any]:
        _, write, read, (got, want) = methods[name]
        path = os.path.join(work, f"{name}.bin")
        try:
            bounds.preallocate(path, args.size)
            wrote = timed(lambda: write(path), device)[1]["seconds"]
            ok = bounds.file_problem(path, expected) is None  # the written bytes, outside the timing
            dropper.drop([path])
            read_seconds = timed(lambda: read(path), device)[1]["seconds"]
        finally:
            measure.remove_path(path)
        equal = bool(torch.equal(got, want))
        got.zero_()  # for the next read to fill again
        return {"write": args.size / 1e9 / wrote, "read": args.size / 1e9 / read_seconds, "ok": equal and ok}

    live = [name for name, m in methods.items() if not isinstance(m, str)]
    try:
        rounds = Rounds(args.repeats, order="rotate").run([live], run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results, ratios = {}, {}
    for name, m in methods.items():
        error = m if isinstance(m, str) else (f"failed: {rounds.errors[name]}" if name in rounds.errors else None)
        results[name] = entry = {"path": None if isinstance(m, str) else m[0], "error": error}
        if error is None:
            ratios[name] = {}
            samples = rounds.samples[name]
            entry.update({f"{op}_gbps": rounds.median(name, op) for op in ("write", "read")})
            entry.update({f"{op}_samples": [s[op] for s in samples] for op in ("write", "read")})
            entry["verified"] = all(s["ok"] for s in samples)
    for name, base, op in itertools.product(ratios, _BASES, ("write", "read")):  # of the methods that ran
        if base in ratios and base != name:
            ratios[name][f"{op}_vs_{base}"] = results[name][f"{op}_gbps"] / results[base][f"{op}_gbps"]
    settings = {"dir": os.path.abspath(args.dir), "size": args.size, "repeats": args.repeats}
    settings.update(block_size=args.block_size, queue_depth=args.queue_depth, threads=args.threads)
    settings.update(device=str(device), cache=dropper.mode)
    machine = measure.machine_info(args.dir, str(device))
    return {"benchmark": "gds", "settings": settings, "machine": machine, "results": results, "ratios": ratios}


def to_markdown(document: dict[str, Any]) -> str:
    s = document["settings"]
    rows = []
    for name, entry in document["results"].items():  # a method that did not run: its error, no figures
        r = document["ratios"].get(name, {})
        cells = [figure(entry.get(f"{op}_gbps")) for op in ("write", "read")]
        cells += [figure(r.get(f"{op}_vs_{base}")) for base in _BASES for op in ("write", "read")]
        rows.append([name, *cells, f"unavailable: {entry['error']}" if entry.get("error") else entry["path"]])
    header = ["method", "write GB/s", "read GB/s", *(f"{op} / {base}" for base in _BASES for op in ("write", "read"))]
    lines = [
        f"{s['size'] / 2**20:.0f} MiB CUDA tensor, median of {s['repeats']}, block {s['block_size'] >> 10} KiB, "
        f"queue depth {s['queue_depth']}, {s['threads']} threads; writes to durability, reads cold",
        "",
        *markdown_table([*header, "path"], "<>>>>>><", rows),
    ]
    return "\n".join(lines) + "\n"


BENCHMARK = Benchmark("gds", _options, _measure, to_markdown, description=__doc__.split("\n")[0], json="either")
main = BENCHMARK.main
