"""The storage ceiling: what the storage does with no format at all, the upper bound each method is compared with.

The best of fio (when installed) and the engine over a grid of block sizes and queue depths. Every read is
verified against the pattern written (4 KiB blocks stamped with their index; fio checks its CRC32C headers):
a misplaced or stale block fails the measurement instead of inflating it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import tempfile
import time
from typing import Any

import torch

from fastpersist import system
from fastpersist.bench import measure
from fastpersist.bench.bounds import fio_command, run_fio
from fastpersist.io import commit

__all__ = ["Candidate", "CeilingProbe", "CeilingVerificationError", "measure_ceiling"]

GRID_BLOCK_SIZES = (1 << 20, 16 << 20)
GRID_QUEUE_DEPTHS = (8, 32)
BLOCK = 4096


class CeilingVerificationError(RuntimeError):
    """A ceiling read returned other bytes than were written: the figure would be meaningless."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way of moving the bytes: ``tool`` (``engine`` or ``fio``) with a block size and queue depth."""

    tool: str
    block_size: int
    queue_depth: int

    @property
    def label(self) -> str:
        size = f"{self.block_size >> 20}M" if self.block_size >= 1 << 20 else f"{self.block_size >> 10}K"
        return f"{self.tool} {size} QD{self.queue_depth}"


def _stamped_pattern(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-aligned random bytes in which every 4 KiB block starts with its own index."""
    from fastpersist.io import memory

    pattern = memory.aligned_empty(nbytes)
    chunk = 64 << 20
    noise = torch.randint(0, 256, (min(chunk, nbytes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    for start in range(0, nbytes, chunk):
        pattern[start : start + chunk].copy_(noise[: min(chunk, nbytes - start)])
    blocks = nbytes // BLOCK
    pattern[: blocks * BLOCK].view(torch.int64).view(blocks, BLOCK // 8)[:, 0] = torch.arange(blocks)
    return pattern


class CeilingProbe(contextlib.AbstractContextManager):
    """Writes and reads one file of ``nbytes`` (rounded up to 4 KiB) in a temporary directory of ``directory``
    with any :class:`Candidate` (fio ones where installed and ``use_fio``); its files are removed on exit."""

    def __init__(self, directory: str, nbytes: int, engine_name: str = "auto", use_fio: bool = True):
        from fastpersist.io import engine, memory

        self.nbytes = max(BLOCK, -(-nbytes // BLOCK) * BLOCK)
        self.engine_name = engine_name
        self.fio = system.find_fio() if use_fio else None
        self.fio_note = None if self.fio or not use_fio else system.FIO_INSTALL_HINT
        self.workdir = tempfile.mkdtemp(prefix=".fastpersist-ceiling-", dir=directory)
        self.direct = bool(engine.probe_directory(self.workdir)["direct"])
        self.dropper = system.CacheDropper()
        self.source = _stamped_pattern(self.nbytes)
        self.destination = memory.aligned_empty(self.nbytes).fill_(0)
        self._engine = engine

    def __exit__(self, *exc: object) -> None:
        measure.remove_path(self.workdir)

    def _path(self, tool: str) -> str:
        return os.path.join(self.workdir, f"{tool}.bin")

    def _handle(self, candidate: Candidate) -> Any:
        knobs = {"block_size": candidate.block_size, "queue_depth": candidate.queue_depth}
        return self._engine.IoHandle(**knobs, engine=self.engine_name, direct=self.direct)

    def candidates(self, op: str, read_buffers: tuple[int, int] | None = None) -> list[Candidate]:
        """The grid for ``op``: engine (and fio) at every block size x queue depth; reads also at ``read_buffers``
        (``(read_buffer_size, read_buffer_count)``, the depth CUDA loads keep in flight)."""
        tools = ["engine"] + (["fio"] if self.fio else [])
        points = [(b, q) for b in GRID_BLOCK_SIZES for q in GRID_QUEUE_DEPTHS]
        if op == "read" and read_buffers and read_buffers not in points:
            points.append(read_buffers)
        return [Candidate(tool, b, q) for tool in tools for b, q in points]

    def write(self, candidate: Candidate, nbytes: int | None = None) -> float:
        """Writes the pattern durably (data, then the directory); returns the seconds it took."""
        n = self.nbytes if nbytes is None else nbytes
        path = self._path(candidate.tool)
        measure.remove_path(path)
        if candidate.tool == "fio":
            # Blocks allocated inside fio's clock, as the engine candidates' and a save's are (with fio's
            # default layout its clock starts after the allocation).
            command = fio_command(
                path, "write", n, candidate.block_size, candidate.queue_depth, direct=self.direct, fallocate=False
            )
            seconds = n / run_fio(command, "write")
            start = time.perf_counter()
            commit.fsync_directory(self.workdir)
            return seconds + time.perf_counter() - start
        handle = self._handle(candidate)
        with self._engine.File(path, "w", direct=self.direct, truncate=True) as file:
            start = time.perf_counter()
            if file.direct:
                file.allocate(0, n)  # as a save reserves its blocks
            handle.submit_write(self.source.data_ptr(), n, file, 0, keepalive=self.source)
            handle.wait()
            file.fsync()
            commit.fsync_directory(self.workdir)
            return time.perf_counter() - start

    def read(self, candidate: Candidate, nbytes: int | None = None) -> float:
        """Reads the file :meth:`write` left, cold, and verifies every byte (CeilingVerificationError if one
        differs); returns the seconds of the read."""
        n = self.nbytes if nbytes is None else nbytes
        path = self._path(candidate.tool)
        if os.path.getsize(path) < n:
            raise CeilingVerificationError(f"{path} has {os.path.getsize(path)} bytes, expected {n}")
        self.dropper.drop([path])
        if candidate.tool == "fio":
            command = fio_command(path, "read", n, candidate.block_size, candidate.queue_depth, direct=self.direct)
            try:
                return n / run_fio(command, "read")
            except RuntimeError as e:
                raise CeilingVerificationError(f"fio's verified read failed: {e}") from e
        handle = self._handle(candidate)
        destination = self.destination[:n]
        with self._engine.File(path, "r", direct=self.direct) as file:
            start = time.perf_counter()
            handle.submit_read(destination.data_ptr(), n, file, 0, keepalive=destination)
            handle.wait()
            seconds = time.perf_counter() - start
        if not torch.equal(destination, self.source[:n]):
            index = int((destination != self.source[:n]).nonzero()[0])
            raise CeilingVerificationError(f"{candidate.label}: byte {index} read back differs from the one written")
        destination.fill_(0)  # the next read must put every byte there again
        return seconds


def _best(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [p for p in points if p.get("gbps")]
    return max(ok, key=lambda p: p["gbps"]) if ok else None


def _write_and_read(probe: CeilingProbe, candidate: Candidate, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A write then a verified read of the same file; the read's check verifies the write too."""
    write = dict(dataclasses.asdict(candidate), bytes=n, gbps=None, error=None)
    read = dict(write)
    try:
        write_seconds = probe.write(candidate, n)
        read_seconds = probe.read(candidate, n)
        write["gbps"], read["gbps"] = n / write_seconds / 1e9, n / read_seconds / 1e9
    except (OSError, RuntimeError) as e:
        write["error"] = read["error"] = f"{type(e).__name__}: {e}"[:500]
    return write, read


def measure_ceiling(
    directory: str,
    nbytes: int,
    *,
    engine_name: str = "auto",
    use_fio: bool = True,
    read_buffers: tuple[int, int] | None = None,
    grid_bytes: int = 1 << 30,
    passes: int = 1,
    seed: int = 0,
    progress: Any = None,
) -> dict[str, Any]:
    """The write and read ceilings of ``directory`` for a file of ``nbytes``.

    Every candidate of the grid moves ``min(nbytes, grid_bytes)``, in a seeded random order; then, ``passes``
    times, the best engine and fio candidates of each operation move ``nbytes``. A sample that fails
    verification or raises has ``error`` set and never counts; an operation's ceiling is its fastest
    full-size sample. Returns ``{"bytes", "direct", "fio", "seed", "grid": {"write": [...], "read": [...]},
    "write": {"gbps", "best", "samples"}, "read": {...}}``.
    """
    progress = progress or (lambda _text: None)
    rng = random.Random(seed)
    with CeilingProbe(directory, nbytes, engine_name, use_fio) as probe:
        grid_n = min(probe.nbytes, max(BLOCK, -(-grid_bytes // BLOCK) * BLOCK))
        writes, reads = probe.candidates("write"), probe.candidates("read", read_buffers)
        order = writes + [c for c in reads if c not in writes]
        rng.shuffle(order)
        grid: dict[str, list[dict[str, Any]]] = {"write": [], "read": []}
        for candidate in order:
            progress(f"ceiling grid: {candidate.label}")
            write, read = _write_and_read(probe, candidate, grid_n)
            if candidate in writes:
                grid["write"].append(write)
            if candidate in reads:
                grid["read"].append(read)
        bests = [_best([p for p in grid[op] if p["tool"] == tool]) for op in grid for tool in ("engine", "fio")]
        finalists = list(dict.fromkeys(Candidate(b["tool"], b["block_size"], b["queue_depth"]) for b in bests if b))
        samples: dict[str, list[dict[str, Any]]] = {"write": [], "read": []}
        for index in range(passes):
            rng.shuffle(finalists)
            for candidate in finalists:
                progress(f"ceiling: {candidate.label} ({index + 1}/{passes})")
                write, read = _write_and_read(probe, candidate, probe.nbytes)
                samples["write"].append(write)
                samples["read"].append(read)
        fio = {"path": probe.fio, "note": probe.fio_note}
        result = {"bytes": probe.nbytes, "direct": probe.direct, "fio": fio, "seed": seed, "grid": grid}
        for op in ("write", "read"):
            best = _best(samples[op])
            result[op] = {"gbps": best["gbps"] if best else None, "best": best, "samples": samples[op]}
        return result
