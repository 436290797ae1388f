"""Checkpoints in S3 and S3-compatible object stores (``s3://bucket/key``): the S3 target and its requests.

:class:`S3Object` (:mod:`.target`) is where a checkpoint's operations meet
the requests, which the other modules make, one concern each:
:mod:`.connection` (URLs, clients, errors), :mod:`.upload` (a plan as a
multipart upload), :mod:`.files` (a local file as one), :mod:`.ranges` (HEADs
and ranged GETs) and :mod:`.keys` (whole objects: one ``PutObject``, deletes,
listings, leftover uploads). The entry points reach all of this through the
target, never directly.

A save produces exactly the bytes a save to a local file produces, through the
same writer (:func:`fastpersist.io.writer.write_plan`), whose ring of
page-locked buffers becomes the upload's parts
(:func:`fastpersist.io.targets.s3.upload.commit_plan`):

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

A local file goes up through
:func:`~fastpersist.io.targets.s3.files.upload_file` (the background half of
a two-tier save, ``async_save(..., local_copy=path)``): the same multipart
upload, committed and aborted as above, whose parts are read from the file
with concurrent ``pread`` calls into at most ``s3_concurrency`` page-aligned
buffers of ``s3_part_size`` bytes (one ``PutObject`` for a file of at most one
part, :func:`~fastpersist.io.targets.s3.keys.put_bytes`). A file written to
during its upload fails it before the commit.

A load asks for the object's size and ETag
(:func:`~fastpersist.io.targets.s3.ranges.head`: ``HeadObject``), then
fetches it with ``s3_concurrency`` concurrent ranged GETs of ``s3_part_size``
bytes, each conditional on that ETag (an object replaced mid-load fails the
load instead of mixing two versions), into one page-aligned buffer of the
object's size (:func:`~fastpersist.io.targets.s3.ranges.download`). The
caller parses the zip from that buffer; CPU storages are views of it.

Every ranged read goes through
:func:`~fastpersist.io.targets.s3.ranges.read_ranges`: whole objects (a
download, the part objects of a collective save), parts of objects (a DCP
load's items, a safetensors object's header and tensors), straight into their
destinations (tensors or buffers), conditional on the ETag each object had
when first asked for (or that the caller's own HEAD found); reads of one
object that touch or nearly do share a GET.
:class:`~fastpersist.io.targets.s3.ranges.ObjectReader` is one object kept
open for reads of chosen ranges: one HEAD, then ``read_ranges`` calls pinned
to that ETag (``safe_open`` of a URL fetches the header, then only the
tensors asked for).

The same requests serve the multi-object checkpoints built on them: a
collective save (:mod:`fastpersist.distributed.objectstore`) uploads each
writer's byte range of the file with ``upload.commit_plan``
(``byte_range=``) and commits a manifest with ``keys.put_bytes``, and cleans
up with ``keys.list_keys``, ``keys.remove_keys`` and ``keys.abort_uploads``;
a DCP checkpoint under a prefix uploads several ``.distcp`` files with
``upload.commit_plan`` and its ``.metadata`` with ``keys.put_bytes``.

Endpoint, region and credentials come from boto3's standard chain
(:mod:`.connection`); boto3 is imported on first use only
(``pip install fastpersist[s3]``).
"""

from fastpersist.io.targets.s3.target import S3Object

__all__ = ["S3Object"]
