"""Where each tensor of a checkpoint lies on disk, read without loading a byte of tensor data.

A checkpoint for offloaded inference is one of:

* a safetensors file (its header gives every tensor's byte range);
* a directory (or its ``*.safetensors.index.json``) of sharded safetensors,
  the Hugging Face layout: the index's ``weight_map`` names each tensor's file,
  a plain file name in the index's directory (checked for every entry before
  any shard is opened);
* a torch zip file (``torch.save`` or ``fastpersist.save``) of a state dict:
  ``data.pkl`` is unpickled with a restricted unpickler that builds
  references, not tensors (only tensor, parameter and storage classes and
  ``OrderedDict`` are allowed; anything else is refused), and each
  reference's bytes are its storage record's payload at the tensor's offset.

The result maps each key to a :class:`TensorSource`: file, absolute offset,
length, dtype and shape. Tensors must be contiguous in the file (a state dict
saved from a model always is); a strided view raises, naming the key.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import io
import json
import os
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from fastpersist.errors import CorruptCheckpointError, UnsafeCheckpointPathError, UnsupportedObjectError
from fastpersist.format import safetensors, zipformat
from fastpersist.format.deserializer import archive_prefix

__all__ = ["TensorSource", "read_index"]

_ZIP_MAGIC = b"PK\x03\x04"


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """One tensor's bytes in a checkpoint file."""

    key: str
    path: str
    offset: int
    """Absolute file offset of the first byte."""
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_index(checkpoint: str | os.PathLike[str]) -> dict[str, TensorSource]:
    """Every tensor of ``checkpoint`` by key (see the module docstring for the formats).

    Raises:
        FileNotFoundError: no such file or directory, or a directory with no
            safetensors index or file.
        CorruptCheckpointError: a malformed header, index or archive.
        UnsafeCheckpointPathError: an index naming a shard that is not a plain
            file name in its directory (an absolute path, ``..``, a
            subdirectory); raised before any shard is opened.
        UnsupportedObjectError: a torch file that is not a state dict of
            plain contiguous tensors.
    """
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        indexes = sorted(glob.glob(os.path.join(path, "*.safetensors.index.json")))
        if len(indexes) > 1:
            raise CorruptCheckpointError(
                f"{path} holds several safetensors indexes ({', '.join(map(os.path.basename, indexes))}): "
                "pass the one to use",
                path=path,
            )
        if indexes:
            return _sharded(indexes[0])
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if len(files) == 1:
            return _safetensors_file(files[0])
        raise FileNotFoundError(
            f"{path} has no *.safetensors.index.json and {len(files)} *.safetensors files: "
            "pass a checkpoint file, or a directory with one safetensors file or a sharded index"
        )
    if path.endswith(".json"):
        return _sharded(path)
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(_ZIP_MAGIC):
        return _torch_file(path)
    if safetensors.looks_like_safetensors(head):
        return _safetensors_file(path)
    raise CorruptCheckpointError(
        f"{path} is neither a safetensors file nor a torch zip checkpoint (legacy torch files are not supported: "
        "re-save with fastpersist.save or torch.save)",
        path=path,
    )


def _safetensors_file(path: str) -> dict[str, TensorSource]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = safetensors.header_length(prefix, size, path)
        header = safetensors.parse_header(prefix + f.read(length), size, path)
    return {
        name: TensorSource(
            name, path, entry.start, entry.size, safetensors.torch_dtype(entry.dtype), tuple(entry.torch_shape)
        )
        for name, entry in header.tensors.items()
    }


def _sharded(index_path: str) -> dict[str, TensorSource]:
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(
            f"{index_path} is not a safetensors index (no weight_map): {e}", path=index_path
        ) from e
    if not isinstance(weight_map, Mapping):
        raise CorruptCheckpointError(
            f"{index_path} is not a safetensors index (its weight_map is not an object)", path=index_path
        )
    for key, name in weight_map.items():  # every name, before any shard is opened
        _check_shard_name(index_path, key, name)
    directory = os.path.dirname(os.path.abspath(index_path))
    by_file: dict[str, dict[str, TensorSource]] = {}
    result = {}
    for key, name in weight_map.items():
        file = os.path.join(directory, name)
        if file not in by_file:
            by_file[file] = _safetensors_file(file)
        source = by_file[file].get(key)
        if source is None:
            raise CorruptCheckpointError(f"{index_path} maps {key!r} to {name}, which does not hold it", path=file)
        result[key] = source
    return result


def _check_shard_name(index_path: str, key: str, name: Any) -> None:
    """Refuses a shard that is not a plain file name: the index must not lead the reader out of its directory.

    Symbolic links among the shards are followed: the Hugging Face cache
    links each snapshot's shards to blobs in a sibling directory, and links
    are placed by whoever owns the directory, not by the index.
    """
    if not isinstance(name, str):
        raise CorruptCheckpointError(
            f"{index_path} maps {key!r} to {name!r}, which is not a file name", path=index_path, record=str(key)
        )
    separators = {"/", os.sep, os.altsep} - {None}
    if name in ("", ".", "..") or "\0" in name or any(s in name for s in separators):
        raise UnsafeCheckpointPathError(
            f"{index_path} maps {key!r} to {name!r}: shards must be plain file names in the index's directory "
            "(no absolute paths, no '..', no directories); the index was not followed",
            path=index_path,
            record=str(key),
        )


# ----------------------------------------------------------------------------- torch zip files


@dataclasses.dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return _TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


class _ReferenceUnpickler(pickle.Unpickler):
    """Unpickles a state dict into :class:`_TensorRef` objects; refuses every other class."""

    _ALLOWED = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch", "Size"): tuple,
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = self._ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and name.endswith("Storage"):
            return getattr(torch, name)
        raise UnsupportedObjectError(
            f"offloaded inference reads state dicts of plain tensors; this checkpoint pickles {module}.{name} "
            "(save model.state_dict() instead)"
        )

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptCheckpointError(f"unexpected persistent id {pid!r} in data.pkl")
        storage_type = pid[1]
        with warnings.catch_warnings():  # the legacy typed storage classes warn on every use
            warnings.simplefilter("ignore", UserWarning)
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        return _StorageRef(str(pid[2]), dtype)


def _state_dict_of(obj: Any, path: str) -> Mapping[str, _TensorRef]:
    """The mapping of tensors in a loaded object: the object itself, or its ``state_dict``/``model`` entry."""
    candidates = [obj]
    if isinstance(obj, Mapping):
        candidates += [obj[k] for k in ("state_dict", "model", "module") if k in obj]
    for candidate in candidates:
        if isinstance(candidate, Mapping) and candidate and all(isinstance(v, _TensorRef) for v in candidate.values()):
            return candidate
    raise UnsupportedObjectError(
        f"{path} does not hold a state dict (a mapping of names to tensors, or one under 'state_dict'): "
        "save model.state_dict()"
    )


def _torch_file(path: str) -> dict[str, TensorSource]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:

        def read_at(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        records = {r.name: r for r in zipformat.read_directory(read_at, size, path)}
        prefix = archive_prefix(list(records), path)
        pickled = records[prefix + "data.pkl"]
        data = read_at(pickled.data_offset, pickled.size)
    state = _state_dict_of(_ReferenceUnpickler(io.BytesIO(data)).load(), path)
    result = {}
    for key, ref in state.items():
        record = records.get(f"{prefix}data/{ref.storage.key}")
        if record is None:
            raise CorruptCheckpointError(
                f"{path}: {key!r} names storage {ref.storage.key}, which is missing", path=path
            )
        itemsize = torch.empty(0, dtype=ref.storage.dtype).element_size()
        numel = 1
        for n in ref.shape:
            numel *= n
        if numel > 1 and not _is_contiguous(ref.shape, ref.stride):
            raise UnsupportedObjectError(
                f"{path}: {key!r} is a strided view (stride {ref.stride} for shape {ref.shape}); "
                "save a state dict of contiguous tensors (tensor.contiguous())"
            )
        start = ref.offset * itemsize
        if start + numel * itemsize > record.size:
            raise CorruptCheckpointError(f"{path}: {key!r} reaches past its storage record", path=path)
        result[str(key)] = TensorSource(
            str(key), path, record.data_offset + start, numel * itemsize, ref.storage.dtype, ref.shape
        )
    return result


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major contiguity, as torch decides it: dimensions of size 1 may carry any stride."""
    step = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1:
            if s != step:
                return False
            step *= n
    return True
