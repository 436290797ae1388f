"""``python -m fastpersist.bench dcp``: torch.distributed.checkpoint with FileSystemWriter vs FastPersistWriter.

Starts ``--ranks`` processes (a process group on this host: gloo, or NCCL
with ``--backend nccl``, one GPU per rank); each rank holds its own share of
a ``--size`` state (bf16 tensors of ``--tensor-size`` on ``--device``; with
CUDA, rank r uses GPU ``r % device_count``) and every
repeat times, in this order, barrier to barrier on rank 0:

* ``ceiling_write``: each rank writes its share of bytes from page-aligned
  host memory with the native engine (O_DIRECT, queue depth), fsync -- what
  the storage can take in this run;
* ``filesystem_writer[t=N]``: durable ``dcp.save`` with DCP's
  ``FileSystemWriter(thread_count=N, sync_files=True)``, for each N of
  ``--threads`` (thread_count tuned);
* ``fastpersist_writer``: durable ``dcp.save`` with ``FastPersistWriter``;
* ``ceiling_read``, ``filesystem_reader``, ``fastpersist_reader``: the loads,
  after dropping the page cache, into a preallocated state on ``--device``
  (FileSystemReader reads the checkpoint of the last thread count).

Every save ends with an fsync of all its files and directories (a no-op for
files the method already synced). Loads are compared with the saved state on
the first repeat. Reported: GB/s (10^9 bytes of tensor payload over all
ranks per second), median/min/max over repeats, and the ratios against the
best FileSystemWriter/Reader and against the ceiling of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["build_parser", "main"]

_GB = 1e9


def _size(text: str) -> int:
    from fastpersist.config import size_argument  # the one size syntax (binary units)

    return size_argument(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastpersist.bench dcp",
        description="dcp.save/dcp.load with FileSystemWriter/Reader vs FastPersistWriter/Reader, several ranks",
    )
    parser.add_argument("--ranks", type=int, default=2, help="processes (one process group on this host)")
    parser.add_argument(
        "--backend",
        default="gloo",
        choices=["gloo", "nccl"],
        help="process group backend (nccl needs --device cuda and a GPU per rank)",
    )
    parser.add_argument(
        "--size",
        type=_size,
        default=_size("4G"),
        help="total state bytes over all ranks",
    )
    parser.add_argument("--tensor-size", type=_size, default=_size("64M"), help="bytes per tensor")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", default="1,4,8", help="FileSystemWriter thread_count values to try")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", required=True, help="directory on the storage to measure")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--no-drop-caches",
        action="store_true",
        help="do not drop the page cache before loads",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
    if args.worker:
        return _worker(args)
    return _launch(args, argv if argv is not None else sys.argv[1:])


# ----------------------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    os.makedirs(args.dir, exist_ok=True)
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(args.ranks),
    )
    command = [sys.executable, "-m", "fastpersist.bench.dcp", *argv, "--worker"]
    processes = [subprocess.Popen(command, env=dict(env, RANK=str(rank))) for rank in range(args.ranks)]
    codes = [p.wait() for p in processes]
    if any(codes):
        print(f"dcp benchmark: ranks exited with {codes}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- worker


class _Run:
    def __init__(self, args: argparse.Namespace):
        import torch
        import torch.distributed as dist

        self.args = args
        self.torch = torch
        self.dist = dist
        if args.device == "cuda":  # before the group: NCCL binds each rank to its current device
            self.device = torch.device("cuda", int(os.environ["RANK"]) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(args.backend)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.state = self._make_state()
        self.payload = sum(t.numel() * t.element_size() for t in self.state.values())
        totals = torch.tensor(
            [self.payload], dtype=torch.int64, device=self.device if args.backend == "nccl" else "cpu"
        )
        dist.all_reduce(totals)
        self.total = int(totals.item())
        from fastpersist.system import CacheDropper

        self.dropper = CacheDropper(enabled=not args.no_drop_caches) if self.rank == 0 else None

    def _make_state(self) -> dict:
        torch = self.torch
        share = self.args.size // self.world
        columns = 4096
        rows = max(1, self.args.tensor_size // (2 * columns))
        generator = torch.Generator(device=self.device).manual_seed(1000 + self.rank)
        state, left, index = {}, share, 0
        while left > 0:
            count = min(rows, max(1, left // (2 * columns)))
            state[f"rank{self.rank}.tensor{index}"] = torch.randn(
                count,
                columns,
                generator=generator,
                device=self.device,
                dtype=torch.bfloat16,
            )
            left -= count * columns * 2
            index += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return state

    def barrier(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        self.dist.barrier()

    def timed(self, function) -> float:
        self.barrier()
        start = time.perf_counter()
        function()
        self.barrier()
        return time.perf_counter() - start

    def drop_caches(self, path: str) -> str:
        self.barrier()
        mode = self.dropper.drop([path]) if self.dropper is not None else ""
        self.barrier()
        return mode

    def remove(self, path: str) -> None:
        from fastpersist.bench.measure import remove_path

        self.barrier()
        if self.rank == 0:
            remove_path(path)
        self.barrier()

    def blank(self) -> dict:
        return {k: self.torch.zeros_like(v) for k, v in self.state.items()}

    def check(self, loaded: dict, what: str) -> None:
        for key, tensor in self.state.items():
            if not self.torch.equal(loaded[key], tensor):
                raise AssertionError(f"{what}: {key} differs after the round trip")


def _durable(path: str, rank: int) -> None:
    from fastpersist.bench.measure import fsync_paths

    if rank == 0:
        fsync_paths(path)


def _ceiling(run: _Run, path: str) -> tuple[float, float]:
    """Raw O_DIRECT write and read of each rank's share of bytes, from and into aligned host memory."""
    from fastpersist import config
    from fastpersist.io import engine, memory

    settings = config.settings()
    buffer = memory.aligned_empty(run.payload, huge_pages=True)
    buffer.fill_(7)
    name = os.path.join(path, f"ceiling.{run.rank}")
    os.makedirs(path, exist_ok=True)

    def write() -> None:
        file = engine.File(name, "w", direct=True, truncate=True)
        try:
            if file.direct:
                file.allocate(0, run.payload)
            handle = engine.make_handle(settings)
            handle.submit_write(buffer.data_ptr(), run.payload, file, 0, buffer)
            handle.wait()
            file.fsync()
        finally:
            file.close()

    def read() -> None:
        file = engine.File(name, "r", direct=True)
        try:
            handle = engine.make_handle(settings)
            handle.submit_read(buffer.data_ptr(), run.payload, file, 0, buffer)
            handle.wait()
        finally:
            file.close()

    seconds_write = run.timed(write)
    run.drop_caches(path)
    seconds_read = run.timed(read)
    run.remove(path)
    return seconds_write, seconds_read


def _timed_load(run: _Run, dcp, reader, *, check: bool) -> float:
    """Seconds of a dcp.load into a preallocated state (checked against the saved one when ``check``)."""
    loaded = run.blank()
    seconds = run.timed(lambda: dcp.load(loaded, storage_reader=reader))
    if check:
        run.check(loaded, type(reader).__name__)
    return seconds


def _worker(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from fastpersist.dcp import FastPersistReader, FastPersistWriter

    run = _Run(args)
    threads = [int(t) for t in str(args.threads).split(",") if t]
    seconds: dict[str, list[float]] = {}
    cache_modes = set()

    def record(name: str, value: float) -> None:
        seconds.setdefault(name, []).append(value)
        if run.rank == 0:
            print(
                f"  {name:<24} {run.total / value / _GB:7.2f} GB/s ({value:.2f} s)",
                flush=True,
            )

    for repeat in range(args.repeats):
        if run.rank == 0:
            print(
                f"repeat {repeat + 1}/{args.repeats}: {run.total / _GB:.2f} GB over {run.world} ranks",
                flush=True,
            )
        write, read = _ceiling(run, os.path.join(args.dir, "ceiling"))
        record("ceiling_write", write)
        record("ceiling_read", read)

        for count in threads:
            path = os.path.join(args.dir, f"filesystem-t{count}")
            run.remove(path)

            def save_theirs(path=path, count=count) -> None:
                dcp.save(
                    run.state,
                    storage_writer=FileSystemWriter(path, thread_count=count, sync_files=True),
                )
                _durable(path, run.rank)

            record(f"filesystem_writer[t={count}]", run.timed(save_theirs))
            if count != threads[-1]:
                run.remove(path)
        path = os.path.join(args.dir, f"filesystem-t{threads[-1]}")
        cache_modes.add(run.drop_caches(path))
        record(
            "filesystem_reader",
            _timed_load(run, dcp, FileSystemReader(path), check=repeat == 0),
        )
        run.remove(path)

        path = os.path.join(args.dir, "fastpersist")
        run.remove(path)

        def save_ours(path=path) -> None:
            dcp.save(run.state, storage_writer=FastPersistWriter(path))
            _durable(path, run.rank)

        record("fastpersist_writer", run.timed(save_ours))
        cache_modes.add(run.drop_caches(path))
        record(
            "fastpersist_reader",
            _timed_load(run, dcp, FastPersistReader(path), check=repeat == 0),
        )
        run.remove(path)

    if run.rank == 0:
        document = _document(args, run, seconds, sorted(m for m in cache_modes if m))
        _print_table(document)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(document, f, indent=2)
            print(f"results written to {args.json}")
    run.barrier()
    run.dist.destroy_process_group()
    return 0


def _document(args, run: _Run, seconds: dict[str, list[float]], cache_modes: list[str]) -> dict[str, Any]:
    from fastpersist.bench.measure import machine_info, summarize

    results = {}
    for name, values in seconds.items():
        rates = [run.total / v / _GB for v in values]
        results[name] = {"seconds": values, "GBps": summarize(rates)}

    def median(name: str) -> float:
        return results[name]["GBps"]["median"]

    writers = [n for n in results if n.startswith("filesystem_writer")]
    best_writer = max(writers, key=median)
    ratios = {
        "save_vs_best_filesystem_writer": median("fastpersist_writer") / median(best_writer),
        "save_vs_ceiling": median("fastpersist_writer") / median("ceiling_write"),
        "best_filesystem_writer_vs_ceiling": median(best_writer) / median("ceiling_write"),
        "load_vs_filesystem_reader": median("fastpersist_reader") / median("filesystem_reader"),
        "load_vs_ceiling": median("fastpersist_reader") / median("ceiling_read"),
    }
    return {
        "benchmark": "dcp",
        "machine": machine_info(args.dir, str(run.device)),
        "config": {
            "ranks": run.world,
            "backend": args.backend,
            "device": args.device,
            "total_bytes": run.total,
            "tensor_size": args.tensor_size,
            "tensors_per_rank": len(run.state),
            "threads": args.threads,
            "repeats": args.repeats,
            "dir": os.path.abspath(args.dir),
            "page_cache": cache_modes,
        },
        "best_filesystem_writer": best_writer,
        "results": results,
        "ratios": ratios,
    }


def _print_table(document: dict[str, Any]) -> None:
    config = document["config"]
    print(
        f"\n{config['total_bytes'] / _GB:.2f} GB, {config['ranks']} ranks ({config.get('backend', 'gloo')}), "
        f"{config['device']}, "
        f"median of {config['repeats']} (min-max), GB/s"
    )
    for name, result in document["results"].items():
        rates = result["GBps"]
        print(f"  {name:<26} {rates['median']:7.2f}  ({rates['min']:.2f}-{rates['max']:.2f})")
    for name, value in document["ratios"].items():
        print(f"  {name:<40} {value:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
