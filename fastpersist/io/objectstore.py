"""The S3 requests under their former name: the names this module had, now in :mod:`fastpersist.io.targets.s3`.

The requests live with the S3 target, one concern a module (the design is
:mod:`fastpersist.io.targets.s3`'s docstring): URLs, clients and errors in
:mod:`fastpersist.io.targets.s3.connection`, saves as multipart uploads in
:mod:`~fastpersist.io.targets.s3.upload`, uploads of local files in
:mod:`~fastpersist.io.targets.s3.files`, HEADs and ranged GETs in
:mod:`~fastpersist.io.targets.s3.ranges`, whole objects by key in
:mod:`~fastpersist.io.targets.s3.keys`. This module re-exports them for code
that calls them by this name (``fastpersist.io.objectstore.upload_file``, the
upload of a two-tier save, is documented for use on its own). fastpersist
itself imports them from where they are defined.

Replacing a name here (a test's ``monkeypatch``) changes nothing the product
calls: replace it in its defining module (``make_client`` in
:mod:`~fastpersist.io.targets.s3.connection`, which every request calls
through).
"""

from __future__ import annotations

from fastpersist.io.targets.s3.connection import MAX_PARTS, SCHEME, ObjectURL, make_client, part_size_for, target
from fastpersist.io.targets.s3.files import upload_file
from fastpersist.io.targets.s3.keys import abort_uploads, list_keys, put_bytes, remove, remove_keys
from fastpersist.io.targets.s3.ranges import ObjectReader, download, head, read_ranges
from fastpersist.io.targets.s3.upload import commit_plan

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
