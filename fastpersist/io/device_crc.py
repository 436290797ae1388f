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

The operations for one segment of each of :data:`SEGMENTS` sizes are captured
as a CUDA graph (about 30 launches become one replay; eager, the launches
alone held a load's thread below the copies' speed), once per device and kept
for later loads (a load running beside another captures a set of its own).
Each segment is copied into the graph's input, replayed and its value copied
out, on the set's stream, which waits for the segment's copy. Pieces shorter
than the smallest segment, and the tail of every piece, stay on the CPU pool.
The first capture in a process takes time and the set keeps part of the
device's memory (both measured in docs/performance.md), so this is off by
default (the ``device_checksum`` setting).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

from fastpersist.io import engine

__all__ = ["CHUNK", "GROUP", "SEGMENTS", "DeviceCrc", "Part", "raw_crc", "crc32_of_raw", "release"]

CHUNK = 256
"""Bytes a table row covers (the table holds ``CHUNK * 256`` int32 entries)."""
GROUP = 256
"""Values one level of products combines."""
SEGMENTS = (16 << 20, 4 << 20)
"""Bytes per captured graph, largest first; each a multiple of ``CHUNK * GROUP``. A piece's rest below the
smallest is checksummed on the CPU: with 1 MiB graphs as well, a load of 36 MB records ran slower than on the
CPU alone (the many small replays held the loading thread), with 16 and 4 MiB it ran fastest
(docs/performance.md). The graphs of a device hold some of its memory while cached (measured there too)."""
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
    rows = data.view(-1, CHUNK)
    x = table.index_select(0, (rows + offsets).view(-1)).view(rows.shape[0], CHUNK)
    width = CHUNK
    while width > 1:
        width //= 2
        x[:, :width].bitwise_xor_(x[:, width : 2 * width])
    bits = ((x[:, :1] >> shifts) & 1).float()  # (chunks, 32)
    span, count = CHUNK, rows.shape[0]
    while count > 1:
        groups = -(-count // GROUP)
        front = groups * GROUP - count  # zero values in front change nothing
        if front:
            bits = torch.cat([bits.new_zeros(front, 32), bits])
        sums = bits.view(groups, GROUP * 32) @ _level(span, data.device)
        bits = (sums.to(torch.int32) & 1).float()
        span, count = span * GROUP, groups
    return (bits.view(32).to(torch.int64) << weights).sum()


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


class _Cache:
    """The process's idle graph sets, by device: a load leases one (or captures one, one capture at a time in the
    process) and gives it back; :func:`release` drops the idle ones. Forgotten in a forked child (the parent's
    graphs are not its own), never destroyed there."""

    def __init__(self):
        self.lock = threading.Lock()
        self.capturing = threading.Lock()
        self.idle: dict[torch.device, list[_Graphs]] = {}
        self.forked: list = []

    def lease(self, device: torch.device) -> _Graphs:
        with self.lock:
            idle = self.idle.get(device)
            if idle:
                return idle.pop()
        with self.capturing:
            return _Graphs(device)

    def give_back(self, graphs: _Graphs) -> None:
        with self.lock:
            self.idle.setdefault(graphs.device, []).append(graphs)

    def release(self) -> int:
        with self.lock:
            idle, self.idle = self.idle, {}
        return sum(graphs.nbytes for sets in idle.values() for graphs in sets)

    def forget_after_fork(self) -> None:
        self.lock, self.capturing = threading.Lock(), threading.Lock()
        self.forked.append(self.idle)
        self.idle = {}


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

    def __init__(self, device: torch.device, segments: int):
        self.device = device
        self._graphs = _cache.lease(device) if device.type == "cuda" else None
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
