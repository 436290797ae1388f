"""Targets: where a checkpoint's bytes go and come from, and :func:`resolve`, the one place that decides which.

Every entry point (``save``, ``load``, ``async_save``, the safetensors
functions, collective saves and loads, the DCP writer and reader, the
Lightning plugins, ``patch``) calls :func:`resolve` once on what it was given
and then uses the :class:`~fastpersist.io.targets.base.Target`'s methods:

========================  =========================================  ===============================
given                     target                                     store
========================  =========================================  ===============================
a path (str, PathLike)    :class:`~.local.LocalFile`                 the local filesystem (engine)
``s3://bucket/key``       :class:`~.s3.S3Object`                     S3 and compatibles (boto3)
``memory://``,            :class:`~.fsspec.FsspecFile`               any fsspec filesystem
``file://``, ``gs://``...
a file object             :class:`~.fileobject.FileObject`           the caller's stream
(benchmarks)              :class:`~.sink.Sink`                       ``/dev/null``, nothing committed
========================  =========================================  ===============================

This module alone tells URLs from paths; each store's file knows its own
URLs. A new store is one file with a :class:`~.base.Target` subclass and a
line here.
"""

from __future__ import annotations

import os
import re
from typing import Any

from fastpersist.io.targets.base import RangeReader, Target
from fastpersist.io.targets.fileobject import FileObject
from fastpersist.io.targets.local import LocalFile
from fastpersist.io.targets.s3 import S3Object
from fastpersist.io.targets.sink import Sink

__all__ = ["FileObject", "LocalFile", "RangeReader", "S3Object", "Sink", "Target", "is_url", "resolve"]

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_COLLAPSED = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")  # what pathlib makes of scheme://...
_BOTO3 = "s3"  # through boto3 (io.targets.s3); every other scheme through fsspec


def _scheme(f: Any) -> str | None:
    """The URL scheme ``f`` names (``"s3"``, ``"memory"``...), or None for a local path or a file object.

    Raises:
        ValueError: ``f`` is a path object made from a URL: ``pathlib.Path("s3://bucket/key")``
            collapses the two slashes to ``s3:/bucket/key``, which would name a folder ``s3:`` here.
    """
    if isinstance(f, str):
        match = _URL.match(f)
        return match.group(1).lower() if match else None
    if isinstance(f, os.PathLike):
        text = os.fspath(f)
        match = _COLLAPSED.match(text) if isinstance(text, str) else None
        if match and _known(match.group(1).lower()):
            scheme = match.group(1)
            raise ValueError(
                f"{f!r} looks like an {scheme}:// URL that pathlib collapsed to {text!r} (a path object merges the "
                f"two slashes, and would name a local folder {scheme + ':'!r}): pass the URL as a string, "
                f"{scheme + '://' + text[match.end() :]!r}"
            )
    return None


def _known(scheme: str) -> bool:
    if scheme == _BOTO3:
        return True
    from fastpersist.io.targets import fsspec

    return fsspec.known_scheme(scheme)


def is_url(f: Any) -> bool:
    """Whether ``f`` is a URL (``scheme://...``, a string) rather than a local path or a file object; no I/O.

    Raises:
        ValueError: a path object made from a URL (see :func:`resolve`).
    """
    return _scheme(f) is not None


def resolve(f: Any) -> Target:
    """The target ``f`` names: a local file, an object of a store, a file object (the table above).

    Parses only: no request is made and no file is opened (the local checks
    come with :meth:`~.base.Target.checked`). A :class:`~.base.Target` is
    returned as it is.

    Raises:
        ValueError: a path object made from a URL (``pathlib`` turns ``s3://b/k`` into ``s3:/b/k``: pass a
            string); a scheme no store knows.
        ObjectStoreUnavailableError: (an ``ImportError``) a scheme whose package is missing (fsspec, or the
            one fsspec names for it, gcsfs for ``gs://``...). boto3 is looked for at the first request.
    """
    if isinstance(f, Target):
        return f
    scheme = _scheme(f)
    if scheme == _BOTO3:
        return S3Object.parse(f)
    if scheme is not None:
        from fastpersist.io.targets.fsspec import FsspecFile

        return FsspecFile.parse(f)
    if isinstance(f, (str, os.PathLike)):
        return LocalFile(f)
    return FileObject(f)
