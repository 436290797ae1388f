"""CRC-32 spread over threads: pieces combined natively give zlib's CRC; verified loads use the pool."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import zlib

import pytest
import torch

import fastpersist
from fastpersist.io import checksum, engine


def _env() -> dict:
    """The environment for a child script: this checkout's fastpersist even when built in place."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("first,second", [(0, 0), (1, 0), (0, 1), (1, 1), (7, 4096), (4097, 65), (1 << 20, 12345)])
def test_crc32_combine_matches_zlib(first, second):
    a = bytes(_random_bytes(first, 1).numpy()) if first else b""
    b = bytes(_random_bytes(second, 2).numpy()) if second else b""
    assert engine.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("length", [0, 1, 63, 4096, (1 << 20) + 3, 5 * (1 << 20) + 17])
@pytest.mark.parametrize("piece", [4096, 1 << 20])
def test_parallel_crc_equals_zlib(length, piece):
    data = _random_bytes(length, length)
    expected = zlib.crc32(bytes(data.numpy()))
    assert checksum.crc32(data.data_ptr(), length, piece_size=piece) == expected
    # Continued from an earlier CRC, like a record written window by window.
    head = zlib.crc32(b"head")
    assert checksum.crc32(data.data_ptr(), length, head, piece_size=piece) == zlib.crc32(bytes(data.numpy()), head)
    assert checksum.submit_crc32(data.data_ptr(), length, piece_size=piece).result() == expected


@pytest.mark.parametrize("length", [0, 100, 3 * 4096 + 5])
def test_parallel_copy_with_crc(length):
    source = _random_bytes(length, 3)
    destination = torch.zeros(length, dtype=torch.uint8)
    crc = checksum.copy_with_crc32(destination.data_ptr(), source.data_ptr(), length, piece_size=4096)
    assert torch.equal(source, destination)
    assert crc == zlib.crc32(bytes(source.numpy()))
    destination.zero_()
    checksum.copy(destination.data_ptr(), source.data_ptr(), length, piece_size=4096)
    assert torch.equal(source, destination)


def test_batched_small_crcs():
    data = _random_bytes(10_000, 4)
    ranges = [(data.data_ptr() + o, n) for o, n in [(0, 0), (0, 1), (5, 64), (100, 9000)]]
    job = checksum.submit_crc32_many(ranges)
    raw = bytes(data.numpy())
    assert [job.crc(i) for i in range(len(job))] == [
        zlib.crc32(raw[o : o + n]) for o, n in [(0, 0), (0, 1), (5, 64), (100, 9000)]
    ]
    assert job.done()
    with pytest.raises(IndexError):
        job.crc(4)


def test_native_pool_threads_are_stopped_and_restarted():
    """checksum.shutdown() joins the native pool's threads; the next CRC starts a new pool."""
    data = _random_bytes(2 << 20, 6)
    expected = zlib.crc32(bytes(data.numpy()))
    assert checksum.crc32(data.data_ptr(), data.numel(), piece_size=1 << 18) == expected
    pool = checksum._crc_pool()
    assert pool.threads == checksum.threads()
    checksum.shutdown()
    assert pool.threads == 0
    assert pool.submit([data.data_ptr()], [data.numel()]).crc(0) == expected  # a stopped pool computes here
    assert checksum.crc32(data.data_ptr(), data.numel(), piece_size=1 << 18) == expected
    assert checksum._crc_pool() is not pool and checksum._crc_pool().threads == checksum.threads()


def test_crcs_at_interpreter_exit_run_on_the_calling_thread(tmp_path):
    """An atexit handler that runs after fastpersist's own (registered before the import) still gets CRC-32s;
    the process exits cleanly, its pool's threads joined."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import atexit, ctypes, sys, zlib\n"
        "data = bytes(range(256)) * 20000\n"
        "buffer = ctypes.create_string_buffer(data, len(data))\n"
        "def late():\n"
        "    from fastpersist.io import checksum\n"
        "    ok = checksum.crc32(ctypes.addressof(buffer), len(data), piece_size=1 << 16) == zlib.crc32(data)\n"
        "    print('late', ok, flush=True)\n"
        "atexit.register(late)\n"
        "from fastpersist.io import checksum\n"
        "print('early', checksum.crc32(ctypes.addressof(buffer), len(data), piece_size=1 << 16) == zlib.crc32(data))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["early", "True", "late", "True"]


def test_pool_is_reused_and_sized():
    assert checksum.threads() >= 1
    first = checksum.executor()
    assert checksum.executor() is first  # created once, reused by every save and load


def test_pool_survives_fork(tmp_path):
    data = _random_bytes(3 << 20, 5)
    checksum.crc32(data.data_ptr(), data.numel(), piece_size=1 << 20)  # parent's pool exists
    pid = os.fork()
    if pid == 0:  # child: the parent's threads are gone; a new pool must start
        try:
            ok = checksum.crc32(data.data_ptr(), data.numel(), piece_size=1 << 20) == zlib.crc32(bytes(data.numpy()))
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_verified_loads_use_pieces_and_catch_damage(tmp_path):
    # Records larger than a read piece are checksummed piece by piece and combined.
    state = {"big": torch.randn(3 << 20), "small": [torch.randn(3) for _ in range(300)], "step": 3}
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    for weights_only in (True, False):
        loaded = fastpersist.load(path, weights_only=weights_only, buffer_size=1 << 20)
        assert torch.equal(loaded["big"], state["big"]) and loaded["step"] == 3
        assert all(torch.equal(a, b) for a, b in zip(loaded["small"], state["small"]))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(fastpersist.ChecksumMismatchError, match="data/0"):
        fastpersist.load(path, buffer_size=1 << 20)


def test_one_handle_per_load(tmp_path, monkeypatch):
    """load(weights_only=False) flushes after every storage: it must not build a handle each time."""
    path = tmp_path / "many.pt"
    state = {f"t{i}": torch.randn(4) for i in range(500)}
    fastpersist.save(state, path)
    made = []
    real = engine.make_handle
    monkeypatch.setattr(engine, "make_handle", lambda *a, **k: made.append(1) or real(*a, **k))
    threads_before = threading.active_count()
    loaded = fastpersist.load(path, weights_only=False)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert len(made) <= 1
    assert threading.active_count() <= threads_before + checksum.threads()


@pytest.mark.gpu
def test_verified_cuda_load_with_small_windows(tmp_path):
    state = {"big": torch.randn(3 << 20), "small": [torch.randn(3) for _ in range(100)]}
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    loaded = fastpersist.load(path, map_location="cuda", read_buffer_size=1 << 20)
    assert torch.equal(loaded["big"].cpu(), state["big"])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(loaded["small"], state["small"]))
