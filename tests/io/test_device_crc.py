"""zlib's CRC-32 computed with torch operations (``fastpersist.io.device_crc``).

The operations run eagerly on CPU tensors here; on a GPU (marked tests) the
same operations are captured as CUDA graphs and replayed, and a verified CUDA
load checksums its records' whole segments that way.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import fastpersist
from fastpersist.io import device_crc
from fastpersist.io.device_crc import DeviceCrc

BLOCK = device_crc.CHUNK * device_crc.GROUP  # the smallest length raw_crc takes


def _random(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("blocks", [1, 2, 255, 256, 257])
def test_raw_crc_gives_zlibs_crc32(blocks):
    """One block (one level), front padding of a level (2, 255, 257 values), a whole group (256)."""
    data = _random(blocks * BLOCK, blocks)
    raw = device_crc.raw_crc(data).item()
    assert device_crc.crc32_of_raw(raw, data.numel()) == zlib.crc32(data.numpy().tobytes())


def test_raw_crc_of_zeros_is_zero_and_of_one_changed_bit_is_not():
    zeros = torch.zeros(BLOCK, dtype=torch.uint8)
    assert device_crc.raw_crc(zeros).item() == 0
    zeros[BLOCK - 1] = 0x80
    assert device_crc.raw_crc(zeros).item() != 0


@pytest.mark.parametrize(
    "data",
    [
        torch.zeros(BLOCK + 1, dtype=torch.uint8),
        torch.zeros(0, dtype=torch.uint8),
        torch.zeros(BLOCK // 4, dtype=torch.int32),
    ],
    ids=["ragged", "empty", "int32"],
)
def test_raw_crc_refuses_what_it_cannot_take(data):
    with pytest.raises(ValueError, match="multiple of"):
        device_crc.raw_crc(data)


def test_split_takes_whole_segments_largest_first_and_leaves_the_tail():
    big, small = device_crc.SEGMENTS
    assert DeviceCrc.split(2 * big + 3 * small + 5) == ([big, big, small, small, small], 5)
    assert DeviceCrc.split(small - 1) == ([], small - 1)
    assert DeviceCrc.split(0) == ([], 0)
    assert DeviceCrc.count(big + small) == 2


def test_a_checker_gives_each_segments_crc32_in_queue_order(monkeypatch):
    monkeypatch.setattr(device_crc, "SEGMENTS", (4 * BLOCK, BLOCK))
    first, second = _random(6 * BLOCK, 1), _random(BLOCK, 2)
    checker = DeviceCrc(torch.device("cpu"), 4)
    parts = checker.queue(first, [4 * BLOCK, BLOCK], None) + checker.queue(second, [BLOCK], None)
    checker.close()
    pieces = [first[: 4 * BLOCK], first[4 * BLOCK : 5 * BLOCK], second]
    assert [part.result() for part in parts] == [zlib.crc32(p.numpy().tobytes()) for p in pieces]


@pytest.mark.gpu
def test_graphs_on_the_gpu_give_zlibs_crc32():
    """Segments of both sizes, replayed from one checker, at offsets that are not segment-aligned."""
    big, small = device_crc.SEGMENTS
    host = _random(big + 3 * small + 4096, 3)
    data = host.cuda()
    checker = DeviceCrc(torch.device("cuda"), 8)
    sizes = [big, small, small]
    parts = checker.queue(data[4096:], sizes, _event_now())
    parts += checker.queue(data[:small], [small], _event_now())
    checker.close()
    expected, offset = [], 4096
    for size in sizes:
        expected.append(zlib.crc32(host[offset : offset + size].numpy().tobytes()))
        offset += size
    expected.append(zlib.crc32(host[:small].numpy().tobytes()))
    assert [part.result() for part in parts] == expected


def _event_now() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


# Two ring buffers: a 40 MiB record is read in 16 MiB windows (a load smaller than 16 windows spreads over the
# ring in smaller ones, and pieces below the smallest segment are all checksummed on the CPU).
_TWO_WINDOWS = {"read_buffer_count": 2}


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [True, False])
def test_a_verified_cuda_load_finds_a_changed_byte_in_any_part_of_a_record(tmp_path, monkeypatch, on_device):
    """A 40 MiB record: a flipped byte in its first and second windows (segments the device checksums) and in
    its last bytes (a tail the CPU checksums) is found, with the device's checksums and without; the untouched
    file loads equal."""
    queued = []
    real_queue = DeviceCrc.queue
    monkeypatch.setattr(DeviceCrc, "queue", lambda self, *a: queued.extend(a[1]) or real_queue(self, *a))
    tensor = _random((40 << 20) + 3000, 4)
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"t": tensor}, path)
    loaded = fastpersist.load(path, map_location="cuda", device_checksum=on_device, **_TWO_WINDOWS)
    assert torch.equal(loaded["t"].cpu(), tensor)
    assert bool(queued) == on_device and set(queued) <= set(device_crc.SEGMENTS)
    offset = _data_offset(path, tensor)
    for where in (10, (20 << 20) + 10, tensor.numel() - 1):
        with open(path, "r+b") as f:
            f.seek(offset + where)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(fastpersist.ChecksumMismatchError, match="data/0"):
            fastpersist.load(path, map_location="cuda", device_checksum=on_device, **_TWO_WINDOWS)
        with open(path, "r+b") as f:
            f.seek(offset + where)
            f.write(byte)


def _data_offset(path, tensor: torch.Tensor) -> int:
    """Where the tensor's bytes start in the file (found by content: the first 64 bytes are random)."""
    blob = open(path, "rb").read()
    offset = blob.find(tensor[:64].numpy().tobytes())
    assert offset > 0
    return offset


def test_a_forked_child_forgets_the_parents_graphs_without_destroying_them():
    cache = device_crc._Cache()
    parent_graphs = object()
    cache.idle[torch.device("cuda", 0)] = [parent_graphs]
    cache.forget_after_fork()
    assert cache.idle == {} and cache.release() == 0
    assert cache.forked == [{torch.device("cuda", 0): [parent_graphs]}]  # kept, never destroyed


@pytest.mark.gpu
def test_loads_reuse_their_graphs_and_release_buffers_frees_them(tmp_path, monkeypatch):
    made = []
    real = device_crc._Graphs.__init__
    monkeypatch.setattr(device_crc._Graphs, "__init__", lambda self, device: made.append(device) or real(self, device))
    fastpersist.release_buffers()
    tensor = _random((40 << 20) + 5, 5)
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"t": tensor}, path)

    def load():
        return fastpersist.load(path, map_location="cuda", device_checksum=True, **_TWO_WINDOWS)["t"].cpu()

    for _ in range(2):
        assert torch.equal(load(), tensor)
    assert len(made) == 1
    assert fastpersist.release_buffers() >= max(device_crc.SEGMENTS)
    assert torch.equal(load(), tensor)
    assert len(made) == 2
