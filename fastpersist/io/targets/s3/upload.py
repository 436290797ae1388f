"""S3 saves: a plan executed by the writer straight into a multipart upload, its ring's windows as the parts.

:func:`commit_plan` is the counterpart of
:func:`fastpersist.io.commit.commit_plan` for the S3 target (the design:
:mod:`fastpersist.io.targets.s3`): ``CreateMultipartUpload``, then
:func:`~fastpersist.io.writer.write_plan` with a ring of ``s3_part_size``
buffers whose handles (:class:`_PartHandle`) upload each window as a part
from the page-locked buffer, then ``CompleteMultipartUpload`` (the commit), or
``AbortMultipartUpload`` on any failure. An object of at most one part is one
``PutObject`` instead (:class:`_SinglePut`). :class:`MultipartUpload` also
carries the uploads of local files (:mod:`fastpersist.io.targets.s3.files`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import threading
from typing import NoReturn

from fastpersist.config import Settings
from fastpersist.errors import PartSkippedError
from fastpersist.io.targets.s3 import connection
from fastpersist.io.targets.s3.connection import ObjectURL, error_fields, part_size_for, translate, with_translation
from fastpersist.io.targets.s3.keys import MemoryBody, put_bytes
from fastpersist.io.writer import write_plan

__all__ = ["MultipartUpload", "abort_and_raise", "commit_plan"]


class MultipartUpload:
    """One multipart upload: the ``file`` of :func:`write_plan`, whose handles upload windows as parts, or the
    parts of a local file (:func:`fastpersist.io.targets.s3.files.upload_file`).

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
        response = with_translation(
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

    def submit_file_part(self, source, offset: int, nbytes: int, buffers):
        """Queues the upload of ``nbytes`` of ``source`` at ``offset``, read into one of ``buffers`` first.

        ``source`` and ``buffers`` are :mod:`.files`' open file and buffer pool (its ``read_into``; ``acquire``
        and ``release``).
        """
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

    def _upload_from_file(self, number: int, source, offset: int, nbytes: int, buffers):
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
                Body=MemoryBody(view),
                ContentLength=len(view),
            )
        except Exception as error:
            translated = translate(error, self.url, self.client, f"uploading part {number} of {self.url}")
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
        with_translation(
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
            if error_fields(error)[0] == "NoSuchUpload":
                return  # already gone (a complete that went through before an interrupt, or a lifecycle rule)
            cause.add_note(
                f"AbortMultipartUpload failed as well ({type(error).__name__}: {error}): the parts uploaded so far "
                f"stay stored (and billed) until a lifecycle rule removes them, or: aws s3api "
                f"abort-multipart-upload --bucket {self.url.bucket} --key {self.url.key} --upload-id {self.upload_id}"
            )

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _PartHandle:
    """The handle of one ring slot (see :func:`~fastpersist.io.writer.write_plan`'s ``make_handle``): its window
    goes up as one part."""

    def __init__(self):
        self._pending: list[concurrent.futures.Future] = []

    def submit_write(self, address: int, nbytes: int, upload: MultipartUpload, offset: int, keepalive) -> None:
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


def abort_and_raise(upload, error: BaseException) -> NoReturn:
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
        client = connection.make_client(settings.s3_concurrency)
    size = plan.size if byte_range is None else byte_range[1] - byte_range[0]
    part_size = part_size_for(size, settings.s3_part_size)
    ring = settings.replace(
        buffer_size=part_size, block_size=part_size, buffer_count=max(2, min(64, settings.s3_concurrency))
    )
    if size <= part_size:
        upload = _SinglePut(client, destination)
    else:
        upload = MultipartUpload(client, destination, settings.s3_concurrency)
    try:
        upload.begin()
        ranged = {} if byte_range is None else {"byte_range": tuple(byte_range), "destination_offset": 0}
        crcs = write_plan(
            plan, upload, ring, streams=streams, make_handle=upload.handle, after_reads=after_reads, **ranged
        )
        if before_commit is not None:
            before_commit()
        upload.complete()
    except BaseException as error:  # noqa: BLE001 - re-raised by abort_and_raise after the abort
        abort_and_raise(upload, error)
    finally:
        upload.close()
    return crcs
