"""An object in S3 or an S3-compatible store (``s3://bucket/key``) as a target, through boto3.

The requests are those of the modules beside this one (the package's
docstring, :mod:`fastpersist.io.targets.s3`, is the design): a save is a
multipart upload fed by the writer's ring, whose completion is the commit and
whose abort leaves the previous object intact;
a load is concurrent ranged GETs pinned to the ETag seen first. This file is
where a checkpoint's operations meet them: one object (a ``torch.save`` or
safetensors file, a collective save's manifest), or a prefix whose children
are a DCP checkpoint's files.

A target made from a URL opens a client per operation, as before (so changes
to the environment apply to the next call); :meth:`S3Object.connected` shares
one client, and one set of pinned ETags, among a save's or a load's requests.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno

from fastpersist.config import Settings
from fastpersist.errors import ObjectNotFoundError, ObjectStoreError
from fastpersist.io.targets.base import RangeReader, Target
from fastpersist.io.targets.s3 import connection, files, keys, ranges, upload

__all__ = ["S3Object"]

SCHEME = connection.SCHEME


@dataclasses.dataclass
class _Session:
    """One client for a save's or a load's requests, and the ``(size, ETag)`` of each object read so far."""

    client: object
    seen: dict = dataclasses.field(default_factory=dict)


class S3Object(Target):
    """``s3://bucket/key``: an object, or (:meth:`as_directory`) the prefix of a DCP checkpoint's objects.

    Made by :func:`fastpersist.io.targets.resolve` without a request; the URL
    is checked when an object is first needed (:attr:`url`).
    """

    scheme = "s3"
    remote = True
    layouts = ("parts",)

    def __init__(self, bucket: str, key: str, *, text: str | None = None, session: _Session | None = None):
        self.bucket = bucket
        self.key = key
        self._text = text
        self._session = session

    @classmethod
    def parse(cls, url: str) -> S3Object:
        """``s3://bucket/key`` split into its bucket and key (checked later, by the operation that uses it)."""
        bucket, _, key = url[len(SCHEME) :].partition("/")
        return cls(bucket, key, text=url)

    @property
    def path(self) -> str:
        if self._text is not None:
            return self._text
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    @property
    def given(self) -> str:
        return self.key  # its stem names the archive's top folder, as a local file's name does

    @property
    def url(self) -> connection.ObjectURL:
        """The object's parsed URL.

        Raises:
            ValueError: no bucket or no key, or a key ending in ``/`` (a "folder").
        """
        return connection.target(self.path)

    def _client(self):
        return None if self._session is None else self._session.client

    def _client_or_new(self, settings: Settings):
        return self._client() or connection.make_client(settings.s3_concurrency)

    # ------------------------------------------------------------------ saves

    def checked(self) -> S3Object:
        """This target, its URL parsed.

        Raises:
            ValueError: a malformed URL (before any request).
        """
        self.url  # noqa: B018 - parses, raising for a malformed URL
        return self

    def collective_layout(self, layout: str | None) -> str:
        """``"parts"``: part objects and a manifest object (ranks cannot write one object in place).

        Raises:
            ValueError: ``layout="file"``; a malformed URL (on every rank, before any exchange).
        """
        if layout == "file":
            raise ValueError(
                f"a collective save to an object store cannot use layout='file' ({self.path}): ranks cannot write "
                "one object in place. Leave layout at its default (for s3:// URLs: layout='parts', each writer "
                "uploads its share as a part object and rank 0 commits a manifest object at the key; "
                "fastpersist.load reads it), or save to a shared filesystem with layout='file'"
            )
        self.checked()
        return "parts"

    def commit_plan(self, plan, settings: Settings, streams=None, *, before_commit=None, after_reads=None) -> list[int]:
        """A multipart upload committed by its completion: :func:`fastpersist.io.targets.s3.upload.commit_plan`."""
        return upload.commit_plan(
            plan,
            self.url,
            settings,
            streams,
            before_commit=before_commit,
            after_reads=after_reads,
            client=self._client(),
        )

    def put_bytes(self, data, settings: Settings) -> None:
        """One ``PutObject`` (:func:`fastpersist.io.targets.s3.keys.put_bytes`)."""
        keys.put_bytes(self.url, data, client=self._client_or_new(settings))

    def upload_file(self, source, settings: Settings) -> None:
        """:func:`fastpersist.io.targets.s3.files.upload_file`."""
        files.upload_file(source, self.url, settings, client=self._client())

    # ------------------------------------------------------------------ loads

    def download(self, settings: Settings):
        """:func:`fastpersist.io.targets.s3.ranges.download` (one HEAD, then concurrent ranged GETs)."""
        return ranges.download(self.url, settings, client=self._client())

    def open_reader(self, settings: Settings) -> RangeReader:
        """:class:`fastpersist.io.targets.s3.ranges.ObjectReader`: one HEAD, then reads pinned to its ETag."""
        return ranges.ObjectReader(self.url, settings, client=self._client())

    def read_ranges(self, reads, settings: Settings) -> None:
        """:func:`fastpersist.io.targets.s3.ranges.read_ranges`, pinned to the ETags this connection saw first."""
        seen = None if self._session is None else self._session.seen
        ranges.read_ranges(
            [(where.url, offset, destination) for where, offset, destination in reads],
            settings,
            client=self._client(),
            seen=seen,
        )

    def exists(self) -> bool:
        """One HEAD.

        Raises:
            BucketNotFoundError: no such bucket.
            ObjectStoreCredentialsError, ObjectStoreError: the store refused, or the network failed.
        """
        url = self.url
        try:
            ranges.head(url, client=self._client() or connection.make_client(1), action=f"looking for {url}")
        except ObjectNotFoundError:  # (a missing bucket is a BucketNotFoundError, raised)
            return False
        return True

    def remove(self) -> None:
        """One ``DeleteObject`` (S3's delete succeeds where there is no object)."""
        keys.remove(self.url.path, client=self._client())

    # ------------------------------------------------------------------ prefixes (DCP)

    def as_directory(self) -> S3Object:
        """The prefix ``s3://bucket/key`` (slashes around the key dropped; an empty key: the bucket's top).

        Raises:
            ValueError: no bucket.
        """
        if not self.bucket:
            raise ValueError(f"expected a checkpoint prefix like 's3://bucket/path/to/step-100', got {self.path!r}")
        return S3Object(self.bucket, self.key.strip("/"), session=self._session)

    def child(self, name: str) -> S3Object:
        return S3Object(self.bucket, f"{self.key}/{name}" if self.key else name, session=self._session)

    def connected(self, settings: Settings, *, client=None) -> S3Object:
        """This prefix or object with one client (``client``, or a new one) for every request made through it."""
        session = _Session(client if client is not None else connection.make_client(settings.s3_concurrency))
        return S3Object(self.bucket, self.key, text=self._text, session=session)

    def check_sizes(self, sizes: dict[str, int], settings: Settings) -> None:
        """Concurrent HEADs: each child of ``sizes`` is an object of that size.

        DCP calls the writer's ``finish`` only once every rank's ``write_data``
        returned, and a rank returns once its uploads are complete; this makes
        sure before the commit that the store shows them.

        Raises:
            ObjectNotFoundError: (``FileNotFoundError``) a rank's object is missing.
            ObjectStoreError: an object has another size (something else wrote
                it), or the store refused, or the network failed.
        """
        if not sizes:
            return
        client = self._client_or_new(settings)

        def check(name: str) -> None:
            url = self.child(name).url
            size, _ = ranges.head(url, client=client, action=f"checking the upload of {url} before the commit")
            if size != sizes[name]:
                raise ObjectStoreError(
                    errno.EIO,
                    f"{url} holds {size} bytes where its rank uploaded {sizes[name]}: another save wrote to "
                    f"{self.path} at the same time. The checkpoint was not committed; save it again",
                    url.path,
                    code="SizeMismatch",
                )

        workers = max(1, min(settings.s3_concurrency, len(sizes)))
        with concurrent.futures.ThreadPoolExecutor(workers, "fastpersist-s3-head") as pool:
            for future in [pool.submit(check, name) for name in sorted(sizes)]:
                future.result()
