"""Small storage records are packed at 64 bytes; large ones stay page-aligned.

Checks that such files stay torch checkpoints (torch.load reads them, also
with ``calculate_storage_offsets``), that ``fastpersist verify`` checks them
(including the alignment the file declares), that they are about as small as
torch.save's, and that any byte range of the plan can still be produced on
its own (what sharded saves rely on).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import fastpersist
from fastpersist.errors import CorruptCheckpointError
from fastpersist.format.plan import SegmentKind, StorageRecord
from fastpersist.format.serializer import plan_save
from fastpersist.format.zipformat import (
    PACKED_ALIGNMENT,
    PACKED_RECORD_LIMIT,
    PAYLOAD_ALIGNMENT,
    check_alignment_claim,
    read_directory,
    storage_alignment_claim,
)


def _records(path):
    with open(path, "rb") as f:
        data = f.read()
    return read_directory(lambda o, n: data[o : o + n], len(data)), data


def _storage_records(records):
    return [r for r in records if "/data/" in r.name]


@pytest.fixture
def calculate_storage_offsets():
    from torch.utils.serialization import config

    old = config.load.calculate_storage_offsets
    config.load.calculate_storage_offsets = True
    yield
    config.load.calculate_storage_offsets = old


def _mixed_state():
    return {
        "tiny": torch.arange(3, dtype=torch.int8),
        "small": torch.randn(100),
        "empty": torch.empty(0),
        "edge_below": torch.ones(PACKED_RECORD_LIMIT - 1, dtype=torch.uint8),
        "edge": torch.ones(PACKED_RECORD_LIMIT, dtype=torch.uint8),
        "large": torch.randn(70_000),
        "after": torch.randn(5, dtype=torch.float64),
        "step": 17,
        "lr": 0.5,
    }


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_small_records_are_packed_large_ones_aligned(tmp_path):
    state = _mixed_state()
    path = tmp_path / "mixed.pt"
    fastpersist.save(state, path)
    records, _ = _records(path)
    sizes = {r.name: r for r in _storage_records(records)}
    assert sizes, "no storage records"
    for record in sizes.values():
        if record.size >= PACKED_RECORD_LIMIT:
            assert record.data_offset % PAYLOAD_ALIGNMENT == 0, record.name
        else:
            assert record.data_offset % PACKED_ALIGNMENT == 0, record.name
    assert any(r.data_offset % PAYLOAD_ALIGNMENT for r in sizes.values()), "nothing was packed"


@pytest.mark.parametrize("offsets", [False, True], ids=["headers", "calculate_storage_offsets"])
@pytest.mark.parametrize("kind", ["mixed", "all_small", "all_large"])
def test_torch_load_reads_packed_files(tmp_path, request, offsets, kind):
    if offsets:
        request.getfixturevalue("calculate_storage_offsets")
    state = {
        "mixed": _mixed_state(),
        "all_small": {f"t{i}": torch.randn(i % 7 + 1) for i in range(50)},
        "all_large": {f"t{i}": torch.randn(20_000 + i) for i in range(3)},
    }[kind]
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    _assert_same(state, torch.load(path, weights_only=False))
    _assert_same(state, torch.load(path, weights_only=True, mmap=True))
    _assert_same(state, fastpersist.load(path, weights_only=False))
    _assert_same(state, fastpersist.load(path))


def test_alignment_claim_follows_the_records(tmp_path):
    assert storage_alignment_claim([1, 2, 0]) == PACKED_ALIGNMENT
    assert storage_alignment_claim([PACKED_RECORD_LIMIT, 1 << 20]) == PAYLOAD_ALIGNMENT
    assert storage_alignment_claim([1, PACKED_RECORD_LIMIT]) is None
    assert storage_alignment_claim([]) == PAYLOAD_ALIGNMENT
    for name, state, claim in [
        ("small", {"a": torch.randn(4)}, b"64"),
        ("large", {"a": torch.randn(1 << 16)}, b"4096"),
        ("mixed", {"a": torch.randn(4), "b": torch.randn(1 << 16)}, None),
    ]:
        path = tmp_path / f"{name}.pt"
        fastpersist.save(state, path)
        records, data = _records(path)
        by_name = {r.name.split("/", 1)[1]: r for r in records}
        if claim is None:
            assert ".format_version" not in by_name and ".storage_alignment" not in by_name
        else:
            record = by_name[".storage_alignment"]
            assert data[record.data_offset : record.data_offset + record.size] == claim
        assert check_alignment_claim(records, lambda o, n, data=data: data[o : o + n]) == (
            int(claim) if claim else None
        )


def test_verify_checks_packed_files_and_their_alignment_claim(tmp_path, recwarn):
    path = tmp_path / "small.pt"
    fastpersist.save({f"t{i}": torch.randn(3) for i in range(20)}, path)
    report = fastpersist.verify(path)
    assert report.checksummed and report.records == 20 + 6
    assert not [w for w in recwarn if "alignment" in str(w.message)]
    records, data = _records(path)
    # Damage one packed payload: its CRC-32 catches it.
    damaged = bytearray(data)
    damaged[_storage_records(records)[5].data_offset] ^= 1
    (tmp_path / "payload.pt").write_bytes(damaged)
    with pytest.raises(fastpersist.ChecksumMismatchError):
        fastpersist.verify(tmp_path / "payload.pt")
    # Declare an alignment the records do not have (same length, so the zip stays valid):
    # torch with calculate_storage_offsets would read wrong bytes; verify says so.
    claim = next(r for r in records if r.name.endswith("/.storage_alignment"))
    lying = bytearray(data)
    lying[claim.data_offset : claim.data_offset + claim.size] = b"32"
    crc = zlib.crc32(b"32")
    # Patch the record's CRC in its descriptor and in the central directory.
    old = zlib.crc32(b"64").to_bytes(4, "little")
    lying = lying.replace(old, crc.to_bytes(4, "little"))
    (tmp_path / "lying.pt").write_bytes(bytes(lying))
    with pytest.warns(RuntimeWarning, match="declared storage alignment"):
        assert fastpersist.verify(tmp_path / "lying.pt").checksummed  # every byte intact: a warning
    with pytest.raises(CorruptCheckpointError, match="alignment"):
        check_alignment_claim(_records(tmp_path / "lying.pt")[0], lambda o, n: bytes(lying[o : o + n]))


def test_many_small_tensors_file_is_about_torch_size(tmp_path):
    state = {f"layer.{i}.weight": torch.randn(16) for i in range(2000)}  # 64 B each
    ours, theirs = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    fastpersist.save(state, ours)
    torch.save(state, theirs)
    assert os.path.getsize(ours) <= 1.1 * os.path.getsize(theirs)
    _assert_same(state, torch.load(ours))


def _produce_range(plan, crcs, start, end) -> bytes:
    """Fills [start, end) of the file from the plan alone, as one rank of a sharded save would."""
    out = bytearray(end - start)
    trailer = plan.trailer(crcs)
    for kind, offset, length, record, data in plan.segments():
        lo, hi = max(offset, start), min(offset + length, end)
        if lo >= hi:
            continue
        if kind == SegmentKind.BYTES:
            piece = data
        elif kind == SegmentKind.STORAGE:
            piece = bytes(plan.records[record].view.numpy().tobytes())
        elif kind == SegmentKind.DESCRIPTOR:
            piece = plan.records[record].entry.data_descriptor(crcs[record])
        else:
            piece = trailer
        out[lo - start : hi - start] = piece[lo - offset : hi - offset]
    return bytes(out)


def test_byte_ranges_of_a_packed_plan_rebuild_the_file(tmp_path):
    pytest.importorskip("numpy")
    state = _mixed_state()
    plan = plan_save(state, "ckpt")
    crcs = []
    for record in plan.records:
        if isinstance(record, StorageRecord):
            crcs.append(zlib.crc32(record.view.numpy().tobytes()))
        else:
            crcs.append(zlib.crc32(record.data))
    # Cut points that fall inside packed records, headers and the big record.
    cuts = sorted(
        {0, plan.size}
        | {min(plan.size, 97 * k + 13) for k in range(1, 40, 7)}
        | {plan.size // 3, plan.size // 2, plan.size - 5}
    )
    pieces = [_produce_range(plan, crcs, a, b) for a, b in zip(cuts, cuts[1:])]
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"".join(pieces))
    _assert_same(state, torch.load(path, weights_only=False))
    fastpersist.verify(path)
    (tmp_path / "whole").mkdir()
    fastpersist.save(state, tmp_path / "whole" / "ckpt.pt")
    whole = (tmp_path / "whole" / "ckpt.pt").read_bytes()
    rebuilt = path.read_bytes()
    # Only the serialization id (random per save) and its CRC-32 (twice) may differ.
    assert len(whole) == len(rebuilt)
    assert sum(a != b for a, b in zip(whole, rebuilt)) <= 40 + 8


def _small_state(count: int = 300) -> dict:
    generator = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(1 + i % 40, generator=generator) for i in range(count)}


@pytest.mark.parametrize("weights_only", [True, False])
def test_small_records_load_as_their_own_storages(tmp_path, weights_only):
    state = _small_state()
    path = tmp_path / "small.pt"
    fastpersist.save(state, path)
    loaded = fastpersist.load(path, weights_only=weights_only)
    _assert_same(state, loaded)
    pointers = {tensor.untyped_storage().data_ptr() for tensor in loaded.values()}
    assert len(pointers) == len(state)  # slices of one read, but one storage each
    assert all(tensor.untyped_storage().nbytes() == tensor.nbytes for tensor in loaded.values())
    fastpersist.save(loaded, tmp_path / "again.pt")  # a loaded state saves again as it was
    _assert_same(state, torch.load(tmp_path / "again.pt"))


@pytest.mark.parametrize("weights_only", [True, False])
def test_small_records_are_read_once_per_slab(tmp_path, monkeypatch, weights_only):
    """One read brings in many small records (whatever the unpickler allows), and each is
    filled when the unpickler gets it: not storage by storage, not waiting for the end."""
    from fastpersist.io import reader

    state = _small_state()
    path = tmp_path / "small.pt"
    fastpersist.save(state, path)
    slab_reads, record_reads = [], []
    submit_slab, start_read = reader.FileStorageProvider._submit_slab, reader.FileStorageProvider._start_read
    monkeypatch.setattr(
        reader.FileStorageProvider,
        "_submit_slab",
        lambda self, slab: slab_reads.append(slab.index) or submit_slab(self, slab),
    )
    monkeypatch.setattr(
        reader.FileStorageProvider,
        "_start_read",
        lambda self, record: record_reads.append(record) or start_read(self, record),
    )
    import torch.nested  # noqa: F401 - registers torch's own safe globals

    _assert_same(state, fastpersist.load(path, weights_only=weights_only))
    assert slab_reads == [0]  # 300 small tensors: one slab, one read
    assert record_reads == []


def test_small_records_hold_their_bytes_while_unpickling(tmp_path):
    """A rebuild function may read a tensor's values before the load ends (nested tensors do)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype"
        nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    for saver in (torch.save, fastpersist.save):
        saver({"nested": nested}, tmp_path / "n.pt")
        for weights_only in (True, False):
            loaded = fastpersist.load(tmp_path / "n.pt", weights_only=weights_only)["nested"]
            assert all(torch.equal(a, b) for a, b in zip(loaded.unbind(), nested.unbind()))


@pytest.mark.parametrize("weights_only", [True, False])
def test_damaged_small_record_is_caught(tmp_path, weights_only, damage_record):
    state = _small_state()
    path = tmp_path / "small.pt"
    fastpersist.save(state, path)
    damage_record(path, "/data/150", offset=1, mask=0xFF)
    with pytest.raises(fastpersist.ChecksumMismatchError, match="data/150"):
        fastpersist.load(path, weights_only=weights_only)
    fastpersist.load(path, weights_only=weights_only, verify=False)  # unverified, it loads
