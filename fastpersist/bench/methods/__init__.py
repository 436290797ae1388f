"""The checkpoint benchmark's methods: :class:`SaveMethod`, :class:`LoadMethod`, their registries, and every
method: torch.save / torch.load / DCP, safetensors, fastpersist, and a raw ``os.write`` of all bytes.

A new method is a subclass and a :func:`register` call (docs/checkpoint-benchmark.md, "Adding a method");
the storage ceilings are in :mod:`fastpersist.bench.methods.ceilings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

import fastpersist
from fastpersist.bench import measure
from fastpersist.tensors import host_memoryview
from fastpersist.tuning import workloads

__all__ = ["BenchContext", "SaveMethod", "LoadMethod", "SAVE_METHODS", "LOAD_METHODS", "register"]


@dataclasses.dataclass
class BenchContext:
    """What every method may need besides the state and a path."""

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


class _Method:
    name: str = ""
    label: str = ""
    default: bool = True  # run when no --methods are given

    def unavailable(self, ctx: BenchContext) -> str | None:
        """Why this method cannot run here, or None."""
        return None

    def flat(self, loaded: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Tensors and other leaves of a loaded state, keyed as :func:`workloads.flatten_state` keys them
        (None for the other leaves: the format does not carry them)."""
        return workloads.flatten_state(loaded)


class SaveMethod(_Method):
    """One way of writing a checkpoint. The runner times :meth:`save` and an fsync of what it wrote (every
    method pays for durability alike), verifies :meth:`read_back` (untimed), then calls :meth:`cleanup`."""

    extension: str = ".pt"

    def target(self, directory: str, ctx: BenchContext) -> str:
        """Where this method writes (a file or a directory), distinct per rank."""
        suffix = f".rank{ctx.dist.rank}" if ctx.dist.world_size > 1 else ""
        return os.path.join(directory, self.name.replace("/", "_") + suffix + self.extension)

    def save(self, state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
        """Returns extra timings (``blocked_seconds`` for async)."""
        raise NotImplementedError

    def read_back(self, path: str, state: Any, ctx: BenchContext) -> Any:
        """What :meth:`save` wrote, loaded to ``ctx.device`` for verification."""
        raise NotImplementedError

    def cleanup(self, path: str) -> None:
        measure.remove_path(path)


class LoadMethod(_Method):
    """One way of reading a checkpoint written by save method ``source``."""

    source: str = ""

    def load(self, path: str, state: Any, ctx: BenchContext) -> Any:
        """Loads ``path`` completely onto ``ctx.device``: every byte resident on return. ``state`` is the
        original, for methods that (like DCP) must be told the structure: its shapes, never its data."""
        raise NotImplementedError


SAVE_METHODS: dict[str, SaveMethod] = {}
LOAD_METHODS: dict[str, LoadMethod] = {}


def register(method: SaveMethod | LoadMethod) -> SaveMethod | LoadMethod:
    """Adds a method to its registry (replacing one of the same name)."""
    if not isinstance(method, (SaveMethod, LoadMethod)):
        raise TypeError(f"not a benchmark method: {method!r}")
    (SAVE_METHODS if isinstance(method, SaveMethod) else LOAD_METHODS)[method.name] = method
    return method


def torch_load(path: str, ctx: BenchContext, **kw: Any) -> Any:
    return torch.load(path, map_location=ctx.device, weights_only=True, **kw)


def _tensors_only(self: Any, loaded: Any) -> tuple[dict[str, torch.Tensor], None]:
    return dict(loaded), None


def empty_like_state(state: Any) -> Any:
    """Same structure, freshly allocated (untouched) tensors; other leaves copied."""
    if isinstance(state, torch.Tensor):
        return torch.empty(state.shape, dtype=state.dtype, device=state.device)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return (list if isinstance(state, list) else tuple)(empty_like_state(v) for v in state)
    return state


class RawWrite(SaveMethod):
    """All tensor bytes in one file with os.write + fsync: no format at all; an upper bound for buffered writes."""

    name, label, extension, default = "os.write", "raw os.write of all bytes + fsync (no format)", ".bin", False
    flat = _tensors_only

    def save(self, state, path, ctx):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in workloads.flatten_state(state)[0].values():
                view = host_memoryview(t.detach().reshape(-1).view(torch.uint8).cpu().contiguous())
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return {}

    def read_back(self, path, state, ctx):
        out: dict[str, torch.Tensor] = {}
        with open(path, "rb") as f:
            for key, t in workloads.flatten_state(state)[0].items():
                raw = bytearray(f.read(t.numel() * t.element_size()))
                flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                out[key] = flat.view(t.dtype).reshape(t.shape).to(ctx.device)
            if f.read(1):
                raise ValueError("raw file is longer than the state")
        return out


class FastpersistSave(SaveMethod):
    name, label = "fastpersist", "fastpersist.save"

    def save(self, state, path, ctx):
        fastpersist.save(state, path, fsync=True, **ctx.fastpersist_overrides)
        return {}

    def read_back(self, path, state, ctx):
        # torch.load: the file must be a drop-in torch checkpoint (the fastpersist.load method checks our reader)
        return torch_load(path, ctx)


class FastpersistAsyncSave(FastpersistSave):
    """blocked = until async_save returns; durable = until result() returns."""

    name, label = "fastpersist-async", "fastpersist.async_save"

    def save(self, state, path, ctx):
        start = time.perf_counter()
        future = fastpersist.async_save(state, path, **ctx.fastpersist_overrides)
        blocked = time.perf_counter() - start
        future.result()
        return {"blocked_seconds": blocked}


class FastpersistLoad(LoadMethod):
    name = label = "fastpersist.load"
    source = "fastpersist"

    def load(self, path, state, ctx):
        return fastpersist.load(path, map_location=ctx.device, **ctx.fastpersist_overrides)


class FastpersistLoadTorchFile(FastpersistLoad):
    """The drop-in path for existing checkpoints."""

    name, label, source = "fastpersist.load-torchfile", "fastpersist.load of a torch.save file", "torch.save"


class SafetensorsSave(SaveMethod):
    """save_file of the flattened tensors; other leaves go to the metadata as JSON."""

    name, label, extension = "safetensors", "safetensors save_file + fsync", ".safetensors"
    flat = _tensors_only

    def unavailable(self, ctx):
        try:
            import numpy  # noqa: F401  (safetensors.torch converts through numpy)
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            return f"safetensors (with numpy) is not installed ({e})"
        return None

    def save(self, state, path, ctx):
        from safetensors.torch import save_file

        tensors, objects = workloads.flatten_state(state)
        save_file(tensors, path, metadata={"objects": json.dumps(objects, default=repr)} if objects else None)
        return {}

    def read_back(self, path, state, ctx):
        from safetensors.torch import load_file

        return load_file(path, device=str(ctx.device))


class SafetensorsLoad(LoadMethod):
    name, label, source = "safetensors.load", "safetensors load_file", "safetensors"
    flat = _tensors_only
    unavailable = SafetensorsSave.unavailable
    load = SafetensorsSave.read_back


@contextlib.contextmanager
def _torch_serialization_settings(**values: Any) -> Iterator[None]:
    import torch.utils.serialization

    config = torch.utils.serialization.config.save
    old = {k: getattr(config, k) for k in values}
    try:
        for k, v in values.items():
            setattr(config, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(config, k, v)


class TorchSave(SaveMethod):
    name, label = "torch.save", "torch.save + fsync"
    fast = False  # torch.utils.serialization's fast settings: no CRC32, pinned memory for copies from CUDA

    def save(self, state, path, ctx):
        with self._settings(ctx):
            torch.save(state, path)
        return {}

    def read_back(self, path, state, ctx):
        return torch_load(path, ctx)

    def _settings(self, ctx: BenchContext) -> contextlib.AbstractContextManager:
        if not self.fast:
            return contextlib.nullcontext()
        pinned = {"use_pinned_memory_for_d2h": True} if ctx.is_cuda else {}
        return _torch_serialization_settings(compute_crc32=False, **pinned)


class TorchSaveFast(TorchSave):
    name, label, fast = "torch.save-fast", "torch.save, no CRC32 + fsync", True


class TorchLoad(LoadMethod):
    name, label, source = "torch.load", "torch.load", "torch.save"

    def load(self, path, state, ctx):
        return torch_load(path, ctx)


class TorchLoadMmap(TorchLoad):
    name, label = "torch.load-mmap", "torch.load(mmap=True) + touch"

    def load(self, path, state, ctx):
        return torch_load(path, ctx, mmap=True)  # the runner touches every page


class DcpLoad(LoadMethod):
    """torch.distributed.checkpoint.load into freshly allocated tensors of the right shapes."""

    name, label, source = "dcp.load", "torch DCP load", "dcp"

    def unavailable(self, ctx):
        try:
            from torch.distributed.checkpoint import FileSystemWriter  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any reason it cannot run is reported, not raised
            return f"torch.distributed.checkpoint is not usable here ({type(e).__name__}: {e})"
        return None

    def load(self, path, state, ctx):
        import torch.distributed.checkpoint as dcp

        # DCP loads in place: allocating the destination is part of the timed cost, as torch.load allocates.
        template = empty_like_state(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(template, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        return template


class DcpSave(SaveMethod):
    """torch.distributed.checkpoint.save with FileSystemWriter. Every rank saves its whole state to its own
    directory, as the other methods do, so DCP runs without collectives (no_dist) even under torchrun."""

    name, label, extension = "dcp", "torch DCP save (FileSystemWriter)", ".dcp"
    unavailable = DcpLoad.unavailable
    read_back = DcpLoad.load

    def save(self, state, path, ctx):
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(
            path, single_file_per_rank=True, sync_files=True, thread_count=ctx.dcp_threads, overwrite=True
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer, no_dist=True)
        return {}


# The registries' order is the default methods' order (and so the results' and every round's shuffle).
for _method in (RawWrite, FastpersistSave, FastpersistAsyncSave, FastpersistLoad, FastpersistLoadTorchFile):
    register(_method())
for _method in (SafetensorsSave, SafetensorsLoad, TorchSave, TorchSaveFast, DcpSave, TorchLoad, TorchLoadMmap, DcpLoad):
    register(_method())
