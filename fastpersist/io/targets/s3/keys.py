"""Whole S3 objects by key: one ``PutObject`` of bytes, deletes, listings, and aborting uploads left behind.

The requests of the S3 target that are not a multipart upload or a ranged
read (the design: :mod:`fastpersist.io.targets.s3`): :func:`put_bytes` stores
a small object in one request (a collective save's manifest, a DCP
checkpoint's ``.metadata``, an object of at most one part), :func:`remove`
deletes one, and :func:`list_keys`, :func:`remove_keys` and
:func:`abort_uploads` clean up after a collective save
(:mod:`fastpersist.distributed.objectstore`).
"""

from __future__ import annotations

import io

from fastpersist.io.targets.s3 import connection
from fastpersist.io.targets.s3.connection import SCHEME, ObjectURL, error_fields, target, with_translation

__all__ = ["MemoryBody", "remove", "put_bytes", "list_keys", "remove_keys", "abort_uploads"]


def remove(url: str, *, client=None) -> None:
    """Deletes the object at ``url`` (nothing happens if there is none: S3's delete is idempotent).

    Raises:
        ValueError: a malformed URL.
        ObjectStoreError and its subclasses: the store refused (credentials, missing bucket, network).
    """
    where = target(url)
    client = client or connection.make_client(1)
    with_translation(where, client, "delete", client.delete_object, Bucket=where.bucket, Key=where.key)


def put_bytes(url: ObjectURL, data, *, client) -> None:
    """Stores ``data`` as the object at ``url`` in one ``PutObject`` (atomic: the old object or the new one).

    For small objects (a collective save's manifest, a DCP checkpoint's
    ``.metadata``): ``data`` (any bytes-like object) is sent from memory, without
    a copy. Like a completed multipart upload, the ``PutObject`` is a commit.

    Raises:
        ObjectStoreCredentialsError, BucketNotFoundError, ObjectStoreError:
            the store refused, or the network failed (whether the object was
            stored is then unknown unless the store answered).
    """
    with_translation(
        url,
        client,
        f"uploading {url}",
        client.put_object,
        Bucket=url.bucket,
        Key=url.key,
        Body=MemoryBody(memoryview(data).cast("B")),
        ContentLength=len(data),
    )


def list_keys(url: ObjectURL, prefix: str, *, client) -> list[str]:
    """The keys of ``url``'s bucket that start with ``prefix`` (``ListObjectsV2``, every page).

    Raises:
        ObjectStoreError and its subclasses: the listing was refused or failed.
    """
    keys: list[str] = []
    arguments = {"Bucket": url.bucket, "Prefix": prefix}
    while True:
        page = with_translation(
            url, client, f"listing {SCHEME}{url.bucket}/{prefix}*", client.list_objects_v2, **arguments
        )
        keys += [item["Key"] for item in page.get("Contents", ())]
        if not page.get("IsTruncated"):
            return keys
        arguments["ContinuationToken"] = page["NextContinuationToken"]


def remove_keys(url: ObjectURL, keys, *, client) -> dict[str, str]:
    """Deletes the objects at ``keys`` of ``url``'s bucket (``DeleteObjects``, 1,000 a request). Never raises.

    Returns:
        key -> why, for each key that may still be there (a refused request
        fails all of its keys).
    """
    keys = list(keys)
    failed: dict[str, str] = {}
    for first in range(0, len(keys), 1000):
        batch = keys[first : first + 1000]
        try:
            response = client.delete_objects(
                Bucket=url.bucket, Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True}
            )
        except Exception as error:  # noqa: BLE001 - reported to the caller, who says what is left
            failed.update((key, f"{type(error).__name__}: {error}") for key in batch)
            continue
        for item in response.get("Errors", ()):
            failed[item.get("Key", "?")] = f"{item.get('Code')}: {item.get('Message', '')}"
    return failed


def abort_uploads(url: ObjectURL, prefix: str, *, client) -> dict[str, str]:
    """Aborts every multipart upload in progress in ``url``'s bucket whose key starts with ``prefix``. Never raises.

    Returns:
        key (or ``prefix``, when the listing failed) -> why, for each upload that may still be in progress.
    """
    failed: dict[str, str] = {}
    arguments = {"Bucket": url.bucket, "Prefix": prefix}
    try:
        while True:
            page = client.list_multipart_uploads(**arguments)
            for upload in page.get("Uploads", ()):
                try:
                    client.abort_multipart_upload(Bucket=url.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                except Exception as error:  # noqa: BLE001 - reported to the caller
                    if error_fields(error)[0] != "NoSuchUpload":
                        failed[upload["Key"]] = f"{type(error).__name__}: {error} (upload id {upload['UploadId']})"
            if not page.get("IsTruncated"):
                return failed
            arguments.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])
    except Exception as error:  # noqa: BLE001 - reported to the caller
        if error_fields(error)[0] != "NoSuchBucket":  # no bucket: no upload either
            failed[prefix] = f"listing the uploads failed ({type(error).__name__}: {error})"
        return failed


class MemoryBody(io.RawIOBase):
    """A read-only, seekable file over a memoryview: an UploadPart body straight from a ring buffer (no copy)."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view = view
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), len(self._view) - self._position))
        memoryview(buffer).cast("B")[:count] = self._view[self._position : self._position + count]
        self._position += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def __len__(self) -> int:
        return len(self._view)
