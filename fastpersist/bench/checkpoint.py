"""``python -m fastpersist.bench checkpoint``: save and load a real-shaped checkpoint every way.

One run compares, on the same bytes, ``torch.save`` (default and fast
settings), ``safetensors``, ``torch.distributed.checkpoint`` and fastpersist
(sync and async), then the matching loads. Every number is a time to durable
(fsync of the files and their directory) or a cold load (page cache dropped
first); every saved file and every loaded state is compared byte for byte with
the original before its method is reported. See docs/checkpoint-benchmark.md.

The pieces are separate so that more methods, async variants and multi-rank
runs can be added without touching the runner:

* :class:`SaveMethod` / :class:`LoadMethod` objects, kept in
  :data:`SAVE_METHODS` / :data:`LOAD_METHODS` (add with :func:`register`);
* :func:`run_benchmark`, which interleaves them round by round and measures;
* :mod:`fastpersist.bench.report`, which prints, charts and renders Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from fastpersist.tensors import host_memoryview
from fastpersist.bench import measure, models, report

__all__ = [
    "BenchContext",
    "SaveMethod",
    "LoadMethod",
    "MethodResult",
    "SAVE_METHODS",
    "LOAD_METHODS",
    "register",
    "verify_state",
    "run_benchmark",
    "build_parser",
    "main",
    "SCHEMA",
]

SCHEMA = "fastpersist.bench.checkpoint/1"
BASELINES = {"save": "torch.save", "load": "torch.load"}


# ============================================================================ context


@dataclasses.dataclass
class BenchContext:
    """What every method may need besides the state and a path.

    Attributes:
        device: where the state lives and where loads must put it.
        dist: rank / world size (from torchrun's environment, else 0 of 1).
        dcp_threads: ``FileSystemWriter(thread_count=...)`` for DCP saves.
        fastpersist_overrides: settings passed to every fastpersist call.
    """

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    dist: measure.DistributedEnv = dataclasses.field(default_factory=measure.DistributedEnv)
    dcp_threads: int = 1
    fastpersist_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


# ============================================================================ methods


class SaveMethod:
    """One way of writing a checkpoint durably.

    Subclasses set ``name`` (registry key), ``label`` (table text) and
    implement :meth:`save` and :meth:`read_back`. The runner calls, per round:
    ``save`` (timed, followed by a timed :func:`measure.fsync_paths` so every
    method pays for durability alike), then ``read_back`` + comparison
    (untimed), and ``cleanup`` at the end of the round.
    """

    name: str = ""
    label: str = ""
    default: bool = True
    """Run when no ``--methods`` are given."""

    def unavailable(self, ctx: BenchContext) -> str | None:
        """Why this method cannot run here, or None."""
        return None

    def target(self, directory: str, ctx: BenchContext) -> str:
        """Where this method writes (a file or a directory), distinct per rank."""
        suffix = f".rank{ctx.dist.rank}" if ctx.dist.world_size > 1 else ""
        return os.path.join(directory, self.name.replace("/", "_") + suffix + self.extension)

    extension: str = ".pt"

    def save(self, state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
        """Writes ``state`` to ``path``; returns extra timings (``blocked_seconds`` for async).

        Returns only when the bytes are durable or the runner's fsync makes them so.
        """
        raise NotImplementedError

    def read_back(self, path: str, state: Any, ctx: BenchContext) -> Any:
        """Loads what :meth:`save` wrote, to ``ctx.device``, for verification."""
        raise NotImplementedError

    def flat(self, loaded: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Tensors and other leaves of a loaded state, keyed as :func:`models.flatten_state` keys them.

        ``None`` for the other leaves means the format does not carry them.
        """
        return models.flatten_state(loaded)

    def cleanup(self, path: str) -> None:
        measure.remove_path(path)


class LoadMethod:
    """One way of reading a checkpoint written by save method ``source``."""

    name: str = ""
    label: str = ""
    source: str = ""
    default: bool = True

    def unavailable(self, ctx: BenchContext) -> str | None:
        return None

    def load(self, path: str, state: Any, ctx: BenchContext) -> Any:
        """Loads ``path`` completely onto ``ctx.device``.

        ``state`` is the original, for methods that (like DCP) must be told the
        structure; they may use its shapes and dtypes, never its data. Every
        byte must be resident when this returns (touch mmap'd pages).
        """
        raise NotImplementedError

    def flat(self, loaded: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        return models.flatten_state(loaded)


SAVE_METHODS: dict[str, SaveMethod] = {}
LOAD_METHODS: dict[str, LoadMethod] = {}


def register(method: SaveMethod | LoadMethod) -> SaveMethod | LoadMethod:
    """Adds a method to its registry (replacing one of the same name)."""
    if isinstance(method, SaveMethod):
        SAVE_METHODS[method.name] = method
    elif isinstance(method, LoadMethod):
        LOAD_METHODS[method.name] = method
    else:
        raise TypeError(f"not a benchmark method: {method!r}")
    return method


# ---------------------------------------------------------------------------- helpers


def _torch_load(path: str, ctx: BenchContext, **kw: Any) -> Any:
    return torch.load(path, map_location=ctx.device, weights_only=True, **kw)


def _touch_pages(loaded: Any) -> None:
    """Reads one byte of every page of every storage, so lazily mapped data is resident."""
    from fastpersist.tensors import storage_byte_view

    tensors = (
        loaded
        if isinstance(loaded, dict) and all(isinstance(v, torch.Tensor) for v in loaded.values())
        else models.flatten_state(loaded)[0]
    )
    seen: set[int] = set()
    for t in tensors.values():
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        int(storage_byte_view(storage)[::4096].sum())


@contextlib.contextmanager
def _torch_serialization_settings(**values: Any) -> Iterator[None]:
    import torch.utils.serialization  # noqa: F401 - makes torch.utils.serialization.config importable

    config = torch.utils.serialization.config.save
    old = {k: getattr(config, k) for k in values}
    try:
        for k, v in values.items():
            setattr(config, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(config, k, v)


def _empty_like_state(state: Any, device: torch.device | None = None) -> Any:
    """Same structure, freshly allocated (untouched) tensors; other leaves copied."""
    if isinstance(state, torch.Tensor):
        return torch.empty(state.shape, dtype=state.dtype, device=state.device if device is None else device)
    if isinstance(state, dict):
        return {k: _empty_like_state(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_empty_like_state(v, device) for v in state]
    if isinstance(state, tuple):
        return tuple(_empty_like_state(v, device) for v in state)
    return state


def _fastpersist_api() -> tuple[Any, str | None]:
    try:
        import fastpersist

        fastpersist.save, fastpersist.load  # noqa: B018 - probe the public API
        return fastpersist, None
    except Exception as e:  # ImportError, AttributeError, or an error building the native module
        return None, f"fastpersist.save is not importable yet ({type(e).__name__}: {e})"


# ---------------------------------------------------------------------------- torch.save


class TorchSave(SaveMethod):
    name = "torch.save"
    label = "torch.save + fsync"

    def save(self, state, path, ctx):
        torch.save(state, path)
        return {}

    def read_back(self, path, state, ctx):
        return _torch_load(path, ctx)


class TorchSaveFast(TorchSave):
    name = "torch.save-fast"
    label = "torch.save, no CRC32 + fsync"

    def _settings(self, ctx: BenchContext) -> dict[str, Any]:
        values: dict[str, Any] = {"compute_crc32": False}
        if ctx.is_cuda:
            values["use_pinned_memory_for_d2h"] = True
        return values

    def unavailable(self, ctx):
        try:
            with _torch_serialization_settings(**self._settings(ctx)):
                pass
        except (ImportError, AttributeError) as e:
            return f"torch {torch.__version__} has no torch.utils.serialization.config.save ({e})"
        return None

    def save(self, state, path, ctx):
        with _torch_serialization_settings(**self._settings(ctx)):
            torch.save(state, path)
        return {}


class TorchLoad(LoadMethod):
    name = "torch.load"
    label = "torch.load"
    source = "torch.save"

    def load(self, path, state, ctx):
        return _torch_load(path, ctx)


class TorchLoadMmap(LoadMethod):
    name = "torch.load-mmap"
    label = "torch.load(mmap=True) + touch"
    source = "torch.save"

    def load(self, path, state, ctx):
        return _torch_load(path, ctx, mmap=True)  # the runner touches every page


# ---------------------------------------------------------------------------- safetensors


class SafetensorsSave(SaveMethod):
    """safetensors.torch.save_file of the flattened tensors (other leaves go to the metadata as JSON)."""

    name = "safetensors"
    label = "safetensors save_file + fsync"
    extension = ".safetensors"

    def unavailable(self, ctx):
        try:
            import numpy  # noqa: F401  (safetensors.torch converts through numpy)
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            return f"safetensors (with numpy) is not installed ({e})"
        return None

    def save(self, state, path, ctx):
        from safetensors.torch import save_file

        tensors, objects = models.flatten_state(state)
        metadata = {"objects": json.dumps(objects, default=repr)} if objects else None
        save_file(tensors, path, metadata=metadata)
        return {}

    def read_back(self, path, state, ctx):
        from safetensors.torch import load_file

        return load_file(path, device=str(ctx.device))

    def flat(self, loaded):
        return dict(loaded), None


class SafetensorsLoad(LoadMethod):
    name = "safetensors.load"
    label = "safetensors load_file"
    source = "safetensors"

    def unavailable(self, ctx):
        return SafetensorsSave().unavailable(ctx)

    def load(self, path, state, ctx):
        from safetensors.torch import load_file

        return load_file(path, device=str(ctx.device))

    def flat(self, loaded):
        return dict(loaded), None


# ---------------------------------------------------------------------------- DCP


def _dcp_kwargs(ctx: BenchContext) -> dict[str, Any]:
    # Every rank saves its whole state to its own directory (like the other methods), so DCP runs
    # without collectives even under torchrun; sharded DCP saves would be a separate method.
    return {"no_dist": True}


def _filter_kwargs(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in params}


class DcpSave(SaveMethod):
    """torch.distributed.checkpoint.save with FileSystemWriter (no process group needed)."""

    name = "dcp"
    extension = ".dcp"

    @property
    def label(self) -> str:  # type: ignore[override]
        return "torch DCP save (FileSystemWriter)"

    def unavailable(self, ctx):
        try:
            import torch.distributed.checkpoint as dcp  # noqa: F401
            from torch.distributed.checkpoint import FileSystemWriter  # noqa: F401
        except Exception as e:
            return f"torch.distributed.checkpoint is not usable here ({type(e).__name__}: {e})"
        return None

    def save(self, state, path, ctx):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        writer = FileSystemWriter(
            path,
            **_filter_kwargs(
                FileSystemWriter,
                {"single_file_per_rank": True, "sync_files": True, "thread_count": ctx.dcp_threads, "overwrite": True},
            ),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer, **_dcp_kwargs(ctx))
        return {}

    def read_back(self, path, state, ctx):
        return DcpLoad().load(path, state, ctx)


class DcpLoad(LoadMethod):
    """torch.distributed.checkpoint.load into freshly allocated tensors of the right shapes."""

    name = "dcp.load"
    label = "torch DCP load"
    source = "dcp"

    def unavailable(self, ctx):
        return DcpSave().unavailable(ctx)

    def load(self, path, state, ctx):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        # DCP loads in place: allocate the destination (part of the timed cost, as torch.load allocates too).
        template = _empty_like_state(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(template, storage_reader=FileSystemReader(path), **_dcp_kwargs(ctx))
        return template


# ---------------------------------------------------------------------------- fastpersist


class FastpersistSave(SaveMethod):
    """fastpersist.save (durable on return)."""

    name = "fastpersist"
    label = "fastpersist.save"

    def unavailable(self, ctx):
        return _fastpersist_api()[1]

    def save(self, state, path, ctx):
        fastpersist, _ = _fastpersist_api()
        fastpersist.save(state, path, fsync=True, **ctx.fastpersist_overrides)
        return {}

    def read_back(self, path, state, ctx):
        # Read back with torch.load: proves the file is a drop-in torch checkpoint, independently
        # of fastpersist's own reader (which the fastpersist.load method checks).
        return _torch_load(path, ctx)


class FastpersistAsyncSave(FastpersistSave):
    """fastpersist.async_save: blocked = until it returns; durable = until result() returns."""

    name = "fastpersist-async"
    label = "fastpersist.async_save"

    def unavailable(self, ctx):
        fastpersist, reason = _fastpersist_api()
        if reason:
            return reason
        if not hasattr(fastpersist, "async_save"):
            return "fastpersist.async_save is not available yet"
        return None

    def save(self, state, path, ctx):
        fastpersist, _ = _fastpersist_api()
        start = time.perf_counter()
        future = fastpersist.async_save(state, path, **ctx.fastpersist_overrides)
        blocked = time.perf_counter() - start
        future.result()
        return {"blocked_seconds": blocked}


class FastpersistLoad(LoadMethod):
    name = "fastpersist.load"
    label = "fastpersist.load"
    source = "fastpersist"

    def unavailable(self, ctx):
        return _fastpersist_api()[1]

    def load(self, path, state, ctx):
        fastpersist, _ = _fastpersist_api()
        return fastpersist.load(path, map_location=ctx.device, **ctx.fastpersist_overrides)


class FastpersistLoadTorchFile(FastpersistLoad):
    """fastpersist.load of the file torch.save wrote: the drop-in path for existing checkpoints."""

    name = "fastpersist.load-torchfile"
    label = "fastpersist.load of a torch.save file"
    source = "torch.save"


# ---------------------------------------------------------------------------- raw write (ceiling)


class RawWrite(SaveMethod):
    """All tensor bytes in one file with os.write + fsync: no format at all; an upper bound for buffered writes."""

    name = "os.write"
    label = "raw os.write of all bytes + fsync (ceiling)"
    extension = ".bin"
    default = False

    def save(self, state, path, ctx):
        tensors, _ = models.flatten_state(state)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors.values():
                data = t.detach().reshape(-1).view(torch.uint8)
                if data.device.type != "cpu":
                    data = data.cpu()
                view = host_memoryview(data.contiguous())
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        return {}

    def read_back(self, path, state, ctx):
        tensors, _ = models.flatten_state(state)
        out: dict[str, torch.Tensor] = {}
        with open(path, "rb") as f:
            for key, t in tensors.items():
                raw = bytearray(f.read(t.numel() * t.element_size()))
                flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                out[key] = flat.view(t.dtype).reshape(t.shape).to(ctx.device)
            if f.read(1):
                raise ValueError("raw file is longer than the state")
        return out

    def flat(self, loaded):
        return dict(loaded), None


# ---------------------------------------------------------------------------- engine ceiling


_CEILING_CHUNK = 64 << 20


def _ceiling_pattern() -> torch.Tensor:
    """A page-locked chunk of random bytes that the ceiling methods write over and over."""
    global _PATTERN
    if _PATTERN is None:
        from fastpersist.io import memory

        _PATTERN = memory.new_cpu_locked_tensor(_CEILING_CHUNK)
        _PATTERN.copy_(torch.randint(0, 256, (_CEILING_CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    return _PATTERN


_PATTERN: torch.Tensor | None = None


class EngineCeilingWrite(SaveMethod):
    """The storage ceiling: the same number of bytes, written by fastpersist's engine with
    O_DIRECT from page-locked memory, no format, no copies, no checksums (fallocate + fsync
    like a save). Its file is not a checkpoint: read-back checks the written pattern."""

    name = "engine-write"
    label = "engine raw O_DIRECT write (ceiling)"
    extension = ".raw"

    def unavailable(self, ctx):
        return _fastpersist_api()[1]

    def save(self, state, path, ctx):
        from fastpersist import config
        from fastpersist.io import engine

        total = models.state_nbytes(state)
        pattern = _ceiling_pattern()
        settings = config.resolve(ctx.fastpersist_overrides)
        file = engine.File(path, "w", direct=settings.direct, truncate=True)
        try:
            file.allocate(0, max(total, 1))
            # As many writes in flight, each on its own handle, as a save keeps ring slots.
            handles = [engine.make_handle(settings) for _ in range(settings.buffer_count)]
            for index, offset in enumerate(range(0, total, _CEILING_CHUNK)):
                handle = handles[index % len(handles)]
                handle.wait()
                handle.submit_write(pattern.data_ptr(), min(_CEILING_CHUNK, total - offset), file, offset, pattern)
            for handle in handles:
                handle.wait()
            file.fsync()
        finally:
            file.close()
        return {}

    def read_back(self, path, state, ctx):
        _check_pattern_file(path, models.state_nbytes(state))
        return state

    def cleanup(self, path):
        measure.remove_path(path)


def _check_pattern_file(path: str, total: int) -> None:
    pattern = _ceiling_pattern()
    if os.path.getsize(path) != total:
        raise ValueError(f"ceiling file has {os.path.getsize(path)} bytes, expected {total}")
    with open(path, "rb") as f:
        for offset in range(0, total, _CEILING_CHUNK):
            data = f.read(min(_CEILING_CHUNK, total - offset))
            if not torch.equal(torch.frombuffer(bytearray(data), dtype=torch.uint8), pattern[: len(data)]):
                raise ValueError(f"ceiling file differs from the pattern near offset {offset}")


class EngineCeilingRead(LoadMethod):
    """The read ceiling: the ceiling file read cold with O_DIRECT into page-locked memory."""

    name = "engine-read"
    label = "engine raw O_DIRECT read (ceiling)"
    source = "engine-write"

    def unavailable(self, ctx):
        return _fastpersist_api()[1]

    def load(self, path, state, ctx):
        from fastpersist import config
        from fastpersist.io import engine, memory

        total = models.state_nbytes(state)
        settings = config.resolve(ctx.fastpersist_overrides)
        count = settings.buffer_count
        with memory.lease_buffers(count, _CEILING_CHUNK) as buffers:
            handles = [engine.make_handle(settings) for _ in buffers]
            file = engine.File(path, "r", direct=settings.direct)
            try:
                for index, offset in enumerate(range(0, total, _CEILING_CHUNK)):
                    slot = index % count
                    handles[slot].wait()
                    handles[slot].submit_read(buffers[slot].data_ptr(), min(_CEILING_CHUNK, total - offset), file,
                                              offset, buffers[slot])  # fmt: skip
                for handle in handles:
                    handle.wait()
            finally:
                file.close()
        return state


for _method in (
    TorchSave(),
    TorchSaveFast(),
    SafetensorsSave(),
    DcpSave(),
    FastpersistSave(),
    FastpersistAsyncSave(),
    RawWrite(),
    TorchLoad(),
    TorchLoadMmap(),
    SafetensorsLoad(),
    DcpLoad(),
    FastpersistLoad(),
    FastpersistLoadTorchFile(),
    EngineCeilingWrite(),
    EngineCeilingRead(),
):
    register(_method)


# ============================================================================ verification


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def verify_state(
    expected: tuple[dict[str, torch.Tensor], dict[str, Any]],
    actual: tuple[dict[str, torch.Tensor], dict[str, Any] | None],
    device: torch.device | None = None,
) -> str | None:
    """Compares a loaded state with the original, byte for byte.

    Args:
        expected: ``models.flatten_state(original)``.
        actual: the loaded state, flattened the same way; its second element
            is None when the format does not carry non-tensor leaves.
        device: the device loads were asked for; a tensor that lived there
            originally must come back there.

    Returns:
        None when every tensor has the same names, dtype, shape and bytes (and
        the other leaves compare equal), else a description of the first
        difference.
    """
    want_tensors, want_objects = expected
    got_tensors, got_objects = actual
    missing = sorted(set(want_tensors) - set(got_tensors))
    extra = sorted(set(got_tensors) - set(want_tensors))
    if missing or extra:
        return f"tensor names differ: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
    for key, want in want_tensors.items():
        got = got_tensors[key]
        if not isinstance(got, torch.Tensor):
            return f"{key}: expected a tensor, got {type(got).__name__}"
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return f"{key}: expected {want.dtype} {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"
        if device is not None and want.device.type == device.type and got.device.type != device.type:
            return f"{key}: loaded to {got.device}, expected {device}"
        a = _bytes_of(want)
        b = _bytes_of(got)
        if b.device != a.device:
            b = b.to(a.device)
        if not torch.equal(a, b):
            index = int((a != b).nonzero()[0]) if a.numel() else 0
            return f"{key}: bytes differ (first at byte {index} of {a.numel()})"
    if got_objects is not None:
        for key, want in want_objects.items():
            if key not in got_objects:
                return f"{key}: missing from the loaded state"
            if got_objects[key] != want:
                return f"{key}: expected {want!r}, got {got_objects[key]!r}"
    return None


# ============================================================================ runner


@dataclasses.dataclass
class MethodResult:
    """Everything measured for one method. ``status``: ok, FAILED (verification or error) or skipped."""

    op: str
    name: str
    label: str
    status: str = "ok"
    reason: str | None = None
    timed: bool = True
    file_bytes: int | None = None
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def fail(self, reason: str) -> None:
        self.status = "FAILED"
        self.reason = reason

    def as_dict(self, state_bytes: int) -> dict[str, Any]:
        timed = [s for s in self.samples if not s.get("warmup")]
        ok = self.status == "ok"
        return {
            "op": self.op,
            "method": self.name,
            "label": self.label,
            "status": self.status,
            "reason": self.reason,
            "timed": self.timed,
            "bytes": state_bytes,
            "file_bytes": self.file_bytes,
            "samples": self.samples,
            "summary": {
                "gbps": measure.summarize([s["gbps"] for s in timed]) if ok else None,
                "seconds": measure.summarize([s["seconds"] for s in timed]) if ok else None,
                "blocked_seconds": measure.summarize([s.get("blocked_seconds") for s in timed]) if ok else None,
                "peak_rss_bytes": measure.summarize([s["peak_rss_bytes"] for s in timed]) if ok else None,
                "rss_delta_bytes": measure.summarize([s["rss_delta_bytes"] for s in timed]) if ok else None,
            },
        }


def _rotate(items: Sequence[Any], k: int) -> list[Any]:
    if not items:
        return []
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def _path_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in measure.files_under(path))


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 300 else text[:297] + "..."


def run_benchmark(
    state: Any,
    save_methods: Sequence[SaveMethod],
    load_methods: Sequence[LoadMethod],
    directory: str,
    *,
    ctx: BenchContext | None = None,
    repeats: int = 3,
    warmup: int = 1,
    dropper: measure.CacheDropper | None = None,
    progress: Callable[[str], None] | None = None,
    state_bytes: int | None = None,
) -> list[MethodResult]:
    """Runs every method ``warmup + repeats`` times, interleaved, and verifies each result.

    Round ``r`` runs every save in the order rotated by ``r`` (so a disk that
    slows down over the run hurts all methods alike), then every load after
    dropping the page cache, then deletes the round's files. A save is timed
    from the call to the end of :func:`measure.fsync_paths` of what it wrote;
    a load from the call until the state is complete on the device. Each saved
    file is read back and each loaded state compared with the original
    (untimed); the first difference or exception marks the method FAILED and
    stops running it (and the loads that read its files).

    Load methods whose ``source`` is not among ``save_methods`` get that save
    run untimed each round to produce their input.

    Returns:
        One :class:`MethodResult` per method: the saves in the given order,
        then the untimed helper saves, then the loads.
    """
    ctx = ctx or BenchContext()
    dropper = dropper or measure.CacheDropper()
    progress = progress or (lambda _text: None)
    if state_bytes is None:
        state_bytes = sum(t.numel() * t.element_size() for t in models.flatten_state(state)[0].values())
    expected = models.flatten_state(state)

    results: dict[tuple[str, str], MethodResult] = {}
    saves = list(save_methods)
    for m in saves:
        results[("save", m.name)] = MethodResult("save", m.name, m.label)
    for m in load_methods:
        if ("save", m.source) not in results:
            if m.source not in SAVE_METHODS:
                raise KeyError(f"load method {m.name!r} reads files of unknown save method {m.source!r}")
            helper = SAVE_METHODS[m.source]
            saves.append(helper)
            results[("save", helper.name)] = MethodResult("save", helper.name, helper.label, timed=False)
    for m in load_methods:
        results[("load", m.name)] = MethodResult("load", m.name, m.label)
    for m in list(saves) + list(load_methods):
        op = "save" if isinstance(m, SaveMethod) else "load"
        reason = m.unavailable(ctx)
        if reason:
            results[(op, m.name)].status = "skipped"
            results[(op, m.name)].reason = reason

    rounds = warmup + repeats
    for round_index in range(rounds):
        is_warmup = round_index < warmup
        written: dict[str, str] = {}  # save method -> its verified output, for the loads
        created: dict[str, str] = {}  # everything to delete at the end of the round
        try:
            for method in _rotate(saves, round_index):
                result = results[("save", method.name)]
                if result.status != "ok":
                    continue
                progress(f"round {round_index + 1}/{rounds}: save {method.name}")
                path = method.target(directory, ctx)
                measure.remove_path(path)
                created[method.name] = path
                sample = _measure_save(method, state, path, ctx, result)
                if sample is None:
                    continue
                result.file_bytes = _path_bytes(path)
                try:
                    loaded = method.read_back(path, state, ctx)
                    problem = verify_state(expected, method.flat(loaded), ctx.device)
                    del loaded
                except Exception as e:
                    problem = f"reading the file back failed: {_short_error(e)}"
                measure.release_memory()
                if problem:
                    result.fail(f"verification failed: {problem}")
                    continue
                written[method.name] = path
                sample.update(round=round_index, warmup=is_warmup, gbps=state_bytes / sample["seconds"] / 1e9)
                result.samples.append(sample)
            for method in _rotate(list(load_methods), round_index):
                result = results[("load", method.name)]
                if result.status != "ok":
                    continue
                source = results[("save", method.source)]
                if method.source not in written:
                    result.status = "skipped"
                    result.reason = (
                        f"its input ({method.source}) was not written: {source.status} {source.reason or ''}".strip()
                    )
                    continue
                progress(f"round {round_index + 1}/{rounds}: load {method.name}")
                path = written[method.source]
                cache = dropper.drop([path])
                ctx.dist.barrier()
                sample, loaded = _measure_load(method, state, path, ctx, result)
                if sample is None:
                    continue
                try:
                    problem = verify_state(expected, method.flat(loaded), ctx.device)
                except Exception as e:
                    problem = f"comparing the loaded state failed: {_short_error(e)}"
                del loaded
                measure.release_memory()
                if problem:
                    result.fail(f"verification failed: {problem}")
                    continue
                sample.update(
                    round=round_index, warmup=is_warmup, cache=cache, gbps=state_bytes / sample["seconds"] / 1e9
                )
                result.samples.append(sample)
        finally:
            by_name = {m.name: m for m in saves}
            for name, path in created.items():
                by_name[name].cleanup(path)
            if created:
                os.sync()
    return list(results.values())


def _measure_save(
    method: SaveMethod, state: Any, path: str, ctx: BenchContext, result: MethodResult
) -> dict[str, Any] | None:
    measure.release_memory()
    ctx.synchronize()
    ctx.dist.barrier()
    try:
        with measure.PeakMemory() as memory:
            start = time.perf_counter()
            extra = method.save(state, path, ctx) or {}
            ctx.synchronize()
            measure.fsync_paths(path)
            seconds = time.perf_counter() - start
    except KeyboardInterrupt:
        raise
    except Exception as e:
        result.fail(f"save raised {_short_error(e)}")
        if os.environ.get("FASTPERSIST_BENCH_TRACEBACK"):
            traceback.print_exc()
        return None
    return {
        "seconds": seconds,
        "blocked_seconds": extra.get("blocked_seconds"),
        "peak_rss_bytes": memory.peak,
        "baseline_rss_bytes": memory.baseline,
        "rss_delta_bytes": memory.delta,
        "memory_source": memory.source,
    }


def _measure_load(
    method: LoadMethod, state: Any, path: str, ctx: BenchContext, result: MethodResult
) -> tuple[dict[str, Any] | None, Any]:
    measure.release_memory()
    ctx.synchronize()
    try:
        with measure.PeakMemory() as memory:
            start = time.perf_counter()
            loaded = method.load(path, state, ctx)
            if ctx.device.type == "cpu":
                _touch_pages(method.flat(loaded)[0])
            ctx.synchronize()
            seconds = time.perf_counter() - start
    except KeyboardInterrupt:
        raise
    except Exception as e:
        result.fail(f"load raised {_short_error(e)}")
        if os.environ.get("FASTPERSIST_BENCH_TRACEBACK"):
            traceback.print_exc()
        return None, None
    sample = {
        "seconds": seconds,
        "peak_rss_bytes": memory.peak,
        "baseline_rss_bytes": memory.baseline,
        "rss_delta_bytes": memory.delta,
        "memory_source": memory.source,
    }
    return sample, loaded


# ============================================================================ command line


def _default_dcp_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastpersist.bench checkpoint",
        description=(
            "Save and load a synthetic checkpoint with the exact tensor shapes of a real model, "
            "with torch.save, safetensors, torch DCP and fastpersist, and compare them: time to "
            "durable (fsync), cold loads (page cache dropped), peak host memory; every result "
            "verified byte for byte."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    what = parser.add_argument_group("what to save")
    what.add_argument("--model", default=models.DEFAULT_MODEL, help="model whose shapes to use (see --list-models)")
    what.add_argument("--layers", type=int, default=None, help="keep only the first N transformer blocks")
    what.add_argument(
        "--size",
        default=None,
        help="keep as many blocks as fit in this size (e.g. 2G, 512MiB); overrides --layers",
    )
    what.add_argument("--dtype", choices=sorted(models.DTYPES), default="bf16", help="parameter dtype")
    what.add_argument("--device", default="cpu", help="where the state lives and loads go: cpu, cuda or cuda:N")
    what.add_argument(
        "--training-state",
        action="store_true",
        help="save a full training checkpoint: + Adam moments (fp32), fp32 master weights, step, RNG state",
    )
    what.add_argument("--seed", type=int, default=0, help="random seed of the synthetic data")

    how = parser.add_argument_group("how to measure")
    how.add_argument(
        "--methods",
        default=None,
        help="comma-separated save and load methods to run (default: every default method; see --list-methods)",
    )
    how.add_argument("--skip", default="", help="comma-separated methods to leave out")
    how.add_argument("--repeats", type=int, default=3, help="timed rounds (medians and min-max are reported)")
    how.add_argument("--warmup", type=int, default=1, help="untimed rounds first (still verified)")
    how.add_argument(
        "--dir",
        default=None,
        help="directory on the filesystem to test; a temporary subdirectory is made there and removed "
        "afterwards (default: the current directory)",
    )
    how.add_argument("--no-drop-caches", action="store_true", help="leave the page cache alone (warm loads)")
    how.add_argument("--dcp-threads", type=int, default=_default_dcp_threads(), help="DCP FileSystemWriter threads")
    how.add_argument(
        "--fp-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a fastpersist setting for the fastpersist methods (repeatable), e.g. block_size=16M",
    )
    how.add_argument(
        "--config", default=None, help="a fastpersist configuration file (as written by 'fastpersist tune')"
    )

    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="PATH", help="write every sample and the machine description")
    out.add_argument("--png", default=None, metavar="PATH", help="bar chart of the medians (needs matplotlib)")
    out.add_argument(
        "--markdown",
        nargs="+",
        default=None,
        metavar="JSON",
        help="do not benchmark: print Markdown tables of earlier --json results and exit",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    out.add_argument("--list-models", action="store_true", help="list the model catalogue and exit")
    out.add_argument("--list-methods", action="store_true", help="list the methods and exit")
    return parser


def _print_models() -> None:
    rows = []
    for name, spec in models.CATALOGUE.items():
        layers = spec.default_layers if spec.default_layers is not None else spec.num_layers
        params = models.parameter_count(spec, layers)
        rows.append(
            (
                name,
                f"{layers}/{spec.num_layers}",
                f"{params / 1e6:,.1f} M",
                models.format_bytes(params * 2),
                spec.description,
            )
        )
    widths = [max(len(r[i]) for r in rows + [("model", "layers", "params", "bf16", "")]) for i in range(4)]
    print(
        f"{'model':<{widths[0]}}  {'layers':>{widths[1]}}  {'params':>{widths[2]}}  {'bf16':>{widths[3]}}  description"
    )
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}")


def _print_methods(ctx: BenchContext) -> None:
    for op, registry in (("save", SAVE_METHODS), ("load", LOAD_METHODS)):
        for name, m in registry.items():
            reason = m.unavailable(ctx)
            extra = f" (reads {m.source}'s files)" if op == "load" else ""
            flag = "default" if m.default else "optional"
            state = f"unavailable: {reason}" if reason else "available"
            print(f"{op}  {name:<28} {flag:<8} {m.label}{extra}; {state}")


def _select_methods(args: argparse.Namespace) -> tuple[list[SaveMethod], list[LoadMethod]]:
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.methods:
        wanted = [s.strip() for s in args.methods.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in SAVE_METHODS and w not in LOAD_METHODS]
        if unknown:
            raise SystemExit(
                f"unknown method(s) {', '.join(unknown)}; known: {', '.join(list(SAVE_METHODS) + list(LOAD_METHODS))}"
            )
    else:
        wanted = [n for n, m in SAVE_METHODS.items() if m.default] + [n for n, m in LOAD_METHODS.items() if m.default]
    unknown = skip - set(SAVE_METHODS) - set(LOAD_METHODS)
    if unknown:
        raise SystemExit(f"unknown method(s) in --skip: {', '.join(sorted(unknown))}")
    saves = [SAVE_METHODS[n] for n in wanted if n in SAVE_METHODS and n not in skip]
    loads = [LOAD_METHODS[n] for n in wanted if n in LOAD_METHODS and n not in skip]
    return saves, loads


def _parse_fp_settings(items: Sequence[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--fp-setting takes NAME=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        values[key.strip()] = value.strip()
    if values:
        from fastpersist import config

        config.settings().replace(**values)  # validates names and values (raises ConfigError)
    return values


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _Progress:
    """A dependency-free progress line on stderr (a line per round when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self._last_round = ""

    def __call__(self, text: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        elapsed = time.perf_counter() - self.start
        if self.tty:
            width = 24
            filled = int(width * min(self.done, self.total) / self.total)
            bar = "#" * filled + "." * (width - filled)
            line = f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f} s  {text}"
            sys.stderr.write(line[:120].ljust(120))
            sys.stderr.flush()
        else:
            current = text.split(":", 1)[0]
            if current != self._last_round:
                self._last_round = current
                sys.stderr.write(f"[{elapsed:5.0f} s] {current}\n")
                sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 120 + "\r")
            sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastpersist.bench checkpoint``.

    Returns:
        0 when every method that ran verified, 1 when one FAILED, 2 on bad
        arguments or an unusable directory, 130 when interrupted.
    """
    if any(a == "--shape" or a.startswith("--shape=") for a in (sys.argv[1:] if argv is None else argv)):
        from fastpersist.bench import shapes  # --shape many-small|many-medium|huge|mixed, --sink (issue 15)

        return shapes.main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    dist = measure.DistributedEnv()
    process_group = _init_process_group(dist)
    try:
        return _main(parser, args, dist)
    finally:
        if process_group:
            import torch.distributed

            torch.distributed.destroy_process_group()


def _init_process_group(dist: measure.DistributedEnv) -> bool:
    """Under torchrun (WORLD_SIZE > 1), a gloo group for the barriers between timed operations."""
    if dist.world_size <= 1:
        return False
    import torch.distributed

    if not torch.distributed.is_available() or torch.distributed.is_initialized():
        return False
    torch.distributed.init_process_group("gloo")
    return True


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, dist: measure.DistributedEnv) -> int:
    say = print if dist.is_main else (lambda *a, **k: None)

    if args.markdown:
        try:
            documents = [report.load_result(p) for p in args.markdown]
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(report.to_markdown(documents), end="")
        return 0
    if args.list_models:
        _print_models()
        return 0

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device: {e}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available to this torch build")
        if device.index is None:
            device = torch.device("cuda", dist.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")

    try:
        overrides = _parse_fp_settings(args.fp_setting)
    except SystemExit:
        raise
    except Exception as e:  # ConfigError
        parser.error(str(e))
    if args.config:
        from fastpersist import config

        try:
            config.load_file(args.config)
        except Exception as e:
            parser.error(f"--config: {e}")
    ctx = BenchContext(device=device, dist=dist, dcp_threads=args.dcp_threads, fastpersist_overrides=overrides)
    if args.list_methods:
        _print_methods(ctx)
        return 0
    saves, loads = _select_methods(args)
    if not saves and not loads:
        parser.error("no methods left to run")

    try:
        spec = models.get_model(args.model)
        dtype = models.DTYPES[args.dtype]
        layers = args.layers
        if args.size:
            layers = models.layers_for_size(spec, models.parse_size(args.size), dtype, args.training_state)
        if layers is None:
            layers = spec.default_layers if spec.default_layers is not None else spec.num_layers
        expected_bytes = models.state_bytes(spec, dtype, layers, args.training_state)
    except (KeyError, ValueError) as e:
        parser.error(str(e.args[0] if isinstance(e, KeyError) else e))

    parent = os.path.abspath(args.dir or os.getcwd())
    if not os.path.isdir(parent):
        print(f"error: --dir {parent} is not a directory", file=sys.stderr)
        return 2
    fs = measure.filesystem_of(parent)
    outputs = len(saves) + sum(1 for m in loads if m.source not in {s.name for s in saves})
    need = int(expected_bytes * 1.05) * max(outputs, 1) * dist.world_size
    if fs.get("free_bytes") is not None and fs["free_bytes"] < need:
        print(
            f"error: {parent} has {models.format_bytes(fs['free_bytes'])} free; this run keeps one copy per "
            f"save method at a time, about {models.format_bytes(need)}. Use --dir elsewhere, fewer --methods, "
            "or a smaller --size.",
            file=sys.stderr,
        )
        return 2
    available = _available_memory()
    if available is not None and device.type == "cpu" and expected_bytes * 3 > available and dist.is_main:
        print(
            f"warning: the state ({models.format_bytes(expected_bytes)}) plus a loaded copy and a verification "
            f"copy may not fit in the {models.format_bytes(available)} of memory available",
            file=sys.stderr,
        )

    dropper = measure.CacheDropper(enabled=not args.no_drop_caches)
    work = None
    interrupted = False
    document: dict[str, Any] | None = None
    failed = False
    with measure.sigterm_as_interrupt():
        try:
            work = tempfile.mkdtemp(prefix=".fastpersist-bench-", dir=parent)
            say(
                f"building {spec.name} ({layers} of {spec.num_layers} blocks, {args.dtype}"
                f"{', training state' if args.training_state else ''}) on {device} ...",
                file=sys.stderr,
            )
            build_start = time.perf_counter()
            state = models.build_state(
                spec, dtype=dtype, device=device, layers=layers, training_state=args.training_state, seed=args.seed
            )
            tensors, _objects = models.flatten_state(state)
            state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            build_seconds = time.perf_counter() - build_start
            ops = (args.repeats + args.warmup) * (len(saves) + len(loads))
            progress = _Progress(ops, enabled=dist.is_main and not args.no_progress)
            started = time.perf_counter()
            try:
                results = run_benchmark(
                    state,
                    saves,
                    loads,
                    work,
                    ctx=ctx,
                    repeats=args.repeats,
                    warmup=args.warmup,
                    dropper=dropper,
                    progress=progress,
                    state_bytes=state_bytes,
                )
            finally:
                progress.close()
            elapsed = time.perf_counter() - started
            document = _document(
                args, spec, layers, state_bytes, len(tensors), results, parent, dropper, ctx, elapsed, build_seconds
            )
            failed = any(r.status == "FAILED" for r in results)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if work is not None:
                measure.remove_path(work)

    if interrupted:
        print("\ninterrupted; temporary files removed, nothing reported", file=sys.stderr)
        return 130
    assert document is not None
    if not dist.is_main:
        return 1 if failed else 0
    print(report.format_table(document))
    if args.json:
        report.write_json(document, args.json)
        print(f"\nresults written to {args.json}")
    if args.png:
        note = report.save_png(document, args.png)
        print(f"chart: {note}")
    return 1 if failed else 0


def _document(
    args: argparse.Namespace,
    spec: models.ModelSpec,
    layers: int,
    state_bytes: int,
    tensor_count: int,
    results: list[MethodResult],
    parent: str,
    dropper: measure.CacheDropper,
    ctx: BenchContext,
    elapsed: float,
    build_seconds: float,
) -> dict[str, Any]:
    fastpersist_settings = None
    try:
        from fastpersist import config

        fastpersist_settings = config.resolve(ctx.fastpersist_overrides).as_dict()
    except Exception:
        pass
    return {
        "schema": SCHEMA,
        "machine": measure.machine_info(parent, str(ctx.device)),
        "settings": {
            "model": spec.name,
            "model_description": spec.description,
            "layers": layers,
            "model_layers": spec.num_layers,
            "dtype": args.dtype,
            "device": str(ctx.device),
            "training_state": args.training_state,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "dir": parent,
            "seed": args.seed,
            "dcp_threads": args.dcp_threads,
            "cache": dropper.mode,
            "cache_detail": dropper.detail,
            "rank": ctx.dist.rank,
            "world_size": ctx.dist.world_size,
            "fastpersist_overrides": ctx.fastpersist_overrides,
            "fastpersist_config_file": args.config or os.environ.get("FASTPERSIST_CONFIG"),
            "fastpersist_settings": fastpersist_settings,
            "argv": sys.argv[1:],
        },
        "state": {
            "bytes": state_bytes,
            "tensors": tensor_count,
            "parameters": models.parameter_count(spec, layers),
            "build_seconds": build_seconds,
        },
        "elapsed_seconds": elapsed,
        "baselines": BASELINES,
        "results": [r.as_dict(state_bytes) for r in results],
    }


if __name__ == "__main__":  # python -m fastpersist.bench.checkpoint
    sys.exit(main())
