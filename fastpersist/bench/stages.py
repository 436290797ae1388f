"""Where a CUDA load's time goes: ``python -m fastpersist.bench stages [--source PATH | --sink] [--json OUT]``.

The load's ring with its stages added one at a time: the reads alone (and with CRC-32) on a ring of their own
(:class:`fastpersist.io.ring.Ring`, refilled as a load's), the copies through the load's own
(:func:`fastpersist.io.reader.stream_to_device`), against ``pread x 8`` / ``x 16`` (plain threads into ring
buffers), from a file read buffered or ``/dev/zero`` (``--sink``); every CRC-32 stage's joined checksum must be
the source's. See docs/performance.md.
"""

from __future__ import annotations

import argparse
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
from fastpersist.io import checksum, engine, memory, reader, workers
from fastpersist.io.ring import Ring, Slot

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
    """CRC-32 of the first ``size`` bytes ``path`` gives, read with plain reads (a short one, as ``/dev/zero``
    may give into memory not yet touched, reads on)."""
    view, crc, offset = memoryview(buffer.numpy()), 0, 0
    with open(path, "rb", buffering=0) as source:
        while offset < size:
            got = source.readinto(view[: min(len(view), size - offset)])
            if not got:
                raise OSError(f"{path} ends at {offset} bytes, before {size}")
            crc = checksum.crc32(buffer.data_ptr(), got, crc)
            offset += got
    return crc


def _read(source, windows: int, window: int, ring: Ring, crc: bool) -> tuple[float, list]:
    """Seconds for every window of the native File ``source`` read through ``ring`` (``crc``: each checksummed on
    the CPU pool before its slot's refill, which a helper thread submits in window order, as a load's ring does)
    and the checksums' parts in file order."""
    parts: list = []

    def refill(slot: Slot, index: int) -> None:
        slot.wait_checksums()
        slot.submit_read(window, source, index * window)

    with workers.executor(1, "fastpersist-stages-refill") as refills:
        started = time.perf_counter()
        for slot in ring.slots[:windows]:
            slot.submit_read(window, source, slot.index * window)
        for index in range(windows):
            slot = ring.slot(index)
            slot.wait_stage()
            slot.wait_io()
            if crc:
                slot.checksums = [checksum.submit_crc32(slot.address, window, piece_size=window)]
                parts.append((slot.checksums[0], window))
            if index + len(ring.slots) < windows:
                slot.stage = refills.submit(refill, slot, index + len(ring.slots))
    ring.wait_idle()
    return time.perf_counter() - started, parts


def _stage(path: str, nbytes: int, window: int, settings, handles: list, target, stage: str) -> tuple[float, Any]:
    """Seconds for ``nbytes`` of ``path`` through ``stage`` and its joined CRC-32 (None without one): the read
    stages on a ring of their own, the copy stages through the load's (:func:`reader.stream_to_device`)."""
    crc = "CRC-32" in stage
    source = engine.File(path, "r", direct=False)
    try:  # closed once nothing reads it: after the ring's block (it drains on an error) or the load's ring
        if "copy" not in stage:
            with Ring(handles, window, huge_pages=settings.huge_pages) as ring:
                seconds, parts = _read(source, nbytes // window, window, ring, crc)
            return seconds, checksum.crc32_combine_all(parts) if crc else None
        on_device = "always" if "device" in stage else "never"
        chosen = settings.replace(read_buffer_size=window, read_buffer_count=len(handles), device_checksum=on_device)
        started = time.perf_counter()
        (value,) = reader.stream_to_device([(source, 0, nbytes, target)], chosen, verify=crc, handles=handles)
        return time.perf_counter() - started, value if crc else None
    finally:
        source.close()


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
    target = torch.empty(nbytes, dtype=torch.uint8, device=device) if device is not None else None
    handles = [engine.make_handle(settings) for _ in range(slots)]
    try:
        expected = _source_crc(path, nbytes, memory.aligned_empty(window))

        def run(name: str, _round: int) -> float:
            if name.startswith("pread"):  # plain threads into the ring's buffers
                with Ring([None] * max(_THREADS), window, huge_pages=settings.huge_pages) as ring:
                    buffers = [slot.buffer for slot in ring.slots]
                    threads = int(name.split()[-1])
                    return bounds.read_ceiling(path, threads, window, size=nbytes, buffers=buffers, direct=False)
            seconds, crc = _stage(path, nbytes, window, settings, handles, target, name)
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
