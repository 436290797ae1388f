"""safetensors files: round trips both ways with the safetensors library, every dtype, errors, lazy access."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
import safetensors

import fastpersist
from fastpersist.api import safetensors as fs
from fastpersist.errors import InvalidSafetensorsError, UnsupportedObjectError
from fastpersist.format import safetensors as layout
from fastpersist.io import engine
from fastpersist.tensors import cast_to_byte_tensor, host_memoryview


def _bytes(tensor: torch.Tensor) -> bytes:
    host = cast_to_byte_tensor(tensor.cpu().contiguous())  # kept alive while the view is read
    return bytes(host_memoryview(host))


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    assert _bytes(a) == _bytes(b)


def _every_dtype() -> list[torch.dtype]:
    return [entry.torch for entry in layout.DTYPES.values() if entry.torch is not None]


def _sample(dtype: torch.dtype, shape=(3, 5), seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with varied bytes (made as raw bytes: float8/float4 have no arithmetic)."""
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _data_section_start(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", _every_dtype(), ids=str)
def test_every_dtype_both_ways(tmp_path, dtype):
    tensors = {"x": _sample(dtype), "scalar": _sample(dtype, ()), "empty": _sample(dtype, (0, 4))}
    if dtype is getattr(torch, "float4_e2m1fn_x2", None):
        # Two 4-bit values per torch element: a 0-d one has no safetensors shape (both libraries refuse it).
        scalar = tensors.pop("scalar")
        with pytest.raises(ValueError, match="0-d"):
            fs.save_file({"scalar": scalar}, tmp_path / "scalar.safetensors")
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    fs.save_file(tensors, ours)
    safetensors_torch.save_file(tensors, theirs)
    for loaded in (safetensors_torch.load_file(ours), fs.load_file(ours), fs.load_file(theirs)):
        assert set(loaded) == set(tensors)
        for name, tensor in tensors.items():
            _same(loaded[name], tensor)


def test_bytes_api_matches_the_library_exactly():
    tensors = {
        name: _sample(dtype, seed=i)
        for i, (name, dtype) in enumerate((str(d).split(".")[-1], d) for d in _every_dtype())
    }
    metadata = {"ünïcode": "✓"}  # one key: the library writes a HashMap, in random order
    ours = fs.save(tensors, metadata=metadata)
    assert ours == safetensors_torch.save(tensors, metadata=metadata)
    loaded = fs.load(ours)
    for name, tensor in tensors.items():
        _same(loaded[name], tensor)


def test_alignment_8_gives_the_library_bytes_and_default_aligns_the_data(tmp_path):
    tensors = {"b": torch.arange(7, dtype=torch.int16), "a": torch.randn(3, 3), "c": torch.ones(2, dtype=torch.float64)}
    safetensors_torch.save_file(tensors, tmp_path / "lib.safetensors", metadata={"k": "v"})
    fs.save_file(tensors, tmp_path / "eight.safetensors", metadata={"k": "v"}, alignment=8)
    assert (tmp_path / "eight.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    fs.save_file(tensors, tmp_path / "aligned.safetensors", metadata={"k": "v"})
    assert _data_section_start(tmp_path / "aligned.safetensors") % 4096 == 0
    with safetensors.safe_open(tmp_path / "aligned.safetensors", framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        for name in tensors:
            _same(f.get_tensor(name), tensors[name])


def test_metadata_round_trip_and_none(tmp_path):
    path = tmp_path / "m.safetensors"
    fs.save_file({"t": torch.ones(2)}, path, metadata={"a": "1", "json": json.dumps({"x": [1, 2]})})
    with fs.safe_open(path) as f:
        assert f.metadata() == {"a": "1", "json": '{"x": [1, 2]}'}
    with safetensors.safe_open(path, framework="pt") as f:
        assert f.metadata() == {"a": "1", "json": '{"x": [1, 2]}'}
    fs.save_file({"t": torch.ones(2)}, path)
    with fs.safe_open(path) as f:
        assert f.metadata() is None


def test_no_tensors_at_all(tmp_path):
    path = tmp_path / "empty.safetensors"
    fs.save_file({}, path, metadata={"only": "metadata"})
    assert fs.load_file(path) == {}
    assert safetensors_torch.load_file(path) == {}
    safetensors_torch.save_file({}, tmp_path / "lib.safetensors")
    assert fs.load_file(tmp_path / "lib.safetensors") == {}


def test_only_empty_tensors(tmp_path):
    tensors = {"a": torch.zeros(2, 0), "b": torch.zeros(0, dtype=torch.int8)}
    path = tmp_path / "e.safetensors"
    fs.save_file(tensors, path)
    for loaded in (fs.load_file(path), safetensors_torch.load_file(path)):
        for name in tensors:
            _same(loaded[name], tensors[name])


@pytest.mark.parametrize("buffer_size", ["4K", "1M"])
@pytest.mark.parametrize("engine_name", engine.engines_compiled())
def test_large_file_across_many_ring_windows(tmp_path, buffer_size, engine_name):
    # Odd sizes so that tensors straddle every window boundary; ~200 MB in all.
    generator = torch.Generator().manual_seed(1)
    tensors = {
        f"layer{i}.weight": torch.randint(-(2**15), 2**15, (size,), dtype=torch.int16, generator=generator)
        for i, size in enumerate([1, 4095, 4097, (1 << 20) + 3, 25_000_001, 75_000_003])
    }
    if buffer_size == "4K":
        tensors = {k: v[:300_000] for k, v in tensors.items()}  # tiny windows: keep it quick
    path = tmp_path / "large.safetensors"
    fs.save_file(tensors, path, buffer_size=buffer_size, engine=engine_name)
    theirs = safetensors_torch.load_file(path)
    ours = fs.load_file(path, buffer_size=buffer_size, engine=engine_name)
    for name, tensor in tensors.items():
        assert torch.equal(theirs[name], tensor)
        assert torch.equal(ours[name], tensor)


def test_loads_on_tmpfs_without_o_direct(shm_dir):
    tensors = {"a": torch.randn(1000, 33), "b": torch.arange(5)}
    path = os.path.join(shm_dir, "x.safetensors")
    fs.save_file(tensors, path)
    loaded = fs.load_file(path)
    for name in tensors:
        _same(loaded[name], tensors[name])


def test_cpu_tensors_own_page_aligned_memory_and_are_writable(tmp_path):
    path = tmp_path / "w.safetensors"
    fs.save_file({"big": torch.randn(512, 1024), "small": torch.ones(3)}, path)
    loaded = fs.load_file(path)
    big = loaded["big"]
    # The storage's address agrees with the file offset modulo the page: the read went direct.
    with fs.safe_open(path) as f:
        offset = f._open().header.tensors["big"].start
    assert big.data_ptr() % 4096 == offset % 4096
    big.add_(1)  # a private copy, never a mapping of the file
    loaded["small"].zero_()
    assert torch.equal(fs.load_file(path)["small"], torch.ones(3))


def test_overwrites_atomically_and_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "model.safetensors"
    fs.save_file({"v": torch.ones(1 << 20)}, path)
    before = path.read_bytes()
    with engine.inject_fault(nth=1, errno=errno.ENOSPC, op="write"):
        with pytest.raises(OSError) as caught:
            fs.save_file({"v": torch.zeros(1 << 20)}, path)
    assert caught.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_async_save_file(tmp_path):
    tensors = {"a": torch.randn(100, 100), "b": torch.arange(10)}
    future = fs.async_save_file(tensors, tmp_path / "a.safetensors", metadata={"step": "3"})
    assert future.result() is None
    loaded = safetensors_torch.load_file(tmp_path / "a.safetensors")
    for name in tensors:
        _same(loaded[name], tensors[name])


def test_settings_are_per_call_and_unknown_keywords_raise(tmp_path):
    fs.save_file({"a": torch.ones(3)}, tmp_path / "a.safetensors", fsync=False, engine="threads", direct=False)
    assert torch.equal(fs.load_file(tmp_path / "a.safetensors", direct=False)["a"], torch.ones(3))
    with pytest.raises(TypeError, match="unexpected keyword"):
        fs.save_file({"a": torch.ones(3)}, tmp_path / "a.safetensors", compress=True)


def test_save_model_and_load_model_handle_tied_weights(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.b.weight = self.a.weight

    model = Tied()
    path = tmp_path / "tied.safetensors"
    with pytest.raises(RuntimeError, match="share memory"):
        fs.save_file(model.state_dict(), path)
    fs.save_model(model, path)
    fresh = Tied()
    missing, unexpected = fs.load_model(fresh, path)
    assert not missing and not unexpected
    assert torch.equal(fresh.a.weight, model.a.weight) and fresh.b.weight is fresh.a.weight
    # The library reads what we wrote and the other way round.
    other = Tied()
    safetensors_torch.load_model(other, path)
    assert torch.equal(other.a.weight, model.a.weight)


# ----------------------------------------------------------------------------- lazy access


def test_safe_open_reads_single_tensors_and_slices(tmp_path):
    big = torch.arange(4000 * 64, dtype=torch.float32).reshape(4000, 64)
    tensors = {"big": big, "vec": torch.arange(10), "scalar": torch.tensor(7, dtype=torch.int32)}
    path = tmp_path / "lazy.safetensors"
    fs.save_file(tensors, path, metadata={"m": "1"})
    with fs.safe_open(path, framework="pt", device="cpu") as f:
        assert f.keys() == ["big", "scalar", "vec"]
        assert set(f.offset_keys()) == set(tensors)
        assert f.metadata() == {"m": "1"}
        assert torch.equal(f.get_tensor("vec"), tensors["vec"])
        part = f.get_slice("big")
        assert part.get_shape() == [4000, 64] and part.get_dtype() == "F32"
        for index in [
            slice(10, 20),
            (slice(None), slice(3, 9)),
            (slice(100, 3000, 7), 5),
            -1,
            (3, slice(None, None, 2)),
            slice(3990, 5000),
            slice(50, 10),
            Ellipsis,
            (Ellipsis, 2),
        ]:
            assert torch.equal(part[index], big[index]), index
        assert torch.equal(f.get_slice("scalar")[()], tensors["scalar"])
        with pytest.raises(IndexError):
            part[4000]
        with pytest.raises(KeyError, match="does not contain tensor nope"):
            f.get_tensor("nope")
    with pytest.raises(ValueError, match="closed"):
        f.keys()
    library = pytest.importorskip("safetensors")
    with pytest.raises(library.SafetensorError, match="closed"):  # what the library raises there
        f.get_tensor("scalar")


def test_safe_open_rejects_other_frameworks_and_backends(tmp_path):
    path = tmp_path / "x.safetensors"
    fs.save_file({"a": torch.ones(1)}, path)
    with pytest.raises(ValueError, match="framework"):
        fs.safe_open(path, framework="numpy")
    with pytest.raises(ValueError, match="backend"):
        fs.safe_open(path, framework="pt", backend="not_a_backend")
    assert torch.equal(fs.load_file(path, backend="pread")["a"], torch.ones(1))


# ----------------------------------------------------------------------------- errors on save


def test_save_refuses_what_the_library_refuses(tmp_path):
    path = tmp_path / "x.safetensors"
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    cases = [
        ("notadict", ValueError, "Expected a dict"),
        ({"a": {"b": 1}}, ValueError, "Key `a` is invalid"),
        ({"a": torch.ones(2, 2).to_sparse()}, ValueError, "sparse"),
        ({"a": base[:, 1]}, ValueError, "non contiguous"),
        ({"A": base, "B": base[:1]}, RuntimeError, "share memory"),
        ({"A": base, "B": base[1:]}, RuntimeError, "share memory"),
        ({"a": torch.zeros(2, device="meta")}, RuntimeError, "Cannot copy out of meta tensor"),
        ({"a": torch.zeros(2, dtype=torch.complex128)}, UnsupportedObjectError, "complex128"),
    ]
    for tensors, error, message in cases:
        for save in (fs.save_file, safetensors_torch.save_file):
            library = save is safetensors_torch.save_file
            if library and error is UnsupportedObjectError:
                continue  # the library raises a bare KeyError(torch.complex128)
            with pytest.raises(error, match=None if library else message):
                save(tensors, path)
    assert not path.exists()
    # Disjoint slices of one storage are allowed, as in the library.
    fs.save_file({"x": base[1:], "y": base[:1]}, path)
    assert torch.equal(fs.load_file(path)["x"], base[1:])
    with pytest.raises(TypeError, match="str to str"):
        fs.save_file({"a": torch.ones(1)}, path, metadata={"step": 3})
    with pytest.raises(OSError) as caught:
        fs.save_file({"a": torch.ones(1)}, tmp_path / "missing" / "x.safetensors")
    assert caught.value.errno == errno.ENOENT


# ----------------------------------------------------------------------------- errors on load


def _write(path, header: bytes, data: bytes = b"", length: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length) + header + data)


def _header(entries: dict) -> bytes:
    return json.dumps(entries).encode()


@pytest.mark.parametrize(
    "header, data, length, message",
    [
        (b"", b"", 0, "invalid JSON"),
        (b"{not json", b"", None, "invalid JSON"),
        (b"\xff\xfe{}", b"", None, "invalid UTF-8"),
        (b"[1, 2]", b"", None, "expected an object"),
        (b"{}", b"", 10**9, "header too large"),
        (b"{}", b"", 100, "invalid header length"),
        (_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}), b"\0" * 4, None, "not fully covered"),
        (_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}), b"\0" * 9, None, "not fully covered"),
        (
            _header(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                }
            ),
            b"\0" * 12,
            None,
            "invalid offset for tensor `b`.*overlaps",
        ),
        (
            _header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}),
            b"\0" * 12,
            None,
            "invalid offset for tensor `a`.*gap",
        ),
        (_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}), b"", None, "invalid offset"),
        (
            _header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}),
            b"\0" * 8,
            None,
            "invalid shape, data type, or offset for tensor `a`",
        ),
        (_header({"a": {"dtype": "X99", "shape": [2], "data_offsets": [0, 8]}}), b"\0" * 8, None, "unsupported dtype"),
        (_header({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}), b"\0" * 8, None, "shape"),
        (_header({"a": {"dtype": "F32", "shape": [2]}}), b"\0" * 8, None, "data_offsets"),
        (_header({"__metadata__": {"a": 1}}), b"", None, "__metadata__"),
        (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {}}', b"\0", None, "duplicate"),
    ],
)
def test_invalid_headers_raise_with_the_library_wording(tmp_path, header, data, length, message):
    path = tmp_path / "bad.safetensors"
    _write(path, header, data, length)
    with pytest.raises(InvalidSafetensorsError, match=message) as caught:
        fs.load_file(path)
    assert str(path) in str(caught.value)
    with pytest.raises(Exception):  # noqa: B017 (the library refuses the same files; its error types vary by version)
        safetensors_torch.load_file(path)


def test_short_files_and_missing_files(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x02\0\0")
    with pytest.raises(InvalidSafetensorsError, match="header too small"):
        fs.load_file(path)
    with pytest.raises(FileNotFoundError):
        fs.load_file(tmp_path / "missing.safetensors")
    with pytest.raises(IsADirectoryError):
        fs.load_file(tmp_path)


def test_dtype_known_to_the_format_but_not_to_torch(tmp_path):
    path = tmp_path / "f6.safetensors"
    _write(
        path,
        _header(
            {
                "a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]},
                "b": {"dtype": "U8", "shape": [1], "data_offsets": [3, 4]},
            }
        ),
        b"\0" * 4,
    )
    with fs.safe_open(path) as f:
        assert f.get_tensor("b").tolist() == [0]
        with pytest.raises(InvalidSafetensorsError, match="F6_E2M3 is not supported"):
            f.get_tensor("a")


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_round_trip_both_ways(tmp_path):
    tensors = {f"t{i}": _sample(dtype, (257, 129), seed=i).cuda() for i, dtype in enumerate(_every_dtype())}
    tensors["big"] = torch.randn(4096, 4097, device="cuda")
    path = tmp_path / "cuda.safetensors"
    fs.save_file(tensors, path, buffer_size="8M")
    for loaded in (
        safetensors_torch.load_file(path, device="cuda:0"),
        fs.load_file(path, device="cuda"),
        fs.load_file(path, device=0, buffer_size="4M"),
    ):
        for name, tensor in tensors.items():
            assert loaded[name].device.type == "cuda"
            _same(loaded[name], tensor)
    with fs.safe_open(path, device="cuda:0") as f:
        assert torch.equal(f.get_slice("big")[100:200], tensors["big"][100:200])


@pytest.mark.gpu
def test_cuda_async_save_and_front_door(tmp_path):
    state = {"w": torch.randn(1000, 1000, device="cuda"), "b": torch.arange(7, device="cuda")}
    future = fs.async_save_file(state, tmp_path / "a.safetensors")
    future.result()
    loaded = fastpersist.load(tmp_path / "a.safetensors", map_location="cuda")
    for name, tensor in state.items():
        assert loaded[name].device.type == "cuda"
        _same(loaded[name], tensor)
    with fs.safe_open(tmp_path / "a.safetensors", device="cuda") as f:
        _same(f.get_tensor("b"), state["b"])


def test_lazy_access_reads_only_the_bytes_asked_for(tmp_path, monkeypatch):
    tensors = {"a": torch.randn(300, 40), "b": torch.arange(1000, dtype=torch.int64), "c": torch.ones(5)}
    path = tmp_path / "lazy.safetensors"
    fs.save_file(tensors, path)
    ranges = []
    original = fs._Reader.read

    def spy(self, pieces, device):
        pieces = list(pieces)
        ranges.extend((start, end) for _, start, end in pieces)
        return original(self, pieces, device)

    monkeypatch.setattr(fs._Reader, "read", spy)
    with fs.safe_open(path) as f:
        entry = f._open().header.tensors["b"]
        assert torch.equal(f.get_tensor("b"), tensors["b"])
        assert ranges == [(entry.start, entry.end)]
        ranges.clear()
        a = f._open().header.tensors["a"]
        assert torch.equal(f.get_slice("a")[10:12], tensors["a"][10:12])
        assert ranges == [(a.start + 10 * 160, a.start + 12 * 160)]


def test_safe_open_is_usable_from_several_threads(tmp_path):
    import concurrent.futures

    tensors = {f"t{i}": torch.full((1000 + i,), float(i)) for i in range(16)}
    path = tmp_path / "threads.safetensors"
    fs.save_file(tensors, path)
    with fs.safe_open(path) as f, concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = dict(zip(tensors, pool.map(f.get_tensor, tensors)))
    for name, tensor in tensors.items():
        assert torch.equal(results[name], tensor)


def test_verify_checks_a_safetensors_header_and_size(tmp_path):
    path = tmp_path / "v.safetensors"
    fs.save_file({"a": torch.ones(10), "b": torch.zeros(3, dtype=torch.int8)}, path)
    report = fastpersist.verify(path)
    assert (report.records, report.bytes, report.checksummed) == (2, 43, False)
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(InvalidSafetensorsError, match="not fully covered"):
        fastpersist.verify(path)


def _seeded_tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_000, generator=generator), "b": torch.randn(7, generator=generator)}


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_concurrent_save_file_to_one_path_from_threads_and_async(tmp_path, in_threads):
    path = str(tmp_path / "m.safetensors")

    def saver(seed):
        for _ in range(4):
            fs.save_file(_seeded_tensors(seed), path)
            fs.load_file(path)  # whichever save landed last: a whole file, never a torn one

    future = fs.async_save_file(_seeded_tensors(9), path)
    errors = in_threads(saver, 3)
    future.result(timeout=60)
    assert not errors, errors
    loaded = safetensors.torch.load_file(path)
    assert any(_same_tensors(_seeded_tensors(s), loaded) for s in (0, 1, 2, 9))
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"], "no temporary file left behind"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_save_file_and_load_file_in_a_forked_child(tmp_path):
    import warnings

    fs.save_file(_seeded_tensors(1), str(tmp_path / "parent.safetensors"))  # the parent's pools exist
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)  # the parent's OpenMP team does not survive fork (not ours to test)
            fs.save_file(_seeded_tensors(2), str(tmp_path / "child.safetensors"))
            fs.async_save_file(_seeded_tensors(3), str(tmp_path / "child-async.safetensors")).result(timeout=60)
            code = 0 if _same_tensors(_seeded_tensors(2), fs.load_file(str(tmp_path / "child.safetensors"))) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _same_tensors(_seeded_tensors(3), safetensors.torch.load_file(str(tmp_path / "child-async.safetensors")))
    assert _same_tensors(_seeded_tensors(1), fs.load_file(str(tmp_path / "parent.safetensors")))


def test_save_file_from_an_atexit_handler_and_a_pending_async_save(tmp_path):
    import subprocess
    import sys

    script = f"""
import atexit, torch
from fastpersist.api import safetensors as fs
path = {str(tmp_path)!r}
atexit.register(lambda: fs.save_file({{"x": torch.full((1000,), 10.0)}}, path + "/atexit.safetensors"))
fs.async_save_file({{"x": torch.full((300_000,), 6.0)}}, path + "/pending.safetensors")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert bool((safetensors.torch.load_file(str(tmp_path / "atexit.safetensors"))["x"] == 10).all())
    assert bool((safetensors.torch.load_file(str(tmp_path / "pending.safetensors"))["x"] == 6).all())
