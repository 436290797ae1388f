"""DCP checkpoints under an ``s3://bucket/prefix``: where each file goes, and the requests around the commit.

A checkpoint under a prefix holds, as objects, exactly the files a local
checkpoint directory holds, under the same names: ``{prefix}/.metadata`` and
``{prefix}/__{rank}_{n}.distcp`` (byte for byte what the local writer
writes), so copying the prefix to a directory (``aws s3 cp --recursive``)
gives a checkpoint that DCP's ``FileSystemReader`` loads, and a
``FileSystemWriter`` directory uploaded under a prefix loads from S3.

The order of a save (``FastPersistWriter``), which makes ``.metadata`` the
commit record as in a directory:

1. the coordinator deletes a stale ``.metadata`` (:func:`retract`) before any
   rank uploads (DCP plans globally before anyone writes);
2. each rank uploads its files (``io.objectstore.commit_plan``: a multipart
   upload fed by the writer's ring, aborted on failure);
3. the coordinator checks that every rank's object is there with its size
   (:func:`check_committed`), then stores ``.metadata`` in one PutObject
   (:func:`store`): the commit.

A save that fails anywhere leaves no ``.metadata`` (and no upload in
progress): readers see no checkpoint, not a mix of old and new objects.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
from collections.abc import Mapping

from fastpersist.config import Settings
from fastpersist.errors import ObjectNotFoundError, ObjectStoreError
from fastpersist.io import objectstore

__all__ = ["Prefix", "prefix_of", "exists", "retract", "check_committed", "store", "fetch"]


@dataclasses.dataclass(frozen=True)
class Prefix:
    """``s3://bucket/key``, the "directory" of a DCP checkpoint (``key`` without a trailing ``/``; ``""``: the
    bucket's top)."""

    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"{objectstore.SCHEME}{self.bucket}/{self.key}" if self.key else f"{objectstore.SCHEME}{self.bucket}"

    def object(self, name: str) -> objectstore.ObjectURL:
        """The object of the checkpoint's file ``name`` (``.metadata``, ``__0_0.distcp``)."""
        return objectstore.ObjectURL(self.bucket, f"{self.key}/{name}" if self.key else name)

    def __str__(self) -> str:
        return self.url


def prefix_of(location: str | os.PathLike) -> Prefix | None:
    """The prefix ``location`` names, or None where it is a local path.

    Raises:
        ValueError: an ``s3://`` URL without a bucket, or a ``pathlib`` path
            made from one (``Path("s3://b/p")`` is ``s3:/b/p``: pass a string).
    """
    objectstore.is_object_url(location)  # raises for a URL that pathlib collapsed
    text = os.fspath(location)
    if isinstance(text, bytes):
        return None
    if not objectstore.is_object_url(text):
        return None
    bucket, _, key = text[len(objectstore.SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"expected a checkpoint prefix like 's3://bucket/path/to/step-100', got {text!r}")
    return Prefix(bucket, key.strip("/"))


def exists(prefix: Prefix, name: str, *, client) -> bool:
    """Whether the checkpoint's file ``name`` is an object under ``prefix``.

    Raises:
        BucketNotFoundError: no such bucket.
        ObjectStoreCredentialsError, ObjectStoreError: the store refused, or the network failed.
    """
    try:
        objectstore.head(prefix.object(name), client=client, action=f"looking for {prefix.object(name)}")
    except ObjectNotFoundError:  # (a missing bucket is a BucketNotFoundError, raised)
        return False
    return True


def retract(prefix: Prefix, name: str, *, client) -> None:
    """Deletes the object of the checkpoint's file ``name`` (S3's delete succeeds where there is none).

    Raises:
        BucketNotFoundError, ObjectStoreCredentialsError, ObjectStoreError: the store refused, or the network failed.
    """
    objectstore.remove(prefix.object(name).path, client=client)


def check_committed(prefix: Prefix, sizes: Mapping[str, int], settings: Settings, *, client) -> None:
    """Checks, with concurrent HEADs, that each file of ``sizes`` (name -> bytes) is an object of that size.

    DCP calls the writer's ``finish`` only once every rank's ``write_data``
    returned, and a rank returns once its uploads are complete; this makes
    sure before the commit that the store shows them.

    Raises:
        ObjectNotFoundError: (``FileNotFoundError``) a rank's object is missing.
        ObjectStoreError: an object has another size (something else wrote
            it), or the store refused, or the network failed.
    """

    def check(name: str) -> None:
        url = prefix.object(name)
        size, _ = objectstore.head(url, client=client, action=f"checking the upload of {url} before the commit")
        if size != sizes[name]:
            raise ObjectStoreError(
                errno.EIO,
                f"{url} holds {size} bytes where its rank uploaded {sizes[name]}: another save wrote to "
                f"{prefix} at the same time. The checkpoint was not committed; save it again",
                url.path,
                code="SizeMismatch",
            )

    if not sizes:
        return
    workers = max(1, min(settings.s3_concurrency, len(sizes)))
    with concurrent.futures.ThreadPoolExecutor(workers, "fastpersist-s3-head") as pool:
        for future in [pool.submit(check, name) for name in sorted(sizes)]:
            future.result()


def store(prefix: Prefix, name: str, data: bytes, *, client) -> None:
    """Stores ``data`` as the checkpoint's file ``name`` in one PutObject (for ``.metadata``: the commit).

    Raises:
        BucketNotFoundError, ObjectStoreCredentialsError, ObjectStoreError: the store refused, or the network failed.
    """
    objectstore.put_bytes(prefix.object(name), data, client=client)


def fetch(prefix: Prefix, name: str, settings: Settings, *, client) -> bytes:
    """The whole object of the checkpoint's file ``name``.

    Raises:
        ObjectNotFoundError, BucketNotFoundError: (``FileNotFoundError``).
        ObjectStoreCredentialsError, ObjectStoreError: the store refused, or the network failed.
    """
    buffer, size = objectstore.download(prefix.object(name), settings, client=client)
    return bytes(memoryview(buffer).cast("B")[:size])
