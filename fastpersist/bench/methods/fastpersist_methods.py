"""fastpersist itself: ``save`` (durable on return), ``async_save``, ``load`` of its own and of torch.save files."""

from __future__ import annotations

import time

from fastpersist.bench.methods.base import (
    LoadMethod,
    SaveMethod,
    fastpersist_api,
    register,
    torch_load,
)

__all__ = ["FastpersistSave", "FastpersistAsyncSave", "FastpersistLoad", "FastpersistLoadTorchFile"]


class FastpersistSave(SaveMethod):
    """fastpersist.save (durable on return)."""

    name = "fastpersist"
    label = "fastpersist.save"

    def unavailable(self, ctx):
        return fastpersist_api()[1]

    def save(self, state, path, ctx):
        fastpersist, _ = fastpersist_api()
        fastpersist.save(state, path, fsync=True, **ctx.fastpersist_overrides)
        return {}

    def read_back(self, path, state, ctx):
        # Read back with torch.load: proves the file is a drop-in torch checkpoint, independently
        # of fastpersist's own reader (which the fastpersist.load method checks).
        return torch_load(path, ctx)


class FastpersistAsyncSave(FastpersistSave):
    """fastpersist.async_save: blocked = until it returns; durable = until result() returns."""

    name = "fastpersist-async"
    label = "fastpersist.async_save"

    def unavailable(self, ctx):
        fastpersist, reason = fastpersist_api()
        if reason:
            return reason
        if not hasattr(fastpersist, "async_save"):
            return "fastpersist.async_save is not available yet"
        return None

    def save(self, state, path, ctx):
        fastpersist, _ = fastpersist_api()
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
        return fastpersist_api()[1]

    def load(self, path, state, ctx):
        fastpersist, _ = fastpersist_api()
        return fastpersist.load(path, map_location=ctx.device, **ctx.fastpersist_overrides)


class FastpersistLoadTorchFile(FastpersistLoad):
    """fastpersist.load of the file torch.save wrote: the drop-in path for existing checkpoints."""

    name = "fastpersist.load-torchfile"
    label = "fastpersist.load of a torch.save file"
    source = "torch.save"


for _method in (FastpersistSave(), FastpersistAsyncSave(), FastpersistLoad(), FastpersistLoadTorchFile()):
    register(_method)
