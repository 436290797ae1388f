"""Ceilings: what the storage can do with no format at all, the upper bounds the other methods are compared with.

:class:`CeilingProbe` measures the storage ceiling independently of any save
path: the best of fio (when installed) and of the engine's single-request mode
(one request over the whole file, split by the engine into ``block_size``
chunks with ``queue_depth`` in flight) over a small grid of block sizes and
queue depths, plus, for reads, the in-flight depth loads use
(``read_buffer_count`` buffers of ``read_buffer_size``). Every file is written from
a random pattern in which each 4 KiB block carries its own index, fsync'ed
with its directory (as a save is), and every read is compared byte for byte
with the pattern (fio reads check fio's own per-block CRC32C headers), so a
misplaced or stale block fails the measurement instead of inflating it.

:class:`RawWrite` is an optional method: one ``os.write`` of all tensor bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import tempfile
import time
from typing import Any

import torch

from fastpersist import system
from fastpersist.bench import measure
from fastpersist.bench.methods.base import SaveMethod, register
from fastpersist.io import commit
from fastpersist.tensors import host_memoryview
from fastpersist.tuning import workloads

__all__ = [
    "Candidate",
    "CeilingProbe",
    "CeilingVerificationError",
    "RawWrite",
    "fio_command",
    "fio_job",
    "measure_ceiling",
]


class RawWrite(SaveMethod):
    """All tensor bytes in one file with os.write + fsync: no format at all; an upper bound for buffered writes."""

    name = "os.write"
    label = "raw os.write of all bytes + fsync (no format)"
    extension = ".bin"
    default = False

    def save(self, state, path, ctx):
        tensors, _ = workloads.flatten_state(state)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors.values():
                data = t.detach().reshape(-1).view(torch.uint8)
                if data.device.type != "cpu":
                    data = data.cpu()
                view = host_memoryview(data.contiguous())
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        return {}

    def read_back(self, path, state, ctx):
        tensors, _ = workloads.flatten_state(state)
        out: dict[str, torch.Tensor] = {}
        with open(path, "rb") as f:
            for key, t in tensors.items():
                raw = bytearray(f.read(t.numel() * t.element_size()))
                flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                out[key] = flat.view(t.dtype).reshape(t.shape).to(ctx.device)
            if f.read(1):
                raise ValueError("raw file is longer than the state")
        return out

    def flat(self, loaded):
        return dict(loaded), None


register(RawWrite())


# ---------------------------------------------------------------------------- storage ceiling

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
        return f"{self.tool} {self.block_size >> 20 or self.block_size >> 10}{'M' if self.block_size >= 1 << 20 else 'K'} QD{self.queue_depth}"

    def as_dict(self) -> dict[str, Any]:
        return {"tool": self.tool, "block_size": self.block_size, "queue_depth": self.queue_depth}


def fio_command(
    path: str,
    rw: str,
    size: int,
    block_size: int,
    queue_depth: int,
    *,
    direct: bool,
    threads: int = 1,
    fallocate: bool = True,
    verify: bool = True,
) -> list[str]:
    """The fio command line for one sequential job over ``path`` (io_uring; ``end_fsync`` for writes).

    With ``verify`` fio stamps every block with a CRC32C header when writing
    and checks it when reading, so a fio read is verified too.
    """
    fio = system.find_fio() or "fio"
    command = [
        fio,
        "--name=fastpersist-ceiling",
        f"--filename={path}",
        f"--rw={rw}",
        f"--bs={block_size}",
        f"--iodepth={queue_depth}",
        "--ioengine=io_uring",
        f"--direct={1 if direct else 0}",
        f"--size={size // threads}",
        f"--numjobs={threads}",
        "--group_reporting",
        "--output-format=json",
        f"--fallocate={'native' if fallocate else 'none'}",
    ]
    if threads > 1:
        command.append(f"--offset_increment={size // threads}")
    if verify:
        command += ["--verify=crc32c", "--do_verify=0"] if rw == "write" else ["--verify=crc32c"]
        command.append("--verify_state_save=0")  # else fio leaves a *-verify.state file in the working directory
    if rw == "write":
        command.append("--end_fsync=1")
    return command


def fio_job(command: list[str]) -> dict[str, Any]:
    """Runs fio (``--output-format=json``) and returns its first job's report.

    Raises:
        RuntimeError: fio failed (for reads with verification: a block did not verify).
    """
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"fio failed ({result.returncode}): {(result.stderr.strip() or result.stdout[-2000:])[:2000]}"
        )
    document = json.loads(result.stdout[result.stdout.index("{") :])
    return document["jobs"][0]


def run_fio(command: list[str], rw: str) -> float:
    """Runs fio and returns the job's bandwidth in bytes per second (its runtime includes end_fsync).

    Raises:
        RuntimeError: as :func:`fio_job`.
    """
    return float(fio_job(command)[rw]["bw_bytes"])


def _stamped_pattern(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-aligned random bytes in which every 4 KiB block starts with its own index."""
    from fastpersist.io import memory

    pattern = memory.aligned_empty(nbytes)
    chunk = 64 << 20
    noise = torch.randint(0, 256, (min(chunk, nbytes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    for start in range(0, nbytes, chunk):
        length = min(chunk, nbytes - start)
        pattern[start : start + length].copy_(noise[:length])
    blocks = nbytes // BLOCK
    if blocks:
        pattern[: blocks * BLOCK].view(torch.int64).view(blocks, BLOCK // 8)[:, 0] = torch.arange(blocks)
    return pattern


class CeilingProbe:
    """Writes and reads one file of ``nbytes`` in ``directory`` with any :class:`Candidate`.

    Args:
        directory: where to measure (a temporary subdirectory is made there).
        nbytes: the file size (rounded up to 4 KiB); two buffers of it are
            allocated (the pattern and the read destination).
        engine_name: the engine for the engine candidates (``auto`` by default).
        use_fio: measure fio candidates when fio is installed.

    Use as a context manager; :meth:`close` removes the files.
    """

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
        self.destination = memory.aligned_empty(self.nbytes)
        self.destination.fill_(0)
        self._engine = engine

    def __enter__(self) -> CeilingProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        measure.remove_path(self.workdir)

    def _path(self, tool: str) -> str:
        return os.path.join(self.workdir, f"{tool}.bin")

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
            # Blocks allocated inside fio's clock, as the engine candidates' fallocate and a save's are
            # (with fio's default layout its clock starts after the allocation).
            command = fio_command(
                path, "write", n, candidate.block_size, candidate.queue_depth, direct=self.direct, fallocate=False
            )
            seconds = n / run_fio(command, "write")
            start = time.perf_counter()
            commit.fsync_directory(self.workdir)
            return seconds + time.perf_counter() - start
        engine = self._engine
        handle = engine.IoHandle(
            block_size=candidate.block_size,
            queue_depth=candidate.queue_depth,
            engine=self.engine_name,
            direct=self.direct,
        )
        with engine.File(path, "w", direct=self.direct, truncate=True) as file:
            start = time.perf_counter()
            if file.direct:
                file.allocate(0, n)  # as a save reserves its blocks
            handle.submit_write(self.source.data_ptr(), n, file, 0, keepalive=self.source)
            handle.wait()
            file.fsync()
            commit.fsync_directory(self.workdir)
            return time.perf_counter() - start

    def read(self, candidate: Candidate, nbytes: int | None = None) -> float:
        """Reads the file :meth:`write` left (cold) and verifies every byte; returns the seconds of the read.

        Raises:
            CeilingVerificationError: the bytes read differ from those written.
            FileNotFoundError: nothing was written with this tool yet.
        """
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
        engine = self._engine
        handle = engine.IoHandle(
            block_size=candidate.block_size,
            queue_depth=candidate.queue_depth,
            engine=self.engine_name,
            direct=self.direct,
        )
        destination = self.destination[:n]
        with engine.File(path, "r", direct=self.direct) as file:
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
    write = dict(candidate.as_dict(), bytes=n, gbps=None, error=None)
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
    probe: CeilingProbe | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """The write and read ceilings of ``directory`` for a file of ``nbytes``.

    First every candidate of the grid writes and reads back ``min(nbytes,
    grid_bytes)``, in a seeded random order; then, ``passes`` times, the best
    engine and the best fio candidate of each operation write and read the
    full ``nbytes``. Every read is verified, which verifies the write before
    it; a sample that fails verification or raises has ``error`` set and never
    counts. The ceiling of an operation is the fastest full-size sample (an
    upper bound: the best any tool did on this storage in this run).

    Returns:
        ``{"bytes", "direct", "fio", "seed", "grid": {"write": [...], "read": [...]},
        "write": {"gbps", "best", "samples"}, "read": {...}}``.
    """
    progress = progress or (lambda _text: None)
    own = probe is None
    probe = probe or CeilingProbe(directory, nbytes, engine_name, use_fio)
    rng = random.Random(seed)
    try:
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
        finalists: list[Candidate] = []
        for op in ("write", "read"):
            for tool in ("engine", "fio"):
                best = _best([p for p in grid[op] if p["tool"] == tool])
                candidate = best and Candidate(tool, best["block_size"], best["queue_depth"])
                if candidate and candidate not in finalists:
                    finalists.append(candidate)
        samples: dict[str, list[dict[str, Any]]] = {"write": [], "read": []}
        for index in range(passes):
            rng.shuffle(finalists)
            for candidate in finalists:
                progress(f"ceiling: {candidate.label} ({index + 1}/{passes})")
                write, read = _write_and_read(probe, candidate, probe.nbytes)
                samples["write"].append(write)
                samples["read"].append(read)
        result: dict[str, Any] = {
            "bytes": probe.nbytes,
            "direct": probe.direct,
            "fio": {"path": probe.fio, "note": probe.fio_note},
            "seed": seed,
            "grid": grid,
        }
        for op in ("write", "read"):
            best = _best(samples[op])
            result[op] = {"gbps": best["gbps"] if best else None, "best": best, "samples": samples[op]}
        return result
    finally:
        if own:
            probe.close()
