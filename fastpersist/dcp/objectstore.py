"""DCP checkpoints under an ``s3://bucket/prefix``: the prefix and the check before the commit, by their names.

The writer and the reader reach a prefix through its target
(:class:`fastpersist.io.targets.S3Object`, :mod:`fastpersist.io.targets`), as
they reach any store's; these are the names this module had before the
targets, kept for code that calls them.

A checkpoint under a prefix holds, as objects, exactly the files a local
checkpoint directory holds, under the same names: ``{prefix}/.metadata`` and
``{prefix}/__{rank}_{n}.distcp`` (byte for byte what the local writer
writes), so copying the prefix to a directory (``aws s3 cp --recursive``)
gives a checkpoint that DCP's ``FileSystemReader`` loads, and a
``FileSystemWriter`` directory uploaded under a prefix loads from S3.

The order of a save (``FastPersistWriter``), which makes ``.metadata`` the
commit record as in a directory:

1. the coordinator deletes a stale ``.metadata`` before any rank uploads
   (DCP plans globally before anyone writes);
2. each rank uploads its files (a multipart upload fed by the writer's ring,
   aborted on failure);
3. the coordinator checks that every rank's object is there with its size
   (:func:`check_committed`), then stores ``.metadata`` in one PutObject: the
   commit.

A save that fails anywhere leaves no ``.metadata`` (and no upload in
progress): readers see no checkpoint, not a mix of old and new objects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fastpersist.config import Settings
from fastpersist.io import targets

__all__ = ["prefix_of", "check_committed"]


def prefix_of(location: str | os.PathLike) -> targets.S3Object | None:
    """The prefix ``location`` names (an :class:`~fastpersist.io.targets.S3Object`), or None where it is not
    an S3 URL.

    Raises:
        ValueError: an S3 URL without a bucket, or a ``pathlib`` path made from one
            (``Path("s3://b/p")`` is ``s3:/b/p``: pass a string).
    """
    target = targets.resolve(location)
    return target.as_directory() if isinstance(target, targets.S3Object) else None


def check_committed(prefix: targets.S3Object, sizes: Mapping[str, int], settings: Settings, *, client) -> None:
    """Checks, with concurrent HEADs through ``client``, that each file of ``sizes`` (name -> bytes) is an object
    of that size under ``prefix``: :meth:`fastpersist.io.targets.S3Object.check_sizes`.

    Raises:
        ObjectNotFoundError: (``FileNotFoundError``) a rank's object is missing.
        ObjectStoreError: an object has another size, or the store refused, or the network failed.
    """
    prefix.connected(settings, client=client).check_sizes(dict(sizes), settings)
