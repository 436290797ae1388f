"""fastpersist.save / fastpersist.load against torch.save / torch.load, byte for byte."""

from __future__ import annotations

import collections
import io
import os
import struct
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.format.zipformat import PAYLOAD_ALIGNMENT
from fastpersist.tensors import storage_byte_view

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def random_tensor(shape, dtype, generator=None):
    generator = generator or torch.Generator().manual_seed(0)
    raw = torch.randint(
        0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=generator
    )
    if dtype == torch.bool:
        return (raw[: torch.Size(shape).numel()] & 1).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def records(path) -> dict[str, bytes]:
    """Record name (without the archive folder) -> bytes, minus the per-save id."""
    with zipfile.ZipFile(path) as archive:
        out = {}
        for info in archive.infolist():
            name = info.filename.split("/", 1)[1]
            if name not in (".data/serialization_id", ".storage_alignment"):
                out[name] = archive.read(info)
        return out


def assert_same(a, b):
    """Deep equality: tensors bit for bit (dtype, shape, strides, storage bytes), the rest with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert type(a) is type(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.requires_grad == b.requires_grad
        assert a.device == b.device
        assert a.storage_offset() == b.storage_offset()
        # uint8 views: exact (no NaN != NaN), and fast for large storages
        assert torch.equal(storage_byte_view(a.untyped_storage()).cpu(), storage_byte_view(b.untyped_storage()).cpu())
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def check_round_trip(obj, directory, **load_kwargs):
    """Saves with both libraries, compares records, loads across, returns fastpersist's load."""
    ours = os.path.join(directory, "ours.pt")
    theirs = os.path.join(directory, "theirs.pt")
    fastpersist.save(obj, ours)
    torch.save(obj, theirs)
    assert records(ours) == records(theirs)
    with zipfile.ZipFile(ours) as archive:
        assert archive.testzip() is None  # every CRC-32 verifies
        for info in archive.infolist():
            if "/data/" in info.filename and info.file_size:
                # payloads start where torch's mmap loader wants them (torch's storage_alignment, 64)
                with open(ours, "rb") as f:
                    f.seek(info.header_offset + 26)
                    name_length, extra_length = struct.unpack("<HH", f.read(4))
                assert (info.header_offset + 30 + name_length + extra_length) % 64 == 0, info.filename
    for weights_only in (True, False):
        assert_same(obj, torch.load(ours, weights_only=weights_only, **load_kwargs))
        assert_same(obj, fastpersist.load(theirs, weights_only=weights_only, **load_kwargs))
    loaded = fastpersist.load(ours, **load_kwargs)
    assert_same(obj, loaded)
    return loaded


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype(dtype, any_dir):
    obj = {
        "t": random_tensor((3, 5), dtype),
        "scalar": random_tensor((), dtype),
        "empty": torch.empty(0, 4, dtype=dtype),
    }
    check_round_trip(obj, any_dir)


def test_nested_containers_and_python_values(tmp_path):
    obj = {
        "list": [torch.randn(2), (torch.arange(3), {"deep": torch.ones(2, 2)})],
        "ordered": collections.OrderedDict(a=torch.zeros(1), b=3),
        "values": [1, 2.5, "text", None, True, b"bytes", (1, 2)],
        "step": 1000,
    }
    check_round_trip(obj, tmp_path)


def test_views_non_contiguous_and_shared_storages(tmp_path):
    base = torch.randn(64, 64)
    obj = {
        "base": base,
        "row": base[3],
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "narrow": base.narrow(1, 5, 7),
        "other": torch.randn(10)[2:],
    }
    loaded = check_round_trip(obj, tmp_path)
    storage = loaded["base"].untyped_storage().data_ptr()
    for key in ("row", "transposed", "strided", "narrow"):
        assert loaded[key].untyped_storage().data_ptr() == storage  # sharing is preserved
    loaded["base"][3, 0] = 12345.0
    assert loaded["row"][0] == 12345.0


def test_parameters_requires_grad_and_modules(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    obj = {
        "params": list(model.parameters()),
        "frozen": torch.randn(3, requires_grad=True),
        "state": model.state_dict(),
    }
    loaded = check_round_trip(obj, tmp_path)
    assert isinstance(loaded["params"][0], torch.nn.Parameter)
    assert loaded["frozen"].requires_grad


def test_model_and_optimizer_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    obj = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(), "epoch": 3}
    loaded = check_round_trip(obj, tmp_path)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(loaded["optimizer"])
    model.load_state_dict(loaded["model"])


def test_thousands_of_small_tensors(tmp_path):
    generator = torch.Generator().manual_seed(1)
    obj = {
        f"layer{i}.bias": torch.randn(int(torch.randint(1, 300, (1,), generator=generator)), generator=generator)
        for i in range(3000)
    }
    check_round_trip(obj, tmp_path)


def test_large_payloads_are_page_aligned_small_ones_packed(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"a": torch.randn(1000), "b": torch.randn(3), "c": torch.randn(50_000)}, path)
    reader = torch._C.PyTorchFileReader(str(path))
    assert reader.get_record_offset("data/2") % PAYLOAD_ALIGNMENT == 0  # 200 KB: O_DIRECT-aligned
    for key in range(2):  # below PACKED_RECORD_LIMIT: packed at 64 bytes, as torch.save does
        assert reader.get_record_offset(f"data/{key}") % 64 == 0
    assert not reader.has_record(".storage_alignment")  # mixed alignment: no claim (see docs/format.md)
    path = tmp_path / "large.pt"
    fastpersist.save({"a": torch.randn(20_000), "c": torch.randn(50_000)}, path)
    reader = torch._C.PyTorchFileReader(str(path))
    assert reader.get_record(".storage_alignment") == str(PAYLOAD_ALIGNMENT).encode()


def test_torch_mmap_and_computed_offsets_read_our_files(tmp_path):
    path = tmp_path / "ckpt.pt"
    obj = {f"w{i}": torch.randn(100 + i) for i in range(20)}
    obj["empty"] = torch.empty(0)
    fastpersist.save(obj, path)
    from torch.utils.serialization import config as torch_config

    assert_same(obj, torch.load(path, mmap=True))
    previous = torch_config.load.calculate_storage_offsets
    torch_config.load.calculate_storage_offsets = True
    try:
        assert_same(obj, torch.load(path, mmap=True))
    finally:
        torch_config.load.calculate_storage_offsets = previous


def test_fastpersist_mmap_load(tmp_path):
    path = tmp_path / "ckpt.pt"
    obj = {"a": torch.randn(1000), "b": torch.arange(10)}
    fastpersist.save(obj, path)
    assert_same(obj, fastpersist.load(path, mmap=True))


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, location: storage],
    ids=["str", "device", "dict", "callable"],
)
def test_map_location_forms(map_location, tmp_path):
    obj = {"a": torch.randn(10), "b": torch.randn(3)[1:]}
    check_round_trip(obj, tmp_path, map_location=map_location)


def test_map_location_meta(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"a": torch.randn(10)}, path)
    loaded = fastpersist.load(path, map_location="meta")
    assert loaded["a"].device.type == "meta" and loaded["a"].shape == (10,)


def test_file_objects(tmp_path):
    obj = {"a": torch.randn(100), "n": 7}
    buffer = io.BytesIO()
    fastpersist.save(obj, buffer)
    buffer.seek(0)
    assert_same(obj, torch.load(buffer))
    buffer.seek(0)
    assert_same(obj, fastpersist.load(buffer))
    with open(tmp_path / "f.pt", "wb") as handle:
        fastpersist.save(obj, handle)
    with open(tmp_path / "f.pt", "rb") as handle:
        assert_same(obj, fastpersist.load(handle))
    assert_same(obj, fastpersist.load(tmp_path / "f.pt"))


class Payload:
    """Not on torch's weights-only allow list."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Payload) and self.value == other.value


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"payload": Payload(3), "t": torch.ones(2)}, path)
    import pickle

    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        fastpersist.load(path)
    assert fastpersist.load(path, weights_only=False)["payload"] == Payload(3)


def test_legacy_format_falls_back_to_torch(tmp_path):
    path = tmp_path / "legacy.pt"
    obj = {"a": torch.randn(5)}
    fastpersist.save(obj, path, _use_new_zipfile_serialization=False)
    assert_same(obj, fastpersist.load(path))


def test_settings_per_call_and_unknown_keyword(tmp_path):
    path = tmp_path / "ckpt.pt"
    obj = {"a": torch.randn(300_000)}
    fastpersist.save(obj, path, buffer_size="64K", block_size="16K", buffer_count=2, engine="threads", direct=False)
    assert_same(obj, fastpersist.load(path, buffer_size="64K", engine="threads"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'bufer_size'"):
        fastpersist.save(obj, path, bufer_size=1)


@pytest.mark.parametrize("buffer_size", ["4K", "12K", "64K"])
def test_windows_cut_through_headers_and_descriptors(buffer_size, any_dir):
    """Small ring windows: descriptors and the central directory straddle window edges."""
    generator = torch.Generator().manual_seed(2)
    obj = [torch.randn(n, generator=generator) for n in (1, 1023, 1024, 1025, 4096, 10_000, 0, 7)]
    path = os.path.join(any_dir, "ckpt.pt")
    fastpersist.save(obj, path, buffer_size=buffer_size, block_size="4K", buffer_count=3)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    assert_same(obj, torch.load(path))
    assert_same(obj, fastpersist.load(path, buffer_size=buffer_size, block_size="4K", buffer_count=2))


def test_async_save(tmp_path):
    path = tmp_path / "ckpt.pt"
    obj = {"a": torch.randn(100_000), "b": [torch.arange(5)]}
    future = fastpersist.async_save(obj, path)
    future.result(timeout=60)
    assert future.done()
    assert_same(obj, fastpersist.load(path))


@pytest.mark.slow
def test_tensor_over_4_gib_uses_zip64(tmp_path):
    big = torch.empty((4 << 30) + 4096 + 3, dtype=torch.uint8)
    big[:: 1 << 20] = 7
    big[-5:] = torch.arange(5, dtype=torch.uint8)
    obj = {"small": torch.arange(3), "big": big, "after": torch.randn(4)}
    path = tmp_path / "big.pt"
    fastpersist.save(obj, path)
    with zipfile.ZipFile(path) as archive:
        assert {i.filename.split("/", 1)[1]: i.file_size for i in archive.infolist()}["data/1"] == big.numel()
    loaded = fastpersist.load(path)
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["after"], obj["after"])
    del loaded
    theirs = torch.load(path, mmap=True)
    assert torch.equal(theirs["big"][-5:], big[-5:]) and torch.equal(theirs["after"], obj["after"])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float8_e4m3fn], ids=str
)
def test_cuda_round_trip(dtype, any_dir):
    obj = {
        "w": random_tensor((1000, 257), dtype).cuda(),
        "view": None,
        "cpu": random_tensor((17,), dtype),
        "scalar": random_tensor((), dtype).cuda(),
    }
    obj["view"] = obj["w"][3:9, ::2]
    path = os.path.join(any_dir, "ckpt.pt")
    fastpersist.save(obj, path, buffer_size="256K", block_size="64K")
    assert_same(obj, torch.load(path))
    for map_location in (None, "cuda", "cuda:0", {"cuda:0": "cuda:0"}):
        loaded = fastpersist.load(path, map_location=map_location, buffer_size="256K", verify=True)
        assert_same({k: v for k, v in obj.items() if k != "cpu"}, {k: v for k, v in loaded.items() if k != "cpu"})
        assert loaded["view"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    to_cpu = fastpersist.load(path, map_location="cpu")
    assert to_cpu["w"].device.type == "cpu"
    assert_same(obj["w"].cpu(), to_cpu["w"])  # bytes: random floats include NaNs


@pytest.mark.gpu
def test_cuda_async_save_orders_after_pending_kernels(tmp_path):
    x = torch.zeros(64 << 20, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(20):
            x.add_(1)  # queued work the save must wait for
        future = fastpersist.async_save({"x": x}, tmp_path / "x.pt")
    future.result()
    assert torch.all(fastpersist.load(tmp_path / "x.pt")["x"] == 20)
