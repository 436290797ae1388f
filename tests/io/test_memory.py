"""Aligned, locked host memory and the per-process buffer pool."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest
import torch

from fastpersist.io import engine, memory


def test_aligned_buffer_basics():
    buf = engine.AlignedBuffer(10_000, lock=False)
    assert buf.ptr % 4096 == 0 and buf.nbytes == 10_000 and len(buf) == 10_000
    assert buf.locked is False and buf.lock_error == ""
    view = memoryview(buf)
    assert view.format == "B" and view.ndim == 1 and not view.readonly and view.nbytes == 10_000
    t = torch.frombuffer(buf, dtype=torch.uint8)
    assert t.data_ptr() == buf.ptr  # zero copy
    t.fill_(3)
    assert bytes(view[:4]) == b"\x03\x03\x03\x03"
    del view


def test_aligned_buffer_locked_and_huge():
    buf = engine.AlignedBuffer(4 << 20, lock=True, huge_pages=True)
    assert buf.ptr % (2 << 20) == 0
    assert buf.locked or buf.lock_error  # locked, or says why not
    empty = engine.AlignedBuffer(0)
    assert empty.nbytes == 0 and memoryview(empty).nbytes == 0


def test_release_hook_runs_before_unmap():
    calls = []
    buf = engine.AlignedBuffer(8192, lock=False)
    buf.set_release_hook(lambda: calls.append("released"))
    t = torch.frombuffer(buf, dtype=torch.uint8)
    del buf
    gc.collect()
    assert calls == []  # the tensor still holds the buffer
    t.fill_(1)
    del t
    gc.collect()
    assert calls == ["released"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_release_hook_errors_do_not_propagate():
    buf = engine.AlignedBuffer(4096, lock=False)

    def boom():
        raise RuntimeError("hook failed")

    buf.set_release_hook(boom)
    del buf  # reported as unraisable, not raised
    gc.collect()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.int64])
def test_new_cpu_locked_tensor(dtype):
    t = memory.new_cpu_locked_tensor(12_345, dtype)
    assert t.dtype == dtype and t.numel() == 12_345 and t.device.type == "cpu"
    assert t.data_ptr() % 4096 == 0 and t.is_contiguous()
    t.zero_()
    assert memory.is_locked_tensor(t) == (os.geteuid() == 0 or memory.is_locked_tensor(t))
    assert memory.free_cpu_locked_tensor(t) is True
    assert memory.free_cpu_locked_tensor(t) is False
    z = memory.new_cpu_locked_tensor(0, dtype)
    assert z.numel() == 0 and z.dtype == dtype


def test_a_locked_tensor_dropped_without_free_is_forgotten_when_unmapped():
    """The registry follows the mapping: a dropped tensor's address range, reused by a later mapping, is not ours."""
    sizes = memory._allocations.sizes
    before = dict(sizes)
    for _ in range(20):
        t = memory.new_cpu_locked_tensor(16 << 10)
        base = t.data_ptr()
        view = t[100:200]
        assert base in sizes and memory.is_managed_locked_memory(view)
        del t
        assert base in sizes  # the view still holds the mapping
        del view  # reference counting frees it at once
        assert base not in sizes  # forgotten before the unmap, without free_cpu_locked_tensor
        reused = memory.aligned_empty(16 << 10)  # often lands where the dropped one was
        assert not memory.is_managed_locked_memory(reused)
        del reused
    assert sizes == before  # nothing leaked


def test_aligned_empty():
    small = memory.aligned_empty(100)
    assert small.dtype == torch.uint8 and small.numel() == 100 and small.data_ptr() % 4096 == 0
    big = memory.aligned_empty(5 << 20)
    assert big.data_ptr() % (2 << 20) == 0  # huge-page aligned
    big.fill_(9)
    assert int(big[-1]) == 9
    assert memory.aligned_empty(0).numel() == 0
    with pytest.raises(ValueError):
        memory.aligned_empty(-1)


def test_lease_buffers_reuses_and_separates():
    size = 3 << 20
    with memory.lease_buffers(2, size) as first:
        assert len(first) == 2 and all(b.numel() == size and b.dtype == torch.uint8 for b in first)
        assert all(b.data_ptr() % 4096 == 0 for b in first)
        pointers = {b.data_ptr() for b in first}
        assert len(pointers) == 2
        with memory.lease_buffers(2, size) as nested:  # concurrent lease: distinct buffers
            assert not pointers & {b.data_ptr() for b in nested}
    with memory.lease_buffers(2, size) as again:  # allocated once, reused
        assert {b.data_ptr() for b in again} <= pointers | {b.data_ptr() for b in nested}
    allocated = memory.pooled_bytes()
    with memory.lease_buffers(4, size):
        pass
    assert memory.pooled_bytes() == allocated  # no new allocation for 4 buffers already in the pool
    assert memory.release_pooled_buffers() >= 4 * size


def test_pooled_buffers_ask_for_huge_pages_unless_the_setting_says_no():
    size = 4 << 20
    with memory.lease_buffers(1, size) as (huge,), memory.lease_buffers(1, size, huge_pages=False) as (small,):
        assert huge.data_ptr() % (2 << 20) == 0  # 2 MiB aligned: advised for transparent huge pages
        assert huge.data_ptr() != small.data_ptr()
    with memory.lease_buffers(1, size, huge_pages=False) as (again,):  # the pool keeps the two kinds apart
        assert again.data_ptr() == small.data_ptr()
    with memory.lease_buffers(1, 1 << 20) as (tiny,):  # below one huge page: plain pages
        assert tiny.data_ptr() % 4096 == 0


def test_save_and_load_rings_follow_the_huge_pages_setting(tmp_path, monkeypatch):
    import fastpersist

    leases = []
    lease = memory.lease_buffers

    def recording(count, size, huge_pages=True):
        leases.append(huge_pages)
        return lease(count, size, huge_pages)

    monkeypatch.setattr(memory, "lease_buffers", recording)
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    for huge in (True, False):
        leases.clear()
        fastpersist.save(state, tmp_path / "s.pt", huge_pages=huge)
        assert leases == [huge]
    assert torch.equal(fastpersist.load(tmp_path / "s.pt")["w"], state["w"])


def test_lease_buffers_thread_safe(in_threads):
    size = 1 << 20
    seen: list[set[int]] = []
    memory.release_pooled_buffers()
    before = memory.pooled_bytes()

    def worker(_):
        for _ in range(20):
            with memory.lease_buffers(2, size) as buffers:
                ptrs = {b.data_ptr() for b in buffers}
                seen.append(ptrs)
                for b in buffers:
                    b.fill_(1)

    assert not in_threads(worker, 4)
    assert memory.pooled_bytes() - before <= 8 * size  # at most 4 threads x 2 buffers ever allocated


def test_lease_buffers_concurrent_leases_never_share(in_threads):
    size = 1 << 20
    active: set[int] = set()
    lock = threading.Lock()
    clashes = []

    def worker(_):
        for _ in range(50):
            with memory.lease_buffers(1, size) as (buffer,):
                with lock:
                    if buffer.data_ptr() in active:
                        clashes.append(buffer.data_ptr())
                    active.add(buffer.data_ptr())
                with lock:
                    active.discard(buffer.data_ptr())

    assert in_threads(worker, 4) == []
    assert clashes == []


def test_cast_to_byte_tensor_reexported():
    t = torch.arange(10, dtype=torch.int32)
    b = memory.cast_to_byte_tensor(t)
    assert b.dtype == torch.uint8 and b.numel() == 40 and b.data_ptr() == t.data_ptr()


_UNLOCKED_SCRIPT = r"""
import warnings, torch
from fastpersist.io import engine, memory
buf = engine.AlignedBuffer(16 << 20, lock=True)
assert buf.locked is False and "mlock" in buf.lock_error and "ulimit -l" in buf.lock_error, buf.lock_error
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = memory.new_cpu_locked_tensor(16 << 20)
    b = memory.new_cpu_locked_tensor(16 << 20)
a.fill_(1); b.fill_(2)
assert int(a.sum()) == 16 << 20
relevant = [w for w in caught if "could not lock" in str(w.message)]
assert len(relevant) == 1, [str(w.message) for w in caught]
print("ok")
"""


@pytest.mark.root
def test_mlock_failure_degrades_to_unlocked_with_one_warning():
    """Without CAP_IPC_LOCK and with a tiny RLIMIT_MEMLOCK, locking fails cleanly."""
    command = [
        "setpriv",
        "--inh-caps=-ipc_lock",
        "--bounding-set=-ipc_lock",
        "--",
        "bash",
        "-c",
        f'ulimit -l 64 && exec "{sys.executable}" -c "$0"',
        _UNLOCKED_SCRIPT,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("setpriv not installed")
    if "setpriv" in result.stderr and result.returncode != 0 and "ok" not in result.stdout:
        if "Operation not permitted" in result.stderr or "unrecognized" in result.stderr:
            pytest.skip(f"cannot drop CAP_IPC_LOCK here: {result.stderr.strip()}")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@pytest.mark.gpu
def test_locked_tensor_is_registered_with_cuda():
    torch.cuda.init()  # registration needs CUDA initialized (a process using CUDA has it)
    t = memory.new_cpu_locked_tensor(1 << 20)
    assert t.is_pinned()  # cudaHostRegister'ed memory counts as pinned
    t.fill_(5)
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(d[0]) == 5
    del t, d
    gc.collect()  # unregistering must not fail or crash


_CPU_SAVE_SCRIPT = r"""
import os, sys, torch, fastpersist
from fastpersist.io import memory
path = os.path.join(sys.argv[1], "cpu.pt")
state = {f"w{i}": torch.full((1000,), float(i)) for i in range(10)}
fastpersist.save(state, path)
assert torch.equal(fastpersist.load(path)["w3"], state["w3"])
for mode in ("snapshot", "pipelined"):
    fastpersist.async_save(state, path + "." + mode, mode=mode).result()
assert not torch.cuda.is_initialized(), "a CPU save or load initialized CUDA"
count, size = memory.ring_shape(os.path.getsize(path), fastpersist.config.get("buffer_size"), 1)
with memory.lease_buffers(1, size) as (before,):
    assert not before.is_pinned()
torch.cuda.init()
with memory.lease_buffers(1, size) as (after,):  # the same pooled buffer, registered on this lease
    assert after.data_ptr() == before.data_ptr() and after.is_pinned()
    after.fill_(7)
    assert int(after.to("cuda", non_blocking=True).sum()) == 7 * size
print("ok")
"""


@pytest.mark.gpu
def test_cpu_saves_do_not_initialize_cuda_and_pooled_buffers_register_later(tmp_path):
    """A CPU-only save must not create a CUDA context (~250 MB of host memory); its ring registers once CUDA is up."""
    result = subprocess.run(
        [sys.executable, "-c", _CPU_SAVE_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@pytest.mark.parametrize("reporting", [False, True])
def test_load_destinations_leave_huge_pages_where_freed_memory_goes_back_to_the_host(tmp_path, monkeypatch, reporting):
    import fastpersist

    monkeypatch.setattr(memory, "_free_page_reporting", reporting)
    made = []
    real = engine.AlignedBuffer

    def recording(nbytes, lock=True, huge_pages=False):
        made.append((nbytes, huge_pages))
        return real(nbytes, lock, huge_pages)

    monkeypatch.setattr(engine, "AlignedBuffer", recording)
    assert memory.destination_huge_pages(True) is not reporting
    assert memory.destination_huge_pages(False) is False
    assert memory.destination_buffer(4 << 20, True).huge_pages is (not reporting)
    assert memory.destination_buffer(1 << 20, True).huge_pages is False  # below one huge page
    assert memory.destination_empty(4 << 20, False).numel() == 4 << 20
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # one 4 MiB record: read in place
    torch.save(state, tmp_path / "t.pt")
    made.clear()
    assert torch.equal(fastpersist.load(tmp_path / "t.pt", map_location="cpu")["w"], state["w"])
    destinations = [huge for nbytes, huge in made if nbytes >= 4 << 20]
    assert destinations == [not reporting]
