"""GdsHandle throughput: ``python -m fastpersist.bench gds --dir D [--size 1G] [--json [PATH]]`` (needs a CUDA device).

One CUDA tensor of ``--size`` bytes written to a fresh preallocated file (timed to fsync) and read back cold
(timed until on the device) by each method in rotating rounds, every byte verified outside the clock:
``ceiling`` (raw O_DIRECT of page-locked host memory), ``aio_copy`` (AioHandle + the torch copy: DeepNVMe
without GDS), ``gds_bounce`` and ``gds_cufile`` (GdsHandle's two paths; one that cannot start is recorded
with the reason). GB/s medians and the ratios to ``ceiling`` and ``aio_copy``; see docs/deepnvme-parity.md.
"""

from __future__ import annotations

import argparse
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
    """name -> (path taken, write(path), read(path), check()) of the methods asked for, or why one cannot start."""
    from fastpersist.deepnvme.gds import GdsHandle
    from fastpersist.deepnvme.handle import AioHandle
    from fastpersist.errors import GdsUnavailableError

    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := sorted(set(wanted) - set(METHODS)):
        raise UsageError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    n = args.size
    destination = torch.empty(n, dtype=torch.uint8, device=source.device)
    host = memory.aligned_empty(n, lock=True)  # the host side of ceiling and aio_copy (pinned for CUDA)

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        ok = bool(torch.equal(got, want))
        got.zero_()
        return ok

    def device_ok() -> bool:
        return same(destination, source)

    methods: dict[str, Any] = {}
    if "ceiling" in wanted:
        io = engine.IoHandle(
            block_size=args.block_size, queue_depth=args.queue_depth, intra_op_parallelism=args.threads, direct=True
        )
        methods["ceiling"] = (
            f"engine {io.engine}, O_DIRECT, host memory",
            lambda path: bounds.engine_write(path, expected, n, io),
            lambda path: bounds.engine_read(path, host, n, io),
            lambda: same(host, expected),
        )
    if "aio_copy" in wanted:
        aio = AioHandle(args.block_size, args.queue_depth, False, True, args.threads)

        def aio_write(path: str) -> None:
            host.copy_(source)  # device -> pinned host (synchronous)
            aio.sync_pwrite(host, path)
            bounds.fsync_file(path)

        def aio_read(path: str) -> None:
            aio.sync_pread(host, path)
            destination.copy_(host)

        methods["aio_copy"] = ("AioHandle on a pinned host tensor + torch copy", aio_write, aio_read, device_ok)
    for name, path_name in (("gds_bounce", "bounce"), ("gds_cufile", "cufile")):
        if name in wanted:
            try:
                h = GdsHandle(args.block_size, args.queue_depth, False, True, args.threads, path=path_name)
            except GdsUnavailableError as e:
                methods[name] = str(e)
                continue
            methods[name] = (
                f"{h.path}: {h.path_reason}",
                lambda path, h=h: (h.sync_pwrite(source, path), bounds.fsync_file(path)),
                lambda path, h=h: h.sync_pread(destination, path),
                device_ok,
            )
    return methods


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Runs every method ``args.repeats`` rounds; returns the results document.

    Raises:
        SystemExit: no CUDA device; UsageError: a size that is not a multiple of 4096, an unknown method.
    """
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
        _, write, read, check = methods[name]
        path = os.path.join(work, f"{name}.bin")
        try:
            bounds.preallocate(path, args.size)
            wrote = timed(lambda: write(path), device)[1]["seconds"]
            ok = bounds.file_problem(path, expected) is None  # the written bytes, outside the timing
            dropper.drop([path])
            read_seconds = timed(lambda: read(path), device)[1]["seconds"]
        finally:
            measure.remove_path(path)
        return {"write": args.size / 1e9 / wrote, "read": args.size / 1e9 / read_seconds, "ok": check() and ok}

    live = [name for name, m in methods.items() if not isinstance(m, str)]
    try:
        rounds = Rounds(args.repeats, order="rotate").run([live], run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {}
    for name, m in methods.items():
        error = m if isinstance(m, str) else (f"failed: {rounds.errors[name]}" if name in rounds.errors else None)
        results[name] = {"path": None if isinstance(m, str) else m[0], "error": error}
        if error is None:
            samples = rounds.samples[name]
            results[name].update(
                write_gbps=rounds.median(name, "write"),
                read_gbps=rounds.median(name, "read"),
                write_samples=[s["write"] for s in samples],
                read_samples=[s["read"] for s in samples],
                verified=all(s["ok"] for s in samples),
            )
    ok = {name: entry for name, entry in results.items() if entry["error"] is None}
    ratios = {
        name: {
            f"{op}_vs_{base}": entry[f"{op}_gbps"] / ok[base][f"{op}_gbps"]
            for base in ("ceiling", "aio_copy")
            if base in ok and base != name
            for op in ("write", "read")
        }
        for name, entry in ok.items()
    }
    settings = {"dir": os.path.abspath(args.dir), "size": args.size, "repeats": args.repeats}
    settings.update(block_size=args.block_size, queue_depth=args.queue_depth, threads=args.threads)
    settings.update(device=str(device), cache=dropper.mode)
    machine = measure.machine_info(args.dir, str(device))
    return {"benchmark": "gds", "settings": settings, "machine": machine, "results": results, "ratios": ratios}


def to_markdown(document: dict[str, Any]) -> str:
    """The result as Markdown: GB/s per method and the ratios to the ceiling and to AioHandle + copy."""
    s = document["settings"]
    rows = []
    for name, entry in document["results"].items():
        if entry.get("error"):
            rows.append([name, "-", "-", "-", "-", "-", "-", f"unavailable: {entry['error']}"])
            continue
        r = document["ratios"].get(name, {})
        ratios = [figure(r.get(f"{op}_vs_{base}")) for base in ("ceiling", "aio_copy") for op in ("write", "read")]
        rows.append([name, f"{entry['write_gbps']:.2f}", f"{entry['read_gbps']:.2f}", *ratios, entry["path"]])
    header = ["method", "write GB/s", "read GB/s", "write / ceiling", "read / ceiling", "write / aio_copy"]
    lines = [
        f"{s['size'] / 2**20:.0f} MiB CUDA tensor, median of {s['repeats']}, block {s['block_size'] >> 10} KiB, "
        f"queue depth {s['queue_depth']}, {s['threads']} threads; writes to durability, reads cold",
        "",
        *markdown_table([*header, "read / aio_copy", "path"], "<>>>>>><", rows),
    ]
    return "\n".join(lines) + "\n"


BENCHMARK = Benchmark("gds", _options, _measure, to_markdown, description=__doc__.split("\n")[0], json="either")
main = BENCHMARK.main
