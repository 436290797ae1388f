"""GdsHandle throughput: ``python -m fastpersist.bench gds --dir D [--size 1G] [--json [PATH]]`` (needs a CUDA device).

One CUDA tensor of ``--size`` bytes is written to a file in ``--dir`` and read
back, by each method in the same run, round by round (the order rotates each
round; medians are reported):

* ``ceiling``: the storage's ceiling for this file size, our raw O_DIRECT
  write/read of page-locked host memory through the engine (no device copy);
* ``aio_copy``: the baseline a DeepNVMe user without GDS writes:
  ``AioHandle`` on a pinned host tensor of the whole size, plus the torch copy
  device -> host before the write (host -> device after the read), both timed;
* ``gds_bounce``: ``GdsHandle(path="bounce")``, the pinned chunk ring;
* ``gds_cufile``: ``GdsHandle(path="cufile")``, NVIDIA cuFile (compatibility
  mode without nvidia-fs); recorded as unavailable, with the reason, where
  cuFile cannot start.

Writes go to a fresh preallocated file (fallocate outside the timing, as fio
does) and are timed to durability (fsync). Before each read the file's page
cache is dropped; reads are timed until the bytes are on the device. Every
write and read is verified byte for byte outside the timing. Results: GB/s
(10^9 bytes/s) per method and the ratios to ``ceiling`` and to ``aio_copy``.
``--json`` prints the document (``--json PATH`` writes it there instead);
``python -m fastpersist.bench report`` renders it into docs/deepnvme-parity.md
when it is placed in docs/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from fastpersist import config, system
from fastpersist.bench import measure
from fastpersist.bench.io import _file_problem
from fastpersist.io import engine, memory

__all__ = ["main", "run", "build_parser", "to_markdown", "METHODS"]

METHODS = ("ceiling", "aio_copy", "gds_bounce", "gds_cufile")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastpersist.bench gds", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=".", help="directory for the test file (a temporary subdirectory, removed)")
    p.add_argument("--size", type=config.size_argument, default=1 << 30, help="tensor bytes (default 1G)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default 3)")
    p.add_argument("--block-size", type=config.size_argument, default=1 << 20, help="handle block_size (default 1M)")
    p.add_argument("--queue-depth", type=int, default=32, help="handle queue_depth (default 32)")
    p.add_argument("--threads", type=int, default=4, help="handle intra_op_parallelism (default 4)")
    p.add_argument("--device", default="cuda", help="CUDA device (default cuda)")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {', '.join(METHODS)} (default: all)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="print the results document as JSON (or write it to PATH)",
    )
    return p


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Method:
    """One way of moving the device tensor to the file and back; ``write``/``read`` are what is timed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: str | None = None
        self.path: str | None = None

    def write(self, path: str) -> None:
        raise NotImplementedError

    def read(self, path: str) -> None:
        raise NotImplementedError


def _make_methods(args: argparse.Namespace, source: torch.Tensor, expected: torch.Tensor, device: torch.device):
    """The methods asked for, each with what it verifies against; a method that cannot start records why."""
    from fastpersist.deepnvme.gds import GdsHandle
    from fastpersist.deepnvme.handle import AioHandle
    from fastpersist.errors import GdsUnavailableError

    size = args.size
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    destination = torch.empty(size, dtype=torch.uint8, device=device)
    host = memory.aligned_empty(size, lock=True)  # the host side of ceiling and aio_copy (pinned for CUDA)
    methods: list[_Method] = []
    checks: dict[str, Callable[[], bool]] = {}

    def device_ok() -> bool:
        ok = bool(torch.equal(destination, source))
        destination.zero_()
        return ok

    if "ceiling" in wanted:
        io = engine.IoHandle(
            block_size=args.block_size, queue_depth=args.queue_depth, intra_op_parallelism=args.threads, direct=True
        )
        m = _Method("ceiling")
        m.path = f"engine {io.engine}, O_DIRECT, host memory"

        def ceiling_write(path: str) -> None:
            with engine.File(path, "w", direct=True) as f:
                io.submit_write(expected.data_ptr(), size, f, 0, keepalive=expected)
                io.wait()
                f.fsync()

        def ceiling_read(path: str) -> None:
            with engine.File(path, "r", direct=True) as f:
                io.submit_read(host.data_ptr(), size, f, 0, keepalive=host)
                io.wait()

        m.write, m.read = ceiling_write, ceiling_read  # type: ignore[method-assign]

        def host_ok() -> bool:
            ok = bool(torch.equal(host, expected))
            host.zero_()
            return ok

        checks["ceiling"] = host_ok
        methods.append(m)
    if "aio_copy" in wanted:
        aio = AioHandle(args.block_size, args.queue_depth, False, True, args.threads)
        m = _Method("aio_copy")
        m.path = "AioHandle on a pinned host tensor + torch copy"

        def aio_write(path: str) -> None:
            host.copy_(source)  # device -> pinned host (synchronous)
            aio.sync_pwrite(host, path)
            _fsync(path)

        def aio_read(path: str) -> None:
            aio.sync_pread(host, path)
            destination.copy_(host)
            torch.cuda.synchronize(device)

        m.write, m.read = aio_write, aio_read  # type: ignore[method-assign]
        checks["aio_copy"] = device_ok
        methods.append(m)
    for name, path_name in (("gds_bounce", "bounce"), ("gds_cufile", "cufile")):
        if name not in wanted:
            continue
        m = _Method(name)
        try:
            handle = GdsHandle(args.block_size, args.queue_depth, False, True, args.threads, path=path_name)
        except GdsUnavailableError as e:
            m.error = str(e)
            methods.append(m)
            continue
        m.path = f"{handle.path}: {handle.path_reason}"

        def gds_write(path: str, handle: Any = handle) -> None:
            handle.sync_pwrite(source, path)
            _fsync(path)

        def gds_read(path: str, handle: Any = handle) -> None:
            handle.sync_pread(destination, path)
            torch.cuda.synchronize(device)

        m.write, m.read = gds_write, gds_read  # type: ignore[method-assign]
        checks[name] = device_ok
        methods.append(m)
    return methods, checks


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs every method ``args.repeats`` rounds; returns the results document.

    Raises:
        SystemExit: no CUDA device, a size that is not a multiple of 4096, an unknown method.
    """
    from fastpersist.bench.measure import machine_info

    if not torch.cuda.is_available():
        raise SystemExit("the gds benchmark needs a CUDA device (GdsHandle moves CUDA tensors)")
    if args.size <= 0 or args.size % 4096:
        raise SystemExit("--size must be a positive multiple of 4096 (the ceiling uses O_DIRECT)")
    device = torch.device(args.device)
    torch.cuda.init()  # before locking host memory: it is then registered with CUDA (pinned)
    expected = memory.aligned_empty(args.size, lock=True)
    expected.view(torch.int64).random_(generator=torch.Generator().manual_seed(0))  # size is a multiple of 4096
    source = expected.to(device)
    torch.cuda.synchronize(device)
    methods, checks = _make_methods(args, source, expected, device)
    dropper = system.CacheDropper()
    samples: dict[str, dict[str, list[float]]] = {m.name: {"write": [], "read": []} for m in methods}
    verified: dict[str, bool] = {}
    live = [m for m in methods if m.error is None]
    work = measure.scratch_dir(args.dir, ".fastpersist-bench-gds-")
    try:
        for round_index in range(args.repeats):
            shift = round_index % max(len(live), 1)
            for m in live[shift:] + live[:shift]:
                if m.error is not None:  # failed in an earlier round
                    continue
                path = os.path.join(work, f"{m.name}.bin")
                if os.path.exists(path):
                    os.unlink(path)
                with engine.File(path, "w", direct=True, truncate=True) as f:
                    f.allocate(0, args.size)
                torch.cuda.synchronize(device)
                try:
                    start = time.perf_counter()
                    m.write(path)
                    write_gbps = args.size / 1e9 / (time.perf_counter() - start)
                    ok = _file_problem(path, expected) is None  # the written bytes, outside the timing
                    dropper.drop([path])
                    torch.cuda.synchronize(device)
                    start = time.perf_counter()
                    m.read(path)
                    read_gbps = args.size / 1e9 / (time.perf_counter() - start)
                except Exception as error:  # noqa: BLE001 - a method that cannot run here is reported, not fatal
                    m.error = f"failed: {type(error).__name__}: {error}"
                    os.unlink(path)
                    continue
                samples[m.name]["write"].append(write_gbps)
                samples[m.name]["read"].append(read_gbps)
                ok = checks[m.name]() and ok
                verified[m.name] = verified.get(m.name, True) and ok
                os.unlink(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results: dict[str, Any] = {}
    for m in methods:
        entry: dict[str, Any] = {"path": m.path, "error": m.error}
        if m.error is None:
            entry.update(
                write_gbps=statistics.median(samples[m.name]["write"]),
                read_gbps=statistics.median(samples[m.name]["read"]),
                write_samples=samples[m.name]["write"],
                read_samples=samples[m.name]["read"],
                verified=verified.get(m.name, False),
            )
        results[m.name] = entry
    ratios: dict[str, Any] = {}
    for name, entry in results.items():
        if entry.get("error") is not None:
            continue
        ratios[name] = {}
        for base in ("ceiling", "aio_copy"):
            other = results.get(base)
            if other and other.get("error") is None and name != base:
                ratios[name][f"write_vs_{base}"] = entry["write_gbps"] / other["write_gbps"]
                ratios[name][f"read_vs_{base}"] = entry["read_gbps"] / other["read_gbps"]
    settings = {
        "dir": os.path.abspath(args.dir),
        "size": args.size,
        "repeats": args.repeats,
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "threads": args.threads,
        "device": str(device),
        "cache": dropper.mode,
    }
    return {
        "benchmark": "gds",
        "settings": settings,
        "machine": machine_info(args.dir, str(device)),
        "results": results,
        "ratios": ratios,
    }


def to_markdown(document: dict[str, Any]) -> str:
    """The result as Markdown: GB/s per method and the ratios to the ceiling and to AioHandle + copy."""
    s = document["settings"]
    lines = [
        f"{s['size'] / 2**20:.0f} MiB CUDA tensor, median of {s['repeats']}, block {s['block_size'] >> 10} KiB, "
        f"queue depth {s['queue_depth']}, {s['threads']} threads; writes to durability, reads cold",
        "",
        "| method | write GB/s | read GB/s | write / ceiling | read / ceiling | write / aio_copy | read / aio_copy | path |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for name, entry in document["results"].items():
        if entry.get("error"):
            lines.append(f"| {name} | - | - | - | - | - | - | unavailable: {entry['error']} |")
            continue
        r = document["ratios"].get(name, {})
        lines.append(
            f"| {name} | {entry['write_gbps']:.2f} | {entry['read_gbps']:.2f} | {cell(r.get('write_vs_ceiling'))} | "
            f"{cell(r.get('read_vs_ceiling'))} | {cell(r.get('write_vs_aio_copy'))} | {cell(r.get('read_vs_aio_copy'))} "
            f"| {entry['path']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    doc = run(args)
    text = json.dumps(doc, indent=2, default=str)
    if args.json == "-":
        print(text)
    else:
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                f.write(text + "\n")
        print(to_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
