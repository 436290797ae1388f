"""What this machine allows, measured in the same run: the bounds the benchmarks print next to each figure.

Each moves the same bytes with no format and no bookkeeping (docs/performance.md); the engine's and fio's raw
transfers are here too. The checkpoint benchmark's storage ceiling (:func:`measure_ceiling`) is the best of fio
(when installed) and the engine over a grid of block sizes and queue depths, every read verified against the
pattern written (4 KiB blocks stamped with their index; fio checks its CRC32C headers): a misplaced or stale block
fails the measurement instead of inflating it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from typing import Any

import torch

from fastpersist import system
from fastpersist.bench.harness import timed
from fastpersist.io import checksum, commit, engine, memory
from fastpersist.tuning.measure import remove_path

__all__ = [
    "CopyCeiling",
    "engine_read",
    "engine_write",
    "file_problem",
    "fio_command",
    "fio_job",
    "fio_write_seconds",
    "fsync_file",
    "preallocate",
    "read_ceiling",
    "run_fio",
    "shared_write_ceiling",
    "takes_o_direct",
    "write_ceiling",
    "Candidate",
    "CeilingProbe",
    "CeilingVerificationError",
    "measure_ceiling",
]

_BLOCK = 8 << 20
_THREADS = 8


def takes_o_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs: usually not)."""
    probe = os.path.join(directory, f".fastpersist-direct-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preallocate(path: str, nbytes: int, direct: bool = True) -> None:
    """A fresh ``path`` of ``nbytes`` with its blocks allocated, as fio lays out a file before its clock starts."""
    remove_path(path)
    with engine.File(path, "w", direct=direct, truncate=True) as f:
        f.allocate(0, nbytes)


def engine_write(
    path: str, buffer: torch.Tensor, nbytes: int, handle: Any, *, direct: bool = True, allocate: bool = False
) -> None:
    """The first ``nbytes`` of page-aligned ``buffer`` written into ``path`` by the engine's ``handle``, fsync'ed
    (``allocate``: the file's blocks allocated first, inside the call, where O_DIRECT works)."""
    with engine.File(path, "w", direct=direct) as f:
        if allocate and f.direct:
            f.allocate(0, nbytes)
        handle.submit_write(buffer.data_ptr(), nbytes, f, 0, keepalive=buffer)
        handle.wait()
        f.fsync()


def engine_read(path: str, buffer: torch.Tensor, nbytes: int, handle: Any, *, direct: bool = True) -> None:
    """The first ``nbytes`` of ``path`` read into page-aligned host ``buffer`` by the engine's ``handle``."""
    with engine.File(path, "r", direct=direct) as f:
        handle.submit_read(buffer.data_ptr(), nbytes, f, 0, keepalive=buffer)
        handle.wait()


def file_problem(path: str, expected: torch.Tensor) -> str | None:
    """Compares the file's bytes with ``expected`` (read through the page cache, 64 MiB at a time)."""
    size, actual, step = expected.numel(), os.path.getsize(path), 64 << 20
    if actual != size:
        return f"{path} has {actual} bytes, expected {size}"
    with open(path, "rb") as f:
        for offset in range(0, size, step):
            chunk = torch.frombuffer(bytearray(f.read(step)), dtype=torch.uint8)
            if not torch.equal(chunk, expected[offset : offset + len(chunk)]):
                return f"{path} differs from the bytes written in [{offset}, {offset + len(chunk)})"
    return None


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
    """fio's command line for one sequential job over ``path`` (io_uring; ``end_fsync`` for writes); ``verify``:
    fio stamps every block with a CRC32C header when writing and checks it when reading."""
    fio = system.find_fio() or "fio"
    command = [fio, "--name=fastpersist-ceiling", f"--filename={path}", f"--rw={rw}", f"--bs={block_size}"]
    command += [f"--iodepth={queue_depth}", "--ioengine=io_uring", f"--direct={1 if direct else 0}"]
    command += [f"--size={size // threads}", f"--numjobs={threads}", "--group_reporting", "--output-format=json"]
    command.append(f"--fallocate={'native' if fallocate else 'none'}")
    command += [f"--offset_increment={size // threads}"] if threads > 1 else []
    if verify:
        command += ["--verify=crc32c", "--do_verify=0"] if rw == "write" else ["--verify=crc32c"]
        command.append("--verify_state_save=0")  # else fio leaves a *-verify.state file in the working directory
    if rw == "write":
        command.append("--end_fsync=1")
    return command


def fio_job(command: list[str]) -> dict[str, Any]:
    """Runs fio: its first job's report; RuntimeError when fio failed (a verified read: a block did not verify)."""
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        problem = (result.stderr.strip() or result.stdout[-2000:])[:2000]
        raise RuntimeError(f"fio failed ({result.returncode}): {problem}")
    return json.loads(result.stdout[result.stdout.index("{") :])["jobs"][0]


def run_fio(command: list[str], rw: str) -> float:
    """Runs fio: the job's bandwidth in bytes per second (its runtime includes end_fsync)."""
    return float(fio_job(command)[rw]["bw_bytes"])


def fio_write_seconds(path: str, nbytes: int) -> float:
    """Seconds fio takes to write a fresh ``path`` of ``nbytes``: 16 MiB blocks, QD 32, O_DIRECT where it
    works, blocks allocated inside the clock (as a save's are), end_fsync. RuntimeError when fio failed."""
    size = max(-(-nbytes // (16 << 20)) * (16 << 20), 16 << 20)
    remove_path(path)  # a fresh file each time, like a checkpoint (overwriting blocks is faster)
    direct = takes_o_direct(os.path.dirname(path) or ".")
    job = fio_job(fio_command(path, "write", size, 16 << 20, 32, direct=direct, fallocate=False, verify=False))
    return (job["job_runtime"] / 1000.0) * nbytes / size  # scaled to the checkpoint's bytes


def _pattern_and_flags(directory: str) -> tuple[memoryview, int]:
    source = memory.aligned_empty(_BLOCK)
    source.fill_(7)
    direct = os.O_DIRECT if takes_o_direct(directory) else 0
    return memoryview(source.numpy()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct


def _pwrite_file(path: str, view: memoryview, nbytes: int, flags: int, threads: int = 1) -> None:
    """``nbytes`` (rounded up to 8 MiB blocks) of ``view`` written into ``path`` by ``threads``, then fsync."""
    fd = os.open(path, flags, 0o600)
    try:
        offsets = range(0, -(-nbytes // _BLOCK) * _BLOCK, _BLOCK)
        if threads == 1:
            for offset in offsets:
                os.pwrite(fd, view, offset)
        else:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda offset: os.pwrite(fd, view, offset), offsets))
        os.fsync(fd)
    finally:
        os.close(fd)


def write_ceiling(directory: str, nbytes: int, repeats: int = 3, in_a_row: int = 0) -> dict[str, Any]:
    """Seconds to write ``nbytes`` into a fresh file of ``directory`` (+ fsync) at the storage's best: ``pwrite-1``,
    ``pwrite-8`` (threads writing 8 MiB blocks, O_DIRECT where it works), ``fio`` (if installed), each the median of
    ``repeats``, the previous file deleted and synced first. Then ``in_a_row`` files the faster pwrite way, as every
    iteration's checkpoint replaces the last: a thread frees each file once the next is written (discarding freed
    blocks costs disk time). ``in_a_row_s``: each write; ``sustained_s``: the row's time per file, freeing included."""
    nbytes = max(nbytes, 1 << 20)
    path = os.path.join(directory, f".fastpersist-ceiling-{os.getpid()}.bin")
    view, flags = _pattern_and_flags(directory)

    def pwrite(threads: int, target: str = path) -> float:
        if target == path and os.path.exists(path):
            os.unlink(path)
            os.sync()
        return timed(lambda: _pwrite_file(target, view, nbytes, flags, threads))[1]["seconds"]

    ways: dict[str, float] = {}
    row: list[float] = []
    try:
        for name, threads in (("pwrite-1", 1), ("pwrite-8", _THREADS)):
            ways[name] = statistics.median(pwrite(threads) for _ in range(repeats))
        if system.find_fio():
            with contextlib.suppress(RuntimeError, OSError, ValueError):
                ways["fio"] = statistics.median(fio_write_seconds(path, nbytes) for _ in range(repeats))
        remove_path(path)
        threads = 1 if ways["pwrite-1"] <= ways["pwrite-8"] else _THREADS
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(1) as freeing:
            for k in range(in_a_row):
                row.append(pwrite(threads, f"{path}.{k}"))
                if k:
                    freeing.submit(remove_path, f"{path}.{k - 1}")
        sustained = (time.perf_counter() - started) / max(in_a_row, 1)
    finally:
        for stale in [path, *(f"{path}.{k}" for k in range(in_a_row))]:
            remove_path(stale)
    best = min(ways, key=ways.get)
    result = {"bytes": nbytes, "direct": bool(flags & os.O_DIRECT), "seconds": ways, "best": best, "best_s": ways[best]}
    if row:
        result.update(in_a_row=f"pwrite-{threads}", in_a_row_s=row, sustained_s=sustained)
    return result


def shared_write_ceiling(directory: str, nbytes: int, writers: int, repeats: int = 3) -> dict[str, Any]:
    """Seconds for ``writers`` threads to write ``nbytes`` together into files of their own in ``directory``
    (+ fsync), as :func:`write_ceiling` does: ``per_writer_s``, a bound for a collective save's ranks."""
    share = max(-(-nbytes // writers), 1 << 20)
    paths = [os.path.join(directory, f".fastpersist-ceiling-{os.getpid()}-{k}.bin") for k in range(writers)]
    view, flags = _pattern_and_flags(directory)

    def once() -> float:
        for path in paths:
            remove_path(path)
        os.sync()
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(writers) as pool:
            list(pool.map(lambda path: _pwrite_file(path, view, share, flags), paths))
        return time.perf_counter() - started

    try:
        seconds = statistics.median(once() for _ in range(repeats))
    finally:
        for path in paths:
            remove_path(path)
    return {"bytes": share * writers, "writers": writers, "direct": bool(flags & os.O_DIRECT), "per_writer_s": seconds}


def read_ceiling(
    path: str,
    threads: int = _THREADS,
    block: int = _BLOCK,
    *,
    size: int | None = None,
    buffers: list | None = None,
    direct: bool = True,
) -> float:
    """Seconds for ``threads`` threads of ``block``-byte ``pread`` calls to read ``path`` (O_DIRECT where it works).
    ``size``: the first bytes only (default: the whole file; ``/dev/zero`` needs it). ``buffers``: page-aligned uint8
    tensors of at least ``block`` bytes, thread ``k`` reads into ``buffers[k % len(buffers)]`` (default: one each).
    ``direct=False`` reads through the page cache. A short read raises OSError. Cold reads: the caller drops the cache.
    """
    size = os.path.getsize(path) if size is None else size
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError:
        if not direct:
            raise
        fd = os.open(path, os.O_RDONLY)
    if buffers is None:
        buffers = [memory.aligned_empty(block) for _ in range(threads)]
    views = [memoryview(b.numpy())[:block] for b in buffers]
    offsets = list(range(0, size, block))

    def read(index: int) -> None:
        view = views[index % len(views)]
        for offset in offsets[index::threads]:
            wanted = min(block, size - offset)
            # O_DIRECT reads whole blocks (the file's tail is short by itself); buffered ones ask for what is left.
            got = os.preadv(fd, [view if direct else view[:wanted]], offset)
            if got < wanted:
                raise OSError(f"{path}: {got} bytes read at offset {offset}, {wanted} expected")

    started = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
    finally:
        os.close(fd)
    return time.perf_counter() - started


class CopyCeiling:
    """Copies ``tensors``' bytes (only read) through a ring of ``slots`` page-locked windows of ``window`` bytes, in
    seconds: :meth:`to_host` is the save pipeline without its format (copies on a side stream or memcpy; ``crc``: each
    window checksummed once landed), :meth:`to_device` the load's (each window checksummed, copied to device/host)."""

    def __init__(self, tensors: list[torch.Tensor], window: int = 64 << 20, slots: int = 8):
        self.sources = [t.detach().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        self.window = window
        self.ring = [memory.new_cpu_locked_tensor(window) for _ in range(slots)]
        for buffer in self.ring:
            buffer.fill_(1)
        devices = sorted({s.device for s in self.sources if s.device.type == "cuda"}, key=str)
        self.targets = {d: [torch.empty(window, dtype=torch.uint8, device=d) for _ in range(slots)] for d in devices}
        on_host = any(s.device.type == "cpu" for s in self.sources)
        self.host_targets = [memory.aligned_empty(window) for _ in range(slots)] if on_host else []
        self.streams = {d: torch.cuda.Stream(d) for d in devices}

    def _pieces(self):
        for source in self.sources:
            for offset in range(0, source.numel(), self.window):
                yield source, offset, min(self.window, source.numel() - offset)

    def to_host(self, crc: bool) -> float:
        started = time.perf_counter()
        pending: collections.deque = collections.deque()  # (slot, event, length) of the device copies
        checks: collections.deque = collections.deque()  # (slot, PendingCrc)
        slots = len(self.ring)
        for index, (source, offset, length) in enumerate(self._pieces()):
            slot = index % slots
            while checks and (len(checks) >= slots - 1 or checks[0][0] == slot):
                checks.popleft()[1].wait()
            while pending and (len(pending) >= slots - 1 or pending[0][0] == slot):
                self._landed(pending, crc, checks)
            buffer = self.ring[slot]
            if source.device.type != "cuda":  # the save's CPU path: copied (and checksummed) in one pass
                copy = checksum.copy_with_crc32 if crc else checksum.copy
                copy(buffer.data_ptr(), source.data_ptr() + offset, length)
                continue
            stream = self.streams[source.device]
            with torch.cuda.stream(stream):
                buffer[:length].copy_(source[offset : offset + length], non_blocking=True)
            pending.append((slot, stream.record_event(), length))
            if len(pending) > 1:  # the previous window's copy has had a window's time to land
                self._landed(pending, crc, checks)
        while pending:
            self._landed(pending, crc, checks)
        for _, check in checks:
            check.wait()
        return time.perf_counter() - started

    def _landed(self, pending: collections.deque, crc: bool, checks: collections.deque) -> None:
        slot, event, length = pending.popleft()
        event.synchronize()
        if crc:
            checks.append((slot, checksum.submit_crc32(self.ring[slot].data_ptr(), length)))

    def to_device(self, crc: bool) -> float:
        started = time.perf_counter()
        slots = len(self.ring)
        in_flight: collections.deque = collections.deque()  # (slot, what to wait for: the copy, then the check)
        for index, (source, _, length) in enumerate(self._pieces()):
            slot = index % slots
            while in_flight and (len(in_flight) >= slots or in_flight[0][0] == slot):
                for wait in in_flight.popleft()[1]:
                    wait()
            buffer = self.ring[slot]
            waits = [checksum.submit_crc32(buffer.data_ptr(), length).wait] if crc else []
            if source.device.type == "cuda":
                stream = self.streams[source.device]
                with torch.cuda.stream(stream):
                    self.targets[source.device][slot][:length].copy_(buffer[:length], non_blocking=True)
                waits.insert(0, stream.record_event().synchronize)
            else:
                checksum.copy(self.host_targets[slot].data_ptr(), buffer.data_ptr(), length)
            in_flight.append((slot, waits))
        for _, waits in in_flight:
            for wait in waits:
                wait()
        return time.perf_counter() - started


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
        self.nbytes = max(BLOCK, -(-nbytes // BLOCK) * BLOCK)
        self.engine_name = engine_name
        self.fio = system.find_fio() if use_fio else None
        self.fio_note = None if self.fio or not use_fio else system.FIO_INSTALL_HINT
        self.workdir = tempfile.mkdtemp(prefix=".fastpersist-ceiling-", dir=directory)
        self.direct = bool(engine.probe_directory(self.workdir)["direct"])
        self.dropper = system.CacheDropper()
        self.source = _stamped_pattern(self.nbytes)
        self.destination = memory.aligned_empty(self.nbytes).fill_(0)

    def __exit__(self, *exc: object) -> None:
        remove_path(self.workdir)

    def _path(self, tool: str) -> str:
        return os.path.join(self.workdir, f"{tool}.bin")

    def _handle(self, candidate: Candidate) -> Any:
        knobs = {"block_size": candidate.block_size, "queue_depth": candidate.queue_depth}
        return engine.IoHandle(**knobs, engine=self.engine_name, direct=self.direct)

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
        remove_path(path)
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
    return max((p for p in points if p.get("gbps")), key=lambda p: p["gbps"], default=None)


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
