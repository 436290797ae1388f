"""Loads that wait for each storage read the following records ahead, into the storages they become."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import fastpersist
from fastpersist.io import engine, reader

# Records of 1.2 MB (large: read in place); a read ahead limit of 4 MiB (1 MiB x 4) holds about 3 of them.
LIMITS = dict(read_buffer_size="1M", read_buffer_count=4)


def _state(count: int = 8) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "weights": {f"w{i}": torch.randn(300_000, generator=generator) for i in range(count)},
        "step": 7,
        "small": [torch.randn(5, generator=generator) for _ in range(3)],
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.device == b.device and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


class _Trace:
    """Records, in order, each read started ("start", name) and each flush ("flush", names flushed)."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, object]] = []
        self.most_ahead = 0
        start, flush = reader.FileStorageProvider._start_read, reader.FileStorageProvider.flush
        trace = self

        def traced_start(provider, record):
            trace.events.append(("start", record.name.rsplit("/", 1)[-1]))
            return start(provider, record)

        def traced_flush(provider):
            trace.events.append(("flush", [read.record.name.rsplit("/", 1)[-1] for read in provider._cpu]))
            trace.most_ahead = max(trace.most_ahead, provider._ahead_bytes)
            return flush(provider)

        monkeypatch.setattr(reader.FileStorageProvider, "_start_read", traced_start)
        monkeypatch.setattr(reader.FileStorageProvider, "flush", traced_flush)

    def started_before_flush_of(self, key: str) -> list[str]:
        """The records whose reads had started when the flush that waits for ``key`` began."""
        started = []
        for kind, value in self.events:
            if kind == "flush" and key in value:
                return started
            if kind == "start":
                started.append(value)
        raise AssertionError(f"no flush waited for {key}")


@pytest.mark.parametrize("map_location", [None, "cpu", "callable"])
def test_a_storage_by_storage_load_reads_the_next_records_ahead(tmp_path, monkeypatch, map_location):
    """weights_only=False (and a callable map_location) flush after each storage: the reads of the
    records that follow have started by then, within the limit, and each is read once."""
    state = _state()
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    trace = _Trace(monkeypatch)
    where = (lambda storage, location: storage) if map_location == "callable" else map_location
    loaded = fastpersist.load(path, weights_only=False, map_location=where, **LIMITS)
    assert _equal(loaded, state)
    flushes = [value for kind, value in trace.events if kind == "flush" and value]
    assert len(flushes) == 8  # one per large storage: the unpickler waits for each
    started = [value for kind, value in trace.events if kind == "start"]
    assert sorted(started) == sorted(set(started)) and len(started) == 8  # every record read once
    first = flushes[0][0]
    ahead = trace.started_before_flush_of(first)
    assert len(ahead) >= 3  # the first record and those after it, up to the limit
    assert trace.most_ahead <= 4 * (1 << 20) + 1_200_000  # the limit, overshot by at most one record


def test_a_batch_load_starts_each_read_when_the_unpickler_asks(tmp_path, monkeypatch):
    """weights_only=True waits once, at the end: all reads are in flight by then, each started once."""
    state = _state()
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    trace = _Trace(monkeypatch)
    assert _equal(fastpersist.load(path, **LIMITS), state)
    started = [value for kind, value in trace.events if kind == "start"]
    assert len(started) == len(set(started)) == 8
    flushes = [value for kind, value in trace.events if kind == "flush" and value]
    assert len(flushes) == 1 and len(flushes[0]) == 8


def test_reads_ahead_that_nobody_asks_for_are_dropped_when_the_load_ends(tmp_path, monkeypatch):
    """A storage record the pickle never names is still read ahead; its read fails here, which is
    nobody's business: the load succeeds and ends with nothing in flight."""
    state = _state()
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    start = reader.FileStorageProvider._start_read

    def failing_start(provider, record):
        if record.name.endswith("/data/6"):  # past the end of the file: the read fails
            record = record._replace(data_offset=os.path.getsize(path) + 4096)
        return start(provider, record)

    monkeypatch.setattr(reader.FileStorageProvider, "_start_read", failing_start)
    closed = []
    close = reader.FileStorageProvider.close
    requests = []

    def traced_close(provider):
        closed.append(sorted(provider._ahead))
        requests.extend(request for read in provider._ahead.values() for request, _ in read.requests)
        close(provider)
        closed.append(provider._ahead)

    monkeypatch.setattr(reader.FileStorageProvider, "close", traced_close)
    real_storage = reader.FileStorageProvider.storage

    def skipping_storage(provider, record, device):
        if record.name.endswith("/data/6"):  # as if the pickle never asked for it: a zeroed stand-in
            return torch.UntypedStorage(record.size)
        return real_storage(provider, record, device)

    monkeypatch.setattr(reader.FileStorageProvider, "storage", skipping_storage)
    loaded = fastpersist.load(path, weights_only=False, **LIMITS)
    assert torch.equal(loaded["weights"]["w7"], state["weights"]["w7"])
    assert closed[0] and closed[0][0].endswith("/data/6")  # read ahead, never asked for
    assert closed[1] == {} and requests and all(r.done for r in requests) and requests[0].failed


@pytest.mark.parametrize("nth", [1, 3, 9])
@pytest.mark.parametrize("weights_only", [True, False])
def test_a_read_error_ahead_fails_the_load_that_needs_it(tmp_path, nth, weights_only):
    state = _state()
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    with pytest.raises(OSError) as info:
        with engine.inject_fault(nth=nth, errno=errno.EIO, op="read"):
            fastpersist.load(path, weights_only=weights_only, block_size="256K", **LIMITS)
    assert info.value.errno == errno.EIO and info.value.filename == str(path)
    assert _equal(fastpersist.load(path, weights_only=weights_only, **LIMITS), state)


@pytest.mark.parametrize("weights_only", [True, False])
def test_damage_in_a_record_read_ahead_is_caught(tmp_path, weights_only, damage_record):
    state = _state()
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    damage_record(path, "/data/5", offset=-10)
    with pytest.raises(fastpersist.ChecksumMismatchError, match="data/5"):
        fastpersist.load(path, weights_only=weights_only, **LIMITS)
    loaded = fastpersist.load(path, weights_only=weights_only, verify=False, **LIMITS)
    assert torch.equal(loaded["weights"]["w4"], state["weights"]["w4"])


@pytest.mark.gpu
def test_a_record_read_ahead_for_the_cpu_may_go_to_the_gpu(tmp_path):
    """Saved devices decide (map_location=None): CPU records start the read ahead, a CUDA one takes its bytes."""
    state = _state()
    state["weights"]["w3"] = state["weights"]["w3"].cuda()
    state["weights"]["w6"] = state["weights"]["w6"].cuda()
    path = tmp_path / "mixed.pt"
    fastpersist.save(state, path)
    for weights_only in (True, False):
        assert _equal(fastpersist.load(path, weights_only=weights_only, **LIMITS), state)
