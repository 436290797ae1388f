"""The object of a torch zip archive from its records: byte order, unpickling, torch's wording of refusals.

Shared by every load of an archive, wherever its bytes come from (a file, an
object store's buffer): :func:`byteorder` reads the optional ``byteorder``
record, :func:`rebuild` unpickles ``data.pkl`` with a storage provider and
words a ``weights_only`` refusal as ``torch.load`` does.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

from fastpersist.errors import CorruptCheckpointError
from fastpersist.format.deserializer import StorageProvider, deserialize
from fastpersist.format.zipformat import ReadAt, ZipRecordInfo
from fastpersist.io.records import record_bytes

__all__ = ["byteorder", "rebuild"]


def byteorder(read_at: ReadAt, records: Mapping[str, ZipRecordInfo], prefix: str, path: str, verify: bool) -> bytes:
    """The archive's byte order (``b"little"`` without the record, as torch assumes)."""
    if prefix + "byteorder" not in records:
        return b"little"
    order = record_bytes(read_at, records[prefix + "byteorder"], path, verify)
    if order not in (b"little", b"big"):
        raise CorruptCheckpointError(f"{path}: unknown byte order record {order!r}", path=path)
    return order


def rebuild(
    pickle_bytes: bytes,
    records: Mapping[str, ZipRecordInfo],
    prefix: str,
    provider: StorageProvider,
    *,
    map_location: Any,
    pickle_module: Any,
    weights_only: bool,
    byteorder: bytes,
    path: str,
    pickle_load_args: dict[str, Any],
) -> Any:
    """:func:`~fastpersist.format.deserializer.deserialize`, releasing records as the state grows.

    Raises:
        pickle.UnpicklingError: with torch.load's "Weights only load failed"
            message when ``weights_only`` refused something.
    """
    try:
        # The records go as the state comes: the zip directory of 100,000 tensors is 27 MiB of objects.
        return deserialize(
            pickle_bytes,
            records,
            prefix,
            provider,
            map_location=map_location,
            pickle_module=pickle_module,
            weights_only=weights_only,
            byteorder=byteorder,
            path=path,
            release_records=True,
            **pickle_load_args,
        )
    except pickle.UnpicklingError as e:
        if not weights_only:
            raise
        from torch.serialization import UNSAFE_MESSAGE

        raise pickle.UnpicklingError(
            f"Weights only load failed. {UNSAFE_MESSAGE}\nWeightsUnpickler error: {e}"
        ) from None
