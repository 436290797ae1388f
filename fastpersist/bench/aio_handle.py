"""AioHandle tensor I/O: ``python -m fastpersist.bench aio_handle --dir D [--size 2GiB] [--json OUT]``.

Measures blocking ``sync_pwrite``/``sync_pread`` of one tensor through
:class:`fastpersist.AioHandle` (the DeepNVMe-compatible handle):

* ``cpu_locked``: a tensor from ``new_cpu_locked_tensor`` (in place, no copy);
* ``cuda_ring`` (with a GPU): a CUDA tensor through the handle's chunked pinned
  ring (default 4 x 8 MiB) on a side stream;
* ``cuda_bounce`` (with a GPU, the baseline): the previous design, a copy of
  the whole tensor into a pinned host buffer of its size (allocated before the
  clock starts, in the baseline's favour), then the write; reads the reverse.

Reports GB/s (median of ``--repeat`` runs), the ring's ratio to the bounce
baseline, and the pinned host bytes each CUDA method needed. Files are
removed between runs; writes are not fsynced (the handle does not fsync, in
either method), direct I/O is used where the filesystem allows it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from fastpersist import config
from fastpersist.bench.measure import machine_info
from fastpersist.deepnvme.handle import AioHandle
from fastpersist.io import memory

__all__ = ["main", "run"]


def _size(text: str) -> int:
    return config.size_argument(text)  # the one size syntax (binary units)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastpersist.bench aio_handle", description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="directory to write the test file in (removed afterwards)")
    p.add_argument("--size", type=_size, default=1 << 30, help="tensor bytes (default 1GiB)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--block-size", type=_size, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--intra-op-parallelism", type=int, default=4)
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA methods even when a GPU is present")
    p.add_argument("--json", default=None, help="write the results document to this path")
    return p


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "fastpersist-bench-aio-handle.bin")
    n = args.size
    h = AioHandle(args.block_size, args.queue_depth, False, True, args.intra_op_parallelism)
    results: dict[str, Any] = {}

    def cleanup() -> None:
        if os.path.exists(path):
            os.remove(path)

    # CPU locked tensor, in place.
    host = h.new_cpu_locked_tensor(n, torch.uint8)
    host.fill_(3)
    writes, reads = [], []
    for _ in range(args.repeat):
        cleanup()
        writes.append(_timed(lambda: h.sync_pwrite(host, path)))
        reads.append(_timed(lambda: h.sync_pread(host, path)))
    results["cpu_locked"] = {"write_GBps": _median_gbps(n, writes), "read_GBps": _median_gbps(n, reads)}

    if torch.cuda.is_available() and not args.no_cuda:
        device = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        back = torch.empty_like(device)
        torch.cuda.synchronize()
        pooled_before = memory.pooled_bytes()
        # Warm the ring's pooled buffers once (allocation is a one-time cost in both designs).
        h.sync_pwrite(device[: 64 << 20], path)
        writes, reads = [], []
        for _ in range(args.repeat):
            cleanup()
            writes.append(_timed(lambda: h.sync_pwrite(device, path)))
            reads.append(_timed(lambda: h.sync_pread(back, path)))
        ok = bool(torch.equal(back, device))
        results["cuda_ring"] = {
            "write_GBps": _median_gbps(n, writes),
            "read_GBps": _median_gbps(n, reads),
            "pinned_bytes": memory.pooled_bytes() - pooled_before,
            "round_trip_equal": ok,
        }
        bounce = torch.empty(n, dtype=torch.uint8).pin_memory()

        def bounce_write() -> None:
            bounce.copy_(device)
            h.sync_pwrite(bounce, path)

        def bounce_read() -> None:
            h.sync_pread(bounce, path)
            back.copy_(bounce)
            torch.cuda.synchronize()

        writes, reads = [], []
        for _ in range(args.repeat):
            cleanup()
            writes.append(_timed(bounce_write))
            reads.append(_timed(bounce_read))
        results["cuda_bounce"] = {
            "write_GBps": _median_gbps(n, writes),
            "read_GBps": _median_gbps(n, reads),
            "pinned_bytes": n,
            "round_trip_equal": bool(torch.equal(back, device)),
        }
        ring, base = results["cuda_ring"], results["cuda_bounce"]
        results["ring_vs_bounce"] = {
            "write_ratio": ring["write_GBps"] / base["write_GBps"],
            "read_ratio": ring["read_GBps"] / base["read_GBps"],
            "pinned_ratio": ring["pinned_bytes"] / base["pinned_bytes"],
        }
        del bounce
    h.free_cpu_locked_tensor(host)
    cleanup()
    return {
        "benchmark": "aio_handle",
        "size_bytes": n,
        "repeat": args.repeat,
        "handle": repr(h),
        "config": {"size_bytes": n, "repeat": args.repeat, "handle": repr(h)},
        "machine": machine_info(args.dir, device="cuda" if "cuda_ring" in results else "cpu"),
        "results": results,
    }


def to_markdown(document: dict[str, Any]) -> str:
    """The result as Markdown: write/read GB/s and pinned bytes per path, then the ring/bounce ratios."""
    results = document["results"]
    lines = [
        f"{document['size_bytes'] / 2**20:.0f} MiB per transfer, median of {document['repeat']}, {document['handle']}",
        "",
        "| path | write GB/s | read GB/s | pinned MiB | round trip equal |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, entry in results.items():
        if "write_GBps" in entry:
            lines.append(
                f"| {name} | {entry['write_GBps']:.2f} | {entry['read_GBps']:.2f} | "
                f"{entry.get('pinned_bytes', 0) / 2**20:.0f} | {entry.get('round_trip_equal', '-')} |"
            )
    ratio = results.get("ring_vs_bounce")
    if ratio:
        lines += [
            "",
            f"- CUDA ring / whole-tensor bounce: write {ratio['write_ratio']:.2f}x, read {ratio['read_ratio']:.2f}x, "
            f"pinned memory {ratio['pinned_ratio']:.4f}x",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    doc = run(args)
    text = json.dumps(doc, indent=2, default=str)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0
