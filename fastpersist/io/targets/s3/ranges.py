"""S3 loads: one HEAD for an object's size and ETag, then concurrent ranged GETs pinned to that ETag.

A load asks for the object's size and ETag (:func:`head`: ``HeadObject``),
then fetches it with ``s3_concurrency`` concurrent ranged GETs of
``s3_part_size`` bytes, each conditional on that ETag (an object replaced
mid-load fails the load instead of mixing two versions), into one
page-aligned buffer of the object's size (:func:`download`).

Every ranged read goes through :func:`read_ranges`: whole objects (a
download, the part objects of a collective save), parts of objects (a DCP
load's items, a safetensors object's header and tensors), straight into their
destinations, conditional on the ETag each object had when first asked for;
reads of one object that touch or nearly do share a GET. :class:`ObjectReader`
is one object kept open for reads of chosen ranges. The design:
:mod:`fastpersist.io.targets.s3`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import threading
from typing import Any

from fastpersist.config import Settings
from fastpersist.errors import ObjectNotFoundError, ObjectStoreError, ShortResponseError, TruncatedCheckpointError
from fastpersist.io import engine
from fastpersist.io.targets.s3 import connection
from fastpersist.io.targets.s3.connection import ObjectURL, error_fields, translate

__all__ = ["head", "ObjectReader", "download", "read_ranges"]

_CHUNK = 1 << 20  # bytes copied at a time from a GET's response into the destination
_ATTEMPTS = 3  # tries of one ranged GET whose response broke off (botocore retries the requests themselves)


def head(url: ObjectURL, *, client, action: str) -> tuple[int, str | None]:
    """The size and ETag of the object at ``url`` (one HeadObject; ``action`` names the caller's step in errors).

    Raises:
        ObjectNotFoundError, BucketNotFoundError: (``FileNotFoundError``) no such object or bucket
            (a HEAD's bare 404 says neither: the bucket is asked for then).
        ObjectStoreCredentialsError: (``PermissionError``) the credentials were refused.
        ObjectStoreError: a network error or another refusal.
    """
    try:
        response = client.head_object(Bucket=url.bucket, Key=url.key)
    except Exception as error:
        translated = translate(error, url, client, action)
        if isinstance(translated, ObjectNotFoundError):  # HEAD's 404 does not say whether the bucket exists
            try:
                client.head_bucket(Bucket=url.bucket)
            except Exception as bucket_error:  # noqa: BLE001 - only "no such bucket" changes the answer
                if error_fields(bucket_error)[0] in ("404", "NoSuchBucket"):
                    translated = translate(bucket_error, url, client, action, code="NoSuchBucket")
        raise translated from error
    return int(response["ContentLength"]), response.get("ETag")


class ObjectReader:
    """One object kept open for ranged reads: its size and ETag (one :func:`head`), then :func:`read_ranges`.

    Every read is conditional on the ETag seen at open (``If-Match``), so the
    bytes of one reader all come from one version of the object: an object
    replaced while it is open fails the read instead of mixing two versions.
    No GET of its own: each read is a :func:`read_ranges` call (ranges of
    ``s3_part_size`` bytes, ``s3_concurrency`` at once, retried where a
    response breaks off). Thread-safe (boto3 clients are).
    ``fastpersist.safe_open`` of a URL reads only the ranges it needs through one.

    Raises (on construction):
        ObjectStoreUnavailableError: boto3 is missing.
        ObjectNotFoundError, BucketNotFoundError: (``FileNotFoundError``) no such object or bucket.
        ObjectStoreCredentialsError: (``PermissionError``) the credentials were refused.
        ObjectStoreError: a network error.
    """

    def __init__(self, url: ObjectURL, settings: Settings, *, client=None):
        self.url = url
        self.settings = settings
        self._owns_client = client is None
        self.client = client if client is not None else connection.make_client(settings.s3_concurrency)
        self._action = f"loading {url}"
        self.size, self.etag = head(url, client=self.client, action=self._action)
        self._seen = {url: (self.size, self.etag)}  # pins read_ranges to this version

    def read_into(self, start: int, destination) -> None:
        """Fills ``destination`` (a writable buffer) with the object's bytes from ``start`` on.

        Raises:
            ValueError: the range reaches past the object's end.
            ObjectStoreError and its subclasses: as :func:`read_ranges` (an
                object replaced since the open: ``code="PreconditionFailed"``).
            KeyboardInterrupt: after every GET in flight has stopped.
        """
        view = memoryview(destination).cast("B")
        end = start + len(view)
        if start < 0 or end > self.size:
            raise ValueError(f"bytes {start}-{end - 1} are outside {self.url} ({self.size} bytes)")
        read_ranges([(self.url, start, view)], self.settings, client=self.client, seen=self._seen, action=self._action)

    def read(self, start: int, end: int) -> engine.AlignedBuffer:
        """Bytes ``[start, end)`` in a new page-aligned buffer (at least one byte is allocated).

        Raises:
            As :meth:`read_into`.
        """
        buffer = engine.AlignedBuffer(max(end - start, 1), lock=False)
        self.read_into(start, memoryview(buffer).cast("B")[: end - start])
        return buffer

    def close(self) -> None:
        """Closes the client's connections where this reader made the client (botocore >= 1.29); idempotent."""
        close = getattr(self.client, "close", None)
        if self._owns_client and close is not None:
            close()


def download(url: ObjectURL, settings: Settings, *, client=None) -> tuple[Any, int]:
    """Fetches the whole object into one page-aligned buffer, with concurrent ranged GETs.

    Returns:
        ``(buffer, size)``: an ``engine.AlignedBuffer`` (a Python buffer) of
        the object's ``size`` bytes (at least one byte is allocated).

    Raises:
        ObjectStoreUnavailableError: boto3 is missing.
        ObjectNotFoundError, BucketNotFoundError: (``FileNotFoundError``) no such object or bucket.
        ObjectStoreCredentialsError: (``PermissionError``) the credentials were refused.
        ObjectStoreError: a network error, or the object was replaced during the load.
        KeyboardInterrupt: after every GET in flight has stopped.
    """
    if client is None:
        client = connection.make_client(settings.s3_concurrency)
    action = f"loading {url}"
    size, etag = head(url, client=client, action=action)
    buffer = engine.AlignedBuffer(max(size, 1), lock=False)
    destination = memoryview(buffer).cast("B")[:size]
    read_ranges([(url, 0, destination)], settings, client=client, seen={url: (size, etag)}, action=action)
    return buffer, size


_COALESCE_GAP = 64 << 10
"""Reads of one object at most this many bytes apart share one GET, the bytes between dropped (a
request costs more than fetching that much)."""


def read_ranges(reads, settings: Settings, *, client=None, seen: dict | None = None, action: str | None = None) -> None:
    """Fills each ``(url, offset, destination)`` of ``reads`` with bytes ``[offset, offset + len(destination))``
    of the object at ``url``, with concurrent ranged GETs.

    Each object not in ``seen`` is asked for its size and ETag once
    (:func:`head`), and every GET of it is conditional on that ETag
    (``If-Match``): an object
    replaced during the reads fails them instead of mixing two versions. Reads
    of one object that touch, or lie at most 64 KiB apart, share a GET (the
    bytes between are fetched and dropped); a GET is at most ``s3_part_size``
    bytes (a longer read is split) and ``s3_concurrency`` GETs run at once. A
    response that breaks off mid-body is fetched again (3 tries).

    Args:
        reads: ``(ObjectURL, offset, destination)``; ``destination`` is a
            writable byte memoryview (of a tensor, a buffer).
        settings: ``s3_part_size`` and ``s3_concurrency``.
        client: from :func:`~fastpersist.io.targets.s3.connection.make_client` (default: a new one).
        seen: ``{url: (size, etag)}`` of the objects already asked for, by an
            earlier call of reads that must all see one version of each
            object, or by the caller itself (a HEAD it made to check a size);
            the objects asked for here are added to it.
        action: names the operation in errors (default: ``reading <url>``,
            the object's URL).

    Raises:
        ObjectNotFoundError, BucketNotFoundError: (``FileNotFoundError``) no such object or bucket.
        ObjectStoreCredentialsError: (``PermissionError``) the credentials were refused.
        ObjectStoreError: a network error; an object was replaced (``code="PreconditionFailed"``).
        TruncatedCheckpointError: a read ends past its object's end (before any GET).
        KeyboardInterrupt: after every GET in flight has stopped.
        The destinations then hold part of their bytes.
    """
    if client is None:
        client = connection.make_client(settings.s3_concurrency)
    seen = {} if seen is None else seen
    by_object: dict[ObjectURL, list] = {}
    for url, offset, destination in reads:
        if len(destination):
            by_object.setdefault(url, []).append((offset, offset + len(destination), destination))
    unknown = [url for url in by_object if url not in seen]
    with concurrent.futures.ThreadPoolExecutor(settings.s3_concurrency, "fastpersist-s3-get") as pool:
        answers = pool.map(lambda url: head(url, client=client, action=action or f"reading {url}"), unknown)
        seen.update(zip(unknown, answers))
        requests = []
        for url, pieces in by_object.items():
            size = seen[url][0]
            end = max(piece[1] for piece in pieces)
            if end > size:
                raise TruncatedCheckpointError(
                    f"{url} holds {size} bytes, but bytes up to {end} are to be read from it: it is not the "
                    "object the checkpoint's metadata describes (truncated or replaced)",
                    path=url.path,
                )
            requests += _coalesce(url, pieces, settings.s3_part_size)
        stop = threading.Event()
        futures = [
            pool.submit(
                _fetch_retrying,
                client,
                url,
                seen[url][1],
                start,
                end,
                _Scatter(pieces),
                stop,
                action or f"reading {url}",
            )
            for url, start, end, pieces in requests
        ]
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
        except BaseException:
            stop.set()
            for future in futures:
                future.cancel()
            raise


def _coalesce(url: ObjectURL, pieces: list, part_size: int) -> list:
    """``(url, start, end, pieces)`` GETs for one object's ``(start, end, destination)`` pieces."""
    pieces.sort(key=lambda piece: piece[0])
    runs: list[list] = []  # [start, end, pieces]
    for piece in pieces:
        if runs and piece[0] <= runs[-1][1] + _COALESCE_GAP:
            runs[-1][1] = max(runs[-1][1], piece[1])
            runs[-1][2].append(piece)
        else:
            runs.append([piece[0], piece[1], [piece]])
    requests = []
    for start, end, members in runs:
        first = 0
        for lo in range(start, end, part_size):
            hi = min(lo + part_size, end)
            while members[first][1] <= lo:  # ended before this GET (members are sorted by start)
                first += 1
            inside = []
            for piece in members[first:]:
                if piece[0] >= hi:
                    break
                if piece[1] > lo:
                    inside.append(piece)
            requests.append((url, lo, hi, inside))
    return requests


class _Scatter:
    """The destinations of one GET, addressed by object offset: ``scatter[a:b] = chunk`` copies each part of
    ``chunk`` into the pieces it belongs to; bytes of no piece (a gap between coalesced reads) are dropped."""

    def __init__(self, pieces: list):
        self._pieces = pieces  # (start, end, destination), sorted by start
        self._first = 0
        self._last = -1

    def __setitem__(self, where: slice, chunk) -> None:
        a, b = where.start, where.stop
        if a < self._last:  # the GET started again (a retry)
            self._first = 0
        self._last = a
        pieces = self._pieces
        while self._first < len(pieces) and pieces[self._first][1] <= a:
            self._first += 1
        view = memoryview(chunk)
        for index in range(self._first, len(pieces)):
            start, end, destination = pieces[index]
            if start >= b:
                break
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                destination[lo - start : hi - start] = view[lo - a : hi - a]


def _fetch_retrying(client, url: ObjectURL, etag, start: int, end: int, destination, stop, action: str) -> None:
    """:func:`_fetch_range`, again where the response broke off; raises the translated error."""
    for attempt in range(_ATTEMPTS):
        try:
            _fetch_range(client, url, etag, start, end, destination, stop)
            return
        except Exception as error:
            if stop.is_set() or attempt + 1 == _ATTEMPTS or not _broken_response(error):
                raise translate(error, url, client, action) from error


def _fetch_range(client, url: ObjectURL, etag, start: int, end: int, destination, stop) -> None:
    """Bytes ``[start, end)`` of the object into ``destination[start:end]`` (addressed by object offset: a
    :class:`_Scatter`), conditional on ``etag``."""
    arguments = dict(Bucket=url.bucket, Key=url.key, Range=f"bytes={start}-{end - 1}")
    if etag:
        arguments["IfMatch"] = etag
    body = client.get_object(**arguments)["Body"]
    try:
        position = start
        for chunk in body.iter_chunks(_CHUNK):
            if stop.is_set():
                return
            if position + len(chunk) > end:
                raise ObjectStoreError(errno.EIO, f"the store sent more than bytes {start}-{end - 1}", url.path)
            destination[position : position + len(chunk)] = chunk
            position += len(chunk)
        if position != end:
            raise ShortResponseError(f"bytes {start}-{end - 1}: the response ended after {position - start} bytes")
    finally:
        body.close()


def _broken_response(error: BaseException) -> bool:
    """A response that broke off mid-body (retried): botocore retries failed requests, not failed reads."""
    return isinstance(error, ShortResponseError) or type(error).__name__ in (
        "ResponseStreamingError",
        "IncompleteReadError",
        "ReadTimeoutError",
        "ProtocolError",
        "ConnectionClosedError",
    )
