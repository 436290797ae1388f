"""The object of a torch zip archive from its records: byte order, unpickling, torch's wording of refusals.

Shared by every load of an archive, wherever its bytes come from (a file, an
object store's buffer): :func:`metadata` reads the small records (checking
the ones nothing else reads when verifying), ``data.pkl`` and the byte order
(:func:`byteorder`); :func:`rebuild` unpickles ``data.pkl`` with a storage
provider and words a ``weights_only`` refusal as ``torch.load`` does.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

from fastpersist.config import Settings
from fastpersist.errors import CorruptCheckpointError
from fastpersist.format.deserializer import StorageProvider, deserialize
from fastpersist.format.zipformat import ReadAt, ZipRecordInfo
from fastpersist.io.records import has_checksums, record_bytes

__all__ = ["LoadRequest", "byteorder", "metadata", "rebuild"]


def metadata(
    read_at: ReadAt, records: Mapping[str, ZipRecordInfo], prefix: str, path: str, verify: bool, warn: bool
) -> tuple[bytes, bytes, bool]:
    """``(data.pkl, byte order, verify)`` of an archive; ``verify`` turns off for a file without CRC-32s.

    With ``verify``, the small records nothing else reads (version,
    serialization id, ...) are checked too; ``warn``: say so when a file
    cannot be verified (the caller's caller is named).
    """
    if verify and not has_checksums(records.values()):
        if warn:
            warnings.warn(f"{path} was written without CRC-32 checksums; it cannot be verified", stacklevel=4)
        verify = False
    if verify:
        for name in records:
            if not name.startswith(prefix + "data/") and name != prefix + "data.pkl":
                record_bytes(read_at, records[name], path, verify)
    pickle_bytes = record_bytes(read_at, records[prefix + "data.pkl"], path, verify)
    return pickle_bytes, byteorder(read_at, records, prefix, path, verify), verify


def byteorder(read_at: ReadAt, records: Mapping[str, ZipRecordInfo], prefix: str, path: str, verify: bool) -> bytes:
    """The archive's byte order (``b"little"`` without the record, as torch assumes)."""
    if prefix + "byteorder" not in records:
        return b"little"
    order = record_bytes(read_at, records[prefix + "byteorder"], path, verify)
    if order not in (b"little", b"big"):
        raise CorruptCheckpointError(f"{path}: unknown byte order record {order!r}", path=path)
    return order


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What one ``fastpersist.load`` call asks for, resolved once by ``load`` and read by every step after it."""

    map_location: Any
    pickle_module: Any
    weights_only: bool
    mmap: bool
    verify: bool
    settings: Settings
    torch_kwargs: dict[str, Any]
    """The arguments torch.load takes for what fastpersist hands to it (legacy files, TorchScript, file objects)."""
    pickle_load_args: dict[str, Any]
    warn_unverifiable: bool = True
    """Warn when ``verify`` was asked for explicitly and a record carries no CRC-32."""


def rebuild(
    pickle_bytes: bytes,
    records: Mapping[str, ZipRecordInfo],
    prefix: str,
    provider: StorageProvider,
    request: LoadRequest,
    *,
    byteorder: bytes,
    path: str,
) -> Any:
    """:func:`~fastpersist.format.deserializer.deserialize` as ``request`` asks, releasing records as the state grows.

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
            map_location=request.map_location,
            pickle_module=request.pickle_module,
            weights_only=request.weights_only,
            byteorder=byteorder,
            path=path,
            release_records=True,
            **request.pickle_load_args,
        )
    except pickle.UnpicklingError as e:
        if not request.weights_only:
            raise
        from torch.serialization import UNSAFE_MESSAGE

        raise pickle.UnpicklingError(
            f"Weights only load failed. {UNSAFE_MESSAGE}\nWeightsUnpickler error: {e}"
        ) from None
