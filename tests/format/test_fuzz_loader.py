"""Fuzzes the loader with damaged and hostile checkpoints (hypothesis).

Real checkpoints (fastpersist's and torch.save's) are mutated -- bit flips,
byte overwrites, truncations, insertions and deletions, and overwrites of
every field of the zip structures (local headers, extra fields, data
descriptors, central directory, zip64 end record and locator, end record)
with boundary values -- and fed to ``fastpersist.load(weights_only=True)``
(with and without ``verify``, read and mmap) and ``fastpersist.verify``.
A second fuzzer rewrites ``data.pkl`` itself (with valid CRCs, so the
unpickler is reached) including persistent ids of every shape and calls to
functions that must never run.

Allowed outcomes: success, ``CorruptCheckpointError`` (and its subclass
``ChecksumMismatchError``), ``pickle.UnpicklingError``, and torch's own
``RuntimeError`` for a storage location naming a device this process lacks
(a valid file saved on such a device gets it from torch.load too). Anything
else is a bug. Also checked: no read or allocation larger than the file (a size read
from the file is never trusted), no hang (a watchdog aborts the run with a
traceback), and when verification passes, the loaded object equals the
original.

CI runs a bounded number of examples, deterministically (about 45 s in all on
the 2-core CI machine). Fuzz longer by hand, with fresh random examples::

    FASTPERSIST_FUZZ_EXAMPLES=100000 python -m pytest -q tests/format/test_fuzz_loader.py

(the count applies to each fuzzer; ``FASTPERSIST_FUZZ_SECONDS`` sets the
watchdog, default 120 s per example).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import pickle
import shutil
import struct
import sys
import tempfile
import warnings
import zipfile

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastpersist
from fastpersist.errors import CorruptCheckpointError
from fastpersist.format.zipformat import read_directory
from fastpersist.io import engine

LONG_RUN = int(os.environ.get("FASTPERSIST_FUZZ_EXAMPLES", "0"))
WATCHDOG_SECONDS = float(os.environ.get("FASTPERSIST_FUZZ_SECONDS", "120"))
ALLOWED = (CorruptCheckpointError, pickle.UnpicklingError)


def fuzz_settings(ci_examples: int):
    return settings(
        max_examples=LONG_RUN or ci_examples,
        deadline=None,
        derandomize=not LONG_RUN,  # CI: the same examples every run; by hand: new ones
        database=None if not LONG_RUN else settings.default.database,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )


# ----------------------------------------------------------------------------- seeds


def _state() -> dict:
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(12, 10, generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "weight": base,
            "row": base[3],  # shares the storage
            "bias": torch.arange(7, dtype=torch.int16),
            "empty": torch.empty(0),
            "half": torch.randn(33, generator=generator).half(),
            "sparse": torch.randn(4, 4, generator=generator).to_sparse(),
            "quantized": torch.quantize_per_tensor(torch.randn(6, generator=generator), 0.1, 2, torch.qint8),
            "meta": {"step": 12, "name": "layer", "lr": [0.1, 0.01], "flag": True},
        }


STATE = _state()


def with_zip64_directory(data: bytes) -> bytes:
    """The same archive with every central entry's sizes and offset moved to zip64 extra fields.

    A real zip64 checkpoint is over 4 GiB; this one exercises the same parsing
    paths (zip64 extras, a saturated end record, the zip64 end record) in a few KB.
    """
    eocd = data.rfind(b"PK\x05\x06")
    count, cd_size, cd_offset = struct.unpack_from("<HII", data, eocd + 10)
    entries, position = [], cd_offset
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, position + 28)
        header = bytearray(data[position : position + 46])
        crc, csize, usize = struct.unpack_from("<III", header, 16)
        offset = struct.unpack_from("<I", header, 42)[0]
        struct.pack_into("<II", header, 20, 0xFFFFFFFF, 0xFFFFFFFF)
        struct.pack_into("<I", header, 42, 0xFFFFFFFF)
        struct.pack_into("<HH", header, 4, 45, 45)  # versions: zip64
        extra = struct.pack("<HHQQQ", 0x0001, 24, usize, csize, offset)
        struct.pack_into("<H", header, 30, len(extra))
        name = data[position + 46 : position + 46 + name_len]
        entries.append(bytes(header) + name + extra)
        position += 46 + name_len + extra_len + comment_len
    directory = b"".join(entries)
    eocd64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, len(directory), cd_offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, cd_offset + len(directory), 1)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return data[:cd_offset] + directory + eocd64 + locator + end


def _seed_files() -> dict[str, bytes]:
    directory = tempfile.mkdtemp(prefix="fastpersist-fuzz-seed-")
    try:
        seeds = {}
        fastpersist.save(STATE, os.path.join(directory, "ckpt.pt"))
        torch.save(STATE, os.path.join(directory, "torch.pt"))  # 64-byte alignment, torch's own writer
        fastpersist.save({"w": torch.randn(3000)}, os.path.join(directory, "one.pt"))
        for name in ("ckpt.pt", "torch.pt", "one.pt"):
            with open(os.path.join(directory, name), "rb") as handle:
                seeds[name] = handle.read()
        seeds["zip64.pt"] = with_zip64_directory(seeds["ckpt.pt"])
        return seeds
    finally:
        shutil.rmtree(directory)


SEEDS = _seed_files()
SEED_NAMES = sorted(SEEDS)


def _fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every field of every zip structure in ``data``."""
    fields = []
    records = read_directory(lambda o, n: data[o : o + n], len(data))
    for r in records:
        h = r.header_offset
        fields += [
            (h + o, w)
            for o, w in ((0, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2))
        ]
        name_len, extra_len = struct.unpack_from("<HH", data, h + 26)
        position = h + 30 + name_len
        while position + 4 <= h + 30 + name_len + extra_len:
            fields += [(position, 2), (position + 2, 2)]
            position += 4 + struct.unpack_from("<H", data, position + 2)[0]
        end = r.data_offset + r.size
        if r.size and data[end : end + 4] == b"PK\x07\x08":
            fields += [(end, 4), (end + 4, 4), (end + 8, 4), (end + 12, 4)]
    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", data, eocd + 12)
    if cd_offset == 0xFFFFFFFF:  # in the zip64 end record
        cd_size, cd_offset = struct.unpack_from("<QQ", data, struct.unpack_from("<Q", data, eocd - 12)[0] + 40)
    position = cd_offset
    while position < cd_offset + cd_size:
        fields += [
            (position + o, w)
            for o, w in (
                (0, 4),
                (4, 2),
                (6, 2),
                (8, 2),
                (10, 2),
                (12, 2),
                (14, 2),
                (16, 4),
                (20, 4),
                (24, 4),
                (28, 2),
                (30, 2),
                (32, 2),
                (34, 2),
                (36, 2),
                (38, 4),
                (42, 4),
            )
        ]
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, position + 28)
        extra = position + 46 + name_len
        while extra + 4 <= position + 46 + name_len + extra_len:  # zip64 extras: tag, length, 8-byte values
            length = struct.unpack_from("<H", data, extra + 2)[0]
            fields += [(extra, 2), (extra + 2, 2)] + [(extra + 4 + 8 * i, 8) for i in range(length // 8)]
            extra += 4 + length
        position += 46 + name_len + extra_len + comment_len
    if data[eocd - 20 : eocd - 16] == b"PK\x06\x07":
        locator = eocd - 20
        fields += [(locator + o, w) for o, w in ((0, 4), (4, 4), (8, 8), (16, 4))]
        eocd64 = struct.unpack_from("<Q", data, locator + 8)[0]
        fields += [
            (eocd64 + o, w)
            for o, w in ((0, 4), (4, 8), (12, 2), (14, 2), (16, 4), (20, 4), (24, 8), (32, 8), (40, 8), (48, 8))
        ]
    fields += [(eocd + o, w) for o, w in ((0, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 2))]
    return fields


FIELDS = {name: _fields(data) for name, data in SEEDS.items()}


# ----------------------------------------------------------------------------- mutations


@st.composite
def mutation(draw, size: int, fields: list[tuple[int, int]]):
    kind = draw(
        st.sampled_from(["flip", "byte", "truncate", "field", "field", "field", "insert", "delete", "copy", "zip64"])
    )
    position = draw(st.integers(0, max(size - 1, 0)))
    if kind == "flip":
        return ("flip", position, 1 << draw(st.integers(0, 7)))
    if kind == "byte":
        return ("byte", position, draw(st.integers(0, 255)))
    if kind == "truncate":
        return ("truncate", draw(st.integers(0, size)))
    if kind in ("insert", "delete"):
        return (
            kind,
            position,
            draw(st.binary(min_size=1, max_size=64)) if kind == "insert" else draw(st.integers(1, 4096)),
        )
    if kind == "copy":  # a piece of the file elsewhere: duplicated headers, swapped entries
        return ("copy", draw(st.integers(0, size)), position, draw(st.integers(1, 128)))
    if kind == "zip64":  # saturate the end record, so that the zip64 records are used
        return ("zip64", draw(st.sampled_from([(8, 2), (10, 2), (12, 4), (16, 4)])))
    offset, width = draw(st.sampled_from(fields))
    top = (1 << (8 * width)) - 1
    value = draw(
        st.one_of(
            st.sampled_from(
                [
                    0,
                    1,
                    2,
                    top,
                    top - 1,
                    top >> 1,
                    (top >> 1) + 1,
                    size,
                    size - 1,
                    size + 1,
                    4096,
                    0xFFFF,
                    0xFFFFFFFF,
                    22,
                    46,
                    56,
                ]
            ),
            st.integers(0, top),
            st.integers(0, size + 64),
        )
    )
    return ("field", offset, width, value & top)


def apply(data: bytes, mutations) -> bytes:
    data = bytearray(data)
    for m in mutations:
        kind = m[0]
        if kind == "flip" and m[1] < len(data):
            data[m[1]] ^= m[2]
        elif kind == "byte" and m[1] < len(data):
            data[m[1]] = m[2]
        elif kind == "truncate":
            del data[m[1] :]
        elif kind == "insert":
            data[m[1] : m[1]] = m[2]
        elif kind == "delete":
            del data[m[1] : m[1] + m[2]]
        elif kind == "copy":
            piece = data[m[1] : m[1] + m[3]]
            data[m[2] : m[2] + len(piece)] = piece
        elif kind == "zip64":
            eocd = data.rfind(b"PK\x05\x06")
            if eocd >= 0 and eocd + 22 <= len(data):
                offset, width = m[1]
                data[eocd + offset : eocd + offset + width] = b"\xff" * width
        elif kind == "field" and m[1] + m[2] <= len(data):
            data[m[1] : m[1] + m[2]] = m[3].to_bytes(m[2], "little")
    return bytes(data)


# ----------------------------------------------------------------------------- guards


@contextlib.contextmanager
def watchdog():
    """Aborts the whole run with every thread's traceback if one example hangs."""
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def bounded_reads_and_allocations(limit: int):
    """Fails if the loader reads or allocates more than ``limit`` bytes at once (sizes from the file unchecked)."""
    real_pread, real_buffer = os.pread, engine.AlignedBuffer
    seen = []

    def pread(fd, length, offset):
        if length > limit:
            seen.append(("pread", length))
            raise AssertionError(f"os.pread of {length} bytes for a {limit}-byte file")
        return real_pread(fd, length, offset)

    def aligned_buffer(nbytes, *args, **kwargs):
        if nbytes > limit:
            seen.append(("AlignedBuffer", nbytes))
            raise AssertionError(f"AlignedBuffer of {nbytes} bytes for a {limit}-byte file")
        return real_buffer(nbytes, *args, **kwargs)

    os.pread, engine.AlignedBuffer = pread, aligned_buffer
    try:
        yield seen
    finally:
        os.pread, engine.AlignedBuffer = real_pread, real_buffer


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if type(a) is not type(b) or a.dtype != b.dtype or a.layout != b.layout or a.shape != b.shape:
            return False
        if a.is_quantized:
            return torch.equal(a.int_repr(), b.int_repr()) and a.q_scale() == b.q_scale()
        if a.layout != torch.strided:
            return torch.equal(a.to_dense(), b.to_dense())
        return torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def expected_object(seed: str):
    return None if seed == "one.pt" else STATE


def unavailable_device(error: BaseException) -> bool:
    """torch's own error for a storage saved on a device this process lacks ('cpu' damaged into 'hpu').

    A real checkpoint saved on such a device gets the same error from torch.load,
    so fastpersist keeps it (a RuntimeError that says to pass map_location).
    """
    if type(error) is not RuntimeError:
        return False
    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    return frame.tb_frame.f_code.co_filename.endswith(os.path.join("torch", "serialization.py")) and (
        "device" in str(error) or "location" in str(error)
    )


def outcome(call):
    """('ok', value) or ('error', exception) for the allowed exceptions; anything else propagates."""
    try:
        return "ok", call()
    except ALLOWED as e:
        return "error", e
    except RuntimeError as e:
        if not unavailable_device(e):
            raise
        return "error", e


@pytest.fixture(scope="module")
def fuzz_dir():
    """tmpfs when there is one (thousands of small files), else the disk."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="fastpersist-fuzz-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def fuzz_disk_dir(tmp_path_factory):
    """On the disk: the O_DIRECT read path, with its alignment handling, sees the hostile offsets."""
    return str(tmp_path_factory.mktemp("fuzz-disk"))


def check_damaged_file(path: str, data: bytes, seed: str, use_mmap: bool) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
    limit = max(len(data), 1) + (64 << 10)  # fixed-size header reads may look past a tiny file's end
    with watchdog(), warnings.catch_warnings(), bounded_reads_and_allocations(limit):
        warnings.simplefilter("ignore")
        verified = outcome(lambda: fastpersist.verify(path))
        checked = outcome(lambda: fastpersist.load(path, weights_only=True, verify=True, mmap=use_mmap))
        outcome(lambda: fastpersist.load(path, weights_only=True, verify=False, mmap=use_mmap))
    original = expected_object(seed)
    if verified[0] == "ok" and verified[1].checksummed:
        # Every byte that matters is intact: the object must come back exactly.
        assert checked[0] == "ok", f"verify passed but load(verify=True) raised {checked[1]!r}"
    if checked[0] == "ok" and original is not None and verified[0] == "ok":
        assert same(original, checked[1]), "load(verify=True) returned different data"


@fuzz_settings(ci_examples=2000)
@given(data=st.data())
def test_damaged_checkpoints(data, fuzz_dir):
    seed = data.draw(st.sampled_from(SEED_NAMES), label="seed")
    original = SEEDS[seed]
    mutations = data.draw(st.lists(mutation(len(original), FIELDS[seed]), min_size=1, max_size=4), label="mutations")
    damaged = apply(original, mutations)
    check_damaged_file(os.path.join(fuzz_dir, "damaged.pt"), damaged, seed, data.draw(st.booleans(), label="mmap"))


@fuzz_settings(ci_examples=400)
@given(data=st.data())
def test_damaged_checkpoints_on_disk(data, fuzz_disk_dir):
    seed = data.draw(st.sampled_from(SEED_NAMES), label="seed")
    original = SEEDS[seed]
    mutations = data.draw(st.lists(mutation(len(original), FIELDS[seed]), min_size=1, max_size=3), label="mutations")
    check_damaged_file(os.path.join(fuzz_disk_dir, "damaged.pt"), apply(original, mutations), seed, False)


def test_every_truncation_of_a_small_checkpoint(fuzz_dir):
    """Not random: every length of the smallest seed, through load and verify."""
    original = SEEDS["one.pt"]
    path = os.path.join(fuzz_dir, "cut.pt")
    for length in range(0, len(original), 7):
        with open(path, "wb") as handle:
            handle.write(original[:length])
        with pytest.raises(ALLOWED + (EOFError,)):
            fastpersist.load(path, weights_only=True)
        with pytest.raises(CorruptCheckpointError):
            fastpersist.verify(path)


# ----------------------------------------------------------------------------- hostile pickles

CALLED = []


def must_never_run(*args):
    """Named by hostile pickles; weights_only must refuse to call it."""
    CALLED.append(args)
    return args


class Call:
    def __init__(self, function, args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


class PersistentId:
    def __init__(self, saved_id):
        self.saved_id = saved_id


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.saved_id if isinstance(obj, PersistentId) else None


STORAGE_TYPES = [torch.FloatStorage, torch.UntypedStorage, torch.HalfStorage, torch.ByteStorage, torch.LongStorage]
atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from(STORAGE_TYPES),
    st.sampled_from(["storage", "cpu", "0", "1", "cuda:0"]),
)
persistent_ids = st.one_of(
    st.tuples(
        st.just("storage"),
        st.sampled_from(STORAGE_TYPES),
        st.sampled_from(["0", "1", "2", "3", "99"]),
        st.sampled_from(["cpu", "meta", "cuda", "nowhere", 7]),
        st.integers(-3, 2**62),
    ),
    st.lists(atoms, max_size=6).map(tuple),
    atoms,
)
hostile = st.recursive(
    st.one_of(
        atoms,
        persistent_ids.map(PersistentId),
        st.sampled_from([must_never_run, os.system, eval, print, torch.load, pickle.loads, Call]).map(
            lambda f: Call(f, ("echo pwned",))
        ),
        st.builds(
            lambda s, o, size: Call(
                torch._utils._rebuild_tensor_v2, (PersistentId(s), o, size, (1,) * len(size), False, {})
            ),
            persistent_ids,
            st.integers(-5, 2**40),
            st.lists(st.integers(-1, 2**40), max_size=3).map(tuple),
        ),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)


def _rebuild_with_pickle(seed: bytes, pickle_bytes: bytes) -> bytes:
    """The seed archive with its data.pkl replaced (every CRC correct, so verify passes)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(seed)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            payload = pickle_bytes if info.filename.endswith("/data.pkl") else source.read(info)
            target.writestr(info.filename, payload)
    return out.getvalue()


def _mutate_bytes(original: bytes, edits) -> bytes:
    data = bytearray(original)
    for position, kind, value in edits:
        position %= max(len(data), 1)
        if kind == "set":
            data[position : position + 1] = bytes([value])
        elif kind == "insert":
            data[position:position] = bytes([value])
        else:
            del data[position : position + 1 + value % 8]
    return bytes(data)


def check_pickle(path: str, seed: bytes, pickle_bytes: bytes) -> None:
    data = _rebuild_with_pickle(seed, pickle_bytes)
    with open(path, "wb") as handle:
        handle.write(data)
    with watchdog(), warnings.catch_warnings(), bounded_reads_and_allocations(len(data) + (64 << 10)):
        warnings.simplefilter("ignore")
        assert fastpersist.verify(path).checksummed
        for verify in (True, False):
            outcome(lambda verify=verify: fastpersist.load(path, weights_only=True, verify=verify))
    assert CALLED == [], f"weights_only called {CALLED}"


@fuzz_settings(ci_examples=1000)
@given(obj=hostile, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_hostile_pickles(obj, protocol, fuzz_dir):
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=protocol).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError, OverflowError):
        return  # not expressible as a pickle at this protocol
    check_pickle(os.path.join(fuzz_dir, "hostile.pt"), SEEDS["ckpt.pt"], buffer.getvalue())


@fuzz_settings(ci_examples=1000)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 1 << 16), st.sampled_from(["set", "insert", "delete"]), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    )
)
def test_mutated_pickles(edits, fuzz_dir):
    with zipfile.ZipFile(io.BytesIO(SEEDS["ckpt.pt"])) as archive:
        original = archive.read("ckpt/data.pkl")
    check_pickle(os.path.join(fuzz_dir, "mutated.pt"), SEEDS["ckpt.pt"], _mutate_bytes(original, edits))


def test_the_seeds_are_sound():
    """The fuzzers start from good files: each verifies and loads back."""
    for name, data in SEEDS.items():
        assert data[:4] == b"PK\x03\x04" and len(FIELDS[name]) > 50
    directory = tempfile.mkdtemp()
    try:
        path = os.path.join(directory, "ckpt.pt")
        for seed in ("ckpt.pt", "zip64.pt", "torch.pt"):
            with open(path, "wb") as handle:
                handle.write(SEEDS[seed])
            assert fastpersist.verify(path).checksummed
            assert same(STATE, fastpersist.load(path, verify=True)), seed
            assert same(STATE, torch.load(path)), seed
            with zipfile.ZipFile(path) as archive:
                assert archive.testzip() is None
    finally:
        shutil.rmtree(directory)
    assert sys.modules[__name__].must_never_run is must_never_run
