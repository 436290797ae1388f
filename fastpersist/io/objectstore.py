"""Checkpoints in S3 and S3-compatible object stores (``s3://bucket/key``): multipart uploads and ranged GETs.

A save produces exactly the bytes a save to a local file produces, through the
same writer (:func:`fastpersist.io.writer.write_plan`), whose ring of
page-locked buffers becomes the upload's parts:

1. ``CreateMultipartUpload`` on the key. Nothing is visible under the key yet.
2. ``write_plan`` runs with a ring of ``max(2, s3_concurrency)`` buffers of
   ``s3_part_size`` bytes (the part size is raised where the checkpoint would
   need more than S3's 10,000 parts). The writer fills the file's windows in
   order and finalizes each one (CRC-32s, data descriptors, central
   directory) before it submits it; here the submission is an
   ``UploadPart`` of that window on a pool of ``s3_concurrency`` threads,
   straight from the page-locked buffer (no copy). Window ``k`` is part
   ``k + 1``: every window but the last has the full part size (S3's 5 MiB
   minimum holds), and the last may be short. The writer never goes back to
   patch bytes it has submitted (the zip trailer is written last, in file
   order, once every CRC is known), so no part is uploaded twice. A slot is
   refilled only once its part is uploaded: host memory is the ring, at most
   ``max(2, s3_concurrency) * s3_part_size``, whatever the checkpoint's size.
3. ``CompleteMultipartUpload`` with every part's ETag: that is the commit.
   The object appears whole, atomically replacing the previous one.
4. On any failure before that -- a part's error, an interrupt
   (``KeyboardInterrupt``), a failed ``before_commit`` check -- the writer
   drains what is in flight, parts not yet started are skipped, and
   ``AbortMultipartUpload`` discards the parts: the previous object at the
   key is intact and no upload is left in progress. If the abort fails too,
   the error raised says so and how to abort by hand.

A local file goes up through :func:`upload_file` (the background half of a
two-tier save, ``async_save(..., local_copy=path)``): the same multipart
upload, committed and aborted as above, whose parts are read from the file
with concurrent ``pread`` calls into at most ``s3_concurrency`` page-aligned
buffers of ``s3_part_size`` bytes (one ``PutObject`` for a file of at most one
part, :func:`put_bytes`). A file written to during its upload fails it before
the commit.

A load asks for the object's size and ETag (:func:`head`: ``HeadObject``),
then fetches it with ``s3_concurrency`` concurrent ranged GETs of
``s3_part_size`` bytes, each conditional on that ETag (an object replaced
mid-load fails the load instead of mixing two versions), into one
page-aligned buffer of the object's size (:func:`download`). The caller
parses the zip from that buffer; CPU storages are views of it.

Every ranged read goes through :func:`read_ranges`: whole objects (a
download, the part objects of a collective save), parts of objects (a DCP
load's items, a safetensors object's header and tensors), straight into their
destinations (tensors or buffers), conditional on the ETag each object had
when first asked for (or that the caller's own HEAD found); reads of one
object that touch or nearly do share a GET. :class:`ObjectReader` is one
object kept open for reads of chosen ranges: one :func:`head`, then
:func:`read_ranges` calls pinned to that ETag (``safe_open`` of a URL fetches
the header, then only the tensors asked for).

The same module serves the multi-object checkpoints built on it: a
collective save (:mod:`fastpersist.distributed.objectstore`) uploads each
writer's byte range of the file with :func:`commit_plan` (``byte_range=``)
and commits a manifest with :func:`put_bytes`, and cleans up with
:func:`list_keys`, :func:`remove_keys` and :func:`abort_uploads`; a DCP
checkpoint under a prefix uploads several ``.distcp`` files with
:func:`commit_plan` and its ``.metadata`` with :func:`put_bytes`. The entry
points reach all of this through the S3 target
(:class:`fastpersist.io.targets.S3Object`), never directly.

Endpoint, region and credentials come from boto3's standard chain (the
``AWS_*`` environment variables, ``~/.aws/config`` and ``~/.aws/credentials``,
instance roles), so MinIO and Ceph work with ``AWS_ENDPOINT_URL``. boto3 is
imported on first use only (``pip install fastpersist[s3]``). A client is made
per save or load (boto3 clients are thread-safe, sessions are not), so
changes to the environment apply to the next call.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import errno
import io
import math
import os
import stat
import threading
from typing import Any, NoReturn

from fastpersist.config import Settings
from fastpersist.errors import (
    BucketNotFoundError,
    CheckpointIOError,
    ObjectNotFoundError,
    ObjectStoreCredentialsError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
    PartSkippedError,
    ShortResponseError,
    TruncatedCheckpointError,
)
from fastpersist.io import engine
from fastpersist.io.writer import write_plan

__all__ = [
    "SCHEME",
    "MAX_PARTS",
    "ObjectURL",
    "target",
    "make_client",
    "part_size_for",
    "remove",
    "commit_plan",
    "put_bytes",
    "head",
    "download",
    "read_ranges",
    "ObjectReader",
    "upload_file",
    "list_keys",
    "remove_keys",
    "abort_uploads",
]

SCHEME = "s3://"
MAX_PARTS = 10_000
"""S3's limit on the parts of one multipart upload."""
_MiB = 1 << 20
_CHUNK = 1 * _MiB  # bytes copied at a time from a GET's response into the destination
_ATTEMPTS = 3  # tries of one ranged GET whose response broke off (botocore retries the requests themselves)

_CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
        "403",
    }
)


@dataclasses.dataclass(frozen=True)
class ObjectURL:
    """A parsed ``s3://bucket/key``: what :func:`commit_plan` and :func:`download` take.

    ``path`` is the URL (errors and futures name it), ``given`` the key (its stem
    names the archive's top folder, as a local file's name does).
    """

    bucket: str
    key: str

    @property
    def path(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @property
    def given(self) -> str:
        return self.key

    def __str__(self) -> str:
        return self.path


def target(url: str) -> ObjectURL:
    """Parses ``s3://bucket/key``.

    Raises:
        ValueError: no bucket or no key, or a key ending in ``/`` (a "folder").
    """
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"expected an object URL like 's3://bucket/path/to/ckpt.pt', got {url!r}")
    return ObjectURL(bucket, key)


def make_client(concurrency: int):
    """A boto3 S3 client configured from the standard AWS chain, with a connection per concurrent request.

    Raises:
        ObjectStoreUnavailableError: (an ``ImportError``) boto3 is not installed.
    """
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise ObjectStoreUnavailableError(
            f"s3:// paths need boto3, which is not installed ({e}); install it with: pip install fastpersist[s3]"
        ) from e
    config = Config(
        max_pool_connections=max(10, concurrency + 2),
        retries={"mode": "standard"},
        user_agent_extra="fastpersist",
    )
    return boto3.session.Session().client("s3", config=config)


def part_size_for(total: int, configured: int) -> int:
    """The part size for an object of ``total`` bytes: ``configured``, or more where that would need too many parts.

    Raised sizes are whole MiB, so the ring's buffers stay page multiples.
    """
    if math.ceil(total / configured) <= MAX_PARTS:
        return configured
    return math.ceil(total / MAX_PARTS / _MiB) * _MiB


# ----------------------------------------------------------------------------- errors


def _describe_store(client) -> str:
    endpoint = getattr(client.meta, "endpoint_url", None)
    region = getattr(client.meta, "region_name", None)
    return f"endpoint {endpoint}, region {region}"


def _translate(
    error: BaseException, url: ObjectURL, client, action: str, *, code: str | None = None
) -> ObjectStoreError:
    """``error`` (from botocore, or anything a request raised) as the fastpersist error that says what to do.

    ``code`` replaces the error's own code (a HEAD's bare ``404`` known to mean ``NoSuchBucket``).
    """
    if isinstance(error, ObjectStoreError):
        return error
    own_code, status, message = _error_fields(error)
    code = code or own_code
    store = _describe_store(client)
    if type(error).__name__ in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        code = type(error).__name__
    if code in _CREDENTIAL_CODES or code in (
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
    ):
        return ObjectStoreCredentialsError(
            errno.EACCES,
            f"{action} was refused: the credentials were not accepted ({code}: {message}) by the store "
            f"({store}). Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or AWS_PROFILE, "
            f"and that they may read and write s3://{url.bucket}",
            url.path,
            code=code,
        )
    if code == "NoSuchBucket":
        return BucketNotFoundError(
            errno.ENOENT,
            f"{action} failed: bucket {url.bucket!r} does not exist ({store}). Create it, or check the URL, "
            "AWS_ENDPOINT_URL and AWS_DEFAULT_REGION",
            url.path,
            code=code,
        )
    if code in ("NoSuchKey", "404"):
        return ObjectNotFoundError(
            errno.ENOENT,
            f"{action} failed: there is no object at this key in bucket {url.bucket!r} ({store}). Check the key "
            f"(aws s3 ls s3://{url.bucket}/{url.key.rpartition('/')[0]})",
            url.path,
            code=code,
        )
    if code in ("PreconditionFailed", "412"):
        return ObjectStoreError(
            errno.EIO,
            f"{action} failed: the object was replaced while it was being read; load it again",
            url.path,
            code=code,
        )
    if code is None and status is None:  # no answer from the store: the network, the endpoint, a timeout
        code = type(error).__name__
        return ObjectStoreError(
            errno.EIO,
            f"{action} failed: {code}: {error} ({store}). Check AWS_ENDPOINT_URL and the network, then retry",
            url.path,
            code=code,
        )
    return ObjectStoreError(
        errno.EIO, f"{action} failed: the store answered {code} ({message}) ({store})", url.path, code=code
    )


def _error_fields(error: BaseException) -> tuple[str | None, int | None, str]:
    """(code, HTTP status, message) of a botocore ``ClientError``; (None, None, str) for anything else."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None, None, str(error)
    details = response.get("Error", {})
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return details.get("Code") or (str(status) if status else None), status, details.get("Message", "")


def _with_translation(url: ObjectURL, client, action: str, call, **arguments):
    try:
        return call(**arguments)
    except Exception as error:
        raise _translate(error, url, client, action) from error


def remove(url: str, *, client=None) -> None:
    """Deletes the object at ``url`` (nothing happens if there is none: S3's delete is idempotent).

    Raises:
        ValueError: a malformed URL.
        ObjectStoreError and its subclasses: the store refused (credentials, missing bucket, network).
    """
    where = target(url)
    client = client or make_client(1)
    _with_translation(where, client, "delete", client.delete_object, Bucket=where.bucket, Key=where.key)


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
    _with_translation(
        url,
        client,
        f"uploading {url}",
        client.put_object,
        Bucket=url.bucket,
        Key=url.key,
        Body=_MemoryBody(memoryview(data).cast("B")),
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
        page = _with_translation(
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
                    if _error_fields(error)[0] != "NoSuchUpload":
                        failed[upload["Key"]] = f"{type(error).__name__}: {error} (upload id {upload['UploadId']})"
            if not page.get("IsTruncated"):
                return failed
            arguments.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])
    except Exception as error:  # noqa: BLE001 - reported to the caller
        if _error_fields(error)[0] != "NoSuchBucket":  # no bucket: no upload either
            failed[prefix] = f"listing the uploads failed ({type(error).__name__}: {error})"
        return failed


# ----------------------------------------------------------------------------- saves


class _MemoryBody(io.RawIOBase):
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


class _MultipartUpload:
    """One multipart upload: the ``file`` of :func:`write_plan`, whose handles upload windows as parts, or the
    parts of a local file (:func:`upload_file`).

    Call order: :meth:`begin`; the writer's ``submit_write`` calls (or
    :meth:`submit_file_part`), in object order; then :meth:`complete` or
    :meth:`abort` (either may follow a failure of the other); :meth:`close` always.
    """

    def __init__(self, client, url: ObjectURL, concurrency: int):
        self.client = client
        self.url = url
        self.upload_id: str | None = None
        self.first_error: BaseException | None = None
        self._parts: dict[int, dict] = {}
        self._submitted = 0  # bytes handed to parts so far: the next part must start there
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="fastpersist-s3-put")

    def begin(self) -> None:
        response = _with_translation(
            self.url,
            self.client,
            f"starting the upload of {self.url}",
            self.client.create_multipart_upload,
            Bucket=self.url.bucket,
            Key=self.url.key,
        )
        self.upload_id = response["UploadId"]

    def handle(self) -> _PartHandle:
        return _PartHandle()

    def _next_part(self, offset: int, nbytes: int) -> int:
        """The number of the part of ``nbytes`` that starts at ``offset`` (parts come in order, without gaps)."""
        if offset != self._submitted:
            raise AssertionError(f"parts must come in order: expected offset {self._submitted}, got {offset}")
        self._submitted += nbytes
        number = len(self._parts) + 1
        self._parts[number] = {}
        return number

    def submit_part(self, address: int, nbytes: int, offset: int, keepalive) -> concurrent.futures.Future:
        """Queues the upload of ``nbytes`` at ``address`` as the part that starts at ``offset`` of the object."""
        number = self._next_part(offset, nbytes)
        return self._pool.submit(self._upload_from_memory, number, address, nbytes, keepalive)

    def submit_file_part(self, source: _FileSource, offset: int, nbytes: int, buffers: _Buffers):
        """Queues the upload of ``nbytes`` of ``source`` at ``offset``, read into one of ``buffers`` first."""
        number = self._next_part(offset, nbytes)
        return self._pool.submit(self._upload_from_file, number, source, offset, nbytes, buffers)

    def _skip_after_failure(self, number: int) -> None:
        if self.first_error is not None:
            raise PartSkippedError(errno.ECANCELED, f"part {number} skipped after an earlier failure", self.url.path)

    def _upload_from_memory(self, number: int, address: int, nbytes: int, keepalive) -> None:
        self._skip_after_failure(number)
        view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        try:
            self._send(number, view)
        finally:
            del view, keepalive  # the ring slot may be refilled once its handle's wait returns

    def _upload_from_file(self, number: int, source: _FileSource, offset: int, nbytes: int, buffers: _Buffers):
        self._skip_after_failure(number)
        buffer = buffers.acquire()
        view = memoryview(buffer).cast("B")[:nbytes]
        try:
            try:
                source.read_into(view, offset)
            except Exception as error:
                self.fail(error)
                raise
            self._send(number, view)
        finally:
            del view
            buffers.release(buffer)

    def fail(self, error: BaseException) -> None:
        """Marks the upload failed by ``error`` (the first one counts): parts not started yet are skipped."""
        with self._lock:
            if self.first_error is None:
                self.first_error = error

    def _send(self, number: int, view: memoryview) -> None:
        """``UploadPart`` of ``view`` as part ``number``; its ETag (and checksum) are kept for the completion."""
        try:
            response = self.client.upload_part(
                Bucket=self.url.bucket,
                Key=self.url.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=_MemoryBody(view),
                ContentLength=len(view),
            )
        except Exception as error:
            translated = _translate(error, self.url, self.client, f"uploading part {number} of {self.url}")
            self.fail(translated)
            raise translated from error
        except BaseException as error:  # an interrupt: the parts not started yet are skipped
            self.fail(error)
            raise
        part = {"ETag": response["ETag"], "PartNumber": number}
        for name in ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256"):
            if name in response:  # botocore sends one per part by default; some stores want them back
                part[name] = response[name]
        self._parts[number] = part

    def complete(self) -> None:
        if not self._parts:
            raise AssertionError("a checkpoint has at least one part")
        parts = [self._parts[number] for number in sorted(self._parts)]
        _with_translation(
            self.url,
            self.client,
            f"completing the upload of {self.url}",
            self.client.complete_multipart_upload,
            Bucket=self.url.bucket,
            Key=self.url.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )

    def abort(self, cause: BaseException) -> None:
        """Discards the parts; a failure to do so is added to ``cause`` as a note (``cause`` is what is raised)."""
        if self.upload_id is None:
            return
        try:
            self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=self.url.key, UploadId=self.upload_id)
        except Exception as error:  # noqa: BLE001 - the save's own error is the one to raise
            if _error_fields(error)[0] == "NoSuchUpload":
                return  # already gone (a complete that went through before an interrupt, or a lifecycle rule)
            cause.add_note(
                f"AbortMultipartUpload failed as well ({type(error).__name__}: {error}): the parts uploaded so far "
                f"stay stored (and billed) until a lifecycle rule removes them, or: aws s3api "
                f"abort-multipart-upload --bucket {self.url.bucket} --key {self.url.key} --upload-id {self.upload_id}"
            )

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _PartHandle:
    """The handle of one ring slot (see :func:`write_plan`'s ``make_handle``): its window goes up as one part."""

    def __init__(self):
        self._pending: list[concurrent.futures.Future] = []

    def submit_write(self, address: int, nbytes: int, upload: _MultipartUpload, offset: int, keepalive) -> None:
        self._pending.append(upload.submit_part(address, nbytes, offset, keepalive))

    def wait(self) -> int:
        """Until this slot's parts are uploaded; raises the first error (an ``ObjectStoreError``)."""
        concurrent.futures.wait(self._pending)  # interruptible; the writer then drains by calling wait again
        pending, self._pending = self._pending, []
        for future in pending:
            if future.exception() is not None:
                raise future.exception()
        return len(pending)


class _SinglePut:
    """An object of one part: the window is copied aside and sent by one PutObject at :meth:`complete`.

    Below one part a multipart upload costs three requests where one does
    (their times: docs/performance.md). The bytes
    are copied (at most one part) because the ring slot is reused once its
    handle's wait returns, and the object must not appear before
    ``before_commit`` has passed: PutObject is the commit, as completion is.
    """

    def __init__(self, client, url: ObjectURL):
        self.client = client
        self.url = url
        self.upload_id = None
        self.first_error = None
        self._body = bytearray()

    def begin(self) -> None:
        pass

    def handle(self) -> _PartHandle:
        return _PartHandle()

    def submit_part(self, address: int, nbytes: int, offset: int, keepalive) -> concurrent.futures.Future:
        if offset != len(self._body):
            raise AssertionError(f"parts must come in order: expected offset {len(self._body)}, got {offset}")
        self._body += (ctypes.c_char * nbytes).from_address(address).raw
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        return done

    def complete(self) -> None:
        put_bytes(self.url, self._body, client=self.client)

    def abort(self, cause: BaseException) -> None:
        self._body = bytearray()  # nothing was sent: the previous object is untouched

    def close(self) -> None:
        self._body = bytearray()


def _abort_and_raise(upload, error: BaseException) -> NoReturn:
    """Aborts ``upload`` after ``error`` and raises the failure itself.

    Where the writer met a part skipped because another part had failed, the
    first part's failure is raised in place of the skip.
    """
    raised = error
    if isinstance(error, PartSkippedError) and upload.first_error is not None:
        raised = upload.first_error
    upload.abort(raised)
    if raised is error:
        raise error
    raise raised from None


def commit_plan(
    plan,
    destination: ObjectURL,
    settings: Settings,
    streams,
    *,
    before_commit=None,
    client=None,
    byte_range=None,
    after_reads=None,
) -> list[int]:
    """Uploads ``plan`` to ``destination`` as a multipart upload, committed by its completion (one PutObject
    for an object of at most one part).

    The counterpart of :func:`fastpersist.io.commit.commit_plan` for object
    stores (see the module docstring). ``plan`` is anything
    :func:`~fastpersist.io.writer.write_plan` executes (a torch archive's
    plan, a DCP ``.distcp`` file's). ``before_commit``, if given, is called
    once every part is uploaded and before the completion; its failure aborts
    the upload. ``byte_range=(start, end)`` uploads only those bytes of the
    plan, as an object of their own (one writer's part of a collective save,
    :mod:`fastpersist.distributed.objectstore`).
    ``after_reads``: as :func:`~fastpersist.io.writer.write_plan`'s.

    Returns:
        What :func:`~fastpersist.io.writer.write_plan` returns: the CRC-32 of
        every record of ``plan`` (with ``byte_range``: of their bytes inside
        the range).

    Raises:
        ObjectStoreUnavailableError: boto3 is missing (before any request).
        ObjectStoreCredentialsError, BucketNotFoundError, ObjectStoreError:
            the store refused a request, or the network failed. The upload is
            then aborted and the previous object at the key is intact (a note
            on the error says so if the abort failed as well).
        Whatever ``before_commit`` raises, after the abort.
    """
    if client is None:
        client = make_client(settings.s3_concurrency)
    size = plan.size if byte_range is None else byte_range[1] - byte_range[0]
    part_size = part_size_for(size, settings.s3_part_size)
    ring = settings.replace(
        buffer_size=part_size, block_size=part_size, buffer_count=max(2, min(64, settings.s3_concurrency))
    )
    if size <= part_size:
        upload = _SinglePut(client, destination)
    else:
        upload = _MultipartUpload(client, destination, settings.s3_concurrency)
    try:
        upload.begin()
        ranged = {} if byte_range is None else {"byte_range": tuple(byte_range), "destination_offset": 0}
        crcs = write_plan(
            plan, upload, ring, streams=streams, make_handle=upload.handle, after_reads=after_reads, **ranged
        )
        if before_commit is not None:
            before_commit()
        upload.complete()
    except BaseException as error:  # noqa: BLE001 - re-raised by _abort_and_raise after the abort
        _abort_and_raise(upload, error)
    finally:
        upload.close()
    return crcs


# ----------------------------------------------------------------------------- uploads of local files


class _FileSource:
    """A local file opened for an upload: its descriptor, its size and identity at open, preads of its ranges."""

    def __init__(self, source: Any):
        if isinstance(source, (str, os.PathLike)):
            self.path = os.fspath(source)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            self._owned = True
        else:
            self.fd = source.fileno()
            self.path = str(getattr(source, "name", f"<file descriptor {self.fd}>"))
            self._owned = False
        try:
            status = os.fstat(self.fd)
            if stat.S_ISDIR(status.st_mode):
                raise IsADirectoryError(errno.EISDIR, "upload_file needs a regular file, got a directory", self.path)
            if not stat.S_ISREG(status.st_mode):
                raise ValueError(f"upload_file needs a regular file (its size is known), got {self.path!r}")
        except BaseException:
            self.close()
            raise
        self.size = status.st_size
        self._identity = (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fills ``view`` with the file's bytes from ``offset`` on (preads release the GIL; any thread may call)."""
        position = 0
        while position < len(view):
            try:
                count = os.preadv(self.fd, [view[position:]], offset + position)
            except OSError as error:
                raise CheckpointIOError(
                    error.errno, f"reading it for its upload failed: {error.strerror}", self.path
                ) from error
            if count == 0:
                raise CheckpointIOError(
                    errno.EIO,
                    f"the file ended at byte {offset + position}, before the {self.size} bytes it had when its "
                    "upload started: it was truncated or rewritten in place during the upload",
                    self.path,
                )
            position += count

    def check_unchanged(self) -> None:
        """Raises CheckpointIOError when the file was written to since it was opened (before the commit)."""
        status = os.fstat(self.fd)
        if (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns) != self._identity:
            raise CheckpointIOError(
                errno.EIO,
                "the file was modified while it was being uploaded, so the object would mix two versions; nothing "
                "was committed. Replace files atomically (fastpersist's saves do) or upload again",
                self.path,
            )

    def close(self) -> None:
        if self._owned and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


class _Buffers:
    """Page-aligned buffers of one size, made on first need and reused: never more than are in use at once."""

    def __init__(self, size: int):
        self.size = size
        self.made = 0
        self._free: list = []
        self._lock = threading.Lock()

    def acquire(self):
        with self._lock:
            if self._free:
                return self._free.pop()
            self.made += 1
        return engine.AlignedBuffer(self.size, lock=False)

    def release(self, buffer) -> None:
        with self._lock:
            self._free.append(buffer)


def upload_file(source: Any, destination: str | ObjectURL, settings: Settings, *, client=None) -> None:
    """Uploads a local file to ``destination``: a multipart upload committed by its completion, or one
    ``PutObject`` for a file of at most one part.

    Parts of ``s3_part_size`` bytes (raised where the file would need more
    than 10,000) are read with concurrent ``pread`` calls into page-aligned
    buffers and sent by ``s3_concurrency`` threads: host memory is at most
    ``s3_concurrency * s3_part_size``, whatever the file's size. The file's
    identity, size and modification time are compared before the commit: a
    file written to during the upload fails it (fastpersist's saves replace
    files by rename, which leaves an open file as it was). On any failure,
    interrupts included, what is in flight is drained, the parts are
    discarded (``AbortMultipartUpload``) and the previous object at the key is
    intact. Blocks until done; may run on any thread.

    Args:
        source: a path, or a binary file object opened for reading (read
            through its ``fileno()``, left open): the bytes of the file it had
            open are uploaded even if its name has been replaced since.
        destination: ``s3://bucket/key`` or an :class:`ObjectURL`.
        settings: ``s3_part_size`` and ``s3_concurrency`` are used.
        client: a boto3 S3 client (default: one from :func:`make_client`).

    Raises:
        ValueError: a malformed URL; ``source`` is not a regular file.
        FileNotFoundError, PermissionError, IsADirectoryError: opening ``source``.
        CheckpointIOError: reading the file failed, or it changed during the
            upload (the upload is aborted).
        ObjectStoreUnavailableError: boto3 is missing.
        ObjectStoreCredentialsError, BucketNotFoundError, ObjectStoreError:
            the store refused a request or the network failed; the upload is
            aborted (a note says so where the abort failed as well).
        KeyboardInterrupt: after the parts in flight finished and the upload was aborted.
    """
    url = target(destination) if isinstance(destination, str) else destination
    file = _FileSource(source)
    try:
        if client is None:
            client = make_client(settings.s3_concurrency)
        part_size = part_size_for(file.size, settings.s3_part_size)
        if file.size <= part_size:
            _put_file(file, url, client)
        else:
            _upload_file_parts(file, url, client, part_size, settings.s3_concurrency)
    finally:
        file.close()


def _put_file(file: _FileSource, url: ObjectURL, client) -> None:
    """A file of at most one part: read whole, then :func:`put_bytes` (the commit; a failure sends nothing)."""
    buffer = engine.AlignedBuffer(max(file.size, 1), lock=False)
    view = memoryview(buffer).cast("B")[: file.size]
    file.read_into(view, 0)
    file.check_unchanged()
    put_bytes(url, view, client=client)


def _upload_file_parts(file: _FileSource, url: ObjectURL, client, part_size: int, concurrency: int) -> None:
    parts = range(0, file.size, part_size)
    upload = _MultipartUpload(client, url, min(concurrency, len(parts)))
    buffers = _Buffers(part_size)
    try:
        upload.begin()
        futures = [upload.submit_file_part(file, start, min(part_size, file.size - start), buffers) for start in parts]
        for future in futures:  # interruptible; parts after a failure are skipped, not sent
            future.result()
        file.check_unchanged()
        upload.complete()
    except BaseException as error:  # noqa: BLE001 - re-raised by _abort_and_raise after the abort
        upload.fail(error)  # parts not started yet are skipped
        upload.close()  # drained: nothing in flight when the abort runs
        _abort_and_raise(upload, error)
    finally:
        upload.close()


# ----------------------------------------------------------------------------- loads


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
        translated = _translate(error, url, client, action)
        if isinstance(translated, ObjectNotFoundError):  # HEAD's 404 does not say whether the bucket exists
            try:
                client.head_bucket(Bucket=url.bucket)
            except Exception as bucket_error:  # noqa: BLE001 - only "no such bucket" changes the answer
                if _error_fields(bucket_error)[0] in ("404", "NoSuchBucket"):
                    translated = _translate(bucket_error, url, client, action, code="NoSuchBucket")
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
        self.client = client if client is not None else make_client(settings.s3_concurrency)
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
        client = make_client(settings.s3_concurrency)
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
        client: from :func:`make_client` (default: a new one).
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
        client = make_client(settings.s3_concurrency)
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
                raise _translate(error, url, client, action) from error


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
