"""Which storages a rank holds byte for byte as rank 0 does: digests, comparison, the rank's plan of rank 0's file.

A collective save writes **rank 0's object**, the file ``torch.save`` would
write on rank 0. Another rank may write a part of it only from storages it
holds identically: in data-parallel training most of the state (weights,
optimizer moments) is replicated, but some is per rank (RNG states, sampler
positions, unsynchronized metrics), the pickled metadata differs (each rank's
tensors are on ``cuda:<rank>``), and a replica may have drifted.

Each writing rank computes a 64-bit digest of each of its storages, before
anything is written:

* storages in host memory, and device storages of at most
  :data:`SMALL_DEVICE_BYTES` (gathered to the host with one copy per device):
  XXH64 of their bytes, natively on every core (kind :data:`HOST`);
* larger CUDA storages: on their own device, with torch operations (kind
  :data:`DEVICE`): the storage is read as 32-bit words ``x[i]``, and the digest
  is ``sum(mix(x[i] * w[i % R] + r[i // R]))`` modulo 2**64, where ``w`` and
  ``r`` are fixed pseudo-random odd 64-bit numbers (row length ``R`` = 2**20
  words) and ``mix(y) = (y ^ (y >> 31)) * K``: a difference anywhere, in any
  bit, changes the sum unless a 64-bit coincidence cancels it. It reads the
  storage once at device-memory speed, on the current stream.

Storages are matched by their key in the pickle (``data/<key>``, in pickling
order): rank k may write rank 0's storage ``key`` when its own storage of
that key has the same size, digest kind and digest. A storage of the same key
and size whose digest differs is *divergent* (a per-rank tensor, or a replica
that drifted); others (different size, missing) are simply not shared. Rank 0
writes whatever no other writer holds. A digest that cannot be computed (a
device with no digest here, out of device memory) makes the storage rank 0's.
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterable, Sequence

import torch

from fastpersist.format.plan import SavePlan, StorageRecord
from fastpersist.io import checksum, engine

__all__ = ["HOST", "DEVICE", "NONE", "SMALL_DEVICE_BYTES", "Digest", "storage_digests", "compare", "storage_names",
           "device_digest", "host_digest"]  # fmt: skip

HOST, DEVICE, NONE = 0, 1, 2
"""Digest kinds: XXH64 of the bytes; the device word hash; no digest (never matches)."""

SMALL_DEVICE_BYTES = 64 << 10
"""Device storages up to this size are gathered to the host and hashed there (one launch per device, not per storage)."""

Digest = tuple  # (nbytes, kind, value)

_ROW = 1 << 20
_ROWS_PER_STEP = 4  # 16 MiB of input, 32 MiB of int64 per step
_SEED = 0x5EED5
_OFFSET_STEP = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit number
_OFFSET_BASE = 0x2545F4914F6CDD1D
_TAIL_OFFSET = 0x6A09E667F3BCC909
_MIX = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed 64-bit number
_weights: dict[torch.device, torch.Tensor] = {}


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


def _mix_(values: torch.Tensor) -> None:
    values ^= values >> 31
    values *= _MIX


def device_digest(view: torch.Tensor) -> torch.Tensor:
    """The :data:`DEVICE` digest of a 1-D uint8 tensor (a 0-d int64 tensor on its device; no synchronization).

    Defined on any device (the tests run it on the CPU); used for CUDA storages.
    """
    weights = _row_weights(view.device)
    total = torch.zeros((), dtype=torch.int64, device=view.device)
    words = view.numel() // 4
    if words:
        x = view[: words * 4].view(torch.int32)
        rows = words // _ROW
        if rows:
            offsets = torch.arange(rows, dtype=torch.int64, device=view.device).mul_(_OFFSET_STEP).add_(_OFFSET_BASE)
            for first in range(0, rows, _ROWS_PER_STEP):
                last = min(rows, first + _ROWS_PER_STEP)
                values = x[first * _ROW : last * _ROW].view(last - first, _ROW) * weights
                values += offsets[first:last, None]
                _mix_(values)
                total += values.sum()
        rest = words - rows * _ROW
        if rest:
            values = x[rows * _ROW :] * weights[:rest]
            values += _signed(rows * _OFFSET_STEP + _OFFSET_BASE)
            _mix_(values)
            total += values.sum()
    tail = view.numel() - words * 4
    if tail:
        values = view[words * 4 :].to(torch.int64) * weights[:tail]
        values += _TAIL_OFFSET  # < 2**63
        _mix_(values)
        total += values.sum()
    return total


_DIGEST_PIECE = 4 << 20
"""Host storages larger than this are hashed in pieces on several cores: XXH64 of the pieces' XXH64s."""


def host_digest(address: int, length: int) -> int:
    """The :data:`HOST` digest of ``length`` bytes at ``address`` (several cores for large ranges)."""
    if length <= _DIGEST_PIECE:
        return engine.hash64(address, length)
    pool = checksum.executor()
    futures = [pool.submit(engine.hash64, address + offset, min(_DIGEST_PIECE, length - offset))
               for offset in range(0, length, _DIGEST_PIECE)]  # fmt: skip
    pieces = (ctypes.c_uint64 * len(futures))(*(f.result() for f in futures))
    return engine.hash64(ctypes.addressof(pieces), ctypes.sizeof(pieces), length)


def _host_digests(records: Sequence[StorageRecord], indices: list[int], out: list) -> list:
    """Queues the host digests of CPU storages; returns futures that fill ``out``."""
    pool = checksum.executor()
    futures = []
    small = [i for i in indices if records[i].entry.size <= _DIGEST_PIECE]
    for start in range(0, len(small), 4096):
        batch = small[start : start + 4096]

        def run(batch=batch):
            hashes = engine.hash64_many([records[i].data_ptr() for i in batch], [records[i].entry.size for i in batch])
            for i, value in zip(batch, hashes):
                out[i] = (records[i].entry.size, HOST, value)

        futures.append(pool.submit(run))
    for i in indices:
        if records[i].entry.size > _DIGEST_PIECE:
            out[i] = (records[i].entry.size, HOST, host_digest(records[i].data_ptr(), records[i].entry.size))
    return futures


def _gather_small(views: list[torch.Tensor]) -> list[int]:
    """HOST digests of small device storages: one concatenation on the device, one copy to the host."""
    joined = torch.cat(views).cpu()
    base = joined.data_ptr()
    addresses, position = [], 0
    for view in views:
        addresses.append(base + position)
        position += view.numel()
    return engine.hash64_many(addresses, [v.numel() for v in views])


def storage_digests(records: Sequence[StorageRecord]) -> list[Digest]:
    """``(nbytes, kind, value)`` for each storage record, in order. Synchronizes with the devices once.

    Never raises for a storage it cannot digest: that storage gets kind :data:`NONE`.
    """
    out: list[Any] = [None] * len(records)
    host = [i for i, r in enumerate(records) if r.device.type == "cpu" and r.entry.size]
    pending = _host_digests(records, host, out)
    by_device: dict[torch.device, list[int]] = {}
    for i, record in enumerate(records):
        if not record.entry.size:
            out[i] = (0, HOST, 0)
        elif record.device.type == "cuda":
            by_device.setdefault(record.device, []).append(i)
        elif record.device.type != "cpu":
            out[i] = (record.entry.size, NONE, 0)
    for device, indices in by_device.items():
        small = [i for i in indices if records[i].entry.size <= SMALL_DEVICE_BYTES]
        large = [i for i in indices if records[i].entry.size > SMALL_DEVICE_BYTES]
        try:
            sums = torch.stack([device_digest(records[i].view) for i in large]).tolist() if large else []
            for i, value in zip(large, sums):
                out[i] = (records[i].entry.size, DEVICE, value)
            if small:
                for i, value in zip(small, _gather_small([records[i].view for i in small])):
                    out[i] = (records[i].entry.size, HOST, value)
        except torch.cuda.OutOfMemoryError:
            for i in indices:  # left to rank 0 (the digest needs a few tens of MiB of device memory)
                if out[i] is None:
                    out[i] = (records[i].entry.size, NONE, 0)
    for future in pending:
        future.result()
    return out


def compare(reference: Sequence[Digest], reference_keys: Sequence[str], records: Sequence[StorageRecord],
            digests: Sequence[Digest]) -> tuple[list[int], list[int]]:  # fmt: skip
    """Which of rank 0's storages this rank holds identically, and which diverge.

    Args:
        reference: rank 0's digests, in rank 0's storage order.
        reference_keys: rank 0's storage keys, same order.
        records, digests: this rank's storages and their digests.

    Returns:
        ``(held, divergent)``: indices into rank 0's storages that this rank
        holds byte for byte (same key, size, digest kind and value); and those
        of the same key and size whose bytes differ.
    """
    mine = {record.key: digest for record, digest in zip(records, digests)}
    held, divergent = [], []
    for index, (key, theirs) in enumerate(zip(reference_keys, reference)):
        own = mine.get(key)
        if own is None or own[0] != theirs[0]:
            continue
        if own[1] == theirs[1] != NONE and own[2] == theirs[2]:
            held.append(index)
        elif own[1] == theirs[1] != NONE:
            divergent.append(index)
    return held, divergent


def storage_names(obj: Any, keys: Iterable[str], plan: SavePlan, limit: int = 100_000) -> dict[str, str]:
    """A readable name for each storage key of ``plan``: the path of a tensor in ``obj`` using it.

    Walks dicts, lists, tuples and objects' ``__dict__`` (at most ``limit``
    items); a storage found nowhere is named ``data/<key>``.
    """
    wanted = {}
    for record in plan.storages:
        if record.key in keys:
            wanted[(record.device, record.data_ptr())] = record.key
    names: dict[str, str] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", obj)]
    visited = 0
    while stack and visited < limit and len(names) < len(wanted):
        path, item = stack.pop()
        visited += 1
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
                key = wanted.get((item.device, storage.data_ptr()))
            except Exception:  # noqa: BLE001 - sparse, nested and other layouts have no plain storage
                key = None
            if key is not None and key not in names:
                names[key] = path or "(the object)"
            continue
        try:
            if isinstance(item, dict):
                children = [(f"{path}.{k}" if path else str(k), v) for k, v in item.items()]
            elif isinstance(item, (list, tuple)):
                children = [(f"{path}[{i}]", v) for i, v in enumerate(item)]
            elif hasattr(item, "__dict__") and not isinstance(item, type):
                children = [(f"{path}.{k}" if path else k, v) for k, v in vars(item).items()]
            else:
                continue
        except Exception:  # noqa: BLE001 - a name is a courtesy; an odd object must not fail the save
            continue
        stack.extend(reversed(children))
    return {key: names.get(key, f"data/{key}") for key in keys}
