"""io.targets.s3.ranges.read_ranges against moto's S3 server: parts of objects straight into their destinations,
coalesced where they (nearly) touch, conditional on the ETag first seen."""

from __future__ import annotations

import os

import pytest

from fastpersist import config
from fastpersist.errors import (
    BucketNotFoundError,
    ObjectNotFoundError,
    ObjectStoreError,
    ShortResponseError,
    TruncatedCheckpointError,
)
from fastpersist.io.targets.s3 import connection, ranges

_MiB = 1 << 20


def _settings():
    return config.settings().replace(s3_part_size=5 * _MiB, s3_concurrency=4)


def _reads(store, key, spans):
    url = connection.ObjectURL(store.bucket, key)
    return [(url, start, memoryview(bytearray(length))) for start, length in spans]


def test_pieces_land_in_their_destinations_with_few_gets(s3, recording_client):
    data = os.urandom(12 * _MiB + 5)
    s3.put("blob", data)
    spans = [
        (0, 10),
        (10, 10),  # touches the previous one
        (100, 4000),  # a small gap: same GET
        (50, 100),  # overlaps two others
        (2 * _MiB, 0),  # nothing to read
        (3 * _MiB, 7 * _MiB),  # far away, longer than a part: two GETs
        (12 * _MiB, 5),  # the last bytes, 2 MiB past the previous read: a GET of its own
    ]
    reads = _reads(s3, "blob", spans)
    ranges.read_ranges(reads, _settings())
    for (start, length), (_, _, destination) in zip(spans, reads):
        assert bytes(destination) == data[start : start + length]
    calls = recording_client[-1].calls
    assert calls["head_object"] == 1
    assert calls["get_object"] == 1 + 2 + 1


def test_seen_objects_are_not_asked_again_and_a_replaced_one_fails(s3, recording_client):
    s3.put("blob", b"a" * 1000)
    seen: dict = {}
    reads = _reads(s3, "blob", [(0, 10)])
    ranges.read_ranges(reads, _settings(), seen=seen)
    url = reads[0][0]
    assert seen[url][0] == 1000
    s3.put("blob", b"b" * 1000)
    with pytest.raises(ObjectStoreError, match="replaced while it was being read") as caught:
        ranges.read_ranges(_reads(s3, "blob", [(0, 10)]), _settings(), seen=seen)
    assert caught.value.code in ("PreconditionFailed", "412")
    assert "head_object" not in recording_client[-1].calls


def test_a_read_past_the_end_fails_before_any_get(s3, recording_client):
    s3.put("blob", b"x" * 100)
    with pytest.raises(TruncatedCheckpointError, match="holds 100 bytes, but bytes up to 101"):
        ranges.read_ranges(_reads(s3, "blob", [(90, 11)]), _settings())
    assert "get_object" not in recording_client[-1].calls


def test_missing_object_and_bucket(s3):
    with pytest.raises(ObjectNotFoundError):
        ranges.read_ranges(_reads(s3, "absent", [(0, 1)]), _settings())
    url = connection.ObjectURL(s3.bucket + "-missing", "blob")
    with pytest.raises(BucketNotFoundError):
        ranges.read_ranges([(url, 0, memoryview(bytearray(1)))], _settings())


def test_a_broken_off_response_is_fetched_again(s3, recording_client, monkeypatch):
    """The retry starts the GET over: its bytes go to the same pieces again."""
    data = os.urandom(3000)
    s3.put("blob", data)
    real = ranges._fetch_range
    broken = {"count": 0}

    def once_broken(client, url, etag, start, end, destination, stop):
        if broken["count"] == 0:
            broken["count"] += 1
            destination[start : start + 10] = b"\0" * 10
            raise ShortResponseError("injected")
        return real(client, url, etag, start, end, destination, stop)

    monkeypatch.setattr(ranges, "_fetch_range", once_broken)
    reads = _reads(s3, "blob", [(0, 100), (200, 2000)])
    ranges.read_ranges(reads, _settings())
    assert bytes(reads[0][2]) == data[:100] and bytes(reads[1][2]) == data[200:2200]
