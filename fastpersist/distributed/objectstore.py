"""Collective saves to ``s3://bucket/key`` as part objects and a manifest object, and loads of them.

A collective save to an object store uses the ``layout="parts"`` model of
:mod:`fastpersist.distributed.save`, with objects for files:

1. **write**: each writer uploads its byte range of rank 0's file as an
   object of its own, ``<key>.<token>.part-<U>-of-<N>`` (the name
   :func:`~fastpersist.distributed.manifest.part_name` gives a local part),
   through :func:`fastpersist.io.targets.s3.upload.commit_plan` with a byte range:
   a multipart upload fed by the writer's ring (one ``PutObject`` for a range
   of at most one part), aborted on failure. The writers upload in parallel;
   that is the point.
2. **commit** (rank 0): the ranges another writer left out become part
   objects of rank 0's, divergent storages' bytes go into the manifest as
   patches, and rank 0 stores the manifest at ``<key>`` in one ``PutObject``:
   that is the commit. Until then nothing is at the key but the previous
   object.
3. **after the commit** (rank 0, best effort): the part objects of earlier
   saves to the key (any token but this save's) are deleted, those of the
   checkpoint the manifest replaced as well as those a failed save could not
   delete. A failure to list or delete them is a ``RuntimeWarning``, not an
   error: the checkpoint is committed.

On a failure before the manifest's ``PutObject`` every rank deletes the part
objects it uploaded, and rank 0 also deletes every object and aborts every
multipart upload of this save's token (those of a rank that died, too). What
cannot be deleted is named in a note on the error raised on that rank. When
the manifest's ``PutObject`` itself fails, whether it was stored is unknown,
so the parts are kept (the next committed save to the key deletes them).

A load of the key finds the manifest (its first bytes), asks each part
object's size and ETag, fetches them all with concurrent ranged GETs
(conditional on those ETags: :func:`fastpersist.io.targets.s3.ranges.read_ranges`)
into one buffer, and writes the manifest's patches and trailer in
(:func:`fastpersist.distributed.load.assemble_into`): the result is the
ordinary file, which the caller parses and verifies as any downloaded object
(every record's CRC-32).
"""

from __future__ import annotations

import concurrent.futures
import errno
import re
import warnings
from typing import Any

from fastpersist import config
from fastpersist.config import Settings
from fastpersist.distributed.load import assemble_into, check_part_size
from fastpersist.distributed.manifest import HEAD_SIZE, Manifest, PartInfo, looks_like_manifest
from fastpersist.errors import BucketNotFoundError, ObjectNotFoundError, ObjectStoreError
from fastpersist.format.names import check_file_name
from fastpersist.io import engine, targets
from fastpersist.io.targets.s3 import connection, ranges, upload
from fastpersist.io.targets.s3.connection import ObjectURL
from fastpersist.io.targets.s3.keys import abort_uploads, list_keys, put_bytes, remove, remove_keys

__all__ = ["ObjectParts", "part_url", "read_parts", "remove_checkpoint"]

_SHOWN = 8  # keys named in a note or warning; the rest are counted


def part_url(url: ObjectURL, name: str) -> ObjectURL:
    """Where the part object ``name`` (a manifest's part name) of the checkpoint at ``url`` is: beside it.

    The manifest parser has checked ``name`` already; checked again here, with
    the same check, because a key is built from it.

    Raises:
        UnsafeFileNameError: ``name`` is not a plain name (``/``, NUL, ``..``...): it would leave the key's folder.
    """
    check_file_name(name, checkpoint=url.path, what="a part object of the sharded checkpoint")
    folder, slash, _ = url.key.rpartition("/")
    return ObjectURL(url.bucket, folder + slash + name)


class ObjectParts:
    """Where a collective ``layout="parts"`` save to ``url`` puts its parts and its manifest (the object store).

    One per rank and save; :mod:`fastpersist.distributed.save` calls it.
    Every rank sees the same store, so rank 0 alone removes earlier saves'
    parts (:attr:`seen_by_every_rank`).

    Raises:
        ValueError: a malformed URL.
        ObjectStoreUnavailableError: boto3 is not installed.
    """

    seen_by_every_rank = True

    def __init__(self, destination, settings: Settings):
        self.url = destination.url  # an io.targets.S3Object: its parsed URL
        self.client = connection.make_client(settings.s3_concurrency)

    @property
    def target(self) -> str:
        """The key: parts are named after it (``<key>.<token>.part-<U>-of-<N>``)."""
        return self.url.key

    def write(self, plan, name: str, byte_range, settings: Settings, streams, after_reads=None) -> list[int]:
        """Uploads ``byte_range`` of ``plan`` as the part object ``name``; returns its records' CRC-32s.

        ``after_reads``: as :func:`~fastpersist.io.writer.write_plan`'s.

        Raises:
            ObjectStoreError and its subclasses: the upload failed and was
                aborted (a note says so if the abort failed as well).
        """
        return upload.commit_plan(
            plan,
            part_url(self.url, name),
            settings,
            streams,
            client=self.client,
            byte_range=(byte_range.start, byte_range.end),
            after_reads=after_reads,
        )

    def commit(self, manifest: bytes, settings: Settings) -> None:
        """Stores the manifest at the key in one ``PutObject``: the commit.

        Raises:
            ObjectStoreError and its subclasses: the store refused, or the
                network failed (the manifest may then be stored or not).
        """
        put_bytes(self.url, manifest, client=self.client)

    def discard(self, names, token: str | None = None) -> str | None:
        """Deletes the part objects ``names`` of a failed save; with ``token`` also every object and multipart
        upload of that save (rank 0's sweep). Never raises.

        Returns:
            A note for the error being raised when something may be left, or None.
        """
        keys = {part_url(self.url, name).key for name in names}
        left: dict[str, str] = {}
        prefix = f"{self.url.key}.{token}.part-" if token else None
        if prefix:
            left.update(abort_uploads(self.url, prefix, client=self.client))
            try:
                keys.update(list_keys(self.url, prefix, client=self.client))
            except BucketNotFoundError:
                pass  # no bucket: nothing was stored
            except OSError as error:
                left[prefix + "*"] = f"listing them failed ({error})"
        left.update(remove_keys(self.url, sorted(keys), client=self.client))
        if not left:
            return None
        return (
            f"the failed save's part objects or uploads could not all be removed: {_listed(self.url, left)}. "
            f"They are not part of any checkpoint: delete them (aws s3 rm s3://{self.url.bucket}/KEY; "
            f"aws s3api abort-multipart-upload for uploads), or let a bucket lifecycle rule expire them"
        )

    def remove_old(self, token: str, *, later: bool = False) -> None:
        """After a committed save: deletes the part objects of earlier saves to the key (any other token).

        Best effort: a failure is a ``RuntimeWarning`` naming what is left, never an error. Always now,
        ``later`` or not: listing and deleting are requests of one call here, and the listing must be made
        before this rank joins the next call (whose parts it would otherwise see as old); their cost beside
        an upload was not measured.
        """
        left = _remove_parts(self.url, self.client, keep=token)
        if left:
            warnings.warn(
                f"collective save to {self.url} committed, but part objects of earlier saves to that key could not "
                f"all be removed: {_listed(self.url, left)}. No checkpoint uses them any more: delete them "
                f"(aws s3 rm s3://{self.url.bucket}/KEY); the next collective save to the key tries again",
                RuntimeWarning,
                stacklevel=5,
            )


def remove_checkpoint(url: str, settings: Settings | None = None) -> None:
    """Deletes the object at ``url`` and, when it is a collective save's manifest, the part objects it names.

    The manifest goes first, so a failure never leaves a manifest without its
    parts. Nothing happens if there is no object (as S3's delete). Needs no
    permission to list the bucket: the parts are read from the manifest. A URL
    of a store that holds no collective saves (an fsspec filesystem) is one
    file, removed (:meth:`~fastpersist.io.targets.base.Target.remove`).

    Raises:
        ValueError: a malformed URL; a local path (remove it with ``os.remove``).
        CorruptCheckpointError: the object looks like a manifest but is damaged, or
            (``UnsafeFileNameError``) names a part that is not a plain name beside it; nothing is deleted.
        ObjectStoreError and its subclasses: the object could not be
            read or deleted, or some part objects could not be deleted (named
            in the message).
    """
    target = targets.resolve(url).checked()
    if not target.remote:
        raise ValueError(f"remove_checkpoint takes the URL of a store, got the local path {url!r}")
    if "parts" not in target.layouts:
        target.remove()
        return
    where = target.url
    settings = settings or config.settings()
    client = connection.make_client(settings.s3_concurrency)
    parts = _manifest_parts(where, settings, client)
    remove(url, client=client)
    left = remove_keys(where, [part_url(where, name).key for name in parts], client=client)
    if left:
        raise ObjectStoreError(
            errno.EIO,
            f"removing {url}: the manifest is gone, but part objects it named could not all be deleted: "
            f"{_listed(where, left)}; delete them (aws s3 rm s3://{where.bucket}/KEY)",
            where.path,
        )


def _manifest_parts(url: ObjectURL, settings: Settings, client) -> list[str]:
    """The part names of the manifest at ``url``; none when there is no object or another kind of object."""
    action = f"removing {url}"
    try:
        size, etag = ranges.head(url, client=client, action=action)
    except ObjectNotFoundError:
        return []
    seen = {url: (size, etag)}  # both reads are of this version of the object
    first = bytearray(min(size, HEAD_SIZE))
    ranges.read_ranges([(url, 0, memoryview(first))], settings, client=client, seen=seen, action=action)
    if not looks_like_manifest(bytes(first)):
        return []
    data = bytearray(size)
    ranges.read_ranges([(url, 0, memoryview(data))], settings, client=client, seen=seen, action=action)
    return [part.name for part in Manifest.from_bytes(bytes(data), url.path).parts]


def _remove_parts(url: ObjectURL, client, *, keep: str | None) -> dict[str, str]:
    """Deletes the part objects ``<key>.<token>.part-<U>-of-<N>`` of the key, but those of token ``keep``.

    Returns key -> why for what may be left (never raises).
    """
    pattern = re.compile(re.escape(url.key) + r"\.(?P<token>[0-9a-f]+)\.part-\d+-of-\d+")
    try:
        keys = list_keys(url, url.key + ".", client=client)
    except OSError as error:
        return {f"{url.key}.*.part-*": f"listing them failed ({error})"}
    parts = [k for k in keys if (match := pattern.fullmatch(k)) is not None and match["token"] != keep]
    return remove_keys(url, parts, client=client)


def _listed(url: ObjectURL, left: dict[str, str]) -> str:
    shown = "; ".join(f"s3://{url.bucket}/{key} ({why})" for key, why in sorted(left.items())[:_SHOWN])
    return shown + (f"; and {len(left) - _SHOWN} more" if len(left) > _SHOWN else "")


def read_parts(source, manifest_bytes: bytes, settings: Settings, *, client=None) -> tuple[Any, int]:
    """The ordinary file's bytes of the sharded checkpoint whose manifest is the object ``source`` (an
    :class:`~fastpersist.io.targets.S3Object`).

    Each part object's size and ETag are asked first (concurrently), then
    every part is fetched with ``s3_concurrency`` concurrent ranged GETs of
    ``s3_part_size`` bytes, each conditional on its ETag, into one
    page-aligned buffer; the manifest's patches and trailer are written in.
    Not verified here: the caller parses and verifies the bytes as it does a
    downloaded checkpoint.

    Returns:
        ``(buffer, size)`` as :func:`fastpersist.io.targets.s3.ranges.download` returns them.

    Raises:
        CorruptCheckpointError: a damaged manifest; (``UnsafeFileNameError``) one naming
            a part that is not a plain name beside it (nothing is fetched).
        ObjectNotFoundError: (``FileNotFoundError``) a part object is missing
            (deleted, or the checkpoint was replaced during the load).
        TruncatedCheckpointError: a part object has another size than the manifest says.
        ObjectStoreError and its subclasses: a request failed; a part was
            replaced during the load.
    """
    url = source.url
    manifest = Manifest.from_bytes(manifest_bytes, url.path)
    if client is None:
        client = connection.make_client(settings.s3_concurrency)
    locations = {part.index: part_url(url, part.name) for part in manifest.parts}

    def look(part: PartInfo) -> tuple[int, str | None]:
        where = locations[part.index]
        try:
            size, etag = ranges.head(where, client=client, action=f"loading {url}")
        except ObjectNotFoundError as error:
            raise ObjectNotFoundError(
                errno.ENOENT,
                f"loading {url} failed: part {part.index} of the sharded checkpoint ({where}, uploaded from host "
                f"{part.host or '?'}) is missing: it was deleted, or a newer save replaced the checkpoint during "
                "this load (then load again)",
                where.path,
                code=error.code,
            ) from error
        check_part_size(part, size, where.path)
        return size, etag

    with concurrent.futures.ThreadPoolExecutor(settings.s3_concurrency, "fastpersist-s3-head") as pool:
        seen = {locations[part.index]: answer for part, answer in zip(manifest.parts, pool.map(look, manifest.parts))}
    buffer = engine.AlignedBuffer(max(manifest.size, 1), lock=False)

    def fetch(pieces: list[tuple[PartInfo, memoryview]]) -> None:
        reads = [(locations[part.index], 0, view) for part, view in pieces]
        ranges.read_ranges(reads, settings, client=client, seen=seen, action=f"loading {url}")

    assemble_into(memoryview(buffer).cast("B")[: manifest.size], manifest, fetch)
    return buffer, manifest.size
