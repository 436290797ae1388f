"""The native CRC-32 equals zlib's, for every length, alignment and starting value."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastpersist.io import engine
from fastpersist.tensors import host_memoryview


def raw(tensor: torch.Tensor) -> bytes:
    return bytes(host_memoryview(tensor))


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))


LENGTHS = list(range(0, 200)) + [255, 256, 4095, 4096, 4097, 65535, 65536 + 15, (1 << 20) + 7, 3 << 20]


@pytest.mark.parametrize("offset", [0, 1, 7, 15, 16, 63])
def test_crc32_matches_zlib(data, offset):
    for length in LENGTHS:
        length = min(length, data.numel() - offset)
        piece = data[offset : offset + length]
        expected = zlib.crc32(raw(piece))
        assert engine.crc32(piece.data_ptr(), length) == expected, length
        assert engine.crc32(piece.data_ptr(), length, 0xDEADBEEF) == zlib.crc32(raw(piece), 0xDEADBEEF), length


def test_crc32_continues_across_pieces(data):
    whole = zlib.crc32(raw(data))
    crc = 0
    for start, stop in [(0, 1), (1, 100), (100, 4096), (4096, 1 << 20), (1 << 20, data.numel())]:
        crc = engine.crc32(data.data_ptr() + start, stop - start, crc)
    assert crc == whole


@pytest.mark.parametrize("offset", [0, 3, 16])
def test_copy_with_crc32_copies_and_checksums(data, offset):
    for length in LENGTHS:
        length = min(length, data.numel() - offset)
        source = data[offset : offset + length]
        destination = torch.full((length + 32,), 0xAB, dtype=torch.uint8)
        crc = engine.copy_with_crc32(destination.data_ptr() + 5, source.data_ptr(), length, 11)
        assert crc == zlib.crc32(raw(source), 11)
        assert torch.equal(destination[5 : 5 + length], source)
        assert torch.all(destination[:5] == 0xAB) and torch.all(destination[5 + length :] == 0xAB)  # no overrun


def test_acceleration_is_reported_as_the_cpu_allows():
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        assert engine.crc32_accelerated() is False
        return
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert engine.crc32_accelerated() is ("pclmulqdq" in flags and "sse4_1" in flags)
    expected = "table"
    if engine.crc32_accelerated():
        expected = "vpclmul" if "vpclmulqdq" in flags and "avx2" in flags else "pclmul"
    assert engine.crc32_method() == expected
    assert engine.crc32_methods()[-1] == expected and engine.crc32_methods()[0] == "table"


@pytest.mark.parametrize("method", engine.crc32_methods())
@pytest.mark.parametrize("offset", [0, 5, 16])
def test_every_method_the_cpu_has_matches_zlib(data, method, offset):
    # The fastest method is what crc32 uses; the slower ones still run on CPUs without the newer instructions.
    for length in list(range(0, 300)) + [511, 512, 513, 4096 + 48, 65536 + 15, (1 << 20) + 7]:
        piece = data[offset : offset + length]
        payload = raw(piece)
        assert engine.crc32_with(method, piece.data_ptr(), length) == zlib.crc32(payload), length
        assert engine.crc32_with(method, piece.data_ptr(), length, 77) == zlib.crc32(payload, 77), length
        copy = torch.full((length + 1,), 0xAB, dtype=torch.uint8)
        assert engine.crc32_with(method, piece.data_ptr(), length, copy_to=copy.data_ptr()) == zlib.crc32(payload)
        assert raw(copy[:length]) == payload and int(copy[length]) == 0xAB, length


def test_an_unknown_crc32_method_is_refused(data):
    with pytest.raises(ValueError, match="not available on this CPU"):
        engine.crc32_with("sse9", data.data_ptr(), 16)


def test_folding_constants_are_the_derived_ones():
    import pathlib
    import re
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tools"))
    try:
        import crc32_constants
    finally:
        sys.path.pop(0)
    source = (root / "native" / "src" / "checksum.cpp").read_text()
    for distance in (128, 512, 1024):
        for half, value in crc32_constants.constants(distance).items():
            name = f"kFold{distance}{half.capitalize()}"
            found = re.search(name + r" = (0x[0-9a-fA-F]+)LL", source)
            assert found is not None, name
            assert int(found.group(1), 16) == value, name


@pytest.mark.parametrize("make", [bytes, bytearray, memoryview, lambda b: memoryview(b"xx" + b)[2:]])
def test_crc32_of_buffers_matches_zlib(data, make):
    for length in LENGTHS:
        payload = raw(data[:length])
        assert engine.crc32_of(make(payload)) == zlib.crc32(payload), length
        assert engine.crc32_of(make(payload), 0xDEADBEEF) == zlib.crc32(payload, 0xDEADBEEF), length


def test_crc32_of_refuses_what_is_not_one_contiguous_buffer():
    with pytest.raises(BufferError):
        engine.crc32_of(memoryview(b"abcdef")[::2])
    with pytest.raises(TypeError):
        engine.crc32_of("text")


def test_copy_many_copies_checksums_or_only_checksums():
    source = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    pieces = [(0, 0), (1, 7), (100, 1000), (3000, 1096)]  # (offset, length), an empty one included
    lengths = [n for _, n in pieces]
    sources = [source.data_ptr() + o for o, _ in pieces]
    expected = [zlib.crc32(source[o : o + n].numpy().tobytes()) for o, n in pieces]
    for checksum in (True, False):
        targets = [torch.zeros(max(n, 1), dtype=torch.uint8) for n in lengths]
        crcs = engine.copy_many([t.data_ptr() for t in targets], sources, lengths, checksum)
        assert crcs == (expected if checksum else [])
        assert all(torch.equal(t[:n], source[o : o + n]) for t, (o, n) in zip(targets, pieces))
    assert engine.copy_many([0] * len(pieces), sources, lengths, True) == expected  # checksums only
    with pytest.raises(ValueError, match="differ in length"):
        engine.copy_many([0], sources, lengths, True)
