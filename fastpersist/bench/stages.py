"""Where a CUDA load's time goes: ``python -m fastpersist.bench stages [--source PATH | --sink] [--json OUT]``.

The load's ring (:func:`fastpersist.io.reader.stream_to_device`) with its stages added one at a time, against
``pread x 8`` / ``x 16`` (plain threads into the same buffers), from a file read buffered or ``/dev/zero``
(``--sink``); every CRC-32 stage's joined checksum must be the source's. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from fastpersist import config
from fastpersist.bench import bounds
from fastpersist.bench.harness import Benchmark, Rounds, UsageError, markdown_table, option, size
from fastpersist.bench.measure import code_version, machine_info
from fastpersist.io import checksum, engine, memory
from fastpersist.io.device_crc import DeviceCrc

__all__ = ["BENCHMARK", "main", "to_markdown"]

_SINK = "/dev/zero"
_STAGES = ("read", "read + CRC-32", "read + copy", "read + copy + CRC-32", "read + copy + device CRC-32")
_THREADS = (8, 16)


def _options(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--source", default=None, help="a file to read (its first --size bytes); kept")
    where.add_argument("--sink", action="store_true", help="read /dev/zero: the load pipeline without storage")
    option(p, "dir", help="where the fresh source file goes (default: the temporary directory)")
    option(p, "size", default=4 << 30, help="bytes per stage (default 4GiB)")
    p.add_argument("--window", type=size, default=None, help="default: read_buffer_size")
    p.add_argument("--slots", type=int, default=None, help="ring buffers (default: read_buffer_count)")
    option(p, "repeats", "--rounds", default=4, help="timed rounds after an untimed one, the stages alternating")
    p.add_argument("--no-cuda", action="store_true", help="leave out the copies even when a GPU is present")


def _write_source(directory: str, size: int) -> str:
    """A fresh file of ``size`` bytes (a random 64 MiB block repeated) in ``directory``."""
    path = os.path.join(directory, f".fastpersist-stages-{os.getpid()}.bin")
    block = os.urandom(64 << 20)
    with open(path, "wb") as out:
        for offset in range(0, size, len(block)):
            out.write(block[: min(len(block), size - offset)])
    return path


def _source_crc(path: str, size: int, buffer: torch.Tensor) -> int:
    """CRC-32 of the first ``size`` bytes ``path`` gives, read with plain reads."""
    view, crc = memoryview(buffer.numpy()), 0
    with open(path, "rb", buffering=0) as source:
        for offset in range(0, size, buffer.numel()):
            n = min(buffer.numel(), size - offset)
            if source.readinto(view[:n]) != n:
                raise OSError(f"{path}: short read at {offset}")
            crc = checksum.crc32(buffer.data_ptr(), n, crc)
    return crc


def _ring(path: str, windows: int, window: int, buffers: list, handles: list, device_memory, stream, stage: str):
    """Seconds for every window of ``path`` through ``stage`` on the ring, refilled from the calling thread in
    window order, and the joined CRC-32 when the stage has one; ``device_memory``: where the copies go."""
    count, copy_wanted, on_device = len(buffers), "copy" in stage, "device CRC-32" in stage
    crc_wanted = "CRC-32" in stage and not on_device
    sizes, tail = DeviceCrc.split(window)
    parts: list = []  # (part, length) in file order: CPU jobs, or device segments then a tail job
    checked: list = [None] * count  # per slot: an event after its last window's device CRC-32
    owed: collections.deque = collections.deque()  # (slot, event, crc job, next window), window order
    checker = None
    source = engine.File(path, "r", direct=False)

    def submit(slot: int, index: int) -> None:
        handles[slot].submit_read(buffers[slot].data_ptr(), window, source, index * window, buffers[slot])

    def done(_slot, event, job, _next) -> bool:
        return (event is None or event.query()) and (job is None or job.done())

    def settle(event, job) -> None:
        if event is not None:
            event.synchronize()
        if job is not None:
            job.wait()

    try:
        if on_device:
            checker = DeviceCrc(device_memory.device, windows * DeviceCrc.count(window))
        started = time.perf_counter()
        for slot in range(min(count, windows)):
            submit(slot, slot)
        for index in range(windows):
            slot = index % count
            while owed and (owed[0][0] == slot or done(*owed[0])):
                waited, event, job, following = owed.popleft()
                settle(event, job)
                submit(waited, following)
            handles[slot].wait()
            buffer, event, job = buffers[slot], None, None
            if crc_wanted:
                job = checksum.submit_crc32(buffer.data_ptr(), window, piece_size=window)
                parts.append((job, window))
            if copy_wanted:
                target = device_memory[slot * window : (slot + 1) * window]
                if checked[slot] is not None:
                    stream.wait_event(checked[slot])  # the slot's last CRC-32 has read it
                with torch.cuda.stream(stream):
                    target.copy_(buffer, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            if checker is not None:
                parts += zip(checker.queue(target, sizes, event), sizes)
                checked[slot] = torch.cuda.Event()
                checked[slot].record(checker.stream)
                if tail:
                    job = checksum.submit_crc32(buffer.data_ptr() + window - tail, tail, piece_size=window)
                    parts.append((job, tail))  # reads the buffer: the refill waits for it
            if index + count < windows:
                owed.append((slot, event, job, index + count))
            else:
                settle(event, job)
        if checker is not None:
            checker.values()  # waits for the device's checksums
        elapsed = time.perf_counter() - started
    finally:
        for handle in handles:
            with contextlib.suppress(OSError):  # the error being raised is the one that matters
                handle.wait()
        source.close()
        if checker is not None:
            checker.close()
    return elapsed, checksum.crc32_combine_all(parts) if "CRC-32" in stage else None


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    settings = config.settings()
    window = args.window or settings.read_buffer_size
    slots = args.slots or settings.read_buffer_count
    windows = args.size // window
    if windows < 1:
        raise UsageError(f"--size {args.size} is smaller than one window ({window} bytes)")
    if args.source and not os.path.isfile(args.source):
        raise UsageError(f"--source {args.source}: no such file")
    if args.dir and not os.path.isdir(args.dir):
        raise UsageError(f"--dir {args.dir}: no such directory")
    nbytes = windows * window
    device = torch.device("cuda") if torch.cuda.is_available() and not args.no_cuda else None
    stages = [s for s in _STAGES if device is not None or "copy" not in s]
    path = _SINK if args.sink else args.source
    if args.source and os.path.getsize(path) < nbytes:
        raise UsageError(f"{path} holds {os.path.getsize(path)} bytes, fewer than --size ({nbytes})")
    made = None if path else _write_source(args.dir or tempfile.gettempdir(), nbytes)
    path = path or made
    crc_checked: dict[str, bool] = {}
    # CUDA first: the pool registers its buffers for DMA only in a process that uses CUDA (else the
    # copies would run from pageable memory, at a fraction of the speed a load gets).
    target = torch.empty(slots * window, dtype=torch.uint8, device=device) if device is not None else None
    stream = torch.cuda.Stream(device) if device is not None else None
    try:
        with memory.lease_buffers(max(slots, max(_THREADS)), window, settings.huge_pages) as buffers:
            expected = _source_crc(path, nbytes, buffers[0])
            handles = [engine.make_handle(settings) for _ in range(slots)]
            ring = functools.partial(_ring, path, windows, window, buffers[:slots], handles, target, stream)

            def run(name: str, _round: int) -> float:
                if name.startswith("pread"):
                    threads = int(name.split()[-1])
                    return bounds.read_ceiling(path, threads, window, size=nbytes, buffers=buffers, direct=False)
                seconds, crc = ring(name)
                if crc is not None:
                    crc_checked[name] = crc_checked.get(name, True) and crc == expected
                return seconds

            names = stages + [f"pread x {t}" for t in _THREADS]
            rounds = Rounds(args.rounds, warmup=1, catch=False).run([names], run)
    finally:
        if made is not None:
            os.unlink(made)
    if not all(crc_checked.values()):
        raise RuntimeError(f"a stage's CRC-32 differs from the source's: {crc_checked}")
    results = []
    for name, seconds in rounds.samples.items():
        rates = [nbytes / s / 1e9 for s in seconds]
        gbps = {"gbps": statistics.median(rates), "gbps_min": min(rates), "gbps_max": max(rates)}
        results.append({"stage": name, **gbps, "seconds": seconds, "crc_checked": crc_checked.get(name)})
    return {
        "benchmark": "stages",
        "config": {
            "source": "sink (/dev/zero)" if args.sink else ("file" if args.source else "fresh file"),
            "path": None if made else path,
            "bytes": nbytes,
            "window_bytes": window,
            "slots": slots,
            "rounds": args.rounds,
            "device": str(device) if device else "cpu",
        },
        "settings": settings.as_dict(),
        "code": code_version(),
        "machine": machine_info(os.path.dirname(path) if not args.sink else None, "cuda" if device else "cpu"),
        "results": results,
    }


def to_markdown(document: dict[str, Any]) -> str:
    """The stages' GB/s, each against the ring's read alone."""
    c = document["config"]
    read = next((r["gbps"] for r in document["results"] if r["stage"] == "read"), None)
    lines = [
        f"{c['bytes'] / 1e9:.1f} GB from {c['source']}, ring of {c['slots']} x {c['window_bytes'] >> 20} MiB, "
        f"device {c['device']}, median of {c['rounds']} rounds",
        "",
        *markdown_table(["stage", "GB/s", "range", "of the ring's read alone"], "<>>>", []),
    ]
    for r in document["results"]:
        ratio = f"{r['gbps'] / read:.2f}" if read else "-"
        lines.append(f"| {r['stage']} | {r['gbps']:.1f} | {r['gbps_min']:.1f}-{r['gbps_max']:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


BENCHMARK = Benchmark("stages", _options, _measure, to_markdown, description=__doc__.split("\n")[0])
main = BENCHMARK.main
