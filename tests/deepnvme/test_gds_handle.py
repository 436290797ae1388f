"""GdsHandle on a CUDA device, both data paths: round trips at awkward sizes, offsets, async, pinning.

Every test runs once per path (``bounce``, ``cufile``); the ``cufile`` cases
skip where cuFile cannot start (no libcufile), saying why. Files are written
and checked with plain Python. Run on a GPU machine::

    python -m pytest -q -rs tests/deepnvme/test_gds_handle.py
"""

from __future__ import annotations

import os

import pytest
import torch

from fastpersist import config
from fastpersist.deepnvme import GDSBuilder, GdsHandle
from fastpersist.errors import GdsUnavailableError
from fastpersist.io.engine import UnexpectedEndOfFileError

pytestmark = pytest.mark.gpu

CHUNK = 64 << 10  # the bounce ring's chunk in these tests: "several chunks" stays small
SIZES = [0, 1, 4095, 4096, 4097, CHUNK - 1, CHUNK + 1, 5 * CHUNK + 123]


@pytest.fixture(params=["bounce", "cufile"])
def handle(request, tmp_path) -> GdsHandle:
    try:
        made = GdsHandle(1 << 20, 8, False, True, 3, path=request.param, cuda_chunk_bytes=CHUNK, cuda_chunks=3)
    except GdsUnavailableError as e:
        pytest.skip(f"the cufile path cannot start here: {e}")
    if made.path == "cufile":
        from fastpersist.deepnvme import cufile, gds

        problem = gds.probe_registration(cufile.open_driver(config.settings().cufile_library), str(tmp_path))
        if problem is not None:
            pytest.skip(f"cuFile opens here but cannot register files in {tmp_path}: {problem}")
    return made


def _random_device(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _write_plain(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _read_plain(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_the_path_asked_for_is_the_path_taken(handle):
    assert handle.path == handle.get_path() == handle.get_requested_path()
    assert handle.path_reason
    if handle.path == "cufile":
        assert isinstance(handle.get_cufile_compat_mode(), bool)
    else:
        assert handle.get_cufile_compat_mode() is None
    assert "path=" in repr(handle)


def test_getters_are_deepnvmes(handle):
    assert handle.get_block_size() == 1 << 20 and handle.get_queue_depth() == 8
    assert not handle.get_single_submit() and handle.get_overlap_events()
    assert handle.get_intra_op_parallelism() == 3 == handle.get_thread_count()
    assert handle.get_alignment() == 4096


@pytest.mark.parametrize("nbytes", SIZES)
def test_read_files_written_by_python(handle, tmp_path, nbytes):
    data = os.urandom(nbytes)
    path = tmp_path / "in.bin"
    _write_plain(path, data)
    out = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    assert handle.sync_pread(out, str(path)) == 1
    assert _bytes_of(out) == data


@pytest.mark.parametrize("nbytes", SIZES)
def test_write_files_read_by_python(handle, tmp_path, nbytes):
    t = _random_device(nbytes, seed=nbytes)
    path = tmp_path / "out.bin"
    assert handle.sync_pwrite(t, str(path)) == 1
    assert _read_plain(path) == _bytes_of(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_round_trip_of_dtypes_and_shapes(handle, tmp_path, dtype):
    t = torch.randn(37, 129, device="cuda").to(dtype)
    back = torch.empty_like(t)
    path = str(tmp_path / "t.bin")
    handle.sync_pwrite(t, path)
    handle.sync_pread(back, path)
    assert torch.equal(back, t)


def test_offsets_write_in_place_and_read_back(handle, tmp_path):
    path = tmp_path / "offsets.bin"
    base = os.urandom(3 * 4096 + 11)
    _write_plain(path, base)
    piece = _random_device(4097, seed=3)
    handle.sync_pwrite(piece, str(path), 4095)  # unaligned offset and size; never truncates
    expected = base[:4095] + _bytes_of(piece) + base[4095 + 4097 :]
    assert _read_plain(path) == expected
    out = torch.empty(5000, dtype=torch.uint8, device="cuda")
    handle.sync_pread(out, str(path), 1234)
    assert _bytes_of(out) == expected[1234 : 1234 + 5000]
    aligned = _random_device(8192, seed=4)
    handle.sync_pwrite(aligned, str(path), 8192, truncate=True)
    assert _read_plain(path) == expected[:8192] + _bytes_of(aligned)


def test_views_inside_a_pinned_tensor(handle, tmp_path):
    data = os.urandom(6 * 4096)
    path = tmp_path / "view.bin"
    _write_plain(path, data)
    big = handle.new_pinned_device_tensor(8 * 4096, torch.uint8)
    try:
        view = big.narrow(0, 4096 + 5, 2 * 4096)  # inside a registered buffer: (base, offset) for cuFile
        handle.sync_pread(view, str(path), 4096)
        assert _bytes_of(view) == data[4096 : 3 * 4096]
        out = tmp_path / "view-out.bin"
        handle.sync_pwrite(view, str(out))
        assert _read_plain(out) == data[4096 : 3 * 4096]
    finally:
        assert handle.free_pinned_device_tensor(big)


def test_async_operations_and_wait(handle, tmp_path):
    inputs = [os.urandom(n) for n in (4097, 3 * CHUNK + 1, 1)]
    paths = []
    for i, data in enumerate(inputs):
        paths.append(str(tmp_path / f"in{i}.bin"))
        _write_plain(paths[-1], data)
    outs = [torch.empty(len(d), dtype=torch.uint8, device="cuda") for d in inputs]
    for out, path in zip(outs, paths):
        assert handle.async_pread(out, path) == 0
    assert handle.wait() == 3
    assert [_bytes_of(o) for o in outs] == inputs
    written = [str(tmp_path / f"out{i}.bin") for i in range(3)]
    for out, path in zip(outs, written):
        assert handle.pwrite(out, path, False, True) == 0  # DeepNVMe's positional async (ds_io's call)
    assert handle.pwrite(outs[0], str(tmp_path / "kw.bin"), **{"async": True}) == 0
    assert handle.wait() == 4 and handle.pending() == 0 and handle.wait() == 0
    assert [_read_plain(p) for p in written] == inputs


def test_pin_unpin_and_new_free_pinned_device_tensor(handle):
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    assert not handle.is_pinned(t)
    assert handle.pin_device_tensor(t) is True
    assert handle.is_pinned(t) and handle.is_pinned(t[4096:8192])
    assert handle.unpin_device_tensor(t) is True and not handle.is_pinned(t)
    assert handle.unpin_device_tensor(t) is False  # was not pinned any more
    example = torch.empty(3, dtype=torch.bfloat16, device="cuda")
    p = handle.new_pinned_device_tensor(1000, example)
    assert p.dtype == torch.bfloat16 and p.device == example.device and p.numel() == 1000 and handle.is_pinned(p)
    assert handle.free_pinned_device_tensor(p) is True and not handle.is_pinned(p)
    q = handle.new_pinned_device_tensor(10, example_tenosr=torch.empty(0, dtype=torch.float32))  # DeepNVMe's keyword
    assert q.device.type == "cuda" and q.dtype == torch.float32
    handle.free_pinned_device_tensor(q)
    assert handle.free_cpu_locked_tensor(q) is False  # what DeepSpeed's ds_io calls on its CUDA buffer at the end
    locked = handle.new_cpu_locked_tensor(4096, torch.uint8)
    assert handle.is_pinned(locked) and handle.free_cpu_locked_tensor(locked) is True


def test_gds_only_calls_refuse_cpu_tensors(handle):
    with pytest.raises(TypeError, match="needs a CUDA tensor"):
        handle.pin_device_tensor(torch.zeros(16))
    with pytest.raises(TypeError, match="needs a CUDA tensor"):
        handle.unpin_device_tensor(torch.zeros(16))
    with pytest.raises(ValueError):
        handle.pin_device_tensor(torch.zeros(4, 4, device="cuda").t())  # not contiguous


def test_cpu_tensors_go_through_the_aio_base_as_in_deepnvme(handle, tmp_path):
    # DeepSpeed's test_gds.py (TestAsyncFileOffset) writes CPU tensors through a gds_handle.
    t = torch.arange(10000, dtype=torch.int32)
    path = str(tmp_path / "cpu.bin")
    assert handle.async_pwrite(t, path) == 0 and handle.wait() == 1
    back = torch.empty_like(t)
    assert handle.sync_pread(back, path) == 1 and torch.equal(back, t)


def test_errors(handle, tmp_path):
    with pytest.raises(FileNotFoundError):
        handle.sync_pread(torch.empty(10, dtype=torch.uint8, device="cuda"), str(tmp_path / "missing.bin"))
    short = tmp_path / "short.bin"
    _write_plain(short, os.urandom(100))
    with pytest.raises(UnexpectedEndOfFileError) as e:
        handle.sync_pread(torch.empty(4096, dtype=torch.uint8, device="cuda"), str(short))
    assert isinstance(e.value, EOFError)
    handle.async_pread(torch.empty(4096, dtype=torch.uint8, device="cuda"), str(short))
    with pytest.raises(EOFError):
        handle.wait()
    assert handle.wait() == 0  # usable afterwards
    with pytest.raises(ValueError, match="file_offset"):
        handle.sync_pwrite(torch.zeros(4, device="cuda"), str(tmp_path / "x"), -1)


def test_validate_and_descriptors(handle, tmp_path):
    t = _random_device(3 * 4096, seed=9)
    path = str(tmp_path / "fd.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert handle.pwrite(t, None, True, False, 0, fd=fd) == 1  # validate=True checks the bytes
        out = torch.empty_like(t)
        assert handle.sync_pread(out, fd=fd) == 1
        assert torch.equal(out, t)
        assert handle.write(t, path, True) == 0 and handle.read(out, path, True) == 0
    finally:
        os.close(fd)


def test_work_queued_on_the_callers_stream_comes_first(handle, tmp_path):
    stream = torch.cuda.Stream()
    t = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    path = str(tmp_path / "stream.bin")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keeps the stream busy, so the fill below is still queued at the call
        t.fill_(42)
        handle.sync_pwrite(t, path)
    assert _read_plain(path) == bytes([42]) * t.numel()
    back = torch.empty_like(t)
    with torch.cuda.stream(stream):
        handle.sync_pread(back, path)
        total = int(back.sum().item())
    assert total == 42 * t.numel()


def test_blocking_calls_from_several_threads(handle, tmp_path, in_threads):
    tensors = [_random_device(2 * CHUNK + i, seed=i) for i in range(4)]

    def run(i: int) -> None:
        path = str(tmp_path / f"thread{i}.bin")
        assert handle.sync_pwrite(tensors[i], path) == 1
        back = torch.empty_like(tensors[i])
        assert handle.sync_pread(back, path) == 1
        assert torch.equal(back, tensors[i])

    errors = in_threads(run, 4)
    assert not errors, errors


def test_auto_without_libcufile_takes_the_bounce_path_and_says_why(tmp_path):
    with config.override(cufile_library=str(tmp_path / "no-such-libcufile.so.0")):
        h = GdsHandle()
    assert h.path == "bounce" and "could not be loaded" in h.path_reason
    with config.override(cufile_library=str(tmp_path / "no-such-libcufile.so.0")):
        with pytest.raises(GdsUnavailableError, match="cannot start"):
            GdsHandle(path="cufile")
    t = _random_device(4097)
    h.sync_pwrite(t, str(tmp_path / "b.bin"))
    assert _read_plain(tmp_path / "b.bin") == _bytes_of(t)


def test_builder_gives_the_handle():
    assert GDSBuilder().is_compatible()
    h = GDSBuilder().load().gds_handle(1 << 18, 2, True, True, 2)
    assert isinstance(h, GdsHandle) and h.get_intra_op_parallelism() == 2
