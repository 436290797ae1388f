"""``python -m fastpersist.bench io``: sequential engine throughput, optionally against fio.

Like DeepSpeed's ``ds_io``: write ``--size`` bytes to one file with the
engine, read them back, repeat, and print the median GB/s (10^9 bytes per
second). With ``--fio`` the same file size, block size, queue depth and
O_DIRECT setting are run through ``fio --ioengine=io_uring`` in the same
invocation, interleaved repeat by repeat, and the ratio engine/fio is printed.

Method (both tools treated alike):

* write: a fresh file, preallocated with fallocate (fio's default
  ``fallocate=native``; ``--no-fallocate`` turns it off for both), written
  sequentially, then fsync'ed; the time includes the fsync.
* read: the file just written, read sequentially (O_DIRECT bypasses the
  page cache; with ``--buffered`` the file's pages are dropped first, see
  :class:`fastpersist.system.CacheDropper`).
* the engine's source and destination buffers are allocated and touched once,
  outside the timing; each read is verified byte for byte against the source
  (outside the timing).

Example::

    python -m fastpersist.bench io --size 4G --block-size 16M --queue-depth 32 --fio
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from fastpersist import config, display, system
from fastpersist.bench.methods import ceilings
from fastpersist.io import engine, memory

__all__ = ["main", "build_parser", "run"]


def _size(text: str) -> int:
    return config.size_argument(text)  # the one size syntax (binary units)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastpersist.bench io",
        description="Sequential write/read throughput of the fastpersist I/O engine (optionally vs fio).",
    )
    p.add_argument("--dir", default=".", help="directory for the test file (default: current directory)")
    p.add_argument("--size", type=_size, default=_size("1G"), help="bytes per file, e.g. 4G (default 1G)")
    p.add_argument("--block-size", type=_size, default=_size("16M"), help="bytes per I/O request (default 16M)")
    p.add_argument("--queue-depth", type=int, default=32, help="requests in flight per lane (default 32)")
    p.add_argument("--threads", type=int, default=1, help="lanes, i.e. intra_op_parallelism (default 1)")
    p.add_argument("--engine", default="auto", choices=("auto", "io_uring", "threads"))
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT (both tools)")
    p.add_argument("--single-submit", action="store_true", help="one io_uring_enter per request")
    p.add_argument("--no-overlap-events", action="store_true", help="submit and reap in batches")
    p.add_argument("--no-fallocate", action="store_true", help="do not preallocate the file (both tools)")
    p.add_argument("--no-huge-pages", action="store_true", help="engine buffers on 4 KiB pages (fio's default memory)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; the median is reported (default 3)")
    p.add_argument("--mode", choices=("both", "write", "read"), default="both")
    p.add_argument("--fio", action="store_true", help="also run fio (ioengine=io_uring) with the same settings")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte check of each read")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return p


def _engine_write(handle: Any, source: torch.Tensor, path: str, size: int, fallocate: bool, direct: bool) -> float:
    if os.path.exists(path):
        os.unlink(path)
    with engine.File(path, "w", direct=direct, truncate=True) as f:
        if fallocate:
            f.allocate(0, size)
        start = time.perf_counter()
        handle.submit_write(source.data_ptr(), size, f, 0, keepalive=source)
        handle.wait()
        f.fsync()
        elapsed = time.perf_counter() - start
    return elapsed


def _engine_read(handle: Any, destination: torch.Tensor, path: str, size: int, direct: bool) -> float:
    if not direct:
        system.CacheDropper().drop([path])
    with engine.File(path, "r", direct=direct) as f:
        start = time.perf_counter()
        handle.submit_read(destination.data_ptr(), size, f, 0, keepalive=destination)
        handle.wait()
        elapsed = time.perf_counter() - start
    return elapsed


def _fio(path: str, rw: str, args: argparse.Namespace) -> float:
    """fio bandwidth in GB/s for one sequential job with the engine's settings."""
    if rw == "read" and args.buffered:
        system.CacheDropper().drop([path])
    command = ceilings.fio_command(
        path,
        rw,
        args.size,
        args.block_size,
        args.queue_depth,
        direct=not args.buffered,
        threads=args.threads,
        fallocate=not args.no_fallocate,
        verify=False,
    )
    return ceilings.run_fio(command, rw) / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark; returns the results document (see ``--json``)."""
    direct = not args.buffered
    size = args.size
    if size % 4096 or args.block_size % 4096:
        raise SystemExit("--size and --block-size must be multiples of 4096")
    use_fio = args.fio
    if use_fio and system.find_fio() is None:
        print(f"{system.FIO_INSTALL_HINT}; running the engine only", file=sys.stderr)
        use_fio = False
    handle = engine.IoHandle(
        block_size=args.block_size,
        queue_depth=args.queue_depth,
        single_submit=args.single_submit,
        overlap_events=not args.no_overlap_events,
        intra_op_parallelism=args.threads,
        engine=args.engine,
        direct=direct,
    )
    probe = engine.probe_directory(args.dir)
    do_write = args.mode in ("both", "write")
    do_read = args.mode in ("both", "read")

    # Random bytes (no pattern a deduplicating or compressing backend could
    # exploit), written once: this also touches every page outside the timing
    # (page faults on fresh memory are far slower than the disk here).
    source = memory.aligned_empty(size, huge_pages=not args.no_huge_pages)
    words = source.view(torch.int64) if size % 8 == 0 else None
    generator = torch.Generator().manual_seed(0)
    step = 32 << 20
    if words is not None:
        for start in range(0, words.numel(), step):
            chunk = words[start : start + step]
            chunk.random_(generator=generator)
    else:
        source.random_(0, 256, generator=generator)
    destination = memory.aligned_empty(size, huge_pages=not args.no_huge_pages) if do_read else None
    if destination is not None:
        destination.fill_(0)

    workdir = tempfile.mkdtemp(prefix=".fastpersist-bench-", dir=args.dir)
    path = os.path.join(workdir, "engine.bin")
    fio_path = os.path.join(workdir, "fio.bin")
    samples: dict[str, list[float]] = {"engine_write": [], "engine_read": [], "fio_write": [], "fio_read": []}
    try:
        if not do_write:  # read only: lay the file down once
            _engine_write(handle, source, path, size, not args.no_fallocate, direct)
        for repeat in range(args.repeats):
            # Alternate who goes first: this disk is fastest right after an
            # idle period and slows down under sustained writing.
            order = ("engine", "fio") if repeat % 2 == 0 else ("fio", "engine")
            for tool in order:
                if tool == "engine":
                    if do_write:
                        seconds = _engine_write(handle, source, path, size, not args.no_fallocate, direct)
                        samples["engine_write"].append(size / 1e9 / seconds)
                    if do_read:
                        seconds = _engine_read(handle, destination, path, size, direct)
                        samples["engine_read"].append(size / 1e9 / seconds)
                        if not args.no_verify:
                            if not torch.equal(destination, source):
                                raise RuntimeError(
                                    "read-back verification failed: bytes read differ from bytes written"
                                )
                            destination.fill_(0)
                    if do_write and os.path.exists(path):
                        os.unlink(path)
                elif use_fio:
                    if do_write or not os.path.exists(fio_path):
                        if os.path.exists(fio_path):
                            os.unlink(fio_path)
                        rate = _fio(fio_path, "write", args)
                        if do_write:
                            samples["fio_write"].append(rate)
                    if do_read:
                        samples["fio_read"].append(_fio(fio_path, "read", args))
                    if do_write and os.path.exists(fio_path):
                        os.unlink(fio_path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    results = {name: median(values) for name, values in samples.items()}
    ratios = {}
    for op in ("write", "read"):
        e, f = results[f"engine_{op}"], results[f"fio_{op}"]
        ratios[op] = e / f if e and f else None
    return {
        "benchmark": "fastpersist.bench.io",
        "settings": {
            "dir": os.path.abspath(args.dir),
            "size": size,
            "block_size": args.block_size,
            "queue_depth": args.queue_depth,
            "threads": args.threads,
            "engine": handle.engine,
            "direct": direct,
            "single_submit": args.single_submit,
            "overlap_events": not args.no_overlap_events,
            "fallocate": not args.no_fallocate,
            "repeats": args.repeats,
            "huge_pages": not args.no_huge_pages,
        },
        "filesystem": probe,
        "gbps_median": results,
        "gbps_samples": samples,
        "ratio_engine_to_fio": ratios,
        "stats": handle.stats(),
    }


def _print_table(doc: dict[str, Any]) -> None:
    s = doc["settings"]
    print(
        f"fastpersist io bench: {s['size'] / 2**30:.2f} GiB, block {s['block_size'] >> 10} KiB, "
        f"queue depth {s['queue_depth']}, lanes {s['threads']}, engine {s['engine']}, "
        f"direct {s['direct']}, fallocate {s['fallocate']}, fs {doc['filesystem']['fs_type']}, "
        f"median of {s['repeats']}"
    )
    rows = []
    for op in ("write", "read"):
        e = doc["gbps_median"][f"engine_{op}"]
        if e is None:
            continue
        f = doc["gbps_median"][f"fio_{op}"]
        r = doc["ratio_engine_to_fio"][op]
        es = " ".join(f"{v:.2f}" for v in doc["gbps_samples"][f"engine_{op}"])
        fs = " ".join(f"{v:.2f}" for v in doc["gbps_samples"][f"fio_{op}"])
        rows.append((op, f"{e:.2f}", f"{f:.2f}" if f else "-", f"{100 * r:.0f}%" if r else "-", f"{es} | {fs}"))
    header = ("op", "engine GB/s", "fio GB/s", "ratio", "samples (engine | fio)")
    print(display.format_table(header, rows, "<>>><", rule=False))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    doc = run(args)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_table(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
