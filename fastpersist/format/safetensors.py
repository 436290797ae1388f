"""The safetensors file layout: header building and validation, and the save plan.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON + the
tensors' bytes, packed back to back in the order of their ``data_offsets``
(relative to the end of the header). The JSON is
``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}, ...}``
and may end with spaces.

fastpersist pads the header with spaces so that the data section starts at
a multiple of ``alignment`` (4096 by default): the whole payload then is
written and read with O_DIRECT from its first byte. The tensors themselves
stay packed (the format forbids gaps between them). With ``alignment=8`` the
bytes are identical to the safetensors library's.

Pure format: no I/O here. Readers pass the first bytes of a file to
:func:`parse_header`; writers execute the :class:`SafetensorsPlan` that
:func:`plan_save_file` builds (it looks like :class:`~fastpersist.format.plan.SavePlan`
to :func:`fastpersist.io.writer.write_plan`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from fastpersist.errors import InvalidSafetensorsError
from fastpersist.format.plan import Segment, SegmentKind

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DTYPES",
    "MAX_HEADER_SIZE",
    "Header",
    "SafetensorsPlan",
    "TensorEntry",
    "build_header",
    "dtype_name",
    "header_length",
    "looks_like_safetensors",
    "parse_header",
    "plan_save_file",
    "sort_key",
    "torch_dtype",
]

MAX_HEADER_SIZE = 100_000_000  # the safetensors library refuses larger headers
DEFAULT_ALIGNMENT = 4096
_PREFIX = 8


@dataclasses.dataclass(frozen=True)
class _Dtype:
    name: str
    bits: int
    torch: torch.dtype | None  # None: valid in the format, unknown to this torch build


def _torch(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


# In the order of the safetensors library's Dtype enum: files sort tensors by
# descending dtype in this order, then by name.
_TABLE: tuple[_Dtype, ...] = (
    _Dtype("BOOL", 8, torch.bool),
    _Dtype("F4", 4, _torch("float4_e2m1fn_x2")),
    _Dtype("F6_E2M3", 6, None),
    _Dtype("F6_E3M2", 6, None),
    _Dtype("U8", 8, torch.uint8),
    _Dtype("I8", 8, torch.int8),
    _Dtype("F8_E5M2", 8, _torch("float8_e5m2")),
    _Dtype("F8_E4M3", 8, _torch("float8_e4m3fn")),
    _Dtype("F8_E8M0", 8, _torch("float8_e8m0fnu")),
    _Dtype("F8_E4M3FNUZ", 8, _torch("float8_e4m3fnuz")),
    _Dtype("F8_E5M2FNUZ", 8, _torch("float8_e5m2fnuz")),
    _Dtype("I16", 16, torch.int16),
    _Dtype("U16", 16, _torch("uint16")),
    _Dtype("F16", 16, torch.float16),
    _Dtype("BF16", 16, torch.bfloat16),
    _Dtype("I32", 32, torch.int32),
    _Dtype("U32", 32, _torch("uint32")),
    _Dtype("F32", 32, torch.float32),
    _Dtype("C64", 64, torch.complex64),
    _Dtype("F64", 64, torch.float64),
    _Dtype("I64", 64, torch.int64),
    _Dtype("U64", 64, _torch("uint64")),
)
DTYPES: dict[str, _Dtype] = {d.name: d for d in _TABLE}
"""Every dtype name the safetensors format defines -> its bit size and torch dtype (or None)."""
_RANK = {d.name: i for i, d in enumerate(_TABLE)}
_BY_TORCH = {d.torch: d for d in _TABLE if d.torch is not None}
_PACKED = {d.name for d in _TABLE if d.bits < 8 and d.torch is not None}  # torch packs 2 per byte


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype.

    Raises:
        UnsupportedObjectError: the format has no such dtype (complex128, complex32, quantized, ...).
    """
    entry = _BY_TORCH.get(dtype)
    if entry is None:
        from fastpersist.errors import UnsupportedObjectError

        raise UnsupportedObjectError(
            f"the safetensors format has no dtype for {dtype}; supported: "
            f"{', '.join(str(d) for d in _BY_TORCH)}. Convert the tensor (e.g. .to(torch.float32)) or save with "
            "fastpersist.save(..., format='torch')"
        )
    return entry.name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; raises InvalidSafetensorsError when torch has none."""
    entry = DTYPES.get(name)
    if entry is None or entry.torch is None:
        raise InvalidSafetensorsError(f"dtype {name} is not supported by this torch build ({torch.__version__})")
    return entry.torch


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header: offsets are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # as stored in the file (logical elements)
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape of the torch tensor: packed 4-bit dtypes hold two elements per torch element."""
        if self.dtype in _PACKED and self.shape:
            return (*self.shape[:-1], self.shape[-1] // 2)
        return self.shape


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed, validated header.

    Attributes:
        tensors: name -> entry, in file (offset) order.
        metadata: the ``__metadata__`` map, or None when the file has none.
        data_offset: where the data section starts (8 + header length).
        file_size: the file's size (data_offset + the data section).
    """

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] | None
    data_offset: int
    file_size: int


def _json_bytes(tensors: Sequence[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    # The safetensors library writes compact JSON with raw UTF-8 (serde_json).
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _check_metadata(metadata: Mapping[str, str] | None) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"metadata must be a dict of str to str; {key!r}: {type(value).__name__} is not "
                "(convert values with str() or json.dumps())"
            )


def build_header(
    tensors: Sequence[tuple[str, str, Sequence[int], int]],
    metadata: Mapping[str, str] | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces so the data starts at a multiple of ``alignment``.

    Args:
        tensors: ``(name, dtype name, shape, nbytes)`` in the order their bytes follow.
        metadata: free-form ``str -> str`` map (``__metadata__``), or None.
        alignment: a multiple of 8; 8 gives the safetensors library's exact bytes.

    Raises:
        ValueError: bad alignment; TypeError: metadata not ``str -> str``;
        InvalidSafetensorsError: the header would exceed the format's 100 MB limit.
    """
    if alignment <= 0 or alignment % 8:
        raise ValueError(f"alignment must be a positive multiple of 8, got {alignment}")
    _check_metadata(metadata)
    text = _json_bytes(tensors, metadata)
    total = -(-(_PREFIX + len(text)) // alignment) * alignment
    length = total - _PREFIX
    if length > MAX_HEADER_SIZE:
        raise InvalidSafetensorsError(
            f"header too large ({length} bytes; the safetensors format allows {MAX_HEADER_SIZE})"
        )
    return struct.pack("<Q", length) + text + b" " * (length - len(text))


def header_length(prefix: bytes, file_size: int, path: str | None = None) -> int:
    """The JSON header's length from a file's first 8 bytes; validates it against the file size."""
    if len(prefix) < _PREFIX or file_size < _PREFIX:
        raise InvalidSafetensorsError(_where(path, "header too small: the file is shorter than 8 bytes"), path=path)
    (length,) = struct.unpack("<Q", prefix[:_PREFIX])
    if length > MAX_HEADER_SIZE:
        raise InvalidSafetensorsError(
            _where(path, f"header too large ({length} bytes; at most {MAX_HEADER_SIZE}): not a safetensors file?"),
            path=path,
        )
    if _PREFIX + length > file_size:
        raise InvalidSafetensorsError(
            _where(
                path,
                f"invalid header length: {length} bytes of header announced, the file has {file_size} (truncated?)",
            ),
            path=path,
        )
    return length


def _where(path: str | None, message: str) -> str:
    return f"{path}: {message}" if path else message


def _no_duplicates(pairs):
    result = {}
    for key, value in pairs:
        if key in result:
            raise InvalidSafetensorsError(f"invalid JSON in header: duplicate key {key!r}")
        result[key] = value
    return result


def parse_header(data: bytes, file_size: int, path: str | None = None) -> Header:
    """Parses and validates the header in ``data`` (the file's first ``8 + N`` bytes or more).

    Checks what the safetensors library checks: header size, UTF-8, JSON,
    dtypes, shapes against byte sizes, offsets that start at 0 and follow each
    other without gap or overlap, and that the tensors cover the file exactly.

    Raises:
        InvalidSafetensorsError: with the library's wording and the offending tensor.
    """
    length = header_length(data, file_size, path)
    raw = data[_PREFIX : _PREFIX + length]
    if len(raw) != length:
        raise ValueError("parse_header needs the whole header: pass the first 8 + N bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidSafetensorsError(_where(path, f"invalid UTF-8 in header: {e}"), path=path) from None
    try:
        document = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise InvalidSafetensorsError(_where(path, f"invalid JSON in header: {e}"), path=path) from None
    except InvalidSafetensorsError as e:
        raise InvalidSafetensorsError(_where(path, str(e)), path=path) from None
    if not isinstance(document, dict):
        raise InvalidSafetensorsError(_where(path, "invalid JSON in header: expected an object"), path=path)
    metadata = document.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise InvalidSafetensorsError(
            _where(path, "invalid JSON in header: __metadata__ must map str to str"), path=path
        )
    entries = [_entry(name, info, path) for name, info in document.items()]
    entries.sort(key=lambda e: (e[3], e[4]))
    data_offset = _PREFIX + length
    position = 0
    tensors: dict[str, TensorEntry] = {}
    for name, dtype, shape, start, end in entries:
        if start != position or end < start:
            what = "overlaps the previous tensor" if start < position else "leaves a gap before it"
            if end < start:
                what = "ends before it starts"
            raise InvalidSafetensorsError(
                _where(
                    path,
                    f"invalid offset for tensor `{name}`: data_offsets [{start}, {end}] {what} "
                    f"(expected a start of {position})",
                ),
                path=path,
                record=name,
            )
        bits = math.prod(shape) * DTYPES[dtype].bits
        if bits % 8:
            raise InvalidSafetensorsError(
                _where(path, f"tensor `{name}`: {dtype} shape {list(shape)} does not end at a byte boundary"),
                path=path,
                record=name,
            )
        if end - start != bits // 8:
            raise InvalidSafetensorsError(
                _where(
                    path,
                    f"invalid shape, data type, or offset for tensor `{name}`: {dtype} {list(shape)} needs "
                    f"{bits // 8} bytes, data_offsets give {end - start}",
                ),
                path=path,
                record=name,
            )
        position = end
        tensors[name] = TensorEntry(name, dtype, shape, data_offset + start, data_offset + end)
    if data_offset + position != file_size:
        problem = (
            "is shorter than its header says (truncated?)"
            if data_offset + position > file_size
            else ("has bytes no tensor covers")
        )
        raise InvalidSafetensorsError(
            _where(
                path,
                f"incomplete metadata, file not fully covered: the file ({file_size} bytes) {problem}; "
                f"the header describes {data_offset + position}",
            ),
            path=path,
        )
    return Header(tensors, metadata, data_offset, file_size)


def _entry(name: str, info: object, path: str | None) -> tuple[str, str, tuple[int, ...], int, int]:
    def fail(message: str) -> InvalidSafetensorsError:
        return InvalidSafetensorsError(
            _where(path, f"invalid JSON in header: tensor `{name}`: {message}"), path=path, record=name
        )

    if not isinstance(info, dict):
        raise fail("expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise fail("missing or non-string dtype")
    if dtype not in DTYPES:
        raise InvalidSafetensorsError(
            _where(path, f"unsupported dtype {dtype!r} for tensor `{name}` (the format defines {', '.join(DTYPES)})"),
            path=path,
            record=name,
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise fail("shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise fail("data_offsets must be two non-negative integers")
    return name, dtype, tuple(shape), offsets[0], offsets[1]


def looks_like_safetensors(head: bytes) -> bool:
    """Whether a file's first bytes (at least 9) look like safetensors: a plausible length, then ``{``."""
    if len(head) < _PREFIX + 1:
        return False
    (length,) = struct.unpack("<Q", head[:_PREFIX])
    return 2 <= length <= MAX_HEADER_SIZE and head[_PREFIX : _PREFIX + 1] == b"{"


# ----------------------------------------------------------------------------- save plan


@dataclasses.dataclass(frozen=True, eq=False)
class _TensorRecord:
    """The bytes of one tensor: a zero-copy uint8 view on its device."""

    name: str
    view: torch.Tensor
    offset: ClassVar[int] = 0  # the view holds the whole payload (writers ask, as of a StorageRecord)

    @property
    def device(self) -> torch.device:
        return self.view.device

    def data_ptr(self) -> int:
        return self.view.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.view.numel()


@dataclasses.dataclass(frozen=True, eq=False)
class SafetensorsPlan:
    """What to write for one safetensors file: the header bytes, then every tensor's bytes.

    Offers what :func:`fastpersist.io.writer.write_plan` needs of a plan
    (``size``, ``records``, ``segments()``, ``devices()``); the file has no
    checksums, so no segment needs one.
    """

    header: bytes
    records: tuple[_TensorRecord, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(r.view.numel() for r in self.records)

    def devices(self) -> set[torch.device]:
        return {r.device for r in self.records}

    def segments(self) -> list[Segment]:
        pieces = [(SegmentKind.BYTES, 0, len(self.header), -1, self.header)]
        position = len(self.header)
        for index, record in enumerate(self.records):
            length = record.view.numel()
            if length:
                pieces.append((SegmentKind.STORAGE, position, length, index, b""))
            position += length
        return pieces

    def trailer(self, crcs) -> bytes:  # no TRAILER segment: never called
        return b""

    @property
    def storages(self) -> tuple[_TensorRecord, ...]:
        """Every tensor's bytes (what a snapshot copies, as of a torch plan's storages)."""
        return self.records

    def with_views(self, views: Mapping[int, torch.Tensor]) -> SafetensorsPlan:
        """The same plan, each record ``r`` reading from ``views[id(r)]`` (a snapshot's copies)."""
        return SafetensorsPlan(self.header, tuple(_TensorRecord(r.name, views[id(r)]) for r in self.records))


def sort_key(name: str, tensor: torch.Tensor) -> tuple[int, str]:
    """The safetensors library's order: descending dtype (its enum order), then name."""
    return (-_RANK[dtype_name(tensor.dtype)], name)


def plan_save_file(
    views: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    metadata: Mapping[str, str] | None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> SafetensorsPlan:
    """A plan for ``views``: name -> (tensor, its zero-copy uint8 byte view), already checked.

    Tensors are ordered like the safetensors library orders them.
    """
    order = sorted(views, key=lambda name: sort_key(name, views[name][0]))
    described = []
    for name in order:
        tensor, view = views[name]
        dtype = dtype_name(tensor.dtype)
        shape = list(tensor.shape)
        if dtype in _PACKED:
            if not shape:
                raise ValueError(
                    f"tensor `{name}`: a 0-d {tensor.dtype} tensor holds two 4-bit values, which safetensors cannot "
                    "describe (its shapes count single values); reshape it to (1,)"
                )
            shape[-1] *= 2  # the file counts 4-bit elements; torch counts bytes of two
        described.append((name, dtype, shape, view.numel()))
    header = build_header(described, metadata, alignment)
    return SafetensorsPlan(header, tuple(_TensorRecord(name, views[name][1]) for name in order))
