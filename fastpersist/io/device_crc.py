"""zlib's CRC-32 of bytes in device memory, computed on the device with torch operations.

A verified load to CUDA checksummed every window on the CPU while the window's
bytes were also being read into, and copied out of, host memory: the three
passes share the host's memory bandwidth, and the CRC-32 pass cost a third of
a load's speed (``bench stages``, docs/performance.md). Here the checksum runs
where the bytes land, on the GPU, after their copy, which also checks the bytes
the tensors hold rather than the staging buffer's.

The CRC-32 register is linear over GF(2). With ``raw`` the register after the
bytes starting from zero (zlib's without its two inversions):

* a chunk of :data:`CHUNK` bytes: ``raw`` is the XOR over its bytes of a table
  entry per (position, byte value): one ``index_select``, then XOR halvings;
* :data:`GROUP` consecutive values, each covering ``span`` bytes: each value's
  32 bits times a 0/1 matrix of the shifts by ``(GROUP - 1 - i) * span``
  bytes, summed as floats (exact: at most ``32 * GROUP`` ones) and taken mod 2;
  levels repeat until one value is left;
* zlib's CRC-32 of ``n`` bytes is ``crc32_combine(0xFFFFFFFF, raw ^ 0xFFFFFFFF, n)``.

The table step runs :data:`BLOCK` bytes at a time, so its temporaries (four
bytes per byte) stay small whatever the segment's size.

The operations for one segment of each of :data:`SEGMENTS` sizes are captured
as a CUDA graph (the launches become one replay; eager, the launches alone
held a load's thread below the copies' speed), once per device and kept for
later loads (a load running beside another captures a set of its own). Each
segment is copied into the graph's input, replayed and its value copied out,
on the set's stream, which waits for the segment's copy. Pieces shorter than
the smallest segment, and the tail of every piece, stay on the CPU pool.

A process's first set takes time, almost all of it warming up (the tables,
the kernels' first launches, cuBLAS), not capturing; the set keeps part of the
device's memory (both measured in docs/performance.md). No capture ever runs on
a thread of its own: while a stream captures, a ``torch.cuda.synchronize()``
on any other thread of the process fails, whatever the capture mode, so a
capture running beside the caller's code could break it. With the
``device_checksum`` setting at ``auto`` (the default) a large verified load
with no set ready warms the device up on a thread of its own (eager
operations, no capture) and checksums on the CPU; the next large one captures
the set inside itself (a cost paid once per process and device, measured in
docs/performance.md), and the loads after it lease the set
(:meth:`DeviceCrc.if_ready`). ``always`` captures, warm-up included, in the
load that needs a set, ``never`` keeps every checksum on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading

import torch

from fastpersist.io import engine, workers

__all__ = [
    "CHUNK",
    "GROUP",
    "BLOCK",
    "SEGMENTS",
    "AUTO_BYTES",
    "DeviceCrc",
    "Part",
    "raw_crc",
    "crc32_of_raw",
    "release",
]

_log = logging.getLogger(__name__)

CHUNK = 256
"""Bytes a table row covers (the table holds ``CHUNK * 256`` int32 entries)."""
GROUP = 256
"""Values one level of products combines."""
SEGMENTS = (16 << 20, 4 << 20)
"""Bytes per captured graph, largest first; each a multiple of ``CHUNK * GROUP``. A piece's rest below the
smallest is checksummed on the CPU: with 1 MiB graphs as well, a load of 36 MB records ran slower than on the
CPU alone (the many small replays held the loading thread), with 16 and 4 MiB it ran fastest
(docs/performance.md). The graphs of a device hold some of its memory while cached (measured there too)."""
BLOCK = 4 << 20
"""Bytes whose table step runs at once within a segment (a multiple of ``CHUNK``): its temporaries, four bytes per
byte, are reused block after block, so a set's memory does not grow with its largest segment."""
AUTO_BYTES = 1 << 30
"""With ``device_checksum="auto"``, a verified load that puts at least this many bytes in whole segments on a
device with no graph set ready warms the device up in the background, or captures a set if it is warm: a load that
size dwarfs the set's memory."""
_MASK = 0xFFFFFFFF


_POLY = 0xEDB88320


def _shift_byte(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Registers (int64) after one more zero byte."""
    return (values >> 8) ^ table[values & 0xFF]


@functools.cache
def _crc_table() -> torch.Tensor:
    """zlib's byte table (int64): the register after byte ``b`` from zero."""
    values = torch.arange(256, dtype=torch.int64)
    for _ in range(8):
        values = (values >> 1) ^ (_POLY * (values & 1))
    return values


def _gf2_columns(nbytes: int) -> torch.Tensor:
    """``(32, 32)`` float 0/1: row ``k`` is the bits of ``1 << k`` after ``nbytes`` zero bytes."""
    return _bits(torch.tensor([engine.crc32_combine(1 << k, 0, nbytes) for k in range(32)], dtype=torch.int64))


def _bits(values: torch.Tensor) -> torch.Tensor:
    return ((values.unsqueeze(-1) >> torch.arange(32, dtype=torch.int64)) & 1).float()


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The byte table (entry ``j * 256 + b``: ``raw`` of a chunk holding only byte ``b`` at position ``j``, as
    int32), each position's offset into it, bit shifts 0-31 (int32) and bit weights (int64)."""
    table = _crc_table()
    rows = [table]  # position CHUNK - 1: no byte after it
    for _ in range(CHUNK - 1):
        rows.append(_shift_byte(rows[-1], table))
    entries = torch.stack(rows[::-1]).view(-1)
    entries = torch.where(entries >= 1 << 31, entries - (1 << 32), entries).to(torch.int32)
    offsets = torch.arange(CHUNK, dtype=torch.int32) * 256
    shifts = torch.arange(32, dtype=torch.int32)
    return entries.to(device), offsets.to(device), shifts.to(device), shifts.to(device, torch.int64)


@functools.cache
def _level(span: int, device: torch.device) -> torch.Tensor:
    """``(GROUP * 32, 32)`` float 0/1: row ``i * 32 + k`` is bit ``k`` shifted by ``(GROUP - 1 - i) * span`` bytes."""
    step = _gf2_columns(span)
    blocks = [torch.eye(32)]  # i = GROUP - 1: no shift
    for _ in range(GROUP - 1):
        blocks.append(torch.remainder(blocks[-1] @ step, 2))
    return torch.cat(blocks[::-1]).to(device)


def raw_crc(data: torch.Tensor) -> torch.Tensor:
    """``raw`` of a contiguous 1-D uint8 tensor whose length is a positive multiple of ``CHUNK * GROUP``, as a
    0-dim int64 tensor on its device (queued, not waited for)."""
    if data.dim() != 1 or data.dtype != torch.uint8 or not data.numel() or data.numel() % (CHUNK * GROUP):
        raise ValueError(f"raw_crc takes a 1-D uint8 tensor of a positive multiple of {CHUNK * GROUP} bytes")
    table, offsets, shifts, weights = _tables(data.device)
    if data.numel() <= BLOCK:
        bits = _chunk_bits(data, table, offsets, shifts)
    else:
        bits = torch.empty(data.numel() // CHUNK, 32, device=data.device)
        for start in range(0, data.numel(), BLOCK):
            block = data[start : start + BLOCK]
            bits[start // CHUNK : (start + block.numel()) // CHUNK] = _chunk_bits(block, table, offsets, shifts)
    span, count = CHUNK, bits.shape[0]
    while count > 1:
        groups = -(-count // GROUP)
        front = groups * GROUP - count  # zero values in front change nothing
        if front:
            bits = torch.cat([bits.new_zeros(front, 32), bits])
        sums = bits.view(groups, GROUP * 32) @ _level(span, data.device)
        bits = (sums.to(torch.int32) & 1).float()
        span, count = span * GROUP, groups
    return (bits.view(32).to(torch.int64) << weights).sum()


def _chunk_bits(data: torch.Tensor, table, offsets, shifts) -> torch.Tensor:
    """``(chunks, 32)`` float 0/1: the bits of each ``CHUNK``-byte chunk's ``raw``."""
    rows = data.view(-1, CHUNK)
    x = table.index_select(0, (rows + offsets).view(-1)).view(rows.shape[0], CHUNK)
    width = CHUNK
    while width > 1:
        width //= 2
        x[:, :width].bitwise_xor_(x[:, width : 2 * width])
    return ((x[:, :1] >> shifts) & 1).float()


def crc32_of_raw(raw: int, length: int) -> int:
    """zlib's CRC-32 of ``length`` bytes whose ``raw`` register is ``raw``."""
    return engine.crc32_combine(_MASK, raw ^ _MASK, length) if length else 0


class Part:
    """One segment's CRC-32 among a load's parts: its value once the owner's stream is done."""

    __slots__ = ("owner", "index")

    def __init__(self, owner: DeviceCrc, index: int):
        self.owner, self.index = owner, index

    def result(self) -> int:
        return self.owner.values()[self.index]


class _Graphs:
    """A graph per segment size on one device, with its input, its output and the stream it replays on.

    Captured with ``capture_begin``/``capture_end`` on the set's own stream (``torch.cuda.graph`` would also
    collect garbage and empty the caching allocator on every capture). ``nbytes``: the device memory it holds.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[int, tuple] = {}
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            before = torch.cuda.memory_reserved(device)
            # One input for every size (a graph reads its first bytes), and one memory pool: the graphs only
            # replay one after another on the set's stream, and each result is copied out before the next.
            source = torch.zeros(max(SEGMENTS), dtype=torch.uint8, device=device)
            pool = None
            for size in SEGMENTS:
                graph, result = self._capture(source[:size], pool)
                pool = graph.pool()
                self.graphs[size] = (graph, source[:size], result)
            self.nbytes = max(torch.cuda.memory_reserved(device) - before, source.numel())

    def _capture(self, source: torch.Tensor, pool) -> tuple:
        with torch.cuda.stream(self.stream):
            raw_crc(source)  # warm-up: tables, cuBLAS workspace
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of the process may use CUDA while this one captures
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                result = raw_crc(source)
            finally:
                graph.capture_end()
        return graph, result


def _warm_up(device: torch.device) -> None:
    """Runs every segment size's operations once, eagerly, on a stream of its own: builds the tables, loads the
    kernels and starts cuBLAS on ``device``, which is most of a first capture's time, without capturing."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            source = torch.zeros(max(SEGMENTS), dtype=torch.uint8, device=device)
            for size in SEGMENTS:
                raw_crc(source[:size])
        stream.synchronize()


class _Cache:
    """The process's idle graph sets, by device: a load leases one (or captures one, one capture at a time in the
    process) and gives it back; :func:`release` drops the idle ones. Forgotten in a forked child (the parent's
    graphs are not its own), never destroyed there.

    :meth:`ready` captures only on the caller's thread, inside its load, and only on a warm device: with ``start``
    and no idle set it captures one where the device is warm, and otherwise starts warming it up (:func:`_warm_up`)
    on a thread of its own (:func:`fastpersist.io.workers.detached`, joined at interpreter exit) and returns None.
    A device whose warm-up or capture failed (its memory was full) is not tried again until :func:`release`; a
    capture that fails is logged, not raised: that load checksums on the CPU.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.capturing = threading.Lock()
        self.idle: dict[torch.device, list[_Graphs]] = {}
        self.background: set[torch.device] = set()  # warm-ups underway on a thread of their own
        self.warm: set[torch.device] = set()
        self.failed: set[torch.device] = set()
        self.forked: list = []

    def lease(self, device: torch.device) -> _Graphs:
        graphs = self.ready(device, start=False)
        if graphs is not None:
            return graphs
        with self.capturing:
            graphs = _Graphs(device)
        with self.lock:
            self.warm.add(device)
        return graphs

    def ready(self, device: torch.device, start: bool) -> _Graphs | None:
        with self.lock:
            idle = self.idle.get(device)
            if idle:
                return idle.pop()
            start = start and device not in self.background and device not in self.failed
            capture = start and device in self.warm
            warm_up = start and not capture and workers.threads_allowed()
            if warm_up:
                self.background.add(device)
        if capture:
            try:
                return self.lease(device)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
                self._failed(device, "capturing", error)
        elif warm_up:
            try:
                workers.detached("fastpersist-crc-warm-up", self._warm_up, device)
            except BaseException:
                with self.lock:
                    self.background.discard(device)
                raise
        return None

    def _warm_up(self, device: torch.device) -> None:
        try:
            _warm_up(device)
        except Exception as error:  # noqa: BLE001 - a warm-up that fails leaves checksums on the CPU
            self._failed(device, "warming up", error)
        else:
            with self.lock:
                self.warm.add(device)
        finally:
            with self.lock:
                self.background.discard(device)

    def _failed(self, device: torch.device, step: str, error: BaseException) -> None:
        _log.warning("checksums of verified loads to %s stay on the CPU: %s failed: %s", device, step, error)
        with self.lock:
            self.failed.add(device)

    def give_back(self, graphs: _Graphs) -> None:
        with self.lock:
            self.idle.setdefault(graphs.device, []).append(graphs)

    def release(self) -> int:
        with self.lock:
            idle, self.idle = self.idle, {}
            self.failed.clear()
        return sum(graphs.nbytes for sets in idle.values() for graphs in sets)

    def forget_after_fork(self) -> None:
        self.lock, self.capturing = threading.Lock(), threading.Lock()
        self.forked.append(self.idle)
        self.idle, self.background, self.warm, self.failed = {}, set(), set(), set()


_cache = _Cache()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_cache.forget_after_fork)


def release() -> int:
    """Drops the idle graph sets (their device memory goes back to torch's caching allocator); returns the bytes."""
    return _cache.release()


class DeviceCrc:
    """The device checksums of one load on one device, on a leased graph set (:class:`_Graphs`).

    ``segments``: how many segments the load will queue (:meth:`count`). Raises what capturing raised (for
    example ``torch.cuda.OutOfMemoryError``); the caller then checksums on the CPU. On a CPU device (tests) the
    operations run eagerly, in order. Used by one thread; :meth:`close` waits for what was queued and gives the
    graph set back.
    """

    def __init__(self, device: torch.device, segments: int, graphs: _Graphs | None = None):
        self.device = device
        if graphs is None and device.type == "cuda":
            graphs = _cache.lease(device)
        self._graphs = graphs
        self._stream = self._graphs.stream if self._graphs is not None else None
        try:
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(device))
            self._results = torch.empty(max(segments, 1), dtype=torch.int64, device=device)
        except BaseException:
            self.close()
            raise
        self._lengths: list[int] = []
        self._values: list[int] | None = None

    @classmethod
    def if_ready(cls, device: torch.device, segments: int, nbytes: int) -> DeviceCrc | None:
        """A checker on a graph set (``device_checksum="auto"``): an idle one, or for a load of at least
        :data:`AUTO_BYTES` in whole segments (``nbytes``) one captured now where the device is warm; otherwise None,
        and such a load warms the device up in the background for the loads after it. On a CPU device (tests) the
        checker runs eagerly."""
        if device.type != "cuda":
            return cls(device, segments)
        graphs = _cache.ready(device, start=nbytes >= AUTO_BYTES)
        return None if graphs is None else cls(device, segments, graphs)

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream the checksums run on (None on a CPU device, or once closed)."""
        return self._stream

    @staticmethod
    def split(length: int) -> tuple[list[int], int]:
        """A piece of ``length`` bytes: the segment sizes its start is cut into, and the tail left for the CPU."""
        sizes = []
        for size in SEGMENTS:
            sizes += [size] * (length // size)
            length %= size
        return sizes, length

    @staticmethod
    def count(length: int) -> int:
        return len(DeviceCrc.split(length)[0])

    def queue(self, source: torch.Tensor, sizes: list[int], after: torch.cuda.Event | None) -> list[Part]:
        """Queues the CRC-32 of ``source``'s first ``sum(sizes)`` bytes, segment by segment, once ``after`` (the
        copy that fills it) is done; returns a part per segment, in order."""
        parts = []
        if self._stream is not None and after is not None:
            self._stream.wait_event(after)
        offset = 0
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for size in sizes:
                index = len(self._lengths)
                segment = source[offset : offset + size]
                if self._graphs is not None:
                    graph, static, result = self._graphs.graphs[size]
                    static.copy_(segment)
                    graph.replay()
                    self._results[index].copy_(result)
                else:
                    self._results[index] = raw_crc(segment)
                self._lengths.append(size)
                parts.append(Part(self, index))
                offset += size
        return parts

    def values(self) -> list[int]:
        """zlib's CRC-32 of every queued segment, in queue order (waits for them, once)."""
        if self._values is None:
            if self._stream is not None:
                self._stream.synchronize()
            raws = self._results[: len(self._lengths)].tolist()
            self._values = [crc32_of_raw(raw, n) for raw, n in zip(raws, self._lengths)]
        return self._values

    def close(self) -> None:
        """Waits for everything queued (the segments read tensors the caller may free next) and gives the graph
        set back; the values stay readable."""
        graphs, self._graphs = self._graphs, None
        if graphs is not None:
            graphs.stream.synchronize()
            self._stream = None  # done: values() need not wait for the set's next user
            _cache.give_back(graphs)
