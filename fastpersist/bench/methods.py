"""The checkpoint benchmark's methods, one row each: torch.save / torch.load / DCP, safetensors, fastpersist, and
a raw ``os.write`` of all bytes. A new method is a row and a :func:`register` call (docs/checkpoint-benchmark.md,
"Adding a method"); the storage ceiling is :func:`fastpersist.bench.bounds.measure_ceiling`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Callable
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


def _runs_anywhere(ctx: BenchContext) -> str | None:
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Method:
    default: bool = True  # run when no --methods are given
    tensors_only: bool = False  # the format keeps the tensors only, not the state's other leaves
    unavailable: Callable[[BenchContext], str | None] = _runs_anywhere  # why it cannot run here, or None

    def flat(self, loaded: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Tensors and other leaves of a loaded state, keyed as :func:`workloads.flatten_state` keys them
        (None for the other leaves: the format does not carry them)."""
        return (dict(loaded), None) if self.tensors_only else workloads.flatten_state(loaded)


@dataclasses.dataclass(frozen=True)
class SaveMethod(_Method):
    """One way of writing a checkpoint. The runner times ``save(state, path, ctx)`` (its extra timings:
    ``blocked_seconds`` for async) and an fsync of what it wrote (every method pays for durability alike), verifies
    ``read_back(path, state, ctx)`` (what it wrote, loaded to ``ctx.device``; untimed), then removes the files."""

    name: str
    label: str
    save: Callable[[Any, str, BenchContext], dict[str, float]]
    read_back: Callable[[str, Any, BenchContext], Any]
    extension: str = ".pt"

    def target(self, directory: str, ctx: BenchContext) -> str:
        """Where this method writes (a file or a directory), distinct per rank."""
        suffix = f".rank{ctx.dist.rank}" if ctx.dist.world_size > 1 else ""
        return os.path.join(directory, self.name.replace("/", "_") + suffix + self.extension)

    def cleanup(self, path: str) -> None:
        measure.remove_path(path)


@dataclasses.dataclass(frozen=True)
class LoadMethod(_Method):
    """One way of reading a checkpoint written by save method ``source``: ``load(path, state, ctx)`` loads ``path``
    completely onto ``ctx.device``, every byte resident on return. ``state`` is the original, for methods that
    (like DCP) must be told the structure: its shapes, never its data."""

    name: str
    label: str
    load: Callable[[str, Any, BenchContext], Any]
    source: str


SAVE_METHODS: dict[str, SaveMethod] = {}
LOAD_METHODS: dict[str, LoadMethod] = {}


def register(method: SaveMethod | LoadMethod) -> SaveMethod | LoadMethod:
    """Adds a method to its registry (replacing one of the same name)."""
    if not isinstance(method, (SaveMethod, LoadMethod)):
        raise TypeError(f"not a benchmark method: {method!r}")
    (SAVE_METHODS if isinstance(method, SaveMethod) else LOAD_METHODS)[method.name] = method
    return method


def empty_like_state(state: Any) -> Any:
    """Same structure, freshly allocated (untouched) tensors; other leaves copied."""
    if isinstance(state, torch.Tensor):
        return torch.empty(state.shape, dtype=state.dtype, device=state.device)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return (list if isinstance(state, list) else tuple)(empty_like_state(v) for v in state)
    return state


def raw_write(state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
    """All tensor bytes in one file with os.write + fsync: no format at all; an upper bound for buffered writes."""
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


def raw_read(path: str, state: Any, ctx: BenchContext) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        for key, t in workloads.flatten_state(state)[0].items():
            raw = bytearray(f.read(t.numel() * t.element_size()))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            out[key] = flat.view(t.dtype).reshape(t.shape).to(ctx.device)
        if f.read(1):
            raise ValueError("raw file is longer than the state")
    return out


def fastpersist_save(state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
    fastpersist.save(state, path, fsync=True, **ctx.fastpersist_overrides)
    return {}


def fastpersist_async_save(state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
    """blocked = until async_save returns; durable = until result() returns."""
    start = time.perf_counter()
    future = fastpersist.async_save(state, path, **ctx.fastpersist_overrides)
    blocked = time.perf_counter() - start
    future.result()
    return {"blocked_seconds": blocked}


def fastpersist_load(path: str, state: Any, ctx: BenchContext) -> Any:
    return fastpersist.load(path, map_location=ctx.device, **ctx.fastpersist_overrides)


def safetensors_unavailable(ctx: BenchContext) -> str | None:
    try:
        import numpy  # noqa: F401  (safetensors.torch converts through numpy)
        import safetensors.torch  # noqa: F401
    except ImportError as e:
        return f"safetensors (with numpy) is not installed ({e})"
    return None


def safetensors_save(state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
    """save_file of the flattened tensors; other leaves go to the metadata as JSON."""
    from safetensors.torch import save_file

    tensors, objects = workloads.flatten_state(state)
    save_file(tensors, path, metadata={"objects": json.dumps(objects, default=repr)} if objects else None)
    return {}


def safetensors_load(path: str, state: Any, ctx: BenchContext) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path, device=str(ctx.device))


def torch_save(state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
    torch.save(state, path)
    return {}


def torch_save_fast(state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
    """torch.utils.serialization's fast settings: no CRC32, pinned memory for copies from CUDA."""
    import torch.utils.serialization

    fast = {"save.compute_crc32": False, **({"save.use_pinned_memory_for_d2h": True} if ctx.is_cuda else {})}
    with torch.utils.serialization.config.patch(fast):  # the previous values restored on exit
        torch.save(state, path)
    return {}


def torch_load(path: str, state: Any, ctx: BenchContext) -> Any:
    return torch.load(path, map_location=ctx.device, weights_only=True)


def torch_load_mmap(path: str, state: Any, ctx: BenchContext) -> Any:
    return torch.load(path, map_location=ctx.device, weights_only=True, mmap=True)  # the runner touches every page


def dcp_unavailable(ctx: BenchContext) -> str | None:
    try:
        from torch.distributed.checkpoint import FileSystemWriter  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any reason it cannot run is reported, not raised
        return f"torch.distributed.checkpoint is not usable here ({type(e).__name__}: {e})"
    return None


def dcp_save(state: Any, path: str, ctx: BenchContext) -> dict[str, float]:
    """torch.distributed.checkpoint.save with FileSystemWriter. Every rank saves its whole state to its own
    directory, as the other methods do, so DCP runs without collectives (no_dist) even under torchrun."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(
        path, single_file_per_rank=True, sync_files=True, thread_count=ctx.dcp_threads, overwrite=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return {}


def dcp_load(path: str, state: Any, ctx: BenchContext) -> Any:
    """torch.distributed.checkpoint.load into freshly allocated tensors of the right shapes."""
    import torch.distributed.checkpoint as dcp

    # DCP loads in place: allocating the destination is part of the timed cost, as torch.load allocates.
    template = empty_like_state(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return template


# The registries' order is the default methods' order (and so the results' and every round's shuffle).
# fastpersist's files are read back with torch.load: they must be drop-in torch checkpoints (the
# fastpersist.load method checks our reader).
for _method in (
    SaveMethod(
        "os.write",
        "raw os.write of all bytes + fsync (no format)",
        raw_write,
        raw_read,
        ".bin",
        default=False,
        tensors_only=True,
    ),
    SaveMethod("fastpersist", "fastpersist.save", fastpersist_save, torch_load),
    SaveMethod("fastpersist-async", "fastpersist.async_save", fastpersist_async_save, torch_load),
    LoadMethod("fastpersist.load", "fastpersist.load", fastpersist_load, "fastpersist"),
    # The drop-in path for existing checkpoints.
    LoadMethod("fastpersist.load-torchfile", "fastpersist.load of a torch.save file", fastpersist_load, "torch.save"),
    SaveMethod(
        "safetensors",
        "safetensors save_file + fsync",
        safetensors_save,
        safetensors_load,
        ".safetensors",
        tensors_only=True,
        unavailable=safetensors_unavailable,
    ),
    LoadMethod(
        "safetensors.load",
        "safetensors load_file",
        safetensors_load,
        "safetensors",
        tensors_only=True,
        unavailable=safetensors_unavailable,
    ),
    SaveMethod("torch.save", "torch.save + fsync", torch_save, torch_load),
    SaveMethod("torch.save-fast", "torch.save, no CRC32 + fsync", torch_save_fast, torch_load),
    SaveMethod("dcp", "torch DCP save (FileSystemWriter)", dcp_save, dcp_load, ".dcp", unavailable=dcp_unavailable),
    LoadMethod("torch.load", "torch.load", torch_load, "torch.save"),
    LoadMethod("torch.load-mmap", "torch.load(mmap=True) + touch", torch_load_mmap, "torch.save"),
    LoadMethod("dcp.load", "torch DCP load", dcp_load, "dcp", unavailable=dcp_unavailable),
):
    register(_method)
