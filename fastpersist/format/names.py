"""The names a checkpoint gives its own files: plain file names beside it, checked before anything is opened.

A sharded checkpoint's manifest names its parts and a DCP checkpoint's
``.metadata`` names its data files. The reader joins each name to the
checkpoint's directory (or, on S3, to the manifest key's folder), so a name
that is a path would lead anywhere: ``../x`` and ``/etc/passwd`` out of the
directory, ``sub/dir`` into another one. Every reader checks names here
first, whatever the storage: the manifest parser for parts (load, collective
load, verify, merge, S3 load and removal), ``fastpersist.verify`` for a DCP
checkpoint's files.
"""

from __future__ import annotations

from fastpersist.errors import UnsafeFileNameError

__all__ = ["check_file_name"]

_FORBIDDEN = ("/", "\0")
"""``/`` separates directories in paths and S3 keys alike; a NUL ends a C string early (``open`` refuses it with
ValueError, a store may cut the key there)."""


def check_file_name(name: object, *, checkpoint: str | None, what: str) -> str:
    """Returns ``name`` when it is a plain file name, one that stays in the checkpoint's directory.

    Args:
        name: the name as the checkpoint stores it.
        checkpoint: the checkpoint (manifest path, URL or DCP directory), for the message.
        what: what the name is for, for the message (``"part 3"``, ``"the file of item 'w'"``).

    Raises:
        UnsafeFileNameError: ``name`` is not a string, is empty, ``.`` or
            ``..``, or holds ``/`` or a NUL byte (``record`` is ``name``).
    """
    if isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in _FORBIDDEN):
        return name
    raise UnsafeFileNameError(
        f"{checkpoint}: {what} is named {name!r}, which is not a plain file name beside the checkpoint; a "
        "checkpoint names only files in its own directory (objects under its own prefix), so this one is "
        "damaged or crafted: nothing was read from that name. Restore the checkpoint from a good copy",
        path=checkpoint,
        record=name if isinstance(name, str) else repr(name),
    )
