"""AioHandle tensor I/O: ``python -m fastpersist.bench aio_handle --dir D [--size 2GiB] [--json OUT]``.

GB/s medians of blocking ``sync_pwrite``/``sync_pread`` of one tensor in interleaved rounds: ``cpu_locked`` (a
``new_cpu_locked_tensor``) and, with a GPU, ``cuda_ring`` (the handle's pinned chunk ring) against ``cuda_bounce``
(a pinned copy of the whole tensor), with the pinned bytes each needs. Not fsynced; see docs/deepnvme-parity.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from fastpersist.bench.harness import Benchmark, Rounds, UsageError, markdown_table, option, size, timed
from fastpersist.bench.measure import machine_info, remove_path
from fastpersist.deepnvme.handle import AioHandle
from fastpersist.io import memory

__all__ = ["BENCHMARK", "main", "to_markdown"]

_OPS = ("write", "read")


def _options(p: argparse.ArgumentParser) -> None:
    option(p, "dir", help="directory to write the test file in (required to measure; the file is removed)")
    option(p, "size", default=1 << 30, help="tensor bytes (default 1GiB)")
    option(p, "repeats", "--repeat")
    p.add_argument("--block-size", type=size, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--intra-op-parallelism", type=int, default=4)
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA methods even when a GPU is present")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    if not args.dir:
        raise UsageError("the following arguments are required: --dir")
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "fastpersist-bench-aio-handle.bin")
    n = args.size
    h = AioHandle(args.block_size, args.queue_depth, False, True, args.intra_op_parallelism)
    host = h.new_cpu_locked_tensor(n, torch.uint8)
    host.fill_(3)
    ways: dict[str, tuple] = {"cpu_locked": (lambda: h.sync_pwrite(host, path), lambda: h.sync_pread(host, path))}
    cuda = torch.cuda.is_available() and not args.no_cuda
    if cuda:
        device = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        back = torch.empty_like(device)
        torch.cuda.synchronize()
        pooled_before = memory.pooled_bytes()
        h.sync_pwrite(device[: 64 << 20], path)  # warms the ring's pooled buffers (a one-time cost in both designs)
        bounce = torch.empty(n, dtype=torch.uint8).pin_memory()
        ways["cuda_ring"] = (lambda: h.sync_pwrite(device, path), lambda: h.sync_pread(back, path))
        ways["cuda_bounce"] = (
            lambda: (bounce.copy_(device), h.sync_pwrite(bounce, path)),
            lambda: (h.sync_pread(bounce, path), back.copy_(bounce)),
        )

    def run(name: str, _round: int) -> dict[str, Any]:
        write, read = ways[name]
        remove_path(path)
        sample = {"write": timed(write, "cuda" if cuda else None)[1]["seconds"]}
        if name != "cpu_locked":
            back.zero_()  # the read must fill it again to compare equal
        sample["read"] = timed(read, "cuda" if cuda else None)[1]["seconds"]
        return sample if name == "cpu_locked" else dict(sample, equal=bool(torch.equal(back, device)))

    rounds = Rounds(args.repeat, order="rotate", catch=False).run([list(ways)], run)
    results: dict[str, Any] = {name: {f"{op}_GBps": n / rounds.median(name, op) / 1e9 for op in _OPS} for name in ways}
    if cuda:
        for name, pinned in (("cuda_ring", memory.pooled_bytes() - pooled_before), ("cuda_bounce", n)):
            results[name].update(pinned_bytes=pinned, round_trip_equal=all(s["equal"] for s in rounds.samples[name]))
        ring, base = results["cuda_ring"], results["cuda_bounce"]
        ratios = {f"{op}_ratio": ring[f"{op}_GBps"] / base[f"{op}_GBps"] for op in _OPS}
        results["ring_vs_bounce"] = dict(ratios, pinned_ratio=ring["pinned_bytes"] / base["pinned_bytes"])
        del bounce
    h.free_cpu_locked_tensor(host)
    remove_path(path)
    run = {"size_bytes": n, "repeat": args.repeat, "handle": repr(h)}
    machine = machine_info(args.dir, device="cuda" if cuda else "cpu")
    return {"benchmark": "aio_handle", **run, "config": run, "machine": machine, "results": results}


def to_markdown(document: dict[str, Any]) -> str:
    results = document["results"]
    rows = [
        [name, f"{e['write_GBps']:.2f}", f"{e['read_GBps']:.2f}", f"{e.get('pinned_bytes', 0) / 2**20:.0f}"]
        + [e.get("round_trip_equal", "-")]
        for name, e in results.items()
        if "write_GBps" in e
    ]
    header = ["path", "write GB/s", "read GB/s", "pinned MiB", "round trip equal"]
    lines = [
        f"{document['size_bytes'] / 2**20:.0f} MiB per transfer, median of {document['repeat']}, {document['handle']}",
        "",
        *markdown_table(header, "<>>><", rows),
    ]
    if ratio := results.get("ring_vs_bounce"):
        lines += [
            "",
            f"- CUDA ring / whole-tensor bounce: write {ratio['write_ratio']:.2f}x, read {ratio['read_ratio']:.2f}x, "
            f"pinned memory {ratio['pinned_ratio']:.4f}x",
        ]
    return "\n".join(lines) + "\n"


BENCHMARK = Benchmark("aio_handle", _options, _measure, to_markdown, description=__doc__.split("\n")[0])
main = BENCHMARK.main
