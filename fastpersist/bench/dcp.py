"""``python -m fastpersist.bench dcp``: torch.distributed.checkpoint with FileSystemWriter vs FastPersistWriter.

``--ranks`` processes of one group on this host each hold their share of a ``--size`` bf16 state. Timed barrier to
barrier: the engine's O_DIRECT ceiling, durable ``dcp.save`` through ``FileSystemWriter`` (each ``--threads``) and
``FastPersistWriter``, cold loads into a preallocated state (checked on the first repeat); see docs/dcp.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fastpersist.bench import bounds, measure
from fastpersist.bench.harness import Benchmark, UsageError, figure, markdown_table, option, size, spawn
from fastpersist.config import settings
from fastpersist.io import engine, memory
from fastpersist.system import CacheDropper

__all__ = ["BENCHMARK", "main"]

_GB = 1e9


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="processes (one process group on this host)")
    backend = "process group backend (nccl needs --device cuda and a GPU per rank)"
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help=backend)
    option(parser, "size", default=4 << 30, help="total state bytes over all ranks")
    parser.add_argument("--tensor-size", type=size, default=64 << 20, help="bytes per tensor")
    option(parser, "device", choices=["cpu", "cuda"])
    parser.add_argument("--threads", default="1,4,8", help="FileSystemWriter thread_count values to try")
    option(parser, "repeats")
    option(parser, "dir", help="directory on the storage to measure (required to measure)")
    option(parser, "no_drop_caches", help="do not drop the page cache before loads")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Starts ``--ranks`` processes on this host (the children of :func:`_worker`); returns rank 0's document."""
    if not args.dir:
        raise UsageError("the following arguments are required: --dir")
    if args.backend == "nccl" and args.device != "cuda":
        raise UsageError("--backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
    os.makedirs(args.dir, exist_ok=True)
    results, error = spawn("dcp", args.argv, ranks=args.ranks, capture=False, group=True)
    if error:
        raise SystemExit(f"dcp benchmark: ranks failed ({error})")
    return results[0]


class _Rank:
    """This process's part of the group: its share of the state, and the seconds of each step (rank 0 prints them)."""

    def __init__(self, args: argparse.Namespace):
        self.device = torch.device("cpu")
        if args.device == "cuda":  # before the group: NCCL binds each rank to its current device
            self.device = torch.device("cuda", int(os.environ["RANK"]) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        dist.init_process_group(args.backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # random bf16 in tensors of `rows` x 4096, seeded by the rank
        generator = torch.Generator(device=self.device).manual_seed(1000 + self.rank)
        rows, left, self.state = max(1, args.tensor_size // (2 * 4096)), args.size // self.world, {}
        while left > 0:
            count = min(rows, max(1, left // (2 * 4096)))
            name = f"rank{self.rank}.tensor{len(self.state)}"
            self.state[name] = torch.randn(count, 4096, generator=generator, device=self.device, dtype=torch.bfloat16)
            left -= count * 4096 * 2
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.payload = sum(t.numel() * t.element_size() for t in self.state.values())
        totals = torch.tensor([self.payload], device=self.device if args.backend == "nccl" else "cpu")  # int64
        dist.all_reduce(totals)
        self.total = int(totals.item())
        self.dropper = CacheDropper(enabled=not args.no_drop_caches) if self.rank == 0 else None
        self.seconds: dict[str, list[float]] = {}

    def barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def fenced(self, function: Callable[[], Any]) -> tuple[Any, float]:
        """``function()``'s result, and its seconds from the barrier before it to the one after."""
        self.barrier()
        start = time.perf_counter()
        result = function()
        self.barrier()
        return result, time.perf_counter() - start

    def record(self, name: str, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)
        if self.rank == 0:
            print(f"  {name:<24} {self.total / seconds / _GB:7.2f} GB/s ({seconds:.2f} s)", flush=True)

    def drop_caches(self, path: str) -> str:
        return self.fenced(lambda: self.dropper.drop([path]) if self.dropper is not None else "")[0]

    def remove(self, path: str) -> None:
        self.fenced(lambda: measure.remove_path(path) if self.rank == 0 else None)

    def ceiling(self, path: str) -> None:
        """Raw O_DIRECT write and read of this rank's bytes, from and into aligned host memory."""
        buffer = memory.aligned_empty(self.payload, huge_pages=True)
        buffer.fill_(7)
        name = os.path.join(path, f"ceiling.{self.rank}")
        os.makedirs(path, exist_ok=True)
        handle = engine.make_handle(settings())
        write = self.fenced(lambda: bounds.engine_write(name, buffer, self.payload, handle, allocate=True))[1]
        self.drop_caches(path)
        read = self.fenced(lambda: bounds.engine_read(name, buffer, self.payload, handle))[1]
        self.remove(path)
        self.record("ceiling_write", write)
        self.record("ceiling_read", read)

    def save(self, dcp: Any, name: str, path: str, writer: Callable[[str], Any]) -> None:
        """A durable dcp.save to a fresh ``path`` through the storage writer ``writer(path)`` makes."""

        def save() -> None:
            dcp.save(self.state, storage_writer=writer(path))
            if self.rank == 0:
                measure.fsync_paths(path)

        self.remove(path)
        self.record(name, self.fenced(save)[1])

    def load(self, dcp: Any, name: str, reader: Any, check: bool) -> None:
        """A dcp.load into a preallocated state (compared with the saved one when ``check``)."""
        loaded = {k: torch.zeros_like(v) for k, v in self.state.items()}
        seconds = self.fenced(lambda: dcp.load(loaded, storage_reader=reader))[1]
        for key, tensor in self.state.items():
            if check and not torch.equal(loaded[key], tensor):
                raise AssertionError(f"{type(reader).__name__}: {key} differs after the round trip")
        self.record(name, seconds)


def _worker(args: argparse.Namespace) -> dict[str, Any] | None:
    """One rank's part: every repeat of every method, timed barrier to barrier; rank 0 returns the document."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from fastpersist.dcp import FastPersistReader, FastPersistWriter

    run = _Rank(args)
    durable = functools.partial(FileSystemWriter, sync_files=True)
    threads = [int(t) for t in str(args.threads).split(",") if t]
    filesystem = [
        (f"filesystem_writer[t={n}]", f"filesystem-t{n}", functools.partial(durable, thread_count=n)) for n in threads
    ]
    methods = [  # writers (name, directory, class) of which the last one's checkpoint is read back by a reader
        (filesystem, "filesystem_reader", FileSystemReader),
        ([("fastpersist_writer", "fastpersist", FastPersistWriter)], "fastpersist_reader", FastPersistReader),
    ]
    cache_modes = set()
    for repeat in range(args.repeats):
        if run.rank == 0:
            print(f"repeat {repeat + 1}/{args.repeats}: {run.total / _GB:.2f} GB over {run.world} ranks", flush=True)
        run.ceiling(os.path.join(args.dir, "ceiling"))
        for writers, name, reader in methods:
            for writer_name, directory, writer in writers:
                path = os.path.join(args.dir, directory)
                run.save(dcp, writer_name, path, writer)
                if directory != writers[-1][1]:
                    run.remove(path)
            cache_modes.add(run.drop_caches(path))
            run.load(dcp, name, reader(path), check=repeat == 0)
            run.remove(path)

    document = _document(args, run, sorted(m for m in cache_modes if m)) if run.rank == 0 else None
    run.barrier()
    dist.destroy_process_group()
    return document


def _document(args: argparse.Namespace, run: _Rank, cache_modes: list[str]) -> dict[str, Any]:
    results = {
        name: {"seconds": values, "GBps": measure.summarize([run.total / v / _GB for v in values])}
        for name, values in run.seconds.items()
    }
    median = {name: result["GBps"]["median"] for name, result in results.items()}
    best_writer = max((n for n in results if n.startswith("filesystem_writer")), key=median.get)
    ratios = {
        "save_vs_best_filesystem_writer": median["fastpersist_writer"] / median[best_writer],
        "save_vs_ceiling": median["fastpersist_writer"] / median["ceiling_write"],
        "best_filesystem_writer_vs_ceiling": median[best_writer] / median["ceiling_write"],
        "load_vs_filesystem_reader": median["fastpersist_reader"] / median["filesystem_reader"],
        "load_vs_ceiling": median["fastpersist_reader"] / median["ceiling_read"],
    }
    config = {"ranks": run.world, "backend": args.backend, "device": args.device, "total_bytes": run.total}
    config.update(tensor_size=args.tensor_size, tensors_per_rank=len(run.state), threads=args.threads)
    config.update(repeats=args.repeats, dir=os.path.abspath(args.dir), page_cache=cache_modes)
    return {
        "benchmark": "dcp",
        "machine": measure.machine_info(args.dir, str(run.device)),
        "config": config,
        "best_filesystem_writer": best_writer,
        "results": results,
        "ratios": ratios,
    }


def _text(document: dict[str, Any]) -> str:
    """The terminal's table: GB/s of every method (median, min-max), then the ratios."""
    config = document["config"]
    lines = [
        f"\n{config['total_bytes'] / _GB:.2f} GB, {config['ranks']} ranks ({config.get('backend', 'gloo')}), "
        f"{config['device']}, median of {config['repeats']} (min-max), GB/s"
    ]
    for name, result in document["results"].items():
        rates = result["GBps"]
        lines.append(f"  {name:<26} {rates['median']:7.2f}  ({rates['min']:.2f}-{rates['max']:.2f})")
    lines += [f"  {name:<40} {value:.2f}x" for name, value in document["ratios"].items()]
    return "\n".join(lines)


def render(documents: list[tuple[str, dict[str, Any]]]) -> str:
    """One table per document, under its path: GB/s and the ratio to the ceiling of the op."""
    parts = []
    for path, document in documents:
        config, results = document["config"], document["results"]
        parts.append(
            f"`{path}`: {config['total_bytes'] / 2**30:.2f} GiB, {config['ranks']} ranks, {config['device']}, "
            f"{config['repeats']} repeats, commit {document['machine']['code']['commit'][:12]}"
        )
        rows = []
        for method, value in results.items():
            if not (gbps := value.get("GBps")):
                continue
            ceiling = results.get("ceiling_read" if "read" in method else "ceiling_write", {}).get("GBps", {})
            ratio = gbps["median"] / ceiling["median"] if ceiling.get("median") else None
            cell = figure(ratio) + (" MEASUREMENT PROBLEM" if ratio is not None and ratio > 1.0 else "")
            rate = f"{gbps['median']:.2f} ({gbps['min']:.2f}-{gbps['max']:.2f})"
            rows.append([method.replace("|", "\\|"), rate, cell])
        parts += ["", *markdown_table(["method", "GB/s median (min-max)", "of ceiling"], "<>>", rows), ""]
    return "\n".join(parts)


BENCHMARK = Benchmark(
    "dcp",
    _options,
    _measure,
    None,
    description="dcp.save/dcp.load with FileSystemWriter/Reader vs FastPersistWriter/Reader, several ranks",
    show=_text,
    render=render,
    child=_worker,
)
main = BENCHMARK.main
