"""Storage records of a save plan: the byte view of a storage is made only when something asks for it."""

from __future__ import annotations

import pytest
import torch

from fastpersist.format.plan import StorageRecord
from fastpersist.format.serializer import plan_save


def test_plan_records_make_their_views_lazily():
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 3, dtype=torch.float64)}
    plan = plan_save(tensors, "ckpt")
    records = plan.storages
    assert all(record._view is None for record in records)  # nothing made while planning
    first = records[0]
    assert first.data_ptr() == tensors["a"].data_ptr()
    assert first.device == torch.device("cpu") and first._view is None
    view = first.view
    assert view.dtype == torch.uint8 and view.numel() == 40 and view.data_ptr() == tensors["a"].data_ptr()
    assert first.view is view  # made once
    assert first.data_ptr() == view.data_ptr()


def test_record_over_a_given_view():
    source = torch.arange(8, dtype=torch.uint8)
    plan = plan_save({"a": torch.ones(2)}, "ckpt")
    record = StorageRecord(plan.storages[0].entry, "0", view=source)
    assert record.view is source and record.data_ptr() == source.data_ptr() and record.device.type == "cpu"


def test_record_needs_exactly_one_source():
    plan = plan_save({"a": torch.ones(2)}, "ckpt")
    entry = plan.storages[0].entry
    with pytest.raises(TypeError):
        StorageRecord(entry, "0")
    with pytest.raises(TypeError):
        StorageRecord(entry, "0", torch.ones(2).untyped_storage(), view=torch.ones(8, dtype=torch.uint8))


def test_segment_rows_are_plain_tuples_the_collector_stops_tracking():
    """A plan of many small tensors has three segments per tensor: as tracked objects they made
    the garbage collector's full collections a third of such a save. Plain tuples of ints and
    bytes are untracked by the first collection that sees them."""
    import gc

    from fastpersist.format.plan import SegmentKind

    state = {f"t{i}": torch.full((4,), float(i)) for i in range(50)}
    rows = plan_save(state, "archive").segments()
    assert all(type(row) is tuple and len(row) == 5 for row in rows)
    kinds = {row[0] for row in rows}
    assert kinds == {SegmentKind.BYTES, SegmentKind.STORAGE, SegmentKind.DESCRIPTOR, SegmentKind.TRAILER}
    assert all(type(kind) is int for kind in kinds)
    gc.collect()
    assert not any(gc.is_tracked(row) for row in rows)
    # The rows still describe the file end to end.
    assert rows[0][1] == 0 and all(a[1] + a[2] == b[1] for a, b in zip(rows, rows[1:]))


def test_a_load_lets_the_zip_directory_go_as_the_state_comes(tmp_path, monkeypatch):
    """The directory of 100,000 small tensors is 27 MiB of objects: each storage's record is
    dropped once the storage is loaded, so a load's peak stays near torch.load's."""
    import fastpersist
    from fastpersist.api import archive

    state = {"a": torch.arange(10), "b": torch.arange(10).view(2, 5), "c": torch.ones(3), "empty": torch.empty(0)}
    state["view"] = state["a"][2:]  # shares a's storage: asked for twice, loaded once
    path = tmp_path / "s.pt"
    fastpersist.save(state, path)
    seen = []
    real = archive.deserialize

    def spy(pickle_bytes, records, *args, **kwargs):
        seen.append(records)
        return real(pickle_bytes, records, *args, **kwargs)

    monkeypatch.setattr(archive, "deserialize", spy)
    for weights_only in (True, False):
        loaded = fastpersist.load(path, weights_only=weights_only)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        assert loaded["view"].untyped_storage().data_ptr() == loaded["a"].untyped_storage().data_ptr()
        remaining = [name for name in seen.pop() if "/data/" in name]
        assert len(remaining) == 1  # only the empty storage's record (empty storages are not shared)


def test_the_zip_directory_of_a_load_is_rows_the_collector_does_not_track(tmp_path):
    """20,000 named-tuple records alive through a load set off a second full collection."""
    import gc
    import os

    import fastpersist
    from fastpersist.format.zipformat import RecordTable, ZipRecordInfo, check_structure, read_rows

    path = tmp_path / "s.pt"
    fastpersist.save({f"t{i}": torch.full((i + 1,), float(i)) for i in range(50)}, path)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size

        def read_at(offset, length):
            return os.pread(handle.fileno(), length, offset)

        for check in (False, True):
            rows = read_rows(read_at, size, str(path), check=check)
            gc.collect()
            assert rows and not any(gc.is_tracked(row) for row in rows)
            assert [tuple(r) for r in check_structure(read_at, size, str(path))] == rows
            table = RecordTable(rows)
            name = rows[-1][0]
            assert len(table) == len(rows) and name in table and list(table)[-1] == name
            assert (
                type(table[name]) is ZipRecordInfo and table[name] == rows[-1] and table.get(name).size == rows[-1][3]
            )
            del table[name]
            assert name not in table and table.get(name) is None and len(table) == len(rows) - 1


def test_placed_record_keeps_its_source_once_the_view_exists():
    """A record placed in another layout reads the same bytes, whether or not its view was made already."""
    from fastpersist.format.plan import StorageRecord
    from fastpersist.format.zipformat import layout_archive

    storage = torch.arange(10, dtype=torch.float32).untyped_storage()
    entries = layout_archive([("a/data/0", storage.nbytes(), True), ("b/data/0", storage.nbytes(), True)]).entries
    record = StorageRecord(entries[0], "0", storage)
    fresh = record.placed(entries[1])
    assert fresh.entry is entries[1] and fresh.data_ptr() == storage.data_ptr()
    record.view  # noqa: B018 - makes and caches the view, as a device digest or a GPU copy does
    placed = record.placed(entries[1])
    assert placed.entry is entries[1] and placed.key == "0" and placed.data_ptr() == storage.data_ptr()
    assert torch.equal(placed.view, record.view)
