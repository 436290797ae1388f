"""The writer's idle work: what a caller queues while the ring's buffers are busy."""

from __future__ import annotations

import threading
import time
import zipfile

import pytest
import torch

import fastpersist
from fastpersist import config
from fastpersist.format.serializer import plan_save
from fastpersist.io import engine, writer

MiB = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(MiB // 4, generator=generator) for i in range(24)}  # 24 MiB, 1 MiB each


class _SlowHandle:
    """A native handle whose writes take 20 ms to submit: the ring is busy whenever the writer comes back."""

    def __init__(self, settings):
        self._inner = engine.make_handle(settings)

    def submit_write(self, *args):
        time.sleep(0.02)
        return self._inner.submit_write(*args)

    def wait(self):
        return self._inner.wait()


def _write_slowly(state, path) -> None:
    settings = config.resolve({"buffer_size": "1M", "block_size": "1M", "buffer_count": 2})
    file = engine.File(str(path), "w", direct=False)
    try:
        writer.write_plan(plan_save(state, "archive"), file, settings, make_handle=lambda: _SlowHandle(settings))
    finally:
        file.close()


def test_idle_work_runs_while_the_ring_is_busy_until_it_says_done(tmp_path):
    calls = []

    def step() -> bool:
        calls.append(threading.current_thread().name)
        return len(calls) < 3  # three steps of work, then nothing left

    state = _state()
    with writer.idle_work(step):
        _write_slowly(state, tmp_path / "a.pt")
    assert calls == [threading.current_thread().name] * 3  # on the writing thread, never again after False
    loaded = torch.load(tmp_path / "a.pt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_idle_work_belongs_to_its_thread_and_block(tmp_path):
    calls = []
    state = _state()
    with writer.idle_work(lambda: calls.append("outer") or True):
        other = threading.Thread(target=_write_slowly, args=(state, tmp_path / "b.pt"))
        other.start()
        other.join()
        assert calls == []  # another thread's write does not see it
        with writer.idle_work(lambda: calls.append("inner") or False):
            _write_slowly(state, tmp_path / "c.pt")
        assert calls == ["inner"]  # the innermost block wins, once it says done
    _write_slowly(state, tmp_path / "d.pt")
    assert calls == ["inner"]  # none outside the blocks


@pytest.mark.parametrize("checksum", [True, False], ids=["crc", "no-crc"])
def test_a_windows_large_cpu_pieces_are_copied_on_the_pool_together_and_their_crcs_fold_in_order(
    tmp_path, monkeypatch, checksum
):
    """Pieces of at least _POOL_COPY bytes go to the pool as one job per window, cut in PIECE_SIZE ranges (so a
    record's CRC-32 folds several ranges, some of them in windows of their own); smaller ones are copied on the
    filling thread. The archive's CRC-32s are zipfile's, and the state loads back equal."""
    monkeypatch.setattr(writer.crc_pool, "PIECE_SIZE", 192 << 10)
    jobs = []
    real = writer.crc_pool.submit_copies
    monkeypatch.setattr(
        writer.crc_pool, "submit_copies", lambda pieces, crc: jobs.append(len(pieces)) or real(pieces, crc)
    )
    generator = torch.Generator().manual_seed(1)
    sizes = [300 << 10, (1 << 20) + 3, 100, (5 << 20) + 7, (256 << 10) - 1, 257 << 10]
    state = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for i, n in enumerate(sizes)}
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path, buffer_size="1M", block_size="1M", buffer_count=2, checksum=checksum)
    assert jobs and max(jobs) > 1  # several ranges of a window in one job
    if checksum:
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None
    loaded = fastpersist.load(path, verify=checksum)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
