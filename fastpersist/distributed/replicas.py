"""Which storages a rank holds byte for byte as rank 0 does: 64-bit digests of storages, and their comparison.

A collective save writes **rank 0's object**, the file ``torch.save`` would
write on rank 0 (:mod:`fastpersist.distributed.save`). Another rank's bytes
may stay in that file only where its storage is identical to rank 0's: in
data-parallel training most of the state (weights, optimizer moments) is
replicated, but some is per rank (RNG states, sampler positions,
unsynchronized metrics), and a replica may have drifted.

Every writing rank computes a 64-bit digest of each of its storages while it
writes (the work runs beside the write and mostly hides behind it):

* storages in host memory, and device storages of at most
  :data:`SMALL_DEVICE_BYTES` (gathered to the host with one copy per device):
  XXH64 of their bytes, natively on the pool's cores (kind :data:`HOST`;
  above 4 MiB, XXH64 of the XXH64s of 4 MiB pieces, seeded with the size);
* larger CUDA storages: on their own device, with torch operations on the
  current stream (kind :data:`DEVICE`): the storage is read as 32-bit words
  ``x[i]``, and the digest is ``sum(mix(x[i] * w[i % R] + r[i // R]))``
  modulo 2**64, where ``w`` and ``r`` are fixed pseudo-random odd 64-bit
  numbers (row length ``R`` = 2**20 words) and ``mix(y) = y ^ (y >> 31)``
  (arithmetic shift): a difference anywhere, in any bit, changes the sum
  unless a 64-bit coincidence cancels it. It reads the storage once, at
  device-memory speed, with at most 128 MiB of scratch memory, in a few
  kernels per 32 MiB whatever the number of storages.

64 bits make an accidental match of different bytes practically impossible
(a CRC-32 would match different bytes once in 2**32 comparisons: too often
over millions of saves). Rank 0 compares each other writer's digests with its
own (:func:`mismatches`); a digest that cannot be computed (a device with no
digest here, or no scratch memory) never matches, so rank 0 writes those bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fastpersist.format.plan import SavePlan, StorageRecord
from fastpersist.io import checksum, engine
from fastpersist.tensors import named_tensors

__all__ = [
    "HOST",
    "DEVICE",
    "NONE",
    "SMALL_DEVICE_BYTES",
    "Digest",
    "storage_digests",
    "storage_names",
    "value_digests",
    "device_digest",
    "device_digests",
    "PendingDigests",
    "mismatches",
]

HOST, DEVICE, NONE = 0, 1, 2
"""Digest kinds: XXH64 of the bytes; the device word hash; no digest (never matches)."""

SMALL_DEVICE_BYTES = 64 << 10
"""Device storages up to this size are gathered to the host and hashed there (one launch per device, not per storage)."""

Digest = tuple  # (nbytes, kind, value)

_ROW = 1 << 20
_ROWS_PER_STEP = 8  # 32 MiB of input, 64 MiB of int64 per step (and as much for the mix's temporary)
_SEED = 0x5EED5
_OFFSET_STEP = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit number
_OFFSET_BASE = 0x2545F4914F6CDD1D
_TAIL_OFFSET = 0x6A09E667F3BCC909
_weights: dict[torch.device, torch.Tensor] = {}
_offsets: dict[torch.device, torch.Tensor] = {}


def _signed(value: int) -> int:
    """``value`` modulo 2**64 as a signed 64-bit number (what torch's int64 arithmetic wraps to)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _row_weights(device: torch.device) -> torch.Tensor:
    weights = _weights.get(device)
    if weights is None:
        generator = torch.Generator().manual_seed(_SEED)
        weights = torch.randint(-(1 << 62), 1 << 62, (_ROW,), generator=generator, dtype=torch.int64) | 1
        weights = _weights[device] = weights.to(device)  # two threads racing make equal tensors
    return weights


def _row_offsets(device: torch.device, rows: int) -> torch.Tensor:
    """``r[i] = i * _OFFSET_STEP + _OFFSET_BASE`` (mod 2**64) for at least ``rows`` rows, made once per device."""
    offsets = _offsets.get(device)
    if offsets is None or offsets.numel() < rows:
        count = max(rows, 1024, 2 * (offsets.numel() if offsets is not None else 0))
        offsets = torch.arange(count, dtype=torch.int64, device=device).mul_(_OFFSET_STEP).add_(_OFFSET_BASE)
        _offsets[device] = offsets  # two threads racing make equal tensors
    return offsets


def _mix_(values: torch.Tensor) -> None:
    # Folds the high bits of each product into its low bits: without it, differences in high bits only
    # (sign flips) could cancel in a plain weighted sum. (A constant factor after it would change nothing:
    # it would multiply the whole sum.)
    values ^= values >> 31


def _steps(nbytes: int) -> int:
    """How many partial sums :func:`_digest_into` writes for a storage of ``nbytes``."""
    words, tail = divmod(nbytes, 4)
    rows, rest = divmod(words, _ROW)
    return -(-rows // _ROWS_PER_STEP) + (1 if rest else 0) + (1 if tail else 0)


def _digest_into(view: torch.Tensor, partials: torch.Tensor) -> None:
    """Writes the partial sums of ``view``'s :data:`DEVICE` digest into ``partials`` (int64, ``_steps`` long).

    Four kernels per 32 MiB of input (multiply-add, shift, xor, sum into its
    slot), so a large state costs few launches; the digest is ``partials.sum()``.
    """
    device = view.device
    weights = _row_weights(device)
    words = view.numel() // 4
    slot = 0
    if words:
        x = view[: words * 4].view(torch.int32)
        rows = words // _ROW
        if rows:
            offsets = _row_offsets(device, rows)
            for first in range(0, rows, _ROWS_PER_STEP):
                last = min(rows, first + _ROWS_PER_STEP)
                block = x[first * _ROW : last * _ROW].view(last - first, _ROW)
                values = torch.addcmul(offsets[first:last, None], block, weights)
                _mix_(values)
                torch.sum(values.view(-1), 0, out=partials[slot])
                slot += 1
        rest = words - rows * _ROW
        if rest:
            values = x[rows * _ROW :] * weights[:rest]
            values += _signed(rows * _OFFSET_STEP + _OFFSET_BASE)
            _mix_(values)
            torch.sum(values, 0, out=partials[slot])
            slot += 1
    tail = view.numel() - words * 4
    if tail:
        values = view[words * 4 :].to(torch.int64) * weights[:tail]
        values += _TAIL_OFFSET  # < 2**63
        _mix_(values)
        torch.sum(values, 0, out=partials[slot])


def device_digests(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The :data:`DEVICE` digests of 1-D uint8 tensors on one device: an int64 tensor there (no synchronization).

    Defined on any device (the tests run it on the CPU); used for CUDA
    storages. The kernels are queued on the current stream: a few per 32 MiB
    of input, whatever the number of storages, plus one final reduction.
    """
    partials = _partials(views)
    for row, view in zip(partials, views):
        _digest_into(view, row)
    return partials.sum(dim=1)


def _partials(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """Zeroed room for the partial sums of ``views``' digests: one row each, on their device."""
    return torch.zeros(len(views), max(_steps(v.numel()) for v in views), dtype=torch.int64, device=views[0].device)


def device_digest(view: torch.Tensor) -> torch.Tensor:
    """The :data:`DEVICE` digest of one 1-D uint8 tensor (a 0-d int64 tensor on its device; no synchronization)."""
    return device_digests([view])[0]


_DIGEST_PIECE = 4 << 20
"""Host storages larger than this are hashed in pieces on several cores: XXH64 of the pieces' XXH64s."""


class PendingDigests:
    """Digests being computed: host work on the native pool, device work queued on each device's current stream.

    A large device storage's kernels are queued by :meth:`launch_next`, one
    storage per call, which the collective save runs in the writer's idle
    moments (:func:`fastpersist.io.writer.idle_work`) when checksums are off:
    queued all at once before the first copy, they took a good part of a rank's
    write to the sink. With checksums on it queues them first: launches
    during the write (or on a helper thread) finished after it, later than
    the old order, with the CRC-32s on Python threads and again on the
    native pool, so the interpreter lock is not why (docs/distributed.md,
    docs/performance.md). :meth:`result` queues what is
    left, waits for everything and returns ``(nbytes, kind, value)`` per
    record, in order. Until then the caller must keep the storages unchanged
    (they are being read).
    """

    def __init__(self, records: Sequence[StorageRecord]):
        self._records = records
        self._out: list[Any] = [None] * len(records)
        self._futures: list = []
        # Per device: (stream, large indices, their partial sums or None, small indices, (gathered, done)).
        self._device: list[tuple[Any, list[int], torch.Tensor | None, list[int], Any]] = []
        self._launches: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (batch, view, row) not yet queued
        self._next = 0
        self._failed: set[int] = set()  # batches whose scratch memory ran out: left to rank 0
        out, pool = self._out, checksum.executor()
        host, by_device = [], {}
        for i, record in enumerate(records):
            if not record.entry.size:
                out[i] = (0, HOST, 0)
            elif record.device.type == "cpu":
                host.append(i)
            elif record.device.type == "cuda":
                by_device.setdefault(record.device, []).append(i)
            else:
                out[i] = (record.entry.size, NONE, 0)  # left to rank 0
        small = [i for i in host if records[i].entry.size <= _DIGEST_PIECE]
        for first in range(0, len(small), 4096):
            self._futures.append(pool.submit(self._hash_batch, small[first : first + 4096]))
        self._large: list[tuple[int, list]] = []
        for i in host:
            size, address = records[i].entry.size, records[i].data_ptr()
            if size > _DIGEST_PIECE:
                self._large.append(
                    (
                        i,
                        [
                            pool.submit(engine.hash64, address + o, min(_DIGEST_PIECE, size - o))
                            for o in range(0, size, _DIGEST_PIECE)
                        ],
                    )
                )
        for device, indices in by_device.items():
            self._prepare(device, indices)

    def _hash_batch(self, batch: list[int]) -> None:
        records = self._records
        hashes = engine.hash64_many([records[i].data_ptr() for i in batch], [records[i].entry.size for i in batch])
        for i, value in zip(batch, hashes):
            self._out[i] = (records[i].entry.size, HOST, value)

    def _prepare(self, device: torch.device, indices: list[int]) -> None:
        """Lists ``indices``' large storages for :meth:`launch_next`; gathers the small ones to the host now."""
        records = self._records
        large = [i for i in indices if records[i].entry.size > SMALL_DEVICE_BYTES]
        small = [i for i in indices if records[i].entry.size <= SMALL_DEVICE_BYTES]
        stream = torch.cuda.current_stream(device)  # the storages' producers ran there
        batch = len(self._device)
        try:
            partials, views = None, [records[i].view for i in large]
            if large:
                partials = _partials(views)
            gathered, done = None, None
            if small:
                joined = torch.cat([records[i].view for i in small])
                gathered = torch.empty(joined.numel(), dtype=torch.uint8, pin_memory=True)
                gathered.copy_(joined, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            self._device.append((stream, large, partials, small, (gathered, done)))
            self._launches += [(batch, view, row) for view, row in zip(views, partials if large else ())]
        except torch.cuda.OutOfMemoryError:
            for i in indices:  # left to rank 0 (the digest needs a few tens of MiB of device memory)
                self._out[i] = (records[i].entry.size, NONE, 0)

    def launch_next(self) -> bool:
        """Queues the digest kernels of the next large device storage; False once none is left."""
        if self._next >= len(self._launches):
            return False
        batch, view, row = self._launches[self._next]
        self._next += 1
        if batch not in self._failed:
            try:
                with torch.cuda.stream(self._device[batch][0]):
                    _digest_into(view, row)
            except torch.cuda.OutOfMemoryError:
                self._failed.add(batch)
        return True

    def launch_all(self) -> None:
        """Queues the digest kernels of every large device storage not queued yet."""
        while self.launch_next():
            pass
        self._launches.clear()

    def result(self) -> list[Digest]:
        self.launch_all()
        records, out = self._records, self._out
        for batch, (stream, large, partials, small, (gathered, done)) in enumerate(self._device):
            if batch in self._failed:
                for i in large:
                    out[i] = (records[i].entry.size, NONE, 0)
            elif partials is not None:
                with torch.cuda.stream(stream):
                    sums = partials.sum(dim=1).tolist()
                for i, value in zip(large, sums):
                    out[i] = (records[i].entry.size, DEVICE, value)
            if small:
                done.synchronize()
                addresses, position = [], gathered.data_ptr()
                for i in small:
                    addresses.append(position)
                    position += records[i].entry.size
                for i, value in zip(small, engine.hash64_many(addresses, [records[i].entry.size for i in small])):
                    out[i] = (records[i].entry.size, HOST, value)
        self._device.clear()
        for future in self._futures:
            future.result()
        self._futures.clear()
        for i, futures in self._large:
            size = records[i].entry.size
            pieces = (ctypes.c_uint64 * len(futures))(*(f.result() for f in futures))
            out[i] = (size, HOST, engine.hash64(ctypes.addressof(pieces), ctypes.sizeof(pieces), size))
        self._large.clear()
        return list(out)


def storage_digests(records: Sequence[StorageRecord]) -> list[Digest]:
    """``(nbytes, kind, value)`` for each storage record, in order (:class:`PendingDigests`, waited for)."""
    return PendingDigests(records).result()


def mismatches(reference: dict[int, Digest], theirs: dict[int, Digest]) -> tuple[list[int], list[int]]:
    """Which storages another rank does not hold as rank 0 does.

    Args:
        reference: rank 0's digests, by rank 0's storage ordinal.
        theirs: the other rank's digests of its storages of the same key and
            size, by the same ordinals.

    Returns:
        ``(differ, divergent)``: every ordinal of ``theirs`` whose digest is
        not rank 0's (the bytes that rank wrote there must be replaced); and
        those of them whose digests are of the same kind, so the values
        really differ (not just a digest that could not be computed, or one
        storage on the CPU and the other on a GPU).
    """
    differ, divergent = [], []
    for ordinal, digest in sorted(theirs.items()):
        own = reference.get(ordinal)
        if own is not None and digest[1] == own[1] != NONE and digest[2] == own[2]:
            continue
        differ.append(ordinal)
        if own is not None and digest[1] == own[1] != NONE:
            divergent.append(ordinal)
    return differ, divergent


def storage_names(obj: Any, keys: Iterable[str], plan: SavePlan, limit: int = 100_000) -> dict[str, str]:
    """A readable name for each storage key of ``plan``: the path of a tensor in ``obj`` using it.

    (:func:`fastpersist.tensors.named_tensors`, at most ``limit`` items); a
    storage found nowhere is named ``data/<key>``.
    """
    keys = list(keys)
    wanted = {(r.device, r.data_ptr()): r.key for r in plan.storages if r.key in keys}
    names: dict[str, str] = {}
    for path, tensor in named_tensors(obj, limit):
        key = wanted.get(_storage_of(tensor))
        if key is not None and key not in names:
            names[key] = path
            if len(names) == len(wanted):
                break
    return {key: names.get(key, f"data/{key}") for key in keys}


def value_digests(obj: Any, records: dict[int, StorageRecord], limit: int = 100_000) -> dict[int, int | None]:
    """For each ordinal of ``records``: a 64-bit digest of the values ``obj``'s tensors see in that storage.

    Two ranks whose storages differ byte for byte may hold the same values:
    a weight kept column-major on one rank (``w.t().contiguous().t()``) and
    row-major on the other. The digest covers, for every tensor of ``obj``
    viewing the storage (in key-path order), its path, dtype, shape and the
    bytes of its values in row-major order (:func:`device_digest` of
    ``tensor.contiguous()``, on its device), so it is the same on two ranks
    exactly when their tensors hold the same values. None where no tensor of
    ``obj`` views the storage, or its values cannot be read (never equal).
    Only for the few storages whose bytes differ: it copies non-contiguous tensors.
    """
    by_storage = {(r.device, r.data_ptr()): ordinal for ordinal, r in records.items() if r.entry.size}
    found: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for path, tensor in named_tensors(obj, limit):
        ordinal = by_storage.get(_storage_of(tensor))
        if ordinal is not None:
            found.setdefault(ordinal, []).append((path, tensor))
    digests: dict[int, int | None] = {}
    for ordinal in records:
        tensors = sorted(found.get(ordinal, ()), key=lambda item: item[0])
        if not tensors:
            digests[ordinal] = None
            continue
        summary = hashlib.blake2b(digest_size=8)
        try:
            for path, tensor in tensors:
                summary.update(repr((path, str(tensor.dtype), tuple(tensor.shape))).encode())
                if tensor.numel():
                    values = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                    summary.update(int(device_digest(values)).to_bytes(8, "little", signed=True))
        except Exception:  # noqa: BLE001 - sparse, quantized, ...: values this cannot read are never equal
            digests[ordinal] = None
            continue
        digests[ordinal] = int.from_bytes(summary.digest(), "little")
    return digests


def _storage_of(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    try:
        return tensor.device, tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - sparse, nested and other layouts have no plain storage
        return None
