"""The PyTorch baselines: ``torch.save`` (default and fastest settings), ``torch.load`` (plain and mmap),
and ``torch.distributed.checkpoint`` save/load with ``FileSystemWriter``/``FileSystemReader``."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from fastpersist.bench.methods.base import (
    BenchContext,
    LoadMethod,
    SaveMethod,
    empty_like_state,
    register,
    torch_load,
)

__all__ = ["TorchSave", "TorchSaveFast", "TorchLoad", "TorchLoadMmap", "DcpSave", "DcpLoad"]


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
    name = "torch.save"
    label = "torch.save + fsync"

    def save(self, state, path, ctx):
        torch.save(state, path)
        return {}

    def read_back(self, path, state, ctx):
        return torch_load(path, ctx)


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
        return torch_load(path, ctx)


class TorchLoadMmap(LoadMethod):
    name = "torch.load-mmap"
    label = "torch.load(mmap=True) + touch"
    source = "torch.save"

    def load(self, path, state, ctx):
        return torch_load(path, ctx, mmap=True)  # the runner touches every page


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
        except Exception as e:  # noqa: BLE001 - any reason it cannot run is reported, not raised
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
        template = empty_like_state(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(template, storage_reader=FileSystemReader(path), **_dcp_kwargs(ctx))
        return template


for _method in (TorchSave(), TorchSaveFast(), DcpSave(), TorchLoad(), TorchLoadMmap(), DcpLoad()):
    register(_method)
